"""The GPU checks of a build, in named steps, on one GPU node.

Run from the repository root of a node with an NVIDIA GPU, the cuda13 (or cuda12) extra
installed, the prebuilt kernels in .cubins and the FFI library in build/ffi_lib (both made by
``python dev/build_cubins.py`` on any machine with the kernels extra):

    python dev/gpu_check.py                      # the default steps: tests launcher ops demo
    python dev/gpu_check.py tests sanitize --out /tmp/check
    python dev/gpu_check.py all --baseline-cubins old_cubins
    python dev/gpu_check.py --list               # the steps and what they run

Every pytest run passes ``--require-gpu``: a GPU test that would skip for a missing piece of the
GPU stack (GPU, jax's GPU backend, CuPy, FFI library, cubins, nvcc) fails the step instead.
Each step's output goes to a log under --out (pytest's results also to a JUnit XML there); the
summary gives per step its result and time, and per test file the passed / failed / skipped
counts.  Each step has a time limit (``--limit`` scales them all).  The exit status is 0 when
every step passed, 1 otherwise, 2 on a usage error.  Standard library only.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

PY = sys.executable
PYTEST = [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--require-gpu", "-ra"]
KERNEL_TESTS = ["tests/test_kernels_gpu.py", "tests/test_select_gpu.py"]
SANITIZER = ["compute-sanitizer", "--print-limit", "20", "--error-exitcode", "99"]
# what tests/gpu.py's skip reasons start with: a skip with one of these means a missing piece of
# the GPU stack (--require-gpu turns them into a failed run; checked again on the results)
STACK_SKIPS = ("no NVIDIA GPU", "no GPU backend in jax", "jax cannot start a backend", "CuPy is not importable",
               "the FFI launcher library", "nvcc is not on PATH", "no prebuilt kernels")  # fmt: skip


@dataclasses.dataclass
class Run:
    """One command of a step: its log (and JUnit XML) are ``<out>/<step>/<name>.*``."""

    name: str
    argv: list
    env: dict = dataclasses.field(default_factory=dict)
    pytest: bool = False  # a pytest run: --junitxml added, results parsed
    sanitizer: bool = False  # a compute-sanitizer run: its summary lines read from the log


@dataclasses.dataclass
class Step:
    name: str
    about: str
    limit: int  # seconds, for all of the step's runs together
    runs: list
    mps: bool = False  # W processes share the GPU: under an MPS daemon


def _pytest(name, files, *extra, env=None):
    return Run(name, PYTEST + list(extra) + list(files), env or {}, pytest=True)


def _sanitized(name, tool, files, k):
    argv = SANITIZER + ["--tool", tool] + PYTEST + ["-k", k] + list(files)
    return Run(name, argv, {}, pytest=True, sanitizer=True)


def steps(a) -> dict:
    """The steps, in the order ``all`` runs them."""
    launch = [PY, "-m", "jax_dsa_exchange.launch"]
    bench = [PY, "benchmarks/bench_kernels.py", "--csv", str(pathlib.Path(a.out) / "bench" / "kernels.csv")]
    if a.baseline_cubins:
        bench += ["--baseline-cubins", a.baseline_cubins]
    out = [
        Step("tests", "the GPU kernel and select tests (W ranks simulated in one process), once per kind of "
             "kernels (JAX_DSA_EXCHANGE_TEST_RESCUE_LIST 0 and 1)", 900, [
                 _pytest("rescue_list0", KERNEL_TESTS, env={"JAX_DSA_EXCHANGE_TEST_RESCUE_LIST": "0"}),
                 _pytest("rescue_list1", KERNEL_TESTS, env={"JAX_DSA_EXCHANGE_TEST_RESCUE_LIST": "1"})]),
        Step("images", "the kernel tests with every merge on merge_wide where a configuration has it, the "
             "select tests with every producer launch on select_push", 600, [
                 _pytest("merge_wide", ["tests/test_kernels_gpu.py"], env={"JAX_DSA_EXCHANGE_TEST_MERGE": "merge_wide"}),
                 _pytest("select_push", ["tests/test_select_gpu.py"], "-k", "not lean_image",
                         env={"JAX_DSA_EXCHANGE_TEST_PRODUCER": "select_push"})]),
        Step("launcher", "the FFI launcher's GPU tests with stand-in kernels (nvcc), the op end to end on them",
             300, [_pytest("launcher", ["tests/test_ffi.py", "tests/test_op.py"], "-m", "gpu")]),
        Step("ops", "the JAX op in W processes on the GPU through the FFI path (all but the long run)", 900,
             [_pytest("ops", ["tests/test_op_gpu.py"], "-k", "not long_run")], mps=True),
        Step("long", "the op's long run: 10^5 calls on one exchange, W = 4 processes", 900,
             [_pytest("long", ["tests/test_op_gpu.py"], "-k", "long_run")], mps=True),
        Step("demo", "the demo, W = 4 processes on the FFI path", 300,
             [Run("demo", launch + ["-n", "4", "--timeout", "240", "--", PY, "-m", "jax_dsa_exchange.demo",
                                    "--path", "ffi", "--world", "4"])], mps=True),  # fmt: skip
        Step("sanitize", "compute-sanitizer: memcheck of the select tests and of the merge's (rescues, "
             "large and clustered configurations), racecheck of the shared-memory-heavy ones", 1500, [
                 _sanitized("memcheck_select", "memcheck", ["tests/test_select_gpu.py"], "not long_rows"),
                 _sanitized("memcheck_merge", "memcheck", ["tests/test_kernels_gpu.py"],
                            "rescue or large_configs or adversarial or clustered"),
                 _sanitized("racecheck", "racecheck", KERNEL_TESTS,
                            "clustered_selection_in_one_cta or rescue_tie_heavy and 8-2048-512 or "
                            "exchange_bit_identical and (1 or 8) or lean_image and ties")]),
        Step("bench", "the kernel benchmark grid (benchmarks/bench_kernels.py; CSVs under <out>/bench)", 900,
             [Run("bench", bench)]),
        Step("suite", "the whole test suite with --require-gpu (what a user runs to check an install)", 2400,
             [_pytest("suite", [])], mps=True),
        Step("serving", "the serving-loop benchmark (python -m jax_dsa_exchange.bench --serving)", 300,
             [Run("serving", [PY, "-m", "jax_dsa_exchange.bench", "--serving", "--out",
                              str(pathlib.Path(a.out) / "serving")])]),  # fmt: skip
    ]
    return {s.name: s for s in out}


DEFAULT = ["tests", "launcher", "ops", "demo"]
# (not: long and suite, which repeat the tests of the others at length)
ALL = ["tests", "images", "launcher", "ops", "demo", "sanitize", "bench", "serving"]


# ------------------------------------------------------------------ results


@dataclasses.dataclass
class Counts:
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    xfailed: int = 0
    stack_skips: int = 0  # skipped for a missing piece of the GPU stack

    def add(self, o: Counts) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(o, f.name))


def test_file(classname: str) -> str:
    """tests.test_op_gpu[.TestClass] -> tests/test_op_gpu.py"""
    parts = classname.split(".")
    for i, p in enumerate(parts):
        if p.startswith("test_"):
            return "/".join(parts[: i + 1]) + ".py"
    return "/".join(parts) + ".py"


def junit_counts(xml_text: str) -> dict:
    """{test file: Counts} of a pytest JUnit XML report."""
    root = ET.fromstring(xml_text)
    out: dict = {}
    for case in root.iter("testcase"):
        c = out.setdefault(test_file(case.get("classname", "")), Counts())
        if case.find("failure") is not None:
            c.failed += 1
        elif case.find("error") is not None:
            c.errors += 1
        elif (sk := case.find("skipped")) is not None:
            if sk.get("type") == "pytest.xfail":
                c.xfailed += 1
            else:
                c.skipped += 1
                if (sk.get("message") or "").startswith(STACK_SKIPS):
                    c.stack_skips += 1
        else:
            c.passed += 1
    return out


def sanitizer_errors(log: str) -> int | None:
    """Errors compute-sanitizer reported in a log (None: no summary line)."""
    got = [int(n) for n in re.findall(r"ERROR SUMMARY: (\d+) error", log)]
    got += [int(n) for n in re.findall(r"RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) error", log)]
    return sum(got) if got else None


def require_gpu_message(log: str) -> str | None:
    """pytest --require-gpu's message where the run stopped for an incomplete GPU stack."""
    m = re.search(r"ERROR: (--require-gpu: .*?)(?:\n\s*\n|\Z)", log, re.S)
    return m.group(1).strip() if m else None


