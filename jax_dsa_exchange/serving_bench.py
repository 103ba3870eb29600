"""Serving-loop benchmark: jitted decode steps dispatched back to back.

    python -m jax_dsa_exchange.bench --serving [--layers 16] [--steps 100] ...

One process, one GPU, a W = 1 exchange (``Exchange.create_local``): the merge runs both
kernels (select+push, merge) with no peer to wait for, so what is measured is what the
op costs the *host and the stream* in a serving loop, not NVLink.  A decode step is one
jitted function of ``--layers`` layers; each layer does 4 matmuls
[R, D] x [D, D] (bf16) on the hidden state, then the merge of that layer's [R, L]
logits, whose counts feed back into the hidden state (as sparse attention's selected
rows would).  ``--steps`` steps are dispatched from Python without waiting (the hidden
state passed on, the way a serving engine passes its cache), then one wait; wall time
per step.  Rows, all in one run:

* ``no merge``: the same step without the op (its counts consumer fed from an input);
* ``ordered=False``, ``default (ordered=True)``, ``ordered="effect"``: with the op in
  each ordering mode (op.py);
* the op's device time per layer in this loop: a profile (``jax.profiler``, CUPTI) of a
  few default-mode steps, from each select_push kernel's start to its merge kernel's end
  (the op's span on the stream; the two kernels overlap through PDL), median over the
  layers; and each kernel's own duration;
* the op's device time per layer the bench's way: a step of only merges,
  (t(2 x layers) - t(layers)) / layers, median of ``--reps``, each step waited for (the
  merges run back to back there, the logits stay in L2: a lower bound);
* the kernels alone (CUDA events, ``testing.timing``) when CuPy and the kernels load.

The check: the default mode adds at most the op's device time in this loop + 2 us per
layer over ``no merge`` (host serialization would show up as device idle time
beyond the op's span).  On a machine without a GPU it says so and exits 2.
"""

from __future__ import annotations

import os
import time

import numpy as np


# The configuration of the serving loop (bench.py's defaults with --serving, unless given):
# one GPU, a decode step of 16 layers at K = N = 2048, R = 16, L = 32768.
DEFAULTS = dict(world=1, local_topk=[2048], rows=[16], cols=[32768], layers=16, reps=15)


def add_args(p) -> None:
    g = p.add_argument_group("the serving-loop benchmark")
    g.add_argument("--serving", action="store_true",
                   help="the serving-loop benchmark instead of the report: one process, a W = 1 exchange, "
                        "--topk and the first --local-topk / --rows / --cols (defaults then: N=2048, R=16, "
                        "L=32768, 16 layers)")
    g.add_argument("--steps", type=int, default=100, help="--serving: steps dispatched back to back (default 100)")
    g.add_argument("--hidden", type=int, default=4096,
                   help="--serving: D of the [R, D] x [D, D] matmuls (default 4096)")
    g.add_argument("--matmuls", type=int, default=4, help="--serving: matmuls per layer (default 4)")


