"""Every private JAX / XLA API the package uses, and only here.

The rest of the package uses public APIs: ``jax.extend.core`` (Primitive, Jaxpr,
Effect, jaxprs_in_params, no_effects), ``jax.core.ShapedArray``, ``jax.ffi``
(ffi_lowering, register_ffi_target, pycapsule, include_dir), the primitive-rule
tables of ``jax.interpreters`` (``ad``, ``batching``, ``mlir.register_lowering``,
``mlir.ir``, ``mlir.TokenSet``) and ``jax.extend.mlir.dialects.stablehlo``; all of
them exist in jax 0.11.2 and 0.12.0.1.

Each wrapper below names the jax versions it was checked on (0.11.2: the GPU
machine; 0.12.0.1: the CPU development machine) and what breaks without it.  Most
are looked up when called, so importing this module imports nothing private;
the few that a module needs at import time say so.
"""

from __future__ import annotations

CHECKED_ON = ("0.11.2", "0.12.0.1")


# ----------------------------------------------------------------- op.py: the primitive


def register_ordered_effect(effect_type) -> None:
    """Makes ``effect_type`` an ordered, shardable, lowerable effect allowed inside
    control flow (as ``io_callback(ordered=True)``'s): ``jax._src.effects``'s type sets.
    Checked on 0.11.2, 0.12.0.1.  Without it ``ordered="effect"`` cannot be traced
    (JAX refuses an unknown effect in jit, scan, while and shard_map)."""
    from jax._src import effects

    effects.ordered_effects.add_type(effect_type)
    effects.shardable_ordered_effects.add_type(effect_type)
    effects.lowerable_effects.add_type(effect_type)
    effects.control_flow_allowed_effects.add_type(effect_type)


def apply_primitive(prim, *args, **params):
    """``jax._src.dispatch.apply_primitive``: an eager call of a primitive through a
    cached one-primitive jit (what JAX's own primitives do).  Checked on 0.11.2,
    0.12.0.1.  Without it the op works only under ``jax.jit``."""
    from jax._src import dispatch

    return dispatch.apply_primitive(prim, *args, **params)


def dce_rules() -> dict:
    """``jax._src.interpreters.partial_eval.dce_rules``: the per-primitive dead-code
    rules (their signature changed between 0.11 and 0.12, see op._keep_when_unused).
    Checked on 0.11.2, 0.12.0.1.  Without it an unused call, or a loop / inner jit whose
    only effect is the exchange, is dropped on some ranks and pairs calls wrongly."""
    from jax._src.interpreters import partial_eval

    return partial_eval.dce_rules


def abstract_token():
    """``jax._src.core.abstract_token``, the aval of the custom calls' ordering token
    (``jax.extend.core.AbstractToken()`` is a new, unequal instance).  Checked on 0.11.2,
    0.12.0.1.  Without it the token operand/result of the custom calls has no aval."""
    from jax._src import core

    return core.abstract_token


def sharding_contexts() -> tuple:
    """(ShardingContext, SPMDAxisContext) of ``jax._src.sharding_impls``: which axis
    context a lowering runs in.  Checked on 0.11.2, 0.12.0.1.  Without them the op cannot
    refuse a GSPMD-partitioned jit (one custom call would then run for many ranks)."""
    from jax._src import sharding_impls

    return sharding_impls.ShardingContext, sharding_impls.SPMDAxisContext


def jaxlib_version() -> tuple:
    """``jax._src.lib.version``: the running jaxlib's version tuple.  Checked on 0.11.2,
    0.12.0.1.  Without it op.dynamic_slice_fusion_workaround_needed cannot compare
    versions (it then keeps the workaround)."""
    from jax._src.lib import version

    return tuple(version)


def clear_runtime_tokens() -> None:
    """``jax._src.dispatch.runtime_tokens.clear()``: drops the ordered-effect token of a
    failed call, which JAX would re-raise at the next ordered dispatch and at exit (seen
    on 0.11.2: such an exit aborted the jax.distributed leader).  Checked on 0.11.2,
    0.12.0.1.  Without it a failed exchange's error comes back at every later ordered
    call of the process."""
    from jax._src import dispatch

    dispatch.runtime_tokens.clear()


def full_like_aval(ctx, value, aval):
    """``jax._src.interpreters.mlir.full_like_aval`` (tests' CPU stand-in lowering).
    Checked on 0.11.2, 0.12.0.1."""
    from jax._src.interpreters import mlir

    return mlir.full_like_aval(ctx, value, aval)


# ----------------------------------------------------------------- _ffi.py: registration


def custom_call_target_traits():
    """``jax._src.lib.xla_client.CustomCallTargetTraits`` or None: the traits XLA takes
    from a target's registration (``jax.ffi.register_ffi_target(..., traits=)``).
    Checked on 0.11.2, 0.12.0.1.  Without it the registration's traits default, and
    XLA may disagree with the handler's own (command-buffer) trait."""
    try:
        from jax._src.lib import xla_client

        return xla_client.CustomCallTargetTraits
    except (ImportError, AttributeError):  # pragma: no cover - other jaxlib layouts
        return None


# ----------------------------------------------------------------- distributed.py, rendezvous.py


def distributed_state():
    """``jax._src.distributed.global_state``: the ``jax.distributed`` client (key-value
    store, barriers) and service.  Checked on 0.11.2, 0.12.0.1.  Without it there is no
    rendezvous of the ranks (Exchange.create) and no clean multi-process shutdown."""
    from jax._src import distributed

    return distributed.global_state


def cluster_classes() -> tuple | None:
    """(SlurmCluster, OmpiCluster) of ``jax._src.clusters`` (``is_env_present()``,
    ``name``), or None when the module moved.  Checked on 0.11.2, 0.12.0.1.  Without it
    distributed.detected_cluster falls back to the environment variables they test."""
    try:
        from jax._src.clusters import OmpiCluster, SlurmCluster
    except (ImportError, AttributeError):  # pragma: no cover - another jax layout
        return None
    return SlurmCluster, OmpiCluster
