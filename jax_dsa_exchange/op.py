"""The JAX op: ``topk_exchange_merge`` (SPEC §3, §7).

One primitive, ``dsa_topk_exchange_merge``, that lowers on CUDA to two XLA FFI
custom calls on XLA's stream, in this order:

1. ``dsa_select_push(token, logits, row_ends) -> (token, s32[] unused)``
2. ``dsa_merge(token, logits, row_ends, req_id, block_table)
   -> (token, kv_rows, counts[, ids][, saturated])``

Both custom calls have ``has_side_effect=True`` (XLA never removes, merges or
duplicates them) and are chained by an XLA token, so merge always follows its
select_push (adjacent on the stream, which lets merge start early through PDL).
Both results are tuples holding a token on purpose: XLA's GPU dynamic-slice
fusion skips such calls; it aborted on, or duplicated, calls fed by a scan's
slices otherwise (jax 0.11.2, H200; see ``_cuda_lowering``).

Ordering between calls (``ordered=True``, the default, SPEC §7): the primitive
carries an *ordered* effect (:class:`DsaExchangeEffect`), so JAX threads one
effect token through every call: calls keep their program order inside
``jit``, ``lax.scan``, ``fori_loop``/``while_loop`` bodies and ``shard_map``,
and across dispatches of separate jitted functions.  The effect is declared
*shardable* (like ``io_callback(ordered=True)``), the only kind of ordered
effect JAX (0.11, 0.12) accepts in multi-device computations: shard_map over
the DCP mesh works, with one token per device, so the order is per device,
which is what the protocol needs (every rank runs the same calls in the same
order).  ``while_loop`` may hold the op in its body, not in its condition.

Price of ``ordered=True`` (measured, jax 0.11/0.12): a jitted function with an
ordered effect leaves JAX's C++ dispatch fast path, and before each dispatch
JAX blocks the host until the previous dispatch's effect token is ready
(``jax._src.array._token_shard_arg`` calls ``block_until_ready``), i.e. until
the previous effectful program finished on the GPU: no host/device overlap
between successive top-level calls.  On CPU a tiny jitted step went from 18 us
to ~360 us per call.  Put the whole decode step (all layers) in one jitted
function so this is paid once per step, not per layer.

``ordered=False``: no JAX effect at all; the C++ fast path and asynchronous
dispatch stay.  Then calls are ordered only by data dependencies inside a
program (XLA may reorder two independent calls; every rank compiles the same
program, but nothing guarantees the same schedule on every rank), and JAX may
drop a call whose outputs are unused.  Safe when every call's inputs depend on
the previous call's outputs (the layer chain of a decode step) and outputs are
used; separate dispatches run in stream order on each device.

``ids``/``saturated`` are outputs of the custom call only when asked for
(``with_ids``/``with_saturated``); otherwise the kernel gets address 0 for them.

Not differentiable (jvp/transpose raise NotImplementedError) and no vmap rule:
the exchange is a per-rank communication with a fixed row count.

Exchange records live in the C++ library keyed by (exchange id, device
ordinal); the compiled program holds only the exchange id.  XLA records the
custom calls into CUDA graphs by default and replays them without calling the
handler, with the exchange's device addresses baked in.  ``Exchange.close()``
therefore keeps the exchange's small state allocation and sets its status word
to closed; both kernels read that word first and then do nothing (no peer
store, no wait; the merge returns empty outputs), so a replay after close
touches no freed memory (see ffi/README.md and layout.py).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import numpy as np

import jax
import jax.numpy as jnp
from jax._src import core, dispatch, effects
from jax._src.interpreters import mlir
from jax.interpreters import ad, batching

from . import _ffi

_ffi.disable_dynamic_slice_fusion()  # before a GPU backend starts (see _ffi)

from . import layout

__all__ = ["MergeOutput", "topk_exchange_merge", "DsaExchangeEffect", "topk_exchange_merge_p"]

PATHS = ("auto", "ffi", "xla")


class MergeOutput(NamedTuple):
    kv_rows: jax.Array  # int32 [R, K]
    counts: jax.Array  # int32 [R]
    ids: jax.Array | None = None  # int32 [R, K] when with_ids
    saturated: jax.Array | None = None  # int32 [R] when with_saturated


class DsaExchangeEffect(effects.Effect):
    """Ordered, shardable side effect of the exchange (device-resident epochs advance per call)."""

    __str__ = lambda self: "DsaExchange"  # noqa: E731


EFFECT = DsaExchangeEffect()
effects.ordered_effects.add_type(DsaExchangeEffect)
effects.shardable_ordered_effects.add_type(DsaExchangeEffect)
effects.lowerable_effects.add_type(DsaExchangeEffect)
effects.control_flow_allowed_effects.add_type(DsaExchangeEffect)

topk_exchange_merge_p = core.Primitive("dsa_topk_exchange_merge")
topk_exchange_merge_p.multiple_results = True


# Eager calls run through a cached one-primitive jit, like any primitive.
topk_exchange_merge_p.def_impl(functools.partial(dispatch.apply_primitive, topk_exchange_merge_p))


def _abstract_eval(logits, row_ends, req_id, block_table, *, exchange_id, topk, block_size, with_ids, with_saturated,
                   ordered):
    rows = logits.shape[0]
    outs = [core.ShapedArray((rows, topk), jnp.int32), core.ShapedArray((rows,), jnp.int32)]
    if with_ids:
        outs.append(core.ShapedArray((rows, topk), jnp.int32))
    if with_saturated:
        outs.append(core.ShapedArray((rows,), jnp.int32))
    return outs, ({EFFECT} if ordered else core.no_effects)


topk_exchange_merge_p.def_effectful_abstract_eval(_abstract_eval)

_NO_GRAD = "topk_exchange_merge has no differentiation rule"


def _no_jvp(primals, tangents, **params):
    raise NotImplementedError(_NO_GRAD + " (it is an integer-valued cross-rank exchange; take gradients elsewhere)")


def _no_transpose(*args, **params):
    raise NotImplementedError(_NO_GRAD)


def _no_vmap(*args, **params):
    raise NotImplementedError(
        "topk_exchange_merge has no batching rule (vmap): every call is one exchange round over "
        "[R, L] rows shared by all ranks; fold the batch into the row axis R instead"
    )


ad.primitive_jvps[topk_exchange_merge_p] = _no_jvp
ad.primitive_transposes[topk_exchange_merge_p] = _no_transpose
batching.primitive_batchers[topk_exchange_merge_p] = _no_vmap


def _check_per_device(ctx) -> None:
    """The custom calls launch per device: refuse GSPMD-partitioned (auto-sharded) contexts."""
    from jax._src import sharding_impls

    ax = ctx.module_context.axis_context
    if isinstance(ax, sharding_impls.ShardingContext) and ax.num_devices > 1:
        raise ValueError(
            "topk_exchange_merge runs per device (one rank each): call it inside shard_map over the "
            f"DCP mesh axis, not in a jit partitioned over {ax.num_devices} devices"
        )
    if isinstance(ax, sharding_impls.SPMDAxisContext):
        auto = set(ax.mesh.axis_names) - set(ax.manual_axes)
        if auto and any(ax.mesh.shape[a] > 1 for a in auto):
            raise ValueError(
                "topk_exchange_merge must be called inside a shard_map that is manual over every mesh "
                f"axis of size > 1; axes {sorted(auto)} are still automatic"
            )


def _cuda_lowering(ctx, logits, row_ends, req_id, block_table, *, exchange_id, topk, block_size, with_ids,
                   with_saturated, ordered):
    # Both custom calls return a TUPLE holding a token: XLA's GPU dynamic-slice fusion
    # (on in jax 0.11.2) leaves such calls alone.  Without it, it rewrote calls fed by
    # a scan's slices: a lone-token result aborted the compiler, and a merge whose
    # results had other users was DUPLICATED (two merges per call: the second waited
    # for an epoch no peer would send).  The token chain is also the order:
    # (effect token ->) select_push -> merge (-> effect token), no barrier needed.
    _check_per_device(ctx)
    threaded = ordered and EFFECT in ctx.tokens_in.effects()
    token = ctx.tokens_in.get(EFFECT) if threaded else mlir.hlo.create_token()
    tok = core.abstract_token
    ticket_aval = core.ShapedArray((), np.int32)  # never written; only makes the tuple
    lg_aval, re_aval = ctx.avals_in[0], ctx.avals_in[1]

    push_ctx = dataclasses.replace(ctx, avals_in=[tok, lg_aval, re_aval], avals_out=[tok, ticket_aval])
    token, _ = jax.ffi.ffi_lowering("dsa_select_push", has_side_effect=True)(
        push_ctx, token, logits, row_ends, exchange_id=np.int64(exchange_id)
    )

    merge_ctx = dataclasses.replace(ctx, avals_in=[tok, *ctx.avals_in], avals_out=[tok, *ctx.avals_out])
    token, *outs = jax.ffi.ffi_lowering("dsa_merge", has_side_effect=True)(
        merge_ctx, token, logits, row_ends, req_id, block_table,
        exchange_id=np.int64(exchange_id), block_size=np.int32(block_size),
        with_ids=np.bool_(with_ids), with_saturated=np.bool_(with_saturated),
    )
    if threaded:
        ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet({EFFECT: token})))
    return outs


def _other_lowering(ctx, *args, **params):
    platforms = getattr(ctx.module_context, "platforms", None)
    raise NotImplementedError(
        f"topk_exchange_merge's FFI path runs only on CUDA GPUs (lowering for {platforms}); "
        "use path='xla' (with axis_name) on other backends"
    )


mlir.register_lowering(topk_exchange_merge_p, _other_lowering)
mlir.register_lowering(topk_exchange_merge_p, _cuda_lowering, platform="cuda")


# ---------------------------------------------------------------------------
# Python entry point: validation, then the FFI primitive or the XLA path.
# ---------------------------------------------------------------------------


def _dtype(x, name):
    dt = getattr(x, "dtype", None)
    if dt is None:
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    return np.dtype(dt)


def _shape(x):
    return tuple(int(d) for d in x.shape)


def _validate(exchange, logits, row_ends, req_id, block_table, block_size, with_ids, with_saturated, path):
    if path not in PATHS:
        raise ValueError(f"path={path!r} must be one of {PATHS}")
    for attr in ("id", "topk", "max_rows", "closed"):
        if not hasattr(exchange, attr):
            raise TypeError(f"exchange must have attribute {attr!r} (got {type(exchange).__name__})")
    if exchange.closed:
        raise ValueError(f"exchange {exchange.id} is closed")
    for name, v in (("with_ids", with_ids), ("with_saturated", with_saturated)):
        if not isinstance(v, (bool, np.bool_)):
            raise TypeError(f"{name} must be a bool, got {v!r}")
    if isinstance(block_size, (bool, np.bool_)) or not isinstance(block_size, (int, np.integer)):
        raise TypeError(f"block_size must be an int, got {block_size!r}")
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")

    if _dtype(logits, "logits") != jnp.bfloat16:
        raise TypeError(f"logits must be bfloat16, got {_dtype(logits, 'logits')}")
    if logits.ndim != 2:
        raise ValueError(f"logits must be [R, L], got shape {_shape(logits)}")
    rows, cols = _shape(logits)
    if rows < 1:
        raise ValueError(f"logits has R={rows} rows; need R >= 1")
    if rows > exchange.max_rows:
        raise ValueError(f"logits has R={rows} rows > the exchange's max_rows={exchange.max_rows}")
    if not 1 <= cols <= layout.MAX_LOCAL_LEN:
        raise ValueError(f"logits has L={cols} columns; need 1 <= L <= {layout.MAX_LOCAL_LEN} (2**17)")
    for name, x in (("row_ends", row_ends), ("req_id", req_id)):
        if _dtype(x, name) != np.int32:
            raise TypeError(f"{name} must be int32, got {_dtype(x, name)}")
        if _shape(x) != (rows,):
            raise ValueError(f"{name} must have shape (R,) = ({rows},), got {_shape(x)}")
    if _dtype(block_table, "block_table") != np.int32:
        raise TypeError(f"block_table must be int32, got {_dtype(block_table, 'block_table')}")
    if block_table.ndim != 2 or min(_shape(block_table)) < 1:
        raise ValueError(f"block_table must be [num_requests >= 1, max_pages >= 1], got shape {_shape(block_table)}")


def _use_ffi(path: str) -> bool:
    if path == "xla":
        return False
    if path == "ffi":
        return True
    dev = jax.devices()[0]  # the default backend's first device
    return dev.platform == "gpu" and "rocm" not in getattr(dev.client, "platform_version", "").lower()


def topk_exchange_merge(
    exchange: Any,
    logits,
    row_ends,
    req_id,
    block_table,
    *,
    block_size: int,
    with_ids: bool = False,
    with_saturated: bool = False,
    path: str = "auto",
    axis_name=None,
    ordered: bool = True,
) -> MergeOutput:
    """Exact DCP top-K merge of this rank's candidates (SPEC §3) through ``exchange``.

    Per-rank arguments (inside ``shard_map`` over the DCP axis, or jit on one
    device): ``logits`` bf16 [R, L], ``row_ends`` int32 [R], ``req_id`` int32
    [R], ``block_table`` int32 [num_requests, max_pages].  ``exchange``: any
    object with ``id``, ``topk``, ``max_rows``, ``closed`` (and ``world``,
    ``rank``, ``local_topk``), registered with the FFI library per device.

    ``path``: ``"auto"`` (the FFI kernels when the default backend is CUDA,
    else the XLA path), ``"ffi"`` (always the FFI custom calls; lowering fails
    on other platforms) or ``"xla"`` (``xla_path.xla_topk_merge``; needs
    ``axis_name``).  ``ordered``: the FFI path's ordering guarantee (module
    docstring: True = ordered JAX effect, False = no effect, faster dispatch).
    Returns :class:`MergeOutput`; ``ids``/``saturated`` are None unless asked
    for.
    """
    if not isinstance(ordered, (bool, np.bool_)):
        raise TypeError(f"ordered must be a bool, got {ordered!r}")
    _validate(exchange, logits, row_ends, req_id, block_table, block_size, with_ids, with_saturated, path)
    with_ids, with_saturated, block_size = bool(with_ids), bool(with_saturated), int(block_size)
    if not _use_ffi(path):
        if axis_name is None:
            raise ValueError(
                "the XLA path (path='xla', or path='auto' on a non-CUDA backend) needs axis_name: "
                "the DCP mesh axis of the enclosing shard_map"
            )
        from . import xla_path  # lazy: written separately, and only needed here

        r = xla_path.xla_topk_merge(
            logits, row_ends, req_id, block_table, axis_name=axis_name, topk=exchange.topk,
            block_size=block_size, with_ids=with_ids, with_saturated=with_saturated,
        )
        return MergeOutput(r.kv_rows, r.counts, r.ids if with_ids else None, r.saturated if with_saturated else None)

    from . import _ffi

    if _ffi.available():
        _ffi.register_targets()
    elif path == "auto" or _ffi.found_unusable():
        # (path="ffi" without any library still traces and lowers, e.g. to inspect the HLO.)
        raise RuntimeError(f"the FFI launcher library is not available: {_ffi.load_error()} (or use path='xla')")
    outs = topk_exchange_merge_p.bind(
        jnp.asarray(logits), jnp.asarray(row_ends), jnp.asarray(req_id), jnp.asarray(block_table),
        exchange_id=int(exchange.id), topk=int(exchange.topk), block_size=block_size,
        with_ids=with_ids, with_saturated=with_saturated, ordered=bool(ordered),
    )
    kv_rows, counts, *rest = outs
    ids = rest.pop(0) if with_ids else None
    saturated = rest.pop(0) if with_saturated else None
    return MergeOutput(kv_rows, counts, ids, saturated)
