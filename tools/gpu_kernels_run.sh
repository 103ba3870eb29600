#!/bin/bash
# Kernel tests (and optionally the benchmark) on the GPU machine, from the repo
# root, with the prebuilt cubins carried in .cubins (no CuTe DSL there):
#   build here:  tools/gpu_kernels_run.sh --build      (CuTe DSL machine)
#   run there:   OUT=... BENCH=1 bash tools/gpu_kernels_run.sh
set -o pipefail
cd "$(dirname "$0")/.."
if [ "$1" = "--build" ]; then
  PY=${PY:-.venv/bin/python}
  # (--both: the rescue_list kernels too, for the tests that run both kinds)
  $PY -m jax_dsa_exchange.build --topk 256 --local-topk 64 256 --world 1 2 4 8 16 --both --out .cubins &&
  $PY -m jax_dsa_exchange.build --topk 2048 --local-topk 256 512 1024 --world 8 --both --out .cubins &&
  $PY -m jax_dsa_exchange.build --topk 2048 --local-topk 512 1024 --world 16 --both --out .cubins &&
  $PY -m jax_dsa_exchange.build --topk 2048 --local-topk 512 --world 2 --both --out .cubins &&
  $PY -m jax_dsa_exchange.build --topk 4096 --local-topk 2048 --world 16 --both --out .cubins &&
  $PY -m jax_dsa_exchange.build --topk 2048 --local-topk 2048 --world 8 16 --out .cubins
  exit $?
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=. JAX_DSA_EXCHANGE_CUBIN_DIR=${JAX_DSA_EXCHANGE_CUBIN_DIR:-.cubins}
OUT=${OUT:-/tmp/kernels_out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv
rc=0
if [ "${TESTS:-1}" = 1 ]; then
  timeout ${TEST_TIMEOUT:-360} python3 -m pytest -q -p no:cacheprovider -rfE tests/test_kernels_gpu.py \
    ${PYTEST_ARGS} 2>&1 | tee "$OUT/pytest.log" | grep -v "^$" | tail -60
  rc=$?
fi
if [ "${BENCH:-0}" = 1 ]; then
  timeout ${BENCH_TIMEOUT:-240} python3 benchmarks/bench_kernels.py ${BENCH_ARGS} 2>&1 | tee "$OUT/bench.log"
fi
exit $rc
