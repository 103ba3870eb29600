"""PTX helpers and the CTA-wide selections shared by both kernels (SPEC §4-§6).

No JAX import.  Every global access goes through an Int64 address and a short
inline-PTX helper, so the memory semantics (volatile LL halves, system-scope
release/acquire, 16-byte stores) are exactly what the PTX shows and what the
compile test checks.

One CTA of ``TB`` threads works on one row at a time.  Two selections:

* :func:`local_select`: this rank's top-``n`` of a bf16 row by SPEC §4, as a
  packed row (SPEC §5) in ascending local index, built in shared memory.  Two
  histogram passes on ``ord16`` (9 high bits, then 7 low bits) find the
  boundary score ``v`` and how many scores lie strictly above it; one
  compaction pass in index order then keeps every score ``> v`` and the first
  ``n - above`` scores ``== v`` (ties go to the lower index), with ONE packed
  block scan per chunk giving every kept token its position.
* :func:`radix_select_keys`: the K-th largest of distinct 64-bit keys, exact,
  digit by digit from the top (9-bit digits, shared histogram, block scan to
  find the bin that holds the K-th key).  Keys come from a caller-supplied
  source: registers when they fit, else re-read from memory every pass (they
  are stable for the whole call).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32, Uint64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

TB = 512  # threads per CTA; also the number of bins of the first histogram
NWARPS = TB // 32
DIGIT = 9  # bits per radix digit of the 64-bit key select (2**9 == TB bins)


# --------------------------------------------------------------------------
# Inline PTX.  Addresses are generic 64-bit; ``.global`` is valid for every
# buffer we touch (cudaMalloc memory, own or a peer's mapped over NVLink).
# --------------------------------------------------------------------------


def _asm(res, args, text, cons, loc=None, ip=None):
    return llvm.inline_asm(
        res, [a.ir_value(loc=loc, ip=ip) for a in args], text, cons,
        has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def ld_u32(addr: Int64, *, loc=None, ip=None) -> Int32:
    """Plain 32-bit load (inputs written by earlier kernels)."""
    return Int32(_asm(T.i32(), [Int64(addr)], "ld.global.u32 $0, [$1];", "=r,l", loc, ip))


@dsl_user_op
def ld_u64(addr: Int64, *, loc=None, ip=None) -> Int64:
    return Int64(_asm(T.i64(), [Int64(addr)], "ld.global.u64 $0, [$1];", "=l,l", loc, ip))


@dsl_user_op
def ld_nc_u64(addr: Int64, *, loc=None, ip=None) -> Uint64:
    """Four bf16 at once (8-byte aligned; read-only while the kernel runs)."""
    return Uint64(
        _asm(T.i64(), [Int64(addr)], "ld.global.nc.u64 $0, [$1];", "=l,l", loc, ip)
    )


@dsl_user_op
def ld_u16(addr: Int64, *, loc=None, ip=None) -> Uint32:
    """One bf16's bits (logits are read-only while the kernel runs)."""
    return Uint32(
        _asm(T.i32(), [Int64(addr)], "ld.global.nc.u16 $0, [$1];", "=r,l", loc, ip)
    )


@dsl_user_op
def ld_volatile_u64(addr: Int64, *, loc=None, ip=None) -> Uint64:
    """One LL half (word | epoch << 32) in ONE 8-byte load: the only
    atomicity the protocol relies on.  Volatile: never served from L1."""
    return Uint64(
        _asm(T.i64(), [Int64(addr)], "ld.volatile.global.u64 $0, [$1];", "=l,l", loc, ip)
    )


@dsl_user_op
def ld_volatile_u32(addr: Int64, *, loc=None, ip=None) -> Uint32:
    return Uint32(
        _asm(T.i32(), [Int64(addr)], "ld.volatile.global.u32 $0, [$1];", "=r,l", loc, ip)
    )


@dsl_user_op
def ld_acquire_sys(addr: Int64, *, loc=None, ip=None) -> Int32:
    return Int32(
        _asm(T.i32(), [Int64(addr)], "ld.acquire.sys.global.u32 $0, [$1];", "=r,l", loc, ip)
    )


@dsl_user_op
def st_u32(addr: Int64, v: Int32, *, loc=None, ip=None) -> None:
    _asm(None, [Int64(addr), Int32(v)], "st.global.u32 [$0], $1;", "l,r,~{memory}", loc, ip)


