"""One rank of the peer-fault tests (tests/test_op_gpu.py): one rank misbehaves at step 1.

``--mode exit``: rank F exits before step 1 (as if it crashed, no close()).
``--mode skip``: rank F skips the call of step 1, sleeps past the timeout, then goes on.
``--mode rows``: rank F calls step 1 with half the rows (another jitted program), then
goes on with all of them.

What must hold (docs/DESIGN.md §6.7), checked here on every rank:

* every rank other than F: its call of step 1 comes back (after about the timeout)
  and its call of step 2 raises, naming rank F, a row and an epoch;
* rank F (skip, rows): it never gets a wrong answer: its peers withdrew their words when
  they timed out, so its late call times out too and a later call raises, naming a peer;
* on every rank, every row of every call is either bit-identical to the model or empty
  (count 0, kv_rows -1): a failed call voids its rows instead of guessing.

Prints "RANK OK" when all that held; exits non-zero otherwise.
"""

import argparse
import os
import time

from jax_dsa_exchange import distributed

rank, world = distributed.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_dsa_exchange import reference  # noqa: E402
from jax_dsa_exchange.testing import cases  # noqa: E402
from jax_dsa_exchange.exchange import Exchange  # noqa: E402
from jax_dsa_exchange.op import jit, topk_exchange_merge  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--mode", choices=("exit", "skip", "rows"), required=True)
p.add_argument("--faulty-rank", type=int, default=1)
p.add_argument("--timeout-us", type=int, default=500_000)
a = p.parse_args()
K, N, R, L, B, LAYERS, STEPS = 256, 64, 8, 1024, 16, 2, 4
F = a.faulty_rank

ex = Exchange.create(topk=K, local_topk=N, max_rows=R, timeout_us=a.timeout_us)


def make_step(ex):
    """A new function object per exchange: the compiled program holds the exchange id, and
    JAX caches traces by function, so re-jitting the same function would reuse the old id."""
    @jit
    def decode_step(logits, row_ends, req_id, block_table):
        def layer(c, xs):
            o = topk_exchange_merge(ex, xs[0], xs[1], req_id, block_table, block_size=B, with_ids=True)
            return c, (o.kv_rows, o.counts, o.ids)

        return jax.lax.scan(layer, 0, (logits, row_ends))[1]

    return decode_step


decode_step = make_step(ex)


rng = np.random.default_rng(3)  # the same on every rank
problems = []


def call(step, per_layer, rows):
    rq, bt = per_layer[0].req_id[rank][:rows], per_layer[0].block_tables[rank]
    outs = decode_step(jnp.stack([jnp.asarray(c.logits[rank][:rows]) for c in per_layer]),
                       jnp.stack([jnp.asarray(c.row_ends[rank][:rows], jnp.int32) for c in per_layer]),
                       jnp.asarray(rq, jnp.int32), jnp.asarray(bt, jnp.int32))
    outs = [np.asarray(o) for o in outs]
    right = empty = 0
    for i, c in enumerate(per_layer):
        want = reference.protocol_merge(c.logits, c.row_ends, per_layer[0].req_id, per_layer[0].block_tables,
                                        topk=K, local_topk=N, block_size=B)[rank]
        for r in range(rows):
            got = (outs[0][i][r], outs[1][i][r], outs[2][i][r])
            if all(np.array_equal(g, w[r]) for g, w in zip(got, (want.kv_rows, want.counts, want.ids))):
                right += 1
            elif got[1] == 0 and (got[0] == -1).all() and (got[2] == -1).all():
                empty += 1
            else:
                problems.append(f"step {step} layer {i} row {r}: neither right nor empty")
    print(f"step {step}: {right} rows right, {empty} rows empty", flush=True)
    return right, empty


raised = None
for step in range(STEPS):
    per_layer = [cases.random_case(rng, world=world, topk=K, local_topk=N, rows=R, cols=L, block_size=B)
                 for _ in range(LAYERS)]
    if rank == F and step == 1:
        if a.mode == "exit":
            print("EXITING (on purpose)", flush=True)
            os._exit(0)  # no close(), no exit handlers: as if the process died
        if a.mode == "skip":
            print("SKIPPING this call (on purpose)", flush=True)
            time.sleep(4 * a.timeout_us / 1e6)
            continue
    rows = R // 2 if (rank == F and step == 1 and a.mode == "rows") else R
    t0 = time.perf_counter()
    try:
        call(step, per_layer, rows)
    # A RuntimeError (what a user catches): from op.jit's poll of the status copy (CUDA
    # graphs on), or jax.errors.JaxRuntimeError (XlaRuntimeError in jax 0.11), a subclass,
    # from the launcher's status check (graphs off / checked).
    except RuntimeError as e:
        raised = (step, str(e).splitlines()[0])
        print(f"step {step} RAISED after {time.perf_counter() - t0:.2f} s: {raised[1][:300]}", flush=True)
        break
    print(f"step {step}: returned after {time.perf_counter() - t0:.2f} s", flush=True)

if raised is None:
    problems.append("no call raised")
else:
    step, msg = raised
    if rank != F:
        if step != 2 or f"rank {F} did not deliver" not in msg:
            problems.append(f"expected step 2 to raise naming rank {F}")
        if a.mode == "rows" and not any(f"row {r} " in msg for r in range(R // 2, R)):
            problems.append(f"expected a row >= {R // 2} (rank {F} called with {R // 2} rows)")
    elif "did not deliver" not in msg or f"rank {F} did not" in msg:
        problems.append("expected an error naming a peer")
    if "epoch" not in msg or "recreate" not in msg:
        problems.append("the error must name the epoch and say to recreate the exchange")

if a.mode != "exit":
    # Recovery: every rank recreates the exchange (collective), builds a new step and goes
    # on; the first call must already work (close() dropped JAX's failed effect token).
    ex.close()
    ex = Exchange.create(topk=K, local_topk=N, max_rows=R, timeout_us=a.timeout_us)
    decode_step = make_step(ex)
    rng = np.random.default_rng(4)  # the ranks left the loop after different draws
    per_layer = [cases.random_case(rng, world=world, topk=K, local_topk=N, rows=R, cols=L, block_size=B)
                 for _ in range(LAYERS)]
    for attempt in range(2):
        try:
            right, empty = call("after recreate", per_layer, R)
            if right != LAYERS * R:
                problems.append(f"after recreating the exchange: {empty} rows empty")
            break
        except Exception as e:  # noqa: BLE001
            print(f"after recreate, attempt {attempt}: {str(e).splitlines()[0][:160]}", flush=True)
            problems.append("the recreated exchange does not work" if attempt else
                            "the first call after recreating raised")
    ex.check()
    ex.close()
for m in problems:
    print("PROBLEM:", m, flush=True)
print("RANK OK" if not problems else f"RANK FAILED ({len(problems)})", flush=True)
# Leave without jax.distributed's exit handlers: with a dead peer its shutdown barrier would
# wait for it, and a failed call's error is re-raised by JAX's exit-time token wait
# (process exit itself is tested by tests/scripts/shutdown_worker.py).
if a.mode != "exit":
    from jax_dsa_exchange.rendezvous import distributed_client

    distributed_client().wait_at_barrier("fault_worker/end", 60_000)
os._exit(1 if problems else 0)
