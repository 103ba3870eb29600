"""Symmetric memory of the exchange: one ``Exchange`` per rank (docs/DESIGN.md §6-§7).

An ``Exchange`` owns, on its GPU:

* the symmetric buffer (LL slots, rescue slots, rescue flags; ``layout.BufferLayout``),
  one plain ``cudaMalloc`` (CuPy's unpooled ``cupy.cuda.Memory``, 2 MiB rounded) that
  every peer writes into;
* the local state (per-row epochs and rescue sequence numbers, the status words the
  merge kernel writes on a timeout; ``layout.StateLayout``);
* the peers table: a device ``int64[W]`` of every rank's symmetric-buffer address as
  mapped in this process (its own rank: the local pointer; others: CUDA IPC mappings
  opened with ``cudaIpcOpenMemHandle``, or plain pointers with peer access when one
  process drives all ranks).

Nothing here changes per call: the kernels advance the epochs on the device, so a
jitted step that uses the exchange can be replayed (CUDA graphs) without host work.

Creation is collective.  ``Exchange.create`` (one rank per process) publishes each
rank's configuration and IPC handle through the jax.distributed key-value store,
checks that W, K, N, max_rows, the exchange id and the kernel build agree, opens the
peers' handles, and confirms in a second phase that every rank succeeded: any
mismatch, missing peer or IPC failure becomes a ``RendezvousError`` on every rank
within ``timeout_s``.  ``Exchange.create_local`` builds the W ranks of one process
that drives W GPUs.

One exchange serves every layer of the model; several may coexist (each has its
own id, agreed by creation order, which the ranks check).
"""

from __future__ import annotations

import atexit
import itertools
import os
import socket
import threading
import weakref
from typing import Sequence

import numpy as np

from . import layout
from .rendezvous import Rendezvous, RendezvousError, check_agreement, distributed_client

DEFAULT_TIMEOUT_US = 5_000_000  # a kernel wait gives up after 5 s (docs/DESIGN.md §6.7)
_ids = itertools.count(1)
_ids_lock = threading.Lock()
_live: "weakref.WeakSet[Exchange]" = weakref.WeakSet()
# What a CUDA-graph replay of a program that called a closed exchange still touches, kept
# for the process's life: its kernels load the peer table (select_push, before it reads
# the status) and the state words, see STATUS_CLOSED, do nothing but report it into the
# pinned status words.
_retired_states: list = []


def _next_id() -> int:
    with _ids_lock:
        return next(_ids)


def _cupy():
    try:
        import cupy
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise ImportError(
            "the GPU exchange needs CuPy (pip install 'jax-dsa-exchange[cuda13]' or "
            "'[cuda12]'); without a GPU use the XLA path (path='xla')"
        ) from e
    return cupy


def kernel_build_id() -> str:
    """The kernel version the ranks must agree on (hash of the kernel sources)."""
    from .kernels import cache

    return cache.source_hash()


class _DeviceMemory:
    """One unpooled cudaMalloc on ``ordinal``, zeroed."""

    def __init__(self, ordinal: int, nbytes: int):
        cp = _cupy()
        with cp.cuda.Device(ordinal):
            self.mem = cp.cuda.Memory(nbytes)  # direct cudaMalloc: IPC needs an allocation of its own
            cp.cuda.runtime.memset(self.mem.ptr, 0, nbytes)
        self.ptr, self.nbytes = self.mem.ptr, nbytes

    def free(self):
        self.mem = None


