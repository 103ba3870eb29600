"""Inline-PTX primitives of the kernels (no JAX import).

Every global access goes through an Int64 address and one of these short wrappers, so the
memory semantics (volatile LL halves, system-scope release / acquire, 16-byte stores, cluster
barriers, bulk copies) are exactly what the PTX shows and what the compile tests check.
Addresses are generic 64-bit; ``.global`` is valid for every buffer the kernels touch
(cudaMalloc memory, own or a peer's mapped over NVLink).  Shared-memory addresses are 32-bit
shared-window offsets.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32, Uint64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


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
def ld_u16(addr: Int64, *, loc=None, ip=None) -> Uint32:
    """One bf16's bits (logits are read-only while the kernel runs)."""
    return Uint32(
        _asm(T.i32(), [Int64(addr)], "ld.global.nc.u16 $0, [$1];", "=r,l", loc, ip)
    )


@dsl_user_op
def ld_u32_if(addr: Int64, pred: Int32, *, loc=None, ip=None) -> Int32:
    """ld_u32 where ``pred`` != 0, else 0, by a predicated load: the same load under an
    ``if`` lets LLVM fold the value's users into the branch (a multiply right after the
    load), so each such load waited for the one before.
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
    to a branch and a convergence barrier per store (docs/kernels.md, the merge's outputs)."""
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


@dsl_user_op
def mapa(addr: Int32, rank: Int32, *, loc=None, ip=None) -> Int32:
    """The same shared-memory offset in CTA ``rank`` of the cluster."""
    return Int32(_asm(T.i32(), [Int32(addr), Int32(rank)], "mapa.shared::cluster.u32 $0, $1, $2;",
                      "=r,r,r", loc, ip))  # fmt: skip


@dsl_user_op
def ld_dsmem_u32(addr: Int32, *, loc=None, ip=None) -> Int32:
    return Int32(_asm(T.i32(), [Int32(addr)], "ld.shared::cluster.u32 $0, [$1];", "=r,r", loc, ip))


@dsl_user_op
def ld_dsmem_v4(addr: Int32, *, loc=None, ip=None):
    st = llvm.StructType.get_literal([T.i32(), T.i32(), T.i32(), T.i32()])
    r = _asm(st, [Int32(addr)], "ld.shared::cluster.v4.u32 {$0, $1, $2, $3}, [$4];",
             "=r,=r,=r,=r,r", loc, ip)  # fmt: skip
    return tuple(Int32(llvm.extractvalue(T.i32(), r, [k], loc=loc, ip=ip)) for k in range(4))


@dsl_user_op
def st_dsmem_u32(addr: Int32, v: Int32, *, loc=None, ip=None) -> None:
    _asm(None, [Int32(addr), Int32(v)], "st.shared::cluster.u32 [$0], $1;", "r,r,~{memory}", loc, ip)


@dsl_user_op
def red_dsmem_or(addr: Int32, v: Int32, *, loc=None, ip=None) -> None:
    _asm(None, [Int32(addr), Int32(v)], "red.relaxed.cluster.shared::cluster.or.b32 [$0], $1;",
         "r,r,~{memory}", loc, ip)  # fmt: skip


@dsl_user_op
def red_smem_add(addr: Int32, v: Int32, *, loc=None, ip=None) -> None:
    _asm(None, [Int32(addr), Int32(v)], "red.shared.add.u32 [$0], $1;", "r,r,~{memory}", loc, ip)


@dsl_user_op
def red_smem_inc_if(addr: Int32, a: Int32, b: Int32, *, loc=None, ip=None) -> None:
    """shared[addr] += 1 when a == b: a predicated red (no branch per token)."""
    _asm(None, [Int32(addr), Int32(a), Int32(b)],
         "{\n\t.reg .pred p;\n\tsetp.eq.u32 p, $1, $2;\n\t@p red.shared.add.u32 [$0], 1;\n\t}",
         "r,r,r,~{memory}", loc, ip)  # fmt: skip


@dsl_user_op
def st_smem_u32_if(addr: Int32, v: Int32, pred: Int32, *, loc=None, ip=None) -> None:
    """shared[addr] = v when pred != 0 (no branch)."""
    _asm(None, [Int32(addr), Int32(v), Int32(pred)],
         "{\n\t.reg .pred p;\n\tsetp.ne.u32 p, $2, 0;\n\t@p st.shared.u32 [$0], $1;\n\t}",
         "r,r,r,~{memory}", loc, ip)  # fmt: skip


@dsl_user_op
def ld_smem_u32(addr: Int32, *, loc=None, ip=None) -> Int32:
    return Int32(_asm(T.i32(), [Int32(addr)], "ld.shared.u32 $0, [$1];", "=r,r,~{memory}", loc, ip))


