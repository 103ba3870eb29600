"""Start W processes on this node, one DCP rank each.

    python -m jax_dsa_exchange.launch -n W [--timeout S] [--grace S] [--bind auto|gpu|none] -- COMMAND...

Every process gets the environment that :func:`jax_dsa_exchange.distributed.initialize`
reads (coordinator ``127.0.0.1:<free port>``, world, rank).  Output of every rank
is forwarded line by line with a ``[rank i]`` prefix (stdout to stdout, stderr to
stderr).  The launch fails if any rank fails: once a rank exits non-zero the
others get ``--grace`` seconds to finish (they are usually stuck in a collective
with the dead rank), then SIGTERM, then SIGKILL.  ``--timeout`` bounds the whole
run (exit code 124).  On a node with at least W NVIDIA GPUs rank r gets GPU r
(``--bind``).  Exit code: 0 if every rank exited 0, else the first
failing rank's code (128 + signal for a signal); 127 when COMMAND is not found
(126: not executable), said in one line.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from . import distributed

_print_lock = threading.Lock()


def free_port() -> int:
    """A TCP port free right now on localhost (tiny race until the coordinator binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _forward(stream, prefix: str, out) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", "replace").rstrip("\n")
        with _print_lock:
            out.write(f"{prefix}{line}\n")
            out.flush()
    stream.close()


def _log(msg: str) -> None:
    with _print_lock:
        sys.stderr.write(f"[launch] {msg}\n")
        sys.stderr.flush()


def _exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _signal_all(procs, sig) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                # Each rank leads its own process group (start_new_session), so
                # its own children (e.g. a shell's) get the signal too.
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def gpu_count() -> int:
    """NVIDIA GPUs on this node per ``nvidia-smi -L`` (0 without it)."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def launch(command: list[str], world: int, *, timeout: float | None = None,
           grace: float = 10.0, env: dict | None = None, bind: str = "auto") -> int:
    """Run ``command`` as ``world`` ranks; returns the launch's exit code (see module doc).

    ``bind``: ``gpu`` gives rank r GPU r only (``JAX_LOCAL_DEVICE_IDS=r``; CUDA
    still sees every GPU, so CUDA IPC between ranks works), ``none`` leaves
    every device visible to every rank (CPU runs, or several ranks sharing one
    GPU), ``auto`` = ``gpu`` when the node has at least ``world`` NVIDIA GPUs.
    A ``JAX_LOCAL_DEVICE_IDS`` already in the environment is kept.
    """
    if bind not in ("auto", "gpu", "none"):
        raise ValueError(f"bind={bind!r} must be auto, gpu or none")
    if world < 1:
        raise ValueError(f"world={world} must be >= 1")
    if not command:
        raise ValueError("no command given")
    base = dict(os.environ if env is None else env)
    base[distributed.ENV_COORDINATOR] = f"127.0.0.1:{free_port()}"
    base[distributed.ENV_WORLD] = str(world)
    base["PYTHONUNBUFFERED"] = "1"  # ranks' lines arrive as they are printed
    # gRPC (the coordinator) honours proxies; localhost must bypass them.  Only
    # touched when a proxy is set (jax warns about any *_proxy variable).
    if any(k.lower() in ("http_proxy", "https_proxy", "all_proxy", "grpc_proxy") for k in base):
        for k in ("no_proxy", "NO_PROXY"):
            base[k] = ",".join(x for x in (base.get(k), "127.0.0.1", "localhost") if x)

    if bind == "auto":
        bind = "gpu" if gpu_count() >= world else "none"
    bind_gpus = bind == "gpu" and "JAX_LOCAL_DEVICE_IDS" not in base

    # SIGTERM/SIGHUP to the launcher (a CI timeout, a closed terminal) must not
    # orphan the ranks: they run in their own sessions, so turn the signal into
    # the same clean-up as Ctrl-C.
    restore = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            restore[sig] = signal.signal(sig, _raise_interrupt)

    procs, threads = [], []
    code = 0
    try:
        for r in range(world):
            env_r = dict(base, **{distributed.ENV_RANK: str(r)})
            if bind_gpus:
                env_r["JAX_LOCAL_DEVICE_IDS"] = str(r)
            try:
                p = subprocess.Popen(command, env=env_r, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
            except OSError as e:  # not found, not executable: one line, as a shell says it
                _log(f"cannot start {command[0]!r}: {e.strerror or e}")
                code = 127 if isinstance(e, FileNotFoundError) else 126
                break
            procs.append(p)
            for stream, out in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
                t = threading.Thread(target=_forward, args=(stream, f"[rank {r}] ", out), daemon=True)
                t.start()
                threads.append(t)

        start = time.monotonic()
        first_fail = None  # (rank, code)
        fail_time = None
        while not code:
            rcs = [p.poll() for p in procs]
            for r, rc in enumerate(rcs):
                if rc not in (None, 0) and first_fail is None:
                    first_fail, fail_time = (r, rc), time.monotonic()
                    _log(f"rank {r} failed with exit code {rc}; "
                         f"stopping the other ranks in {grace:g} s unless they finish")
            if all(rc is not None for rc in rcs):
                break
            now = time.monotonic()
            if fail_time is not None and now - fail_time > grace:
                _log("grace period over: terminating the remaining ranks")
                break
            if timeout is not None and now - start > timeout:
                _log(f"timeout after {timeout:g} s: terminating all ranks")
                code = 124
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        _log("interrupted: terminating all ranks")
        code = 130
    finally:
        for sig, handler in restore.items():
            signal.signal(sig, handler)
        _signal_all(procs, signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        _signal_all(procs, signal.SIGKILL)
        for p in procs:
            p.wait()
        for t in threads:
            t.join(timeout=5.0)

    if code:
        return code
    for r, p in enumerate(procs):
        if p.returncode != 0:
            _log(f"rank {r} exited with code {p.returncode}")
    if first_fail is not None:
        return _exit_code(first_fail[1]) or 1
    bad = [p.returncode for p in procs if p.returncode != 0]
    return _exit_code(bad[0]) or 1 if bad else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jax_dsa_exchange.launch",
        description="Run COMMAND as W processes (one DCP rank each) on this node.")
    parser.add_argument("-n", "--world", type=int, required=True, help="number of processes (ranks)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds for the whole run; then every rank is killed (exit 124)")
    parser.add_argument("--grace", type=float, default=10.0,
                        help="seconds the other ranks get after one fails (default 10)")
    parser.add_argument("--bind", choices=("auto", "gpu", "none"), default="auto",
                        help="gpu: rank r uses GPU r only; none: every rank sees every device; "
                             "auto (default): gpu when the node has >= W NVIDIA GPUs")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("missing COMMAND (use: -n W -- COMMAND...)")
    if args.world < 1:
        parser.error("-n must be >= 1")
    return launch(command, args.world, timeout=args.timeout, grace=args.grace, bind=args.bind)


if __name__ == "__main__":
    sys.exit(main())
