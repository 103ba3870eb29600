"""The exchange merge (docs/DESIGN.md §6.2-§6.7): each rank's consumer kernel waits for the
W ranks' local top-N lists of a row, selects their exact top-K, writes the outputs, rescues
saturated ranks, and bumps the row's epoch.

ABI: ``abi.MERGE`` (kernels/abi.py, the one declaration; ``kernel`` and ``entry`` spell it
out, tests/test_kernels_compile.py checks them against it).

Protocol, per row t with e = epoch[t] + 1 (grid = G CTAs, or G clusters of ``clus`` CTAs;
CTA b walks rows b, b + G, ... in the same order on every rank, so a CTA only waits for CTAs
that already run, §6.7):

  round 1     the W lists of parity e & 1 in this rank's own buffer, each 8-byte LL half
              trusted once its tag is e (volatile polls under a %globaltimer timeout, which
              records status [1, row, epoch, rank]);
  select      T = the K-th largest key (ord16 score << G | 2^G - 1 - g, g = l W + q), 0 when
              the row has fewer than K: the boundary score from a score histogram, then a
              tie-break on g among the keys of that score;
  outputs     the order-preserving compaction of {key >= T} (owner-major, lists ascend in
              l): ids, this rank's kv_rows through the block table, counts, -1 padding;
  saturation  rank q is saturated when all N of its keys were selected and T is not its
              own: its list may have hidden keys above T (full keys, §6.4);
  rescue      a saturated rank pushes its local top-K into slot s of every rank's rescue
              region and releases flag seq + 1 (system scope); every rank acquires the flags
              (timeout: status [2, ...]), selects round 2 over the non-saturated lists and
              the K-lists, rewrites the outputs; seq[t] += 1;
  row end     griddepcontrol.wait (the producer grid is complete), a failure anywhere voids
              the row (empty outputs), then epoch[t] = e.

Paths by configuration (``Merge.__init__`` decides them from a ``MergeConfig``): the keys of
a row in registers (up to KP_MAX words per thread), else re-read from memory by a radix
select; a row of many words per thread split over a cluster of CTAs whose sums travel
through DSMEM; round 2 in registers, in loops rolled over shared memory, or by the radix
select.
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
# Up to this many words per thread the stats, histogram, selection and output stores have no
# branch per word (predicated stores, a dummy bin): W = 8, N = 512: -0.4..-1.2 us; with 32
# (W = 16, N = 1024) ptxas spilled the words (45.7 -> 71.8 us), so those keep branches.
BRANCH_FREE_KP = 18
# Above this many round-1 words per thread the outputs loop is rolled over a shared-memory copy
# of the words: unrolled, W = 16, N = 1024 (32) waited on instruction fetch 53% of the time.
ROLL_KP = 18
# Round 2 rolled: pair groups (8 bytes) per thread held by the rescue select's hist1 and mask
# (free once its K-list is pushed); the rest go to the merge's own stage2.
R2_H = S.NB1 // (2 * C.TB)
R2_M = S.MASK_WORDS // (2 * C.TB)
# A merge CTA must fit on an SM beside a producer CTA (it starts under PDL while the producer
# runs): round 2 is rolled only where both kernels' shared memory, plus the 1 KB an SM reserves
# per CTA, fit the H100 / H200's 228 KB.
SM_SMEM_BYTES = 228 * 1024
CTA_RESERVED_SMEM = 1024
EQ_MAX = abi.MERGE_EQ_MAX  # most keys at the boundary score tie-broken by ranking (one per thread)
# A row of more than CLUS_KP round-1 words per thread is split over a cluster of at most
# CLUS_MAX CTAs of at least CLUS_KP words each (8: W = 8, N = 512's branch-free size).  W = 16,
# N = 1024 as 2 CTAs of 16 words beat 4 of 8 at R >= 64 (H200: 20.1 against 30.7 us at
# R = 64, 55 against 96 at R = 256; one CTA 29 / 86) and lost at R = 16 (18.2 against 13.3).
CLUS_KP = 8
CLUS_MAX = 2
# The merge_wide image (kernels/cache.py): clusters of up to CLUS_WIDE CTAs of at least WIDE_KP
# words, launched when every row of a call has its own cluster at once (layout.merge_uses_wide):
# W = 16, N = 1024, R = 1: 12.6 against 19.5 us; W = 8, N = 1024 over 4 CTAs of 4 words: 10.8 /
# 11.5 us at R = 1 / 16 against 12.3 / 12.1 over 2 of 8.
CLUS_WIDE = abi.MERGE_CLUS_WIDE
WIDE_KP = 4
CLUS_XC = 16  # words of a clustered CTA's published row totals (MergeSmem.xc)


@dataclasses.dataclass(frozen=True)
class MergeConfig:
    """What varies between merge images: the exchange's shape, the rescue list (a rescue pushes
    the producer's K-list of the row instead of selecting it here), and the cluster a row of
    many words per thread may be split over (the merge_wide image: ``wide()``)."""

    world: int
    topk: int
    local_topk: int
    rescue_list: bool = False
    max_cluster: int = CLUS_MAX  # the most CTAs of a clustered row
    min_cluster_words: int = CLUS_KP  # the fewest round-1 words per thread of a clustered CTA

    def wide(self) -> "MergeConfig":
        return dataclasses.replace(self, max_cluster=CLUS_WIDE, min_cluster_words=WIDE_KP)


# page = (l * page_magic(B)) >> PAGE_SHIFT equals l // B for every 0 <= l < 2**17 and B >= 1:
# with m = 2**40 // B + 1 the excess l * (m - 2**40 / B) / 2**40 is below 2**-23, less than
# 1 / B for B <= 2**17, and for larger B l / B + 2**-23 < 1 (tests/test_kernels_compile.py
# checks it over every l for many B)
PAGE_SHIFT = 40


def page_magic(block_size: int) -> int:
    return (1 << PAGE_SHIFT) // max(int(block_size), 1) + 1


FH_DUMMY = SCORE_BINS  # fh's extra bin: the empty words' count (never read), so that every word counts unconditionally
FAST_WORDS = (SCORE_BINS + 16 + SCORE_BINS2 + EQ_MAX + 16 + 16 + 32 + 16  # fh (+ dummy), fh2, eq, st, wt, pref, sc
              + SCORE_BINS + 2 * SCORE_BINS2)  # fg, fg2, fg3


def smem_bytes(topk: int) -> int:
    rw = layout.row_words(topk)
    # the rescue's select (its row is buf), hist, warp_totals, scalars, rcnt, seg
    # (MergeSmem order), fast-path tensors + slack
    return (S.smem_bytes(rw, cached=False) + C.TB * 4 + (C.NWARPS + 16 + 16 + 48) * 4
            + FAST_WORDS * 4 + 7 * 16 + 128)


class MergeSmem:
    def __init__(self, rw: int, stage_words: int = 0, stage2_words: int = 0, r2m_words: int = 0,
                 clus: bool = False):
        smem = cutlass.memory.SmemAllocator()
        # the rescue's local top-K: the producer's select on one CTA (its row is buf)
        self.sel = S.SelectSmem(smem, rw, False)
        self.buf = self.sel.row
        self.hist = smem.allocate_tensor(Int32, cute.make_layout((C.TB,)), 16)
        self.warp_totals = smem.allocate_tensor(Int32, cute.make_layout((C.NWARPS,)), 16)
        self.scalars = smem.allocate_tensor(Int32, cute.make_layout((16,)), 16)
        self.rcnt = smem.allocate_tensor(Int32, cute.make_layout((16,)), 16)
        # seg_off[q] (q <= W) and seg_slot[q] of round 2's owner-major segments
        self.seg = smem.allocate_tensor(Int32, cute.make_layout((48,)), 16)
        # fast path: score histograms, keys at the boundary score, stats (4 slots of
        # [count, max, min, eq count]: row parity x round), warp totals, per-rank
        # prefix of the selected counts, scalars
        self.fh = smem.allocate_tensor(Int32, cute.make_layout((SCORE_BINS + 16,)), 16)
        self.fh2 = smem.allocate_tensor(Int32, cute.make_layout((SCORE_BINS2,)), 16)
        self.eq = smem.allocate_tensor(Int32, cute.make_layout((EQ_MAX,)), 16)
        self.st = smem.allocate_tensor(Int32, cute.make_layout((16,)), 16)
        self.wt = smem.allocate_tensor(Int32, cute.make_layout((16,)), 16)
        self.pref = smem.allocate_tensor(Int32, cute.make_layout((32,)), 16)
        self.sc = smem.allocate_tensor(Int32, cute.make_layout((16,)), 16)
        # tie-break histograms on g (many keys at the boundary score)
        self.fg = smem.allocate_tensor(Int32, cute.make_layout((SCORE_BINS,)), 16)
        self.fg2 = smem.allocate_tensor(Int32, cute.make_layout((SCORE_BINS2,)), 16)
        self.fg3 = smem.allocate_tensor(Int32, cute.make_layout((SCORE_BINS2,)), 16)
        # round 1's words, [word i][thread] (ROLL_KP: the outputs' loop rolled over them)
        self.stage = smem.allocate_tensor(Int32, cute.make_layout((max(stage_words, 4),)), 16)
        # round 2's words past those the rescue select's hist1 and mask hold (r2roll)
        self.stage2 = smem.allocate_tensor(Int32, cute.make_layout((max(stage2_words, 4),)), 16)
        self.r2m = smem.allocate_tensor(Int32, cute.make_layout((max(r2m_words, 4),)), 16)  # its mask words
        if clus:
            # a clustered row (Merge.clus): the cluster's sum of a histogram (or its tied keys'
            # g, from EQ_MAX on) read by this CTA only, and this CTA's row totals that the
            # others read through DSMEM (xc)
            self.hs = smem.allocate_tensor(Int32, cute.make_layout((SCORE_BINS,)), 16)
            self.he = smem.allocate_tensor(Int32, cute.make_layout((EQ_MAX,)), 16)
            self.xc = smem.allocate_tensor(Int32, cute.make_layout((CLUS_XC,)), 16)

    def parts(self):
        """The tensors as locals: the DSL cannot carry a Python object whose
        attributes are written through a dynamic if / loop, but it carries
        tensors fine."""
        return self.buf, self.hist, self.warp_totals, self.scalars, self.rcnt, self.seg

    def fparts(self):
        return self.fh, self.fh2, self.eq, self.st, self.wt, self.pref, self.sc


class Merge:
    """The exchange merge of one ``MergeConfig``; ``compile()`` builds its cubin (cached)."""

    def __init__(self, config: MergeConfig):
        world, topk, n = config.world, config.topk, config.local_topk
        layout.check_config(world, topk, n)
        self.config = config
        self.world, self.topk, self.n = world, topk, n
        self.gbits = layout.gid_bits(world)
        self.keybits = 16 + self.gbits
        self.rw_k = layout.row_words(topk)
        self.klist = S.klist_n2(n, topk, config.rescue_list) > 0  # a rescue pushes the producer's K-list
        self.rescue_row_bytes = layout.rescue_row_bytes(topk)
        self.ll_row_bytes = layout.ll_row_bytes(n)
        self.slots = layout.rescue_slots(topk, n, world)
        # Round 1 in registers (fast1): kp1 words per thread, warp-interleaved pairs (position
        # v = warp * 32 * kp1 + 64 i + 2 * lane + h), else the radix select from memory.
        self.nk1 = world * n
        self.kp1 = 2 * -(-self.nk1 // (2 * C.TB))
        self.fast1 = self.kp1 <= KP_MAX
        self.kp1_row = self.kp1  # (the words per thread of a row on one CTA)
        # A row of more than min_cluster_words words per thread is split over a cluster of
        # clus CTAs of kp1 words each, CTA c holding the owner-major positions [c cp, (c + 1) cp):
        # whole lists, each warp's inside one list.  Every sum the select takes is each CTA's
        # own, published by a cluster barrier and read through DSMEM, every decision computed
        # alike in every CTA (so all pass the same barriers); a rescue runs on CTA 0 alone.
        self.clus = 1
        c = min(config.max_cluster, self.kp1 // max(2, config.min_cluster_words), S.CLUSTER_MAX)
        ck = self.kp1 // c if c > 1 else 0
        if (c > 1 and self.fast1 and ck % 2 == 0 and self.nk1 == c * C.TB * ck
                and world % c == 0 and n % (32 * ck) == 0):
            self.clus = c
            self.kp1 = ck
        self.cp = self.nk1 // self.clus  # positions per CTA of a row
        # Round 2 (a rescue) over the non-saturated lists and up to ``slots`` K-lists: in
        # registers (fast2) where its words fit, else the radix select.
        self.nk2max = self.slots * topk + (world - self.slots) * n
        self.kp2 = 2 * -(-self.nk2max // (2 * C.TB))
        self.fast2 = self.slots > 0 and self.kp2 <= KP_MAX
        self.kp = max([2] + [k for k, f in ((self.kp1, self.fast1), (self.kp2, self.fast2)) if f])
        # Round 1's block-table entries prefetched (in flight during the select) into
        # registers, or for more words per thread into shared memory.
        self.pre_bt = self.fast1 and self.kp1 <= PRE_BT_MAX
        # More round-1 words per thread than ROLL_KP: the outputs walk them in a rolled loop
        # from a shared-memory copy (the unrolled code waited on instruction fetch).
        self.roll1 = self.fast1 and self.kp1 > ROLL_KP
        self.stage_words = self.kp1 * C.TB if self.roll1 else 0
        # Clustered rows hold round 1 as contiguous runs (thread t: positions t kp1 .. + kp1 - 1
        # of its CTA): the selected keys before a key come from one warp scan, where pair groups
        # take four ballots each.  W = 16, N = 1024: -0.35..-1.5 us at R = 1-64; on one CTA
        # (W = 8, N = 512) it lost 0.5 us at R = 1 and 3 us at R = 256, so one CTA keeps pairs.
        self.runs = (self.clus > 1 and self.fast1 and not self.roll1 and n % self.kp1 == 0
                     and 32 % self.kp1 == 0)  # fmt: skip
        # Round 2 rolled over shared memory (round2_rolled): a third of the register path's code,
        # which a rescue fetches cold once per launch (W = 8, N = 512: forced rescue 49.2 ->
        # 40.5 us).  Its pair groups go to the rescue select's hist1 and mask, then stage2; at
        # most 16 groups (4-bit segment codes in two registers), and only where the merge
        # still fits beside a producer CTA (else round 2 stays in registers).
        self.roll2 = False
        self.stage2_words = self.r2m_words = 0
        if self.fast2 and self.kp2 // 2 <= 16:
            self.stage2_words = max(0, self.kp2 // 2 - R2_H - R2_M) * 2 * C.TB
            self.r2m_words = (self.nk2max // 32 + 3) // 4 * 4
            self.roll2 = (self._smem() + select_push_smem(n, topk, config.rescue_list) + 2 * CTA_RESERVED_SMEM
                          <= SM_SMEM_BYTES)  # fmt: skip
            if not self.roll2:
                self.stage2_words = self.r2m_words = 0
        self.smem = self._smem()
        # The rescue select's vectors per round: the producer's, except for many words per
        # thread, where ptxas then spilled the whole kernel (W = 16, N = 1024: 45.9 -> 72.1 us).
        self.rescue_u1 = 4 if self.kp1_row > BRANCH_FREE_KP else S.U1
        # A row without a rescue ends (and the launch after such a last row) before the
        # rescue's ~100 KB of code, which it then never fetches (W = 8, N = 512: -0.6..-0.9 us);
        # for many words per thread one end after it (ptxas spilled more: W = 16, N = 1024
        # +3.5 us).
        self.end_first = self.kp1 <= BRANCH_FREE_KP
        self._compiled = {}

    def _smem(self) -> int:
        """Launch shared memory (bytes) of the MergeSmem parts this configuration allocates."""
        return (smem_bytes(self.topk) + 4 * max(self.stage_words, 4) + 16
                + 4 * max(self.stage2_words, 4) + 16 + 4 * max(self.r2m_words, 4) + 16
                + (4 * (SCORE_BINS + EQ_MAX + CLUS_XC) + 32 if self.clus > 1 else 0))  # fmt: skip

    # ---------------------------------------------------------------- keys

    @cute.jit
    def make_key(self, w: Uint32, m: Uint32, j: Int32, q: Int32) -> Uint64:
        """Packed word (+ its mask word) of list index j of rank q -> 64-bit
        key ord16 << G | (2^G - 1 - g), g = l * W + q; 0 for an empty word."""
        key = Uint64(0)
        if w != Uint32(0):
            hi = (m >> Uint32(j & Int32(31))) & Uint32(1)
            lidx = (Uint32(0xFFFF) - (w & Uint32(0xFFFF))) | (hi << Uint32(16))
            g = Uint64(lidx) * Uint64(self.world) + Uint64(q)
            key = (Uint64(w >> Uint32(16)) << Uint64(self.gbits)) | (
                Uint64((1 << self.gbits) - 1) - g
            )
        return key

    @cute.jit
    def probe(self, addr: Int64, flag: cutlass.Constexpr) -> Uint64:
        """One load of what a wait watches, tag in the high word: an LL half
        (word | tag << 32, volatile load) or a rescue flag (acquire load at system
        scope; the flag's value is its tag)."""
        h = Uint64(0)
        if cutlass.const_expr(flag):
            h = Uint64(Uint32(P.ld_acquire_sys(addr))) << Uint64(32)
        else:
            h = P.ld_volatile_u64(addr)
        return h

    @cute.jit
    def wait_tag(self, addr: Int64, want: Int32, flag: cutlass.Constexpr, status: Int64,
                 code: cutlass.Constexpr, t: Int32, ep: Int32, q: Int32, timeout_ns: Int64) -> Uint64:
        """probe(addr) once its tag is ``want``.  Spins with a %globaltimer timeout:
        on timeout it records [code, row, epoch, rank] once (the first failure in
        the whole grid wins); once status is set every wait gives up at once."""  # fmt: skip
        h = self.probe(addr, flag)
        if Int32(Uint32(h >> Uint64(32))) != want:
            start = P.globaltimer()
            go = Int32(1)
            while go != Int32(0):
                h = self.probe(addr, flag)
                if Int32(Uint32(h >> Uint64(32))) == want:
                    go = Int32(0)
                elif P.ld_volatile_u32(status) != Uint32(layout.STATUS_OK):
                    go = Int32(0)
                elif P.globaltimer() - start > timeout_ns:
                    self.record(status, Int32(code), t, ep, q)
                    go = Int32(0)
        return h

    @cute.jit
    def ll_half(self, addr: Int64, ep: Int32, wait: cutlass.Constexpr, status: Int64,
                t: Int32, q: Int32, timeout_ns: Int64) -> Uint32:
        """Word of the LL half at addr; with ``wait``, once its tag is ep."""
        h = Uint64(0)
        if cutlass.const_expr(wait):
            h = self.wait_tag(addr, ep, False, status, layout.STATUS_TIMEOUT_ROUND1, t, ep, q, timeout_ns)
        else:
            h = P.ld_volatile_u64(addr)
        return Uint32(h & Uint64(0xFFFFFFFF))

    @cute.jit
    def record(self, status: Int64, code: Int32, t: Int32, ep: Int32, q: Int32):
        old = P.atom_cas_u32(C.status_word(status, layout.STATUS_CODE), Int32(layout.STATUS_OK), code)
        if old == Int32(layout.STATUS_OK):
            P.st_volatile_u32(C.status_word(status, layout.STATUS_ROW), t)
            P.st_volatile_u32(C.status_word(status, layout.STATUS_EPOCH), ep)
            P.st_volatile_u32(C.status_word(status, layout.STATUS_RANK), q)

    @cute.jit
    def ll_key(self, ll_base: Int64, q: Int32, j: Int32, ep: Int32, wait: cutlass.Constexpr,
               status: Int64, t: Int32, timeout_ns: Int64) -> Uint64:
        """Key j of rank q's round-1 list; ll_base = this row's LL row of rank
        0 (rank q's is ll_base + q * max_rows * row bytes, passed in)."""  # fmt: skip
        w = self.ll_half(C.ll_word_addr(ll_base, j), ep, wait, status, t, q, timeout_ns)
        mj = Int32(self.n) + (j >> Int32(5))
        m = self.ll_half(C.ll_word_addr(ll_base, mj), ep, wait, status, t, q, timeout_ns)
        return self.make_key(w, m, j, q)

    @cute.jit
    def key_r1(self, v: Int32, ll0: Int64, ll_stride: Int64, ep: Int32, wait: cutlass.Constexpr,
               status: Int64, t: Int32, timeout_ns: Int64) -> Uint64:
        """Round-1 key at owner-major index v = q * N + j (0 past the end)."""
        key = Uint64(0)
        if v < Int32(self.nk1):
            q = v // Int32(self.n)
            j = v - q * Int32(self.n)
            key = self.ll_key(ll0 + Int64(q) * ll_stride, q, j, ep, wait, status, t, timeout_ns)
        return key

    @cute.jit
    def key_r2(self, v: Int32, seg: cute.Tensor, ll0: Int64, ll_stride: Int64, resc0: Int64,
               ep: Int32, status: Int64, t: Int32, timeout_ns: Int64) -> Uint64:
        """Round-2 key at owner-major index v: segment q is rank q's K-list
        (rescue slot seg[17 + q] >= 0) or its round-1 list."""  # fmt: skip
        key = Uint64(0)
        if v < seg[self.world]:
            q = Int32(0)
            for r in cutlass.range_constexpr(1, self.world):
                if seg[r] <= v:
                    q = Int32(r)
            j = v - seg[q]
            s = seg[17 + q]
            if s >= Int32(0):
                base = resc0 + Int64(s) * Int64(self.rescue_row_bytes)
                w = P.ld_volatile_u32(base + Int64(j) * Int64(4))
                m = P.ld_volatile_u32(base + Int64(Int32(self.topk) + (j >> Int32(5))) * Int64(4))
                key = self.make_key(w, m, j, q)
            else:
                key = self.ll_key(ll0 + Int64(q) * ll_stride, q, j, ep, False, status, t,
                                  timeout_ns)  # fmt: skip
        return key

    # ------------------------------------------------------------- select

    @cute.jit
    def hist_add(self, key: Uint64, hi: Int32, lo: Int32, prefix: Uint64, hist: cute.Tensor):
        d = Int32((key >> Uint64(lo)) & ((Uint64(1) << Uint64(hi - lo)) - Uint64(1)))
        C.hist_inc(hist, d, key != Uint64(0) and (key >> Uint64(hi)) == prefix)

    @cute.jit
    def find_key(self, key: Uint64, hi: Int32, prefix: Uint64, scalars: cute.Tensor):
        if key != Uint64(0) and (key >> Uint64(hi)) == prefix:
            scalars[8] = Int32(Uint32(key & Uint64(0xFFFFFFFF)))
            scalars[9] = Int32(Uint32(key >> Uint64(32)))

    @cute.jit
    def radix_select(self, keys: cute.Tensor, round2: cutlass.Constexpr,
                     sm: MergeSmem, tid, lane, warp, ll0: Int64, ll_stride: Int64, resc0: Int64,
                     ep: Int32, status: Int64, t: Int32, timeout_ns: Int64) -> Uint64:
        """T = the K-th largest nonzero key (0 if fewer than K), exact.
        9-bit digits from the top; the bin holding the K-th key becomes the
        prefix of the next pass; a bin of one key ends the search with one
        extra read pass.  Uniform control flow (every value from smem)."""  # fmt: skip
        hist, scalars, seg, warp_totals = sm.hist, sm.scalars, sm.seg, sm.warp_totals
        hi = Int32(self.keybits)
        prefix = Uint64(0)
        need = Int32(self.topk)
        T = Uint64(0)
        done = Int32(0)
        first = Int32(1)
        nk = Int32(self.nk1)
        if cutlass.const_expr(round2):
            nk = seg[self.world]
        while done == Int32(0):
            lo = hi - Int32(C.DIGIT)
            if lo < Int32(0):
                lo = Int32(0)
            hist[tid] = Int32(0)
            cute.arch.sync_threads()
            for v in cutlass.range(tid, nk, C.TB, unroll=1):
                key = Uint64(0)
                if cutlass.const_expr(round2):
                    key = self.key_r2(v, seg, ll0, ll_stride, resc0, ep, status, t, timeout_ns)
                else:
                    key = self.key_r1(v, ll0, ll_stride, ep, False, status, t, timeout_ns)
                self.hist_add(key, hi, lo, prefix, hist)
            cute.arch.sync_threads()
            nb = Int32(1) << (hi - lo)
            total = C.find_bin(hist, nb, need, tid, lane, warp, warp_totals, scalars, 0)
            if first == Int32(1) and total < Int32(self.topk):
                done = Int32(1)  # fewer than K keys: all are selected, T = 0
            else:
                b = scalars[0]
                cnt = scalars[2]
                prefix = (prefix << Uint64(hi - lo)) | Uint64(b)
                need = need - scalars[1]
                hi = lo
                if hi == Int32(0):
                    T = prefix
                    done = Int32(1)
                elif cnt == Int32(1):
                    for v in cutlass.range(tid, nk, C.TB, unroll=1):
                        key = Uint64(0)
                        if cutlass.const_expr(round2):
                            key = self.key_r2(v, seg, ll0, ll_stride, resc0, ep, status,
                                              t, timeout_ns)  # fmt: skip
                        else:
                            key = self.key_r1(v, ll0, ll_stride, ep, False, status, t, timeout_ns)
                        self.find_key(key, hi, prefix, scalars)
                    cute.arch.sync_threads()
                    T = (Uint64(Uint32(scalars[9])) << Uint64(32)) | Uint64(Uint32(scalars[8]))
                    done = Int32(1)
            first = Int32(0)
            cute.arch.sync_threads()
        return T

    # ------------------------------------------------------------ outputs

    @cute.jit
    def emit_chunk(self, key: Uint64, T: Uint64, count_ranks: cutlass.Constexpr, sm: MergeSmem,
                   tid, lane, warp, all_run: Int32, own_run: Int32, rank: Int32, t: Int32,
                   ids: Int64, kv_rows: Int64, bt_row: Int64, req_ok: Int32, bt_cols: Int32,
                   block_size: Int32):
        """One TB-chunk of the owner-major compaction of {key >= T}; returns
        the updated (all_run, own_run)."""  # fmt: skip
        sm_buf, sm_hist, sm_warp_totals, sm_scalars, sm_rcnt, sm_seg = sm.parts()
        sel = key != Uint64(0) and key >= T
        g = Int32(0)
        q = Int32(0)
        flag = Int32(0)
        if sel:
            g = Int32(Uint64((1 << self.gbits) - 1) - (key & Uint64((1 << self.gbits) - 1)))
            q = g % Int32(self.world)
            flag = Int32(1)
            if q == rank:
                flag = Int32(1 + (1 << 16))
        incl, tot = C.block_scan(flag, lane, warp, sm_warp_totals)
        excl = incl - flag
        if sel:
            pos = all_run + (excl & Int32(0xFFFF))
            if ids != Int64(0):
                P.st_u32(ids + (Int64(t) * Int64(self.topk) + Int64(pos)) * Int64(4), g)
            if cutlass.const_expr(count_ranks):
                cute.arch.atomic_add(sm_rcnt.iterator + q, Int32(1), sem="relaxed", scope="cta")
            if q == rank:
                kpos = own_run + (excl >> Int32(16))
                slot = self.kv_slot(g // Int32(self.world), bt_row, req_ok, bt_cols, block_size)
                P.st_u32(kv_rows + (Int64(t) * Int64(self.topk) + Int64(kpos)) * Int64(4), slot)
        return all_run + (tot & Int32(0xFFFF)), own_run + (tot >> Int32(16))

    @cute.jit
    def page_of(self, lidx: Int32, block_size: Int32) -> Int32:
        """lidx // block_size for 0 <= lidx < 2**17, by a multiply with the launch's
        ``self.pdiv`` = page_magic(block_size) (no division per key, and no branch: a
        uniform branch per key split the loops into a block per key)."""
        return Int32((Uint64(lidx) * self.pdiv) >> Uint64(PAGE_SHIFT))

    @cute.jit
    def lidx_of(self, w: Uint32, hbits: Uint32, i: cutlass.Constexpr) -> Int32:
        """Local index of word i (bit 16 from hbits)."""
        return Int32(Uint32(0xFFFF) - (w & Uint32(0xFFFF))) | (Int32((hbits >> Uint32(i)) & Uint32(1)) << Int32(16))

    @cute.jit
    def kv_slot(self, lidx: Int32, bt_row: Int64, req_ok: Int32, bt_cols: Int32,
                block_size: Int32) -> Int32:
        """block_table[req, l // B] * B + l % B; -1 if req or the page is out
        of range (never reads out of bounds)."""
        slot = Int32(-1)
        if req_ok != Int32(0):
            page = self.page_of(lidx, block_size)
            if page < bt_cols:
                blk = P.ld_u32(bt_row + Int64(page) * Int64(4))
                slot = blk * block_size + (lidx - page * block_size)
        return slot

    @cute.jit
    def emit(self, keys: cute.Tensor, round2: cutlass.Constexpr,
             T: Uint64, sm: MergeSmem, tid, lane, warp, ll0: Int64, ll_stride: Int64,
             resc0: Int64, ep: Int32, status: Int64, t: Int32, timeout_ns: Int64, rank: Int32,
             ids: Int64, kv_rows: Int64, counts: Int64, bt_row: Int64, req_ok: Int32,
             bt_cols: Int32, block_size: Int32):
        """Outputs of row t from the selection {key >= T}: kv_rows (own
        tokens, ascending l), ids (owner-major), counts; -1 padding.  Round 1
        also counts the selected keys of every rank (sm_rcnt)."""  # fmt: skip
        sm_buf, sm_hist, sm_warp_totals, sm_scalars, sm_rcnt, sm_seg = sm.parts()
        if tid < Int32(16):
            sm_rcnt[tid] = Int32(0)
        cute.arch.sync_threads()
        all_run = Int32(0)
        own_run = Int32(0)
        nk = Int32(self.nk1)
        if cutlass.const_expr(round2):
            nk = sm_seg[self.world]
        for base in cutlass.range(0, nk, C.TB, unroll=1):
            v = base + tid
            key = Uint64(0)
            if cutlass.const_expr(round2):
                if v < nk:
                    key = self.key_r2(v, sm_seg, ll0, ll_stride, resc0, ep, status, t, timeout_ns)
            else:
                key = self.key_r1(v, ll0, ll_stride, ep, False, status, t, timeout_ns)
            all_run, own_run = self.emit_chunk(
                key, T, not round2, sm, tid, lane, warp, all_run, own_run, rank, t, ids,
                kv_rows, bt_row, req_ok, bt_cols, block_size)  # fmt: skip
        # -1 padding (all_run, own_run are uniform: they come from block totals)
        for i in cutlass.range(own_run + tid, self.topk, C.TB, unroll=1):
            P.st_u32(kv_rows + (Int64(t) * Int64(self.topk) + Int64(i)) * Int64(4), Int32(-1))
        if ids != Int64(0):
            for i in cutlass.range(all_run + tid, self.topk, C.TB, unroll=1):
                P.st_u32(ids + (Int64(t) * Int64(self.topk) + Int64(i)) * Int64(4), Int32(-1))
        if tid == Int32(0):
            P.st_u32(counts + Int64(t) * Int64(4), own_run)
        cute.arch.sync_threads()

    # ------------------------------------------------------ fast path
    # Candidate words (32 bits: ord16 << 16 | 0xFFFF - (l & 0xFFFF)) in registers,
    # warp-interleaved pairs: thread (warp, lane) holds positions
    # v = warp * 32 * kp + i * 64 + 2 * lane + h (i < kp / 2, h < 2); bit i of hb[0]
    # is bit 16 of l.  Select: the boundary score v from a histogram over
    # (s - lo) >> shift (lo / hi / count from warp reductions), then the tie-break on
    # g among the keys of score v only; outputs by warp ballots (the lists arrive in
    # ascending l, so the selection is an order-preserving compaction).

    @cute.jit
    def pair_pos(self, i: cutlass.Constexpr, kp: cutlass.Constexpr, lane, warp) -> Int32:
        v = warp * Int32(32 * kp) + Int32(i * 64) + Int32(2) * lane
        if cutlass.const_expr(self.clus > 1):
            v = v + self.cbase  # (0 in CTA 0, the only one that runs a round 2)
        return v

    @cute.jit
    def pos1(self, i: cutlass.Constexpr, kp: cutlass.Constexpr, lane, warp) -> Int32:
        """Round 1's position of pair group i of this lane: pair_pos, or with runs (a clustered
        row) (32 warp + lane) kp + 2 i + the CTA's base."""
        v = Int32(0)
        if cutlass.const_expr(self.runs):
            v = (warp * Int32(32) + lane) * Int32(kp) + Int32(2 * i)
            if cutlass.const_expr(self.clus > 1):
                v = v + self.cbase
        else:
            v = self.pair_pos(i, kp, lane, warp)
        return v

    @cute.jit
    def owner(self, v: Int32, round2: cutlass.Constexpr, seg: cute.Tensor):
        """(segment q, index j in it) of position v."""
        q = Int32(0)
        j = Int32(0)
        if cutlass.const_expr(round2):
            for r in cutlass.range_constexpr(1, self.world):
                if seg[r] <= v:
                    q = Int32(r)
            j = v - seg[q]
        else:
            q = v // Int32(self.n)
            j = v - q * Int32(self.n)
        return q, j

    @cute.jit
    def owner_p(self, ip: cutlass.Constexpr, kp: cutlass.Constexpr, lane, warp,
                round2: cutlass.Constexpr, seg: cute.Tensor, qj: cute.Tensor):
        """owner() of pair group ip of this lane; in round 2: from qj[ip] (q << 16 | j,
        computed once by load_r2_fast), not W - 1 shared loads per call."""
        q = Int32(0)
        j = Int32(0)
        if cutlass.const_expr(round2):
            x = qj[ip]
            q = x >> Int32(16)
            j = x & Int32(0xFFFF)
        else:
            q, j = self.owner(self.pos1(ip, kp, lane, warp), round2, seg)
        return q, j

    @cute.jit
    def ll_word_addr(self, base: Int64, j: Int32) -> Int64:
        return C.ll_word_addr(base, j)

    @cute.jit
    def pair_addr(self, i: cutlass.Constexpr, v: Int32, ll0: Int64, ll_stride: Int64, lane,
                  warp) -> Int64:
        """Address of the LL record of round-1 pair group i of this lane (position v).
        When a warp's positions lie in one list (N a multiple of 32 * kp), it is a
        per-warp base plus i * 512 bytes (no per-pair address registers)."""
        kp = self.kp1
        a = Int64(0)
        if cutlass.const_expr(self.runs):
            # (runs) this thread's run lies in one list: its first record, then 16 bytes a pair
            v0 = (warp * Int32(32) + lane) * Int32(kp)
            if cutlass.const_expr(self.clus > 1):
                v0 = v0 + self.cbase
            q0 = v0 // Int32(self.n)
            j0 = v0 - q0 * Int32(self.n)
            a = ll0 + Int64(q0) * ll_stride + Int64(j0 >> Int32(1)) * Int64(16) + Int64(i * 16)
        elif cutlass.const_expr(self.n % (32 * kp) == 0):
            v0 = warp * Int32(32 * kp)
            if cutlass.const_expr(self.clus > 1):
                v0 = v0 + self.cbase
            q0 = v0 // Int32(self.n)
            j0 = v0 - q0 * Int32(self.n)
            a = ll0 + Int64(q0) * ll_stride + Int64((j0 >> Int32(1)) + lane) * Int64(16) + Int64(i * 512)
        else:
            q, j = self.owner(v, False, None)
            a = self.ll_word_addr(ll0 + Int64(q) * ll_stride, j)
        return a

    @cute.jit
    def mask_half(self, vm: Int32, ll0: Int64, ll_stride: Int64) -> Uint64:
        """The LL half (word, tag) of the mask word that holds bit 16 of l for position vm."""
        q, j = self.owner(vm, False, None)
        return P.ld_volatile_u64(self.ll_word_addr(ll0 + Int64(q) * ll_stride, Int32(self.n) + (j >> Int32(5))))

    @cute.jit
    def load_r1_fast(self, words: cute.Tensor, hb: cute.Tensor, lane, warp, ll0: Int64,
                     ll_stride: Int64, ep: Int32, status: Int64, t: Int32, timeout_ns: Int64):
        """Round-1 words into registers.  Every 16-byte LL record (a pair of words) of a
        batch, and the mask halves, are loaded before any tag is checked (loads in
        flight together); then only halves whose tag is not ep are spun on (8-byte
        volatile loads).  Mask words: the 32 positions of a half-warp in a pair group
        share one mask word, so lane k < kp loads the one of (group k >> 1, half
        k & 1) and the warp shuffles it to the lanes that need it."""
        kp = self.kp1
        np_ = kp // 2
        B = min(np_, LOAD_BATCH)
        d0 = cute.make_rmem_tensor((B,), Uint64)
        d1 = cute.make_rmem_tensor((B,), Uint64)
        good = Uint64(ep) << Uint64(32)  # past the end: an empty word with the right tag
        # the mask half of this lane (k = lane < kp)
        mh = good
        vm = warp * Int32(32 * kp) + (lane >> Int32(1)) * Int32(64) + (lane & Int32(1)) * Int32(32)
        if cutlass.const_expr(self.runs):
            vm = (warp * Int32(32) + lane) * Int32(kp)  # (runs) the mask word of this thread's own run
        if cutlass.const_expr(self.clus > 1):
            vm = vm + self.cbase
        if cutlass.const_expr(self.runs):
            if vm < Int32(self.nk1):  # (runs) every lane, its own run's
                mh = self.mask_half(vm, ll0, ll_stride)
        elif lane < Int32(kp) and vm < Int32(self.nk1):
            mh = self.mask_half(vm, ll0, ll_stride)
        hbits = Uint32(0)
        mword = Uint32(0)
        for b0 in cutlass.range_constexpr(0, np_, B):
            for k in cutlass.range_constexpr(B):
                if cutlass.const_expr(b0 + k < np_):
                    v = self.pos1(b0 + k, kp, lane, warp)
                    d0[k] = good
                    d1[k] = good
                    if v < Int32(self.nk1):
                        a, c = P.ld_volatile_v2_u64(self.pair_addr(b0 + k, v, ll0, ll_stride, lane, warp))
                        d0[k] = a
                        d1[k] = c
            # One test of every tag of the batch; the waits (spin code per half) sit behind one
            # rarely taken branch, not inline after each record: the hot path stays short
            # and straight (cold instruction fetch was a measured stall of this kernel).
            bad = Int32(0)
            if cutlass.const_expr(b0 == 0):
                bad = Int32(Int32(Uint32(mh >> Uint64(32))) != ep)
            for k in cutlass.range_constexpr(B):
                if cutlass.const_expr(b0 + k < np_):
                    bad = bad | Int32(Int32(Uint32(d0[k] >> Uint64(32))) != ep) | Int32(
                        Int32(Uint32(d1[k] >> Uint64(32))) != ep)
            if bad != Int32(0):
                mh, bad = self.poll_batch(d0, d1, mh, vm, b0, B, np_, kp, lane, warp, ll0, ll_stride,
                                          ep, status, t, timeout_ns)  # fmt: skip
            if bad != Int32(0):
                # (bpoll: only after a timeout or a failure elsewhere; each wait then gives up at once)
                if cutlass.const_expr(b0 == 0):
                    if Int32(Uint32(mh >> Uint64(32))) != ep:
                        q, j = self.owner(vm, False, None)
                        mh = Uint64(self.ll_half(self.ll_word_addr(ll0 + Int64(q) * ll_stride,
                                                                   Int32(self.n) + (j >> Int32(5))),
                                                 ep, True, status, t, q, timeout_ns))  # fmt: skip
                for k in cutlass.range_constexpr(B):
                    if cutlass.const_expr(b0 + k < np_):
                        i = b0 + k
                        v = self.pos1(i, kp, lane, warp)
                        q, j = self.owner(v, False, None)
                        if Int32(Uint32(d0[k] >> Uint64(32))) != ep:
                            d0[k] = Uint64(self.ll_half(self.pair_addr(i, v, ll0, ll_stride, lane, warp), ep,
                                                        True, status, t, q, timeout_ns))  # fmt: skip
                        if Int32(Uint32(d1[k] >> Uint64(32))) != ep:
                            d1[k] = Uint64(self.ll_half(self.pair_addr(i, v, ll0, ll_stride, lane, warp)
                                                        + Int64(layout.LL_HALF_BYTES), ep, True, status, t, q,
                                                        timeout_ns))  # fmt: skip
            if cutlass.const_expr(b0 == 0):
                mword = Uint32(mh & Uint64(0xFFFFFFFF))
            for k in cutlass.range_constexpr(B):
                if cutlass.const_expr(b0 + k < np_):
                    i = b0 + k
                    v = self.pos1(i, kp, lane, warp)
                    q, j = self.owner(v, False, None)
                    w0 = Uint32(d0[k] & Uint64(0xFFFFFFFF))
                    w1 = Uint32(d1[k] & Uint64(0xFFFFFFFF))
                    m = mword  # (runs: this thread's own mask word)
                    if cutlass.const_expr(not self.runs):
                        m = cute.arch.shuffle_sync(mword, Int32(2 * i) + (lane >> Int32(4)))
                    words[2 * i] = w0
                    words[2 * i + 1] = w1
                    sh = Uint32(j & Int32(31))
                    hbits = hbits | (((m >> sh) & Uint32(1)) << Uint32(2 * i)) | (
                        ((m >> (sh + Uint32(1))) & Uint32(1)) << Uint32(2 * i + 1))
        hb[0] = hbits

    @cute.jit
    def poll_batch(self, d0: cute.Tensor, d1: cute.Tensor, mh: Uint64, vm: Int32, b0: cutlass.Constexpr,
                   B: cutlass.Constexpr, np_: cutlass.Constexpr, kp: cutlass.Constexpr, lane, warp,
                   ll0: Int64, ll_stride: Int64, ep: Int32, status: Int64, t: Int32, timeout_ns: Int64):
        """(bpoll) Re-load every stale half of a round-1 batch (and, in batch 0, the mask half)
        together, predicated, until none is stale; returns (mh, bad).  A merge that starts
        under PDL while its producer runs finds all of its own list stale: waiting for the
        halves one at a time then cost a round trip per half after the data had landed.  The
        timeout (from the first poll) is recorded here, for the owner of a half still stale;
        once the status is set (here or by another wait) it returns with bad != 0 and the
        per-half waits after it give up at once."""
        start = P.globaltimer()
        bad = Int32(1)
        go = Int32(1)
        while go != Int32(0):
            stw = P.ld_volatile_u32(status)
            qbad = Int32(-1)
            if cutlass.const_expr(b0 == 0):
                sm_ = Int32(Int32(Uint32(mh >> Uint64(32))) != ep)
                qm, jm = self.owner(vm, False, None)
                nm = P.ld_volatile_u64_if(self.ll_word_addr(ll0 + Int64(qm) * ll_stride,
                                                            Int32(self.n) + (jm >> Int32(5))), sm_)  # fmt: skip
                if sm_ != Int32(0):
                    mh = nm
            for k in cutlass.range_constexpr(B):
                if cutlass.const_expr(b0 + k < np_):
                    v = self.pos1(b0 + k, kp, lane, warp)
                    a0 = self.pair_addr(b0 + k, v, ll0, ll_stride, lane, warp)
                    s0 = Int32(Int32(Uint32(d0[k] >> Uint64(32))) != ep)
                    s1 = Int32(Int32(Uint32(d1[k] >> Uint64(32))) != ep)
                    n0 = P.ld_volatile_u64_if(a0, s0)
                    n1 = P.ld_volatile_u64_if(a0 + Int64(layout.LL_HALF_BYTES), s1)
                    if s0 != Int32(0):
                        d0[k] = n0
                    if s1 != Int32(0):
                        d1[k] = n1
            bad = Int32(0)
            if cutlass.const_expr(b0 == 0):
                if Int32(Uint32(mh >> Uint64(32))) != ep:
                    bad = Int32(1)
                    qm, jm = self.owner(vm, False, None)
                    qbad = qm
            for k in cutlass.range_constexpr(B):
                if cutlass.const_expr(b0 + k < np_):
                    if Int32(Int32(Uint32(d0[k] >> Uint64(32))) != ep) | Int32(
                            Int32(Uint32(d1[k] >> Uint64(32))) != ep) != Int32(0):  # fmt: skip
                        bad = Int32(1)
                        q, j = self.owner(self.pos1(b0 + k, kp, lane, warp), False, None)
                        qbad = q
            if bad == Int32(0):
                go = Int32(0)
            elif stw != Uint32(layout.STATUS_OK):
                go = Int32(0)
            elif P.globaltimer() - start > timeout_ns:
                self.record(status, Int32(layout.STATUS_TIMEOUT_ROUND1), t, ep, qbad)
                go = Int32(0)
        return mh, bad

    @cute.jit
    def load_r2_fast(self, words: cute.Tensor, hb: cute.Tensor, lane, warp, seg: cute.Tensor,
                     ll0: Int64, ll_stride: Int64, resc0: Int64, qj: cute.Tensor):
        """Round-2 words into registers: segment q is rank q's K-list (rescue slot
        seg[17 + q] >= 0, plain words) or its round-1 LL list (tags already checked);
        qj[i] = q << 16 | j of pair group i (for owner_p)."""
        kp = self.kp2
        nk = seg[self.world]
        hbits = Uint32(0)
        for i in cutlass.range_constexpr(kp // 2):
            # no branch per pair: both sources' loads predicated (P.ld_u32_if), so every
            # pair's loads are in flight together
            v = self.pair_pos(i, kp, lane, warp)
            inr = Int32(v < nk)
            q, j = self.owner(v, True, seg)
            qj[i] = ((q << Int32(16)) | j) & (Int32(0) - inr)
            s = seg[17 + q]
            pr = inr & Int32(s >= Int32(0))  # a rescued rank: its K-list, plain words
            pl = inr & Int32(s < Int32(0))  # else its round-1 LL list (tags checked in round 1)
            rbase = resc0 + Int64(cutlass.max(s, Int32(0))) * Int64(self.rescue_row_bytes)
            lbase = ll0 + Int64(q) * ll_stride
            d = P.ld_volatile_u64_if(rbase + Int64(j) * Int64(4), pr)
            mr = P.ld_volatile_u32_if(rbase + Int64(Int32(self.topk) + (j >> Int32(5))) * Int64(4), pr)
            a, c = P.ld_volatile_v2_u64_if(self.ll_word_addr(lbase, j), pl)
            ml = Uint32(P.ld_volatile_u64_if(self.ll_word_addr(lbase, Int32(self.n) + (j >> Int32(5))), pl)
                        & Uint64(0xFFFFFFFF))  # fmt: skip
            # (a predicated-off load leaves 0, so the two sources can be or-ed)
            w0 = Uint32(d & Uint64(0xFFFFFFFF)) | Uint32(a & Uint64(0xFFFFFFFF))
            w1 = Uint32(d >> Uint64(32)) | Uint32(c & Uint64(0xFFFFFFFF))
            m = mr | ml
            sh = Uint32(j & Int32(31))
            hbits = hbits | (((m >> sh) & Uint32(1)) << Uint32(2 * i)) | (
                ((m >> (sh + Uint32(1))) & Uint32(1)) << Uint32(2 * i + 1))
            words[2 * i] = w0
            words[2 * i + 1] = w1
        hb[0] = hbits

    @cute.jit
    def gid(self, w: Uint32, hbits: Uint32, i: cutlass.Constexpr, q: Int32) -> Int32:
        lidx = Int32(Uint32(0xFFFF) - (w & Uint32(0xFFFF))) | (Int32((hbits >> Uint32(i)) & Uint32(1)) << Int32(16))
        return lidx * Int32(self.world) + q

    @cute.jit
    def warp_find_bin(self, hist: cute.Tensor, nb: cutlass.Constexpr, need: Int32, lane,
                      sc: cute.Tensor, slot: cutlass.Constexpr):
        """One warp: bins scanned from the top, the bin holding the need-th element
        (need <= total) -> sc[slot] = bin, sc[slot + 1] = elements above it,
        sc[slot + 2] = its count.  Lane k sums the nb / 32 bins ranked k * per ..
        from the top; a warp scan finds the lane, whose bins the warp then scans
        (one per lane)."""
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
            sc[slot] = b
            sc[slot + 1] = excl2
            sc[slot + 2] = x

    @cute.jit
    def cta_find_bin(self, hist: cute.Tensor, nb: cutlass.Constexpr, need: Int32, lane, warp,
                     sc: cute.Tensor, slot: cutlass.Constexpr):
        """warp_find_bin by warp 0 between two block barriers (the histogram complete before,
        sc[slot ..] visible to every thread after)."""
        cute.arch.sync_threads()
        if warp == Int32(0):
            self.warp_find_bin(hist, nb, need, lane, sc, slot)
        cute.arch.sync_threads()

    @cute.jit
    def pair_counts(self, selm: Uint32, ip: cutlass.Constexpr, kp: cutlass.Constexpr, lane, warp,
                    round2: cutlass.Constexpr, seg: cute.Tensor, rank: Int32, lt: Uint32,
                    qj: cute.Tensor):
        """Selected keys (own << 16 | all) of pair group ip of this warp: (of the lanes
        below this one, of the whole warp (warp-uniform)), from four ballots."""
        q, j = self.owner_p(ip, kp, lane, warp, round2, seg, qj)
        s0 = ((selm >> Uint32(2 * ip)) & Uint32(1)) != Uint32(0)
        s1 = ((selm >> Uint32(2 * ip + 1)) & Uint32(1)) != Uint32(0)
        return self.ballot_counts(s0, s1, q == rank, lt)

    @cute.jit
    def ballot_counts(self, s0, s1, own, lt: Uint32):
        """(selected keys of the lanes below this one, of the whole warp), own << 16 | all,
        of a pair group whose two keys' selection bits are s0, s1 (own: this rank's)."""
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
    def pair_counts_dyn(self, selm: Uint32, ip: Int32, kp: cutlass.Constexpr, lane, warp, rank: Int32,
                        lt: Uint32):
        """pair_counts of round 1 for a pair group ip known at run time (the rolled loops)."""
        v = warp * Int32(32 * kp) + ip * Int32(64) + Int32(2) * lane
        own = (v // Int32(self.n)) == rank
        s0 = ((selm >> (Uint32(2) * Uint32(ip))) & Uint32(1)) != Uint32(0)
        s1 = ((selm >> (Uint32(2) * Uint32(ip) + Uint32(1))) & Uint32(1)) != Uint32(0)
        return self.ballot_counts(s0, s1, own, lt)

    @cute.jit
    def prefetch_bt(self, words: cute.Tensor, hb: cute.Tensor, btp: cute.Tensor, lane, warp,
                    rank: Int32, bt_row: Int64, req_ok: Int32, bt_cols: Int32, block_size: Int32):
        """Block-table entries of this rank's round-1 keys (their l is known once the
        words are in), loaded now so that they are in flight during the select instead
        of after it."""
        kp = self.kp1
        hbits = hb[0]
        for ip in cutlass.range_constexpr(kp // 2):
            q, j = self.owner(self.pos1(ip, kp, lane, warp), False, None)
            for h in cutlass.range_constexpr(2):
                # no branch: predicated loads, all in flight together (P.ld_u32_if)
                i = 2 * ip + h
                page = self.page_of(self.lidx_of(words[i], hbits, i), block_size)
                ok = Int32(q == rank) & Int32(words[i] != Uint32(0)) & req_ok & Int32(page < bt_cols)
                btp[i] = P.ld_u32_if(bt_row + Int64(page) * Int64(4), ok)

    @cute.jit
    def prefetch_bt_smem(self, words: cute.Tensor, hb: cute.Tensor, buf: cute.Tensor, lane, warp,
                         rank: Int32, bt_row: Int64, req_ok: Int32, bt_cols: Int32,
                         block_size: Int32):
        """prefetch_bt for many words per thread: the entries go to buf[j] (j = index in
        this rank's list; buf is free until a rescue), loads first, then the stores."""
        kp = self.kp1
        hbits = hb[0]
        btv = cute.make_rmem_tensor((kp,), Int32)
        for ip in cutlass.range_constexpr(kp // 2):
            q, j = self.owner(self.pos1(ip, kp, lane, warp), False, None)
            btv[2 * ip] = Int32(0)
            btv[2 * ip + 1] = Int32(0)
            if q == rank:  # (warp-uniform when a warp's positions lie in one list)
                for h in cutlass.range_constexpr(2):
                    i = 2 * ip + h  # predicated loads, in flight together (prefetch_bt)
                    page = self.page_of(self.lidx_of(words[i], hbits, i), block_size)
                    ok = Int32(words[i] != Uint32(0)) & req_ok & Int32(page < bt_cols)
                    btv[i] = P.ld_u32_if(bt_row + Int64(page) * Int64(4), ok)
        for ip in cutlass.range_constexpr(kp // 2):
            q, j = self.owner(self.pos1(ip, kp, lane, warp), False, None)
            if q == rank:
                buf[j] = btv[2 * ip]
                buf[j + Int32(1)] = btv[2 * ip + 1]

    @cute.jit
    def rank_eq(self, eqb: cute.Tensor, m: Int32, need: Int32, tid, sc: cute.Tensor) -> Int32:
        """The need-th smallest of the m distinct values eqb[0..m) (stored, barrier passed):
        thread tid < m ranks eqb[tid], the winner writes sc[6], one barrier."""
        if tid < m:
            my = eqb[tid]
            r = Int32(0)
            for jj in cutlass.range(m, unroll=4):
                if eqb[jj] < my:
                    r = r + Int32(1)
            if r == need - Int32(1):
                sc[6] = my
        cute.arch.sync_threads()
        return sc[6]

    @cute.jit
    def tie_break(self, words: cute.Tensor, hbits: Uint32, kp: cutlass.Constexpr,
                  round2: cutlass.Constexpr, vth: Int32, m: Int32, need: Int32, slot: Int32,
                  sm: MergeSmem, tid, lane, warp, qj: cute.Tensor, cl: cutlass.Constexpr = False) -> Int32:
        """gT: the need-th smallest g among the m keys of score vth (their order in the
        selection: smaller g first).  ``cl``: m, need are the cluster's; the tied keys
        (or their g histograms) are summed over the cluster."""
        fh, fh2, eqb, st, wt, pref, sc = sm.fparts()
        fg, fg2, fg3 = sm.fg, sm.fg2, sm.fg3
        seg = sm.seg
        G = self.gbits
        gmax = Int32((1 << G) - 1)
        gT = Int32(-1)
        if m <= Int32(EQ_MAX):
            # the g of every key at score vth into eqb, then each one's rank
            c = Int32(0)
            for i in cutlass.range_constexpr(kp):
                if Int32(words[i] >> Uint32(16)) == vth:
                    c = c + Int32(1)
            if c != Int32(0):
                pos = cute.arch.atomic_add(st.iterator + slot * Int32(4) + Int32(3), c, sem="relaxed",
                                           scope="cta")  # fmt: skip
                for ip in cutlass.range_constexpr(kp // 2):
                    q = Int32(0)
                    j = Int32(0)
                    if Int32(words[2 * ip] >> Uint32(16)) == vth or Int32(words[2 * ip + 1] >> Uint32(16)) == vth:
                        q, j = self.owner_p(ip, kp, lane, warp, round2, seg, qj)
                    for h in cutlass.range_constexpr(2):
                        if Int32(words[2 * ip + h] >> Uint32(16)) == vth:
                            eqb[pos] = self.gid(words[2 * ip + h], hbits, 2 * ip + h, q)
                            pos = pos + Int32(1)
            if cutlass.const_expr(cl):
                gT = self.rank_eq(self.clus_gather_eq(eqb, m, slot, sm, tid), m, need, tid, sc)
            else:
                cute.arch.sync_threads()
                gT = self.rank_eq(eqb, m, need, tid, sc)
        else:
            # many keys at the boundary score: the need-th smallest g among them by
            # three histograms of u = gmax - g (larger u = smaller g): the top 10 bits,
            # the next 6, the last G - 16 (G >= 17), as the score select does
            uT = Int32(0)
            nd = need
            for d in cutlass.range_constexpr(3):
                hi_ = (G, G - 10, G - 16)[d]
                lo_ = (G - 10, G - 16, 0)[d]
                hist = (fg, fg2, fg3)[d]
                for ip in cutlass.range_constexpr(kp // 2):
                    q = Int32(0)
                    j = Int32(0)
                    if Int32(words[2 * ip] >> Uint32(16)) == vth or Int32(words[2 * ip + 1] >> Uint32(16)) == vth:
                        q, j = self.owner_p(ip, kp, lane, warp, round2, seg, qj)
                    for h in cutlass.range_constexpr(2):
                        if Int32(words[2 * ip + h] >> Uint32(16)) == vth:
                            u = gmax - self.gid(words[2 * ip + h], hbits, 2 * ip + h, q)
                            if (u >> Int32(hi_)) == (uT >> Int32(hi_)):
                                cute.arch.atomic_add(hist.iterator + ((u >> Int32(lo_)) & Int32((1 << (hi_ - lo_)) - 1)),
                                                     Int32(1), sem="relaxed", scope="cta")  # fmt: skip
                self.find_bin_x(hist, (SCORE_BINS, SCORE_BINS2, SCORE_BINS2)[d], nd, tid, lane, warp, sc, 8,
                                cl, sm)  # fmt: skip
                uT = uT | (sc[8] << Int32(lo_))
                nd = nd - sc[9]
            gT = gmax - uT
        return gT

    @cute.jit
    def publish_stats(self, cnt: Int32, mx: Int32, mn: Int32, slot: Int32, sm: MergeSmem, tid, lane,
                      cl: cutlass.Constexpr = False):
        """This thread's count / max / min score of its nonzero words -> the CTA's (warp
        reductions, one atomic each per warp into stats slot ``slot``), the fast path's
        histograms cleared, one barrier; returns (count, min, max - min).  ``cl``: the
        barrier is a cluster barrier and the result the cluster's (every CTA's slot read
        through DSMEM)."""
        fh, fh2, eqb, st, wt, pref, sc = sm.fparts()
        fg, fg2, fg3 = sm.fg, sm.fg2, sm.fg3
        cnt = cute.arch.warp_redux_sync(cnt, "add")
        mx = cute.arch.warp_redux_sync(mx, "max")
        mn = cute.arch.warp_redux_sync(mn, "min")
        if lane == Int32(0):
            cute.arch.atomic_add(st.iterator + slot * Int32(4), cnt, sem="relaxed", scope="cta")
            cute.arch.atomic_max(st.iterator + slot * Int32(4) + Int32(1), mx, sem="relaxed", scope="cta")
            cute.arch.atomic_min(st.iterator + slot * Int32(4) + Int32(2), mn, sem="relaxed", scope="cta")
        for u in cutlass.range_constexpr(SCORE_BINS // C.TB):
            fh[tid + Int32(u * C.TB)] = Int32(0)
        for u in cutlass.range_constexpr(SCORE_BINS // C.TB):
            fg[tid + Int32(u * C.TB)] = Int32(0)
        if tid < Int32(SCORE_BINS2):
            fh2[tid] = Int32(0)
            fg2[tid] = Int32(0)
            fg3[tid] = Int32(0)
        tot = Int32(0)
        lo = Int32(0)
        hi = Int32(0)
        if cutlass.const_expr(cl):
            P.cluster_sync_local()
            st_a = P.smem_addr(st) + slot * Int32(16)
            lo = Int32(0xFFFF)
            for r in cutlass.range_constexpr(self.clus):
                a, b, c, _ = P.ld_dsmem_v4(P.mapa(st_a, Int32(r)))
                tot = tot + a
                hi = cutlass.max(hi, b)
                lo = cutlass.min(lo, c)
        else:
            cute.arch.sync_threads()
            lo = st[slot * Int32(4) + Int32(2)]
            tot = st[slot * Int32(4)]
            hi = st[slot * Int32(4) + Int32(1)]
        return tot, lo, hi - lo

    @cute.jit
    def find_bin_x(self, hist: cute.Tensor, nb: cutlass.Constexpr, need: Int32, tid, lane, warp,
                   sc: cute.Tensor, slot: cutlass.Constexpr, cl: cutlass.Constexpr, sm: MergeSmem):
        """cta_find_bin; ``cl``: over the cluster's sum of ``hist`` -- a cluster barrier
        publishes every CTA's histogram, thread k < nb / 4 sums bins 4k .. 4k + 3 over the
        C CTAs (16-byte DSMEM loads, all in flight) into this CTA's hs, warp 0 finds the
        bin there."""
        if cutlass.const_expr(cl):
            hs = sm.hs
            P.cluster_sync_local()
            h_a = P.smem_addr(hist) + tid * Int32(16)
            if tid < Int32(nb // 4):
                g0 = Int32(0)
                g1 = Int32(0)
                g2 = Int32(0)
                g3 = Int32(0)
                for r in cutlass.range_constexpr(self.clus):
                    a, b, c, d = P.ld_dsmem_v4(P.mapa(h_a, Int32(r)))
                    g0 = g0 + a
                    g1 = g1 + b
                    g2 = g2 + c
                    g3 = g3 + d
                hs[Int32(4) * tid] = g0
                hs[Int32(4) * tid + Int32(1)] = g1
                hs[Int32(4) * tid + Int32(2)] = g2
                hs[Int32(4) * tid + Int32(3)] = g3
            cute.arch.sync_threads()
            if warp == Int32(0):
                self.warp_find_bin(hs, nb, need, lane, sc, slot)
            cute.arch.sync_threads()
        else:
            self.cta_find_bin(hist, nb, need, lane, warp, sc, slot)

    @cute.jit
    def clus_gather_eq(self, eqb: cute.Tensor, m: Int32, slot: Int32, sm: MergeSmem, tid) -> cute.Tensor:
        """The cluster's m keys at the boundary score (each CTA's in its eqb, counted in its
        stats slot word 3) gathered into this CTA's he after a cluster barrier (which
        replaces the block barrier after the local gather); returns he."""
        he = sm.he
        P.cluster_sync_local()
        st_a = P.smem_addr(sm.st) + slot * Int32(16) + Int32(12)
        e_a = P.smem_addr(eqb)
        if tid < m:
            off = Int32(0)
            val = Int32(0)
            for r in cutlass.range_constexpr(self.clus):
                c = P.ld_dsmem_u32(P.mapa(st_a, Int32(r)))
                if tid >= off and tid < off + c:
                    val = P.ld_dsmem_u32(P.mapa(e_a + (tid - off) * Int32(4), Int32(r)))
                off = off + c
            he[tid] = val
        cute.arch.sync_threads()
        return he

    @cute.jit
    def clus_totals(self, wt: cute.Tensor, tot: Int32, flag: Int32, sm: MergeSmem, tid, rank: Int32):
        """A clustered row's selected counts: this CTA's total, its ranks' counts (their
        warps' totals: a warp's positions lie in one list) and its failure flag into xc, a
        cluster barrier, then from every CTA's xc (DSMEM): the selected keys of the CTAs
        before this one, of the row, of this rank; rcnt[q] = rank q's count (the
        saturation test); sc[7] = 1 when any CTA saw a failure recorded after its waits."""
        xc = sm.xc
        rcnt = sm.rcnt
        sc = sm.sc
        npc = self.world // self.clus  # ranks per CTA
        wpr = self.n // (32 * self.kp1)  # warps per rank
        if tid < Int32(npc):
            x = Int32(0)
            for u in cutlass.range_constexpr(wpr):
                x = x + (wt[tid * Int32(wpr) + Int32(u)] & Int32(0xFFFF))
            xc[Int32(1) + tid] = x
        if tid == Int32(0):
            xc[0] = tot & Int32(0xFFFF)
            xc[15] = flag
        P.cluster_sync_local()
        xa = P.smem_addr(xc)
        base = Int32(0)
        allr = Int32(0)
        for r in cutlass.range_constexpr(self.clus):
            x = P.ld_dsmem_u32(P.mapa(xa, Int32(r)))
            allr = allr + x
            if Int32(r) < self.crank:
                base = base + x
        own = P.ld_dsmem_u32(P.mapa(xa + (Int32(1) + rank % Int32(npc)) * Int32(4), rank // Int32(npc)))
        if tid < Int32(self.world):
            rcnt[tid] = P.ld_dsmem_u32(P.mapa(xa + (Int32(1) + tid % Int32(npc)) * Int32(4), tid // Int32(npc)))
        if tid == Int32(0):
            f = Int32(0)
            for r in cutlass.range_constexpr(self.clus):
                f = f | P.ld_dsmem_u32(P.mapa(xa + Int32(60), Int32(r)))
            sc[7] = f
        return base, allr, own

    @cute.jit
    def warp_prefix(self, wt: cute.Tensor, warp):
        """(the selected counts of the warps before this one, of all), own << 16 | all, from
        the warp totals wt (stored, barrier passed)."""
        wbase = Int32(0)
        tot = Int32(0)
        for w in cutlass.range_constexpr(C.NWARPS):
            x = wt[w]
            if Int32(w) < warp:
                wbase = wbase + x
            tot = tot + x
        return wbase, tot

    @cute.jit
    def fast_round(self, words: cute.Tensor, hb: cute.Tensor, round2: cutlass.Constexpr, slot: Int32,
                   sm: MergeSmem, tid, lane, warp, ll0: Int64, ll_stride: Int64, resc0: Int64,
                   ep: Int32, status: Int64, t: Int32, timeout_ns: Int64, rank: Int32, ids: Int64,
                   kv_rows: Int64, counts: Int64, bt_row: Int64, req_ok: Int32, bt_cols: Int32,
                   block_size: Int32, keys: cute.Tensor, btp: cute.Tensor,
                   pre_bt: cutlass.Constexpr, qj: cute.Tensor) -> Uint64:
        """Exact top-K of the words in registers and the outputs; returns T (the K-th
        key, 0 if fewer than K).  Round 1 also leaves pref[q] = selected keys before
        rank q's list (pref[W] = all).  ``pre_bt``: 1: btp[i] holds the block-table
        entry of own key i (prefetch_bt), 2: sm.buf[j] that of own list index j
        (prefetch_bt_smem), 0: loaded here.  stats slot ``slot`` was reset before (and
        fh / fh2 cleared here, before the first barrier)."""
        fh, fh2, eqb, st, wt, pref, sc = sm.fparts()
        fg, fg2, fg3 = sm.fg, sm.fg2, sm.fg3
        seg = sm.seg
        kp = self.kp2 if round2 else self.kp1
        cl = self.clus > 1 and not round2  # round 1 of a clustered row (a round 2 runs on CTA 0 alone)
        rn = self.runs and not round2  # round 1's keys as contiguous runs per thread (runs)
        fl = Int32(0)  # (cl) a failure recorded once this CTA's waits were over
        K = self.topk
        G = self.gbits
        gmax = Int32((1 << G) - 1)
        hbits = hb[0]
        vth = Int32(0)  # boundary score
        gT = Int32(-1)  # largest selected g at score vth
        T = Uint64(0)
        # ---- stats: count, max and min score over the nonzero words
        cnt = Int32(0)
        mx = Int32(0)
        mn = Int32(0xFFFF)
        for i in cutlass.range_constexpr(kp):
            # branch-free (a per-word `if` compiles to a branch + convergence barrier):
            # an empty word (sv = 0) leaves the max alone and counts as 0xFFFF for the min
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
        total, lo, rng = self.publish_stats(cnt, mx, mn, slot, sm, tid, lane, cl)
        if cutlass.const_expr(cl):
            # every wait of this CTA is over (the barrier above): its status word, in flight
            # during the select, published with the counts (clus_totals)
            if tid == Int32(0):
                sw0 = P.ld_volatile_u32(status)
                if sw0 == Uint32(layout.STATUS_TIMEOUT_ROUND1) or sw0 == Uint32(layout.STATUS_TIMEOUT_RESCUE):
                    fl = Int32(1)
        if total >= Int32(K):
            shift = Int32(0)
            while (rng >> shift) >= Int32(SCORE_BINS):
                shift = shift + Int32(1)
            fh_a = P.smem_addr(fh)
            for i in cutlass.range_constexpr(kp):
                sv = Int32(words[i] >> Uint32(16))
                if cutlass.const_expr(kp > BRANCH_FREE_KP):
                    if sv != Int32(0):
                        P.red_smem_add(fh_a + ((sv - lo) >> shift) * Int32(4), Int32(1))
                else:
                    b_ = Int32(FH_DUMMY)
                    if sv != Int32(0):
                        b_ = (sv - lo) >> shift
                    P.red_smem_add(fh_a + b_ * Int32(4), Int32(1))  # unconditional (see the stats)
            self.find_bin_x(fh, SCORE_BINS, Int32(K), tid, lane, warp, sc, 0, cl, sm)
            b = sc[0]
            above = sc[1]
            m = sc[2]
            vth = lo + (b << shift)
            if shift > Int32(0):
                low = (Int32(1) << shift) - Int32(1)
                for i in cutlass.range_constexpr(kp):
                    sv = Int32(words[i] >> Uint32(16))
                    if sv != Int32(0) and ((sv - lo) >> shift) == b:
                        cute.arch.atomic_add(fh2.iterator + ((sv - lo) & low), Int32(1), sem="relaxed",
                                             scope="cta")  # fmt: skip
                self.find_bin_x(fh2, SCORE_BINS2, Int32(K) - above, tid, lane, warp, sc, 3, cl, sm)
                vth = vth + sc[3]
                above = above + sc[4]
                m = sc[5]
            need = Int32(K) - above
            gT = self.tie_break(words, hbits, kp, round2, vth, m, need, slot, sm, tid, lane, warp, qj, cl)
            T = (Uint64(vth) << Uint64(G)) | Uint64(gmax - gT)
        # ---- outputs: selection = s > vth or (s == vth and g <= gT)
        # Round 1: the status word, read once every wait of the row is over (barriers
        # above), in flight during the outputs: sc[7] = 1 when a timeout was recorded
        # (the row is then voided, see kernel), for rows without a rescue.
        stw = Uint32(0)
        if cutlass.const_expr(not round2 and not cl):
            if tid == Int32(0):
                stw = P.ld_volatile_u32(status)
        all_run = Int32(0)
        own_run = Int32(0)
        selm = Uint32(0)
        if cutlass.const_expr(kp > BRANCH_FREE_KP):
            for ip in cutlass.range_constexpr(kp // 2):
                q = Int32(0)
                j = Int32(0)
                if Int32(words[2 * ip] >> Uint32(16)) == vth or Int32(words[2 * ip + 1] >> Uint32(16)) == vth:
                    q, j = self.owner_p(ip, kp, lane, warp, round2, seg, qj)
                for h in cutlass.range_constexpr(2):
                    i = 2 * ip + h
                    sv = Int32(words[i] >> Uint32(16))
                    if sv > vth:
                        selm = selm | Uint32(1 << i)
                    elif sv == vth and sv != Int32(0):
                        if self.gid(words[i], hbits, i, q) <= gT:
                            selm = selm | Uint32(1 << i)
        else:
            # branch-free: selected = s > vth, or s == vth != 0 and g <= gT
            for ip in cutlass.range_constexpr(kp // 2):
                q, j = self.owner_p(ip, kp, lane, warp, round2, seg, qj)
                for h in cutlass.range_constexpr(2):
                    i = 2 * ip + h
                    sv = Int32(words[i] >> Uint32(16))
                    tie = Int32(sv == vth) & Int32(sv != Int32(0)) & Int32(self.gid(words[i], hbits, i, q) <= gT)
                    selm = selm | (Uint32(Int32(sv > vth) | tie) << Uint32(i))
        lt = cute.arch.lanemask_lt()
        run = Int32(0)  # warp-uniform: own << 16 | all (ballots are recomputed below)
        roll = cutlass.const_expr(not round2 and self.roll1)
        if cutlass.const_expr(roll):
            sw = sm.stage
            for i in cutlass.range_constexpr(kp):  # read back by this thread only
                sw[Int32(i * C.TB) + tid] = Int32(words[i])
            for rip0 in cutlass.range(kp // 2, unroll=1):
                _, rc20 = self.pair_counts_dyn(selm, rip0, kp, lane, warp, rank, lt)
                run = run + rc20
        elif cutlass.const_expr(rn):
            # (runs) this thread's selected keys (own << 16 | all), the lanes' before it by one
            # warp scan, the warp's total in every lane
            q0, _ = self.owner_p(0, kp, lane, warp, round2, seg, qj)
            xa = Int32(cute.arch.popc(selm))
            xr = xa + ((xa * Int32(q0 == rank)) << Int32(16))
            xi = C.warp_incl_scan(xr, lane)
            tex = xi - xr  # (names of their own: the rolled outputs loop carries rex / rpos / rkpos,
            # and the DSL finds a loop's carried values by name, whichever branch is traced)
            run = cute.arch.shuffle_sync(xi, Int32(31))
        else:
            for ip in cutlass.range_constexpr(kp // 2):
                _, c2 = self.pair_counts(selm, ip, kp, lane, warp, round2, seg, rank, lt, qj)
                run = run + c2
        if lane == Int32(0):
            wt[warp] = run
        cute.arch.sync_threads()
        wbase, tot = self.warp_prefix(wt, warp)
        all_run = tot & Int32(0xFFFF)
        own_run = tot >> Int32(16)
        if cutlass.const_expr(cl):
            # the row's positions of this CTA's selected keys start after the CTAs' before
            # it (its own rank's, if any, are all here: their kv_rows prefix is local)
            cb, all_run, own_run = self.clus_totals(wt, tot, fl, sm, tid, rank)
            wbase = wbase + cb
        trow = Int64(t) * Int64(K)
        ids_row = ids + trow * Int64(4)
        kv_row = kv_rows + trow * Int64(4)
        ids_on = Int32(ids != Int64(0))
        blks = cute.make_rmem_tensor((8,), Int32)
        if cutlass.const_expr(roll):
            # one pair group per iteration, stores predicated (no branch per word); the
            # block-table entry of list index rj was prefetched into sm.buf[rj] (pre_bt 2)
            for rip in cutlass.range(kp // 2, unroll=1):
                rv = warp * Int32(32 * kp) + rip * Int32(64) + Int32(2) * lane
                rq = rv // Int32(self.n)
                rj = rv - rq * Int32(self.n)
                rc1, rc2 = self.pair_counts_dyn(selm, rip, kp, lane, warp, rank, lt)
                rex = wbase + rc1
                wbase = wbase + rc2
                rpos = rex & Int32(0xFFFF)
                rkpos = rex >> Int32(16)
                if rj == Int32(0) and rv < Int32(self.nk1):
                    pref[rq] = rpos
                for h in cutlass.range_constexpr(2):
                    ri = Int32(2) * rip + Int32(h)
                    rw = Uint32(sw[ri * Int32(C.TB) + tid])
                    rsel = Int32((selm >> Uint32(ri)) & Uint32(1))
                    rlidx = Int32(Uint32(0xFFFF) - (rw & Uint32(0xFFFF))) | (
                        Int32((hbits >> Uint32(ri)) & Uint32(1)) << Int32(16))
                    rg = rlidx * Int32(self.world) + rq
                    P.st_u32_if(ids + (trow + Int64(rpos)) * Int64(4), rg, rsel & ids_on)
                    rpos = rpos + rsel
                    rown = rsel & Int32(rq == rank)
                    rpage = self.page_of(rlidx, block_size)
                    rslot = sm.buf[rj + Int32(h)] * block_size + (rlidx - rpage * block_size)
                    if req_ok == Int32(0) or rpage >= bt_cols:
                        rslot = Int32(-1)
                    P.st_u32_if(kv_rows + (trow + Int64(rkpos)) * Int64(4), rslot, rown)
                    rkpos = rkpos + rown
        tpos = Int32(0)  # (runs) the next output positions of this thread's run
        tkpos = Int32(0)
        if cutlass.const_expr(rn):
            tpos = (wbase + tex) & Int32(0xFFFF)
            tkpos = (wbase + tex) >> Int32(16)
        for b0 in cutlass.range_constexpr(0, 0 if roll else kp // 2, 4):
            # block-table loads of this batch's own selected tokens first (in flight
            # together), then the stores
            for k in cutlass.range_constexpr(8):
                blks[k] = Int32(0)
                if cutlass.const_expr(b0 * 2 + k < kp and pre_bt == 1):
                    blks[k] = btp[b0 * 2 + k]
                elif cutlass.const_expr(b0 * 2 + k < kp and pre_bt == 2):
                    if cutlass.const_expr(kp > BRANCH_FREE_KP):
                        if ((selm >> Uint32(b0 * 2 + k)) & Uint32(1)) != Uint32(0):
                            q, j = self.owner_p((b0 * 2 + k) // 2, kp, lane, warp, round2, seg, qj)
                            if q == rank:
                                blks[k] = sm.buf[j + Int32(k % 2)]
                    else:
                        # read for every key (j < n: in bounds), used for own selected ones only
                        _, j = self.owner_p((b0 * 2 + k) // 2, kp, lane, warp, round2, seg, qj)
                        blks[k] = sm.buf[j + Int32(k % 2)]
                elif cutlass.const_expr(b0 * 2 + k < kp):
                    # predicated loads of this batch's own selected keys, all in flight
                    i = b0 * 2 + k
                    q, j = self.owner_p(i // 2, kp, lane, warp, round2, seg, qj)
                    page = self.page_of(self.lidx_of(words[i], hbits, i), block_size)
                    ok = (Int32((selm >> Uint32(i)) & Uint32(1)) & Int32(q == rank) & req_ok
                          & Int32(page < bt_cols))  # fmt: skip
                    blks[k] = P.ld_u32_if(bt_row + Int64(page) * Int64(4), ok)
            for kk in cutlass.range_constexpr(4):
                ip = b0 + kk
                if cutlass.const_expr(ip < kp // 2):
                    v = self.pos1(ip, kp, lane, warp)
                    q, j = self.owner_p(ip, kp, lane, warp, round2, seg, qj)
                    pos = tpos
                    kpos = tkpos
                    if cutlass.const_expr(not rn):
                        c1, c2 = self.pair_counts(selm, ip, kp, lane, warp, round2, seg, rank, lt, qj)
                        e = wbase + c1
                        wbase = wbase + c2
                        pos = e & Int32(0xFFFF)
                        kpos = e >> Int32(16)
                    if cutlass.const_expr(not round2):
                        if j == Int32(0) and v < Int32(self.nk1):
                            pref[q] = pos
                    for h in cutlass.range_constexpr(2 if kp > BRANCH_FREE_KP else 0):
                        i = 2 * ip + h
                        if ((selm >> Uint32(i)) & Uint32(1)) != Uint32(0):
                            lidx = self.lidx_of(words[i], hbits, i)
                            g = lidx * Int32(self.world) + q
                            if ids != Int64(0):
                                P.st_u32(ids + (trow + Int64(pos)) * Int64(4), g)
                            pos = pos + Int32(1)
                            if q == rank:
                                page = self.page_of(lidx, block_size)
                                slot_ = Int32(-1)
                                if req_ok != Int32(0) and page < bt_cols:
                                    slot_ = blks[2 * kk + h] * block_size + (lidx - page * block_size)
                                P.st_u32(kv_rows + (trow + Int64(kpos)) * Int64(4), slot_)
                                kpos = kpos + Int32(1)
                    for h in cutlass.range_constexpr(0 if kp > BRANCH_FREE_KP else 2):
                        # predicated stores, no branch per key (as the selection)
                        # (l first and g = l W + q: the old g // W was a signed division
                        # per key; the row bases are computed once: fewer instructions in
                        # a stage that issues ~450 per warp)
                        i = 2 * ip + h
                        sel = Int32((selm >> Uint32(i)) & Uint32(1))
                        lidx = self.lidx_of(words[i], hbits, i)
                        g = lidx * Int32(self.world) + q
                        P.st_u32_if(ids_row + Int64(pos) * Int64(4), g, sel & ids_on)
                        pos = pos + sel
                        own = sel & Int32(q == rank)
                        page = self.page_of(lidx, block_size)
                        slot_ = blks[2 * kk + h] * block_size + (lidx - page * block_size)
                        if req_ok == Int32(0) or page >= bt_cols:
                            slot_ = Int32(-1)
                        P.st_u32_if(kv_row + Int64(kpos) * Int64(4), slot_, own)
                        kpos = kpos + own
                    if cutlass.const_expr(rn):
                        tpos = pos
                        tkpos = kpos
        if cutlass.const_expr(cl):
            # (sc[7] set by clus_totals; the padding shared by the cluster's CTAs)
            if tid == Int32(0):
                pref[self.world] = all_run
                if self.crank == Int32(0):
                    P.st_u32(counts + Int64(t) * Int64(4), own_run)
        elif tid == Int32(0):
            pref[self.world] = all_run
            P.st_u32(counts + Int64(t) * Int64(4), own_run)
            if cutlass.const_expr(not round2):
                sc[7] = Int32(0)
                if stw == Uint32(layout.STATUS_TIMEOUT_ROUND1) or stw == Uint32(layout.STATUS_TIMEOUT_RESCUE):
                    sc[7] = Int32(1)
        trow = Int64(t) * Int64(K)
        p0 = tid  # first padding index of this thread, step
        pstep = C.TB
        if cutlass.const_expr(cl):
            p0 = self.crank * Int32(C.TB) + tid
            pstep = C.TB * self.clus
        for i in cutlass.range(own_run + p0, K, pstep, unroll=1):
            P.st_u32(kv_rows + (trow + Int64(i)) * Int64(4), Int32(-1))
        if ids != Int64(0):
            for i in cutlass.range(all_run + p0, K, pstep, unroll=1):
                P.st_u32(ids + (trow + Int64(i)) * Int64(4), Int32(-1))
        cute.arch.sync_threads()
        return T

    # ------------------------------------------------------ round 2, rolled (r2roll)

    @cute.jit
    def r2_addr(self, p: Int32, ax: Int32, d1: Int32, d2: Int32) -> Int32:
        """Shared address of this thread's round-2 pair group p (8 bytes: its two words):
        groups [0, R2_H) in the rescue select's hist1, [R2_H, R2_H + R2_M) in its mask, the
        rest in stage2, each [group][thread] (ax: stage2's base for this thread less
        R2_H + R2_M rows; d1, d2: the steps to the mask's and hist1's bases)."""
        return (p * Int32(8 * C.TB) + ax + (d1 & (Int32(0) - Int32(p < Int32(R2_H + R2_M))))
                + (d2 & (Int32(0) - Int32(p < Int32(R2_H)))))  # fmt: skip

    @cute.jit
    def lidx_at(self, w: Uint32, hbits: Uint32, i: Int32) -> Int32:
        """lidx_of for a word index known at run time."""
        return Int32(Uint32(0xFFFF) - (w & Uint32(0xFFFF))) | (Int32((hbits >> Uint32(i)) & Uint32(1)) << Int32(16))

    @cute.jit
    def r2_q(self, p: Int32, qb0: Uint32, qb1: Uint32) -> Int32:
        """Segment (source rank) of this thread's round-2 pair group p: 4 bits per group,
        groups 0-7 in qb0, 8-15 in qb1."""
        qw = qb0 ^ ((qb0 ^ qb1) & (Uint32(0) - Uint32(p >= Int32(8))))
        return Int32((qw >> (Uint32(p & Int32(7)) * Uint32(4))) & Uint32(15))

    @cute.jit
    def r2_owner(self, v: Int32, segr: cute.Tensor) -> Int32:
        """Segment of position v (< nk) from the segment starts in registers."""
        q = Int32(0)
        for r in cutlass.range_constexpr(1, self.world):
            q = q + Int32(segr[r] <= v)
        return q

    @cute.jit
    def round2_rolled(self, slot: Int32, sm: MergeSmem, tid, lane, warp, rank: Int32, t: Int32,
                      ll0: Int64, ll_stride: Int64, resc0: Int64, ids: Int64, kv_rows: Int64,
                      counts: Int64, bt_row: Int64, req_ok: Int32, bt_cols: Int32,
                      block_size: Int32):
        """Round 2 of a rescue: fast_round's selection and outputs, bit for bit, in loops
        rolled (unroll r2roll) over a shared-memory copy of the words.  The register fast
        path unrolls every pass over its 18 words per thread (W = 8, N = 512: ~66 KB of SASS,
        fetched cold from HBM once per rescue); here each pass is one loop body.  The words
        come in by cp.async (no register waits for them, so a rolled loop keeps every copy in
        flight): pair group p of this thread (positions v, v + 1, v = warp * 32 * kp + 64 p
        + 2 lane, as fast_round) to its 8-byte slot; the mask words of every segment (word u:
        positions 32 u .. 32 u + 31, segments start at multiples of 32) to r2m; the
        block-table entries of this rank's keys to buf[j] (j: index in this rank's list, as
        prefetch_bt_smem), in flight during the select."""
        fh, fh2, eqb, st, wt, pref, sc = sm.fparts()
        fg, fg2, fg3 = sm.fg, sm.fg2, sm.fg3
        seg = sm.seg
        W = self.world
        kp = self.kp2
        npair = kp // 2
        K = self.topk
        G = self.gbits
        TB = C.TB
        gmax = Int32((1 << G) - 1)
        nk = seg[W]
        ah = P.smem_addr(sm.sel.hist1) + tid * Int32(8)
        am = P.smem_addr(sm.sel.mask) + tid * Int32(8) - Int32(R2_H * 8 * TB)
        ax = P.smem_addr(sm.stage2) + tid * Int32(8) - Int32((R2_H + R2_M) * 8 * TB)
        d1 = am - ax
        d2 = ah - am
        ma = P.smem_addr(sm.r2m)
        buf_a = P.smem_addr(sm.buf)
        segr = cute.make_rmem_tensor((W,), Int32)
        for r in cutlass.range_constexpr(W):
            segr[r] = seg[r]
        # ---- copies: the mask words, then the words
        for u in cutlass.range(tid, (nk + Int32(31)) >> Int32(5), TB, unroll=1):
            q = self.r2_owner(u << Int32(5), segr)
            s = seg[17 + q]
            jm = (u - (seg[q] >> Int32(5)))
            src = C.ll_word_addr(ll0 + Int64(q) * ll_stride, Int32(self.n) + jm)
            if s >= Int32(0):
                src = resc0 + Int64(s) * Int64(self.rescue_row_bytes) + Int64(Int32(K) + jm) * Int64(4)
            P.cp_async(ma + u * Int32(4), src, 4)
        qb0 = Uint32(0)
        qb1 = Uint32(0)
        for p in cutlass.range(npair, unroll=1):
            v = warp * Int32(32 * kp) + p * Int32(64) + Int32(2) * lane
            dst = self.r2_addr(p, ax, d1, d2)
            q = Int32(0)
            if v < nk:
                q = self.r2_owner(v, segr)
                j = v - seg[q]
                s = seg[17 + q]
                if s >= Int32(0):  # a rescued rank: its K-list, plain words
                    P.cp_async(dst, resc0 + Int64(s) * Int64(self.rescue_row_bytes) + Int64(j) * Int64(4), 8)
                else:  # its round-1 LL list (tags checked in round 1): each record's two words
                    a = C.ll_word_addr(ll0 + Int64(q) * ll_stride, j)
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
        # ---- bit 16 of each l; this rank's block-table entries (copies in flight during
        # the select); the stats
        hbits = Uint32(0)
        cnt = Int32(0)
        mx = Int32(0)
        mn = Int32(0xFFFF)
        nmw = (nk + Int32(31)) >> Int32(5)
        for p in cutlass.range(npair, unroll=1):
            v = warp * Int32(32 * kp) + p * Int32(64) + Int32(2) * lane
            m = Uint32(P.ld_smem_u32(ma + cutlass.min(v >> Int32(5), nmw - Int32(1)) * Int32(4)))
            w0, w1 = P.ld_smem_v2(self.r2_addr(p, ax, d1, d2))
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
                lidx = Int32(Uint32(0xFFFF) - (w & Uint32(0xFFFF))) | (Int32((hp >> Uint32(h)) & Uint32(1)) << Int32(16))
                page = self.page_of(lidx, block_size)
                if q == rank and nz != Int32(0) and req_ok != Int32(0) and page < bt_cols:
                    P.cp_async(buf_a + (v - seg[q] + Int32(h)) * Int32(4), bt_row + Int64(page) * Int64(4), 4)
        total, lo, rng = self.publish_stats(cnt, mx, mn, slot, sm, tid, lane)
        vth = Int32(0)  # boundary score (0: fewer than K keys, every one selected)
        gT = Int32(-1)  # largest selected g at score vth
        if total >= Int32(K):
            shift = Int32(0)
            while (rng >> shift) >= Int32(SCORE_BINS):
                shift = shift + Int32(1)
            fh_a = P.smem_addr(fh)
            for p in cutlass.range(npair, unroll=1):
                w0, w1 = P.ld_smem_v2(self.r2_addr(p, ax, d1, d2))
                for h in cutlass.range_constexpr(2):
                    sv = Int32(Uint32((w0, w1)[h]) >> Uint32(16))
                    b_ = Int32(FH_DUMMY)
                    if sv != Int32(0):
                        b_ = (sv - lo) >> shift
                    P.red_smem_add(fh_a + b_ * Int32(4), Int32(1))
            self.cta_find_bin(fh, SCORE_BINS, Int32(K), lane, warp, sc, 0)
            b = sc[0]
            above = sc[1]
            m = sc[2]
            vth = lo + (b << shift)
            if shift > Int32(0):
                low = (Int32(1) << shift) - Int32(1)
                for p in cutlass.range(npair, unroll=1):
                    w0, w1 = P.ld_smem_v2(self.r2_addr(p, ax, d1, d2))
                    for h in cutlass.range_constexpr(2):
                        sv = Int32(Uint32((w0, w1)[h]) >> Uint32(16))
                        if sv != Int32(0) and ((sv - lo) >> shift) == b:
                            cute.arch.atomic_add(fh2.iterator + ((sv - lo) & low), Int32(1), sem="relaxed",
                                                 scope="cta")  # fmt: skip
                self.cta_find_bin(fh2, SCORE_BINS2, Int32(K) - above, lane, warp, sc, 3)
                vth = vth + sc[3]
                above = above + sc[4]
                m = sc[5]
            need = Int32(K) - above
            # ---- gT: the need-th smallest g among the m keys at score vth (tie_break)
            # every key at score vth selected (a rescued K-list's lowest score is often the
            # boundary): no tie-break (W = 8, N = 512: forced rescue 40.8 -> 34.0 us)
            whole = Int32(need == m)
            if whole != Int32(0):
                gT = gmax
            elif m <= Int32(EQ_MAX):
                c = Int32(0)
                for p in cutlass.range(npair, unroll=1):
                    w0, w1 = P.ld_smem_v2(self.r2_addr(p, ax, d1, d2))
                    c = c + Int32(Int32(Uint32(w0) >> Uint32(16)) == vth) + Int32(Int32(Uint32(w1) >> Uint32(16)) == vth)
                if c != Int32(0):
                    pos = cute.arch.atomic_add(st.iterator + slot * Int32(4) + Int32(3), c, sem="relaxed",
                                               scope="cta")  # fmt: skip
                    for p in cutlass.range(npair, unroll=1):
                        w0, w1 = P.ld_smem_v2(self.r2_addr(p, ax, d1, d2))
                        q = self.r2_q(p, qb0, qb1)
                        for h in cutlass.range_constexpr(2):
                            w = Uint32((w0, w1)[h])
                            if Int32(w >> Uint32(16)) == vth:
                                eqb[pos] = self.lidx_at(w, hbits, Int32(2) * p + Int32(h)) * Int32(W) + q
                                pos = pos + Int32(1)
                cute.arch.sync_threads()
                gT = self.rank_eq(eqb, m, need, tid, sc)
            else:
                uT = Int32(0)
                nd = need
                for d in cutlass.range_constexpr(3):
                    hi_ = (G, G - 10, G - 16)[d]
                    lo_ = (G - 10, G - 16, 0)[d]
                    hist = (fg, fg2, fg3)[d]
                    for p in cutlass.range(npair, unroll=1):
                        w0, w1 = P.ld_smem_v2(self.r2_addr(p, ax, d1, d2))
                        q = self.r2_q(p, qb0, qb1)
                        for h in cutlass.range_constexpr(2):
                            w = Uint32((w0, w1)[h])
                            if Int32(w >> Uint32(16)) == vth:
                                u = gmax - (self.lidx_at(w, hbits, Int32(2) * p + Int32(h)) * Int32(W) + q)
                                if (u >> Int32(hi_)) == (uT >> Int32(hi_)):
                                    cute.arch.atomic_add(hist.iterator + ((u >> Int32(lo_)) & Int32((1 << (hi_ - lo_)) - 1)),
                                                         Int32(1), sem="relaxed", scope="cta")  # fmt: skip
                    self.cta_find_bin(hist, (SCORE_BINS, SCORE_BINS2, SCORE_BINS2)[d], nd, lane, warp, sc, 8)
                    uT = uT | (sc[8] << Int32(lo_))
                    nd = nd - sc[9]
                gT = gmax - uT
        # ---- selection = s > vth or (s == vth != 0 and g <= gT); per pair group, then the
        # warp's counts (own << 16 | all)
        selm = Uint32(0)
        lt = cute.arch.lanemask_lt()
        run = Int32(0)
        for p in cutlass.range(npair, unroll=1):
            w0, w1 = P.ld_smem_v2(self.r2_addr(p, ax, d1, d2))
            q = self.r2_q(p, qb0, qb1)
            sp = Uint32(0)
            for h in cutlass.range_constexpr(2):
                w = Uint32((w0, w1)[h])
                sv = Int32(w >> Uint32(16))
                tie = (Int32(sv == vth) & Int32(sv != Int32(0))
                       & Int32(self.lidx_at(w, hbits, Int32(2) * p + Int32(h)) * Int32(W) + q <= gT))  # fmt: skip
                sp = sp | (Uint32(Int32(sv > vth) | tie) << Uint32(h))
            selm = selm | (sp << (Uint32(2) * Uint32(p)))
            _, c2 = self.ballot_counts((sp & Uint32(1)) != Uint32(0), (sp & Uint32(2)) != Uint32(0), q == rank, lt)
            run = run + c2
        if lane == Int32(0):
            wt[warp] = run
        P.cp_async_wait_all()  # (this thread's block-table entries: read by it alone, below)
        cute.arch.sync_threads()
        wbase, tot = self.warp_prefix(wt, warp)
        all_run = tot & Int32(0xFFFF)
        own_run = tot >> Int32(16)
        # ---- outputs: order-preserving compaction (positions ascend with warp, group, lane, h)
        trow = Int64(t) * Int64(K)
        ids_on = Int32(ids != Int64(0))
        jmax = Int32(self.rw_k - 2)
        for p in cutlass.range(npair, unroll=1):
            q = self.r2_q(p, qb0, qb1)
            v = warp * Int32(32 * kp) + p * Int32(64) + Int32(2) * lane
            # (a group past nk: q = 0, no key selected; j clamped into buf for the unused reads)
            j = cutlass.min(cutlass.max(v - seg[q], Int32(0)), jmax)
            sp = (selm >> (Uint32(2) * Uint32(p))) & Uint32(3)
            c1, c2 = self.ballot_counts((sp & Uint32(1)) != Uint32(0), (sp & Uint32(2)) != Uint32(0), q == rank, lt)
            e = wbase + c1
            wbase = wbase + c2
            pos = e & Int32(0xFFFF)
            kpos = e >> Int32(16)
            w0, w1 = P.ld_smem_v2(self.r2_addr(p, ax, d1, d2))
            bt0, bt1 = P.ld_smem_v2(buf_a + j * Int32(4))
            for h in cutlass.range_constexpr(2):
                w = Uint32((w0, w1)[h])
                sel = Int32((sp >> Uint32(h)) & Uint32(1))
                lidx = self.lidx_at(w, hbits, Int32(2) * p + Int32(h))
                P.st_u32_if(ids + (trow + Int64(pos)) * Int64(4), lidx * Int32(W) + q, sel & ids_on)
                pos = pos + sel
                own = sel & Int32(q == rank)
                page = self.page_of(lidx, block_size)
                slot_ = (bt0, bt1)[h] * block_size + (lidx - page * block_size)
                if req_ok == Int32(0) or page >= bt_cols:
                    slot_ = Int32(-1)
                P.st_u32_if(kv_rows + (trow + Int64(kpos)) * Int64(4), slot_, own)
                kpos = kpos + own
        if tid == Int32(0):
            pref[W] = all_run
            P.st_u32(counts + Int64(t) * Int64(4), own_run)
        for i in cutlass.range(own_run + tid, K, C.TB, unroll=1):
            P.st_u32(kv_rows + (trow + Int64(i)) * Int64(4), Int32(-1))
        if ids != Int64(0):
            for i in cutlass.range(all_run + tid, K, C.TB, unroll=1):
                P.st_u32(ids + (trow + Int64(i)) * Int64(4), Int32(-1))
        cute.arch.sync_threads()

    # ------------------------------------------------------------- kernel

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
        sm = MergeSmem(self.rw_k, self.stage_words, self.stage2_words, self.r2m_words, self.clus > 1)
        sm_buf, sm_hist, sm_warp_totals, sm_scalars, sm_rcnt, sm_seg = sm.parts()
        # clus: row t on cluster t (its CTAs in the order of their rank crank), G = nblk / C
        # clusters; cbase = the row's first position of this CTA
        nstep = nblk
        t = Int32(bid)
        if cutlass.const_expr(self.clus > 1):
            if cute.arch.cluster_size() != Int32(self.clus):
                P.trap()  # launched without its cluster: DSMEM would address CTAs that do not exist
            self.crank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
            self.cbase = self.crank * Int32(self.cp)
            t = cute.arch.cluster_idx()[0]
            nstep = Int32(nblk) // Int32(self.clus)
        W = self.world
        status = C.state_status(state, max_rows)
        timeout_ns = Int64(timeout_us) * Int64(1000)
        ll_stride = Int64(max_rows) * Int64(self.ll_row_bytes)  # next source rank
        keys = cute.make_rmem_tensor((1,), Uint64)  # (the old register path is not used)
        words = cute.make_rmem_tensor((self.kp,), Uint32)
        hb = cute.make_rmem_tensor((1,), Uint32)
        btp = cute.make_rmem_tensor((self.kp1 if self.pre_bt else 1,), Int32)
        sm_st = sm.st
        if tid < Int32(16):  # fast-path stats slots: [count, max, min, eq count]
            sm_st[tid] = Int32(0)
            if (tid & Int32(3)) == Int32(2):
                sm_st[tid] = Int32(0xFFFF)
        cute.arch.sync_threads()
        rowi = Int32(0)
        last_f = Int32(0)
        finished = Int32(0)  # the launch's end done (after a last row without a rescue)
        refused = Int32(0)
        # epoch of the first row, loaded together with the status word (a plain load of
        # this rank's own state: harmless even when the call is refused); later rows'
        # epochs are loaded one row ahead.  Only this CTA touches its rows' epochs.
        epn = Int32(0)
        if t < rows:
            epn = P.ld_u32(C.state_epoch(state, max_rows, t))
        # A failed or closed exchange (status set before this launch) does no exchange
        # work: empty outputs, no wait, no store to a peer, no epoch bump (layout.py).
        stw0 = P.ld_volatile_u32(status)
        if cutlass.const_expr(self.clus > 1):
            # CTA 0's word for the whole cluster (the CTAs must agree: each passes the same
            # cluster barriers); this barrier also has every CTA of the cluster running before
            # any DSMEM access
            sm_xc = sm.xc
            if tid == Int32(0):
                sm_xc[14] = Int32(stw0)
            P.cluster_sync_local()
            stw0 = Uint32(P.ld_dsmem_u32(P.mapa(P.smem_addr(sm_xc) + Int32(56), Int32(0))))
        # page_of's multiplier: one 64-bit division per launch, while the loads above are in
        # flight (block_size < 1 never reaches a lookup: req_ok is 0 then)
        self.pdiv = (Uint64(1) << Uint64(PAGE_SHIFT)) // Uint64(cutlass.max(block_size, Int32(1))) + Uint64(1)
        if stw0 != Uint32(layout.STATUS_OK):
            refused = Int32(1)
            while t < rows:
                if cutlass.const_expr(self.clus > 1):
                    if self.crank == Int32(0):
                        self.empty_row(t, tid, kv_rows, counts, ids, saturated)
                else:
                    self.empty_row(t, tid, kv_rows, counts, ids, saturated)
                t = t + Int32(nstep)
        while t < rows:
            ep = epn + Int32(1)
            seq = P.ld_u32(C.state_seq(state, max_rows, t))
            # LL row [parity, 0, t] (layout.ll_row_offset, factored: ll_stride steps the source)
            ll0 = local + Int64(ep & Int32(1)) * Int64(W) * ll_stride + Int64(t) * Int64(self.ll_row_bytes)
            # rescue row [t, 0] (layout.rescue_row_offset with slot 0)
            resc0 = local + rescue_off + Int64(t) * Int64(self.slots * self.rescue_row_bytes)
            req = P.ld_u32(req_id + Int64(t) * Int64(4))
            req_ok = Int32(0)
            bt_row = block_table
            if req >= Int32(0) and req < bt_rows and block_size > Int32(0):
                req_ok = Int32(1)
                bt_row = block_table + Int64(req) * Int64(bt_cols) * Int64(4)
            # stats slots of this row: 2 * (rowi & 1) + round; reset the other row parity's
            # (last read before the previous row's final barrier)
            slot1 = Int32(2) * (rowi & Int32(1))
            if tid < Int32(8):
                o = (Int32(2) - slot1) * Int32(4) + tid
                sm_st[o] = Int32(0)
                if (tid & Int32(3)) == Int32(2):
                    sm_st[o] = Int32(0xFFFF)
            # ---- round 1: wait for the W lists of epoch ep
            T = Uint64(0)
            if cutlass.const_expr(self.fast1):
                self.load_r1_fast(words, hb, lane, warp, ll0, ll_stride, ep, status, t, timeout_ns)
                if cutlass.const_expr(self.pre_bt):
                    self.prefetch_bt(words, hb, btp, lane, warp, rank, bt_row, req_ok, bt_cols, block_size)
                else:
                    self.prefetch_bt_smem(words, hb, sm_buf, lane, warp, rank, bt_row, req_ok, bt_cols,
                                          block_size)  # fmt: skip
                T = self.fast_round(words, hb, False, slot1, sm, tid, lane, warp, ll0, ll_stride, resc0,
                                    ep, status, t, timeout_ns, rank, ids, kv_rows, counts, bt_row,
                                    req_ok, bt_cols, block_size, keys, btp,
                                    1 if self.pre_bt else 2, hb)  # fmt: skip
            else:
                for v in cutlass.range(tid, self.nk1, C.TB, unroll=1):
                    self.key_r1(v, ll0, ll_stride, ep, True, status, t, timeout_ns)
                cute.arch.sync_threads()
                T = self.radix_select(keys, False, sm, tid, lane, warp, ll0, ll_stride,
                                      resc0, ep, status, t, timeout_ns)  # fmt: skip
                self.emit(keys, False, T, sm, tid, lane, warp, ll0, ll_stride, resc0,
                          ep, status, t, timeout_ns, rank, ids, kv_rows, counts, bt_row, req_ok,
                          bt_cols, block_size)  # fmt: skip
            # ---- saturation (uniform: from smem counts and T)
            t_owner = Int32(-1)
            if T != Uint64(0):
                t_owner = Int32(Uint64((1 << self.gbits) - 1) - (T & Uint64((1 << self.gbits) - 1))) % Int32(W)
            # lane q < W of every warp tests rank q, one ballot gives the mask (the same in
            # every warp: smem counts); a loop over the W ranks in every thread was ~2.5% of
            # the normal path's instructions at W = 8 (ncu, eleventh session)
            ql = cutlass.min(lane, Int32(W - 1))
            cq = Int32(0)
            if cutlass.const_expr(self.fast1 and self.clus == 1):
                cq = sm.pref[ql + Int32(1)] - sm.pref[ql]
            else:
                cq = sm_rcnt[ql]
            sat = Int32(lane < Int32(W)) & Int32(cq == Int32(self.n)) & Int32(t_owner != lane)
            mask = Int32(cute.arch.vote_ballot_sync(sat != Int32(0)))
            nsat = Int32(cute.arch.popc(Uint32(mask)))
            if nsat > Int32(self.slots):
                mask = Int32(0)  # impossible (docs/DESIGN.md §6.4); keeps the slots in bounds
            if cutlass.const_expr(self.clus > 1):
                # A clustered row ends on CTA 0 (mask and sc[7] are the cluster's: the same in
                # every CTA).  Where CTA 0 then rewrites the outputs -- a rescue's round 2, or the
                # empty row of a failed call -- a cluster barrier that releases global memory
                # first orders the other CTAs' round-1 stores before its stores.  The others go
                # on to their next row (their next cluster barrier waits for CTA 0).
                if mask != Int32(0) or sm.sc[7] != Int32(0):
                    P.cluster_sync()
                if self.crank == Int32(0):
                    if mask == Int32(0):
                        epn, last_f = self.row_epilogue(t, ep, mask, True, epn, nstep, rows, state, max_rows,
                                                        saturated, status, sm, tid, kv_rows, counts, ids)  # fmt: skip
                        if t + Int32(nstep) >= rows:  # this cluster's last row: CTA 0's end here too
                            self.finish(refused, last_f, rowi + Int32(1), status, sm_seg, tid, peers,
                                        state, rank, max_rows, host_status, ids, bid)  # fmt: skip
                            finished = Int32(1)
                    else:
                        self.rescue(mask, nsat, sm, tid, lane, warp, peers, local, logits, row_ends,
                                    rows, cols, rank, max_rows, rescue_off, flags_off, t, ep, seq,
                                    status, timeout_ns, ll0, ll_stride, resc0, ids, kv_rows, counts,
                                    bt_row, req_ok, bt_cols, block_size, keys, words, hb,
                                    slot1 + Int32(1), state)  # fmt: skip
                        if tid == Int32(0):  # flags of the next rescue of row t carry seq + 2
                            P.st_u32(C.state_seq(state, max_rows, t), seq + Int32(1))
                        epn, last_f = self.row_epilogue(t, ep, mask, False, epn, nstep, rows, state, max_rows,
                                                        saturated, status, sm, tid, kv_rows, counts, ids)  # fmt: skip
                elif t + Int32(nstep) < rows:
                    epn = P.ld_u32(C.state_epoch(state, max_rows, t + Int32(nstep)))
            elif cutlass.const_expr(not self.end_first):
                if mask != Int32(0):
                    self.rescue(mask, nsat, sm, tid, lane, warp, peers, local, logits, row_ends,
                                rows, cols, rank, max_rows, rescue_off, flags_off, t, ep, seq,
                                status, timeout_ns, ll0, ll_stride, resc0, ids, kv_rows, counts,
                                bt_row, req_ok, bt_cols, block_size, keys, words, hb,
                                slot1 + Int32(1), state)  # fmt: skip
                    if tid == Int32(0):  # flags of the next rescue of row t carry seq + 2
                        P.st_u32(C.state_seq(state, max_rows, t), seq + Int32(1))
                epn, last_f = self.row_epilogue(t, ep, mask, None, epn, nstep, rows, state, max_rows,
                                                saturated, status, sm, tid, kv_rows, counts, ids)  # fmt: skip
            else:
                # The row's end for rows without a rescue sits here, before the rescue's code
                # (a one-CTA select and a second round, ~100 KB of SASS): when it sat after it,
                # the normal path fetched its end cold on every launch (ncu, eleventh session:
                # most of the extra no-instruction stalls against a build without the rescue).
                if mask == Int32(0):
                    epn, last_f = self.row_epilogue(t, ep, mask, True, epn, nstep, rows, state, max_rows,
                                                    saturated, status, sm, tid, kv_rows, counts, ids)  # fmt: skip
                    if t + Int32(nstep) >= rows:  # this CTA's last row: its end here too
                        self.finish(refused, last_f, rowi + Int32(1), status, sm_seg, tid, peers,
                                    state, rank, max_rows, host_status, ids, bid)  # fmt: skip
                        finished = Int32(1)
                else:
                    self.rescue(mask, nsat, sm, tid, lane, warp, peers, local, logits, row_ends,
                                rows, cols, rank, max_rows, rescue_off, flags_off, t, ep, seq,
                                status, timeout_ns, ll0, ll_stride, resc0, ids, kv_rows, counts,
                                bt_row, req_ok, bt_cols, block_size, keys, words, hb,
                                slot1 + Int32(1), state)  # fmt: skip
                    if tid == Int32(0):  # flags of the next rescue of row t carry seq + 2
                        P.st_u32(C.state_seq(state, max_rows, t), seq + Int32(1))
                    epn, last_f = self.row_epilogue(t, ep, mask, False, epn, nstep, rows, state, max_rows,
                                                    saturated, status, sm, tid, kv_rows, counts, ids)  # fmt: skip
            t = t + Int32(nstep)
            rowi = rowi + Int32(1)
        if finished == Int32(0):
            self.finish(refused, last_f, rowi, status, sm_seg, tid, peers, state, rank, max_rows,
                        host_status, ids, bid)  # fmt: skip
        if cutlass.const_expr(self.clus > 1):
            # no CTA leaves while another may still read its shared memory
            P.cluster_arrive()
            P.cluster_wait()

    @cute.jit
    def finish(self, refused: Int32, last_f: Int32, rowi: Int32, status: Int64, sm_seg: cute.Tensor,
               tid: Int32, peers: Int64, state: Int64, rank: Int32, max_rows: Int32,
               host_status: Int64, ids: Int64, bid):
        """The launch's end for this CTA: withdraw on a failure, the host's status copy."""
        report = refused
        if refused == Int32(0):
            # This call failed here or elsewhere in the grid: withdraw this rank's pushed
            # rows from every peer (both parities), so a peer that arrives late times out
            # too instead of pairing its call with this one's words (the producer grid is
            # complete: pdl_wait above, or below when this CTA had no row).
            # A CTA that merged rows reuses its last row's check: status never clears
            # within a launch, and the CTA whose wait failed sees it (withdraw is idempotent).
            P.pdl_wait()
            fe = last_f
            if cutlass.const_expr(self.clus > 1):
                # (the other CTAs of a cluster end no row: they read the status here)
                if rowi == Int32(0) or self.crank != Int32(0):
                    fe = self.failed(status, sm_seg, tid)
            elif rowi == Int32(0):
                fe = self.failed(status, sm_seg, tid)
            if fe != Int32(0):
                self.withdraw(peers, state, rank, max_rows, tid)
            report = fe
        # The host's copy of a set status (pinned words that op.jit's poll and the
        # launcher's handlers read without a sync): written by a refused launch or a CTA
        # that saw this launch fail; a healthy launch writes nothing (the copy starts at
        # 0 and a status never clears).
        if host_status != Int64(0):
            if report != Int32(0):
                if tid == Int32(0):
                    self.report(status, host_status)
    @cute.jit
    def row_epilogue(self, t: Int32, ep: Int32, mask: Int32, plain: cutlass.Constexpr, epn: Int32,
                     nblk, rows: Int32, state: Int64, max_rows: Int32, saturated: Int64,
                     status: Int64, sm: MergeSmem, tid: Int32, kv_rows: Int64, counts: Int64,
                     ids: Int64):
        """Row t's end: its saturated mask, the next row's epoch loaded, the producer grid
        waited for, the row voided on a failure, the epoch bumped.  ``plain``: True for a row
        without a rescue, False for one with, None: decided by ``mask`` here (the fast path
        without a rescue reuses the status word read after the row's last wait, during the
        outputs: sc[7], published by the outputs' final barrier).  Returns (the next row's
        epoch, the failure flag)."""
        if saturated != Int64(0):
            if tid == Int32(0):
                P.st_u32(saturated + Int64(t) * Int64(4), mask)
        if t + Int32(nblk) < rows:
            epn = P.ld_u32(C.state_epoch(state, max_rows, t + Int32(nblk)))
        # ---- every word of the row was read; the producer grid is done
        P.pdl_wait()
        # A failure anywhere in the grid (status set) voids this row: waits that gave
        # up read stale words, so the row gets empty outputs, never a guess.
        # (failed() starts with a barrier: every thread is done reading the row.)
        f = Int32(0)
        if cutlass.const_expr(self.fast1 and plain is None):
            if mask == Int32(0):
                f = sm.sc[7]
            else:
                f = self.failed(status, sm.seg, tid)
        elif cutlass.const_expr(self.fast1 and plain):
            f = sm.sc[7]
        else:
            f = self.failed(status, sm.seg, tid)
        if f != Int32(0):
            self.empty_row(t, tid, kv_rows, counts, ids, saturated)
        if tid == Int32(0):
            P.st_u32(C.state_epoch(state, max_rows, t), ep)
        return epn, f

    @cute.jit
    def report(self, status: Int64, host_status: Int64):
        """Copy the status words [code, row, epoch, rank] to the host, the code last (a
        reader that sees the code sees the rest)."""
        for i in cutlass.range_constexpr(layout.STATUS_REPORT_WORDS):
            if cutlass.const_expr(i != layout.STATUS_CODE):
                P.st_volatile_u32(host_status + Int64(4 * i), Int32(P.ld_volatile_u32(C.status_word(status, i))))
        P.fence_sys()
        P.st_volatile_u32(host_status + Int64(4 * layout.STATUS_CODE),
                          Int32(P.ld_volatile_u32(C.status_word(status, layout.STATUS_CODE))))

    @cute.jit
    def failed(self, status: Int64, sm_seg: cute.Tensor, tid: Int32) -> Int32:
        """CTA-uniform: 1 when a timeout was recorded (status 1 or 2)."""
        cute.arch.sync_threads()
        if tid == Int32(0):
            code = Int32(P.ld_volatile_u32(status))
            sm_seg[47] = Int32(0)
            if code == Int32(layout.STATUS_TIMEOUT_ROUND1) or code == Int32(layout.STATUS_TIMEOUT_RESCUE):
                sm_seg[47] = Int32(1)
        cute.arch.sync_threads()
        return sm_seg[47]

    @cute.jit
    def withdraw(self, peers: Int64, state: Int64, rank: Int32, max_rows: Int32, tid: Int32):
        """Overwrite the first LL record of each of this rank's rows, both parities,
        in every rank's buffer, with a tag 2^31 away from the row's epoch: no reader
        within 2^31 calls accepts it (idempotent: every failed CTA may do it)."""
        for p in cutlass.range(self.world, unroll=1):
            base = P.ld_u64(peers + Int64(p) * Int64(8))
            for i in cutlass.range(tid, Int32(2) * max_rows, C.TB, unroll=1):
                par = i // max_rows
                r = i - par * max_rows
                bad = P.ld_u32(C.state_epoch(state, max_rows, r)) ^ Int32(-(2**31))
                off = C.ll_row_offset(par, rank, r, self.world, max_rows, self.ll_row_bytes)
                P.st_ll_v4(base + off, Int32(0), bad, Int32(0))

    @cute.jit
    def empty_row(self, t: Int32, tid: Int32, kv_rows: Int64, counts: Int64, ids: Int64,
                  saturated: Int64):
        """Outputs of a row the exchange refused: nothing selected."""
        base = Int64(t) * Int64(self.topk) * Int64(4)
        for i in cutlass.range(tid, self.topk, C.TB, unroll=1):
            P.st_u32(kv_rows + base + Int64(i) * Int64(4), Int32(-1))
            if ids != Int64(0):
                P.st_u32(ids + base + Int64(i) * Int64(4), Int32(-1))
        if tid == Int32(0):
            P.st_u32(counts + Int64(t) * Int64(4), Int32(0))
            if saturated != Int64(0):
                P.st_u32(saturated + Int64(t) * Int64(4), Int32(0))

    @cute.jit
    def rescue(self, mask: Int32, nsat: Int32, sm: MergeSmem, tid, lane, warp, peers: Int64,
               local: Int64, logits: Int64, row_ends: Int64, rows: Int32, cols: Int32,
               rank: Int32, max_rows: Int32, rescue_off: Int64, flags_off: Int64, t: Int32,
               ep: Int32, seq: Int32, status: Int64, timeout_ns: Int64, ll0: Int64,
               ll_stride: Int64, resc0: Int64, ids: Int64, kv_rows: Int64, counts: Int64,
               bt_row: Int64, req_ok: Int32, bt_cols: Int32, block_size: Int32,
               keys: cute.Tensor, words: cute.Tensor, hb: cute.Tensor, slot2: Int32,
               state: Int64):  # fmt: skip
        sm_buf, sm_hist, sm_warp_totals, sm_scalars, sm_rcnt, sm_seg = sm.parts()
        sel = sm.sel.parts()
        W = self.world
        flag_val = seq + Int32(1)
        if ((mask >> rank) & Int32(1)) != Int32(0):
            # This rank is saturated: its local top-K from its logits (which
            # the kernel before the producer wrote: wait for the grid chain).
            P.pdl_wait()
            klist = Int64(0)  # (rescue_list) the producer made this row's K-list: no select here
            if cutlass.const_expr(self.klist):
                klist = C.state_klist(state, max_rows, t, self.rw_k)
            else:
                end = row_end(row_ends, t, cols)
                S.select_row(logits + Int64(t) * Int64(cols) * Int64(2), end, self.topk, self.rw_k,
                             sel, tid, lane, warp, Int32(1), Int32(0), False, False, Int32(0),
                             self.rescue_u1)  # fmt: skip
            s = Int32(cute.arch.popc(Uint32(mask & ((Int32(1) << rank) - Int32(1)))))
            off = rescue_off + C.rescue_row_offset(t, s, self.slots, self.rescue_row_bytes)
            if cutlass.const_expr(self.klist):
                # the producer's K-list (written by the grid pdl_wait waited for; .cg: not
                # through this SM's L1, which may hold an earlier call's lines)
                for i in cutlass.range(tid, self.rw_k // 4, C.TB, unroll=1):
                    a, b, c, d = P.ld_cg_v4(klist + Int64(i) * Int64(16))
                    for p in cutlass.range_constexpr(W):
                        dst = P.ld_u64(peers + Int64(p) * Int64(8)) + off
                        P.st_v4(dst + Int64(i) * Int64(16), a, b, c, d)
            else:
                for p in cutlass.range(W, unroll=1):
                    dst = P.ld_u64(peers + Int64(p) * Int64(8)) + off
                    for i in cutlass.range(tid, self.rw_k // 4, C.TB, unroll=1):
                        P.st_v4(dst + Int64(i) * Int64(16), sm_buf[4 * i], sm_buf[4 * i + 1],
                                sm_buf[4 * i + 2], sm_buf[4 * i + 3])  # fmt: skip
            cute.arch.sync_threads()
            foff = flags_off + C.flag_offset(rank, t, max_rows)
            # lane p of warp 0: fence.acq_rel.sys then a strong (relaxed.sys) store of
            # rank p's flag = a release pattern (PTX memory model); bar.sync above
            # orders the CTA's stores before each lane's fence (cumulativity).  One
            # MEMBAR for the warp, the W stores in one instruction.
            if tid < Int32(W):
                pa = P.ld_u64(peers + Int64(tid) * Int64(8))
                P.fence_sys()
                P.st_relaxed_sys(pa + foff, flag_val)
        # Every rank: acquire the saturated ranks' flags (one lane per rank).
        if tid < Int32(W):
            if ((mask >> tid) & Int32(1)) != Int32(0):
                addr = local + flags_off + C.flag_offset(tid, t, max_rows)
                self.wait_tag(addr, flag_val, True, status, layout.STATUS_TIMEOUT_RESCUE, t, ep, tid,
                              timeout_ns)  # fmt: skip
        if tid == Int32(0):
            off = Int32(0)
            s = Int32(0)
            for q in cutlass.range_constexpr(W):
                sm_seg[q] = off
                if ((mask >> Int32(q)) & Int32(1)) != Int32(0):
                    sm_seg[17 + q] = s
                    s = s + Int32(1)
                    off = off + Int32(self.topk)
                else:
                    sm_seg[17 + q] = Int32(-1)
                    off = off + Int32(self.n)
            sm_seg[W] = off
        cute.arch.sync_threads()
        if cutlass.const_expr(self.roll2):
            self.round2_rolled(slot2, sm, tid, lane, warp, rank, t, ll0, ll_stride, resc0, ids, kv_rows,
                               counts, bt_row, req_ok, bt_cols, block_size)  # fmt: skip
        elif cutlass.const_expr(self.fast2):
            qj = cute.make_rmem_tensor((self.kp2 // 2,), Int32)
            self.load_r2_fast(words, hb, lane, warp, sm_seg, ll0, ll_stride, resc0, qj)
            self.fast_round(words, hb, True, slot2, sm, tid, lane, warp, ll0, ll_stride, resc0, ep,
                            status, t, timeout_ns, rank, ids, kv_rows, counts, bt_row, req_ok,
                            bt_cols, block_size, keys, hb, 0, qj)  # fmt: skip
        else:
            T2 = self.radix_select(keys, True, sm, tid, lane, warp, ll0, ll_stride, resc0, ep,
                                   status, t, timeout_ns)  # fmt: skip
            self.emit(keys, True, T2, sm, tid, lane, warp, ll0, ll_stride, resc0, ep, status,
                      t, timeout_ns, rank, ids, kv_rows, counts, bt_row, req_ok, bt_cols,
                      block_size)  # fmt: skip

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

    def compile(self, arch: str = "sm_90a", dump_dir: str = "."):
        return cute.compile(self.entry, *ABI.dummies(Int64, Int32), options=C.compile_options(arch, dump_dir))
