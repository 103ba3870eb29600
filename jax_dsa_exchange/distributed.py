"""Multi-process helpers: join the job started by ``jax_dsa_exchange.launch``.

The launcher gives every process these environment variables:

* ``JAX_DSA_EXCHANGE_COORDINATOR``: ``host:port`` of the jax.distributed coordinator
* ``JAX_DSA_EXCHANGE_WORLD``: number of processes (= DCP ranks)
* ``JAX_DSA_EXCHANGE_RANK``: this process's id / rank
* ``JAX_LOCAL_DEVICE_IDS`` (only with GPU binding): the GPU of this rank

:func:`initialize` turns them into ``jax.distributed.initialize``; without them, in a
job that JAX itself detects (SLURM ``srun``, Open MPI ``mpirun``), it calls
``jax.distributed.initialize()`` with no arguments, as JAX users launch; and it selects
gloo for CPU collectives (the default CPU client has no cross-process
collectives, so a multi-process CPU all_gather would fail).  It must run before
anything touches a JAX backend: the CPU client reads the collectives option when
it is created.

One rank per process: :func:`dcp_mesh` builds a 1-D mesh with one device per
process (or, in a single process, one device per local device), and
:func:`shard_ranks` / :func:`rank_shards` move per-rank NumPy data in and out of
global arrays with a leading rank axis [W, ...] (xla_path's layout).
"""

from __future__ import annotations

import atexit
import ctypes
import inspect
import os
import socket
import sys
import time

import numpy as np

ENV_COORDINATOR = "JAX_DSA_EXCHANGE_COORDINATOR"
ENV_WORLD = "JAX_DSA_EXCHANGE_WORLD"
ENV_RANK = "JAX_DSA_EXCHANGE_RANK"


def launched() -> bool:
    """True when this process was started by ``jax_dsa_exchange.launch``."""
    return ENV_COORDINATOR in os.environ


def rank() -> int:
    """This process's rank from the launcher's environment (0 when not launched)."""
    return int(os.environ.get(ENV_RANK, "0"))


def world() -> int:
    """Process count from the launcher's environment (1 when not launched)."""
    return int(os.environ.get(ENV_WORLD, "1"))


def detected_cluster() -> str | None:
    """The name of the job environment JAX's own ``jax.distributed.initialize()`` would
    detect among SLURM and Open MPI ("slurm", "ompi"), or None.

    Asks JAX's cluster classes (_jax_private.cluster_classes: the same tests JAX runs);
    falls back to their environment variables if that module moved.  Only these two:
    the other detectors (Cloud TPU, Kubernetes) query metadata servers or warn."""
    from ._jax_private import cluster_classes

    classes = cluster_classes()
    if classes is not None:
        for cls in classes:
            if cls.is_env_present():
                return cls.name
        return None
    # pragma: no cover - another jax layout
    if all(v in os.environ for v in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS",
                                     "SLURM_PROCID", "SLURM_LOCALID")):
        return "slurm"
    if "OMPI_MCA_orte_hnp_uri" in os.environ:
        return "ompi"
    return None


def initialize(*, cpu_collectives: str = "gloo", timeout_s: int = 120) -> tuple[int, int]:
    """Join the job; returns ``(rank, world)``.

    * started by ``jax_dsa_exchange.launch``: ``jax.distributed.initialize`` with the
      launcher's coordinator, world and rank (and GPU binding);
    * else, in a SLURM or Open MPI job that JAX detects (:func:`detected_cluster`):
      ``jax.distributed.initialize()`` with no arguments (JAX reads the job's variables);
    * else nothing: a script runs unchanged as one process, (0, 1).
    * already initialized (e.g. the caller ran ``jax.distributed.initialize`` itself):
      returns that job's (process index, process count).

    ``cpu_collectives`` (gloo) is set in every case; it only affects the CPU client, so it
    is harmless on GPU.  When this call initialized jax.distributed, the ranks also shut
    it down at exit in an order that leaves no gRPC errors (:func:`shutdown`).
    """
    import jax

    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    from .rendezvous import distributed_client

    if distributed_client() is not None:
        return jax.process_index(), jax.process_count()
    if launched():
        coord = os.environ[ENV_COORDINATOR]
        r, w = rank(), world()
        kwargs = dict(coordinator_address=coord, num_processes=w, process_id=r,
                      initialization_timeout=timeout_s)
        # The launcher's GPU binding; newer jax reads this variable itself, older
        # releases only take the argument.
        if os.environ.get("JAX_LOCAL_DEVICE_IDS"):
            kwargs["local_device_ids"] = [int(x) for x in os.environ["JAX_LOCAL_DEVICE_IDS"].split(",")]
        # Bind the coordinator to the address we advertise (the default binds
        # [::], which fails where IPv6 is off); older jax lacks the argument.
        if "coordinator_bind_address" in inspect.signature(jax.distributed.initialize).parameters:
            kwargs["coordinator_bind_address"] = coord
        jax.distributed.initialize(**kwargs)
    elif detected_cluster() is not None:
        jax.distributed.initialize(initialization_timeout=timeout_s)
        r, w = jax.process_index(), jax.process_count()
    else:
        return 0, 1
    _register_shutdown()
    return r, w


_shutdown_registered = False
EXIT_BARRIER_S = 60.0
PEER_EXIT_WAIT_S = 10.0


