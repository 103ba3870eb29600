"""PTX helpers and the CTA-wide selections shared by both kernels (docs/DESIGN.md §4-§6).

No JAX import.  Every global access goes through an Int64 address and a short
inline-PTX helper, so the memory semantics (volatile LL halves, system-scope
release/acquire, 16-byte stores) are exactly what the PTX shows and what the
compile test checks.

One CTA of ``TB`` threads works on one row at a time.  Two selections:

* the local top-n of a bf16 row (producer and rescue) lives in ``select.py``;
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

from .. import layout

TB = 512  # threads per CTA; also the number of bins of the first histogram
NWARPS = TB // 32
DIGIT = 9  # bits per radix digit of the 64-bit key select (2**9 == TB bins)


# --------------------------------------------------------------------------
# Addresses in the local state (int32 words, layout.StateLayout) and its status
# words (layout.STATUS_*), built from layout.py's numbers.
# --------------------------------------------------------------------------


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
    """Address of klist[t] (layout.StateLayout.klist_off: the status words, then 16-byte
    aligned; rows of ``row_words`` words)."""
    w = Int64(max_rows) * Int64(layout.STATE_STATUS_ROWS) + Int64(layout.STATUS_WORDS)
    w = (w + Int64(3)) & Int64(-4)
    return state + (w + Int64(t) * Int64(row_words)) * Int64(4)


def state_status(state, max_rows):
    """Address of the status words (word layout.STATUS_CODE first)."""
    return state + Int64(max_rows) * Int64(4 * layout.STATE_STATUS_ROWS)


def status_word(status, i: int):
    """Address of status word ``i`` (layout.STATUS_ROW, ...)."""
    return status if i == 0 else status + Int64(4 * i)


def ll_row_offset(parity, src, row, world, max_rows, row_bytes):
    """layout.ll_row_offset on device integers (Int64)."""
    return layout.ll_row_offset(parity, src, row, world, max_rows, row_bytes, i64=Int64)


def rescue_row_offset(row, slot, slots, row_bytes):
    """layout.rescue_row_offset on device integers (Int64)."""
    return layout.rescue_row_offset(row, slot, slots, row_bytes, i64=Int64)


def flag_offset(src, row, max_rows):
    """layout.flag_offset on device integers (Int64)."""
    return layout.flag_offset(src, row, max_rows, i64=Int64)


def ll_word_addr(base, j):
    """Address of word ``j`` of the LL row at ``base`` (layout.ll_offset)."""
    return (base + Int64(j >> Int32(1)) * Int64(layout.LL_RECORD_BYTES)
            + Int64(j & Int32(1)) * Int64(layout.LL_HALF_BYTES))  # fmt: skip


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



def compile_options(arch: str, dump_dir: str, ptxas: str = "") -> str:
    """cute.compile options: the PTX and cubin are kept (the cache stores them) in
    ``dump_dir``, where the DSL writes them under the kernel's name and reads them back:
    one directory per compile, or builds running side by side can read each other's.
    ``ptxas``: extra ptxas options (one string)."""
    extra = f" --ptxas-options '{ptxas}'" if ptxas else ""
    return f"--gpu-arch {arch} --keep-ptx --keep-cubin --dump-dir={dump_dir}{extra}"


@dsl_user_op
def ld_u32(addr: Int64, *, loc=None, ip=None) -> Int32:
    """Plain 32-bit load (inputs written by earlier kernels)."""
    return Int32(_asm(T.i32(), [Int64(addr)], "ld.global.u32 $0, [$1];", "=r,l", loc, ip))


@dsl_user_op
def ld_u64(addr: Int64, *, loc=None, ip=None) -> Int64:
    return Int64(_asm(T.i64(), [Int64(addr)], "ld.global.u64 $0, [$1];", "=l,l", loc, ip))


@dsl_user_op
def ld_u16(addr: Int64, *, loc=None, ip=None) -> Uint32:
    """One bf16's bits (logits are read-only while the kernel runs)."""
    return Uint32(
        _asm(T.i32(), [Int64(addr)], "ld.global.nc.u16 $0, [$1];", "=r,l", loc, ip)
    )


