"""Raw-kernel benchmark on ONE GPU: W ranks simulated in one process (CuPy).

    JAX_DSA_EXCHANGE_CUBIN_DIR=.cubins python benchmarks/bench_kernels.py [--csv docs/perf/kernels.csv]

Tables (``--tables``; default ``producer merge``), rank 0's kernels of W = 8, K = 2048:

* producer: N in {256, 512, 1024}, R in {1, 16, 64, 256}, L in {8K, 32K, 128K}: rank 0's
  select+push (its local top-N of R x L bf16 and the push of its rows to the W ranks) and its
  merge, next to the baselines measured in the same run on the same shapes: torch.topk and
  jax.lax.top_k of the top-N of [R, L] bf16 (what select+push replaces), and one read of
  R x L bf16 at the device's measured copy bandwidth;
* merge: rank 0's merge alone (every rank's rows already pushed), R in {1, 16, 64, 256}, without
  and with a forced rescue (rank 0's scores + 100: it is saturated on every row), next to the
  top-K of random 64-bit keys [R, W N] (the merge's round 1) by torch.topk and jax.lax.top_k,
  and to the local top-K of the rescued rows (select+push of a build with N = K);
* pair: rank 0's producer and merge back to back on one stream, the merge under programmatic
  dependent launch (as the C++ launcher launches it) and in plain stream order.

Times are medians in microseconds of CUDA events around the launch, after a memset that keeps
the stream busy (host launch gaps are not timed) and leaves the L2 cold; inputs are drawn on the
device and rotate over several sets.  "kernel" columns are the kernel's own duration (CUPTI,
through torch.profiler); torch's columns are left out where PyTorch is not importable.

``--baseline-cubins DIR`` times the same configurations of another build next to this one, in
the same run and on the same inputs: DIR is a folder of ``python -m jax_dsa_exchange.build --out
DIR`` from another source tree (the source hash in its folder names is ignored); the tables then
show both times and their ratio (this build / baseline: below 1 is faster).  ``--csv FILE``
writes each table as CSV (FILE with the table's name before its suffix: kernels.csv ->
kernels_producer.csv), stamped in comment lines (``# gpu:``, ``# driver:``, ``# jax:``,
``# commit:``, ``# date:``, ``# command:``) before its header row.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import math
import os
import pathlib
import shlex
import subprocess
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # (JAX beside CuPy on one GPU)
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jax_dsa_exchange import layout  # noqa: E402
from jax_dsa_exchange.baselines import jax_topk_time, topk64_times, torch_topk_time  # noqa: E402
from jax_dsa_exchange.testing.timing import KernelTimer, copy_bandwidth, prebuilt_images  # noqa: E402

TABLES = ("producer", "merge", "pair")
STAMP_KEYS = ("gpu", "driver", "jax", "commit", "date", "command")


# ------------------------------------------------------------------ arguments


def _positive(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text}: expected a positive integer")
    return v


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python benchmarks/bench_kernels.py",
        description="Device time of the raw kernels (W ranks simulated on one GPU) next to torch.topk, "
                    "jax.lax.top_k and one read of the logits; see the module docstring.")  # fmt: skip
    ap.add_argument("--tables", nargs="+", choices=TABLES, default=["producer", "merge"],
                    help="which tables to measure (default: producer merge)")
    ap.add_argument("--world", type=_positive, default=8, help="W, the ranks simulated (default 8)")
    ap.add_argument("--topk", type=_positive, default=2048, help="K, the merged top-k (default 2048)")
    ap.add_argument("--n", type=_positive, nargs="+", default=[256, 512, 1024],
                    help="N, each rank's local top-N (default 256 512 1024)")
    ap.add_argument("--rows", type=_positive, nargs="+", default=[1, 16, 64, 256],
                    help="R, the rows of a call (default 1 16 64 256)")
    ap.add_argument("--cols", type=_positive, nargs="+", default=[8192, 32768, 131072],
                    help="L, each rank's tokens per row, of the producer and pair tables (default 8192 32768 131072)")
    ap.add_argument("--merge-cols", type=_positive, default=8192,
                    help="L of the merge table (the merge reads L only in a rescue; default 8192)")
    ap.add_argument("--iters", type=_positive, default=12, help="timed iterations per measurement (default 12)")
    ap.add_argument("--no-rescue", action="store_true", help="leave out the forced-rescue measurements")
    ap.add_argument("--no-jax", action="store_true", help="leave out the jax.lax.top_k baselines")
    ap.add_argument("--no-torch", action="store_true",
                    help="leave out torch.topk and the CUPTI kernel durations (also without PyTorch)")
    ap.add_argument("--pattern", default="random", choices=("random", "recent"),
                    help="input scores: random, or recent (rising along the row: the top-N are the last tokens)")
    ap.add_argument("--spacer-mb", type=_positive, default=256,
                    help="the memset before each timed launch, MB: 256 leaves the L2 cold, 1 keeps it warm")
    ap.add_argument("--baseline-cubins", metavar="DIR", type=pathlib.Path,
                    help="also time the same configurations of the build in DIR (another source tree), with ratios")
    ap.add_argument("--csv", metavar="FILE", type=pathlib.Path,
                    help="write each table as stamped CSV to FILE with the table's name before the suffix")
    a = ap.parse_args(argv)
    for n in a.n:
        try:
            layout.check_config(a.world, a.topk, n)
        except ValueError as e:
            ap.error(f"--world {a.world} --topk {a.topk} --n {n}: {e}")
    if a.baseline_cubins is not None and not a.baseline_cubins.is_dir():
        ap.error(f"--baseline-cubins {a.baseline_cubins}: not a folder")
    a.torch = not a.no_torch and importlib.util.find_spec("torch") is not None
    return a


# ------------------------------------------------------------------ CSV


def stamp(command: list, gpu: str, driver: str) -> dict:
    """What a CSV says about the run that made it: ``STAMP_KEYS``, in that order."""
    try:
        jax_version = importlib.metadata.version("jax")
    except importlib.metadata.PackageNotFoundError:
        jax_version = "not installed"
    commit = "unknown"
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=30)  # fmt: skip
        if head.returncode == 0 and head.stdout.strip():
            commit = head.stdout.strip()
            dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=30).stdout.strip()  # fmt: skip
            if dirty:
                commit += " (with uncommitted changes)"
    except (OSError, subprocess.SubprocessError):
        pass
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    return dict(gpu=gpu, driver=driver, jax=jax_version, commit=commit, date=date, command=shlex.join(command))


def _cell(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def csv_text(stamp_: dict, header: list, rows: list) -> str:
    """The stamp as ``# key: value`` lines, then the header row and the rows (dicts)."""
    import csv
    import io

    out = io.StringIO()
    for k in STAMP_KEYS:
        out.write(f"# {k}: {stamp_[k]}\n")
    w = csv.writer(out, lineterminator="\n")
    w.writerow(header)
    for r in rows:
        w.writerow([_cell(r.get(h)) for h in header])
    return out.getvalue()


