"""The JAX op: ``topk_exchange_merge`` (docs/DESIGN.md §3, §7).

One primitive, ``dsa_topk_exchange_merge``, that lowers on CUDA to two XLA FFI
custom calls on XLA's stream, in this order:

1. ``dsa_select_push(token, logits, row_ends) -> (token, s32[] unused)``
2. ``dsa_merge(token, logits, row_ends, req_id, block_table)
   -> (token, kv_rows, counts[, ids][, saturated])``

Both custom calls have ``has_side_effect=True`` (XLA never removes, merges or
duplicates them) and are chained by an XLA token, so merge always follows its
select_push (adjacent on the stream, which lets merge start early through PDL).
Both results are tuples holding a token (XLA's GPU dynamic-slice fusion skips such
calls in the XLA sources read, ``IsCustomCall`` in ``DynamicSliceFusionRewriter``, but
not in jax 0.11.2's XLA: see below).

**XLA's GPU dynamic-slice fusion, jax 0.11.2 (H200):** the pass still matched the
calls when their operands were slices (a ``lax.scan`` over stacked layers, or ``x[i]``
of an unrolled loop): the compiler aborted (``Check failed: shape.IsArray() ||
shape.IsTuple()`` in ``GpuHloCostAnalysis::FusionCalculateUtilizations``, the fused
call's token), or left a fused merge beside the original (two merges per call).  The
op touches no flag; the workaround is scoped to the programs that call it: compile
them with ``jax.jit(step, compiler_options=compiler_options())``
(:func:`compiler_options`: ``{"xla_gpu_enable_dynamic_slice_fusion": False}`` for the
affected jax versions, ``{}`` for the others), which turns the pass off for that
executable only.  Version gate: :data:`DSF_SAFE_FROM`.

Ordering between calls (``ordered=True``, the default, docs/DESIGN.md §7) without a JAX
effect, so jitted steps keep JAX's C++ dispatch fast path and the host never
waits for the device between dispatches:

* *program order by data dependence*: every call's select_push takes the token
  the previous call's merge returned in the same lowered body (a jit or
  shard_map body, one ``lax.scan``/``while_loop``/``cond`` body, a Python-unrolled
  loop), so XLA cannot reorder two calls of one body even when their data is
  independent; iterations of a loop run in order; separately dispatched
  programs run in stream order on each device (one stream per device);
* *never dropped*: a DCE rule (``pe.dce_rules``, as jax-triton does) keeps the
  equation when its outputs are unused, and XLA keeps side-effecting calls.  JAX
  would still drop a whole ``lax.scan``/``while_loop``/``cond``/inner ``jit`` whose
  outputs are all unused (no JAX effect): the DCE rules of those primitives are
  wrapped to keep such an equation when its body calls the op
  (:func:`_wrap_higher_order_dce_rules`; jax 0.11 and 0.12);
* *never duplicated or merged*: ``has_side_effect`` (XLA CSE leaves the calls alone),
  and the dynamic-slice fusion, which did duplicate them, is off for the executable
  (:func:`compiler_options`; counted in the optimized HLO by the GPU tests).

What the token chain cannot see: a call *outside* a loop/cond/inner jit and
calls *inside* it, with no data flowing between them.  XLA then orders them by
its (deterministic) schedule, the same on every rank compiling the same program
with the same XLA, but not necessarily program order (lowering such a program warns:
:class:`CrossBodyOrderWarning`).  ``ordered="effect"``
covers that case with JAX's *ordered* effect (:class:`DsaExchangeEffect`, shardable,
as ``io_callback(ordered=True)``): a token threaded through every call, loop and
inner jit, at a price: the program leaves JAX's C++ fast path and JAX blocks the
host before each dispatch until the previous effectful program finished on the
device (``jax._src.array._token_shard_arg``), so the GPU idles while the next step
is dispatched (H200, ``python -m jax_dsa_exchange.bench --serving``, W=1 K=2048
N=2048 R=16 L=32768: +32 us per layer over the kernels).

``ordered=False``: no chain between calls (each select_push starts from a fresh
token; the pair stays chained); XLA may run independent calls of one body in any
order.  Same dispatch cost as the default.

``ids``/``saturated`` are outputs of the custom call only when asked for
(``with_ids``/``with_saturated``); otherwise the kernel gets address 0 for them.

Not differentiable (jvp/transpose raise NotImplementedError) and no vmap rule:
the exchange is a per-rank communication with a fixed row count.  The XLA path
refuses both the same way (``xla_path``'s guard), so a step that works on one path
does not change meaning on the other.

Exchange records live in the C++ library keyed by (exchange id, device
ordinal); the compiled program holds only the exchange id.  XLA records the
custom calls into CUDA graphs by default and replays them without calling the
handler, with the exchange's device addresses baked in.  ``Exchange.close()``
therefore keeps what a replay touches (the state words, the peer table, the pinned
status words) for the process's life and sets the status word to closed; both
kernels read it (select_push after loading the peer table) and then do no exchange
work (no peer store, no wait; the merge returns empty outputs), so a replay after
close touches no freed memory (see ffi/README.md and layout.py).
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import weakref
from typing import Any

import numpy as np

import jax
import jax.numpy as jnp
from jax import core as jax_core
from jax.extend import core
from jax.extend.mlir.dialects import stablehlo
from jax.interpreters import ad, batching, mlir

from . import _ffi, _jax_private, checks, layout
from .output import MergeOutput

__all__ = ["MergeOutput", "topk_exchange_merge", "DsaExchangeEffect", "topk_exchange_merge_p", "compiler_options",
           "jit", "CrossBodyOrderWarning"]

PATHS = ("auto", "ffi", "xla")
ORDERED = (True, False, "effect")

DSF_OPTION = "xla_gpu_enable_dynamic_slice_fusion"
# The first jaxlib version whose XLA leaves the exchange's custom calls alone with the
# dynamic-slice fusion on, as shown on a GPU by tests/test_op_gpu.py::
# test_decode_loop_with_dynamic_slice_fusion_forced_on[...-no-workaround]; None: no
# version shown yet (0.11.2 aborted, 0.12 not run on a GPU).
DSF_SAFE_FROM: tuple[int, ...] | None = None


def dynamic_slice_fusion_workaround_needed() -> bool:
    """Whether this jaxlib needs :func:`compiler_options` (``JAX_DSA_EXCHANGE_DSF_WORKAROUND``
    = 0 / 1 overrides, e.g. to check a newer jax on a GPU)."""
    import os

    env = os.environ.get("JAX_DSA_EXCHANGE_DSF_WORKAROUND", "").strip()
    if env in ("0", "1"):
        return env == "1"
    if DSF_SAFE_FROM is None:
        return True
    return _jax_private.jaxlib_version() < DSF_SAFE_FROM


def compiler_options() -> dict:
    """Compiler options for ``jax.jit(step, compiler_options=...)`` of a program that calls
    the op: XLA's GPU dynamic-slice fusion off for that executable on the jax versions that
    need it (module docstring), else ``{}``.  Nothing process-wide changes."""
    return {DSF_OPTION: False} if dynamic_slice_fusion_workaround_needed() else {}


def jit(fun=None, **kwargs):
    """``jax.jit`` with :func:`compiler_options` merged in (``kwargs`` win); also a decorator.

    The result also checks, before every dispatch, each exchange its programs call
    (``Exchange.poll``: the pinned host copy of the status words, no synchronization), so
    a peer's failure raises on the next step even when XLA replays the calls from a CUDA
    graph without calling the launcher (the default graph mode, ``_ffi.cuda_graph_mode``).
    Which exchanges: those whose calls were traced through this object, by a call or its
    ``lower`` / ``trace`` / ``eval_shape`` (not learned: a second ``jit`` of the same
    function, or an inner ``jax.jit`` traced before on its own, that JAX serves from its
    trace cache: keep one ``op.jit`` per step function).  Everything else is the
    ``jax.jit`` object's; a ``lower(...).compile()``d executable does not poll."""
    if fun is None:
        return functools.partial(jit, **kwargs)
    opts = dict(compiler_options(), **(kwargs.pop("compiler_options", None) or {}))
    return _PollingJit(jax.jit(fun, compiler_options=opts or None, **kwargs))


