"""topk_exchange_merge: validation (the same on every path), CUDA lowering (custom calls,
side effects, token order) inside jit / scan / fori_loop / shard_map, no grad / vmap on any
path, the XLA path delegation; on a GPU, the FFI path end to end with stand-in kernels."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from gpu import requires
from jax_dsa_exchange import _ffi
from jax_dsa_exchange.kernels.abi import MERGE as MG
from jax_dsa_exchange.kernels.abi import SELECT_PUSH as SP
from jax_dsa_exchange.op import MergeOutput, topk_exchange_merge

REPO = pathlib.Path(__file__).resolve().parents[1]


@dataclasses.dataclass
class DummyExchange:
    id: int = 7
    world: int = 2
    rank: int = 0
    topk: int = 64
    local_topk: int = 32
    max_rows: int = 16
    closed: bool = False
    interleave: int = 1


R, L, NREQ, PAGES, B = 4, 256, 3, 8, 32


def sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


ARGS = (sds((R, L), jnp.bfloat16), sds((R,), jnp.int32), sds((R,), jnp.int32), sds((NREQ, PAGES), jnp.int32))


def cuda_text(fn, *args):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def custom_calls(text):
    """[(result names, target, operand names, attrs)] of every custom call, in text order."""
    out = []
    for m in re.finditer(r"(%[\w#:]+)\s*=\s*stablehlo\.custom_call @(\w+)\(([^)]*)\)\s*\{([^}]*\})", text):
        out.append((m.group(1), m.group(2), [s.strip() for s in m.group(3).split(",")], m.group(4)))
    return out


# ----------------------------------------------------------------------------- validation


def _call(**kw):
    ex = kw.pop("exchange", DummyExchange())
    a = dict(
        logits=jnp.zeros((R, L), jnp.bfloat16), row_ends=jnp.zeros((R,), jnp.int32),
        req_id=jnp.zeros((R,), jnp.int32), block_table=jnp.zeros((NREQ, PAGES), jnp.int32),
    )
    a.update({k: kw.pop(k) for k in list(kw) if k in a})
    kw.setdefault("block_size", B)
    kw.setdefault("path", "ffi")
    return topk_exchange_merge(ex, a["logits"], a["row_ends"], a["req_id"], a["block_table"], **kw)


@pytest.mark.parametrize(
    "kw, exc, msg",
    [
        (dict(exchange=DummyExchange(closed=True)), ValueError, "exchange 7 is closed"),
        (dict(logits=jnp.zeros((R, L), jnp.float32)), TypeError, "logits are float32 but the exchange's GPU kernels take bfloat16"),
        (dict(logits=jnp.zeros((R, L, 1), jnp.bfloat16)), ValueError, r"logits must be \[R, L\]"),
        (dict(logits=sds((17, L), jnp.bfloat16)), ValueError, r"R=17 rows > the exchange's max_rows=16"),
        (dict(logits=sds((0, L), jnp.bfloat16)), ValueError, "R=0 rows"),
        (dict(logits=sds((R, (1 << 17) + 1), jnp.bfloat16)), ValueError, r"L=131073 columns"),
        (dict(logits=sds((R, 0), jnp.bfloat16)), ValueError, r"L=0 columns"),
        (dict(row_ends=np.zeros((R,), np.int64)), TypeError, "row_ends must be int32, got int64"),
        (dict(row_ends=jnp.zeros((R + 1,), jnp.int32)), ValueError, r"row_ends must have shape \(R,\) = \(4,\)"),
        (dict(req_id=jnp.zeros((R,), jnp.float32)), TypeError, "req_id must be int32"),
        (dict(req_id=jnp.zeros((R, 1), jnp.int32)), ValueError, "req_id must have shape"),
        (dict(block_table=jnp.zeros((NREQ,), jnp.int32)), ValueError, "block_table must be"),
        (dict(block_table=jnp.zeros((0, PAGES), jnp.int32)), ValueError, "block_table must be"),
        (dict(block_table=jnp.zeros((NREQ, PAGES), jnp.uint32)), TypeError, "block_table must be int32"),
        (dict(block_size=0), ValueError, "block_size=0 must be >= 1"),
        (dict(block_size=True), TypeError, "block_size must be an int"),
        (dict(block_size=2.0), TypeError, "block_size must be an int"),
        (dict(with_ids=1), TypeError, "with_ids must be a bool"),
        (dict(path="cuda"), ValueError, "path='cuda' must be one of"),
        (dict(path="xla"), ValueError, "needs axis_name"),
        (dict(exchange=object()), TypeError, "exchange must have attribute 'id'"),
        (dict(exchange=DummyExchange(world=17)), ValueError, r"world=17 must be in \[1, 16\]"),
        (dict(exchange=DummyExchange(topk=100)), ValueError, "topk=100 must be a multiple of 32"),
        (dict(exchange=DummyExchange(local_topk=128)), ValueError, r"local_topk=128 must be a multiple of 32 in \[32, topk=64\]"),
        (dict(ordered=None), TypeError, "ordered must be True, False or 'effect'"),
        (dict(ordered="yes"), TypeError, "ordered must be True, False or 'effect'"),
    ],
)
def test_validation(kw, exc, msg):
    with pytest.raises(exc, match=msg):
        _call(**kw)


# Every path checks its arguments with one function (jax_dsa_exchange/checks.py): the same
# bad argument raises the same exception with the same message on the FFI path, the XLA
# path through topk_exchange_merge, and xla_path.xla_topk_merge called directly, at trace
# time (before any custom call or collective).  On CPU the FFI path is traced, not run.
MERGE_PATHS = ("ffi", "xla", "xla_topk_merge")


def _merge_fn(path, ex, **kw):
    """Per-rank merge ``fn(logits, row_ends, req_id, block_table) -> MergeOutput`` of one path."""
    if path == "xla_topk_merge":
        from jax_dsa_exchange import xla_path

        kw.setdefault("topk", ex.topk)
        return lambda *a: xla_path.xla_topk_merge(*a, axis_name="dcp", **kw)
    if path == "xla":
        kw["axis_name"] = "dcp"
    return lambda *a: topk_exchange_merge(ex, *a, path=path, **kw)


def _over_one_rank(per_rank, reduce=None):
    """``per_rank`` inside a jitted shard_map over a one-device "dcp" axis: arguments and
    results carry a leading rank axis of size 1 (``reduce``: a per-rank scalar instead)."""
    def body(*a):
        out = per_rank(*(x[0] for x in a))
        if reduce is not None:
            return reduce(out)[None]
        return tuple(x[None] for x in out if x is not None)

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("dcp",))  # Auto axis: unsharded inputs pass
    return jax.shard_map(body, mesh=mesh, in_specs=P("dcp"), out_specs=P("dcp"))


def _rank_args(**over):
    a = dict(logits=sds((R, L), jnp.bfloat16), row_ends=sds((R,), jnp.int32), req_id=sds((R,), jnp.int32),
             block_table=sds((NREQ, PAGES), jnp.int32))
    a.update(over)
    return [sds((1,) + tuple(x.shape), x.dtype) for x in a.values()]  # the rank axis in front


BAD_ON_EVERY_PATH = [
    (dict(logits=sds((R, L), jnp.float16)), TypeError, "logits must be bfloat16 or float32, got float16"),
    (dict(interleave=0), ValueError, r"interleave=0 must be in \[1, 2147483647\]"),
    (dict(interleave=1.0), TypeError, "interleave must be an int, got float 1.0"),
    (dict(logits=sds((R, L, 1), jnp.bfloat16)), ValueError, r"logits must be \[R, L\], got shape \(4, 256, 1\)"),
    (dict(logits=sds((0, L), jnp.bfloat16)), ValueError, "logits has R=0 rows"),
    (dict(logits=sds((R, 0), jnp.bfloat16)), ValueError, "logits has L=0 columns"),
    (dict(logits=sds((R, (1 << 17) + 1), jnp.bfloat16)), ValueError, "logits has L=131073 columns"),
    (dict(row_ends=sds((R,), jnp.float32)), TypeError, "row_ends must be int32, got float32"),
    (dict(row_ends=sds((R,), jnp.int16)), TypeError, "row_ends must be int32, got int16"),
    (dict(row_ends=sds((1,), jnp.int32)), ValueError, r"row_ends must have shape \(R,\) = \(4,\), got \(1,\)"),
    (dict(row_ends=sds((R, 1), jnp.int32)), ValueError, r"row_ends must have shape \(R,\) = \(4,\), got \(4, 1\)"),
    (dict(req_id=sds((R,), jnp.float32)), TypeError, "req_id must be int32, got float32"),
    (dict(req_id=sds((1,), jnp.int32)), ValueError, r"req_id must have shape \(R,\) = \(4,\), got \(1,\)"),
    (dict(block_table=sds((NREQ, PAGES), jnp.float32)), TypeError, "block_table must be int32, got float32"),
    (dict(block_table=sds((NREQ, PAGES), jnp.uint32)), TypeError, "block_table must be int32, got uint32"),
    (dict(block_table=sds((NREQ,), jnp.int32)), ValueError, r"block_table must be \[num_requests >= 1, max_pages >= 1\], got shape \(3,\)"),
    (dict(block_table=sds((1, NREQ, PAGES), jnp.int32)), ValueError, r"block_table must be \[num_requests"),
    (dict(block_table=sds((NREQ, 0), jnp.int32)), ValueError, r"block_table must be \[num_requests"),
    (dict(block_size=0), ValueError, "block_size=0 must be >= 1"),
    (dict(block_size=True), TypeError, "block_size must be an int, got True"),
    (dict(block_size=2.0), TypeError, "block_size must be an int, got 2.0"),
    (dict(with_ids=1), TypeError, "with_ids must be a bool, got 1"),
    (dict(with_saturated="yes"), TypeError, "with_saturated must be a bool, got 'yes'"),
    (dict(topk=100), ValueError, r"topk=100 must be a multiple of 32 in \[64, 4096\]"),
    (dict(topk=32), ValueError, r"topk=32 must be a multiple of 32 in \[64, 4096\]"),
]


def _case_id(kw):
    return "-".join(f"{k}={v.dtype.name}{list(v.shape)}" if hasattr(v, "shape") else f"{k}={v!r}"
                    for k, v in kw.items())


@pytest.mark.parametrize("path", MERGE_PATHS)
@pytest.mark.parametrize("kw, exc, msg", [pytest.param(*c, id=_case_id(c[0])) for c in BAD_ON_EVERY_PATH])
def test_every_path_rejects_the_same_arguments_the_same_way(path, kw, exc, msg):
    kw = dict(kw)
    ex = DummyExchange(world=1, topk=kw.pop("topk", 64))
    arrays = {k: kw.pop(k) for k in ("logits", "row_ends", "req_id", "block_table") if k in kw}
    kw.setdefault("block_size", B)
    fn = _over_one_rank(_merge_fn(path, ex, **kw))
    with pytest.raises(exc, match=msg):
        jax.jit(fn).trace(*_rank_args(**arrays))
    # The same call with good arguments traces (and, off the FFI path, runs).
    good = _over_one_rank(_merge_fn(path, DummyExchange(world=1), block_size=B))
    jax.jit(good).trace(*_rank_args())


@pytest.mark.parametrize("path", ["ffi", "xla"])
def test_the_op_takes_the_kernels_score_dtype_and_the_exchanges_interleave(path):
    """The FFI path takes the kernels' bfloat16 logits (float32 is a TypeError naming both
    dtypes and the XLA path), the XLA path either dtype; a call's interleave, when given, must
    be its exchange's (a ValueError naming both values)."""
    f32 = _rank_args(logits=sds((R, L), jnp.float32))
    fn = _over_one_rank(_merge_fn(path, DummyExchange(world=1), block_size=B))
    if path == "ffi":
        with pytest.raises(TypeError, match="logits are float32 but the exchange's GPU kernels take bfloat16 "
                                            r"\(score_dtype=bfloat16\).*path='xla'"):
            jax.jit(fn).trace(*f32)
    else:
        jax.jit(fn).trace(*f32)
    with pytest.raises(ValueError, match="interleave=2 but exchange 7 was created with interleave=1"):
        jax.jit(_over_one_rank(_merge_fn(path, DummyExchange(world=1), block_size=B, interleave=2))).trace(
            *_rank_args())
    i16 = DummyExchange(world=1, interleave=16)
    for interleave in (None, 16):
        jax.jit(_over_one_rank(_merge_fn(path, i16, block_size=B, interleave=interleave))).trace(*_rank_args())


