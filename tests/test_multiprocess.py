"""Multi-process CPU runs: the launcher, jax.distributed + gloo, the XLA path, the demo, the example.

Every test starts ``python -m jax_dsa_exchange.launch`` in a subprocess.  The
rank worker is this file run as a script (``python tests/test_multiprocess.py
worker ...``): it joins the job, runs xla_topk_merge in a jitted shard_map over
a mesh of W processes x 1 CPU device and compares its own rank's outputs with
the oracle, bit for bit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THIS = os.path.abspath(__file__)


def _env():
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # one CPU device per process
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _launch(world, *command, timeout=240, launch_args=()):
    cmd = [sys.executable, "-m", "jax_dsa_exchange.launch", "-n", str(world), *launch_args, "--", *command]
    t0 = time.monotonic()
    p = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    return p, time.monotonic() - t0


def _explain(p):
    return f"rc={p.returncode}\nstdout:\n{p.stdout[-6000:]}\nstderr:\n{p.stderr[-6000:]}"


@pytest.mark.parametrize("world", [2, 4])
def test_xla_path_on_every_rank(world):
    p, _ = _launch(world, sys.executable, THIS, "worker", "--timeout", "200")
    assert p.returncode == 0, _explain(p)
    for r in range(world):
        assert f"[rank {r}] RANK OK" in p.stdout, _explain(p)


def test_failing_rank_fails_the_launch():
    """Rank 1 dies before the collective; the others would wait for it forever:
    the launcher must stop them after the grace period and fail."""
    p, dt = _launch(3, sys.executable, THIS, "worker", "--fail-rank", "1",
                    launch_args=("--grace", "3", "--timeout", "120"))
    assert p.returncode == 7, _explain(p)
    assert "[rank 1] rank 1: failing on purpose" in p.stderr, _explain(p)
    assert "rank 1 failed with exit code 7" in p.stderr, _explain(p)
    assert dt < 100, dt


def test_launch_timeout_and_prefixes():
    code = "import os, sys, time; print('hello', os.environ['JAX_DSA_EXCHANGE_RANK'], os.environ['JAX_DSA_EXCHANGE_WORLD']); sys.stdout.flush(); time.sleep(60)"
    p, dt = _launch(2, sys.executable, "-c", code, launch_args=("--timeout", "3"))
    assert p.returncode == 124, _explain(p)
    assert "[rank 0] hello 0 2" in p.stdout and "[rank 1] hello 1 2" in p.stdout, _explain(p)
    assert dt < 30, dt


def test_launch_all_succeed_and_exit_code():
    p, _ = _launch(2, sys.executable, "-c", "import sys, os; sys.exit(0)")
    assert p.returncode == 0, _explain(p)
    p, _ = _launch(2, sys.executable, "-c", "import sys, os; sys.exit(3 if os.environ['JAX_DSA_EXCHANGE_RANK'] == '1' else 0)")
    assert p.returncode == 3, _explain(p)


def test_demo_processes():
    cmd = [sys.executable, "-m", "jax_dsa_exchange.demo", "--processes", "--world", "2", "--steps", "2",
           "--layers", "2", "--rows", "4", "--cols", "512", "--topk", "128", "--local-topk", "64"]
    p = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert p.returncode == 0, _explain(p)
    assert "[rank 0] OK: 2 steps" in p.stdout, _explain(p)
    assert "MISMATCH" not in p.stdout, _explain(p)
    _assert_no_grpc_noise(p)


def test_example_decode_loop_joins_the_launched_ranks():
    """examples/decode_loop.py started by the launcher runs one rank per process (W = the
    process count, collectives over gloo), each process checking its own rank."""
    p, _ = _launch(2, sys.executable, os.path.join(ROOT, "examples", "decode_loop.py"),
                   launch_args=("--timeout", "200"))
    assert p.returncode == 0, _explain(p)
    for r in range(2):
        assert f"[rank {r}] W=2 ranks (2 processes)" in p.stdout, _explain(p)
        assert f"[rank {r}] rank {r} of 2: every layer bit-identical" in p.stdout, _explain(p)
    assert "of 4" not in p.stdout and "devices of one process" not in p.stdout, _explain(p)
    _assert_no_grpc_noise(p)


GRPC_NOISE = ("WatchTasks", "GRPC", "grpc", "UNAVAILABLE", "Connection refused", "CANCELLED")


def _assert_no_grpc_noise(p):
    for bad in GRPC_NOISE:
        assert bad not in p.stdout + p.stderr, (bad, _explain(p))


@pytest.mark.parametrize("order", ["leader-first", "leader-last", "together"])
def test_clean_exit_without_grpc_noise(order):
    """Ranks leave jax.distributed in an order that prints no gRPC error, whichever rank
    reaches its exit first (distributed.shutdown, registered by distributed.initialize)."""
    p, dt = _launch(3, sys.executable, os.path.join(ROOT, "tests", "scripts", "exit_worker.py"),
                    "--order", order, timeout=120, launch_args=("--timeout", "100"))
    assert p.returncode == 0, _explain(p)
    assert p.stdout.count("RANK OK") == 3, _explain(p)
    _assert_no_grpc_noise(p)


_CLUSTER_SCRIPT = ("from jax_dsa_exchange import distributed as d; c = d.detected_cluster(); "
                   "r, w = d.initialize(); import jax; "
                   "print('JOINED', c, r, w, jax.process_index(), jax.process_count(), flush=True)")


@pytest.mark.parametrize("cluster", ["slurm", "ompi"])
def test_initialize_joins_jobs_that_jax_detects(cluster):
    """Not started by the package's launcher, but by srun / mpirun (their variables set by
    hand here, 2 processes on CPU): distributed.initialize() joins through
    jax.distributed.initialize() with no arguments, as JAX users launch."""
    import random

    job = random.randrange(1 << 20)  # both derive the coordinator port from the job id
    envs = []
    for i in range(2):
        e = _env()
        for k in list(e):
            if k.startswith(("SLURM_", "OMPI_", "JAX_DSA_EXCHANGE_")):
                del e[k]
        if cluster == "slurm":
            e.update(SLURM_JOB_ID=str(job), SLURM_STEP_NODELIST="localhost", SLURM_NTASKS="2",
                     SLURM_PROCID=str(i), SLURM_LOCALID=str(i))
        else:
            e.update(OMPI_MCA_orte_hnp_uri=f"{job}.0;tcp://127.0.0.1:5555", OMPI_COMM_WORLD_SIZE="2",
                     OMPI_COMM_WORLD_RANK=str(i), OMPI_COMM_WORLD_LOCAL_RANK=str(i))
        envs.append(e)
    procs = [subprocess.Popen([sys.executable, "-c", _CLUSTER_SCRIPT], env=e, cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for e in envs]
    outs = [p.communicate(timeout=120) for p in procs]
    for i, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, err[-3000:]
        assert f"JOINED {cluster} {i} 2 {i} 2" in out, (out, err[-3000:])
        for bad in GRPC_NOISE:
            assert bad not in out + err, (bad, err[-3000:])


def test_no_cluster_no_launcher_runs_as_one_process():
    e = _env()
    for k in list(e):
        if k.startswith(("SLURM_", "OMPI_", "JAX_DSA_EXCHANGE_")):
            del e[k]
    p = subprocess.run([sys.executable, "-c", _CLUSTER_SCRIPT], env=e, cwd=ROOT, text=True, capture_output=True,
                       timeout=120)
    assert p.returncode == 0 and "JOINED None 0 1 0 1" in p.stdout, _explain(p)


@pytest.mark.skipif(bool(__import__("shutil").which("nvidia-smi")), reason="a GPU machine runs the real bench")
def test_bench_without_gpu_says_so_once():
    """Without a GPU the bench says so once, before starting W processes (it used to start
    them and print "no GPU" from each)."""
    p = subprocess.run([sys.executable, "-m", "jax_dsa_exchange.bench", "--world", "4"], env=_env(),
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 2, _explain(p)
    assert (p.stdout + p.stderr).count("no GPU") == 1, _explain(p)
    assert "[rank" not in p.stdout + p.stderr, _explain(p)
    p = subprocess.run([sys.executable, "-m", "jax_dsa_exchange.bench", "--serving"], env=_env(),
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 2 and (p.stdout + p.stderr).count("no GPU") == 1, _explain(p)


def test_demo_single_process():
    env = _env()
    cmd = [sys.executable, "-m", "jax_dsa_exchange.demo", "--world", "3", "--steps", "2", "--layers", "3",
           "--rows", "5", "--cols", "300", "--topk", "128", "--local-topk", "32", "--path", "xla"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert p.returncode == 0, _explain(p)
    assert "step 1:" in p.stdout and "OK: 2 steps x 3 layers x 5 rows, W=3" in p.stdout, _explain(p)


def test_demo_ffi_without_gpu_is_a_clear_error():
    cmd = [sys.executable, "-m", "jax_dsa_exchange.demo", "--world", "2", "--steps", "1", "--layers", "1",
           "--rows", "2", "--cols", "128", "--topk", "64", "--local-topk", "32", "--path", "ffi"]
    p = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert p.returncode != 0
    assert "NotImplementedError" in p.stderr and "--path xla" in p.stderr, _explain(p)


# ---------------------------------------------------------------------------
# Worker: one rank (runs under the launcher)


def _worker(argv) -> int:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--fail-rank", type=int, default=-1)
    ap.add_argument("--timeout", type=int, default=120)
    a = ap.parse_args(argv)

    from jax_dsa_exchange import distributed

    rank, world = distributed.initialize(timeout_s=a.timeout)
    if rank == a.fail_rank:
        print(f"rank {rank}: failing on purpose", file=sys.stderr, flush=True)
        os._exit(7)  # no clean jax.distributed shutdown, like a crash

    import jax
    import numpy as np

    from jax_dsa_exchange import reference
    from jax_dsa_exchange.testing import cases
    from jax_dsa_exchange.xla_path import xla_topk_merge_sharded

    assert jax.process_count() == world and jax.process_index() == rank
    mesh = distributed.dcp_mesh("dcp")
    assert mesh.devices.size == world
    rng = np.random.default_rng(99)  # the same on every rank: every rank knows all data
    bad, checked, fns = 0, 0, {}
    for K, N in ((64, 32), (128, 32)):
        for case in cases.adversarial_cases(rng, world=world, topk=K, local_topk=N, rows=8):
            if not case.equal_cols:
                continue
            key = (case.topk, case.block_size)
            if key not in fns:
                fns[key] = jax.jit(lambda *x, K=case.topk, B=case.block_size: xla_topk_merge_sharded(
                    mesh, "dcp", *x, topk=K, block_size=B, with_ids=True, with_saturated=True))
            out = fns[key](*[distributed.shard_ranks(mesh, "dcp", x) for x in case.args])
            want = reference.topk_merge(*case.args, topk=case.topk, block_size=case.block_size)
            for name in ("kv_rows", "counts", "ids", "saturated"):
                shards = distributed.rank_shards(getattr(out, name))
                assert list(shards) == [rank], shards.keys()
                if not np.array_equal(shards[rank], getattr(want[rank], name)):
                    bad += 1
                    print(f"MISMATCH {case!r} {name}", flush=True)
            checked += 1
    print(f"rank {rank}: {checked} cases checked, {bad} mismatches", flush=True)
    print("RANK OK" if bad == 0 and checked else "RANK FAILED", flush=True)
    return 1 if bad or not checked else 0


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    sys.exit(_worker(sys.argv[2:]))


def _pytest_in_every_rank(world, extra_env=None):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.getcwd(), **(extra_env or {}))
    cmd = [sys.executable, "-m", "jax_dsa_exchange.launch", "-n", str(world), "--timeout", "240",
           "--", sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           os.path.join(os.path.dirname(__file__), "ranks")]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def test_pytest_runs_in_every_rank():
    r = _pytest_in_every_rank(2)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for q in range(2):
        assert f"[rank {q}] 2 passed" in r.stdout, r.stdout[-3000:]


def test_a_test_failing_on_one_rank_fails_the_run():
    r = _pytest_in_every_rank(2, {"DSA_TEST_FAIL_RANK": "1"})
    assert r.returncode != 0
    assert "[rank 1] FAILED" in r.stdout or "deliberate failure on rank 1" in r.stdout, r.stdout[-3000:]