# The exchanges a traced op.jit function calls: topk_exchange_merge adds its exchange to
# the sets of every op.jit call (or lower / trace / eval_shape) being traced, outer ones
# too (where no compiler option is needed, op.jit may nest).  A nested jax.jit whose trace
# JAX serves from its cache does not call topk_exchange_merge again: its exchanges are
# polled only if they were traced through this op.jit once (jit docstring).
_polled_exchanges: contextvars.ContextVar = contextvars.ContextVar("dsa_polled_exchanges", default=())


def _note_exchange(exchange) -> None:
    if not callable(getattr(exchange, "poll", None)):
        return
    for seen in _polled_exchanges.get():
        try:
            seen.add(exchange)
        except TypeError:  # an object without weak references: nothing to poll later
            return


class _PollingJit:
    """What :func:`jit` returns: the ``jax.jit`` object, plus a host status check of the
    exchanges its programs call before each call (about a microsecond per step)."""

    def __init__(self, jitted):
        self._jitted = jitted
        self._exchanges: "weakref.WeakSet" = weakref.WeakSet()
        functools.update_wrapper(self, jitted, updated=())

    def __call__(self, *args, **kwargs):
        for ex in list(self._exchanges):
            ex.poll()
        return self._collecting(self._jitted, *args, **kwargs)

    def _collecting(self, fn, *args, **kwargs):
        token = _polled_exchanges.set(_polled_exchanges.get() + (self._exchanges,))
        try:
            return fn(*args, **kwargs)
        finally:
            _polled_exchanges.reset(token)

    def __getattr__(self, name):
        attr = getattr(self._jitted, name)
        if name in ("lower", "trace", "eval_shape"):  # they trace too (and JAX reuses it)
            return functools.partial(self._collecting, attr)
        return attr

    def __get__(self, obj, objtype=None):  # as a method decorator, like jax.jit
        return self if obj is None else functools.partial(self, obj)


