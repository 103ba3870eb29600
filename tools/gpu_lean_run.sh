#!/bin/bash
# The lean producer image (kernels/lean.py, "select_push_lean"; twenty-fourth session) in ONE
# call on the GPU machine: the GPU kernel + select tests (the launcher's choice of image), the
# select tests again with every launch on select_push, tools/lean_time.py (select_push vs the
# launcher's choice at the issue #11 shapes, policy and forced splits), the select phase
# profiles, memcheck / racecheck of the lean tests, then (OPS=1) the JAX op through the C++
# launcher under MPS and the demo.
#   build here (~6 min):  PY=.venv/bin/python bash tools/gpu_lean_run.sh --build
#                         (and build/ffi_lib for OPS=1: tools/gpu_integration_run.sh --build
#                         with FFI_INCLUDE = a jax 0.11 jaxlib/include)
#   run there:            OUT=dir bash tools/gpu_lean_run.sh   (carry .cubins, build/ffi_lib)
#   EXTRA="tune ..." (at --build): more select variants' W = 8 N = 512 cubins, timed with
#   TIME_VARIANTS="name=tune[@image] ..." at the run;
#   NO_TESTS=1 / NO_TIME=1 / NO_PROF=1 / NO_SAN=1 leave out a step; TIME_ARGS: lean_time.py's
set -o pipefail
cd "$(dirname "$0")/.."
if [ "$1" = "--build" ]; then
  PY=${PY:-.venv/bin/python}; PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")
  PY=$PY bash tools/gpu_kernels_run.sh --build > /tmp/lean_build.log 2>&1 || { echo "build failed: /tmp/lean_build.log"; exit 1; }
  for cfg in "1 2048 2048" "2 256 64" "3 256 64" "4 512 128 --both" "4 2048 1024"; do  # (the op tests')
    set -- $cfg
    $PY -m jax_dsa_exchange.build --world $1 --topk $2 --local-topk $3 $4 --out .cubins >> /tmp/lean_build.log 2>&1 \
      || { echo "build $cfg failed"; exit 1; }
  done
  for t in $EXTRA; do  # (other select variants, timing only in this run: the W = 8 N = 512 cubins)
    JAX_DSA_EXCHANGE_SELECT_TUNE="$t" $PY -m jax_dsa_exchange.build --topk 2048 --local-topk 512 --world 8 \
      --out .cubins >> /tmp/lean_build.log 2>&1 || { echo "build [$t] failed"; exit 1; }
  done
  JAX_DSA_EXCHANGE_MERGE_TUNE=prof=1 JAX_DSA_EXCHANGE_SELECT_TUNE=prof=1 $PY -m jax_dsa_exchange.build --topk 2048 \
    --local-topk 512 --world 8 --out .cubins >> /tmp/lean_build.log 2>&1 || { echo "build [prof=1] failed"; exit 1; }
  bash tools/pack_cubins.sh .cubins > /dev/null  # (PTX and cubins gzipped: the carry is 64 MiB)
  echo "cubins: $(ls .cubins | wc -l) folders, $(du -sh .cubins | cut -f1)"
  exit 0
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=. JAX_DSA_EXCHANGE_CUBIN_DIR=${JAX_DSA_EXCHANGE_CUBIN_DIR:-.cubins}
export JAX_DSA_EXCHANGE_FFI_LIB=$PWD/build/ffi_lib/libdsa_exchange_ffi.so
OUT=${OUT:-/tmp/lean_out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
rc=0
if [ -z "$NO_TESTS" ]; then
  echo "== GPU kernel + select tests (the launcher's producer image)"
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -rfEs \
    tests/test_select_gpu.py tests/test_kernels_gpu.py > "$OUT/tests.log" 2>&1 || rc=1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | head -12
  echo "== GPU select tests, every launch on select_push"
  JAX_DSA_EXCHANGE_TEST_PRODUCER=select_push timeout 200 python3 -m pytest -q -p no:cacheprovider -rfEs \
    tests/test_select_gpu.py -k "not lean_image" > "$OUT/tests_sp.log" 2>&1 || rc=1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests_sp.log" | head -6
fi
if [ -z "$NO_TIME" ]; then
  echo "== timing: select_push on every launch vs the launcher's choice"
  timeout ${TIME_TIMEOUT:-300} python3 tools/lean_time.py --out "$OUT/time.json" \
    ${TIME_VARIANTS:+--variants select_push=@select_push auto=@auto $TIME_VARIANTS} ${TIME_ARGS} > "$OUT/time.log" 2>&1 || rc=1
  sed -n '/^== select_push alone/,$p' "$OUT/time.log"; grep -E "Error|error" "$OUT/time.log" | head -5
fi
if [ -z "$NO_PROF" ]; then
  echo "== phase profiles (select, the launcher's image)"
  timeout 90 python3 tools/phase_profile.py --only select --shapes ${PROF_SHAPES:-1,8192 256,8192 1,131072} \
    >> "$OUT/prof_select.log" 2>&1
  grep -E "^== |^ +[0-9]+ " "$OUT/prof_select.log" | grep -v "CTA [1-7] " | cut -c1-100 | head -60
fi
if [ -z "$NO_SAN" ]; then
  echo "== memcheck / racecheck: the lean image's tests"
  timeout 200 compute-sanitizer --tool memcheck --print-limit 20 python3 -m pytest -q -p no:cacheprovider -rfE \
    tests/test_select_gpu.py -k "lean_image and (random or specials) or exchange_bit_identical" > "$OUT/memcheck.log" 2>&1 || rc=1
  grep -E "ERROR SUMMARY|passed|failed|Invalid" "$OUT/memcheck.log" | tail -3
  timeout 150 compute-sanitizer --tool racecheck --print-limit 20 python3 -m pytest -q -p no:cacheprovider -rfE \
    tests/test_select_gpu.py -k "exchange_bit_identical and (1 or 8) or lean_image and ties" > "$OUT/racecheck.log" 2>&1 || rc=1
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" "$OUT/racecheck.log" | tail -3
fi
if [ -n "$OPS" ]; then
  STEPS=${STEPS:-"mps ops demo nomps"} OUT=$OUT/ops bash tools/gpu_integration_run.sh 2>&1 | tail -25 || rc=1
fi
exit $rc
