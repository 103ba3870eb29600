"""Exact local top-n of one bf16 row (docs/DESIGN.md §4 on one rank), split over the C CTAs of a
thread-block cluster: the producer's select (select_push) and the merge's rescue select (C = 1).

Each CTA takes one slice of the row's valid prefix (ceil(end / C) rounded up to 8 tokens); a
token's score is its ``ord16`` (docs/DESIGN.md §5, 0 for NaN and past the end).  In
:func:`select_row`: pass 1 histograms the high B1 bits (keeping the slice on chip where it fits);
after a cluster barrier the C histograms (DSMEM) give the boundary bin; pass 2 masks the tokens
at or above it and histograms the boundary bin's low bits; after a second cluster barrier those
give the boundary score v, the ties kept and what precedes this slice; the compaction walks the
mask twice (counts, a pair block scan, every kept word at its final position).  The rescue list
(``n2``) is a second count from the same passes.  docs/kernels.md, "The select", says why.

Every branch around a barrier depends on values read from shared memory after a barrier, so it
is uniform over the CTA (and the cluster).  Exactness does not depend on C: the boundary, the
counts and every position come from exact integer counts over the whole row.
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32, Uint64

from .. import layout
from . import common as C
from . import ptx as P

TB = C.TB
NWARPS = C.NWARPS
B1 = 11  # high bits of ord16 in the first histogram
NB1 = 1 << B1  # 2048 bins
NB2 = 1 << (16 - B1)  # 32 bins of the second pass
BPT = NB1 // TB  # first-pass bins per thread in the boundary search (contiguous)
# 16-byte loads per thread per round of passes 1 and 2 (H200, N = 512, R = 1, L = 8K: 10.17 us
# against 10.88 with 4, 48 registers against 59)
U1 = 2
# clusters of at least BOUNDED_MIN CTAs sum only the first-histogram bins that can hold the
# boundary (publish_bounds): every histogram whole was 64 KB of DSMEM loads per CTA at C = 8
BOUNDED_MIN = 5
# a kept slice whose boundary bin holds more than max(BIG_B1, BIG_RATIO x its own count above it)
# walks an even share of a list of its candidates (make_list): a recency bias crowds the bin into
# a few threads' units; random scores stay below it (at most 3.5x)
BIG_B1 = 512
BIG_RATIO = 8
CACHE_MAX = layout.PRODUCER_CACHE_MAX  # the most tokens per CTA kept on chip (SelectSmem.cache)
CLUSTER_MAX = layout.PRODUCER_CLUSTER_MAX  # CTAs per cluster summed over (the portable limit)
MASK_WORDS = layout.MAX_LOCAL_LEN // 32  # pass 2's mask: a bit per token of the longest slice
NCHUNK = -(-CACHE_MAX // (TB * 8))  # bulk copies of TB vectors (8 KB) per slice at most
# (CACHE_MAX <= 2**16: a kept slice's tokens are 16-bit list entries)
assert CACHE_MAX % 8 == 0 and layout.PRODUCER_SLICE_MAX <= CACHE_MAX <= 65536, CACHE_MAX
assert CLUSTER_MAX <= NWARPS, CLUSTER_MAX  # the boundary score: warp r sums CTA r
assert BPT == 4, "the boundary search loads its bins as one 16-byte vector"

# scalars slots (the rescue list's n2: the same slot + _K; _TOTAL + _K counts its kept tokens
# below 2**16)
_B1, _ABOVE1, _TOTAL, _OWN_ABOVE1, _LOWV, _ABOVE2 = 0, 1, 2, 3, 4, 5
_GT_BEFORE, _EQ_BEFORE, _GT_OWN, _EQ_OWN = 8, 9, 10, 11
_K = 12


class Slice(NamedTuple):
    """This CTA's slice: token lt's bf16 at row_addr + 2 (s0 + lt), its ord16 at shared address
    cache_a + 2 lt where ``keep`` (the slice is kept on chip)."""

    row_addr: Int64
    s0: Int32
    keep: Int32
    cache_a: Int32


class Units(NamedTuple):
    """A thread's share of the walks over the mask (shared address mask_a): its contiguous
    16-token units [u0, u1), ``per_thread`` of them at most."""

    mask_a: Int32
    u0: Int32
    u1: Int32
    per_thread: Int32


class ListShare(NamedTuple):
    """A crowded slice's list (mask words from ``first_word``): where ``used``, a thread walks its
    entries [r0, r1) instead of its units."""

    mask: cute.Tensor
    first_word: Int32
    r0: Int32
    r1: Int32
    used: Int32


def slice_len(end, csize):
    """ceil(end / csize) rounded up to 8: a CTA's tokens (the unsigned quotient: end >= 0)."""
    return Int32((Uint32(end + csize - Int32(1)) // Uint32(csize) + Uint32(7)) & Uint32(0xFFFFFFF8))


def klist_n2(n: int, topk: int, rescue_list: bool) -> int:
    """The rescue list's count: K where a rescue can happen (K > n), else 0."""
    return topk if rescue_list and topk > n else 0


def klist_staged(n2: int) -> bool:
    """Whether a CTA's K-list words are staged in hist1 (free after the second cluster barrier),
    then stored whole (coalesced): where they fit."""
    return 0 < n2 <= NB1


def smem_words(rw: int, cached: bool, dual: bool = False) -> int:
    """Shared 32-bit words of :class:`SelectSmem` (16-byte aligned parts; the cache last, so a
    launch with a smaller cache needs that much less)."""
    h2 = NB2 * (2 if dual else 1)  # second histograms: one per count (n, and the rescue list's n2)
    parts = [NB1, h2, h2, 16, 32, 2 * NWARPS, rw, MASK_WORDS, 2 * NCHUNK if cached else 4,
             CACHE_MAX // 2 if cached else 4]
    return sum(-(-p // 4) * 4 for p in parts)


def smem_bytes(rw: int, cached: bool, dual: bool = False) -> int:
    return smem_words(rw, cached, dual) * 4 + 128  # + allocator alignment slack


class SelectSmem:
    """The select's shared arrays, allocated from ``smem`` (a SmemAllocator)."""

    def __init__(self, smem, rw: int, cached: bool, dual: bool = False):
        def arr(n):
            return smem.allocate_tensor(Int32, cute.make_layout((n,)), 16)

        self.hist1 = arr(NB1)
        self.hist2 = arr(NB2 * (2 if dual else 1))  # (the rescue list's at [NB2, 2 NB2))
        self.gsum2 = arr(NB2 * (2 if dual else 1))  # the cluster's second histograms
        # read by the other CTAs: [0] own count above b1, [1] own valid count, [2] own count above
        # n2's b1, [4..6] publish_bounds'
        self.published = arr(16)
        self.scalars = arr(32)  # CTA-local (the _B1 ... slots)
        self.warp_totals = arr(2 * NWARPS)  # of the pair scan
        self.row = arr(rw)  # the packed row (CTA 0's; own_part: each CTA's range of it)
        self.mask = arr(MASK_WORDS)  # a bit per slice token (pass 2); a crowded slice's list after it
        self.mbar = arr(2 * NCHUNK if cached else 4)  # the bulk copies' mbarriers (8 bytes each)
        self.cache = arr(CACHE_MAX // 2 if cached else 4)  # the slice's ord16 pairs, last

    def parts(self):
        """The arrays as a tuple (the DSL carries tuples of tensors through traced code)."""
        return (self.cache, self.hist1, self.hist2, self.gsum2, self.published, self.scalars,
                self.warp_totals, self.row, self.mask, self.mbar)  # fmt: skip


# ---- loads and ord16
@cute.jit
def clamp_end(end: Int32, cols: Int32) -> Int32:
    """A row's end clamped to [0, min(cols, 2**17)] (docs/DESIGN.md §3)."""
    lim = cols
    if lim > Int32(layout.MAX_LOCAL_LEN):
        lim = Int32(layout.MAX_LOCAL_LEN)
    if end > lim:
        end = lim
    if end < Int32(0):
        end = Int32(0)
    return end


@cute.jit
def ord16_pair(w: Int32) -> Int32:
    """Two bf16 (low half first) -> their ord16, packed the same way, without branches: x ^ 0x8000
    for a clear sign, ~x for a set one, then -0 (at 0x7FFF) -> 0x8000 and NaN -> 0."""
    u = Uint32(w)
    neg = (u >> Uint32(15)) & Uint32(0x00010001)
    o = u ^ (neg * Uint32(0x7FFF)) ^ Uint32(0x80008000)
    lo = o & Uint32(0xFFFF)
    hi = o >> Uint32(16)
    if lo == Uint32(0x7FFF):
        lo = Uint32(0x8000)
    if hi == Uint32(0x7FFF):
        hi = Uint32(0x8000)
    if lo < Uint32(0x007F) or lo > Uint32(0xFF80):
        lo = Uint32(0)
    if hi < Uint32(0x007F) or hi > Uint32(0xFF80):
        hi = Uint32(0)
    return Int32(lo | (hi << Uint32(16)))


@cute.jit
def ord16_special(w: Int32) -> Uint32:
    """Nonzero where a half of the pair is NaN or +-0, by packed arithmetic (no carry crosses the
    halves): |h| + 0x7F >= 0x8000 iff NaN; (|h| | 0x8000) - 1 < 0x8000 iff |h| == 0."""
    a = Uint32(w) & Uint32(0x7FFF7FFF)
    nan = a + Uint32(0x007F007F)
    zero = ~((a | Uint32(0x80008000)) - Uint32(0x00010001))
    return (nan | zero) & Uint32(0x80008000)


@cute.jit
def ord16_fast(w: Int32) -> Int32:
    """ord16_pair of a pair without NaN or +-0."""
    u = Uint32(w)
    neg = (u >> Uint32(15)) & Uint32(0x00010001)
    return Int32(u ^ (neg * Uint32(0x7FFF)) ^ Uint32(0x80008000))


@cute.jit
def ord16_quad(a: Int32, b: Int32, c: Int32, d: Int32, xs: cute.Tensor, off: cutlass.Constexpr):
    """xs[off : off+4] = ord16_pair of the four pairs: the short form unless one of them holds
    NaN or +-0 (rare in scores)."""
    if (ord16_special(a) | ord16_special(b) | ord16_special(c) | ord16_special(d)) == Uint32(0):
        for q, w in enumerate((a, b, c, d)):
            xs[off + q] = ord16_fast(w)
    else:
        for q, w in enumerate((a, b, c, d)):
            xs[off + q] = ord16_pair(w)


@cute.jit
def load_vector(row_addr: Int64, s0: Int32, vi: Int32, s_len: Int32, aligned: Int32, xs: cute.Tensor,
                off: cutlass.Constexpr):
    """ord16 pairs of slice tokens 8*vi .. 8*vi+7 into xs[off : off+4] (0 past s_len)."""
    l0 = vi * Int32(8)
    if aligned != Int32(0) and l0 + Int32(8) <= s_len:
        a, b, c, d = P.ld_nc_v4(row_addr + Int64(s0 + l0) * Int64(2))
        ord16_quad(a, b, c, d, xs, off)
    else:
        for k in cutlass.range_constexpr(4):
            xs[off + k] = Int32(0)
        for k in cutlass.range_constexpr(8):
            if l0 + Int32(k) < s_len:
                o = C.ord16(P.ld_u16(row_addr + Int64(s0 + l0 + Int32(k)) * Int64(2)))
                xs[off + k // 2] = xs[off + k // 2] | Int32(o << Uint32(16 * (k % 2)))


@cute.jit
def load_vectors(row_addr: Int64, s0: Int32, v0: Int32, nvec: Int32, s_len: Int32, aligned: Int32, cache_a: Int32,
                 xs: cute.Tensor, from_cache: Int32, nv: cutlass.Constexpr, stride: cutlass.Constexpr):
    """xs[4u : 4u+4] = ord16 pairs of vector v0 + u*stride (u < nv, 0 past nvec), from the cache
    where ``from_cache`` (uniform), else from global memory."""
    for u in cutlass.range_constexpr(nv):
        vi = v0 + Int32(u * stride)
        for k in cutlass.range_constexpr(4):
            xs[4 * u + k] = Int32(0)
        if vi < nvec:
            if from_cache != Int32(0):
                for q, w in enumerate(P.ld_smem_v4(cache_a + vi * Int32(16))):
                    xs[4 * u + q] = w
            else:
                load_vector(row_addr, s0, vi, s_len, aligned, xs, 4 * u)


# ---- scans and barriers
@cute.jit
def block_scan2(a: Int32, b: Int32, lane, warp, warp_totals: cute.Tensor):
    """Inclusive sums over the CTA in thread order of a pair -> (ia, ib, ta, tb)."""
    x = a
    y = b
    for d in cutlass.range_constexpr(5):
        xa = cute.arch.shuffle_sync_up(x, 1 << d)
        ya = cute.arch.shuffle_sync_up(y, 1 << d)
        if lane >= Int32(1 << d):
            x = x + xa
            y = y + ya
    if lane == Int32(31):
        warp_totals[warp] = x
        warp_totals[NWARPS + warp] = y
    cute.arch.sync_threads()
    ba, bb, ta, tb = Int32(0), Int32(0), Int32(0), Int32(0)
    for w in cutlass.range_constexpr(NWARPS):
        u = warp_totals[w]
        v = warp_totals[NWARPS + w]
        if Int32(w) < warp:
            ba = ba + u
            bb = bb + v
        ta = ta + u
        tb = tb + v
    cute.arch.sync_threads()
    return x + ba, y + bb, ta, tb


@cute.jit
def one_cta(csize: Int32) -> Int32:
    """1 where the cluster is one CTA: it takes block barriers and reads its own shared memory."""
    return Int32(csize == Int32(1))


@cute.jit
def cluster_barrier(clustered: cutlass.Constexpr, csize: Int32):
    """Cluster barriers 1 and 2: every DSMEM datum read after them was written by its owner CTA, so
    each CTA releases only its own shared memory (P.cluster_sync_local); one CTA: a block barrier."""
    if one_cta(csize) != Int32(0):
        cute.arch.sync_threads()
    else:
        if cutlass.const_expr(clustered):
            P.cluster_sync_local()
        else:
            cute.arch.sync_threads()


@cute.jit
def closing_barrier(clustered: cutlass.Constexpr, csize: Int32):
    """After the CTAs wrote into CTA 0's row (DSMEM stores): a full release; a one-CTA cluster
    keeps a cluster barrier (a bar.sync is not shown to order DSMEM stores)."""
    if cutlass.const_expr(clustered):
        if csize == Int32(1):
            P.cluster_sync_local()
        else:
            P.cluster_sync()
    else:
        cute.arch.sync_threads()


@cute.jit
def sum_cluster_bins(h1_a: Int32, bin_lo: Int32, csize: Int32, cluster_bins: cute.Tensor):
    """cluster_bins[0..4) += first-histogram bins bin_lo .. bin_lo + 3 of every CTA of the cluster
    (one 16-byte DSMEM load each, all in flight at once: a remote load costs a round trip)."""
    for r in cutlass.range_constexpr(CLUSTER_MAX):
        if Int32(r) < csize:
            a, b, c, d = P.ld_dsmem_v4(P.mapa(h1_a + bin_lo * Int32(4), Int32(r)))
            cluster_bins[0] = cluster_bins[0] + a
            cluster_bins[1] = cluster_bins[1] + b
            cluster_bins[2] = cluster_bins[2] + c
            cluster_bins[3] = cluster_bins[3] + d


# ---- pass 1 and the boundary bin (first cluster barrier)
@cute.jit
def start_bulk_copies(row_addr: Int64, s0: Int32, nfull: Int32, copies: Int32, cache_a: Int32, mbar_a: Int32, tid):
    """A kept, 16-byte aligned slice's ``nfull`` full vectors in flight at once: ``copies``
    cp.async.bulk copies of TB vectors into the cache, each by one lane of warp 0 on its mbarrier."""
    if tid < copies:
        nb = cutlass.min(Int32(TB), nfull - tid * Int32(TB)) * Int32(16)
        P.bulk_start(mbar_a + tid * Int32(8), cache_a + tid * Int32(TB * 16),
                     row_addr + Int64(s0 + tid * Int32(TB * 8)) * Int64(2), nb)  # fmt: skip


@cute.jit
def zero_counters(hist1: cute.Tensor, hist2: cute.Tensor, gsum2: cute.Tensor, scalars: cute.Tensor,
                  row: cute.Tensor, rw: cutlass.Constexpr, dual: cutlass.Constexpr, tid):
    """Zero the histograms, the scalars and the row buffer (other CTAs write into the row only after
    the first cluster barrier); ends with a block barrier."""
    for i in cutlass.range(tid, rw, TB, unroll=1):
        row[i] = Int32(0)
    for i in cutlass.range_constexpr(BPT):
        hist1[tid + Int32(i * TB)] = Int32(0)
    if tid < Int32(NB2 * (1 + int(dual))):
        hist2[tid] = Int32(0)
        gsum2[tid] = Int32(0)
    if tid < Int32(NB2):
        scalars[tid] = Int32(0)
    cute.arch.sync_threads()


@cute.jit
def load_landed_vectors(row_addr: Int64, s0: Int32, s_len: Int32, nvec: Int32, nfull: Int32, aligned: Int32,
                        copies: Int32, cache_a: Int32, mbar_a: Int32, xs: cute.Tensor, base: Int32, tid,
                        vpr: cutlass.Constexpr):
    """A round of pass 1 over bulk-copied vectors: their copies waited for, their ord16 into xs
    (the partial last vector from global memory)."""
    for u in cutlass.range_constexpr(vpr):
        c = base // Int32(TB) + Int32(u)
        if c < copies:  # (every issued copy: one may cover the partial last vector)
            P.mbar_wait0(mbar_a + c * Int32(8))
    for u in cutlass.range_constexpr(vpr):
        vi = base + tid + Int32(u * TB)
        for k in cutlass.range_constexpr(4):
            xs[4 * u + k] = Int32(0)
        if vi < nfull:
            a, b, c, d = P.ld_smem_v4(cache_a + vi * Int32(16))
            ord16_quad(a, b, c, d, xs, 4 * u)
        elif vi < nvec:
            load_vector(row_addr, s0, vi, s_len, aligned, xs, 4 * u)


@cute.jit
def pass1(row_addr: Int64, s0: Int32, s_len: Int32, nvec: Int32, nfull: Int32, aligned: Int32,
          keep: Int32, bulk: Int32, copies: Int32, cache_a: Int32, mbar_a: Int32, h1_a: Int32,
          xs: cute.Tensor, tid, cached: cutlass.Constexpr, vpr: cutlass.Constexpr):
    """The slice read once (from the bulk copies, else by 16-byte loads), its ord16 kept in the
    cache (a kept slice), and the first histogram of every token."""
    for base in cutlass.range(0, nvec, TB * vpr, unroll=1):
        if cutlass.const_expr(cached):
            if bulk != Int32(0):
                load_landed_vectors(row_addr, s0, s_len, nvec, nfull, aligned, copies, cache_a, mbar_a, xs, base,
                                    tid, vpr)  # fmt: skip
            else:
                load_vectors(row_addr, s0, base + tid, nvec, s_len, aligned, cache_a, xs, Int32(0), vpr, TB)
        else:
            load_vectors(row_addr, s0, base + tid, nvec, s_len, aligned, cache_a, xs, Int32(0), vpr, TB)
        for u in cutlass.range_constexpr(vpr):
            vi = base + tid + Int32(u * TB)
            if cutlass.const_expr(cached):
                if vi < nvec and keep != Int32(0):
                    P.st_smem_v4(cache_a + vi * Int32(16), xs[4 * u], xs[4 * u + 1], xs[4 * u + 2], xs[4 * u + 3])
            for k in cutlass.range_constexpr(8):
                # every token, unconditionally (a predicated red compiles to a branch and a
                # convergence barrier per token): NaN / past the end (o = 0) count in bin 0
                o = (Uint32(xs[4 * u + k // 2]) >> Uint32(16 * (k % 2))) & Uint32(0xFFFF)
                P.red_smem_add(h1_a + Int32(o >> Uint32(16 - B1)) * Int32(4), Int32(1))
    if cutlass.const_expr(cached):
        if bulk != Int32(0):
            # every issued copy waited for (those the rounds did not take): none may still land
            done = (nvec + Int32(TB * vpr - 1)) // Int32(TB * vpr) * Int32(vpr)
            for c in cutlass.range(done, copies, unroll=1):
                P.mbar_wait0(mbar_a + c * Int32(8))


@cute.jit
def publish_bounds(hist1: cute.Tensor, published: cute.Tensor, warp_totals: cute.Tensor,
                   own_bins: cute.Tensor, bin_lo: Int32, count: cutlass.Constexpr, tid, lane, warp):
    """Before the first cluster barrier: this CTA's [valid count, own count-th bin (0: fewer), own
    top non-empty bin (0: none)] in published[4..6].  The cluster's count-th score lies between
    the largest of the CTAs' count-th bins and the largest of their top bins."""
    cute.arch.sync_threads()  # hist1 complete
    for p in cutlass.range_constexpr(BPT):
        own_bins[p] = hist1[bin_lo + Int32(p)]
    if tid == Int32(TB - 1):
        own_bins[0] = Int32(0)  # bin 0: the invalid tokens (pass 1)
    own = own_bins[0] + own_bins[1] + own_bins[2] + own_bins[3]
    inc = C.warp_incl_scan(own, lane)
    if lane == Int32(31):
        warp_totals[warp] = inc
    cute.arch.sync_threads()
    total = Int32(0)
    for w in cutlass.range_constexpr(NWARPS):
        x = warp_totals[w]
        if Int32(w) < warp:
            inc = inc + x
        total = total + x
    above = inc - own  # own scores in bins above this thread's
    if above < Int32(count) and inc >= Int32(count):
        for p in cutlass.range_constexpr(BPT):
            c = own_bins[BPT - 1 - p]
            if c > Int32(0) and above < Int32(count) and above + c >= Int32(count):
                published[5] = bin_lo + Int32(BPT - 1 - p)
            above = above + c
    if own > Int32(0) and inc == own:
        top = bin_lo
        for p in cutlass.range_constexpr(1, BPT):
            if own_bins[p] > Int32(0):
                top = bin_lo + Int32(p)
        published[6] = top
    if tid == Int32(0):
        published[4] = total
        if total < Int32(count):
            published[5] = Int32(0)
        if total == Int32(0):
            published[6] = Int32(0)


@cute.jit
def cluster_histogram(hist1: cute.Tensor, h1_a: Int32, published_a: Int32, own_bins: cute.Tensor,
                      cluster_bins: cute.Tensor, bin_lo: Int32, csize: Int32, tid, lane,
                      clustered: cutlass.Constexpr) -> Int32:
    """After the first cluster barrier: own_bins / cluster_bins = this thread's 4 bins of its CTA's
    / the cluster's first histogram (bin 0 dropped) -> the cluster's valid count where only the
    bounded bins were summed, else -1 (the scan's total is it)."""
    for p in cutlass.range_constexpr(BPT):
        own_bins[p] = hist1[bin_lo + Int32(p)]
        cluster_bins[p] = Int32(0)
    if tid == Int32(TB - 1):
        own_bins[0] = Int32(0)  # bin 0: the invalid tokens (pass 1)
    cl_total = Int32(-1)
    if cutlass.const_expr(clustered):
        if csize >= Int32(BOUNDED_MIN):
            # every warp: lane r < C reads CTA r's published triple (one 16-byte load)
            pt, pl, ph, pz = Int32(0), Int32(0), Int32(0), Int32(0)
            if lane < csize:
                pt, pl, ph, pz = P.ld_dsmem_v4(P.mapa(published_a + Int32(16), lane))
            cl_total = cute.arch.warp_redux_sync(pt, "add")
            lo = cute.arch.warp_redux_sync(pl, "max")
            hi = cute.arch.warp_redux_sync(ph, "max")
            if bin_lo + Int32(BPT - 1) >= lo and bin_lo <= hi:
                sum_cluster_bins(h1_a, bin_lo, csize, cluster_bins)
        elif one_cta(csize) != Int32(0):
            for p in cutlass.range_constexpr(BPT):
                cluster_bins[p] = own_bins[p]
        else:
            sum_cluster_bins(h1_a, bin_lo, csize, cluster_bins)  # every bin
    else:
        for p in cutlass.range_constexpr(BPT):
            cluster_bins[p] = own_bins[p]
    if tid == Int32(TB - 1):
        cluster_bins[0] = Int32(0)
    return cl_total


@cute.jit
def locate_boundary_bin(count: cutlass.Constexpr, ig: Int32, il: Int32, sg: Int32, sl: Int32, cluster_bins: cute.Tensor,
                        own_bins: cute.Tensor, bin_lo: Int32, scalars: cute.Tensor, so: cutlass.Constexpr):
    """The thread whose bins hold the cluster's count-th score (ig / il: the inclusive scans of the
    cluster's / own bin sums sg / sl) writes its bin, the cluster's and its CTA's scores above it
    into scalars[so + _B1, _ABOVE1, _OWN_ABOVE1]."""
    above = ig - sg
    own_above = il - sl
    if above < Int32(count) and ig >= Int32(count):
        for p in cutlass.range_constexpr(BPT):
            c = cluster_bins[BPT - 1 - p]
            if c > Int32(0) and above < Int32(count) and above + c >= Int32(count):
                scalars[so + _B1] = bin_lo + Int32(BPT - 1 - p)
                scalars[so + _ABOVE1] = above
                scalars[so + _OWN_ABOVE1] = own_above
            above = above + c
            own_above = own_above + own_bins[BPT - 1 - p]


@cute.jit
def boundary_bin(hist1: cute.Tensor, h1_a: Int32, published: cute.Tensor, published_a: Int32,
                 scalars: cute.Tensor, warp_totals: cute.Tensor, csize: Int32, tid, lane, warp,
                 n: cutlass.Constexpr, n2: cutlass.Constexpr, clustered: cutlass.Constexpr):
    """Around the first cluster barrier: the boundary bin of the top-n (and top-n2) in scalars by
    one block scan from the top bin, the row's valid count in scalars[_TOTAL], this CTA's in
    published[1].  Ends with a block barrier."""
    # thread tid owns bins bin_lo + 3 .. bin_lo, bin_lo = NB1 - 4 (tid + 1): the scans rank from the top
    bin_lo = Int32(NB1 - BPT) - tid * Int32(BPT)
    own_bins = cute.make_rmem_tensor((BPT,), Int32)
    cluster_bins = cute.make_rmem_tensor((BPT,), Int32)
    if cutlass.const_expr(clustered):
        if csize >= Int32(BOUNDED_MIN):
            publish_bounds(hist1, published, warp_totals, own_bins, bin_lo, max(n, n2), tid, lane, warp)
    cluster_barrier(clustered, csize)
    cl_total = cluster_histogram(hist1, h1_a, published_a, own_bins, cluster_bins, bin_lo, csize, tid, lane, clustered)
    sg = cluster_bins[0] + cluster_bins[1] + cluster_bins[2] + cluster_bins[3]
    sl = own_bins[0] + own_bins[1] + own_bins[2] + own_bins[3]
    ig, il, tg, tl = block_scan2(sg, sl, lane, warp, warp_totals)
    if cl_total >= Int32(0):
        tg = cl_total  # (the scan summed only the bins in [lo, hi])
    if cutlass.const_expr(n2 > 0):
        locate_boundary_bin(n2, ig, il, sg, sl, cluster_bins, own_bins, bin_lo, scalars, _K)
    locate_boundary_bin(n, ig, il, sg, sl, cluster_bins, own_bins, bin_lo, scalars, 0)
    if tid == Int32(0):
        scalars[_TOTAL] = tg
        published[1] = tl
    cute.arch.sync_threads()


# ---- pass 2: the mask and the second histograms
@cute.jit
def pass2(row_addr: Int64, s0: Int32, s_len: Int32, nvec: Int32, nvec4: Int32, aligned: Int32,
          keep: Int32, big: Int32, mthr: Uint32, b1c: Int32, b1kc: Int32, cache_a: Int32, h2_a: Int32,
          mask_a: Int32, xs: cute.Tensor, tid, dual: cutlass.Constexpr, vpr: cutlass.Constexpr):
    """A mask bit per token of ord16 >= mthr (about n + the boundary bin's count over the row); a
    slice re-read from global memory or a crowded one (``big``) also counts the second histogram
    of bin b1c's (and b1kc's) tokens here, a kept one from the mask's set bits (hist2_walk)."""
    for base in cutlass.range(0, nvec4, TB * vpr, unroll=1):
        load_vectors(row_addr, s0, base + tid, nvec, s_len, aligned, cache_a, xs, keep, vpr, TB)
        for u in cutlass.range_constexpr(vpr):
            mb = Int32(0)
            for k in cutlass.range_constexpr(8):
                o = (Uint32(xs[4 * u + k // 2]) >> Uint32(16 * (k % 2))) & Uint32(0xFFFF)
                if o >= mthr:
                    mb = mb | Int32(1 << k)
            if (keep == Int32(0) or big != Int32(0)) and mb != Int32(0):
                for k in cutlass.range_constexpr(8):
                    o = (Uint32(xs[4 * u + k // 2]) >> Uint32(16 * (k % 2))) & Uint32(0xFFFF)
                    # a valid score's bin is >= 3 (ord16 >= 0x7F): bin == b1 excludes NaN
                    P.red_smem_inc_if(h2_a + Int32(o & Uint32(NB2 - 1)) * Int32(4), Int32(o >> Uint32(16 - B1)), b1c)
                    if cutlass.const_expr(dual):
                        P.red_smem_inc_if(h2_a + Int32(NB2 * 4) + Int32(o & Uint32(NB2 - 1)) * Int32(4),
                                          Int32(o >> Uint32(16 - B1)), b1kc)  # fmt: skip
            vi = base + tid + Int32(u * TB)
            if vi < nvec4:
                P.st_smem_u8(mask_a + vi, mb)


@cute.jit
def pass2_thresholds(total: Int32, b1: Int32, b1k: Int32, n: cutlass.Constexpr, n2: cutlass.Constexpr):
    """(the mask's threshold: the lower boundary bin's first ord16, 1 where the row has at most that
    count; the bin whose second histogram is counted, -1: none; the rescue list's)."""
    mthr = Uint32(1)  # ord16 >= 1: valid
    b1c = Int32(-1)
    if total > Int32(n):
        mthr = Uint32(b1) << Uint32(16 - B1)
        b1c = b1
    b1kc = Int32(-1)
    if cutlass.const_expr(n2 > 0):
        mthr = Uint32(1)
        if total > Int32(n2):
            mthr = Uint32(b1k) << Uint32(16 - B1)
            b1kc = b1k
    return mthr, b1c, b1kc


@cute.jit
def mask_unit_pair(mask_a: Int32, ua: Int32, u1: Int32) -> Uint32:
    """Mask units ua, ua + 1 (16 tokens each; zero at or past u1) as one word, by two predicated
    loads: the walks take a thread's units two at a time."""
    lo = P.ld_smem_u16_if(mask_a + ua * Int32(2), Int32(ua < u1))
    hi = P.ld_smem_u16_if(mask_a + ua * Int32(2) + Int32(2), Int32(ua + Int32(1) < u1))
    return lo | (hi << Uint32(16))


@cute.jit
def next_two_set_bits(m: Uint32, base: Int32, sl: Slice):
    """One step of a walk over the set bits m (some set) of the word whose bit 0 is slice token
    ``base``: the lowest two set bits' tokens and ord16 (the second's 0 where there is none, which
    every walk skips), both loads issued before either is used -> (lta, oa, ltb, ob, m without them)."""
    lta = base + P.low_bit(Int32(m))
    m = m & (m - Uint32(1))
    ltb = lta
    more = Int32(0)
    if m != Uint32(0):
        more = Int32(1)
        ltb = base + P.low_bit(Int32(m))
    m = m & (m - Uint32(1))  # (m = 0 stays 0)
    oa, ob = Uint32(0), Uint32(0)
    if sl.keep != Int32(0):
        oa = P.ld_smem_u16(sl.cache_a + lta * Int32(2))
        ob = P.ld_smem_u16(sl.cache_a + ltb * Int32(2))
    else:
        oa = C.ord16(P.ld_u16(sl.row_addr + Int64(sl.s0 + lta) * Int64(2)))
        ob = C.ord16(P.ld_u16(sl.row_addr + Int64(sl.s0 + ltb) * Int64(2)))
    if more == Int32(0):
        ob = Uint32(0)
    return lta, oa, ltb, ob, m


@cute.jit
def hist2_add(h2_a: Int32, o: Uint32, b: Int32):
    """The second histogram's count of ord16 o where its bin is b, by an unconditional red of
    (bin == b) (o = 0, no token, is in bin 0, never b)."""
    P.red_smem_add(h2_a + Int32(o & Uint32(NB2 - 1)) * Int32(4), Int32(Int32(o >> Uint32(16 - B1)) == b))


@cute.jit
def low_counter_add(o: Uint32, b1: Int32, above: Int32, lowc: Uint64, ovf: Int32):
    """One token of the hist2 walk (o = 0: none): above + (bin > b1); a bin-b1 token adds 1 to its
    low value's 2-bit counter in lowc, or sets ovf where that is 3.  Once v is known they give the
    compaction's counts without its first walk."""
    bn = Int32(o >> Uint32(16 - B1))
    if bn > b1:
        above = above + Int32(1)
    if bn == b1:
        sh = Uint64((o & Uint32(NB2 - 1)) * Uint32(2))
        if ((lowc >> sh) & Uint64(3)) == Uint64(3):
            ovf = Int32(1)
        else:
            lowc = lowc + (Uint64(1) << sh)
    return above, lowc, ovf


@cute.jit
def hist2_walk(sl: Slice, units: Units, b1: Int32, b1kc: Int32, h2_a: Int32, dual: cutlass.Constexpr):
    """A kept slice's second histogram(s) from its mask's set bits over the thread's units; one count
    (no rescue list) also keeps low_counter_add's counters -> (1 where no counter passed 3, above,
    counters)."""
    above, lowc, ovf = Int32(0), Uint64(0), Int32(0)
    for j in cutlass.range(0, (units.per_thread + Int32(1)) >> Int32(1), unroll=1):
        m = mask_unit_pair(units.mask_a, units.u0 + Int32(2) * j, units.u1)
        while m != Uint32(0):
            _a, oa, _b, ob, m = next_two_set_bits(m, (units.u0 + Int32(2) * j) * Int32(16), sl)
            hist2_add(h2_a, oa, b1)
            hist2_add(h2_a, ob, b1)
            if cutlass.const_expr(not dual):
                above, lowc, ovf = low_counter_add(oa, b1, above, lowc, ovf)
                above, lowc, ovf = low_counter_add(ob, b1, above, lowc, ovf)
            if cutlass.const_expr(dual):
                hist2_add(h2_a + Int32(NB2 * 4), oa, b1kc)
                hist2_add(h2_a + Int32(NB2 * 4), ob, b1kc)
    ok = Int32(0)
    if cutlass.const_expr(not dual):
        ok = Int32(1) - ovf
    return ok, above, lowc


# ---- the boundary score (second cluster barrier)
@cute.jit
def boundary_score_one_cta(nn: cutlass.Constexpr, b1: Int32, hist2: cute.Tensor, published: cute.Tensor,
                           scalars: cute.Tensor, lane, warp, ho: cutlass.Constexpr, pa: cutlass.Constexpr,
                           so: cutlass.Constexpr):
    """boundary_step of a one-CTA cluster: warp 0 scans its own second histogram, one block barrier
    instead of three -> (v, need_eq)."""
    if warp == Int32(0):
        c = hist2[Int32(ho + NB2 - 1) - lane]  # (bins from the top)
        inc = C.warp_incl_scan(c, lane)
        need2 = Int32(nn) - scalars[so + _ABOVE1]
        if c > Int32(0) and inc >= need2 and inc - c < need2:  # (exactly one lane)
            scalars[so + _LOWV] = Int32(NB2 - 1) - lane
            scalars[so + _ABOVE2] = inc - c
            scalars[so + _GT_OWN] = published[pa] + inc - c
            scalars[so + _EQ_OWN] = c
    cute.arch.sync_threads()
    v = (Uint32(b1) << Uint32(16 - B1)) | Uint32(scalars[so + _LOWV])
    need_eq = Int32(nn) - scalars[so + _ABOVE1] - scalars[so + _ABOVE2]
    return v, need_eq


@cute.jit
def boundary_score_cluster(nn: cutlass.Constexpr, b1: Int32, hist2: cute.Tensor, gsum2: cute.Tensor,
                           published: cute.Tensor, scalars: cute.Tensor, h2_a: Int32, g2_a: Int32,
                           published_a: Int32, scalars_a: Int32, r: Int32, j: Int32, lane, warp,
                           csize: Int32, me: Int32, clustered: cutlass.Constexpr, ho: cutlass.Constexpr,
                           pa: cutlass.Constexpr, so: cutlass.Constexpr):
    """boundary_step where the row has more than nn valid tokens: warp r < C (lane j: bin j) adds
    CTA r's second histogram into gsum2, warp 0 finds the boundary score in it, then warp r adds
    CTA r's counts > v / == v to this CTA's counts before its slice (r < me) or in it (r == me)."""
    x = Int32(0)
    above = Int32(0)  # CTA r's count above b1 (lane j == 0), loaded with x
    if r < csize:
        if cutlass.const_expr(clustered):
            if one_cta(csize) != Int32(0):  # (r == me == 0: its own histogram)
                x = hist2[ho + j]
                if j == Int32(0):
                    above = published[pa]
            else:
                x = P.ld_dsmem_u32(P.mapa(h2_a + (Int32(ho) + j) * Int32(4), r))
                # (only CTAs up to this one count: every DSMEM load is used before own_part's
                # relaxed arrival)
                if j == Int32(0) and r <= me:
                    above = P.ld_dsmem_u32(P.mapa(published_a + Int32(4 * pa), r))
        else:
            x = hist2[ho + j]
            above = published[pa]
        if x != Int32(0):
            P.red_smem_add(g2_a + (Int32(ho) + j) * Int32(4), x)
    cute.arch.sync_threads()
    need2 = Int32(nn) - scalars[so + _ABOVE1]
    if warp == Int32(0):
        c = gsum2[Int32(ho + NB2 - 1) - lane]
        inc = C.warp_incl_scan(c, lane)
        if c > Int32(0) and inc >= need2 and inc - c < need2:
            scalars[so + _LOWV] = Int32(NB2 - 1) - lane
            scalars[so + _ABOVE2] = inc - c
    cute.arch.sync_threads()
    lowv = scalars[so + _LOWV]
    v = (Uint32(b1) << Uint32(16 - B1)) | Uint32(lowv)
    need_eq = Int32(nn) - scalars[so + _ABOVE1] - scalars[so + _ABOVE2]
    if r < csize:
        gt, eq = Int32(0), Int32(0)
        if j > lowv:
            gt = x
        if j == lowv:
            eq = x
        if j == Int32(0):
            gt = gt + above
        if r < me:
            if gt != Int32(0):
                P.red_smem_add(scalars_a + Int32((so + _GT_BEFORE) * 4), gt)
            if eq != Int32(0):
                P.red_smem_add(scalars_a + Int32((so + _EQ_BEFORE) * 4), eq)
        if r == me:
            if gt != Int32(0):
                P.red_smem_add(scalars_a + Int32((so + _GT_OWN) * 4), gt)
            if eq != Int32(0):
                P.red_smem_add(scalars_a + Int32((so + _EQ_OWN) * 4), eq)
    return v, need_eq


@cute.jit
def boundary_step(nn: cutlass.Constexpr, total: Int32, b1: Int32, hist2: cute.Tensor, gsum2: cute.Tensor,
                  published: cute.Tensor, scalars: cute.Tensor, h2_a: Int32, g2_a: Int32, published_a: Int32,
                  scalars_a: Int32, tid, lane, warp, csize: Int32, me: Int32, clustered: cutlass.Constexpr,
                  ho: cutlass.Constexpr, pa: cutlass.Constexpr, so: cutlass.Constexpr):
    """After the second cluster barrier: the boundary score v of the top-nn, need_eq (how many == v
    are kept), and how many > v / == v precede this slice and lie in it (scalars slots + so) ->
    (v, need_eq).  (so, ho, pa): the count's scalars, second histograms (hist2 / gsum2) and
    published own count above its b1, (0, 0, 0) for n, (_K, NB2, 2) for n2.  Ends with a block
    barrier."""
    v, need_eq = Uint32(0), Int32(0)
    r = tid >> Int32(5)
    j = tid & Int32(31)
    fast = Int32(0)  # a one-CTA cluster: warp 0 does the step
    if cutlass.const_expr(clustered):
        if total > Int32(nn):
            fast = one_cta(csize)
    if fast != Int32(0):
        v, need_eq = boundary_score_one_cta(nn, b1, hist2, published, scalars, lane, warp, ho, pa, so)
    elif total > Int32(nn):
        v, need_eq = boundary_score_cluster(nn, b1, hist2, gsum2, published, scalars, h2_a, g2_a, published_a,
                                            scalars_a, r, j, lane, warp, csize, me, clustered, ho, pa, so)
    else:
        # every valid token is kept (v = 0); what precedes the slice is the earlier CTAs' valid count
        if tid < csize and tid < me:
            y = Int32(0)
            if cutlass.const_expr(clustered):
                y = P.ld_dsmem_u32(P.mapa(published_a + Int32(4), tid))
            P.red_smem_add(scalars_a + Int32((so + _GT_BEFORE) * 4), y)
        if tid == Int32(0):
            scalars[so + _GT_OWN] = published[1]
    if fast == Int32(0):  # (the one-CTA step ended with its barrier)
        cute.arch.sync_threads()
    return v, need_eq


# ---- a crowded slice's list
@cute.jit
def refine_mask(mask: cute.Tensor, cache_a: Int32, nvec4: Int32, v: Uint32, tid):
    """Clear the mask bit of every token below the boundary score v: what stays is kept or tied.
    Thread tid takes mask words tid, tid + TB, ... (a vector's ord16 loaded where it has a set bit)."""
    for wi in cutlass.range(tid, nvec4 // Int32(4), TB, unroll=1):
        w = Uint32(mask[wi])
        if w != Uint32(0):
            nw = Uint32(0)
            for j in cutlass.range_constexpr(4):
                byte = (w >> Uint32(8 * j)) & Uint32(0xFF)
                if byte != Uint32(0):
                    a, b, c, d = P.ld_smem_v4(cache_a + (wi * Int32(4) + Int32(j)) * Int32(16))
                    xs = (a, b, c, d)
                    ge = Uint32(0)  # (selects, not a branch per token)
                    for k in cutlass.range_constexpr(8):
                        o = (Uint32(xs[k // 2]) >> Uint32(16 * (k % 2))) & Uint32(0xFFFF)
                        ge = ge | (Uint32(Int32(o >= v)) << Uint32(k))
                    nw = nw | ((byte & ge) << Uint32(8 * j))
            mask[wi] = Int32(nw)


@cute.jit
def build_list(mask_a: Int32, cache_a: Int32, lw: Int32, u0: Int32, u1: Int32, pos: Int32):
    """mask[lw + pos ..] = (ord16 << 16) | token of every set bit of units [u0, u1) in index order:
    a unit's ord16 in two 16-byte loads, then a predicated store per bit (no chain of loads)."""
    for u in cutlass.range(u0, u1, unroll=1):
        m = P.ld_smem_u16(mask_a + u * Int32(2))
        if m != Uint32(0):
            xs = cute.make_rmem_tensor((8,), Int32)
            for k in cutlass.range_constexpr(8):
                xs[k] = Int32(0)
            if (m & Uint32(0xFF)) != Uint32(0):
                for q, w in enumerate(P.ld_smem_v4(cache_a + u * Int32(32))):
                    xs[q] = w
            if (m >> Uint32(8)) != Uint32(0):  # (a set bit: that vector is inside the slice)
                for q, w in enumerate(P.ld_smem_v4(cache_a + u * Int32(32) + Int32(16))):
                    xs[4 + q] = w
            for k in cutlass.range_constexpr(16):
                o = (Uint32(xs[k // 2]) >> Uint32(16 * (k % 2))) & Uint32(0xFFFF)
                bit = Int32((m >> Uint32(k)) & Uint32(1))
                P.st_smem_u32_if(mask_a + (lw + pos) * Int32(4),
                                 Int32((o << Uint32(16)) | Uint32(u * Int32(16) + Int32(k))), bit)  # fmt: skip
                pos = pos + bit


@cute.jit
def make_list(mask_a: Int32, cache_a: Int32, lw: Int32, u0: Int32, u1: Int32, lane, warp,
              warp_totals: cute.Tensor, tid):
    """The mask's set bits as a list at mask[lw ..] (build_list) where it fits -> (1, r0, r1):
    thread tid walks entries [r0, r1); else (0, 0, 0).  Every thread of the CTA calls it."""
    cnt = Int32(0)
    for u in cutlass.range(u0, u1, unroll=1):
        cnt = cnt + Int32(cute.arch.popc(P.ld_smem_u16(mask_a + u * Int32(2))))
    icnt, _, nbits, _ = block_scan2(cnt, Int32(0), lane, warp, warp_totals)
    ok, r0, r1 = Int32(0), Int32(0), Int32(0)
    if nbits <= Int32(MASK_WORDS) - lw:
        ok = Int32(1)
        build_list(mask_a, cache_a, lw, u0, u1, icnt - cnt)
        cute.arch.sync_threads()
        q = (nbits + Int32(TB - 1)) // Int32(TB)
        r0 = cutlass.min(tid * q, nbits)
        r1 = cutlass.min(r0 + q, nbits)
    return ok, r0, r1


# ---- the compaction
@cute.jit
def count_token(o: Uint32, v: Uint32, ngt: Int32, neq: Int32):
    """(ngt, neq) + (o > v, o == v kept): one token of the compaction's first walk."""
    if o > v:
        ngt = ngt + Int32(1)
    if o == v and v != Uint32(0):
        neq = neq + Int32(1)
    return ngt, neq


@cute.jit
def counts_from_low_counters(above: Int32, lowc: Uint64, lowv: Int32):
    """A thread's compaction counts (> v, == v) from its hist2 walk's counters, v = (b1 << 5) | lowv."""
    x = lowc >> Uint64(Int32(2) * lowv)
    hi = x >> Uint64(2)  # (two shifts: lowv = 31 shifts by 64 in all)
    ngt = above + P.popc64(hi & Uint64(0x5555555555555555)) + Int32(2) * P.popc64(hi & Uint64(0xAAAAAAAAAAAAAAAA))
    return ngt, Int32(x & Uint64(3))


@cute.jit
def kept_pos(o: Uint32, v: Uint32, gt_b: Int32, eq_b: Int32, need_eq: Int32, n: cutlass.Constexpr):
    """One token of a compaction walk in index order (> v kept; == v kept while fewer than need_eq
    came before) -> (its position in the packed row or -1, the advanced gt_b, eq_b)."""
    pos = Int32(-1)
    if o > v:
        pos = gt_b + cutlass.min(eq_b, need_eq)
        gt_b = gt_b + Int32(1)
    if o == v and v != Uint32(0):
        if eq_b < need_eq:
            pos = gt_b + eq_b
        eq_b = eq_b + Int32(1)
    if pos >= Int32(n):
        pos = Int32(-1)  # never past the row (logits changed while the kernel reads them)
    return pos, gt_b, eq_b


@cute.jit
def emit_token(o: Uint32, lu: Uint32, v: Uint32, gt_b: Int32, eq_b: Int32, need_eq: Int32,
               n: cutlass.Constexpr, remote: Int32, dst_a: Int32, row: cute.Tensor, row_a: Int32):
    """The packed word of a kept token (ord16 o, row index lu) at its position in the row buffer
    at dst_a (another CTA's where ``remote``) -> the advanced (gt_b, eq_b)."""
    pos, gt_b, eq_b = kept_pos(o, v, gt_b, eq_b, need_eq, n)
    if pos >= Int32(0):
        word = Int32((o << Uint32(16)) | (Uint32(0xFFFF) - (lu & Uint32(0xFFFF))))
        hi = (lu >> Uint32(16)) != Uint32(0)
        maddr = dst_a + (Int32(n) + (pos >> Int32(5))) * Int32(4)
        mbit = Int32(1) << (pos & Int32(31))
        if remote != Int32(0):
            P.st_dsmem_u32(dst_a + pos * Int32(4), word)
            if hi:
                P.red_dsmem_or(maddr, mbit)
        else:
            # plain shared accesses (a one-CTA cluster too): what closing_barrier's relaxed barrier releases
            row[pos] = word
            if hi:
                P.red_smem_or(row_a + (Int32(n) + (pos >> Int32(5))) * Int32(4), mbit)
    return gt_b, eq_b


@cute.jit
def emit_k(o: Uint32, lu: Uint32, v: Uint32, gt_b: Int32, eq_b: Int32, need_eq: Int32,
           n: cutlass.Constexpr, k_out: Int64, lo16: Int32, staged: cutlass.Constexpr, st_a: Int32):
    """emit_token for the rescue list: the word at position pos of the K-list row, at shared
    address st_a + 4 pos where ``staged`` (stored whole after the walk), else at k_out + 4 pos
    -> the advanced (gt_b, eq_b, lo16: kept tokens with l < 2**16)."""
    pos, gt_b, eq_b = kept_pos(o, v, gt_b, eq_b, need_eq, n)
    if pos >= Int32(0):
        word = Int32((o << Uint32(16)) | (Uint32(0xFFFF) - (lu & Uint32(0xFFFF))))
        if cutlass.const_expr(staged):
            P.st_smem_u32(st_a + pos * Int32(4), word)
        else:
            P.st_u32(k_out + Int64(pos) * Int64(4), word)
        if (lu >> Uint32(16)) == Uint32(0):
            lo16 = lo16 + Int32(1)
    return gt_b, eq_b, lo16


@cute.jit
def mask_bits(p_hi: Int32, p_end: Int32, k: Int32, nmw: cutlass.Constexpr) -> Int32:
    """Mask word k of a packed row: bit j set for position 32 k + j in [p_hi, p_end); the padding
    words past the nmw mask words are zero."""
    a = cutlass.min(cutlass.max(p_hi - Int32(32) * k, Int32(0)), Int32(32))
    b = cutlass.min(cutlass.max(p_end - Int32(32) * k, Int32(0)), Int32(32))
    bits = Int32(0)
    if b > a and k < Int32(nmw):
        ones_b = (Uint64(1) << Uint64(b)) - Uint64(1)
        bits = Int32(Uint64(ones_b ^ ((Uint64(1) << Uint64(a)) - Uint64(1))))
    return bits


@cute.jit
def own_range(scalars: cute.Tensor, so: cutlass.Constexpr, need_eq: Int32, count: cutlass.Constexpr):
    """(> v, == v kept before this slice, the same up to its end, its positions [p0, p1))."""
    gt_run = scalars[so + _GT_BEFORE]
    eq_run = scalars[so + _EQ_BEFORE]
    gt_end = gt_run + scalars[so + _GT_OWN]
    eq_end = cutlass.min(eq_run + scalars[so + _EQ_OWN], need_eq)
    p0 = cutlass.min(gt_run + cutlass.min(eq_run, need_eq), Int32(count))
    p1 = cutlass.min(gt_end + eq_end, Int32(count))
    return gt_run, eq_run, gt_end, eq_end, p0, p1


@cute.jit
def count_kept(sl: Slice, units: Units, share: ListShare, v: Uint32, vk: Uint32, cnt_ok: Int32,
               c2_above: Int32, c2_low: Uint64, dual: cutlass.Constexpr):
    """The compaction's first walk: this thread's counts (> v, == v; > vk, == vk) over its list
    entries, from its hist2 walk's counters, or over its units -> (ngt, neq, ngtk, neqk)."""
    ngt, neq, ngtk, neqk = Int32(0), Int32(0), Int32(0), Int32(0)
    if share.used != Int32(0):
        for r in cutlass.range(share.r0, share.r1, unroll=1):
            o = Uint32(share.mask[share.first_word + r]) >> Uint32(16)
            ngt, neq = count_token(o, v, ngt, neq)
            if cutlass.const_expr(dual):
                ngtk, neqk = count_token(o, vk, ngtk, neqk)
    elif cnt_ok != Int32(0):
        ngt, neq = counts_from_low_counters(c2_above, c2_low, Int32(v & Uint32(NB2 - 1)))
    else:
        for j in cutlass.range(0, (units.per_thread + Int32(1)) >> Int32(1), unroll=1):
            m = mask_unit_pair(units.mask_a, units.u0 + Int32(2) * j, units.u1)  # (the refined mask where big)
            while m != Uint32(0):
                _a, oa, _b, ob, m = next_two_set_bits(m, (units.u0 + Int32(2) * j) * Int32(16), sl)
                ngt, neq = count_token(oa, v, ngt, neq)
                ngt, neq = count_token(ob, v, ngt, neq)
                if cutlass.const_expr(dual):
                    ngtk, neqk = count_token(oa, vk, ngtk, neqk)
                    ngtk, neqk = count_token(ob, vk, ngtk, neqk)
    return ngt, neq, ngtk, neqk


@cute.jit
def emit_kept(sl: Slice, units: Units, share: ListShare, v: Uint32, need_eq: Int32, gt_b: Int32, eq_b: Int32,
              vk: Uint32, need_eqk: Int32, gtk_b: Int32, eqk_b: Int32, remote: Int32, dst_a: Int32, row: cute.Tensor,
              row_a: Int32, k_out, h1_a: Int32, p0k: Int32, n: cutlass.Constexpr, n2: cutlass.Constexpr,
              stage_klist: cutlass.Constexpr):
    """The compaction's second walk, over count_kept's tokens: each kept token's word at its
    position (emit_token; emit_k for the K-list) -> this thread's kept K-list tokens with l < 2**16."""
    lo16 = Int32(0)
    if share.used != Int32(0):
        for r in cutlass.range(share.r0, share.r1, unroll=1):
            e = Uint32(share.mask[share.first_word + r])
            o = e >> Uint32(16)
            lu = Uint32(sl.s0) + (e & Uint32(0xFFFF))
            gt_b, eq_b = emit_token(o, lu, v, gt_b, eq_b, need_eq, n, remote, dst_a, row, row_a)
            if cutlass.const_expr(n2 > 0):
                gtk_b, eqk_b, lo16 = emit_k(o, lu, vk, gtk_b, eqk_b, need_eqk, n2, k_out, lo16, stage_klist,
                                            h1_a - p0k * Int32(4))  # fmt: skip
    else:
        for j in cutlass.range(0, (units.per_thread + Int32(1)) >> Int32(1), unroll=1):
            m = mask_unit_pair(units.mask_a, units.u0 + Int32(2) * j, units.u1)
            while m != Uint32(0):
                lta, oa, ltb, ob, m = next_two_set_bits(m, (units.u0 + Int32(2) * j) * Int32(16), sl)
                gt_b, eq_b = emit_token(oa, Uint32(sl.s0 + lta), v, gt_b, eq_b, need_eq, n, remote, dst_a, row, row_a)
                if cutlass.const_expr(n2 > 0):
                    gtk_b, eqk_b, lo16 = emit_k(oa, Uint32(sl.s0 + lta), vk, gtk_b, eqk_b, need_eqk, n2, k_out,
                                                lo16, stage_klist, h1_a - p0k * Int32(4))  # fmt: skip
                gt_b, eq_b = emit_token(ob, Uint32(sl.s0 + ltb), v, gt_b, eq_b, need_eq, n, remote, dst_a, row, row_a)
                if cutlass.const_expr(n2 > 0):
                    gtk_b, eqk_b, lo16 = emit_k(ob, Uint32(sl.s0 + ltb), vk, gtk_b, eqk_b, need_eqk, n2, k_out,
                                                lo16, stage_klist, h1_a - p0k * Int32(4))  # fmt: skip
    return lo16


@cute.jit
def compact(sl: Slice, units: Units, share: ListShare, scalars: cute.Tensor, scalars_a: Int32, warp_totals: cute.Tensor,
            row: cute.Tensor, row_a: Int32, h1_a: Int32, k_out, v: Uint32, need_eq: Int32, vk: Uint32, need_eqk: Int32,
            cnt_ok: Int32, c2_above: Int32, c2_low: Uint64, csize: Int32, lane, warp, n: cutlass.Constexpr,
            n2: cutlass.Constexpr, clustered: cutlass.Constexpr, own: cutlass.Constexpr):
    """After the boundary step: this thread's counts (count_kept), one pair block scan, then every
    kept token's word at its final position (emit_kept), in this CTA's row buffer (``own``) or
    CTA 0's, and the K-list's -> this CTA's positions [p0, p1) of the row, [p0k, p1k) of the K-list."""
    dual = cutlass.const_expr(n2 > 0)
    gt_run, eq_run, gt_end, eq_end, p0, p1 = own_range(scalars, 0, need_eq, n)
    dst_a = row_a
    remote = Int32(0)  # the row lives in another CTA (DSMEM stores)
    if cutlass.const_expr(clustered and not own):
        dst_a = P.mapa(row_a, Int32(0))
        if csize > Int32(1):
            remote = Int32(1)
    gtk_run = Int32(0)  # (the rescue list) the same for n2
    eqk_run, p0k, p1k = Int32(0), Int32(0), Int32(0)
    stage_klist = cutlass.const_expr(klist_staged(n2))
    work = Int32(0)  # (the rescue list) n2's tokens to write
    if cutlass.const_expr(dual):
        gtk_run, eqk_run, gtk_end, eqk_end, p0k, p1k = own_range(scalars, _K, need_eqk, n2)
        work = Int32(gtk_run < gtk_end) | Int32(eqk_run < eqk_end)
    lo16 = Int32(0)  # (the rescue list) this thread's kept n2 tokens with l < 2**16
    if gt_run < gt_end or eq_run < eq_end or work != Int32(0):
        ngt, neq, ngtk, neqk = count_kept(sl, units, share, v, vk, cnt_ok, c2_above, c2_low, dual)
        igt, ieq, _, _ = block_scan2(ngt, neq, lane, warp, warp_totals)
        gtk_b, eqk_b = Int32(0), Int32(0)
        if cutlass.const_expr(dual):
            igtk, ieqk, _, _ = block_scan2(ngtk, neqk, lane, warp, warp_totals)
            gtk_b = gtk_run + igtk - ngtk
            eqk_b = eqk_run + ieqk - neqk
        gt_b = gt_run + igt - ngt
        eq_b = eq_run + ieq - neq
        if ngt + neq + ngtk + neqk != Int32(0):
            lo16 = emit_kept(sl, units, share, v, need_eq, gt_b, eq_b, vk, need_eqk, gtk_b, eqk_b, remote, dst_a,
                             row, row_a, k_out, h1_a, p0k, n, n2, stage_klist)  # fmt: skip
    if cutlass.const_expr(dual):
        if lo16 != Int32(0):
            P.red_smem_add(scalars_a + Int32((_K + _TOTAL) * 4), lo16)
    return p0, p1, p0k, p1k


@cute.jit
def write_klist_tail(k_out: Int64, p16: Int32, cnt: Int32, n2: cutlass.Constexpr, tid):
    """The K-list row's mask words (bit 16 of l set at positions [p16, cnt)) and its empty words."""
    for i in cutlass.range(tid, layout.row_words(n2) - n2, TB, unroll=1):
        P.st_u32(k_out + Int64(n2 + i) * Int64(4), mask_bits(p16, cnt, i, n2 // 32))
    for i in cutlass.range(cnt + tid, n2, TB, unroll=1):
        P.st_u32(k_out + Int64(i) * Int64(4), Int32(0))


# ---- the select
@cute.jit
def select_row(row_addr: Int64, end: Int32, n: cutlass.Constexpr, rw: cutlass.Constexpr,
               parts, tid, lane, warp, csize: Int32, me: Int32, clustered: cutlass.Constexpr,
               cached: cutlass.Constexpr, cache_cap: Int32, vpr: cutlass.Constexpr = U1,
               early=None, own_part: cutlass.Constexpr = False, n2: cutlass.Constexpr = 0, k_out=None):
    """Top-min(n, valid) of the first ``end`` bf16 at ``row_addr`` (``end`` clamped by the caller)
    -> the packed row (docs/DESIGN.md §5) in the ``row`` buffer of the cluster's CTA 0 (this CTA's
    where not ``clustered``), complete after the closing cluster barrier.  ``csize`` / ``me``: the
    cluster's size and this CTA's rank; ``parts``: SelectSmem.parts(); ``cached``: keep a slice of
    at most ``cache_cap`` (<= CACHE_MAX) tokens on chip, else re-read it (mostly L2) in every pass;
    ``vpr``: 16-byte vectors per thread per round of passes 1 and 2; ``early``: traced right after
    the bulk copies are issued.

    ``own_part`` (with ``clustered``): each CTA writes only its positions [p0, p1) of the packed row
    into its own row buffer (bit 16 of l in its own mask words) and returns ``(p0, p1, p_end,
    writer)``: p_end the row's kept count, ``writer`` 1 in the one CTA (whose slice holds token
    2**16, else the last) that derives the mask words from its first set bit.  It ends after a
    relaxed arrival at the cluster barrier: the caller must ``P.cluster_wait()`` before exit.

    ``n2`` > n (the rescue list): also the top-min(n2, valid), a packed row of n2 at ``k_out`` in
    global memory (each CTA its positions; the writer the mask words and the empty words)."""
    own = bool(clustered and own_part)
    dual = cutlass.const_expr(n2 > 0)
    if cutlass.const_expr(dual):
        assert n2 > n and n2 % 32 == 0, (n, n2)
    cache, hist1, hist2, gsum2, published, scalars, warp_totals, row, mask, mbar = parts
    cache_a, h1_a, h2_a, g2_a, published_a, scalars_a, row_a, mbar_a = map(
        P.smem_addr, (cache, hist1, hist2, gsum2, published, scalars, row, mbar))
    # ---- this CTA's slice: s_len <= slice_tokens tokens from s0
    slice_tokens = slice_len(end, csize)
    keep = Int32(0)  # the slice stays in shared memory
    if cutlass.const_expr(cached):
        # (clamped: a kept slice's tokens are 16-bit list entries, whatever a caller passes)
        if slice_tokens <= cutlass.min(cache_cap, Int32(CACHE_MAX)):
            keep = Int32(1)
    aligned = Int32(0)
    if (row_addr & Int64(15)) == Int64(0):
        aligned = Int32(1)
    s0 = cutlass.min(me * slice_tokens, end)
    s_len = cutlass.min(slice_tokens, end - s0)
    nfull = s_len // Int32(8)  # full 16-byte vectors
    copies = (nfull + Int32(TB - 1)) // Int32(TB)
    bulk = Int32(0)
    if cutlass.const_expr(cached):
        if keep != Int32(0) and aligned != Int32(0) and nfull > Int32(0):
            bulk = Int32(1)
            start_bulk_copies(row_addr, s0, nfull, copies, cache_a, mbar_a, tid)
    if cutlass.const_expr(early is not None):
        early()  # the caller's work that waits on a load (after the copies are on their way)
    nvec = (s_len + Int32(7)) // Int32(8)
    zero_counters(hist1, hist2, gsum2, scalars, row, rw, dual, tid)
    # ---- pass 1, then the boundary bin over the cluster (first cluster barrier)
    xs = cute.make_rmem_tensor((4 * vpr,), Int32)
    pass1(row_addr, s0, s_len, nvec, nfull, aligned, keep, bulk, copies, cache_a, mbar_a, h1_a, xs, tid, cached, vpr)
    boundary_bin(hist1, h1_a, published, published_a, scalars, warp_totals, csize, tid, lane, warp, n, n2, clustered)
    total = scalars[_TOTAL]  # valid tokens of the whole row (uniform over the cluster)
    b1 = scalars[_B1]
    b1k = scalars[_K + _B1]  # (the rescue list)
    # ---- pass 2: the mask from the lower boundary bin, the second histograms of the boundary bins
    mthr, b1c, b1kc = pass2_thresholds(total, b1, b1k, n, n2)
    nvec4 = (nvec + Int32(3)) // Int32(4) * Int32(4)  # the mask's last word written whole
    mask_a = P.smem_addr(mask)
    listed = cutlass.const_expr(cached)
    big = Int32(0)  # a kept slice with a crowded boundary bin: see BIG_B1
    if cutlass.const_expr(listed):
        if keep != Int32(0) and total > Int32(n):
            if hist1[b1] > cutlass.max(Int32(BIG_B1), Int32(BIG_RATIO) * scalars[_OWN_ABOVE1]):
                big = Int32(1)
    if total > Int32(0):
        pass2(row_addr, s0, s_len, nvec, nvec4, aligned, keep, big, mthr, b1c, b1kc, cache_a, h2_a, mask_a, xs,
              tid, dual, vpr)  # fmt: skip
    # the mask in 16-token units, thread tid taking the contiguous units [u0, u1): all TB threads
    # share the slice, so each walk over the set bits stays short
    nu = nvec4 // Int32(2)
    upt = (nu + Int32(TB - 1)) // Int32(TB)
    u0 = cutlass.min(tid * upt, nu)
    u1 = cutlass.min(u0 + upt, nu)
    lw = (nvec4 + Int32(15)) // Int32(16) * Int32(4)  # the list's first word in mask
    sl = Slice(row_addr, s0, keep, cache_a)
    units = Units(mask_a, u0, u1, upt)
    cnt_ok = Int32(0)  # this thread's compaction counts come from its hist2 walk
    c2_above, c2_low = Int32(0), Uint64(0)
    if total > Int32(n):
        if tid == Int32(0):
            published[0] = scalars[_OWN_ABOVE1]
            if cutlass.const_expr(dual):
                published[2] = scalars[_K + _OWN_ABOVE1]
        if keep != Int32(0) and big == Int32(0):
            cute.arch.sync_threads()  # the mask bytes of the other threads
            cnt_ok, c2_above, c2_low = hist2_walk(sl, units, b1, b1kc, h2_a, dual)
    # ---- the boundary score v, need_eq and what precedes this slice (second cluster barrier)
    cluster_barrier(clustered, csize)
    v, need_eq = boundary_step(n, total, b1, hist2, gsum2, published, scalars, h2_a, g2_a, published_a,
                               scalars_a, tid, lane, warp, csize, me, clustered, 0, 0, 0)  # fmt: skip
    vk = Uint32(0)  # (the rescue list) n2's
    need_eqk = Int32(0)
    if cutlass.const_expr(dual):
        vk, need_eqk = boundary_step(n2, total, b1k, hist2, gsum2, published, scalars, h2_a, g2_a, published_a,
                                     scalars_a, tid, lane, warp, csize, me, clustered, NB2, 2, _K)  # fmt: skip
    if cutlass.const_expr(own):
        # every DSMEM load of this CTA was used above; a one-CTA cluster neither arrives nor waits
        if one_cta(csize) == Int32(0):
            P.cluster_arrive()
    # a crowded slice: the walks take even shares of a list of its tokens at or above the (lower)
    # boundary score, not the units (a few of which would hold all of them)
    use_list, r0, r1 = Int32(0), Int32(0), Int32(0)
    if cutlass.const_expr(listed):
        if big != Int32(0):
            vlo = v  # (the rescue list: n2's boundary, the lower one, keeps both counts' tokens)
            if cutlass.const_expr(dual):
                vlo = vk
            refine_mask(mask, cache_a, nvec4, vlo, tid)
            cute.arch.sync_threads()
            use_list, r0, r1 = make_list(mask_a, cache_a, lw, u0, u1, lane, warp, warp_totals, tid)
    share = ListShare(mask, lw, r0, r1, use_list)
    # ---- the compaction, in index order, straight to the final positions
    p0, p1, p0k, p1k = compact(sl, units, share, scalars, scalars_a, warp_totals, row, row_a, h1_a, k_out, v, need_eq,
                               vk, need_eqk, cnt_ok, c2_above, c2_low, csize, lane, warp, n, n2, clustered, own)
    if cutlass.const_expr(own):
        cute.arch.sync_threads()  # this CTA's part of the row is complete
    else:
        closing_barrier(clustered, csize)
    # the CTA whose slice holds token 2**16 (else the last): own_part's writer of the mask words
    writer = cutlass.min(Int32(1 << 16) // cutlass.max(slice_tokens, Int32(8)), csize - Int32(1))
    if cutlass.const_expr(klist_staged(n2)):
        for i in cutlass.range(tid, p1k - p0k, TB, unroll=1):
            P.st_u32(k_out + Int64(p0k + i) * Int64(4), hist1[i])
    if cutlass.const_expr(dual):
        # bit 16 is set at [p16, count): p16 = the writer's first position + its kept tokens below
        # 2**16 (positions ascend with l)
        if me == writer:
            write_klist_tail(k_out, p0k + scalars[_K + _TOTAL], cutlass.min(total, Int32(n2)), n2, tid)
    return p0, p1, cutlass.min(total, Int32(n)), Int32(me == writer)