def _register_shutdown() -> None:
    global _shutdown_registered
    if not _shutdown_registered:
        _shutdown_registered = True
        atexit.register(shutdown)


_KEEP_ALIVE: list = []  # process 0's coordination service after shutdown() (see there)


def shutdown(barrier_timeout_s: float = EXIT_BARRIER_S) -> None:
    """Leave the job cleanly (registered at exit by :func:`initialize`; idempotent).

    Without this, each process's jax.distributed client and process 0's coordinator
    service are torn down whenever the interpreter gets to them: when process 0 went
    first, every other rank's client printed ``WatchTasksAsync failed ... UNAVAILABLE ...
    Connection refused`` and ``Additional GRPC error information`` (seen on the H200 with
    jax 0.11.2 after every multi-process run).  Order here:

    1. the exchanges still open are closed (their own barrier; they use the key-value store);
    2. all ranks meet at an exit barrier (``barrier_timeout_s``; a rank that died or left
       without us: skip to 4);
    3. every client shuts down (its shutdown barrier: all clients together), and process 0,
       which hosts the coordinator, waits until the other processes of its host have
       exited (their PIDs, published before the barrier; at most ``PEER_EXIT_WAIT_S``),
       and 0.5 s for other hosts, then leaves the service running until the process
       ends (its own GPU runtime still watches it: stopping it logs an error);
    4. without the barrier (a peer is gone) the clients are left to the interpreter, as before.
    """
    from ._jax_private import distributed_state

    state = distributed_state()
    if state.client is None:
        return
    ex = sys.modules.get(__package__ + ".exchange")
    if ex is not None:
        ex._close_all()
    import jax

    me, n = jax.process_index(), jax.process_count()
    host = socket.gethostname()
    try:
        state.client.key_value_set(f"jax_dsa_exchange/exit/{me}", f"{host} {os.getpid()}")
        state.client.wait_at_barrier("jax_dsa_exchange/exit", int(barrier_timeout_s * 1000))
        peers = [state.client.blocking_key_value_get(f"jax_dsa_exchange/exit/{q}", 10_000).split()
                 for q in range(n) if q != me] if state.service is not None else []
    except Exception:  # noqa: BLE001 - a peer is missing: no clean shutdown possible
        return
    service = state.service
    state.service = None  # stopped below, after the clients
    try:
        state.shutdown()  # preemption manager, then this process's client
    except Exception:  # noqa: BLE001
        pass
    if service is not None:
        local = [int(pid) for h, pid in peers if h == host]
        deadline = time.monotonic() + PEER_EXIT_WAIT_S
        while local and time.monotonic() < deadline:
            local = [pid for pid in local if _alive(pid)]
            time.sleep(0.02)
        if len(local) < len(peers):
            time.sleep(0.5)
        # The service is NOT shut down: this process's own PJRT client still watches it
        # (pjrt_client.cc WatchTasksAsync) until the interpreter tears the backend down,
        # and a shutdown cancels that call: "WatchTasksAsync failed for task 0:
        # UNAVAILABLE: Cancelling all calls" (jax 0.11.2, H200, even after every other
        # rank had exited).  One reference is kept for the life of the process, so its
        # destructor never runs; exit() ends its threads with nothing in flight.
        _KEEP_ALIVE.append(service)
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(service))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped by the launcher) is gone for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def dcp_mesh(axis_name: str = "dcp", world: int | None = None, backend: str | None = None):
    """1-D mesh of the DCP ranks.

    Multi-process: the first device of every process, ordered by process index
    (one rank per process).  Single process: the first ``world`` local devices
    (default: all).  ``backend`` (e.g. "cpu") picks a non-default platform.
    Axis type Auto (``jax.sharding.Mesh``'s default), so shard_map accepts
    unsharded inputs.
    """
    import jax

    if jax.process_count() > 1:
        first = {}
        for d in jax.devices(backend):
            first.setdefault(d.process_index, d)
        devices = [first[p] for p in sorted(first)]
        if world is not None and world != len(devices):
            raise ValueError(f"world={world} but the job has {len(devices)} processes")
    else:
        devices = jax.local_devices(backend=backend)
        world = len(devices) if world is None else world
        if world > len(devices):
            raise ValueError(
                f"need {world} devices, this process has {len(devices)} "
                f"({devices[0].platform}); on CPU set "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={world} before importing jax")
        devices = devices[:world]
    return jax.sharding.Mesh(np.array(devices), (axis_name,))


def shard_ranks(mesh, axis_name: str, per_rank):
    """Global array [W, ...] sharded over ``axis_name`` from a list of W per-rank arrays.

    Every process passes the full list (only the rows of its own devices are
    read), which suits tests and demos whose data is generated from a seed.
    """
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    stacked = np.stack([np.asarray(x) for x in per_rank])
    sharding = NamedSharding(mesh, P(axis_name))
    return jax.make_array_from_callback(stacked.shape, sharding, lambda idx: stacked[idx])


def rank_shards(x, axis: int = 0) -> dict[int, np.ndarray]:
    """``{rank: numpy data}`` of the ranks this process holds of a global array
    whose dimension ``axis`` is the rank axis (size W); the rank axis is dropped."""
    out = {}
    for s in x.addressable_shards:
        start = s.index[axis].start or 0
        data = np.asarray(s.data)
        for j in range(data.shape[axis]):
            out[start + j] = np.take(data, j, axis=axis)
    return out
