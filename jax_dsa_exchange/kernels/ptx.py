"""Inline-PTX primitives of the kernels (no JAX import).

Every global access goes through an Int64 address and one of these short wrappers, so the
memory semantics (volatile LL halves, system-scope release / acquire, 16-byte stores, cluster
barriers, bulk copies) are exactly what the PTX shows and what the compile tests check.
Addresses are generic 64-bit; ``.global`` is valid for every buffer the kernels touch
(cudaMalloc memory, own or a peer's mapped over NVLink).  Shared-memory addresses are 32-bit
shared-window offsets.  A ``*_if`` load returns zeros where ``pred`` == 0 and a ``*_if`` store
stores nothing: predicated instructions, no branch (an ``if`` around a load lets LLVM fold the
value's users into the branch, so each such load waited for the one before; around a store it
costs a branch and a convergence barrier per store).  Their outputs are early-clobber (``=&``):
the zero is written before the load, never into the address's register.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32, Uint64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

_IR_TYPE = {Int32: T.i32, Uint32: T.i32, Int64: T.i64, Uint64: T.i64}


def _asm(res, args, text, cons, loc=None, ip=None):
    return llvm.inline_asm(
        res, [a.ir_value(loc=loc, ip=ip) for a in args], text, cons,
        has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    )  # fmt: skip


def _op(text, cons, args=(), out=None, n=1):
    """A DSL op of one inline-PTX statement: ``args`` the operands' types, ``out`` the result's
    (None: no result; ``n`` > 1: a tuple of n).  ``text`` may be a function of the trailing
    compile-time arguments, which it formats into the PTX."""

    @dsl_user_op
    def op(*vals, loc=None, ip=None):
        if len(vals) != len(args) + (text.__code__.co_argcount if callable(text) else 0):
            raise TypeError(f"{len(vals)} operands for {text!r}")
        ins = [ty(v) for ty, v in zip(args, vals)]
        txt = text(*vals[len(args):]) if callable(text) else text
        if out is None:
            _asm(None, ins, txt, cons, loc, ip)
            return None
        ty = _IR_TYPE[out]
        if n == 1:
            return out(_asm(ty(), ins, txt, cons, loc, ip))
        r = _asm(llvm.StructType.get_literal([ty()] * n), ins, txt, cons, loc, ip)
        return tuple(out(llvm.extractvalue(ty(), r, [k], loc=loc, ip=ip)) for k in range(n))

    return op


# operand types: a global / shared address, and with it a 32-bit value or predicate
_G, _GV, _S, _SV = (Int64,), (Int64, Int32), (Int32,), (Int32, Int32)

# ---- global memory
ld_u32 = _op("ld.global.u32 $0, [$1];", "=r,l", _G, Int32)  # (inputs written by earlier kernels)
ld_u64 = _op("ld.global.u64 $0, [$1];", "=l,l", _G, Int64)
ld_u16 = _op("ld.global.nc.u16 $0, [$1];", "=r,l", _G, Uint32)  # one bf16 (logits: read-only here)
ld_u32_if = _op("{ .reg .pred p; setp.ne.s32 p, $2, 0; mov.u32 $0, 0; @p ld.global.u32 $0, [$1]; }",
                "=&r,l,r", _GV, Int32)  # fmt: skip
ld_volatile_u64_if = _op("{ .reg .pred p; setp.ne.s32 p, $2, 0; mov.u64 $0, 0; "
                         "@p ld.volatile.global.u64 $0, [$1]; }", "=&l,l,r", _GV, Uint64)  # fmt: skip
ld_volatile_u32_if = _op("{ .reg .pred p; setp.ne.s32 p, $2, 0; mov.u32 $0, 0; "
                         "@p ld.volatile.global.u32 $0, [$1]; }", "=&r,l,r", _GV, Uint32)  # fmt: skip
# one LL half (word | epoch << 32) in ONE 8-byte load, the only atomicity the protocol relies on;
# volatile: never served from L1
ld_volatile_u64 = _op("ld.volatile.global.u64 $0, [$1];", "=l,l", _G, Uint64)
ld_volatile_u32 = _op("ld.volatile.global.u32 $0, [$1];", "=r,l", _G, Uint32)
ld_acquire_sys = _op("ld.acquire.sys.global.u32 $0, [$1];", "=r,l", _G, Int32)
st_u32 = _op("st.global.u32 [$0], $1;", "l,r,~{memory}", _GV)
st_u32_if = _op("{ .reg .pred p; setp.ne.s32 p, $2, 0; @p st.global.u32 [$0], $1; }", "l,r,r,~{memory}",
                (Int64, Int32, Int32))  # fmt: skip
st_volatile_u32 = _op("st.volatile.global.u32 [$0], $1;", "l,r,~{memory}", _GV)
# NCCL-LL store (w0, e, w1, e) as two 64-bit elements of one 16-byte store: each 8-byte half
# (word, epoch) is one single-copy-atomic access in the PTX memory model, like the merge's 8-byte
# reads of a half (a v4.u32 store is four 32-bit elements there)
st_ll_v4 = _op("{ .reg .b64 h0, h1; mov.b64 h0, {$1, $2}; mov.b64 h1, {$3, $2}; "
               "st.volatile.global.v2.u64 [$0], {h0, h1}; }", "l,r,r,r,~{memory}", (Int64,) + (Int32,) * 3)
st_ll_v4_if = _op("{ .reg .pred p; .reg .b64 h0, h1; setp.ne.s32 p, $4, 0; mov.b64 h0, {$1, $2}; "
                  "mov.b64 h1, {$3, $2}; @p st.volatile.global.v2.u64 [$0], {h0, h1}; }",
                  "l,r,r,r,r,~{memory}", (Int64,) + (Int32,) * 4)  # fmt: skip
# one 8-byte half (w, e) of an LL record (an edge word of a CTA's part of a row) in ONE 64-bit
# store (a v2.u32 store is two 32-bit accesses in the memory model)
st_ll_half_if = _op("{ .reg .pred p; .reg .b64 h; setp.ne.s32 p, $3, 0; mov.b64 h, {$1, $2}; "
                    "@p st.volatile.global.u64 [$0], h; }", "l,r,r,r,~{memory}", (Int64,) + (Int32,) * 3)
st_v4 = _op("st.global.v4.u32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r,~{memory}", (Int64,) + (Int32,) * 4)
ld_cg_v4 = _op("ld.global.cg.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", _G, Int32, 4)  # (L2 only)
ld_nc_v4 = _op("ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", _G, Int32, 4)  # 8 bf16
ld_nc_v4_if = _op("{ .reg .pred p; setp.ne.s32 p, $5, 0; mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; "
                  "mov.b32 $3, 0; @p ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4]; }",
                  "=&r,=&r,=&r,=&r,l,r", _GV, Int32, 4)  # fmt: skip
# one LL record (w0 | e << 32, w1 | e << 32): each 8-byte half one 64-bit element access
ld_volatile_v2_u64 = _op("ld.volatile.global.v2.u64 {$0, $1}, [$2];", "=l,=l,l", _G, Uint64, 2)
ld_volatile_v2_u64_if = _op("{ .reg .pred p; setp.ne.s32 p, $3, 0; mov.u64 $0, 0; mov.u64 $1, 0; "
                            "@p ld.volatile.global.v2.u64 {$0, $1}, [$2]; }", "=&l,=&l,l,r", _GV, Uint64, 2)
atom_cas_u32 = _op("atom.relaxed.gpu.global.cas.b32 $0, [$1], $2, $3;", "=r,l,r,r,~{memory}",
                   (Int64, Int32, Int32), Int32)  # fmt: skip
# a strong store at system scope (after a fence.acq_rel.sys: a release pattern)
st_relaxed_sys = _op("st.relaxed.sys.global.u32 [$0], $1;", "l,r,~{memory}", _GV)

# ---- fences, timers, launches
globaltimer = _op("mov.u64 $0, %globaltimer;", "=l", (), Int64)
fence_sys = _op("fence.acq_rel.sys;", "~{memory}")
pdl_wait = _op("griddepcontrol.wait;", "~{memory}")  # (a no-op unless launched with PDL)
pdl_launch_dependents = _op("griddepcontrol.launch_dependents;", "~{memory}")
trap = _op("trap;", "~{memory}")

# ---- shared memory (and the cluster's, distributed)
mapa = _op("mapa.shared::cluster.u32 $0, $1, $2;", "=r,r,r", _SV, Int32)  # the address in CTA ``rank``
ld_dsmem_u32 = _op("ld.shared::cluster.u32 $0, [$1];", "=r,r", _S, Int32)
ld_dsmem_u32_if = _op("{ .reg .pred p; setp.ne.s32 p, $2, 0; mov.b32 $0, 0; "
                      "@p ld.shared::cluster.u32 $0, [$1]; }", "=&r,r,r", _SV, Int32)  # fmt: skip
ld_dsmem_v4 = _op("ld.shared::cluster.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r", _S, Int32, 4)
st_dsmem_u32 = _op("st.shared::cluster.u32 [$0], $1;", "r,r,~{memory}", _SV)
red_dsmem_or = _op("red.relaxed.cluster.shared::cluster.or.b32 [$0], $1;", "r,r,~{memory}", _SV)
red_smem_add = _op("red.shared.add.u32 [$0], $1;", "r,r,~{memory}", _SV)
red_smem_or = _op("red.shared.or.b32 [$0], $1;", "r,r,~{memory}", _SV)
red_smem_max = _op("red.shared.max.u32 [$0], $1;", "r,r,~{memory}", _SV)
# shared[addr] += 1 where a == b
red_smem_inc_if = _op("{\n\t.reg .pred p;\n\tsetp.eq.u32 p, $1, $2;\n\t@p red.shared.add.u32 [$0], 1;\n\t}",
                      "r,r,r,~{memory}", (Int32,) * 3)  # fmt: skip
st_smem_u32_if = _op("{\n\t.reg .pred p;\n\tsetp.ne.u32 p, $2, 0;\n\t@p st.shared.u32 [$0], $1;\n\t}",
                     "r,r,r,~{memory}", (Int32,) * 3)  # fmt: skip
ld_smem_u32 = _op("ld.shared.u32 $0, [$1];", "=r,r,~{memory}", _S, Int32)
st_smem_u32 = _op("st.shared.u32 [$0], $1;", "r,r,~{memory}", _SV)
st_smem_u8 = _op("st.shared.u8 [$0], $1;", "r,r,~{memory}", _SV)
ld_smem_u16 = _op("ld.shared.u16 $0, [$1];", "=r,r", _S, Uint32)
ld_smem_u16_if = _op("{\n\t.reg .pred p;\n\tsetp.ne.u32 p, $2, 0;\n\tmov.u32 $0, 0;\n\t"
                     "@p ld.shared.u16 $0, [$1];\n\t}", "=r,r,r", _SV, Uint32)  # fmt: skip
ld_smem_v2 = _op("ld.shared.v2.u32 {$0, $1}, [$2];", "=r,=r,r,~{memory}", _S, Int32, 2)
st_smem_v2 = _op("st.shared.v2.u32 [$0], {$1, $2};", "r,r,r,~{memory}", (Int32,) * 3)
ld_smem_v4 = _op("ld.shared.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r", _S, Int32, 4)
st_smem_v4 = _op("st.shared.v4.u32 [$0], {$1, $2, $3, $4};", "r,r,r,r,r,~{memory}", (Int32,) * 5)
# cp.async.ca(dst, src, nbytes = 4 or 8): no register waits for the data (cp_async_wait_all)
cp_async = _op(lambda nbytes: f"cp.async.ca.shared.global [$0], [$1], {int(nbytes)};", "r,l,~{memory}", (Int32, Int64))
cp_async_wait_all = _op("cp.async.wait_all;", "~{memory}")
# bulk_start(mbar, dst, src, nbytes): initialise the mbarrier (one arrival), make that visible to
# the async proxy, arrive expecting nbytes and start one cp.async.bulk of them from global to shared
# memory, completing on the mbarrier (nbytes, dst and src multiples of 16)
bulk_start = _op("mbarrier.init.shared::cta.b64 [$0], 1;\n\t"
                 "fence.mbarrier_init.release.cluster;\n\t"
                 "fence.proxy.async.shared::cta;\n\t"
                 "mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $3;\n\t"
                 "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$1], [$2], $3, [$0];",
                 "r,r,l,r,~{memory}", (Int32, Int32, Int64, Int32))  # fmt: skip
# until the mbarrier's phase 0 completes (its bulk copy landed)
mbar_wait0 = _op("{\n\t.reg .pred p;\n\tjdx_wait:\n\t"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [$0], 0;\n\t"
                 "@!p bra jdx_wait;\n\t}", "r,~{memory}", _S)  # fmt: skip

# ---- cluster barriers
# every thread of every CTA of the cluster: release, then acquire
cluster_sync = _op("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;", "~{memory}")
# a relaxed arrival: says only that this thread reads no other CTA's shared memory any more;
# cluster_wait completes it (before a CTA exits, no other CTA may still read its shared memory)
cluster_arrive = _op("barrier.cluster.arrive.relaxed.aligned;", "~{memory}")
cluster_wait = _op("barrier.cluster.wait.aligned;", "~{memory}")
# releases only this CTA's own shared memory (what the others read after it through DSMEM) at
# cluster scope: MEMBAR.ALL.CTA in SASS where arrive.release gives MEMBAR.ALL.GPU.  Not enough
# where a CTA wrote into ANOTHER CTA's shared memory before it (select.closing_barrier).
cluster_sync_local = _op("fence.release.sync_restrict::shared::cta.cluster;\n\t"
                         "barrier.cluster.arrive.relaxed.aligned;\n\tbarrier.cluster.wait.aligned;",
                         "~{memory}")  # fmt: skip

# ---- integer
popc64 = _op("popc.b64 $0, $1;", "=r,l", (Uint64,), Int32)
# the index of the lowest set bit (m != 0)
low_bit = _op("{\n\t.reg .b32 t;\n\tneg.s32 t, $1;\n\tand.b32 t, t, $1;\n\tbfind.u32 $0, t;\n\t}", "=r,r", _S, Int32)
max_u16x2 = _op("max.u16x2 $0, $1, $2;", "=r,r,r", _SV, Int32)  # halfword-wise unsigned maximum
# or_if_ge(m, x, thr, bit): m | (1 << bit) where x >= thr (unsigned), by a predicated or
or_if_ge = _op(lambda bit: "{ .reg .pred p; setp.ge.u32 p, $2, $3; mov.b32 $0, $1; @p or.b32 $0, $0, %d; }"
               % (1 << bit), "=&r,r,r,r", (Uint32,) * 3, Uint32)  # fmt: skip
# bin_addr(base, w, pos, bits): base + 4 * (bits pos .. pos + bits - 1 of w), a histogram bin's
# address in one bit-field extract and one shift-add
bin_addr = _op(lambda pos, bits: "{ .reg .b32 t; bfe.u32 t, $2, %d, %d; shl.b32 t, t, 2; add.u32 $0, $1, t; }"
               % (pos, bits), "=r,r,r", _SV, Int32)  # fmt: skip


@dsl_user_op
def smem_addr(t: cute.Tensor, *, loc=None, ip=None) -> Int32:
    """32-bit shared-window address of a shared-memory tensor's first element."""
    return Int32(t.iterator.toint(loc=loc, ip=ip))
