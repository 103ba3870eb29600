"""What a K-list made by the producer would cost it and save the rescue (a design bound for
issue #12's long-row rescue; fifteenth session, kernels/NOTES.md).

The rescue's local top-K runs on one merge CTA (W = 8, N = 512: ~8 us at L = 8K, ~175 us at
L = 128K); the merge with ``rnosel=1`` (timing only: no local select) is what the rescue
would cost if the saturated rank's K-list were ready-made.  This prints the other side:
select_push's own time with ``skip=push`` (timing only: the select without the push) at
n = N = 512 and at n = K = 2048 over the producer shapes, so sel(K) - sel(N) bounds what
emitting a second, K-long list in the same passes could add to every producer call.
Needs the cubins of W = 8, K = 2048, N = 512 and N = 2048 built with
JAX_DSA_EXCHANGE_SELECT_TUNE=skip=push (and the default).  Run on the GPU machine:
    PYTHONPATH=. JAX_DSA_EXCHANGE_CUBIN_DIR=.cubins python3 tools/klist_bound.py
"""

import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]
SHAPES = [(1, 8192), (64, 8192), (1, 131072), (16, 131072), (64, 131072)]


def main():
    import cupy as cp

    x = cp.empty(256 << 20, cp.uint8)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.5:  # clocks ramp
        x.fill(1)
        cp.cuda.Device().synchronize()
    del x
    rows = []
    for tune in ("skip=push", ""):
        os.environ["JAX_DSA_EXCHANGE_SELECT_TUNE"] = tune
        from jax_dsa_exchange.kernels.timing import KernelTimer  # (reads the tune per build)

        for n in (512, 2048):
            b = KernelTimer(cp, 8, 2048, n, 64)
            cells = []
            for R, L in SHAPES:
                ev = b.run(R, L, rescue=False, iters=20, merge=False)[0]
                cells.append((ev, b.last_producer_kernel_us))
            del b
            cp.get_default_memory_pool().free_all_blocks()
            rows.append((tune or "default (push)", n, cells))
            print(rows[-1], flush=True)
    print("\nselect_push, W=8 K=2048 (events us [CUPTI]); skip=push: the select alone (timing only)")
    print(f"{'build':16s} {'n':>5s} " + " ".join(f"{f'R={R} L={L // 1024}K':>16s}" for R, L in SHAPES))
    for tune, n, cells in rows:
        print(f"{tune:16s} {n:5d} " + " ".join(f"{e:7.2f} [{k:5.2f}]" for e, k in cells))


if __name__ == "__main__":
    main()
