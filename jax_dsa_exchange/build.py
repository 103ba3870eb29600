"""Build the kernels' cubins + PTX + metadata for configurations (no GPU needed).

    python -m jax_dsa_exchange.build --arch sm_90a --topk K --local-topk N --world W --out DIR

--topk / --local-topk / --world take several values (every valid combination
is built).  --rescue-list builds the kernels of Exchange.create(..., rescue_list=True)
(--both: both kinds).  Point JAX_DSA_EXCHANGE_CUBIN_DIR at DIR where the kernels run.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jax_dsa_exchange.build", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="sm_90a", help="GPU architecture of the cubins (default sm_90a, Hopper)")
    ap.add_argument("--topk", type=int, nargs="+", required=True,
                    help="K: one or more values, each a multiple of 32 in 64..4096")
    ap.add_argument("--local-topk", type=int, nargs="+", required=True,
                    help="N: one or more values, each a multiple of 32 in 32..K (combinations with N > K are skipped)")
    ap.add_argument("--world", type=int, nargs="+", required=True, help="W: one or more rank counts in 1..16")
    ap.add_argument("--out", required=True,
                    help="folder to write into (one subfolder per configuration); point "
                         "JAX_DSA_EXCHANGE_CUBIN_DIR at it")
    kind = ap.add_mutually_exclusive_group()
    kind.add_argument("--rescue-list", action="store_true",
                      help="the producer also makes each row's local top-K for a rescue")
    kind.add_argument("--both", action="store_true", help="the default kernels and --rescue-list's")
    a = ap.parse_args(argv)

    from . import layout
    from .kernels import cache

    if not cache.cutlass_available():
        print("error: the CuTe DSL (pip install nvidia-cutlass-dsl) is not importable", file=sys.stderr)
        return 2
    configs = []
    for w, k, n in itertools.product(a.world, a.topk, a.local_topk):
        try:
            layout.check_config(w, k, n)
        except ValueError as e:
            if len(a.world) * len(a.topk) * len(a.local_topk) == 1:
                print(f"error: {e}", file=sys.stderr)
                return 2
            continue  # e.g. N > K in a cross product
        configs.append((w, k, n))
    t_all = time.perf_counter()
    kinds = (False, True) if a.both else (a.rescue_list,)
    for w, k, n in configs:
        for rl in kinds:
            imgs = cache.compile_images(a.arch, w, k, n, rescue_list=rl)
            d = cache.write_images(imgs, a.out)
            secs = " ".join(f"{name}={s:.1f}s" for name, (_, s) in imgs.items())
            print(f"W={w} K={k} N={n}{' rescue_list' if rl else ''}: {d}  ({secs})", flush=True)
    print(f"{len(configs) * len(kinds)} configuration(s) in {time.perf_counter() - t_all:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