@dsl_user_op
def st_smem_u32(addr: Int32, v: Int32, *, loc=None, ip=None) -> None:
    _asm(None, [Int32(addr), Int32(v)], "st.shared.u32 [$0], $1;", "r,r,~{memory}", loc, ip)


@dsl_user_op
def ld_smem_v2(addr: Int32, *, loc=None, ip=None):
    st = llvm.StructType.get_literal([T.i32(), T.i32()])
    r = _asm(st, [Int32(addr)], "ld.shared.v2.u32 {$0, $1}, [$2];", "=r,=r,r,~{memory}", loc, ip)
    return tuple(Int32(llvm.extractvalue(T.i32(), r, [k], loc=loc, ip=ip)) for k in range(2))


@dsl_user_op
def st_smem_v2(addr: Int32, a: Int32, b: Int32, *, loc=None, ip=None) -> None:
    _asm(None, [Int32(addr), Int32(a), Int32(b)], "st.shared.v2.u32 [$0], {$1, $2};", "r,r,r,~{memory}", loc, ip)


@dsl_user_op
def cp_async(dst: Int32, src: Int64, nbytes: int, *, loc=None, ip=None) -> None:
    """cp.async.ca of ``nbytes`` (4 or 8) from global ``src`` to shared ``dst`` (no register
    waits for the data: cp_async_wait_all)."""
    _asm(None, [Int32(dst), Int64(src)], f"cp.async.ca.shared.global [$0], [$1], {int(nbytes)};",
         "r,l,~{memory}", loc, ip)  # fmt: skip


@dsl_user_op
def cp_async_wait_all(*, loc=None, ip=None) -> None:
    _asm(None, [], "cp.async.wait_all;", "~{memory}", loc, ip)


@dsl_user_op
def red_smem_or(addr: Int32, v: Int32, *, loc=None, ip=None) -> None:
    _asm(None, [Int32(addr), Int32(v)], "red.shared.or.b32 [$0], $1;", "r,r,~{memory}", loc, ip)


@dsl_user_op
def bulk_start(mbar: Int32, dst: Int32, src: Int64, nbytes: Int32, *, loc=None, ip=None) -> None:
    """Initialise the mbarrier (one arrival), make that visible to the async proxy, arrive
    expecting ``nbytes`` and start one cp.async.bulk of them from global memory into shared
    memory, completing on the mbarrier (nbytes, dst and src multiples of 16)."""
    _asm(None, [Int32(mbar), Int32(dst), Int64(src), Int32(nbytes)],
         "mbarrier.init.shared::cta.b64 [$0], 1;\n\t"
         "fence.mbarrier_init.release.cluster;\n\t"
         "fence.proxy.async.shared::cta;\n\t"
         "mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $3;\n\t"
         "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$1], [$2], $3, [$0];",
         "r,r,l,r,~{memory}", loc, ip)  # fmt: skip


@dsl_user_op
def mbar_wait0(mbar: Int32, *, loc=None, ip=None) -> None:
    """Until the mbarrier's phase 0 completes (its bulk copy landed)."""
    _asm(None, [Int32(mbar)],
         "{\n\t.reg .pred p;\n\tjdx_wait:\n\t"
         "mbarrier.try_wait.parity.shared::cta.b64 p, [$0], 0;\n\t"
         "@!p bra jdx_wait;\n\t}",
         "r,~{memory}", loc, ip)  # fmt: skip


@dsl_user_op
def st_smem_u8(addr: Int32, v: Int32, *, loc=None, ip=None) -> None:
    _asm(None, [Int32(addr), Int32(v)], "st.shared.u8 [$0], $1;", "r,r,~{memory}", loc, ip)


@dsl_user_op
def ld_smem_u16(addr: Int32, *, loc=None, ip=None) -> Uint32:
    return Uint32(_asm(T.i32(), [Int32(addr)], "ld.shared.u16 $0, [$1];", "=r,r", loc, ip))


@dsl_user_op
def low_bit(m: Int32, *, loc=None, ip=None) -> Int32:
    """Index of the lowest set bit of m (m != 0)."""
    return Int32(_asm(T.i32(), [Int32(m)],
                      "{\n\t.reg .b32 t;\n\tneg.s32 t, $1;\n\tand.b32 t, t, $1;\n\tbfind.u32 $0, t;\n\t}",
                      "=r,r", loc, ip))  # fmt: skip


@dsl_user_op
def ld_smem_u16_if(addr: Int32, pred: Int32, *, loc=None, ip=None) -> Uint32:
    """The u16 at shared address addr where pred != 0, else 0 (a predicated load)."""
    return Uint32(_asm(T.i32(), [Int32(addr), Int32(pred)],
                       "{\n\t.reg .pred p;\n\tsetp.ne.u32 p, $2, 0;\n\tmov.u32 $0, 0;\n\t"
                       "@p ld.shared.u16 $0, [$1];\n\t}", "=r,r,r", loc, ip))  # fmt: skip


