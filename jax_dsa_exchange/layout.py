"""Encodings and memory layout shared by every layer (docs/DESIGN.md §5-§6).

One module, no JAX and no CUDA import, so the NumPy reference, the CuTe DSL
kernels, the FFI launcher's Python side and the exchange allocator all agree on
the same numbers.  Nothing here allocates.

Packed candidate row (docs/DESIGN.md §5), bfloat16 scores: a list of ``n`` candidates is
``n`` words ``ord16 << 16 | (0xFFFF - (l & 0xFFFF))`` (0 = empty) followed by ``n // 32``
mask words holding bit 16 of ``l`` (candidate ``j``: word ``n + j // 32``, bit
``j % 32``), padded with zero words to a multiple of 4 words.  float32 scores: candidate
``j`` is the word pair ``(ord32, l)`` at words ``2 j, 2 j + 1`` (``ord32`` 0 = empty), one
LL record per candidate.  Lists are stored in ascending local index ``l`` with their empty
candidates last, so an order-preserving compaction of a list gives its tokens in ``l`` order.

Global positions (docs/DESIGN.md §4): with KV caches interleaved over the W ranks in chunks
of ``I`` consecutive tokens, local index ``l`` of rank ``q`` is global position
``g = (l div I) * W * I + q * I + l mod I`` (:func:`global_position`; ``I = 1``: ``l * W + q``).

Symmetric buffer of one rank (one cudaMalloc, shared over CUDA IPC), byte
offsets from :class:`BufferLayout`:

* ``ll``: int32 ``[2 (parity), W (source rank), max_rows, 2 * words(N)]``; word
  ``j`` of a row sits at byte ``(j // 2) * 16 + (j % 2) * 8`` as the LL pair
  ``(word, epoch)``, so one 16-byte store carries ``(w0, e, w1, e)``.
* ``rescue``: int32 ``[max_rows, slots, words(K)]`` (plain packed rows, guarded
  by ``flags``).
* ``flags``: int32 ``[W (source rank), max_rows]``, the rescue sequence numbers.

Local (not shared) state, int32, from :class:`StateLayout`: ``epoch[max_rows]``,
``seq[max_rows]`` (rescue sequence per row) and ``status[STATUS_WORDS]``
(``[code, row, epoch, rank, ...]``, 0 = healthy), then, 16-byte aligned,
``klist[max_rows, words(K)]``: each row's local top-K as a packed row, written by the
producer of an exchange created with ``rescue_list=True`` and read by the merge's rescue
of that row instead of selecting it again.  A kernel that finds a
non-zero status when it starts does no exchange work at all (no peer store, no
wait, no epoch bump; the merge writes empty outputs): a failed exchange refuses
further calls until it is recreated, and a closed one is safe against replays
of CUDA graphs that XLA recorded with its addresses.
"""

from __future__ import annotations

import dataclasses

LOCAL_INDEX_BITS = 17  # docs/DESIGN.md §2: L <= 2**17
MAX_LOCAL_LEN = 1 << LOCAL_INDEX_BITS
MAX_WORLD = 16
MIN_TOPK, MAX_TOPK = 64, 4096
ALIGN = 2 << 20  # cudaMalloc sizes are rounded to 2 MiB (docs/DESIGN.md §7)
REGION_ALIGN = 256
STATUS_WORDS = 8

# status[0] codes written by the merge kernel (0 = healthy).
STATUS_OK = 0
STATUS_TIMEOUT_ROUND1 = 1  # a peer's LL words of the current epoch never came
STATUS_TIMEOUT_RESCUE = 2  # a saturated peer's rescue flag never came
STATUS_CLOSED = 3  # Exchange.close() ran: kernels (e.g. CUDA-graph replays) must do nothing

# The status words: [code, row, epoch, rank, (unused)...].  The first STATUS_REPORT_WORDS
# words are what a failure reports (the FFI launcher copies them to the host).
STATUS_CODE, STATUS_ROW, STATUS_EPOCH, STATUS_RANK = 0, 1, 2, 3
STATUS_REPORT_WORDS = 4

