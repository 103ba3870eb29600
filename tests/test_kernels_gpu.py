"""GPU tests of the raw kernels (select_push + merge): W ranks in one process
on one GPU (jax_dsa_exchange.testing.sim), bit-identical to the NumPy
protocol model on the shared adversarial cases.

Runs where a GPU and CuPy exist, from prebuilt cubins found through
JAX_DSA_EXCHANGE_CUBIN_DIR (a GPU node needs no CuTe DSL): ``python dev/build_cubins.py``
builds every configuration of CONFIGS and INTERLEAVED.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from jax_dsa_exchange import layout, reference
from jax_dsa_exchange.kernels.abi import MERGE_CLUS_WIDE as CLUS_WIDE
from jax_dsa_exchange.kernels.abi import MERGE_EQ_MAX as EQ_MAX
from jax_dsa_exchange.testing import cases

from gpu import requires_gpu_stack

pytestmark = [pytest.mark.gpu, requires_gpu_stack]

SMALL_K, SMALL_N = 256, 64
WORLDS = [1, 2, 4, 8, 16]
# (W, K, N) configurations these tests use (dev/build_cubins.py builds them).
CONFIGS = ([(w, SMALL_K, SMALL_N) for w in WORLDS] + [(w, SMALL_K, SMALL_K) for w in WORLDS]
           + [(8, 2048, 512), (16, 2048, 1024), (2, 2048, 512), (16, 4096, 2048), (8, 2048, 1024),
              (16, 2048, 512)])  # fmt: skip
# merges whose row is split over a cluster of CTAs (kernels/merge.py Merge.clus): W = 16, N = 1024,
# W = 8, N = 1024 and W = 16, N = 512 over 2 (16, 8 and 8 words per thread)
CLUSTERED = [(16, 2048, 1024), (8, 2048, 1024), (16, 2048, 512)]
# ... and those with a second merge image of wider clusters (kernels/cache.py OPTIONAL):
# W = 16, N = 1024 over 4 CTAs of 8 words, W = 8, N = 1024 and W = 16, N = 512 over 4 of 4
WIDE = [(16, 2048, 1024), (8, 2048, 1024), (16, 2048, 512)]
# KV caches interleaved in chunks of I tokens (docs/DESIGN.md §4): (W, K, N, I) configurations,
# the small one at every W and I, and the paths of the larger ones (one CTA in registers, a
# clustered row, keys re-read from memory) at one I each, a power of two or not
INTERLEAVED = ([(w, SMALL_K, SMALL_N, i) for w in (1, 2, 8, 16) for i in (2, 16, 64)]
               + [(3, SMALL_K, SMALL_N, 16), (8, 2048, 512, 16), (16, 2048, 1024, 64), (16, 4096, 2048, 3)])
# which merge image the sims launch: "auto" (the launcher's choice by rows), "merge" or
# "merge_wide" (every call on it where the configuration has one)
TEST_MERGE = os.environ.get("JAX_DSA_EXCHANGE_TEST_MERGE", "auto")
# ... and which producer image: "auto" (the launcher's choice: the lean image where a launch's
# slices fit it), "select_push" (every call on it)
# or "select_push_lean"
TEST_PRODUCER = os.environ.get("JAX_DSA_EXCHANGE_TEST_PRODUCER", "auto")

_SIMS: dict = {}


def sim_for(world, topk, n, max_rows=64, rescue_list=None, interleave=1):
    """A cached Sim; ``rescue_list`` None: $JAX_DSA_EXCHANGE_TEST_RESCUE_LIST (1: every test
    on the rescue-list kernels: dev/gpu_check.py's tests step runs them once per kind)."""
    from jax_dsa_exchange.testing.sim import Sim

    if rescue_list is None:
        rescue_list = os.environ.get("JAX_DSA_EXCHANGE_TEST_RESCUE_LIST", "") == "1"
    key = (world, topk, n, rescue_list, interleave)
    if key not in _SIMS or _SIMS[key].max_rows < max_rows:
        _SIMS[key] = Sim(world, topk, n, max_rows, rescue_list=rescue_list, merge=TEST_MERGE, producer=TEST_PRODUCER,
                         interleave=interleave)
    return _SIMS[key]


def check(case, got, *, want_ids=True, want_sat=True, what=""):
    ref = case.model()
    for q in range(case.world):
        g, r = got[q], ref[q]
        assert (g["status"] == 0).all(), f"{what} {case} rank {q}: status {g['status']}"
        for name in ("counts", "kv_rows") + (("ids",) if want_ids else ()) + (
                ("saturated",) if want_sat else ()):  # fmt: skip
            a, b = g[name], getattr(r, name)
            if not np.array_equal(a, b):
                bad = np.argwhere(a != b)
                i = tuple(bad[0])
                row = i[0]
                raise AssertionError(
                    f"{what} {case} rank {q}: {name} differs at {len(bad)} places, first {i}: "
                    f"got {a[i]} want {b[i]}; row {row} counts got {g['counts'][row]} want "
                    f"{r.counts[row]}, saturated got {g['saturated'][row]} want {r.saturated[row]}")


def _run_check(sim, case, **kw):
    got = sim.call(case, **kw)
    check(case, got, want_ids=kw.get("want_ids", True), want_sat=kw.get("want_sat", True))
    for q, g in enumerate(got):  # a healthy call leaves the host copy of the status alone
        assert (g["host_status"] == 0).all(), (q, g["host_status"])
    return got


@pytest.mark.parametrize("world", WORLDS)
def test_adversarial(world):
    rng = np.random.default_rng(1000 + world)
    allc = cases.adversarial_cases(rng, world=world, topk=SMALL_K, local_topk=SMALL_N, rows=16)
    for i, case in enumerate(allc):
        sim = sim_for(world, case.topk, case.local_topk)
        _run_check(sim, case)
        if i == 0:  # optional outputs off: kv_rows / counts still right
            _run_check(sim, case, want_ids=False, want_sat=False)


@pytest.mark.parametrize("world,topk,n,interleave", INTERLEAVED,
                         ids=[f"W{w}-K{k}-N{n}-I{i}" for w, k, n, i in INTERLEAVED])
def test_adversarial_interleaved(world, topk, n, interleave):
    """Every adversarial family with the KV cache interleaved in chunks of I tokens (ties that
    straddle chunk boundaries, rows shorter than one chunk, rescues): ids (the interleaved
    global positions), kv_rows, counts and saturated bit-identical to the protocol model."""
    rng = np.random.default_rng([2000, world, topk, n, interleave])
    sim = sim_for(world, topk, n, interleave=interleave)
    allc = cases.adversarial_cases(rng, world=world, topk=topk, local_topk=n, interleave=interleave,
                                   rows=16 if topk == SMALL_K else 4, cols=3000 if topk > SMALL_K else None,
                                   saturating_rows=2)  # fmt: skip
    assert "chunk_ties" in {c.name for c in allc}
    for case in allc:
        _run_check(sim, case)


@pytest.mark.parametrize("world,topk,n", [(w, SMALL_K, SMALL_N) for w in (1, 2, 4, 8)] + [(8, 2048, 512)])
def test_merge_under_pdl_behind_its_producer(world, topk, n):
    """Each rank's producer then its merge on one stream, the merge launched with programmatic
    stream serialization (the C++ launcher's launch): its CTAs start while the producer runs
    (griddepcontrol), and every output is still the protocol model's, rescues included;
    several calls in a row, so a merge's epoch bump meets the next call's producer."""
    rng = np.random.default_rng(4200 + world)
    sim = sim_for(world, topk, n)
    allc = cases.adversarial_cases(rng, world=world, topk=topk, local_topk=n, rows=4,
                                   cols=3000 if topk > SMALL_K else None, saturating_rows=2)  # fmt: skip
    for rep in range(2):
        for case in allc:
            _run_check(sim, case, pdl=True)


def test_consecutive_calls_cycle_epochs():
    """Hundreds of calls on the same buffers, fresh data each time, varying
    row counts (rows' epochs drift apart), rescues mixed in."""
    world = 4
    sim = sim_for(world, SMALL_K, SMALL_N)
    rng = np.random.default_rng(7)
    sat_rows = 0
    for it in range(240):
        rows = int(rng.integers(1, 9))
        if it % 5 == 4:
            case = cases.saturating_case(rng, world, SMALL_K, SMALL_N, 1 + it % 3, rows=rows,
                                         cols=300)  # fmt: skip
        else:
            case = cases.random_case(rng, world=world, topk=SMALL_K, local_topk=SMALL_N, rows=rows,
                                     cols=int(rng.integers(40, 600)),
                                     distinct_values=[None, 3][it % 2])  # fmt: skip
        got = sim.call(case)
        check(case, got, what=f"call {it}")
        sat_rows += int((got[0]["saturated"] != 0).sum())
    assert sat_rows > 0
    ep = sim.epochs(0)
    assert ep.max() > 100 and len(set(ep[:8].tolist())) > 1


@pytest.mark.parametrize("world,topk,n,cols,rows", [
    (8, 2048, 512, 20000, 8),      # the production shape
    (16, 2048, 1024, 5000, 4),     # a cluster of 2 CTAs per row; round 2 from memory
    (8, 2048, 1024, 5000, 4),      # a cluster of 2 CTAs per row; round 2 in registers
    (2, 2048, 512, 1 << 17, 4),    # L = 2**17: bit 16 of l in the mask words
    (16, 4096, 2048, 4500, 2),     # W*N > 32 words/thread: round 1 re-read from memory
])  # fmt: skip
def test_large_configs(world, topk, n, cols, rows):
    rng = np.random.default_rng(world * 7 + n)
    sim = sim_for(world, topk, n)
    _run_check(sim, cases.random_case(rng, world=world, topk=topk, local_topk=n, rows=rows,
                                      cols=cols, row_ends="mixed"))  # fmt: skip
    _run_check(sim, cases.random_case(rng, world=world, topk=topk, local_topk=n, rows=rows,
                                      cols=cols, distinct_values=5))  # fmt: skip
    for s in range(1, min(world, layout.rescue_slots(topk, n)) + 1):
        _run_check(sim, cases.saturating_case(rng, world, topk, n, s, rows=rows,
                                              cols=max(n, min(cols, 3 * topk))))  # fmt: skip


@pytest.mark.parametrize("world,topk,n,cols,rows", [
    (8, 2048, 512, 20000, 8), (2, 2048, 512, 1 << 17, 4), (16, 2048, 1024, 5000, 4),
    (16, 4096, 2048, 4500, 2)])  # fmt: skip
def test_rescue_list_saturating(world, topk, n, cols, rows):
    """The rescue-list kernels (the producer makes each row's local top-K, a rescue pushes
    it): 1 .. slots saturated ranks, rows up to 2**17 (bit 16 of l in the K-list's mask
    words), bit-identical to the model."""
    rng = np.random.default_rng(world * 11 + n)
    sim = sim_for(world, topk, n, rescue_list=True)
    for s in range(1, min(world, layout.rescue_slots(topk, n)) + 1):
        got = _run_check(sim, cases.saturating_case(rng, world, topk, n, s, rows=rows, cols=cols))
        assert (np.asarray(got[0]["saturated"])[:rows] != 0).any()
    _run_check(sim, cases.random_case(rng, world=world, topk=topk, local_topk=n, rows=rows,
                                      cols=cols, row_ends="mixed"))  # fmt: skip


def _mixed_rescue_case(rng, world, topk, n, rows, cols, saturated_rows):
    """Rows of a saturating case (1..3 saturated ranks, cycling) where ``saturated_rows``
    says so, the rest random rows (no rescue) of the same length and block tables."""
    cs = [cases.saturating_case(rng, world, topk, n, s, rows=rows, cols=cols)
          for s in range(1, min(3, world, layout.rescue_slots(topk, n, world)) + 1)]  # fmt: skip
    rnd = cases.random_case(rng, world=world, topk=topk, local_topk=n, rows=rows, cols=cols,
                            row_ends="full")
    logits = [x.copy() for x in rnd.logits]
    ends = [x.copy() for x in rnd.row_ends]
    for r in range(rows):
        if saturated_rows[r]:
            c = cs[r % len(cs)]
            for q in range(world):
                logits[q][r], ends[q][r] = c.logits[q][r], c.row_ends[q][r]
    return cases.Case("mixed_rescues", world, topk, n, rnd.block_size, logits, ends, rnd.req_id,
                      rnd.block_tables)  # fmt: skip


@pytest.mark.parametrize("rescue_list", [False, True])
@pytest.mark.parametrize("world,topk,n", [(8, SMALL_K, SMALL_N), (8, 2048, 512)] + CLUSTERED)
def test_rescued_and_plain_rows_in_one_cta(world, topk, n, rescue_list):
    """One merge CTA (and three) walking 43 rows: every row rescued, rescued and plain rows
    alternating (a CTA's last row plain after a rescued one: the launch then ends after that
    row, before the rescue's code), two of every three rescued, or runs of 9; bit-identical to
    the model, call after call on the same buffers (every row's epoch and rescue sequence
    number carried on)."""
    rows = 43
    sim = sim_for(world, topk, n, max_rows=rows, rescue_list=rescue_list)
    rng = np.random.default_rng(31 + world)
    cols = max(n, 3 * topk) if topk > SMALL_K else 400
    patterns = [np.ones(rows, bool), np.arange(rows) % 2 == 1, np.arange(rows) % 3 != 1,
                (np.arange(rows) // 9) % 2 == 0]
    # (a clustered merge: every rank's clusters co-resident, W * grid clusters of C)
    grids = (1, 3) if sim.merge_cluster == 1 or 3 * world <= sim.merge_fit else (1,)
    for grid in grids:
        for pat in patterns:
            case = _mixed_rescue_case(rng, world, topk, n, rows, cols, pat)
            got = _run_check(sim, case, grid=grid)
            assert ((got[0]["saturated"] != 0) == pat).all(), (grid, got[0]["saturated"])


def test_failed_call_over_rescued_and_plain_rows_in_one_cta():
    """One merge CTA over rows alternating rescued / plain, rank 3 pushing only the first 3:
    the others time out at row 3 or later naming rank 3, and every row of every rank is right
    or empty (the CTA's last row is plain: its launch end, the withdraw included, runs after
    that row)."""
    from jax_dsa_exchange.testing.sim import Sim

    world, rows = 8, 9
    sim = Sim(world, SMALL_K, SMALL_N, 16)  # fresh buffers: this call leaves them stale
    rng = np.random.default_rng(14)
    case = _mixed_rescue_case(rng, world, SMALL_K, SMALL_N, rows, 400, np.arange(rows) % 2 == 1)
    ref = reference.protocol_merge(*case.args, topk=SMALL_K, local_topk=SMALL_N,
                                   block_size=case.block_size)
    got = sim.call(case, short_rank=3, short_rows=3, timeout_us=200_000, grid=1)
    for q in range(world):
        st = got[q]["status"]
        if q != 3:
            assert st[0] in (layout.STATUS_TIMEOUT_ROUND1, layout.STATUS_TIMEOUT_RESCUE), (q, st)
            assert st[1] >= 3 and st[3] == 3, (q, st)
            np.testing.assert_array_equal(got[q]["host_status"], st[:layout.STATUS_REPORT_WORDS])
        for r in range(rows if q != 3 else 3):
            g = {k: got[q][k][r] for k in ("kv_rows", "counts", "ids")}
            right = all(np.array_equal(g[k], getattr(ref[q], k)[r]) for k in g)
            empty = g["counts"] == 0 and (g["kv_rows"] == -1).all() and (g["ids"] == -1).all()
            assert right or empty, (q, r)


@pytest.mark.parametrize("world,topk,n", CLUSTERED)
def test_clustered_selection_in_one_cta(world, topk, n):
    """A clustered merge's rows whose selected keys all lie in one CTA of the cluster (the
    ranks it holds score high: CTA r % C at row r), then in two CTAs; bit-identical to the
    model (the other CTAs select nothing, the positions of the hot CTA's keys start after
    the empty CTAs before it)."""
    sim = sim_for(world, topk, n)
    c = sim.merge_cluster
    assert c > 1, f"W={world} N={n}: expected a clustered merge, got cluster {c}"
    npc = world // c  # ranks per CTA
    rng = np.random.default_rng(41 + world)
    rows, cols = 2 * c, 3 * n
    base = cases.random_case(rng, world=world, topk=topk, local_topk=n, rows=rows, cols=cols,
                             row_ends="full")
    logits = [x.copy() for x in base.logits]
    for r in range(rows):
        hot = {r % c} if r < c else {r % c, (r + 1) % c}
        for q in range(world):
            if q // npc in hot:
                logits[q][r] = (logits[q][r].astype(np.float32) + 50).astype(cases.BF16)
    _run_check(sim, cases.Case("one_cta", world, topk, n, base.block_size, logits, base.row_ends,
                               base.req_id, base.block_tables))  # fmt: skip


@pytest.mark.parametrize("short_rank", ["first_cta", "last_cta"])
@pytest.mark.parametrize("world,topk,n", CLUSTERED)
def test_clustered_failed_call_rows_right_or_empty(world, topk, n, short_rank):
    """A rank of the first (or last) CTA of each cluster pushes only 3 of 8 rows: the
    others time out naming it, and every row of every rank is right or empty (a cluster
    voids a row as one: no row half real, half empty)."""
    from jax_dsa_exchange.testing.sim import Sim

    sim = Sim(world, topk, n, 16, merge=TEST_MERGE)  # fresh buffers: this call leaves them stale
    short = 1 if short_rank == "first_cta" else world - 1
    rng = np.random.default_rng(17 + short)
    case = cases.random_case(rng, world=world, topk=topk, local_topk=n, rows=8, cols=3000)
    ref = reference.protocol_merge(*case.args, topk=topk, local_topk=n, block_size=case.block_size)
    got = sim.call(case, short_rank=short, short_rows=3, timeout_us=200_000)
    for q in range(world):
        st = got[q]["status"]
        if q != short:
            assert st[0] == layout.STATUS_TIMEOUT_ROUND1 and st[1] >= 3 and st[3] == short, (q, st)
            np.testing.assert_array_equal(got[q]["host_status"], st[:layout.STATUS_REPORT_WORDS])
        for r in range(8 if q != short else 3):
            g = {k: got[q][k][r] for k in ("kv_rows", "counts", "ids")}
            right = all(np.array_equal(g[k], getattr(ref[q], k)[r]) for k in g)
            empty = g["counts"] == 0 and (g["kv_rows"] == -1).all() and (g["ids"] == -1).all()
            assert right or empty, (q, r)


@pytest.mark.parametrize("world,topk,n", WIDE)
def test_wide_merge_image(world, topk, n):
    """The configuration's merge_wide image (rows over clusters of merge.CLUS_WIDE CTAs):
    bit-identical to the model on random, tied, saturated and adversarial rows, one cluster
    walking several rows too; and the launcher's choice: merge_wide while every row has its
    own cluster of it, the merge above."""
    from jax_dsa_exchange.testing.sim import Sim

    sim = Sim(world, topk, n, 16, merge="merge_wide")
    assert sim.merge_cluster == CLUS_WIDE and sim.images["merge_wide"].kernel == "merge", sim.merge_cluster
    rng = np.random.default_rng(61 + world)
    for rows in (1, 3, 6):
        _run_check(sim, cases.random_case(rng, world=world, topk=topk, local_topk=n, rows=rows,
                                          cols=4000, row_ends="mixed"))  # fmt: skip
        _run_check(sim, cases.saturating_case(rng, world, topk, n, min(1 + rows % 3, (topk - 1) // n),
                                              rows=rows, cols=3 * topk))
    _run_check(sim, _tie_case(rng, world, topk, n, 4000, [1, 2, 100, EQ_MAX, EQ_MAX + 1, 1500]))
    for c in cases.adversarial_cases(rng, world=world, topk=topk, local_topk=n, rows=4, cols=3000,
                                     saturating_rows=2):
        _run_check(sim, c)
    auto = Sim(world, topk, n, 64)
    g = auto.image_grid("merge_wide")
    assert g >= 1 and auto.merge_image(1) == "merge_wide" and auto.merge_image(g) == "merge_wide"
    assert auto.merge_image(g + 1) == "merge" and auto.merge_grid(g + 1) <= auto.image_grid("merge")
    for rows in (1, g, g + 1):
        _run_check(auto, cases.random_case(rng, world=world, topk=topk, local_topk=n, rows=rows, cols=3000))


def test_delayed_rank():
    world = 4
    sim = sim_for(world, SMALL_K, SMALL_N)
    rng = np.random.default_rng(11)
    for delay_rank in (0, 3):
        case = cases.saturating_case(rng, world, SMALL_K, SMALL_N, 2, rows=8, cols=400)
        _run_check(sim, case, delay_rank=delay_rank, delay_s=0.2)
        case = cases.random_case(rng, world=world, topk=SMALL_K, local_topk=SMALL_N, rows=8, cols=500)
        _run_check(sim, case, delay_rank=delay_rank, delay_s=0.05)


def test_missing_rank_times_out():
    from jax_dsa_exchange.testing.sim import Sim

    world, missing = 4, 2
    sim = Sim(world, SMALL_K, SMALL_N, 16)  # fresh buffers: this call leaves them stale
    rng = np.random.default_rng(5)
    case = cases.random_case(rng, world=world, topk=SMALL_K, local_topk=SMALL_N, rows=6, cols=300)
    t0 = time.perf_counter()
    got = sim.call(case, skip_rank=missing, timeout_us=100_000)
    dt = time.perf_counter() - t0
    assert dt < 20, f"took {dt:.1f}s"
    for q in range(world):
        st = got[q]["status"]
        assert st[0] == layout.STATUS_TIMEOUT_ROUND1, (q, st)
        assert 0 <= st[1] < case.rows and st[2] == 1 and st[3] == missing, (q, st)
        # the merge reported the same words to the pinned host copy (Exchange.poll reads it)
        np.testing.assert_array_equal(got[q]["host_status"], st[:layout.STATUS_REPORT_WORDS])


def test_a_late_rank_after_a_timeout_times_out_too():
    """Rank 1 starts after rank 0 gave up on it.  Rank 0 withdrew its pushed words when it
    timed out, so rank 1 does not merge with a call rank 0 abandoned: it times out too,
    naming rank 0.  Every row of both ranks is empty (a failed call voids its rows)."""
    from jax_dsa_exchange.testing.sim import Sim

    world = 2
    sim = Sim(world, SMALL_K, SMALL_N, 16)
    rng = np.random.default_rng(12)
    case = cases.random_case(rng, world=world, topk=SMALL_K, local_topk=SMALL_N, rows=6, cols=300)
    got = sim.call(case, delay_rank=1, delay_s=0.6, timeout_us=100_000)
    st0, st1 = got[0]["status"], got[1]["status"]
    assert st0[0] == layout.STATUS_TIMEOUT_ROUND1 and st0[3] == 1 and st0[2] == 1, st0
    assert st1[0] == layout.STATUS_TIMEOUT_ROUND1 and st1[3] == 0 and st1[2] == 1, st1
    for q in range(world):
        assert (got[q]["counts"] == 0).all() and (got[q]["kv_rows"] == -1).all(), q
        assert (got[q]["ids"] == -1).all() and (got[q]["saturated"] == 0).all(), q


def test_rows_of_a_failed_call_are_right_or_empty():
    """Rank 3 never pushes rows 3.. (it is given fewer rows): every rank's rows are either
    bit-identical to the model (rows every rank pushed, merged before the failure) or
    empty; none is a guess from stale words."""
    from jax_dsa_exchange.testing.sim import Sim

    world = 4
    sim = Sim(world, SMALL_K, SMALL_N, 16)
    rng = np.random.default_rng(13)
    case = cases.random_case(rng, world=world, topk=SMALL_K, local_topk=SMALL_N, rows=8, cols=300)
    ref = reference.protocol_merge(*case.args, topk=SMALL_K, local_topk=SMALL_N,
                                   block_size=case.block_size)
    got = sim.call(case, short_rank=3, short_rows=3, timeout_us=200_000)
    for q in range(world):
        st = got[q]["status"]
        if q != 3:
            assert st[0] == layout.STATUS_TIMEOUT_ROUND1 and st[1] >= 3 and st[3] == 3, (q, st)
        for r in range(got[q]["counts"].shape[0] if q != 3 else 3):
            g = {k: got[q][k][r] for k in ("kv_rows", "counts", "ids")}
            right = all(np.array_equal(g[k], getattr(ref[q], k)[r]) for k in g)
            empty = g["counts"] == 0 and (g["kv_rows"] == -1).all() and (g["ids"] == -1).all()
            assert right or empty, (q, r)


def test_missing_rescue_times_out():
    """A saturated rank that pushed round 1 but never runs its merge (so never
    rescues): the others record [2, row, epoch, that rank], no hang."""
    from jax_dsa_exchange.testing.sim import Sim

    world = 4
    sim = Sim(world, SMALL_K, SMALL_N, 16)
    rng = np.random.default_rng(9)
    case = cases.saturating_case(rng, world, SMALL_K, SMALL_N, 1, rows=6, cols=400)
    ref = reference.protocol_merge(*case.args, topk=case.topk, local_topk=case.local_topk,
                                   block_size=case.block_size)  # fmt: skip
    mask0 = int(ref[0].saturated[0])
    assert mask0 != 0
    victim = (mask0 & -mask0).bit_length() - 1
    got = sim.call(case, skip_merge_rank=victim, timeout_us=100_000)
    for q in range(world):
        if q == victim:
            continue
        st = got[q]["status"]
        assert st[0] == layout.STATUS_TIMEOUT_RESCUE, (q, st)
        assert st[3] == victim and st[2] == 1, (q, st)
        np.testing.assert_array_equal(got[q]["host_status"], st[:layout.STATUS_REPORT_WORDS])
        assert (int(ref[0].saturated[st[1]]) >> victim) & 1, (q, st)


def test_failed_or_closed_exchange_refuses_calls():
    """After a timeout (status set) every later call of the exchange does no exchange work:
    empty outputs at once (no wait, no hang), epochs unchanged, no store into any peer.
    The same holds for a closed exchange (status STATUS_CLOSED), which is what makes a
    CUDA-graph replay after Exchange.close() harmless."""
    from jax_dsa_exchange.testing.sim import Sim

    world = 4
    sim = Sim(world, SMALL_K, SMALL_N, 16)
    rng = np.random.default_rng(6)
    case = cases.random_case(rng, world=world, topk=SMALL_K, local_topk=SMALL_N, rows=6, cols=300)
    sim.call(case, skip_rank=1, timeout_us=100_000)  # every rank times out: status set
    epochs = [sim.epochs(q) for q in range(world)]
    bufs = [b.get() for b in sim.bufs]
    t0 = time.perf_counter()
    got = sim.call(case, timeout_us=10_000_000)  # a wait would take 10 s: there must be none
    assert time.perf_counter() - t0 < 5
    for q in range(world):
        assert (got[q]["counts"] == 0).all() and (got[q]["kv_rows"] == -1).all(), q
        assert (got[q]["ids"] == -1).all() and (got[q]["saturated"] == 0).all(), q
        assert (sim.epochs(q) == epochs[q]).all(), q
        assert (sim.bufs[q].get() == bufs[q]).all(), f"rank {q}'s buffer was written"
    # A healthy exchange that was closed behaves the same.
    sim2 = Sim(world, SMALL_K, SMALL_N, 16)
    for q in range(world):
        sim2.states[q][sim2.st.status_off] = layout.STATUS_CLOSED
    got = sim2.call(case, timeout_us=10_000_000)
    for q in range(world):
        assert (got[q]["counts"] == 0).all() and (sim2.bufs[q].get() == 0).all(), q
        assert got[q]["host_status"][layout.STATUS_CODE] == layout.STATUS_CLOSED, q  # reported


@pytest.mark.parametrize("start", [2**31 - 3, 2**32 - 3])
def test_epochs_across_the_int32_and_uint32_wrap(start):
    """Epochs started just below 2^31 (sign flip) and 2^32 (wrap through 0) keep working:
    tags compare as 32-bit words and the parity is the low bit, so nothing changes there."""
    from jax_dsa_exchange.testing.sim import Sim

    world = 4
    sim = Sim(world, SMALL_K, SMALL_N, 16)
    e0 = np.array([start], np.uint32).view(np.int32)[0]
    for q in range(world):
        sim.states[q][:16] = e0
    rng = np.random.default_rng(start % 1000)
    for i in range(8):  # crosses the boundary after 2-3 calls
        if i % 2:
            case = cases.saturating_case(rng, world, SMALL_K, SMALL_N, 1 + i % 3, rows=16, cols=300)
        else:
            case = cases.random_case(rng, world=world, topk=SMALL_K, local_topk=SMALL_N, rows=16,
                                     cols=300, distinct_values=5)
        _run_check(sim, case)
    want = np.array([start + 8], np.uint64).astype(np.uint32).view(np.int32)[0]
    for q in range(world):
        assert (sim.epochs(q)[:16] == want).all(), (q, sim.epochs(q)[:4], want)


def test_long_run():
    """Many consecutive calls on one set of buffers, no host synchronisation between them
    (ranks may run a call ahead of each other), varying R, forced rescues, checked against
    the model at intervals with poisoned outputs.  DSA_LONG_RUN_CALLS sets the count
    (default 100000)."""
    import os

    from jax_dsa_exchange.testing.sim import POISON, Sim

    world, calls = 4, int(os.environ.get("DSA_LONG_RUN_CALLS", "100000"))
    sim = Sim(world, SMALL_K, SMALL_N, 64)
    rng = np.random.default_rng(2026)
    pool = []
    for i, rows in enumerate([1, 7, 16, 64, 3, 33, 64, 12]):
        if i % 3 == 2:
            c = cases.saturating_case(rng, world, SMALL_K, SMALL_N, 1 + i % 3, rows=rows, cols=300)
        else:
            c = cases.random_case(rng, world=world, topk=SMALL_K, local_topk=SMALL_N, rows=rows,
                                  cols=300, distinct_values=None if i % 2 else 6)
        ref = reference.protocol_merge(*c.args, topk=SMALL_K, local_topk=SMALL_N,
                                       block_size=c.block_size)
        pool.append((c, sim.upload(c), ref))
    checked = 0
    t0 = time.perf_counter()
    for i in range(calls):
        c, dev, ref = pool[i % len(pool)]
        check_now = i % 5000 < len(pool) or i >= calls - len(pool)
        if check_now:
            for s in sim.streams:
                s.synchronize()
            for d in dev:
                for k in ("kv", "counts", "ids", "sat"):
                    d[k].fill(POISON)
            sim.cp.cuda.Device().synchronize()
        for q in range(world):
            sim.launch_rank(q, dev[q], c.rows, c.cols[0], c.block_size)
        if check_now:
            for s in sim.streams:
                s.synchronize()
            for q in range(world):
                d, r = dev[q], ref[q]
                assert (sim.status(q) == 0).all(), (i, q, sim.status(q))
                for k, name in (("kv", "kv_rows"), ("counts", "counts"), ("ids", "ids"),
                                ("sat", "saturated")):
                    assert np.array_equal(d[k].get(), getattr(r, name)), (i, q, name, c.name)
            checked += 1
    dt = time.perf_counter() - t0
    print(f"long run: {calls} calls x {world} ranks, {checked} checked, {dt:.1f} s "
          f"({dt / calls * 1e6:.0f} us per call)")
    assert checked >= 2 * len(pool)


def test_out_of_range_lookups_give_minus_one():
    """Bad req_ids (negative, huge) and block tables with too few pages: the selected
    tokens stay in ids/counts, their kv_rows entries are -1, no out-of-bounds read."""
    world = 4
    sim = sim_for(world, SMALL_K, SMALL_N)
    rng = np.random.default_rng(21)
    for _ in range(3):
        _run_check(sim, cases.bad_lookup_case(rng, world=world, topk=SMALL_K, local_topk=SMALL_N,
                                              rows=9, cols=400))


# ---------------------------------------------------------------- merge select paths
# merge.py's fast path: the boundary score from a histogram of (s - lo) >> shift (a
# second histogram when the score range is >= SCORE_BINS), then the tie-break on g:
# ranking when the boundary score holds <= EQ_MAX keys, else three histograms of g.


def _tie_case(rng, world, topk, local_topk, cols, ms, tie_bits=0x3F80):
    """Row i: a group of ms[i] tokens of one score (1.0 by default) straddles the K-th
    position of the union: fewer than K tokens score higher (distinct-ish, 2..66),
    the rest lower; positions random over the ranks.  Per rank at most ~N/2 of the
    high and tie tokens, so the whole group reaches the merge (then |U| may be < K:
    the row selects all)."""
    rows = len(ms)
    W, K, N = world, topk, local_topk
    logits = [np.empty((rows, cols), np.uint16) for _ in range(W)]
    for i, m in enumerate(ms):
        m = min(m, W * N // 2)
        a = int(rng.integers(max(0, K - m), K)) if m > 1 else K - 1
        a = min(a, W * N // 2)
        if tie_bits == 0x3F80:  # a narrow score range: one score histogram (shift 0)
            flat = (0.5 + 0.49 * rng.random(W * cols)).astype(cases.BF16).view(np.uint16)
        elif tie_bits == 0xFF80:  # -inf ties: everything below is NaN (never valid)
            flat = rng.choice(np.array([0x7FC0, 0xFFC1, 0x7F81], np.uint16), W * cols)
        else:  # a wide range: the second histogram too
            flat = (rng.random(W * cols) * -5).astype(cases.BF16).view(np.uint16)
        # high and tie tokens on distinct positions spread over the ranks
        pos = rng.permutation(W * cols)[:a + m]
        hi = ((1.5 + 2.4 * rng.random(a)) if tie_bits == 0x3F80 else (2 + 64 * rng.random(a)))
        hi = hi.astype(cases.BF16).view(np.uint16)
        flat[pos[:a]] = hi
        flat[pos[a:]] = tie_bits
        if tie_bits == 0:
            flat[pos[a:][rng.random(m) < 0.5]] = 0x8000  # -0 and +0: one score
        for q in range(W):
            logits[q][i] = flat[q * cols:(q + 1) * cols]
    ends = [np.full(rows, cols, np.int64) for _ in range(W)]
    return cases._finish(rng, f"ties_m{max(ms)}", W, K, N, 16,
                         [x.view(cases.BF16) for x in logits], ends)


@pytest.mark.parametrize("world", WORLDS)
def test_ties_straddling_the_boundary_score(world):
    """Boundary groups of 1..>EQ_MAX keys (ranking and radix tie-breaks), ±0 ties."""
    rng = np.random.default_rng(300 + world)
    n = SMALL_N if world >= 8 else SMALL_K  # W*N > K: a boundary inside the union
    sim = sim_for(world, SMALL_K, n)
    ms = [1, 2, 3, 17, 64, 129, 255, 256, 257, 500]
    for tie in (0x3F80, 0x0000, 0xFF80):  # 1.0, ±0, -inf
        _run_check(sim, _tie_case(rng, world, SMALL_K, n, 600, ms, tie))


@pytest.mark.parametrize("world,n", [(8, 512)] + [(w, n) for w, _, n in CLUSTERED])
def test_ties_straddling_the_boundary_score_large(world, n):
    """(Clustered: the tied keys of every CTA ranked together, or their g histograms summed.)"""
    rng = np.random.default_rng(77 + world + n)
    sim = sim_for(world, 2048, n)
    E = EQ_MAX
    ms = [1, 2, 5, 100, E - 1, E, E + 1, 1500]
    _run_check(sim, _tie_case(rng, world, 2048, n, 4000, ms))
    _run_check(sim, _tie_case(rng, world, 2048, n, 4000, ms, 0x0000), want_ids=False)


@pytest.mark.parametrize("world,topk,n", [(8, 2048, 512), (16, 2048, 1024), (4, SMALL_K, SMALL_N)])
def test_wide_score_range(world, topk, n):
    """Scores spread over the whole bf16 range (random bit patterns, NaN included):
    the range does not fit SCORE_BINS, so the second score histogram runs."""
    rng = np.random.default_rng(world + n)
    sim = sim_for(world, topk, n)
    cols = 3 * n
    rows = 6
    logits = [rng.integers(0, 1 << 16, (rows, cols)).astype(np.uint16).view(cases.BF16)
              for _ in range(world)]
    ends = [np.where(rng.random(rows) < 0.8, cols, rng.integers(0, cols + 1, rows)) for _ in range(world)]
    _run_check(sim, cases._finish(rng, "wide_range", world, topk, n, 16, logits, ends))
    # narrow ranges on one side of the boundary, a wide one on the other
    for q in range(world):
        x = logits[q].view(np.uint16).copy()
        x[:, : cols // 2] = (1 + rng.random((rows, cols // 2))).astype(cases.BF16).view(np.uint16)
        logits[q] = x.view(cases.BF16)
    _run_check(sim, cases._finish(rng, "half_wide", world, topk, n, 16, logits, ends))


@pytest.mark.parametrize("world,n", [(8, 512), (2, 512), (16, 1024), (8, 1024)])
def test_adversarial_large(world, n):
    """The adversarial set (all-equal rows, NaN/±0/±inf, heavy ties, ties at the K-th
    key, short rows, saturated ranks) at K=2048: every selection path of the
    production configurations."""
    rng = np.random.default_rng(900 + world)
    sim = sim_for(world, 2048, n)
    for c in cases.adversarial_cases(rng, world=world, topk=2048, local_topk=n, rows=4,
                                     cols=3000, saturating_rows=2):
        _run_check(sim, c)


@pytest.mark.parametrize("block_size", [1, 3, 24, 64, 100, 4096])
def test_block_sizes_powers_of_two_and_not(block_size):
    """kv_rows through the block table for page sizes that are powers of two (the merge
    shifts) and that are not (it divides), a rescue included; bit-identical to the model."""
    world = 4
    sim = sim_for(world, SMALL_K, SMALL_N)
    rng = np.random.default_rng(200 + block_size)
    _run_check(sim, cases.random_case(rng, world=world, topk=SMALL_K, local_topk=SMALL_N, rows=8, cols=700,
                                      block_size=block_size))
    _run_check(sim, cases.saturating_case(rng, world, SMALL_K, SMALL_N, 1, rows=4, cols=500,
                                          block_size=block_size))


@pytest.mark.parametrize("rescue_list", [False, True])
@pytest.mark.parametrize("world,topk,n", [(8, 2048, 512), (2, 2048, 512), (4, SMALL_K, SMALL_N)])
def test_rescue_tie_heavy(world, topk, n, rescue_list):
    """Round 2 on tie-heavy rescue rows: row 0 rank 0's scores + 100 (bf16: a handful of
    values, hundreds of its top K at the boundary score: the bench's forced rescue), row 1
    rank 0 all-equal (its K-list at one score), row 2 ranks 0 and 1 the same + 100 row, row
    3 the first min(3, slots) ranks all-equal: round 2's tie-break with more than EQ_MAX
    keys at the boundary score (the g histograms), on boundary bins of <= EQ_MAX keys (rows
    1, 2) and of more (row 3 at W >= 4: 128 l values x 3 ranks per 1024-g bin)."""
    rng = np.random.default_rng(4242 + world)
    sim = sim_for(world, topk, n, rescue_list=rescue_list)
    rows, cols = 4, max(4 * topk, 1024)
    logits = [rng.standard_normal((rows, cols)).astype(np.float32) for _ in range(world)]
    logits[0][[0, 2]] += 100.0
    logits[0][1] = 7.0
    if world > 1:
        logits[1][2] = logits[0][2]
    for q in range(min(3, world, layout.rescue_slots(topk, n, world))):
        logits[q][3] = 7.0
    logits = [x.astype(cases.BF16) for x in logits]
    ends = [np.full(rows, cols) for _ in range(world)]
    got = _run_check(sim, cases._finish(rng, "rescue_ties", world, topk, n, 16, logits, ends))
    assert (np.asarray(got[0]["saturated"])[:rows] & 1).all(), got[0]["saturated"]
