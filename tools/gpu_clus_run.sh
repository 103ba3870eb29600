#!/bin/bash
# The clustered merge (nineteenth session, kernels/merge.py Merge.clus) in ONE call on the GPU
# machine: the GPU kernel + select tests (the clustered configurations W = 16 / 8, N = 1024
# among them; W = 16 again with every call on its merge_wide image, twentieth session),
# tools/clus_time.py, then memcheck and racecheck of the clustered tests.
#   build here (~8 min):  PY=.venv/bin/python bash tools/gpu_clus_run.sh --build
#   run there:            OUT=dir bash tools/gpu_clus_run.sh   (carry .cubins, build/ffi_lib)
#   NO_TESTS=1 / NO_VARIANTS=1 / NO_SAN=1 / NO_TIME=1 leave out the tests / the candidates' tests /
#   the sanitizers / the timing
set -o pipefail
cd "$(dirname "$0")/.."
if [ "$1" = "--build" ]; then
  PY=${PY:-.venv/bin/python}; PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")
  PY=$PY bash tools/gpu_kernels_run.sh --build > /tmp/clus_build.log 2>&1 || { echo "build failed: /tmp/clus_build.log"; exit 1; }
  # the one-CTA merge (the twenty-first session's ckp candidates, measured and rejected, were
  # "ckp=4 8 512" "ckp=2,clus=4 8 512": add them here and to VARIANTS below to re-measure)
  for v in "clus=0 16 1024" "clus=0 8 1024"; do
    set -- $v
    JAX_DSA_EXCHANGE_MERGE_TUNE=$1 $PY -m jax_dsa_exchange.build --topk 2048 --local-topk $3 --world $2 \
      --out .cubins >> /tmp/clus_build.log 2>&1 || { echo "build $v failed: /tmp/clus_build.log"; exit 1; }
  done
  echo "cubins: $(ls .cubins | wc -l) folders, $(du -sh .cubins | cut -f1)"
  exit 0
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=. JAX_DSA_EXCHANGE_CUBIN_DIR=${JAX_DSA_EXCHANGE_CUBIN_DIR:-.cubins}
export JAX_DSA_EXCHANGE_FFI_LIB=$PWD/build/ffi_lib/libdsa_exchange_ffi.so
OUT=${OUT:-/tmp/clus_out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
rc=0
if [ -z "$NO_TESTS" ]; then
  echo "== GPU kernel + select tests"
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -rfEs -x ${PYTEST_K:+-k "$PYTEST_K"} \
    tests/test_kernels_gpu.py tests/test_select_gpu.py > "$OUT/tests.log" 2>&1 || rc=1
  grep -E "passed|failed|Error|error" "$OUT/tests.log" | tail -8
  echo "== the kernel tests of the merge_wide configurations again, every call on merge_wide (4 CTAs per row)"
  JAX_DSA_EXCHANGE_TEST_MERGE=merge_wide timeout ${WIDE_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider -rfEs -x \
    tests/test_kernels_gpu.py -k "${WIDE_K:-2048-1024 or 16-1024 or 8-1024 or 16-2048-512 or 16-512}" > "$OUT/tests_wide.log" 2>&1 || rc=1
  grep -E "passed|failed|Error|error" "$OUT/tests_wide.log" | tail -8
fi
if [ -z "$NO_VARIANTS" ]; then
  # the candidates' exactness (cubins of their tune tag, their configuration only)
  T=tests/test_kernels_gpu.py
  N512="$T::test_large_configs[8-2048-512-20000-8] $T::test_rescued_and_plain_rows_in_one_cta[8-2048-512-False]
    $T::test_clustered_selection_in_one_cta[8-2048-512] $T::test_clustered_failed_call_rows_right_or_empty[8-2048-512-last_cta]
    $T::test_ties_straddling_the_boundary_score_large[8-512] $T::test_wide_score_range[8-2048-512]
    $T::test_adversarial_large[8-512] $T::test_rescue_tie_heavy[8-2048-512-False]"
  N1024="$T::test_large_configs[8-2048-1024-5000-4] $T::test_rescued_and_plain_rows_in_one_cta[8-2048-1024-False]
    $T::test_clustered_selection_in_one_cta[8-2048-1024] $T::test_clustered_failed_call_rows_right_or_empty[8-2048-1024-first_cta]
    $T::test_ties_straddling_the_boundary_score_large[8-1024] $T::test_adversarial_large[8-1024]"
  for v in ${VARIANTS:-}; do  # e.g. VARIANTS="ckp=4:N512 ckp=2,clus=4:N512"
    t=${v%%:*}; name=${v##*:}; ids=${!name}
    echo "== variant $t: kernel tests of its configuration"
    JAX_DSA_EXCHANGE_MERGE_TUNE=$t JAX_DSA_EXCHANGE_TEST_MERGE=merge timeout ${VAR_TIMEOUT:-90} python3 -m pytest -q \
      -p no:cacheprovider -rfEs -x $(set -f; echo $ids) > "$OUT/tests_${t//[=,]/_}.log" 2>&1 || rc=1
    grep -E "passed|failed|Error|error" "$OUT/tests_${t//[=,]/_}.log" | tail -4
  done
fi
if [ -z "$NO_TIME" ]; then
  echo "== timing"
  timeout ${TIME_TIMEOUT:-300} python3 tools/clus_time.py --out "$OUT/time.json" > "$OUT/time.log" 2>&1 || rc=1
  tail -14 "$OUT/time.log"
fi
if [ -z "$NO_SAN" ]; then
  echo "== memcheck: the clustered tests"
  timeout ${MEMCHECK_TIMEOUT:-150} compute-sanitizer --tool memcheck --print-limit 20 python3 -m pytest -q \
    -p no:cacheprovider -rfE tests/test_kernels_gpu.py -k "${MEMCHECK_K:-clustered or 16-2048-1024 or 8-2048-1024 or 16-1024 or 8-1024 or wide_merge_image}" \
    > "$OUT/memcheck.log" 2>&1 || rc=1
  grep -E "ERROR SUMMARY|passed|failed|Invalid" "$OUT/memcheck.log" | tail -4
  echo "== racecheck: the clustered one-CTA-selection test"
  timeout ${RACE_TIMEOUT:-90} compute-sanitizer --tool racecheck --print-limit 20 python3 -m pytest -q \
    -p no:cacheprovider -rfE tests/test_kernels_gpu.py -k "clustered_selection_in_one_cta" > "$OUT/racecheck.log" 2>&1 || rc=1
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|hazard|passed|failed" "$OUT/racecheck.log" | tail -4
  echo "== racecheck: the same test on merge_wide (W = 16 and W = 8, N = 1024)"
  JAX_DSA_EXCHANGE_TEST_MERGE=merge_wide timeout ${RACE_TIMEOUT:-90} compute-sanitizer --tool racecheck --print-limit 20 \
    python3 -m pytest -q -p no:cacheprovider -rfE tests/test_kernels_gpu.py -k "clustered_selection_in_one_cta and 2048-1024" \
    > "$OUT/racecheck_wide.log" 2>&1 || rc=1
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|hazard|passed|failed" "$OUT/racecheck_wide.log" | tail -4
fi
exit $rc