@dataclasses.dataclass
class Result:
    step: str
    run: str
    rc: int | None  # None: killed at the time limit
    seconds: float
    log: str
    counts: dict = dataclasses.field(default_factory=dict)  # test file -> Counts
    why: list = dataclasses.field(default_factory=list)  # why it failed

    @property
    def ok(self) -> bool:
        return not self.why


def judge(r: Result, run: Run, log_text: str, xml_text: str | None) -> Result:
    """Fill r.counts and r.why from the run's exit status, its log and its JUnit XML."""
    if r.rc is None:
        r.why.append("time limit")
    elif r.rc != 0:
        r.why.append(f"exit status {r.rc}")
    if run.pytest:
        msg = require_gpu_message(log_text)
        if msg:
            r.why.append(msg)
        if xml_text:
            r.counts = junit_counts(xml_text)
            total = Counts()
            for c in r.counts.values():
                total.add(c)
            if total.stack_skips:
                r.why.append(f"{total.stack_skips} test(s) skipped for a missing piece of the GPU stack")
            if total.passed + total.failed + total.errors == 0 and not msg:
                r.why.append("no test ran")
        elif not msg:
            r.why.append("no JUnit XML written")
    if run.sanitizer:
        n = sanitizer_errors(log_text)
        if n is None:
            r.why.append("no compute-sanitizer summary in the log")
        elif n:
            r.why.append(f"compute-sanitizer: {n} error(s)")
    return r


