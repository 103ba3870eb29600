"""Benchmark report: the op inside a jitted decode step, against the baselines.

``python -m jax_dsa_exchange.bench`` (W processes through the launcher, one rank each):
for every configuration (K, N, R, L), every rank runs a jitted decode step that calls
``topk_exchange_merge`` once per layer inside ``lax.scan``, rotating through several
input sets so the L2 does not hold the logits between calls.

Time per layer is the device time of the layer loop, measured by difference: each
repetition times one step of ``layers`` layers and one of ``2 * layers`` layers (wall
clock around ``block_until_ready``, after a warm-up); (long - short) / layers cancels
the per-step costs (dispatch, the ordered effect's host wait, the transfer of the
result) and leaves what one more layer costs on the device.  Median and p10/p90 over
the repetitions.  In the same run, rank 0 times, by the same method:

* ``jax.lax.top_k`` over the whole row on one device: bf16 [R, W*L], k = K (what a single
  GPU holding the whole context would do);
* the XLA path (``all_gather`` + exact top-K) where the W ranks have W distinct GPUs
  (it needs NCCL, which refuses several ranks on one GPU);

and the kernels alone (``testing.timing``: CUDA events, W ranks simulated in one
process, rank 0's select+push and merge) next to the memory floor of the producer (one
read of R x L bf16 at the copy bandwidth measured in the same run).

On a machine with fewer GPUs than W the W processes share one GPU: every "peer" store is
a local store (NVLink is NOT measured), and the W ranks' kernels share one GPU's SMs and
memory bandwidth, so the op's numbers are an upper bound of its per-GPU cost.  Without
MPS the GPU time-slices between the processes and a merge waits for peers whose process
is not scheduled: run under MPS (``nvidia-cuda-mps-control -d``); the report says which.

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

NO_GPU = ("bench: no GPU: nothing to measure (the XLA path on CPU is not a baseline worth "
          "timing)")
METHODS = ("op (ffi)", "lax.top_k whole row", "xla path", "select+push kernel", "merge kernel",
           "1 read of [R, L]", "torch.topk [R, L] k=N", "lax.top_k [R, L] k=N",
           "torch.topk int64 [R, W*N] k=K", "lax.top_k int64 [R, W*N] k=K")


def parser(serving: bool = False) -> argparse.ArgumentParser:
    """The command line (``serving``: with the serving loop's defaults)."""
    p = argparse.ArgumentParser(prog="python -m jax_dsa_exchange.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=8,
                   help="W: processes started through the launcher, one rank each (default 8)")
    p.add_argument("--topk", type=int, default=2048, help="K (default 2048)")
    p.add_argument("--local-topk", type=int, nargs="+", default=[256, 512, 1024],
                   help="N values to measure, each a configuration (default 256 512 1024)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256],
                   help="R values (query rows per call) to measure (default 1 16 64 256)")
    p.add_argument("--cols", type=int, nargs="+", default=[8192, 32768, 131072],
                   help="L values (tokens per rank and row) to measure (default 8192 32768 131072)")
    p.add_argument("--layers", type=int, default=8,
                   help="layers of the short step; the long one has twice as many (default 8)")
    p.add_argument("--sets", type=int, default=4,
                   help="input sets rotated through, so the L2 does not keep the logits (default 4)")
    p.add_argument("--reps", type=int, default=15, help="timed repetitions per configuration (default 15)")
    p.add_argument("--warmup", type=int, default=3, help="untimed repetitions first (default 3)")
    p.add_argument("--out", default="bench_out", help="folder for bench.csv and bench.png (--serving: serving.csv) (default bench_out)")
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="seconds for the whole multi-process run (default 1800)")
    p.add_argument("--no-kernels", action="store_true", help="skip the kernels-alone rows")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="the scores' dtype (default bfloat16); float32: the GPU kernels take bfloat16, so only "
                        "the XLA path and the whole-row lax.top_k are measured")
    p.add_argument("--interleave", type=int, default=1,
                   help="I: the KV cache's interleave size the exchange is created for (default 1)")
    from . import serving_bench

    serving_bench.add_args(p)
    if serving:  # the serving loop's own configuration unless given
        p.set_defaults(**serving_bench.DEFAULTS)
    return p


def _args(argv):
    return parser(serving="--serving" in argv).parse_args(argv)


def _time_layers(step, make_inputs, reps, warmup, layers):
    """Per-layer device time in us: median, p10, p90 of (t(2 layers) - t(layers)) / layers.

    ``step(x)`` runs one decode step over x's leading (layer) axis; ``make_inputs(n)``
    returns input sets of n layers (rotated through)."""
    import jax

    short, long_ = make_inputs(layers), make_inputs(2 * layers)
    for i in range(warmup):
        jax.block_until_ready(step(*short[i % len(short)]))
        jax.block_until_ready(step(*long_[i % len(long_)]))
    ts = []
    for i in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(step(*short[i % len(short)]))
        t1 = time.perf_counter()
        jax.block_until_ready(step(*long_[i % len(long_)]))
        t2 = time.perf_counter()
        ts.append(((t2 - t1) - (t1 - t0)) / layers * 1e6)
    ts = np.array(ts)
    return float(np.median(ts)), float(np.percentile(ts, 10)), float(np.percentile(ts, 90))


