"""The main job: a jitted DCP decode loop that merges top-K every layer, checked exactly.

    python -m jax_dsa_exchange.demo                 # W=4 CPU devices in one process
    python -m jax_dsa_exchange.demo --processes     # W processes (launcher + gloo)
    python -m jax_dsa_exchange.launch -n 8 -- python -m jax_dsa_exchange.demo --path ffi

Each decode step is one jitted function: ``shard_map`` over the DCP axis, inside
it a ``lax.scan`` over the layers; every layer merges its indexer scores with
``merge_fn`` and gathers the selected KV rows (a stand-in for sparse attention).
After every step the outputs of every layer are compared bit for bit with the
NumPy oracle (``reference.topk_merge``) and one line is printed:

    step 2: rows 16  K 512  N 128  W 4  |  0.85 ms/layer wall  |  rescue rows 3/64  |  OK

The per-step time is host wall time around one step (dispatch, the step, the wait; the
checks come after it), divided by the layers: not the op's cost.  At the end the demo
measures the per-layer device time the bench's way: (t(2 x layers) - t(layers)) / layers
on the same data, median of 5, which cancels dispatch and transfers and leaves one layer's
merge plus the stand-in attention gather.

"rescue rows" counts (layer, row) pairs for which the two-round protocol needs
its second round: reported by the FFI path itself, and for the XLA path (which
gathers K candidates and never needs one) taken from the protocol model
(``reference.saturated_masks``).  Exit code 1 on any mismatch.

``--path``: ``xla`` (pure XLA, any backend), ``ffi`` (the NVLink kernels;
needs ``jax_dsa_exchange.op`` and NVIDIA GPUs), ``auto`` (ffi on GPUs when the
op is importable, else xla).  The only place the path matters is
:func:`make_merge_fn`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

AXIS = "dcp"


RESCUE_HELP = """\
rescue rows: the FFI path's protocol sends each rank's top N (--local-topk) candidates
per row in a first round and merges them.  When a rank sent N candidates and even its
smallest beats the merged K-th, a token it did not send could still belong to the top
K: that row takes a second round (the rescue), in which such ranks send their top K.
Each step line counts the (layer, row) pairs that needed it.  The XLA path sends K
candidates at once and never needs one, so there the count comes from the protocol
model (reference.saturated_masks) and is marked "(model)".  The results are exact
either way; the count shows how often the rescue's extra cost is paid (none with N = K).
"""


def _parse(argv):
    from . import layout

    p = argparse.ArgumentParser(prog="python -m jax_dsa_exchange.demo", description=__doc__.split("\n")[0],
                                epilog=RESCUE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=4,
                   help=f"DCP ranks W, 1..{layout.MAX_WORLD} (default 4; under the launcher: its -n)")
    p.add_argument("--steps", type=int, default=5, help="decode steps, >= 1 (default 5)")
    p.add_argument("--layers", type=int, default=4, help="layers per step, scanned, >= 1 (default 4)")
    p.add_argument("--rows", type=int, default=16, help="query rows R per call, >= 1 (default 16)")
    p.add_argument("--cols", type=int, default=8192,
                   help=f"local KV tokens L per rank, 1..{layout.MAX_LOCAL_LEN} (default 8192)")
    p.add_argument("--topk", type=int, default=2048,
                   help=f"K, a multiple of 32 in {layout.MIN_TOPK}..{layout.MAX_TOPK} (default 2048)")
    p.add_argument("--local-topk", type=int, default=1024,
                   help="N, the first round's candidates per rank and row: a multiple of 32 in 32..K "
                        "(default 1024; see rescue rows below)")
    p.add_argument("--block-size", type=int, default=64, help="KV page size B, >= 1 (default 64)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="the indexer scores' dtype (default bfloat16); float32 scores are merged exactly as "
                        "float32 (the XLA path: --path auto picks it)")
    p.add_argument("--interleave", type=int, default=1,
                   help="I: the KV cache is spread over the ranks in chunks of I consecutive tokens "
                        "(default 1: token by token)")
    p.add_argument("--path", choices=("auto", "xla", "ffi"), default="auto",
                   help="xla: pure XLA, any backend; ffi: the NVLink kernels (NVIDIA GPUs); "
                        "auto (default): ffi on GPUs when the op imports, else xla")
    p.add_argument("--processes", action="store_true",
                   help="one process per rank (launcher + jax.distributed, gloo on CPU)")
    p.add_argument("--timeout", type=float, default=600.0, help="--processes: whole-run timeout in s (default 600)")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated workload (default 0)")
    a = p.parse_args(argv)
    # Every option names itself when out of range (argparse's message, exit code 2),
    # instead of failing later inside jax or NumPy with an unrelated error.
    for opt, v, lo, hi in (("--world", a.world, 1, layout.MAX_WORLD), ("--steps", a.steps, 1, None),
                           ("--layers", a.layers, 1, None), ("--rows", a.rows, 1, None),
                           ("--cols", a.cols, 1, layout.MAX_LOCAL_LEN), ("--block-size", a.block_size, 1, None)):
        if v < lo or (hi is not None and v > hi):
            p.error(f"argument {opt}: {v} is out of range: need {lo} <= {opt[2:]}"
                    + (f" <= {hi}" if hi is not None else ""))
    if a.topk % 32 or not layout.MIN_TOPK <= a.topk <= layout.MAX_TOPK:
        p.error(f"argument --topk: {a.topk} must be a multiple of 32 in [{layout.MIN_TOPK}, {layout.MAX_TOPK}]")
    if a.local_topk % 32 or not 32 <= a.local_topk <= a.topk:
        p.error(f"argument --local-topk: {a.local_topk} must be a multiple of 32 in [32, --topk={a.topk}]")
    if not a.timeout > 0:
        p.error(f"argument --timeout: {a.timeout} must be > 0")
    try:
        layout.check_interleave(a.interleave, a.world)
    except ValueError as e:
        p.error(f"argument --interleave: {e}")
    if a.dtype == "float32" and a.path == "ffi":
        p.error("argument --dtype: float32 scores run on the XLA path (--path xla or auto); the GPU kernels "
                "take bfloat16")
    return a


# ---------------------------------------------------------------------------
# The hook: one function decides which merge the decode step calls.


def resolve_path(path: str, mesh, dtype: str = "bfloat16") -> str:
    """``auto`` -> ``ffi`` when the mesh is NVIDIA GPUs, the op imports and the scores are
    bfloat16 (what the kernels take), else ``xla``."""
    if path != "auto":
        return path
    if mesh.devices.flat[0].platform != "gpu" or dtype != "bfloat16":
        return "xla"
    try:
        from . import op  # noqa: F401
    except ImportError:
        return "xla"
    return "ffi"


def make_merge_fn(path: str, mesh, *, topk: int, local_topk: int, block_size: int, max_rows: int,
                  interleave: int = 1):
    """Per-rank merge ``fn(logits, row_ends, req_id, block_table) -> result`` for ``path``.

    Called inside the shard_map body (one rank's [R, L] block).  The result has
    ``kv_rows``, ``counts``, ``ids``, ``saturated`` (the last may be None).
    Returns ``(fn, reports_rescue)``; ``reports_rescue`` says whether the path
    reports real rescue rounds in ``saturated``.
    """
    if path == "xla":
        from .xla_path import xla_topk_merge

        def fn(logits, row_ends, req_id, block_table):
            return xla_topk_merge(logits, row_ends, req_id, block_table, axis_name=AXIS, topk=topk,
                                  block_size=block_size, with_ids=True, interleave=interleave)

        return fn, False

    if path != "ffi":
        raise ValueError(f"unknown path {path!r} (auto, xla, ffi)")
    platforms = {d.platform for d in mesh.devices.flat}
    if platforms != {"gpu"}:
        raise NotImplementedError(
            f"--path ffi needs NVIDIA GPUs, this job has {sorted(platforms)} devices; "
            "use --path xla (or auto)")
    import jax

    try:
        from .exchange import Exchange
        from .op import topk_exchange_merge
    except ImportError as e:
        raise NotImplementedError(
            f"--path ffi needs the GPU op (jax_dsa_exchange.op / .exchange), which failed to "
            f"import: {e}; use --path xla") from e
    if jax.process_count() > 1:  # one rank per process: collective creation over IPC
        ex = Exchange.create(topk=topk, local_topk=local_topk, max_rows=max_rows, interleave=interleave)
    else:  # all ranks in this process; the ranks share one exchange id
        ex = Exchange.create_local(list(mesh.devices.flat), topk=topk, local_topk=local_topk,
                                   max_rows=max_rows, interleave=interleave)[0]

    def fn(logits, row_ends, req_id, block_table):
        return topk_exchange_merge(ex, logits, row_ends, req_id, block_table, block_size=block_size,
                                   with_ids=True, with_saturated=True, path="ffi")

    return fn, True


# ---------------------------------------------------------------------------
# Workload: decode-like rows, every process generates the same data.


def make_step_data(rng, step, a, world, base_len, req_id, tables):
    """Per-rank inputs of one decode step: logits [layers, W, R, L] (--dtype), row_ends [W, R]."""
    import ml_dtypes

    R, L, layers, chunk = a.rows, a.cols, a.layers, a.interleave
    # Row i's context has base_len[i] + step tokens; chunk c of I tokens lives on rank c % W
    # (docs/DESIGN.md §4), so rank q holds I per whole round of W chunks and its share of the last.
    seq = base_len + step
    q = np.arange(world)[:, None]
    rounds, rest = seq[None, :] // (world * chunk), seq[None, :] % (world * chunk)
    row_ends = np.clip(rounds * chunk + np.clip(rest - q * chunk, 0, chunk), 0, L).astype(np.int32)
    x = rng.standard_normal((layers, world, R, L)).astype(np.float32)
    # Some rows concentrate their best tokens on one rank (that rank's top-N is
    # not enough there: the protocol's rescue round), some have few distinct
    # scores (ties at the K-th key); quantizing keeps plenty of exact ties.
    hot = rng.random((layers, R)) < 0.15
    hot_rank = rng.integers(0, world, (layers, R))
    for ly, i in zip(*np.nonzero(hot)):
        x[ly, hot_rank[ly, i], i] += 3.0
    coarse = rng.random((layers, R)) < 0.25
    x = np.where(coarse[:, None, :, None], np.round(x), np.round(x * 16) / 16)
    return x.astype(ml_dtypes.bfloat16 if a.dtype == "bfloat16" else np.float32), row_ends


# ---------------------------------------------------------------------------


def run(a) -> int:
    from . import distributed

    rank, nproc = distributed.initialize()
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec as P

    from . import reference
    from .xla_path import shard_map

    world = nproc if nproc > 1 else a.world
    backend = None
    if nproc == 1 and len(jax.local_devices()) < world and a.path != "ffi":
        # E.g. one GPU but W=4: run the XLA path on W CPU devices instead.
        backend = "cpu"
        print(f"demo: {len(jax.local_devices())} {jax.default_backend()} device(s) < W={world}: "
              f"using {world} CPU devices", flush=True)
    mesh = distributed.dcp_mesh(AXIS, world, backend=backend)
    path = resolve_path(a.path, mesh, a.dtype)
    K, N, B, R, L, I = a.topk, a.local_topk, a.block_size, a.rows, a.cols, a.interleave
    merge, reports_rescue = make_merge_fn(path, mesh, topk=K, local_topk=N, block_size=B, max_rows=R, interleave=I)
    lead = rank == 0

    def log(msg):
        if lead:
            print(msg, flush=True)

    D = 8  # width of the stand-in KV cache

    def rank_step(logits, row_ends, req_id, block_table, kv_cache):
        # Per-rank shapes: logits [layers, 1, R, L]; the rest [1, ...].
        re, rq, bt, cache = row_ends[0], req_id[0], block_table[0], kv_cache[0]

        def layer(acc, lg):
            out = merge(lg[0], re, rq, bt)
            # Sparse attention stand-in: average this rank's selected KV rows.
            valid = out.kv_rows >= 0
            rows = jnp.where(valid[..., None], cache[jnp.maximum(out.kv_rows, 0)], 0.0)
            acc = acc + rows.sum(1) / jnp.maximum(out.counts, 1)[:, None]
            sat = out.saturated if out.saturated is not None else jnp.zeros_like(out.counts)
            return acc, (out.kv_rows[None], out.counts[None], out.ids[None], sat[None])

        # The initial carry must vary over the rank axis like the carry the body
        # returns (shard_map's check_vma); multiplying by a per-rank value does
        # that on every jax version.
        acc0 = jnp.zeros((R, D), jnp.float32) * re[:, None]
        acc, ys = lax.scan(layer, acc0, logits)
        return (acc[None], *ys)  # ys: [layers, 1, ...] each

    spec = P(AXIS)
    lspec = P(None, AXIS)  # [layers, W, ...]: the rank axis is the second one
    if path == "ffi":  # the op's compiler_options (op.py: XLA's dynamic-slice fusion)
        from .op import jit
    else:
        jit = jax.jit
    step_fn = jit(shard_map(rank_step, mesh=mesh, in_specs=(lspec, spec, spec, spec, spec),
                                out_specs=(spec, lspec, lspec, lspec, lspec)))

    # Fixed per run: requests, block tables, KV caches; every process the same.
    rng = np.random.default_rng(a.seed)
    num_req = max(1, R // 2)
    pages = -(-L // B)
    req_id = rng.integers(0, num_req, (world, R)).astype(np.int32)
    tables = np.stack([rng.permutation(num_req * pages + 7)[: num_req * pages].reshape(num_req, pages)
                       for _ in range(world)]).astype(np.int32)
    cache = rng.standard_normal((world, (num_req * pages + 7) * B, D)).astype(np.float32)
    # Context lengths leave room for the steps' growth where the rows allow it (a tiny L
    # may not: row_ends then clamp to L).
    hi = max(world * L - a.steps, 1)
    base_len = rng.integers(min(world * L // 8, hi - 1), hi, R)
    base_len[0] = min(K // 2, hi)  # one short row: fewer than K tokens
    put = lambda x: distributed.shard_ranks(mesh, AXIS, list(x))  # noqa: E731
    g_req, g_tab, g_cache = put(req_id), put(tables), put(cache)
    from jax.sharding import NamedSharding

    lsharding = NamedSharding(mesh, lspec)

    log(f"jax_dsa_exchange demo: path={path} W={world} ({'processes' if nproc > 1 else 'devices'} of "
        f"{mesh.devices.flat[0].platform}) layers={a.layers} rows={R} L={L} K={K} N={N} B={B} "
        f"scores={a.dtype} interleave={I}")
    bad_total = 0
    for step in range(a.steps):
        logits, row_ends = make_step_data(rng, step, a, world, base_len, req_id, tables)
        g_logits = jax.make_array_from_callback(logits.shape, lsharding, lambda idx: logits[idx])
        g_ends = put(row_ends)
        t0 = time.perf_counter()
        outs = step_fn(g_logits, g_ends, g_req, g_tab, g_cache)
        jax.block_until_ready(outs)
        dt = time.perf_counter() - t0
        _, kv, cnt, ids, sat = [distributed.rank_shards(o, axis=1) for o in outs]
        bad, rescue = 0, 0
        for ly in range(a.layers):
            lg = [logits[ly, q] for q in range(world)]
            want = reference.topk_merge(lg, list(row_ends), list(req_id), list(tables), topk=K, block_size=B,
                                        interleave=I)
            model_sat = reference.saturated_masks(lg, list(row_ends), topk=K, local_topk=N, interleave=I)
            for q in kv:  # the ranks this process holds
                got = dict(kv_rows=kv[q][ly], counts=cnt[q][ly], ids=ids[q][ly])
                for name, g in got.items():
                    if not np.array_equal(g, getattr(want[q], name)):
                        bad += 1
                        rows = np.nonzero((g != getattr(want[q], name)).reshape(R, -1).any(1))[0]
                        print(f"MISMATCH step {step} layer {ly} rank {q} {name}: rows {rows[:8]}", flush=True)
                if reports_rescue and not np.array_equal(sat[q][ly], model_sat):
                    bad += 1
                    print(f"MISMATCH step {step} layer {ly} rank {q} saturated", flush=True)
            src = sat[min(sat)][ly] if reports_rescue else model_sat
            rescue += int(np.count_nonzero(src))
        if nproc > 1:  # every rank's verdict, so rank 0's line speaks for all
            bad = _sum_over_ranks(f"demo/{a.seed}/{step}", bad, rank, nproc)
        bad_total += bad
        what = "compile+run" if step == 0 else "layer wall"
        ms = dt * 1e3 / (1 if step == 0 else a.layers)
        log(f"step {step}: rows {R}  K {K}  N {N}  W {world}  |  {ms:8.2f} ms {what:<11} |  "
            f"rescue rows {rescue}/{a.layers * R}{'' if reports_rescue else ' (model)'}  |  "
            f"{'OK' if bad == 0 else f'MISMATCH ({bad})'}")
    dev_ms = _device_ms_per_layer(step_fn, logits, lsharding, (g_ends, g_req, g_tab, g_cache), a.layers)
    log(f"device time per layer: {dev_ms:.3f} ms = (t({2 * a.layers} layers) - t({a.layers})) / {a.layers}, "
        f"median of 5: one layer's merge ({path} path) + the stand-in attention gather, every rank; "
        f"without dispatch, transfers or the checks")
    log(f"{'OK' if bad_total == 0 else 'FAILED'}: {a.steps} steps x {a.layers} layers x {R} rows, "
        f"W={world}, path={path}: {'bit-identical to the oracle' if bad_total == 0 else f'{bad_total} mismatches'}")
    return 0 if bad_total == 0 else 1


def _device_ms_per_layer(step_fn, logits, lsharding, rest, layers, reps=5) -> float:
    """(t(2 x layers) - t(layers)) / layers in ms, median of ``reps`` (as the bench times):
    the same step on the last step's logits and on them twice over (every rank runs the
    same calls: collective on the FFI path)."""
    import jax

    double = np.concatenate([logits, logits])
    short = jax.make_array_from_callback(logits.shape, lsharding, lambda idx: logits[idx])
    long_ = jax.make_array_from_callback(double.shape, lsharding, lambda idx: double[idx])
    jax.block_until_ready(step_fn(short, *rest))
    jax.block_until_ready(step_fn(long_, *rest))
    ds = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(step_fn(short, *rest))
        t1 = time.perf_counter()
        jax.block_until_ready(step_fn(long_, *rest))
        t2 = time.perf_counter()
        ds.append(((t2 - t1) - (t1 - t0)) / layers * 1e3)
    return float(np.median(ds))


def _sum_over_ranks(key: str, value: int, rank: int, nproc: int) -> int:
    """Sum of an int over the processes, through the jax.distributed key-value store:
    no XLA collective, so it also works where NCCL cannot (several ranks sharing one GPU)."""
    from .rendezvous import distributed_client

    client = distributed_client()
    client.key_value_set(f"{key}/{rank}", str(value))
    return sum(int(client.blocking_key_value_get(f"{key}/{q}", 60_000)) for q in range(nproc))


def main(argv=None) -> int:
    a = _parse(argv)
    from . import distributed

    if a.processes and not distributed.launched():
        from . import launch

        argv = list(sys.argv[1:] if argv is None else argv)
        argv = [x for x in argv if x != "--processes"]
        return launch.launch([sys.executable, "-m", "jax_dsa_exchange.demo", *argv], a.world,
                             timeout=a.timeout)
    if not distributed.launched() and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        # W CPU devices in this process; must precede jax's CPU client (only
        # the host platform reads it, so GPUs are unaffected).
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={a.world}").strip()
    try:
        return run(a)
    except NotImplementedError as e:  # e.g. --path ffi without GPUs: no traceback needed
        print(f"demo: NotImplementedError: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
