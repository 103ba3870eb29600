"""Top-k baselines timed next to the kernels, on the same shapes and in the same run
(``benchmarks/bench_kernels.py``, ``python -m jax_dsa_exchange.bench``): jax.lax.top_k
(device time of dependent calls in one jitted loop) and torch.topk (CUDA-graph replay)
where PyTorch is importable.  Each returns None where its library or GPU is missing."""

from __future__ import annotations

import statistics
import time


def jax_topk_time(shape, k, reps=16):
    """Device time per lax.top_k on bf16 [R, C]: ``reps`` dependent top_k
    calls inside ONE jitted fori_loop (rotating over 4 inputs), so dispatch
    overhead is amortized; median of 5 timed calls.  None without a JAX GPU."""
    try:
        import jax
        import jax.numpy as jnp
    except Exception:
        return None
    if jax.default_backend() != "gpu":
        return None
    k = min(k, shape[1])
    xs = jax.random.normal(jax.random.PRNGKey(0), (4,) + tuple(shape), jnp.bfloat16)

    @jax.jit
    def f(xs):
        def body(i, acc):
            x = jax.lax.dynamic_index_in_dim(xs, i % 4, keepdims=False)
            # acc feeds the next input: the calls cannot overlap or be elided
            v, idx = jax.lax.top_k(x + acc.astype(x.dtype), k)
            return acc + v[:, -1].astype(jnp.float32).sum() * 1e-30 + idx[0, 0].astype(jnp.float32) * 1e-30
        return jax.lax.fori_loop(0, reps, body, jnp.zeros((), jnp.float32))

    jax.block_until_ready(f(xs))
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(f(xs))
        ts.append((time.perf_counter() - t0) / reps)
    return statistics.median(ts)


def torch_topk_time(shape, k, dtype="bfloat16", reps=20):
    """Device time of torch.topk(x, k) on a [R, C] tensor by CUDA-graph replay of
    ``reps`` calls over 4 rotating inputs (median of 5 replays); None without
    PyTorch + CUDA.  dtype "bfloat16" (the logits) or "int64" (merge keys)."""
    try:
        import torch
    except Exception:
        return None
    if not torch.cuda.is_available():
        return None
    k = min(k, shape[1])
    g = torch.Generator(device="cuda").manual_seed(0)
    if dtype == "int64":
        xs = [torch.randint(1, 1 << 62, tuple(shape), device="cuda", generator=g) for _ in range(4)]
    else:
        xs = [torch.randn(tuple(shape), device="cuda", generator=g).to(torch.bfloat16) for _ in range(4)]
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for x in xs:  # warm-up outside the graph (allocations, kernel selection)
            torch.topk(x, k)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s):
        for i in range(reps):
            torch.topk(xs[i % 4], k)
    ts = []
    for _ in range(7):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        graph.replay()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e-3 / reps)
    del graph, xs
    return statistics.median(ts[2:])


def topk64_times(R, C, k, reps=16):
    """Device time per top-k of random 64-bit keys [R, C] (the merge's round-1 shape):
    torch.topk (int64) replayed from a CUDA graph of ``reps`` calls, and jax.lax.top_k
    (int64, x64 on) as ``reps`` dependent calls in one jitted loop; medians.  None
    where the library is not importable (or has no GPU)."""
    k = min(k, C)
    out = {"torch": None, "jax": None}
    try:
        import torch

        if torch.cuda.is_available():
            x = torch.randint(-(2**62), 2**62, (R, C), dtype=torch.int64, device="cuda")
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    torch.topk(x, k)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(reps):
                    torch.topk(x, k)
            ts = []
            for _ in range(7):
                e0 = torch.cuda.Event(enable_timing=True)
                e1 = torch.cuda.Event(enable_timing=True)
                e0.record()
                g.replay()
                e1.record()
                e1.synchronize()
                ts.append(e0.elapsed_time(e1) * 1e3 / reps)
            out["torch"] = statistics.median(ts[2:])
            del g, x
    except Exception as e:  # noqa: BLE001 - a baseline, not the subject
        print(f"torch.topk baseline unavailable: {type(e).__name__}: {e}", flush=True)
    try:
        import jax
        import jax.numpy as jnp

        if jax.default_backend() == "gpu":
            jax.config.update("jax_enable_x64", True)
            xs = jax.random.randint(jax.random.PRNGKey(1), (4, R, C), -(2**62), 2**62, jnp.int64)

            @jax.jit
            def f(xs):
                def body(i, acc):
                    x = jax.lax.dynamic_index_in_dim(xs, i % 4, keepdims=False)
                    v, idx = jax.lax.top_k(x + acc, k)
                    # data-dependent (XLA cannot fold it to 0 and hoist top_k out of the loop)
                    return acc + (v[0, -1] & 1) + (idx[0, 0] & 1).astype(jnp.int64)
                return jax.lax.fori_loop(0, reps, body, jnp.zeros((), jnp.int64))

            jax.block_until_ready(f(xs))
            ts = []
            for _ in range(5):
                t0 = time.perf_counter()
                jax.block_until_ready(f(xs))
                ts.append((time.perf_counter() - t0) / reps * 1e6)
            out["jax"] = statistics.median(ts)
            jax.config.update("jax_enable_x64", False)
    except Exception as e:  # noqa: BLE001
        print(f"jax.lax.top_k int64 baseline unavailable: {type(e).__name__}: {e}", flush=True)
    return out