class DsaExchangeEffect(core.Effect):
    """Ordered, shardable side effect of the exchange, only with ``ordered="effect"``."""

    __str__ = lambda self: "DsaExchange"  # noqa: E731


EFFECT = DsaExchangeEffect()
_jax_private.register_ordered_effect(DsaExchangeEffect)

topk_exchange_merge_p = core.Primitive("dsa_topk_exchange_merge")
topk_exchange_merge_p.multiple_results = True


# Eager calls run through a cached one-primitive jit, like any primitive.
topk_exchange_merge_p.def_impl(functools.partial(_jax_private.apply_primitive, topk_exchange_merge_p))


def _abstract_eval(logits, row_ends, req_id, block_table, *, exchange_id, topk, block_size, with_ids, with_saturated,
                   ordered):
    rows = logits.shape[0]
    outs = [jax_core.ShapedArray((rows, topk), jnp.int32), jax_core.ShapedArray((rows,), jnp.int32)]
    if with_ids:
        outs.append(jax_core.ShapedArray((rows, topk), jnp.int32))
    if with_saturated:
        outs.append(jax_core.ShapedArray((rows,), jnp.int32))
    return outs, ({EFFECT} if ordered == "effect" else core.no_effects)


topk_exchange_merge_p.def_effectful_abstract_eval(_abstract_eval)


def _keep_when_unused(*args):
    """DCE rule: the call stays, and all its inputs stay live, whether or not its outputs
    are used (an unused call still advances every rank's epochs; dropping it on one rank
    would shift the pairing of all later calls).  The rule's signature changed between
    jax releases ((used_outputs, eqn) in 0.11.x, (used_outputs, live_inputs, eqn) in
    0.12): the equation is always last."""
    eqn = args[-1]
    return [True] * len(eqn.invars), eqn


_DCE_RULES = _jax_private.dce_rules()
_DCE_RULES[topk_exchange_merge_p] = _keep_when_unused

_holds_op_cache: "weakref.WeakKeyDictionary[core.Jaxpr, bool]" = weakref.WeakKeyDictionary()


