"""The op on the GPU through the FFI path, one rank per process (SPEC §7).

W processes share the one GPU of the test machine (each with its own exchange, peers
mapped over CUDA IPC) and run a jitted decode loop (lax.scan over layers, several steps);
every rank checks every call against the NumPy protocol model, bit for bit.  Skipped
without a GPU.  XLA collectives cannot run here (NCCL refuses two ranks on one GPU), so
the comparison is with the oracle, not with the XLA path.
"""

import os
import subprocess
import sys

import pytest

from gpu import requires_gpu_stack

WORKER = os.path.join(os.path.dirname(__file__), "scripts", "op_worker.py")


@requires_gpu_stack
@pytest.mark.gpu
@pytest.mark.parametrize("world,topk,local_topk", [(2, 256, 64), (4, 512, 128), (8, 2048, 512)])
def test_multiprocess_decode_loop_matches_oracle(world, topk, local_topk):
    env = dict(os.environ, PYTHONPATH=os.getcwd(), XLA_PYTHON_CLIENT_PREALLOCATE="false")
    cmd = [sys.executable, "-m", "jax_dsa_exchange.launch", "-n", str(world), "--timeout", "400",
           "--", sys.executable, WORKER, "--topk", str(topk), "--local-topk", str(local_topk),
           "--rows", "16", "--cols", "4096", "--layers", "4", "--steps", "3"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=450)
    print(r.stdout[-6000:], r.stderr[-6000:])
    assert r.returncode == 0
    assert r.stdout.count("RANK OK") == world


@requires_gpu_stack
@pytest.mark.gpu
def test_a_rank_that_stops_fails_the_others_in_python():
    """Rank 1 exits before step 1: rank 0's call of step 1 times out on the device (after
    0.5 s, no hang) and its next call raises in Python, naming rank 1, the row and epoch."""
    env = dict(os.environ, PYTHONPATH=os.getcwd(), XLA_PYTHON_CLIENT_PREALLOCATE="false",
               JAX_DSA_EXCHANGE_CUDA_GRAPHS="0")  # the check runs in the handler (ffi/README.md)
    cmd = [sys.executable, "-m", "jax_dsa_exchange.launch", "-n", "2", "--timeout", "200",
           "--grace", "60", "--", sys.executable, WORKER, "--topk", "256", "--local-topk", "64",
           "--rows", "8", "--cols", "1024", "--layers", "2", "--steps", "3", "--stop-rank", "1",
           "--stop-step", "1", "--timeout-us", "500000"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=260)
    print(r.stdout[-4000:], r.stderr[-4000:])
    assert "[rank 0] RAISED OK" in r.stdout
    assert r.returncode == 0


@requires_gpu_stack
@pytest.mark.gpu
def test_concurrency_patterns():
    """Two exchanges alternately in one program, two programs interleaving on one exchange
    with different R, scan vs unrolled: all bit-identical to the model (W = 2 processes).
    Written in the first session after its last GPU run: not yet run on a GPU."""
    env = dict(os.environ, PYTHONPATH=os.getcwd(), XLA_PYTHON_CLIENT_PREALLOCATE="false")
    worker = os.path.join(os.path.dirname(__file__), "scripts", "concurrency_worker.py")
    cmd = [sys.executable, "-m", "jax_dsa_exchange.launch", "-n", "2", "--timeout", "300", "--",
           sys.executable, worker]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=360)
    print(r.stdout[-4000:], r.stderr[-4000:])
    assert r.returncode == 0 and r.stdout.count("RANK OK") == 2
