"""The exchange merge (docs/DESIGN.md §6.2-§6.7): each rank's consumer kernel waits for the W
ranks' local top-N lists of a row, selects their exact top-K, writes the outputs, rescues
saturated ranks and bumps the row's epoch.  ABI: ``abi.MERGE``.

Protocol, per row t with e = epoch[t] + 1 (CTA or cluster b walks rows b, b + G, ... in the same
order on every rank, so a CTA only waits for CTAs that already run, §6.7):

  round 1     the W lists of parity e & 1 in this rank's buffer, each 8-byte LL half trusted
              once its tag is e (polls under a %globaltimer timeout: status [1, row, epoch, q]);
  select      T = the K-th largest key (ord16 score << G | 2^G - 1 - g), 0 for fewer than K
              keys: the boundary score from score histograms, then a tie-break on g;
  outputs     the order-preserving compaction of {key >= T}: ids, this rank's kv_rows through
              the block table, counts, -1 padding;
  saturation  rank q is saturated when all N of its keys were selected and T is not its own;
  rescue      a saturated rank pushes its local top-K into its slot of every rank's rescue row
              and releases flag seq + 1; every rank acquires the flags (timeout: status 2),
              selects round 2 over the other lists and the K-lists, rewrites the outputs;
  row end     griddepcontrol.wait, a failure anywhere voids the row, then epoch[t] = e.

``Merge.__init__`` picks the paths of a ``MergeConfig``: the keys in registers (up to KP_MAX
words per thread) or re-read by a radix select; a row of many words split over a cluster
(sums through DSMEM); round 2 in registers, rolled over shared memory, or by the radix select.
"""

from __future__ import annotations

import dataclasses

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32, Uint64

from .. import layout
from . import abi
from . import common as C
from . import ptx as P
from . import select as S
from .select_push import row_end
from .select_push import smem_bytes as select_push_smem

ABI = abi.MERGE

KP_MAX = 32  # candidate words per thread kept in registers
SCORE_BINS = 1024  # bins of the first score histogram ((s - lo) >> shift)
SCORE_BINS2 = 64  # bins of the second one (the low `shift` bits, shift <= 6)
LOAD_BATCH = 16  # LL records (pairs) per thread in flight at once in round 1
PRE_BT_MAX = 8  # round-1 block-table entries prefetched into registers up to this many words
# Up to this many words per thread the select and stores have no branch per word (W = 8,
# N = 512: -0.4..-1.2 us); at 32 (W = 16, N = 1024) ptxas spilled the words (45.7 -> 71.8 us).
BRANCH_FREE_KP = 18
# Above this many round-1 words per thread the outputs loop is rolled over a shared-memory copy
# (unrolled, W = 16, N = 1024 waited on instruction fetch 53% of the time).
ROLL_KP = 18
# Round 2 rolled: pair groups per thread held by the rescue select's hist1 and mask (free once
# its K-list is pushed); the rest go to stage2.
R2_H = S.NB1 // (2 * C.TB)
R2_M = S.MASK_WORDS // (2 * C.TB)
# A merge CTA starts under PDL beside a producer CTA: round 2 is rolled only where both fit an
# SM's shared memory with the 1 KB reserved per CTA.
CTA_RESERVED_SMEM = 1024
EQ_MAX = abi.MERGE_EQ_MAX  # most keys at the boundary score tie-broken by ranking (one per thread)
# A row of more than CLUS_KP round-1 words per thread is split over a cluster of at most
# CLUS_MAX CTAs (W = 16, N = 1024, H200: 2 CTAs 20.1 us against 4 CTAs 30.7 us at R = 64).
CLUS_KP = 8
CLUS_MAX = 2
# The merge_wide image: clusters of up to CLUS_WIDE CTAs of at least WIDE_KP words, launched
# when every row of a call has its own cluster (W = 16, N = 1024, R = 1: 12.6 against 19.5 us).
CLUS_WIDE = abi.MERGE_CLUS_WIDE
WIDE_KP = 4
CLUS_XC = 16  # words of a clustered CTA's published row totals (MergeSmem.cluster_totals)


@dataclasses.dataclass(frozen=True)
class MergeConfig:
    """What varies between merge images: the exchange's shape, the rescue list (a rescue pushes
    the producer's K-list), and the cluster a row may be split over (merge_wide: ``wide()``)."""

    world: int
    topk: int
    local_topk: int
    rescue_list: bool = False
    max_cluster: int = CLUS_MAX  # the most CTAs of a clustered row
    min_cluster_words: int = CLUS_KP  # the fewest round-1 words per thread of a clustered CTA
    interleave: int = 1  # the KV cache's chunks of I tokens per rank (docs/DESIGN.md §4)
    arch: str = "sm_90a"  # the target (layout.ARCHS)

    def wide(self) -> "MergeConfig":
        return dataclasses.replace(self, max_cluster=CLUS_WIDE, min_cluster_words=WIDE_KP)


# page = (l * page_magic(B)) >> PAGE_SHIFT equals l // B for 0 <= l < 2**17 and B >= 1: the
# excess of m = 2**40 // B + 1 adds less than 2**-23 (tests/test_kernels_compile.py checks it)
PAGE_SHIFT = 40


def page_magic(block_size: int) -> int:
    return (1 << PAGE_SHIFT) // max(int(block_size), 1) + 1


EMPTY_BIN = SCORE_BINS  # the score histogram's extra bin: empty words count there (never read)


class MergeSmem:
    """The merge's shared memory: the rescue select's, then the Int32 arrays of ``parts`` in order.
    Dynamic regions carry tensors, not this object: stores go through a local name of the tensor."""

    def __init__(self, merge: "Merge"):
        smem = cutlass.memory.SmemAllocator()
        # the rescue's local top-K; its row (buf) holds round 1's block-table entries by list index
        self.sel = S.SelectSmem(smem, merge.rw_k, False)
        self.buf = self.sel.row
        for name, words in self.parts(merge):
            setattr(self, name, smem.allocate_tensor(Int32, cute.make_layout((words,)), 16))

    @staticmethod
    def parts(merge: "Merge") -> tuple:
        """(name, words) of each array, in allocation order."""
        return (
            # the radix select of rows read from memory; selected keys per rank
            ("hist", C.TB), ("warp_totals", C.NWARPS), ("scalars", 16), ("rank_counts", 16),
            # round 2's segments: seg[q] rank q's first position, seg[17 + q] its rescue slot (-1: its
            # round-1 list); seg[47]: failed()'s answer
            ("seg", 48),
            # the register path: score histograms, tied keys' g, stats slots ([count, max, min, tied]
            # per row parity and round), selected keys per warp (own << 16 | all) and before each list,
            # found: [0..2] / [3..5] a score histogram's bin, keys above it, its keys; [6] the ranked g;
            # [7] the row's failure flag; [8..10] a g histogram's bin
            ("score_hist", SCORE_BINS + 16), ("score_hist2", SCORE_BINS2), ("tied", EQ_MAX), ("stats", 16),
            ("warp_sel", 16), ("list_start", 32), ("found", 16),
            ("g_hist", SCORE_BINS), ("g_hist2", SCORE_BINS2), ("g_hist3", SCORE_BINS2),
            # round 1's words [word][thread] (roll1); round 2's pair groups past hist1 and mask, and its
            # mask words (roll2)
            ("stage", max(merge.stage_words, 4)), ("stage2", max(merge.stage2_words, 4)),
            ("r2m", max(merge.r2m_words, 4)),
        ) + ((  # a clustered row: the cluster's sums and tied keys, this CTA's totals (read through DSMEM)
            ("cluster_hist", SCORE_BINS), ("cluster_tied", EQ_MAX), ("cluster_totals", CLUS_XC),
        ) if merge.clus > 1 else ())


@dataclasses.dataclass(frozen=True)
class Launch:
    """One thread's view of a launch: its coordinates, the arguments, values derived once
    (immutable: dynamic regions take it as a closure)."""

    tid: Int32
    lane: Int32
    warp: Int32
    peers: Int64
    local: Int64
    state: Int64
    logits: Int64
    row_ends: Int64
    kv_rows: Int64
    counts: Int64
    ids: Int64
    saturated: Int64
    rows: Int32
    cols: Int32
    bt_cols: Int32
    block_size: Int32
    rank: Int32
    max_rows: Int32
    rescue_off: Int64
    flags_off: Int64
    host_status: Int64
    status: Int64  # this rank's status words
    timeout_ns: Int64
    ll_stride: Int64  # bytes from one source rank's LL rows to the next's
    nstep: Int32  # rows between two of this CTA's
    page_div: Uint64  # page_magic(block_size)
    crank: Int32 = None  # (clustered rows) this CTA's rank in its cluster
    cbase: Int32 = None  # (clustered rows) its first position of a row


@dataclasses.dataclass(frozen=True)
class Row:
    """The row a CTA merges now."""

    t: Int32
    ep: Int32  # the epoch this call writes
    seq: Int32  # the row's rescues so far
    ll0: Int64  # its LL row from source rank 0 (parity ep & 1)
    resc0: Int64  # its rescue row, slot 0
    bt_row: Int64  # its request's block-table row
    req_ok: Int32  # 1 when the request is in the block table
    slot: Int32  # its round 1's stats slot (round 2's: slot + 1)


@dataclasses.dataclass(frozen=True)
class Round2Smem:
    """This thread's shared addresses of round 2's rolled copy (Merge.r2_addr)."""

    base: Int32  # its pair groups' place in stage2, less R2_H + R2_M groups
    to_mask: Int32  # from there to the groups in the rescue select's mask
    to_hist: Int32  # from those to the groups in its hist1
    masks: Int32  # the mask words (r2m)
    buf: Int32  # this rank's block-table entries by list index


@dataclasses.dataclass(frozen=True)
class Words:
    """A round's words as the select reads them: kp per thread in registers (regs; round 2: qj[i]
    = q << 16 | j of pair group i), or round 2's rolled copy (grp; segments in qb0 / qb1)."""

    kp: int
    round2: bool
    hbits: Uint32  # bit i: bit 16 of word i's l
    regs: cute.Tensor = None
    qj: cute.Tensor = None
    grp: Round2Smem = None
    qb0: Uint32 = None
    qb1: Uint32 = None


