"""Addresses in the symmetric buffer and the local state, and the CTA-wide pieces both kernels
share (docs/DESIGN.md §4-§6): the merge's select of the K-th largest 64-bit key, ``DIGIT`` bits
at a time from the top, takes its histogram, block scan and bin search from here.  No JAX import.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32

from .. import layout

TB = 512  # threads per CTA; also the number of bins of the first histogram
NWARPS = TB // 32
DIGIT = 9  # bits per radix digit of the 64-bit key select (2**9 == TB bins)


# ---- addresses in the local state (int32 words, layout.StateLayout) and its status words
def _region(max_rows, rows: int):
    """Int64 word offset rows * max_rows of a state region (rows from layout.py)."""
    return Int64(max_rows) if rows == 1 else Int64(max_rows) * Int64(rows)


def state_epoch(state, max_rows, t):
    """Address of epoch[t]."""
    if layout.STATE_EPOCH_ROWS == 0:
        return state + Int64(t) * Int64(4)
    return state + (_region(max_rows, layout.STATE_EPOCH_ROWS) + Int64(t)) * Int64(4)


def state_seq(state, max_rows, t):
    """Address of seq[t] (the rescue sequence of row t)."""
    return state + (_region(max_rows, layout.STATE_SEQ_ROWS) + Int64(t)) * Int64(4)


def state_klist(state, max_rows, t, row_words: int):
    """Address of klist[t] (layout.StateLayout.klist_off; rows of ``row_words`` words)."""
    w = Int64(max_rows) * Int64(layout.STATE_STATUS_ROWS) + Int64(layout.STATUS_WORDS)
    w = (w + Int64(3)) & Int64(-4)
    return state + (w + Int64(t) * Int64(row_words)) * Int64(4)


def state_status(state, max_rows):
    """Address of the status words (word layout.STATUS_CODE first)."""
    return state + Int64(max_rows) * Int64(4 * layout.STATE_STATUS_ROWS)


def status_word(status, i: int):
    """Address of status word ``i`` (layout.STATUS_ROW, ...)."""
    return status if i == 0 else status + Int64(4 * i)


# layout's offsets on device integers (Int64)
def ll_row_offset(parity, src, row, world, max_rows, row_bytes):
    return layout.ll_row_offset(parity, src, row, world, max_rows, row_bytes, i64=Int64)


def rescue_row_offset(row, slot, slots, row_bytes):
    return layout.rescue_row_offset(row, slot, slots, row_bytes, i64=Int64)


def flag_offset(src, row, max_rows):
    return layout.flag_offset(src, row, max_rows, i64=Int64)


def ll_word_addr(base, j):
    """Address of word ``j`` of the LL row at ``base`` (layout.ll_offset)."""
    return (base + Int64(j >> Int32(1)) * Int64(layout.LL_RECORD_BYTES)
            + Int64(j & Int32(1)) * Int64(layout.LL_HALF_BYTES))  # fmt: skip


def compile_options(arch: str, dump_dir: str, ptxas: str = "") -> str:
    """cute.compile options: the PTX and cubin kept in ``dump_dir`` (one per compile: the DSL reads
    them back by the kernel's name), ``ptxas`` extra ptxas options."""
    extra = f" --ptxas-options '{ptxas}'" if ptxas else ""
    return f"--gpu-arch {arch} --keep-ptx --keep-cubin --dump-dir={dump_dir}{extra}"


# ---- small device functions
@cute.jit
def hist_inc(hist: cute.Tensor, b: Int32, valid):
    """hist[b] += 1 for the lanes with ``valid``, by plain shared atomics (warp-aggregated ones,
    match.any.sync per element, measured 37% slower on an H200)."""
    if valid:
        cute.arch.atomic_add(hist.iterator + b, Int32(1), sem="relaxed", scope="cta")


@cute.jit
def ord16(bits: Uint32) -> Uint32:
    """docs/DESIGN.md §5: the order-preserving map of bf16 bits to 1..0xFFFF, 0 for NaN."""
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
def warp_incl_scan(x: Int32, lane) -> Int32:
    """Inclusive sum over the warp in lane order (5 shuffles)."""
    for d in cutlass.range_constexpr(5):
        y = cute.arch.shuffle_sync_up(x, 1 << d)
        if lane >= Int32(1 << d):
            x = x + y
    return x


@cute.jit
def block_scan(val: Int32, lane: Int32, warp: Int32, warp_totals: cute.Tensor):
    """Inclusive sum over the CTA in thread order -> (inclusive, total); ``warp_totals`` (NWARPS
    words of shared memory) is free again when it returns."""
    x = warp_incl_scan(val, lane)
    if lane == Int32(31):
        warp_totals[warp] = x
    cute.arch.sync_threads()
    before, total = Int32(0), Int32(0)
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
    """The bin holding the need-th element from the top (nbins <= TB, may be dynamic): scalars[slot]
    = bin, [slot+1] = elements above it, [slot+2] = its count -> the total over all bins."""
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
