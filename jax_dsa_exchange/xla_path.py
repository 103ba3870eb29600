"""Pure-XLA exact top-K merge (docs/DESIGN.md §7 "pure-XLA path"): all_gather + top-k.

Runs on any backend (CPU included) inside ``jax.jit`` and ``shard_map`` over the
DCP mesh axis, needs no 64-bit integers (``jax_enable_x64`` may stay off) and
gives results bit-identical to ``reference.topk_merge`` (docs/DESIGN.md §4).

How it stays exact without 64-bit keys: a score key (``ord16`` of bfloat16 scores,
``ord32`` of float32 ones, as a signed int32 with INT32_MIN for "none") and a
position (17-31 bits) do not fit one int32, so no single ``top_k`` can order by
(score desc, position asc).  Instead every selection is done in two exact steps
that never depend on how ``lax.top_k`` orders equal values:

1. ``T`` = the K-th largest score key (a value, so tie order is irrelevant).
   Everything strictly above ``T`` is selected.
2. The remaining ``need = K - #(key > T)`` slots go to the tokens with
   ``key == T`` and the lowest positions: locally the columns are in position
   order, so a cumsum over the tied mask finds them; in the gathered lists the
   positions of the tied tokens are distinct, so a ``top_k`` over
   ``-position`` (again distinct values) finds the cut.

Protocol: each rank selects its exact local top-K (not top-N: this path has no
rescue round, so it sends K candidates and is always exact), all-gathers the
(score key, global position) lists, and every rank runs the same exact global
selection, so ``ids`` and ``saturated`` are identical on every rank.

Layout convention for the convenience wrapper :func:`xla_topk_merge_sharded`:
every array carries a leading rank axis of size W, sharded over the mesh axis:
``logits`` [W, R, L], ``row_ends`` [W, R], ``req_id`` [W, R], ``block_table``
[W, num_req, max_pages]; outputs ``kv_rows`` [W, R, K], ``counts`` [W, R],
``ids`` [W, R, K], ``saturated`` [W, R].  Index ``q`` of the leading axis is
rank ``q``'s data, i.e. ``np.stack`` of the per-rank lists ``reference``
takes.  All ranks have the same L (shard_map needs equal shapes); shorter ranks
express their length through ``row_ends``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core
from jax.interpreters import ad, batching, mlir
from jax.sharding import PartitionSpec as P

from . import checks, layout
from .output import MergeOutput

# jax >= 0.7 exports shard_map at top level; older releases only have the
# experimental one.  The two spell the replication check differently, which we
# never pass, so both call the same way.
try:
    shard_map = jax.shard_map
except AttributeError:  # pragma: no cover - old jax
    from jax.experimental.shard_map import shard_map


def axis_ranks(axis_name) -> int:
    """Static size of the mesh axis ``axis_name`` of the enclosing shard_map (the world W);
    ValueError outside one."""
    try:
        if hasattr(lax, "axis_size"):
            return int(lax.axis_size(axis_name))
        return int(lax.psum(1, axis_name))  # (older jax) a Python int for a constant operand
    except NameError as e:
        raise ValueError(f"axis_name={axis_name!r} is not a mesh axis here: call the XLA path inside "
                         "shard_map over the DCP mesh axis (or use xla_topk_merge_sharded)") from e


# The XLA path is plain jax.numpy, so JAX would differentiate it (an all-zero gradient:
# the outputs are integers) and batch it (vmap).  The FFI primitive allows neither
# (op.py), and a step must mean the same on both paths, so the inputs pass through this
# identity primitive, whose JVP and batching rules raise the FFI path's errors.  One
# behaviour for vmap: a clear error, since the FFI path cannot batch a call (one call is
# one exchange round over at most max_rows rows) and a vmap that ran on CPU only would
# fail when the same step moves to GPUs.
_guard_p = core.Primitive("dsa_xla_path_guard")
_guard_p.multiple_results = True
_guard_p.def_impl(lambda *xs: xs)
_guard_p.def_abstract_eval(lambda *avals: avals)
mlir.register_lowering(_guard_p, lambda ctx, *xs: xs)


def _guard_no_jvp(primals, tangents):
    raise NotImplementedError(checks.NO_GRAD)


def _guard_no_vmap(args, dims):
    raise NotImplementedError(checks.NO_VMAP)


ad.primitive_jvps[_guard_p] = _guard_no_jvp
batching.primitive_batchers[_guard_p] = _guard_no_vmap


NONE = jnp.iinfo(jnp.int32).min  # the score key of "no candidate" (NaN, past the row's end)


def ord16(logits: jax.Array) -> jax.Array:
    """docs/DESIGN.md §5 order-preserving map of bf16 scores to int32 in [1, 0xFFFF]; NaN -> 0.

    -0 and +0 both map to 0x8000; -inf to 0x007F, +inf to 0xFF80.
    """
    bits = lax.bitcast_convert_type(logits, jnp.uint16).astype(jnp.int32)
    bits = jnp.where(bits == 0x8000, 0, bits)  # -0 == +0
    key = jnp.where(bits & 0x8000, (~bits) & 0xFFFF, bits | 0x8000)
    is_nan = (bits & 0x7FFF) > 0x7F80
    return jnp.where(is_nan, 0, key)


def ord32(logits: jax.Array) -> jax.Array:
    """docs/DESIGN.md §5 order-preserving map of float32 scores to uint32 in [1, 0xFFFFFFFF];
    NaN -> 0 (-0 and +0 both map to 0x80000000)."""
    bits = lax.bitcast_convert_type(logits, jnp.uint32)
    bits = jnp.where(bits == jnp.uint32(0x80000000), jnp.uint32(0), bits)  # -0 == +0
    key = jnp.where(bits & jnp.uint32(0x80000000), ~bits, bits | jnp.uint32(0x80000000))
    is_nan = (bits & jnp.uint32(0x7FFFFFFF)) > jnp.uint32(0x7F800000)
    return jnp.where(is_nan, jnp.uint32(0), key)


def score_key(logits: jax.Array) -> jax.Array:
    """The signed int32 the selections compare: ord16 of bfloat16 scores, ord32 - 2**31 of
    float32 ones (the same order in a signed type), NONE for NaN."""
    if logits.dtype == jnp.float32:
        return lax.bitcast_convert_type(ord32(logits) ^ jnp.uint32(0x80000000), jnp.int32)
    code = ord16(logits)
    return jnp.where(code == 0, NONE, code)


def _select(score: jax.Array, pos: jax.Array | None, k: int) -> jax.Array:
    """Mask of the exact top-k of each row by (score desc, pos asc).

    ``score``: int32 [R, M], NONE = invalid (never selected).  ``pos``: int32
    [R, M] positions, distinct among the valid entries of a row and
    > INT32_MIN; None means "the column index" (positions ascend along the
    row).  Selects min(k, #valid) entries.
    """
    valid = score > NONE
    m = score.shape[-1]
    if m <= k:  # everything valid fits (static shapes)
        return valid
    kth = lax.top_k(score, k)[0][:, k - 1 : k]  # [R, 1], NONE if fewer than k valid
    above = score > kth
    need = k - jnp.sum(above, axis=-1, keepdims=True, dtype=jnp.int32)  # >= 1 when kth > NONE
    tied = (score == kth) & (kth > NONE)
    if pos is None:
        # Positions ascend along the row: the first `need` tied entries.
        return above | (tied & (jnp.cumsum(tied, axis=-1, dtype=jnp.int32) <= need))
    # Lowest positions among the tied: top_k over -pos (distinct values, so
    # its tie order does not matter); non-tied entries rank below all of them.
    neg = jnp.where(tied, -pos, jnp.iinfo(jnp.int32).min)
    cut = jnp.take_along_axis(lax.top_k(neg, k)[0], jnp.maximum(need - 1, 0), axis=-1)
    return above | (tied & (neg >= cut))


def _compact(mask: jax.Array, values: jax.Array, k: int) -> jax.Array:
    """Per row, the values at the masked positions in their order, padded with -1 to k."""
    dest = jnp.where(mask, jnp.cumsum(mask, axis=-1, dtype=jnp.int32) - 1, k)  # k = dropped
    out = jnp.full(mask.shape[:-1] + (k,), -1, jnp.int32)
    rows = jnp.arange(mask.shape[0], dtype=jnp.int32)[:, None]
    return out.at[rows, dest].set(values.astype(jnp.int32), mode="drop")


def xla_topk_merge(
    logits,
    row_ends,
    req_id,
    block_table,
    *,
    axis_name,
    topk: int,
    block_size: int,
    with_ids: bool = False,
    with_saturated: bool = False,
    interleave: int = 1,
) -> MergeOutput:
    """Exact DCP top-K merge for one rank; call inside shard_map over ``axis_name``.

    Per-rank arguments (docs/DESIGN.md §3): ``logits`` bf16 or float32 [R, L] (compared as
    numbers of their dtype), ``row_ends`` int32 [R]
    (clamped to [0, L]), ``req_id`` int32 [R], ``block_table`` int32
    [num_req, max_pages].  Returns :class:`MergeOutput` with ``kv_rows`` [R, K]
    and ``counts`` [R]; ``ids`` [R, K] if ``with_ids``; ``saturated`` [R] (all
    zero: this path never needs a rescue round) if ``with_saturated``.
    ``ids``/``saturated`` are None when not requested.

    Static arguments: ``topk`` (docs/DESIGN.md §2 limits), ``block_size``, the flags,
    ``interleave`` (the KV cache's chunks of I tokens per rank: the global position of local
    index l of rank q is ``layout.global_position(l, q, W, I)``, docs/DESIGN.md §4).
    Arguments are checked as ``topk_exchange_merge`` checks them (``checks.check_call``:
    the same TypeError / ValueError, before any collective).  Like the FFI path, no
    gradient and no vmap (NotImplementedError; wrap the logits in
    ``jax.lax.stop_gradient`` to differentiate the rest of a step).  Works with
    ``jax_enable_x64`` off or on.  A selected token whose block-table lookup is out of
    range (bad ``req_id`` or too few pages) stays selected but gets kv_rows -1 (the rule
    of every path, layout.py).
    """
    world = axis_ranks(axis_name)
    # This path sends K candidates per rank (no rescue round): local_topk = topk.
    checks.check_call(logits, row_ends, req_id, block_table, world=world, topk=topk, local_topk=topk,
                      block_size=block_size, with_ids=with_ids, with_saturated=with_saturated,
                      interleave=interleave)
    logits, row_ends, req_id, block_table = _guard_p.bind(logits, row_ends, req_id, block_table)
    R, L = logits.shape
    me = lax.axis_index(axis_name).astype(jnp.int32)

    # 1. Exact local top-K (fewer if fewer valid), listed in ascending l.
    l_idx = lax.broadcasted_iota(jnp.int32, (R, L), 1)
    ends = jnp.clip(row_ends, 0, L)[:, None]
    score = jnp.where(l_idx < ends, score_key(logits), NONE)
    n = min(topk, L)
    local = _select(score, None, topk)  # columns are l: ties by cumsum
    cand_l = _compact(local, l_idx, n)  # [R, n], -1 = empty
    cand_s = jnp.where(cand_l >= 0, jnp.take_along_axis(score, jnp.maximum(cand_l, 0), axis=-1), NONE)
    # (g < 2**31: layout.check_interleave)
    cand_g = jnp.where(cand_l >= 0, layout.global_position(cand_l, me, world, interleave), -1)

    # 2. Every rank gets every rank's list: [R, W * n], owner-major, each
    # owner's part in ascending l, i.e. already in the order docs/DESIGN.md §3 wants ids.
    all_s = lax.all_gather(cand_s, axis_name, axis=1, tiled=True)
    all_g = lax.all_gather(cand_g, axis_name, axis=1, tiled=True)

    # 3. Same exact global selection on every rank.
    chosen = _select(all_s, all_g, topk)

    # 4. Outputs.  This rank's part of the gathered list is block [me*n, (me+1)*n).
    mine = lax.dynamic_slice_in_dim(chosen, me * n, n, axis=1)
    counts = jnp.sum(mine, axis=-1, dtype=jnp.int32)
    own_l = _compact(mine, cand_l, topk)  # ascending l
    # A selected token whose lookup is out of range stays selected (ids, counts) with
    # kv_rows -1, the same rule as the kernels and the reference (layout.py).
    page = own_l // block_size
    req = req_id[:, None]
    ok = (own_l >= 0) & (page < block_table.shape[1]) & (req >= 0) & (req < block_table.shape[0])
    phys = block_table[jnp.clip(req, 0, block_table.shape[0] - 1),
                                         jnp.clip(page, 0, block_table.shape[1] - 1)]
    kv_rows = jnp.where(ok, phys * block_size + own_l % block_size, -1)

    ids = _compact(chosen, all_g, topk) if with_ids else None
    saturated = jnp.zeros((R,), jnp.int32) if with_saturated else None
    return MergeOutput(kv_rows, counts, ids, saturated)


def xla_topk_merge_sharded(
    mesh,
    axis_name,
    logits,
    row_ends,
    req_id,
    block_table,
    *,
    topk: int,
    block_size: int,
    with_ids: bool = False,
    with_saturated: bool = False,
    interleave: int = 1,
) -> MergeOutput:
    """:func:`xla_topk_merge` over global arrays with a leading rank axis [W, ...].

    ``mesh`` has axis ``axis_name`` of size W (other mesh axes replicate).  See
    the module docstring for the layout.  Jit-able; returns global arrays
    sharded over the rank axis (``ids``/``saturated`` None unless requested).
    """

    def per_rank(lg, re, rq, bt):
        out = xla_topk_merge(
            lg[0], re[0], rq[0], bt[0], axis_name=axis_name, topk=topk,
            block_size=block_size, with_ids=with_ids, with_saturated=with_saturated, interleave=interleave,
        )
        # Only the requested outputs leave shard_map (None is no array).
        return tuple(x[None] for x in out if x is not None)

    spec = P(axis_name)
    n_out = 2 + with_ids + with_saturated
    fn = shard_map(per_rank, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec,) * n_out)
    outs = list(fn(logits, row_ends, req_id, block_table))
    kv_rows, counts = outs[0], outs[1]
    ids = outs[2] if with_ids else None
    saturated = outs[-1] if with_saturated else None
    return MergeOutput(kv_rows, counts, ids, saturated)
