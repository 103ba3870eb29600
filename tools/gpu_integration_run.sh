#!/bin/bash
# The JAX op on the GPU machine (no CuTe DSL, no network there): cubins prebuilt here in
# .cubins, the FFI library prebuilt here (jax 0.11.2 headers) in build/ffi_lib; both carried.
#   here:  tools/gpu_integration_run.sh --build
#   there: OUT=... STEPS="kernels ops sanitizer mps long bench nomps" bash tools/gpu_integration_run.sh
# Steps run in the order given; "mps" starts an MPS daemon (W processes then share the
# GPU's SMs instead of time-slicing it) and "nomps" stops it.
# Issue #13 (serving): STEPS="serving mps dsf demo nomps e2e noise": the serving-loop benchmark
# (one process, W = 1), the op tests with XLA's dynamic-slice fusion forced on plus the
# concurrency/order test, the demo, then a check that no log holds gRPC shutdown errors.
# No output filter: the runs print no gRPC noise at exit (distributed.shutdown).
set -o pipefail
cd "$(dirname "$0")/.."
if [ "$1" = "--build" ]; then
  PY=${PY:-.venv/bin/python}
  for cfg in "1 2048 2048" "2 256 64" "3 256 64" "4 512 128 --both" "8 2048 512 --both" "4 2048 1024" "8 2048 256" "8 2048 1024"; do
    set -- $cfg
    $PY -m jax_dsa_exchange.build --world $1 --topk $2 --local-topk $3 $4 --out .cubins || exit 1
  done  # (--both: the rescue-list kernels too, for the op tests that use them)
  # The GPU machine's jax (0.11.2) speaks XLA FFI API 0.4: a library built against newer jax
  # headers is refused there (_ffi._compatible).  FFI_INCLUDE = a jax 0.11 jaxlib/include
  # (e.g. of a venv with jax==0.11.2) builds it against those; else the installed one is copied.
  mkdir -p build/ffi_lib
  if [ -n "$FFI_INCLUDE" ]; then
    cmake -S ffi -B build/ffi011 -DJAX_FFI_INCLUDE_DIR="$FFI_INCLUDE" > /dev/null && cmake --build build/ffi011 > /dev/null \
      && cp build/ffi011/libdsa_exchange_ffi.so build/ffi_lib/ || exit 1
  else
    cp "$($PY -c 'import jax_dsa_exchange._ffi as f; print(f.library_path())')" build/ffi_lib/ || exit 1
  fi
  api=$($PY -c 'import ctypes; print(ctypes.CDLL("build/ffi_lib/libdsa_exchange_ffi.so").dsa_ffi_api_version())')
  [ -n "$api" ] || { echo "build/ffi_lib/libdsa_exchange_ffi.so does not load here"; exit 1; }
  echo "build/ffi_lib: XLA FFI API 0.$api"
  [ "$api" -le 4 ] || { echo "built against XLA FFI API 0.$api > 0.4 (jax 0.11.2 on the GPU machine refuses it): set FFI_INCLUDE"; exit 1; }
  exit 0
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=. JAX_DSA_EXCHANGE_CUBIN_DIR=${JAX_DSA_EXCHANGE_CUBIN_DIR:-.cubins}
export JAX_DSA_EXCHANGE_FFI_LIB=$PWD/build/ffi_lib/libdsa_exchange_ffi.so XLA_PYTHON_CLIENT_PREALLOCATE=false
export PATH=$PATH:/usr/local/cuda/bin
OUT=${OUT:-/tmp/integration_out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import jax, jax_dsa_exchange._ffi as f; print('jax', jax.__version__, 'ffi', f.available(), f.load_error())"
rc=0
for step in ${STEPS:-ops demo}; do
  echo "=== $step $(date +%T)"
  case $step in
    kernels) timeout 300 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_kernels_gpu.py tests/test_select_gpu.py 2>&1 | tee "$OUT/kernels.log" | tail -15 || rc=1 ;;
    memcheck_select) timeout ${MEMCHECK_TIMEOUT:-200} compute-sanitizer --tool memcheck --print-limit 20 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_select_gpu.py -k "${MEMCHECK_K:-random or rescue or mixed or exchange_bit_identical_for_every_split and 8}" 2>&1 | tee "$OUT/memcheck_select.log" | grep -E "ERROR SUMMARY|passed|failed|Invalid" | tail -8 || rc=1 ;;
    ops) timeout 420 python3 -m pytest -q -p no:cacheprovider -rfE -s tests/test_op_gpu.py -k "${OPS_K:-not long_run}" 2>&1 | tee "$OUT/ops.log" | grep -E "step|RANK|MISMATCH|PROBLEM|RAISED|passed|failed|Error|error|closed" | tail -60 || rc=1 ;;
    long) JAX_DSA_EXCHANGE_LONG_STEPS=${LONG_STEPS:-1000} timeout 540 python3 -m pytest -q -p no:cacheprovider -rfE -s tests/test_op_gpu.py -k long_run 2>&1 | tee "$OUT/long.log" | grep -E "step|RANK|MISMATCH|calls|passed|failed|rror" | tail -30 || rc=1 ;;
    sanitizer)
      timeout 240 compute-sanitizer --tool memcheck --print-limit 20 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_kernels_gpu.py -k "not long_run" 2>&1 | tee "$OUT/sanitizer_kernels.log" | tail -8 || rc=1
      timeout 200 compute-sanitizer --tool memcheck --target-processes all --print-limit 20 python3 -m jax_dsa_exchange.launch -n 2 --timeout 180 -- python3 tests/scripts/op_worker.py --rows 8 --cols 1024 --layers 2 --steps 2 2>&1 | tee "$OUT/sanitizer_op.log" | grep -E "ERROR SUMMARY|RANK|Invalid|rror" | tail -12 || rc=1 ;;
    demo) timeout ${DEMO_TIMEOUT:-200} python3 -m jax_dsa_exchange.launch -n 4 --timeout 180 -- python3 -m jax_dsa_exchange.demo --path ffi --world 4 ${DEMO_ARGS} 2>&1 | tee "$OUT/demo.log" | tail -25 || rc=1 ;;
    bench) timeout ${BENCH_TIMEOUT:-400} python3 -m jax_dsa_exchange.bench --out "$OUT/bench${BENCH_TAG}" ${BENCH_ARGS} 2>&1 | tee "$OUT/bench${BENCH_TAG}.log" | tail -${BENCH_TAIL:-30} || rc=1 ;;
    serving) timeout ${SERVING_TIMEOUT:-150} python3 -m jax_dsa_exchange.bench --serving --out "$OUT/serving" ${SERVING_ARGS} 2>&1 | tee "$OUT/serving.log" | tail -16 || rc=1 ;;
    dsf) timeout ${DSF_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -rfE -s tests/test_op_gpu.py -k "${DSF_K:-dynamic_slice or concurrency}" 2>&1 | tee "$OUT/dsf.log" | grep -E "HLO|RANK|MISMATCH|PROBLEM|passed|failed|Error|error" | tail -30 || rc=1 ;;
    e2e) timeout ${E2E_TIMEOUT:-90} python3 -m pytest -q -p no:cacheprovider -rfE tests/test_op.py -k stand_in 2>&1 | tee "$OUT/e2e.log" | tail -5 || rc=1 ;;
    noise) n=$(cat "$OUT"/*.log 2>/dev/null | grep -c -E "WatchTasks|GRPC|UNAVAILABLE|Connection refused"); echo "gRPC shutdown noise lines in $OUT/*.log: $n"; [ "$n" = 0 ] || rc=1 ;;
    mps)
      export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps_log
      mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
      nvidia-cuda-mps-control -d && echo "MPS daemon started" ;;
    nomps) echo quit | nvidia-cuda-mps-control; sleep 1; unset CUDA_MPS_PIPE_DIRECTORY ;;
  esac
done
exit $rc
