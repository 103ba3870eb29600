"""W ranks of the exchange in ONE process on ONE GPU, through CuPy (tests and
benchmarks of the raw kernels; no JAX, no FFI).

Every rank gets its own zeroed symmetric buffer (layout.BufferLayout) and
local state (layout.StateLayout); one device int64[W] peers table holds all
ranks' buffer addresses (same-device pointers play the NVLink peers).  A call
launches, per rank on its own stream, select_push then merge; the W merges
run concurrently, so a rescue can complete.  The merge grid is sized so the
W grids are co-resident (docs/DESIGN.md §6.7).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import tempfile
import time

import numpy as np

from .. import layout
from ..kernels import abi
from ..kernels.cache import load_kernels

POISON = -123456789  # outputs are filled with this before every call

# cuLaunchKernelEx through ctypes: CuPy's launch has no cluster dimensions.
_CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
_CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14
_NONPORTABLE = set()  # CUfunction handles allowed clusters of more than 8 CTAs


class _LaunchAttrValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("align", ctypes.c_void_p), ("dim", ctypes.c_uint * 3)]


class _LaunchAttr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _LaunchAttrValue)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttr)),
                ("nattrs", ctypes.c_uint)]  # fmt: skip


_LIBCUDA = None


def _typed(params, values):
    """``values`` (launch order) as NumPy scalars of the metadata's (name, type) pairs."""
    assert len(params) == len(values), (params, values)
    return tuple((np.int64 if t == "i64" else np.int32)(v) for (_, t), v in zip(params, values))