@pytest.mark.parametrize("path", ["ffi", "xla"])
@pytest.mark.parametrize("ex, msg", [
    (DummyExchange(world=1, max_rows=2), "R=4 rows > the exchange's max_rows=2"),
    (DummyExchange(world=1, local_topk=96), r"local_topk=96 must be a multiple of 32 in \[32, topk=64\]"),
    (DummyExchange(world=0), r"world=0 must be in \[1, 16\]"),
])
def test_both_paths_of_the_op_check_the_exchange(path, ex, msg):
    with pytest.raises(ValueError, match=msg):
        jax.jit(_over_one_rank(_merge_fn(path, ex, block_size=B))).trace(*_rank_args())


def test_xla_path_checks_the_axis():
    with pytest.raises(ValueError, match=r"exchange 7 has world=2 but the mesh axis 'dcp' has 1 ranks"):
        jax.jit(_over_one_rank(_merge_fn("xla", DummyExchange(world=2), block_size=B))).trace(*_rank_args())
    from jax_dsa_exchange import xla_path

    with pytest.raises(ValueError, match="axis_name='dcp' is not a mesh axis here"):
        jax.jit(lambda *a: xla_path.xla_topk_merge(*a, axis_name="dcp", topk=64, block_size=B)).trace(
            *(sds(x.shape[1:], x.dtype) for x in _rank_args()))


