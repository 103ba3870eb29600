"""A NumPy model of the producer's split select (kernels/select.py, `select_row`),
step by step as the kernel computes it: C slices, the 11-bit histograms summed over
the cluster, the boundary bin, the 5-bit histograms inside it, the boundary score and
need_eq, what precedes each slice, and every kept token's position, computed per thread as
the kernel partitions the compaction (contiguous 16-token units per thread, or, in a CTA
with a crowded boundary bin, even shares of a list of its refined mask's bits).  Checked on CPU
against reference.pack_local_topk for every cluster size the launcher can choose, on
the shared kinds of hard rows.  (The GPU tests compare the kernel's bytes with the same
reference: tests/test_select_gpu.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from jax_dsa_exchange import layout, reference
from jax_dsa_exchange.testing import cases

B1, NB1, NB2 = 11, 2048, 32
BOUNDED_MIN = 2  # (the kernel's select.BOUNDED_MIN is larger; the model checks the bound at every C >= 2)
TB = 512  # threads per CTA (kernels/common.TB)
MASK_WORDS = layout.MAX_LOCAL_LEN // 32  # select.MASK_WORDS: the mask's words, its tail the list
# select.BIG_B1 / BIG_RATIO (test_big_rule_constants checks them): a kept slice whose
# boundary bin holds more than max(BIG_B1, BIG_RATIO x its count above the bin) refines its
# mask and walks a list
BIG_B1, BIG_RATIO = 512, 8


def split_select_model(bits: np.ndarray, row_end: int, n: int, csize: int, cache_cap: int = 65536,
                       big_b1: int = BIG_B1, big_ratio: int = BIG_RATIO, paths: list | None = None,
                       parts: list | None = None) -> np.ndarray:
    """The packed row (layout.row_words(n) uint32 words) select_row builds in CTA 0.
    ``cache_cap``: the launch's kept slice length (a longer slice is re-read, never "big");
    ``paths``: gets each CTA's compaction path ("units", "list" or "refined units");
    ``parts``: gets what each CTA of select_push's own-part mode holds and returns, as
    (its own row buffer, p0, p1, p_end, writer) (see own_part_push)."""
    end = int(np.clip(row_end, 0, min(bits.size, layout.MAX_LOCAL_LEN)))
    o = reference.ord16(bits[:end]).astype(np.int64)  # 0 = NaN
    S = -(-(-(-end // csize)) // 8) * 8
    starts = [min(c * S, end) for c in range(csize)]
    slices = [o[s:min(s + S, end)] for s in starts]
    # pass 1: per-CTA histograms of the high 11 bits, summed over the cluster
    h1 = np.array([np.bincount(x[x != 0] >> (16 - B1), minlength=NB1) for x in slices])
    total = int(h1.sum())
    g1 = h1.sum(0)
    if csize >= BOUNDED_MIN:
        # the kernel sums only the bins in [lo, hi] over the cluster: lo = the largest of the
        # CTAs' own n-th bins (0 for a CTA with fewer than n), hi = the largest of their top
        # non-empty bins; the others count 0 in its scan (and the total comes from the
        # CTAs' published counts)
        def nth_bin(h):
            top = np.cumsum(h[::-1])
            return 0 if top[-1] < n else NB1 - 1 - int(np.searchsorted(top, n))

        lo = max(nth_bin(h) for h in h1)
        hi = max((int(np.nonzero(h)[0].max()) if h.any() else 0) for h in h1)
        keep = np.zeros(NB1, bool)
        keep[lo:hi + 1] = True
        g1 = np.where(keep, g1, 0)
    gt_before = np.zeros(csize, np.int64)
    eq_before = np.zeros(csize, np.int64)
    gt_own = np.zeros(csize, np.int64)
    eq_own = np.zeros(csize, np.int64)
    mthr = 1  # pass 2's mask: ord16 >= mthr (every valid token unless the row has > n)
    if total > n:
        from_top = np.cumsum(g1[::-1])
        i = int(np.searchsorted(from_top, n))  # first bin (from the top) reaching n
        b1 = NB1 - 1 - i
        above1 = int(from_top[i] - g1[b1])
        own_above1 = h1[:, b1 + 1:].sum(1)
        # pass 2: the low 5 bits inside b1
        h2 = np.array([np.bincount(x[(x >> (16 - B1)) == b1] & (NB2 - 1), minlength=NB2)
                       for x in slices])  # fmt: skip
        g2 = h2.sum(0)
        need2 = n - above1
        top2 = np.cumsum(g2[::-1])
        k = int(np.searchsorted(top2, need2))
        lowv = NB2 - 1 - k
        above2 = int(top2[k] - g2[lowv])
        v = (b1 << (16 - B1)) | lowv
        mthr = b1 << (16 - B1)
        need_eq = n - above1 - above2
        per_gt = own_above1 + h2[:, lowv + 1:].sum(1)
        per_eq = h2[:, lowv]
        for c in range(csize):
            gt_before[c], eq_before[c] = per_gt[:c].sum(), per_eq[:c].sum()
        gt_own[:], eq_own[:] = per_gt, per_eq
    else:
        v, need_eq = 0, 0
        per = h1.sum(1)
        for c in range(csize):
            gt_before[c] = per[:c].sum()
        gt_own[:] = per
    # compaction, as the kernel partitions it: thread t of a CTA walks the mask bits of its
    # contiguous 16-token units [t upt, (t + 1) upt) -- or, in a big CTA whose list fits,
    # entries [t q, (t + 1) q) of the list of its (refined) mask's bits -- counts (> v, == v),
    # one exclusive scan over the threads, then writes each kept token at its position
    row = np.zeros(layout.row_words(n), np.uint32)
    p_end = min(total, n)
    for c, (s0, x) in enumerate(zip(starts, slices)):
        own = np.zeros_like(row)  # this CTA's row buffer in own-part mode
        p0 = min(int(gt_before[c]) + min(int(eq_before[c]), need_eq), n)
        p1 = min(int(gt_before[c] + gt_own[c]) + min(int(eq_before[c] + eq_own[c]), need_eq), n)
        s_len = x.size
        nvec4 = -(-(-(-s_len // 8)) // 4) * 4
        nu = nvec4 // 2
        upt = -(-nu // TB)
        mask = x >= mthr  # pass 2's mask (0 = NaN / invalid never reaches mthr >= 1)
        if total > n:
            assert not (x[~mask] >= v).any()  # the mask misses no kept or tied token
        big = (S <= cache_cap and total > n
               and h1[c][b1] > max(big_b1, big_ratio * int(own_above1[c])))  # fmt: skip
        path = "units"
        if big:
            mask = mask & (x >= v)  # refine_mask
            path = "refined units"
        seq = np.flatnonzero(mask)  # the set bits in index order
        # thread t's share: seq[lo[t]:hi[t]] (its units' bits; the list's entries below)
        unit_of = seq // 16
        ts = np.arange(TB)
        lo = np.searchsorted(unit_of, np.minimum(ts * upt, nu))
        hi = np.searchsorted(unit_of, np.minimum((ts + 1) * upt, nu))
        if big:
            # make_list: per-thread popcounts, an exclusive scan, each thread's bits written
            # at its rank (build_list), then even shares of the list
            cnt = hi - lo
            base = np.concatenate([[0], np.cumsum(cnt)[:-1]])
            nbits = int(cnt.sum())
            lw = -(-nvec4 // 16) * 4
            if nbits <= MASK_WORDS - lw:
                lst = np.full(nbits, -1, np.int64)
                for t in range(TB):
                    lst[base[t]:base[t] + cnt[t]] = seq[lo[t]:hi[t]]
                assert np.array_equal(lst, seq)  # the list is the bits in index order
                q = -(-nbits // TB)
                lo = np.minimum(ts * q, nbits)
                hi = np.minimum(lo + q, nbits)
                path = "list"
        if paths is not None:
            paths.append(path)
        assert (lo <= hi).all() and (hi[:-1] <= lo[1:]).all() and hi[-1] == seq.size  # a partition
        cgt = np.concatenate([[0], np.cumsum(x[seq] > v)])
        ceq = np.concatenate([[0], np.cumsum(x[seq] == v)]) if v != 0 else np.zeros(seq.size + 1, np.int64)
        ngt, neq = cgt[hi] - cgt[lo], ceq[hi] - ceq[lo]
        gt_b0 = gt_before[c] + np.concatenate([[0], np.cumsum(ngt)[:-1]])
        eq_b0 = eq_before[c] + np.concatenate([[0], np.cumsum(neq)[:-1]])
        shares = [seq[lo[t]:hi[t]] for t in range(TB)]
        for t in range(TB):
            gt_b, eq_b = int(gt_b0[t]), int(eq_b0[t])
            for i in shares[t].tolist():
                oi = int(x[i])
                pos = -1
                if oi > v:
                    pos = gt_b + min(eq_b, need_eq)
                    gt_b += 1
                if oi == v and v != 0:
                    if eq_b < need_eq:
                        pos = gt_b + eq_b
                    eq_b += 1
                if pos >= 0:
                    assert pos < n, (pos, n)
                    assert p0 <= pos < p1, (pos, p0, p1)  # the CTA's part is contiguous
                    lu = s0 + i
                    row[pos] = own[pos] = (oi << 16) | (0xFFFF - (lu & 0xFFFF))
                    if lu >> 16:
                        row[n + pos // 32] |= np.uint32(1 << (pos % 32))
                        own[n + pos // 32] |= np.uint32(1 << (pos % 32))
        assert ngt.sum() == gt_own[c]  # the counts the kernel published
        assert neq.sum() == eq_own[c]
        if parts is not None:
            writer = int(c == min((1 << 16) // max(S, 8), csize - 1))
            parts.append((own, p0, p1, p_end, writer))
    return row


def own_part_push(parts: list, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The LL row's words as select_push's own-part mode stores them, thread by thread as
    select_push.push_part maps them (records r_lo + tid + j TB, the edge halves by threads
    TB - 1 / TB - 2, the mask records by threads < mrec of the writer; a one-CTA cluster
    the whole row by the old loop), as (byte offset of an 8-byte half, word) stores ->
    (the words, how many times each 8-byte half was stored).  CTA c stores positions
    [p0, p1) of its own buffer (the last CTA up to n: the empty words), the writer every
    mask word, from p_hi = its first own set mask bit (or its hi) and p_end."""
    rw = layout.row_words(n)
    half = layout.LL_HALF_BYTES
    out = np.zeros(rw, np.uint32)
    stores = np.zeros(rw, np.int64)
    tids = np.arange(TB)

    def store(offsets, words):
        j = np.asarray(offsets, np.int64) // half  # word j's half lies at byte 8 j
        assert (np.asarray(offsets) % half == 0).all()
        np.add.at(stores, j, 1)
        out[j] = words

    csize = len(parts)
    for c, (own, p0, p1, p_end, writer) in enumerate(parts):
        if csize == 1:  # the whole-row loop: record i by thread i, both halves
            i = tids[tids < rw // 2]
            store(np.concatenate([16 * i, 16 * i + 8]), np.concatenate([own[2 * i], own[2 * i + 1]]))
            continue
        lo, hi = p0, (n if c == csize - 1 else p1)
        r_lo, r_hi = (lo + 1) >> 1, hi >> 1
        for j in range(-(-(rw // 2) // TB)):  # nr: records per thread at most
            i = r_lo + tids + j * TB
            i = i[i < r_hi]
            store(np.concatenate([16 * i, 16 * i + 8]), np.concatenate([own[2 * i], own[2 * i + 1]]))
        if lo < hi and lo & 1:  # thread TB - 1: the word at an odd lo, its record's upper half
            store([16 * (lo >> 1) + 8], [own[lo]])
        if lo < hi and hi & 1:  # thread TB - 2: the word before an odd hi, the lower half
            store([16 * (hi >> 1)], [own[hi - 1]])
        if writer:
            mw = own[n:n + n // 32]
            f = n
            for k in np.flatnonzero(mw):  # (warp 0: lane k's word, its lowest set bit; a min)
                f = min(f, 32 * int(k) + int(np.flatnonzero((int(mw[k]) >> np.arange(32)) & 1)[0]))
            p_hi = min(f, hi)
            mrec = (rw - n) // 2
            assert mrec <= 32  # select_push.own_part_ok: one warp's lanes
            words = []
            for k in range(2 * mrec):  # thread t < mrec: mask words 2 t, 2 t + 1
                a = min(max(p_hi - 32 * k, 0), 32)
                b = min(max(p_end - 32 * k, 0), 32)
                words.append(((1 << b) - 1) ^ ((1 << a) - 1) if (b > a and k < n // 32) else 0)
            t = np.arange(mrec)
            store(np.concatenate([16 * (n // 2 + t), 16 * (n // 2 + t) + 8]),
                  np.array(words[0::2] + words[1::2], np.uint32))
    return out, stores


def _rows(kind, rng, L):
    if kind == "random":
        return cases.random_logits(rng, 3, L)
    if kind == "ties":
        return cases.random_logits(rng, 3, L, distinct_values=3)
    if kind == "equal":
        return np.full((3, L), -1.5, cases.BF16)
    if kind in ("recent", "runs"):  # kept tokens in dense runs (as tests/test_select_gpu.py)
        x = rng.standard_normal((3, L)).astype(np.float32)
        if kind == "recent":
            x += np.linspace(0.0, 8.0, L, dtype=np.float32)[None, :]
        else:
            for t in range(3):
                for _ in range(int(rng.integers(1, 6))):
                    a = int(rng.integers(0, L))
                    x[t, a:a + int(rng.integers(40, 700))] += 6.0
        return (x.view(np.uint32) >> 16).astype(np.uint16).view(cases.BF16)
    x = cases.random_logits(rng, 3, L).view(np.uint16).copy()
    specials = np.array([0x7FC0, 0xFFC1, 0x7F81, 0x0000, 0x8000, 0x7F80, 0xFF80], np.uint16)
    m = rng.random(x.shape) < 0.3
    x[m] = rng.choice(specials, int(m.sum()))
    return x.view(cases.BF16)


@pytest.mark.parametrize("kind", ["random", "ties", "equal", "specials", "recent", "runs"])
@pytest.mark.parametrize("n", [32, 512])
def test_split_select_model_is_the_local_topk(kind, n):
    rng = np.random.default_rng(hash((kind, n)) % 2**32)
    for L in (n - 1, 3 * n + 5, 4099, 70001):
        logits = _rows(kind, rng, L)
        ends = [0, 1, n - 1, n, n + 1, L // 2 + 3, L, L + 9, -4]
        for t, end in enumerate(ends):
            bits = logits[t % 3].view(np.uint16)
            want = reference.pack_local_topk(bits, end, n)
            for csize in range(1, layout.PRODUCER_CLUSTER_MAX + 1):
                parts = []
                got = split_select_model(bits, end, n, csize, parts=parts)
                assert np.array_equal(got, want), (kind, n, L, end, csize)
                # select_push's own-part mode: every word stored exactly once, the same row
                pushed, stores = own_part_push(parts, n)
                assert (stores == 1).all(), (kind, n, L, end, csize)
                assert np.array_equal(pushed, want), (kind, n, L, end, csize)
                assert sum(p[4] for p in parts) == 1


@pytest.mark.parametrize("kind", ["random", "ties", "equal", "recent", "runs"])
def test_crowded_bin_path_model(kind):
    """The crowded-bin path (refine_mask, make_list, even shares) forced on every kept slice
    (thresholds 0) is the local top-K too; with the kernel's thresholds it takes the list on
    the recent pattern and never on random scores."""
    rng = np.random.default_rng(hash(("crowded", kind)) % 2**32)
    seen = set()
    for L in (4099, 70001):
        logits = _rows(kind, rng, L)
        for t, end in enumerate([L, L // 2 + 3, 600]):
            bits = logits[t % 3].view(np.uint16)
            for n in (32, 512):
                want = reference.pack_local_topk(bits, end, n)
                for csize in (1, 2, 3, 8):
                    paths = []
                    got = split_select_model(bits, end, n, csize, big_b1=0, big_ratio=0, paths=paths)
                    assert np.array_equal(got, want), (kind, L, end, n, csize)
                    seen.update(paths)
                    paths = []
                    assert np.array_equal(split_select_model(bits, end, n, csize, paths=paths), want)
                    if kind == "random":
                        assert set(paths) == {"units"}, (L, end, n, csize, paths)
                    if kind == "recent" and L == 70001 and end == L and n == 512 and csize in (2, 3):
                        assert "list" in paths, (csize, paths)
    assert "list" in seen
    if kind in ("ties", "equal"):
        assert "refined units" in seen  # ties at v that do not fit the list


def test_big_rule_constants():
    """The model's thresholds and shapes are the kernel's (select.py needs the CuTe DSL)."""
    pytest.importorskip("cutlass")
    from jax_dsa_exchange.kernels import common, select

    assert (select.BIG_B1, select.BIG_RATIO, select.MASK_WORDS, common.TB) == (
        BIG_B1, BIG_RATIO, MASK_WORDS, TB)


def test_model_covers_bit_16_of_l():
    """Rows longer than 2^16 keep bit 16 of l in the mask words, whatever the split."""
    rng = np.random.default_rng(3)
    L = layout.MAX_LOCAL_LEN
    bits = cases.random_logits(rng, 1, L)[0].view(np.uint16).copy()
    bits[-40:] = 0x7F00  # the largest finite scores sit past 2^16
    want = reference.pack_local_topk(bits, L, 64)
    assert want[64:66].any()
    for csize in (1, 3, 8):
        assert np.array_equal(split_select_model(bits, L, 64, csize), want)
    # the own-part push's mask words (one writer, from its first set bit) on rows where the
    # kept tokens past 2^16 start inside a slice, at a slice boundary, or in no slice
    for end, tail in ((L, 40), (L - 5, 3000), (70001, 4460), (65536 + 8, 8), (65536, 40)):
        b = bits.copy()
        b[end - tail:end] = 0x7F00
        for n in (64, 512, 2048):  # (2048: 64 mask words, the most the own-part push serves)
            want = reference.pack_local_topk(b, end, n)
            for csize in range(2, layout.PRODUCER_CLUSTER_MAX + 1):
                parts = []
                assert np.array_equal(split_select_model(b, end, n, csize, parts=parts), want)
                pushed, stores = own_part_push(parts, n)
                assert (stores == 1).all() and np.array_equal(pushed, want), (end, tail, n, csize)


def test_ord16_short_form_and_its_guard():
    """select.ord16_quad's packed arithmetic, on every bf16 in both halves of a pair: the
    guard (ord16_special) is set exactly for NaN and +-0, and without it the short form
    (ord16_fast) equals reference.ord16."""
    h = np.arange(65536, dtype=np.uint32)
    want = reference.ord16(h.astype(np.uint16)).astype(np.uint32)
    special = ((h & 0x7FFF) > 0x7F80) | ((h & 0x7FFF) == 0)
    for other in (0x3F80, 0x8000, 0x7FC0, 0x0000, 0xFF80, 0x0001):
        for shift in (0, 16):
            w = (h << shift) | (np.uint32(other) << (16 - shift))
            a = w & 0x7FFF7FFF
            guard = ((a + 0x007F007F) | ~((a | 0x80008000) - 0x00010001)) & 0x80008000
            fast = w ^ (((w >> 15) & 0x00010001) * 0x7FFF) ^ 0x80008000
            mine = (fast >> shift) & 0xFFFF
            mine_guard = (guard >> shift) & 0x8000
            assert np.array_equal(mine_guard != 0, special), (other, shift)
            assert np.array_equal(mine[~special], want[~special]), (other, shift)
