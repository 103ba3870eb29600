"""Exchange creation: bad arguments fail in Python before any GPU work (no GPU needed)."""

import pytest

from jax_dsa_exchange.exchange import Exchange


@pytest.mark.parametrize("kw,match", [
    (dict(topk=100), "topk=100 must be a multiple of 32"),
    (dict(topk=8192), "topk=8192 must be a multiple of 32 in \\[64, 4096\\]"),
    (dict(local_topk=48), "local_topk=48 must be a multiple of 32"),
    (dict(local_topk=4096), "local_topk=4096 must be a multiple of 32 in \\[32, topk=2048\\]"),
    (dict(max_rows=0), "max_rows=0 must be a positive int"),
    (dict(world=17), "world=17 must be in \\[1, 16\\]"),
    (dict(rank=4), "rank=4 must be in \\[0, world=4\\)"),
    (dict(timeout_us=0), "timeout_us=0 must be a positive int32"),
])
def test_bad_arguments_fail_before_any_gpu_work(kw, match):
    args = dict(topk=2048, local_topk=512, max_rows=64, world=4, rank=0)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        Exchange.create(**args)


def test_create_local_needs_distinct_gpus():
    with pytest.raises(ValueError, match="distinct GPUs"):
        Exchange.create_local([0, 0], topk=2048, local_topk=512, max_rows=8)