# ----------------------------------------------------------------------------- lowering


def _op(ex=DummyExchange(), **kw):
    kw.setdefault("block_size", B)
    kw.setdefault("path", "ffi")

    def f(lg, re_, rq, bt):
        return topk_exchange_merge(ex, lg, re_, rq, bt, **kw)

    return f


def test_lowering_two_custom_calls_in_token_order():
    text = cuda_text(_op(with_ids=True, with_saturated=True), *ARGS)
    calls = custom_calls(text)
    assert [c[1] for c in calls] == ["dsa_select_push", "dsa_merge"]
    (push_res, _, push_ops, push_attrs), (merge_res, _, merge_ops, merge_attrs) = calls
    for attrs in (push_attrs, merge_attrs):
        assert "has_side_effect = true" in attrs
        assert "exchange_id = 7 : i64" in attrs
    assert "block_size = 32 : i32" in merge_attrs
    assert "with_ids = true" in merge_attrs and "with_saturated = true" in merge_attrs
    # The default has no JAX effect: no token enters or leaves the program (C++ fast path,
    # no host wait); select_push starts a chain, merge follows it.  Both results are
    # tuples holding a token (XLA's dynamic-slice fusion must leave the calls alone, op.py).
    assert "jax.token" not in text
    assert re.search(re.escape(push_ops[0]) + r" = stablehlo.create_token", text)
    assert merge_ops[0] == push_res.split(":")[0] + "#0"
    assert re.search(r"stablehlo.custom_call @dsa_select_push[^\n]*-> \(!stablehlo.token, tensor<i32>\)", text)
    assert re.search(r"stablehlo.custom_call @dsa_merge[^\n]*-> \(!stablehlo.token, tensor<4x64xi32>, "
                     r"tensor<4xi32>, tensor<4x64xi32>, tensor<4xi32>\)", text)
    assert not jax.make_jaxpr(_op())(*ARGS).effects


def test_effect_mode_threads_jax_ordered_effect_token():
    """ordered="effect": JAX's ordered effect; its token enters the program, goes through
    select_push, then merge, and leaves the program."""
    text = cuda_text(_op(ordered="effect"), *ARGS)
    (push_res, _, push_ops, _), (merge_res, _, merge_ops, _) = custom_calls(text)
    assert re.search(r"@main\(%arg0: !stablehlo.token \{jax.token = true\}", text)
    assert push_ops[0] == "%arg0"
    assert merge_ops[0] == push_res.split(":")[0] + "#0"
    assert re.search(r"return " + re.escape(merge_res.split(":")[0]) + r"#0,", text)
    assert jax.make_jaxpr(_op(ordered="effect"))(*ARGS).effects


def test_lowering_optional_outputs_absent():
    text = cuda_text(_op(), *ARGS)
    merge = custom_calls(text)[1]
    assert "with_ids = false" in merge[3] and "with_saturated = false" in merge[3]
    assert re.search(r"stablehlo.custom_call @dsa_merge[^\n]*-> \(!stablehlo.token, tensor<4x64xi32>, tensor<4xi32>\)", text)
    out = jax.eval_shape(_op(), *ARGS)
    assert isinstance(out, MergeOutput) and out.ids is None and out.saturated is None
    assert out.kv_rows.shape == (R, 64) and out.counts.shape == (R,)


def _tok(call):
    return call[0].split(":")[0] + "#0"  # "%3:3" -> its token result "%3#0"


@pytest.mark.parametrize("ordered", [True, "effect"])
def test_two_calls_chain_and_unused_results_are_kept(ordered):
    op = _op(ordered=ordered)

    def f(*a):
        op(*a)  # results unused: must not be dropped
        op(*a)  # identical call: must not be merged with the first
        return jnp.int32(0)

    calls = custom_calls(cuda_text(f, *ARGS))
    assert [c[1] for c in calls] == ["dsa_select_push", "dsa_merge"] * 2
    # token chain: push1 -> merge1 -> push2 -> merge2
    assert calls[1][2][0] == _tok(calls[0])
    assert calls[2][2][0] == _tok(calls[1])
    assert calls[3][2][0] == _tok(calls[2])


def test_independent_calls_run_in_program_order():
    """Two calls on unrelated data (and two exchanges) in one body: the second's
    select_push takes the first's merge token, so XLA cannot swap them; the chain goes
    on through calls with used and unused outputs alike, in program order."""
    op7, op8 = _op(), _op(DummyExchange(id=8))

    def f(lg, re_, rq, bt):
        a = op7(lg, re_, rq, bt)
        b = op8(lg * 2, re_ + 1, rq, bt)  # independent of a
        op7(lg, re_ - 1, rq, bt)  # unused
        c = op8(-lg, re_, rq, bt)
        return a.counts, b.counts, c.counts

    text = cuda_text(f, *ARGS)
    calls = custom_calls(text)
    assert [c[1] for c in calls] == ["dsa_select_push", "dsa_merge"] * 4
    assert [re.search(r"exchange_id = (\d+)", c[3]).group(1) for c in calls[::2]] == ["7", "8", "7", "8"]
    for prev, nxt in zip(calls, calls[1:]):
        assert nxt[2][0] == _tok(prev), (prev, nxt)
    assert text.count("stablehlo.create_token") == 1