@dsl_user_op
def st_volatile_u32(addr: Int64, v: Int32, *, loc=None, ip=None) -> None:
    _asm(None, [Int64(addr), Int32(v)], "st.volatile.global.u32 [$0], $1;",
         "l,r,~{memory}", loc, ip)  # fmt: skip


@dsl_user_op
def st_release_sys(addr: Int64, v: Int32, *, loc=None, ip=None) -> None:
    _asm(None, [Int64(addr), Int32(v)], "st.release.sys.global.u32 [$0], $1;",
         "l,r,~{memory}", loc, ip)  # fmt: skip


@dsl_user_op
def st_ll_v4(addr: Int64, w0: Int32, e: Int32, w1: Int32, *, loc=None, ip=None) -> None:
    """NCCL-LL store (w0, e, w1, e): one 16-byte volatile store, so each
    8-byte half (word, epoch) lands at once and bypasses L1 on the peer."""
    _asm(None, [Int64(addr), Int32(w0), Int32(e), Int32(w1)],
         "st.volatile.global.v4.u32 [$0], {$1, $2, $3, $2};",
         "l,r,r,r,~{memory}", loc, ip)  # fmt: skip


@dsl_user_op
def st_v4(addr: Int64, a: Int32, b: Int32, c: Int32, d: Int32, *, loc=None, ip=None) -> None:
    """Plain 16-byte store (rescue rows: published by a release flag)."""
    _asm(None, [Int64(addr), Int32(a), Int32(b), Int32(c), Int32(d)],
         "st.global.v4.u32 [$0], {$1, $2, $3, $4};",
         "l,r,r,r,r,~{memory}", loc, ip)  # fmt: skip


@dsl_user_op
def atom_cas_u32(addr: Int64, cmp: Int32, v: Int32, *, loc=None, ip=None) -> Int32:
    return Int32(
        _asm(T.i32(), [Int64(addr), Int32(cmp), Int32(v)],
             "atom.relaxed.gpu.global.cas.b32 $0, [$1], $2, $3;",
             "=r,l,r,r,~{memory}", loc, ip)
    )  # fmt: skip


@dsl_user_op
def globaltimer(*, loc=None, ip=None) -> Int64:
    return Int64(_asm(T.i64(), [], "mov.u64 $0, %globaltimer;", "=l", loc, ip))


@dsl_user_op
def fence_sys(*, loc=None, ip=None) -> None:
    _asm(None, [], "fence.acq_rel.sys;", "~{memory}", loc, ip)


@dsl_user_op
def pdl_wait(*, loc=None, ip=None) -> None:
    """griddepcontrol.wait: no-op unless launched with programmatic
    dependent launch; then waits until the previous grid completed."""
    _asm(None, [], "griddepcontrol.wait;", "~{memory}", loc, ip)


@dsl_user_op
def pdl_launch_dependents(*, loc=None, ip=None) -> None:
    _asm(None, [], "griddepcontrol.launch_dependents;", "~{memory}", loc, ip)


# --------------------------------------------------------------------------
# Small device functions.
# --------------------------------------------------------------------------


@cute.jit
def hist_inc(hist: cute.Tensor, b: Int32, valid):
    """hist[b] += 1 for the lanes with ``valid``.  Plain shared atomics: a
    warp-aggregated variant (match.any.sync per element) measured 37% slower
    on the producer on an H200 (bench_kernels, normal scores)."""  # fmt: skip
    if valid:
        cute.arch.atomic_add(hist.iterator + b, Int32(1), sem="relaxed", scope="cta")


@cute.jit
def ord16(bits: Uint32) -> Uint32:
    """SPEC §5: order-preserving map of non-NaN bf16 bits to 1..0xFFFF; 0 for
    NaN (never a candidate)."""
    o = Uint32(0)
    if (bits & Uint32(0x7FFF)) <= Uint32(0x7F80):
        b = bits
        if b == Uint32(0x8000):
            b = Uint32(0)  # -0 == +0
        if (b & Uint32(0x8000)) == Uint32(0):
            o = b | Uint32(0x8000)
        else:
            o = (~b) & Uint32(0xFFFF)
    return o


