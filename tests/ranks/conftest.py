"""pytest in every rank: ``python -m jax_dsa_exchange.launch -n W -- python -m pytest tests/ranks``.

Each process joins the job (jax.distributed, gloo on CPU) before any test runs, so the
tests here see W ranks; the launcher fails the run if pytest fails on any rank.  Run
without the launcher (e.g. by the main test suite) these tests skip.
"""

import pathlib

import pytest

from jax_dsa_exchange import distributed


def pytest_configure(config):
    if distributed.launched():
        distributed.initialize()


HERE = pathlib.Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    # This hook sees every collected item, not only this folder's: skip just ours.
    if not distributed.launched():
        skip = pytest.mark.skip(reason="runs only under python -m jax_dsa_exchange.launch")
        for item in items:
            if HERE in pathlib.Path(item.fspath).parents:
                item.add_marker(skip)
