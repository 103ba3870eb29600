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
