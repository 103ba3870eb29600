"""Build the kernels' cubins + PTX + metadata for configurations (no GPU needed).

    python -m jax_dsa_exchange.build --arch sm_90a --topk K --local-topk N --world W --out DIR

--topk / --local-topk / --world / --interleave take several values (every valid
combination is built).  --rescue-list builds the kernels of Exchange.create(...,
rescue_list=True) (--both: both kinds).  --arch: sm_90a (H100, H200; tested on hardware),
sm_100a (B200, GB200) or sm_103a (B300, GB300) (built and compile-tested only); kernels of
one target run on that compute capability only.  Point JAX_DSA_EXCHANGE_CUBIN_DIR at DIR
where the kernels run.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

from . import layout


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jax_dsa_exchange.build", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="sm_90a", choices=list(layout.ARCHS),
                    help="GPU target of the cubins: " + "; ".join(f"{a} ({v.parts})" for a, v in layout.ARCHS.items())
                    + " (default sm_90a)")
    ap.add_argument("--topk", type=int, nargs="+", required=True,
                    help="K: one or more values, each a multiple of 32 in 64..4096")
    ap.add_argument("--local-topk", type=int, nargs="+", required=True,
                    help="N: one or more values, each a multiple of 32 in 32..K (combinations with N > K are skipped)")
    ap.add_argument("--world", type=int, nargs="+", required=True, help="W: one or more rank counts in 1..16")
    ap.add_argument("--out", required=True,
                    help="folder to write into (one subfolder per configuration); point "
                         "JAX_DSA_EXCHANGE_CUBIN_DIR at it")
    ap.add_argument("--interleave", type=int, nargs="+", default=[1],
                    help="I: the KV cache's interleave size(s) (Exchange.create(interleave=...); default 1: "
                         "token by token); only the merge depends on it")
    kind = ap.add_mutually_exclusive_group()
    kind.add_argument("--rescue-list", action="store_true",
                      help="the producer also makes each row's local top-K for a rescue")
    kind.add_argument("--both", action="store_true", help="the default kernels and --rescue-list's")
    a = ap.parse_args(argv)

    from .kernels import cache

    if not cache.cutlass_available():
        print("error: the CuTe DSL (pip install nvidia-cutlass-dsl) is not importable", file=sys.stderr)
        return 2
    configs = []
    combos = list(itertools.product(a.world, a.topk, a.local_topk, a.interleave))
    for w, k, n, i in combos:
        try:
            cache.check_build(a.arch, w, k, n, i)
        except ValueError as e:
            if len(combos) == 1:
                print(f"error: {e}", file=sys.stderr)
                return 2
            continue  # e.g. N > K in a cross product
        configs.append((w, k, n, i))
    t_all = time.perf_counter()
    kinds = (False, True) if a.both else (a.rescue_list,)
    for w, k, n, i in configs:
        for rl in kinds:
            imgs = cache.compile_images(a.arch, w, k, n, rescue_list=rl, interleave=i)
            d = cache.write_images(imgs, a.out)
            secs = " ".join(f"{name}={s:.1f}s" for name, (_, s) in imgs.items())
            print(f"{a.arch} W={w} K={k} N={n}{f' I={i}' if i != 1 else ''}{' rescue_list' if rl else ''}: {d}  "
                  f"({secs})", flush=True)
    print(f"{len(configs) * len(kinds)} configuration(s) in {time.perf_counter() - t_all:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
