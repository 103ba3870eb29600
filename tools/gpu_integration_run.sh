#!/bin/bash
# The JAX op on the GPU machine (no CuTe DSL, no network there): cubins prebuilt here in
# .cubins, the FFI library prebuilt here (jax 0.11.2 headers) in build/ffi_lib; both carried.
#   here:  tools/gpu_integration_run.sh --build
#   there: OUT=... bash tools/gpu_integration_run.sh
set -o pipefail
cd "$(dirname "$0")/.."
if [ "$1" = "--build" ]; then
  PY=${PY:-.venv/bin/python}
  for cfg in "2 256 64" "4 512 128" "8 2048 512" "4 2048 1024" "8 2048 256" "8 2048 1024"; do
    set -- $cfg
    $PY -m jax_dsa_exchange.build --world $1 --topk $2 --local-topk $3 --out .cubins || exit 1
  done
  mkdir -p build/ffi_lib && cp "$($PY -c 'import jax_dsa_exchange._ffi as f; print(f.library_path())')" build/ffi_lib/
  exit $?
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=. JAX_DSA_EXCHANGE_CUBIN_DIR=${JAX_DSA_EXCHANGE_CUBIN_DIR:-.cubins}
export JAX_DSA_EXCHANGE_FFI_LIB=$PWD/build/ffi_lib/libdsa_exchange_ffi.so XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/integration_out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import jax, jax_dsa_exchange._ffi as f; print('jax', jax.__version__, 'ffi', f.available(), f.load_error())"
rc=0
for step in ${STEPS:-ops demo}; do
  case $step in
    kernels) timeout 240 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_kernels_gpu.py 2>&1 | tee "$OUT/kernels.log" | tail -15 || rc=1 ;;
    ops) timeout 300 python3 -m pytest -q -p no:cacheprovider -rfE -s tests/test_op_gpu.py 2>&1 | tee "$OUT/ops.log" | grep -E "step|RANK|MISMATCH|passed|failed|Error|error" | tail -40 || rc=1 ;;
    demo) timeout 200 python3 -m jax_dsa_exchange.launch -n 4 --timeout 180 -- python3 -m jax_dsa_exchange.demo --path ffi --world 4 2>&1 | tee "$OUT/demo.log" | tail -25 || rc=1 ;;
    bench) timeout 240 python3 -m jax_dsa_exchange.bench ${BENCH_ARGS} 2>&1 | tee "$OUT/bench.log" | tail -40 || rc=1 ;;
  esac
done
exit $rc
