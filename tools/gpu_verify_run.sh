#!/bin/bash
# One GPU call that verifies the default build (seventeenth session): the GPU kernel + select
# tests of both kinds of kernels, the JAX op (STEPS of tools/gpu_integration_run.sh), the full
# kernel grid (benchmarks/bench_kernels.py, N = 256 / 512 / 1024) and the candidates' timing
# (tools/candidates_time.py's default; VERIFY_VARIANTS="names" for more), then memcheck of the select tests.  Each step's log in
# $OUT; summaries on stdout, the grid's table last but one.
#   here:  PY=.venv/bin/python bash tools/gpu_candidates_run.sh --build, then
#          FFI_INCLUDE=<jax 0.11 jaxlib/include> PY=.venv/bin/python bash tools/gpu_integration_run.sh --build
#   there: OUT=dir bash tools/gpu_verify_run.sh  (~7 min; carry .cubins and build/ffi_lib)
set -o pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=. JAX_DSA_EXCHANGE_CUBIN_DIR=${JAX_DSA_EXCHANGE_CUBIN_DIR:-.cubins}
export JAX_DSA_EXCHANGE_FFI_LIB=$PWD/build/ffi_lib/libdsa_exchange_ffi.so PATH=$PATH:/usr/local/cuda/bin
OUT=${OUT:-/tmp/verify_out}; mkdir -p "$OUT"
rc=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for rl in "" 1; do
  echo "== GPU kernel + select tests, rescue list [${rl:-0}]"
  JAX_DSA_EXCHANGE_TEST_RESCUE_LIST=$rl timeout 150 python3 -m pytest -q -p no:cacheprovider -rfEs \
    tests/test_kernels_gpu.py tests/test_select_gpu.py > "$OUT/tests${rl}.log" 2>&1 || rc=1
  tail -2 "$OUT/tests${rl}.log"
done
echo "== the JAX op: ${STEPS:=e2e mps ops demo nomps noise}"
OUT=$OUT/integration STEPS="$STEPS" bash tools/gpu_integration_run.sh > "$OUT/integration.log" 2>&1 || rc=1
grep -E "passed|failed|bit-identical|MISMATCH|noise lines|rror" "$OUT/integration.log" | tail -12
echo "== full kernel grid"
timeout 200 env JAX_DSA_EXCHANGE_CACHE=/tmp/none python3 benchmarks/bench_kernels.py > "$OUT/kernels.log" 2>&1 || rc=1
echo "== candidates' timing"
timeout 150 python3 tools/candidates_time.py --only ${VERIFY_VARIANTS:-default} --out "$OUT/time.json" > "$OUT/time.log" \
  2>&1 || rc=1  # (the default only: the candidates and floors are timed by gpu_candidates_run / gpu_report_run)
grep -A12 "== merge alone" "$OUT/time.log" | grep -v "^$"
echo "== memcheck: the select tests"
timeout ${MEMCHECK_TIMEOUT:-120} compute-sanitizer --tool memcheck --print-limit 20 python3 -m pytest -q -p no:cacheprovider \
  -rfE tests/test_select_gpu.py > "$OUT/memcheck.log" 2>&1 || rc=1
grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -2
grep -A16 "   N    R       L  C" "$OUT/kernels.log" | head -18
exit $rc
