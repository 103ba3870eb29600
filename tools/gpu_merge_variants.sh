#!/bin/bash
# Merge-kernel variants (JAX_DSA_EXCHANGE_MERGE_TUNE, kernels/NOTES.md "Merge variants"):
# breakdown (timing-only variants that leave one stage out) and exact candidates (none now: those
# of 2026-12-01 and of branch merge-fast3 were adopted or removed; tools/merge_variants.py VARIANTS).
#   build here (CuTe DSL):  PY=/work/venv2/bin/python bash tools/gpu_merge_variants.sh --build
#       -> build/merge_variants_cubins: every variant for W=8 K=2048 N=512 and W=16 K=2048
#          N=1024; the exact ones also for the test configs (K=256 N=64/256 W=1..16, W=2 N=512);
#          default also N=K=2048; packed into .cubins/merge_variants.tar.xz (~3 MB; 80 MB loose)
#   run there (GPU, carry .cubins):  OUT=dir bash tools/gpu_merge_variants.sh
#       -> 1. exact variants: the merge GPU test subset (tests/test_kernels_gpu.py functions,
#             tools/merge_variants.py test_list) with each variant's env, a process each   (<= 140 s)
#          2. every variant timed like bench_kernels.py --merge-only (default twice)  (<= 70 s)
#          3. the table (last)
#       (step 0: the archive is unpacked into $CUB, default /tmp/merge_variants_cubins)
# Logs and JSON under $OUT (tests.log, bench.log, tests.json, bench.json, table.txt).
# MV_ONLY="default noout ..." limits steps 1-3 to those variants (tools/merge_variants.py
# VARIANTS names; e.g. the exact ones only, the breakdown being known).
set -o pipefail
cd "$(dirname "$0")/.."
if [ "$1" = "--build" ]; then
  PY=${PY:-.venv/bin/python}
  # loose images in build/merge_variants_cubins (~70 MB: over the 64 MiB carry), only the
  # archive in .cubins
  PYTHONPATH=. $PY tools/merge_variants.py --build --jobs ${JOBS:-2}
  exit $?
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=.
unset JAX_DSA_EXCHANGE_MERGE_TUNE JAX_DSA_EXCHANGE_SELECT_TUNE
OUT=${OUT:-/tmp/merge_variants_out}; mkdir -p "$OUT"
CUB=${CUB:-/tmp/merge_variants_cubins}
timeout 60 python3 tools/merge_variants.py --unpack "$CUB" || exit 3
export JAX_DSA_EXCHANGE_CUBIN_DIR=$CUB:.cubins
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader 2>&1 | head -2
nvidia-smi --query-gpu=timestamp,clocks.sm --format=csv,noheader -lms 200 > "$OUT/clocks.csv" 2>&1 &
SMI=$!
SEL=(); [ -n "$MV_ONLY" ] && SEL=(--variants $MV_ONLY)
rc=0
timeout -k 5 ${TEST_TIMEOUT:-300} python3 tools/merge_variants.py --tests --per-variant-s ${PER_VARIANT_S:-45} \
  "${SEL[@]}" --out-json "$OUT" > "$OUT/tests.log" 2>&1 || rc=$?
echo "tests rc=$rc ($(grep -c ': ok' "$OUT/tests.log") ok, $(grep -c ': FAIL' "$OUT/tests.log") failed)"
# the bench resumes after a crash (a variant that killed its CUDA context is marked, skipped)
END=$((SECONDS + ${BENCH_TIMEOUT:-120}))
for try in 1 2 3; do
  left=$((END - SECONDS)); [ $left -le 5 ] && break
  timeout -k 5 $left python3 tools/merge_variants.py --bench "${SEL[@]}" --out-json "$OUT" >> "$OUT/bench.log" 2>&1
  brc=$?; [ $brc = 0 ] && break
  echo "bench rc=$brc (try $try; partial results kept)"
  [ $brc = 124 ] && break
done
kill $SMI 2>/dev/null
grep -E "FAIL|Error|error" "$OUT/tests.log" | head -8
grep -E "Error|error" "$OUT/bench.log" | head -4
echo "== SM clock MHz (min/median/max)"
awk -F', ' '{gsub(/ MHz/,"",$2); print $2}' "$OUT/clocks.csv" | sort -n | awk '{a[NR]=$1} END{print a[1], a[int((NR+1)/2)], a[NR], "samples", NR}'
timeout 20 python3 tools/merge_variants.py --table "${SEL[@]}" --out-json "$OUT" 2>&1 | tee "$OUT/table.txt"
exit $rc
