"""The clustered merge (kernels/merge.py Merge.clus, nineteenth session) timed against the
one-CTA merge (clus=0) and the merge_wide image (4 CTAs per row) in one process (GPU machine; cubins prebuilt
by tools/gpu_clus_run.sh --build).  Merge alone (bench_kernels.time_merge: data pushed, rank
0's merge, grid min(R, 64) rows at once, CUDA events median, CUPTI kernel median in brackets)
at K = 2048, L = 8192, R = 1 / 16 / 24 / 32 / 64 / 256, and the forced rescue of rank 0 at R = 1; the
default first and last (drift shows as noise); the table last.

  JAX_DSA_EXCHANGE_CUBIN_DIR=.cubins PYTHONPATH=. python3 tools/clus_time.py [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]
MT = "JAX_DSA_EXCHANGE_MERGE_TUNE"
# (name, merge tune, W, N, merge image: kernels/cache.py)
VARIANTS = [
    ("w16 merge", "", 16, 1024, "merge"),  # clus=2: 2 CTAs per row of 16 words per thread
    ("w16 merge_wide", "", 16, 1024, "merge_wide"),  # 4 CTAs per row of 8 words per thread
    ("w16 clus=0", "clus=0", 16, 1024, "merge"),  # one CTA per row (before)
    ("w16 merge#2", "", 16, 1024, "merge"),
    ("w8n1024 merge", "", 8, 1024, "merge"),  # clus=2: 2 CTAs per row of 8 words
    ("w8n1024 merge_wide", "", 8, 1024, "merge_wide"),  # 4 CTAs per row of 4 words
    ("w8n1024 clus=0", "clus=0", 8, 1024, "merge"),
    ("w8n512 merge", "", 8, 512, "merge"),  # (not clustered: the reference point)
    ("w16n512 merge", "", 16, 512, "merge"),  # 2 CTAs per row of 8 words
    ("w16n512 merge_wide", "", 16, 512, "merge_wide"),  # 4 CTAs per row of 4 words
    # (twenty-first session's candidates, rejected: ("w8n512 ckp=4", "ckp=4", 8, 512, "merge"): 2 CTAs
    # of 4 words; ("w8n512 ckp=2 c4", "ckp=2,clus=4", 8, 512, "merge"): 4 CTAs of 2 words)
    ("w8n512 merge#2", "", 8, 512, "merge"),
    # (twenty-eighth session's candidates, measured in the twenty-ninth: runs=1 over clusters, now
    # the default of every clustered row; wide2=1, merge_wide for two CTAs per SM: slower, removed.)
    # runs=0: the pair-group layout on clusters (the default before the twenty-ninth session), to
    # compare with runs in one call (R = 256 at W = 16 N = 1024 measured slower across calls)
    ("w16 runs=0", "runs=0", 16, 1024, "merge"),
    ("w16 wide runs=0", "runs=0", 16, 1024, "merge_wide"),
    ("w8n1024 runs=0", "runs=0", 8, 1024, "merge"),
    ("w8n1024 wide runs=0", "runs=0", 8, 1024, "merge_wide"),
    ("w16n512 runs=0", "runs=0", 16, 512, "merge"),
    ("w16n512 wide runs=0", "runs=0", 16, 512, "merge_wide"),
]
ROWS = (1, 16, 24, 32, 64, 256)


def launcher_rows(res: dict, fit: dict, rows) -> list:
    """Add to ``res`` the rows the launcher would time with one rank per GPU: for each merge_wide
    variant timed (``fit``: its co-resident clusters of 4), that image where
    layout.merge_uses_wide(R, fit), else its merge (the variant of the same W, N and tune) -> the
    lines that say so."""
    from jax_dsa_exchange import layout

    spec = {v[0]: v[1:] for v in VARIANTS}  # name -> (tune, W, N, image)
    lines = []
    for wname, nfit in fit.items():
        wmt, w, n, _ = spec[wname]
        narrow = [nm for nm, (mt, w2, n2, img) in spec.items()
                  if img == "merge" and (w2, n2) == (w, n) and mt == wmt and "#" not in nm and nm in res]
        nar, wid = (res[narrow[0]] if narrow else {}), res.get(wname, {})
        res[f"{wname} launcher"] = {"cluster": "*", **{
            f"r{R}": (wid if layout.merge_uses_wide(R, nfit) else nar)[f"r{R}"] for R in rows
            if f"r{R}" in nar and f"r{R}" in wid}}
        lines.append(f"{wname}: fit {nfit} clusters of 4: the launcher runs it at R <= {nfit}, "
                     f"else {narrow[0] if narrow else '(its merge not timed)'}")
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/clus_time.json")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-rescue", action="store_true")
    ap.add_argument("--only", nargs="*", default=None, help="variant names (default: all)")
    ap.add_argument("--rows", type=int, nargs="*", default=list(ROWS))
    a = ap.parse_args(argv)
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
    fit = {}
    for name, mt, w, n, image in VARIANTS:
        if a.only and name not in a.only:
            continue
        os.environ[MT] = mt
        r = {}
        try:
            b = KernelTimer(cp, w, 2048, n, 256, merge=image)
            r["cluster"] = b.sim.merge_cluster
            if image == "merge_wide":  # clusters of 4 the GPU holds at once
                fit[name] = r["fit"] = b.sim.merge_fit
            for R in a.rows:
                r[f"r{R}"] = (round(time_merge(b, R, 8192, False, iters=a.iters), 2), round(b.last_kernel_us, 2))
                print(name, R, r[f"r{R}"], flush=True)
            if not a.no_rescue and "#" not in name:
                r["r1resc"] = (round(time_merge(b, 1, 8192, True, iters=6, warm=2), 2), round(b.last_kernel_us, 2))
                print(name, "rescue R=1", r["r1resc"], flush=True)
            del b
        except Exception as e:  # noqa: BLE001 - keep timing the others
            r["error"] = f"{type(e).__name__}: {e}"[:300]
            print(name, "ERROR", r["error"], flush=True)
        res[name] = r
    os.environ[MT] = ""
    # the launcher with one rank per GPU: merge_wide where layout.merge_uses_wide(R, its fit)
    for line in launcher_rows(res, fit, a.rows):
        print(line)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    cols = [f"r{R}" for R in a.rows] + ["r1resc"]
    print("\n== merge alone, K=2048 L=8192 (events us [CUPTI]); r1resc = forced rescue of rank 0, R = 1")
    print(f"{'variant':32s} {'C':>2s} " + " ".join(f"{c:>15s}" for c in cols))
    for nm, r in res.items():
        cells = [f"{r[c][0]:6.2f} [{r[c][1]:6.2f}]" if c in r else f"{'-':>15s}" for c in cols]
        print(f"{nm:32s} {r.get('cluster', '-')!s:>2s} " + " ".join(cells) + (f"  {r['error']}" if "error" in r else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
