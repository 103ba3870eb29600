#!/bin/bash
# The producer experiments the twenty-sixth session built but could not run (no device lent):
#  1. the lean image over non-portable clusters of 16 CTAs (a W = 8 N = 512 build with the select
#     knob lcm=16; the launchers stay <= 8): byte-identity at C = 16 (tools/lean_c16_probe.py),
#     then its CUPTI time at R = 1..16, L = 32K..128K against the default's C = 8 (and at
#     (16, 128K), where select_push runs at C = 6: 256 CTAs of 8K tokens, two per SM);
#  2. C = 2 against C = 1 where R x 2 <= 132 (N = 256 / 512 / 1024): the rule
#     keeps C = 1 at (64, 8K), where N = 1024 measured 7.46 -> 6.91 us at C = 2 (N = 512 equal,
#     N = 256 +0.26); are R = 32 / 48, L = 4K / 16K alike?
#   build here:  PY=.venv/bin/python bash tools/gpu_split_probe.sh --build   (+ the default cubins:
#                tools/gpu_lean_run.sh --build)
#   run there:   OUT=dir bash tools/gpu_split_probe.sh   (carry .cubins)
set -o pipefail
cd "$(dirname "$0")/.."
if [ "$1" = "--build" ]; then
  PY=${PY:-.venv/bin/python}
  JAX_DSA_EXCHANGE_SELECT_TUNE=lcm=16 $PY -m jax_dsa_exchange.build --topk 2048 --local-topk 512 --world 8 \
    --out .cubins > /tmp/split_probe_build.log 2>&1 || { echo "build failed: /tmp/split_probe_build.log"; exit 1; }
  bash tools/pack_cubins.sh .cubins > /dev/null  # (PTX and cubins gzipped: the carry is 64 MiB)
  echo "cubins: $(ls .cubins | wc -l) folders, $(du -sh .cubins | cut -f1)"
  exit 0
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=. JAX_DSA_EXCHANGE_CUBIN_DIR=${JAX_DSA_EXCHANGE_CUBIN_DIR:-.cubins}
OUT=${OUT:-/tmp/split_probe}; mkdir -p "$OUT"
rc=0
echo "== C = 16 (lcm=16): rows byte-identical to the model"
JAX_DSA_EXCHANGE_SELECT_TUNE=lcm=16 timeout 200 python3 tools/lean_c16_probe.py > "$OUT/c16_exact.log" 2>&1 || rc=1
tail -3 "$OUT/c16_exact.log"
echo "== C = 16 timing"
timeout 200 python3 tools/lean_time.py --n 512 --variants lean=@auto lcm16=lcm=16@auto --iters 15 \
  --out "$OUT/c16.json" --shapes 1,131072 1,131072,16 2,131072,8 2,131072,16 4,131072,8 4,131072,16 1,65536 \
  1,65536,16 1,32768 1,32768,16 8,131072,16 16,131072 16,131072,8 16,131072,16 > "$OUT/c16_time.log" 2>&1 || rc=1
sed -n '/^== select_push alone/,$p' "$OUT/c16_time.log"
echo "== C = 2 against the rule's C = 1"
timeout 200 python3 tools/lean_time.py --n 256 512 1024 --variants lean=@auto --iters 15 --out "$OUT/c2.json" \
  --shapes 32,8192 32,8192,1 48,8192 48,8192,2 64,4096 64,4096,2 64,8192 64,8192,2 64,16384 64,16384,2 \
  > "$OUT/c2_time.log" 2>&1 || rc=1
sed -n '/^== select_push alone/,$p' "$OUT/c2_time.log"
exit $rc
