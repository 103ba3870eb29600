"""Diagnostic (twenty-fifth session): the merge alone (bench_kernels.time_merge) at W = 8,
N = 1024 under the bench's grid choice, per merge image and grid, to find why the bench grid's
merge column reads 19 / 59 us at R = 16 / 64 where tools/clus_time.py read 12 / 13."""
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]


def main():
    import cupy as cp
    from bench_kernels import time_merge

    from jax_dsa_exchange.kernels.timing import KernelTimer

    x = cp.empty(256 << 20, cp.uint8)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.5:
        x.fill(1)
        cp.cuda.Device().synchronize()
    del x
    for n in (1024, 512):
        for image in ("auto", "merge", "merge_wide"):
            b = KernelTimer(cp, 8, 2048, n, 256, merge=image)
            s = b.sim
            for R in (1, 16, 64):
                for L in (8192, 32768):
                    name = s.merge_image(R)
                    t = time_merge(b, R, L, False, iters=12)
                    print(f"N={n} merge={image:10s} R={R:3d} L={L:6d}: image {name} cluster "
                          f"{s.images[name].cluster} sim grid {s.merge_grid(R)} -> {t:7.2f} us "
                          f"(kernel {b.last_kernel_us:6.2f})", flush=True)
            del b


if __name__ == "__main__":
    main()