def run(a) -> int:
    import jax
    import jax.numpy as jnp

    from . import _ffi
    from .exchange import Exchange
    from .op import compiler_options, jit, topk_exchange_merge

    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        print("bench --serving: no GPU: nothing to measure", flush=True)
        return 2
    K, N = a.topk, a.local_topk[0]
    R, L = a.rows[0], a.cols[0]
    layers, steps, D, B = a.layers, a.steps, a.hidden, 64
    dev = gpus[0]
    print(f"serving: {dev.device_kind}, jax {jax.__version__}, CUDA graphs {_ffi.cuda_graph_mode()!r}; W=1 "
          f"exchange, K={K} N={N} R={R} L={L}, {layers} layers per step, each {a.matmuls} matmuls "
          f"[{R}, {D}] x [{D}, {D}] bf16 then the merge; {steps} steps dispatched back to back; compiler options {compiler_options()}", flush=True)
    ex = Exchange.create_local([dev], topk=K, local_topk=N, max_rows=R)[0]
    try:
        pages = -(-L // B)
        bt = jnp.asarray(np.arange(R * pages, dtype=np.int32).reshape(R, pages))
        req = jnp.arange(R, dtype=jnp.int32)
        ends = jnp.full((R,), L, jnp.int32)
        key = jax.random.PRNGKey(0)
        ws = (jax.random.normal(key, (a.matmuls, D, D), jnp.bfloat16) * (1.0 / np.sqrt(D)),
              jnp.zeros((R,), jnp.int32))  # (weights, the "no merge" stand-in for the counts)
        # One array per layer, as a real step computes each layer's logits: slicing one
        # stacked input would add a device copy per layer (1.7 us at R=16, L=32K, H200),
        # since the custom call takes a whole buffer while the dynamic-slice fusion is off.
        lgs = tuple(jax.random.normal(k, (R, L), jnp.bfloat16)
                    for k in jax.random.split(jax.random.PRNGKey(1), 2 * layers))
        h0 = jax.random.normal(jax.random.PRNGKey(2), (R, D), jnp.bfloat16)

        def make_step(ordered, n_layers, with_mm=True):
            def step(h, params, lgs):
                ws, counts0 = params
                for i in range(n_layers):
                    if with_mm:
                        for m in range(a.matmuls):
                            h = jnp.tanh(h @ ws[m])
                    counts = counts0  # "no merge": the same consumer of [R] counts, from an input
                    if ordered is not None:
                        counts = topk_exchange_merge(ex, lgs[i], ends, req, bt, block_size=B, ordered=ordered).counts
                    h = h + (counts[:, None] > K).astype(h.dtype)  # never true: counts <= K
                return h
            return jit(step)  # every mode, "no merge" too: the same compiler options

        def serve(step):
            h = h0
            for _ in range(3):
                h = step(h, ws, lgs)
            jax.block_until_ready(h)
            t0 = time.perf_counter()
            for _ in range(steps):
                h = step(h, ws, lgs)
            jax.block_until_ready(h)
            return (time.perf_counter() - t0) / steps * 1e6

        modes = [("no merge", None), ("ordered=False", False), ("default (ordered=True)", True),
                 ('ordered="effect"', "effect")]
        steps_by_mode = {name: make_step(ordered, layers) for name, ordered in modes}
        per_step = {}
        for name, _ in modes:
            per_step[name] = serve(steps_by_mode[name])
        # Twice, in the other order too: the first loop of a process can carry warm-up.
        for name, _ in reversed(modes):
            per_step[name] = min(per_step[name], serve(steps_by_mode[name]))

        # The op's device time per layer, the bench's way.
        short, long_ = make_step(True, layers, with_mm=False), make_step(True, 2 * layers, with_mm=False)
        for _ in range(3):
            jax.block_until_ready(short(h0, ws, lgs))
            jax.block_until_ready(long_(h0, ws, lgs))
        ds = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            jax.block_until_ready(short(h0, ws, lgs))
            t1 = time.perf_counter()
            jax.block_until_ready(long_(h0, ws, lgs))
            t2 = time.perf_counter()
            ds.append(((t2 - t1) - (t1 - t0)) / layers * 1e6)
        op_dev = float(np.median(ds))
        span = _profiled_op_time(steps_by_mode["default (ordered=True)"], (h0, ws, lgs), layers)
        ex.check()
    finally:
        ex.close()

    kern = _kernels_alone(a, K, N, R, L)
    base = per_step["no merge"]
    print(f"\n{'mode':<24} {'us/step':>9} {'added us/layer':>15}")
    for name, _ in modes:
        t = per_step[name]
        print(f"{name:<24} {t:>9.0f} {(t - base) / layers:>15.1f}" if name != "no merge" else
              f"{name:<24} {t:>9.0f} {'-':>15}")
    print(f"op device time per layer (merges only, (t({2 * layers} layers) - t({layers})) / {layers}, "
          f"median of {a.reps}): {op_dev:.1f} us")
    if span is not None:
        print(f"op device time per layer in the default loop (profile of {span[3]} layers: select_push start -> "
              f"merge end, median): {span[0]:.1f} us (kernel durations: select_push {span[1]:.1f} us, merge "
              f"{span[2]:.1f} us)")
    if kern is not None:
        print(f"kernels alone (CUDA events, W=1): select+push {kern[0]:.1f} us + merge {kern[1]:.1f} us = "
              f"{kern[0] + kern[1]:.1f} us")
    added = (per_step["default (ordered=True)"] - base) / layers
    dev, how = (span[0], "in this loop (profile)") if span is not None else (op_dev, "merges only")
    ok = added <= dev + 2.0
    print(f"serving check: the default adds {added:.1f} us per layer; op device time {how} + 2 us = "
          f"{dev + 2.0:.1f} us: {'PASS' if ok else 'FAIL'}", flush=True)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "serving.csv"), "w") as f:
            f.write("mode,us_per_step,added_us_per_layer\n")
            for name, _ in modes:
                f.write(f"{name},{per_step[name]:.1f},{(per_step[name] - base) / layers:.2f}\n")
            f.write(f"op device time per layer (merges only),,{op_dev:.2f}\n")
            if span is not None:
                f.write(f"op device time per layer in the loop (profile),,{span[0]:.2f}\n")
            if kern is not None:
                f.write(f"kernels alone per layer,,{kern[0] + kern[1]:.2f}\n")
    return 0 if ok else 1