# The local state is int32 [3 regions]: epoch[max_rows], seq[max_rows], status[8]; the
# region i starts at word STATE_REGION_ROWS[i] * max_rows (StateLayout).
STATE_EPOCH_ROWS, STATE_SEQ_ROWS, STATE_STATUS_ROWS = 0, 1, 2


# How the producer splits a row over a thread-block cluster (kernels/select.py):
# CTA c of a cluster of C takes the c-th of C equal slices of the row (multiples of 8
# tokens); a slice stays in shared memory after its one read when it has at most
# producer_cache_tokens() tokens (16K to 64K), a longer one is re-read in each pass.  C is chosen per call by
# producer_cluster(); the C++ launcher computes the same from the kernel metadata
# ("split"), and a CI test compares the two.  Measured on an H200 (docs/kernels.md): the
# fixed cost of a CTA dominates below ~8K tokens (R = 16, L = 32K: 16.9 us with C = 8,
# 12.2 with C = 4), and one CTA per SM beats more, smaller slices once R fills the SMs,
# unless the slices are then too long to keep on chip (producer_cluster).
PRODUCER_SLICE_MAX = 16384  # tokens (their ord16) always kept in shared memory: 32 KB per CTA
PRODUCER_CLUSTER_MAX = 8  # the portable cluster size limit
PRODUCER_MIN_SLICE = 8192  # no slice shorter than this (unless the row is)
PRODUCER_FILL_CTAS = 132  # split only while the grid keeps within this many CTAs
# Without the launcher's count of co-resident clusters (producer_cluster_fit): clusters of
# more than this many CTAs only while the grid keeps within fill_ctas / 2 CTAs (H200, N =
# 512, L = 64K / 128K: R = 16 16.8 / 18.6 us with C = 8, 13.4 / 16.5 with C = 4; R = 8 12.8 /
# 14.2 with C = 8, 13.0 / 15.6 with C = 4)
PRODUCER_WIDE_CLUSTER = 4
# Longer slices kept on chip too (the launch's dynamic shared memory sized for them,
# producer_cache_tokens): up to PRODUCER_CACHE_WIDE tokens at any grid size (64 KB: two
# 512-thread CTAs still fit an SM), up to PRODUCER_CACHE_MAX (128 KB: one CTA per SM)
# while the grid keeps within fill_ctas CTAs.  H200, W=8 N=512, R=64 L=128K (C=2, 64K-token
# slices): 48.7 us re-reading the slice in each pass, 38.6 us keeping it (2026-12-01).
PRODUCER_CACHE_MAX = 65536
PRODUCER_CACHE_WIDE = 32768
# The lean producer image (kernels/lean.py, "select_push_lean"): a CTA's slice of at most this
# many tokens over its threads' registers.  The launcher runs it instead of select_push when
# the launch's slices fit (producer_uses_lean); its metadata carries this as its split's
# slice_max.
PRODUCER_LEAN_SLICE_MAX = 16384
# Where a launch runs the lean image, its rows are cut finer than select_push's policy cuts
# them: one CTA per PRODUCER_LEAN_MIN_SLICE tokens while the launch keeps within
# PRODUCER_LEAN_FILL_CTAS CTAs (producer_lean_cluster; the lean image's split carries both as
# its min_slice and fill_ctas).  H200, W = 8, K = 2048, CUPTI: N = 512
# (1, 8K) C = 1 / 2 / 4 / 8 5.47 / 5.18 / 5.06 / 5.14 us, (16, 8K) C = 1 / 4 5.79 / 5.49,
# (1, 32K) C = 4 / 8 5.95 / 5.41; N = 1024 (1, 8K) 6.59 -> 5.41 (C = 4), (16, 8K) 6.96 -> 5.82,
# (1, 32K) 6.13 -> 5.54 (C = 8); but past 64 CTAs more CTAs lose: (16, 32K) C = 8 7.25 against
# C = 4 6.40, (64, 32K) C = 4 13.95 against C = 2 9.06, (64, 8K) C = 2 6.21 against C = 1 6.08.
PRODUCER_LEAN_MIN_SLICE = 2048
PRODUCER_LEAN_FILL_CTAS = 64


