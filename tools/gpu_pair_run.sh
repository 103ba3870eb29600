#!/bin/bash
# The decode step's pair on ONE GPU (twenty-second session): the GPU test of the merge under
# PDL behind its producer, then benchmarks/bench_kernels.py --pair (rank 0's producer + merge
# on one stream, PDL and plain, next to each alone).
#   run there:  OUT=dir bash tools/gpu_pair_run.sh   (carry .cubins; the cubins of the default
#   build: PY=.venv/bin/python bash tools/gpu_kernels_run.sh --build)
#   PAIR_N / PAIR_R / PAIR_L: the bench's --n / --rows / --cols; NO_TESTS=1 leaves the test out;
#   PAIR_VARIANTS="bpoll=0 ...": the pair again on merge builds of those tune strings (built here
#   with JAX_DSA_EXCHANGE_MERGE_TUNE=<it> python -m jax_dsa_exchange.build ...)
set -o pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=. JAX_DSA_EXCHANGE_CUBIN_DIR=${JAX_DSA_EXCHANGE_CUBIN_DIR:-.cubins}
OUT=${OUT:-/tmp/pair_out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
rc=0
if [ -z "$NO_TESTS" ]; then
  echo "== GPU test: the merge under PDL behind its producer"
  timeout ${TEST_TIMEOUT:-120} python3 -m pytest -q -p no:cacheprovider -rfEs -x tests/test_kernels_gpu.py \
    -k "merge_under_pdl" > "$OUT/tests_pdl.log" 2>&1 || rc=1
  grep -E "passed|failed|Error|error" "$OUT/tests_pdl.log" | tail -6
fi
echo "== the pair"
timeout ${TIME_TIMEOUT:-400} python3 benchmarks/bench_kernels.py --pair --n ${PAIR_N:-512 1024} \
  --rows ${PAIR_R:-1 16 64 256} --cols ${PAIR_L:-8192 131072} > "$OUT/pair.log" 2>&1 || rc=1
grep -A40 "^the pair on rank 0" "$OUT/pair.log" || tail -20 "$OUT/pair.log"
for v in ${PAIR_VARIANTS:-}; do
  f="$OUT/pair_${v//[=,]/_}.log"
  echo "== the pair, merge $v"
  JAX_DSA_EXCHANGE_MERGE_TUNE=$v timeout ${TIME_TIMEOUT:-400} python3 benchmarks/bench_kernels.py --pair \
    --n ${PAIR_N:-512 1024} --rows ${PAIR_R:-1 16 64 256} --cols ${PAIR_L:-8192 131072} > "$f" 2>&1 || rc=1
  grep -A40 "^the pair on rank 0" "$f" || tail -20 "$f"
done
exit $rc
