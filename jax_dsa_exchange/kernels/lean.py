"""The lean select: a CTA's slice of at most ``TB * TMAX`` tokens held in registers, each thread a
contiguous run of them (select_push's lean image).  Same inputs, outputs and cluster protocol as
``select.select_row(..., own_part=True)``, in fewer phases (:func:`select_row_lean`): every
16-byte load in flight before any is used; pass 1 from registers (the histogram, the CTA's top
ord16, the slice copied to shared memory for the sparse walks); after a cluster barrier warp 0
walks the cluster's histogram down from its top bin, 32 bins a step (usually one step, no block
scan); pass 2 from registers (candidate masks, the second histogram); after a second cluster
barrier warp 0 finds the boundary score; the compaction from the masks and counters.  Six block
barriers where select_row takes ~12, and no pass over the slice after pass 2.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32, Uint64

from .. import layout
from . import common as C
from . import ptx as P
from . import select as S

TB = C.TB
NWARPS = C.NWARPS
TMAX = 32  # tokens per thread at most (16 registers of ord16 pairs)
NVEC = TMAX // 8  # 16-byte vectors per thread
SLICE_MAX = TB * TMAX  # the longest slice the lean select takes (16384 tokens)
assert SLICE_MAX == layout.PRODUCER_LEAN_SLICE_MAX, (SLICE_MAX, layout.PRODUCER_LEAN_SLICE_MAX)
SH1 = 16 - S.B1  # ord16 >> SH1 = the first histogram's bin
BIN_MIN = 0x007F >> SH1  # the lowest bin a valid score reaches (ord16 >= 0x7F: -inf)
# published slots (read by the other CTAs): own count above b1, own valid count, top ord16
_P_ABOVE, _P_VALID, _P_TOP = 0, 1, 3
# scalars slots (CTA-local, written by warp 0, read by all after a barrier)
_B1, _ABOVE1, _TOTAL, _OWN_ABOVE1, _KBEFORE = 0, 1, 2, 3, 4
_V, _NEED_EQ, _GTB, _EQB, _GTO, _EQO = 8, 9, 10, 11, 12, 13


def smem_words(rw: int) -> int:
    """Shared 32-bit words of :class:`LeanSmem` (16-byte aligned parts, the slice copy last)."""
    parts = [S.NB1, S.NB2, 16, 32, 2 * NWARPS, rw, SLICE_MAX // 2]
    return sum(-(-p // 4) * 4 for p in parts)


def smem_bytes(rw: int) -> int:
    return smem_words(rw) * 4 + 128  # + allocator alignment slack


class LeanSmem:
    """The lean select's shared arrays (``parts()`` in SelectSmem.parts()'s order, None where unused)."""

    def __init__(self, smem, rw: int):
        def arr(n):
            return smem.allocate_tensor(Int32, cute.make_layout((n,)), 16)

        self.hist1 = arr(S.NB1)
        self.hist2 = arr(S.NB2)
        self.published = arr(16)  # read by the other CTAs of the cluster (_P_*)
        self.scalars = arr(32)
        self.warp_totals = arr(2 * NWARPS)
        self.row = arr(rw)
        self.cache = arr(SLICE_MAX // 2)  # the slice's ord16 pairs, last

    def parts(self):
        return (self.cache, self.hist1, self.hist2, None, self.published, self.scalars, self.warp_totals,
                self.row, None, None)  # fmt: skip


def thread_len(s):
    """Tokens per thread of a slice of s tokens: ceil(s / TB) rounded up to 8 (at most TMAX)."""
    return Int32(((Uint32(s) + Uint32(TB - 1)) // Uint32(TB) + Uint32(7)) & Uint32(0xFFFFFFF8))


@cute.jit
def fits(cols: Int32, csize: Int32) -> Int32:
    """1 where every slice of a launch of rows of ``cols`` in clusters of csize fits the lean select."""
    return Int32(thread_len(S.slice_len(cutlass.min(cols, Int32(layout.MAX_LOCAL_LEN)), csize)) <= Int32(TMAX))


@cute.jit
def cluster_word(a: Int32, r: Int32, one: Int32) -> Int32:
    """The shared word at ``a`` of CTA r of the cluster (own shared memory where ``one``)."""
    x = Int32(0)
    if one != Int32(0):
        x = P.ld_smem_u32(a)
    else:
        x = P.ld_dsmem_u32(P.mapa(a, r))
    return x


@cute.jit
def cluster_sum(a: Int32, csize: Int32, one: Int32, upto: Int32):
    """(the sum over the CTAs r < csize of the shared word at ``a``, over r < upto), every DSMEM load
    in flight at once (``one``: its own word, and 0)."""
    tot, bef = Int32(0), Int32(0)
    if one != Int32(0):
        tot = P.ld_smem_u32(a)
    else:
        for r in cutlass.range_constexpr(S.CLUSTER_MAX):
            # (rank clamped into the cluster: mapa of a rank outside it is undefined)
            x = P.ld_dsmem_u32_if(P.mapa(a, cutlass.min(Int32(r), csize - Int32(1))), Int32(Int32(r) < csize))
            tot = tot + x
            if Int32(r) < upto:
                bef = bef + x
    return tot, bef


@cute.jit
def lowest_lane(bal: Uint32) -> Int32:
    return Int32(cute.arch.popc((bal & (~bal + Uint32(1))) - Uint32(1)))


@cute.jit
def issue_loads(row_addr: Int64, blen: Int32, csize: Int32, me: Int32, tid, aligned: Int32, xs: cute.Tensor,
                vok: cute.Tensor):
    """Slices cut from ``blen``: every 16-byte load of the thread issued into xs (vok: which were)
    -> (slice length, tokens per thread, slice start, the slice's tokens below blen)."""
    sl = S.slice_len(blen, csize)
    ch = thread_len(sl)
    s0 = cutlass.min(me * sl, blen)
    s_buf = cutlass.min(sl, blen - s0)
    t0 = tid * ch
    base = row_addr + Int64(s0 + t0) * Int64(2)
    for k in cutlass.range_constexpr(NVEC):
        ok = aligned & Int32(Int32(8 * k) < ch) & Int32(t0 + Int32(8 * k + 8) <= s_buf)
        vok[k] = ok
        for q, w in enumerate(P.ld_nc_v4_if(base + Int64(16 * k), ok)):
            xs[4 * k + q] = w
    return sl, ch, s0, s_buf


@cute.jit
def zero_counters(h1_a: Int32, hist2: cute.Tensor, scalars: cute.Tensor, published: cute.Tensor,
                  row: cute.Tensor, rw: cutlass.Constexpr, tid):
    """Zero the counters and the row while the loads are on their way; ends with a block barrier."""
    P.st_smem_v4(h1_a + tid * Int32(16), Int32(0), Int32(0), Int32(0), Int32(0))  # 4 bins each
    if tid < Int32(S.NB2):
        hist2[tid] = Int32(0)
    if tid < Int32(32):
        scalars[tid] = Int32(0)
    if tid < Int32(16):
        published[tid] = Int32(0)
    for i in cutlass.range(tid, rw, TB, unroll=1):
        row[i] = Int32(0)
    cute.arch.sync_threads()


@cute.jit
def clear_past_end(xs: cute.Tensor, k: cutlass.Constexpr, l0: Int32, s_lim: Int32):
    """ord16 0 for the tokens of vector k (slice tokens l0 ..) at or past the row's end s_lim."""
    for p in cutlass.range_constexpr(4):
        nk = cutlass.min(cutlass.max(s_lim - l0 - Int32(2 * p), Int32(0)), Int32(2))
        keep = Uint32(0)
        if nk == Int32(1):
            keep = Uint32(0xFFFF)
        if nk == Int32(2):
            keep = Uint32(0xFFFFFFFF)
        xs[4 * k + p] = Int32(Uint32(xs[4 * k + p]) & keep)


@cute.jit
def pass1(row_addr: Int64, xs: cute.Tensor, vok: cute.Tensor, ch: Int32, t0: Int32, s0: Int32, s_buf: Int32,
          end: Int32, aligned: Int32, cache_a: Int32, h1_a: Int32, published_a: Int32, lane):
    """Pass 1 from registers: ord16 (in xs and the slice copy), the first histogram of every token,
    the CTA's top ord16 (one shared red per warp)."""
    s_lim = cutlass.max(cutlass.min(end - s0, s_buf), Int32(0))  # the slice's valid prefix
    tw = Int32(0)  # (packed maximum of the thread's ord16 pairs)
    for k in cutlass.range_constexpr(NVEC):
        if Int32(8 * k) < ch:
            l0 = t0 + Int32(8 * k)
            if vok[k] != Int32(0):
                S.ord16_quad(xs[4 * k], xs[4 * k + 1], xs[4 * k + 2], xs[4 * k + 3], xs, 4 * k)
                if l0 + Int32(8) > s_lim:
                    clear_past_end(xs, k, l0, s_lim)
            elif l0 < s_lim:
                # an unaligned row or the buffer's partial last vector: token by token
                S.load_vector(row_addr, s0, l0 >> Int32(3), s_lim, aligned, xs, 4 * k)
            if l0 < s_buf:
                P.st_smem_v4(cache_a + l0 * Int32(2), xs[4 * k], xs[4 * k + 1], xs[4 * k + 2], xs[4 * k + 3])
            tw = P.max_u16x2(tw, P.max_u16x2(P.max_u16x2(xs[4 * k], xs[4 * k + 1]),
                                             P.max_u16x2(xs[4 * k + 2], xs[4 * k + 3])))  # fmt: skip
            for p in cutlass.range_constexpr(4):
                # every token, unconditionally: the CTA's valid tokens are TB * ch - bin 0
                P.red_smem_add(P.bin_addr(h1_a, xs[4 * k + p], SH1, S.B1), Int32(1))
                P.red_smem_add(P.bin_addr(h1_a, xs[4 * k + p], 16 + SH1, S.B1), Int32(1))
    top = cute.arch.warp_redux_sync(cutlass.max(tw & Int32(0xFFFF), Int32(Uint32(tw) >> Uint32(16))), "max")
    if lane == Int32(0):
        P.red_smem_max(published_a + Int32(4 * _P_TOP), top)


@cute.jit
def boundary_bin(hist1: cute.Tensor, h1_a: Int32, published: cute.Tensor, published_a: Int32, scalars: cute.Tensor,
                 ch: Int32, csize: Int32, me: Int32, one: Int32, lane, n: cutlass.Constexpr):
    """Warp 0, after the first cluster barrier, into scalars: the row's valid count, the earlier
    CTAs', and the boundary bin b1 (-1: every valid token kept), walking the cluster's histogram
    down from its top bin 32 bins a step (lane 0 the highest) until n scores lie at or above one."""
    ptop, pcnt = Int32(0), Int32(0)
    if lane < csize:
        ptop = cluster_word(published_a + Int32(4 * _P_TOP), lane, one)
        pcnt = Int32(TB) * ch - cluster_word(h1_a, lane, one)  # (every CTA of the cluster has this ch)
    ctop = cute.arch.warp_redux_sync(ptop, "max")
    w_total = cute.arch.warp_redux_sync(pcnt, "add")
    kb = Int32(0)  # valid tokens of the CTAs before this one (every valid token kept)
    if lane < me:
        kb = pcnt
    kbefore = cute.arch.warp_redux_sync(kb, "add")
    w_b1, w_above1, w_oabove1 = Int32(-1), Int32(0), Int32(0)
    if w_total > Int32(n):
        hi = ctop >> Int32(SH1)
        above, oabove, go = Int32(0), Int32(0), Int32(1)
        while go != Int32(0):
            bn = hi - lane
            c, cb, ow = Int32(0), Int32(0), Int32(0)
            if bn >= Int32(BIN_MIN):
                ow = P.ld_smem_u32(h1_a + bn * Int32(4))
                if one != Int32(0):
                    c = ow
                else:
                    c, cb = cluster_sum(h1_a + bn * Int32(4), csize, one, Int32(0))
            inc = C.warp_incl_scan(c, lane)
            oinc = C.warp_incl_scan(ow, lane)
            hit = Int32(c > Int32(0)) & Int32(above + inc >= Int32(n)) & Int32(above + inc - c < Int32(n))
            bal = Uint32(cute.arch.vote_ballot_sync(hit != Int32(0)))
            if bal != Uint32(0):
                src = lowest_lane(bal)
                w_b1 = cute.arch.shuffle_sync(bn, src)
                w_above1 = above + cute.arch.shuffle_sync(inc - c, src)
                w_oabove1 = oabove + cute.arch.shuffle_sync(oinc - ow, src)
                go = Int32(0)
            else:
                above = above + cute.arch.shuffle_sync(inc, Int32(31))
                oabove = oabove + cute.arch.shuffle_sync(oinc, Int32(31))
                hi = hi - Int32(32)
                if hi < Int32(BIN_MIN):
                    go = Int32(0)  # (never for exact counts: the n-th score lies at or above BIN_MIN)
    if lane == Int32(0):
        scalars[_B1] = w_b1
        scalars[_ABOVE1] = w_above1
        scalars[_OWN_ABOVE1] = w_oabove1
        scalars[_TOTAL] = w_total
        scalars[_KBEFORE] = kbefore
        published[_P_ABOVE] = w_oabove1  # (read by the later CTAs after the second cluster barrier)
        published[_P_VALID] = Int32(TB) * ch - hist1[0]


@cute.jit
def pass2(xs: cute.Tensor, ch: Int32, t0: Int32, b1: Int32, cache_a: Int32, h2_a: Int32):
    """Pass 2 from registers: the thread's tokens of bin >= b1 and > b1 as masks (b1 = -1: every
    valid token), the second histogram of its bin-b1 tokens (from the slice copy) and their 2-bit
    counters (select.low_counter_add) -> (masks, counters, 1 where a counter would pass 3)."""
    thr, thr_g = Uint32(1), Uint32(1)
    if b1 >= Int32(0):
        thr = Uint32(b1) << Uint32(SH1)
        thr_g = thr + Uint32(1 << SH1)
    mcand, mg = Uint32(0), Uint32(0)
    for k in cutlass.range_constexpr(NVEC):
        if Int32(8 * k) < ch:
            for p in cutlass.range_constexpr(4):
                w = Uint32(xs[4 * k + p])
                lo = w & Uint32(0xFFFF)
                hi2 = w >> Uint32(16)
                mcand = P.or_if_ge(mcand, lo, thr, 8 * k + 2 * p)
                mcand = P.or_if_ge(mcand, hi2, thr, 8 * k + 2 * p + 1)
                mg = P.or_if_ge(mg, lo, thr_g, 8 * k + 2 * p)
                mg = P.or_if_ge(mg, hi2, thr_g, 8 * k + 2 * p + 1)
    lowc, ovf = Uint64(0), Int32(0)
    m = mcand & ~mg
    while m != Uint32(0):
        j = P.low_bit(Int32(m))
        m = m & (m - Uint32(1))
        o = P.ld_smem_u16(cache_a + (t0 + j) * Int32(2))
        P.red_smem_add(h2_a + Int32(o & Uint32(S.NB2 - 1)) * Int32(4), Int32(1))
        sh = Uint64((o & Uint32(S.NB2 - 1)) * Uint32(2))
        if ((lowc >> sh) & Uint64(3)) == Uint64(3):
            ovf = Int32(1)
        else:
            lowc = lowc + (Uint64(1) << sh)
    return mcand, mg, lowc, ovf


@cute.jit
def boundary_score(hist2: cute.Tensor, h2_a: Int32, published: cute.Tensor, published_a: Int32, scalars: cute.Tensor,
                   b1: Int32, csize: Int32, me: Int32, one: Int32, lane, n: cutlass.Constexpr):
    """Warp 0, after the second cluster barrier, into scalars: the boundary score v, need_eq, and
    the counts > v / == v before this slice and in it."""
    u_v, u_need, u_gtb, u_eqb, u_gto, u_eqo = Int32(0), Int32(0), Int32(0), Int32(0), Int32(0), Int32(0)
    if b1 >= Int32(0):
        need2 = Int32(n) - scalars[_ABOVE1]
        b2 = Int32(S.NB2 - 1) - lane  # lane 0 the highest low value
        own2 = hist2[b2]
        c2 = own2
        bef2 = Int32(0)
        if one == Int32(0):
            c2, bef2 = cluster_sum(h2_a + b2 * Int32(4), csize, one, me)
        inc2 = C.warp_incl_scan(c2, lane)
        hit2 = Int32(c2 > Int32(0)) & Int32(inc2 >= need2) & Int32(inc2 - c2 < need2)
        src2 = lowest_lane(Uint32(cute.arch.vote_ballot_sync(hit2 != Int32(0))))
        lowv = cute.arch.shuffle_sync(b2, src2)
        u_need = need2 - cute.arch.shuffle_sync(inc2 - c2, src2)
        u_v = (b1 << Int32(SH1)) | lowv
        pa = Int32(0)  # the earlier CTAs' counts above b1
        if lane < me:
            pa = cluster_word(published_a + Int32(4 * _P_ABOVE), lane, one)
        above_v = Int32(b2 > lowv)
        u_gtb = cute.arch.warp_redux_sync(pa + bef2 * above_v, "add")
        u_eqb = cute.arch.shuffle_sync(bef2, src2)
        u_gto = scalars[_OWN_ABOVE1] + cute.arch.warp_redux_sync(own2 * above_v, "add")
        u_eqo = cute.arch.shuffle_sync(own2, src2)
    else:
        u_gtb = scalars[_KBEFORE]
        u_gto = published[_P_VALID]
    if lane == Int32(0):
        scalars[_V] = u_v
        scalars[_NEED_EQ] = u_need
        scalars[_GTB] = u_gtb
        scalars[_EQB] = u_eqb
        scalars[_GTO] = u_gto
        scalars[_EQO] = u_eqo


@cute.jit
def count_kept(mcand: Uint32, mg: Uint32, lowc: Uint64, ovf: Int32, v: Uint32, t0: Int32, cache_a: Int32):
    """The thread's counts (> v, == v) from its masks and counters, or by a walk where one overflowed."""
    ngt = Int32(cute.arch.popc(mg))
    neq = Int32(0)
    if ovf == Int32(0):
        ngt, neq = S.counts_from_low_counters(ngt, lowc, Int32(v & Uint32(S.NB2 - 1)))
    else:
        m = mcand & ~mg
        while m != Uint32(0):
            j = P.low_bit(Int32(m))
            m = m & (m - Uint32(1))
            o = P.ld_smem_u16(cache_a + (t0 + j) * Int32(2))
            ngt, neq = S.count_token(o, v, ngt, neq)
    return ngt, neq


@cute.jit
def pair_scan(ngt: Int32, neq: Int32, warp_totals: cute.Tensor, wt_a: Int32, lane, warp):
    """Inclusive sums over the CTA of a pair in thread order (warp totals read as 16-byte vectors)."""
    x = C.warp_incl_scan(ngt, lane)
    y = C.warp_incl_scan(neq, lane)
    if lane == Int32(31):
        warp_totals[warp] = x
        warp_totals[NWARPS + warp] = y
    cute.arch.sync_threads()
    for w4 in cutlass.range_constexpr(NWARPS // 4):
        f0, f1, f2, f3 = P.ld_smem_v4(wt_a + Int32(16 * w4))
        g0, g1, g2, g3 = P.ld_smem_v4(wt_a + Int32(4 * NWARPS + 16 * w4))
        for q, (wa, wb) in enumerate(((f0, g0), (f1, g1), (f2, g2), (f3, g3))):
            if Int32(4 * w4 + q) < warp:
                x = x + wa
                y = y + wb
    return x, y


@cute.jit
def emit_kept(mcand: Uint32, v: Uint32, need_eq: Int32, gt_b: Int32, eq_b: Int32, s0: Int32, t0: Int32,
              cache_a: Int32, row: cute.Tensor, row_a: Int32, n: cutlass.Constexpr):
    """Each kept candidate's packed word at its position of this CTA's row buffer."""
    m = mcand
    while m != Uint32(0):
        j = P.low_bit(Int32(m))
        m = m & (m - Uint32(1))
        o = P.ld_smem_u16(cache_a + (t0 + j) * Int32(2))
        gt_b, eq_b = S.emit_token(o, Uint32(s0 + t0 + j), v, gt_b, eq_b, need_eq, n, Int32(0), row_a, row, row_a)


@cute.jit
def select_row_lean(row_addr: Int64, end_raw: Int32, cols: Int32, rows: Int32, n: cutlass.Constexpr,
                    rw: cutlass.Constexpr, parts, tid, lane, warp, csize: Int32, me: Int32,
                    spec_ctas: cutlass.Constexpr, early=None):
    """This CTA's part of the top-min(n, valid) of the first end bf16 at ``row_addr`` (end =
    ``end_raw`` clamped) -> (p0, p1, p_end, writer) as ``select.select_row(..., own_part=True)``
    (the caller waits at the cluster barrier before exit).  Launches of at most ``spec_ctas`` CTAs
    (one wave) cut the slices from the buffer's row length, so that their loads need not wait for
    ``end_raw``'s (H200, R = 1, L = 128K: 7.46 us against 8.03); larger ones, whose bandwidth
    counts, from the row's end.  Every slice fits (the caller's test, ``fits``)."""
    cache, hist1, hist2, gsum2, pub, scal, wt, row, mask, mbar = parts
    cache_a, h1_a, h2_a, pub_a, row_a, wt_a = map(P.smem_addr, (cache, hist1, hist2, pub, row, wt))
    one = S.one_cta(csize)  # (a one-CTA cluster takes block barriers and reads its own memory)
    aligned = Int32((row_addr & Int64(15)) == Int64(0))
    # ---- every 16-byte load in flight before any is used (a branch each, so that nothing waits)
    xs = cute.make_rmem_tensor((TMAX // 2,), Int32)
    vok = cute.make_rmem_tensor((NVEC,), Int32)
    sl, ch, s0, s_buf = Int32(0), Int32(0), Int32(0), Int32(0)
    if rows * csize <= Int32(spec_ctas):
        sl, ch, s0, s_buf = issue_loads(row_addr, cutlass.min(cols, Int32(layout.MAX_LOCAL_LEN)), csize, me, tid,
                                        aligned, xs, vok)  # fmt: skip
    else:
        sl, ch, s0, s_buf = issue_loads(row_addr, S.clamp_end(end_raw, cols), csize, me, tid, aligned, xs, vok)
    end = S.clamp_end(end_raw, cols)
    t0 = tid * ch  # the thread's first token in the slice
    if cutlass.const_expr(early is not None):
        early()
    zero_counters(h1_a, hist2, scal, pub, row, rw, tid)
    pass1(row_addr, xs, vok, ch, t0, s0, s_buf, end, aligned, cache_a, h1_a, pub_a, lane)
    S.cluster_barrier(True, csize)
    if warp == Int32(0):
        boundary_bin(hist1, h1_a, pub, pub_a, scal, ch, csize, me, one, lane, n)
    cute.arch.sync_threads()
    b1 = scal[_B1]
    mcand, mg, lowc, ovf = pass2(xs, ch, t0, b1, cache_a, h2_a)
    S.cluster_barrier(True, csize)
    if warp == Int32(0):
        boundary_score(hist2, h2_a, pub, pub_a, scal, b1, csize, me, one, lane, n)
    if one == Int32(0):
        P.cluster_arrive()  # every DSMEM load of this CTA was used above (the caller waits)
    cute.arch.sync_threads()
    # ---- the compaction: counts, one pair block scan, each kept word at its position
    v = Uint32(scal[_V])
    need_eq = scal[_NEED_EQ]
    gtb = scal[_GTB]
    eqb = scal[_EQB]
    ngt, neq = count_kept(mcand, mg, lowc, ovf, v, t0, cache_a)
    x, y = pair_scan(ngt, neq, wt, wt_a, lane, warp)
    emit_kept(mcand, v, need_eq, gtb + x - ngt, eqb + y - neq, s0, t0, cache_a, row, row_a, n)
    cute.arch.sync_threads()  # this CTA's part of the row is complete
    total = scal[_TOTAL]
    p0 = cutlass.min(gtb + cutlass.min(eqb, need_eq), Int32(n))
    p1 = cutlass.min(gtb + scal[_GTO] + cutlass.min(eqb + scal[_EQO], need_eq), Int32(n))
    writer = cutlass.min(Int32(1 << 16) // cutlass.max(sl, Int32(8)), csize - Int32(1))
    return p0, p1, cutlass.min(total, Int32(n)), Int32(me == writer)