def _holds_op(jaxpr) -> bool:
    """Whether ``jaxpr`` (or any jaxpr nested in its equations) calls the exchange."""
    try:
        return _holds_op_cache[jaxpr]
    except (KeyError, TypeError):
        pass
    found = any(e.primitive is topk_exchange_merge_p or any(map(_holds_op, core.jaxprs_in_params(e.params)))
                for e in jaxpr.eqns)
    try:
        _holds_op_cache[jaxpr] = found
    except TypeError:
        pass
    return found


def _keeping_loops_with_the_op(rule):
    """Wraps a higher-order primitive's DCE rule (scan, while, cond, jit, shard_map, remat,
    custom_jvp/vjp): such an equation whose outputs are all unused is dropped whole by its
    rule, since it has no JAX effect; when its body calls the exchange it is kept as is."""

    def wrapped(*args):
        used_outputs, eqn = args[0], args[-1]
        if not any(used_outputs) and any(map(_holds_op, core.jaxprs_in_params(eqn.params))):
            return [True] * len(eqn.invars), eqn
        return rule(*args)

    wrapped._dsa_exchange_wrapped = True
    return wrapped


def _wrap_higher_order_dce_rules() -> None:
    # Every rule registered by now (jax registers them when its modules load: lax's
    # control flow, jit, shard_map, remat, custom derivatives); the rule itself is
    # unchanged for equations that do not call the exchange.
    for prim, rule in list(_DCE_RULES.items()):
        if prim is not topk_exchange_merge_p and not getattr(rule, "_dsa_exchange_wrapped", False):
            _DCE_RULES[prim] = _keeping_loops_with_the_op(rule)


_wrap_higher_order_dce_rules()

# Both paths refuse the same transformations with the same messages (checks.py; the XLA
# path through xla_path's guard primitive).


def _no_jvp(primals, tangents, **params):
    raise NotImplementedError(checks.NO_GRAD)


def _no_transpose(*args, **params):
    raise NotImplementedError(checks.NO_GRAD)


def _no_vmap(*args, **params):
    raise NotImplementedError(checks.NO_VMAP)


ad.primitive_jvps[topk_exchange_merge_p] = _no_jvp
ad.primitive_transposes[topk_exchange_merge_p] = _no_transpose
batching.primitive_batchers[topk_exchange_merge_p] = _no_vmap


def _check_per_device(ctx) -> None:
    """The custom calls launch per device: refuse GSPMD-partitioned (auto-sharded) contexts."""
    sharding_context, spmd_axis_context = _jax_private.sharding_contexts()
    ax = ctx.module_context.axis_context
    if isinstance(ax, sharding_context) and ax.num_devices > 1:
        raise ValueError(
            "topk_exchange_merge runs per device (one rank each): call it inside shard_map over the "
            f"DCP mesh axis, not in a jit partitioned over {ax.num_devices} devices"
        )
    if isinstance(ax, spmd_axis_context):
        auto = set(ax.mesh.axis_names) - set(ax.manual_axes)
        if auto and any(ax.mesh.shape[a] > 1 for a in auto):
            raise ValueError(
                "topk_exchange_merge must be called inside a shard_map that is manual over every mesh "
                f"axis of size > 1; axes {sorted(auto)} are still automatic"
            )


_CHAIN_KEY = ("jax_dsa_exchange", "token chain")
_chains_fallback: dict = {}


def _chain_slots(ctx) -> list:
    """[block, token] pairs of this module's lowering: the token the last call lowered in
    each block returned.  Kept in the module context's ``cached_primitive_lowerings``
    dict (module-wide and per lowering in jax 0.11 and 0.12), else per module object."""
    mc = ctx.module_context
    store = getattr(mc, "cached_primitive_lowerings", None)
    if not isinstance(store, dict):
        store = _chains_fallback.setdefault(id(mc.module), {"module": mc.module})
    return store.setdefault(_CHAIN_KEY, [])


def _chain_get(ctx):
    block = mlir.ir.InsertionPoint.current.block
    for b, tok in _chain_slots(ctx):
        if b == block:
            return tok
    return None


class CrossBodyOrderWarning(UserWarning):
    """Calls of the op in different lowered bodies of one program (module docstring)."""


