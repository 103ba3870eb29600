#!/bin/bash
# select_push variants (issue #11): exactness of every exact variant + timing of all of them
# (the default twice per round, see benchmarks/bench_select_variants.py), in one GPU call.
#   build here (CuTe DSL machine):   PY=/work/venv2/bin/python bash tools/gpu_select_variants.sh --build
#   run there (repo root, .cubins carried; python3 + cupy, no CuTe DSL):
#                                    OUT=dir bash tools/gpu_select_variants.sh
# Variants = JAX_DSA_EXCHANGE_SELECT_TUNE strings (kernels/select.py).  EXACT ones are tested
# (a fast subset of tests/test_select_gpu.py: every forced C = 1..8 byte for byte, ties, all
# equal, NaN/+-0/+-inf, short rows and row-end edges, 2^17 rows; the rescue's n = K select;
# the whole exchange at C = 1, 3, 8); skip=* builds are TIMING ONLY (wrong outputs, not tested).
# Everything under `timeout`; the whole run stays under ~4 minutes.
set -o pipefail
cd "$(dirname "$0")/.."
EXACT="relax=relax=1 wt2=wt2=1 w0=w0=1 fast=relax=1,wt2=1,w0=1"
TIMING="skip-hist1=skip=hist1 skip-pass2=skip=pass2 skip-dsmem=skip=dsmem skip-compact=skip=compact
skip-push=skip=push bare=skip=hist1+pass2+dsmem+compact+push"
tune() { echo "${1#*=}"; }
name() { echo "${1%%=*}"; }
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
  # every variant resolves from .cubins (no compile), as the GPU machine will look them up
  JAX_DSA_EXCHANGE_CUBIN_DIR=.cubins JAX_DSA_EXCHANGE_CACHE=/nonexistent PYTHONPATH=. timeout 120 \
    $PY benchmarks/bench_select_variants.py --dry-run --variants default= $EXACT $TIMING | tail -1
  exit $?
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=. JAX_DSA_EXCHANGE_CUBIN_DIR=${JAX_DSA_EXCHANGE_CUBIN_DIR:-.cubins}
PY=${PY:-python3}
OUT=${OUT:-/tmp/select_variants_out}; mkdir -p "$OUT"
timeout 20 nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv
T=tests/test_select_gpu.py
SUBSET="$T::test_pushed_rows_are_the_model_rows_for_every_split $T::test_rescue_select_on_long_rows
$T::test_exchange_bit_identical_for_every_split[1] $T::test_exchange_bit_identical_for_every_split[3]
$T::test_exchange_bit_identical_for_every_split[8]"
: > "$OUT/tests.txt"
rc=0
for v in ${TEST_VARIANTS:-$EXACT}; do
  n=$(name $v); t0=$(date +%s)
  JAX_DSA_EXCHANGE_SELECT_TUNE="$(tune $v)" timeout ${TEST_TIMEOUT:-35} $PY -m pytest -q -x \
    -p no:cacheprovider -rfE $SUBSET > "$OUT/test_$n.log" 2>&1
  r=$?
  if [ $r = 0 ] && tail -1 "$OUT/test_$n.log" | grep -q passed; then s=pass
  elif [ $r = 0 ]; then s=SKIPPED; rc=1  # e.g. no GPU / no CuPy: nothing was checked
  elif [ $r = 124 ]; then s=TIMEOUT; rc=1; else s=FAIL; rc=1; fi
  echo "$n $s $(( $(date +%s) - t0 ))s $(tail -1 "$OUT/test_$n.log")" | tee -a "$OUT/tests.txt"
  [ $s = pass ] || grep -E "^(E |FAILED|ERROR)" "$OUT/test_$n.log" | head -8
done
timeout ${BENCH_TIMEOUT:-80} $PY benchmarks/bench_select_variants.py --tests "$OUT/tests.txt" \
  --json "$OUT/variants.json" --variants default= $EXACT $TIMING 2>&1 | tee "$OUT/bench.log" | \
  grep -v "^round " 
r=$?
[ $r = 0 ] || { echo "bench rc=$r (124 = timeout; rounds so far:)"; grep "^round " "$OUT/bench.log" | tail -12; rc=1; }
exit $rc
