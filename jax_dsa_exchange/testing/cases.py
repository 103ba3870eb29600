"""Shared test inputs: random and adversarial merge cases (docs/DESIGN.md §4, §6.4).

A :class:`Case` is a full set of per-rank inputs for one call of the merge, so
the NumPy reference, the XLA path and the GPU kernels can all be run on it and
compared.  Generators take a ``numpy.random.Generator`` and are deterministic
for a given generator state, so a failing seed replays exactly.

Sizes are arguments; defaults stay small so the reference runs fast.  The GPU
path needs the same L on every rank; only ``uneven_cols=True`` (or a per-rank
``cols`` list) makes cases with different L (check ``Case.equal_cols``).  Every generator
takes the scores' ``dtype`` ("bfloat16", the default, or "float32") and the KV cache's
``interleave`` size (docs/DESIGN.md §4; default 1).
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

from .. import layout

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {name: np.dtype(name) for name in layout.SCORE_DTYPES}  # (ml_dtypes names bfloat16)
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1

# bf16 bit patterns worth having in every test.
NAN_BITS = (0x7FC0, 0xFFC0, 0x7F81, 0xFF81, 0x7FFF, 0xFFFF, 0x7FA5, 0xFFD3)  # both signs, assorted payloads
ZERO_BITS = (0x0000, 0x8000)  # +0, -0 (equal scores)
INF_BITS = (0x7F80, 0xFF80)  # +inf, -inf
FINITE_EDGE_BITS = (0x7F7F, 0xFF7F, 0x0001, 0x8001, 0x0080, 0x8080, 0x3F80, 0xBF80)  # ±max, ±min subnormal, ±min normal, ±1
SPECIAL_BITS = NAN_BITS + ZERO_BITS + INF_BITS + FINITE_EDGE_BITS

# The same for float32 scores.
NAN_BITS32 = (0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FA5A5A5, 0xFFD30000)
ZERO_BITS32 = (0x00000000, 0x80000000)
INF_BITS32 = (0x7F800000, 0xFF800000)
FINITE_EDGE_BITS32 = (0x7F7FFFFF, 0xFF7FFFFF, 0x00000001, 0x80000001, 0x00800000, 0x80800000, 0x3F800000,
                      0xBF800000, 0x3F800001, 0xBF800001)  # ±max, ±min subnormal, ±min normal, ±1, ±1 + 1 ulp
SPECIAL_BITS32 = NAN_BITS32 + ZERO_BITS32 + INF_BITS32 + FINITE_EDGE_BITS32
# (uint type of the bits, NaN, zero and special patterns) per dtype
_BITS = {"bfloat16": (np.uint16, NAN_BITS, ZERO_BITS, SPECIAL_BITS),
         "float32": (np.uint32, NAN_BITS32, ZERO_BITS32, SPECIAL_BITS32)}


def _dtype(dtype) -> str:
    """The canonical dtype name of a generator's ``dtype`` argument (TypeError for another)."""
    return layout.score_dtype_name(dtype)


def as_scores(values, dtype) -> np.ndarray:
    """Float values rounded to the scores' dtype."""
    return np.asarray(values, np.float32).astype(DTYPES[_dtype(dtype)])


def from_bits(bits, dtype) -> np.ndarray:
    """Scores of the given bit patterns (uint16 for bfloat16, uint32 for float32)."""
    uint = _BITS[_dtype(dtype)][0]
    return np.asarray(bits, uint).view(DTYPES[_dtype(dtype)])


