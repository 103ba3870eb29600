"""Shared fixtures and options: random seeds that can be replayed, and ``--require-gpu``.

Tests that take the ``seed`` (or ``rng``) fixture run once per seed of
``SEEDS``: fixed regression seeds plus "fresh", a new random seed per run of
pytest (shown in the pytest header and under every failure).  Replay a failure
with ``pytest 'THE_TEST_ID' --seed N``: ``--seed`` sets the seed the "fresh"
parameter uses.

GPU tests name the pieces of the GPU stack they need (tests/gpu.py).  Where one
is missing they skip; with ``--require-gpu`` the run instead stops before any
test runs, with one message naming each missing piece and how to install it
(exit status 4), so that a green run on a GPU node means the GPU tests ran.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from compile_progress import pytest_sessionstart  # noqa: F401  (kernel-compile progress lines)

import gpu

# JAX and CuPy share the one GPU in a test process: JAX must not take most of its memory first.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

FRESH = "fresh"
SEEDS = [0, 1, 12345, FRESH]


def pytest_addoption(parser):
    parser.addoption("--seed", type=int, default=None,
                     help="seed for the 'fresh' parameter of seeded tests (replay a failure)")
    parser.addoption("--require-gpu", action="store_true", default=False,
                     help="fail the run, before any test runs, when a selected GPU test would skip for a "
                          "missing piece of the GPU stack (no GPU, no GPU backend in jax, no CuPy, no FFI "
                          "library, no cubins, no nvcc); other skips are listed by reason")


def pytest_configure(config):
    seed = config.getoption("--seed")
    if seed is None:
        seed = int.from_bytes(os.urandom(4), "little")
    config._fresh_seed = seed
    config.addinivalue_line("markers", f"{gpu.MARK}(*pieces): needs these pieces of the GPU stack (tests/gpu.py)")
    if config.getoption("--require-gpu") and "s" not in config.option.reportchars and "a" not in config.option.reportchars:
        config.option.reportchars += "s"  # the skips that remain, listed by reason


@pytest.hookimpl(trylast=True)  # after -m / -k deselected what will not run
def pytest_collection_modifyitems(config, items):
    """Skip the GPU tests whose stack is missing, or, with --require-gpu, stop the run."""
    need: dict[str, list] = {}
    for item in items:
        pieces = [p for m in item.iter_markers(gpu.MARK) for p in m.args]
        if not pieces and item.get_closest_marker("gpu"):
            pieces = ["gpu"]  # (a GPU test that names nothing else still needs a GPU)
        if pieces:
            need[item.nodeid] = pieces
    if config.getoption("--require-gpu"):
        wanted = {p for pieces in need.values() for p in pieces}
        gone = [p for p in gpu.PIECES if p in wanted and gpu.missing(p)]
        if gone:
            lines = "\n".join(f"  - {why}" for why in dict.fromkeys(gpu.missing(p) for p in gone))
            n = sum(1 for pieces in need.values() if set(pieces) & set(gone))
            raise pytest.UsageError(f"--require-gpu: {n} selected GPU test(s) cannot run here, the GPU stack "
                                    f"is incomplete:\n{lines}")
        return
    for item in items:
        p = gpu.first_missing(need.get(item.nodeid, ()))
        if p:
            item.add_marker(pytest.mark.skip(reason=gpu.missing(p)))


def pytest_report_header(config):
    return f"fresh seed: {config._fresh_seed} (replay with --seed {config._fresh_seed})"


@pytest.fixture(params=SEEDS)
def seed(request) -> int:
    s = request.config._fresh_seed if request.param == FRESH else request.param
    request.node.user_properties.append(("seed", s))
    return s


@pytest.fixture
def rng(seed) -> np.random.Generator:
    return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.failed:
        seeds = [v for k, v in item.user_properties if k == "seed"]
        if seeds:
            fresh = getattr(item, "callspec", None) and item.callspec.params.get("seed") == FRESH
            how = f" --seed {seeds[0]}" if fresh else ""
            rep.sections.append(("seed", f"seed={seeds[0]}; replay: pytest '{item.nodeid}'{how}"))