def _profiled_op_time(step, args, layers, steps=4):
    """(median span, median select_push duration, median merge duration, layers seen) in us
    from a jax.profiler trace of ``steps`` steps, or None when the trace has no such kernels
    (e.g. no CUPTI).  Kernels are found by their CuTe DSL entry names (kernels/cache.py)."""
    import glob
    import tempfile

    import jax

    try:
        h = args[0]
        jax.block_until_ready(step(h, *args[1:]))
        d = tempfile.mkdtemp(prefix="dsa_serving_trace_")
        with jax.profiler.trace(d):
            for _ in range(steps):
                h = step(h, *args[1:])
            jax.block_until_ready(h)
        files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        pd = jax.profiler.ProfileData.from_file(files[0])
        evs, every = [], []
        for plane in pd.planes:
            if not plane.name.startswith("/device:GPU"):
                continue
            for line in plane.lines:
                for e in line.events:
                    every.append((e.start_ns, e.duration_ns, line.name, e.name))
                    kind = ("s" if "kernelsselect_push" in e.name else "m" if "kernelsmerge" in e.name else None)
                    if kind:
                        evs.append((e.start_ns, e.start_ns + e.duration_ns, kind))
        evs.sort()
        every.sort()
        if len(evs) > 2 * layers + 4:  # what the device does around one call, mid-profile
            t_a, t_b = evs[2 * layers - 1][1] - 30_000, evs[2 * layers + 3][1]
            print("serving: device events around one layer (us from the first, duration, line, name):")
            for t, dur, ln, name in every:
                if t_a <= t <= t_b:
                    print(f"  {(t - t_a) / 1e3:8.2f} {dur / 1e3:7.2f}  {ln[:18]:<18} {name[:70]}")
        spans, sel, mer, open_sel = [], [], [], None
        for t0, t1, kind in evs:
            if kind == "s":
                open_sel = (t0, t1)
            elif open_sel is not None:
                spans.append(t1 - open_sel[0])
                sel.append(open_sel[1] - open_sel[0])
                mer.append(t1 - t0)
                open_sel = None
        if len(spans) < layers:
            print(f"serving: the profile held {len(spans)} select_push/merge pairs: not used", flush=True)
            return None
        return (float(np.median(spans)) / 1e3, float(np.median(sel)) / 1e3, float(np.median(mer)) / 1e3,
                len(spans))
    except Exception as e:  # noqa: BLE001 - a profiler that does not work here: say so, go on
        print(f"serving: profile not taken: {type(e).__name__}: {e}", flush=True)
        return None


def _kernels_alone(a, K, N, R, L):
    try:
        import cupy as cp

        from .testing.timing import KernelTimer

        timer = KernelTimer(cp, 1, K, N, R)
        return timer.run(R, L, rescue=False, iters=a.reps, warm=3)
    except Exception as e:  # noqa: BLE001 - e.g. no CuTe DSL and no cubin for the simulator
        print(f"serving: kernels alone not measured: {type(e).__name__}: {e}", flush=True)
        return None
