"""Tests that run in every rank of a launched job (see conftest.py)."""

import os

import numpy as np
import pytest

from jax_dsa_exchange import distributed, reference
from jax_dsa_exchange.testing import cases


def test_xla_path_matches_the_oracle_on_this_rank():
    import jax

    from jax_dsa_exchange.xla_path import xla_topk_merge_sharded

    world, rank = jax.process_count(), jax.process_index()
    mesh = distributed.dcp_mesh("dcp", world)
    rng = np.random.default_rng(7)  # the same data on every rank
    case = cases.random_case(rng, world=world, topk=64, local_topk=32, rows=8, cols=300,
                             distinct_values=5)
    put = lambda x: distributed.shard_ranks(mesh, "dcp", x)  # noqa: E731
    out = jax.jit(lambda *a: xla_topk_merge_sharded(mesh, "dcp", *a, topk=64, block_size=16,
                                                    with_ids=True))(
        put(case.logits), put(case.row_ends), put(case.req_id), put(case.block_tables))
    want = reference.topk_merge(*case.args, topk=64, block_size=16)[rank]
    got = {k: distributed.rank_shards(getattr(out, k))[rank] for k in ("kv_rows", "counts", "ids")}
    for k, g in got.items():
        np.testing.assert_array_equal(g, getattr(want, k), err_msg=f"rank {rank} {k}")


def test_fails_on_the_rank_named_by_the_environment():
    """A deliberate failure on one rank (for the launcher's failure test); passes otherwise."""
    bad = os.environ.get("DSA_TEST_FAIL_RANK")
    if bad is not None and int(bad) == distributed.rank():
        pytest.fail(f"deliberate failure on rank {bad}")
