"""NumPy model of the merge kernel's select (kernels/merge.py, fast path), checked
against reference.protocol_merge's round 1 / round 2 keys on the shared cases (CPU).

The kernel's select on the <= W*N candidates of a row (positions in owner-major
order, lists ascending l):
  1. stats: count of nonzero words, min and max ord16 score s;
  2. fewer than K: everything nonzero is selected, T = 0;
  3. histogram of (s - lo) >> shift over NB bins (shift the smallest that fits the
     range), top-down scan -> bin of the K-th key; if shift > 0 a second histogram
     of the low shift bits inside that bin -> boundary score v, c_gt = #(s > v),
     m = #(s == v); need = K - c_gt;
  4. tie-break on g inside the boundary score: m <= MMAX -> rank of each eq key's g
     by counting (the need-th smallest g is gT); else three histograms of
     u = 2^G - 1 - g (10, 6 and G - 16 bits) find it;
  5. selection = s > v or (s == v and g <= gT), an order-preserving compaction.
"""

from __future__ import annotations

import numpy as np
import pytest

from jax_dsa_exchange import layout, reference
from jax_dsa_exchange.testing import cases

NB = 1024  # bins of the first score histogram (kernels/merge.py SCORE_BINS)
MMAX = 256  # most keys at the boundary score resolved by ranking (merge.py EQ_MAX)


def model_select(s, g, K, nb=NB, mmax=MMAX, G=None):
    """s: ord16 scores (0 = empty), g: global positions, one per candidate position.
    Returns (selected mask, v, gT, path)."""
    s = s.astype(np.int64)
    g = g.astype(np.int64)
    nz = s != 0
    total = int(nz.sum())
    if total < K:
        return nz, 0, -1, "all"
    lo, hi = int(s[nz].min()), int(s[nz].max())
    shift = 0
    while ((hi - lo) >> shift) >= nb:
        shift += 1
    b = (s - lo) >> shift
    hist = np.bincount(b[nz], minlength=nb)
    cum = 0
    for bb in range(nb - 1, -1, -1):  # top-down
        if cum + hist[bb] >= K:
            break
        cum += hist[bb]
    above = cum
    if shift:
        inb = nz & (b == bb)
        sub = (s - lo) & ((1 << shift) - 1)
        h2 = np.bincount(sub[inb], minlength=1 << shift)
        cum2 = above
        for b2 in range((1 << shift) - 1, -1, -1):
            if cum2 + h2[b2] >= K:
                break
            cum2 += h2[b2]
        above = cum2
        v = lo + (bb << shift) + b2
    else:
        v = lo + bb
    eq = nz & (s == v)
    m = int(eq.sum())
    need = K - above
    assert int((nz & (s > v)).sum()) == above and 1 <= need <= m
    if m <= mmax:
        ge = np.sort(g[eq])
        gT = int(ge[need - 1])
        path = "rank"
    else:
        # three histograms of u = gmax - g: bits [G-10, G), [G-16, G-10), [0, G-16)
        G = int(g.max()).bit_length() if G is None else G
        gmax = (1 << G) - 1
        u = gmax - g[eq]
        uT, nd = 0, need
        for hi, lo in ((G, G - 10), (G - 10, G - 16), (G - 16, 0)):
            cand = u[(u >> hi) == (uT >> hi)]
            h = np.bincount((cand >> lo) & ((1 << (hi - lo)) - 1), minlength=1 << (hi - lo))
            cum = 0
            for b in range(h.size - 1, -1, -1):
                if cum + h[b] >= nd:
                    break
                cum += h[b]
            uT |= b << lo
            nd -= cum
        gT = gmax - uT
        assert gT == int(np.sort(g[eq])[need - 1])
        path = "radix"
    sel = nz & ((s > v) | ((s == v) & (g <= gT)))
    return sel, v, gT, path


def _lists(case, i, n):
    W = case.world
    bits = [x.view(np.uint16) for x in case.logits]
    words = [reference.pack_local_topk(bits[q][i], case.row_ends[q][i], n) for q in range(W)]
    return words


