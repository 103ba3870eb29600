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
    (dict(interleave=0), r"interleave=0 must be in \[1, 2147483647\]"),
    (dict(world=16, rank=0, interleave=2**20), "global positions of 24 bits; the GPU kernels take up to 22"),
])
def test_bad_arguments_fail_before_any_gpu_work(kw, match):
    args = dict(topk=2048, local_topk=512, max_rows=64, world=4, rank=0)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        Exchange.create(**args)


@pytest.mark.parametrize("score_dtype, exc, match", [
    ("float32", NotImplementedError, "score_dtype=float32: the GPU kernels take bfloat16 scores; float32 scores "
                                     "merge exactly on the XLA path"),
    ("float16", TypeError, "score dtype must be bfloat16 or float32, got 'float16'"),
])
def test_score_dtypes_the_kernels_do_not_take(score_dtype, exc, match):
    with pytest.raises(exc, match=match):
        Exchange.create(topk=2048, local_topk=512, max_rows=64, world=4, rank=0, score_dtype=score_dtype)


def test_create_local_needs_distinct_gpus():
    with pytest.raises(ValueError, match="distinct GPUs"):
        Exchange.create_local([0, 0], topk=2048, local_topk=512, max_rows=8)


def _polled_exchange(words, *, freed=False):
    """An Exchange without GPU memory: only what poll() reads (its pinned status copy)."""
    import numpy as np

    ex = object.__new__(Exchange)
    ex.id, ex.rank, ex.timeout_us, ex.closed = 5, 1, 500000, False
    ex._host_view = np.array(words, np.int32)
    if freed:
        ex._freed = True
    return ex


def test_poll_raises_on_every_call_after_a_failure_until_close():
    from jax_dsa_exchange import layout

    _polled_exchange([layout.STATUS_OK, 0, 0, 0]).poll()  # healthy: nothing
    ex = _polled_exchange([layout.STATUS_TIMEOUT_ROUND1, 6, 3, 2])
    for _ in range(2):  # sticky: every later step raises too
        with pytest.raises(RuntimeError, match=r"rank 2 did not deliver its candidates for row 6 at epoch 3 "
                                               r"within 500000 us; recreate the exchange"):
            ex.poll()
    assert ex.closed  # further traces refuse it (op._validate)
    with pytest.raises(RuntimeError, match="did not deliver its rescue list"):
        _polled_exchange([layout.STATUS_TIMEOUT_RESCUE, 0, 1, 0]).poll()
    with pytest.raises(RuntimeError, match="is closed"):
        _polled_exchange([layout.STATUS_CLOSED, 0, 0, 0]).poll()
    # after close(): silent (a replay's kernels do no work; a recreated exchange is not blocked)
    _polled_exchange([layout.STATUS_TIMEOUT_ROUND1, 6, 3, 2], freed=True).poll()



@pytest.mark.parametrize("cc, arch, want", [
    ("90", None, "sm_90a"), ("100", None, "sm_100a"), ("103", None, "sm_103a"), ("90", "sm_90a", "sm_90a"),
    ("100", "sm_90a", r"arch='sm_90a' but GPU 0 is sm_100a: kernels of one target run on that compute "
                      r"capability only .*--arch sm_100a"),
    ("80", None, r"GPU 0 is sm_80a \(compute capability 8.0\); the kernels build for sm_90a, sm_100a, sm_103a only"),
    ("90", "sm_75", r"arch='sm_75': the kernels build for sm_90a, sm_100a, sm_103a"),
])
def test_the_kernels_target_is_the_devices(monkeypatch, cc, arch, want):
    """Exchange takes its device's target (layout.ARCHS); another one, or a device the kernels
    do not build for, is a ValueError naming the device's target and what to do."""
    from types import SimpleNamespace

    from jax_dsa_exchange import exchange

    device = SimpleNamespace(compute_capability=cc)
    monkeypatch.setattr(exchange, "_cupy", lambda: SimpleNamespace(cuda=SimpleNamespace(Device=lambda o: device)))
    if want.startswith("sm_"):
        assert exchange._device_arch(0, arch) == want
    else:
        with pytest.raises(ValueError, match=want):
            exchange._device_arch(0, arch)


def test_the_producer_split_follows_the_devices_sms():
    """The metadata's fill CTAs (measured on 132-SM parts) scale with the device's SM count:
    unchanged on H100 SXM / H200, one CTA per SM on a 148-SM part, the lean image's half too."""
    from jax_dsa_exchange import layout

    sp, lean = layout.producer_split(), layout.producer_lean_split()
    assert layout.split_for_device(sp, 132) == sp and layout.split_for_device(lean, 132) == lean
    assert layout.split_for_device(sp, 148)["fill_ctas"] == 148
    assert layout.split_for_device(sp, 114)["fill_ctas"] == 114
    assert layout.split_for_device(lean, 148)["fill_ctas"] == 64 * 148 // 132
    assert {k: v for k, v in layout.split_for_device(sp, 148).items() if k != "fill_ctas"} == \
        {k: v for k, v in sp.items() if k != "fill_ctas"}
