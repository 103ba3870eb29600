"""The result of one call on one rank, the same type on every path (no JAX import).

:func:`jax_dsa_exchange.topk_exchange_merge` (FFI and XLA paths) returns one
:class:`MergeOutput` of ``jax.Array``; ``jax_dsa_exchange.xla_path`` returns one;
``jax_dsa_exchange.reference.topk_merge`` / ``protocol_merge`` return one per rank
of NumPy arrays.  docs/DESIGN.md §3 defines the fields.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class MergeOutput(NamedTuple):
    kv_rows: Any  # int32 [R, K]: this rank's selected KV slots, ascending l, then -1
    counts: Any  # int32 [R]: valid entries of kv_rows
    ids: Any = None  # int32 [R, K]: every selected global position, owner-major, then -1
    saturated: Any = None  # int32 [R]: bitmask of saturated ranks
