"""One rank of the long run through the JAX op (tests/test_op_gpu.py::test_long_run_through_the_op).

``--steps`` jitted decode steps of ``--layers`` layers each (lax.scan; 10^5 op calls by
default) on one exchange: R changes every step (several compiled programs interleave on
the exchange), the logits are fresh random data drawn on the device every step (plain
normal, few-value ties, and layers where one rank's scores are shifted up so it
saturates and the row is rescued), row_ends cover short, empty, negative and > L rows.
Every ``--check-every`` steps each rank regenerates every rank's inputs of that step and
compares some layers (a forced-rescue one among them) with the NumPy protocol model, bit
for bit; between checks nothing is copied to the host.  Prints progress, the rescue
count seen and "RANK OK".
"""

import argparse
import sys
import time

from jax_dsa_exchange import distributed

rank, world = distributed.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_dsa_exchange import reference  # noqa: E402
from jax_dsa_exchange.exchange import Exchange  # noqa: E402
from jax_dsa_exchange.op import jit, topk_exchange_merge  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--topk", type=int, default=2048)
p.add_argument("--local-topk", type=int, default=1024)
p.add_argument("--cols", type=int, default=4096)
p.add_argument("--rows", type=int, nargs="+", default=[1, 3, 16, 32])
p.add_argument("--layers", type=int, default=100)
p.add_argument("--steps", type=int, default=1000)
p.add_argument("--check-every", type=int, default=100)
a = p.parse_args()
K, N, L, B, LAYERS = a.topk, a.local_topk, a.cols, 16, a.layers
NREQ, PAGES = 64, -(-a.cols // 16)

ex = Exchange.create(topk=K, local_topk=N, max_rows=max(a.rows))


@jit
def gen(step, q, rows_like):
    """Inputs of rank q at ``step`` (rows = rows_like.shape[0]): any rank can redo them."""
    R = rows_like.shape[0]
    key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(7), step), q)
    k1, k2, k3 = jax.random.split(key, 3)
    x = jax.random.normal(k1, (LAYERS, R, L), jnp.float32)
    layer = jnp.arange(LAYERS)[:, None, None]
    x = jnp.where(layer % 4 == 1, jnp.floor(x * 2), x)  # 13 values: heavy ties
    # layer % 4 == 0: rank (layer // 4) % W scores far above the others -> saturated
    x = jnp.where((layer % 4 == 0) & ((layer // 4) % world == q), x + 16.0, x)
    ends = jax.random.randint(k2, (LAYERS, R), -2, L + 3, jnp.int32)
    ends = jnp.where(jax.random.bernoulli(k3, 0.7, (LAYERS, R)), L, ends)  # most rows full
    return x.astype(jnp.bfloat16), ends


def tables(R, q):
    rng = np.random.default_rng(1000 * R + q)
    req = rng.permutation(NREQ)[:R].astype(np.int32)
    bt = rng.integers(0, 1 << 20, (NREQ, PAGES)).astype(np.int32)
    return req, bt


@jit
def decode_step(logits, ends, req, bt):
    def layer(c, xs):
        o = topk_exchange_merge(ex, xs[0], xs[1], req, bt, block_size=B, with_ids=True,
                                with_saturated=True)
        return c + o.counts.sum(), (o.kv_rows, o.counts, o.ids, o.saturated)

    return jax.lax.scan(layer, jnp.int32(0), (logits, ends))


bad, rescued, checked, t0 = 0, 0, 0, time.perf_counter()
for step in range(a.steps):
    R = a.rows[step % len(a.rows)]
    rows_like = jnp.zeros((R,), jnp.int8)
    logits, ends = gen(step, rank, rows_like)
    req, bt = tables(R, 0)[0], tables(R, rank)[1]
    total, outs = decode_step(logits, ends, jnp.asarray(req), jnp.asarray(bt))
    if (step + 1) % a.check_every == 0 or step == a.steps - 1:
        outs = [np.asarray(o) for o in outs]
        per = [gen(step, q, rows_like) for q in range(world)]
        lg = [np.asarray(x[0]) for x in per]
        en = [np.asarray(x[1]) for x in per]
        bts = [tables(R, q)[1] for q in range(world)]
        for layer in (0, 1, 2, LAYERS - 1):
            want = reference.protocol_merge([x[layer] for x in lg], [x[layer] for x in en],
                                            [req] * world, bts, topk=K, local_topk=N,
                                            block_size=B)[rank]
            got = dict(kv_rows=outs[0][layer], counts=outs[1][layer], ids=outs[2][layer],
                       saturated=outs[3][layer])
            rescued += int(np.count_nonzero(want.saturated))
            checked += 1
            for name, g in got.items():
                if not np.array_equal(g, getattr(want, name)):
                    bad += 1
                    print(f"MISMATCH step {step} layer {layer} {name}", flush=True)
        ex.check()
        print(f"step {step + 1}/{a.steps}: {(step + 1) * LAYERS} calls, {checked} layers checked "
              f"({rescued} rescued rows among them), {time.perf_counter() - t0:.1f} s", flush=True)
ex.check()
ex.close()
print(f"{a.steps * LAYERS} calls in {time.perf_counter() - t0:.1f} s")
print("RANK OK" if bad == 0 and rescued > 0 else f"RANK FAILED ({bad} mismatches, {rescued} rescues)",
      flush=True)
sys.exit(0 if bad == 0 and rescued > 0 else 1)