@cute.jit
def block_scan(val: Int32, lane: Int32, warp: Int32, warp_totals: cute.Tensor):
    """Inclusive sum over the CTA in thread order -> (inclusive, total).
    Two barriers; ``warp_totals`` (NWARPS Int32 in smem) is free again when it
    returns."""
    x = val
    for d in cutlass.range_constexpr(5):
        y = cute.arch.shuffle_sync_up(x, 1 << d)
        if lane >= Int32(1 << d):
            x = x + y
    if lane == Int32(31):
        warp_totals[warp] = x
    cute.arch.sync_threads()
    before = Int32(0)
    total = Int32(0)
    for w in cutlass.range_constexpr(NWARPS):
        t = warp_totals[w]
        if Int32(w) < warp:
            before = before + t
        total = total + t
    cute.arch.sync_threads()
    return x + before, total


@cute.jit
def find_bin(hist: cute.Tensor, nbins, need: Int32, tid, lane, warp, warp_totals,
             scalars: cute.Tensor, slot: cutlass.Constexpr):
    """Bins scanned from the top (bin nbins-1 first): the bin holding the
    need-th element.  scalars[slot] = bin, [slot+1] = elements above it,
    [slot+2] = its count; returns the total over all bins (uniform).
    ``nbins`` <= TB may be dynamic."""  # fmt: skip
    cnt = Int32(0)
    if tid < nbins:
        cnt = hist[nbins - Int32(1) - tid]
    incl, total = block_scan(cnt, lane, warp, warp_totals)
    if cnt > Int32(0) and incl >= need and incl - cnt < need:
        scalars[slot] = nbins - Int32(1) - tid
        scalars[slot + 1] = incl - cnt
        scalars[slot + 2] = cnt
    cute.arch.sync_threads()
    return total


# --------------------------------------------------------------------------
# Local top-n of one bf16 row -> packed row in shared memory.
# --------------------------------------------------------------------------


# Static tuning of the local select (SelectPush / Merge pass them on).
VEC = 8  # tokens per load unit: 8 -> one 16-byte load, 4 -> one 8-byte load
U12 = 4  # load units per thread in flight in the histogram passes
U3 = 4  # consecutive load units per thread per chunk of the compaction pass
B1 = 9  # bits of ord16 histogrammed by the first pass (then 16 - B1)


def hist_bins(b1: int = B1) -> int:
    """Histogram entries the CTA needs (>= TB: the merge's radix uses TB)."""
    return max(TB, 1 << b1)


@dsl_user_op
def ld_nc_v2_u64(addr: Int64, *, loc=None, ip=None):
    """Eight bf16 in one 16-byte load (16-byte aligned; read-only input)."""
    st = llvm.StructType.get_literal([T.i64(), T.i64()])
    r = _asm(st, [Int64(addr)], "ld.global.nc.v2.u64 {$0, $1}, [$2];", "=l,=l,l", loc, ip)
    return (Uint64(llvm.extractvalue(T.i64(), r, [0], loc=loc, ip=ip)),
            Uint64(llvm.extractvalue(T.i64(), r, [1], loc=loc, ip=ip)))  # fmt: skip


@cute.jit
def pack4(x: Uint64) -> Uint64:
    """Four bf16 bit patterns -> their ord16 (0 for NaN), 16 bits each."""
    r = Uint64(0)
    for k in cutlass.range_constexpr(4):
        o = ord16(Uint32((x >> Uint64(16 * k)) & Uint64(0xFFFF)))
        r = r | (Uint64(o) << Uint64(16 * k))
    return r