@dataclasses.dataclass(frozen=True)
class ArchLimits:
    """What the kernels and the launch policy need of one GPU target.  The launcher reads the
    device's own SM count and co-resident cluster counts at run time; ``sm_count`` is what the
    kernels' compile-time thresholds assume (a full-size part of the target)."""

    arch: str  # the CuTe DSL / ptxas target: kernels of one target run on that compute capability only
    compute_capability: tuple
    parts: str
    sm_count: int
    smem_per_sm: int  # shared memory of an SM, bytes (1 KB of it reserved per resident CTA)
    smem_per_cta: int  # the most dynamic shared memory one CTA may opt in to, bytes


# The targets the kernels build for.  sm_90a is tested on hardware (H100, H200); sm_100a and
# sm_103a are built and compile-tested only.  Shared memory per SM and per CTA: the CUDA
# programming guide's table for compute capabilities 9.0, 10.0 and 10.3.
ARCHS = {
    "sm_90a": ArchLimits("sm_90a", (9, 0), "H100, H200", 132, 228 * 1024, 227 * 1024),
    "sm_100a": ArchLimits("sm_100a", (10, 0), "B200, GB200", 148, 228 * 1024, 227 * 1024),
    "sm_103a": ArchLimits("sm_103a", (10, 3), "B300, GB300", 148, 228 * 1024, 227 * 1024),
}


def arch_limits(arch: str) -> ArchLimits:
    """The table entry of ``arch``; ValueError naming the supported targets."""
    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r}: the kernels build for {', '.join(ARCHS)}")
    return ARCHS[arch]


def arch_of(compute_capability) -> str:
    """The arch-specific target of a compute capability ((9, 0) -> "sm_90a"), whether or not
    the kernels build for it (the caller names it in its error)."""
    major, minor = (int(x) for x in compute_capability)
    return f"sm_{major}{minor}a"


def producer_split() -> dict:
    """The split policy's parameters, as the kernel metadata carries them."""
    return {"slice_max": PRODUCER_SLICE_MAX, "cluster_max": PRODUCER_CLUSTER_MAX,
            "min_slice": PRODUCER_MIN_SLICE, "fill_ctas": PRODUCER_FILL_CTAS,
            "cache_max": PRODUCER_CACHE_MAX, "cache_wide": PRODUCER_CACHE_WIDE}  # fmt: skip


def split_for_device(split: dict, sm_count: int) -> dict:
    """A metadata split for a device of ``sm_count`` SMs: its fill_ctas (measured on 132-SM
    parts: one CTA per SM for select_push, about half of them for the lean image) scaled to the
    device's SMs, the same share of them."""
    out = dict(split)
    out["fill_ctas"] = int(split["fill_ctas"]) * int(sm_count) // PRODUCER_FILL_CTAS
    return out


def producer_lean_split() -> dict:
    """The lean image's metadata split: slices of at most PRODUCER_LEAN_SLICE_MAX tokens (its
    slice copy holds that many: cache_max), cut by producer_lean_cluster's min_slice and
    fill_ctas."""
    return dict(producer_split(), slice_max=PRODUCER_LEAN_SLICE_MAX, cache_max=PRODUCER_LEAN_SLICE_MAX,
                cache_wide=PRODUCER_LEAN_SLICE_MAX, min_slice=PRODUCER_LEAN_MIN_SLICE,
                fill_ctas=PRODUCER_LEAN_FILL_CTAS)  # fmt: skip