def launch_cluster(fn, grid, block, smem, stream, params, values, cluster, pdl=False):
    """Launch CuPy function ``fn`` with a (cluster, 1, 1) cluster (none where ``cluster`` is 0);
    ``params`` are the kernel metadata's (name, "i64" | "i32") pairs, ``values`` their values.
    ``pdl``: programmatic stream serialization, as the C++ launcher launches the merge (it may
    start once every CTA of the kernel before it on the stream has triggered, or exited)."""
    global _LIBCUDA
    if _LIBCUDA is None:
        _LIBCUDA = ctypes.CDLL("libcuda.so.1")
        _LIBCUDA.cuLaunchKernelEx.restype = ctypes.c_int
    assert len(params) == len(values), (params, values)
    args = [(ctypes.c_int64 if t == "i64" else ctypes.c_int32)(int(v)) for (_, t), v in zip(params, values)]
    ptrs = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args])
    attrs = (_LaunchAttr * 2)()
    n = 0
    if pdl:
        attrs[n].id = _CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attrs[n].value.dim[0] = 1  # programmaticStreamSerializationAllowed (an int at offset 0)
        n += 1
    if cluster:
        attrs[n].id = _CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attrs[n].value.dim[0], attrs[n].value.dim[1], attrs[n].value.dim[2] = int(cluster), 1, 1
        n += 1
    cfg = _LaunchConfig()
    cfg.grid[0], cfg.grid[1], cfg.grid[2] = int(grid), 1, 1
    cfg.block[0], cfg.block[1], cfg.block[2] = int(block), 1, 1
    cfg.smem = int(smem)
    cfg.stream = ctypes.c_void_p(int(stream.ptr))
    cfg.attrs = ctypes.cast(attrs, ctypes.POINTER(_LaunchAttr)) if n else None
    cfg.nattrs = n
    handle = fn.kernel.ptr if hasattr(fn, "kernel") else fn.ptr  # RawKernel -> its CUfunction
    if cluster and int(cluster) > 8 and int(handle) not in _NONPORTABLE:
        # (a forced split past the portable size: a timing experiment; the launchers stay <= 8)
        rc = _LIBCUDA.cuFuncSetAttribute(ctypes.c_void_p(int(handle)), _CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
        if rc != 0:
            raise RuntimeError(f"cuFuncSetAttribute(NON_PORTABLE_CLUSTER_SIZE_ALLOWED) failed with CUresult {rc}")
        _NONPORTABLE.add(int(handle))
    rc = _LIBCUDA.cuLaunchKernelEx(ctypes.byref(cfg), ctypes.c_void_p(int(handle)), ptrs, None)
    if rc != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {rc} (grid {grid}, cluster {cluster}, pdl {pdl})")


def cluster_fit(fn, block, smem, cluster_max):
    """Clusters of c = 1..PRODUCER_CLUSTER_MAX CTAs of CuPy function ``fn`` the device runs at
    once at ``smem`` bytes of dynamic shared memory (cuOccupancyMaxActiveClusters; -1 past
    cluster_max or on an error): the launcher's MeasureClusterFit, for the same policy."""
    global _LIBCUDA
    if _LIBCUDA is None:
        _LIBCUDA = ctypes.CDLL("libcuda.so.1")
        _LIBCUDA.cuLaunchKernelEx.restype = ctypes.c_int
    out = [-1] * layout.PRODUCER_CLUSTER_MAX
    query = getattr(_LIBCUDA, "cuOccupancyMaxActiveClusters", None)
    if query is None:
        return tuple(out)
    handle = fn.kernel.ptr if hasattr(fn, "kernel") else fn.ptr
    for c in range(1, min(int(cluster_max), layout.PRODUCER_CLUSTER_MAX) + 1):
        attr = _LaunchAttr()
        attr.id = _CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attr.value.dim[0], attr.value.dim[1], attr.value.dim[2] = c, 1, 1
        cfg = _LaunchConfig()
        cfg.grid[0], cfg.grid[1], cfg.grid[2] = c, 1, 1
        cfg.block[0], cfg.block[1], cfg.block[2] = int(block), 1, 1
        cfg.smem = int(smem)
        cfg.stream = None
        cfg.attrs = ctypes.pointer(attr)
        cfg.nattrs = 1
        n = ctypes.c_int(-1)
        if query(ctypes.byref(n), ctypes.c_void_p(int(handle)), ctypes.byref(cfg)) == 0 and n.value >= 0:
            out[c - 1] = n.value
    return tuple(out)


def _load_function(img, tmpdir, name=None):
    """cubin first; if the driver refuses it (newer toolkit), the PTX (JIT).  The file is named
    after the image (``name``): merge and merge_wide are both kernel "merge", and CuPy caches a
    RawModule loaded from a path (or loads it lazily), so with one file name for both, merge_wide's
    launches ran the merge's code on clusters of 4: its cluster-size check trapped
    (unspecified launch failure)."""
    import cupy as cp

    errors = []
    for ext, data in (("cubin", img.cubin), ("ptx", img.ptx.encode())):
        path = os.path.join(tmpdir, f"{name or img.kernel}.{ext}")
        with open(path, "wb") as f:
            f.write(data)
        try:
            mod = cp.RawModule(path=path)
            fn = mod.get_function(img.entry)
            if img.smem > 48 * 1024:
                fn.max_dynamic_shared_size_bytes = img.smem
            return mod, fn, ext
        except Exception as e:  # noqa: BLE001 - report both attempts
            errors.append(f"{ext}: {e}")
    raise RuntimeError(f"cannot load {img.kernel}: {errors}")


class Sim:
    def __init__(self, world, topk, local_topk, max_rows, *, arch=None, cta_budget=96,
                 rescue_list=False, merge="auto", producer="auto", images=None, interleave=1):
        """``merge``: which merge image every call launches: "auto" the launcher's choice
        (layout.merge_uses_wide), "merge" or "merge_wide" (the configuration's, where it has
        one: else "merge").  ``producer``: likewise "auto" (layout.producer_uses_lean),
        "select_push" or "select_push_lean" (where the configuration has it and the launch's
        slices fit it: else select_push).  ``images``: the kernel images to launch (another
        build of this configuration, testing.timing.prebuilt_images); None: this tree's, for
        ``arch`` (None: the device's target) and the KV cache's ``interleave``."""
        import cupy as cp

        if merge not in ("auto", "merge", "merge_wide"):
            raise ValueError(f"merge={merge!r}: expected 'auto', 'merge' or 'merge_wide'")
        if producer not in ("auto", "select_push", "select_push_lean"):
            raise ValueError(f"producer={producer!r}: expected 'auto', 'select_push' or 'select_push_lean'")
        self.producer_choice = producer

        self.cp = cp
        self.world, self.topk, self.n, self.max_rows = world, topk, local_topk, max_rows
        self.lay = layout.BufferLayout(world, topk, local_topk, max_rows)
        self.rescue_list = bool(rescue_list)  # (the kernels' option: Exchange.create)
        self.st = layout.StateLayout(max_rows, topk if rescue_list else 0)
        self.interleave = interleave
        dev = cp.cuda.Device()
        cc = dev.compute_capability
        arch = arch or layout.arch_of((int(cc[:-1]), int(cc[-1])))
        images = images if images is not None else load_kernels(arch, world, topk, local_topk,
                                                                rescue_list=self.rescue_list, interleave=interleave)
        # the splits as the launcher sets them on this device (Exchange._register)
        sms = dev.attributes["MultiProcessorCount"]
        self.images = {name: dataclasses.replace(img, split=layout.split_for_device(img.split, sms))
                       if img.split else img for name, img in images.items()}
        self._tmp = tempfile.TemporaryDirectory()
        self.fns, self.loaded_from = {}, {}
        self._mods = []
        for name, img in self.images.items():
            mod, fn, ext = _load_function(img, self._tmp.name, name)
            self._mods.append(mod)
            self.fns[name], self.loaded_from[name] = fn, ext
        self.bufs = [cp.zeros(self.lay.nbytes, cp.uint8) for _ in range(world)]
        self.states = [cp.zeros(self.st.alloc_words, cp.int32) for _ in range(world)]
        self.peers = cp.asarray(np.array([b.data.ptr for b in self.bufs], np.int64))
        self.streams = [cp.cuda.Stream(non_blocking=True) for _ in range(world)]
        # the pinned host copies of each rank's status words (the merge fills them on a failure)
        self._host_status = [cp.cuda.alloc_pinned_memory(4 * layout.STATUS_REPORT_WORDS) for _ in range(world)]
        for h in self._host_status:
            np.frombuffer(h, np.int32, layout.STATUS_REPORT_WORDS)[:] = 0
        self.cta_budget = cta_budget
        # the split the launcher would use: the metadata's plus the device's co-resident
        # cluster counts (the C++ launcher measures the same when the split is set)
        sp = self.images["select_push"]
        self.split = dict(sp.split) if sp.split else None
        if self.split and self.split.get("cluster_max", 0) > 1:
            self.split["cluster_fit"] = cluster_fit(self.fns["select_push"], sp.block, sp.smem,
                                                    self.split["cluster_max"])
        # a clustered merge (the metadata's cluster C > 1): clusters of C this device runs at
        # once, of each merge image
        self.fits = {}
        for name in ("merge", "merge_wide"):
            if name in self.images and self.images[name].cluster > 1:
                mg = self.images[name]
                self.fits[name] = cluster_fit(self.fns[name], mg.block, mg.smem, mg.cluster)[mg.cluster - 1]
        self.merge_choice = merge if merge == "auto" or merge in self.images else "merge"
        # the image a call launches when forced, else the merge's (merge_cluster / merge_fit:
        # what the tests size their grids by)
        shown = "merge" if self.merge_choice == "auto" else self.merge_choice
        self.merge_cluster = int(self.images[shown].cluster)
        self.merge_fit = self.fits.get(shown, -1)
        cp.cuda.Device().synchronize()

    def launch_split(self):
        """The split select_push launches with: the loaded image's metadata (a variant may
        differ from the first) with this device's cluster counts (measured once: the same
        GPU), or None (a build without a split)."""
        split = dict(self.images["select_push"].split or {})
        if split and self.split and "cluster_fit" in self.split:
            split["cluster_fit"] = self.split["cluster_fit"]
        return split or None

    def producer_cluster(self, rows, cols):
        """CTAs per row the launcher picks for [rows, cols] on this device."""
        return layout.producer_cluster(rows, cols, self.launch_split())

    def producer_image(self, cols, c):
        """The producer image a launch over [rows, cols] in clusters of c runs: the lean one
        where the configuration has it and its slices fit (layout.producer_uses_lean), unless
        a choice was forced."""
        lean = self.images.get("select_push_lean")
        fits = lean is not None and layout.producer_uses_lean(cols, c, lean.split["slice_max"])
        if self.producer_choice == "select_push" or not fits:
            return "select_push"
        return "select_push_lean"

    def producer_launch(self, rows, cols, cluster=None):
        """(image, CTAs per row) of the producer launch over [rows, cols], as the C++ launcher
        picks them: select_push's C (layout.producer_cluster), the image by
        layout.producer_uses_lean, the lean image's rows then cut by its own split
        (layout.producer_lean_cluster); a forced ``cluster`` is taken as it is."""
        c = cluster or layout.producer_cluster(rows, cols, self.launch_split())
        name = self.producer_image(cols, c)
        if name == "select_push_lean" and not cluster:
            c = layout.producer_lean_cluster(rows, cols, c, self.images[name].split)
        return name, c

    def image_grid(self, name):
        """Rows each rank's launch of merge image ``name`` takes at once (its CTAs, or with a
        clustered merge its clusters): the W grids co-resident within cta_budget CTAs (and
        the device's count of co-resident clusters)."""
        c = self.images[name].cluster
        g = self.cta_budget // (self.world * c)
        if c > 1 and self.fits.get(name, -1) >= 0:
            g = min(g, self.fits[name] // self.world)
        return max(1, g)

    def merge_image(self, rows):
        """The merge image a call over ``rows`` launches: the forced one, or the launcher's
        choice (merge_wide where the configuration has it and every row gets its own cluster)."""
        if self.merge_choice != "auto":
            return self.merge_choice
        wide = self.image_grid("merge_wide") if "merge_wide" in self.images else 0
        return "merge_wide" if layout.merge_uses_wide(rows, wide) else "merge"

    def merge_grid(self, rows):
        """Rows each rank's merge over ``rows`` rows takes at once (merge_image's grid)."""
        return min(rows, self.image_grid(self.merge_image(rows)))

    def status(self, q):
        s = self.states[q].get()
        return s[self.st.status_off:self.st.status_off + layout.STATUS_WORDS].copy()

    def host_status(self, q):
        """The pinned host copy of rank q's reported status words (read after a sync)."""
        return np.frombuffer(self._host_status[q], np.int32, layout.STATUS_REPORT_WORDS).copy()

    def epochs(self, q):
        return self.states[q].get()[: self.max_rows].copy()

    def upload(self, case):
        """Device copies of a Case's per-rank inputs + poisoned outputs."""
        cp = self.cp
        R, K = case.rows, self.topk
        assert case.world == self.world and case.equal_cols and R <= self.max_rows
        dev = []
        for q in range(self.world):
            d = dict(
                logits=cp.asarray(np.ascontiguousarray(case.logits[q]).view(np.uint16)),
                row_ends=cp.asarray(case.row_ends[q].astype(np.int32)),
                req_id=cp.asarray(case.req_id[q].astype(np.int32)),
                bt=cp.asarray(np.ascontiguousarray(case.block_tables[q], np.int32)),
                kv=cp.full((R, K), POISON, cp.int32), counts=cp.full((R,), POISON, cp.int32),
                ids=cp.full((R, K), POISON, cp.int32), sat=cp.full((R,), POISON, cp.int32),
            )  # fmt: skip
            dev.append(d)
        return dev

    def launch_rank(self, q, d, rows, cols, block_size, *, want_ids=True, want_sat=True,
                    timeout_us=2_000_000, grid=None, producer=True, merge=True,
                    cluster=None, pdl=False):  # fmt: skip
        """Rank q's select_push and / or merge on its stream; ``pdl`` launches the merge with
        programmatic stream serialization (as the C++ launcher does): behind this rank's
        producer it then starts once every producer CTA has triggered."""
        name = self.merge_image(rows)
        mg = self.images[name]
        with self.streams[q]:
            if producer:
                # the split, the slice cache and the shared memory for it as the C++ launcher
                # derives them from the metadata (a cache=N variant build has its own cache_max):
                # the image and C by producer_launch, the cache from select_push's split at that C
                split = self.launch_split() or {}
                pname, c = self.producer_launch(rows, cols, cluster)
                sp = self.images[pname]
                cache, smem = 0, sp.smem  # (a build without a slice cache: the launcher's case too)
                if split.get("cache_max", 0) > 0:
                    cache = layout.producer_cache_tokens(rows, cols, c, split)
                    smem = sp.smem - 2 * (sp.split["cache_max"] - cache)
                values = abi.SELECT_PUSH.pack(dict(
                    logits=d["logits"].data.ptr, row_ends=d["row_ends"].data.ptr, rows=rows, cols=cols,
                    epoch=self.states[q].data.ptr, peers=self.peers.data.ptr, rank=q,
                    max_rows=self.max_rows, cache_tokens=cache))  # fmt: skip
                launch_cluster(self.fns[pname], rows * c, sp.block, smem, self.streams[q],
                               sp.params, values, c)  # fmt: skip
            if merge:
                bt = d["bt"]
                values = abi.MERGE.pack(dict(
                    peers=self.peers.data.ptr, local=self.bufs[q].data.ptr, state=self.states[q].data.ptr,
                    logits=d["logits"].data.ptr, row_ends=d["row_ends"].data.ptr,
                    req_id=d["req_id"].data.ptr, block_table=bt.data.ptr, kv_rows=d["kv"].data.ptr,
                    counts=d["counts"].data.ptr, ids=d["ids"].data.ptr if want_ids else 0,
                    saturated=d["sat"].data.ptr if want_sat else 0, rows=rows, cols=cols,
                    bt_rows=bt.shape[0], bt_cols=bt.shape[1], block_size=block_size, rank=q,
                    max_rows=self.max_rows, rescue_off=self.lay.rescue_off, flags_off=self.lay.flags_off,
                    timeout_us=timeout_us, host_status=self._host_status[q].ptr))  # fmt: skip
                g = grid or self.merge_grid(rows)
                if mg.cluster > 1 or pdl:
                    c = mg.cluster if mg.cluster > 1 else 0
                    launch_cluster(self.fns[name], g * max(c, 1), mg.block, mg.smem, self.streams[q],
                                   mg.params, values, c, pdl=pdl)  # fmt: skip
                else:
                    self.fns[name]((g,), (mg.block,), _typed(mg.params, values), shared_mem=mg.smem)

    def call(self, case, *, want_ids=True, want_sat=True, delay_rank=None, delay_s=0.0,
             skip_rank=None, skip_merge_rank=None, short_rank=None, short_rows=0,
             timeout_us=2_000_000, grid=None, cluster=None, pdl=False):  # fmt: skip
        """One exchange call of every rank on a Case -> per-rank dict of NumPy
        outputs (kv_rows, counts, ids, saturated, status).  ``skip_rank``
        never pushes (its merge still runs); ``skip_merge_rank`` pushes but
        never merges (so never rescues); ``delay_rank`` starts late;
        ``short_rank`` calls with only ``short_rows`` rows (its outputs past
        them stay poisoned).  ``pdl``: each rank's producer then its merge on its
        stream, the merge under programmatic stream serialization (the C++
        launcher's order; the merge then starts while its producer runs); only
        for small calls, whose W producers and W merges all fit on the GPU at once,
        and not with the other options."""
        if case.interleave != self.interleave:
            raise ValueError(f"{case} has interleave={case.interleave}, this Sim's merge is built for "
                             f"interleave={self.interleave}")
        cp = self.cp
        dev = self.upload(case)
        cp.cuda.Device().synchronize()
        R, L = case.rows, case.cols[0]
        kw = dict(want_ids=want_ids, want_sat=want_sat, timeout_us=timeout_us, grid=grid,
                  cluster=cluster)  # cluster: CTAs per row of select_push (None: the policy)
        if pdl:
            if delay_rank is not None or skip_rank is not None or skip_merge_rank is not None or short_rank is not None:
                raise ValueError("pdl=True runs every rank's full call: no delay / skip / short rank")
            for q in range(self.world):
                self.launch_rank(q, dev[q], R, L, case.block_size, pdl=True, **kw)
            for s in self.streams:
                s.synchronize()
            return self._outputs(dev)
        # All on-time producers first; the merges wait for them (an event per
        # producer).  On W GPUs each rank's producer has its GPU to itself; here a
        # producer cluster (up to 8 CTAs in one GPC) could find no room beside the
        # other ranks' spinning merges.  A late rank therefore pushes with one CTA
        # per row (any free SM takes it): the same bytes (tests/test_select_gpu.py).
        order = [q for q in range(self.world) if q != delay_rank]
        rows_of = {q: short_rows if q == short_rank else R for q in range(self.world)}
        done = []
        for q in order:
            if q != skip_rank:
                self.launch_rank(q, dev[q], rows_of[q], L, case.block_size, merge=False, **kw)
                ev = cp.cuda.Event(disable_timing=True)
                ev.record(self.streams[q])
                done.append(ev)
        for q in order:
            if q != skip_merge_rank:
                for ev in done:
                    self.streams[q].wait_event(ev)
                self.launch_rank(q, dev[q], rows_of[q], L, case.block_size, producer=False, **kw)
        if delay_rank is not None:
            time.sleep(delay_s)  # the other ranks' merges spin meanwhile
            self.launch_rank(delay_rank, dev[delay_rank], R, L, case.block_size,
                             **dict(kw, cluster=1))  # fmt: skip
        for s in self.streams:
            s.synchronize()
        return self._outputs(dev)

    def _outputs(self, dev):
        out = []
        for q in range(self.world):
            d = dev[q]
            out.append(dict(kv_rows=d["kv"].get(), counts=d["counts"].get(), ids=d["ids"].get(),
                            saturated=d["sat"].get(), status=self.status(q), host_status=self.host_status(q)))  # fmt: skip
        return out
