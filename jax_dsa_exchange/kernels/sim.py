"""W ranks of the exchange in ONE process on ONE GPU, through CuPy (tests and
benchmarks of the raw kernels; no JAX, no FFI).

Every rank gets its own zeroed symmetric buffer (layout.BufferLayout) and
local state (layout.StateLayout); one device int64[W] peers table holds all
ranks' buffer addresses (same-device pointers play the NVLink peers).  A call
launches, per rank on its own stream, select_push then merge; the W merges
run concurrently, so a rescue can complete.  The merge grid is sized so the
W grids are co-resident (SPEC §6.7).
"""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np

from .. import layout
from .cache import load_kernels

POISON = -123456789  # outputs are filled with this before every call


def _load_function(img, tmpdir):
    """cubin first; if the driver refuses it (newer toolkit), the PTX (JIT)."""
    import cupy as cp

    errors = []
    for ext, data in (("cubin", img.cubin), ("ptx", img.ptx.encode())):
        path = os.path.join(tmpdir, f"{img.kernel}.{ext}")
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
    def __init__(self, world, topk, local_topk, max_rows, *, arch="sm_90a", cta_budget=96):
        import cupy as cp

        self.cp = cp
        self.world, self.topk, self.n, self.max_rows = world, topk, local_topk, max_rows
        self.lay = layout.BufferLayout(world, topk, local_topk, max_rows)
        self.st = layout.StateLayout(max_rows)
        self.images = load_kernels(arch, world, topk, local_topk)
        self._tmp = tempfile.TemporaryDirectory()
        self.fns, self.loaded_from = {}, {}
        self._mods = []
        for name, img in self.images.items():
            mod, fn, ext = _load_function(img, self._tmp.name)
            self._mods.append(mod)
            self.fns[name], self.loaded_from[name] = fn, ext
        self.bufs = [cp.zeros(self.lay.nbytes, cp.uint8) for _ in range(world)]
        self.states = [cp.zeros(self.st.words, cp.int32) for _ in range(world)]
        self.peers = cp.asarray(np.array([b.data.ptr for b in self.bufs], np.int64))
        self.streams = [cp.cuda.Stream(non_blocking=True) for _ in range(world)]
        self.cta_budget = cta_budget
        cp.cuda.Device().synchronize()

    def merge_grid(self, rows):
        return max(1, min(rows, self.cta_budget // self.world))

    def status(self, q):
        s = self.states[q].get()
        return s[self.st.status_off:self.st.status_off + layout.STATUS_WORDS].copy()

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
                    timeout_us=2_000_000, grid=None, producer=True, merge=True):  # fmt: skip
        i64, i32 = np.int64, np.int32
        sp, mg = self.images["select_push"], self.images["merge"]
        with self.streams[q]:
            if producer:
                self.fns["select_push"](
                    (rows,), (sp.block,),
                    (i64(d["logits"].data.ptr), i64(d["row_ends"].data.ptr), i32(rows), i32(cols),
                     i64(self.states[q].data.ptr), i64(self.peers.data.ptr), i32(q),
                     i32(self.max_rows)), shared_mem=sp.smem)  # fmt: skip
            if merge:
                bt = d["bt"]
                self.fns["merge"](
                    (grid or self.merge_grid(rows),), (mg.block,),
                    (i64(self.peers.data.ptr), i64(self.bufs[q].data.ptr),
                     i64(self.states[q].data.ptr), i64(d["logits"].data.ptr),
                     i64(d["row_ends"].data.ptr), i64(d["req_id"].data.ptr), i64(bt.data.ptr),
                     i64(d["kv"].data.ptr), i64(d["counts"].data.ptr),
                     i64(d["ids"].data.ptr if want_ids else 0),
                     i64(d["sat"].data.ptr if want_sat else 0),
                     i32(rows), i32(cols), i32(bt.shape[0]), i32(bt.shape[1]), i32(block_size),
                     i32(q), i32(self.max_rows), i64(self.lay.rescue_off), i64(self.lay.flags_off),
                     i32(timeout_us)), shared_mem=mg.smem)  # fmt: skip

    def call(self, case, *, want_ids=True, want_sat=True, delay_rank=None, delay_s=0.0,
             skip_rank=None, skip_merge_rank=None, short_rank=None, short_rows=0,
             timeout_us=2_000_000, grid=None):  # fmt: skip
        """One exchange call of every rank on a Case -> per-rank dict of NumPy
        outputs (kv_rows, counts, ids, saturated, status).  ``skip_rank``
        never pushes (its merge still runs); ``skip_merge_rank`` pushes but
        never merges (so never rescues); ``delay_rank`` starts late;
        ``short_rank`` calls with only ``short_rows`` rows (its outputs past
        them stay poisoned)."""
        cp = self.cp
        dev = self.upload(case)
        cp.cuda.Device().synchronize()
        R, L = case.rows, case.cols[0]
        kw = dict(want_ids=want_ids, want_sat=want_sat, timeout_us=timeout_us, grid=grid)
        order = [q for q in range(self.world) if q != delay_rank]
        for q in order:
            self.launch_rank(q, dev[q], short_rows if q == short_rank else R, L, case.block_size,
                             producer=q != skip_rank, merge=q != skip_merge_rank, **kw)  # fmt: skip
        if delay_rank is not None:
            time.sleep(delay_s)  # the other ranks' merges spin meanwhile
            self.launch_rank(delay_rank, dev[delay_rank], R, L, case.block_size, **kw)
        for s in self.streams:
            s.synchronize()
        out = []
        for q in range(self.world):
            d = dev[q]
            out.append(dict(kv_rows=d["kv"].get(), counts=d["counts"].get(), ids=d["ids"].get(),
                            saturated=d["sat"].get(), status=self.status(q)))  # fmt: skip
        return out