def _chain_set(ctx, token) -> None:
    block = mlir.ir.InsertionPoint.current.block
    slots = _chain_slots(ctx)
    for slot in slots:
        if slot[0] == block:
            slot[1] = token
            return
    slots.append([block, token])
    if len(slots) == 2:
        import warnings

        warnings.warn(
            "topk_exchange_merge is called in two different bodies of one program (e.g. outside "
            "and inside a lax.scan/while_loop/cond or an inner jit): the op's token chain orders "
            "the calls of each body; between bodies only data dependence (or XLA's schedule, the "
            "same on every rank) orders them.  If those calls share no data, pass "
            "ordered='effect' (JAX's ordered effect: program order, but the host waits for the "
            "device before each dispatch)", CrossBodyOrderWarning, stacklevel=2)


def _cuda_lowering(ctx, logits, row_ends, req_id, block_table, *, exchange_id, topk, block_size, with_ids,
                   with_saturated, ordered):
    # Both custom calls return a TUPLE holding a token (newer XLA's dynamic-slice fusion
    # skips such calls; jax 0.11.2's does not: compiler_options(), module docstring).
    # The token chain is also the order:
    # (previous call's merge | effect token ->) select_push -> merge (-> next call).
    _check_per_device(ctx)
    threaded = ordered == "effect" and EFFECT in ctx.tokens_in.effects()
    chained = ordered is True
    token = None
    if threaded:
        token = ctx.tokens_in.get(EFFECT)
    elif chained:
        token = _chain_get(ctx)
    if token is None:
        token = stablehlo.create_token()
    tok = _jax_private.abstract_token()
    ticket_aval = jax_core.ShapedArray((), np.int32)  # never written; only makes the tuple
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
    elif chained:
        _chain_set(ctx, token)
    return outs


def _other_lowering(ctx, *args, **params):
    platforms = getattr(ctx.module_context, "platforms", None)
    raise NotImplementedError(
        f"topk_exchange_merge's FFI path runs only on CUDA GPUs (lowering for {platforms}); "
        "use path='xla' (with axis_name) on other backends"
    )


# cacheable=False: lowered inline in the caller's body, every time (jax 0.11/0.12 otherwise
# emit a primitive's lowering once into a private function called from each use), so the
# token chain links the calls of one body in program order.
mlir.register_lowering(topk_exchange_merge_p, _other_lowering, cacheable=False)
mlir.register_lowering(topk_exchange_merge_p, _cuda_lowering, platform="cuda", cacheable=False)


# ---------------------------------------------------------------------------
# Python entry point: validation, then the FFI primitive or the XLA path.
# ---------------------------------------------------------------------------


