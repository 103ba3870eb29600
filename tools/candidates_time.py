"""Exact candidate knobs timed against the default in one process (GPU machine; the cubins of
every variant prebuilt by tools/gpu_candidates_run.sh --build).  A variant picks its cubins by
the tune strings (cache.source_hash mixes them into the tag), set before each KernelTimer
loads its kernels.  Merge alone (bench_kernels.time_merge: data pushed, rank 0's merge, CUDA
events median, CUPTI kernel median in brackets) at W = 8, K = 2048, N = 512, L = 8192 for
R = 1 / 16 / 64 / 256, the forced rescue of rank 0 at R = 1 / 64 (and R = 1, L = 128K for the
rescue knobs), the producer (select+push alone) for the select knobs; the default first and
last (drift shows as noise); the table last.

  JAX_DSA_EXCHANGE_CUBIN_DIR=.cubins PYTHONPATH=. python3 tools/candidates_time.py [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]
MT, ST = "JAX_DSA_EXCHANGE_MERGE_TUNE", "JAX_DSA_EXCHANGE_SELECT_TUNE"
# (name, merge tune, select tune, what to time): "m" merge normal path, "r" forced rescue,
# "R" forced rescue also at L = 128K, "p" the producer; "L": the rescue-list kernels
# (Exchange.create(rescue_list=True))
VARIANTS = [
    ("default", "", "", "mrp"),  # b1w=1 (seventeenth session), cnt2=1, flat=2, r2roll=1, r2all=1
    # twenty-third session, exact, measured and removed (no gain): h1w=1, h1w=2, swar=1 (commit
    # b631992); timing only: skip=push / pass2 / compact / hist1+pass2+dsmem+compact+push, and
    # skip=select+push (the floor), each "p"
    # ("rep2", "", "rep=2", "p"): timing only, the select twice in one launch (twenty-third session)
    # twenty-ninth session, measured (kernels/NOTES.md): btq, fbrot, early, spread, their set
    # all4, runs, all4r (merge, W = 8 N = 512: none faster than the default; runs was kept for
    # clustered rows, where it gains) and csw (select: 0.1-0.3 us slower): removed
    # timing only (outputs wrong): the merge's measured floor and breakdown on this source tree
    # (#12's limits): "floor" = the launch, the status / epoch / LL records' round trips and the
    # row's end (no select, no outputs); "nosel" = the outputs of the first K positions without
    # the select (stats, histograms, tie-break); "noout" = the select without the outputs
    ("floor", "nosel=1,noout=1", "", "m"),
    ("nosel", "nosel=1", "", "m"),
    ("noout", "noout=1", "", "m"),
    ("default#2", "", "", "mrp"),
]
# C = 1 (where one=1 acts) at (1, 8K), (64, 8K), (256, 32K); clusters of 2-8 at the others
PRODUCER_SHAPES = [(1, 8192), (64, 8192), (256, 8192), (1, 32768), (16, 32768), (256, 32768),
                   (1, 131072), (16, 131072), (64, 131072), (256, 131072)]


def missing_cubins(dirs) -> list:
    """The (variant, tag) folders this run needs that none of ``dirs`` holds (checked before
    any timing: a variant built from another source tree has another tag)."""
    import pathlib

    from jax_dsa_exchange.kernels import cache

    need = [(n, mt, st, 8, 2048, 512, "L" in what) for n, mt, st, what in VARIANTS]
    need.append(("localK", "", "", 8, 2048, 2048, False))
    out = []
    for n, mt, st, w, k, nn, rl in need:
        os.environ[MT], os.environ[ST] = mt, st
        tag = cache.config_tag("sm_90a", w, k, nn, cache.source_hash(), rl)
        if not any((pathlib.Path(d) / tag / f).is_file() for d in dirs for f in ("merge.cubin", "merge.cubin.gz")):
            out.append((n, tag))
    os.environ[MT], os.environ[ST] = "", ""
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/candidates_time.json")
    ap.add_argument("--only", nargs="*", default=None, help="variant names")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--check", action="store_true", help="only check that every variant's cubins are there")
    ap.add_argument("--resc-rows", type=int, nargs="+", default=[1, 64], help="R of the forced-rescue timings")
    a = ap.parse_args(argv)
    miss = missing_cubins(os.environ.get("JAX_DSA_EXCHANGE_CUBIN_DIR", ".cubins").split(":"))
    if miss or a.check:
        print(f"cubins missing: {miss}" if miss else "every variant's cubins are there", flush=True)
        return 1 if miss else 0
    import cupy as cp
    from bench_kernels import time_merge

    from jax_dsa_exchange.kernels.timing import KernelTimer

    x = cp.empty(256 << 20, cp.uint8)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.5:  # clocks ramp
        x.fill(1)
        cp.cuda.Device().synchronize()
    del x
    res = {}
    for name, mt, st, what in VARIANTS:
        if a.only and name.split("#")[0] not in a.only:
            continue
        os.environ[MT], os.environ[ST] = mt, st
        r = {}
        try:
            if "m" in what or "r" in what:
                b = KernelTimer(cp, 8, 2048, 512, 256, rescue_list="L" in what)
                if name == "default":
                    r["empty"] = round(time_merge(b, 0, 8192, False, iters=a.iters), 2)
                for R in (1, 16, 64, 256) if "m" in what else ():
                    r[f"r{R}"] = (round(time_merge(b, R, 8192, False, iters=a.iters), 2), round(b.last_kernel_us, 2))
                for R in a.resc_rows if "r" in what else ():
                    r[f"r{R}resc"] = (round(time_merge(b, R, 8192, True, iters=8, warm=2), 2),
                                      round(b.last_kernel_us, 2))  # fmt: skip
                del b
            if "R" in what:
                b = KernelTimer(cp, 8, 2048, 512, 4, rescue_list="L" in what)
                r["r1resc128k"] = (round(time_merge(b, 1, 131072, True, iters=8, warm=2), 2), round(b.last_kernel_us, 2))
                del b
            if "p" in what:
                b = KernelTimer(cp, 8, 2048, 512, 256, rescue_list="L" in what)
                for R, L in PRODUCER_SHAPES:
                    tp = b.run(R, L, rescue=False, iters=a.iters, merge=False)[0]
                    r[f"p{R}x{L // 1024}k"] = (round(tp, 2), round(b.last_producer_kernel_us, 2))
                del b
        except Exception as e:  # noqa: BLE001
            r["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        cp.get_default_memory_pool().free_all_blocks()
        res[name] = r
        print(name, r, flush=True)
    os.environ[MT], os.environ[ST] = "", ""
    lk = {}
    if not a.only or "default" in a.only:
        for L in (8192, 131072):  # the rescue goal's reference: select+push with N = K
            b = KernelTimer(cp, 8, 2048, 2048, 4)
            lk[str(L)] = round(b.run(1, L, rescue=False, iters=8, warm=2, merge=False)[0], 2)
            del b
    json.dump({"res": res, "localK_r1": lk}, open(a.out, "w"), indent=1)
    print("\n== merge alone, W=8 K=2048 N=512 L=8192 (events us [CUPTI]); resc = forced rescue of rank 0")
    cols = ["r1", "r16", "r64", "r256"] + [f"r{R}resc" for R in a.resc_rows] + ["r1resc128k"]
    print(f"{'variant':14s} " + " ".join(f"{c:>14s}" for c in cols))
    for n, r in res.items():
        if any(c in r for c in cols):
            cells = [f"{r[c][0]:6.2f} [{r[c][1]:5.2f}]" if c in r else f"{'-':>14s}" for c in cols]
            print(f"{n:14s} " + " ".join(cells) + (f"  {r['error']}" if "error" in r else ""))
    pc = [f"p{R}x{L // 1024}k" for R, L in PRODUCER_SHAPES]
    print("\n== producer alone (select+push), N=512 (events us [CUPTI]), R x L")
    print(f"{'variant':14s} " + " ".join(f"{c:>14s}" for c in pc))
    for n, r in res.items():
        if any(c in r for c in pc):
            print(f"{n:14s} " + " ".join(f"{r[c][0]:6.2f} [{r[c][1]:5.2f}]" if c in r else f"{'-':>14s}" for c in pc))
    print("empty merge launch:", res.get("default", {}).get("empty"), "us;  local top-K (select+push N=K, R=1):", lk)
    return 0


if __name__ == "__main__":
    sys.exit(main())