class Exchange:
    """One rank's symmetric memory and its registration with the FFI launcher."""

    def __init__(self, *, exchange_id, world, rank, topk, local_topk, max_rows, ordinal,
                 timeout_us, arch, rescue_list=False, interleave=1):
        self.id, self.world, self.rank = exchange_id, world, rank
        self.rescue_list = rescue_list
        self.interleave = interleave  # the KV cache's interleave size (docs/DESIGN.md §4)
        self.score_dtype = layout.KERNEL_SCORE_DTYPE  # what the kernels take (op.py checks every call's logits)
        self.topk, self.local_topk, self.max_rows = topk, local_topk, max_rows
        self.ordinal, self.timeout_us, self.arch = ordinal, timeout_us, arch
        self.layout = layout.BufferLayout(world, topk, local_topk, max_rows)
        self.state_layout = layout.StateLayout(max_rows, topk if rescue_list else 0)
        self.closed = False
        self._buffer = _DeviceMemory(ordinal, self.layout.nbytes)
        self._state = _DeviceMemory(ordinal, self.state_layout.alloc_words * 4)
        self._peers_table = _DeviceMemory(ordinal, 8 * world)
        # Pinned host copy of the reported status words (layout.STATUS_REPORT_WORDS), written
        # by the merge kernel when the status is set (also from CUDA-graph replays) and read
        # without a sync by poll() (op.jit, before each dispatch) and the launcher's handlers.
        self._host_status = _cupy().cuda.alloc_pinned_memory(4 * layout.STATUS_REPORT_WORDS)
        self._host_view = np.frombuffer(self._host_status, np.int32, layout.STATUS_REPORT_WORDS)
        self._host_view[:] = 0
        self._ipc_opened: list[int] = []  # peer pointers this process must close
        self._rdv: Rendezvous | None = None
        self._registered = False
        self._ranks_on_gpu = 1  # ranks whose merge grids share this GPU (merge_grid)
        # a clustered merge (its metadata's cluster C > 1): C CTAs per row, and the clusters of
        # C the device runs at once (set when the kernels are loaded; -1 unknown)
        self._merge_cluster, self._merge_fit = 1, -1
        # the configuration's merge_wide image (kernels/cache.py OPTIONAL): its cluster size
        # and fit alike (cluster 0: none)
        self._wide_cluster, self._wide_fit = 0, -1

    # -- creation ---------------------------------------------------------------------

    @classmethod
    def create(cls, *, topk: int, local_topk: int, max_rows: int, world: int | None = None,
               rank: int | None = None, device=None, timeout_s: float = 60.0,
               timeout_us: int = DEFAULT_TIMEOUT_US, arch: str | None = None,
               rescue_list: bool = False, interleave: int = 1, score_dtype="bfloat16") -> "Exchange":
        """This process's rank of a W-process exchange (collective over jax.distributed).

        ``world``/``rank`` default to ``jax.process_count()``/``jax.process_index()`` and
        ``device`` to this process's first local GPU; ``arch`` (None: the device's) the kernels'
        target (layout.ARCHS; the device's own: another one is a ValueError naming both).
        ``interleave`` (the same on every rank): the KV cache is spread over the ranks in chunks
        of that many consecutive tokens (docs/DESIGN.md §4; 1: token by token).
        ``score_dtype``: the logits' dtype; the GPU kernels take bfloat16 (float32 scores run on
        the XLA path).  ``rescue_list`` (the same on every
        rank): the producer also makes each row's local top-K, so that a rescue (a rank with
        all N of its candidates selected) pushes it instead of selecting the row again on one
        CTA: a rescue costs ~24 us at any row length instead of 34 us at L = 8K and 200 us at
        L = 128K, and every producer call 2.4-5.8 us more at R <= 64 (23 us at R = 256,
        L = 128K; W = 8, K = 2048, N = 512 on one H200, README).  Outputs are the same either
        way.
        """
        import jax

        world = jax.process_count() if world is None else world
        rank = jax.process_index() if rank is None else rank
        _check_create_args(topk, local_topk, max_rows, world, rank, timeout_us, rescue_list, interleave, score_dtype)
        ordinal = _device_ordinal(device)
        exchange_id = _next_id()
        rdv = Rendezvous(distributed_client(), world=world, rank=rank,
                         prefix=f"jax_dsa_exchange/{exchange_id}", timeout_s=timeout_s)
        cp = _cupy()
        build = kernel_build_id()
        ex = None
        error = None
        try:
            # (inside the try: a rank whose GPU the kernels do not build for tells its peers)
            arch = _device_arch(ordinal, arch)
            ex = cls(exchange_id=exchange_id, world=world, rank=rank, topk=topk,
                     local_topk=local_topk, max_rows=max_rows, ordinal=ordinal,
                     timeout_us=timeout_us, arch=arch, rescue_list=rescue_list, interleave=interleave)
            handle = bytes(cp.cuda.runtime.ipcGetMemHandle(ex._buffer.ptr)).hex()
        except Exception as e:  # tell the peers instead of leaving them waiting
            error, handle = f"{type(e).__name__}: {e}", ""
        record = dict(world=world, rank=rank, topk=topk, local_topk=local_topk,
                      max_rows=max_rows, exchange_id=exchange_id, kernels=build, arch=arch,
                      rescue_list=rescue_list, interleave=interleave,
                      host=socket.gethostname(), pid=os.getpid(), bus=_bus_id(ordinal),
                      handle=handle, error=error)
        records = rdv.allgather("config", record)
        try:
            failed = [(q, r["error"]) for q, r in enumerate(records) if r["error"]]
            if failed:
                raise RendezvousError("exchange creation failed: " + "; ".join(
                    f"rank {q}: {m}" for q, m in failed))
            check_agreement(records, ("world", "topk", "local_topk", "max_rows", "exchange_id",
                                      "kernels", "arch", "rescue_list", "interleave"), f"exchange {exchange_id}")
            bad_rank = [q for q, r in enumerate(records) if r["rank"] != q]
            if bad_rank:
                raise RendezvousError(f"exchange {exchange_id}: ranks {bad_rank} published under "
                                      "another rank's number (two processes with the same rank?)")
        except RendezvousError:
            if ex is not None:
                ex._free()
            raise
        ex._rdv = rdv
        error = None
        try:
            peers = []
            for q, r in enumerate(records):
                if q == rank:
                    peers.append(ex._buffer.ptr)
                elif r["pid"] == os.getpid() and r["host"] == record["host"]:
                    raise RendezvousError(f"rank {q} lives in this process: use Exchange.create_local")
                else:
                    with cp.cuda.Device(ordinal):
                        ptr = cp.cuda.runtime.ipcOpenMemHandle(
                            bytes.fromhex(r["handle"]), cp.cuda.runtime.cudaIpcMemLazyEnablePeerAccess)
                    ex._ipc_opened.append(ptr)
                    peers.append(ptr)
            ex._write_peers(peers)
            ex._ranks_on_gpu = sum(1 for r in records if (r["host"], r["bus"]) == (record["host"], record["bus"]))
            ex._register()
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        try:
            # Every rank opened its peers and zeroed its buffer before anyone may push.
            rdv.check_all_ok("opened", error)
        except RendezvousError:
            ex._free()
            raise
        _live.add(ex)
        return ex

    @classmethod
    def create_local(cls, devices: Sequence, *, topk: int, local_topk: int, max_rows: int,
                     timeout_us: int = DEFAULT_TIMEOUT_US, arch: str | None = None,
                     rescue_list: bool = False, interleave: int = 1, score_dtype="bfloat16") -> list["Exchange"]:
        """The W ranks of one process driving W GPUs (``devices``: jax devices or CUDA
        ordinals, rank q on ``devices[q]``).  Peers use direct peer access, no IPC.  All
        ranks share one exchange id, so the same jitted code (e.g. inside shard_map)
        finds each rank's state by the device it runs on."""
        world = len(devices)
        _check_create_args(topk, local_topk, max_rows, world, 0, timeout_us, rescue_list, interleave, score_dtype)
        ordinals = [_device_ordinal(d) for d in devices]
        if len(set(ordinals)) != world:
            raise ValueError(f"create_local needs {world} distinct GPUs, got ordinals {ordinals}")
        archs = {_device_arch(o, arch) for o in ordinals}
        if len(archs) != 1:
            raise ValueError(f"create_local needs GPUs of one target, got {sorted(archs)}")
        arch = archs.pop()
        cp = _cupy()
        for a in ordinals:
            with cp.cuda.Device(a):
                for b in ordinals:
                    if a != b:
                        if not cp.cuda.runtime.deviceCanAccessPeer(a, b):
                            raise RuntimeError(f"GPU {a} cannot access GPU {b} (no peer access)")
                        try:
                            cp.cuda.runtime.deviceEnablePeerAccess(b)
                        except cp.cuda.runtime.CUDARuntimeError as e:
                            if "AlreadyEnabled" not in str(e):
                                raise
        exchange_id = _next_id()
        exs = [cls(exchange_id=exchange_id, world=world, rank=q, topk=topk, local_topk=local_topk,
                   max_rows=max_rows, ordinal=o, timeout_us=timeout_us, arch=arch, rescue_list=rescue_list,
                   interleave=interleave)
               for q, o in enumerate(ordinals)]
        peers = [ex._buffer.ptr for ex in exs]
        for ex in exs:
            ex._write_peers(peers)
            ex._register()
            _live.add(ex)
        return exs

    # -- device state -----------------------------------------------------------------

    def _write_peers(self, peers: Sequence[int]) -> None:
        cp = _cupy()
        table = np.asarray(peers, dtype=np.int64)
        with cp.cuda.Device(self.ordinal):
            cp.cuda.runtime.memcpy(self._peers_table.ptr, table.ctypes.data, table.nbytes,
                                   cp.cuda.runtime.memcpyHostToDevice)
            cp.cuda.runtime.deviceSynchronize()
        self.peers = list(peers)

    @property
    def merge_grid(self) -> int:
        """Rows the merge takes at once: one CTA per SM (a clustered merge: the device's
        co-resident clusters), shared among the ranks on this GPU, so every waiting CTA is
        resident at once (docs/DESIGN.md §6.7)."""
        return self._grid(self._merge_cluster, self._merge_fit)

    @property
    def merge_wide_grid(self) -> int:
        """The same for the configuration's merge_wide image (0: it has none); a merge over at
        most this many rows runs that image (layout.merge_uses_wide)."""
        return self._grid(self._wide_cluster, self._wide_fit) if self._wide_cluster > 1 else 0

    def _grid(self, c: int, fit: int) -> int:
        cp = _cupy()
        sms = cp.cuda.Device(self.ordinal).attributes["MultiProcessorCount"]
        ranks = max(1, self._ranks_on_gpu)
        if c > 1:
            # a cluster's CTAs share one GPC: fewer than sms / c run at once (unknown: half)
            fit = fit if fit > 0 else sms // (2 * c)
            return max(1, fit // ranks)
        return max(1, sms // ranks)

    def _register(self) -> None:
        from . import _ffi
        from .kernels import cache

        images = cache.load_kernels(self.arch, self.world, self.topk, self.local_topk,
                                    rescue_list=self.rescue_list, interleave=self.interleave)
        sms = _cupy().cuda.Device(self.ordinal).attributes["MultiProcessorCount"]
        keys = {}
        for name, img in images.items():
            keys[name] = (f"{name}/{self.arch}/w{self.world}k{self.topk}n{self.local_topk}"
                          f"{'rl' if self.rescue_list else ''}i{self.interleave}/{img.source_hash}")
            _ffi.load_kernel(keys[name], img.kernel, img.params, img.cubin, img.ptx, img.entry, self.ordinal,
                             img.block, img.smem, arch=img.arch)
            if name == "merge" and img.cluster > 1:
                self._merge_fit = _ffi.set_kernel_cluster(keys[name], self.ordinal, img.cluster)
                self._merge_cluster = img.cluster
            if name == "merge_wide":
                self._wide_fit = _ffi.set_kernel_cluster(keys[name], self.ordinal, img.cluster)
                self._wide_cluster = img.cluster
            if img.split is not None:
                split = layout.split_for_device(img.split, sms)
                if self._ranks_on_gpu > 1:
                    # Ranks sharing a GPU (MPS): a rank's producer must find room beside
                    # the other ranks' spinning merges, and a cluster needs several free
                    # SMs of one GPC at once: one CTA per row, which any free SM takes;
                    # and no slice cache beyond cache_wide (two producer CTAs per SM):
                    # fill_ctas 0 (cache_max stays the build's capacity, which the
                    # launcher's shared-memory size per launch is computed from).
                    split["cluster_max"] = 1
                    split["fill_ctas"] = 0
                # (register_exchange copies the kernel with the split set now)
                _ffi.set_kernel_split(keys[name], self.ordinal, split)
        _ffi.register_exchange(
            self.id, self.ordinal, rank=self.rank, world=self.world, topk=self.topk,
            local_topk=self.local_topk, max_rows=self.max_rows, peers=self._peers_table.ptr,
            local=self._buffer.ptr, state=self._state.ptr, rescue_off=self.layout.rescue_off,
            flags_off=self.layout.flags_off, timeout_us=self.timeout_us,
            merge_grid=self.merge_grid, select_key=keys["select_push"], merge_key=keys["merge"],
            host_status=self._host_status.ptr)
        self._registered = True
        if "merge_wide" in keys:
            _ffi.set_exchange_wide_merge(self.id, self.ordinal, keys["merge_wide"], self.merge_wide_grid)
        if "select_push_lean" in keys:
            _ffi.set_exchange_lean_producer(self.id, self.ordinal, keys["select_push_lean"])

    def read_state(self) -> dict:
        """Host copy of the local state (synchronizes the device): epochs, rescue
        sequence numbers and the status words."""
        cp = _cupy()
        host = np.empty(self.state_layout.words, dtype=np.int32)
        with cp.cuda.Device(self.ordinal):
            cp.cuda.runtime.deviceSynchronize()
            cp.cuda.runtime.memcpy(host.ctypes.data, self._state.ptr, host.nbytes,
                                   cp.cuda.runtime.memcpyDeviceToHost)
        s = self.state_layout
        return dict(epoch=host[s.epoch_off:s.epoch_off + self.max_rows],
                    seq=host[s.seq_off:s.seq_off + self.max_rows],
                    status=host[s.status_off:s.status_off + layout.STATUS_WORDS])

    def check(self) -> None:
        """Raise if a kernel of this exchange timed out waiting for a peer (synchronizes)."""
        if getattr(self, "_freed", False):
            raise RuntimeError(f"exchange {self.id} rank {self.rank} is closed")
        st = self.read_state()["status"]
        self._raise_for(*(int(st[i]) for i in (layout.STATUS_CODE, layout.STATUS_ROW,
                                               layout.STATUS_EPOCH, layout.STATUS_RANK)))

    def poll(self) -> None:
        """Raise if an earlier call of this exchange failed (every time, until it is
        closed), from the pinned host copy of the status words (no synchronization: the
        copy lags the device by the calls still in flight).  ``op.jit`` runs this before
        every dispatch of a program that calls the exchange, so a failure raises on the
        next step also when XLA replays the calls from a CUDA graph without calling the
        launcher's handlers.  After ``close()`` it says nothing: a new trace refuses the
        exchange, and a replay's kernels see it closed and do no work (empty outputs), so
        a step that also calls a recreated exchange is not blocked by the old one."""
        if getattr(self, "_freed", False):
            return
        v = self._host_view
        if v[layout.STATUS_CODE] != layout.STATUS_OK:
            self._raise_for(*(int(v[i]) for i in (layout.STATUS_CODE, layout.STATUS_ROW,
                                                  layout.STATUS_EPOCH, layout.STATUS_RANK)))

    def _raise_for(self, code: int, row: int, epoch: int, peer: int) -> None:
        if code == layout.STATUS_OK:
            return
        if code == layout.STATUS_CLOSED:
            raise RuntimeError(f"exchange {self.id} rank {self.rank} is closed; recreate it")  # (check())
        what = {layout.STATUS_TIMEOUT_ROUND1: "its candidates",
                layout.STATUS_TIMEOUT_RESCUE: "its rescue list"}.get(code, f"status {code}")
        self.closed = True  # refuse further calls: the ranks' epochs no longer agree
        raise RuntimeError(
            f"exchange {self.id} rank {self.rank}: rank {peer} did not deliver {what} for "
            f"row {row} at epoch {epoch} within {self.timeout_us} us; recreate the exchange")

    # -- teardown ---------------------------------------------------------------------

    def close(self) -> None:
        """Release the IPC mappings and the memory (idempotent).  In a multi-process
        exchange every rank first unmaps its peers, then all meet (with a timeout, so a
        dead peer cannot hang the exit) before anyone frees the memory others mapped."""
        if getattr(self, "_freed", False):
            return
        self.closed = True
        _forget_failed_jax_tokens()
        if self._registered:
            from . import _ffi

            try:
                _ffi.unregister_exchange(self.id, self.ordinal)
            except Exception:
                pass
            self._registered = False
        cp = _cupy()
        # XLA may replay CUDA graphs that recorded this exchange's addresses without calling
        # our handler: the kernels read the peer table and the status word, see it closed
        # and do nothing; so those small allocations (and the pinned status words) outlive
        # close(), kept first, whatever fails below.
        state = self._state
        _retired_states.append((state, self._peers_table, self._host_status))
        self._state = self._peers_table = None
        with cp.cuda.Device(self.ordinal):
            try:
                cp.cuda.runtime.deviceSynchronize()  # no kernel of ours still writes to a peer
                closed = np.array([layout.STATUS_CLOSED], np.int32)
                cp.cuda.runtime.memcpy(state.ptr + 4 * (self.state_layout.status_off + layout.STATUS_CODE),
                                       closed.ctypes.data, 4, cp.cuda.runtime.memcpyHostToDevice)
                cp.cuda.runtime.deviceSynchronize()
            except Exception:
                pass
            for ptr in self._ipc_opened:
                try:
                    cp.cuda.runtime.ipcCloseMemHandle(ptr)
                except Exception:
                    pass
            self._ipc_opened = []
        if self._rdv is not None:
            try:
                self._rdv.client.wait_at_barrier(f"{self._rdv.prefix}/close", 10_000)
            except Exception:
                pass  # a peer that already exited has unmapped us too
        self._free()

    def _free(self) -> None:
        for m in (getattr(self, "_buffer", None), getattr(self, "_state", None),
                  getattr(self, "_peers_table", None)):
            if m is not None:
                m.free()
        self._freed = True
        self.closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return (f"Exchange(id={self.id}, rank={self.rank}/{self.world}, K={self.topk}, "
                f"N={self.local_topk}, max_rows={self.max_rows}, gpu={self.ordinal}, "
                f"{'closed' if self.closed else 'open'})")


def _check_create_args(topk, local_topk, max_rows, world, rank, timeout_us, rescue_list=False, interleave=1,
                       score_dtype="bfloat16"):
    layout.check_config(world, topk, local_topk)
    layout.check_kernel_interleave(interleave, world)
    if layout.score_dtype_name(score_dtype) != layout.KERNEL_SCORE_DTYPE:
        raise NotImplementedError(
            f"score_dtype={layout.score_dtype_name(score_dtype)}: the GPU kernels take bfloat16 scores; float32 "
            "scores merge exactly on the XLA path (xla_path.xla_topk_merge, or topk_exchange_merge(..., "
            "path='xla', axis_name=...) with a bfloat16 exchange)")
    if not isinstance(rescue_list, bool):
        raise TypeError(f"rescue_list={rescue_list!r} must be a bool")
    if not isinstance(max_rows, int) or max_rows < 1:
        raise ValueError(f"max_rows={max_rows!r} must be a positive int")
    if not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"rank={rank!r} must be in [0, world={world})")
    if not isinstance(timeout_us, int) or not 0 < timeout_us < 2**31:
        raise ValueError(f"timeout_us={timeout_us!r} must be a positive int32")


def _device_ordinal(device) -> int:
    """CUDA ordinal of a jax device, an int, or this process's first GPU."""
    if device is None:
        import jax

        gpus = [d for d in jax.local_devices() if d.platform == "gpu"]
        if not gpus:
            raise RuntimeError("no local GPU: the exchange needs one (use the XLA path on CPU)")
        device = gpus[0]
    if isinstance(device, int):
        return device
    return int(device.local_hardware_id)


def _device_arch(ordinal: int, arch: str | None) -> str:
    """The kernels' target for CUDA device ``ordinal``: its compute capability's (layout.ARCHS);
    ``arch``, where given, must be that one.  ValueError naming the device's target, the ones the
    kernels build for and the build command."""
    cc = _cupy().cuda.Device(ordinal).compute_capability  # e.g. "90", "100", "103"
    mine = layout.arch_of((int(cc[:-1]), int(cc[-1])))
    if mine not in layout.ARCHS:
        raise ValueError(f"GPU {ordinal} is {mine} (compute capability {cc[:-1]}.{cc[-1]}); the kernels build for "
                         f"{', '.join(layout.ARCHS)} only: merge on xla_path.xla_topk_merge there")
    if arch is not None and arch != mine:
        layout.arch_limits(arch)
        raise ValueError(f"arch={arch!r} but GPU {ordinal} is {mine}: kernels of one target run on that compute "
                         f"capability only (leave arch unset, or build with python -m jax_dsa_exchange.build "
                         f"--arch {mine})")
    return mine


def _bus_id(ordinal: int) -> str:
    try:
        return _cupy().cuda.runtime.deviceGetPCIBusId(ordinal)
    except Exception:
        return f"ordinal-{ordinal}"


def _forget_failed_jax_tokens() -> None:
    """JAX keeps the effect token of the last ordered call; when that call failed (e.g. the
    launcher refused a failed or closed exchange), JAX re-raises its error at the next
    ordered dispatch and again at exit (seen with jax 0.11.2: such an exit aborted the
    jax.distributed leader).  The error has reached the caller already: wait for the calls
    in flight and drop a failed token (JAX itself makes a fresh one after such an error)."""
    import sys

    if "jax" not in sys.modules:
        return
    try:
        import jax

        from ._jax_private import clear_runtime_tokens

        try:
            jax.effects_barrier()
        except Exception:  # noqa: BLE001 - the failed call's error, reported before
            clear_runtime_tokens()
    except Exception:  # noqa: BLE001 - other JAX versions: keep their behaviour
        pass


@atexit.register
def _close_all():
    for ex in list(_live):
        try:
            ex.close()
        except Exception:
            pass
    _forget_failed_jax_tokens()