def test_unused_calls_in_loops_and_inner_jits_are_kept():
    """A call whose outputs are unused stays, also inside a loop / inner jit whose outputs
    are all unused (JAX's DCE would drop such a loop whole: op.py wraps those rules)."""
    op = _op()

    def scan_unused(*a):
        lax.scan(lambda c, _: (c, op(*a).counts), jnp.int32(0), None, length=3)
        return jnp.int32(0)

    def fori_unused(*a):
        lax.fori_loop(0, 3, lambda i, c: c + op(*a).counts, jnp.zeros((R,), jnp.int32))
        return jnp.int32(0)

    def cond_unused(*a):
        lax.cond(a[1][0] > 0, lambda: op(*a).counts, lambda: jnp.zeros((R,), jnp.int32))
        return jnp.int32(0)

    def jit_unused(*a):
        jax.jit(lambda *b: op(*b).counts)(*a)
        return jnp.int32(0)

    def body_output_unused(*a):
        def body(c, _):
            op(*a)
            return c + 1, None
        return lax.scan(body, jnp.int32(0), None, length=3)[0]

    for fn in (scan_unused, fori_unused, cond_unused, jit_unused, body_output_unused):
        calls = [c[1] for c in custom_calls(cuda_text(fn, *ARGS))]
        assert calls == ["dsa_select_push", "dsa_merge"], (fn.__name__, calls)
    # An equation without the op is still removed as before.
    def plain_unused(x):
        lax.scan(lambda c, _: (c + 1, None), x, None, length=3)
        return x
    assert "while" not in jax.jit(plain_unused).lower(jnp.int32(0)).as_text()


def test_unordered_mode_has_no_chain_between_calls():
    """ordered=False: no JAX effect and no chain between calls; select_push -> merge
    still chained by a local token."""
    op = _op(ordered=False)
    jaxpr = jax.make_jaxpr(op)(*ARGS)
    assert not jaxpr.effects
    text = cuda_text(lambda *a: (op(*a).counts, op(*a).counts), *ARGS)
    assert "jax.token" not in text
    calls = custom_calls(text)
    assert [c[1] for c in calls] == ["dsa_select_push", "dsa_merge"] * 2
    for push, merge in (calls[0:2], calls[2:4]):
        assert re.search(re.escape(push[2][0]) + r" = stablehlo.create_token", text)
        assert merge[2][0] == _tok(push)
    assert all("has_side_effect = true" in c[3] for c in calls)


@pytest.mark.parametrize("ordered", [True, "effect"])
def test_lowering_inside_scan_and_fori_loop(ordered):
    op = _op(ordered=ordered)

    def scanned(*a):
        def body(c, _):
            return c + op(*a).counts + op(*a).counts, None

        return lax.scan(body, jnp.zeros((R,), jnp.int32), None, length=3)[0]

    def looped(*a):
        return lax.fori_loop(0, 3, lambda i, c: c + op(*a).counts + op(*a).counts, jnp.zeros((R,), jnp.int32))

    for fn in (scanned, looped):
        text = cuda_text(fn, *ARGS)
        assert "stablehlo.while" in text
        calls = custom_calls(text)
        # the calls sit in the body, once each (no copy outside the loop), chained
        assert [c[1] for c in calls] == ["dsa_select_push", "dsa_merge"] * 2
        for prev, nxt in zip(calls, calls[1:]):
            assert nxt[2][0] == _tok(prev)
        if ordered == "effect":  # the effect token is a loop-carried value
            assert re.search(r"stablehlo.while\(%iterArg = %arg0,", text)
        else:
            assert "jax.token" not in text


def test_scan_and_unrolled_loops_lower_to_the_same_calls():
    """A layer loop in lax.scan and unrolled in Python: the same custom calls, each
    once per layer, chained in layer order (unrolled) / once in the body (scan)."""
    op = _op()
    layers = 4

    def unrolled(lg, re_, rq, bt):
        c = jnp.zeros((R,), jnp.int32)
        for i in range(layers):
            c = c + op(lg + i, re_, rq, bt).counts
        return c

    def scanned(lg, re_, rq, bt):
        return lax.scan(lambda c, i: (c + op(lg + i.astype(lg.dtype), re_, rq, bt).counts, None),
                        jnp.zeros((R,), jnp.int32), jnp.arange(layers))[0]

    u = custom_calls(cuda_text(unrolled, *ARGS))
    assert [c[1] for c in u] == ["dsa_select_push", "dsa_merge"] * layers
    for prev, nxt in zip(u, u[1:]):
        assert nxt[2][0] == _tok(prev)
    s_ = custom_calls(cuda_text(scanned, *ARGS))
    assert [c[1] for c in s_] == ["dsa_select_push", "dsa_merge"]
    assert [c[3] for c in s_] == [c[3] for c in u[:2]]


def test_lowering_on_cpu_is_a_clear_error():
    with pytest.raises(NotImplementedError, match="runs only on CUDA GPUs"):
        jax.jit(_op()).trace(*ARGS).lower(lowering_platforms=("cpu",))


SHARD_MAP_SCRIPT = textwrap.dedent(
    """
    import os, re
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax, jax.numpy as jnp
    from jax import lax
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jax_dsa_exchange.op import topk_exchange_merge
    class Ex:
        id, world, rank, topk, local_topk, max_rows, closed = 9, 4, None, 64, 32, 16, False
    W, R, L = 4, 4, 256
    mesh = jax.make_mesh((W,), ("dcp",))
    sh = NamedSharding(mesh, P("dcp"))
    args = [jax.ShapeDtypeStruct(s, d, sharding=sh) for s, d in
            [((W, R, L), jnp.bfloat16), ((W, R), jnp.int32), ((W, R), jnp.int32), ((W, 3, 8), jnp.int32)]]
    def per_rank(lg, re_, rq, bt):
        def body(c, _):
            o = topk_exchange_merge(Ex(), lg[0], re_[0], rq[0], bt[0], block_size=4, path="ffi",
                                    ordered={"1": True, "effect": "effect"}[os.environ["ORD"]])
            return c + o.counts, None
        return lax.scan(body, jnp.zeros((R,), jnp.int32), None, length=2)[0][None]
    f = jax.shard_map(per_rank, mesh=mesh, in_specs=P("dcp"), out_specs=P("dcp"))
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mhlo.num_partitions = 4" in text
    assert "sdy.manual_computation(%arg0," in text or "manual_computation" in text
    print("CALLS", re.findall(r"custom_call @(\\w+)", text))
    # Outside shard_map the per-device custom call is refused.
    rep = NamedSharding(mesh, P())
    rargs = [jax.ShapeDtypeStruct(a.shape[1:], a.dtype, sharding=rep) for a in args]
    g = lambda lg, re_, rq, bt: topk_exchange_merge(Ex(), lg, re_, rq, bt, block_size=4, path="ffi").counts
    try:
        jax.jit(g).trace(*rargs).lower(lowering_platforms=("cuda",))
        print("UNSHARDED lowered")
    except ValueError as e:
        print("UNSHARDED", e)
    """
)


