"""NumPy reference: the oracle of SPEC §4 and the CPU model of the protocol (§5-§6).

Two independent computations of the same answer:

* :func:`topk_merge` is the oracle.  Per row it concatenates every rank's valid
  tokens, sorts them by (score as a float, descending; global position g,
  ascending) and keeps K.  It does not use the bit encodings at all, so it can
  judge them.
* :func:`protocol_merge` is the protocol as the GPU kernels run it: ``ord16``
  keys, local top-N packed into words (layout.py), decoding into 64-bit global
  keys, round 1, the exact saturation rule, the rescue lists and round 2.  Its
  pieces (:func:`ord16`, :func:`pack_local_topk`, :func:`decode_keys`,
  :func:`kth_key`, :func:`saturated_mask`, ...) are public so GPU tests can check
  kernel outputs bit-exactly.

Both return one :class:`MergeResult` per rank and must agree on every input.

Input checks (both functions): ``logits``, ``row_ends``, ``req_id`` and
``block_tables`` must be sequences of the same length W >= 1; each ``logits[q]``
is a 2-D ``ml_dtypes.bfloat16`` array [R, L_q] with the same R on every rank;
``row_ends[q]`` and ``req_id[q]`` are 1-D integer arrays [R] (int32 per SPEC;
any integer dtype whose values fit int32 is accepted); ``block_tables[q]`` is a
2-D integer array.  Wrong types raise TypeError, wrong shapes or values
ValueError, each naming the argument and rank.

Block-table lookups happen only for tokens that are selected (as the kernel
does): a row whose ``req_id`` is outside ``[0, num_requests)`` or whose block
table row has too few pages for a selected token raises IndexError naming the
rank, the row and the offending value.  Rows of a rank that selects nothing are
never looked up, so their ``req_id`` may be anything.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import ml_dtypes
import numpy as np

from . import layout

BF16 = np.dtype(ml_dtypes.bfloat16)
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


@dataclasses.dataclass(frozen=True)
class MergeResult:
    """The outputs of one rank (SPEC §3), all int32 NumPy arrays."""

    kv_rows: np.ndarray  # [R, K]: this rank's selected KV slots, ascending l, then -1
    counts: np.ndarray  # [R]: valid entries of kv_rows
    ids: np.ndarray  # [R, K]: every selected global position, owner-major, then -1
    saturated: np.ndarray  # [R]: bitmask of saturated ranks (zeros from the oracle)


# ---------------------------------------------------------------------------
# Input checks


def _check_positive_int(name: str, v) -> None:
    if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
        raise TypeError(f"{name} must be an int, got {type(v).__name__} {v!r}")
    if v < 1:
        raise ValueError(f"{name}={v} must be >= 1")


def _as_int_array(name: str, q: int, a, ndim: int) -> np.ndarray:
    a = np.asarray(a)
    if not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"{name}[{q}] must be an integer (int32) array, got dtype {a.dtype}")
    if a.ndim != ndim:
        raise ValueError(f"{name}[{q}] must be {ndim}-D, got shape {a.shape}")
    if a.size and (a.min() < _INT32_MIN or a.max() > _INT32_MAX):
        raise ValueError(f"{name}[{q}] has values outside int32")
    return a.astype(np.int64)


def _check_inputs(logits, row_ends, req_id, block_tables, topk, block_size):
    """Validate and normalize; returns (W, R, logits, row_ends, req_id, block_tables).

    Integer arrays come back as int64 (no overflow in the slot arithmetic);
    logits stay bfloat16.
    """
    _check_positive_int("topk", topk)
    _check_positive_int("block_size", block_size)
    seqs = {"logits": logits, "row_ends": row_ends, "req_id": req_id, "block_tables": block_tables}
    for name, s in seqs.items():
        if isinstance(s, np.ndarray) or not isinstance(s, Sequence):
            raise TypeError(f"{name} must be a sequence (list/tuple) of W per-rank arrays, "
                            f"got {type(s).__name__}")
    world = len(logits)
    if world < 1:
        raise ValueError("logits is empty: need at least one rank (W >= 1)")
    for name, s in seqs.items():
        if len(s) != world:
            raise ValueError(f"len({name})={len(s)} != W={world} (len(logits))")

    lg = []
    for q, x in enumerate(logits):
        if not isinstance(x, np.ndarray):
            raise TypeError(f"logits[{q}] must be a NumPy array, got {type(x).__name__}")
        if x.dtype != BF16:
            raise TypeError(f"logits[{q}] must have dtype bfloat16, got {x.dtype}")
        if x.ndim != 2:
            raise ValueError(f"logits[{q}] must be 2-D [R, L], got shape {x.shape}")
        if x.shape[0] != logits[0].shape[0]:
            raise ValueError(f"logits[{q}] has R={x.shape[0]} rows, logits[0] has {logits[0].shape[0]}")
        lg.append(x)
    rows = lg[0].shape[0]
    if rows < 1:
        raise ValueError("logits have R=0 rows; need R >= 1")

    ends, reqs, tables = [], [], []
    for q in range(world):
        e = _as_int_array("row_ends", q, row_ends[q], 1)
        r = _as_int_array("req_id", q, req_id[q], 1)
        t = _as_int_array("block_tables", q, block_tables[q], 2)
        if e.shape != (rows,):
            raise ValueError(f"row_ends[{q}] has shape {e.shape}, expected ({rows},)")
        if r.shape != (rows,):
            raise ValueError(f"req_id[{q}] has shape {r.shape}, expected ({rows},)")
        ends.append(e)
        reqs.append(r)
        tables.append(t)
    return world, rows, lg, ends, reqs, tables


# ---------------------------------------------------------------------------
# Outputs from the selected global positions (shared by oracle and model)


def _kv_slot(table: np.ndarray, req: int, l: np.ndarray, block_size: int, rank: int, row: int):
    """Physical KV slots of local indices ``l`` (SPEC §3), with IndexError on a bad lookup."""
    if not 0 <= req < table.shape[0]:
        raise IndexError(f"rank {rank} row {row}: req_id={req} is outside the block table "
                         f"of {table.shape[0]} requests")
    pages = l // block_size
    if pages.size and pages.max() >= table.shape[1]:
        raise IndexError(f"rank {rank} row {row}: selected local index {int(l.max())} needs page "
                         f"{int(pages.max())}, block table has {table.shape[1]} pages")
    slots = table[req, pages] * block_size + l % block_size
    if slots.size and (slots.min() < _INT32_MIN or slots.max() > _INT32_MAX):
        raise ValueError(f"rank {rank} row {row}: KV slot overflows int32")
    return slots


def _build_results(selected, world, rows, topk, reqs, tables, block_size, saturated=None):
    """``selected[i]``: int64 array of the global positions picked for row i (any order)."""
    ids = np.full((rows, topk), -1, np.int32)
    kv = [np.full((rows, topk), -1, np.int32) for _ in range(world)]
    counts = [np.zeros(rows, np.int32) for _ in range(world)]
    for i, g in enumerate(selected):
        g = np.asarray(g, np.int64)
        owner, l = g % world, g // world
        order = np.lexsort((l, owner))  # owner-major: ascending (g mod W, g div W)
        g, owner, l = g[order], owner[order], l[order]
        ids[i, : g.size] = g
        for q in range(world):
            lq = l[owner == q]  # already ascending in l
            counts[q][i] = lq.size
            if lq.size:
                kv[q][i, : lq.size] = _kv_slot(tables[q], int(reqs[q][i]), lq, block_size, q, i)
    sat = np.zeros(rows, np.int32) if saturated is None else np.asarray(saturated, np.int32)
    return [MergeResult(kv_rows=kv[q], counts=counts[q], ids=ids.copy(), saturated=sat.copy())
            for q in range(world)]


# ---------------------------------------------------------------------------
# The oracle (SPEC §4)


def topk_merge(logits, row_ends, req_id, block_tables, *, topk, block_size):
    """Exact global top-K of every row over all W ranks (SPEC §4), the oracle.

    Per row i: every rank q contributes its tokens l < clamp(row_ends[q][i], 0, L_q)
    whose score is not NaN, with global position g = l * W + q.  They are sorted
    by (score descending, compared as floats so -0.0 == +0.0; g ascending) and the
    first min(K, count) are kept.  Returns one :class:`MergeResult` per rank
    (``saturated`` is all zeros here).  See the module docstring for the input
    checks and the IndexError on bad block-table lookups.
    """
    world, rows, lg, ends, reqs, tables = _check_inputs(
        logits, row_ends, req_id, block_tables, topk, block_size)
    selected = []
    for i in range(rows):
        scores, gids = [], []
        for q in range(world):
            row = lg[q][i].astype(np.float32)
            n = int(np.clip(ends[q][i], 0, row.size))
            l = np.arange(n, dtype=np.int64)
            s = row[:n]
            keep = ~np.isnan(s)
            scores.append(s[keep])
            gids.append(l[keep] * world + q)
        s = np.concatenate(scores)
        g = np.concatenate(gids)
        # -s + 0.0 turns -0.0 into +0.0 (belt and braces: sorting compares with <
        # anyway, where -0.0 == +0.0).  lexsort: last key is the primary one.
        order = np.lexsort((g, -s + np.float32(0.0)))
        selected.append(g[order[:topk]])
    return _build_results(selected, world, rows, topk, reqs, tables, block_size)