@dataclasses.dataclass(frozen=True, eq=False)
class Case:
    """Per-rank inputs of one merge call (lists of length ``world``)."""

    name: str
    world: int
    topk: int
    local_topk: int
    block_size: int
    logits: list  # W x bf16 or float32 [R, L_q]
    row_ends: list  # W x int32 [R]
    req_id: list  # W x int32 [R]
    block_tables: list  # W x int32 [num_requests, max_pages_q]
    interleave: int = 1  # the KV cache's interleave size (docs/DESIGN.md §4)

    @property
    def rows(self) -> int:
        return self.logits[0].shape[0]

    @property
    def cols(self) -> tuple:
        return tuple(x.shape[1] for x in self.logits)

    @property
    def equal_cols(self) -> bool:
        """True when every rank has the same L (what the GPU path needs)."""
        return len(set(self.cols)) == 1

    @property
    def dtype(self) -> str:
        """The scores' dtype name ("bfloat16" or "float32")."""
        return self.logits[0].dtype.name

    @property
    def args(self) -> tuple:
        """Positional arguments of topk_merge / protocol_merge."""
        return (self.logits, self.row_ends, self.req_id, self.block_tables)

    def oracle(self) -> list:
        """reference.topk_merge of the case: one MergeOutput per rank."""
        from .. import reference

        return reference.topk_merge(*self.args, topk=self.topk, block_size=self.block_size,
                                    interleave=self.interleave)

    def model(self, local_topk: int | None = None) -> list:
        """reference.protocol_merge of the case (at the case's N unless given)."""
        from .. import reference

        return reference.protocol_merge(*self.args, topk=self.topk, block_size=self.block_size,
                                        local_topk=self.local_topk if local_topk is None else local_topk,
                                        interleave=self.interleave)

    def __repr__(self) -> str:  # short: shows up in pytest ids and failures
        extra = (f", {self.dtype}" if self.dtype != "bfloat16" else "") + \
            (f", I={self.interleave}" if self.interleave != 1 else "")
        return (f"Case({self.name!r}, W={self.world}, K={self.topk}, N={self.local_topk}, "
                f"B={self.block_size}, R={self.rows}, L={self.cols}{extra})")


# ---------------------------------------------------------------------------
# Building blocks


def _cols_list(cols, world: int) -> list:
    if isinstance(cols, (int, np.integer)):
        cols = [int(cols)] * world
    cols = [int(c) for c in cols]
    if len(cols) != world:
        raise ValueError(f"cols has {len(cols)} entries, world={world}")
    for c in cols:
        if not 1 <= c <= layout.MAX_LOCAL_LEN:
            raise ValueError(f"cols={c} must be in [1, {layout.MAX_LOCAL_LEN}]")
    return cols


def default_cols(topk: int, local_topk: int) -> int:
    """L large enough for every row_end of interest (K+1, N+1) and ties past K."""
    return min(2 * topk + 37, layout.MAX_LOCAL_LEN)


def _check(world, topk, local_topk, block_size):
    layout.check_config(world, topk, local_topk)
    if not isinstance(block_size, (int, np.integer)) or block_size < 1:
        raise ValueError(f"block_size={block_size!r} must be a positive int")


