"""How much of a kernel's own time (CUPTI) is a cold L2: the producer (select+push) with
everything cold (the benchmark's way: a 256 MB memset before each timed launch), with its
code warm but its logits cold (another rank's producer ran just before on its own inputs),
and with both warm (a 1 MB memset); the merge cold and warm.  W = 8, K = 2048, N = 512.

  JAX_DSA_EXCHANGE_CUBIN_DIR=.cubins PYTHONPATH=. python3 tools/l2_code_probe.py
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]


def main():
    import cupy as cp
    from bench_kernels import time_merge

    from jax_dsa_exchange.kernels.timing import KernelTimer

    W, K, N = 8, 2048, 512
    shapes = [(1, 8192), (64, 8192), (1, 131072), (16, 131072), (64, 131072)]
    cold, warm = KernelTimer(cp, W, K, N, 64), KernelTimer(cp, W, K, N, 64, spacer_mb=1)
    rows = []
    for R, L in shapes:
        out = []
        for b, cw in ((cold, False), (cold, True), (warm, False)):
            b.run(R, L, False, iters=15, warm=3, merge=False, code_warm=cw)
            out.append(b.last_producer_kernel_us)
        rows.append(("select+push", R, L, *out))
        print(rows[-1], flush=True)
    for R, resc in ((1, False), (64, False), (1, True), (64, True)):
        out = []
        for b in (cold, warm):
            time_merge(b, R, 8192, resc, iters=12 if not resc else 6, warm=3 if not resc else 2)
            out.append(b.last_kernel_us)
        rows.append(("merge" + (" forced rescue" if resc else ""), R, 8192, out[0], float("nan"), out[1]))
        print(rows[-1], flush=True)
    print(f"\nW={W} K={K} N={N}; kernel durations (CUPTI, median, us): all cold (256 MB memset before each "
          f"launch, the benchmark's way) / code warm + data cold / all warm (1 MB memset)")
    print(f"{'kernel':>22} {'R':>4} {'L':>7} | {'cold':>7} {'code warm':>9} {'warm':>7} | {'cold - warm':>11}")
    for name, R, L, c, cw, w in rows:
        print(f"{name:>22} {R:>4} {L:>7} | {c:7.2f} {cw:9.2f} {w:7.2f} | {c - w:11.2f}")


if __name__ == "__main__":
    main()
