"""Shared fixtures: random seeds that can be replayed.

Tests that take the ``seed`` (or ``rng``) fixture run once per seed of
``SEEDS``: fixed regression seeds plus "fresh", a new random seed per session
(shown in the pytest header and under every failure).  Replay a failure with
``pytest 'THE_TEST_ID' --seed N``: ``--seed`` sets the seed the "fresh"
parameter uses.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from compile_progress import pytest_sessionstart  # noqa: F401  (kernel-compile progress lines)

FRESH = "fresh"
SEEDS = [0, 1, 12345, FRESH]


def pytest_addoption(parser):
    parser.addoption("--seed", type=int, default=None,
                     help="seed for the 'fresh' parameter of seeded tests (replay a failure)")


def pytest_configure(config):
    seed = config.getoption("--seed")
    if seed is None:
        seed = int.from_bytes(os.urandom(4), "little")
    config._fresh_seed = seed


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
