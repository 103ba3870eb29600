"""The argument checks of one merge call, shared by every path (no JAX import).

``op.topk_exchange_merge`` (FFI and XLA paths) and ``xla_path.xla_topk_merge`` call
:func:`check_call` before any custom call or collective, so a bad argument raises the
same exception with the same message whichever path the caller took: ``TypeError``
for a wrong type or dtype, ``ValueError`` for a wrong shape or an out-of-range value,
each naming the argument.  Shapes and dtypes are static, so the checks run at trace
time and cost nothing per step.  The messages of the transformations that no path
supports (gradient, vmap) are here too, for the same reason.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from . import layout

BF16 = np.dtype(ml_dtypes.bfloat16)
SCORE_DTYPES = tuple(np.dtype(name) for name in layout.SCORE_DTYPES)  # (ml_dtypes names bfloat16)
INT32 = np.dtype(np.int32)

NO_GRAD = (
    "the top-K merge (topk_exchange_merge / xla_topk_merge, every path) has no differentiation "
    "rule: its outputs are integer slots chosen across ranks; wrap its logits in "
    "jax.lax.stop_gradient to differentiate the rest of the step")
NO_VMAP = (
    "the top-K merge (topk_exchange_merge / xla_topk_merge, every path) has no batching rule "
    "(vmap): one call is one exchange round over the [R, L] rows of every rank; fold the batch "
    "into the row axis R instead")


def _dtype(x, name) -> np.dtype:
    dt = getattr(x, "dtype", None)
    if dt is None or not hasattr(x, "shape"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    return np.dtype(dt)


def _shape(x) -> tuple:
    return tuple(int(d) for d in x.shape)


def check_flags(*, block_size, with_ids, with_saturated) -> None:
    """The static arguments every path takes."""
    for name, v in (("with_ids", with_ids), ("with_saturated", with_saturated)):
        if not isinstance(v, (bool, np.bool_)):
            raise TypeError(f"{name} must be a bool, got {v!r}")
    if isinstance(block_size, (bool, np.bool_)) or not isinstance(block_size, (int, np.integer)):
        raise TypeError(f"block_size must be an int, got {block_size!r}")
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")


def check_arrays(logits, row_ends, req_id, block_table, *, max_rows=None, score_dtype=None) -> None:
    """Dtypes, ranks and shapes of one rank's arrays (docs/DESIGN.md §3); ``max_rows``:
    the exchange's row limit (the FFI path), None where there is none (the XLA path);
    ``score_dtype``: the exchange's score dtype name, which the logits must have (None: any
    score dtype)."""
    dt = _dtype(logits, "logits")
    if dt not in SCORE_DTYPES:  # a silent rounding would change the ties
        raise TypeError(f"logits must be bfloat16 or float32, got {dt}")
    if score_dtype is not None and dt.name != score_dtype:
        raise TypeError(f"logits are {dt.name} but the exchange's GPU kernels take {score_dtype} "
                        f"(score_dtype={score_dtype}): pass {score_dtype} logits, or merge {dt.name} scores on the "
                        "XLA path (path='xla' with axis_name, or xla_path.xla_topk_merge)")
    if len(logits.shape) != 2:
        raise ValueError(f"logits must be [R, L], got shape {_shape(logits)}")
    rows, cols = _shape(logits)
    if rows < 1:
        raise ValueError(f"logits has R={rows} rows; need R >= 1")
    if max_rows is not None and rows > max_rows:
        raise ValueError(f"logits has R={rows} rows > the exchange's max_rows={max_rows}")
    if not 1 <= cols <= layout.MAX_LOCAL_LEN:
        raise ValueError(f"logits has L={cols} columns; need 1 <= L <= {layout.MAX_LOCAL_LEN} (2**17)")
    # Integer arrays must be int32 exactly: a float would be truncated and a wider or
    # narrower integer converted without a word (the kernels read int32 words).
    for name, x in (("row_ends", row_ends), ("req_id", req_id)):
        if _dtype(x, name) != INT32:
            raise TypeError(f"{name} must be int32, got {_dtype(x, name)}")
        if _shape(x) != (rows,):  # (1,) would otherwise broadcast to every row
            raise ValueError(f"{name} must have shape (R,) = ({rows},), got {_shape(x)}")
    if _dtype(block_table, "block_table") != INT32:
        raise TypeError(f"block_table must be int32, got {_dtype(block_table, 'block_table')}")
    if len(block_table.shape) != 2 or min(_shape(block_table)) < 1:
        raise ValueError(f"block_table must be [num_requests >= 1, max_pages >= 1], got shape {_shape(block_table)}")


def check_call(logits, row_ends, req_id, block_table, *, world, topk, local_topk, block_size, with_ids,
               with_saturated, max_rows=None, interleave=1, score_dtype=None) -> None:
    """Every check of one call, in one order (flags, configuration, arrays): what each
    path runs first.  ``world``/``topk``/``local_topk``/``interleave``: docs/DESIGN.md §2
    limits (``layout.check_config``, ``layout.check_interleave``)."""
    check_flags(block_size=block_size, with_ids=with_ids, with_saturated=with_saturated)
    layout.check_config(world, topk, local_topk)
    layout.check_interleave(interleave, world)
    check_arrays(logits, row_ends, req_id, block_table, max_rows=max_rows, score_dtype=score_dtype)


def check_interleave_matches(interleave, exchange_interleave: int, exchange_id, world: int) -> int:
    """A call's ``interleave`` (None: the exchange's) against its exchange's, whose kernels and
    buffers are built for one size: the checks of every path first, then a ValueError naming
    both values."""
    if interleave is None:
        return exchange_interleave
    layout.check_interleave(interleave, world)
    if interleave != exchange_interleave:
        raise ValueError(f"interleave={interleave} but exchange {exchange_id} was created with "
                         f"interleave={exchange_interleave}")
    return exchange_interleave