@pytest.mark.parametrize("ordered", ["1", "effect"])
def test_lowering_inside_shard_map_multi_device(ordered):
    """The op inside shard_map over 4 devices, in a scan (default and ordered="effect": the
    shardable effect); refused outside shard_map."""
    r = subprocess.run([sys.executable, "-c", SHARD_MAP_SCRIPT], capture_output=True, text=True, cwd=REPO,
                       env=dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", ORD=ordered))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "CALLS ['dsa_select_push', 'dsa_merge']" in r.stdout
    assert "UNSHARDED topk_exchange_merge runs per device" in r.stdout, r.stdout


# ----------------------------------------------------------------------------- no grad, no vmap
# One behaviour on every path: a gradient through the merge and a vmap of it are clear
# errors (checks.NO_GRAD / NO_VMAP).  The XLA path is plain jax.numpy, which JAX would
# differentiate to an all-zero gradient and batch: xla_path's guard refuses both.  vmap
# is an error rather than a batching rule because the FFI path cannot batch a call (one
# call is one exchange round over at most max_rows rows; fold the batch into R).


def _loss(merge):
    def loss(lg, re_, rq, bt):
        o = merge(lg, re_, rq, bt)
        return jnp.sum(o.counts.astype(jnp.float32)) + jnp.sum(lg.astype(jnp.float32))

    return loss


def _valid_rank_arrays(rank_axis=True):
    rng = np.random.default_rng(3)
    a = (jnp.asarray(rng.standard_normal((R, L)), jnp.bfloat16), jnp.asarray(rng.integers(0, L, (R,)), jnp.int32),
         jnp.asarray(rng.integers(0, NREQ, (R,)), jnp.int32), jnp.asarray(rng.integers(0, 50, (NREQ, PAGES)), jnp.int32))
    return tuple(x[None] for x in a) if rank_axis else a


@pytest.mark.parametrize("path", MERGE_PATHS)
def test_grad_is_a_clear_error_on_every_path(path):
    from jax_dsa_exchange import checks

    msg = re.escape(checks.NO_GRAD)
    merge = _merge_fn(path, DummyExchange(world=1), block_size=B)
    loss = _over_one_rank(_loss(merge), reduce=lambda x: x)
    args = _valid_rank_arrays()
    with pytest.raises(NotImplementedError, match=msg):
        jax.jit(jax.grad(lambda lg: loss(lg, *args[1:]).sum())).trace(args[0])
    with pytest.raises(NotImplementedError, match=msg):
        jax.jit(lambda lg: jax.jvp(lambda x: loss(x, *args[1:]), (lg,), (lg,))).trace(args[0])
    # stop_gradient on the logits: the rest of the step differentiates (d sum(lg) = 1).
    sg = _over_one_rank(_loss(lambda lg, *a: merge(lax.stop_gradient(lg), *a)), reduce=lambda x: x)
    grad = jax.jit(jax.grad(lambda lg: sg(lg, *args[1:]).sum()))
    if path == "ffi":  # no GPU needed to show it traces; it runs in the GPU tests
        grad.trace(args[0])
    else:
        np.testing.assert_array_equal(np.asarray(grad(args[0]), np.float32), np.ones((1, R, L), np.float32))


def test_grad_outside_shard_map_is_a_clear_error():
    """The FFI path called on one device, outside shard_map."""
    from jax_dsa_exchange import checks

    args = _valid_rank_arrays(rank_axis=False)
    loss = _loss(_merge_fn("ffi", DummyExchange(), block_size=B))
    with pytest.raises(NotImplementedError, match=re.escape(checks.NO_GRAD)):
        jax.grad(loss)(*args)


@pytest.mark.parametrize("path", MERGE_PATHS)
@pytest.mark.parametrize("where", ["inside shard_map", "around shard_map"])
def test_vmap_is_a_clear_error_on_every_path(path, where):
    from jax_dsa_exchange import checks

    merge = _merge_fn(path, DummyExchange(world=1), block_size=B)
    batched = tuple(jnp.stack([x, x]) for x in _valid_rank_arrays(rank_axis=False))  # [2, ...] each
    if where == "inside shard_map":  # per rank: a batch of 2 calls
        fn = _over_one_rank(lambda *a: jax.vmap(merge)(*a))
        args = tuple(x[None] for x in batched)
    else:  # a batch of 2 whole (one-rank) steps
        fn = jax.vmap(_over_one_rank(merge))
        args = tuple(x[:, None] for x in batched)
    with pytest.raises(NotImplementedError, match=re.escape(checks.NO_VMAP)):
        jax.jit(fn).trace(*args)
    if path != "ffi":  # the same step without vmap runs
        out = jax.jit(_over_one_rank(merge))(*(x[:1] for x in batched))
        assert out[0].shape == (1, R, 64)


# ----------------------------------------------------------------------------- XLA path


@pytest.mark.parametrize("path", ["xla", "auto"])
def test_xla_path_delegates(path):
    from jax_dsa_exchange import xla_path

    if path == "auto" and jax.default_backend() == "gpu":
        pytest.skip("auto means the FFI path on a GPU")
    mesh = jax.make_mesh((1,), ("dcp",))
    rng = np.random.default_rng(0)
    lg = jnp.asarray(rng.standard_normal((1, R, L)), jnp.bfloat16)
    re_ = jnp.asarray(rng.integers(0, L + 5, (1, R)), jnp.int32)
    rq = jnp.asarray(rng.integers(0, NREQ, (1, R)), jnp.int32)
    bt = jnp.asarray(rng.integers(0, 100, (1, NREQ, PAGES)), jnp.int32)
    ex = DummyExchange(world=1)

    def ours(lg, re_, rq, bt):
        o = topk_exchange_merge(ex, lg[0], re_[0], rq[0], bt[0], block_size=B, with_ids=True, path=path,
                                axis_name="dcp")
        assert o.saturated is None
        return o.kv_rows[None], o.counts[None], o.ids[None]

    def theirs(lg, re_, rq, bt):
        o = xla_path.xla_topk_merge(lg[0], re_[0], rq[0], bt[0], axis_name="dcp", topk=ex.topk, block_size=B,
                                    with_ids=True, with_saturated=False)
        return o.kv_rows[None], o.counts[None], o.ids[None]

    sm = lambda fn: jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("dcp"), out_specs=P("dcp")))  # noqa: E731
    sharded = jax.device_put((lg, re_, rq, bt), jax.sharding.NamedSharding(mesh, P("dcp")))
    for a, b in zip(sm(ours)(*sharded), sm(theirs)(*sharded)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ----------------------------------------------------------------------------- GPU, end to end

FAKE_CU = REPO / "ffi" / "testing" / "fake_kernels.cu"
FAKE_TOPK = 64  # compiled into the stand-in kernels


@pytest.mark.gpu
@requires("gpu", "jax", "cupy", "driver", "nvcc")
def test_ffi_path_end_to_end_with_stand_in_kernels(tmp_path):
    """Stand-in kernels with the real ABI: results, device-side epochs advancing once per call
    (jit, eager, scan, fori_loop, shard_map, unused results), scalar params, PDL launch, errors."""
    import cupy as cp
    subprocess.run(["nvcc", "-cubin", "-arch=sm_90a", "-o", str(tmp_path / "f.cubin"), str(FAKE_CU)], check=True)
    subprocess.run(["nvcc", "-ptx", "-arch=sm_90a", "-o", str(tmp_path / "f.ptx"), str(FAKE_CU)], check=True)
    cubin, ptx = (tmp_path / "f.cubin").read_bytes(), (tmp_path / "f.ptx").read_text()

    dev = jax.devices()[0]
    ordinal = dev.local_hardware_id
    max_rows, rows, cols = 16, 5, 300
    with cp.cuda.Device(ordinal):
        state = cp.zeros(2 * max_rows + 8, cp.int32)
        buf = cp.zeros(4 * max_rows, cp.int32)
        peers = cp.asarray([buf.data.ptr], cp.int64)
        cp.cuda.Device(ordinal).synchronize()
    sel = _ffi.load_kernel("e2e_sel", SP.kernel, SP.pairs(), cubin, ptx, "fake_select_push", ordinal, 128, 0)
    mrg = _ffi.load_kernel("e2e_merge", MG.kernel, MG.pairs(), cubin, ptx, "fake_merge", ordinal, 128, 64 << 10)
    assert sel == mrg == "cubin"
    exid = 31337
    _ffi.register_exchange(exid, ordinal, rank=0, world=1, topk=FAKE_TOPK, local_topk=32, max_rows=max_rows,
                           peers=peers.data.ptr, local=buf.data.ptr, state=state.data.ptr, rescue_off=111,
                           flags_off=222, timeout_us=333, merge_grid=2, select_key="e2e_sel",
                           merge_key="e2e_merge")
    ex = DummyExchange(id=exid, world=1, topk=FAKE_TOPK, max_rows=max_rows)
    try:
        rng = np.random.default_rng(1)
        lg_np = rng.standard_normal((rows, cols)).astype(np.float32)
        lg_np[0, :7] = np.nan
        re_np = np.array([cols, 10, -3, cols + 50, 200], np.int32)
        rq_np = np.array([2, 0, 1, 2, 0], np.int32)
        bt_np = rng.integers(0, 1000, (3, 20)).astype(np.int32)
        lg = jnp.asarray(lg_np, jnp.bfloat16)
        args = (lg, jnp.asarray(re_np), jnp.asarray(rq_np), jnp.asarray(bt_np))
        lg_bf = np.asarray(lg).astype(np.float32)
        n = np.clip(re_np, 0, cols)
        pos = np.array([(lg_bf[i, : n[i]] > 0).sum() for i in range(rows)])
        want_counts = np.minimum(pos, FAKE_TOPK)
        j = np.arange(FAKE_TOPK)
        bs = 4
        want_kv = np.where(j[None] < want_counts[:, None], bt_np[rq_np][:, (j // bs) % 20] * bs + j % bs, -1)
        want_ids = np.where(j[None] < want_counts[:, None], j * 16, -1)

        def op(*a):
            return topk_exchange_merge(ex, *a, block_size=bs, with_ids=True, with_saturated=True, path="ffi")

        def epochs():
            jax.effects_barrier()
            cp.cuda.Device(ordinal).synchronize()
            return cp.asnumpy(state)

        f = jax.jit(op)
        for call in (1, 2):
            o = f(*args)
            np.testing.assert_array_equal(np.asarray(o.counts), want_counts)
            np.testing.assert_array_equal(np.asarray(o.kv_rows), want_kv)
            np.testing.assert_array_equal(np.asarray(o.ids), want_ids)
            np.testing.assert_array_equal(np.asarray(o.saturated), np.full(rows, call))
        st = epochs()
        np.testing.assert_array_equal(st[:rows], 2)
        np.testing.assert_array_equal(st[max_rows:max_rows + 8], [rows, cols, 3, 20, bs, 111, 222, 333])

        def scanned(*a):
            def body(c, _):
                return c + op(*a).saturated, None

            return lax.scan(body, jnp.zeros((rows,), jnp.int32), None, length=4)[0]

        np.testing.assert_array_equal(np.asarray(jax.jit(scanned)(*args)), np.full(rows, 3 + 4 + 5 + 6))

        def unused(*a):
            op(*a)
            op(*a)
            return jnp.int32(0)

        jax.jit(unused)(*args)
        np.testing.assert_array_equal(epochs()[:rows], 8)

        np.testing.assert_array_equal(np.asarray(op(*args).saturated), 9)  # eager

        looped = jax.jit(lambda *a: lax.fori_loop(0, 2, lambda i, c: c + op(*a).saturated, jnp.zeros((rows,), jnp.int32)))
        np.testing.assert_array_equal(np.asarray(looped(*args)), 10 + 11)

        mesh = jax.make_mesh((1,), ("dcp",))
        sm = jax.jit(jax.shard_map(lambda *a: op(*(x[0] for x in a)).saturated[None], mesh=mesh,
                                   in_specs=P("dcp"), out_specs=P("dcp")))
        sharded = jax.device_put([x[None] for x in args], jax.sharding.NamedSharding(mesh, P("dcp")))
        np.testing.assert_array_equal(np.asarray(sm(*sharded)), [[12] * rows])
        np.testing.assert_array_equal(epochs()[:rows], 12)
        np.testing.assert_array_equal(epochs()[rows:max_rows], 0)
    finally:
        _ffi.unregister_exchange(exid, ordinal)
    # A program compiled afterwards calls the handler, which reports the missing
    # record.  (An executable that already ran may replay a recorded CUDA graph
    # without calling the handler: see ffi/README.md, exchange lifetime.)
    fresh = jax.jit(lambda *a: op(*a).counts + 0)
    try:
        with pytest.raises(Exception, match=r"no exchange registered \(exchange 31337, device"):
            jax.block_until_ready(fresh(*args))
    finally:
        # The failed call's ordered-effect token carries the error into later
        # effectful calls of this process; drop it so other tests start clean.
        from jax_dsa_exchange._jax_private import clear_runtime_tokens

        clear_runtime_tokens()


FLAGS_SCRIPT = textwrap.dedent(
    """
    import os, sys
    before = os.environ.get("XLA_FLAGS")
    import jax_dsa_exchange.op, jax_dsa_exchange._ffi, jax_dsa_exchange.exchange  # noqa: F401
    import jax_dsa_exchange.bench, jax_dsa_exchange.demo  # noqa: F401
    import jax
    jax.devices()
    print("FLAGS", repr(before), repr(os.environ.get("XLA_FLAGS")))
    """
)


@pytest.mark.parametrize("flags", [None, "--xla_dump_hlo_as_text"])
def test_import_leaves_xla_flags_alone(flags):
    """Importing the op (or anything of the package) changes no process-wide setting."""
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    if flags is not None:
        env["XLA_FLAGS"] = flags
    r = subprocess.run([sys.executable, "-c", FLAGS_SCRIPT], capture_output=True, text=True, cwd=REPO, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"FLAGS {flags!r} {flags!r}" in r.stdout, r.stdout
    assert "dynamic_slice_fusion" not in r.stdout + r.stderr


def test_scan_decode_loop_calls_are_shaped_for_the_dynamic_slice_fusion_to_skip():
    """XLA's GPU DynamicSliceFusionRewriter matches a registered custom call fed by slices
    of a scan's stacked inputs unless its result is a tuple holding a token (its
    IsCustomCall).  In a lax.scan decode loop over stacked per-layer logits (what the pass
    rewrote on jax 0.11.2), both custom calls appear once, inside the loop body, with
    such a result.  (That did not keep jax 0.11.2's XLA from matching them: op.py; the GPU
    test, op_worker --dynamic-slice-fusion on, compiles it with the pass forced on and
    counts the calls in the optimized HLO, with and without op.compiler_options().)"""
    op = _op()
    layers = 6

    def step(lgs, re_, rq, bt):
        def layer(c, lg):
            o = op(lg, re_, rq, bt)
            return c + o.counts, o.kv_rows
        return lax.scan(layer, jnp.zeros((R,), jnp.int32), lgs)

    text = cuda_text(step, sds((layers, R, L), jnp.bfloat16), *ARGS[1:])
    calls = custom_calls(text)
    assert [c[1] for c in calls] == ["dsa_select_push", "dsa_merge"]
    for name in ("dsa_select_push", "dsa_merge"):
        for m in re.finditer(r"stablehlo.custom_call @" + name + r"\([^\n]*-> ([^\n]*)", text):
            assert m.group(1).startswith("(!stablehlo.token,"), m.group(1)


def test_compiler_options_scope_the_fusion_workaround_to_one_executable(monkeypatch):
    """The workaround for XLA's dynamic-slice fusion is a per-executable compiler option
    (op.compiler_options / op.jit), version-gated, with an override; XLA accepts the option
    name (a wrong name is an error at compile); XLA_FLAGS stays as it was."""
    from jax_dsa_exchange import op as opmod

    flags = os.environ.get("XLA_FLAGS")
    monkeypatch.delenv("JAX_DSA_EXCHANGE_DSF_WORKAROUND", raising=False)
    assert opmod.DSF_SAFE_FROM is None and opmod.dynamic_slice_fusion_workaround_needed()
    assert opmod.compiler_options() == {"xla_gpu_enable_dynamic_slice_fusion": False}
    monkeypatch.setenv("JAX_DSA_EXCHANGE_DSF_WORKAROUND", "0")
    assert opmod.compiler_options() == {}
    monkeypatch.setenv("JAX_DSA_EXCHANGE_DSF_WORKAROUND", "1")
    f = opmod.jit(lambda x: x * 2 + 1)
    np.testing.assert_array_equal(np.asarray(f(jnp.arange(3))), [1, 3, 5])
    g = opmod.jit(lambda x: x - 1, compiler_options={"xla_embed_ir_in_executable": False})
    assert int(g(jnp.int32(3))) == 2
    # op.jit's program lowers like jax.jit's (the option only reaches the compiler)
    assert custom_calls(opmod.jit(_op()).trace(*ARGS).lower(lowering_platforms=("cuda",)).as_text()) == \
        custom_calls(cuda_text(_op(), *ARGS))
    with pytest.raises(Exception, match="No such compile option"):
        jax.jit(lambda x: x, compiler_options={"xla_gpu_enable_dynamic_slice_fusionn": False})(1.0)
    assert os.environ.get("XLA_FLAGS") == flags


SERIALIZE_SCRIPT = textwrap.dedent(
    """
    import time, numpy as np, jax, jax.numpy as jnp
    from jax.interpreters import mlir
    from jax_dsa_exchange import op
    from jax_dsa_exchange._jax_private import full_like_aval
    from jax_dsa_exchange.op import topk_exchange_merge, topk_exchange_merge_p, EFFECT

    def fake_cpu(ctx, logits, row_ends, req_id, block_table, *, ordered, **kw):
        # Stand-in for the kernels on CPU: same avals, same effect handling; no work.
        if ordered == "effect":
            ctx.set_tokens_out(ctx.tokens_in)
        return [full_like_aval(ctx, 0, a) for a in ctx.avals_out]

    mlir.register_lowering(topk_exchange_merge_p, fake_cpu, platform="cpu", cacheable=False)

    class Ex:
        id, world, rank, topk, local_topk, max_rows, closed = 3, 1, 0, 64, 32, 16, False

    R, L = 4, 256
    lg, re_, rq, bt = (jnp.zeros((R, L), jnp.bfloat16), jnp.full((R,), L, jnp.int32),
                       jnp.zeros((R,), jnp.int32), jnp.zeros((2, 8), jnp.int32))
    w = jnp.asarray(np.random.default_rng(0).standard_normal((768, 768)) / 30, jnp.float32)

    def make(ordered):
        def step(h):
            for _ in range(12):
                h = jnp.tanh(h @ w)
            if ordered is not None:
                o = topk_exchange_merge(Ex(), lg, re_, rq, bt, block_size=4, path="ffi", ordered=ordered)
                h = h + o.counts.sum()
            return h
        return jax.jit(step)

    for name, ordered in (("none", None), ("default", True), ("effect", "effect")):
        f = make(ordered)
        h = jnp.ones((768, 768), jnp.float32)
        for _ in range(3):
            h = f(h)
        jax.block_until_ready(h)
        n = 30
        t0 = time.perf_counter()
        for _ in range(n):
            h = f(h)
        t1 = time.perf_counter()
        jax.block_until_ready(h)
        t2 = time.perf_counter()
        print("MODE", name, f"{(t1 - t0) / (t2 - t0):.3f}", f"{(t2 - t0) / n * 1e6:.0f}", flush=True)
    """
)


def test_default_mode_does_not_serialize_the_host_with_the_device():
    """A serving loop: with the op in the step (a CPU stand-in lowering with the same effects),
    dispatching 30 steps back to back returns long before they finish in the default mode,
    like a step without the op; the ordered effect (ordered="effect") makes each dispatch
    wait for the previous step."""
    r = subprocess.run([sys.executable, "-c", SERIALIZE_SCRIPT], capture_output=True, text=True, cwd=REPO,
                       env=dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu"), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    frac = {m.group(1): float(m.group(2)) for m in re.finditer(r"MODE (\w+) ([\d.]+)", r.stdout)}
    assert set(frac) == {"none", "default", "effect"}, r.stdout
    # fraction of the wall time spent dispatching: small when the host runs ahead
    assert frac["none"] < 0.5 and frac["default"] < 0.5, r.stdout
    assert frac["effect"] > 0.8, r.stdout


def test_calls_in_two_bodies_of_one_program_warn():
    """The token chain is per body: a program with calls outside and inside a loop says so
    (CrossBodyOrderWarning, pointing at ordered='effect'); one body does not warn."""
    from jax_dsa_exchange.op import CrossBodyOrderWarning

    op = _op()

    def mixed(*a):
        c = op(*a).counts
        return lax.scan(lambda c, _: (c + op(*a).counts, None), c, None, length=2)[0]

    with pytest.warns(CrossBodyOrderWarning, match="ordered='effect'"):
        cuda_text(mixed, *ARGS)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", CrossBodyOrderWarning)
        cuda_text(lambda *a: lax.scan(lambda c, _: (c + op(*a).counts + op(*a).counts, None),
                                      jnp.zeros((R,), jnp.int32), None, length=2)[0], *ARGS)
        cuda_text(_op(ordered="effect"), *ARGS)
        cuda_text(lambda *a: (_op(ordered="effect")(*a).counts,
                              lax.scan(lambda c, _: (c + _op(ordered="effect")(*a).counts, None),
                                       jnp.zeros((R,), jnp.int32), None, length=2)[0]), *ARGS)


POLL_SCRIPT = textwrap.dedent(
    """
    import weakref, jax, jax.numpy as jnp
    from jax.interpreters import mlir
    from jax_dsa_exchange import op
    from jax_dsa_exchange._jax_private import full_like_aval
    from jax_dsa_exchange.op import topk_exchange_merge, topk_exchange_merge_p

    def fake_cpu(ctx, *args, ordered, **kw):  # the kernels' avals, no work
        return [full_like_aval(ctx, 0, a) for a in ctx.avals_out]

    mlir.register_lowering(topk_exchange_merge_p, fake_cpu, platform="cpu", cacheable=False)

    class Ex:
        world, rank, topk, local_topk, max_rows, closed = 1, 0, 64, 32, 16, False
        def __init__(self, id):
            self.id, self.polls, self.failure = id, 0, None
        def poll(self):
            self.polls += 1
            if self.failure:
                raise RuntimeError(self.failure)

    R, L = 4, 256
    args = (jnp.zeros((R, L), jnp.bfloat16), jnp.full((R,), L, jnp.int32), jnp.zeros((R,), jnp.int32),
            jnp.zeros((2, 8), jnp.int32))
    a, b, c = Ex(1), Ex(2), Ex(3)
    merge = lambda ex, x: topk_exchange_merge(ex, *x, block_size=4, path="ffi").counts

    @op.jit
    def step(*x):
        return merge(a, x) + jax.lax.scan(lambda s, _: (s + merge(b, x), None), 0 * x[1], None, length=2)[0]

    inner = jax.jit(lambda *x: merge(c, x))  # (compiler_options only on the top-level jit)
    outer = op.jit(lambda *x: inner(*x) + 1)
    plain = op.jit(lambda *x: x[1] + 1)
    for _ in range(3):
        step(*args); outer(*args); plain(*args)
    # polled before each dispatch but the first (nothing to poll before the first trace)
    print("POLLS", a.polls, b.polls, c.polls)
    print("ATTRS", callable(step.lower), callable(step.trace), step.__wrapped__ is not None)
    # lower() before the first call traces too (JAX then reuses that trace)
    d = Ex(4)
    lowered_first = op.jit(lambda *x: merge(d, x) + 2)
    lowered_first.lower(*args)
    for _ in range(2):
        lowered_first(*args)
    # as a method decorator
    class Model:
        @op.jit(static_argnums=0)
        def step(self, *x):
            return merge(d, x) * 1
    m = Model()
    m.step(*args); m.step(*args)
    print("LOWERED", d.polls)
    b.failure = "exchange 2 rank 0: rank 1 did not deliver its candidates"
    try:
        step(*args)
        print("NO RAISE")
    except RuntimeError as e:
        print("RAISED", e)
    plain(*args); outer(*args)
    print("OTHERS OK")
    """
)


def test_op_jit_polls_the_exchanges_its_programs_call():
    """op.jit checks, before each dispatch, every exchange its traced programs call (a scan
    body's, an inner jax.jit's too) through Exchange.poll, and raises its error; programs
    without the op poll nothing (CPU stand-in lowering, as in the test above)."""
    r = subprocess.run([sys.executable, "-c", POLL_SCRIPT], capture_output=True, text=True, cwd=REPO,
                       env=dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu"), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "POLLS 2 2 2" in r.stdout, r.stdout
    assert "ATTRS True True True" in r.stdout, r.stdout
    assert "LOWERED 3" in r.stdout, r.stdout  # 2 calls after lower() + the method's second call
    assert "RAISED exchange 2 rank 0: rank 1 did not deliver its candidates" in r.stdout, r.stdout
    assert "OTHERS OK" in r.stdout, r.stdout