@dsl_user_op
def popc64(m: Uint64, *, loc=None, ip=None) -> Int32:
    return Int32(_asm(T.i32(), [Uint64(m)], "popc.b64 $0, $1;", "=r,l", loc, ip))


@dsl_user_op
def ld_smem_v4(addr: Int32, *, loc=None, ip=None):
    st = llvm.StructType.get_literal([T.i32(), T.i32(), T.i32(), T.i32()])
    r = _asm(st, [Int32(addr)], "ld.shared.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r", loc, ip)
    return tuple(Int32(llvm.extractvalue(T.i32(), r, [k], loc=loc, ip=ip)) for k in range(4))


@dsl_user_op
def st_smem_v4(addr: Int32, a: Int32, b: Int32, c: Int32, d: Int32, *, loc=None, ip=None) -> None:
    _asm(None, [Int32(addr), Int32(a), Int32(b), Int32(c), Int32(d)],
         "st.shared.v4.u32 [$0], {$1, $2, $3, $4};", "r,r,r,r,r,~{memory}", loc, ip)  # fmt: skip


@dsl_user_op
def ld_nc_v4(addr: Int64, *, loc=None, ip=None):
    """Eight bf16 in one 16-byte load (read-only while the kernel runs)."""
    st = llvm.StructType.get_literal([T.i32(), T.i32(), T.i32(), T.i32()])
    r = _asm(st, [Int64(addr)], "ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l",
             loc, ip)  # fmt: skip
    return tuple(Int32(llvm.extractvalue(T.i32(), r, [k], loc=loc, ip=ip)) for k in range(4))


@dsl_user_op
def cluster_sync(*, loc=None, ip=None) -> None:
    """Every thread of every CTA of the cluster: release, then acquire (orders
    shared and distributed-shared accesses across the cluster)."""
    _asm(None, [], "barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;",
         "~{memory}", loc, ip)  # fmt: skip


@dsl_user_op
def cluster_arrive(*, loc=None, ip=None) -> None:
    """This thread's relaxed arrival at the cluster barrier (no memory ordering: it says
    only that this thread reads no other CTA's shared memory any more); ``cluster_wait``
    completes it."""
    _asm(None, [], "barrier.cluster.arrive.relaxed.aligned;", "~{memory}", loc, ip)


@dsl_user_op
def cluster_wait(*, loc=None, ip=None) -> None:
    """Until every thread of the cluster arrived (``cluster_arrive``): before a CTA exits,
    no other CTA may still read its shared memory."""
    _asm(None, [], "barrier.cluster.wait.aligned;", "~{memory}", loc, ip)


@dsl_user_op
def cluster_sync_local(*, loc=None, ip=None) -> None:
    """A cluster barrier that releases only this CTA's own shared memory (what the other
    CTAs read after it through DSMEM) at cluster scope: fence.release.sync_restrict::
    shared::cta.cluster (MEMBAR.ALL.CTA in SASS, where arrive.release gives MEMBAR.ALL.GPU),
    barrier.cluster.arrive.relaxed, barrier.cluster.wait (acquire).  Not enough where a CTA
    wrote into ANOTHER CTA's shared memory before it (select.closing_barrier)."""
    _asm(None, [], "fence.release.sync_restrict::shared::cta.cluster;\n\t"
         "barrier.cluster.arrive.relaxed.aligned;\n\tbarrier.cluster.wait.aligned;",
         "~{memory}", loc, ip)  # fmt: skip


@dsl_user_op
def smem_addr(t: cute.Tensor, *, loc=None, ip=None) -> Int32:
    """32-bit shared-window address of a shared-memory tensor's first element."""
    return Int32(t.iterator.toint(loc=loc, ip=ip))


@dsl_user_op
def ld_nc_v4_if(addr: Int64, pred: Int32, *, loc=None, ip=None):
    """Eight bf16 in one 16-byte load where ``pred`` != 0, else zeros (predicated: the loads of
    a thread are all in flight before the first is used)."""
    st = llvm.StructType.get_literal([T.i32(), T.i32(), T.i32(), T.i32()])
    r = _asm(st, [Int64(addr), Int32(pred)],
               "{ .reg .pred p; setp.ne.s32 p, $5, 0; mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; "
               "mov.b32 $3, 0; @p ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4]; }",
               "=&r,=&r,=&r,=&r,l,r", loc, ip)  # fmt: skip
    return tuple(Int32(llvm.extractvalue(T.i32(), r, [k], loc=loc, ip=ip)) for k in range(4))


@dsl_user_op
def red_smem_max(addr: Int32, v: Int32, *, loc=None, ip=None) -> None:
    _asm(None, [Int32(addr), Int32(v)], "red.shared.max.u32 [$0], $1;", "r,r,~{memory}", loc, ip)


