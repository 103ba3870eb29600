"""GPU tests of the producer's split select (kernels/select.py): for every
cluster size the launcher can choose (1..8 CTAs per row), the rows select_push
pushes are byte-identical to reference.pack_local_topk, with the right epoch
tag in every LL half, in every rank's buffer; the whole exchange stays
bit-identical to the protocol model; the rescue's n = K select (one CTA, the
row re-read from global memory) is exact on 2^17-token rows.

Runs where a GPU and CuPy exist, from prebuilt cubins (JAX_DSA_EXCHANGE_CUBIN_DIR).
"""

from __future__ import annotations

import numpy as np
import pytest

from jax_dsa_exchange import layout, reference
from jax_dsa_exchange.testing import cases

from gpu import requires, requires_gpu_stack
from test_kernels_gpu import check, sim_for

pytestmark = [pytest.mark.gpu, requires_gpu_stack]

CLUSTERS = list(range(1, layout.PRODUCER_CLUSTER_MAX + 1))
L_MAX = layout.MAX_LOCAL_LEN


def _row_ends(n, L, rows, rng):
    """Lengths of interest: empty, 1, around N, around slice and vector edges, L."""
    S8 = -(-L // 8) // 8 * 8
    want = [0, 1, 7, 8, 9, n - 1, n, n + 1, 2 * n + 3, S8 - 1, S8 + 1, L // 3, L - 9, L - 1, L,
            L + 5, -3]  # fmt: skip
    # slices around 8192 tokens: 8192 / 8193 at C = 1, and at C = 2 / 4 / 8 slices of 8200
    # whose last is <= 8192 (one round of pass 1 in one CTA of the cluster, more in the others)
    want += [8192, 8193, 16390, 32770, 65536, 65544]
    want += list(rng.integers(0, L + 1, max(0, rows - len(want))))
    return np.array(want[:rows], np.int64).astype(np.int32)


def _logits(kind, rows, L, rng):
    if kind == "random":
        return cases.random_logits(rng, rows, L)
    if kind == "ties":
        return cases.random_logits(rng, rows, L, distinct_values=3)
    if kind == "equal":
        return np.full((rows, L), 0.5, cases.BF16)
    if kind in ("recent", "runs"):
        # kept tokens in dense runs (the select's list walk): "recent" rises along the row
        # (the top n are its last tokens, in one slice); "runs" lifts a few runs of 40-700
        # tokens at random places (several slices, several threads' units, slice edges)
        x = rng.standard_normal((rows, L)).astype(np.float32)
        if kind == "recent":
            x += np.linspace(0.0, 8.0, L, dtype=np.float32)[None, :]
        else:
            for t in range(rows):
                for _ in range(int(rng.integers(1, 6))):
                    a = int(rng.integers(0, L))
                    x[t, a:a + int(rng.integers(40, 700))] += 6.0
        return (x.view(np.uint32) >> 16).astype(np.uint16).view(cases.BF16)
    # specials: NaN (both signs, payloads), +-0, +-inf among normal scores
    x = cases.random_logits(rng, rows, L).view(np.uint16).copy()
    specials = np.array([0x7FC0, 0xFFC1, 0x7F81, 0x0000, 0x8000, 0x7F80, 0xFF80], np.uint16)
    m = rng.random((rows, L)) < 0.3
    x[m] = rng.choice(specials, int(m.sum()))
    return x.view(cases.BF16)


def _pushed(sim, dst, src, t, n):
    """(words, tags) of row t that rank src pushed into rank dst's buffer."""
    e = int(sim.epochs(src)[t]) + 1
    off = sim.lay.ll_row(e & 1, src, t)
    raw = sim.bufs[dst][off:off + layout.ll_row_bytes(n)].get().view(np.uint32).reshape(-1, 4)
    return raw[:, [0, 2]].ravel(), raw[:, [1, 3]].ravel(), e


def _launch_and_check(sim, d, rows, L, c, want, ends, what):
    """Rank 0's producer over ``rows`` rows of L columns in clusters of c, then every rank's
    buffer holds want[t] for row t, with the call's epoch in every LL half."""
    sim.cp.cuda.Device().synchronize()  # (the caller's fills run on another stream than the launch)
    sim.launch_rank(0, d, rows, L, 16, merge=False, cluster=c)
    sim.cp.cuda.Device().synchronize()
    for dst in range(sim.world):
        for t in range(rows):
            words, tags, e = _pushed(sim, dst, 0, t, sim.n)
            assert (tags == e).all(), f"{what} row {t}: epoch tags {set(tags.tolist())} != {e}"
            if not np.array_equal(words, want[t]):
                bad = np.flatnonzero(words != want[t])
                raise AssertionError(
                    f"{what} row {t} (end {ends[t]}) in rank {dst}'s buffer: {bad.size} words differ, "
                    f"first at {bad[0]}: got {words[bad[0]]:#x} want {want[t][bad[0]]:#x}")


@pytest.mark.parametrize("rescue_list", [False, True])
@pytest.mark.parametrize("kind", ["random", "ties", "equal", "specials", "recent", "runs"])
def test_pushed_rows_are_the_model_rows_for_every_split(kind, rescue_list):
    """... and with the rescue-list kernels each row's K-list in the local state (what the
    merge's rescue pushes) is reference.pack_local_topk(row, end, K), word for word."""
    world, topk, n = 2, 2048, 512
    sim = sim_for(world, topk, n, max_rows=64, rescue_list=rescue_list)
    klist = rescue_list
    rwk = layout.row_words(topk)
    rng = np.random.default_rng({"random": 1, "ties": 2, "equal": 3, "specials": 4, "recent": 5,
                                 "runs": 6}[kind])  # fmt: skip
    for L in (L_MAX, 20001):
        rows = 28
        logits = _logits(kind, rows, L, rng)
        ends = _row_ends(n, L, rows, rng)
        want = [reference.pack_local_topk(logits[t].view(np.uint16), ends[t], n) for t in range(rows)]
        want_k = [reference.pack_local_topk(logits[t].view(np.uint16), ends[t], topk) if klist else None
                  for t in range(rows)]  # fmt: skip
        d = sim.upload(cases.Case("sel", world, topk, n, 16, [logits] * world, [ends] * world,
                                  [np.zeros(rows, np.int32)] * world,
                                  [np.zeros((1, -(-L // 16)), np.int32)] * world))[0]  # fmt: skip
        for c in CLUSTERS:
            for b in sim.bufs:
                b.fill(0)
            if klist:  # (every K-list word must be written: none left from before)
                sim.states[0][sim.st.klist_off:].fill(-1)
            _launch_and_check(sim, d, rows, L, c, want, ends, f"{kind} L={L} C={c}")
            if klist:
                st = sim.states[0].get().view(np.uint32)
                for t in range(rows):
                    got = st[sim.st.klist_off + t * rwk:sim.st.klist_off + (t + 1) * rwk]
                    if not np.array_equal(got, want_k[t]):
                        bad = np.flatnonzero(got != want_k[t])
                        raise AssertionError(
                            f"{kind} L={L} C={c} row {t} (end {ends[t]}): K-list: {bad.size} words "
                            f"differ, first at {bad[0]}: got {got[bad[0]]:#x} want {want_k[t][bad[0]]:#x}")


@pytest.mark.parametrize("kind", ["random", "ties", "equal", "specials", "recent", "runs"])
def test_lean_image_pushes_the_model_rows(kind):
    """The lean producer image (kernels/lean.py), forced, at every split whose slices fit it
    (16K tokens), in launches of at most one wave of CTAs (layout.ARCHS: 132 on sm_90a) (slices cut from the buffer's
    row length, loaded before the row end is known) and of more (slices cut from each row's end):
    rows byte-identical to reference.pack_local_topk, the right epoch tag in every LL half."""
    from jax_dsa_exchange.testing.sim import Sim

    world, topk, n = 2, 2048, 512
    sim = Sim(world, topk, n, 160, producer="select_push_lean")
    rng = np.random.default_rng({"random": 21, "ties": 22, "equal": 23, "specials": 24, "recent": 25,
                                 "runs": 26}[kind])  # fmt: skip
    # (rows, C) with rows * C <= 132 and > 132 at every L: both ways of cutting the slices
    # (L = 100000: l = 2**16 inside a thread's run of the slice that holds it, whose walk knows
    # where bit 16 of l starts in the row: the direct push's mask records)
    for L, rows_of in ((8192, (16, 140)), (16384, (16, 133)), (16385, (16, 70)), (20001, (16, 70)),
                       (100000, (16, 24)), (L_MAX, (16, 17))):
        for rows in rows_of:
            logits = _logits(kind, rows, L, rng)
            ends = rng.permutation(_row_ends(n, L, rows, rng))
            want = [reference.pack_local_topk(logits[t].view(np.uint16), ends[t], n) for t in range(rows)]
            d = sim.upload(cases.Case("lean", world, topk, n, 16, [logits] * world, [ends] * world,
                                      [np.zeros(rows, np.int32)] * world,
                                      [np.zeros((1, -(-L // 16)), np.int32)] * world))[0]  # fmt: skip
            for c in CLUSTERS:
                if sim.producer_image(L, c) != "select_push_lean":
                    assert not layout.producer_uses_lean(L, c, layout.PRODUCER_LEAN_SLICE_MAX)
                    continue
                for b in sim.bufs:
                    b.fill(0)
                _launch_and_check(sim, d, rows, L, c, want, ends, f"{kind} L={L} R={rows} C={c} ({rows * c} CTAs)")


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_exchange_bit_identical_for_every_split(cluster):
    """The shared adversarial cases through select_push (forced C) + merge."""
    rng = np.random.default_rng(50 + cluster)
    world, topk, n = 8, 2048, 512
    sim = sim_for(world, topk, n)
    for case in cases.adversarial_cases(rng, world=world, topk=topk, local_topk=n, cols=9000, rows=8):
        got = sim.call(case, cluster=cluster)
        check(case, got, what=f"C={cluster}")


def test_policy_split_and_mixed_lengths_in_one_call():
    """The launcher's own choice of C over shapes that give different splits, rows
    of one call with very different lengths (so different slice sizes)."""
    rng = np.random.default_rng(9)
    world, topk, n = 2, 2048, 512
    sim = sim_for(world, topk, n)
    # ((1, 8192), (16, 8192), (2, 20001), (4, 3000): the lean image's own finer cut,
    # layout.producer_lean_cluster: C = 4, 4, 8, 2)
    for rows, L in ((1, L_MAX), (3, 65537), (16, 8192), (64, 4096), (12, L_MAX), (16, L_MAX), (32, 65536),
                    (1, 8192), (2, 20001), (4, 3000)):
        image, c = sim.producer_launch(rows, L)
        assert c >= 1
        case = cases.random_case(rng, world=world, topk=topk, local_topk=n, rows=rows, cols=L,
                                 row_ends="uniform")  # fmt: skip
        check(case, sim.call(case), what=f"R={rows} L={L} C={c} {image}")


@requires("driver")
def test_cluster_fit_is_the_launchers():
    """The device's count of co-resident clusters (which caps the split policy): the sim
    measures it as the C++ launcher does when the split is set, and both agree; up to 32
    rows the policy's clusters all run at once at one CTA per SM."""
    from jax_dsa_exchange import _ffi

    sim = sim_for(8, 2048, 512)
    fit = sim.split["cluster_fit"]
    assert len(fit) == layout.PRODUCER_CLUSTER_MAX and fit[0] >= 1 and min(fit) >= 0, fit
    assert all(fit[c - 1] * c <= fit[0] for c in range(1, len(fit) + 1)), fit
    for rows in (1, 8, 12, 16, 24, 32):  # (one wave: the rows fit at the policy's C)
        for L in (8192, 65536, L_MAX):
            c = sim.producer_cluster(rows, L)
            assert rows <= layout.producer_cluster_fit(sim.split)[c - 1], (rows, L, c, fit)
    img = sim.images["select_push"]
    key = f"fit_probe/{img.source_hash}"
    _ffi.load_kernel(key, img.kernel, img.params, img.cubin, img.ptx, img.entry, 0, img.block, img.smem)
    _ffi.set_kernel_split(key, 0, dict(img.split))
    assert _ffi.kernel_cluster_fit(key, 0) == tuple(fit)
    print(f"cluster fit (clusters of 1..8 CTAs at once, one CTA per SM): {fit}")


def test_rescue_select_on_long_rows():
    """A saturated rank's local top-K (n = K) on 2^17-token rows: one CTA of the merge
    re-reads the row from global memory in every pass."""
    rng = np.random.default_rng(11)
    world, topk, n = 2, 2048, 512
    sim = sim_for(world, topk, n)
    case = cases.saturating_case(rng, world, topk, n, 1, rows=3, cols=L_MAX)
    got = sim.call(case)
    check(case, got, what="rescue L=2^17")
    assert (got[0]["saturated"] != 0).all()
