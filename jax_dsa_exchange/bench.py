"""Benchmark report: the op inside a jitted decode step, against the baselines.

``python -m jax_dsa_exchange.bench`` (W processes through the launcher, one rank each):
for every configuration (K, N, R, L), every rank runs a jitted decode step that calls
``topk_exchange_merge`` once per layer inside ``lax.scan`` (rotating through several input
sets, so the L2 does not hold the logits between calls), and times whole steps after a
warm-up; per-layer time = step time / layers, median and spread over the repetitions.
In the same run, rank 0 times the baselines:

* ``jax.lax.top_k`` over the whole row on one device: bf16 [R, W*L], k = K (what a single
  GPU holding the whole context would do);
* the XLA path (``all_gather`` + exact top-K) where the W ranks have W distinct GPUs
  (it needs NCCL, which refuses several ranks on one GPU).

The producer and merge kernels alone (CUDA events, W ranks simulated in one process)
are measured by ``benchmarks/bench_kernels.py``.

On a machine with fewer GPUs than W, the W processes share one GPU: their kernels
compete for its SMs and every "peer" store is a local store, so the numbers do NOT
measure NVLink, and they overstate the per-rank cost of the compute; the report says so.

Output: progress lines, ``bench.csv`` and ``bench.png`` (time per layer vs R, one line
per method and (N, L)) in ``--out``, and a short table last.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import os
import sys
import time

import numpy as np

METHODS = ("op (ffi)", "lax.top_k whole row", "xla path")


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--local-topk", type=int, nargs="+", default=[256, 512, 1024])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--cols", type=int, nargs="+", default=[8192, 32768, 131072])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--sets", type=int, default=4, help="input sets rotated through")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default="bench_out")
    p.add_argument("--timeout", type=float, default=1800.0)
    return p.parse_args(argv)


def _time_steps(fn, inputs, reps, warmup, layers):
    """Median and (p10, p90) of the per-layer time in us, over ``reps`` timed steps."""
    import jax

    for i in range(warmup):
        jax.block_until_ready(fn(*inputs[i % len(inputs)]))
    ts = []
    for i in range(reps):
        x = inputs[i % len(inputs)]
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*x))
        ts.append((time.perf_counter() - t0) / layers * 1e6)
    ts = np.array(ts)
    return float(np.median(ts)), float(np.percentile(ts, 10)), float(np.percentile(ts, 90))


def _barrier(client, key, nproc):
    """All ranks meet (key-value store: no XLA collective, works on a shared GPU)."""
    if nproc > 1:
        client.wait_at_barrier(key, 600_000)


def run(a) -> int:
    from . import distributed

    rank, nproc = distributed.initialize()
    from . import op  # noqa: F401  (before any JAX backend starts: it sets XLA flags)
    import jax
    import jax.numpy as jnp

    from .exchange import Exchange
    from .op import topk_exchange_merge
    from .rendezvous import distributed_client

    world = nproc
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        print("bench: no GPU: nothing to measure (the XLA path on CPU is not a baseline "
              "worth timing)", flush=True)
        return 2
    distinct_gpus = _gpus_on_this_node()
    client = distributed_client()
    lead = rank == 0
    K, B = a.topk, 64
    configs = list(itertools.product(a.local_topk, a.cols, a.rows))
    rows_out = []
    os.makedirs(a.out, exist_ok=True)
    if lead:
        print(f"bench: W={world} processes, {jax.devices()[0].device_kind}, jax {jax.__version__}; "
              f"{len(configs)} configurations", flush=True)
        if distinct_gpus < world:
            print(f"bench: NOTE: the {world} ranks share {distinct_gpus} GPU(s): the NVLink part is "
                  "NOT measured (peer stores are local stores), and without MPS the GPU "
                  "time-slices between the ranks' processes, so a merge waits for peers whose "
                  "process is not scheduled: the op's numbers then measure context switching, "
                  "not the op (benchmarks/bench_kernels.py times the kernels of W ranks in one "
                  "process instead).", flush=True)
    rng = np.random.default_rng(rank)
    top_k_cache = {}
    for ci, (N, L, R) in enumerate(configs):
        ex = Exchange.create(topk=K, local_topk=N, max_rows=R)
        pages = -(-L // B)
        bt = jnp.asarray(np.arange(R * pages, dtype=np.int32).reshape(R, pages))
        req = jnp.arange(R, dtype=jnp.int32)
        ends = jnp.full((R,), L, jnp.int32)

        @jax.jit
        def step(logits):
            def layer(c, lg):
                o = topk_exchange_merge(ex, lg, ends, req, bt, block_size=B)
                return c + o.counts.sum(), None
            return jax.lax.scan(layer, jnp.int32(0), logits)[0]

        sets = [(jnp.asarray(rng.standard_normal((a.layers, R, L), np.float32), jnp.bfloat16),)
                for _ in range(a.sets)]
        _barrier(client, f"bench/{ci}/start", nproc)
        med, p10, p90 = _time_steps(step, sets, a.reps, a.warmup, a.layers)
        ex.check()
        _barrier(client, f"bench/{ci}/done", nproc)
        del sets
        ex.close()
        if lead:
            rows_out.append(dict(method=METHODS[0], W=world, K=K, N=N, R=R, L=L,
                                 us_per_layer=med, p10=p10, p90=p90))
            key = (R, L)
            if key not in top_k_cache:  # the baseline does not depend on N
                @jax.jit
                def base(x):
                    def layer(c, lg):
                        v, i = jax.lax.top_k(lg, K)
                        return c + i[:, 0].sum(), None
                    return jax.lax.scan(layer, jnp.int32(0), x)[0]

                bsets = [(jnp.asarray(rng.standard_normal((a.layers, R, world * L), np.float32),
                                      jnp.bfloat16),) for _ in range(2)]
                top_k_cache[key] = _time_steps(base, bsets, a.reps, a.warmup, a.layers)
                del bsets
            bm, b10, b90 = top_k_cache[key]
            rows_out.append(dict(method=METHODS[1], W=world, K=K, N=N, R=R, L=L,
                                 us_per_layer=bm, p10=b10, p90=b90))
            print(f"[{ci + 1}/{len(configs)}] N={N} L={L} R={R}: op {med:.1f} us/layer "
                  f"(p10 {p10:.1f}, p90 {p90:.1f}); lax.top_k [R, W*L] {bm:.1f} us", flush=True)
        if distinct_gpus >= world:  # all ranks take part: it is a collective
            xm, x10, x90 = _time_xla_path(a, world, K, N, R, L, B, rng)
            if lead:
                rows_out.append(dict(method=METHODS[2], W=world, K=K, N=N, R=R, L=L,
                                     us_per_layer=xm, p10=x10, p90=x90))
                print(f"    xla path (all_gather + exact top-K): {xm:.1f} us/layer", flush=True)
        _barrier(client, f"bench/{ci}/next", nproc)
    if lead:
        if distinct_gpus < world:
            print(f"bench: xla path (all_gather): not measured: it needs W={world} distinct GPUs "
                  f"(this machine: {distinct_gpus}; NCCL refuses several ranks on one GPU)", flush=True)
        _write(a.out, rows_out)
    return 0


def _gpus_on_this_node() -> int:
    """GPUs of this host (CUDA's count: the launcher binds ranks through JAX, not CUDA)."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        import jax

        return len(jax.local_devices(backend="gpu"))


def _time_xla_path(a, world, K, N, R, L, B, rng):
    """The XLA path over the W distinct GPUs (global arrays, shard_map, NCCL all_gather)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from . import distributed
    from .xla_path import xla_topk_merge_sharded

    mesh = distributed.dcp_mesh("dcp", world, backend="gpu")
    pages = -(-L // B)
    rank_spec = NamedSharding(mesh, P("dcp"))
    put = lambda x: jax.make_array_from_callback(x.shape, rank_spec, lambda i: x[i])  # noqa: E731
    ends = put(np.full((world, R), L, np.int32))
    req = put(np.tile(np.arange(R, dtype=np.int32), (world, 1)))
    bt = put(np.tile(np.arange(R * pages, dtype=np.int32).reshape(1, R, pages), (world, 1, 1)))

    @jax.jit
    def step(logits):  # [layers, W, R, L]
        def layer(c, lg):
            o = xla_topk_merge_sharded(mesh, "dcp", lg, ends, req, bt, topk=K, block_size=B)
            return c + o.counts.sum(), None
        return jax.lax.scan(layer, jnp.int32(0), logits)[0]

    shape = (a.layers, world, R, L)
    lsharding = NamedSharding(mesh, P(None, "dcp"))

    def make():
        x = rng.standard_normal((a.layers, 1, R, L), np.float32).astype(jnp.bfloat16)
        return jax.make_array_from_callback(shape, lsharding, lambda i: x)

    return _time_steps(step, [(make(),) for _ in range(2)], a.reps, a.warmup, a.layers)


def _write(out, rows):
    path = os.path.join(out, "bench.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 5))
        groups = sorted({(r["method"], r["N"], r["L"]) for r in rows})
        for m, n, l in groups:
            if m != METHODS[0] and n != min(r["N"] for r in rows):
                continue  # the baseline does not depend on N: one line per L
            pts = sorted((r["R"], r["us_per_layer"]) for r in rows
                         if (r["method"], r["N"], r["L"]) == (m, n, l))
            label = f"{m} L={l // 1024}K" + (f" N={n}" if m == METHODS[0] else "")
            ax.plot(*zip(*pts), marker="o", label=label, linestyle="-" if m == METHODS[0] else "--")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("rows R")
        ax.set_ylabel("time per layer (us)")
        ax.set_title(f"top-K merge per layer, W={rows[0]['W']}, K={rows[0]['K']}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out, "bench.png"), dpi=110)
    except ImportError:
        print("bench: matplotlib missing: no plot (pip install '.[bench]')", flush=True)
    print(f"\n{'N':>5} {'L':>7} {'R':>4} {'op us':>9} {'top_k us':>9} {'speedup':>8}")
    for r in rows:
        if r["method"] != METHODS[0]:
            continue
        b = next(x for x in rows if x["method"] == METHODS[1] and (x["R"], x["L"]) == (r["R"], r["L"]))
        print(f"{r['N']:>5} {r['L']:>7} {r['R']:>4} {r['us_per_layer']:>9.1f} "
              f"{b['us_per_layer']:>9.1f} {b['us_per_layer'] / r['us_per_layer']:>7.1f}x")
    print(f"wrote {path}", flush=True)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = _args(argv)
    from . import distributed

    if not distributed.launched() and a.world > 1:
        from .launch import launch

        return launch([sys.executable, "-m", "jax_dsa_exchange.bench", *argv], a.world,
                      timeout=a.timeout)
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
