"""Diagnostic (twenty-sixth session): how much of the merge's own duration (CUPTI) is a cold
L2 -- its code and the pushed LL records evicted by the bench's 256 MB spacer -- against an L2
left warm (1 MB spacer: the records the peers just wrote, and the code of the last launch).
Merge alone (bench_kernels.time_merge), W = 8, K = 2048; R = 0 is the empty launch."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]


def main():
    import cupy as cp
    from bench_kernels import time_merge

    from jax_dsa_exchange.kernels.timing import KernelTimer

    ns = [int(x) for x in (sys.argv[1:] or ["512"])]
    for n in ns:
        for spacer in (256, 1):
            b = KernelTimer(cp, 8, 2048, n, 256, spacer_mb=spacer)
            for R in (0, 1, 16, 64, 256):
                t = time_merge(b, R, 8192, False, iters=15)
                print(f"N={n} spacer={spacer:3d} MB R={R:3d}: events {t:7.2f} us  kernel {b.last_kernel_us:6.2f} us",
                      flush=True)
            del b


if __name__ == "__main__":
    main()
