"""NumPy reference: the oracle of docs/DESIGN.md §4 and the CPU model of the protocol (§5-§6).

Two independent computations of the same answer:

* :func:`topk_merge` is the oracle.  Per row it concatenates every rank's valid
  tokens, sorts them by (score as a float, descending; global position g,
  ascending) and keeps K.  It does not use the bit encodings at all, so it can
  judge them.
* :func:`protocol_merge` is the protocol as the GPU kernels run it: ``ord16`` /
  ``ord32`` keys, local top-N packed into words (layout.py), decoding into 64-bit global
  keys, round 1, the exact saturation rule, the rescue lists and round 2.  Its
  pieces (:func:`ord16`, :func:`ord32`, :func:`pack_local_topk`, :func:`decode_keys`,
  :func:`kth_key`, :func:`saturated_mask`, ...) are public so GPU tests can check
  kernel outputs bit-exactly.

Both return one :class:`~jax_dsa_exchange.output.MergeOutput` (NumPy arrays) per rank and must agree on every input.

Input checks (both functions): ``logits``, ``row_ends``, ``req_id`` and
``block_tables`` must be sequences of the same length W >= 1; each ``logits[q]``
is a 2-D ``ml_dtypes.bfloat16`` or ``float32`` array [R, L_q] with the same R and the same
dtype on every rank;
``row_ends[q]`` and ``req_id[q]`` are 1-D integer arrays [R] (int32 per docs/DESIGN.md §3;
any integer dtype whose values fit int32 is accepted); ``block_tables[q]`` is a
2-D integer array.  Wrong types raise TypeError, wrong shapes or values
ValueError, each naming the argument and rank.

Block-table lookups happen only for tokens that are selected.  A selected token
whose lookup is out of range (``req_id`` outside ``[0, num_requests)``, or a page
past the block table's row) stays selected (it is in ``ids`` and ``counts``) but
its ``kv_rows`` entry is -1: the same rule as the kernels and the XLA path, which
cannot raise from inside a jitted step and must never read out of bounds.
"""

from __future__ import annotations

from typing import Sequence

import ml_dtypes
import numpy as np

from . import layout
from .output import MergeOutput

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
SCORE_NP_DTYPES = tuple(np.dtype(name) for name in layout.SCORE_DTYPES)  # (ml_dtypes names bfloat16)
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


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


