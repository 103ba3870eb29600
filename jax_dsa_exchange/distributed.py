"""Multi-process helpers: join the job started by ``jax_dsa_exchange.launch``.

The launcher gives every process these environment variables:

* ``JAX_DSA_EXCHANGE_COORDINATOR``: ``host:port`` of the jax.distributed coordinator
* ``JAX_DSA_EXCHANGE_WORLD``: number of processes (= DCP ranks)
* ``JAX_DSA_EXCHANGE_RANK``: this process's id / rank
* ``JAX_LOCAL_DEVICE_IDS`` (only with GPU binding): the GPU of this rank

:func:`initialize` turns them into ``jax.distributed.initialize`` and selects
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

import inspect
import os

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


def initialize(*, cpu_collectives: str = "gloo", timeout_s: int = 120) -> tuple[int, int]:
    """Join the launcher's job; returns ``(rank, world)``.

    Without the launcher's environment this does nothing and returns (0, 1), so
    a script runs unchanged as one process.  ``cpu_collectives`` (gloo) is set
    in both cases; it only affects the CPU client, so it is harmless on GPU.
    """
    import jax

    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    if not launched():
        return 0, 1
    coord = os.environ[ENV_COORDINATOR]
    r, w = rank(), world()
    kwargs = dict(coordinator_address=coord, num_processes=w, process_id=r,
                  initialization_timeout=timeout_s)
    # Bind the coordinator to the address we advertise (the default binds
    # [::], which fails where IPv6 is off); older jax lacks the argument.
    # The launcher's GPU binding; newer jax reads this variable itself, older
    # releases only take the argument.
    if os.environ.get("JAX_LOCAL_DEVICE_IDS"):
        kwargs["local_device_ids"] = [int(x) for x in os.environ["JAX_LOCAL_DEVICE_IDS"].split(",")]
    if "coordinator_bind_address" in inspect.signature(jax.distributed.initialize).parameters:
        kwargs["coordinator_bind_address"] = coord
    jax.distributed.initialize(**kwargs)
    return r, w


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
