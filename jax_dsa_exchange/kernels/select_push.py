"""Producer kernel (docs/DESIGN.md §6.1): the local top-N of each row, pushed as NCCL-LL 16-byte
stores into every rank's symmetric buffer.  ABI: ``abi.SELECT_PUSH``.

Launch: grid (rows * C, 1, 1) in clusters of (C, 1, 1), C = ``layout.producer_cluster(rows, cols,
split)``; block (TB,).  Cluster b selects row b (kernels/select.py, or kernels/lean.py in the
lean image); each CTA then pushes its own part of the packed row (one CTA also the bit-16 mask
words) to every rank; a one-CTA cluster or a row of more than 2048 candidates pushes the whole
row from CTA 0.  The producer never waits on a peer, so any grid is deadlock-free.
:class:`ProducerConfig` is what varies between images, :func:`producer_configs` picks them.
"""

from __future__ import annotations

import dataclasses
import functools

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32

from .. import layout
from . import abi
from . import common as C
from . import lean as LS
from . import ptx as P
from . import select as S

ABI = abi.SELECT_PUSH
# ptxas's default register heuristic flips between 40 registers + spills (0.3-3 us slower) and ~50
# without on small code changes; level 8 keeps the kernel out of it (ptxas 13.0: 51, no spill)
PTXAS_OPTIONS = "--register-usage-level=8"


def own_part_ok(n: int) -> bool:
    """Whether each CTA pushes its own part of rows of n candidates (the lanes of one warp derive
    the mask records)."""
    return (layout.row_words(n) - n) // 2 <= 32


def lean_ok(n: int, topk: int = 0, rescue_list: bool = False) -> bool:
    """Whether a configuration gets the lean image: own parts and no rescue list (one count)."""
    return own_part_ok(n) and S.klist_n2(n, topk, rescue_list) == 0


@dataclasses.dataclass(frozen=True)
class ProducerConfig:
    """One producer image.  ``rescue_list``: each row's local top-K also goes to its klist row of
    the local state for the merge's rescue; ``lean``: the "select_push_lean" image (kernels/lean.py,
    for launches whose slices fit it: layout.producer_uses_lean)."""

    world: int
    topk: int
    local_topk: int
    rescue_list: bool = False
    lean: bool = False
    arch: str = "sm_90a"  # the target (layout.ARCHS)

    def __post_init__(self):
        layout.arch_limits(self.arch)
        if self.lean and not lean_ok(self.local_topk, self.topk, self.rescue_list):
            raise ValueError(f"no lean select_push for n={self.local_topk}, topk={self.topk}, "
                             f"rescue_list={self.rescue_list}")  # fmt: skip

    @property
    def image(self) -> str:
        return "select_push_lean" if self.lean else "select_push"


def producer_configs(world: int, topk: int, local_topk: int, rescue_list: bool = False, arch: str = "sm_90a") -> tuple:
    """The producer images of a configuration: select_push, and the lean one where lean_ok."""
    base = ProducerConfig(world, topk, local_topk, bool(rescue_list), arch=arch)
    if lean_ok(local_topk, topk, rescue_list):
        return base, dataclasses.replace(base, lean=True)
    return (base,)


def smem_bytes(n: int, topk: int = 0, rescue_list: bool = False) -> int:
    """Dynamic shared memory of select_push's CTA with a cache of S.CACHE_MAX tokens (a launch of
    cache_tokens = c needs 2 * (S.CACHE_MAX - c) bytes less: the cache is last)."""
    dual = S.klist_n2(n, topk, rescue_list) > 0  # (a second list: its own second histograms)
    return S.smem_bytes(layout.row_words(n), cached=True, dual=dual) + layout.MAX_WORLD * 8


def split() -> dict:
    """select_push's metadata split: layout.producer_split(), its cache capacity S.CACHE_MAX."""
    return layout.producer_split()


@cute.jit
def store_peers(peer_addrs: cute.Tensor, peer: Int64, tid: Int32, world: cutlass.Constexpr):
    if tid < Int32(world):
        peer_addrs[tid] = peer


@cute.jit
def row_end(row_ends: Int64, t: Int32, cols: Int32) -> Int32:
    """clamp(row_ends[t], 0, min(cols, 2**17))."""
    return S.clamp_end(P.ld_u32(row_ends + Int64(t) * Int64(4)), cols)


