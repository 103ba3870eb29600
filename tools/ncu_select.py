"""select_push alone, a few launches per shape, for ncu (one process, W ranks simulated):

    ncu --kernel-name regex:SelectPush --launch-skip 2 --launch-count 1 \
        python3 tools/ncu_select.py --shape 64x131072

Normal bf16 scores (as the benchmarks); rank 0 only, no merge.  Prebuilt cubins
(JAX_DSA_EXCHANGE_CUBIN_DIR), no CuTe DSL needed."""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", nargs="+", default=["64x131072"], help="RxL ...")
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--launches", type=int, default=4)
    a = ap.parse_args()
    import cupy as cp

    from jax_dsa_exchange.testing.sim import Sim

    shapes = [tuple(int(x) for x in s.split("x")) for s in a.shape]
    sim = Sim(a.world, a.topk, a.n, max(r for r, _ in shapes))
    for R, L in shapes:
        cp.random.seed(1)
        x = cp.random.standard_normal((R, L), dtype=cp.float32)
        d = dict(logits=(x.view(cp.uint32) >> 16).astype(cp.uint16), row_ends=cp.full((R,), L, cp.int32))
        for _ in range(a.launches):
            sim.launch_rank(0, d, R, L, 64, merge=False)
        cp.cuda.Device().synchronize()
        print(f"R={R} L={L}: {a.launches} launches", flush=True)


if __name__ == "__main__":
    main()
