#!/bin/bash
# ncu profiles of the kernels alone on the GPU machine (prebuilt cubins in .cubins):
#   OUT=dir bash tools/gpu_ncu_run.sh
# PROFILES: a list of name:kernel:skip:script-args (defaults below); each writes
# the details page (<name>.txt) and the per-SASS-line source counters (<name>_sass.csv),
# packed into $OUT/ncu.tar.gz (the device tool returns few files); map the CSV to source
# lines with tools/ncu_lines.py and a cubin built with CUTE_DSL_LINEINFO=1.
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=. JAX_DSA_EXCHANGE_CUBIN_DIR=${JAX_DSA_EXCHANGE_CUBIN_DIR:-.cubins}
OUT=${OUT:-/tmp/ncu_out}; mkdir -p "$OUT"; W=$(mktemp -d)
PROFILES=${PROFILES:-"merge_w8_r1:Merge:8:tools/ncu_merge.py --rows 1
merge_w8_r64:Merge:8:tools/ncu_merge.py --rows 64
merge_w16_r64:Merge:16:tools/ncu_merge.py --rows 64 --world 16 --n 1024
select_r1_128k:SelectPush:2:tools/ncu_select.py --shape 1x131072
select_r64_128k:SelectPush:2:tools/ncu_select.py --shape 64x131072"}
while IFS= read -r p; do
  [ -z "$p" ] && continue
  name=${p%%:*}; rest=${p#*:}; kern=${rest%%:*}; rest=${rest#*:}; skip=${rest%%:*}; args=${rest#*:}
  echo "== $name ($kern, skip $skip): $args"
  timeout ${NCU_TIMEOUT:-150} ncu --clock-control none --kernel-name regex:$kern --launch-skip $skip --launch-count 1 \
    --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
    --section SchedulerStats --section SourceCounters --metrics smsp__inst_executed.sum \
    -f -o "$W/$name" python3 $args > "$W/$name.run.log" 2>&1 || tail -5 "$W/$name.run.log"
  ncu -i "$W/$name.ncu-rep" --page details > "$W/$name.txt" 2>&1
  ncu -i "$W/$name.ncu-rep" --page source --csv --print-source sass > "$W/${name}_sass.csv" 2>&1
  grep -E "Duration|Warp Cycles Per Issued|Registers Per|Achieved Occ|Executed Ipc A|inst_executed.sum|Eligible Warps" "$W/$name.txt"
done <<< "$PROFILES"
rm -f "$W"/*.ncu-rep; tar -C "$W" -czf "$OUT/ncu.tar.gz" .