def csv_path(base: pathlib.Path, table: str) -> pathlib.Path:
    """kernels.csv + producer -> kernels_producer.csv"""
    return base.with_name(f"{base.stem}_{table}{base.suffix or '.csv'}")


def print_table(title: str, header: list, rows: list) -> None:
    cells = [[_cell(r.get(h)) or "-" for h in header] for r in rows]
    width = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(header)]
    print(f"\n{title}")
    print("  ".join(h.rjust(w) for h, w in zip(header, width)))
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, width)), flush=True)


def columns(a, names: list) -> list:
    """``names`` without the columns this run does not measure."""
    out = []
    for h in names:
        if not a.torch and ("torch" in h or "kernel" in h or "span" in h):
            continue
        if a.no_jax and "jax" in h:
            continue
        if a.no_rescue and ("rescue" in h or h == "local_topk_us"):
            continue
        if a.baseline_cubins is None and ("base_" in h or h.endswith("_ratio")):
            continue
        out.append(h)
    return out


def _ratio(x, y):
    return None if x is None or y is None or y != y or x != x or y == 0 else x / y


# ------------------------------------------------------------------ measurements


def _warm_up(timer, cp, seconds=0.5):
    """Keep the GPU busy before timing, so that its clocks have ramped up."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for i in range(8):
            timer.spacer.fill(i)
        cp.cuda.Device().synchronize()


def _timers(cp, a, n, max_rows, baseline=True):
    """This build's timer for N, and the baseline build's (None without --baseline-cubins)."""
    kw = dict(pattern=a.pattern, spacer_mb=a.spacer_mb)
    cur = KernelTimer(cp, a.world, a.topk, n, max_rows, **kw)
    print(f"N={n}: this build, loaded {cur.sim.loaded_from}", flush=True)
    base = None
    if baseline and a.baseline_cubins is not None:
        imgs = prebuilt_images(a.baseline_cubins, a.world, a.topk, n)
        base = KernelTimer(cp, a.world, a.topk, n, max_rows, images=imgs, **kw)
        print(f"N={n}: baseline {next(iter(imgs.values())).source_hash[:16]} from {a.baseline_cubins}", flush=True)
    return cur, base


def producer_table(cp, a, bw):
    cache = {}

    def topk_us(kind, R, L, n):
        key = (kind, R, L, n)
        if key not in cache:
            t = jax_topk_time((R, L), n) if kind == "jax" else torch_topk_time((R, L), n, "bfloat16")
            cache[key] = None if t is None else t * 1e6
        return cache[key]

    rows = []
    for n in a.n:
        cur, base = _timers(cp, a, n, max(a.rows))
        _warm_up(cur, cp)
        for R in a.rows:
            for L in a.cols:
                image, c = cur.sim.producer_launch(R, L)
                r = dict(W=a.world, K=a.topk, N=n, R=R, L=L, image=image, C=c)
                r["select_push_us"], r["merge_us"] = cur.run(R, L, rescue=False, iters=a.iters, warm=3)
                r["select_push_kernel_us"] = cur.last_producer_kernel_us
                if base is not None:
                    r["base_select_push_us"], r["base_merge_us"] = base.run(R, L, rescue=False, iters=a.iters, warm=3)
                    r["select_push_ratio"] = _ratio(r["select_push_us"], r["base_select_push_us"])
                    r["merge_ratio"] = _ratio(r["merge_us"], r["base_merge_us"])
                if not a.no_rescue:
                    _, r["merge_rescue_us"] = cur.run(R, L, rescue=True, iters=max(2, a.iters // 2), warm=2)
                    r["rescued_rows"] = cur.last_sat_rows
                r["read_us"] = R * L * 2 / bw * 1e6  # one read of the logits at the copy bandwidth
                r["torch_topk_us"] = topk_us("torch", R, L, n) if a.torch else None
                r["jax_top_k_us"] = None if a.no_jax else topk_us("jax", R, L, n)
                rows.append(r)
                print(" ".join(f"{k}={_cell(v)}" for k, v in r.items()), flush=True)
        del cur, base
    header = columns(a, ["W", "K", "N", "R", "L", "image", "C", "select_push_us", "select_push_kernel_us",
                         "base_select_push_us", "select_push_ratio", "read_us", "torch_topk_us", "jax_top_k_us",
                         "merge_us", "base_merge_us", "merge_ratio", "merge_rescue_us", "rescued_rows"])  # fmt: skip
    title = (f"producer: rank 0's select+push and merge, W={a.world} K={a.topk}; us, median of CUDA events; "
             f"copy bandwidth {bw / 1e12:.2f} TB/s (read + write); baselines: top-N of [R, L] bf16, one read "
             f"of [R, L] bf16")  # fmt: skip
    return title, header, rows


def merge_table(cp, a):
    L = a.merge_cols
    rows = []
    for n in a.n:
        if a.world * n <= a.topk:
            # every row then needs a rescue, and rank 0's merge, run alone first here, would wait
            # for its peers' rescue flags until the timeout (the producer table times such rows)
            print(f"merge table: N={n} left out (W*N = {a.world * n} <= K = {a.topk}: every row is rescued)")
            continue
        cur, base = _timers(cp, a, n, max(a.rows))
        _warm_up(cur, cp)
        r = dict(W=a.world, K=a.topk, N=n, R=0, L=L)
        r["merge_us"] = cur.merge_alone(0, L, False, iters=a.iters)
        r["merge_kernel_us"] = cur.last_kernel_us
        print(f"merge launch floor (R=0, an empty launch): {_cell(r['merge_us'])} us", flush=True)
        rows.append(r)
        for R in a.rows:
            r = dict(W=a.world, K=a.topk, N=n, R=R, L=L)
            r["merge_us"] = cur.merge_alone(R, L, False, iters=a.iters)
            r["merge_kernel_us"] = cur.last_kernel_us
            if base is not None:
                r["base_merge_us"] = base.merge_alone(R, L, False, iters=a.iters)
                r["merge_ratio"] = _ratio(r["merge_us"], r["base_merge_us"])
            if not a.no_rescue:
                it = max(2, a.iters // 2)
                r["merge_rescue_us"] = cur.merge_alone(R, L, True, iters=it, warm=2)
                r["merge_rescue_kernel_us"] = cur.last_kernel_us
                r["rescued_rows"] = cur.last_sat_rows
                if base is not None:
                    r["base_merge_rescue_us"] = base.merge_alone(R, L, True, iters=it, warm=2)
                    r["merge_rescue_ratio"] = _ratio(r["merge_rescue_us"], r["base_merge_rescue_us"])
            if a.torch or not a.no_jax:
                t = topk64_times(R, a.world * n, a.topk)
                r["torch_topk64_us"] = t["torch"] if a.torch else None
                r["jax_top_k64_us"] = None if a.no_jax else t["jax"]
            rows.append(r)
            print(" ".join(f"{k}={_cell(v)}" for k, v in r.items()), flush=True)
        del cur, base
    if not a.no_rescue and rows:
        # the local top-K of the rows the forced rescue selects from (rank 0's scores + 100):
        # select+push of the build with N = K
        try:
            local = KernelTimer(cp, a.world, a.topk, a.topk, max(a.rows), spacer_mb=a.spacer_mb)
            for r in rows:
                if r["R"]:
                    r["local_topk_us"], _ = local.run(r["R"], L, rescue=True, iters=max(2, a.iters // 2), warm=2,
                                                      merge=False)  # fmt: skip
            del local
        except FileNotFoundError as e:
            print(f"merge table: no N = K build for the local top-K: {e}", flush=True)
    header = columns(a, ["W", "K", "N", "R", "L", "merge_us", "merge_kernel_us", "base_merge_us", "merge_ratio",
                         "merge_rescue_us", "merge_rescue_kernel_us", "base_merge_rescue_us", "merge_rescue_ratio",
                         "rescued_rows", "local_topk_us", "torch_topk64_us", "jax_top_k64_us"])  # fmt: skip
    title = (f"merge: rank 0's merge alone (R=0: an empty launch), W={a.world} K={a.topk} L={L}; us, median of "
             f"CUDA events; baselines: top-K of random int64 keys [R, W*N], the local top-K of the rescued rows")
    return title, header, rows


def pair_table(cp, a):
    rows = []
    for n in a.n:
        if a.world * n <= a.topk:  # (rank 0's merge would wait for its peers' rescues: see merge_table)
            print(f"pair table: N={n} left out (W*N = {a.world * n} <= K = {a.topk}: every row is rescued)")
            continue
        cur, _ = _timers(cp, a, n, max(a.rows), baseline=False)
        _warm_up(cur, cp)
        for R in a.rows:
            for L in a.cols:
                r = dict(W=a.world, K=a.topk, N=n, R=R, L=L)
                r["producer_us"], _ = cur.run(R, L, rescue=False, iters=a.iters, warm=3, merge=False)
                r["producer_kernel_us"] = cur.last_producer_kernel_us
                r["merge_us"] = cur.merge_alone(R, L, False, iters=a.iters)
                r["merge_kernel_us"] = cur.last_kernel_us
                r["pair_pdl_us"] = cur.pair(R, L, True, iters=a.iters)
                r["pair_pdl_span_us"] = cur.last_pair_span_us
                r["pair_plain_us"] = cur.pair(R, L, False, iters=a.iters)
                r["pair_plain_span_us"] = cur.last_pair_span_us
                r["merge_adds_us"] = r["pair_pdl_us"] - r["producer_us"]
                rows.append(r)
                print(" ".join(f"{k}={_cell(v)}" for k, v in r.items()), flush=True)
        del cur
    header = columns(a, ["W", "K", "N", "R", "L", "producer_us", "producer_kernel_us", "merge_us", "merge_kernel_us",
                         "pair_plain_us", "pair_plain_span_us", "pair_pdl_us", "pair_pdl_span_us",
                         "merge_adds_us"])  # fmt: skip
    title = (f"pair: rank 0's producer then merge on one stream, W={a.world} K={a.topk}; us, median; span = "
             f"CUPTI from the producer's start to the merge's end; merge_adds = pair (PDL) - producer alone")
    return title, header, rows


def _device(cp):
    dev = cp.cuda.Device()
    name = cp.cuda.runtime.getDeviceProperties(dev.id)["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    driver = None
    try:
        out = subprocess.run(["nvidia-smi", "-i", str(dev.id), "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)  # fmt: skip
        driver = out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        pass
    if driver is None:
        v = cp.cuda.runtime.driverGetVersion()
        driver = f"CUDA {v // 1000}.{v % 1000 // 10}"
    return name, driver


def main(argv=None) -> int:
    a = parse_args(argv)
    command = ["python", *(sys.argv if argv is None else [os.path.relpath(__file__), *argv])]
    import cupy as cp

    gpu, driver = _device(cp)
    print(f"{gpu}, driver {driver}", flush=True)
    tables = []
    if "producer" in a.tables:
        bw = copy_bandwidth(cp)
        print(f"device copy bandwidth: {bw / 1e12:.2f} TB/s (read + write)", flush=True)
        tables.append(("producer", *producer_table(cp, a, bw)))
    if "merge" in a.tables:
        tables.append(("merge", *merge_table(cp, a)))
    if "pair" in a.tables:
        tables.append(("pair", *pair_table(cp, a)))
    st = stamp(command, gpu, driver)
    for name, title, header, rows in tables:
        print_table(title, header, rows)
        if a.csv is not None:
            path = csv_path(a.csv, name)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(csv_text(st, header, rows))
            print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