@dsl_user_op
def ld_u32_if(addr: Int64, pred: Int32, *, loc=None, ip=None) -> Int32:
    """ld_u32 where ``pred`` != 0, else 0, by a predicated load: the same load under an
    ``if`` lets LLVM fold the value's users into the branch (a multiply right after the
    load), so each such load waited for the one before (kernels/NOTES.md, 7th session).
    The zero is written first: the output is early-clobber (``=&``), never the address's
    register."""
    return Int32(_asm(T.i32(), [Int64(addr), Int32(pred)],
                      "{ .reg .pred p; setp.ne.s32 p, $2, 0; mov.u32 $0, 0; @p ld.global.u32 $0, [$1]; }",
                      "=&r,l,r", loc, ip))  # fmt: skip


@dsl_user_op
def ld_volatile_u64_if(addr: Int64, pred: Int32, *, loc=None, ip=None) -> Uint64:
    """ld_volatile_u64 where ``pred`` != 0, else 0 (predicated, see ld_u32_if)."""
    return Uint64(_asm(T.i64(), [Int64(addr), Int32(pred)],
                       "{ .reg .pred p; setp.ne.s32 p, $2, 0; mov.u64 $0, 0; "
                       "@p ld.volatile.global.u64 $0, [$1]; }",
                       "=&l,l,r", loc, ip))  # fmt: skip


@dsl_user_op
def ld_volatile_u32_if(addr: Int64, pred: Int32, *, loc=None, ip=None) -> Uint32:
    """ld_volatile_u32 where ``pred`` != 0, else 0 (predicated, see ld_u32_if)."""
    return Uint32(_asm(T.i32(), [Int64(addr), Int32(pred)],
                       "{ .reg .pred p; setp.ne.s32 p, $2, 0; mov.u32 $0, 0; "
                       "@p ld.volatile.global.u32 $0, [$1]; }",
                       "=&r,l,r", loc, ip))  # fmt: skip


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
def st_u32_if(addr: Int64, v: Int32, pred: Int32, *, loc=None, ip=None) -> None:
    """st_u32 when ``pred`` != 0, by a predicated store: an ``if`` around a store compiles
    to a branch and a convergence barrier per store (kernels/NOTES.md, merge outputs)."""
    _asm(None, [Int64(addr), Int32(v), Int32(pred)],
         "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p st.global.u32 [$0], $1; }", "l,r,r,~{memory}",
         loc, ip)  # fmt: skip


@dsl_user_op
def st_volatile_u32(addr: Int64, v: Int32, *, loc=None, ip=None) -> None:
    _asm(None, [Int64(addr), Int32(v)], "st.volatile.global.u32 [$0], $1;",
         "l,r,~{memory}", loc, ip)  # fmt: skip


@dsl_user_op
def st_ll_v4(addr: Int64, w0: Int32, e: Int32, w1: Int32, *, loc=None, ip=None) -> None:
    """NCCL-LL store (w0, e, w1, e): one 16-byte volatile store of two 64-bit elements,
    so each 8-byte half (word, epoch) is one single-copy-atomic access in the PTX memory
    model, like the merge's 8-byte reads of a half (a v4.u32 store is four 32-bit
    elements there, even though the hardware writes the 16 bytes at once)."""
    _asm(None, [Int64(addr), Int32(w0), Int32(e), Int32(w1)],
         "{ .reg .b64 h0, h1; mov.b64 h0, {$1, $2}; mov.b64 h1, {$3, $2}; "
         "st.volatile.global.v2.u64 [$0], {h0, h1}; }",
         "l,r,r,r,~{memory}", loc, ip)  # fmt: skip


@dsl_user_op
def st_ll_v4_if(addr: Int64, w0: Int32, e: Int32, w1: Int32, pred: Int32, *, loc=None, ip=None) -> None:
    """st_ll_v4 when ``pred`` != 0 (a predicated store, no branch)."""
    _asm(None, [Int64(addr), Int32(w0), Int32(e), Int32(w1), Int32(pred)],
         "{ .reg .pred p; .reg .b64 h0, h1; setp.ne.s32 p, $4, 0; mov.b64 h0, {$1, $2}; "
         "mov.b64 h1, {$3, $2}; @p st.volatile.global.v2.u64 [$0], {h0, h1}; }",
         "l,r,r,r,r,~{memory}", loc, ip)  # fmt: skip