class Merge:
    """The exchange merge of one ``MergeConfig``; ``compile()`` builds its cubin (cached)."""

    def __init__(self, config: MergeConfig):
        world, topk, n = config.world, config.topk, config.local_topk
        layout.check_config(world, topk, n)
        layout.check_kernel_interleave(config.interleave, world)
        self.config, self.world, self.topk, self.n, self.interleave = config, world, topk, n, config.interleave
        self.gbits = layout.gid_bits(world, config.interleave)
        self.keybits = 16 + self.gbits
        self.rw_k = layout.row_words(topk)
        self.klist = S.klist_n2(n, topk, config.rescue_list) > 0  # a rescue pushes the producer's K-list
        self.rescue_row_bytes, self.ll_row_bytes = layout.rescue_row_bytes(topk), layout.ll_row_bytes(n)
        self.slots = layout.rescue_slots(topk, n, world)
        # Round 1 in registers (fast1): kp1 words per thread as pair groups (position
        # v = warp * 32 kp1 + 64 i + 2 lane + h), else the radix select from memory.
        self.nk1 = world * n
        self.kp1 = 2 * -(-self.nk1 // (2 * C.TB))
        self.fast1 = self.kp1 <= KP_MAX
        self.kp1_row = self.kp1  # (the words per thread of a row on one CTA)
        # A clustered row: CTA c holds positions [c cp, (c + 1) cp) (whole lists, each warp's in
        # one list); every CTA takes every decision alike from the cluster's sums, so all pass
        # the same barriers; a rescue runs on CTA 0 alone.
        self.clus = 1
        c = min(config.max_cluster, self.kp1 // max(2, config.min_cluster_words), S.CLUSTER_MAX)
        ck = self.kp1 // c if c > 1 else 0
        if (c > 1 and self.fast1 and ck % 2 == 0 and self.nk1 == c * C.TB * ck
                and world % c == 0 and n % (32 * ck) == 0):
            self.clus, self.kp1 = c, ck
        self.cp = self.nk1 // self.clus  # positions per CTA of a row
        # Round 2 over the non-saturated lists and up to ``slots`` K-lists: in registers (fast2)
        # where its words fit, else the radix select.
        self.nk2max = self.slots * topk + (world - self.slots) * n
        self.kp2 = 2 * -(-self.nk2max // (2 * C.TB))
        self.fast2 = self.slots > 0 and self.kp2 <= KP_MAX
        self.kp = max([2] + [k for k, f in ((self.kp1, self.fast1), (self.kp2, self.fast2)) if f])
        # round 1's block-table entries prefetched into registers, or shared memory for more words
        self.pre_bt = self.fast1 and self.kp1 <= PRE_BT_MAX
        self.roll1 = self.fast1 and self.kp1 > ROLL_KP
        self.stage_words = self.kp1 * C.TB if self.roll1 else 0
        # Clustered rows hold round 1 as contiguous runs (thread t: positions t kp1 ..), counted
        # by one warp scan (W = 16, N = 1024: -0.35..-1.5 us at R = 1-64); on one CTA pair
        # groups won (W = 8, N = 512: runs +0.5 us at R = 1, +3 us at R = 256).
        self.runs = (self.clus > 1 and self.fast1 and not self.roll1 and n % self.kp1 == 0
                     and 32 % self.kp1 == 0)  # fmt: skip
        # Round 2 rolled over shared memory: a third of the register path's code, fetched cold
        # once per rescue (W = 8, N = 512: forced rescue 49.2 -> 40.5 us); at most 16 groups
        # (4-bit segment codes in two registers), where the merge fits beside a producer CTA.
        self.roll2 = False
        self.stage2_words = self.r2m_words = 0
        if self.fast2 and self.kp2 // 2 <= 16:
            self.stage2_words = max(0, self.kp2 // 2 - R2_H - R2_M) * 2 * C.TB
            self.r2m_words = (self.nk2max // 32 + 3) // 4 * 4
            self.roll2 = (self._smem() + select_push_smem(n, topk, config.rescue_list) + 2 * CTA_RESERVED_SMEM
                          <= layout.arch_limits(config.arch).smem_per_sm)  # fmt: skip
            if not self.roll2:
                self.stage2_words = self.r2m_words = 0
        self.smem = self._smem()
        # the rescue select's vectors per round: fewer for many words per thread, where ptxas
        # spilled the whole kernel (W = 16, N = 1024: 45.9 -> 72.1 us)
        self.rescue_u1 = 4 if self.kp1_row > BRANCH_FREE_KP else S.U1
        # A row without a rescue ends before the rescue's ~100 KB of code (W = 8, N = 512:
        # -0.6..-0.9 us); for many words per thread after it (W = 16, N = 1024: +3.5 us otherwise).
        self.end_first = self.kp1 <= BRANCH_FREE_KP
        self._compiled = {}

    def _smem(self) -> int:
        """Launch shared memory (bytes): MergeSmem's parts and slack for their 16-byte alignment (288
        bytes, 320 with a cluster's parts: the sizes roll2 was decided and measured with)."""
        words = sum(w for _, w in MergeSmem.parts(self))
        return S.smem_bytes(self.rw_k, cached=False) + 4 * words + 288 + (32 if self.clus > 1 else 0)

    # ------------------------------------------------------------------ keys and waits
    # Helpers without dynamic control flow are plain methods: the trace runs them inline.

    @cute.jit
    def make_key(self, w: Uint32, m: Uint32, j: Int32, q: Int32) -> Uint64:
        """Word (+ mask word) of list index j of rank q -> ord16 << G | (2^G - 1 - g); 0 if empty."""
        key = Uint64(0)
        if w != Uint32(0):
            hi = (m >> Uint32(j & Int32(31))) & Uint32(1)
            lidx = (Uint32(0xFFFF) - (w & Uint32(0xFFFF))) | (hi << Uint32(16))
            g = Uint64(0)
            if cutlass.const_expr(self.interleave == 1):
                g = Uint64(lidx) * Uint64(self.world) + Uint64(q)
            else:
                g = Uint64(Uint32(self.gpos(Int32(lidx), q)))
            key = (Uint64(w >> Uint32(16)) << Uint64(self.gbits)) | (Uint64((1 << self.gbits) - 1) - g)
        return key

    def probe(self, addr: Int64, flag: bool) -> Uint64:
        """What a wait watches, tag in the high word: an LL half or a rescue flag (acquire.sys)."""
        if flag:
            return Uint64(Uint32(P.ld_acquire_sys(addr))) << Uint64(32)
        return P.ld_volatile_u64(addr)

    @cute.jit
    def wait_tag(self, addr: Int64, want: Int32, flag: cutlass.Constexpr, code: cutlass.Constexpr,
                 q: Int32, ctx: Launch, row: Row) -> Uint64:
        """probe(addr) once its tag is ``want``; a timeout records [code, row, epoch, q], and once
        the status is set every wait gives up at once."""
        h = self.probe(addr, flag)
        if Int32(Uint32(h >> Uint64(32))) != want:
            start = P.globaltimer()
            go = Int32(1)
            while go != Int32(0):
                h = self.probe(addr, flag)
                if Int32(Uint32(h >> Uint64(32))) == want:
                    go = Int32(0)
                elif P.ld_volatile_u32(ctx.status) != Uint32(layout.STATUS_OK):
                    go = Int32(0)
                elif P.globaltimer() - start > ctx.timeout_ns:
                    self.record(Int32(code), q, ctx, row)
                    go = Int32(0)
        return h

    def ll_half(self, addr: Int64, wait: bool, q: Int32, ctx: Launch, row: Row) -> Uint32:
        """Word of the LL half at addr; with ``wait``, once its tag is the row's epoch."""
        if wait:
            h = self.wait_tag(addr, row.ep, False, layout.STATUS_TIMEOUT_ROUND1, q, ctx, row)
        else:
            h = P.ld_volatile_u64(addr)
        return Uint32(h & Uint64(0xFFFFFFFF))

    @cute.jit
    def record(self, code: Int32, q: Int32, ctx: Launch, row: Row):
        """The status [code, row, epoch, rank q], unless a failure was recorded before."""
        old = P.atom_cas_u32(C.status_word(ctx.status, layout.STATUS_CODE), Int32(layout.STATUS_OK), code)
        if old == Int32(layout.STATUS_OK):
            P.st_volatile_u32(C.status_word(ctx.status, layout.STATUS_ROW), row.t)
            P.st_volatile_u32(C.status_word(ctx.status, layout.STATUS_EPOCH), row.ep)
            P.st_volatile_u32(C.status_word(ctx.status, layout.STATUS_RANK), q)

    def ll_key(self, ll_base: Int64, q: Int32, j: Int32, wait: bool, ctx: Launch, row: Row) -> Uint64:
        """Key j of rank q's round-1 list, whose LL row is at ll_base."""
        w = self.ll_half(C.ll_word_addr(ll_base, j), wait, q, ctx, row)
        m = self.ll_half(C.ll_word_addr(ll_base, Int32(self.n) + (j >> Int32(5))), wait, q, ctx, row)
        return self.make_key(w, m, j, q)

    @cute.jit
    def key_r1(self, v: Int32, wait: cutlass.Constexpr, ctx: Launch, row: Row) -> Uint64:
        """Round-1 key at owner-major position v = q * N + j (0 past the end)."""
        key = Uint64(0)
        if v < Int32(self.nk1):
            q, j = self.owner(v, False, None)
            key = self.ll_key(row.ll0 + Int64(q) * ctx.ll_stride, q, j, wait, ctx, row)
        return key

    @cute.jit
    def key_r2(self, v: Int32, seg: cute.Tensor, ctx: Launch, row: Row) -> Uint64:
        """Round-2 key at position v: of rank q's K-list (rescue slot seg[17 + q] >= 0) or its list."""
        key = Uint64(0)
        if v < seg[self.world]:
            q, j = self.owner(v, True, seg)
            s = seg[17 + q]
            if s >= Int32(0):
                base = row.resc0 + Int64(s) * Int64(self.rescue_row_bytes)
                w = P.ld_volatile_u32(base + Int64(j) * Int64(4))
                m = P.ld_volatile_u32(base + Int64(Int32(self.topk) + (j >> Int32(5))) * Int64(4))
                key = self.make_key(w, m, j, q)
            else:
                key = self.ll_key(row.ll0 + Int64(q) * ctx.ll_stride, q, j, False, ctx, row)
        return key

    # ------------------------------------------------------------------ rows read from memory
    # More than KP_MAX words per thread: a radix select over the keys, re-read on every pass.

    @cute.jit
    def hist_add(self, key: Uint64, hi: Int32, lo: Int32, prefix: Uint64, hist: cute.Tensor):
        d = Int32((key >> Uint64(lo)) & ((Uint64(1) << Uint64(hi - lo)) - Uint64(1)))
        C.hist_inc(hist, d, key != Uint64(0) and (key >> Uint64(hi)) == prefix)

    @cute.jit
    def find_key(self, key: Uint64, hi: Int32, prefix: Uint64, scalars: cute.Tensor):
        if key != Uint64(0) and (key >> Uint64(hi)) == prefix:
            scalars[8] = Int32(Uint32(key & Uint64(0xFFFFFFFF)))
            scalars[9] = Int32(Uint32(key >> Uint64(32)))

    def key_at(self, v: Int32, round2: bool, seg: cute.Tensor, ctx: Launch, row: Row) -> Uint64:
        return self.key_r2(v, seg, ctx, row) if round2 else self.key_r1(v, False, ctx, row)

    @cute.jit
    def radix_select(self, round2: cutlass.Constexpr, sm: MergeSmem, ctx: Launch, row: Row) -> Uint64:
        """The K-th largest nonzero key (0 if fewer than K): digits from the top, the K-th key's
        bin the next prefix; a bin of one key ends with one more read pass.  CTA-uniform."""
        tid = ctx.tid
        hist, scalars, seg, warp_totals = sm.hist, sm.scalars, sm.seg, sm.warp_totals
        hi, prefix, need, kth = Int32(self.keybits), Uint64(0), Int32(self.topk), Uint64(0)
        done, first = Int32(0), Int32(1)
        nk = self.nk_of(round2, seg)
        while done == Int32(0):
            lo = hi - Int32(C.DIGIT)
            if lo < Int32(0):
                lo = Int32(0)
            hist[tid] = Int32(0)
            cute.arch.sync_threads()
            for v in cutlass.range(tid, nk, C.TB, unroll=1):
                self.hist_add(self.key_at(v, round2, seg, ctx, row), hi, lo, prefix, hist)
            cute.arch.sync_threads()
            nb = Int32(1) << (hi - lo)
            total = C.find_bin(hist, nb, need, tid, ctx.lane, ctx.warp, warp_totals, scalars, 0)
            if first == Int32(1) and total < Int32(self.topk):
                done = Int32(1)  # fewer than K keys: all are selected
            else:
                b, cnt = scalars[0], scalars[2]
                prefix = (prefix << Uint64(hi - lo)) | Uint64(b)
                need = need - scalars[1]
                hi = lo
                if hi == Int32(0):
                    kth = prefix
                    done = Int32(1)
                elif cnt == Int32(1):
                    for v in cutlass.range(tid, nk, C.TB, unroll=1):
                        self.find_key(self.key_at(v, round2, seg, ctx, row), hi, prefix, scalars)
                    cute.arch.sync_threads()
                    kth = (Uint64(Uint32(scalars[9])) << Uint64(32)) | Uint64(Uint32(scalars[8]))
                    done = Int32(1)
            first = Int32(0)
            cute.arch.sync_threads()
        return kth

    def nk_of(self, round2: bool, seg: cute.Tensor):
        """The keys of a round: round 2's from its segments."""
        return seg[self.world] if round2 else Int32(self.nk1)

    @cute.jit
    def emit_chunk(self, key: Uint64, kth: Uint64, count_ranks: cutlass.Constexpr, sm: MergeSmem,
                   all_run: Int32, own_run: Int32, ctx: Launch, row: Row):
        """One TB-chunk of the compaction of {key >= kth}; returns the new (all_run, own_run)."""
        rank_counts = sm.rank_counts
        sel = key != Uint64(0) and key >= kth
        g, q, flag = Int32(0), Int32(0), Int32(0)
        if sel:
            g = Int32(Uint64((1 << self.gbits) - 1) - (key & Uint64((1 << self.gbits) - 1)))
            q = self.owner_of(g)
            flag = Int32(1)
            if q == ctx.rank:
                flag = Int32(1 + (1 << 16))
        incl, tot = C.block_scan(flag, ctx.lane, ctx.warp, sm.warp_totals)
        excl = incl - flag
        if sel:
            pos = all_run + (excl & Int32(0xFFFF))
            if ctx.ids != Int64(0):
                P.st_u32(ctx.ids + (Int64(row.t) * Int64(self.topk) + Int64(pos)) * Int64(4), g)
            if cutlass.const_expr(count_ranks):
                cute.arch.atomic_add(rank_counts.iterator + q, Int32(1), sem="relaxed", scope="cta")
            if q == ctx.rank:
                kpos = own_run + (excl >> Int32(16))
                slot = self.kv_slot(self.local_of(g), ctx, row)
                P.st_u32(ctx.kv_rows + (Int64(row.t) * Int64(self.topk) + Int64(kpos)) * Int64(4), slot)
        return all_run + (tot & Int32(0xFFFF)), own_run + (tot >> Int32(16))

    @cute.jit
    def emit(self, round2: cutlass.Constexpr, kth: Uint64, sm: MergeSmem, ctx: Launch, row: Row):
        """The row's outputs of {key >= kth}, -1 padded; round 1 also counts each rank's (rank_counts)."""
        tid, t = ctx.tid, row.t
        rank_counts, seg = sm.rank_counts, sm.seg
        if tid < Int32(16):
            rank_counts[tid] = Int32(0)
        cute.arch.sync_threads()
        all_run, own_run = Int32(0), Int32(0)
        nk = self.nk_of(round2, seg)
        for base in cutlass.range(0, nk, C.TB, unroll=1):
            v = base + tid
            key = Uint64(0)
            if cutlass.const_expr(round2):
                if v < nk:
                    key = self.key_r2(v, seg, ctx, row)
            else:
                key = self.key_r1(v, False, ctx, row)
            all_run, own_run = self.emit_chunk(key, kth, not round2, sm, all_run, own_run, ctx, row)
        # (all_run, own_run are CTA-uniform block totals)
        for i in cutlass.range(own_run + tid, self.topk, C.TB, unroll=1):
            P.st_u32(ctx.kv_rows + (Int64(t) * Int64(self.topk) + Int64(i)) * Int64(4), Int32(-1))
        if ctx.ids != Int64(0):
            for i in cutlass.range(all_run + tid, self.topk, C.TB, unroll=1):
                P.st_u32(ctx.ids + (Int64(t) * Int64(self.topk) + Int64(i)) * Int64(4), Int32(-1))
        if tid == Int32(0):
            P.st_u32(ctx.counts + Int64(t) * Int64(4), own_run)
        cute.arch.sync_threads()

    # ------------------------------------------------------------------ the block table

    def page_of(self, lidx: Int32, ctx: Launch) -> Int32:
        """lidx // block_size by a multiply (page_magic): no division, no branch per key."""
        return Int32((Uint64(lidx) * ctx.page_div) >> Uint64(PAGE_SHIFT))

    def lidx_of(self, w: Uint32, hbits: Uint32, i) -> Int32:
        """Local index l of word i (bit 16 from hbits)."""
        return Int32(Uint32(0xFFFF) - (w & Uint32(0xFFFF))) | (Int32((hbits >> Uint32(i)) & Uint32(1)) << Int32(16))

    @cute.jit
    def kv_slot(self, lidx: Int32, ctx: Launch, row: Row) -> Int32:
        """block_table[req, l // B] * B + l % B; -1 (no load) if the request or page is out of range."""
        slot = Int32(-1)
        if row.req_ok != Int32(0):
            page = self.page_of(lidx, ctx)
            if page < ctx.bt_cols:
                blk = P.ld_u32(row.bt_row + Int64(page) * Int64(4))
                slot = blk * ctx.block_size + (lidx - page * ctx.block_size)
        return slot

    @cute.jit
    def kv_slot_of(self, entry: Int32, lidx: Int32, ctx: Launch, row: Row) -> Int32:
        """kv_slot from the entry of l's page loaded before (any value where out of range)."""
        page = self.page_of(lidx, ctx)
        slot = entry * ctx.block_size + (lidx - page * ctx.block_size)
        if row.req_ok == Int32(0) or page >= ctx.bt_cols:
            slot = Int32(-1)
        return slot

    # ------------------------------------------------------------------ rows in registers
    # Words ord16 << 16 | 0xFFFF - (l & 0xFFFF), kp per thread (bit i of hbits: bit 16 of word i's
    # l).  Pair groups: positions v = warp * 32 kp + 64 i + 2 lane + h, a warp's group one 512-byte
    # stretch of LL records; runs (clustered round 1): positions t kp .. t kp + kp - 1.

    def pair_pos(self, i: int, kp: int, ctx: Launch) -> Int32:
        v = ctx.warp * Int32(32 * kp) + Int32(i * 64) + Int32(2) * ctx.lane
        return v + ctx.cbase if self.clus > 1 else v  # (cbase is 0 in CTA 0, which runs round 2)

    def pos1(self, i: int, kp: int, ctx: Launch) -> Int32:
        """Round 1's position of this thread's pair group i."""
        if not self.runs:
            return self.pair_pos(i, kp, ctx)
        v = (ctx.warp * Int32(32) + ctx.lane) * Int32(kp) + Int32(2 * i)
        return v + ctx.cbase if self.clus > 1 else v

    @cute.jit
    def owner(self, v: Int32, round2: cutlass.Constexpr, seg: cute.Tensor):
        """(segment q, index j in it) of position v."""
        q, j = Int32(0), Int32(0)
        if cutlass.const_expr(round2):
            for r in cutlass.range_constexpr(1, self.world):
                if seg[r] <= v:
                    q = Int32(r)
            j = v - seg[q]
        else:
            q = v // Int32(self.n)
            j = v - q * Int32(self.n)
        return q, j

    def owner_p(self, ip: int, src: Words, seg: cute.Tensor, ctx: Launch):
        """owner() of this thread's pair group ip (round 2: from qj, not W - 1 shared loads)."""
        if not src.round2:
            return self.owner(self.pos1(ip, src.kp, ctx), False, seg)
        x = src.qj[ip]
        return x >> Int32(16), x & Int32(0xFFFF)

    @cute.jit
    def tied_owner(self, ip: cutlass.Constexpr, src: Words, vth: Int32, seg: cute.Tensor, ctx: Launch) -> Int32:
        """The segment of pair group ip where one of its words has score vth (else 0)."""
        q, j = Int32(0), Int32(0)
        if Int32(src.regs[2 * ip] >> Uint32(16)) == vth or Int32(src.regs[2 * ip + 1] >> Uint32(16)) == vth:
            q, j = self.owner_p(ip, src, seg, ctx)
        return q

    def gid(self, w: Uint32, hbits: Uint32, i, q: Int32) -> Int32:
        """The global position of word i of segment q."""
        return self.gpos(self.lidx_of(w, hbits, i), q)

    # Global positions (layout.global_position): chunk c of I tokens of rank q at (c W + q) I ..;
    # a power-of-two I takes shifts and masks.

    def gpos(self, lidx: Int32, q: Int32) -> Int32:
        """The global position of local index lidx of rank q."""
        W, I = self.world, self.interleave
        if I == 1:
            return lidx * Int32(W) + q
        if I & (I - 1) == 0:
            s = I.bit_length() - 1
            return ((lidx >> Int32(s)) * Int32(W) + q) * Int32(I) + (lidx & Int32(I - 1))
        return ((lidx // Int32(I)) * Int32(W) + q) * Int32(I) + lidx % Int32(I)

    def owner_of(self, g: Int32) -> Int32:
        """The rank that holds global position g."""
        W, I = self.world, self.interleave
        if I == 1:
            return g % Int32(W)
        if I & (I - 1) == 0:
            return (g >> Int32(I.bit_length() - 1)) % Int32(W)
        return (g // Int32(I)) % Int32(W)

    def local_of(self, g: Int32) -> Int32:
        """Its local index on that rank."""
        W, I = self.world, self.interleave
        if I == 1:
            return g // Int32(W)
        if I & (I - 1) == 0:
            s = I.bit_length() - 1
            return ((g >> Int32(s)) // Int32(W) << Int32(s)) + (g & Int32(I - 1))
        return (g // Int32(I * W)) * Int32(I) + g % Int32(I)

    def pair_addr(self, i: int, v: Int32, ctx: Launch, row: Row) -> Int64:
        """Address of the LL record of this thread's round-1 pair group i (position v): a base and
        a constant offset where a warp's (runs: a thread's) positions lie in one list."""
        kp = self.kp1
        if not self.runs and self.n % (32 * kp) != 0:
            q, j = self.owner(v, False, None)
            return C.ll_word_addr(row.ll0 + Int64(q) * ctx.ll_stride, j)
        v0 = (ctx.warp * Int32(32) + ctx.lane) * Int32(kp) if self.runs else ctx.warp * Int32(32 * kp)
        if self.clus > 1:
            v0 = v0 + ctx.cbase
        q0 = v0 // Int32(self.n)
        j0 = v0 - q0 * Int32(self.n)
        if self.runs:
            return row.ll0 + Int64(q0) * ctx.ll_stride + Int64(j0 >> Int32(1)) * Int64(16) + Int64(i * 16)
        return row.ll0 + Int64(q0) * ctx.ll_stride + Int64((j0 >> Int32(1)) + ctx.lane) * Int64(16) + Int64(i * 512)

    def mask_addr(self, v: Int32, ctx: Launch, row: Row) -> Int64:
        """Address of the LL half of the mask word of position v."""
        q, j = self.owner(v, False, None)
        return C.ll_word_addr(row.ll0 + Int64(q) * ctx.ll_stride, Int32(self.n) + (j >> Int32(5)))

    def stale(self, half: Uint64, ep: Int32):
        """Whether an LL half (word | tag << 32) is not yet the row's (tag ep)."""
        return Int32(Uint32(half >> Uint64(32))) != ep

    def add_hbits(self, hbits: Uint32, m: Uint32, j: Int32, i: int) -> Uint32:
        """hbits with bits 2i, 2i + 1 from the mask word m's bits of list indices j, j + 1."""
        sh = Uint32(j & Int32(31))
        return hbits | (((m >> sh) & Uint32(1)) << Uint32(2 * i)) | (
            ((m >> (sh + Uint32(1))) & Uint32(1)) << Uint32(2 * i + 1))

    @cute.jit
    def load_r1(self, words: cute.Tensor, hb: cute.Tensor, ctx: Launch, row: Row):
        """Round 1's words into registers: a batch's LL records and mask halves all loaded before
        any tag is checked.  A half-warp's group shares a mask word: lane k < kp loads that of
        (group k >> 1, half k & 1) and shuffles it (runs: each thread loads its own)."""
        kp = self.kp1
        npairs = kp // 2
        batch = min(npairs, LOAD_BATCH)
        half0 = cute.make_rmem_tensor((batch,), Uint64)
        half1 = cute.make_rmem_tensor((batch,), Uint64)
        good = Uint64(row.ep) << Uint64(32)  # past the end: an empty word with the right tag
        mhalf = good
        mpos = ctx.warp * Int32(32 * kp) + (ctx.lane >> Int32(1)) * Int32(64) + (ctx.lane & Int32(1)) * Int32(32)
        if cutlass.const_expr(self.runs):
            mpos = (ctx.warp * Int32(32) + ctx.lane) * Int32(kp)
        if cutlass.const_expr(self.clus > 1):
            mpos = mpos + ctx.cbase
        if cutlass.const_expr(self.runs):
            if mpos < Int32(self.nk1):
                mhalf = P.ld_volatile_u64(self.mask_addr(mpos, ctx, row))
        elif ctx.lane < Int32(kp) and mpos < Int32(self.nk1):
            mhalf = P.ld_volatile_u64(self.mask_addr(mpos, ctx, row))
        hbits, mword = Uint32(0), Uint32(0)
        for b0 in cutlass.range_constexpr(0, npairs, batch):
            for k in cutlass.range_constexpr(min(batch, npairs - b0)):
                v = self.pos1(b0 + k, kp, ctx)
                half0[k] = half1[k] = good
                if v < Int32(self.nk1):
                    half0[k], half1[k] = P.ld_volatile_v2_u64(self.pair_addr(b0 + k, v, ctx, row))
            mhalf = self.settle_batch(half0, half1, mhalf, mpos, b0, batch, ctx, row)
            if cutlass.const_expr(b0 == 0):
                mword = Uint32(mhalf & Uint64(0xFFFFFFFF))
            for k in cutlass.range_constexpr(min(batch, npairs - b0)):
                i = b0 + k
                q, j = self.owner(self.pos1(i, kp, ctx), False, None)
                w0 = Uint32(half0[k] & Uint64(0xFFFFFFFF))
                w1 = Uint32(half1[k] & Uint64(0xFFFFFFFF))
                m = mword
                if cutlass.const_expr(not self.runs):
                    m = cute.arch.shuffle_sync(mword, Int32(2 * i) + (ctx.lane >> Int32(4)))
                words[2 * i], words[2 * i + 1] = w0, w1
                hbits = self.add_hbits(hbits, m, j, i)
        hb[0] = hbits

    @cute.jit
    def settle_batch(self, half0: cute.Tensor, half1: cute.Tensor, mhalf: Uint64, mpos: Int32,
                     b0: cutlass.Constexpr, batch: cutlass.Constexpr, ctx: Launch, row: Row) -> Uint64:
        """Every half of a loaded batch (batch 0: and the mask half) with the row's tag; returns
        the mask half.  The polls sit behind one rarely taken branch (cold fetch stalled)."""
        ep = row.ep
        npairs = self.kp1 // 2
        bad = Int32(0)
        if cutlass.const_expr(b0 == 0):
            bad = Int32(self.stale(mhalf, ep))
        for k in cutlass.range_constexpr(min(batch, npairs - b0)):
            bad = bad | Int32(self.stale(half0[k], ep)) | Int32(self.stale(half1[k], ep))
        if bad != Int32(0):
            mhalf, bad = self.poll_batch(half0, half1, mhalf, mpos, b0, batch, ctx, row)
        if bad != Int32(0):
            if cutlass.const_expr(b0 == 0):
                if self.stale(mhalf, ep):
                    q, j = self.owner(mpos, False, None)
                    mhalf = Uint64(self.ll_half(self.mask_addr(mpos, ctx, row), True, q, ctx, row))
            for k in cutlass.range_constexpr(min(batch, npairs - b0)):
                i = b0 + k
                v = self.pos1(i, self.kp1, ctx)
                q, j = self.owner(v, False, None)
                if self.stale(half0[k], ep):
                    half0[k] = Uint64(self.ll_half(self.pair_addr(i, v, ctx, row), True, q, ctx, row))
                if self.stale(half1[k], ep):
                    a1 = self.pair_addr(i, v, ctx, row) + Int64(layout.LL_HALF_BYTES)
                    half1[k] = Uint64(self.ll_half(a1, True, q, ctx, row))
        return mhalf

    @cute.jit
    def poll_batch(self, half0: cute.Tensor, half1: cute.Tensor, mhalf: Uint64, mpos: Int32,
                   b0: cutlass.Constexpr, batch: cutlass.Constexpr, ctx: Launch, row: Row):
        """Re-load every stale half of a batch together, predicated, until none is stale (a merge
        under PDL finds its own list stale: one wait per half cost a round trip each); returns
        (mhalf, bad), bad != 0 after a timeout (recorded here) or a failure elsewhere."""
        ep, kp = row.ep, self.kp1
        npairs = kp // 2
        start = P.globaltimer()
        bad, go = Int32(1), Int32(1)
        while go != Int32(0):
            status_word = P.ld_volatile_u32(ctx.status)
            qbad = Int32(-1)
            if cutlass.const_expr(b0 == 0):
                stale = Int32(self.stale(mhalf, ep))
                fresh = P.ld_volatile_u64_if(self.mask_addr(mpos, ctx, row), stale)
                if stale != Int32(0):
                    mhalf = fresh
            for k in cutlass.range_constexpr(min(batch, npairs - b0)):
                v = self.pos1(b0 + k, kp, ctx)
                a0 = self.pair_addr(b0 + k, v, ctx, row)
                s0, s1 = Int32(self.stale(half0[k], ep)), Int32(self.stale(half1[k], ep))
                n0 = P.ld_volatile_u64_if(a0, s0)
                n1 = P.ld_volatile_u64_if(a0 + Int64(layout.LL_HALF_BYTES), s1)
                if s0 != Int32(0):
                    half0[k] = n0
                if s1 != Int32(0):
                    half1[k] = n1
            bad = Int32(0)
            if cutlass.const_expr(b0 == 0):
                if self.stale(mhalf, ep):
                    bad = Int32(1)
                    qm, jm = self.owner(mpos, False, None)
                    qbad = qm
            for k in cutlass.range_constexpr(min(batch, npairs - b0)):
                if Int32(self.stale(half0[k], ep)) | Int32(self.stale(half1[k], ep)) != Int32(0):
                    bad = Int32(1)
                    q, j = self.owner(self.pos1(b0 + k, kp, ctx), False, None)
                    qbad = q
            if bad == Int32(0):
                go = Int32(0)
            elif status_word != Uint32(layout.STATUS_OK):
                go = Int32(0)
            elif P.globaltimer() - start > ctx.timeout_ns:
                self.record(Int32(layout.STATUS_TIMEOUT_ROUND1), qbad, ctx, row)
                go = Int32(0)
        return mhalf, bad

    @cute.jit
    def load_r2(self, words: cute.Tensor, hb: cute.Tensor, seg: cute.Tensor, qj: cute.Tensor, ctx: Launch, row: Row):
        """Round 2's words into registers from each segment's K-list or LL list (tags checked in
        round 1); qj[i] = q << 16 | j.  Both sources' loads predicated: all in flight together."""
        kp = self.kp2
        nk = seg[self.world]
        hbits = Uint32(0)
        for i in cutlass.range_constexpr(kp // 2):
            v = self.pair_pos(i, kp, ctx)
            inr = Int32(v < nk)
            q, j = self.owner(v, True, seg)
            qj[i] = ((q << Int32(16)) | j) & (Int32(0) - inr)
            s = seg[17 + q]
            pr, pl = inr & Int32(s >= Int32(0)), inr & Int32(s < Int32(0))
            rbase = row.resc0 + Int64(cutlass.max(s, Int32(0))) * Int64(self.rescue_row_bytes)
            lbase = row.ll0 + Int64(q) * ctx.ll_stride
            d = P.ld_volatile_u64_if(rbase + Int64(j) * Int64(4), pr)
            mr = P.ld_volatile_u32_if(rbase + Int64(Int32(self.topk) + (j >> Int32(5))) * Int64(4), pr)
            a, c = P.ld_volatile_v2_u64_if(C.ll_word_addr(lbase, j), pl)
            ml = Uint32(P.ld_volatile_u64_if(C.ll_word_addr(lbase, Int32(self.n) + (j >> Int32(5))), pl)
                        & Uint64(0xFFFFFFFF))  # fmt: skip
            # (a predicated-off load leaves 0, so the two sources can be or-ed)
            w0 = Uint32(d & Uint64(0xFFFFFFFF)) | Uint32(a & Uint64(0xFFFFFFFF))
            w1 = Uint32(d >> Uint64(32)) | Uint32(c & Uint64(0xFFFFFFFF))
            hbits = self.add_hbits(hbits, mr | ml, j, i)
            words[2 * i], words[2 * i + 1] = w0, w1
        hb[0] = hbits

    @cute.jit
    def prefetch_bt(self, words: cute.Tensor, hb: cute.Tensor, btp: cute.Tensor, ctx: Launch, row: Row):
        """Block-table entries of this rank's round-1 keys, in flight during the select."""
        kp = self.kp1
        hbits = hb[0]
        for ip in cutlass.range_constexpr(kp // 2):
            q, j = self.owner(self.pos1(ip, kp, ctx), False, None)
            for h in cutlass.range_constexpr(2):
                i = 2 * ip + h
                page = self.page_of(self.lidx_of(words[i], hbits, i), ctx)
                ok = Int32(q == ctx.rank) & Int32(words[i] != Uint32(0)) & row.req_ok & Int32(page < ctx.bt_cols)
                btp[i] = P.ld_u32_if(row.bt_row + Int64(page) * Int64(4), ok)

    @cute.jit
    def prefetch_bt_smem(self, words: cute.Tensor, hb: cute.Tensor, buf: cute.Tensor, ctx: Launch, row: Row):
        """prefetch_bt into buf[j] (j: list index; buf is free until a rescue), loads first."""
        kp = self.kp1
        hbits = hb[0]
        entries = cute.make_rmem_tensor((kp,), Int32)
        for ip in cutlass.range_constexpr(kp // 2):
            q, j = self.owner(self.pos1(ip, kp, ctx), False, None)
            entries[2 * ip] = Int32(0)
            entries[2 * ip + 1] = Int32(0)
            if q == ctx.rank:  # (warp-uniform where a warp's positions lie in one list)
                for h in cutlass.range_constexpr(2):
                    i = 2 * ip + h
                    page = self.page_of(self.lidx_of(words[i], hbits, i), ctx)
                    ok = Int32(words[i] != Uint32(0)) & row.req_ok & Int32(page < ctx.bt_cols)
                    entries[i] = P.ld_u32_if(row.bt_row + Int64(page) * Int64(4), ok)
        for ip in cutlass.range_constexpr(kp // 2):
            q, j = self.owner(self.pos1(ip, kp, ctx), False, None)
            if q == ctx.rank:
                buf[j] = entries[2 * ip]
                buf[j + Int32(1)] = entries[2 * ip + 1]

    # ------------------------------------------------------------------ the score select
    # The boundary score from a histogram of (s - lo) >> shift, a second over the low shift bits,
    # then a tie-break on g among that score's keys; sums are the CTA's or the cluster's.

    @cute.jit
    def warp_find_bin(self, hist: cute.Tensor, nb: cutlass.Constexpr, need: Int32, lane,
                      found: cute.Tensor, slot: cutlass.Constexpr):
        """One warp: the bin of the need-th element from the top -> found[slot ..] = bin, elements
        above it, its count (a scan of per-lane sums finds the lane, then one of its bins)."""
        per = nb // 32
        assert per * 32 == nb and per & (per - 1) == 0, nb
        s = Int32(0)
        for u in cutlass.range_constexpr(per):
            s = s + hist[Int32(nb - 1 - u) - lane * Int32(per)]
        incl = C.warp_incl_scan(s, lane)
        excl = incl - s
        bal = Uint32(cute.arch.vote_ballot_sync(excl < need and incl >= need))
        c = Int32(cute.arch.popc((bal & (~bal + Uint32(1))) - Uint32(1)))  # lowest set lane
        base = cute.arch.shuffle_sync(excl, c)
        x = Int32(0)
        b = Int32(nb - 1) - c * Int32(per) - lane
        if lane < Int32(per):
            x = hist[b]
        incl2 = C.warp_incl_scan(x, lane) + base
        excl2 = incl2 - x
        if lane < Int32(per) and x > Int32(0) and excl2 < need and incl2 >= need:
            found[slot] = b
            found[slot + 1] = excl2
            found[slot + 2] = x

    @cute.jit
    def find_bin(self, hist: cute.Tensor, nb: cutlass.Constexpr, need: Int32, slot: cutlass.Constexpr,
                 cl: cutlass.Constexpr, sm: MergeSmem, ctx: Launch):
        """warp_find_bin by warp 0 between two block barriers, into sm.found; ``cl``: over the
        cluster's sum of ``hist`` (thread k sums bins 4k .. 4k + 3 of every CTA through DSMEM)."""
        tid = ctx.tid
        if cutlass.const_expr(cl):
            summed = sm.cluster_hist
            P.cluster_sync_local()
            h_a = P.smem_addr(hist) + tid * Int32(16)
            if tid < Int32(nb // 4):
                sums = [Int32(0)] * 4
                for r in cutlass.range_constexpr(self.clus):
                    part = P.ld_dsmem_v4(P.mapa(h_a, Int32(r)))
                    sums = [sums[u] + part[u] for u in range(4)]
                summed[Int32(4) * tid] = sums[0]
                for u in cutlass.range_constexpr(1, 4):
                    summed[Int32(4) * tid + Int32(u)] = sums[u]
            hist = summed
        cute.arch.sync_threads()
        if ctx.warp == Int32(0):
            self.warp_find_bin(hist, nb, need, ctx.lane, sm.found, slot)
        cute.arch.sync_threads()

    @cute.jit
    def word_stats(self, words: cute.Tensor, kp: cutlass.Constexpr):
        """(count, max, min) of this thread's nonzero scores; branch-free up to BRANCH_FREE_KP."""
        cnt, mx, mn = Int32(0), Int32(0), Int32(0xFFFF)
        for i in cutlass.range_constexpr(kp):
            sv = Int32(words[i] >> Uint32(16))
            if cutlass.const_expr(kp > BRANCH_FREE_KP):
                if sv != Int32(0):
                    cnt = cnt + Int32(1)
                    mx = cutlass.max(mx, sv)
                    mn = cutlass.min(mn, sv)
            else:
                nz = Int32(sv != Int32(0))
                cnt = cnt + nz
                mx = cutlass.max(mx, sv)
                mn = cutlass.min(mn, sv | ((nz - Int32(1)) & Int32(0xFFFF)))
        return cnt, mx, mn

    @cute.jit
    def publish_stats(self, cnt: Int32, mx: Int32, mn: Int32, slot: Int32, sm: MergeSmem, ctx: Launch,
                      cl: cutlass.Constexpr = False):
        """This thread's count / max / min -> the CTA's (``cl``: the cluster's) in stats slot
        ``slot``, the histograms cleared; returns (count, min, max - min)."""
        tid = ctx.tid
        stats, score_hist, score_hist2 = sm.stats, sm.score_hist, sm.score_hist2
        g_hist, g_hist2, g_hist3 = sm.g_hist, sm.g_hist2, sm.g_hist3
        cnt = cute.arch.warp_redux_sync(cnt, "add")
        mx = cute.arch.warp_redux_sync(mx, "max")
        mn = cute.arch.warp_redux_sync(mn, "min")
        if ctx.lane == Int32(0):
            cute.arch.atomic_add(stats.iterator + slot * Int32(4), cnt, sem="relaxed", scope="cta")
            cute.arch.atomic_max(stats.iterator + slot * Int32(4) + Int32(1), mx, sem="relaxed", scope="cta")
            cute.arch.atomic_min(stats.iterator + slot * Int32(4) + Int32(2), mn, sem="relaxed", scope="cta")
        for u in cutlass.range_constexpr(SCORE_BINS // C.TB):
            score_hist[tid + Int32(u * C.TB)] = Int32(0)
        for u in cutlass.range_constexpr(SCORE_BINS // C.TB):
            g_hist[tid + Int32(u * C.TB)] = Int32(0)
        if tid < Int32(SCORE_BINS2):
            score_hist2[tid] = Int32(0)
            g_hist2[tid] = Int32(0)
            g_hist3[tid] = Int32(0)
        if cutlass.const_expr(cl):
            P.cluster_sync_local()
            stats_a = P.smem_addr(stats) + slot * Int32(16)
            tot, hi, lo = Int32(0), Int32(0), Int32(0xFFFF)
            for r in cutlass.range_constexpr(self.clus):
                a, b, c, _ = P.ld_dsmem_v4(P.mapa(stats_a, Int32(r)))
                tot = tot + a
                hi = cutlass.max(hi, b)
                lo = cutlass.min(lo, c)
        else:
            cute.arch.sync_threads()
            lo = stats[slot * Int32(4) + Int32(2)]
            tot = stats[slot * Int32(4)]
            hi = stats[slot * Int32(4) + Int32(1)]
        return tot, lo, hi - lo

    @cute.jit
    def score_boundary(self, src: Words, lo: Int32, rng: Int32, sm: MergeSmem, ctx: Launch,
                       cl: cutlass.Constexpr = False):
        """(boundary score, keys above it, keys at it) of a row of at least K keys."""
        K = self.topk
        found = sm.found
        shift = Int32(0)
        while (rng >> shift) >= Int32(SCORE_BINS):
            shift = shift + Int32(1)
        self.fill_score_hist(src, lo, shift, P.smem_addr(sm.score_hist))
        self.find_bin(sm.score_hist, SCORE_BINS, Int32(K), 0, cl, sm, ctx)
        b, above, m = found[0], found[1], found[2]
        vth = lo + (b << shift)
        if shift > Int32(0):
            self.fill_score_hist(src, lo, shift, sm.score_hist2, b, (Int32(1) << shift) - Int32(1))
            self.find_bin(sm.score_hist2, SCORE_BINS2, Int32(K) - above, 3, cl, sm, ctx)
            vth = vth + found[3]
            above = above + found[4]
            m = found[5]
        return vth, above, m

    @cute.jit
    def fill_score_hist(self, src: Words, lo: Int32, shift: Int32, hist, b: Int32 = None, low: Int32 = None):
        """Count the words' scores in the first histogram (hist: its shared address) or, given the
        first's bin b, those in b in the second (hist: the tensor; low: the mask of the low bits)."""
        if cutlass.const_expr(src.grp is None):
            for i in cutlass.range_constexpr(src.kp):
                self.add_score(Int32(src.regs[i] >> Uint32(16)), lo, shift, hist, b, low, src.kp > BRANCH_FREE_KP)
        else:
            for p in cutlass.range(src.kp // 2, unroll=1):
                w0, w1 = P.ld_smem_v2(self.r2_addr(p, src.grp))
                for h in cutlass.range_constexpr(2):
                    self.add_score(Int32(Uint32((w0, w1)[h]) >> Uint32(16)), lo, shift, hist, b, low, False)

    @cute.jit
    def add_score(self, sv: Int32, lo: Int32, shift: Int32, hist, b: Int32, low: Int32, branchy: cutlass.Constexpr):
        """fill_score_hist of score sv (the first histogram: an empty word in EMPTY_BIN, no branch)."""
        if cutlass.const_expr(b is not None):
            if sv != Int32(0) and ((sv - lo) >> shift) == b:
                cute.arch.atomic_add(hist.iterator + ((sv - lo) & low), Int32(1), sem="relaxed", scope="cta")
        elif cutlass.const_expr(branchy):
            if sv != Int32(0):
                P.red_smem_add(hist + ((sv - lo) >> shift) * Int32(4), Int32(1))
        else:
            b_ = Int32(EMPTY_BIN)
            if sv != Int32(0):
                b_ = (sv - lo) >> shift
            P.red_smem_add(hist + b_ * Int32(4), Int32(1))

    @cute.jit
    def tie_break(self, src: Words, vth: Int32, m: Int32, need: Int32, slot: Int32, sm: MergeSmem, ctx: Launch,
                  cl: cutlass.Constexpr = False) -> Int32:
        """The need-th smallest g among the m keys of score vth; a rolled round 2 skips it where
        all of them are selected (W = 8, N = 512: forced rescue 40.8 -> 34.0 us)."""
        g_last = Int32(-1)
        if cutlass.const_expr(src.grp is None):
            g_last = self.tie_search(src, vth, m, need, slot, sm, ctx, cl)
        else:
            whole = Int32(need == m)
            if whole != Int32(0):
                g_last = Int32((1 << self.gbits) - 1)
            else:
                g_last = self.tie_search(src, vth, m, need, slot, sm, ctx, cl)
        return g_last

    @cute.jit
    def tie_search(self, src: Words, vth: Int32, m: Int32, need: Int32, slot: Int32, sm: MergeSmem, ctx: Launch,
                   cl: cutlass.Constexpr) -> Int32:
        """tie_break: up to EQ_MAX keys ranked one per thread, more by histograms of g."""
        g_last = Int32(-1)
        if m <= Int32(EQ_MAX):
            # the g of every key at score vth into sm.tied (places from the slot's tied count)
            c = self.count_tied(src, vth)
            if c != Int32(0):
                pos = cute.arch.atomic_add(sm.stats.iterator + slot * Int32(4) + Int32(3), c, sem="relaxed",
                                           scope="cta")  # fmt: skip
                self.store_tied(src, vth, pos, sm, ctx)
            if cutlass.const_expr(cl):
                g_last = self.rank_tied(self.gather_cluster_tied(m, slot, sm, ctx), m, need, sm.found, ctx)
            else:
                cute.arch.sync_threads()
                g_last = self.rank_tied(sm.tied, m, need, sm.found, ctx)
        else:
            g_last = self.tie_by_histograms(src, vth, need, sm, ctx, cl)
        return g_last

    @cute.jit
    def count_tied(self, src: Words, vth: Int32) -> Int32:
        c = Int32(0)
        if cutlass.const_expr(src.grp is None):
            for i in cutlass.range_constexpr(src.kp):
                if Int32(src.regs[i] >> Uint32(16)) == vth:
                    c = c + Int32(1)
        else:
            for p in cutlass.range(src.kp // 2, unroll=1):
                w0, w1 = P.ld_smem_v2(self.r2_addr(p, src.grp))
                c = c + Int32(Int32(Uint32(w0) >> Uint32(16)) == vth) + Int32(Int32(Uint32(w1) >> Uint32(16)) == vth)
        return c

    @cute.jit
    def store_tied(self, src: Words, vth: Int32, pos: Int32, sm: MergeSmem, ctx: Launch):
        tied = sm.tied
        if cutlass.const_expr(src.grp is None):
            words = src.regs
            for ip in cutlass.range_constexpr(src.kp // 2):
                q = self.tied_owner(ip, src, vth, sm.seg, ctx)
                for h in cutlass.range_constexpr(2):
                    if Int32(words[2 * ip + h] >> Uint32(16)) == vth:
                        tied[pos] = self.gid(words[2 * ip + h], src.hbits, 2 * ip + h, q)
                        pos = pos + Int32(1)
        else:
            for p in cutlass.range(src.kp // 2, unroll=1):
                w0, w1 = P.ld_smem_v2(self.r2_addr(p, src.grp))
                q = self.r2_q(p, src.qb0, src.qb1)
                for h in cutlass.range_constexpr(2):
                    w = Uint32((w0, w1)[h])
                    if Int32(w >> Uint32(16)) == vth:
                        tied[pos] = self.gid(w, src.hbits, Int32(2) * p + Int32(h), q)
                        pos = pos + Int32(1)

    @cute.jit
    def rank_tied(self, tied: cute.Tensor, m: Int32, need: Int32, found: cute.Tensor, ctx: Launch) -> Int32:
        """The need-th smallest of the m distinct values tied[0..m): thread tid ranks tied[tid]."""
        if ctx.tid < m:
            my = tied[ctx.tid]
            r = Int32(0)
            for jj in cutlass.range(m, unroll=4):
                if tied[jj] < my:
                    r = r + Int32(1)
            if r == need - Int32(1):
                found[6] = my
        cute.arch.sync_threads()
        return found[6]

    @cute.jit
    def tie_by_histograms(self, src: Words, vth: Int32, need: Int32, sm: MergeSmem, ctx: Launch,
                          cl: cutlass.Constexpr) -> Int32:
        """tie_break of many keys: histograms of u = 2^G - 1 - g, top 10 bits, next 6, the rest."""
        G = self.gbits
        gmax = Int32((1 << G) - 1)
        u_last, nd = Int32(0), need
        for d in cutlass.range_constexpr(3):
            hi_, lo_ = (G, G - 10, G - 16)[d], (G - 10, G - 16, 0)[d]
            hist = (sm.g_hist, sm.g_hist2, sm.g_hist3)[d]
            self.fill_g_hist(src, vth, gmax, u_last, hi_, lo_, hist, sm, ctx)
            self.find_bin(hist, (SCORE_BINS, SCORE_BINS2, SCORE_BINS2)[d], nd, 8, cl, sm, ctx)
            u_last = u_last | (sm.found[8] << Int32(lo_))
            nd = nd - sm.found[9]
        return gmax - u_last

    @cute.jit
    def add_g(self, u: Int32, u_last: Int32, hi_: cutlass.Constexpr, lo_: cutlass.Constexpr, hist: cute.Tensor):
        """Count u's bits [lo_, hi_) if its bits above hi_ are those found so far."""
        if (u >> Int32(hi_)) == (u_last >> Int32(hi_)):
            cute.arch.atomic_add(hist.iterator + ((u >> Int32(lo_)) & Int32((1 << (hi_ - lo_)) - 1)), Int32(1),
                                 sem="relaxed", scope="cta")  # fmt: skip

    @cute.jit
    def fill_g_hist(self, src: Words, vth: Int32, gmax: Int32, u_last: Int32, hi_: cutlass.Constexpr,
                    lo_: cutlass.Constexpr, hist: cute.Tensor, sm: MergeSmem, ctx: Launch):
        if cutlass.const_expr(src.grp is None):
            words = src.regs
            for ip in cutlass.range_constexpr(src.kp // 2):
                q = self.tied_owner(ip, src, vth, sm.seg, ctx)
                for h in cutlass.range_constexpr(2):
                    if Int32(words[2 * ip + h] >> Uint32(16)) == vth:
                        self.add_g(gmax - self.gid(words[2 * ip + h], src.hbits, 2 * ip + h, q), u_last, hi_, lo_,
                                   hist)  # fmt: skip
        else:
            for p in cutlass.range(src.kp // 2, unroll=1):
                w0, w1 = P.ld_smem_v2(self.r2_addr(p, src.grp))
                q = self.r2_q(p, src.qb0, src.qb1)
                for h in cutlass.range_constexpr(2):
                    w = Uint32((w0, w1)[h])
                    if Int32(w >> Uint32(16)) == vth:
                        self.add_g(gmax - self.gid(w, src.hbits, Int32(2) * p + Int32(h), q), u_last, hi_, lo_, hist)

    # ------------------------------------------------------------------ a clustered row's sums

    @cute.jit
    def gather_cluster_tied(self, m: Int32, slot: Int32, sm: MergeSmem, ctx: Launch) -> cute.Tensor:
        """The cluster's m tied keys (each CTA's tied, counted in stats word 3) -> cluster_tied."""
        tid = ctx.tid
        gathered = sm.cluster_tied
        P.cluster_sync_local()
        stats_a = P.smem_addr(sm.stats) + slot * Int32(16) + Int32(12)
        tied_a = P.smem_addr(sm.tied)
        if tid < m:
            off, val = Int32(0), Int32(0)
            for r in cutlass.range_constexpr(self.clus):
                c = P.ld_dsmem_u32(P.mapa(stats_a, Int32(r)))
                if tid >= off and tid < off + c:
                    val = P.ld_dsmem_u32(P.mapa(tied_a + (tid - off) * Int32(4), Int32(r)))
                off = off + c
            gathered[tid] = val
        cute.arch.sync_threads()
        return gathered

    @cute.jit
    def cluster_counts(self, tot: Int32, failed_here: Int32, sm: MergeSmem, ctx: Launch):
        """A clustered row's selected keys (published, then read through DSMEM): of the CTAs
        before this one, of the row, of this rank; rank_counts; found[7]: any CTA's failure."""
        tid = ctx.tid
        totals, rank_counts, found, warp_sel = sm.cluster_totals, sm.rank_counts, sm.found, sm.warp_sel
        npc = self.world // self.clus  # ranks per CTA
        wpr = self.n // (32 * self.kp1)  # warps per rank
        if tid < Int32(npc):
            x = Int32(0)
            for u in cutlass.range_constexpr(wpr):
                x = x + (warp_sel[tid * Int32(wpr) + Int32(u)] & Int32(0xFFFF))
            totals[Int32(1) + tid] = x
        if tid == Int32(0):
            totals[0] = tot & Int32(0xFFFF)
            totals[15] = failed_here
        P.cluster_sync_local()
        xa = P.smem_addr(totals)
        base, allr = Int32(0), Int32(0)
        for r in cutlass.range_constexpr(self.clus):
            x = P.ld_dsmem_u32(P.mapa(xa, Int32(r)))
            allr = allr + x
            if Int32(r) < ctx.crank:
                base = base + x
        own = P.ld_dsmem_u32(P.mapa(xa + (Int32(1) + ctx.rank % Int32(npc)) * Int32(4), ctx.rank // Int32(npc)))
        if tid < Int32(self.world):
            rank_counts[tid] = P.ld_dsmem_u32(P.mapa(xa + (Int32(1) + tid % Int32(npc)) * Int32(4), tid // Int32(npc)))
        if tid == Int32(0):
            f = Int32(0)
            for r in cutlass.range_constexpr(self.clus):
                f = f | P.ld_dsmem_u32(P.mapa(xa + Int32(60), Int32(r)))
            found[7] = f
        return base, allr, own

    # ------------------------------------------------------------------ a round in registers

    @cute.jit
    def fast_round(self, words: cute.Tensor, hb: cute.Tensor, round2: cutlass.Constexpr, slot: Int32,
                   sm: MergeSmem, ctx: Launch, row: Row, btp: cute.Tensor, pre_bt: cutlass.Constexpr,
                   qj: cute.Tensor) -> Uint64:
        """Exact top-K of the words in registers and the row's outputs; returns the K-th key (0
        if fewer).  ``pre_bt``: the block-table entries in btp (1), in sm.buf (2), or loaded here."""
        cl = self.clus > 1 and not round2  # a clustered round 1 (a round 2 runs on CTA 0 alone)
        src = Words(self.kp2 if round2 else self.kp1, round2, hb[0], regs=words, qj=qj)
        vth, g_last, kth, failed_here = self.select(src, self.word_stats(src.regs, src.kp), slot, sm, ctx)
        # round 1: the status word after the row's last wait, in flight during the outputs
        status_word = Uint32(0)
        if cutlass.const_expr(not round2 and not cl):
            if ctx.tid == Int32(0):
                status_word = P.ld_volatile_u32(ctx.status)
        sel_bits = self.selection(src, vth, g_last, sm.seg, ctx)
        all_run, own_run = self.fast_outputs(src, sel_bits, failed_here, sm, ctx, row, btp, pre_bt)
        list_start, found = sm.list_start, sm.found
        if cutlass.const_expr(cl):
            # (found[7] set by cluster_counts; the padding shared by the cluster's CTAs)
            if ctx.tid == Int32(0):
                list_start[self.world] = all_run
                if ctx.crank == Int32(0):
                    P.st_u32(ctx.counts + Int64(row.t) * Int64(4), own_run)
            self.pad_row(all_run, own_run, ctx.crank * Int32(C.TB) + ctx.tid, C.TB * self.clus, ctx, row)
        else:
            if ctx.tid == Int32(0):
                list_start[self.world] = all_run
                P.st_u32(ctx.counts + Int64(row.t) * Int64(4), own_run)
                if cutlass.const_expr(not round2):
                    found[7] = Int32(0)
                    if (status_word == Uint32(layout.STATUS_TIMEOUT_ROUND1)
                            or status_word == Uint32(layout.STATUS_TIMEOUT_RESCUE)):  # fmt: skip
                        found[7] = Int32(1)
            self.pad_row(all_run, own_run, ctx.tid, C.TB, ctx, row)
        cute.arch.sync_threads()
        return kth

    @cute.jit
    def select(self, src: Words, stats, slot: Int32, sm: MergeSmem, ctx: Launch):
        """(boundary score vth, the largest selected g at vth, the K-th key, the failure flag) from
        this thread's (count, max, min) ``stats``; vth = 0 selects every key of fewer than K."""
        cl = self.clus > 1 and not src.round2
        K, G = self.topk, self.gbits
        gmax = Int32((1 << G) - 1)
        failed_here = Int32(0)  # (cl) a failure recorded once this CTA's waits were over
        vth, g_last, kth = Int32(0), Int32(-1), Uint64(0)
        cnt, mx, mn = stats
        total, lo, rng = self.publish_stats(cnt, mx, mn, slot, sm, ctx, cl)
        if cutlass.const_expr(cl):
            # the status word after this CTA's waits, published with the counts (cluster_counts)
            if ctx.tid == Int32(0):
                sw0 = P.ld_volatile_u32(ctx.status)
                if sw0 == Uint32(layout.STATUS_TIMEOUT_ROUND1) or sw0 == Uint32(layout.STATUS_TIMEOUT_RESCUE):
                    failed_here = Int32(1)
        if total >= Int32(K):
            vth, above, m = self.score_boundary(src, lo, rng, sm, ctx, cl)
            g_last = self.tie_break(src, vth, m, Int32(K) - above, slot, sm, ctx, cl)
            kth = (Uint64(vth) << Uint64(G)) | Uint64(gmax - g_last)
        return vth, g_last, kth, failed_here

    @cute.jit
    def selection(self, src: Words, vth: Int32, g_last: Int32, seg: cute.Tensor, ctx: Launch) -> Uint32:
        """Bit i: word i is selected (s > vth, or s == vth != 0 and g <= g_last)."""
        words, hbits = src.regs, src.hbits
        sel_bits = Uint32(0)
        for ip in cutlass.range_constexpr(src.kp // 2):
            if cutlass.const_expr(src.kp > BRANCH_FREE_KP):
                q = self.tied_owner(ip, src, vth, seg, ctx)
                for i in cutlass.range_constexpr(2 * ip, 2 * ip + 2):
                    sv = Int32(words[i] >> Uint32(16))
                    if sv > vth:
                        sel_bits = sel_bits | Uint32(1 << i)
                    elif sv == vth and sv != Int32(0):
                        if self.gid(words[i], hbits, i, q) <= g_last:
                            sel_bits = sel_bits | Uint32(1 << i)
            else:
                q, j = self.owner_p(ip, src, seg, ctx)
                for i in cutlass.range_constexpr(2 * ip, 2 * ip + 2):
                    sv = Int32(words[i] >> Uint32(16))
                    tie = Int32(sv == vth) & Int32(sv != Int32(0)) & Int32(self.gid(words[i], hbits, i, q) <= g_last)
                    sel_bits = sel_bits | (Uint32(Int32(sv > vth) | tie) << Uint32(i))
        return sel_bits

    @cute.jit
    def ballot_counts(self, s0, s1, own, lt: Uint32):
        """(selected keys of the lanes below, of the warp), own << 16 | all, of a pair group."""
        b0 = Uint32(cute.arch.vote_ballot_sync(s0))
        b1 = Uint32(cute.arch.vote_ballot_sync(s1))
        o0 = Uint32(cute.arch.vote_ballot_sync(s0 and own))
        o1 = Uint32(cute.arch.vote_ballot_sync(s1 and own))
        before = Int32(cute.arch.popc(b0 & lt)) + Int32(cute.arch.popc(b1 & lt)) + (
            (Int32(cute.arch.popc(o0 & lt)) + Int32(cute.arch.popc(o1 & lt))) << Int32(16))
        total = Int32(cute.arch.popc(b0)) + Int32(cute.arch.popc(b1)) + (
            (Int32(cute.arch.popc(o0)) + Int32(cute.arch.popc(o1))) << Int32(16))
        return before, total

    @cute.jit
    def pair_counts(self, sel_bits: Uint32, ip: cutlass.Constexpr, src: Words, lt: Uint32, seg: cute.Tensor,
                    ctx: Launch):
        """ballot_counts of pair group ip."""
        q, j = self.owner_p(ip, src, seg, ctx)
        s0 = ((sel_bits >> Uint32(2 * ip)) & Uint32(1)) != Uint32(0)
        s1 = ((sel_bits >> Uint32(2 * ip + 1)) & Uint32(1)) != Uint32(0)
        return self.ballot_counts(s0, s1, q == ctx.rank, lt)

    @cute.jit
    def pair_counts_dyn(self, sel_bits: Uint32, ip: Int32, kp: cutlass.Constexpr, lt: Uint32, ctx: Launch):
        """pair_counts of round 1 for a pair group known at run time (the rolled loops)."""
        v = ctx.warp * Int32(32 * kp) + ip * Int32(64) + Int32(2) * ctx.lane
        own = (v // Int32(self.n)) == ctx.rank
        s0 = ((sel_bits >> (Uint32(2) * Uint32(ip))) & Uint32(1)) != Uint32(0)
        s1 = ((sel_bits >> (Uint32(2) * Uint32(ip) + Uint32(1))) & Uint32(1)) != Uint32(0)
        return self.ballot_counts(s0, s1, own, lt)

    @cute.jit
    def warp_prefix(self, warp_sel: cute.Tensor, warp):
        """(selected keys of the warps before this one, of all), own << 16 | all."""
        before, tot = Int32(0), Int32(0)
        for w in cutlass.range_constexpr(C.NWARPS):
            x = warp_sel[w]
            if Int32(w) < warp:
                before = before + x
            tot = tot + x
        return before, tot

    @cute.jit
    def fast_outputs(self, src: Words, sel_bits: Uint32, failed_here: Int32, sm: MergeSmem, ctx: Launch, row: Row,
                     btp: cute.Tensor, pre_bt: cutlass.Constexpr):
        """The order-preserving compaction's places and stores; returns the row's (all, own)."""
        tid, lane, warp, kp = ctx.tid, ctx.lane, ctx.warp, src.kp
        roll = cutlass.const_expr(not src.round2 and self.roll1)
        warp_sel = sm.warp_sel
        lt = cute.arch.lanemask_lt()
        # warp-uniform own << 16 | all (the stores recompute the ballots); (runs) the lanes' before this one
        run, run_before = Int32(0), Int32(0)
        if cutlass.const_expr(roll):
            stage = sm.stage
            for i in cutlass.range_constexpr(kp):  # read back by this thread only
                stage[Int32(i * C.TB) + tid] = Int32(src.regs[i])
            for ip in cutlass.range(kp // 2, unroll=1):
                _, c2 = self.pair_counts_dyn(sel_bits, ip, kp, lt, ctx)
                run = run + c2
        elif cutlass.const_expr(self.runs and not src.round2):
            # this thread's selected keys, the lanes' before it and the warp's by one warp scan
            q0, _ = self.owner_p(0, src, sm.seg, ctx)
            xa = Int32(cute.arch.popc(sel_bits))
            xr = xa + ((xa * Int32(q0 == ctx.rank)) << Int32(16))
            xi = C.warp_incl_scan(xr, lane)
            run_before = xi - xr
            run = cute.arch.shuffle_sync(xi, Int32(31))
        else:
            for ip in cutlass.range_constexpr(kp // 2):
                _, c2 = self.pair_counts(sel_bits, ip, src, lt, sm.seg, ctx)
                run = run + c2
        if lane == Int32(0):
            warp_sel[warp] = run
        cute.arch.sync_threads()
        before, tot = self.warp_prefix(warp_sel, warp)
        all_run, own_run = tot & Int32(0xFFFF), tot >> Int32(16)
        if cutlass.const_expr(self.clus > 1 and not src.round2):
            # places after the CTAs' before this one (this rank's keys are all in one CTA)
            cb, all_run, own_run = self.cluster_counts(tot, failed_here, sm, ctx)
            before = before + cb
        if cutlass.const_expr(roll):
            self.store_rolled(src.hbits, sel_bits, before, lt, sm, ctx, row)
        else:
            self.store_unrolled(src, sel_bits, before, run_before, lt, sm, ctx, row, btp, pre_bt)
        return all_run, own_run

    @cute.jit
    def store_rolled(self, hbits: Uint32, sel_bits: Uint32, before: Int32, lt: Uint32, sm: MergeSmem,
                     ctx: Launch, row: Row):
        """The stores of more than ROLL_KP words per thread: a pair group per iteration."""
        tid, kp = ctx.tid, self.kp1
        trow = Int64(row.t) * Int64(self.topk)
        ids_on = Int32(ctx.ids != Int64(0))
        stage, list_start = sm.stage, sm.list_start
        for ip in cutlass.range(kp // 2, unroll=1):
            v = ctx.warp * Int32(32 * kp) + ip * Int32(64) + Int32(2) * ctx.lane
            q = v // Int32(self.n)
            j = v - q * Int32(self.n)
            c1, c2 = self.pair_counts_dyn(sel_bits, ip, kp, lt, ctx)
            e = before + c1
            before = before + c2
            pos, kpos = e & Int32(0xFFFF), e >> Int32(16)
            if j == Int32(0) and v < Int32(self.nk1):
                list_start[q] = pos
            for h in cutlass.range_constexpr(2):
                i = Int32(2) * ip + Int32(h)
                w = Uint32(stage[i * Int32(C.TB) + tid])
                sel = Int32((sel_bits >> Uint32(i)) & Uint32(1))
                lidx = self.lidx_of(w, hbits, i)
                g = self.gpos(lidx, q)
                P.st_u32_if(ctx.ids + (trow + Int64(pos)) * Int64(4), g, sel & ids_on)
                pos = pos + sel
                own = sel & Int32(q == ctx.rank)
                page = self.page_of(lidx, ctx)
                slot = sm.buf[j + Int32(h)] * ctx.block_size + (lidx - page * ctx.block_size)
                if row.req_ok == Int32(0) or page >= ctx.bt_cols:
                    slot = Int32(-1)
                P.st_u32_if(ctx.kv_rows + (trow + Int64(kpos)) * Int64(4), slot, own)
                kpos = kpos + own

    @cute.jit
    def bt_entries(self, entries: cute.Tensor, b0: cutlass.Constexpr, src: Words, sel_bits: Uint32, sm: MergeSmem,
                   ctx: Launch, row: Row, btp: cute.Tensor, pre_bt: cutlass.Constexpr):
        """The block-table entries of pair groups b0 .. b0 + 3, loads in flight together."""
        kp = src.kp
        for k in cutlass.range_constexpr(8):
            i = b0 * 2 + k
            entries[k] = Int32(0)
            if cutlass.const_expr(i < kp and pre_bt == 1):
                entries[k] = btp[i]
            elif cutlass.const_expr(i < kp and pre_bt == 2 and kp > BRANCH_FREE_KP):
                if ((sel_bits >> Uint32(i)) & Uint32(1)) != Uint32(0):
                    q, j = self.owner_p(i // 2, src, sm.seg, ctx)
                    if q == ctx.rank:
                        entries[k] = sm.buf[j + Int32(k % 2)]
            elif cutlass.const_expr(i < kp and pre_bt == 2):
                # read for every key (j < n: in bounds), used for own selected ones only
                _, j = self.owner_p(i // 2, src, sm.seg, ctx)
                entries[k] = sm.buf[j + Int32(k % 2)]
            elif cutlass.const_expr(i < kp):
                # predicated loads of this batch's own selected keys, all in flight
                q, j = self.owner_p(i // 2, src, sm.seg, ctx)
                page = self.page_of(self.lidx_of(src.regs[i], src.hbits, i), ctx)
                ok = (Int32((sel_bits >> Uint32(i)) & Uint32(1)) & Int32(q == ctx.rank) & row.req_ok
                      & Int32(page < ctx.bt_cols))  # fmt: skip
                entries[k] = P.ld_u32_if(row.bt_row + Int64(page) * Int64(4), ok)

    @cute.jit
    def store_unrolled(self, src: Words, sel_bits: Uint32, before: Int32, run_before: Int32, lt: Uint32,
                       sm: MergeSmem, ctx: Launch, row: Row, btp: cute.Tensor, pre_bt: cutlass.Constexpr):
        """The stores, four pair groups at a time; round 1 also list_start."""
        kp = src.kp
        runs = cutlass.const_expr(self.runs and not src.round2)
        trow = Int64(row.t) * Int64(self.topk)
        ids_row = ctx.ids + trow * Int64(4)
        kv_row = ctx.kv_rows + trow * Int64(4)
        ids_on = Int32(ctx.ids != Int64(0))
        list_start = sm.list_start
        entries = cute.make_rmem_tensor((8,), Int32)
        tpos, tkpos = Int32(0), Int32(0)  # (runs) the next output places of this thread's run
        if cutlass.const_expr(runs):
            tpos, tkpos = (before + run_before) & Int32(0xFFFF), (before + run_before) >> Int32(16)
        for b0 in cutlass.range_constexpr(0, kp // 2, 4):
            self.bt_entries(entries, b0, src, sel_bits, sm, ctx, row, btp, pre_bt)
            for ip in cutlass.range_constexpr(b0, min(b0 + 4, kp // 2)):
                v = self.pos1(ip, kp, ctx)
                q, j = self.owner_p(ip, src, sm.seg, ctx)
                pos, kpos = tpos, tkpos
                if cutlass.const_expr(not runs):
                    c1, c2 = self.pair_counts(sel_bits, ip, src, lt, sm.seg, ctx)
                    e = before + c1
                    before = before + c2
                    pos, kpos = e & Int32(0xFFFF), e >> Int32(16)
                if cutlass.const_expr(not src.round2):
                    if j == Int32(0) and v < Int32(self.nk1):
                        list_start[q] = pos
                for i in cutlass.range_constexpr(2 * ip, 2 * ip + 2):
                    entry = entries[i - 2 * b0]
                    if cutlass.const_expr(kp > BRANCH_FREE_KP):
                        pos, kpos = self.store_key_branchy(src.regs[i], src.hbits, i, q, sel_bits, pos, kpos, entry,
                                                           trow, ctx, row)  # fmt: skip
                    else:
                        pos, kpos = self.store_key(src.regs[i], src.hbits, i, q, sel_bits, pos, kpos, entry, ids_row,
                                                   kv_row, ids_on, ctx, row)  # fmt: skip
                if cutlass.const_expr(runs):
                    tpos, tkpos = pos, kpos

    @cute.jit
    def store_key(self, w: Uint32, hbits: Uint32, i: cutlass.Constexpr, q: Int32, sel_bits: Uint32, pos: Int32,
                  kpos: Int32, entry: Int32, ids_row: Int64, kv_row: Int64, ids_on: Int32, ctx: Launch, row: Row):
        """Word i's outputs by predicated stores (no branch per key); returns the next places."""
        sel = Int32((sel_bits >> Uint32(i)) & Uint32(1))
        lidx = self.lidx_of(w, hbits, i)
        g = self.gpos(lidx, q)
        P.st_u32_if(ids_row + Int64(pos) * Int64(4), g, sel & ids_on)
        pos = pos + sel
        own = sel & Int32(q == ctx.rank)
        slot = self.kv_slot_of(entry, lidx, ctx, row)
        P.st_u32_if(kv_row + Int64(kpos) * Int64(4), slot, own)
        return pos, kpos + own

    @cute.jit
    def store_key_branchy(self, w: Uint32, hbits: Uint32, i: cutlass.Constexpr, q: Int32, sel_bits: Uint32,
                          pos: Int32, kpos: Int32, entry: Int32, trow: Int64, ctx: Launch, row: Row):
        """store_key behind a branch (many words per thread: branch-free code spilled)."""
        if ((sel_bits >> Uint32(i)) & Uint32(1)) != Uint32(0):
            lidx = self.lidx_of(w, hbits, i)
            g = self.gpos(lidx, q)
            if ctx.ids != Int64(0):
                P.st_u32(ctx.ids + (trow + Int64(pos)) * Int64(4), g)
            pos = pos + Int32(1)
            if q == ctx.rank:
                page = self.page_of(lidx, ctx)
                slot = Int32(-1)
                if row.req_ok != Int32(0) and page < ctx.bt_cols:
                    slot = entry * ctx.block_size + (lidx - page * ctx.block_size)
                P.st_u32(ctx.kv_rows + (trow + Int64(kpos)) * Int64(4), slot)
                kpos = kpos + Int32(1)
        return pos, kpos

    @cute.jit
    def pad_row(self, all_run: Int32, own_run: Int32, first: Int32, step: cutlass.Constexpr, ctx: Launch, row: Row):
        """-1 past the row's selected keys (this thread: first, first + step, ...)."""
        trow = Int64(row.t) * Int64(self.topk)
        for i in cutlass.range(own_run + first, self.topk, step, unroll=1):
            P.st_u32(ctx.kv_rows + (trow + Int64(i)) * Int64(4), Int32(-1))
        if ctx.ids != Int64(0):
            for i in cutlass.range(all_run + first, self.topk, step, unroll=1):
                P.st_u32(ctx.ids + (trow + Int64(i)) * Int64(4), Int32(-1))

    # ------------------------------------------------------------------ round 2 rolled
    # fast_round's selection and outputs, bit for bit, in loops over a shared-memory copy: the
    # unrolled passes (W = 8, N = 512: ~66 KB of SASS) were fetched cold once per rescue.

    def r2_addr(self, p: Int32, grp: Round2Smem) -> Int32:
        """Shared address of this thread's round-2 pair group p (8 bytes: its two words)."""
        return (p * Int32(8 * C.TB) + grp.base + (grp.to_mask & (Int32(0) - Int32(p < Int32(R2_H + R2_M))))
                + (grp.to_hist & (Int32(0) - Int32(p < Int32(R2_H)))))  # fmt: skip

    def r2_q(self, p: Int32, qb0: Uint32, qb1: Uint32) -> Int32:
        """Segment of this thread's round-2 pair group p (4 bits each, groups 8-15 in qb1)."""
        qw = qb0 ^ ((qb0 ^ qb1) & (Uint32(0) - Uint32(p >= Int32(8))))
        return Int32((qw >> (Uint32(p & Int32(7)) * Uint32(4))) & Uint32(15))

    def r2_owner(self, v: Int32, segr: cute.Tensor) -> Int32:
        """Segment of position v (< nk) from the segment starts in registers."""
        q = Int32(0)
        for r in range(1, self.world):
            q = q + Int32(segr[r] <= v)
        return q

    def r2_pos(self, p: Int32, ctx: Launch) -> Int32:
        return ctx.warp * Int32(32 * self.kp2) + p * Int32(64) + Int32(2) * ctx.lane

    @cute.jit
    def round2_rolled(self, slot: Int32, sm: MergeSmem, ctx: Launch, row: Row):
        """Round 2 over shared memory: pair groups copied by cp.async (a rolled loop keeps every
        copy in flight) into hist1, mask, then stage2, the mask words into r2m, this rank's
        block-table entries into buf[j], in flight during the select."""
        tid, TB, W = ctx.tid, C.TB, self.world
        seg = sm.seg
        nk = seg[W]
        ah = P.smem_addr(sm.sel.hist1) + tid * Int32(8)
        am = P.smem_addr(sm.sel.mask) + tid * Int32(8) - Int32(R2_H * 8 * TB)
        ax = P.smem_addr(sm.stage2) + tid * Int32(8) - Int32((R2_H + R2_M) * 8 * TB)
        grp = Round2Smem(ax, am - ax, ah - am, P.smem_addr(sm.r2m), P.smem_addr(sm.buf))
        segr = cute.make_rmem_tensor((W,), Int32)
        for r in cutlass.range_constexpr(W):
            segr[r] = seg[r]
        qb0, qb1 = self.r2_copy(nk, segr, grp, sm, ctx, row)
        hbits, cnt, mx, mn = self.r2_stats(nk, qb0, qb1, grp, sm, ctx, row)
        src = Words(self.kp2, True, hbits, grp=grp, qb0=qb0, qb1=qb1)
        vth, g_last, _, _ = self.select(src, (cnt, mx, mn), slot, sm, ctx)
        lt = cute.arch.lanemask_lt()
        sel_bits, run = self.r2_selection(src, vth, g_last, lt, ctx)
        warp_sel = sm.warp_sel
        if ctx.lane == Int32(0):
            warp_sel[ctx.warp] = run
        P.cp_async_wait_all()  # (this thread's block-table entries: read by it alone, below)
        cute.arch.sync_threads()
        before, tot = self.warp_prefix(warp_sel, ctx.warp)
        all_run, own_run = tot & Int32(0xFFFF), tot >> Int32(16)
        self.r2_store(src, sel_bits, before, lt, sm, ctx, row)
        list_start = sm.list_start
        if tid == Int32(0):
            list_start[W] = all_run
            P.st_u32(ctx.counts + Int64(row.t) * Int64(4), own_run)
        self.pad_row(all_run, own_run, tid, C.TB, ctx, row)
        cute.arch.sync_threads()

    @cute.jit
    def r2_copy(self, nk: Int32, segr: cute.Tensor, grp: Round2Smem, sm: MergeSmem, ctx: Launch, row: Row):
        """The mask words and words copied in; returns the segments of the pair groups (r2_q)."""
        seg = sm.seg
        for u in cutlass.range(ctx.tid, (nk + Int32(31)) >> Int32(5), C.TB, unroll=1):
            q = self.r2_owner(u << Int32(5), segr)
            s = seg[17 + q]
            jm = (u - (seg[q] >> Int32(5)))
            src = C.ll_word_addr(row.ll0 + Int64(q) * ctx.ll_stride, Int32(self.n) + jm)
            if s >= Int32(0):
                src = row.resc0 + Int64(s) * Int64(self.rescue_row_bytes) + Int64(Int32(self.topk) + jm) * Int64(4)
            P.cp_async(grp.masks + u * Int32(4), src, 4)
        qb0, qb1 = Uint32(0), Uint32(0)
        for p in cutlass.range(self.kp2 // 2, unroll=1):
            v = self.r2_pos(p, ctx)
            dst = self.r2_addr(p, grp)
            q = Int32(0)
            if v < nk:
                q = self.r2_owner(v, segr)
                j = v - seg[q]
                s = seg[17 + q]
                if s >= Int32(0):  # a rescued rank: its K-list, plain words
                    P.cp_async(dst, row.resc0 + Int64(s) * Int64(self.rescue_row_bytes) + Int64(j) * Int64(4), 8)
                else:  # its round-1 LL list (tags checked in round 1): each record's two words
                    a = C.ll_word_addr(row.ll0 + Int64(q) * ctx.ll_stride, j)
                    P.cp_async(dst, a, 4)
                    P.cp_async(dst + Int32(4), a + Int64(layout.LL_HALF_BYTES), 4)
            else:
                P.st_smem_v2(dst, Int32(0), Int32(0))
            qs = Uint32(q) << (Uint32(p & Int32(7)) * Uint32(4))
            if p < Int32(8):
                qb0 = qb0 | qs
            else:
                qb1 = qb1 | qs
        P.cp_async_wait_all()
        cute.arch.sync_threads()
        return qb0, qb1

    @cute.jit
    def r2_stats(self, nk: Int32, qb0: Uint32, qb1: Uint32, grp: Round2Smem, sm: MergeSmem, ctx: Launch, row: Row):
        """(hbits, count, max, min) of this thread's words; the block-table copies started."""
        seg = sm.seg
        hbits, cnt, mx, mn = Uint32(0), Int32(0), Int32(0), Int32(0xFFFF)
        nmw = (nk + Int32(31)) >> Int32(5)
        for p in cutlass.range(self.kp2 // 2, unroll=1):
            v = self.r2_pos(p, ctx)
            m = Uint32(P.ld_smem_u32(grp.masks + cutlass.min(v >> Int32(5), nmw - Int32(1)) * Int32(4)))
            w0, w1 = P.ld_smem_v2(self.r2_addr(p, grp))
            hp = (m >> Uint32(v & Int32(31))) & Uint32(3)
            if v >= nk:
                hp = Uint32(0)
            hbits = hbits | (hp << (Uint32(2) * Uint32(p)))
            q = self.r2_q(p, qb0, qb1)
            for h in cutlass.range_constexpr(2):
                w = Uint32((w0, w1)[h])
                sv = Int32(w >> Uint32(16))
                nz = Int32(sv != Int32(0))
                cnt = cnt + nz
                mx = cutlass.max(mx, sv)
                mn = cutlass.min(mn, sv | ((nz - Int32(1)) & Int32(0xFFFF)))
                lidx = self.lidx_of(w, hp, h)
                page = self.page_of(lidx, ctx)
                if q == ctx.rank and nz != Int32(0) and row.req_ok != Int32(0) and page < ctx.bt_cols:
                    P.cp_async(grp.buf + (v - seg[q] + Int32(h)) * Int32(4), row.bt_row + Int64(page) * Int64(4), 4)
        return hbits, cnt, mx, mn

    @cute.jit
    def r2_selection(self, src: Words, vth: Int32, g_last: Int32, lt: Uint32, ctx: Launch):
        """(selection bits, the warp's selected keys own << 16 | all), as fast_round's."""
        grp, hbits = src.grp, src.hbits
        sel_bits, run = Uint32(0), Int32(0)
        for p in cutlass.range(self.kp2 // 2, unroll=1):
            w0, w1 = P.ld_smem_v2(self.r2_addr(p, grp))
            q = self.r2_q(p, src.qb0, src.qb1)
            sp = Uint32(0)
            for h in cutlass.range_constexpr(2):
                w = Uint32((w0, w1)[h])
                sv = Int32(w >> Uint32(16))
                tie = (Int32(sv == vth) & Int32(sv != Int32(0))
                       & Int32(self.gid(w, hbits, Int32(2) * p + Int32(h), q) <= g_last))  # fmt: skip
                sp = sp | (Uint32(Int32(sv > vth) | tie) << Uint32(h))
            sel_bits = sel_bits | (sp << (Uint32(2) * Uint32(p)))
            _, c2 = self.ballot_counts((sp & Uint32(1)) != Uint32(0), (sp & Uint32(2)) != Uint32(0), q == ctx.rank, lt)
            run = run + c2
        return sel_bits, run

    @cute.jit
    def r2_store(self, src: Words, sel_bits: Uint32, before: Int32, lt: Uint32, sm: MergeSmem, ctx: Launch, row: Row):
        """The outputs (places ascend with warp, group, lane, h), stores predicated."""
        seg, grp, hbits = sm.seg, src.grp, src.hbits
        trow = Int64(row.t) * Int64(self.topk)
        ids_on = Int32(ctx.ids != Int64(0))
        jmax = Int32(self.rw_k - 2)
        for p in cutlass.range(self.kp2 // 2, unroll=1):
            q = self.r2_q(p, src.qb0, src.qb1)
            v = self.r2_pos(p, ctx)
            # (a group past nk: q = 0, no key selected; j clamped into buf for the unused reads)
            j = cutlass.min(cutlass.max(v - seg[q], Int32(0)), jmax)
            sp = (sel_bits >> (Uint32(2) * Uint32(p))) & Uint32(3)
            c1, c2 = self.ballot_counts((sp & Uint32(1)) != Uint32(0), (sp & Uint32(2)) != Uint32(0), q == ctx.rank, lt)
            e = before + c1
            before = before + c2
            pos, kpos = e & Int32(0xFFFF), e >> Int32(16)
            w0, w1 = P.ld_smem_v2(self.r2_addr(p, grp))
            bt0, bt1 = P.ld_smem_v2(grp.buf + j * Int32(4))
            for h in cutlass.range_constexpr(2):
                w = Uint32((w0, w1)[h])
                sel = Int32((sp >> Uint32(h)) & Uint32(1))
                lidx = self.lidx_of(w, hbits, Int32(2) * p + Int32(h))
                P.st_u32_if(ctx.ids + (trow + Int64(pos)) * Int64(4), self.gpos(lidx, q), sel & ids_on)
                pos = pos + sel
                own = sel & Int32(q == ctx.rank)
                slot = self.kv_slot_of((bt0, bt1)[h], lidx, ctx, row)
                P.st_u32_if(ctx.kv_rows + (trow + Int64(kpos)) * Int64(4), slot, own)
                kpos = kpos + own

    # ------------------------------------------------------------------ saturation and rescue

    @cute.jit
    def saturated_ranks(self, kth: Uint64, sm: MergeSmem, ctx: Launch) -> Int32:
        """The mask of ranks whose N keys were all selected and whose key is not the K-th (lane q
        tests rank q, one ballot: a loop over the ranks was ~2.5% of the instructions at W = 8)."""
        W, lane = self.world, ctx.lane
        t_owner = Int32(-1)
        if kth != Uint64(0):
            t_owner = self.owner_of(Int32(Uint64((1 << self.gbits) - 1) - (kth & Uint64((1 << self.gbits) - 1))))
        q = cutlass.min(lane, Int32(W - 1))
        if cutlass.const_expr(self.fast1 and self.clus == 1):
            selected = sm.list_start[q + Int32(1)] - sm.list_start[q]
        else:
            selected = sm.rank_counts[q]
        sat = Int32(lane < Int32(W)) & Int32(selected == Int32(self.n)) & Int32(t_owner != lane)
        mask = Int32(cute.arch.vote_ballot_sync(sat != Int32(0)))
        nsat = Int32(cute.arch.popc(Uint32(mask)))
        if nsat > Int32(self.slots):
            mask = Int32(0)  # impossible (docs/DESIGN.md §6.4); keeps the slots in bounds
        return mask

    @cute.jit
    def rescue(self, mask: Int32, words: cute.Tensor, hb: cute.Tensor, sm: MergeSmem, ctx: Launch, row: Row):
        """The saturated ranks push their K-lists, every rank waits for their flags and rewrites
        the outputs from round 2; the row's rescue count goes up."""
        tid = ctx.tid
        flag_val = row.seq + Int32(1)
        if ((mask >> ctx.rank) & Int32(1)) != Int32(0):
            self.push_klist(mask, flag_val, sm, ctx, row)
        # every rank: acquire the saturated ranks' flags (one lane per rank)
        if tid < Int32(self.world):
            if ((mask >> tid) & Int32(1)) != Int32(0):
                addr = ctx.local + ctx.flags_off + C.flag_offset(tid, row.t, ctx.max_rows)
                self.wait_tag(addr, flag_val, True, layout.STATUS_TIMEOUT_RESCUE, tid, ctx, row)
        if tid == Int32(0):
            seg = sm.seg
            off, s = Int32(0), Int32(0)
            for q in cutlass.range_constexpr(self.world):
                seg[q] = off
                if ((mask >> Int32(q)) & Int32(1)) != Int32(0):
                    seg[17 + q] = s
                    s = s + Int32(1)
                    off = off + Int32(self.topk)
                else:
                    seg[17 + q] = Int32(-1)
                    off = off + Int32(self.n)
            seg[self.world] = off
        cute.arch.sync_threads()
        slot2 = row.slot + Int32(1)
        if cutlass.const_expr(self.roll2):
            self.round2_rolled(slot2, sm, ctx, row)
        elif cutlass.const_expr(self.fast2):
            qj = cute.make_rmem_tensor((self.kp2 // 2,), Int32)
            self.load_r2(words, hb, sm.seg, qj, ctx, row)
            self.fast_round(words, hb, True, slot2, sm, ctx, row, hb, 0, qj)
        else:
            kth2 = self.radix_select(True, sm, ctx, row)
            self.emit(True, kth2, sm, ctx, row)
        if tid == Int32(0):
            P.st_u32(C.state_seq(ctx.state, ctx.max_rows, row.t), row.seq + Int32(1))

    @cute.jit
    def push_klist(self, mask: Int32, flag_val: Int32, sm: MergeSmem, ctx: Launch, row: Row):
        """This rank's local top-K (the producer's K-list, or selected here from its logits) into
        its slot of every rank's rescue row, then its flag released to every rank."""
        tid, t, W = ctx.tid, row.t, self.world
        P.pdl_wait()
        if cutlass.const_expr(self.klist):
            klist = C.state_klist(ctx.state, ctx.max_rows, t, self.rw_k)
        else:
            end = row_end(ctx.row_ends, t, ctx.cols)
            S.select_row(ctx.logits + Int64(t) * Int64(ctx.cols) * Int64(2), end, self.topk, self.rw_k,
                         sm.sel.parts(), tid, ctx.lane, ctx.warp, Int32(1), Int32(0), False, False, Int32(0),
                         self.rescue_u1)  # fmt: skip
        s = Int32(cute.arch.popc(Uint32(mask & ((Int32(1) << ctx.rank) - Int32(1)))))
        off = ctx.rescue_off + C.rescue_row_offset(t, s, self.slots, self.rescue_row_bytes)
        if cutlass.const_expr(self.klist):
            # (.cg: not through this SM's L1, which may hold an earlier call's lines)
            for i in cutlass.range(tid, self.rw_k // 4, C.TB, unroll=1):
                a, b, c, d = P.ld_cg_v4(klist + Int64(i) * Int64(16))
                for p in cutlass.range_constexpr(W):
                    dst = P.ld_u64(ctx.peers + Int64(p) * Int64(8)) + off
                    P.st_v4(dst + Int64(i) * Int64(16), a, b, c, d)
        else:
            buf = sm.buf
            for p in cutlass.range(W, unroll=1):
                dst = P.ld_u64(ctx.peers + Int64(p) * Int64(8)) + off
                for i in cutlass.range(tid, self.rw_k // 4, C.TB, unroll=1):
                    P.st_v4(dst + Int64(i) * Int64(16), buf[4 * i], buf[4 * i + 1], buf[4 * i + 2], buf[4 * i + 3])
        cute.arch.sync_threads()
        foff = ctx.flags_off + C.flag_offset(ctx.rank, t, ctx.max_rows)
        # lane p: fence.acq_rel.sys, relaxed.sys store of rank p's flag (a release; the barrier
        # orders the CTA's stores before each fence by cumulativity)
        if tid < Int32(W):
            pa = P.ld_u64(ctx.peers + Int64(tid) * Int64(8))
            P.fence_sys()
            P.st_relaxed_sys(pa + foff, flag_val)

    # ------------------------------------------------------------------ the kernel

    @cute.kernel
    def kernel(self, peers: Int64, local: Int64, state: Int64, logits: Int64, row_ends: Int64,
               req_id: Int64, block_table: Int64, kv_rows: Int64, counts: Int64, ids: Int64,
               saturated: Int64, rows: Int32, cols: Int32, bt_rows: Int32, bt_cols: Int32,
               block_size: Int32, rank: Int32, max_rows: Int32, rescue_off: Int64,
               flags_off: Int64, timeout_us: Int32, host_status: Int64):  # fmt: skip
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        nblk, _, _ = cute.arch.grid_dim()
        tid = Int32(tid)
        lane = cute.arch.lane_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        sm = MergeSmem(self)
        # CTA b does rows b, b + G, ...; a clustered row t runs on cluster t
        nstep, t, crank, cbase = nblk, Int32(bid), None, None
        if cutlass.const_expr(self.clus > 1):
            if cute.arch.cluster_size() != Int32(self.clus):
                P.trap()  # launched without its cluster: DSMEM would address CTAs that do not exist
            crank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
            cbase = crank * Int32(self.cp)
            t = cute.arch.cluster_idx()[0]
            nstep = Int32(nblk) // Int32(self.clus)
        status = C.state_status(state, max_rows)
        timeout_ns = Int64(timeout_us) * Int64(1000)
        ll_stride = Int64(max_rows) * Int64(self.ll_row_bytes)
        words = cute.make_rmem_tensor((self.kp,), Uint32)
        hb = cute.make_rmem_tensor((1,), Uint32)
        btp = cute.make_rmem_tensor((self.kp1 if self.pre_bt else 1,), Int32)
        stats = sm.stats
        if tid < Int32(16):  # the stats slots: [count, max, min, tied count]
            stats[tid] = Int32(0)
            if (tid & Int32(3)) == Int32(2):
                stats[tid] = Int32(0xFFFF)
        cute.arch.sync_threads()
        # (finished: the launch's end done, after a last row without a rescue)
        rowi, last_f, finished, refused = Int32(0), Int32(0), Int32(0), Int32(0)
        # the first row's epoch, loaded with the status word; later rows' a row ahead
        epn = Int32(0)
        if t < rows:
            epn = P.ld_u32(C.state_epoch(state, max_rows, t))
        # a failed or closed exchange does no exchange work: empty outputs, no epoch bump
        stw0 = P.ld_volatile_u32(status)
        if cutlass.const_expr(self.clus > 1):
            # CTA 0's word for the cluster (all pass the same barriers); every CTA runs before DSMEM
            totals = sm.cluster_totals
            if tid == Int32(0):
                totals[14] = Int32(stw0)
            P.cluster_sync_local()
            stw0 = Uint32(P.ld_dsmem_u32(P.mapa(P.smem_addr(totals) + Int32(56), Int32(0))))
        # page_of's multiplier, while the loads above are in flight (block_size < 1: req_ok is 0)
        page_div = (Uint64(1) << Uint64(PAGE_SHIFT)) // Uint64(cutlass.max(block_size, Int32(1))) + Uint64(1)
        ctx = Launch(tid, lane, warp, peers, local, state, logits, row_ends, kv_rows, counts, ids, saturated,
                     rows, cols, bt_cols, block_size, rank, max_rows, rescue_off, flags_off, host_status,
                     status, timeout_ns, ll_stride, nstep, page_div, crank, cbase)  # fmt: skip
        if stw0 != Uint32(layout.STATUS_OK):
            refused = Int32(1)
            t = self.refuse_rows(t, ctx)
        while t < rows:
            row = self.start_row(t, epn, rowi, req_id, block_table, bt_rows, sm, ctx)
            kth = self.round1(words, hb, btp, sm, ctx, row)
            mask = self.saturated_ranks(kth, sm, ctx)
            epn, last_f, finished = self.end_row(mask, epn, last_f, finished, refused, rowi, words, hb, sm,
                                                 ctx, row)  # fmt: skip
            t = t + Int32(nstep)
            rowi = rowi + Int32(1)
        if finished == Int32(0):
            self.finish(refused, last_f, rowi, sm, ctx)
        if cutlass.const_expr(self.clus > 1):
            # no CTA leaves while another may still read its shared memory
            P.cluster_arrive()
            P.cluster_wait()

    @cute.jit
    def refuse_rows(self, t: Int32, ctx: Launch) -> Int32:
        """Empty outputs for this CTA's rows of a refused launch; returns the row past them."""
        while t < ctx.rows:
            if cutlass.const_expr(self.clus > 1):
                if ctx.crank == Int32(0):
                    self.empty_row(t, ctx)
            else:
                self.empty_row(t, ctx)
            t = t + Int32(ctx.nstep)
        return t

    @cute.jit
    def start_row(self, t: Int32, epn: Int32, rowi: Int32, req_id: Int64, block_table: Int64, bt_rows: Int32,
                  sm: MergeSmem, ctx: Launch) -> Row:
        """Row t's addresses and request; its stats slots reset."""
        ep = epn + Int32(1)
        seq = P.ld_u32(C.state_seq(ctx.state, ctx.max_rows, t))
        # LL row [parity, 0, t] (layout.ll_row_offset, factored: ll_stride steps the source)
        ll0 = ctx.local + Int64(ep & Int32(1)) * Int64(self.world) * ctx.ll_stride + Int64(t) * Int64(self.ll_row_bytes)
        # rescue row [t, 0] (layout.rescue_row_offset with slot 0)
        resc0 = ctx.local + ctx.rescue_off + Int64(t) * Int64(self.slots * self.rescue_row_bytes)
        req = P.ld_u32(req_id + Int64(t) * Int64(4))
        req_ok, bt_row = Int32(0), block_table
        if req >= Int32(0) and req < bt_rows and ctx.block_size > Int32(0):
            req_ok = Int32(1)
            bt_row = block_table + Int64(req) * Int64(ctx.bt_cols) * Int64(4)
        # stats slots 2 * (rowi & 1) + round; the other parity's reset (read before the last barrier)
        slot = Int32(2) * (rowi & Int32(1))
        if ctx.tid < Int32(8):
            stats = sm.stats
            o = (Int32(2) - slot) * Int32(4) + ctx.tid
            stats[o] = Int32(0)
            if (ctx.tid & Int32(3)) == Int32(2):
                stats[o] = Int32(0xFFFF)
        return Row(t, ep, seq, ll0, resc0, bt_row, req_ok, slot)

    @cute.jit
    def round1(self, words: cute.Tensor, hb: cute.Tensor, btp: cute.Tensor, sm: MergeSmem, ctx: Launch,
               row: Row) -> Uint64:
        """Round 1: wait for the W lists, select, write the outputs; returns the K-th key."""
        if cutlass.const_expr(self.fast1):
            self.load_r1(words, hb, ctx, row)
            if cutlass.const_expr(self.pre_bt):
                self.prefetch_bt(words, hb, btp, ctx, row)
            else:
                self.prefetch_bt_smem(words, hb, sm.buf, ctx, row)
            kth = self.fast_round(words, hb, False, row.slot, sm, ctx, row, btp, 1 if self.pre_bt else 2, hb)
        else:
            for v in cutlass.range(ctx.tid, self.nk1, C.TB, unroll=1):
                self.key_r1(v, True, ctx, row)
            cute.arch.sync_threads()
            kth = self.radix_select(False, sm, ctx, row)
            self.emit(False, kth, sm, ctx, row)
        return kth

    @cute.jit
    def end_row(self, mask: Int32, epn: Int32, last_f: Int32, finished: Int32, refused: Int32, rowi: Int32,
                words: cute.Tensor, hb: cute.Tensor, sm: MergeSmem, ctx: Launch, row: Row):
        """The row's rescue, if any, and its end; returns (next epoch, failure flag, finished)."""
        t, nstep = row.t, ctx.nstep
        if cutlass.const_expr(self.clus > 1):
            # a clustered row ends on CTA 0; where it rewrites the outputs, a cluster barrier
            # first orders the other CTAs' round-1 stores before its own
            if mask != Int32(0) or sm.found[7] != Int32(0):
                P.cluster_sync()
            if ctx.crank == Int32(0):
                if mask == Int32(0):
                    epn, last_f, finished = self.end_plain_row(mask, epn, finished, refused, rowi, sm, ctx, row)
                else:
                    self.rescue(mask, words, hb, sm, ctx, row)
                    epn, last_f = self.row_epilogue(mask, False, epn, sm, ctx, row)
            elif t + Int32(nstep) < ctx.rows:
                epn = P.ld_u32(C.state_epoch(ctx.state, ctx.max_rows, t + Int32(nstep)))
        elif cutlass.const_expr(not self.end_first):
            if mask != Int32(0):
                self.rescue(mask, words, hb, sm, ctx, row)
            epn, last_f = self.row_epilogue(mask, None, epn, sm, ctx, row)
        else:
            # a row without a rescue ends before the rescue's ~100 KB of code (else fetched cold)
            if mask == Int32(0):
                epn, last_f, finished = self.end_plain_row(mask, epn, finished, refused, rowi, sm, ctx, row)
            else:
                self.rescue(mask, words, hb, sm, ctx, row)
                epn, last_f = self.row_epilogue(mask, False, epn, sm, ctx, row)
        return epn, last_f, finished

    @cute.jit
    def end_plain_row(self, mask: Int32, epn: Int32, finished: Int32, refused: Int32, rowi: Int32,
                      sm: MergeSmem, ctx: Launch, row: Row):
        """The end of a row without a rescue, and after this CTA's last row the launch's."""
        epn, last_f = self.row_epilogue(mask, True, epn, sm, ctx, row)
        if row.t + Int32(ctx.nstep) >= ctx.rows:
            self.finish(refused, last_f, rowi + Int32(1), sm, ctx)
            finished = Int32(1)
        return epn, last_f, finished

    # ------------------------------------------------------------------ row and launch ends

    @cute.jit
    def row_epilogue(self, mask: Int32, plain: cutlass.Constexpr, epn: Int32, sm: MergeSmem, ctx: Launch, row: Row):
        """The row's end: the next epoch loaded, the producer grid waited for, the row voided on a
        failure, the epoch bumped.  ``plain`` (None: by ``mask``): no rescue, so found[7] holds
        the status read after the row's last wait.  Returns (next epoch, failure flag)."""
        tid, t, nstep = ctx.tid, row.t, ctx.nstep
        if ctx.saturated != Int64(0):
            if tid == Int32(0):
                P.st_u32(ctx.saturated + Int64(t) * Int64(4), mask)
        if t + Int32(nstep) < ctx.rows:
            epn = P.ld_u32(C.state_epoch(ctx.state, ctx.max_rows, t + Int32(nstep)))
        # every word of the row was read; the producer grid is done
        P.pdl_wait()
        # a failure anywhere voids the row: waits that gave up read stale words
        f = Int32(0)
        if cutlass.const_expr(self.fast1 and plain is None):
            if mask == Int32(0):
                f = sm.found[7]
            else:
                f = self.failed(sm, ctx)
        elif cutlass.const_expr(self.fast1 and plain):
            f = sm.found[7]
        else:
            f = self.failed(sm, ctx)
        if f != Int32(0):
            self.empty_row(t, ctx)
        if tid == Int32(0):
            P.st_u32(C.state_epoch(ctx.state, ctx.max_rows, t), row.ep)
        return epn, f

    @cute.jit
    def finish(self, refused: Int32, last_f: Int32, rowi: Int32, sm: MergeSmem, ctx: Launch):
        """The launch's end for this CTA: withdraw on a failure, the host's status copy."""
        report = refused
        if refused == Int32(0):
            # a failed call withdraws this rank's rows, so that a late peer times out too instead
            # of pairing with this call's words (a CTA that merged rows reuses its last check)
            P.pdl_wait()
            fe = last_f
            if cutlass.const_expr(self.clus > 1):
                # (the other CTAs of a cluster end no row: they read the status here)
                if rowi == Int32(0) or ctx.crank != Int32(0):
                    fe = self.failed(sm, ctx)
            elif rowi == Int32(0):
                fe = self.failed(sm, ctx)
            if fe != Int32(0):
                self.withdraw(ctx)
            report = fe
        # the host's pinned copy of a set status; a healthy launch writes nothing
        if ctx.host_status != Int64(0):
            if report != Int32(0):
                if ctx.tid == Int32(0):
                    self.report(ctx)

    @cute.jit
    def report(self, ctx: Launch):
        """Copy the status words to the host, the code last (whoever sees it sees the rest)."""
        for i in cutlass.range_constexpr(layout.STATUS_REPORT_WORDS):
            if cutlass.const_expr(i != layout.STATUS_CODE):
                P.st_volatile_u32(ctx.host_status + Int64(4 * i), Int32(P.ld_volatile_u32(C.status_word(ctx.status, i))))
        P.fence_sys()
        P.st_volatile_u32(ctx.host_status + Int64(4 * layout.STATUS_CODE),
                          Int32(P.ld_volatile_u32(C.status_word(ctx.status, layout.STATUS_CODE))))

    @cute.jit
    def failed(self, sm: MergeSmem, ctx: Launch) -> Int32:
        """CTA-uniform: 1 when a timeout was recorded (status 1 or 2)."""
        seg = sm.seg
        cute.arch.sync_threads()
        if ctx.tid == Int32(0):
            code = Int32(P.ld_volatile_u32(ctx.status))
            seg[47] = Int32(0)
            if code == Int32(layout.STATUS_TIMEOUT_ROUND1) or code == Int32(layout.STATUS_TIMEOUT_RESCUE):
                seg[47] = Int32(1)
        cute.arch.sync_threads()
        return seg[47]

    @cute.jit
    def withdraw(self, ctx: Launch):
        """Tag the first LL record of this rank's rows (both parities) on every rank 2^31 away
        from the row's epoch: no reader accepts it (idempotent)."""
        max_rows = ctx.max_rows
        for p in cutlass.range(self.world, unroll=1):
            base = P.ld_u64(ctx.peers + Int64(p) * Int64(8))
            for i in cutlass.range(ctx.tid, Int32(2) * max_rows, C.TB, unroll=1):
                par = i // max_rows
                r = i - par * max_rows
                bad = P.ld_u32(C.state_epoch(ctx.state, max_rows, r)) ^ Int32(-(2**31))
                off = C.ll_row_offset(par, ctx.rank, r, self.world, max_rows, self.ll_row_bytes)
                P.st_ll_v4(base + off, Int32(0), bad, Int32(0))

    @cute.jit
    def empty_row(self, t: Int32, ctx: Launch):
        """Outputs of a row the exchange refused or voided: nothing selected."""
        base = Int64(t) * Int64(self.topk) * Int64(4)
        for i in cutlass.range(ctx.tid, self.topk, C.TB, unroll=1):
            P.st_u32(ctx.kv_rows + base + Int64(i) * Int64(4), Int32(-1))
            if ctx.ids != Int64(0):
                P.st_u32(ctx.ids + base + Int64(i) * Int64(4), Int32(-1))
        if ctx.tid == Int32(0):
            P.st_u32(ctx.counts + Int64(t) * Int64(4), Int32(0))
            if ctx.saturated != Int64(0):
                P.st_u32(ctx.saturated + Int64(t) * Int64(4), Int32(0))

    # ------------------------------------------------------------------ launch

    @cute.jit
    def entry(self, peers: Int64, local: Int64, state: Int64, logits: Int64, row_ends: Int64,
              req_id: Int64, block_table: Int64, kv_rows: Int64, counts: Int64, ids: Int64,
              saturated: Int64, rows: Int32, cols: Int32, bt_rows: Int32, bt_cols: Int32,
              block_size: Int32, rank: Int32, max_rows: Int32, rescue_off: Int64,
              flags_off: Int64, timeout_us: Int32, host_status: Int64):  # fmt: skip
        self.kernel(peers, local, state, logits, row_ends, req_id, block_table, kv_rows, counts,
                    ids, saturated, rows, cols, bt_rows, bt_cols, block_size, rank, max_rows,
                    rescue_off, flags_off, timeout_us, host_status).launch(
            grid=(rows, 1, 1), block=(C.TB, 1, 1), smem=self.smem)

    def compile(self, arch: str | None = None, dump_dir: str = "."):
        """The compiled kernel for the configuration's target (cached; PTX, cubin in dump_dir)."""
        arch = arch or self.config.arch
        if arch != self.config.arch:
            raise ValueError(f"a merge configured for {self.config.arch} cannot compile for {arch}")
        if arch not in self._compiled:
            self._compiled[arch] = cute.compile(self.entry, *ABI.dummies(Int64, Int32),
                                                options=C.compile_options(arch, dump_dir))
        return self._compiled[arch]
