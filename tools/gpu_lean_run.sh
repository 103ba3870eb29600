#!/bin/bash
# The lean select (kernels/lean.py, select knob lean=1; twenty-fourth session) in ONE call on the
# GPU machine: the GPU kernel + select tests on the lean build (exactness), tools/lean_time.py
# (default vs lean at the issue #11 shapes, policy and forced splits), the select phase profiles
# of both, then memcheck / racecheck of the select tests on the lean build.
#   build here (~5 min):  PY=.venv/bin/python bash tools/gpu_lean_run.sh --build
#   run there:            OUT=dir bash tools/gpu_lean_run.sh   (carry .cubins)
#   LEAN=knobs (at --build and at the run): the lean variant's tune string (default lean=1);
#   EXTRA="tune ..." (at --build): more select variants' W = 8 N = 512 cubins, timed with
#   TIME_VARIANTS="name=tune ..." at the run;
#   NO_TESTS=1 / NO_TIME=1 / NO_PROF=1 / NO_SAN=1 leave out a step; TIME_ARGS: lean_time.py's
set -o pipefail
cd "$(dirname "$0")/.."
LEAN=${LEAN:-lean=1}
if [ "$1" = "--build" ]; then
  PY=${PY:-.venv/bin/python}; PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")
  for t in "" "$LEAN"; do
    JAX_DSA_EXCHANGE_SELECT_TUNE="$t" PY=$PY bash tools/gpu_kernels_run.sh --build > /tmp/lean_build.log 2>&1 \
      || { echo "build [$t] failed: /tmp/lean_build.log"; exit 1; }
  done
  for t in $EXTRA; do  # (other lean variants, timing only in this run: the W = 8 N = 512 cubins)
    JAX_DSA_EXCHANGE_SELECT_TUNE="$t" $PY -m jax_dsa_exchange.build --topk 2048 --local-topk 512 --world 8 \
      --out .cubins >> /tmp/lean_build.log 2>&1 || { echo "build [$t] failed"; exit 1; }
  done
  for t in "prof=1" "prof=1,$LEAN"; do
    JAX_DSA_EXCHANGE_MERGE_TUNE=prof=1 JAX_DSA_EXCHANGE_SELECT_TUNE="$t" $PY -m jax_dsa_exchange.build --topk 2048 \
      --local-topk 512 --world 8 --out .cubins >> /tmp/lean_build.log 2>&1 || { echo "build [$t] failed"; exit 1; }
  done
  echo "cubins: $(ls .cubins | wc -l) folders, $(du -sh .cubins | cut -f1)"
  exit 0
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=. JAX_DSA_EXCHANGE_CUBIN_DIR=${JAX_DSA_EXCHANGE_CUBIN_DIR:-.cubins}
OUT=${OUT:-/tmp/lean_out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
rc=0
if [ -z "$NO_TESTS" ]; then
  echo "== GPU kernel + select tests, select [$LEAN]"
  JAX_DSA_EXCHANGE_SELECT_TUNE=$LEAN timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -x -p no:cacheprovider -rfEs \
    tests/test_select_gpu.py tests/test_kernels_gpu.py > "$OUT/tests.log" 2>&1 || rc=1
  grep -E "^(FAILED|ERROR)|passed|failed|Error" "$OUT/tests.log" | head -12
fi
if [ -z "$NO_TIME" ]; then
  echo "== timing: default vs [$LEAN]"
  timeout ${TIME_TIMEOUT:-300} python3 tools/lean_time.py --variants default= "lean=$LEAN" $TIME_VARIANTS --out "$OUT/time.json" \
    ${TIME_ARGS} > "$OUT/time.log" 2>&1 || rc=1
  sed -n '/^== select_push alone/,$p' "$OUT/time.log"; grep -E "Error|error" "$OUT/time.log" | head -5
fi
if [ -z "$NO_PROF" ]; then
  echo "== phase profiles (select): default, [$LEAN]"
  for t in "" "$LEAN"; do
    timeout 90 python3 tools/phase_profile.py --only select ${t:+--select-tune $t} \
      --shapes ${PROF_SHAPES:-1,8192 256,8192 16,131072,8} >> "$OUT/prof_select.log" 2>&1
  done
  grep -E "^== |^ +[0-9]+ " "$OUT/prof_select.log" | grep -v "CTA [1-7] " | cut -c1-100 | head -90
fi
if [ -z "$NO_SAN" ]; then
  echo "== memcheck / racecheck: the select tests, select [$LEAN]"
  JAX_DSA_EXCHANGE_SELECT_TUNE=$LEAN timeout 150 compute-sanitizer --tool memcheck --print-limit 20 python3 -m pytest \
    -q -p no:cacheprovider -rfE tests/test_select_gpu.py -k "exchange_bit_identical or policy_split" \
    > "$OUT/memcheck.log" 2>&1 || rc=1
  grep -E "ERROR SUMMARY|passed|failed|Invalid" "$OUT/memcheck.log" | tail -3
  JAX_DSA_EXCHANGE_SELECT_TUNE=$LEAN timeout 120 compute-sanitizer --tool racecheck --print-limit 20 python3 -m pytest \
    -q -p no:cacheprovider -rfE tests/test_select_gpu.py -k "exchange_bit_identical and 1 or policy_split" \
    > "$OUT/racecheck.log" 2>&1 || rc=1
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|hazard|passed|failed" "$OUT/racecheck.log" | tail -3
fi
exit $rc
