#!/bin/bash
# The open issues' report from a fresh run in ONE call (issues #11 / #12, item 4: the README
# tables regenerated from one run, the kernels next to jax.lax.top_k and torch.topk measured in
# the same run; where a goal is missed, the measured limit):
#   1. the merge alone, W = 8 N = 512, L = 8K, R = 1 / 16 / 64 / 256, with the forced rescue, the
#      local top-K of the same rows and top-k of 64-bit keys [R, W N] by torch and jax
#      (benchmarks/bench_kernels.py --merge-only: README "the merge alone" table);
#   2. the merge's floor and breakdown on this source tree (tools/candidates_time.py, timing-only
#      builds: floor = nosel=1,noout=1, nosel, noout; the default beside them);
#   3. W = 16 and W = 8, N = 1024: the merge, merge_wide and the launcher's choice by the measured
#      co-resident clusters (tools/clus_time.py);
#   4. the producer's grid N = 256 / 512 / 1024 x R x L with the copy bandwidth, the floors and
#      the baselines (benchmarks/bench_kernels.py --no-rescue: README "kernels alone"); NO_GRID=1
#      leaves it out (tools/gpu_verify_run.sh runs it too); with it the call may pass 600 s: run
#      it alone then (NO_MERGE=1).
#   build here:  PY=.venv/bin/python bash tools/gpu_candidates_run.sh --build  (the default set,
#                the timing-only variants, clus_time's images)
#   run there:   OUT=dir NO_GRID=1 bash tools/gpu_report_run.sh (carry .cubins; ~4 min), and the grid
#                in a call of its own: OUT=dir2 NO_MERGE=1 bash tools/gpu_report_run.sh (~3-4 min)
set -o pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=. JAX_DSA_EXCHANGE_CUBIN_DIR=${JAX_DSA_EXCHANGE_CUBIN_DIR:-.cubins}
OUT=${OUT:-/tmp/report_out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
python3 tools/candidates_time.py --check || exit 3  # (cubins of another source tree: rebuild here)
rc=0
if [ -z "$NO_MERGE" ]; then
echo "== 1. the merge alone, W = 8 N = 512 (forced rescue, local top-K, top-k of 64-bit keys)"
timeout 150 python3 benchmarks/bench_kernels.py --merge-only --world 8 --n 512 --rows 1 16 64 256 --cols 8192 \
  > "$OUT/merge_alone.log" 2>&1 || rc=1
sed -n '/^merge alone, W=/,$p' "$OUT/merge_alone.log"
echo "== 2. the merge's floor and breakdown (timing-only builds)"
timeout 150 python3 tools/candidates_time.py --only default floor nosel noout --out "$OUT/floor.json" \
  > "$OUT/floor.log" 2>&1 || rc=1
sed -n '/^== merge alone/,/^$/p' "$OUT/floor.log"
grep "^empty merge launch" "$OUT/floor.log"
echo "== 3. W = 16 / 8, N = 1024: merge, merge_wide, the launcher's choice"
timeout 200 python3 tools/clus_time.py --only "w16 merge" "w16 merge_wide" "w8n1024 merge" \
  "w8n1024 merge_wide" --rows 1 16 64 256 --no-rescue --iters 15 --out "$OUT/clus.json" \
  > "$OUT/clus.log" 2>&1 || rc=1
grep -E "fit|^== |^w" "$OUT/clus.log" | tail -16
fi
if [ -z "$NO_GRID" ]; then
  echo "== 4. the producer's grid (N = 256 / 512 / 1024, copy bandwidth, floors, baselines)"
  timeout 220 env JAX_DSA_EXCHANGE_CACHE=/tmp/none python3 benchmarks/bench_kernels.py --no-rescue --n 512 1024 256 \
    > "$OUT/kernels.log" 2>&1 || rc=1
  sed -n '/^W=.*copy bw/,$p' "$OUT/kernels.log" | head -42
fi
exit $rc
