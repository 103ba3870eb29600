"""One rank of the shutdown tests (tests/test_op_gpu.py::test_shutdown_orders).

Every rank creates two exchanges, runs a few jitted calls on both, then the ranks leave
in the order ``--order`` asks for:

* ``forward`` / ``reverse``: rank q waits q (or W-1-q) x 0.4 s, closes both exchanges
  explicitly and exits;
* ``atexit``: nobody calls close(); the exit handler closes them, ranks exit staggered;
* ``mixed``: rank 0 closes one exchange at once and keeps the other until exit, the others
  close both after a delay.

Checks on every rank: close() returns without error (also the second time), the IPC
mappings of the peers are released (none left open), a closed exchange refuses calls
with a clear error, and the memory that the exchanges took is given back.  Prints
"RANK OK"; the launcher's exit code and stderr tell whether the exits were clean.
"""

import argparse
import sys
import time

from jax_dsa_exchange import distributed

rank, world = distributed.initialize()

import cupy as cp  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_dsa_exchange.exchange import Exchange  # noqa: E402
from jax_dsa_exchange.op import jit, topk_exchange_merge  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--order", choices=("forward", "reverse", "atexit", "mixed"), required=True)
a = p.parse_args()
K, N, R, L, B = 256, 64, 8, 512, 16

# max_rows large enough that the buffers are many MiB: their release shows in memGetInfo.
exs = [Exchange.create(topk=K, local_topk=N, max_rows=4096) for _ in range(2)]
rng = np.random.default_rng(rank)
bt = jnp.asarray(np.arange(R * (L // B), dtype=np.int32).reshape(R, L // B))
req = jnp.arange(R, dtype=jnp.int32)
ends = jnp.full((R,), L, jnp.int32)


@jit
def step(x):
    o1 = topk_exchange_merge(exs[0], x, ends, req, bt, block_size=B)
    o2 = topk_exchange_merge(exs[1], x, ends, req, bt, block_size=B)
    return o1.counts.sum() + o2.counts.sum()


for _ in range(5):
    total = int(step(jnp.asarray(rng.standard_normal((R, L)), jnp.bfloat16)))
    assert 0 < total <= 2 * R * K, total  # this rank's share of the 2 x R x K selected
for ex in exs:
    ex.check()
problems = []


def close(ex):
    t0 = time.perf_counter()
    ex.close()
    ex.close()  # idempotent
    if ex._ipc_opened:
        problems.append(f"exchange {ex.id}: IPC mappings left open: {ex._ipc_opened}")
    try:  # a new trace refuses a closed exchange
        topk_exchange_merge(ex, jnp.zeros((R, L), jnp.bfloat16), ends, req, bt, block_size=B)
        problems.append(f"exchange {ex.id}: a call after close() did not raise")
    except ValueError as e:
        if "closed" not in str(e):
            problems.append(f"exchange {ex.id}: unclear error after close(): {e}")
    return time.perf_counter() - t0


def compiled_call_after_close():
    """The compiled step after both exchanges closed: op.jit's poll refuses ("is closed"),
    or the handler does (graphs off), or a CUDA-graph replay's kernels see the closed status
    and do nothing: never a wait."""
    t0 = time.perf_counter()
    try:
        total = int(step(jnp.zeros((R, L), jnp.bfloat16)))
        if total != 0:
            problems.append(f"a compiled call after close() selected {total} tokens")
    except Exception as e:  # noqa: BLE001
        if "no exchange registered" not in str(e) and "is closed" not in str(e):
            problems.append(f"unclear error from a compiled call after close(): {e}")
    if time.perf_counter() - t0 > 2:
        problems.append("a compiled call after close() waited")


if a.order in ("forward", "reverse"):
    time.sleep(0.4 * (rank if a.order == "forward" else world - 1 - rank))
    held = sum(ex.layout.nbytes for ex in exs)
    free0 = cp.cuda.runtime.memGetInfo()[0]
    dts = [close(ex) for ex in exs]
    freed = cp.cuda.runtime.memGetInfo()[0] - free0  # device-wide: peers may free too
    if freed < 0.75 * held:
        problems.append(f"close() gave back {freed / 2**20:.1f} MiB of the {held / 2**20:.1f} MiB held")
    print(f"closed both exchanges in {max(dts):.2f} s", flush=True)
    compiled_call_after_close()
elif a.order == "mixed":
    if rank == 0:
        close(exs[0])
    time.sleep(0.3 * rank)
    if rank != 0:
        close(exs[0])
        close(exs[1])
else:  # atexit: the exit handler closes them
    time.sleep(0.4 * (world - 1 - rank))
for m in problems:
    print("PROBLEM:", m, flush=True)
print("RANK OK" if not problems else "RANK FAILED", flush=True)
sys.exit(1 if problems else 0)
