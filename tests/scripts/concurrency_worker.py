"""One rank of the concurrency test (tests/test_op_gpu.py::test_concurrency_patterns).

Checks, against the NumPy protocol model, on every rank:
1. two exchanges used alternately by the layers of one jitted program;
2. two jitted programs with different R interleaving calls on one exchange;
3. a layer loop in lax.scan and the same loop unrolled in Python give identical results;
4. two independent calls (unrelated data) in one program on one exchange run in program
   order on every rank (the op's token chain; XLA could otherwise swap them per rank);
5. calls whose outputs are unused still run, once each: in a jit, in a scan and in an
   inner jit whose outputs are all unused (the epochs advance by exactly the call count).
Prints "RANK OK" or the mismatches; exits non-zero on any mismatch.
"""

import dataclasses
import sys

from jax_dsa_exchange import distributed

rank, world = distributed.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_dsa_exchange import reference  # noqa: E402
from jax_dsa_exchange.testing import cases  # noqa: E402
from jax_dsa_exchange.op import jit, topk_exchange_merge  # noqa: E402
from jax_dsa_exchange.exchange import Exchange  # noqa: E402

K, N, L, B = 256, 64, 1024, 16
ex1 = Exchange.create(topk=K, local_topk=N, max_rows=16)
ex2 = Exchange.create(topk=K, local_topk=N, max_rows=16)
rng = np.random.default_rng(5)  # the same on every rank
bad = 0


def case(rows):
    return cases.random_case(rng, world=world, topk=K, local_topk=N, rows=rows, cols=L,
                             block_size=B, distinct_values=int(rng.integers(0, 2)) * 6 or None)


def want(c):
    return reference.protocol_merge(*c.args, topk=K, local_topk=N, block_size=B)[rank]


def compare(tag, got, c):
    global bad
    w = want(c)
    for name in ("kv_rows", "counts", "ids"):
        if not np.array_equal(np.asarray(got[name]), getattr(w, name)):
            bad += 1
            print(f"MISMATCH {tag} {name}", flush=True)


def args(c):
    return (jnp.asarray(c.logits[rank]), jnp.asarray(c.row_ends[rank]), jnp.asarray(c.req_id[rank]),
            jnp.asarray(c.block_tables[rank]))


def merge(ex, a):
    o = topk_exchange_merge(ex, *a, block_size=B, with_ids=True)
    return dict(kv_rows=o.kv_rows, counts=o.counts, ids=o.ids)


merge_jit = jit(lambda a_: merge(ex1, a_))


# 1. Two exchanges alternately, inside one program (4 layers: ex1, ex2, ex1, ex2).
cs = [case(16) for _ in range(4)]
outs = jit(lambda *xs: [merge(ex1 if i % 2 == 0 else ex2, xs[4 * i:4 * i + 4]) for i in range(4)])(
    *[x for c in cs for x in args(c)])
for i, (c, o) in enumerate(zip(cs, outs)):
    compare(f"two-exchanges layer {i}", o, c)

# 2. Two programs with different R interleaving on one exchange.
f8, f16 = jit(lambda *a: merge(ex1, a)), jit(lambda *a: merge(ex1, a))
for i in range(6):
    c = case(8 if i % 2 else 16)
    compare(f"interleaved call {i} (R={c.rows})", (f8 if i % 2 else f16)(*args(c)), c)

# 3. scan vs unrolled: same inputs, same outputs (and both equal to the model).  Every
# layer uses layer 0's request mapping, and the model is told the same.
cs = [case(16) for _ in range(3)]
cs = [dataclasses.replace(c, req_id=cs[0].req_id, block_tables=cs[0].block_tables) for c in cs]
req0, bt0 = args(cs[0])[2:]
stack = lambda k: jnp.stack([args(c)[k] for c in cs])  # noqa: E731


@jit
def scanned(lg, re):
    return jax.lax.scan(lambda s, x: (s, merge(ex2, (x[0], x[1], req0, bt0))), 0, (lg, re))[1]


@jit
def unrolled(lg, re):
    return [merge(ex2, (lg[i], re[i], req0, bt0)) for i in range(3)]


a = scanned(stack(0), stack(1))
b = unrolled(stack(0), stack(1))
for i, c in enumerate(cs):
    sa = {k: np.asarray(v)[i] for k, v in a.items()}
    compare(f"scan layer {i}", sa, c)
    compare(f"unrolled layer {i}", b[i], c)
    if any(not np.array_equal(sa[k], np.asarray(b[i][k])) for k in sa):
        bad += 1
        print(f"MISMATCH scan vs unrolled layer {i}", flush=True)

# 4. Two independent calls in one program, program order.
for i in range(3):
    ca, cb = case(16), case(16)
    oa, ob = jit(lambda a_, b_: (merge(ex1, a_), merge(ex1, b_)))(args(ca), args(cb))
    compare(f"independent calls {i} first", oa, ca)
    compare(f"independent calls {i} second", ob, cb)

# 5. Unused outputs: every call runs, once.
c = case(16)
before = ex1.read_state()["epoch"][:16].copy()
jax.block_until_ready(jit(lambda *x: (merge(ex1, x), jnp.int32(0))[1])(*args(c)))
jax.block_until_ready(jit(lambda *x: (jax.lax.scan(lambda s, _: (s, merge(ex1, x)["counts"]), 0, None,
                                                       length=2), jnp.int32(0))[1])(*args(c)))
jax.block_until_ready(jit(lambda *x: (jax.jit(lambda *y: merge(ex1, y)["counts"])(*x), jnp.int32(1))[1])(*args(c)))  # inner: plain jax.jit (compiler options are top-level only)
delta = ex1.read_state()["epoch"][:16] - before
if not np.all(delta == 4):
    bad += 1
    print(f"MISMATCH unused-output calls advanced the epochs by {sorted(set(delta.tolist()))}, want 4", flush=True)
compare("after unused calls", merge_jit(args(c)), c)

ex1.check()
ex2.check()
ex1.close()
ex2.close()
print("RANK OK" if bad == 0 else f"RANK FAILED ({bad})", flush=True)
sys.exit(1 if bad else 0)