def _cluster_count(sp: dict, c: int) -> int:
    """The device's count of co-resident clusters of c CTAs in ``sp`` (-1: unknown)."""
    fit = sp.get("cluster_fit")
    if fit is None or not 1 <= c <= min(len(fit), PRODUCER_CLUSTER_MAX):
        return -1
    return max(-1, min(int(fit[c - 1]), 2**31 - 1))


def producer_rows_at_once(split: dict, c: int) -> int:
    """Rows of clusters of c that run at once at one CTA per SM: fill_ctas // c, at most the
    device's count where the split has one (the slice-cache rule's test, producer_cache_tokens)."""
    f = max(0, int(split["fill_ctas"])) // max(1, int(c))
    m = _cluster_count(split, int(c))
    return min(f, m) if m >= 0 else f


def producer_cluster_fit(split: dict | None = None) -> tuple:
    """Rows the policy lets run at once, one CTA per SM, with clusters of c CTAs, for
    c = 1..PRODUCER_CLUSTER_MAX (entry c - 1): fill_ctas // c, and where the split carries
    ``cluster_fit`` (the launcher's count of clusters of c that the device runs at once at
    the kernel's full shared memory, cuOccupancyMaxActiveClusters; -1 = unknown) at most
    that.  Without it, clusters of more than PRODUCER_WIDE_CLUSTER only within fill_ctas / 2
    CTAs (the rule before the count).  Why the count: a cluster's CTAs share one GPC, and
    an H200's 132 SMs hold at most 120 CTAs in clusters of 4 or 8 at one CTA per SM (a
    larger grid puts two CTAs on some SMs: R = 16, L = 128K with C = 8 17.2 us, C = 6 15.2,
    C = 4 16.3; R = 32, L = 128K with C = 4 22.0, C = 3 19.3; N = 512, docs/kernels.md)."""
    sp = split or producer_split()
    fill = max(0, int(sp["fill_ctas"]))
    out = []
    for c in range(1, PRODUCER_CLUSTER_MAX + 1):
        if _cluster_count(sp, c) < 0 and c > PRODUCER_WIDE_CLUSTER:
            out.append((fill // 2) // c)
        else:
            out.append(producer_rows_at_once(sp, c))
    return tuple(out)


def producer_cache_tokens(rows: int, cols: int, c: int, split: dict | None = None) -> int:
    """Tokens of a CTA's slice select_push keeps in shared memory in a launch over
    [rows, cols] with clusters of c (its ``cache_tokens``; the C++ launcher computes the
    same, CI-compared, and sizes the launch's shared memory for it): S = the longest slice
    of the launch, kept up to slice_max always, up to cache_wide at any grid size, up to
    cache_max while the rows run at once at one CTA per SM (producer_rows_at_once); else
    slice_max (rows with slices that short)."""
    sp = split or producer_split()
    length = max(1, min(int(cols), MAX_LOCAL_LEN))
    c = max(1, int(c))
    s = _round_up(-(-length // c), 8)
    if s <= sp["slice_max"]:
        return s
    if s <= sp["cache_max"] and (s <= sp["cache_wide"] or rows <= producer_rows_at_once(sp, c)):
        return s
    return sp["slice_max"]


def producer_cluster(rows: int, cols: int, split: dict | None = None) -> int:
    """CTAs per row (the cluster size) of a select_push launch over [rows, cols]:
    one per min_slice tokens, at most cluster_max, and fewer while the rows would not run
    at once at one CTA per SM (producer_cluster_fit); then more again (up to cluster_max)
    while the slices would be longer than the launch keeps in shared memory
    (producer_cache_tokens)."""
    s = split or producer_split()
    length = max(1, min(int(cols), MAX_LOCAL_LEN))
    cmax = min(int(s["cluster_max"]), PRODUCER_CLUSTER_MAX)
    fit = producer_cluster_fit(s)
    c = min(cmax, -(-length // max(1, s["min_slice"])))
    while c > 1 and rows > fit[c - 1]:
        c -= 1
    c = max(1, c)
    # A slice kept on chip is read from HBM once; a longer one is re-read in every pass
    # (the mask walk too).  Smaller, cached slices in more waves of CTAs cost less (H200,
    # N = 512: R = 256 L = 128K 85.5 -> 80.0 us with C = 4, R = 128 59.5 -> 47.9;
    # docs/kernels.md).
    cache = dict(s, cache_max=s.get("cache_max", 0), cache_wide=s.get("cache_wide", 0))
    while c < cmax and producer_cache_tokens(rows, cols, c, cache) < _round_up(-(-length // c), 8):
        c += 1
    return c


def producer_uses_lean(cols: int, c: int, lean_slice_max: int) -> bool:
    """Whether a select_push launch over [rows, cols] in clusters of c runs the configuration's
    lean image (kernels/cache.py OPTIONAL, kernels/lean.py) instead of select_push: when it has
    one (``lean_slice_max`` > 0: that image's split's slice_max, else 0) and every slice of the
    launch, cut from the buffer's row length min(cols, 2**17), has at most that many tokens.
    H200, W = 8, K = 2048, N = 512: 7.0 -> 5.6 us at R = 1, L = 8K;
    9.3 -> 7.5 at R = 1, L = 128K (C = 8).  The C++ launcher's rule is this one
    (dsa_producer_uses_lean, tests/test_ffi.py)."""
    length = max(1, min(int(cols), MAX_LOCAL_LEN))
    return int(lean_slice_max) > 0 and _round_up(-(-length // max(1, int(c))), 8) <= int(lean_slice_max)


def producer_lean_cluster(rows: int, cols: int, c: int, lean_split: dict | None = None) -> int:
    """CTAs per row of a launch over [rows, cols] that runs the lean image (producer_uses_lean
    at select_push's cluster size c): c, or more where that keeps the launch within the lean
    split's fill_ctas CTAs: one CTA per min_slice tokens, at most its cluster_max
    (PRODUCER_LEAN_MIN_SLICE, measured above).  More CTAs only shorten the slices, so the lean
    image still takes them.  The C++ launcher's rule is this one (dsa_producer_lean_cluster,
    tests/test_ffi.py)."""
    s = lean_split or producer_lean_split()
    length = max(1, min(int(cols), MAX_LOCAL_LEN))
    cmax = min(int(s["cluster_max"]), PRODUCER_CLUSTER_MAX)
    want = min(cmax, -(-length // max(1, int(s["min_slice"]))), max(0, int(s["fill_ctas"])) // max(1, int(rows)))
    return max(int(c), want)


def merge_uses_wide(rows: int, wide_grid: int) -> bool:
    """Whether a merge launch over ``rows`` rows runs the configuration's merge_wide image
    (kernels/cache.py OPTIONAL: rows over wider clusters) instead of its merge: when it has one
    (``wide_grid`` > 0: the clusters of its size each rank's launch may hold at once) and every
    row then has its own cluster.  Past that a row's cluster does several rows one after
    another, which the narrower clusters of the merge do faster (H200, W = 16, N = 1024: 4 CTAs
    per row 12.6 us at R = 1, 31.3 at R = 64; 2 CTAs 19.5 and 20.5).  The C++
    launcher's rule is this one (dsa_merge_uses_wide, tests/test_ffi.py)."""
    return int(wide_grid) > 0 and 0 < int(rows) <= int(wide_grid)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def check_config(world: int, topk: int, local_topk: int) -> None:
    """docs/DESIGN.md §2 limits on the static configuration; ValueError names the value."""
    for name, v in (("world", world), ("topk", topk), ("local_topk", local_topk)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"{name} must be an int, got {type(v).__name__} {v!r}")
    if not 1 <= world <= MAX_WORLD:
        raise ValueError(f"world={world} must be in [1, {MAX_WORLD}]")
    if topk % 32 or not MIN_TOPK <= topk <= MAX_TOPK:
        raise ValueError(f"topk={topk} must be a multiple of 32 in [{MIN_TOPK}, {MAX_TOPK}]")
    if local_topk % 32 or not 32 <= local_topk <= topk:
        raise ValueError(f"local_topk={local_topk} must be a multiple of 32 in [32, topk={topk}]")


# Score dtypes the exchange takes (docs/DESIGN.md §3) and the bits of their order-preserving
# key (ord16 / ord32, docs/DESIGN.md §5).
SCORE_DTYPES = ("bfloat16", "float32")
SCORE_BITS = {"bfloat16": 16, "float32": 32}
# The scores the GPU kernels take (ord16 keys); float32 merges on the XLA path.
KERNEL_SCORE_DTYPE = "bfloat16"


def score_dtype_name(dtype) -> str:
    """The canonical name ("bfloat16" / "float32") of a score dtype given as a name, a NumPy /
    ml_dtypes / JAX dtype or scalar type; TypeError for any other dtype."""
    name = getattr(dtype, "name", None) or getattr(dtype, "__name__", None) or str(dtype)
    if name not in SCORE_DTYPES:
        raise TypeError(f"score dtype must be bfloat16 or float32, got {dtype!r}")
    return name


def row_words(n: int, score_dtype: str = "bfloat16") -> int:
    """Words of a packed row of ``n`` candidates (docs/DESIGN.md §5)."""
    if score_dtype_name(score_dtype) == "float32":
        return _round_up(2 * n, 4)
    return _round_up(n + n // 32, 4)


def ll_row_bytes(n: int, score_dtype: str = "bfloat16") -> int:
    """Bytes of one LL row: every word travels with its epoch."""
    return row_words(n, score_dtype) * LL_HALF_BYTES


LL_RECORD_BYTES = 16  # one LL record: (w0, e, w1, e), one 16-byte store
LL_HALF_BYTES = 8  # one (word, epoch) half of a record, one 8-byte access


def ll_offset(j: int) -> int:
    """Byte offset of word ``j`` inside an LL row."""
    return (j >> 1) * LL_RECORD_BYTES + (j & 1) * LL_HALF_BYTES


def rescue_row_bytes(topk: int, score_dtype: str = "bfloat16") -> int:
    """Bytes of one rescue row: a plain packed row of K candidates."""
    return row_words(topk, score_dtype) * 4


# Offsets inside the buffer's regions, each one expression for Python ints (i64=int)
# and for the kernels' device integers (i64=cutlass.Int64, kernels/common.py), so the
# kernels compute exactly what BufferLayout defines.
def ll_row_offset(parity, src, row, world, max_rows, row_bytes, i64=int):
    """Byte offset of LL row [parity, src, row] from the start of the LL region."""
    return ((i64(parity) * i64(world) + i64(src)) * i64(max_rows) + i64(row)) * i64(row_bytes)


def rescue_row_offset(row, slot, slots, row_bytes, i64=int):
    """Byte offset of rescue row [row, slot] from the start of the rescue region."""
    return (i64(row) * i64(slots) + i64(slot)) * i64(row_bytes)


def flag_offset(src, row, max_rows, i64=int):
    """Byte offset of flag [src, row] from the start of the flags region."""
    return (i64(src) * i64(max_rows) + i64(row)) * i64(4)


def rescue_slots(topk: int, local_topk: int, world: int | None = None) -> int:
    """Most ranks that can be saturated in one row: floor((K-1)/N) (docs/DESIGN.md §6.4), and
    never more than the W ranks there are (sizes the rescue slots: at K = 2048, N = 32,
    W = 16 that is 16 slots, not 63)."""
    bound = (topk - 1) // local_topk
    return bound if world is None else min(world, bound)


# ids are int32 (docs/DESIGN.md §3): every global position must fit.
MAX_GLOBAL_POSITION = 2**31 - 1


def global_position(l, q, world: int, interleave: int = 1):
    """Global position of local index ``l`` of rank ``q`` (docs/DESIGN.md §4) with the KV cache
    interleaved over the ranks in chunks of ``interleave`` tokens:
    ``(l div I) * W * I + q * I + l mod I``.  Works on Python ints and NumPy integer arrays
    (the kernels compute the same expression on device integers)."""
    if interleave == 1:
        return l * world + q
    # (no W * I constant: it would overflow int32 arrays where the positions themselves do not)
    return ((l // interleave) * world + q) * interleave + l % interleave


def owner_and_local(g, world: int, interleave: int = 1):
    """The inverse of :func:`global_position`: ``(q, l)`` of global position ``g``."""
    if interleave == 1:
        return g % world, g // world
    chunk = g // interleave
    return chunk % world, (chunk // world) * interleave + g % interleave


def max_global_position(world: int, interleave: int = 1) -> int:
    """The largest global position a configuration can produce: the last local index
    (2**17 - 1) of the last rank (global_position grows with l and with q)."""
    return global_position(MAX_LOCAL_LEN - 1, world - 1, world, interleave)


def check_interleave(interleave, world: int) -> None:
    """The interleave size I (docs/DESIGN.md §2): an int >= 1 whose global positions fit int32
    ids for W ranks of up to 2**17 tokens each; TypeError / ValueError naming the value."""
    if not isinstance(interleave, int) or isinstance(interleave, bool):
        raise TypeError(f"interleave must be an int, got {type(interleave).__name__} {interleave!r}")
    if not 1 <= interleave <= MAX_GLOBAL_POSITION:
        raise ValueError(f"interleave={interleave} must be in [1, {MAX_GLOBAL_POSITION}]")
    if max_global_position(world, interleave) > MAX_GLOBAL_POSITION:
        raise ValueError(f"interleave={interleave} with world={world}: global positions up to "
                         f"{max_global_position(world, interleave)} do not fit int32 ids "
                         f"(local rows of up to {MAX_LOCAL_LEN} tokens)")


# The GPU merge ranks the global positions of tied keys in three histogram passes of 10, 6 and 6
# bits: every interleave size up to a rank's longest row (2**17) fits for every W.
KERNEL_GID_BITS = 22


def check_kernel_interleave(interleave: int, world: int) -> None:
    """The interleave sizes the GPU kernels take (after check_interleave): global positions of
    at most KERNEL_GID_BITS bits; ValueError naming the value otherwise (the XLA path takes
    every size check_interleave does)."""
    check_interleave(interleave, world)
    if gid_bits(world, interleave) > KERNEL_GID_BITS:
        raise ValueError(f"interleave={interleave} with world={world}: global positions of "
                         f"{gid_bits(world, interleave)} bits; the GPU kernels take up to {KERNEL_GID_BITS} "
                         f"(any interleave <= {MAX_LOCAL_LEN}); xla_path.xla_topk_merge takes larger ones")


def gid_bits(world: int, interleave: int = 1) -> int:
    """G: bits of a global position (docs/DESIGN.md §5), enough for max_global_position; with
    ``interleave`` 1 that is 17 + bits(W - 1)."""
    return max_global_position(world, interleave).bit_length()


@dataclasses.dataclass(frozen=True)
class BufferLayout:
    """Byte layout of one rank's symmetric buffer."""

    world: int
    topk: int
    local_topk: int
    max_rows: int

    def __post_init__(self):
        check_config(self.world, self.topk, self.local_topk)
        if not isinstance(self.max_rows, int) or self.max_rows < 1:
            raise ValueError(f"max_rows={self.max_rows!r} must be a positive int")

    @property
    def slots(self) -> int:
        return rescue_slots(self.topk, self.local_topk, self.world)

    @property
    def ll_row_bytes(self) -> int:
        return ll_row_bytes(self.local_topk)

    @property
    def rescue_row_bytes(self) -> int:
        return rescue_row_bytes(self.topk)

    @property
    def ll_off(self) -> int:
        return 0

    @property
    def ll_bytes(self) -> int:
        return 2 * self.world * self.max_rows * self.ll_row_bytes

    @property
    def rescue_off(self) -> int:
        return _round_up(self.ll_off + self.ll_bytes, REGION_ALIGN)

    @property
    def rescue_bytes(self) -> int:
        return self.max_rows * self.slots * self.rescue_row_bytes

    @property
    def flags_off(self) -> int:
        return _round_up(self.rescue_off + self.rescue_bytes, REGION_ALIGN)

    @property
    def flags_bytes(self) -> int:
        return self.world * self.max_rows * 4

    @property
    def nbytes(self) -> int:
        """Allocation size, rounded to 2 MiB."""
        return _round_up(self.flags_off + self.flags_bytes, ALIGN)

    def ll_row(self, parity: int, src: int, row: int) -> int:
        """Byte offset of LL row [parity, src, row]."""
        return self.ll_off + ll_row_offset(parity, src, row, self.world, self.max_rows, self.ll_row_bytes)

    def rescue_row(self, row: int, slot: int) -> int:
        """Byte offset of rescue row [row, slot]."""
        return self.rescue_off + rescue_row_offset(row, slot, self.slots, self.rescue_row_bytes)

    def flag(self, src: int, row: int) -> int:
        """Byte offset of the flag of source rank ``src`` for ``row``."""
        return self.flags_off + flag_offset(src, row, self.max_rows)


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """Int32 word offsets of one rank's local state buffer.  ``words``: the epochs, rescue
    sequences and status words (what ``Exchange.read_state`` copies); ``alloc_words``: with
    the K-list region of ``topk`` (0: none) after them."""

    max_rows: int
    topk: int = 0

    @property
    def epoch_off(self) -> int:
        return STATE_EPOCH_ROWS * self.max_rows

    @property
    def seq_off(self) -> int:
        return STATE_SEQ_ROWS * self.max_rows

    @property
    def status_off(self) -> int:
        return STATE_STATUS_ROWS * self.max_rows

    @property
    def words(self) -> int:
        return self.status_off + STATUS_WORDS

    @property
    def klist_off(self) -> int:
        """Word offset of klist[0] (16-byte aligned; kernels/common.state_klist)."""
        return _round_up(self.words, 4)

    @property
    def alloc_words(self) -> int:
        return self.klist_off + self.max_rows * row_words(self.topk) if self.topk else self.words


def launcher_constants() -> dict:
    """The layout numbers the C++ launcher (ffi/dsa_exchange_ffi.cc) uses, by the names
    its ``dsa_layout_constant`` answers to (tests/test_ffi.py compares them)."""
    return {
        "STATUS_OK": STATUS_OK, "STATUS_TIMEOUT_ROUND1": STATUS_TIMEOUT_ROUND1,
        "STATUS_TIMEOUT_RESCUE": STATUS_TIMEOUT_RESCUE, "STATUS_CLOSED": STATUS_CLOSED,
        "STATUS_CODE": STATUS_CODE, "STATUS_ROW": STATUS_ROW, "STATUS_EPOCH": STATUS_EPOCH,
        "STATUS_RANK": STATUS_RANK, "STATUS_REPORT_WORDS": STATUS_REPORT_WORDS,
        "STATE_EPOCH_ROWS": STATE_EPOCH_ROWS, "STATE_STATUS_ROWS": STATE_STATUS_ROWS,
        "MAX_LOCAL_LEN": MAX_LOCAL_LEN, "PRODUCER_CLUSTER_MAX": PRODUCER_CLUSTER_MAX,
        "PRODUCER_WIDE_CLUSTER": PRODUCER_WIDE_CLUSTER,
        "LOAD_KERNEL_ARGS": 11,  # (_ffi.load_kernel's arguments: a library of another count is refused)
    }  # fmt: skip
