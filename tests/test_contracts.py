"""Contracts between layers that no other test pins down: the package's public names
and result type, a cheap side-effect-free import, private JAX APIs confined to one
module, and the repository's design document cited by path."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
PKG = REPO / "jax_dsa_exchange"


def test_import_is_cheap_and_side_effect_free():
    """``import jax_dsa_exchange`` imports no JAX, no submodule, sets no environment."""
    code = ("import os, sys; env = dict(os.environ); import jax_dsa_exchange as d; "
            "mods = sorted(m for m in sys.modules if m.startswith(('jax', 'numpy', 'cupy', 'cutlass'))); "
            "assert mods == ['jax_dsa_exchange'], mods; assert dict(os.environ) == env; "
            "assert sorted(d.__all__) == ['Exchange', 'MergeOutput', 'topk_exchange_merge']")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_public_names():
    from jax_dsa_exchange import Exchange, MergeOutput, topk_exchange_merge
    from jax_dsa_exchange import exchange, op, output

    assert topk_exchange_merge is op.topk_exchange_merge
    assert Exchange is exchange.Exchange
    assert MergeOutput is output.MergeOutput is op.MergeOutput


def test_every_path_returns_merge_output():
    """Reference (NumPy), XLA path and the op (FFI / XLA) share one result type."""
    import jax
    import jax.numpy as jnp

    from jax_dsa_exchange import MergeOutput, reference, xla_path
    from jax_dsa_exchange.testing import cases

    c = cases.random_case(np.random.default_rng(0), world=1, topk=64, local_topk=32, rows=2, cols=256)
    args = (c.logits, c.row_ends, c.req_id, c.block_tables)
    for r in (reference.topk_merge(*args, topk=64, block_size=c.block_size)
              + reference.protocol_merge(*args, topk=64, local_topk=32, block_size=c.block_size)):  # fmt: skip
        assert type(r) is MergeOutput
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    out = xla_path.xla_topk_merge_sharded(
        mesh, "x", *(jnp.asarray(np.stack(a)) for a in args), topk=64, block_size=c.block_size)
    assert type(out) is MergeOutput


def test_private_jax_apis_only_in_one_module():
    """Every private JAX / XLA API (``jax._src``, ``xla_client``) is used in
    jax_dsa_exchange/_jax_private.py only."""
    bad = []
    for p in sorted(PKG.rglob("*.py")) + sorted((REPO / "tests").rglob("*.py")):
        if p.name in ("_jax_private.py", "test_contracts.py"):
            continue
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if re.search(r"jax\._src|xla_client|jax\.lib\b", line) and "``jax._src" not in line:
                bad.append(f"{p.relative_to(REPO)}:{i}: {line.strip()}")
    assert not bad, "\n".join(bad)


def test_design_citations_point_into_the_repository():
    """Code cites the design by docs/DESIGN.md §N, and every cited section exists."""
    design = (REPO / "docs" / "DESIGN.md").read_text()
    sections = set(re.findall(r"^##+ (\d+(?:\.\d+)?)\.? ", design, re.M))
    missing = []
    for p in sorted(PKG.rglob("*.py")) + sorted((REPO / "tests").rglob("*.py")) + sorted((REPO / "ffi").rglob("*")):
        if not p.is_file() or p.name == "test_contracts.py":
            continue
        text = p.read_text(errors="replace")
        assert not re.search(r"\bSPEC §", text), f"{p.relative_to(REPO)} cites SPEC (use docs/DESIGN.md §N)"
        for sec in re.findall(r"DESIGN\.md §(\d+(?:\.\d+)?)", text):
            if sec not in sections:
                missing.append(f"{p.relative_to(REPO)}: §{sec}")
    assert not missing, missing