def _check_inputs(logits, row_ends, req_id, block_tables, topk, block_size, interleave=1):
    """Validate and normalize; returns (W, R, logits, row_ends, req_id, block_tables).

    Integer arrays come back as int64 (no overflow in the slot arithmetic);
    logits keep their dtype (bfloat16 or float32).
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
        if x.dtype not in SCORE_NP_DTYPES:
            raise TypeError(f"logits[{q}] must have dtype bfloat16 or float32, got {x.dtype}")
        if x.dtype != logits[0].dtype:
            raise TypeError(f"logits[{q}] has dtype {x.dtype}, logits[0] has {logits[0].dtype}: "
                            "every rank's scores must have the same dtype")
        if x.ndim != 2:
            raise ValueError(f"logits[{q}] must be 2-D [R, L], got shape {x.shape}")
        if x.shape[0] != logits[0].shape[0]:
            raise ValueError(f"logits[{q}] has R={x.shape[0]} rows, logits[0] has {logits[0].shape[0]}")
        lg.append(x)
    rows = lg[0].shape[0]
    if rows < 1:
        raise ValueError("logits have R=0 rows; need R >= 1")
    layout.check_interleave(interleave, world)

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
    """Physical KV slots of local indices ``l`` (docs/DESIGN.md §3); -1 where the lookup is out of range."""
    pages = l // block_size
    ok = (0 <= req < table.shape[0]) & (pages < table.shape[1])
    slots = np.full(l.shape, -1, np.int64)
    if ok.any():
        slots[ok] = table[req, pages[ok]].astype(np.int64) * block_size + l[ok] % block_size
    if slots.size and (slots.min() < _INT32_MIN or slots.max() > _INT32_MAX):
        raise ValueError(f"rank {rank} row {row}: KV slot overflows int32")
    return slots


def _build_results(selected, world, rows, topk, reqs, tables, block_size, saturated=None, interleave=1):
    """``selected[i]``: int64 array of the global positions picked for row i (any order)."""
    ids = np.full((rows, topk), -1, np.int32)
    kv = [np.full((rows, topk), -1, np.int32) for _ in range(world)]
    counts = [np.zeros(rows, np.int32) for _ in range(world)]
    for i, g in enumerate(selected):
        g = np.asarray(g, np.int64)
        owner, l = layout.owner_and_local(g, world, interleave)
        order = np.lexsort((l, owner))  # owner-major: ascending (owner rank, local index)
        g, owner, l = g[order], owner[order], l[order]
        ids[i, : g.size] = g
        for q in range(world):
            lq = l[owner == q]  # already ascending in l
            counts[q][i] = lq.size
            if lq.size:
                kv[q][i, : lq.size] = _kv_slot(tables[q], int(reqs[q][i]), lq, block_size, q, i)
    sat = np.zeros(rows, np.int32) if saturated is None else np.asarray(saturated, np.int32)
    return [MergeOutput(kv_rows=kv[q], counts=counts[q], ids=ids.copy(), saturated=sat.copy())
            for q in range(world)]


# ---------------------------------------------------------------------------
# The oracle (docs/DESIGN.md §4)


def topk_merge(logits, row_ends, req_id, block_tables, *, topk, block_size, interleave=1):
    """Exact global top-K of every row over all W ranks (docs/DESIGN.md §4), the oracle.

    Per row i: every rank q contributes its tokens l < clamp(row_ends[q][i], 0, L_q)
    whose score is not NaN, with global position g = layout.global_position(l, q, W,
    interleave) (``l * W + q`` for interleave 1).  They are sorted by (score descending,
    compared as floats of the logits' dtype so -0.0 == +0.0; g ascending) and the first
    min(K, count) are kept.  Returns one :class:`MergeOutput` per rank (``saturated`` is
    all zeros here).  See the module docstring for the input checks and the -1 ``kv_rows``
    of bad block-table lookups.
    """
    world, rows, lg, ends, reqs, tables = _check_inputs(
        logits, row_ends, req_id, block_tables, topk, block_size, interleave)
    selected = []
    for i in range(rows):
        scores, gids = [], []
        for q in range(world):
            row = lg[q][i].astype(np.float32)  # exact for both dtypes
            n = int(np.clip(ends[q][i], 0, row.size))
            l = np.arange(n, dtype=np.int64)
            s = row[:n]
            keep = ~np.isnan(s)
            scores.append(s[keep])
            gids.append(layout.global_position(l[keep], q, world, interleave))
        s = np.concatenate(scores)
        g = np.concatenate(gids)
        # -s + 0.0 turns -0.0 into +0.0 (belt and braces: sorting compares with <
        # anyway, where -0.0 == +0.0).  lexsort: last key is the primary one.
        order = np.lexsort((g, -s + np.float32(0.0)))
        selected.append(g[order[:topk]])
    return _build_results(selected, world, rows, topk, reqs, tables, block_size, interleave=interleave)


# ---------------------------------------------------------------------------
# The protocol model (docs/DESIGN.md §5-§6), piece by piece as the kernels do it


def bf16_bits(x) -> np.ndarray:
    """The raw uint16 bit patterns of a bfloat16 array (a view, no copy)."""
    x = np.asarray(x)
    if x.dtype != BF16:
        raise TypeError(f"expected a bfloat16 array, got dtype {x.dtype}")
    return x.view(np.uint16)


def score_bits(x) -> np.ndarray:
    """The raw bit patterns of scores: bfloat16 values -> uint16, float32 values -> uint32;
    uint16 / uint32 bits are returned as they are (a view, no copy)."""
    x = np.asarray(x)
    if x.dtype == BF16:
        return x.view(np.uint16)
    if x.dtype == F32:
        return x.view(np.uint32)
    if x.dtype in (np.uint16, np.uint32):
        return x
    raise TypeError(f"expected bfloat16 / float32 values or uint16 / uint32 bits, got dtype {x.dtype}")


def _bits(x) -> np.ndarray:
    """Accept bf16 values or their uint16 bits; return the uint16 bits."""
    x = np.asarray(x)
    if x.dtype == BF16:
        return x.view(np.uint16)
    if x.dtype != np.uint16:
        if not np.issubdtype(x.dtype, np.integer) or (x.size and (x.min() < 0 or x.max() > 0xFFFF)):
            raise TypeError(f"expected bfloat16 values or uint16 bits, got dtype {x.dtype}")
        x = x.astype(np.uint16)
    return x


def _bits32(x) -> np.ndarray:
    """Accept float32 values or their uint32 bits; return the uint32 bits."""
    x = np.asarray(x)
    if x.dtype == F32:
        return x.view(np.uint32)
    if x.dtype != np.uint32:
        if not np.issubdtype(x.dtype, np.integer) or (x.size and (x.min() < 0 or x.max() > 0xFFFFFFFF)):
            raise TypeError(f"expected float32 values or uint32 bits, got dtype {x.dtype}")
        x = x.astype(np.uint32)
    return x


def is_nan_bits(bits) -> np.ndarray:
    """NaN test on bf16 bits (docs/DESIGN.md §5): exponent all ones and a nonzero mantissa."""
    b = _bits(bits).astype(np.uint32)
    return (b & 0x7FFF) > 0x7F80


def is_nan_bits32(bits) -> np.ndarray:
    """NaN test on float32 bits: exponent all ones and a nonzero mantissa."""
    b = _bits32(bits).astype(np.uint64)
    return (b & 0x7FFFFFFF) > 0x7F800000


def ord16(bits) -> np.ndarray:
    """Order-preserving map of bf16 bits into 1..0xFFFF (docs/DESIGN.md §5), as uint32.

    -0 is canonicalized to +0 first, so both map to 0x8000.  Positive values set
    the top bit (above every negative); negative values are bit-inverted so a
    larger magnitude gives a smaller code.  -inf -> 0x007F, +inf -> 0xFF80.
    NaN (either sign, any payload) is not a candidate and maps to 0, the code
    reserved for "no candidate".  Accepts bf16 values or uint16 bits.
    """
    b = _bits(bits).astype(np.uint32)
    b = np.where(b == 0x8000, 0, b)  # -0 -> +0
    code = np.where(b & 0x8000, ~b & 0xFFFF, b | 0x8000)
    return np.where(is_nan_bits(b), 0, code).astype(np.uint32)


def ord32(bits) -> np.ndarray:
    """Order-preserving map of float32 bits into 1..0xFFFFFFFF (docs/DESIGN.md §5), as uint64.

    The rule of :func:`ord16` on 32 bits: -0 -> +0 (0x80000000), a clear sign bit set, a set
    one inverted; -inf -> 0x007FFFFF, +inf -> 0xFF800000; NaN -> 0 ("no candidate").
    Accepts float32 values or uint32 bits.
    """
    b = _bits32(bits).astype(np.uint64)
    b = np.where(b == 0x80000000, 0, b)  # -0 -> +0
    code = np.where(b & 0x80000000, ~b & 0xFFFFFFFF, b | 0x80000000)
    return np.where(is_nan_bits32(b), 0, code).astype(np.uint64)


def score_code(x) -> np.ndarray:
    """ord16 of bfloat16 scores (values or uint16 bits), ord32 of float32 ones (values or
    uint32 bits), as uint64: the score part of every key (docs/DESIGN.md §5)."""
    b = score_bits(x)
    return ord32(b) if b.dtype == np.uint32 else ord16(b).astype(np.uint64)


def _score_dtype_of(bits) -> str:
    return "float32" if bits.dtype == np.uint32 else "bfloat16"


def local_topk_indices(logits_row, row_end, n) -> np.ndarray:
    """Local indices l of a rank's top-n of one row (docs/DESIGN.md §6.1), ascending l.

    Valid tokens are l < clamp(row_end, 0, L) with a non-NaN score; order is
    the score code descending, then l ascending (= g ascending within one rank).  Fewer
    than n if fewer are valid.  ``logits_row``: bf16 / float32 values or their bits [L].
    """
    code = score_code(logits_row).astype(np.int64)
    end = int(np.clip(int(row_end), 0, code.size))
    l = np.arange(end, dtype=np.int64)
    code = code[:end]
    l = l[code != 0]
    code = code[code != 0]
    order = np.lexsort((l, -code))  # primary: code descending; then l ascending
    return np.sort(l[order[:n]])


def pack_local_topk(logits_row_bits, row_end, n) -> np.ndarray:
    """Packed words of a rank's local top-n of one row (docs/DESIGN.md §5, layout.py).

    Returns uint32 [layout.row_words(n, dtype)], candidates by ascending local index l, empty
    ones (zero) last.  bfloat16 scores (values or uint16 bits): candidate j is
    ``ord16 << 16 | (0xFFFF - (l & 0xFFFF))``, bit 16 of l is bit ``j % 32`` of word
    ``n + j // 32``, the rest zero padding.  float32 scores (values or uint32 bits): candidate
    j is the word pair ``(ord32, l)`` at words ``2 j, 2 j + 1``.
    """
    if not isinstance(n, (int, np.integer)) or n < 1 or n % 32:
        raise ValueError(f"n={n!r} must be a positive multiple of 32")
    bits = score_bits(logits_row_bits) if np.asarray(logits_row_bits).dtype in (F32, np.uint32) \
        else _bits(logits_row_bits)
    if bits.ndim != 1:
        raise ValueError(f"logits_row_bits must be 1-D, got shape {bits.shape}")
    if bits.size > layout.MAX_LOCAL_LEN:
        raise ValueError(f"L={bits.size} exceeds {layout.MAX_LOCAL_LEN} (17-bit local index)")
    dtype = _score_dtype_of(bits)
    l = local_topk_indices(bits, row_end, n).astype(np.uint32)
    words = np.zeros(layout.row_words(n, dtype), np.uint32)
    if dtype == "float32":
        words[0 : 2 * l.size : 2] = ord32(bits[l]).astype(np.uint32)
        words[1 : 2 * l.size : 2] = l
        return words
    j = np.arange(l.size)
    words[: l.size] = (ord16(bits[l]) << 16) | (0xFFFF - (l & 0xFFFF))
    # np.bitwise_or.at: several candidates share one mask word.
    np.bitwise_or.at(words, n + j // 32, ((l >> 16) & 1) << (j % 32).astype(np.uint32))
    return words


def unpack_candidates(words, n, score_dtype="bfloat16") -> tuple:
    """(score code uint64 [n], local index int64 [n]) of a packed row; code 0 = empty."""
    dtype = layout.score_dtype_name(score_dtype)
    words = np.asarray(words, np.uint32)
    if words.shape != (layout.row_words(n, dtype),):
        raise ValueError(f"words has shape {words.shape}, expected ({layout.row_words(n, dtype)},) "
                         f"for n={n}, {dtype}")
    if dtype == "float32":
        return words[0 : 2 * n : 2].astype(np.uint64), words[1 : 2 * n : 2].astype(np.int64)
    w = words[:n].astype(np.uint64)
    j = np.arange(n)
    hi = (words[n + j // 32].astype(np.uint64) >> (j % 32).astype(np.uint64)) & 1
    l = (np.uint64(0xFFFF) - (w & np.uint64(0xFFFF))) | (hi << np.uint64(16))
    return w >> np.uint64(16), l.astype(np.int64)


def decode_keys(words, n, rank, world, *, interleave=1, score_dtype="bfloat16") -> np.ndarray:
    """Global 64-bit keys of a packed row from ``rank`` (docs/DESIGN.md §5); 0 = empty.

    ``code << G | (2**G - 1 - g)`` with code the ord16 / ord32 of the score,
    g = layout.global_position(l, rank, world, interleave) and G = layout.gid_bits(world,
    interleave).  Returns uint64 [n], in the list's order.
    """
    if not 0 <= rank < world:
        raise ValueError(f"rank={rank} must be in [0, world={world})")
    code, l = unpack_candidates(words, n, score_dtype)
    G = layout.gid_bits(world, interleave)
    g = layout.global_position(l, rank, world, interleave).astype(np.uint64)
    keys = (code << np.uint64(G)) | (np.uint64((1 << G) - 1) - g)
    return np.where(code == 0, np.uint64(0), keys)


def key_to_gid(keys, world, interleave=1) -> np.ndarray:
    """Global positions g of (nonzero) 64-bit keys, int64."""
    G = layout.gid_bits(world, interleave)
    mask = np.uint64((1 << G) - 1)
    return (mask - (np.asarray(keys, np.uint64) & mask)).astype(np.int64)


def top_keys(keys, k) -> np.ndarray:
    """The k largest nonzero keys, descending (fewer if fewer exist)."""
    keys = np.asarray(keys, np.uint64)
    keys = keys[keys != 0]
    return np.sort(keys)[::-1][:k]


def kth_key(keys, k) -> int:
    """T of round 1 (docs/DESIGN.md §6.3): the k-th largest nonzero key, 0 if fewer than k."""
    top = top_keys(keys, k)
    return int(top[k - 1]) if top.size == k else 0


def saturated_mask(lists, topk, local_topk) -> tuple[int, int]:
    """Round 1 and the exact saturation rule (docs/DESIGN.md §6.3-§6.4) for one row.

    ``lists[q]``: uint64 [N] decoded round-1 keys of rank q (0 = empty).
    Returns ``(mask, T)``: rank q's bit is set iff its list is full (N nonzero
    keys) and its smallest key is strictly greater than T (full 64-bit keys).
    """
    T = kth_key(np.concatenate([np.asarray(x, np.uint64) for x in lists]), topk)
    mask = 0
    for q, keys in enumerate(lists):
        keys = np.asarray(keys, np.uint64)
        valid = keys[keys != 0]
        if valid.size == local_topk and int(valid.min()) > T:
            mask |= 1 << q
    # Each saturated rank puts N keys above T into the top K, so s * N <= K - 1.
    assert bin(mask).count("1") <= layout.rescue_slots(topk, local_topk), (mask, T)
    return mask, T


def _round1_lists(bits, ends, i, n, world, interleave):
    """The W decoded round-1 lists of row i (what every rank receives)."""
    dtype = _score_dtype_of(bits[0])
    return [decode_keys(pack_local_topk(bits[q][i], ends[q][i], n), n, q, world,
                        interleave=interleave, score_dtype=dtype) for q in range(world)]


def saturated_masks(logits, row_ends, *, topk, local_topk, interleave=1) -> np.ndarray:
    """Saturated bitmask of every row (int32 [R]), from per-rank logits and row_ends."""
    world = len(logits)
    bits = [score_bits(x) for x in logits]
    rows = bits[0].shape[0]
    return np.array([saturated_mask(_round1_lists(bits, row_ends, i, local_topk, world, interleave),
                                    topk, local_topk)[0] for i in range(rows)], np.int32)


def round2_keys(lists, rescue, mask, T, topk) -> np.ndarray:
    """Final selection (docs/DESIGN.md §6.5): top-K keys, descending.

    Non-saturated ranks contribute their round-1 keys >= T (keys below T can
    never make the top K: at least K keys >= T are already in round 1, and each
    saturated rank's K-list contains its round-1 list); saturated ranks
    contribute their rescue K-lists ``rescue[q]``.  With mask == 0 this is the
    round-1 top K.
    """
    parts = []
    for q, keys in enumerate(lists):
        if mask >> q & 1:
            parts.append(np.asarray(rescue[q], np.uint64))
        else:
            keys = np.asarray(keys, np.uint64)
            parts.append(keys[keys >= np.uint64(T)])
    return top_keys(np.concatenate(parts), topk)


def protocol_merge(logits, row_ends, req_id, block_tables, *, topk, local_topk, block_size, interleave=1):
    """CPU model of the two-round protocol (docs/DESIGN.md §5-§6); equals :func:`topk_merge`.

    Per row: every rank packs its local top-N (:func:`pack_local_topk`), every
    rank decodes the W lists (:func:`decode_keys`) and runs round 1 and the
    saturation rule (:func:`saturated_mask`); saturated ranks pack their local
    top-K, decoded like the round-1 lists; round 2 (:func:`round2_keys`) gives
    the final keys.  Returns one :class:`MergeOutput` per rank with
    ``saturated`` = the bitmask of saturated ranks of each row.  Configuration
    limits are docs/DESIGN.md §2 (layout.check_config, L <= 2**17); input checks and the
    -1 ``kv_rows`` of bad block-table lookups are as in :func:`topk_merge`.
    """
    if not isinstance(logits, Sequence) or isinstance(logits, np.ndarray):
        raise TypeError(f"logits must be a sequence of W per-rank arrays, got {type(logits).__name__}")
    layout.check_config(len(logits), topk, local_topk)
    world, rows, lg, ends, reqs, tables = _check_inputs(
        logits, row_ends, req_id, block_tables, topk, block_size, interleave)
    for q, x in enumerate(lg):
        if not 1 <= x.shape[1] <= layout.MAX_LOCAL_LEN:
            raise ValueError(f"logits[{q}] has L={x.shape[1]}, must be in [1, {layout.MAX_LOCAL_LEN}]")
    bits = [score_bits(x) for x in lg]
    dtype = _score_dtype_of(bits[0])
    n = local_topk

    selected, sat = [], np.zeros(rows, np.int32)
    for i in range(rows):
        # Round 1: what every rank receives from every rank (its own included).
        lists = _round1_lists(bits, ends, i, n, world, interleave)
        mask, T = saturated_mask(lists, topk, n)
        # Rescue: saturated ranks push their local top-K lists.
        rescue = {q: decode_keys(pack_local_topk(bits[q][i], ends[q][i], topk), topk, q, world,
                                 interleave=interleave, score_dtype=dtype)
                  for q in range(world) if mask >> q & 1}
        final = round2_keys(lists, rescue, mask, T, topk)
        selected.append(key_to_gid(final, world, interleave))
        sat[i] = mask
    return _build_results(selected, world, rows, topk, reqs, tables, block_size, saturated=sat,
                          interleave=interleave)