def summary(results: list) -> str:
    lines = ["", "== summary"]
    for r in results:
        state = "ok" if r.ok else "FAILED"
        lines.append(f"{r.step + '/' + r.run:28s} {state:7s} {r.seconds:7.1f} s  {r.log}")
        for why in r.why:
            lines.append("    " + why.replace("\n", "\n    "))
        if r.counts:
            lines.append(f"    {'test file':34s} {'passed':>6} {'failed':>6} {'errors':>6} {'skipped':>7} {'xfailed':>7}")
            for f, c in sorted(r.counts.items()):
                lines.append(f"    {f:34s} {c.passed:6d} {c.failed:6d} {c.errors:6d} {c.skipped:7d} {c.xfailed:7d}")
    bad = [r for r in results if not r.ok]
    lines.append(f"{len(results) - len(bad)} of {len(results)} runs passed" + (": FAILED" if bad else ""))
    return "\n".join(lines)


# ------------------------------------------------------------------ running


class Mps:
    """An MPS daemon of our own (pipe and log folders under /tmp: the socket path is short), so
    that the W processes of a step share the GPU's SMs instead of time-slicing it."""

    def __init__(self):
        self.env: dict = {}

    def start(self) -> None:
        if self.env:
            return
        if shutil.which("nvidia-cuda-mps-control") is None:
            print("  (no nvidia-cuda-mps-control: the processes time-slice the GPU)", flush=True)
            return
        d = tempfile.mkdtemp(prefix="mps")
        env = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(d, "pipe"), "CUDA_MPS_LOG_DIRECTORY": os.path.join(d, "log")}
        for v in env.values():
            os.makedirs(v, exist_ok=True)
        r = subprocess.run(["nvidia-cuda-mps-control", "-d"], env={**os.environ, **env}, capture_output=True,
                           text=True)  # fmt: skip
        if r.returncode == 0:
            self.env = env
            print(f"  MPS daemon started ({env['CUDA_MPS_PIPE_DIRECTORY']})", flush=True)
        else:
            print(f"  MPS daemon did not start ({r.stderr.strip()}): the processes time-slice the GPU", flush=True)

    def stop(self) -> None:
        if not self.env:
            return
        subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", env={**os.environ, **self.env}, text=True,
                       capture_output=True)  # fmt: skip
        time.sleep(1)
        print("  MPS daemon stopped", flush=True)
        self.env = {}