def _mps_active() -> bool:
    """An MPS control daemon answers on this machine (the default or the env pipe)."""
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    return os.path.exists(os.path.join(pipe, "control"))


def _barrier(client, key, nproc):
    """All ranks meet (key-value store: no XLA collective, works on a shared GPU)."""
    if nproc > 1:
        client.wait_at_barrier(key, 600_000)


def run(a) -> int:
    from . import distributed

    rank, nproc = distributed.initialize()
    import jax
    import jax.numpy as jnp

    from . import _ffi
    from .exchange import Exchange
    from .op import jit, topk_exchange_merge
    from .rendezvous import distributed_client

    world = nproc
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:  # (main() says so once before starting W processes; this is a direct run)
        if rank == 0:
            print(NO_GPU, flush=True)
        return 2
    distinct_gpus = _gpus_on_this_node()
    graph_mode, mps = _ffi.cuda_graph_mode(), _mps_active()
    client = distributed_client()
    lead = rank == 0
    K, B = a.topk, 64
    configs = list(itertools.product(a.local_topk, a.cols, a.rows))
    rows_out = []
    os.makedirs(a.out, exist_ok=True)
    if lead:
        print(f"bench: W={world} processes, {jax.devices()[0].device_kind}, jax {jax.__version__}; "
              f"{len(configs)} configurations", flush=True)
        print(f"bench: CUDA graphs {graph_mode!r} (JAX_DSA_EXCHANGE_CUDA_GRAPHS), MPS "
              f"{'on' if mps else 'off'}", flush=True)
        if distinct_gpus < world:
            print(f"bench: NOTE: the {world} ranks share {distinct_gpus} GPU(s): the NVLink part is "
                  "NOT measured (peer stores are local stores) and the ranks' kernels share one "
                  "GPU's SMs and bandwidth (an upper bound of the per-GPU cost)."
                  + ("" if mps else " MPS is off: the GPU time-slices between the processes, "
                     "so the op's numbers measure context switching, not the op."), flush=True)
    rng = np.random.default_rng(rank)
    top_k_cache = {}
    op_too = a.dtype == "bfloat16"  # (the kernels take bfloat16 scores: float32 runs on the XLA path)
    if lead and not op_too:
        print("bench: float32 scores: the op's GPU kernels take bfloat16, so the op and kernel rows are not "
              "measured; the XLA path (where the GPUs are distinct) and lax.top_k are", flush=True)
    kernel_rows = _kernel_rows(a, world, K) if lead and not a.no_kernels and op_too else {}
    dtype = jnp.bfloat16 if a.dtype == "bfloat16" else jnp.float32

    def device_normal(shape, seed):  # drawn on the device: host RNG is slow at 10^9 values
        return jax.random.normal(jax.random.PRNGKey(seed), shape, dtype)

    for ci, (N, L, R) in enumerate(configs):
        common = dict(W=world, K=K, N=N, R=R, L=L, graphs=graph_mode, mps=mps)
        med = p10 = p90 = float("nan")
        if op_too:
            med, p10, p90 = _time_op(a, Exchange, jit, topk_exchange_merge, client, nproc, rank, ci, world,
                                     N, L, R, device_normal)
        if lead:
            if op_too:
                rows_out.append(dict(method=METHODS[0], **common, us_per_layer=med, p10=p10, p90=p90))
            key = (R, L)
            if key not in top_k_cache:  # the baseline does not depend on N
                @jax.jit
                def base(x):
                    def layer(c, lg):
                        v, i = jax.lax.top_k(lg, K)
                        return c + i[:, 0].sum(), None
                    return jax.lax.scan(layer, jnp.int32(0), x)[0]

                # [R, W*L] is W times an op input: fewer layers when 3 x layers would not fit
                # in ~24 GiB (the difference method cancels the layer count anyway).
                bl = max(1, min(a.layers, (8 << 30) // (R * world * L * 2)))
                top_k_cache[key] = _time_layers(
                    base, lambda n: [(device_normal((n, R, world * L), 7 + i),) for i in range(2)],
                    a.reps, a.warmup, bl)
            bm, b10, b90 = top_k_cache[key]
            rows_out.append(dict(method=METHODS[1], **common, us_per_layer=bm, p10=b10, p90=b90))
            extra = ""
            for name, v in kernel_rows.get((N, R, L), {}).items():
                rows_out.append(dict(method=name, **common, us_per_layer=v, p10=v, p90=v))
                extra += f"; {name} {v:.1f} us"
            print(f"[{ci + 1}/{len(configs)}] N={N} L={L} R={R}: op {med:.1f} us/layer "
                  f"(p10 {p10:.1f}, p90 {p90:.1f}); lax.top_k [R, W*L] {bm:.1f} us{extra}", flush=True)
        if distinct_gpus >= world:  # all ranks take part: it is a collective
            xm, x10, x90 = _time_xla_path(a, world, K, N, R, L, B, rng)
            if lead:
                rows_out.append(dict(method=METHODS[2], **common, us_per_layer=xm, p10=x10, p90=x90))
                print(f"    xla path (all_gather + exact top-K): {xm:.1f} us/layer", flush=True)
        _barrier(client, f"bench/{ci}/next", nproc)
    if lead:
        if distinct_gpus < world:
            print(f"bench: xla path (all_gather): not measured: it needs W={world} distinct GPUs "
                  f"(this machine: {distinct_gpus}; NCCL refuses several ranks on one GPU)", flush=True)
        _write(a.out, rows_out)
    return 0


def _time_op(a, Exchange, jit, topk_exchange_merge, client, nproc, rank, ci, world, N, L, R, device_normal):
    """The op's (median, p10, p90) us per layer on every rank, in a jitted scan over layers."""
    import jax
    import jax.numpy as jnp

    K, B = a.topk, 64
    ex = Exchange.create(topk=K, local_topk=N, max_rows=R, interleave=a.interleave)
    pages = -(-L // B)
    bt = jnp.asarray(np.arange(R * pages, dtype=np.int32).reshape(R, pages))
    req = jnp.arange(R, dtype=jnp.int32)
    ends = jnp.full((R,), L, jnp.int32)

    @jit  # jax.jit with the op's compiler_options (op.py)
    def step(logits):
        def layer(c, lg):
            o = topk_exchange_merge(ex, lg, ends, req, bt, block_size=B)
            return c + o.counts.sum(), None
        return jax.lax.scan(layer, jnp.int32(0), logits)[0]

    # The W ranks' input sets share one GPU here: keep them under ~24 GiB in all.
    nsets = max(2, min(a.sets, (24 << 30) // (3 * a.layers * R * L * 2 * world)))

    def make(n):
        return [(device_normal((n, R, L), 1000 * rank + 10 * ci + i),) for i in range(nsets)]

    _barrier(client, f"bench/{ci}/start", nproc)
    med, p10, p90 = _time_layers(step, make, a.reps, a.warmup, a.layers)
    ex.check()
    _barrier(client, f"bench/{ci}/done", nproc)
    ex.close()
    return med, p10, p90


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
    def xla_step(logits, ends, req, bt):  # logits [layers, W, R, L]; global arrays are arguments
        def layer(c, lg):
            o = xla_topk_merge_sharded(mesh, "dcp", lg, ends, req, bt, topk=K, block_size=B, interleave=a.interleave)
            return c + o.counts.sum(), None
        return jax.lax.scan(layer, jnp.int32(0), logits)[0]

    step = lambda logits: xla_step(logits, ends, req, bt)  # noqa: E731

    lsharding = NamedSharding(mesh, P(None, "dcp"))

    def make(n):
        out = []
        for _ in range(2):
            x = rng.standard_normal((n, 1, R, L), np.float32).astype(jnp.bfloat16 if a.dtype == "bfloat16" else np.float32)
            out.append((jax.make_array_from_callback((n, world, R, L), lsharding, lambda i: x),))
        return out

    return _time_layers(step, make, a.reps, a.warmup, a.layers)


def _kernel_rows(a, world, K) -> dict:
    """{(N, R, L): {method: us}}: rank 0's kernels alone (W ranks simulated in this
    process, CUDA events) and the producer's memory floor, for every configuration."""
    try:
        import cupy as cp

        from .baselines import jax_topk_time, topk64_times, torch_topk_time
        from .testing.timing import KernelTimer, copy_bandwidth
    except ImportError as e:
        print(f"bench: kernels alone not measured: {e}", flush=True)
        return {}
    bw = copy_bandwidth(cp)
    print(f"bench: device copy bandwidth {bw / 1e12:.2f} TB/s (read + write)", flush=True)
    out = {}
    for N in a.local_topk:
        try:
            timer = KernelTimer(cp, world, K, N, max(a.rows))
        except Exception as e:  # noqa: BLE001 - e.g. no cubin for this configuration
            print(f"bench: kernels alone for N={N} not measured: {e}", flush=True)
            continue
        for R in a.rows:
            k64 = topk64_times(R, world * N, K)  # the merge's round-1 shape, same run
            for L in a.cols:
                tp, tm = timer.run(R, L, rescue=False, iters=a.reps, warm=min(3, a.reps))
                row = {METHODS[3]: tp, METHODS[4]: tm, METHODS[5]: R * L * 2 / bw * 1e6}
                for m, t in ((METHODS[6], torch_topk_time((R, L), N)), (METHODS[7], jax_topk_time((R, L), N)),
                             (METHODS[8], k64["torch"]), (METHODS[9], k64["jax"])):  # fmt: skip
                    if t is not None:
                        row[m] = t * 1e6 if m in (METHODS[6], METHODS[7]) else t
                out[(N, R, L)] = row
        del timer
        cp.get_default_memory_pool().free_all_blocks()
    return out


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

        Ls = sorted({r["L"] for r in rows})
        Ns = sorted({r["N"] for r in rows})
        fig, axes = plt.subplots(1, len(Ls), figsize=(5 * len(Ls), 4.5), squeeze=False)
        style = {METHODS[0]: "-", METHODS[1]: "--", METHODS[2]: "--", METHODS[3]: ":",
                 METHODS[4]: ":", METHODS[5]: "-."}
        for ax, L in zip(axes[0], Ls):
            for m in METHODS[:6]:  # the top-k baselines of the kernels: table and CSV only
                for n in (Ns if m in (METHODS[0], METHODS[3], METHODS[4]) else Ns[:1]):
                    if m in (METHODS[3], METHODS[4]) and n != Ns[len(Ns) // 2]:
                        continue  # kernels: the middle N only, to keep the plot readable
                    pts = sorted((r["R"], r["us_per_layer"]) for r in rows
                                 if (r["method"], r["N"], r["L"]) == (m, n, L))
                    if pts:
                        label = m + (f" N={n}" if m != METHODS[1] and m != METHODS[5] else "")
                        ax.plot(*zip(*pts), marker="o", ms=3, label=label, linestyle=style[m])
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("rows R")
            ax.set_ylabel("time per layer (us)")
            ax.set_title(f"L = {L // 1024}K per rank", fontsize=10)
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=7)
        fig.suptitle(f"top-K merge per layer, W={rows[0]['W']}, K={rows[0]['K']} "
                     f"(CUDA graphs {rows[0]['graphs']}, MPS {'on' if rows[0]['mps'] else 'off'})")
        fig.tight_layout()
        fig.savefig(os.path.join(out, "bench.png"), dpi=110)
    except ImportError:
        print("bench: matplotlib missing: no plot (pip install '.[bench]')", flush=True)
    def find(method, r):
        return next((x["us_per_layer"] for x in rows if x["method"] == method
                     and (x["N"], x["R"], x["L"]) == (r["N"], r["R"], r["L"])), float("nan"))

    first = rows[0]
    print(f"\nW={first['W']} K={first['K']}, CUDA graphs {first['graphs']}, MPS {'on' if first['mps'] else 'off'}; "
          "us per layer (median); kernels: rank 0 alone, CUDA events; floor: one read of [R, L]")
    print(f"{'N':>5} {'L':>7} {'R':>4} {'op':>9} {'top_k':>9} {'speedup':>8} {'sel+push':>9} {'merge':>7} "
          f"{'floor':>7} {'torch RL':>9} {'jax RL':>8} {'torch 64':>9} {'jax 64':>8}")
    lead_method = METHODS[0] if any(r["method"] == METHODS[0] for r in rows) else METHODS[1]
    for r in rows:
        if r["method"] != lead_method:
            continue
        b = find(METHODS[1], r)
        print(f"{r['N']:>5} {r['L']:>7} {r['R']:>4} {r['us_per_layer']:>9.1f} {b:>9.1f} "
              f"{b / r['us_per_layer']:>7.1f}x {find(METHODS[3], r):>9.1f} {find(METHODS[4], r):>7.1f} "
              f"{find(METHODS[5], r):>7.1f} {find(METHODS[6], r):>9.1f} {find(METHODS[7], r):>8.1f} "
              f"{find(METHODS[8], r):>9.1f} {find(METHODS[9], r):>8.1f}")
    print(f"wrote {path}", flush=True)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = _args(argv)
    from . import distributed

    if a.serving:
        if distributed.launched() and distributed.world() > 1:
            print("bench --serving runs in one process (W = 1 exchange); start it without the launcher",
                  flush=True)
            return 2
        from . import serving_bench

        return serving_bench.run(a)
    if not distributed.launched() and a.world > 1:
        from .launch import gpu_count, launch

        if gpu_count() == 0:  # once, here, instead of once per rank
            print(NO_GPU + f" (nvidia-smi lists none; {a.world} processes not started)", flush=True)
            return 2

        return launch([sys.executable, "-m", "jax_dsa_exchange.bench", *argv], a.world,
                      timeout=a.timeout)
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