@cute.jit
def load_unit(row_addr: Int64, ui: Int32, end: Int32, aligned: Int32, xs: cute.Tensor,
              off: cutlass.Constexpr, vec: cutlass.Constexpr):
    """ord16 of tokens vec*ui .. vec*ui+vec-1 into xs[off : off + vec/4]
    (4 per Uint64; 0 = NaN or past end).  One vector load when the row is
    aligned to the unit and the unit is whole, else 2-byte loads."""  # fmt: skip
    l0 = ui * Int32(vec)
    for k in cutlass.range_constexpr(vec // 4):
        xs[off + k] = Uint64(0)
    if aligned != Int32(0) and l0 + Int32(vec) <= end:
        if cutlass.const_expr(vec == 8):
            a, b = ld_nc_v2_u64(row_addr + Int64(l0) * Int64(2))
            xs[off] = pack4(a)
            xs[off + 1] = pack4(b)
        else:
            xs[off] = pack4(ld_nc_u64(row_addr + Int64(l0) * Int64(2)))
    else:
        for k in cutlass.range_constexpr(vec):
            if l0 + Int32(k) < end:
                o = ord16(ld_u16(row_addr + Int64(l0 + Int32(k)) * Int64(2)))
                xs[off + k // 4] = xs[off + k // 4] | (Uint64(o) << Uint64(16 * (k % 4)))


@cute.jit
def hist_pass(row_addr: Int64, end: Int32, aligned: Int32, hist: cute.Tensor, tid, b1: Int32,
              second: cutlass.Constexpr, vec: cutlass.Constexpr, u12: cutlass.Constexpr,
              bits1: cutlass.Constexpr):
    """Histogram of the valid tokens: the bits1 high bits of ord16 (first
    pass), or the low 16 - bits1 bits of those whose high bits are b1 (second
    pass).  Strided units (coalesced), u12 vector loads in flight per thread
    (bytes in flight, not instructions, bound a single CTA's read rate)."""  # fmt: skip
    nu = (end + Int32(vec - 1)) // Int32(vec)
    w = vec // 4
    xs = cute.make_rmem_tensor((u12 * w,), Uint64)
    for base in cutlass.range(0, nu, TB * u12, unroll=1):
        for u in cutlass.range_constexpr(u12):
            ui = base + Int32(u * TB) + tid
            if ui < nu:
                load_unit(row_addr, ui, end, aligned, xs, u * w, vec)
            else:
                for k in cutlass.range_constexpr(w):
                    xs[u * w + k] = Uint64(0)
        for i in cutlass.range_constexpr(u12 * w):
            x = xs[i]
            for k in cutlass.range_constexpr(4):
                o = Uint32((x >> Uint64(16 * k)) & Uint64(0xFFFF))
                if cutlass.const_expr(second):
                    hist_inc(hist, Int32(o & Uint32((1 << (16 - bits1)) - 1)),
                             o != Uint32(0) and Int32(o >> Uint32(16 - bits1)) == b1)
                else:
                    hist_inc(hist, Int32(o >> Uint32(16 - bits1)), o != Uint32(0))


@cute.jit
def find_bin_p(hist: cute.Tensor, nbins: cutlass.Constexpr, need: Int32, tid, lane, warp,
               warp_totals, scalars: cute.Tensor, slot: cutlass.Constexpr):
    """find_bin for nbins = P * TB bins: thread t owns the P bins ranked
    t*P .. t*P+P-1 from the top; one block scan of its sums, then the owner
    of the need-th element walks its P bins."""  # fmt: skip
    P = nbins // TB
    s = Int32(0)
    for p in cutlass.range_constexpr(P):
        s = s + hist[Int32(nbins - 1 - p) - tid * Int32(P)]
    incl, total = block_scan(s, lane, warp, warp_totals)
    run = incl - s
    if run < need and incl >= need:
        for p in cutlass.range_constexpr(P):
            b = Int32(nbins - 1 - p) - tid * Int32(P)
            c = hist[b]
            if c > Int32(0) and run < need and run + c >= need:
                scalars[slot] = b
                scalars[slot + 1] = run
                scalars[slot + 2] = c
            run = run + c
    cute.arch.sync_threads()
    return total


@cute.jit
def local_select(row_addr: Int64, end: Int32, n: cutlass.Constexpr, rw: cutlass.Constexpr,
                 buf: cute.Tensor, hist: cute.Tensor, warp_totals: cute.Tensor,
                 scalars: cute.Tensor, tid, lane, warp, vec: cutlass.Constexpr = VEC,
                 u12: cutlass.Constexpr = U12, u3: cutlass.Constexpr = U3,
                 bits1: cutlass.Constexpr = B1):
    """Top-min(n, valid) of the ``end`` first bf16 of ``row_addr`` (SPEC §4 on
    one rank) -> ``buf[0:rw]`` packed (SPEC §5), ascending local index, empty
    words last, mask words after the n words, zero padding.  ``hist`` needs
    hist_bins(bits1) entries.  Ends with a barrier: ``buf`` is complete for
    every thread."""  # fmt: skip
    nb1 = 1 << bits1
    nb2 = 1 << (16 - bits1)
    aligned = Int32(0)
    if (row_addr & Int64(2 * vec - 1)) == Int64(0):
        aligned = Int32(1)
    for i in cutlass.range(tid, rw, TB, unroll=1):
        buf[i] = Int32(0)
    for i in cutlass.range_constexpr(hist_bins(bits1) // TB):
        hist[tid + Int32(i * TB)] = Int32(0)
    cute.arch.sync_threads()
    # Pass 1: histogram of the high bits of ord16 over the valid tokens.
    hist_pass(row_addr, end, aligned, hist, tid, Int32(0), False, vec, u12, bits1)
    cute.arch.sync_threads()
    total = Int32(0)
    if cutlass.const_expr(nb1 > TB):
        total = find_bin_p(hist, nb1, Int32(n), tid, lane, warp, warp_totals, scalars, 0)
    else:
        total = find_bin(hist, Int32(nb1), Int32(n), tid, lane, warp, warp_totals, scalars, 0)
    # Fewer than n valid tokens: keep them all (v = 0: every ord16 > 0).
    v = Uint32(0)
    c_gt = total
    if total > Int32(n):
        b1 = scalars[0]
        above = scalars[1]
        for i in cutlass.range_constexpr(hist_bins(bits1) // TB):
            hist[tid + Int32(i * TB)] = Int32(0)  # read before find_bin's barriers
        cute.arch.sync_threads()
        # Pass 2: the low bits inside bin b1.
        hist_pass(row_addr, end, aligned, hist, tid, b1, True, vec, u12, bits1)
        cute.arch.sync_threads()
        find_bin(hist, Int32(nb2), Int32(n) - above, tid, lane, warp, warp_totals, scalars, 3)
        v = (Uint32(b1) << Uint32(16 - bits1)) | Uint32(scalars[3])
        c_gt = above + scalars[4]
    need_eq = Int32(0)
    if total > Int32(n):
        need_eq = Int32(n) - c_gt
    # Pass 3: compaction in index order.  Before token l, (#gt) + min(#eq,
    # need_eq) tokens are kept: that is its position in the ascending list.
    # Thread tid owns u3 consecutive load units of each chunk; ONE block scan of
    # its packed (gt << 16 | eq) counts per chunk gives its offsets.
    nu = (end + Int32(vec - 1)) // Int32(vec)
    w = vec // 4
    xs = cute.make_rmem_tensor((u3 * w,), Uint64)
    gt_run = Int32(0)
    eq_run = Int32(0)
    base = Int32(0)
    while base < nu and (gt_run < c_gt or eq_run < need_eq):
        u0 = base + tid * Int32(u3)
        cnt = Int32(0)
        for u in cutlass.range_constexpr(u3):
            if u0 + Int32(u) < nu:
                load_unit(row_addr, u0 + Int32(u), end, aligned, xs, u * w, vec)
            else:
                for k in cutlass.range_constexpr(w):
                    xs[u * w + k] = Uint64(0)
        for i in cutlass.range_constexpr(u3 * w):
            for k in cutlass.range_constexpr(4):
                o = Uint32((xs[i] >> Uint64(16 * k)) & Uint64(0xFFFF))
                if o > v:
                    cnt = cnt + Int32(1 << 16)
                if o == v and v != Uint32(0):
                    cnt = cnt + Int32(1)
        incl, tot = block_scan(cnt, lane, warp, warp_totals)
        excl = incl - cnt
        gt_b = gt_run + (excl >> Int32(16))
        eq_b = eq_run + (excl & Int32(0xFFFF))
        if cnt != Int32(0):
            for i in cutlass.range_constexpr(u3 * w):
                for k in cutlass.range_constexpr(4):
                    o = Uint32((xs[i] >> Uint64(16 * k)) & Uint64(0xFFFF))
                    pos = Int32(-1)
                    if o > v:
                        pos = gt_b + cutlass.min(eq_b, need_eq)
                        gt_b = gt_b + Int32(1)
                    if o == v and v != Uint32(0):
                        if eq_b < need_eq:
                            pos = gt_b + eq_b
                        eq_b = eq_b + Int32(1)
                    if pos >= Int32(0):
                        lu = Uint32(u0 * Int32(vec) + Int32(i * 4 + k))
                        buf[pos] = Int32((o << Uint32(16)) | (Uint32(0xFFFF) - (lu & Uint32(0xFFFF))))
                        if (lu >> Uint32(16)) != Uint32(0):
                            cute.arch.atomic_or(buf.iterator + (Int32(n) + (pos >> Int32(5))),
                                                Int32(1) << (pos & Int32(31)),
                                                sem="relaxed", scope="cta")  # fmt: skip
        gt_run = gt_run + (tot >> Int32(16))
        eq_run = eq_run + (tot & Int32(0xFFFF))
        base = base + Int32(TB * u3)
    cute.arch.sync_threads()