def environment(root: pathlib.Path) -> dict:
    """The variables every run gets: the checkout's package, its cubins and FFI library."""
    env = {"PYTHONPATH": str(root), "PYTHONUNBUFFERED": "1", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    if "JAX_DSA_EXCHANGE_CUBIN_DIR" not in os.environ and (root / ".cubins").is_dir():
        env["JAX_DSA_EXCHANGE_CUBIN_DIR"] = str(root / ".cubins")
    lib = root / "build" / "ffi_lib" / "libdsa_exchange_ffi.so"
    if "JAX_DSA_EXCHANGE_FFI_LIB" not in os.environ and lib.is_file():
        env["JAX_DSA_EXCHANGE_FFI_LIB"] = str(lib)
    cuda_bin = "/usr/local/cuda/bin"
    if os.path.isdir(cuda_bin) and cuda_bin not in os.environ.get("PATH", "").split(os.pathsep):
        env["PATH"] = os.environ.get("PATH", "") + os.pathsep + cuda_bin  # (nvcc, compute-sanitizer)
    return env


def execute(run: Run, step: str, out: pathlib.Path, env: dict, seconds: float) -> Result:
    d = out / step
    d.mkdir(parents=True, exist_ok=True)
    log, xml = d / f"{run.name}.log", d / f"{run.name}.xml"
    argv = list(run.argv)
    if run.pytest:
        xml.unlink(missing_ok=True)
        argv.append(f"--junitxml={xml}")
    print(f"-- {step}/{run.name}: {shlex.join(argv)}", flush=True)
    t0 = time.monotonic()
    with open(log, "w") as f:
        f.write(f"$ {' '.join(f'{k}={v}' for k, v in run.env.items())} {shlex.join(argv)}\n")
        f.flush()
        p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **env, **run.env},
                             start_new_session=True)  # fmt: skip
        try:
            rc = p.wait(timeout=max(1.0, seconds))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # (the launcher's W ranks too)
            p.wait()
            rc = None
    r = Result(step, run.name, rc, time.monotonic() - t0, str(log))
    return judge(r, run, log.read_text(errors="replace"), xml.read_text() if xml.is_file() else None)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python dev/gpu_check.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("steps", nargs="*", metavar="STEP",
                    help=f"steps to run, in order (default: {' '.join(DEFAULT)}; 'all': {' '.join(ALL)}; "
                         f"--list describes them)")
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "gpu_check"),
                    help="folder of the logs, JUnit XMLs and benchmark CSVs (default: %(default)s)")
    ap.add_argument("--limit", type=float, default=1.0, metavar="SCALE",
                    help="multiply every step's time limit by SCALE (default 1)")
    ap.add_argument("--baseline-cubins", metavar="DIR",
                    help="bench: also time the build in DIR (benchmarks/bench_kernels.py --baseline-cubins)")
    ap.add_argument("--no-mps", action="store_true", help="run the multi-process steps without an MPS daemon")
    ap.add_argument("--list", action="store_true", help="list the steps and what they run, then exit")
    ap.add_argument("--dry-run", action="store_true", help="print the commands without running them")
    a = ap.parse_args(argv)
    if a.limit <= 0:
        ap.error(f"--limit {a.limit}: expected a positive scale")
    names = []
    for s in a.steps or DEFAULT:
        names += ALL if s == "all" else [s]
    known = steps(a)
    unknown = [s for s in names if s not in known]
    if unknown:
        ap.error(f"unknown step(s) {unknown}: expected some of {list(known)} or 'all'")
    a.steps = list(dict.fromkeys(names))
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    known = steps(a)
    if a.list or a.dry_run:
        for name in known if a.list else a.steps:
            s = known[name]
            print(f"{name}{' (under MPS)' if s.mps else ''}, limit {s.limit * a.limit:.0f} s: {s.about}")
            for run in s.runs:
                print(f"    {' '.join(f'{k}={v}' for k, v in run.env.items())} {shlex.join(run.argv)}".rstrip())
        return 0
    root = pathlib.Path.cwd()
    if not (root / "jax_dsa_exchange").is_dir() or not (root / "tests").is_dir():
        print(f"run this from the repository root (no jax_dsa_exchange/ and tests/ in {root})", file=sys.stderr)
        return 2
    out = pathlib.Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = environment(root)
    print(f"steps: {' '.join(a.steps)}; logs under {out}", flush=True)
    for k in ("JAX_DSA_EXCHANGE_CUBIN_DIR", "JAX_DSA_EXCHANGE_FFI_LIB"):
        print(f"  {k}={env.get(k, os.environ.get(k, '(not set)'))}", flush=True)
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True)  # fmt: skip
        print(f"  GPU: {smi.stdout.strip() or smi.stderr.strip()}", flush=True)
    mps = Mps()
    results = []
    try:
        for name in a.steps:
            s = known[name]
            print(f"== {name}: {s.about}", flush=True)
            if s.mps and not a.no_mps:
                mps.start()
            else:
                mps.stop()  # (compute-sanitizer and the single-process steps run without it)
            deadline = time.monotonic() + s.limit * a.limit
            for run in s.runs:
                left = deadline - time.monotonic()
                r = execute(run, name, out, {**env, **mps.env}, left)
                results.append(r)
                print(f"   {'ok' if r.ok else 'FAILED: ' + '; '.join(w.splitlines()[0] for w in r.why)} "
                      f"({r.seconds:.0f} s)", flush=True)  # fmt: skip
    finally:
        mps.stop()
    print(summary(results), flush=True)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
