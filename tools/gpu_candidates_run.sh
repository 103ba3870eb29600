#!/bin/bash
# Exact candidate knobs timed against the default in ONE call on the GPU machine (seventeenth
# session: select b1w=1 adopted; reg, b1w=2, bs, p1 measured and removed; kernels/NOTES.md
# "Seventeenth session").  A new candidate: add it to tools/candidates_time.py VARIANTS and set
# COMBO_M / COMBO_S (environment, at --build and at the run) to it: the GPU tests, memcheck and
# racecheck then run with it (empty: the default); TEST_RESCUE_LIST=1 runs those checks on the
# rescue-list kernels (Exchange.create(rescue_list=True)) instead; PROF_S=knobs (at --build and
# at the run) adds select phase profiles, default against those knobs (PROF_SHAPES="R,L ...": the
# shapes, default "1,8192 1,131072 64,131072").
#   build here (CuTe DSL; ~15 s per folder on 2 cores):  PY=.venv/bin/python bash tools/gpu_candidates_run.sh --build
#       -> .cubins: the default and the combination COMBO_M + COMBO_S for every test configuration;
#          each variant of tools/candidates_time.py for W=8 K=2048 N=512 (its rescue-list kind for
#          "L" variants); the prof=1 builds for the phase profiles (W = 8 N = 512 default and
#          COMBO_M, W = 16 N = 1024 default: its R = 64 profile); carry .cubins and build/ffi_lib
#          (FFI library: tools/gpu_integration_run.sh --build with FFI_INCLUDE, jax 0.11 headers)
#   run there (~4-6 min without the timing, ~6 min the timing alone): OUT=dir NO_TIME=1 bash
#       tools/gpu_candidates_run.sh, then OUT=dir2 TIME_ONLY=1 bash tools/gpu_candidates_run.sh
#       -> 1. the GPU kernel + select tests with the combination (exactness; a failure names
#             the knob to drop: rerun with one knob; BISECT="MT|ST ..." (environment, at --build and
#             at the run): where the combination's tests fail, these merge|select tune pairs'
#             tests run instead, and the call ends there)   2. phase profiles, default vs COMBO_M
#             (NO_PROF=1: none), vs PROF_S (select)   3. tools/candidates_time.py (the table last)
#             4. tools/clus_time.py: the clustered merges at W = 16 / 8 N = 1024 and W = 16
#             N = 512, merge and merge_wide, runs (the default) and runs=0 (pair groups), with
#             merge_wide's co-resident clusters
set -o pipefail
cd "$(dirname "$0")/.."
COMBO_M=${COMBO_M:-}
COMBO_S=${COMBO_S:-}
if [ "$1" = "--build" ]; then
  PY=${PY:-.venv/bin/python}; PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")  # (absolute, the venv link kept)
  full() {  # every test configuration, with merge tune $1 and select tune $2
    JAX_DSA_EXCHANGE_MERGE_TUNE="$1" JAX_DSA_EXCHANGE_SELECT_TUNE="$2" PY=$PY bash tools/gpu_kernels_run.sh --build \
      > /tmp/cand_build_full.log 2>&1 || { echo "build [$1|$2] failed: /tmp/cand_build_full.log"; exit 1; }
  }
  one() {  # $1 merge tune, $2 select tune, then the build's arguments (a cwd of its own)
    local mt="$1" st="$2" d; shift 2; d=$(mktemp -d)
    (cd $d && JAX_DSA_EXCHANGE_MERGE_TUNE="$mt" JAX_DSA_EXCHANGE_SELECT_TUNE="$st" $PY -m jax_dsa_exchange.build "$@" \
       --out "$OLDPWD/.cubins" > $d/log 2>&1) || { echo "build [$mt|$st] $* failed: $d/log"; exit 1; }
  }
  full "" "" && { [ -z "$COMBO_M$COMBO_S" ] || full "$COMBO_M" "$COMBO_S"; } || exit 1
  for b in $BISECT; do full "${b%%|*}" "${b#*|}" || exit 1; done
  tunes=$($PY -c 'import sys; sys.path.insert(0, "tools"); import candidates_time as c
print("\n".join(sorted({mt + "|" + st + "|" + str(int("L" in w)) for _, mt, st, w in c.VARIANTS})))') || exit 1
  while IFS='|' read -r mt st rl; do  # (rl = 1: the rescue-list kind, Exchange.create(rescue_list=True))
    one "$mt" "$st" --topk 2048 --local-topk 512 --world 8 $([ "$rl" = 1 ] && echo --rescue-list) || exit 1
  done <<< "$tunes"
  one "prof=1" "prof=1" --topk 2048 --local-topk 512 --world 8 && one "prof=1" "prof=1" --topk 2048 --local-topk 1024 \
    --world 16 && one "prof=1${COMBO_M:+,$COMBO_M}" "prof=1${COMBO_S:+,$COMBO_S}" --topk 2048 --local-topk 512 --world 8 || exit 1
  if [ -n "$PROF_S" ]; then one "prof=1" "prof=1,$PROF_S" --topk 2048 --local-topk 512 --world 8 || exit 1; fi
  for wn in "16 1024" "8 1024" "16 512"; do  # (tools/clus_time.py's, timed below; the default set has them too)
    set -- $wn; one "" "" --topk 2048 --local-topk $2 --world $1 && one "runs=0" "" --topk 2048 --local-topk $2 --world $1 || exit 1
  done
  bash tools/pack_cubins.sh .cubins > /dev/null  # (PTX and cubins gzipped: the carry is 64 MiB)
  echo "cubins: $(ls .cubins | wc -l) folders, $(du -sh .cubins | cut -f1)"
  exit 0
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=. JAX_DSA_EXCHANGE_CUBIN_DIR=${JAX_DSA_EXCHANGE_CUBIN_DIR:-.cubins}
export JAX_DSA_EXCHANGE_FFI_LIB=$PWD/build/ffi_lib/libdsa_exchange_ffi.so
OUT=${OUT:-/tmp/candidates_out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
python3 tools/candidates_time.py --check || exit 3  # (cubins of another source tree: rebuild here)
rc=0
if [ -z "$TIME_ONLY" ]; then  # (TIME_ONLY=1: the timing alone, after a NO_TIME=1 call)
echo "== GPU tests with merge [$COMBO_M] select [$COMBO_S] rescue list [${TEST_RESCUE_LIST:-0}]"
JAX_DSA_EXCHANGE_TEST_RESCUE_LIST=${TEST_RESCUE_LIST:-} JAX_DSA_EXCHANGE_MERGE_TUNE=$COMBO_M JAX_DSA_EXCHANGE_SELECT_TUNE=$COMBO_S timeout 200 python3 -m pytest -q -p no:cacheprovider \
  -rfEs tests/test_kernels_gpu.py tests/test_select_gpu.py > "$OUT/tests.log" 2>&1 || rc=1
tail -4 "$OUT/tests.log"
if [ $rc != 0 ] && [ -n "$BISECT" ]; then  # (which part of the combination fails: each pair's tests)
  i=0
  for b in $BISECT; do
    i=$((i + 1)); echo "== GPU tests with merge [${b%%|*}] select [${b#*|}]"
    JAX_DSA_EXCHANGE_MERGE_TUNE="${b%%|*}" JAX_DSA_EXCHANGE_SELECT_TUNE="${b#*|}" timeout 200 python3 -m pytest -q \
      -p no:cacheprovider -rfEs tests/test_kernels_gpu.py tests/test_select_gpu.py > "$OUT/tests_bisect$i.log" 2>&1
    tail -3 "$OUT/tests_bisect$i.log"
  done
  exit 1
fi
echo "== memcheck: the rescue tests with merge [$COMBO_M] select [$COMBO_S]"
JAX_DSA_EXCHANGE_TEST_RESCUE_LIST=${TEST_RESCUE_LIST:-} JAX_DSA_EXCHANGE_MERGE_TUNE=$COMBO_M JAX_DSA_EXCHANGE_SELECT_TUNE=$COMBO_S timeout ${MEMCHECK_TIMEOUT:-150} compute-sanitizer --tool memcheck --print-limit 20 python3 -m pytest -q \
  -p no:cacheprovider -rfE tests/test_kernels_gpu.py -k "rescue or large_configs or adversarial" > "$OUT/memcheck.log" 2>&1 || rc=1
grep -E "ERROR SUMMARY|passed|failed|Invalid" "$OUT/memcheck.log" | tail -4
echo "== racecheck (shared memory): the tie-heavy rescue at W = 8, N = 512, merge [$COMBO_M]"
JAX_DSA_EXCHANGE_TEST_RESCUE_LIST=${TEST_RESCUE_LIST:-} JAX_DSA_EXCHANGE_MERGE_TUNE=$COMBO_M JAX_DSA_EXCHANGE_SELECT_TUNE=$COMBO_S timeout ${RACE_TIMEOUT:-90} compute-sanitizer --tool racecheck --print-limit 20 python3 -m pytest -q \
  -p no:cacheprovider -rfE tests/test_kernels_gpu.py -k "rescue_tie_heavy and 8-2048-512" > "$OUT/racecheck.log" 2>&1 || rc=1
grep -E "ERROR SUMMARY|RACECHECK SUMMARY|hazard|passed|failed" "$OUT/racecheck.log" | tail -4
if [ -z "$NO_PROF" ]; then  # (NO_PROF=1: leave the phase profiles out, ~2 min)
  echo "== phase profiles (merge): default, $COMBO_M"
  timeout 90 python3 tools/phase_profile.py --only merge > "$OUT/prof.log" 2>&1
  timeout 90 python3 tools/phase_profile.py --only merge --merge-tune $COMBO_M ${COMBO_S:+--select-tune $COMBO_S} \
    >> "$OUT/prof.log" 2>&1  # (the build's select tune too: prof=1,COMBO_S picks its folder)
  grep -E "^== merge W=(8 K=2048 N=512 R=(1|64)|16) |^ +[0-9]+ " "$OUT/prof.log" | grep -v "r2:\|rescue:" | cut -c1-100 | head -150
fi
if [ -n "$PROF_S" ]; then  # (PROF_S=knobs, built with --build too: select phase profiles, default vs those)
  echo "== phase profiles (select): default, $PROF_S"
  for t in "" "$PROF_S"; do
    timeout 90 python3 tools/phase_profile.py --only select ${t:+--select-tune $t} --shapes ${PROF_SHAPES:-1,8192 1,131072 64,131072} >> "$OUT/prof_select.log" 2>&1
    timeout 60 python3 tools/phase_profile.py --only select ${t:+--select-tune $t} --pattern recent --shapes 1,131072 >> "$OUT/prof_select.log" 2>&1
  done
  grep -E "^== |walk|scan|push" "$OUT/prof_select.log" | grep -v "CTA [1-7] " | cut -c1-110 | head -80
fi
fi
[ -n "$NO_TIME" ] && exit $rc  # (NO_TIME=1: the checks only; the timing in a call of its own)
echo "== timing"
timeout 330 python3 tools/candidates_time.py --out "$OUT/time.json" > "$OUT/time.log" 2>&1 || rc=1
tail -32 "$OUT/time.log"
echo "== the clustered merges (W = 16 / 8 N = 1024, W = 16 N = 512), runs (the default) and runs=0, the launcher's images"
timeout 270 python3 tools/clus_time.py --only "w16 merge" "w16 merge_wide" "w16 runs=0" "w16 wide runs=0" "w8n1024 merge" \
  "w8n1024 merge_wide" "w8n1024 runs=0" "w8n1024 wide runs=0" "w16n512 merge" "w16n512 merge_wide" "w16n512 runs=0" \
  "w16n512 wide runs=0" --rows 1 16 32 64 256 --no-rescue --iters 15 --out "$OUT/clus.json" > "$OUT/clus.log" 2>&1 || rc=1
grep -E "fit|^== |^w" "$OUT/clus.log" | tail -30
exit $rc
