"""Device timing of the raw kernels on one GPU (CuPy, CUDA events; no JAX), and the
kernels' own durations from CUPTI through ``torch.profiler`` where PyTorch is importable
(:class:`KernelClock`).

Used by ``benchmarks/bench_kernels.py`` and by ``python -m jax_dsa_exchange.bench``
(the kernels-alone rows next to the op).  The stream is kept busy by a spacer memset
before the first event so host launch gaps are not timed; inputs are drawn on the
device and rotate over several sets.  :func:`prebuilt_images` reads the images of
another build (an older source tree) of the same configuration, so that both builds
are timed in one run (``KernelTimer(..., images=...)``).
"""

from __future__ import annotations

import pathlib
import statistics


def _events(cp):
    return cp.cuda.Event(), cp.cuda.Event()


def copy_bandwidth(cp, nbytes=2 << 30, reps=10):
    a = cp.ones(nbytes // 4, cp.float32)
    b = cp.empty_like(a)
    s = cp.cuda.Stream(non_blocking=True)
    ts = []
    with s:
        for _ in range(reps + 2):
            e0, e1 = _events(cp)
            e0.record(s)
            cp.copyto(b, a)
            e1.record(s)
            e1.synchronize()
            ts.append(cp.cuda.get_elapsed_time(e0, e1) * 1e-3)
    del a, b
    return 2 * nbytes / statistics.median(ts[2:])


# input patterns of KernelTimer: "random" (standard normal scores), "recent" (scores rising
# along the row: the top-N are the last tokens, contiguous: the producer's worst case for
# its compaction walks, which are serial per kept token within a thread's units)
PATTERNS = ("random", "recent")


def pattern_scores(cp, R, L, pattern):
    """float32 [R, L] scores of an input pattern (PATTERNS), on the current stream."""
    if pattern not in PATTERNS:
        raise ValueError(f"pattern {pattern!r}: one of {sorted(PATTERNS)}")
    x = cp.random.standard_normal((R, L), dtype=cp.float32)
    if pattern == "recent":
        # the best scores at the end of the row (recent tokens): the kept tokens are
        # contiguous, in the last slice of the row
        x += cp.linspace(0.0, 8.0, L, dtype=cp.float32)[None, :]
    return x


def prebuilt_images(folder, world, topk, n, arch="sm_90a", rescue_list=False) -> dict:
    """The images of configuration (arch, W, K, N, rescue_list) in a folder of prebuilt
    kernels (``python -m jax_dsa_exchange.build --out FOLDER``) whatever their source hash:
    the build of another source tree, timed next to this one.  Exactly one build of the
    configuration must be there.  The images must take the parameters this tree's launcher
    passes (kernels/abi.py); the buffer layout is not checked: compare builds of one layout."""
    from ..kernels import abi, cache

    folder = pathlib.Path(folder)
    prefix = cache.config_tag(arch, world, topk, n, "0" * 16, rescue_list)[:-16]
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: not a folder of prebuilt kernels")
    found = sorted(d for d in folder.iterdir()
                   if d.is_dir() and d.name.startswith(prefix) and len(d.name) == len(prefix) + 16
                   and all((d / f"{k}.json").is_file() for k in cache.KERNELS))  # fmt: skip
    if len(found) != 1:
        what = "no build" if not found else f"{len(found)} builds ({', '.join(d.name for d in found)})"
        raise FileNotFoundError(f"{folder}: {what} of {prefix}<source hash>; expected exactly one")
    images = cache.read_images(found[0])
    for name, img in images.items():
        want = abi.KERNELS[cache.KIND[name]].pairs()
        if tuple(img.params) != tuple(want):
            raise ValueError(f"{found[0]}/{name}: its parameters {img.params} are not this launcher's {want}: "
                             f"a build of another kernel ABI cannot be timed here")  # fmt: skip
    return images


class KernelTimer:
    """Device time of rank 0's select+push and merge, W ranks simulated in one process
    (testing.sim), CUDA events, inputs rotating over several sets.  ``images``: the kernel
    images to time (:func:`prebuilt_images`); None: this source tree's."""

    def __init__(self, cp, world, topk, n, max_rows, pattern="random", spacer_mb=256, rescue_list=False,
                 merge="auto", producer="auto", images=None):
        from .sim import Sim

        if pattern not in PATTERNS:
            raise ValueError(f"pattern {pattern!r}: one of {sorted(PATTERNS)}")
        self.pattern = pattern
        self.cp = cp
        self.sim = Sim(world, topk, n, max_rows, cta_budget=8 * world, rescue_list=rescue_list, merge=merge,
                       producer=producer, images=images)  # fmt: skip
        # the memset before each timed launch: keeps the stream busy while the host enqueues,
        # and at 256 MB (> the 50 MB L2) leaves the L2 cold, code included (spacer_mb=1:
        # L2 warm, the events then include some enqueue time; the CUPTI durations do not)
        self.spacer = cp.empty(max(1, int(spacer_mb)) << 20, cp.uint8)
        self.world, self.topk, self.n = world, topk, n

    def inputs(self, R, L, nsets, rescue, seed):
        """Device-generated inputs (host RNG is far too slow at R x L = 32M)."""
        cp, W = self.cp, self.world
        cp.random.seed(seed)
        sets = []
        npages = -(-L // 64)
        for s in range(nsets):
            per = []
            for q in range(W):
                x = pattern_scores(cp, R, L, self.pattern)
                if rescue and q == 0:
                    x += 100.0
                bits = (x.view(cp.uint32) >> 16).astype(cp.uint16)  # bf16 (truncated)
                del x
                d = dict(
                    logits=bits, row_ends=cp.full((R,), L, cp.int32),
                    req_id=cp.arange(R, dtype=cp.int32) % 4,
                    bt=cp.random.permutation(4 * npages).reshape(4, npages).astype(cp.int32),
                    kv=cp.empty((R, self.topk), cp.int32), counts=cp.empty((R,), cp.int32),
                    ids=cp.empty((R, self.topk), cp.int32), sat=cp.empty((R,), cp.int32),
                )  # fmt: skip
                per.append(d)
            sets.append(per)
        # generated on the current stream; the Sim's streams are non-blocking: a kernel
        # launched there before this work ends reads rows still being written
        cp.cuda.Device().synchronize()
        return sets

    def run(self, R, L, rescue, iters=12, warm=3, seed=0, merge=True):
        """Median select+push and merge times (us) of rank 0, the producer in the launcher's
        split; ``merge=False`` times the producer only (the merge time is then nan).  Also
        sets ``last_producer_kernel_us``: the median of rank 0's select_push kernel's own
        duration (CUPTI, :class:`KernelClock`; nan without PyTorch), and ``last_sat_rows``:
        the share of rank 0's rows that were rescued (with the merge)."""
        cp, sim, W = self.cp, self.sim, self.world
        clock = KernelClock()
        nsets = 2 if R * L * W * 2 > (1 << 29) else 4
        sets = self.inputs(R, L, nsets, rescue, seed)
        s0 = sim.streams[0]
        tp, tm = [], []
        for it in range(warm + iters):
            d = sets[it % nsets]
            if it == warm:
                clock.__enter__()
            for q in range(1, W):  # the other producers first: rank 0's runs alone
                sim.launch_rank(q, d[q], R, L, 64, merge=False)
            cp.cuda.Device().synchronize()
            e0, e1 = _events(cp)
            with s0:
                self.spacer.fill(it & 0xFF)  # keeps s0 busy while we enqueue
                e0.record(s0)
                sim.launch_rank(0, d[0], R, L, 64, merge=False)
                e1.record(s0)
            cp.cuda.Device().synchronize()
            if not merge:
                if it >= warm:
                    tp.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3)
                continue
            e2, e3 = _events(cp)
            # Without a rescue (and W * N > K: no row rescued) rank 0's merge runs alone on the
            # GPU, as on its own GPU (its data is pushed: it waits for no peer), min(R, 64) rows
            # at once as merge_alone; beside it, the others' merges take SMs from a clustered one
            # (H200, W = 8, K = 2048, N = 1024, R = 64: 58.9 us against 12.7 alone).  With a
            # rescue the others' merges run beside it (a rescue may wait on them): rank 0 64 CTAs'
            # worth of rows, the others 8 (clusters of c CTAs: 64 / c and 8 / c), 120 CTAs
            # co-resident on 132 SMs.
            alone = not rescue and W * self.n > self.topk
            c = max(1, sim.images[sim.merge_image(R)].cluster)
            with s0:
                self.spacer.fill(it & 0xFF)
                e2.record(s0)
                sim.launch_rank(0, d[0], R, L, 64, producer=False, grid=min(R, 64 if alone else max(1, 64 // c)))
                e3.record(s0)
            if alone:
                s0.synchronize()
            for q in range(1, W):
                sim.launch_rank(q, d[q], R, L, 64, producer=False, grid=min(R, max(1, 8 // c)))
            cp.cuda.Device().synchronize()
            if it >= warm:
                tp.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3)
                tm.append(cp.cuda.get_elapsed_time(e2, e3) * 1e3)
        clock.__exit__(None, None, None)
        # per iteration the other ranks' producers ran first, then rank 0's alone
        ks = [d for i, (_, d) in enumerate(clock.starts_and_durations("kernelsselect_push")) if i % W == W - 1]
        self.last_producer_kernel_us = statistics.median(ks) if len(ks) == iters else float("nan")
        if not merge:
            del sets
            return statistics.median(tp), float("nan")
        st = sim.status(0)
        assert st[0] == 0, f"status {st}"
        sat = sets[0][0]["sat"].get()
        self.last_sat_rows = float((sat != 0).mean())
        del sets
        return statistics.median(tp), statistics.median(tm)

    def merge_alone(self, R, L, rescue, iters=12, warm=3, seed=0):
        """Median device time (us, CUDA events) of rank 0's merge ALONE on the GPU, data
        already pushed: every producer first, then rank 0's merge (grid min(R, 64)), then
        the other ranks' merges after it (so they do not take SMs from it; with the forced
        rescue only rank 0 is saturated, so its merge waits for no other rank).  R = 0
        times an empty launch of the merge (the launch and event floor).  Also sets
        ``last_kernel_us``, the median of the merge kernel's own duration (CUPTI; nan without
        PyTorch), and ``last_sat_rows``."""
        cp, sim, W = self.cp, self.sim, self.world
        clock = KernelClock()
        Rd = max(R, 1)
        nsets = 2 if Rd * L * W * 2 > (1 << 29) else 4
        sets = self.inputs(Rd, L, nsets, rescue, seed)
        s0 = sim.streams[0]
        tm = []
        for it in range(warm + iters):
            d = sets[it % nsets]
            if it == warm:
                clock.__enter__()
            if R:
                for q in range(W):
                    sim.launch_rank(q, d[q], R, L, 64, merge=False)
            cp.cuda.Device().synchronize()
            e0, e1 = _events(cp)
            with s0:
                self.spacer.fill(it & 0xFF)  # keeps s0 busy while we enqueue
                e0.record(s0)
                sim.launch_rank(0, d[0], R, L, 64, producer=False, grid=max(1, min(R, 64)))
                e1.record(s0)
            s0.synchronize()
            if R:
                for q in range(1, W):
                    sim.launch_rank(q, d[q], R, L, 64, producer=False, grid=min(R, 8))
            cp.cuda.Device().synchronize()
            if it >= warm:
                tm.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3)
        clock.__exit__(None, None, None)
        # rank 0's merge ran (and was waited for) before the other ranks' merges of its iteration
        ks = firsts_of_groups(clock.starts_and_durations("kernelsmerge"), W if R else 1)
        self.last_kernel_us = statistics.median(ks) if len(ks) == iters else float("nan")
        for q in range(W):
            st = sim.status(q)
            assert st[0] == 0, f"rank {q} status {st}"
        self.last_sat_rows = float((sets[0][0]["sat"].get()[:Rd] != 0).mean()) if R else 0.0
        del sets
        return statistics.median(tm)

    def pair(self, R, L, pdl, iters=12, warm=3, seed=0):
        """Rank 0's producer and merge back to back on its stream (the decode step's order),
        the other ranks' data already pushed: median CUDA-event time of the pair, and
        ``last_pair_span_us``, the median CUPTI span from the producer's start to the merge's
        end (no launch latency).  ``pdl``: the merge under programmatic stream serialization,
        as the C++ launcher launches it (its CTAs start once every producer CTA has started
        and triggered, so its launch and its first loads overlap the producer); else plain
        stream order.  Merge grid min(R, 64) as in the merge-alone timing."""
        cp, sim, W = self.cp, self.sim, self.world
        clock = KernelClock()
        nsets = 2 if R * L * W * 2 > (1 << 29) else 4
        sets = self.inputs(R, L, nsets, False, seed)
        s0 = sim.streams[0]
        tm = []
        for it in range(warm + iters):
            d = sets[it % nsets]
            if it == warm:
                clock.__enter__()
            for q in range(1, W):
                sim.launch_rank(q, d[q], R, L, 64, merge=False)
            cp.cuda.Device().synchronize()
            e0, e1 = _events(cp)
            with s0:
                self.spacer.fill(it & 0xFF)
                e0.record(s0)
                sim.launch_rank(0, d[0], R, L, 64, grid=min(R, 64), pdl=pdl)
                e1.record(s0)
            s0.synchronize()
            for q in range(1, W):
                sim.launch_rank(q, d[q], R, L, 64, producer=False, grid=min(R, 8))
            cp.cuda.Device().synchronize()
            if it >= warm:
                tm.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3)
        clock.__exit__(None, None, None)
        st = sim.status(0)
        assert st[0] == 0, f"status {st}"
        # per iteration: W - 1 producers, rank 0's producer, then rank 0's merge first of W
        ps = clock.starts_and_durations("kernelsselect_push")[W - 1::W]
        ms = clock.starts_and_durations("kernelsmerge")[0::W]
        spans = [m0 + md - p0 for (p0, _), (m0, md) in zip(ps, ms)]
        self.last_pair_span_us = statistics.median(spans) if len(spans) == iters and len(ms) == iters else float("nan")
        self.last_pair_overlap_us = (statistics.median([p0 + pd - m0 for (p0, pd), (m0, _) in zip(ps, ms)])
                                     if len(spans) == iters else float("nan"))  # fmt: skip
        del sets
        return statistics.median(tm)


class KernelClock:
    """Kernel execution times (start, duration) from CUPTI through ``torch.profiler``, where
    PyTorch with CUDA is importable (it records every kernel of the process, CuPy's too).

    CUDA events around one launch also count the launch itself (a few us for a single
    kernel after a busy stream); these are the kernels' own times on the device.  Use::

        clock = KernelClock()
        with clock:
            ...launches...
        clock.starts_and_durations("kernelsmerge")  # [(start_us, duration_us)] by start

    ``available`` is False (and the lists empty) without PyTorch or CUDA."""

    def __init__(self):
        try:
            import torch
            from torch.profiler import ProfilerActivity, profile

            self.available = bool(torch.cuda.is_available())
        except Exception:  # noqa: BLE001 - no PyTorch (or a broken one): no clock
            self.available = False
        self._prof, self._events = None, []
        if self.available:
            self._make = lambda: profile(activities=[ProfilerActivity.CUDA])

    def __enter__(self):
        if self.available:
            self._prof = self._make()
            self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        if self._prof is None:
            return False
        self._prof.__exit__(*exc)
        self._events = []
        for e in self._prof.events():
            tr = getattr(e, "time_range", None)
            if str(getattr(e, "device_type", "")).endswith("CUDA") and tr is not None:
                self._events.append((tr.start, tr.elapsed_us(), e.name))
        self._events.sort()
        self._prof = None
        return False

    def starts_and_durations(self, name_part: str) -> list:
        return [(t, d) for t, d, n in self._events if name_part in n]


def firsts_of_groups(events, group: int) -> list:
    """Durations of the first kernel of each run of ``group`` kernels in start order (e.g.
    rank 0's merge, launched and finished before the other ranks' merges of the same
    iteration)."""
    return [d for i, (_, d) in enumerate(events) if i % group == 0]
