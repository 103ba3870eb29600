"""Exactness of several select builds (JAX_DSA_EXCHANGE_SELECT_TUNE strings) in ONE process
on the GPU: a subset of tests/test_select_gpu.py per variant, called directly (one CUDA
context, no pytest start per variant):

* test_pushed_rows_are_the_model_rows_for_every_split[random|ties|equal|specials|recent|runs]: every
  forced C = 1..8, rows of 2^17 and 20001 tokens, row ends 0, 1, 7..9, N-1..N+1, 2N+3, slice
  edges, L/3, L-9, L-1, L, > L, < 0; NaN (both signs, payloads), +-0, +-inf; byte-identical
  to reference.pack_local_topk with the right epoch tag in every rank's buffer;
* test_rescue_select_on_long_rows (the merge's n = K select of 2^17-token rows);
* test_exchange_bit_identical_for_every_split at C = 1, 3, 8 (the whole exchange).

    PYTHONPATH=. JAX_DSA_EXCHANGE_CUBIN_DIR=.cubins python3 tools/select_variant_tests.py \
        --out tests.txt relax=relax=1 cache32k=cache=32768

Writes one line per variant to --out as it finishes: ``NAME pass|FAIL SECONDS [first error]``.
Exit status 1 when any variant failed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
TUNE_ENV = "JAX_DSA_EXCHANGE_SELECT_TUNE"


def cases(tsel):
    for kind in ("random", "ties", "equal", "specials", "recent", "runs"):
        yield f"pushed_rows[{kind}]", tsel.test_pushed_rows_are_the_model_rows_for_every_split, (kind,)
    yield "rescue_long_rows", tsel.test_rescue_select_on_long_rows, ()
    for c in (1, 3, 8):
        yield f"exchange[C={c}]", tsel.test_exchange_bit_identical_for_every_split, (c,)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("variants", nargs="+", help="NAME=TUNE ...")
    ap.add_argument("--out", required=True)
    ap.add_argument("--list", action="store_true", help="list the checks only (no GPU)")
    a = ap.parse_args(argv)
    import test_kernels_gpu as tk
    import test_select_gpu as tsel

    if a.list:
        for v in a.variants:
            print(v, [n for n, _, _ in cases(tsel)])
        return 0
    from gpu import gpu_stack_missing

    why = gpu_stack_missing()
    if why is not None:
        print(f"cannot run: {why}")
        return 2
    bad = 0
    for spec in a.variants:
        name, _, tune = spec.partition("=")
        if tune:
            os.environ[TUNE_ENV] = tune
        else:
            os.environ.pop(TUNE_ENV, None)
        tk._SIMS.clear()  # Sims load the kernels of the current tune
        t0 = time.perf_counter()
        status, first = "pass", ""
        for label, fn, args in cases(tsel):
            t1 = time.perf_counter()
            try:
                fn(*args)
                print(f"  {name} {label}: ok ({time.perf_counter() - t1:.1f}s)", flush=True)
            except BaseException as e:  # noqa: BLE001 - pytest.fail raises a BaseException
                if isinstance(e, KeyboardInterrupt):
                    raise
                status = "FAIL"
                msg = " ".join(str(e).split())[:300]
                first = first or f"{label}: {type(e).__name__}: {msg}"
                print(f"  {name} {label}: FAILED {type(e).__name__}: {msg}", flush=True)
                traceback.print_exc(limit=3)
        line = f"{name} {status} {time.perf_counter() - t0:.0f}s {first}".rstrip()
        print(line, flush=True)
        with open(a.out, "a") as f:
            f.write(line + "\n")
        bad += status != "pass"
    tk._SIMS.clear()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
