"""One rank of the multi-process GPU test of the op (tests/test_op_gpu.py).

Started by ``python -m jax_dsa_exchange.launch -n W -- python tests/scripts/op_worker.py ...``.
Every rank draws the same cases (same seed), runs its own shard through a jitted decode
step (``lax.scan`` over layers, several steps) on the FFI path, and compares its outputs
with the NumPy protocol model, bit for bit, at every call.  Prints one line per step and
"RANK OK" at the end; exits non-zero on any mismatch.
"""

import argparse
import os
import re
import sys
import time

# --dynamic-slice-fusion on|off: this worker sets XLA's flag itself, before JAX starts (the
# op leaves XLA_FLAGS alone); on = the pass that wrapped/duplicated the calls on jax 0.11.2.
if "--dynamic-slice-fusion" in sys.argv:
    _dsf = sys.argv[sys.argv.index("--dynamic-slice-fusion") + 1]
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_gpu_enable_dynamic_slice_fusion={'true' if _dsf == 'on' else 'false'}").strip()

from jax_dsa_exchange import distributed

rank, world = distributed.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_dsa_exchange import layout, reference  # noqa: E402
from jax_dsa_exchange.testing import cases  # noqa: E402
from jax_dsa_exchange.exchange import Exchange  # noqa: E402
from jax_dsa_exchange.op import compiler_options, jit, topk_exchange_merge  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--topk", type=int, default=256)
p.add_argument("--local-topk", type=int, default=64)
p.add_argument("--rows", type=int, default=16)
p.add_argument("--cols", type=int, default=4096)
p.add_argument("--layers", type=int, default=4)
p.add_argument("--steps", type=int, default=3)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--timeout-us", type=int, default=5_000_000)
p.add_argument("--rescue-list", action="store_true", help="Exchange.create(rescue_list=True)")
p.add_argument("--interleave", type=int, default=1, help="Exchange.create(interleave=...)")
p.add_argument("--chain", action="store_true",
               help="make each layer's row_ends depend on the previous layer's counts, as in a "
                    "real decode step (the next layer's input depends on this layer's attention)")
p.add_argument("--dynamic-slice-fusion", choices=("on", "off"), default=None,
               help="force XLA's GPU dynamic-slice fusion on/off (XLA_FLAGS, set by this worker) and "
                    "count the custom calls in the optimized HLO of the decode step")
p.add_argument("--no-workaround", action="store_true",
               help="compile with plain jax.jit, without the op's compiler_options() (which turn the "
                    "dynamic-slice fusion off for this executable on the jax versions that need it)")
a = p.parse_args()
K, N, R, L, B = a.topk, a.local_topk, a.rows, a.cols, 16

ex = Exchange.create(topk=K, local_topk=N, max_rows=R, timeout_us=a.timeout_us, rescue_list=a.rescue_list,
                     interleave=a.interleave)
# which merge image the launcher runs for these R rows (the op tests assert it where it matters)
print(f"merge image: {'merge_wide' if layout.merge_uses_wide(R, ex.merge_wide_grid) else 'merge'} "
      f"(wide grid {ex.merge_wide_grid})", flush=True)


@(jax.jit if a.no_workaround else jit)
def decode_step(logits_by_layer, row_ends_by_layer, req_id, block_table):
    def layer(carry, xs):
        logits, row_ends = xs
        if a.chain:  # a data dependence on the previous call that XLA cannot fold away
            row_ends = row_ends + jnp.where(carry < -1, 1, 0).astype(jnp.int32)
        out = topk_exchange_merge(ex, logits, row_ends, req_id, block_table, block_size=B,
                                  with_ids=True, with_saturated=True)
        return out.counts[0], (out.kv_rows, out.counts, out.ids, out.saturated)

    return jax.lax.scan(layer, jnp.int32(0), (logits_by_layer, row_ends_by_layer))[1]


slots = (K - 1) // N
rng = np.random.default_rng(a.seed)  # the same on every rank: every rank knows all data
bad = 0
for step in range(a.steps):
    per_layer = []
    for layer in range(a.layers):
        kind = (step * a.layers + layer) % 3
        if kind == 2 and slots:
            c = cases.saturating_case(rng, world, K, N, 1 + layer % min(world, slots),
                                      rows=R, cols=L, block_size=B, interleave=a.interleave)
        else:
            c = cases.random_case(rng, world=world, topk=K, local_topk=N, rows=R, cols=L,
                                  block_size=B, distinct_values=None if kind == 0 else 7, interleave=a.interleave)
        per_layer.append(c)
    # One request mapping for the whole step, as in a decode step: layer 0's.
    bt = per_layer[0].block_tables
    rq = per_layer[0].req_id
    step_args = (jnp.stack([jnp.asarray(c.logits[rank]) for c in per_layer]),
                 jnp.stack([jnp.asarray(c.row_ends[rank], jnp.int32) for c in per_layer]),
                 jnp.asarray(rq[rank], jnp.int32), jnp.asarray(bt[rank], jnp.int32))
    if step == 0 and a.dynamic_slice_fusion:
        hlo = decode_step.lower(*step_args).compile().as_text()
        n_push = len(re.findall(r'custom_call_target="dsa_select_push"', hlo))
        n_merge = len(re.findall(r'custom_call_target="dsa_merge"', hlo))
        n_dsf = len(re.findall(r"dynamic.slice.fusion|address_computation", hlo))
        good = n_push == 1 and n_merge == 1 and n_dsf == 0
        print(f"HLO {'OK' if good else 'BAD'}: dynamic-slice fusion {a.dynamic_slice_fusion} in XLA_FLAGS, "
              f"{'plain jax.jit' if a.no_workaround else 'op.jit (compiler_options ' + str(compiler_options()) + ')'}, optimized HLO "
              f"of the scan decode step: {n_push} dsa_select_push, {n_merge} dsa_merge, "
              f"{n_dsf} dynamic-slice-fusion mentions", flush=True)
        bad += 0 if good else 1
    t0 = time.perf_counter()
    outs = decode_step(*step_args)
    outs = [np.asarray(o) for o in outs]
    dt = time.perf_counter() - t0
    rescued = 0
    for layer, c in enumerate(per_layer):
        want = reference.protocol_merge(c.logits, c.row_ends, rq, bt, topk=K, local_topk=N,
                                        block_size=B, interleave=a.interleave)[rank]
        got = dict(kv_rows=outs[0][layer], counts=outs[1][layer], ids=outs[2][layer],
                   saturated=outs[3][layer])
        rescued += int(np.count_nonzero(want.saturated))
        for name, g in got.items():
            w = getattr(want, name)
            if not np.array_equal(g, w):
                bad += 1
                rows = np.nonzero((g != w).reshape(len(g), -1).any(axis=1))[0]
                print(f"MISMATCH step {step} layer {layer} ({c.name}) {name}: rows {rows[:8]}",
                      flush=True)
    print(f"step {step}: {a.layers} layers x {R} rows, K={K} N={N} W={world}, "
          f"{dt * 1e3:.1f} ms (incl. transfers), rescued rows {rescued}", flush=True)
ex.check()
ex.close()
print("RANK OK" if bad == 0 else f"RANK FAILED ({bad} mismatches)", flush=True)
sys.exit(1 if bad else 0)
