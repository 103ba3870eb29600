#!/bin/bash
# select_push variants (issue #11): timing of every variant (two interleaved rounds,
# benchmarks/bench_select_variants.py), then exactness of every EXACT variant
# (tools/select_variant_tests.py: a subset of tests/test_select_gpu.py in one process: every
# forced C = 1..8 byte for byte against reference.pack_local_topk, ties, all equal,
# NaN/+-0/+-inf, short rows and row-end edges, 2^17 rows; the rescue's n = K select; the whole
# exchange at C = 1, 3, 8), then the table (with the test status) LAST.
#   build here (CuTe DSL machine):   PY=/work/venv2/bin/python bash tools/gpu_select_variants.sh --build
#   run there (repo root, .cubins carried; python3 + cupy, no CuTe DSL):
#                                    OUT=dir bash tools/gpu_select_variants.sh
# Variants are NAME=TUNE (JAX_DSA_EXCHANGE_SELECT_TUNE strings, kernels/select.py); skip=*
# builds are TIMING ONLY (wrong outputs; never tested).  Everything under `timeout`:
# bench <= 90 s, tests <= 130 s (partial results are kept), ~4 minutes in all.
set -o pipefail
cd "$(dirname "$0")/.."
EXACT=${EXACT-"nobulk=bulk=0 norelax=relax=0"}  # the default without one of its two exact speed-ups
TIMING=${TIMING-"skip-hist1=skip=hist1 skip-pass2=skip=pass2 skip-compact=skip=compact
bare=skip=hist1+pass2+dsmem+compact+push floor=skip=select+push"}
tune() { echo "${1#*=}"; }
if [ "$1" = "--build" ]; then
  PY=${PY:-.venv/bin/python}
  for v in default= $EXACT; do  # W=2 for tests/test_select_gpu.py, W=8 for its exchange test + bench
    JAX_DSA_EXCHANGE_SELECT_TUNE="$(tune $v)" timeout 600 $PY -m jax_dsa_exchange.build --topk 2048 \
      --local-topk 512 --world 2 8 --out .cubins | tail -1 || exit 1
  done
  for v in $TIMING; do
    JAX_DSA_EXCHANGE_SELECT_TUNE="$(tune $v)" timeout 600 $PY -m jax_dsa_exchange.build --topk 2048 \
      --local-topk 512 --world 8 --out .cubins | tail -1 || exit 1
  done
  # every variant resolves from .cubins without compiling, as it will on the GPU machine
  JAX_DSA_EXCHANGE_CUBIN_DIR=.cubins JAX_DSA_EXCHANGE_CACHE=/nonexistent PYTHONPATH=. timeout 120 \
    $PY benchmarks/bench_select_variants.py --dry-run --variants default= $EXACT $TIMING | tail -1
  exit $?
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=. JAX_DSA_EXCHANGE_CUBIN_DIR=${JAX_DSA_EXCHANGE_CUBIN_DIR:-.cubins}
export JAX_DSA_EXCHANGE_CACHE=${JAX_DSA_EXCHANGE_CACHE:-/tmp/jdx_no_cache}  # only .cubins
PY=${PY:-python3}
OUT=${OUT:-/tmp/select_variants_out}; mkdir -p "$OUT"
timeout 20 nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv
rc=0
timeout ${BENCH_TIMEOUT:-90} $PY benchmarks/bench_select_variants.py --json "$OUT/variants.json" \
  --variants default= $EXACT $TIMING > "$OUT/bench.log" 2>&1
r=$?
grep -E "^[a-z0-9-]+: \{" "$OUT/bench.log"  # registers / CTAs per SM per variant
[ $r = 0 ] || { echo "bench rc=$r (124 = timeout)"; tail -15 "$OUT/bench.log"; rc=1; }
: > "$OUT/tests.txt"
timeout ${TEST_TIMEOUT:-130} $PY tools/select_variant_tests.py --out "$OUT/tests.txt" \
  ${TEST_VARIANTS:-$EXACT} > "$OUT/tests.log" 2>&1
r=$?
[ $r = 0 ] || { echo "tests rc=$r (124 = timeout; 1 = a variant failed)"; grep -E "FAIL|rror|cannot" "$OUT/tests.log" | head -12; rc=1; }
cat "$OUT/tests.txt"
if [ -s "$OUT/variants.json" ]; then
  timeout 30 $PY benchmarks/bench_select_variants.py --table "$OUT/variants.json" --tests "$OUT/tests.txt"
else
  echo "no timing table (see $OUT/bench.log)"
fi
exit $rc
