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
from jax_dsa_exchange.kernels.abi import MERGE_EQ_MAX
from jax_dsa_exchange.testing import cases

NB = 1024  # bins of the first score histogram (kernels/merge.py SCORE_BINS)
MMAX = MERGE_EQ_MAX  # most keys at the boundary score resolved by ranking


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


@pytest.mark.parametrize("world,n,clus", [(8, 512, 1), (8, 256, 1), (16, 256, 1), (4, 1024, 1), (4, 256, 1),
                                          (2, 512, 1), (3, 64, 1), (1, 256, 1), (16, 1024, 2), (16, 1024, 4),
                                          (8, 1024, 2), (8, 1024, 4), (16, 512, 2), (16, 512, 4)])
def test_runs_layout_counts_every_position_in_order(world, n, clus):
    """Merge.runs (clustered rows' layout; one CTA (clus = 1), measured and not kept in the
    kernel, is here as the layout's simplest case): round 1's thread t = 32 w + l of CTA c of a
    row's cluster of ``clus`` holds positions c P + t kp .. + kp - 1 (P = 512 kp: Merge.pos1, pair i at + 2 i).  The
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
