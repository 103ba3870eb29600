"""Contracts between layers that no other test pins down: private JAX APIs confined
to one module."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
PKG = REPO / "jax_dsa_exchange"


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
