"""A user's jitted DCP decode step with the pure-XLA merge inside shard_map.

    python examples/decode_loop.py                                            # one process
    python -m jax_dsa_exchange.launch -n 2 -- python examples/decode_loop.py  # a process per rank

The KV cache of every sequence is split over W ranks (token t on rank t % W, at
local index t // W).  Each layer, every rank scores its own tokens (the DSA
indexer), the merge picks the global top-K, and every rank attends to the KV
rows it owns among them.

Run directly, W = 4 CPU devices of one process stand in for the W GPUs.  Started by
the launcher (or srun / mpirun), the script joins the job (``distributed.initialize``)
and W is the number of processes, one rank each (gloo carries the collectives on CPU);
the decode step is the same code either way, on the mesh ``distributed.dcp_mesh``
builds.  Every process checks the ranks it holds against the NumPy oracle.
"""

import os

from jax_dsa_exchange import distributed

if not distributed.launched():
    # 4 CPU devices for a one-process run; must be set before jax creates its CPU client.
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
RANK, NPROC = distributed.initialize()  # (0, 1) when run directly

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from jax_dsa_exchange import reference  # noqa: E402
from jax_dsa_exchange.xla_path import shard_map, xla_topk_merge  # noqa: E402

W = NPROC if NPROC > 1 else 4  # ranks: one per process, or 4 devices of this process
LAYERS, R, L, D = 3, 8, 1024, 32  # layers, query rows, local tokens per rank, head dim
K, B = 256, 16  # top-K, KV page size
PAGES = L // B

mesh = distributed.dcp_mesh("dcp", W)


def rank_decode_step(q, idx_keys, kv, row_ends, req_id, block_table):
    """One rank's view (shard_map strips the leading rank axis to size 1).

    q: [LAYERS, R, D] queries (same on every rank); idx_keys: [1, LAYERS, L, D]
    this rank's indexer keys; kv: [1, LAYERS, slots, D] its paged KV cache;
    row_ends [1, R]; req_id [1, R]; block_table [1, num_req, PAGES].
    """
    idx_keys, kv, row_ends, req_id, block_table = (x[0] for x in (idx_keys, kv, row_ends, req_id, block_table))

    def layer(h, xs):
        q_l, keys_l, kv_l = xs
        # [R, L] float32 indexer scores of this rank's tokens, merged as they are (rounding
        # them to bfloat16 first would be one more pass and would rank collapsed scores by position)
        logits = (q_l + h) @ keys_l.T
        sel = xla_topk_merge(logits, row_ends, req_id, block_table,
                             axis_name="dcp", topk=K, block_size=B, with_ids=True)
        # Sparse attention over the selected tokens: this rank's partial sums,
        # then a psum over the ranks (softmax left out to keep it short).
        rows = jnp.where((sel.kv_rows >= 0)[..., None], kv_l[jnp.maximum(sel.kv_rows, 0)], 0.0)
        h = lax.psum(rows.sum(1), "dcp") / K
        return h, (logits, sel.kv_rows, sel.counts, sel.ids)

    h, outs = lax.scan(layer, jnp.zeros((R, D), jnp.float32), (q, idx_keys, kv))
    return h, *(o[None] for o in outs)  # put the rank axis back: [1, LAYERS, ...]


# Every per-rank array carries a leading rank axis [W, ...] sharded over "dcp".
decode_step = jax.jit(shard_map(
    rank_decode_step, mesh=mesh,
    in_specs=(P(), P("dcp"), P("dcp"), P("dcp"), P("dcp"), P("dcp")),
    out_specs=(P(), P("dcp"), P("dcp"), P("dcp"), P("dcp"))))

if __name__ == "__main__":
    # Every process generates all W ranks' data from one seed and hands jax the rows of
    # the ranks it holds (distributed.shard_ranks), as a job would load its own shard.
    rng = np.random.default_rng(0)
    num_req = R
    seq_len = rng.integers(K // 2, W * L, R)  # tokens of each row's sequence
    row_ends = np.stack([(seq_len - r + W - 1) // W for r in range(W)]).clip(0, L).astype(np.int32)
    req_id = np.tile(np.arange(R, dtype=np.int32), (W, 1))
    block_table = np.stack([rng.permutation(num_req * PAGES).reshape(num_req, PAGES)
                            for _ in range(W)]).astype(np.int32)
    q = rng.standard_normal((LAYERS, R, D)).astype(np.float32)
    idx_keys = rng.standard_normal((W, LAYERS, L, D)).astype(np.float32)
    kv = rng.standard_normal((W, LAYERS, num_req * PAGES * B, D)).astype(np.float32)

    put = lambda x: distributed.shard_ranks(mesh, "dcp", list(x))  # noqa: E731
    g_q = jax.make_array_from_callback(q.shape, NamedSharding(mesh, P()), lambda idx: q[idx])
    h, logits, kv_rows, counts, ids = decode_step(g_q, put(idx_keys), put(kv), put(row_ends), put(req_id),
                                                  put(block_table))
    where = f"{NPROC} processes" if NPROC > 1 else f"{W} devices of one process"
    print(f"W={W} ranks ({where}); hidden state after {LAYERS} layers: {h.shape}", flush=True)

    # Check every layer of the ranks this process holds against the NumPy oracle.  The
    # oracle needs every rank's scores (they came out of the step): gathered to every
    # process; the outputs checked are this process's own.
    logits = np.asarray(multihost_utils.process_allgather(logits, tiled=True))  # [W, LAYERS, R, L]
    kv_rows, counts, ids = (distributed.rank_shards(x) for x in (kv_rows, counts, ids))
    for r in sorted(kv_rows):
        for ly in range(LAYERS):
            want = reference.topk_merge([logits[s, ly] for s in range(W)], list(row_ends), list(req_id),
                                        list(block_table), topk=K, block_size=B)[r]
            assert np.array_equal(kv_rows[r][ly], want.kv_rows)
            assert np.array_equal(counts[r][ly], want.counts)
            assert np.array_equal(ids[r][ly], want.ids)
        print(f"rank {r} of {W}: every layer bit-identical to reference.topk_merge "
              f"(tokens selected per row, layer 0: {counts[r][0].tolist()})", flush=True)
