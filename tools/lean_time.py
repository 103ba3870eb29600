"""Producer variants at the issue #11 grid's shapes, with the launcher's split or a forced one,
in ONE process on the GPU machine (W = 8 simulated, K = 2048; the cubins of every variant
prebuilt: tools/gpu_lean_run.sh --build).  A variant is NAME=TUNE[@IMAGE]: a select tune string
and the producer image the launches take ("auto": the launcher's choice, the lean image where
the slices fit; "select_push": that image on every launch).  Per shape and variant: rank 0's
producer alone,
CUDA-event median and its CUPTI kernel median, the goal of issue #11 (max(6 us, 3 x the floor:
one read of [R, L] bf16 or one write of the LL rows pushed to W ranks, at the copy bandwidth
measured here)), the table last.

  JAX_DSA_EXCHANGE_CUBIN_DIR=.cubins PYTHONPATH=. python3 tools/lean_time.py [--n 512 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
ST = "JAX_DSA_EXCHANGE_SELECT_TUNE"
VARIANTS = [("select_push", "", "select_push"), ("auto", "", "auto")]
# (R, L, C): C None = the launcher's split; a forced C where the policy's slices are longer than
# the lean select takes (16K tokens)
SHAPES = [(1, 8192, None), (16, 8192, None), (64, 8192, None), (256, 8192, None),
          (1, 32768, None), (16, 32768, None), (64, 32768, None), (256, 32768, None), (256, 32768, 2),
          (1, 131072, None), (16, 131072, None), (16, 131072, 8), (64, 131072, None), (64, 131072, 8),
          (256, 131072, None), (256, 131072, 8)]  # fmt: skip


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, nargs="+", default=[512])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--variants", nargs="*", default=None,
                    help="NAME=TUNE[@IMAGE] (default: select_push=@select_push auto=@auto)")
    ap.add_argument("--out", default="/tmp/lean_time.json")
    ap.add_argument("--shapes", nargs="*", default=None,
                    help="R,L[,C] (C: a forced split; default: the issue #11 grid's shapes)")
    a = ap.parse_args(argv)
    shapes = SHAPES
    if a.shapes:
        shapes = [tuple(int(x) for x in s.split(",")) for s in a.shapes]
        shapes = [(s[0], s[1], s[2] if len(s) > 2 else None) for s in shapes]
    variants = VARIANTS
    if a.variants:
        variants = []
        for v in a.variants:
            name, rest = v.split("=", 1)
            tune, _, image = rest.partition("@")
            variants.append((name, tune, image or "auto"))
    import cupy as cp

    from jax_dsa_exchange import layout
    from jax_dsa_exchange.kernels.timing import KernelTimer, copy_bandwidth

    bw = copy_bandwidth(cp)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    res = {}
    for n in a.n:
        timers = {}
        for name, tune, image in variants:
            os.environ[ST] = tune
            try:
                timers[name] = KernelTimer(cp, 8, 2048, n, 256, producer=image)
            except FileNotFoundError:
                print(f"  {name} N={n}: no cubins (not built for this N)", flush=True)
        for R, L, c in shapes:
            floor = max(R * L * 2, 8 * R * layout.ll_row_bytes(n)) / bw * 1e6
            goal = max(6.0, 3 * floor)
            for name, tune, _ in variants:
                if name not in timers:
                    continue
                if c is not None and c > 8 and "lcm=" not in tune:
                    # (a lean image sums at most its lcm CTAs, 8 unless built with lcm=16: forced
                    # wider, its rows would be wrong, and a fault would end this process)
                    continue
                t = timers[name]
                pimg, cc = t.sim.producer_launch(R, L, c)
                img = "lean" if pimg == "select_push_lean" else "sp"
                try:
                    ev = t.run(R, L, rescue=False, iters=a.iters, merge=False, cluster=c)[0]
                    k = t.last_producer_kernel_us
                except Exception as e:  # noqa: BLE001
                    ev, k = float("nan"), float("nan")
                    print(f"  {name} N={n} R={R} L={L}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                res[f"n{n} {name} {R}x{L} C{cc}"] = dict(n=n, variant=name, R=R, L=L, C=cc, forced=c is not None,
                                                          image=img, events=ev, kernel=k, goal=goal)  # fmt: skip
                print(f"N={n} {name:8s} R={R:4d} L={L:7d} C={cc}{'*' if c else ' '} {img:4s} events {ev:7.2f} "
                      f"kernel {k:7.2f} goal {goal:6.2f} ({k / goal:4.2f}x)", flush=True)
        del timers
        cp.get_default_memory_pool().free_all_blocks()
    json.dump(res, open(a.out, "w"), indent=1)
    print("\n== select_push alone, W=8 K=2048: kernel us by CUPTI [events]; C* = forced split")
    names = [v[0] for v in variants]
    print("(image: sp = select_push, lean = select_push_lean)")
    print(f"{'N':>5} {'R':>4} {'L':>7} " + " ".join(f"{nm + ' C image':>27s}" for nm in names) + f" {'goal':>6}")
    for n in a.n:
        for R, L, c in shapes:
            cells, goal = [], 0.0
            for nm in names:
                r = next((v for v in res.values() if v["n"] == n and v["variant"] == nm and v["R"] == R
                          and v["L"] == L and v["forced"] == (c is not None) and (c is None or v["C"] == c)),
                         None)  # fmt: skip
                if r:
                    goal = r["goal"]
                    cells.append(f"{r['kernel']:6.2f} [{r['events']:6.2f}] C{r['C']}{'*' if r['forced'] else ' '} "
                                 f"{r['image']:4s}")
                else:
                    cells.append(f"{'-':>27s}")
            print(f"{n:5d} {R:4d} {L:7d} " + " ".join(f"{x:>27s}" for x in cells) + f" {goal:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