def random_block_tables(rng, world, cols, block_size, num_requests):
    """Per rank: a random permutation of physical blocks, [num_requests, pages covering L_q]."""
    tables = []
    for q in range(world):
        pages = -(-cols[q] // block_size)
        # A pool larger than needed, so physical block numbers are not just 0..n-1.
        pool = rng.permutation(num_requests * pages + int(rng.integers(0, 8)))
        tables.append(pool[: num_requests * pages].reshape(num_requests, pages).astype(np.int32))
    return tables


def random_req_ids(rng, world, rows, num_requests):
    """Rows of a rank point at random requests (they may repeat)."""
    return [rng.integers(0, num_requests, rows).astype(np.int32) for _ in range(world)]


def special_row_ends(topk, local_topk, cols) -> list:
    """row_end values of interest for one rank with L = cols (unclamped)."""
    K, N, L = topk, local_topk, cols
    return [0, 1, N - 1, N, N + 1, K - 1, K, K + 1, L - 1, L, L + 1, -1, -7, INT32_MAX, INT32_MIN]


def random_logits(rng, rows, cols, distinct_values=None, dtype="bfloat16") -> np.ndarray:
    """Scores [rows, cols] of ``dtype``; with ``distinct_values`` every row uses that many values
    (ties)."""
    if distinct_values is None:
        return as_scores(rng.standard_normal((rows, cols)), dtype)
    out = np.empty((rows, cols), DTYPES[_dtype(dtype)])
    for i in range(rows):
        pool = np.unique(as_scores(rng.standard_normal(4 * distinct_values + 8), dtype))
        pool = rng.permutation(pool)[:distinct_values]
        out[i] = pool[rng.integers(0, pool.size, cols)]
    return out


def _mixed_zeros(rng, n, dtype) -> np.ndarray:
    """n zeros of ``dtype``, +0 and -0 mixed (one score: they compare equal)."""
    zeros = np.array(_BITS[_dtype(dtype)][2], _BITS[_dtype(dtype)][0])
    return from_bits(rng.choice(zeros, n), dtype)


def _finish(rng, name, world, topk, local_topk, block_size, logits, row_ends, num_requests=None,
            interleave=1):
    cols = [x.shape[1] for x in logits]
    rows = logits[0].shape[0]
    num_requests = num_requests or max(1, (rows + 1) // 2)
    return Case(
        name=name, world=world, topk=topk, local_topk=local_topk, block_size=block_size,
        logits=logits,
        row_ends=[np.asarray(e, np.int64).astype(np.int32) for e in row_ends],
        req_id=random_req_ids(rng, world, rows, num_requests),
        block_tables=random_block_tables(rng, world, cols, block_size, num_requests),
        interleave=interleave,
    )


# ---------------------------------------------------------------------------
# Generators


def random_case(rng, *, world, topk, local_topk, rows, cols, block_size=16,
                distinct_values=None, row_ends="mixed", name="random", dtype="bfloat16",
                interleave=1) -> Case:
    """Random scores; ``row_ends``: "full" (= L), "mixed" (half L, half special
    values incl. negative and > L), "special" (only special values) or
    "uniform" (uniform in [0, L])."""
    _check(world, topk, local_topk, block_size)
    cols = _cols_list(cols, world)
    logits = [random_logits(rng, rows, c, distinct_values, dtype) for c in cols]
    ends = []
    for c in cols:
        specials = np.array(special_row_ends(topk, local_topk, c), np.int64)
        if row_ends == "full":
            e = np.full(rows, c)
        elif row_ends == "uniform":
            e = rng.integers(0, c + 1, rows)
        elif row_ends == "special":
            e = rng.choice(specials, rows)
        elif row_ends == "mixed":
            e = np.where(rng.random(rows) < 0.5, c, rng.choice(specials, rows))
        else:
            raise ValueError(f"row_ends={row_ends!r} must be 'full', 'mixed', 'special' or 'uniform'")
        ends.append(e)
    return _finish(rng, name, world, topk, local_topk, block_size, logits, ends, interleave=interleave)


def saturating_case(rng, world, topk, local_topk, num_saturated, *, rows=8, cols=None,
                    block_size=16, full_others=None, name=None, dtype="bfloat16", interleave=1) -> Case:
    """Every row has exactly ``num_saturated`` saturated ranks (docs/DESIGN.md §6.4).

    Per row, s random ranks get scores above everything else and at least N
    valid tokens: their top-N keys are the best s*N < K keys of round 1, so T is
    below them and they are saturated.  The other ranks must not be:

    * "full others" (when possible): they hold N or more tokens of one equal low
      score.  The keys above T are then the first K - s*N - 1 of those in g
      order, spread evenly over the W - s ranks, so none holds N of them as long
      as K - s*N - 1 <= (W - s)(N - 1), and |U| >= K needs (W - s) * N >= K - s*N
      (with chunks of I tokens per rank the first positions in g order are spread
      chunk by chunk, so the variant is used only where I = 1).
    * otherwise they have fewer than N valid tokens (never full, so never saturated).

    ``full_others``: True / False forces a variant (True raises if impossible),
    None picks per row.  Tokens past row_end hold high garbage (must be ignored).
    """
    _check(world, topk, local_topk, block_size)
    K, N, W, s = topk, local_topk, world, num_saturated
    if not 1 <= s <= min(W, layout.rescue_slots(K, N)):
        raise ValueError(f"num_saturated={s} must be in [1, min(world={W}, floor((K-1)/N)="
                         f"{layout.rescue_slots(K, N)})]")
    L = default_cols(K, N) if cols is None else int(cols)
    if not N <= L <= layout.MAX_LOCAL_LEN:
        raise ValueError(f"cols={L} must be in [local_topk={N}, {layout.MAX_LOCAL_LEN}]")
    m = K - s * N  # keys of the other ranks that round 1 keeps (T is the m-th)
    can_full = W > s and (W - s) * N >= m and m - 1 <= (W - s) * (N - 1) and interleave == 1
    if full_others and not can_full:
        raise ValueError(f"full_others impossible for W={W}, K={K}, N={N}, s={s}, interleave={interleave}")

    scores = DTYPES[_dtype(dtype)]
    logits = [np.empty((rows, L), scores) for _ in range(W)]
    ends = [np.empty(rows, np.int64) for _ in range(W)]
    garbage = np.array([np.inf, 1e30, 100.0], np.float32)
    for i in range(rows):
        sat = set(rng.choice(W, s, replace=False).tolist())
        full = (can_full and bool(rng.integers(0, 2))) if full_others is None else full_others
        low_value = float(rng.choice(np.array([-1.0, 0.0, 1.0])))
        for q in range(W):
            if q in sat:
                # High scores with ties (few distinct values in [2, 66)).
                pool = as_scores(2 + 64 * rng.random(int(rng.integers(3, 40))), dtype)
                row = pool[rng.integers(0, pool.size, L)]
                end = int(rng.integers(N, L + 1))
            elif full:
                row = _mixed_zeros(rng, L, dtype) if low_value == 0 else as_scores(np.full(L, low_value), dtype)
                end = int(rng.integers(N, L + 1))
            else:
                row = as_scores(rng.random(L) * 3 - 1.5, dtype)  # below the high scores
                end = int(rng.integers(0, N))
            if end < L:
                row[end:] = as_scores(rng.choice(garbage, L - end), dtype)
            logits[q][i] = row
            # Sometimes a row_end past L (clamps to L): only when nothing is masked.
            ends[q][i] = L + int(rng.integers(1, 5)) if end == L and rng.random() < 0.3 else end
    name = name or f"saturate_{s}"
    return _finish(rng, name, W, K, N, block_size, logits, ends, interleave=interleave)


def _ties_at_kth(rng, world, topk, local_topk, rows, cols, block_size, dtype="bfloat16",
                 interleave=1) -> Case:
    """The K-th selected token lies inside a group of equal scores spread over all ranks.

    Per row: a < K tokens get higher scores, a few get lower ones, and all the
    rest (at least K - a + 1 of them, so the group straddles position K) share
    one tie value; a zero tie value mixes +0 and -0.
    """
    total = sum(cols)
    logits = [np.empty((rows, c), DTYPES[_dtype(dtype)]) for c in cols]
    for i in range(rows):
        tie = float(rng.choice(np.array([0.0, 1.0, -1.0, 10.0, np.inf])))
        flat = _mixed_zeros(rng, total, dtype) if tie == 0 else as_scores(np.full(total, tie), dtype)
        a = int(rng.integers(0, min(topk, total)))  # tokens above the tie
        low = int(rng.integers(0, max(1, total - topk)))  # tokens below the tie
        pos = rng.permutation(total)
        if tie == np.inf:  # nothing is above +inf
            a = 0
        hi_pos, lo_pos = pos[:a], pos[a:a + low]
        flat[hi_pos] = as_scores(tie + 1 + rng.integers(0, 3, a), dtype)
        flat[lo_pos] = as_scores(tie - 1 - rng.integers(0, 3, low) if np.isfinite(tie) else np.full(low, 1.0), dtype)
        start = 0
        for q, c in enumerate(cols):
            logits[q][i] = flat[start:start + c]
            start += c
    ends = [np.full(rows, c) for c in cols]
    return _finish(rng, "ties_at_kth", world, topk, local_topk, block_size, logits, ends, interleave=interleave)


def _all_equal(rng, world, topk, local_topk, rows, cols, block_size, dtype="bfloat16", interleave=1) -> Case:
    """Every valid token of a row has the same score (ties decided by g alone)."""
    uint, nans, zeros, specials = _BITS[_dtype(dtype)]
    logits, ends = [], []
    choices = [b for b in specials if b not in nans] + list(nans[:2])
    values = [rng.choice(np.array(choices, uint)) for _ in range(rows)]
    for c in cols:
        x = np.empty((rows, c), uint)
        for i, v in enumerate(values):
            x[i] = v
            if v in zeros:  # +0 and -0 mixed: still all equal
                x[i] = rng.choice(np.array(zeros, uint), c)
        logits.append(from_bits(x, dtype))
        ends.append(np.where(rng.random(rows) < 0.7, c, rng.integers(0, c + 1, rows)))
    return _finish(rng, "all_equal", world, topk, local_topk, block_size, logits, ends, interleave=interleave)


def _specials(rng, world, topk, local_topk, rows, cols, block_size, nan_fraction, name, dtype="bfloat16",
              interleave=1) -> Case:
    """Random scores with special bit patterns (NaN, ±0, ±inf, edges) mixed in."""
    uint, nans, _, specials = _BITS[_dtype(dtype)]
    logits, ends = [], []
    special = np.array(specials, uint)
    nan = np.array(nans, uint)
    for c in cols:
        x = as_scores(rng.standard_normal((rows, c)), dtype).view(uint)
        u = rng.random((rows, c))
        x = np.where(u < 0.3, rng.choice(special, (rows, c)), x)
        x = np.where(u > 1 - nan_fraction, rng.choice(nan, (rows, c)), x)
        logits.append(from_bits(x.astype(uint), dtype))
        ends.append(np.where(rng.random(rows) < 0.7, c, rng.integers(0, c + 1, rows)))
    return _finish(rng, name, world, topk, local_topk, block_size, logits, ends, interleave=interleave)


def _short_rows(rng, world, topk, local_topk, rows, cols, block_size, dtype="bfloat16", interleave=1) -> Case:
    """Fewer than K valid tokens in the row (rows shorter than N on many ranks)."""
    logits = [random_logits(rng, rows, c, int(rng.integers(2, 6)), dtype) for c in cols]
    ends = [rng.integers(-2, max(1, topk // world) + 1, rows) for _ in cols]
    for e in ends:
        e[rng.random(rows) < 0.2] = 0  # empty on this rank
    if rows > 1:
        for e in ends:
            e[0] = 0  # row 0 empty on every rank
    return _finish(rng, "short_rows", world, topk, local_topk, block_size, logits, ends, interleave=interleave)


def _bf16_collapse(rng, world, topk, local_topk, rows, cols, block_size, interleave=1) -> Case:
    """float32 scores that differ only below bfloat16's precision: each row's values share a
    few bfloat16 roundings (a few high 16-bit patterns) and differ in their low 16 bits, so
    the top K is decided by the low bits; a bfloat16 ranking would order them by position."""
    logits = []
    for c in cols:
        x = np.empty((rows, c), np.uint32)
        for i in range(rows):
            highs = rng.choice(np.array([0x3F80, 0xBF80, 0x4120, 0x0000, 0x8000, 0x7F7F], np.uint32),
                               int(rng.integers(1, 4)))
            lows = rng.integers(0, 1 << 16, c).astype(np.uint32)
            lows[rng.random(c) < 0.2] = 0x1234  # equal in float32 too: ties by g
            x[i] = (rng.choice(highs, c) << 16) | lows
        logits.append(from_bits(x, "float32"))
    ends = [np.where(rng.random(rows) < 0.8, c, rng.integers(0, c + 1, rows)) for c in cols]
    return _finish(rng, "bf16_collapse", world, topk, local_topk, block_size, logits, ends, interleave=interleave)


def _chunk_ties(rng, world, topk, local_topk, rows, cols, block_size, dtype="bfloat16", interleave=1) -> Case:
    """Equal scores on both sides of chunk boundaries (the last token of a chunk of I on one
    rank and the first of the next chunk, on the next rank), a few higher ones, and row ends
    that are not multiples of I (some shorter than one chunk)."""
    logits, ends = [], []
    for q, c in enumerate(cols):
        x = as_scores(rng.standard_normal((rows, c)) - 4, dtype)
        l = np.arange(c)
        edge = (l % interleave == interleave - 1) | (l % interleave == 0)
        for i in range(rows):
            x[i, edge & (rng.random(c) < 0.7)] = as_scores(1.0, dtype)
            x[i, rng.random(c) < 0.02] = as_scores(3.0, dtype)
        logits.append(x)
        e = rng.integers(0, c + 1, rows)
        e[rng.random(rows) < 0.3] = rng.integers(0, max(1, interleave), 1)  # shorter than a chunk
        e[rng.random(rows) < 0.3] = c
        ends.append(e)
    return _finish(rng, "chunk_ties", world, topk, local_topk, block_size, logits, ends, interleave=interleave)


def _every_special_end(rng, c: Case) -> Case:
    """``c`` with row_ends cycling through every special value (row-major over rows x
    ranks, from a random offset): all of them occur once rows * W >= their count."""
    specials = np.array(special_row_ends(c.topk, c.local_topk, c.cols[0]), np.int64)
    slot = (np.arange(c.rows)[:, None] * c.world + np.arange(c.world)[None, :]
            + int(rng.integers(0, specials.size))) % specials.size
    ends = [specials[slot[:, q]].astype(np.int32) for q in range(c.world)]
    return dataclasses.replace(c, row_ends=ends)


def adversarial_cases(rng, *, world, topk, local_topk, cols=None, block_size=16, rows=32,
                      uneven_cols=False, n_equals_k=False, saturating_rows=None, dtype="bfloat16",
                      interleave=1) -> list:
    """The adversarial set for one configuration (W, K, N, dtype, I); see the module docstring.

    Covers heavy ties, ties at the K-th key across ranks, all-equal rows, NaN of
    both signs with assorted payloads, ±0, ±inf, special row_ends (0, 1, N-1, N,
    N+1, K-1, K, K+1, L, negative, > L), rows with fewer than K valid tokens,
    rows with exactly s saturated ranks for every s in 1..min(W, floor((K-1)/N));
    float32: scores equal in bfloat16 but distinct in float32; I > 1: ties on both sides of
    chunk boundaries and rows shorter than one chunk.

    Every case has ``local_topk`` = the argument (one exchange configuration),
    unless ``n_equals_k``: then a tie case with N = K is added (or call with
    local_topk=topk).  ``uneven_cols`` adds cases whose ranks have different L
    (oracle/model only; the GPU path needs equal L).  ``saturating_rows``: rows
    of each saturating case (default rows // 8, at least 2).
    """
    _check(world, topk, local_topk, block_size)
    layout.check_interleave(interleave, world)
    L = default_cols(topk, local_topk) if cols is None else int(cols)
    cl = [L] * world
    sat_rows = saturating_rows or max(2, rows // 8)
    common = dict(world=world, topk=topk, local_topk=local_topk, block_size=block_size, dtype=dtype,
                  interleave=interleave)
    pos = (world, topk, local_topk, rows, cl, block_size)
    kw = dict(dtype=dtype, interleave=interleave)
    out = [
        random_case(rng, rows=rows, cols=cl, name="random", **common),
        random_case(rng, rows=rows, cols=cl, distinct_values=3, name="heavy_ties", **common),
        random_case(rng, rows=rows, cols=cl, distinct_values=1, row_ends="special",
                    name="one_value_special_ends", **common),
        _every_special_end(rng, random_case(rng, rows=rows, cols=cl, row_ends="special",
                                            name="special_row_ends", **common)),
        _ties_at_kth(rng, *pos, **kw),
        _all_equal(rng, *pos, **kw),
        _specials(rng, *pos, 0.05, "nan_inf_zero", **kw),
        _specials(rng, *pos, 0.9, "mostly_nan", **kw),
        _short_rows(rng, *pos, **kw),
    ]
    if _dtype(dtype) == "float32":
        out.append(_bf16_collapse(rng, *pos, interleave=interleave))
    if interleave > 1:
        out.append(_chunk_ties(rng, *pos, **kw))
    # Same row_end on every rank of a row (the common production shape).
    e = rng.choice(np.array(special_row_ends(topk, local_topk, L), np.int64), rows)
    c = random_case(rng, rows=rows, cols=cl, distinct_values=4, name="shared_special_ends", **common)
    out.append(dataclasses.replace(c, row_ends=[e.astype(np.int32) for _ in range(world)]))
    if n_equals_k and local_topk != topk:
        t = _ties_at_kth(rng, world, topk, topk, rows, cl, block_size, **kw)
        out.append(dataclasses.replace(t, name="ties_at_kth_n_eq_k"))
    for s in range(1, min(world, layout.rescue_slots(topk, local_topk)) + 1):
        out.append(saturating_case(rng, world, topk, local_topk, s, rows=sat_rows, cols=max(L, local_topk),
                                   block_size=block_size, **kw))
    if uneven_cols and world > 1:
        ucols = [int(rng.integers(1, L + 1)) for _ in range(world)]
        ucols[0], ucols[-1] = L, 1
        out.append(random_case(rng, rows=rows, cols=ucols, distinct_values=5, name="uneven_cols", **common))
        out.append(_specials(rng, world, topk, local_topk, rows, ucols, block_size, 0.2, "uneven_cols_specials",
                             **kw))
    return out


def bad_lookup_case(rng, *, world, topk, local_topk, rows=8, cols=300, block_size=16, dtype="bfloat16",
                    interleave=1) -> Case:
    """Random scores with out-of-range block-table lookups: every third row's req_id is
    negative or too large, and every block table has only half the pages the rows need.
    Selected tokens keep their place in ids/counts and get kv_rows -1 (every path)."""
    c = random_case(rng, world=world, topk=topk, local_topk=local_topk, rows=rows, cols=cols,
                    block_size=block_size, row_ends="full", name="bad_lookups", dtype=dtype,
                    interleave=interleave)
    bad = np.array([-1, 10**6, -(2**31)], np.int64)
    for q in range(world):
        idx = np.arange(0, rows, 3)
        c.req_id[q][idx] = bad[np.arange(idx.size) % bad.size].astype(np.int32)
        c.block_tables[q] = np.ascontiguousarray(c.block_tables[q][:, : max(1, c.block_tables[q].shape[1] // 2)])
    return c