class SelectPush:
    """select_push for one :class:`ProducerConfig` (n = local_topk, K = topk)."""

    def __init__(self, config: ProducerConfig):
        self.config = config
        self.world, self.n, self.lean = config.world, config.local_topk, config.lean
        self.n2 = S.klist_n2(self.n, config.topk, config.rescue_list)
        self.rw = layout.row_words(self.n)
        self.ll_row_bytes = layout.ll_row_bytes(self.n)
        self.own = own_part_ok(self.n)
        if self.lean:
            self.smem = LS.smem_bytes(self.rw) + layout.MAX_WORLD * 8
        else:
            self.smem = smem_bytes(self.n, config.topk, config.rescue_list)
        self._compiled = {}

    def split(self) -> dict:
        """The image's metadata split (what the launcher's rules and shared memory per launch read)."""
        if self.lean:
            return layout.producer_lean_split()  # (slice_max: lean.SLICE_MAX, asserted there)
        return split()

    @cute.kernel
    def kernel(self, logits: Int64, row_ends: Int64, rows: Int32, cols: Int32, epoch: Int64, peers: Int64,
               rank: Int32, max_rows: Int32, cache_tokens: Int32):
        tid, _, _ = cute.arch.thread_idx()
        tid = Int32(tid)
        lane = cute.arch.lane_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        csize = cute.arch.make_warp_uniform(cute.arch.cluster_size())
        me = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        smem = cutlass.memory.SmemAllocator()
        peer_addrs = smem.allocate_tensor(Int64, cute.make_layout((layout.MAX_WORLD,)), 16)
        sm = None
        if cutlass.const_expr(self.lean):
            sm = LS.LeanSmem(smem, self.rw)  # (its slice copy last)
        else:
            sm = S.SelectSmem(smem, self.rw, True, self.n2 > 0)  # (its slice cache last: see smem_bytes)
        # the merge may launch once every CTA of this grid started (it never holds an SM a producer
        # CTA needs), and waits for this grid's completion before it bumps an epoch or reads logits
        P.pdl_wait()
        P.pdl_launch_dependents()
        t = Int32(0)
        t = cute.arch.cluster_idx()[0]  # (= block // csize: clusters of (csize, 1, 1))
        # everything the push needs loaded now, beside the row's length (a chain of round trips cost
        # microseconds); stored only in ``early`` and the push, as a store waits for its load
        peer = Int64(0)
        if tid < Int32(self.world):
            peer = Int64(P.ld_u64(peers + Int64(tid) * Int64(8)))
        status = P.ld_volatile_u32(C.state_status(epoch, max_rows))
        e0 = P.ld_u32(C.state_epoch(epoch, max_rows, t))
        end_raw = P.ld_u32(row_ends + Int64(t) * Int64(4))
        early = functools.partial(store_peers, peer_addrs, peer, tid, self.world)
        p0, p1, p_end, writer = Int32(0), Int32(self.n), Int32(0), Int32(1)
        if cutlass.const_expr(self.lean):
            # (the launcher runs this image only where every slice fits: layout.producer_uses_lean)
            if LS.fits(cols, csize) == Int32(0):
                P.trap()
            row_addr = logits + Int64(t) * Int64(cols) * Int64(2)
            p0, p1, p_end, writer = LS.select_row_lean(row_addr, end_raw, cols, rows, self.n, self.rw, sm.parts(),
                                                       tid, lane, warp, csize, me,
                                                       layout.arch_limits(self.config.arch).sm_count, early=early)
        else:
            k_out = None
            if cutlass.const_expr(self.n2 > 0):
                k_out = C.state_klist(epoch, max_rows, t, layout.row_words(self.n2))
            row_addr = logits + Int64(t) * Int64(cols) * Int64(2)
            p0, p1, p_end, writer = S.select_row(row_addr, S.clamp_end(end_raw, cols), self.n, self.rw, sm.parts(),
                                                 tid, lane, warp, csize, me, True, True, cache_tokens, early=early,
                                                 own_part=self.own, n2=self.n2, k_out=k_out)  # fmt: skip
        # a failed or closed exchange pushes nothing (every CTA ran the select's cluster barriers)
        if status == Uint32(layout.STATUS_OK):
            e = e0 + Int32(1)
            if csize == Int32(1) or cutlass.const_expr(not self.own):
                if me == Int32(0):  # (CTA 0 holds the whole packed row, its mask words too)
                    self.push_row(peer_addrs, sm.row, e, rank, t, max_rows, tid)
            else:
                if cutlass.const_expr(self.own):  # (the condition above is dynamic)
                    # every CTA its positions [p0, p1) (the last up to n), the writer the mask words
                    hi = p1
                    if me == csize - Int32(1):
                        hi = Int32(self.n)
                    self.push_part(peer_addrs, sm.row, e, rank, t, max_rows, p0, hi, p_end, writer, tid, lane, warp)
        if cutlass.const_expr(self.own):
            if S.one_cta(csize) == Int32(0):  # (a one-CTA cluster did not arrive)
                P.cluster_wait()  # (the select's arrival: no CTA still reads this one's DSMEM)

    @cute.jit
    def push_row(self, peer_addrs: cute.Tensor, row: cute.Tensor, e: Int32, rank: Int32, t: Int32, max_rows: Int32,
                 tid):
        """The whole packed row (this CTA's row buffer) to every rank, as LL records of epoch e."""
        off = C.ll_row_offset(e & Int32(1), rank, t, self.world, max_rows, self.ll_row_bytes)
        for p in cutlass.range_constexpr(self.world):
            dst = peer_addrs[p] + off
            for i in cutlass.range(tid, self.rw // 2, C.TB, unroll=1):
                P.st_ll_v4(dst + Int64(i) * Int64(layout.LL_RECORD_BYTES), row[2 * i], e, row[2 * i + 1])

    @cute.jit
    def push_part(self, peer_addrs: cute.Tensor, row: cute.Tensor, e: Int32, rank: Int32, t: Int32, max_rows: Int32,
                  lo: Int32, hi: Int32, p_end: Int32, writes_mask: Int32, tid, lane, warp):
        """Words [lo, hi) of the packed row to every rank: whole LL records, and an edge word in its
        record's 8-byte half (each half has its own tag, so two CTAs may write one record).
        ``writes_mask``: also the mask words, bit 16 of l set at [p_hi, p_end) (positions ascend
        with l: p_hi is this CTA's first own set mask bit, or hi)."""
        n = self.n
        nmw = n // 32  # mask words
        mrec = (self.rw - n) // 2  # their records (with the padding words)
        assert own_part_ok(n), n
        m0, m1 = Int32(0), Int32(0)
        if writes_mask != Int32(0) and warp == Int32(0):
            f = Int32(n)
            for k in cutlass.range_constexpr(0, nmw, 32):
                w = Int32(0)
                if lane + Int32(k) < Int32(nmw):
                    w = row[n + k + lane]
                if w != Int32(0):
                    f = cutlass.min(f, (lane + Int32(k)) * Int32(32) + P.low_bit(w))
            p_hi = cutlass.min(cute.arch.warp_redux_sync(f, "min"), hi)
            if lane < Int32(mrec):
                m0 = S.mask_bits(p_hi, p_end, Int32(2) * lane, nmw)
                m1 = S.mask_bits(p_hi, p_end, Int32(2) * lane + Int32(1), nmw)
        # each thread's words loaded once, then predicated stores per peer (a loop per peer over
        # dynamic bounds measured +0.5 us at C = 1)
        wm = Int32(writes_mask != Int32(0)) & Int32(tid < Int32(mrec))
        # the edge words: thread TB - 1 the one at lo (odd lo), TB - 2 the one before hi (odd hi)
        e_lo = Int32(lo < hi) & Int32(tid == Int32(C.TB - 1)) & (lo & Int32(1))
        e_hi = Int32(lo < hi) & Int32(tid == Int32(C.TB - 2)) & (hi & Int32(1))
        ew, eo = Int32(0), Int64(0)
        if e_lo != Int32(0):
            ew = row[lo]
            eo = Int64(lo >> Int32(1)) * Int64(layout.LL_RECORD_BYTES) + Int64(layout.LL_HALF_BYTES)
        if e_hi != Int32(0):
            ew = row[hi - Int32(1)]
            eo = Int64(hi >> Int32(1)) * Int64(layout.LL_RECORD_BYTES)
        ee = e_lo | e_hi
        r_lo = (lo + Int32(1)) >> Int32(1)
        r_hi = hi >> Int32(1)
        nr = -(-(self.rw // 2) // C.TB)  # records per thread at most
        ok = cute.make_rmem_tensor((nr,), Int32)
        wa = cute.make_rmem_tensor((nr,), Int32)
        wb = cute.make_rmem_tensor((nr,), Int32)
        for j in cutlass.range_constexpr(nr):
            i = r_lo + tid + Int32(j * C.TB)
            ok[j] = Int32(i < r_hi)
            wa[j] = Int32(0)
            wb[j] = Int32(0)
            if i < r_hi:
                wa[j] = row[Int32(2) * i]
                wb[j] = row[Int32(2) * i + Int32(1)]
        off = C.ll_row_offset(e & Int32(1), rank, t, self.world, max_rows, self.ll_row_bytes)
        rb = Int64(layout.LL_RECORD_BYTES)
        base = off + Int64(r_lo + tid) * rb
        mo = off + Int64(n // 2 + tid) * rb
        for p in cutlass.range_constexpr(self.world):
            dst = peer_addrs[p]
            for j in cutlass.range_constexpr(nr):
                P.st_ll_v4_if(dst + base + Int64(j * C.TB) * rb, wa[j], e, wb[j], ok[j])
            P.st_ll_half_if(dst + off + eo, ew, e, ee)
            P.st_ll_v4_if(dst + mo, m0, e, m1, wm)

    @cute.jit
    def entry(self, logits: Int64, row_ends: Int64, rows: Int32, cols: Int32, epoch: Int64, peers: Int64,
              rank: Int32, max_rows: Int32, cache_tokens: Int32):
        # compile-time launch shape only: the launcher gives the grid and cluster
        self.kernel(logits, row_ends, rows, cols, epoch, peers, rank, max_rows,
                    cache_tokens).launch(grid=(rows, 1, 1), block=(C.TB, 1, 1), smem=self.smem )

    def compile(self, arch: str | None = None, dump_dir: str = "."):
        """The compiled kernel for the configuration's target (cached; ``dump_dir``:
        common.compile_options)."""
        arch = arch or self.config.arch
        if arch != self.config.arch:
            raise ValueError(f"a producer configured for {self.config.arch} cannot compile for {arch}")
        if arch not in self._compiled:
            self._compiled[arch] = cute.compile(self.entry, *ABI.dummies(Int64, Int32),
                                                options=C.compile_options(arch, dump_dir, PTXAS_OPTIONS))
        return self._compiled[arch]