def _decode(words, n, q, W):
    w = words[:n].astype(np.int64)
    j = np.arange(n)
    hib = (words[n + j // 32].astype(np.int64) >> (j % 32)) & 1
    l = (0xFFFF - (w & 0xFFFF)) | (hib << 16)
    return (w >> 16), l * W + q


@pytest.mark.parametrize("world", [1, 2, 4, 8, 16])
def test_model_matches_reference(world):
    rng = np.random.default_rng(50 + world)
    K, N = 256, 64
    allc = cases.adversarial_cases(rng, world=world, topk=K, local_topk=N, rows=8)
    allc += cases.adversarial_cases(rng, world=world, topk=K, local_topk=K, rows=4)
    allc.append(cases.random_case(rng, world=world, topk=K, local_topk=N, rows=8, cols=3000))
    paths = set()
    for case in allc:
        n = case.local_topk
        G = layout.gid_bits(world)
        for i in range(case.rows):
            words = _lists(case, i, n)
            sg = [_decode(words[q], n, q, world) for q in range(world)]
            s = np.concatenate([x[0] for x in sg])
            g = np.concatenate([x[1] for x in sg])
            lists = [reference.decode_keys(words[q], n, q, world) for q in range(world)]
            mask, T = reference.saturated_mask(lists, K, n)
            sel, v, gT, path = model_select(s, g, K, G=G)
            paths.add(path)
            Tm = 0 if path == "all" else (v << G) | ((1 << G) - 1 - gT)
            assert Tm == T, (case, i)
            keys = np.concatenate(lists)
            assert np.array_equal(sel, (keys != 0) & (keys >= np.uint64(T))), (case, i)
            # saturation from per-rank selected counts (prefix differences)
            pref = np.concatenate([[0], np.cumsum(sel)])[np.arange(world + 1) * n]
            t_owner = -1 if T == 0 else gT % world
            m2 = sum(1 << q for q in range(world)
                     if pref[q + 1] - pref[q] == n and t_owner != q)
            assert m2 == mask, (case, i)
    want = {"all", "rank"} | ({"radix"} if world * K > MMAX else set())
    assert want <= paths, paths


def test_model_small_bins_second_pass():
    """NB = 16 forces the second score histogram on ordinary data."""
    rng = np.random.default_rng(3)
    for _ in range(200):
        n = int(rng.integers(1, 400))
        s = rng.integers(0, 0x10000, n)
        s[rng.random(n) < 0.2] = 0
        s[rng.random(n) < 0.3] = s[0] or 5
        g = rng.permutation(min(10 * n, 1 << 17))[:n]
        K = int(rng.integers(1, n + 1))
        sel, v, gT, path = model_select(s, g, K, nb=16, mmax=8, G=17)
        order = np.lexsort((g, -s))
        order = order[s[order] != 0][:K]
        want = np.zeros(n, bool)
        want[order] = True
        assert np.array_equal(sel, want)


def test_find_bin_rotation_reads_every_lane_bin_in_distinct_banks():
    """merge.warp_find_bin with fbrot=1 (at 1024 bins: per = 32 bins a lane, 8 chunks of 16
    bytes): lane k sums its bins [nb - (k + 1) per, nb - k per) reading chunk (u + k) mod 8 at
    step u: the same bins as the plain order, and the 8 lanes of each quarter-warp (a 16-byte
    load's unit of bank-conflict resolution) in 8 distinct 4-bank groups, where the plain order
    (chunk u for every lane, as ptxas vectorized it: LDS.128) puts them in one (8-way)."""
    nb, per = 1024, 32
    nch = per // 4
    for k in range(32):
        start = nb - (k + 1) * per
        rot = [start + 4 * ((u + k) & (nch - 1)) + e for u in range(nch) for e in range(4)]
        assert sorted(rot) == list(range(start, start + per))
    for u in range(nch):
        for q in range(4):  # quarter-warps
            lanes = range(8 * q, 8 * q + 8)
            groups_rot = {((nb - (k + 1) * per) + 4 * ((u + k) & (nch - 1))) // 4 % 8 for k in lanes}
            groups_plain = {((nb - (k + 1) * per) + 4 * u) // 4 % 8 for k in lanes}
            assert len(groups_rot) == 8 and len(groups_plain) == 1


def _incl_scan(x):
    return np.cumsum(x)


@pytest.mark.parametrize("world,n", [(8, 512), (16, 256), (4, 256), (2, 512), (8, 128), (3, 64)])
def test_spread_layout_counts_every_position_in_order(world, n):
    """merge.py spread=1 (a candidate): round 1's pair group ip of warp w, lane l at position
    ip * 1024 + 64 w + 2 l (Merge.pos1).  The formulas of the kernel, for every thread: each
    position once; a pair group's 64 positions in one list, its LL record of lane l at the
    group's base record + l (Merge.pair_addr); the mask half of lane k (pair group k >> 1, half
    k & 1) covers the 32 list indices of that half-warp (load_r1_fast's vm); and the outputs'
    positions from the (group, warp) totals by Merge.spread_bases's scan (lane l holds totals l
    and 32 + l; group ip's base of warp w from lane (16 ip) % 32 + w of the first or second
    half) are the order-preserving compaction of a random selection."""
    TB, NW, S_ = 512, 16, 64 * 16
    nk1 = world * n
    kp = 2 * -(-nk1 // (2 * TB))
    assert n % 64 == 0 and S_ % n == 0
    ng = kp // 2
    seen = set()
    for w in range(NW):
        for ip in range(ng):
            v0 = ip * S_ + 64 * w
            q0, j0 = v0 // n, v0 % n
            for lane in range(32):
                v = v0 + 2 * lane
                if v >= nk1:
                    continue
                q, j = v // n, v % n
                assert (q, j) == (q0, j0 + 2 * lane)  # one list per group
                assert (j0 >> 1) + lane == j // 2  # its record
                seen.update((v, v + 1))
        for k in range(min(kp, 32)):  # the mask halves (lane k < kp)
            vm = (k >> 1) * S_ + 64 * w + (k & 1) * 32
            if vm < nk1:
                for lane in range(16 * (k & 1), 16 * (k & 1) + 16):  # the half-warp that reads it
                    v = (k >> 1) * S_ + 64 * w + 2 * lane
                    assert v // n == vm // n and (v % n) // 32 == (vm % n) // 32
    assert seen == set(range(nk1))
    rng = np.random.default_rng(world * 1000 + n)
    for _ in range(5):
        sel = rng.random(ng * S_) < rng.random()
        sel[nk1:] = False
        own_q = int(rng.integers(world))
        # warp totals per (group, warp), own << 16 | all (pair_counts' c2)
        wt = np.zeros(ng * NW, np.int64)
        for ip in range(ng):
            for w in range(NW):
                v0 = ip * S_ + 64 * w
                blk = sel[v0:v0 + 64]
                own = (v0 // n) == own_q
                wt[ip * NW + w] = int(blk.sum()) + ((int(blk.sum()) << 16) if own else 0)
        # spread_bases
        x0 = np.array([wt[lane] if lane < ng * NW else 0 for lane in range(32)])
        x1 = np.array([wt[lane + 32] if lane + 32 < ng * NW else 0 for lane in range(32)])
        s0, s1 = _incl_scan(x0), _incl_scan(x1)
        e0, e1 = s0 - x0, s1 - x1 + s0[31]
        tot = s0[31] + (s1[31] if ng * NW > 32 else 0)
        want_pos = np.cumsum(sel) - sel  # selected before each position
        own_sel = sel & (np.arange(ng * S_) // n == own_q)
        want_kpos = np.cumsum(own_sel) - own_sel
        for ip in range(ng):
            for w in range(NW):
                e = (e0 if ip * NW < 32 else e1)[(ip * NW) % 32 + w]
                v0 = ip * S_ + 64 * w
                blk = sel[v0:v0 + 64]
                own = (v0 // n) == own_q
                for lane in range(32):
                    c1 = int(blk[:2 * lane].sum())  # pair_counts' before (both halves of lower lanes)
                    e_l = e + c1 + ((c1 << 16) if own else 0)
                    pos, kpos = e_l & 0xFFFF, e_l >> 16
                    for h in range(2):
                        v = v0 + 2 * lane + h
                        if sel[v]:
                            assert pos == want_pos[v]
                            if own:
                                assert kpos == want_kpos[v]
                        pos += int(sel[v])
                        kpos += int(sel[v] and own)
        assert tot & 0xFFFF == sel.sum() and tot >> 16 == own_sel.sum()


@pytest.mark.parametrize("world,n,clus", [(8, 512, 1), (8, 256, 1), (16, 256, 1), (4, 1024, 1), (4, 256, 1),
                                          (2, 512, 1), (3, 64, 1), (1, 256, 1), (16, 1024, 2), (16, 1024, 4),
                                          (8, 1024, 2), (8, 1024, 4), (16, 512, 2), (16, 512, 4)])
def test_runs_layout_counts_every_position_in_order(world, n, clus):
    """Merge.runs (clustered rows' layout; one CTA (clus = 1) is the twenty-eighth session's
    measured candidate, kept here as the layout's simplest case): round 1's thread t = 32 w + l
    of CTA c of a row's cluster of
    ``clus`` holds positions c P + t kp .. + kp - 1 (P = 512 kp: Merge.pos1, pair i at + 2 i).  The
    formulas of the kernel, for every thread: each position once; a run in one list (kp divides N)
    and in one mask word (kp divides 32: load_r1_fast's vm, its word j >> 5), pair i's LL record
    at the run's first record + i (Merge.pair_addr); each warp holds the same 32 kp positions as
    with pair groups (the warp totals keep their meaning for clus_totals); and the outputs'
    positions from each thread's count (popc of its selection bits, own << 16 | all), one
    inclusive warp scan, the warp totals, warp_prefix and the CTAs before (clus_totals), then
    running over the thread's words, are the order-preserving compaction of a random selection,
    over all keys and over this rank's, with pref[q] (the selected keys before list q, written by
    the thread whose run starts it) as the saturation test reads it."""
    TB, NW = 512, 16
    nk1 = world * n
    kp = 2 * -(-nk1 // (2 * TB * clus))  # each CTA's words per thread
    if not (n % kp == 0 and 32 % kp == 0) or (clus > 1 and nk1 != clus * TB * kp):
        pytest.skip(f"runs is off there (kp={kp})")
    P = TB * kp
    seen = set()
    for c in range(clus):
        for t in range(TB):
            v0 = c * P + t * kp
            if v0 >= nk1:
                continue
            q0, j0 = v0 // n, v0 % n
            w = t // 32
            assert c * P + w * 32 * kp <= v0 < c * P + (w + 1) * 32 * kp  # the warp's positions
            for i in range(kp // 2):
                for h in range(2):
                    v = v0 + 2 * i + h
                    assert v < nk1 and v // n == q0 and (v % n) >> 5 == j0 >> 5  # one list, one mask word
                    assert (v % n) // 2 == (j0 >> 1) + i  # its record
                    seen.add(v)
    assert seen == set(range(nk1))
    rng = np.random.default_rng(world * 100 + n + clus)
    for _ in range(5):
        sel = rng.random(clus * P) < rng.random()
        sel[nk1:] = False
        own_q = int(rng.integers(world))
        want_pos = np.cumsum(sel) - sel
        own_sel = sel & (np.arange(clus * P) // n == own_q)
        want_kpos = np.cumsum(own_sel) - own_sel
        pref = {}
        before = 0  # the CTAs before this one (clus_totals' base), own << 16 | all
        for c in range(clus):
            per_thread = sel[c * P:(c + 1) * P].reshape(TB, kp)
            own_t = np.array([(c * P + t * kp) // n == own_q for t in range(TB)])
            x = per_thread.sum(1) + ((per_thread.sum(1) * own_t) << 16)
            xw = x.reshape(NW, 32)
            incl = np.cumsum(xw, axis=1)
            rex = (incl - xw).reshape(TB)
            wt = incl[:, 31]  # lane 0 stores its warp's total (the shuffle of lane 31's)
            for t in range(TB):
                e = before + int(wt[:t // 32].sum()) + int(rex[t])  # + warp_prefix + the scan
                pos, kpos = e & 0xFFFF, e >> 16
                for i in range(kp):
                    v = c * P + t * kp + i
                    if v < nk1 and v % n == 0:
                        pref[v // n] = pos
                    if sel[v]:
                        assert pos == want_pos[v]
                        if own_t[t]:
                            assert kpos == want_kpos[v]
                    pos += int(sel[v])
                    kpos += int(sel[v] and own_t[t])
            before += int(wt.sum())
        assert before & 0xFFFF == sel.sum() and before >> 16 == own_sel.sum()
        assert pref == {q: int(sel[:q * n].sum()) for q in range(world)}