@dsl_user_op
def st_ll_half_if(addr: Int64, w: Int32, e: Int32, pred: Int32, *, loc=None, ip=None) -> None:
    """One 8-byte half (w, e) of an NCCL-LL record when ``pred`` != 0 (an edge word of a
    CTA's part of a row): ONE 64-bit store, single-copy atomic like the merge's 8-byte
    reads of a half (a v2.u32 store is two 32-bit accesses in the memory model)."""
    _asm(None, [Int64(addr), Int32(w), Int32(e), Int32(pred)],
         "{ .reg .pred p; .reg .b64 h; setp.ne.s32 p, $3, 0; mov.b64 h, {$1, $2}; "
         "@p st.volatile.global.u64 [$0], h; }",
         "l,r,r,r,~{memory}", loc, ip)  # fmt: skip


@dsl_user_op
def st_v4(addr: Int64, a: Int32, b: Int32, c: Int32, d: Int32, *, loc=None, ip=None) -> None:
    """Plain 16-byte store (rescue rows: published by a release flag)."""
    _asm(None, [Int64(addr), Int32(a), Int32(b), Int32(c), Int32(d)],
         "st.global.v4.u32 [$0], {$1, $2, $3, $4};",
         "l,r,r,r,r,~{memory}", loc, ip)  # fmt: skip


@dsl_user_op
def ld_cg_v4(addr: Int64, *, loc=None, ip=None):
    """16-byte load cached in the L2 only (data another grid wrote: not through the L1)."""
    st = llvm.StructType.get_literal([T.i32(), T.i32(), T.i32(), T.i32()])
    r = _asm(st, [Int64(addr)], "ld.global.cg.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l",
             loc, ip)  # fmt: skip
    return tuple(Int32(llvm.extractvalue(T.i32(), r, [k], loc=loc, ip=ip)) for k in range(4))


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
def clock32(*, loc=None, ip=None) -> Int32:
    """The SM's cycle counter (low 32 bits): phase marks of timing-only builds."""
    return Int32(_asm(T.i32(), [], "mov.u32 $0, %clock;", "=r", loc, ip))


@dsl_user_op
def globaltimer_lo(*, loc=None, ip=None) -> Int32:
    return Int32(_asm(T.i32(), [], "mov.u32 $0, %globaltimer_lo;", "=r", loc, ip))


class Marks:
    """Timing only (``prof=1`` builds, outputs partly overwritten): SM clock samples at
    numbered points of a kernel, kept in registers and stored once at its end by
    ``store``.  Off (the default build), every call is nothing at trace time."""

    N = 16

    def __init__(self, on: bool, n: int = N):
        self.on = bool(on)
        self.N = int(n)  # (a multiple of 4: stored as 16-byte vectors)
        self.t = cute.make_rmem_tensor((self.N,), Int32) if self.on else None
        if self.on:
            for i in range(self.N):
                self.t[i] = Int32(0)

    def __call__(self, i: int):
        if self.on:
            self.t[i] = clock32()

    def gtime(self, i: int):
        """The global nanosecond timer's low word (comparable across SMs)."""
        if self.on:
            self.t[i] = globaltimer_lo()

    def store(self, addr, pred):
        """The N samples as int32 at ``addr`` (16-byte aligned) where ``pred`` != 0 (predicated
        stores: the DSL cannot carry this object through a run-time ``if``)."""
        if self.on:
            for i in range(0, self.N, 4):
                _asm(None, [Int64(addr + Int64(4 * i)), self.t[i], self.t[i + 1], self.t[i + 2],
                            self.t[i + 3], Int32(pred)],
                     "{ .reg .pred p; setp.ne.s32 p, $5, 0; @p st.global.v4.u32 [$0], {$1, $2, $3, $4}; }",
                     "l,r,r,r,r,r,~{memory}")  # fmt: skip


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
    """docs/DESIGN.md §5: order-preserving map of non-NaN bf16 bits to 1..0xFFFF; 0 for
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
def warp_incl_scan(x: Int32, lane) -> Int32:
    """Inclusive sum over the warp in lane order (5 shuffles)."""
    for d in cutlass.range_constexpr(5):
        y = cute.arch.shuffle_sync_up(x, 1 << d)
        if lane >= Int32(1 << d):
            x = x + y
    return x


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
