#!/bin/bash
# Diagnostic of the second session, kept for the record (README "Where the pieces are"): a W=2 run with a data dependence between
# layers, and a W=1 run with the optimized HLO and thunk sequence dumped to $OUT/dump.tgz
# (that dump showed the merge custom call duplicated by the dynamic-slice fusion).
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=. JAX_DSA_EXCHANGE_CUBIN_DIR=.cubins XLA_PYTHON_CLIENT_PREALLOCATE=false
export JAX_DSA_EXCHANGE_FFI_LIB=$PWD/build/ffi_lib/libdsa_exchange_ffi.so
W="python3 tests/scripts/op_worker.py --topk 256 --local-topk 64 --rows 16 --cols 4096 --layers 4 --steps 2"
echo "== W=2 --chain"; timeout 100 python3 -m jax_dsa_exchange.launch -n 2 --timeout 90 -- $W --chain 2>&1 | grep -E "step|RANK|Error" | head -8
echo "== dump W=1"; mkdir -p /tmp/d; XLA_FLAGS="--xla_dump_to=/tmp/d --xla_dump_hlo_as_text" timeout 100 python3 -m jax_dsa_exchange.launch -n 1 --timeout 90 -- $W 2>&1 | grep -E "step|RANK|Error" | head -4
ls /tmp/d | head -30; tar czf $OUT/dump.tgz -C /tmp d