def _validate(exchange, logits, row_ends, req_id, block_table, block_size, with_ids, with_saturated, path,
              interleave):
    """Every argument check, before any custom call; returns the call's interleave size (the
    exchange's: ``interleave`` may only repeat it)."""
    if path not in PATHS:
        raise ValueError(f"path={path!r} must be one of {PATHS}")
    for attr in ("id", "world", "topk", "local_topk", "max_rows", "closed"):
        if not hasattr(exchange, attr):
            raise TypeError(f"exchange must have attribute {attr!r} (got {type(exchange).__name__})")
    if exchange.closed:
        raise ValueError(f"exchange {exchange.id} is closed")
    # The checks every path runs (checks.py): the same errors on the FFI and XLA paths.
    # Exchanges made before these options (or stand-ins in tests) are bfloat16, token by token.
    ex_interleave = int(getattr(exchange, "interleave", 1))
    interleave = checks.check_interleave_matches(interleave, ex_interleave, exchange.id, exchange.world)
    # The kernels take one score dtype; the XLA path takes either.
    score_dtype = layout.KERNEL_SCORE_DTYPE if _use_ffi(path) else None
    checks.check_call(logits, row_ends, req_id, block_table, world=exchange.world, topk=exchange.topk,
                      local_topk=exchange.local_topk, block_size=block_size, with_ids=with_ids,
                      with_saturated=with_saturated, max_rows=exchange.max_rows, interleave=interleave,
                      score_dtype=score_dtype)
    return interleave


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
    ordered: bool | str = True,
    interleave: int | None = None,
) -> MergeOutput:
    """Exact DCP top-K merge of this rank's candidates (docs/DESIGN.md §3) through ``exchange``.

    Per-rank arguments (inside ``shard_map`` over the DCP axis, or jit on one
    device): ``logits`` [R, L] of the exchange's ``score_dtype`` (bfloat16 or float32),
    ``row_ends`` int32 [R], ``req_id`` int32 [R], ``block_table`` int32
    [num_requests, max_pages].  ``exchange``: any object with ``id``, ``topk``,
    ``max_rows``, ``closed`` (and ``world``, ``rank``, ``local_topk``; ``score_dtype`` and
    ``interleave`` where not bfloat16 / 1), registered with the FFI library per device.
    ``interleave``: the KV cache's interleave size, which is the exchange's (None, the
    default: the exchange's; any other value than the exchange's is a ValueError).

    ``path``: ``"auto"`` (the FFI kernels when the default backend is CUDA,
    else the XLA path), ``"ffi"`` (always the FFI custom calls; lowering fails
    on other platforms) or ``"xla"`` (``xla_path.xla_topk_merge``; needs
    ``axis_name``).  ``ordered``: the FFI path's ordering between calls (module
    docstring): True (default) = program order by a token chain, no JAX effect, async
    dispatch; ``"effect"`` = JAX's ordered effect (also orders calls across loop
    bodies, but blocks the host before every dispatch); False = no chain.
    Returns :class:`MergeOutput`; ``ids``/``saturated`` are None unless asked
    for.

    Arguments are checked at trace time, the same way on every path (``checks.py``):
    TypeError / ValueError naming the argument.  No path differentiates or batches the
    merge: ``jax.grad`` through it and ``jax.vmap`` of it raise NotImplementedError.
    """
    if isinstance(ordered, np.bool_):
        ordered = bool(ordered)
    if not (ordered is True or ordered is False or ordered == "effect"):
        raise TypeError(f"ordered must be True, False or 'effect', got {ordered!r}")
    interleave = _validate(exchange, logits, row_ends, req_id, block_table, block_size, with_ids, with_saturated,
                           path, interleave)
    _note_exchange(exchange)
    with_ids, with_saturated, block_size = bool(with_ids), bool(with_saturated), int(block_size)
    if not _use_ffi(path):
        if axis_name is None:
            raise ValueError(
                "the XLA path (path='xla', or path='auto' on a non-CUDA backend) needs axis_name: "
                "the DCP mesh axis of the enclosing shard_map"
            )
        from . import xla_path  # lazy: only this path needs it

        ranks = xla_path.axis_ranks(axis_name)
        if ranks != exchange.world:
            raise ValueError(f"exchange {exchange.id} has world={exchange.world} but the mesh axis "
                             f"{axis_name!r} has {ranks} ranks")
        return xla_path.xla_topk_merge(
            logits, row_ends, req_id, block_table, axis_name=axis_name, topk=exchange.topk,
            block_size=block_size, with_ids=with_ids, with_saturated=with_saturated, interleave=interleave,
        )  # a MergeOutput (ids / saturated None unless asked for)

    if _ffi.available():
        _ffi.register_targets()
    elif path == "auto" or _ffi.found_unusable():
        # (path="ffi" without any library still traces and lowers, e.g. to inspect the HLO.)
        raise RuntimeError(f"the FFI launcher library is not available: {_ffi.load_error()} (or use path='xla')")
    outs = topk_exchange_merge_p.bind(
        jnp.asarray(logits), jnp.asarray(row_ends), jnp.asarray(req_id), jnp.asarray(block_table),
        exchange_id=int(exchange.id), topk=int(exchange.topk), block_size=block_size,
        with_ids=with_ids, with_saturated=with_saturated, ordered=ordered,
    )
    kv_rows, counts, *rest = outs
    ids = rest.pop(0) if with_ids else None
    saturated = rest.pop(0) if with_saturated else None
    return MergeOutput(kv_rows, counts, ids, saturated)
