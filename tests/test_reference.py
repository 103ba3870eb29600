"""The NumPy oracle, the CPU model of the protocol and the shared cases (docs/DESIGN.md §4-§6)."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest

from jax_dsa_exchange import layout
from jax_dsa_exchange.testing import cases
from jax_dsa_exchange import reference as ref

BF16 = ml_dtypes.bfloat16
NAN, INF = float("nan"), float("inf")


def bf(rows) -> np.ndarray:
    return np.array(rows, np.float32).astype(BF16)


def i32(x) -> np.ndarray:
    return np.array(x, np.int32)


def one_table(world, pages=64):
    """Identity block tables (slot == l for block_size 1 and one request)."""
    return [i32([list(range(pages))]) for _ in range(world)]


def oracle(logits, row_ends=None, req_id=None, tables=None, *, topk, block_size=1):
    W = len(logits)
    R = logits[0].shape[0]
    if row_ends is None:
        row_ends = [i32([x.shape[1]] * R) for x in logits]
    if req_id is None:
        req_id = [i32([0] * R)] * W
    if tables is None:
        tables = one_table(W, max(x.shape[1] for x in logits))
    return ref.topk_merge(logits, row_ends, req_id, tables, topk=topk, block_size=block_size)


def assert_same(a, b, what=""):
    assert len(a) == len(b)
    for q, (x, y) in enumerate(zip(a, b)):
        for f in ("ids", "counts", "kv_rows"):
            u, v = getattr(x, f), getattr(y, f)
            assert u.dtype == v.dtype == np.int32, (what, q, f)
            if not np.array_equal(u, v):
                bad = np.argwhere(np.atleast_2d(u != v))[0]
                raise AssertionError(f"{what}: rank {q} {f} differs first at {tuple(bad)}:\n{u}\n{v}")


# ---------------------------------------------------------------------------
# Hand-made cases for the oracle (small K is fine: the oracle takes any K >= 1)


def test_ties_broken_by_global_position():
    # W=2, every score equal: g = l*2 + q, so the order is g0 (r0 l0), g1 (r1 l0), g2 (r0 l1)...
    res = oracle([bf([[5, 5, 5]]), bf([[5, 5, 5]])], topk=3)
    assert res[0].ids.tolist() == [[0, 2, 1]]  # owner-major: rank 0's g0, g2, then rank 1's g1
    assert res[1].ids.tolist() == [[0, 2, 1]]
    assert res[0].kv_rows.tolist() == [[0, 1, -1]] and res[0].counts.tolist() == [2]
    assert res[1].kv_rows.tolist() == [[0, -1, -1]] and res[1].counts.tolist() == [1]


def test_owner_major_ids_and_score_order():
    # W=3.  Scores: r0 = [1, 9, 2], r1 = [8, 0, 7], r2 = [3, 6, 4]; g = l*3 + q.
    # Top 5 by score: 9 (r0 l1, g3), 8 (r1 l0, g1), 7 (r1 l2, g7), 6 (r2 l1, g5), 4 (r2 l2, g8).
    res = oracle([bf([[1, 9, 2]]), bf([[8, 0, 7]]), bf([[3, 6, 4]])], topk=5)
    assert res[0].ids.tolist() == [[3, 1, 7, 5, 8]]
    assert [r.counts.tolist() for r in res] == [[1], [2], [2]]
    assert res[0].kv_rows.tolist() == [[1, -1, -1, -1, -1]]
    assert res[1].kv_rows.tolist() == [[0, 2, -1, -1, -1]]
    assert res[2].kv_rows.tolist() == [[1, 2, -1, -1, -1]]


def test_nan_never_selected():
    nan_bits = np.array([0x7FC0, 0xFFC0, 0x7F81, 0xFFFF], np.uint16)  # both signs, assorted payloads
    row = np.concatenate([nan_bits[:2], [0x3F80], nan_bits[2:]]).astype(np.uint16).view(BF16)  # 1.0 at l=2
    res = oracle([row[None, :]], topk=4)
    assert res[0].ids.tolist() == [[2, -1, -1, -1]]
    assert res[0].counts.tolist() == [1]
    assert res[0].kv_rows.tolist() == [[2, -1, -1, -1]]


def test_signed_zeros_are_equal():
    # -0 at l0 and l2, +0 at l1: equal scores, so g decides: l0, l1.
    res = oracle([bf([[-0.0, 0.0, -0.0]])], topk=2)
    assert res[0].ids.tolist() == [[0, 1]]
    # Across ranks: r0 has -0 (g0), r1 has +0 (g1); K=1 picks g0.
    res = oracle([bf([[-0.0]]), bf([[0.0]])], topk=1)
    assert res[0].ids.tolist() == [[0]]
    assert res[1].counts.tolist() == [0] and res[1].kv_rows.tolist() == [[-1]]


def test_infinities():
    mx = float(ml_dtypes.finfo(BF16).max)
    row = bf([[-INF, 1, INF, -1, NAN, mx]])
    # Order: +inf (l2), max (l5), 1 (l1), -1 (l3), -inf (l0); NaN never.
    assert oracle([row], topk=6)[0].ids.tolist() == [[0, 1, 2, 3, 5, -1]]
    assert oracle([row], topk=2)[0].ids.tolist() == [[2, 5]]
    assert oracle([row], topk=4)[0].ids.tolist() == [[1, 2, 3, 5]]


def test_row_ends_clamp_and_empty_rows():
    x = bf([[3, 2, 1, 0], [3, 2, 1, 0], [3, 2, 1, 0], [3, 2, 1, 0]])
    ends = [i32([0, -5, 2, 99])]
    res = oracle([x], ends, topk=3)
    assert res[0].ids.tolist() == [[-1, -1, -1], [-1, -1, -1], [0, 1, -1], [0, 1, 2]]
    assert res[0].counts.tolist() == [0, 0, 2, 3]
    assert res[0].kv_rows.tolist() == [[-1, -1, -1], [-1, -1, -1], [0, 1, -1], [0, 1, 2]]
    ends = [i32([-(2**31), 2**31 - 1, 1, 4])]
    assert oracle([x], ends, topk=3)[0].counts.tolist() == [0, 3, 1, 3]


def test_rows_shorter_than_k():
    res = oracle([bf([[1, 2]]), bf([[3]])], topk=64)
    assert res[0].ids[0, :4].tolist() == [0, 2, 1, -1]
    assert (res[0].ids[0, 3:] == -1).all()
    assert res[0].counts.tolist() == [2] and res[1].counts.tolist() == [1]


def test_block_table_mapping():
    # B=4, rank 0 row 0 uses request 1 = pages [7, 1]; rank 1 row 0 uses request 0 = [2, 5].
    x0 = bf([[0, 9, 0, 0, 0, 8, 0, 0]])  # picks l=1 (page 0) and l=5 (page 1)
    x1 = bf([[0, 0, 0, 0, 0, 0, 0, 7]])  # picks l=7 (page 1)
    tables = [i32([[9, 3], [7, 1]]), i32([[2, 5], [0, 0]])]
    res = oracle([x0, x1], None, [i32([1]), i32([0])], tables, topk=3, block_size=4)
    # ascending l, not ascending slot: l=1 -> 7*4+1 = 29, l=5 -> 1*4+1 = 5
    assert res[0].kv_rows.tolist() == [[29, 5, -1]]
    assert res[1].kv_rows.tolist() == [[5 * 4 + 3, -1, -1]]
    assert res[0].ids.tolist() == [[2, 10, 15]]


def test_bad_block_lookup_gives_minus_one_but_stays_selected():
    x = bf([[1, 2, 3, 4, 5]])  # K=4 picks l = 4, 3, 2, 1
    res = oracle([x], None, [i32([3])], [i32([[0, 1]])], topk=4, block_size=4)  # req_id 3 of 1
    assert res[0].kv_rows.tolist() == [[-1, -1, -1, -1]] and res[0].counts.tolist() == [4]
    assert res[0].ids.tolist() == [[1, 2, 3, 4]]
    res = oracle([x], None, [i32([0])], [i32([[6]])], topk=4, block_size=4)  # 1 page: l=4 has none
    assert res[0].kv_rows.tolist() == [[25, 26, 27, -1]] and res[0].counts.tolist() == [4]
    res = oracle([x], None, [i32([-1])], [i32([[6, 7]])], topk=4, block_size=4)
    assert res[0].kv_rows.tolist() == [[-1] * 4]
    # A rank that selects nothing in a row never looks its request up.
    res = oracle([x, bf([[NAN]])], None, [i32([0]), i32([77])], [i32([[0, 1]]), i32([[0]])],
                 topk=4, block_size=4)
    assert res[1].counts.tolist() == [0]


# ---------------------------------------------------------------------------
# Hand-made cases for the protocol model


def _proto(logits, ends=None, *, topk=64, local_topk=32, block_size=1):
    W, R = len(logits), logits[0].shape[0]
    ends = ends or [i32([x.shape[1]] * R) for x in logits]
    args = (logits, ends, [i32([0] * R)] * W, one_table(W, max(x.shape[1] for x in logits)))
    got = ref.protocol_merge(*args, topk=topk, local_topk=local_topk, block_size=block_size)
    assert_same(ref.topk_merge(*args, topk=topk, block_size=block_size), got)
    return got


def test_saturation_compares_full_keys_when_min_ties_t():
    # W=2, K=64, N=32.  r0: 40 tokens of score 1.  r1: 32 tokens of 0.5, then 32 of 1.
    # Round 1: r0 sends l0..31 (g 0..62), r1 sends l32..63 (g 65..127), all score 1.
    # T = 64th key = r1's l63 (g 127).  r0's smallest key (g 62) ties T's score but is a
    # larger key, so r0 is saturated, and indeed its unseen l32 (g 64) beats T.
    r0 = np.ones((1, 40), np.float32)
    r1 = np.concatenate([np.full(32, 0.5), np.ones(32)]).astype(np.float32)[None]
    got = _proto([r0.astype(BF16), r1.astype(BF16)])
    assert got[0].saturated.tolist() == [0b01] and got[1].saturated.tolist() == [0b01]
    assert 64 in got[0].ids[0].tolist()  # r0 l32, only found in round 2
    assert got[0].counts.tolist() == [40] and got[1].counts.tolist() == [24]


def test_all_equal_scores_saturate_only_the_strictly_better_rank():
    # Every score equal: the two lists interleave, T = r1's l31 (g 63); r0's min (g 62) > T.
    x = np.ones((1, 100), np.float32).astype(BF16)
    got = _proto([x, x])
    assert got[0].saturated.tolist() == [0b01]
    assert got[0].ids[0].tolist() == list(range(0, 64, 2)) + list(range(1, 64, 2))


def test_no_saturation_when_n_equals_k():
    x = np.ones((1, 200), np.float32).astype(BF16)
    got = _proto([x, x, x], topk=64, local_topk=64)
    assert got[0].saturated.tolist() == [0]


def test_short_lists_never_saturate_but_t_zero_does():
    # r0 has 100 valid tokens, r1 none: |U| = 32 < K, T = 0, r0 (full) is saturated.
    x = np.arange(100, dtype=np.float32)[None].astype(BF16)
    got = _proto([x, x], [i32([100]), i32([0])])
    assert got[0].saturated.tolist() == [0b01]
    assert got[0].counts.tolist() == [64] and got[1].counts.tolist() == [0]
    # 31 valid tokens on each rank: no list is full, nobody is saturated.
    got = _proto([x, x], [i32([31]), i32([31])])
    assert got[0].saturated.tolist() == [0] and got[0].counts.tolist() == [31]


# ---------------------------------------------------------------------------
# Encodings


def test_ord16_is_monotone_over_all_bf16_patterns():
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    vals = bits.view(BF16).astype(np.float32)
    code = ref.ord16(bits)
    nan = np.isnan(vals)
    assert np.array_equal(ref.is_nan_bits(bits), nan)
    assert nan.sum() == 2 * 127
    assert (code[nan] == 0).all()
    v, c = vals[~nan], code[~nan].astype(np.int64)
    assert c.min() >= 1 and c.max() <= 0xFFFF
    order = np.argsort(v, kind="stable")
    dv, dc = np.diff(v[order]), np.diff(c[order])
    assert (dc[dv > 0] > 0).all()  # strictly larger value -> strictly larger code
    assert (dc[dv == 0] == 0).all()  # equal values (only -0 == +0) -> same code
    assert (dv == 0).sum() == 1
    assert ref.ord16(np.uint16(0x8000)) == ref.ord16(np.uint16(0)) == 0x8000
    assert ref.ord16(np.uint16(0xFF80)) == 0x7F and ref.ord16(np.uint16(0x7F80)) == 0xFF80
    # bf16 values are accepted as well as bits
    assert np.array_equal(ref.ord16(bits.view(BF16)), code)


def test_pack_by_hand_with_bit_16_of_l():
    L, n = 70000, 32
    bits = np.full(L, 0x7FC0, np.uint16)  # NaN everywhere...
    picks = {5: 0x3F80, 65539: 0x4000, 69999: 0x8000}  # ...but 1.0, 2.0, -0.0
    for l, b in picks.items():
        bits[l] = b
    w = ref.pack_local_topk(bits, L, n)
    assert w.dtype == np.uint32 and w.shape == (layout.row_words(n),) == (36,)
    assert w[0] == (0xBF80 << 16) | (0xFFFF - 5)
    assert w[1] == (0xC000 << 16) | (0xFFFF - 3)  # 65539 & 0xFFFF = 3
    assert w[2] == (0x8000 << 16) | (0xFFFF - (69999 - 65536))
    assert (w[3:32] == 0).all()
    assert w[32] == 0b110  # bit 16 of l for candidates 1 and 2
    assert (w[33:] == 0).all()
    keys = ref.decode_keys(w, n, rank=2, world=3)
    G = layout.gid_bits(3)
    assert G == 19
    want = [(0xBF80 << G) | ((1 << G) - 1 - (5 * 3 + 2)),
            (0xC000 << G) | ((1 << G) - 1 - (65539 * 3 + 2)),
            (0x8000 << G) | ((1 << G) - 1 - (69999 * 3 + 2))]
    assert keys.dtype == np.uint64 and keys[:3].tolist() == want and (keys[3:] == 0).all()
    assert ref.key_to_gid(keys[:3], 3).tolist() == [17, 196619, 209999]
    # row_end cuts the list; top-1 of two equal scores keeps the lower l.
    assert ref.pack_local_topk(bits, 65539, n)[1] == 0
    assert ref.local_topk_indices(bf([1, 3, 3, 2]), 4, 1).tolist() == [1]


def test_pack_decode_round_trip(rng):
    for world in (1, 3, 16):
        for n in (32, 64, 96):
            L = int(rng.choice([1, 31, 200, 70000]))
            rank = int(rng.integers(0, world))
            x = cases.random_logits(rng, 1, L, distinct_values=int(rng.integers(1, 5)))[0]
            bits = x.view(np.uint16).copy()
            bits[rng.random(L) < 0.1] = 0xFFC1  # some NaN
            end = int(rng.integers(-2, L + 3))
            w = ref.pack_local_topk(bits, end, n)
            l = ref.local_topk_indices(bits, end, n)
            keys = ref.decode_keys(w, n, rank, world)
            valid = keys[keys != 0]
            assert valid.size == l.size == min(n, int(np.sum(~ref.is_nan_bits(bits[:max(end, 0)]))))
            assert (w[l.size:n] == 0).all() and (keys[l.size:] == 0).all()  # empties last
            assert ref.key_to_gid(valid, world).tolist() == (l * world + rank).tolist()  # ascending l
            G = layout.gid_bits(world)
            assert ((valid >> np.uint64(G)).astype(np.uint32) == ref.ord16(bits[l])).all()
            # The selection is the rank's own top-n by (score desc, l asc), checked with floats.
            f = bits.view(BF16).astype(np.float32)[: max(0, min(end, L))]
            ok = np.flatnonzero(~np.isnan(f))
            best = ok[np.lexsort((ok, -f[ok] + np.float32(0)))][:n]
            assert sorted(best.tolist()) == l.tolist()


# ---------------------------------------------------------------------------
# Protocol model == oracle on the adversarial set

CONFIGS = [(64, 32), (64, 64), (128, 32), (256, 96), (2048, 32), (2048, 256), (2048, 2048)]
WORLDS = [1, 2, 3, 4, 8, 16]


def _rows(world, topk):
    base = 24 if topk <= 256 else 6
    return max(2, base // max(1, world // 2))


def check_case(case: cases.Case):
    want = case.oracle()
    got = case.model()
    assert_same(want, got, repr(case))
    # Invariants of docs/DESIGN.md §3-§4 on the oracle itself.
    K, W = case.topk, case.world
    for q in range(W):
        assert np.array_equal(want[q].ids, want[0].ids)
        assert np.array_equal(got[q].saturated, got[0].saturated)
        assert (want[q].saturated == 0).all()
    valid = np.zeros(case.rows, np.int64)
    for q in range(W):
        f = case.logits[q].astype(np.float32)
        end = np.clip(case.row_ends[q].astype(np.int64), 0, f.shape[1])
        valid += ((np.arange(f.shape[1])[None] < end[:, None]) & ~np.isnan(f)).sum(1)
    n_ids = (want[0].ids != -1).sum(1)
    assert np.array_equal(n_ids, np.minimum(valid, K))
    assert np.array_equal(sum(r.counts.astype(np.int64) for r in want), n_ids)
    sat = np.array([bin(int(m)).count("1") for m in got[0].saturated])
    assert sat.max(initial=0) <= layout.rescue_slots(K, case.local_topk)
    assert (got[0].saturated >> W == 0).all()
    if case.local_topk == K:
        assert (sat == 0).all()
    return got


@pytest.mark.parametrize("topk,local_topk", CONFIGS, ids=[f"K{k}-N{n}" for k, n in CONFIGS])
@pytest.mark.parametrize("world", WORLDS, ids=[f"W{w}" for w in WORLDS])
def test_protocol_equals_oracle(world, topk, local_topk, seed):
    rng = np.random.default_rng([seed, world, topk, local_topk])
    cs = cases.adversarial_cases(rng, world=world, topk=topk, local_topk=local_topk,
                                 rows=_rows(world, topk), uneven_cols=True, n_equals_k=True,
                                 block_size=int(rng.choice([1, 16, 64])))
    names = {c.name for c in cs}
    assert {"heavy_ties", "ties_at_kth", "all_equal", "nan_inf_zero", "short_rows"} <= names
    for case in cs:
        check_case(case)


SAT_CONFIGS = [(1, 64, 32), (2, 64, 32), (4, 128, 32), (8, 256, 32), (16, 2048, 128), (16, 512, 32),
               (3, 2048, 512), (5, 160, 32)]


@pytest.mark.parametrize("world,topk,local_topk", SAT_CONFIGS,
                         ids=[f"W{w}-K{k}-N{n}" for w, k, n in SAT_CONFIGS])
def test_every_saturation_count_is_reached(world, topk, local_topk, seed):
    rng = np.random.default_rng([seed, world, topk, local_topk, 7])
    top = min(world, layout.rescue_slots(topk, local_topk))
    assert top >= 1
    for s in range(1, top + 1):
        K, N = topk, local_topk
        m = K - s * N
        can_full = world > s and (world - s) * N >= m and m - 1 <= (world - s) * (N - 1)
        for full in sorted({False, can_full}):
            case = cases.saturating_case(rng, world, topk, local_topk, s, rows=3, full_others=full,
                                         cols=int(rng.integers(local_topk, 2 * topk + 40)))
            got = check_case(case)
            counts = [bin(int(m)).count("1") for m in got[0].saturated]
            assert counts == [s] * case.rows, (case, full, counts)


def test_saturating_case_rejects_impossible_counts():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="num_saturated"):
        cases.saturating_case(rng, 4, 64, 32, 2)  # floor(63/32) = 1
    with pytest.raises(ValueError, match="num_saturated"):
        cases.saturating_case(rng, 4, 64, 64, 1)  # N = K: never
    with pytest.raises(ValueError, match="full_others"):
        cases.saturating_case(rng, 1, 64, 32, 1, full_others=True)


def test_saturated_masks_helper_matches_protocol(rng):
    case = cases.saturating_case(rng, 4, 128, 32, 2, rows=4)
    got = ref.protocol_merge(*case.args, topk=128, local_topk=32, block_size=case.block_size)
    masks = ref.saturated_masks(case.logits, case.row_ends, topk=128, local_topk=32)
    assert np.array_equal(masks, got[0].saturated)


def test_cases_are_well_formed(rng):
    cs = cases.adversarial_cases(rng, world=3, topk=64, local_topk=32, rows=8, uneven_cols=True,
                                 n_equals_k=True)
    for c in cs:
        assert len(c.logits) == len(c.row_ends) == len(c.req_id) == len(c.block_tables) == c.world
        for q in range(c.world):
            assert c.logits[q].dtype == BF16 and c.logits[q].shape[0] == c.rows
            assert c.row_ends[q].dtype == c.req_id[q].dtype == c.block_tables[q].dtype == np.int32
            t = c.block_tables[q]
            assert t.shape[1] * c.block_size >= c.logits[q].shape[1]  # pages cover L
            assert len(np.unique(t)) == t.size  # a permutation: no physical block twice
            assert (0 <= c.req_id[q]).all() and (c.req_id[q] < t.shape[0]).all()
    assert any(not c.equal_cols for c in cs)
    plain = cases.adversarial_cases(rng, world=3, topk=64, local_topk=32, rows=4)
    assert all(c.equal_cols and c.local_topk == 32 and c.topk == 64 for c in plain)
    assert any(c.local_topk == 64 for c in cs)
    # row_ends of interest are all present somewhere
    ends = {int(e) for c in cs for q in range(c.world) for e in c.row_ends[q]}
    L = cases.default_cols(64, 32)
    assert {0, 1, 31, 32, 33, 63, 64, 65, L} <= ends
    assert min(ends) < 0 and max(ends) > L
    # NaN of both signs, ±0 and ±inf occur
    bits = {int(b) for c in cs for x in c.logits for b in np.unique(x.view(np.uint16))}
    assert {0x7FC0, 0xFFC0, 0x0000, 0x8000, 0x7F80, 0xFF80} <= bits
    # same generator state -> same case
    a = cases.random_case(np.random.default_rng(5), world=2, topk=64, local_topk=32, rows=3, cols=50)
    b = cases.random_case(np.random.default_rng(5), world=2, topk=64, local_topk=32, rows=3, cols=50)
    assert all(np.array_equal(x.view(np.uint16), y.view(np.uint16)) for x, y in zip(a.logits, b.logits))


# ---------------------------------------------------------------------------
# Input validation


def _args(W=2, R=3, L=10):
    logits = [np.zeros((R, L), BF16) for _ in range(W)]
    return dict(logits=logits, row_ends=[i32([L] * R)] * W, req_id=[i32([0] * R)] * W,
                block_tables=one_table(W, L))


@pytest.mark.parametrize("fn", ["oracle", "protocol"])
def test_input_validation(fn):
    def call(topk=64, block_size=1, **over):
        kw = _args()
        kw.update(over)
        if fn == "protocol":
            return ref.protocol_merge(**kw, topk=topk, local_topk=32, block_size=block_size)
        return ref.topk_merge(**kw, topk=topk, block_size=block_size)

    call()
    a = _args()
    with pytest.raises(ValueError, match="len\\(row_ends\\)=1"):
        call(row_ends=a["row_ends"][:1])
    with pytest.raises(ValueError, match="len\\(block_tables\\)=3"):
        call(block_tables=one_table(3))
    with pytest.raises(TypeError, match="logits\\[1\\] has dtype float32, logits\\[0\\] has bfloat16"):
        call(logits=[a["logits"][0], np.zeros((3, 10), np.float32)])
    with pytest.raises(TypeError, match="logits\\[0\\].*bfloat16 or float32.*float16"):
        call(logits=[np.zeros((3, 10), np.float16)] * 2)
    for bad, err in ((0, ValueError), (-2, ValueError), (1.0, TypeError), (True, TypeError),
                     (2**31, ValueError)):
        with pytest.raises(err, match="interleave"):
            call(interleave=bad)
    with pytest.raises(ValueError, match="logits\\[1\\].*R=2"):
        call(logits=[a["logits"][0], np.zeros((2, 10), BF16)])
    with pytest.raises(ValueError, match="logits\\[0\\].*2-D"):
        call(logits=[np.zeros(10, BF16)] * 2)
    with pytest.raises(TypeError, match="row_ends\\[0\\].*float"):
        call(row_ends=[np.zeros(3, np.float32)] * 2)
    with pytest.raises(ValueError, match="req_id\\[1\\].*shape"):
        call(req_id=[i32([0] * 3), i32([0] * 4)])
    with pytest.raises(ValueError, match="row_ends\\[0\\].*outside int32"):
        call(row_ends=[np.array([2**31] * 3)] * 2)
    with pytest.raises(ValueError, match="block_tables\\[0\\].*2-D"):
        call(block_tables=[i32([0, 1])] * 2)
    with pytest.raises(TypeError, match="logits must be a sequence"):
        call(logits=np.zeros((2, 3, 10), BF16))
    with pytest.raises(ValueError, match="block_size=0"):
        call(block_size=0)
    with pytest.raises(TypeError, match="topk"):
        call(topk=64.0)
    with pytest.raises(ValueError, match="topk"):
        call(topk=0)


def test_protocol_config_limits():
    a = _args()
    args = (a["logits"], a["row_ends"], a["req_id"], a["block_tables"])
    for topk, n, msg in [(48, 32, "topk=48"), (64, 48, "local_topk=48"), (64, 96, "local_topk=96"),
                         (8192, 32, "topk=8192")]:
        with pytest.raises(ValueError, match=msg):
            ref.protocol_merge(*args, topk=topk, local_topk=n, block_size=1)
    big = _args(W=17, R=1, L=2)
    with pytest.raises(ValueError, match="world=17"):
        ref.protocol_merge(big["logits"], big["row_ends"], big["req_id"], big["block_tables"],
                           topk=64, local_topk=32, block_size=1)
    # the oracle has no such limits
    ref.topk_merge(big["logits"], big["row_ends"], big["req_id"], big["block_tables"], topk=3, block_size=1)
    long = [np.zeros((1, layout.MAX_LOCAL_LEN + 1), BF16)]
    with pytest.raises(ValueError, match="L=131073"):
        ref.protocol_merge(long, [i32([1])], [i32([0])], [i32([[0]])], topk=64, local_topk=32,
                           block_size=1 << 20)


def test_merge_result_is_frozen():
    from jax_dsa_exchange import MergeOutput

    res = oracle([bf([[1.0]])], topk=1)[0]
    assert type(res) is MergeOutput  # the op's result type too
    with pytest.raises(AttributeError):
        res.ids = None


def test_bad_lookups_same_rule_in_the_xla_path(rng):
    """kv_rows -1 for a selected token whose lookup is out of range; ids/counts unchanged."""
    import jax

    from jax_dsa_exchange.xla_path import xla_topk_merge_sharded

    c = cases.bad_lookup_case(rng, world=1, topk=64, local_topk=32)
    want = ref.topk_merge(*c.args, topk=64, block_size=c.block_size)[0]
    assert (want.kv_rows == -1).sum() > (want.ids == -1).sum()  # some lookups did fail
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("dcp",))
    got = xla_topk_merge_sharded(mesh, "dcp", *[np.stack(x) for x in c.args], topk=64,
                                 block_size=c.block_size, with_ids=True)
    for k in ("kv_rows", "counts", "ids"):
        np.testing.assert_array_equal(np.asarray(getattr(got, k))[0], getattr(want, k), err_msg=k)


# ---------------------------------------------------------------------------
# float32 scores (docs/DESIGN.md §4-§5)


def f32(rows) -> np.ndarray:
    return np.array(rows, np.float32)


def test_float32_scores_equal_in_bf16_rank_by_float32():
    # 1 + 2**-20 and 1 + 2**-21 both round to 1.0 in bfloat16; in float32 they differ.
    a, b = np.float32(1 + 2**-20), np.float32(1 + 2**-21)
    assert BF16(a) == BF16(b)
    res = oracle([f32([[1.0, b, a]]), f32([[b, 1.0, 0.5]])], topk=2)
    # g = l * 2 + q: a (rank 0, l 2: g 4), then the first b by position (rank 1, l 0: g 1; rank
    # 0's b is g 2); bfloat16 ranking would take the lowest positions of the tied 1.0s instead
    assert res[0].ids.tolist() == [[4, 1]]  # owner-major


def test_float32_special_values():
    x = f32([[NAN, -0.0, 0.0, INF, -INF, -NAN, 3.0e38, 1e-45]])
    res = oracle([x], topk=6)
    # +inf (l 3), 3e38 (l 6), 1e-45 (l 7), then -0 (l 1) == +0 (l 2) by position, then -inf (l 4)
    assert sorted(res[0].ids[0].tolist()) == [1, 2, 3, 4, 6, 7]
    res = oracle([x], topk=5)
    assert sorted(res[0].ids[0].tolist()) == [1, 2, 3, 6, 7]


def test_ord32_is_monotone_and_canonical(rng):
    bits = np.concatenate([rng.integers(0, 2**32, 200000, dtype=np.uint64).astype(np.uint32),
                           np.array(cases.SPECIAL_BITS32, np.uint32)])
    vals = bits.view(np.float32)
    code = ref.ord32(bits)
    nan = np.isnan(vals)
    assert (code[nan] == 0).all() and (code[~nan] > 0).all() and code.max() <= 0xFFFFFFFF
    v, c = vals[~nan].astype(np.float64), code[~nan].astype(np.int64)
    order = np.argsort(v, kind="stable")
    v, c = v[order], c[order]
    assert (np.diff(c)[np.diff(v) > 0] > 0).all()  # larger value: larger code
    assert (np.diff(c)[np.diff(v) == 0] == 0).all()  # equal values (-0 == +0): equal codes
    assert ref.ord32(np.array([0x80000000, 0], np.uint32)).tolist() == [0x80000000] * 2
    assert ref.ord32(np.float32(-np.inf)) == 0x007FFFFF and ref.ord32(np.float32(np.inf)) == 0xFF800000


def test_float32_pack_decode_round_trip(rng):
    for world, interleave in ((1, 1), (3, 1), (8, 16), (16, 64)):
        for n in (32, 96):
            L = int(rng.choice([1, 31, 200, 70000]))
            rank = int(rng.integers(0, world))
            x = cases.random_logits(rng, 1, L, distinct_values=int(rng.integers(1, 5)), dtype="float32")[0]
            x[rng.random(L) < 0.1] = np.float32("nan")
            end = int(rng.integers(-2, L + 3))
            w = ref.pack_local_topk(x, end, n)
            assert w.shape == (layout.row_words(n, "float32"),) == (2 * n,)
            l = ref.local_topk_indices(x, end, n)
            keys = ref.decode_keys(w, n, rank, world, interleave=interleave, score_dtype="float32")
            valid = keys[keys != 0]
            assert valid.size == l.size
            assert (w[2 * l.size:] == 0).all()
            assert ref.key_to_gid(valid, world, interleave).tolist() == \
                layout.global_position(l, rank, world, interleave).tolist()
            G = layout.gid_bits(world, interleave)
            assert ((valid >> np.uint64(G)) == ref.ord32(x[l])).all()


F32_CONFIGS = [(64, 32), (256, 96), (2048, 256)]


@pytest.mark.parametrize("topk,local_topk", F32_CONFIGS, ids=[f"K{k}-N{n}" for k, n in F32_CONFIGS])
@pytest.mark.parametrize("world", WORLDS, ids=[f"W{w}" for w in WORLDS])
def test_protocol_equals_oracle_float32(world, topk, local_topk, seed):
    rng = np.random.default_rng([seed, world, topk, local_topk, 32])
    cs = cases.adversarial_cases(rng, world=world, topk=topk, local_topk=local_topk, dtype="float32",
                                 rows=_rows(world, topk), uneven_cols=True, block_size=int(rng.choice([1, 16])))
    assert all(c.dtype == "float32" for c in cs) and "bf16_collapse" in {c.name for c in cs}
    for case in cs:
        check_case(case)


def test_float32_collapse_differs_from_bfloat16(rng):
    """The float32 answer is not the bfloat16 one: rounding first changes the selection."""
    case = [c for c in cases.adversarial_cases(rng, world=2, topk=64, local_topk=32, rows=4, dtype="float32")
            if c.name == "bf16_collapse"][0]
    f = case.oracle()
    b = ref.topk_merge([x.astype(BF16) for x in case.logits], *case.args[1:], topk=64,
                       block_size=case.block_size)
    assert any(not np.array_equal(f[0].ids[i], b[0].ids[i]) for i in range(case.rows))


def test_float32_rows_of_2_to_the_17(rng):
    L = layout.MAX_LOCAL_LEN
    case = cases.random_case(rng, world=2, topk=2048, local_topk=512, rows=1, cols=L, row_ends="full",
                             distinct_values=3000, dtype="float32")
    check_case(case)
    sat = cases.saturating_case(rng, 2, 2048, 512, 1, rows=1, cols=L, dtype="float32")
    got = check_case(sat)
    assert got[0].saturated.tolist() != [0]


# ---------------------------------------------------------------------------
# KV caches interleaved in chunks of I tokens (docs/DESIGN.md §4)


def test_interleaved_global_positions_by_hand():
    # W = 2, I = 2: rank 0 holds tokens 0 1 4 5 8 ..., rank 1 holds 2 3 6 7 ...
    assert [layout.global_position(l, 0, 2, 2) for l in range(5)] == [0, 1, 4, 5, 8]
    assert [layout.global_position(l, 1, 2, 2) for l in range(5)] == [2, 3, 6, 7, 10]
    x = [bf([[5, 5, 5, 5]]), bf([[5, 5, 5, 5]])]
    res = ref.topk_merge(x, [i32([4])] * 2, [i32([0])] * 2, one_table(2), topk=5, block_size=1, interleave=2)
    # the five lowest g: 0 1 (r0 l0 l1), 2 3 (r1 l0 l1), 4 (r0 l2); owner-major in ids
    assert res[0].ids.tolist() == [[0, 1, 4, 2, 3]]
    assert res[0].counts.tolist() == [3] and res[1].counts.tolist() == [2]
    assert res[0].kv_rows[0, :3].tolist() == [0, 1, 2] and res[1].kv_rows[0, :2].tolist() == [0, 1]
    # I = 1 is the token-by-token layout
    one = ref.topk_merge(x, [i32([4])] * 2, [i32([0])] * 2, one_table(2), topk=5, block_size=1)
    assert one[0].ids.tolist() == [[0, 2, 4, 1, 3]]


def test_gid_bits_and_limits():
    for w in range(1, 17):
        assert layout.gid_bits(w) == layout.gid_bits(w, 1) == 17 + (w - 1).bit_length()
        for interleave in (2, 16, 64, 3, 1000):
            assert layout.max_global_position(w, interleave) < 2**layout.gid_bits(w, interleave)
    layout.check_interleave(2**27, 16)
    with pytest.raises(ValueError, match="interleave=268435456 with world=16"):
        layout.check_interleave(2**28, 16)


INTERLEAVES = [2, 16, 64]


@pytest.mark.parametrize("interleave", INTERLEAVES, ids=[f"I{i}" for i in INTERLEAVES])
@pytest.mark.parametrize("world", [1, 2, 3, 8, 16], ids=lambda w: f"W{w}")
def test_protocol_equals_oracle_interleaved(world, interleave, seed):
    rng = np.random.default_rng([seed, world, interleave, 49])
    topk, local_topk = (256, 64) if world < 8 else (2048, 256)
    cs = cases.adversarial_cases(rng, world=world, topk=topk, local_topk=local_topk, interleave=interleave,
                                 rows=_rows(world, topk), uneven_cols=True, block_size=int(rng.choice([1, 16])),
                                 dtype="float32" if seed % 2 else "bfloat16")
    assert "chunk_ties" in {c.name for c in cs} and all(c.interleave == interleave for c in cs)
    for case in cs:
        check_case(case)
        # every selected g names a valid token: a local index below its owner's row end
        ids = case.oracle()[0].ids.astype(np.int64)
        owner, lidx = layout.owner_and_local(ids, world, interleave)
        for i in range(case.rows):
            sel = ids[i] >= 0
            ends = np.array([np.clip(case.row_ends[q][i], 0, case.cols[q]) for q in range(world)])
            assert (lidx[i][sel] < ends[owner[i][sel]]).all(), case


def test_interleave_changes_the_tie_order(rng):
    c = cases.random_case(rng, world=3, topk=64, local_topk=32, rows=3, cols=100, distinct_values=1,
                          row_ends="full")
    one = c.oracle()
    four = dataclasses.replace(c, interleave=4).oracle()
    assert not np.array_equal(one[0].ids, four[0].ids)
    assert all(set(one[0].ids[i]) != set(four[0].ids[i]) for i in range(c.rows))


def test_kernel_interleave_limit():
    """The GPU kernels rank positions of up to 22 bits: every W with every I <= 2^17; a larger
    I is a ValueError naming the XLA path (which takes it)."""
    for w in (1, 2, 3, 8, 16):
        for interleave in (1, 2, 3, 16, 64, 1000, layout.MAX_LOCAL_LEN):
            layout.check_kernel_interleave(interleave, w)
    with pytest.raises(ValueError, match=r"interleave=1048576 with world=16: global positions of 24 bits; the GPU "
                                         r"kernels take up to 22 .*xla_path.xla_topk_merge"):
        layout.check_kernel_interleave(2**20, 16)
    layout.check_interleave(2**20, 16)  # (the XLA path's limit: int32 positions)
    with pytest.raises(ValueError, match=r"interleave=2147483648 must be in \[1, 2147483647\]"):
        layout.check_interleave(2**31, 1)


def test_global_positions_fit_int32_arrays():
    """global_position on int32 arrays never forms W * I: the largest accepted I gives the
    largest positions without overflowing."""
    interleave = 2**30
    layout.check_interleave(interleave, 2)
    l = np.array([0, 1, layout.MAX_LOCAL_LEN - 1], np.int32)
    g = layout.global_position(l, np.int32(1), 2, interleave)
    assert g.dtype == np.int32 and g.tolist() == [2**30, 2**30 + 1, 2**30 + layout.MAX_LOCAL_LEN - 1]
