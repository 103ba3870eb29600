"""Rank 0's merge alone, data already pushed, a few launches per shape, for ncu (one
process, W ranks simulated):

    ncu --kernel-name regex:Merge --launch-skip 8 --launch-count 1 \
        python3 tools/ncu_merge.py --rows 1

Per launch: every rank's select_push, then rank 0's merge alone (grid min(R, 64)), then
the other ranks' merges (grid min(R, 8)), so with W = 8 rank 0's merge is merge launch
number W * i (skip 8 = the second iteration's).  Normal bf16 scores (no rescue), as in
benchmarks/bench_kernels.py --merge-only.  Prebuilt cubins (JAX_DSA_EXCHANGE_CUBIN_DIR)."""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--cols", type=int, default=8192)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--launches", type=int, default=3)
    a = ap.parse_args()
    import cupy as cp

    from jax_dsa_exchange.kernels.timing import KernelTimer

    b = KernelTimer(cp, a.world, a.topk, a.n, a.rows)
    sim, R, L, W = b.sim, a.rows, a.cols, a.world
    d = b.inputs(R, L, 1, False, seed=1)[0]
    for _ in range(a.launches):
        for q in range(W):
            sim.launch_rank(q, d[q], R, L, 64, merge=False)
        cp.cuda.Device().synchronize()
        sim.launch_rank(0, d[0], R, L, 64, producer=False, grid=max(1, min(R, 64)))
        cp.cuda.Device().synchronize()
        for q in range(1, W):
            sim.launch_rank(q, d[q], R, L, 64, producer=False, grid=min(R, 8))
        cp.cuda.Device().synchronize()
    st = sim.status(0)
    assert st[0] == 0, f"status {st}"
    print(f"merge W={W} N={a.n} R={R} L={L}: {a.launches} launches per rank", flush=True)


if __name__ == "__main__":
    main()
