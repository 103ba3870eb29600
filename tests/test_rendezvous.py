"""The collective checks of exchange creation, on CPU processes (jax.distributed key-value store)."""

import os
import socket
import subprocess
import sys


WORKER = os.path.join(os.path.dirname(__file__), "scripts", "rendezvous_worker.py")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(nproc, scenario):
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.getcwd())
    procs = [subprocess.Popen([sys.executable, WORKER, str(port), str(nproc), str(r), scenario],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for r in range(nproc)]
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=120)
        outs.append(out)
    return [next((line for line in o.splitlines() if line.startswith(("AGREED", "ERROR"))), o)
            for o in outs]


def test_agree():
    assert _run(2, "ok") == ["AGREED", "AGREED"]


def test_mismatch_fails_on_every_rank_with_the_value_named():
    lines = _run(2, "mismatch")
    for line in lines:
        assert line.startswith("ERROR") and "topk=1024 on rank 1 but 2048 on rank 0" in line, lines


def test_local_failure_fails_every_rank():
    lines = _run(2, "ipcfail")
    for line in lines:
        assert line.startswith("ERROR") and "rank 0: IPC open failed" in line, lines


def test_missing_rank_times_out_naming_it():
    lines = _run(2, "missing")
    for line in lines:
        assert line.startswith("ERROR") and "rank 2 of 3 did not publish" in line, lines
