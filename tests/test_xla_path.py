"""The pure-XLA merge (xla_path) against the oracle, on CPU devices of one process.

The device count (XLA_FLAGS=--xla_force_host_platform_device_count=W) is read
once, when jax creates its CPU client, and other test files may have imported
jax already; so every world size runs in its own subprocess: this file, run as
a script (``python tests/test_xla_path.py --world W``), is the worker.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (K, N) pairs: N only shapes the cases (saturating rows); the XLA path always
# gathers K candidates per rank.
CONFIGS = [(64, 32), (128, 32), (256, 64)]


def _run_worker(world: int, *extra: str) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={world}"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--world", str(world), *extra],
                          env=env, capture_output=True, text=True, timeout=600)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (
        f"worker W={world} failed (rc={proc.returncode})\n"
        f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8, 16])  # 3: not a power of two; 16: the max of docs/DESIGN.md §2
def test_adversarial_cases_bit_identical(world):
    res = _run_worker(world)
    assert res["mismatches"] == [], res["mismatches"][:20]
    assert res["checked"] > 0


WIDE = [(w, i, d) for w, i in [(1, 2), (2, 16), (3, 64), (8, 1), (16, 2)] for d in ("bfloat16", "float32")
        if (i, d) != (1, "bfloat16")]  # (that one is test_adversarial_cases_bit_identical's)


@pytest.mark.parametrize("world,interleave,dtype", WIDE, ids=[f"W{w}-I{i}-{d}" for w, i, d in WIDE])
def test_float32_and_interleaved_cases_bit_identical(world, interleave, dtype):
    """float32 scores and KV caches interleaved in chunks of I tokens (docs/DESIGN.md §4)."""
    res = _run_worker(world, "--dtype", dtype, "--interleave", str(interleave))
    assert res["mismatches"] == [], res["mismatches"][:20]
    assert res["checked"] > 0


def test_explicit_mesh_and_api():
    """jax.make_mesh (Explicit axes on new jax) with pre-sharded inputs, option handling."""
    res = _run_worker(4, "--api")
    assert res["mismatches"] == [], res["mismatches"]


def test_example_decode_loop():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("XLA_FLAGS", None)
    env["JAX_PLATFORMS"] = "cpu"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "decode_loop.py")], env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "W=4 ranks (4 devices of one process)" in p.stdout, p.stdout
    for r in range(4):
        assert f"rank {r} of 4: every layer bit-identical to reference.topk_merge" in p.stdout, p.stdout


# ---------------------------------------------------------------------------
# Worker (runs in the subprocess)


def _worker(world: int, api: bool, dtype: str = "bfloat16", interleave: int = 1) -> dict:
    import numpy as np
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jax_dsa_exchange import distributed, reference
    from jax_dsa_exchange.testing import cases
    from jax_dsa_exchange.xla_path import xla_topk_merge_sharded

    assert not jax.config.jax_enable_x64  # the path must not need 64-bit ints
    assert len(jax.devices()) == world, jax.devices()
    mesh = distributed.dcp_mesh("dcp", world)
    mismatches, checked = [], 0
    jitted = {}

    def run(case, mesh, shard):
        key = (case.topk, case.block_size, case.interleave, id(mesh))
        if key not in jitted:  # one jit per static config; shapes share its cache
            jitted[key] = jax.jit(lambda *a, K=case.topk, B=case.block_size, I=case.interleave: xla_topk_merge_sharded(
                mesh, "dcp", *a, topk=K, block_size=B, with_ids=True, with_saturated=True, interleave=I))
        return jitted[key](*shard(case))

    def check(case, out, tag=""):
        nonlocal checked
        ref = case.oracle()
        got = {f: np.asarray(getattr(out, f)) for f in ("kv_rows", "counts", "ids", "saturated")}
        for q in range(world):
            for f in ("kv_rows", "counts", "ids"):
                want = getattr(ref[q], f)
                g = got[f][q]
                if g.dtype != np.int32 or not np.array_equal(g, want):
                    rows = np.nonzero((g != want).reshape(g.shape[0], -1).any(-1))[0] if g.shape == want.shape else "shape"
                    mismatches.append(f"{tag}{case!r} rank {q} {f} rows {rows}")
            if np.any(got["saturated"][q] != 0):
                mismatches.append(f"{tag}{case!r} rank {q} saturated not zero")
            checked += 1

    def stacked(case):
        return [np.stack(x) for x in case.args]

    rng = np.random.default_rng(1234 + world)
    if not api:
        kw = dict(dtype=dtype, interleave=interleave)
        for K, N in CONFIGS if dtype == "bfloat16" and interleave == 1 else CONFIGS[-1:]:
            todo = cases.adversarial_cases(rng, world=world, topk=K, local_topk=N, rows=16, **kw)
            # L below K, equal to K, and L = 1 (this path's n = min(K, L) branch).
            for cols in (1, N - 5, K):
                todo.append(cases.random_case(rng, world=world, topk=K, local_topk=N, rows=8,
                                              cols=cols, distinct_values=3, name=f"cols{cols}", **kw))
            for case in todo:
                if case.equal_cols:
                    check(case, run(case, mesh, stacked))
        return dict(mismatches=mismatches, checked=checked)

    # --api: Explicit-axis mesh (jax.make_mesh on new jax) with inputs already
    # sharded over the rank axis, and the optional outputs switched off.
    emesh = jax.make_mesh((world,), ("dcp",))
    sharding = NamedSharding(emesh, P("dcp"))
    case = cases.random_case(rng, world=world, topk=128, local_topk=32, rows=8, cols=300, distinct_values=4)
    out = run(case, emesh, lambda c: [jax.device_put(x, sharding) for x in stacked(c)])
    check(case, out, "explicit mesh: ")
    plain = jax.jit(lambda *a: xla_topk_merge_sharded(mesh, "dcp", *a, topk=128, block_size=case.block_size))(
        *stacked(case))
    if plain.ids is not None or plain.saturated is not None:
        mismatches.append("ids/saturated must be None when not requested")
    if not np.array_equal(np.asarray(plain.kv_rows), np.asarray(out.kv_rows)):
        mismatches.append("kv_rows differ with/without ids")
    try:
        jax.jit(lambda *a: xla_topk_merge_sharded(mesh, "dcp", *a, topk=100, block_size=4))(*stacked(case))
        mismatches.append("topk=100 (not a multiple of 32) was accepted")
    except ValueError:
        pass
    try:
        f16 = [x.astype(np.float16) if x.dtype == reference.BF16 else x for x in stacked(case)]
        jax.jit(lambda *a: xla_topk_merge_sharded(mesh, "dcp", *a, topk=128, block_size=4))(*f16)
        mismatches.append("float16 logits were accepted")
    except TypeError as e:
        if "bfloat16 or float32, got float16" not in str(e):
            mismatches.append(f"float16 logits: {e}")
    # ord16 on every bf16 bit pattern equals the reference encoding (docs/DESIGN.md §5).
    from jax_dsa_exchange.xla_path import ord16

    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    got = np.asarray(jax.jit(ord16)(bits.view(reference.BF16)))
    if not np.array_equal(got, reference.ord16(bits).astype(np.int32)):
        mismatches.append("ord16 differs from reference.ord16")
    # ord32 on sampled and special float32 patterns likewise.
    from jax_dsa_exchange.xla_path import ord32

    bits32 = np.concatenate([rng.integers(0, 2**32, 1 << 16, dtype=np.uint64).astype(np.uint32),
                             np.array(cases.SPECIAL_BITS32, np.uint32)])
    got32 = np.asarray(jax.jit(ord32)(bits32.view(np.float32)))
    if not np.array_equal(got32.astype(np.uint64), reference.ord32(bits32)):
        mismatches.append("ord32 differs from reference.ord32")
    return dict(mismatches=mismatches, checked=checked)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--api", action="store_true")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--interleave", type=int, default=1)
    a = ap.parse_args()
    print("RESULT " + json.dumps(_worker(a.world, a.api, a.dtype, a.interleave)), flush=True)
