"""Producer kernel (SPEC §6.1): local top-N of each row, pushed as NCCL-LL
16-byte stores into every rank's symmetric buffer.

ABI (fixed; all plain Int64 addresses / Int32 scalars, in this order)::

    logits: i64 (bf16 [rows, cols] row-major), row_ends: i64 (int32 [rows]),
    rows: i32, cols: i32, epoch: i64 (int32 [max_rows], this rank's),
    peers: i64 (int64 [W] device table of every rank's buffer base),
    rank: i32, max_rows: i32

grid = (any G >= 1, 1, 1): CTA b handles rows b, b + G, ...; block = (TB,).
The producer never waits on a peer, so any grid is deadlock-free.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32

from .. import layout
from . import common as C

PARAMS = [
    ("logits", "i64"), ("row_ends", "i64"), ("rows", "i32"), ("cols", "i32"),
    ("epoch", "i64"), ("peers", "i64"), ("rank", "i32"), ("max_rows", "i32"),
]  # fmt: skip


def smem_bytes(n: int, bits1: int = C.B1) -> int:
    """Dynamic shared memory of the CTA (SmemParts order) + slack."""
    rw = layout.row_words(n)
    return _align(rw * 4, 16) + C.hist_bins(bits1) * 4 + (C.NWARPS + 16) * 4 + 128


def _align(x, a):
    return -(-x // a) * a


class SmemParts:
    """The CTA's shared arrays (one allocator, static sizes)."""

    def __init__(self, rw: int, bits1: int):
        smem = cutlass.memory.SmemAllocator()
        self.buf = smem.allocate_tensor(Int32, cute.make_layout((rw,)), 16)
        self.hist = smem.allocate_tensor(Int32, cute.make_layout((C.hist_bins(bits1),)), 16)
        self.warp_totals = smem.allocate_tensor(Int32, cute.make_layout((C.NWARPS,)), 16)
        self.scalars = smem.allocate_tensor(Int32, cute.make_layout((16,)), 16)


@cute.jit
def row_end(row_ends: Int64, t: Int32, cols: Int32) -> Int32:
    """clamp(row_ends[t], 0, min(cols, 2**17))."""
    end = C.ld_u32(row_ends + Int64(t) * Int64(4))
    lim = cols
    if lim > Int32(layout.MAX_LOCAL_LEN):
        lim = Int32(layout.MAX_LOCAL_LEN)
    if end > lim:
        end = lim
    if end < Int32(0):
        end = Int32(0)
    return end


class SelectPush:
    """select_push for one static (world, n); n = local_topk."""

    def __init__(self, world: int, n: int, *, vec=C.VEC, u12=C.U12, u3=C.U3, bits1=C.B1):
        self.world, self.n = world, n
        self.rw = layout.row_words(n)
        self.ll_row_bytes = layout.ll_row_bytes(n)
        self.tune = (vec, u12, u3, bits1)  # static tuning of the select (common.py)
        self.smem = smem_bytes(n, bits1)

    @cute.kernel
    def kernel(self, logits: Int64, row_ends: Int64, rows: Int32, cols: Int32,
               epoch: Int64, peers: Int64, rank: Int32, max_rows: Int32):  # fmt: skip
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        nblk, _, _ = cute.arch.grid_dim()
        lane = cute.arch.lane_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        sm = SmemParts(self.rw, self.tune[3])
        # The logits and epochs come from earlier kernels (PDL-safe).
        C.pdl_wait()
        t = Int32(bid)
        # A failed or closed exchange (status word set) pushes nothing (layout.py).
        if C.ld_volatile_u32(epoch + Int64(max_rows) * Int64(8)) != Uint32(0):
            t = rows
        while t < rows:
            e = C.ld_u32(epoch + Int64(t) * Int64(4)) + Int32(1)
            end = row_end(row_ends, t, cols)
            row_addr = logits + Int64(t) * Int64(cols) * Int64(2)
            C.local_select(row_addr, end, self.n, self.rw, sm.buf, sm.hist, sm.warp_totals,
                           sm.scalars, tid, lane, warp, *self.tune)  # fmt: skip
            off = (((Int64(e & Int32(1)) * Int64(self.world) + Int64(rank)) * Int64(max_rows)
                    + Int64(t)) * Int64(self.ll_row_bytes))  # fmt: skip
            for p in cutlass.range(self.world, unroll=1):
                dst = Int64(C.ld_u64(peers + Int64(p) * Int64(8))) + off
                for i in cutlass.range(tid, self.rw // 2, C.TB, unroll=1):
                    C.st_ll_v4(dst + Int64(i) * Int64(16), sm.buf[2 * i], e, sm.buf[2 * i + 1])
            cute.arch.sync_threads()  # buf is reused by the next row
            t = t + Int32(nblk)
        C.pdl_launch_dependents()

    @cute.jit
    def entry(self, logits: Int64, row_ends: Int64, rows: Int32, cols: Int32,
              epoch: Int64, peers: Int64, rank: Int32, max_rows: Int32):  # fmt: skip
        self.kernel(logits, row_ends, rows, cols, epoch, peers, rank, max_rows).launch(
            grid=(rows, 1, 1), block=(C.TB, 1, 1), smem=self.smem
        )

    def compile(self, arch: str = "sm_90a"):
        z64, z32 = Int64(0), Int32(1)
        return cute.compile(
            self.entry, z64, z64, z32, z32, z64, z64, Int32(0), z32,
            options=f"--gpu-arch {arch} --keep-ptx --keep-cubin",
        )  # fmt: skip