@dsl_user_op
def ld_dsmem_u32_if(addr: Int32, pred: Int32, *, loc=None, ip=None) -> Int32:
    """A DSMEM word where ``pred`` != 0, else 0 (predicated: every CTA's load in flight at once)."""
    return Int32(_asm(T.i32(), [Int32(addr), Int32(pred)],
                        "{ .reg .pred p; setp.ne.s32 p, $2, 0; mov.b32 $0, 0; "
                        "@p ld.shared::cluster.u32 $0, [$1]; }", "=&r,r,r", loc, ip))  # fmt: skip


@dsl_user_op
def max_u16x2(a: Int32, b: Int32, *, loc=None, ip=None) -> Int32:
    """Halfword-wise unsigned maximum of two packed ord16 pairs."""
    return Int32(_asm(T.i32(), [Int32(a), Int32(b)], "max.u16x2 $0, $1, $2;", "=r,r,r", loc, ip))


@dsl_user_op
def or_if_ge(m: Uint32, x: Uint32, thr: Uint32, bit: cutlass.Constexpr, *, loc=None, ip=None) -> Uint32:
    """m | (1 << bit) where x >= thr (unsigned): a compare and a predicated or."""
    return Uint32(_asm(T.i32(), [Uint32(m), Uint32(x), Uint32(thr)],
                         "{ .reg .pred p; setp.ge.u32 p, $2, $3; mov.b32 $0, $1; @p or.b32 $0, $0, %d; }" % (1 << bit),
                         "=&r,r,r,r", loc, ip))  # fmt: skip


@dsl_user_op
def bin_addr(base: Int32, w: Int32, pos: cutlass.Constexpr, bits: cutlass.Constexpr, *, loc=None,
             ip=None) -> Int32:
    """base + 4 * (bits ``pos`` .. ``pos + bits - 1`` of w): a histogram bin's address in one
    bit-field extract and one shift-add."""
    return Int32(_asm(T.i32(), [Int32(base), Int32(w)],
                      "{ .reg .b32 t; bfe.u32 t, $2, %d, %d; shl.b32 t, t, 2; add.u32 $0, $1, t; }" % (pos, bits),
                      "=r,r,r", loc, ip))  # fmt: skip


@dsl_user_op
def trap(*, loc=None, ip=None) -> None:
    _asm(None, [], "trap;", "~{memory}", loc, ip)


@dsl_user_op
def st_relaxed_sys(addr: Int64, v: Int32, *, loc=None, ip=None) -> None:
    """A strong store at system scope (after a fence.acq_rel.sys: a release pattern)."""
    _asm(None, [Int64(addr), Int32(v)], "st.relaxed.sys.global.u32 [$0], $1;",
           "l,r,~{memory}", loc, ip)  # fmt: skip


@dsl_user_op
def ld_volatile_v2_u64(addr: Int64, *, loc=None, ip=None):
    """One LL record (w0 | e << 32, w1 | e << 32) in one 16-byte load; each
    8-byte half is one 64-bit element access (its tag checked separately)."""
    st = llvm.StructType.get_literal([T.i64(), T.i64()])
    r = llvm.inline_asm(st, [Int64(addr).ir_value(loc=loc, ip=ip)],
                        "ld.volatile.global.v2.u64 {$0, $1}, [$2];", "=l,=l,l",
                        has_side_effects=True, is_align_stack=False,
                        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)  # fmt: skip
    return (Uint64(llvm.extractvalue(T.i64(), r, [0], loc=loc, ip=ip)),
            Uint64(llvm.extractvalue(T.i64(), r, [1], loc=loc, ip=ip)))  # fmt: skip


@dsl_user_op
def ld_volatile_v2_u64_if(addr: Int64, pred: Int32, *, loc=None, ip=None):
    """ld_volatile_v2_u64 where ``pred`` != 0, else (0, 0) (predicated: C.ld_u32_if)."""
    st = llvm.StructType.get_literal([T.i64(), T.i64()])
    r = llvm.inline_asm(st, [Int64(addr).ir_value(loc=loc, ip=ip), Int32(pred).ir_value(loc=loc, ip=ip)],
                        "{ .reg .pred p; setp.ne.s32 p, $3, 0; mov.u64 $0, 0; mov.u64 $1, 0; "
                        "@p ld.volatile.global.v2.u64 {$0, $1}, [$2]; }", "=&l,=&l,l,r",
                        has_side_effects=True, is_align_stack=False,
                        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)  # fmt: skip
    return (Uint64(llvm.extractvalue(T.i64(), r, [0], loc=loc, ip=ip)),
            Uint64(llvm.extractvalue(T.i64(), r, [1], loc=loc, ip=ip)))  # fmt: skip
