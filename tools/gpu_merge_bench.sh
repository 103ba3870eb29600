#!/bin/bash
# Merge-kernel run on the GPU machine (from the repo root, prebuilt cubins in .cubins):
# kernel tests, then the merge benchmark (W=8 N=512 with forced rescue, W=16 N=1024),
# the same benchmark on an older build in ./old when present (A/B in one run), one
# Nsight Compute reading of a W=8 R=1 merge, and the SM clock sampled throughout.
#   OUT=dir bash tools/gpu_merge_bench.sh
# ./old (optional, the previous merge for the A/B), made on the CuTe DSL machine:
#   mkdir old && git archive 5745c9c | tar -x -C old && cp benchmarks/bench_kernels.py old/benchmarks/
#   (cd old && PYTHONPATH=. python -m jax_dsa_exchange.build --topk 2048 --local-topk 512 --world 8 --out .cubins
#    && PYTHONPATH=. python -m jax_dsa_exchange.build --topk 2048 --local-topk 1024 --world 16 --out .cubins)
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/merge_out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,utilization.gpu,power.draw --format=csv,noheader -lms 100 \
  > "$OUT/clocks.csv" 2>&1 &
SMI=$!
export PYTHONUNBUFFERED=1 DSA_LONG_RUN_CALLS=${DSA_LONG_RUN_CALLS:-20000}
OUT=$OUT TEST_TIMEOUT=${TEST_TIMEOUT:-120} PYTEST_ARGS="--maxfail=8" BENCH=1 BENCH_TIMEOUT=90 \
  BENCH_ARGS="--merge-only --world 8 --n 512 --rows 1 16 64 256 --cols 8192" bash tools/gpu_kernels_run.sh > "$OUT/run.log" 2>&1
rc=$?
B="timeout 40 python3 benchmarks/bench_kernels.py --merge-only --cols 8192"
export JAX_DSA_EXCHANGE_CUBIN_DIR=.cubins
PYTHONPATH=. $B --world 16 --n 1024 --rows 1 64 256 --no-rescue > "$OUT/bench16.log" 2>&1
if [ -d old ]; then
  (cd old && PYTHONPATH=. $B --world 8 --n 512 --rows 1 64 --no-rescue --no-jax > "$OUT/old8.log" 2>&1
   PYTHONPATH=. $B --world 16 --n 1024 --rows 1 64 --no-rescue --no-jax > "$OUT/old16.log" 2>&1)
fi
if command -v ncu > /dev/null; then
  PYTHONPATH=. timeout 60 ncu --clock-control none -k regex:Merge --launch-skip 31 --launch-count 2 \
    --metrics gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,sm__cycles_elapsed.max,smsp__inst_executed.sum,smsp__average_warp_latency_per_inst_issued.ratio \
    python3 benchmarks/bench_kernels.py --merge-only --world 8 --n 512 --rows 1 --cols 8192 --no-rescue --no-jax --iters 4 \
    > "$OUT/ncu8.log" 2>&1
fi
kill $SMI
grep -E "passed|failed|error" "$OUT/run.log" | tail -3
grep -B2 -A3 "^Error\|assert" "$OUT/pytest.log" | head -30
for f in bench.log bench16.log old8.log old16.log; do echo "== $f"; grep -A8 "^merge alone" "$OUT/$f" | tail -n +2; grep "floor" "$OUT/$f"; done
echo "== ncu"; grep -E "duration|per_second|inst_executed|cycles_elapsed|latency|==PROF==|rror" "$OUT/ncu8.log" | head -14
echo "== SM clock MHz (min/median/max over the run)"
awk -F', ' '{gsub(/ MHz/,"",$2); print $2}' "$OUT/clocks.csv" | sort -n | awk '{a[NR]=$1} END{print a[1], a[int((NR+1)/2)], a[NR], "samples", NR}'
exit $rc
