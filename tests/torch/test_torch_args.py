"""Argument checks of routepack.torch, by class of input (hypothesis), in one process (a gloo
group of one rank where a function is collective): a value of the wrong type or out of range
is a `RoutepackError` naming the argument; a rank without tokens (T = 0) is valid everywhere
and gives empty results of the right shape, forward and backward."""

import datetime
import os
import re
import tempfile

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402

import routepack as rp  # noqa: E402
from routepack.plan import REPLICA_DTYPE, Placement, Plan  # noqa: E402
from routepack.torch import (  # noqa: E402
    EPMoE,
    agree_on_plan,
    broadcast_plan,
    checksum,
    dense_moe,
    expert_counts,
    flow_table,
    gather_ints,
    plan_digest,
    rank_microbatches,
    route_tokens,
)

SETTINGS = settings(max_examples=40, deadline=None)

#: values that are not an int (or not one a count can take)
NOT_INTS = st.sampled_from(
    [
        None,
        "2",
        "",
        1.5,
        2.0,
        float("nan"),
        float("inf"),
        True,
        {},
        {0: 1},
        [1],
        (2,),
        b"3",
        1j,
        np.float64(2.0),
        np.bool_(True),
        np.array([2]),
        object(),
    ]
)
NOT_PLANS = st.sampled_from([None, "x", 0, 1.5, {}, [], (), object(), np.zeros(2), b""])
#: dtypes that are not integer ids
NOT_INT_DTYPES = st.sampled_from([np.float64, np.float32, np.bool_, np.complex64, "U3", object])


@pytest.fixture(scope="module", autouse=True)
def group():
    """A gloo group of world size 1 (created here unless one exists; destroyed if created)."""
    made = not dist.is_initialized()
    if made:
        store = os.path.join(tempfile.mkdtemp(prefix="rp_args_"), "store")
        dist.init_process_group(
            "gloo", init_method=f"file://{store}", rank=0, world_size=1, timeout=datetime.timedelta(seconds=30)
        )
    yield
    if made:
        dist.destroy_process_group()


def names(err, *args):
    """The error's message names one of ``args`` as an identifier (``arg:``, ``arg[``, ``arg=``)."""
    msg = str(err.value)
    assert any(re.search(rf"(?<![\w.]){re.escape(a)}\s*[:\[=.]", msg) for a in args), msg


def small_plan(experts=4, samples=3, ranks=1):
    topo = rp.Topology(ranks, ranks, 1, experts)
    return Plan(
        Placement.static(2, experts, topo),
        np.arange(samples, dtype=np.int32) % ranks,
        np.zeros(samples, dtype=np.int32),
        1,
    )


# ------------------------------------------------------------------ wrong types, out of range
@SETTINGS
@given(bad=NOT_INTS, where=st.sampled_from(["layer", "num_experts", "hidden", "ffn"]))
def test_epmoe_sizes_must_be_ints(bad, where):
    args = {"layer": 0, "num_experts": 3, "hidden": 4, "ffn": 2}
    args[where] = bad
    with pytest.raises(rp.RoutepackError) as e:
        EPMoE(
            args["layer"],
            args["num_experts"],
            args["hidden"],
            args["ffn"],
            rp.Topology(1, 1, 1, 3),
            np.arange(3, dtype=np.int32),
        )
    names(e, where)


@SETTINGS
@given(hidden=st.integers(2**20, 2**63 - 1), ffn=st.integers(2**20, 2**40))
def test_epmoe_refuses_weights_larger_than_the_device_before_allocating(hidden, ffn):
    with pytest.raises(rp.RoutepackError) as e:
        EPMoE(0, 1, hidden, ffn, rp.Topology(1, 1, 1, 1), np.zeros(1, dtype=np.int32))
    names(e, "hidden")
    assert "bytes" in str(e.value)


@SETTINGS
@given(pp=st.integers(2, 6), stage=st.data(), case=st.sampled_from(["no pipeline_group", "its size", "layer order"]))
def test_plan_runner_under_a_pipeline_names_what_it_needs(pp, stage, case):
    """A pipeline stage's layers (a part of the plan's, from layer ``stage * 2``) under
    ``topo.pp`` > 1 without ``pipeline_group``, with one whose size is not ``pp`` (this
    process's group of one), or out of layer order: refused naming the argument. (With them
    right a stage trains like the unsharded model: tests/torch/test_torch_pipeline.py.)"""
    from routepack.torch import PlanRunner

    topo = rp.Topology(1, 1, 1, 3, pp=pp)
    first = 2 * stage.draw(st.integers(0, pp - 1))
    order = [1, 0] if case == "layer order" else [0, 1]
    layers = [EPMoE(first + i, 3, 4, 2, topo, np.arange(3, dtype=np.int32)) for i in order]
    kwargs = {"dp_rank": 0} if case == "no pipeline_group" else {"dp_rank": 0, "pipeline_group": dist.group.WORLD}
    with pytest.raises(rp.RoutepackError) as e:
        PlanRunner(layers, topo, **kwargs)
    names(e, "layers" if case == "layer order" else "pipeline_group")
    if case != "layer order":
        assert f"topo.pp = {pp}" in str(e.value)


@SETTINGS
@given(bad=st.sampled_from([None, "x", 1.5, [], object(), (1, 1, 1, 1), {"dp": 1}]))
def test_epmoe_topo_must_be_a_topology(bad):
    with pytest.raises(rp.RoutepackTypeError) as e:
        EPMoE(0, 3, 4, 2, bad, np.arange(3, dtype=np.int32))
    names(e, "topo")


@SETTINGS
@given(
    row=st.lists(st.integers(-3, 2**33), min_size=0, max_size=5)
    | st.sampled_from([np.array([0.0, 1.0, 2.0]), np.array([True, False, True]), np.array(["0", "1", "2"]), [0, 1]])
)
def test_epmoe_placement_row_is_checked(row):
    arr = np.asarray(row)
    ok = arr.dtype.kind in "iu" and arr.shape == (3,) and set(arr.tolist()) >= {0, 1, 2}
    if ok:
        EPMoE(0, 3, 4, 2, rp.Topology(1, 1, 1, 3), row)
        return
    with pytest.raises(rp.RoutepackError) as e:
        EPMoE(0, 3, 4, 2, rp.Topology(1, 1, 1, 3), row)
    names(e, "phy2log_row")


@SETTINGS
@given(bad=NOT_INTS | st.integers(2**63, 2**70) | st.integers(-(2**70), -(2**63) - 1), pos=st.integers(0, 2))
def test_gather_ints_values_must_be_int64(bad, pos):
    values = [1, 2, 3]
    values[pos] = bad
    with pytest.raises(rp.RoutepackError) as e:
        gather_ints(values)
    names(e, f"values[{pos}]", "values")


@SETTINGS
@given(values=st.lists(st.integers(-(2**63), 2**63 - 1), min_size=0, max_size=4))
def test_gather_ints_carries_any_int64(values):
    out = gather_ints(values)
    assert out.shape == (1, len(values)) and out[0].tolist() == values


@SETTINGS
@given(bad=NOT_PLANS)
def test_plan_functions_refuse_what_is_not_a_plan(bad):
    for fn in (plan_digest, agree_on_plan):
        with pytest.raises(rp.RoutepackTypeError) as e:
            fn(bad)
        names(e, "plan")
    with pytest.raises(rp.RoutepackTypeError) as e:
        broadcast_plan(bad, 0)
    names(e, "plan")
    with pytest.raises(rp.RoutepackTypeError) as e:
        rank_microbatches(bad, np.zeros((3, 2, 1), np.int32), 0, [0, 1, 2, 3])
    names(e, "plan")


@SETTINGS
@given(src=NOT_INTS | st.integers(-5, -1) | st.integers(1, 2**64))
def test_broadcast_src_must_be_a_rank_of_the_group(src):
    with pytest.raises(rp.RoutepackError) as e:
        broadcast_plan(small_plan(), src)
    names(e, "src")


@SETTINGS
@given(dtype=NOT_INT_DTYPES, shape=st.sampled_from([(0,), (3,), (2, 2), (1, 1, 4)]))
def test_expert_ids_must_be_integers(dtype, shape):
    ids = np.zeros(shape, dtype=dtype)
    with pytest.raises(rp.RoutepackTypeError) as e:
        expert_counts(ids, 4)
    names(e, "topk_ids")
    with pytest.raises(rp.RoutepackError) as e:
        route_tokens(
            ids.reshape(-1, 1),
            np.zeros((1, 4), np.int64),
            np.arange(4, dtype=np.int32),
            rp.Topology(1, 1, 1, 4),
            np.zeros(0, REPLICA_DTYPE),
            0,
        )
    names(e, "topk_ids")
    plan = small_plan()
    with pytest.raises(rp.RoutepackError) as e:
        rank_microbatches(plan, np.zeros((3, 2, 1), dtype=dtype), 0, [0, 1, 2, 3])
    names(e, "routed")


@SETTINGS
@given(num_experts=NOT_INTS | st.integers(-3, 0))
def test_expert_counts_num_experts_must_be_positive(num_experts):
    with pytest.raises(rp.RoutepackError) as e:
        expert_counts(np.zeros((2, 1), np.int64), num_experts)
    names(e, "num_experts")


@SETTINGS
@given(ep_rank=NOT_INTS | st.integers(-4, -1) | st.integers(2, 9))
def test_route_tokens_ep_rank_must_be_a_rank(ep_rank):
    topo = rp.Topology(2, 2, 2, 1)
    with pytest.raises(rp.RoutepackError) as e:
        route_tokens(
            np.array([[0]]),
            np.array([[1, 0], [0, 0]]),
            np.array([0, 1], np.int32),
            topo,
            np.zeros(0, REPLICA_DTYPE),
            ep_rank,
        )
    names(e, "ep_rank")


@SETTINGS
@given(
    field=st.sampled_from(["expert", "src_rank", "dst_rank", "share"]),
    value=st.sampled_from([-1, 7, 2**20]) | st.floats(allow_nan=True, allow_infinity=True),
)
def test_replica_rows_out_of_range_are_named(field, value):
    topo = rp.Topology(2, 2, 2, 1)
    rows = np.array([(0, 0, 0, 0, 0, 1, 0.5)], dtype=REPLICA_DTYPE)
    try:
        rows[field][0] = value
    except (OverflowError, ValueError):
        return
    good = {
        "expert": 0 <= rows["expert"][0] < 2,
        "src_rank": 0 <= rows["src_rank"][0] < 2,
        "dst_rank": 0 <= rows["dst_rank"][0] < 2,
        "share": 0 <= rows["share"][0] <= 1,
    }[field]
    args = (np.array([[1, 0], [0, 0]]), np.array([0, 1], np.int32), topo, rows)
    if good:
        flow_table(*args)
        return
    with pytest.raises(rp.RoutepackError) as e:
        flow_table(*args)
    names(e, "cell_rows")


@SETTINGS
@given(bad=st.sampled_from([None, np.zeros(2), [(0, 0, 0, 0, 0, 1, 0.5)], "rows"]))
def test_cell_rows_must_be_a_replica_table(bad):
    with pytest.raises(rp.RoutepackTypeError) as e:
        flow_table(np.array([[1, 0], [0, 0]]), np.array([0, 1], np.int32), rp.Topology(2, 2, 2, 1), bad)
    names(e, "cell_rows")


@SETTINGS
@given(rank=NOT_INTS | st.integers(-3, -1) | st.integers(1, 50))
def test_rank_microbatches_rank_is_checked(rank):
    with pytest.raises(rp.RoutepackError) as e:
        rank_microbatches(small_plan(), np.zeros((3, 2, 1), np.int32), rank, [0, 1, 2, 3])
    names(e, "rank")


@SETTINGS
@given(
    dtype=st.sampled_from([torch.float32, torch.float64, torch.int32, torch.int8, torch.bool, torch.int64]),
    shape=st.sampled_from([(0,), (5,), (2, 3), ()]),
)
def test_checksum_takes_only_1d_byte_buffers(dtype, shape):
    buf = torch.zeros(shape, dtype=dtype)
    with pytest.raises(rp.RoutepackError) as e:
        checksum(buf)
    names(e, "buf")


@SETTINGS
@given(t=st.integers(0, 6), h=st.integers(1, 5), i=st.integers(1, 4), e_n=st.integers(1, 4), data=st.data())
def test_dense_moe_refuses_inconsistent_shapes(t, h, i, e_n, data):
    k = data.draw(st.integers(1, e_n))
    good = {
        "x": torch.zeros(t, h),
        "topk_ids": torch.zeros(t, k, dtype=torch.int64),
        "topk_weights": torch.zeros(t, k),
        "w1": torch.zeros(e_n, h, 2 * i),
        "w2": torch.zeros(e_n, i, h),
    }
    which = data.draw(st.sampled_from(sorted(good)))
    bad = data.draw(
        st.sampled_from(
            [
                None,
                "x",
                torch.zeros(1),
                torch.zeros(t + 1, 99),
                torch.zeros(2, 2, 2, 2),
                good[which].double(),
                good[which].to(torch.int32),
            ]
        )
    )
    args = dict(good, **{which: bad})
    try:  # a replacement that happens to be consistent (same shape, accepted dtype) is fine
        dense_moe(**args)
    except rp.RoutepackError as e:
        assert re.search(r"\b(x|topk_ids|topk_weights|w1|w2)\s*:", str(e)), str(e)


# ------------------------------------------------------------------ zero tokens
@SETTINGS
@given(h=st.integers(1, 5), i=st.integers(1, 4), e_n=st.integers(1, 4), data=st.data())
def test_zero_tokens_give_an_empty_output_in_the_graph(h, i, e_n, data):
    k = data.draw(st.integers(1, e_n))
    x = torch.zeros(0, h, dtype=torch.float64, requires_grad=True)
    ids, gw = torch.zeros(0, k, dtype=torch.int64), torch.zeros(0, k, dtype=torch.float64)
    w1 = torch.randn(e_n, h, 2 * i, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(e_n, i, h, dtype=torch.float64, requires_grad=True)
    y = dense_moe(x, ids, gw, w1, w2)
    assert y.shape == (0, h)
    y.sum().backward()
    assert x.grad.shape == (0, h) and not w1.grad.any() and not w2.grad.any()

    spr = e_n + data.draw(st.integers(0, 2))
    layer = EPMoE(
        0,
        e_n,
        h,
        i,
        rp.Topology(1, 1, 1, spr),
        np.concatenate([np.arange(e_n), np.zeros(spr - e_n, np.int64)]),
        dtype=torch.float64,
    )
    z = layer(x, ids, gw)
    assert z.shape == (0, h) and layer.last_route.send_order.size == 0
    z.sum().backward()
    assert layer.w1.grad is not None and not layer.w1.grad.any()


def test_a_rank_without_samples_gets_empty_microbatches():
    plan = small_plan(samples=3, ranks=1)
    routed = np.arange(12, dtype=np.int32).reshape(6, 2, 1) % 4
    mbs = rank_microbatches(plan, routed, 1, [0, 1, 3, 6], dp=2)
    assert len(mbs) == 1 and mbs[0].routed.shape == (0, 2, 1) and mbs[0].samples.size == 0
    assert mbs[0].cu_seqlens.tolist() == [0]
    with pytest.raises(rp.RoutepackError) as e:
        rank_microbatches(plan, routed, 1, [0, 1, 3, 6])
    names(e, "rank")
    with pytest.raises(rp.RoutepackError) as e:
        rank_microbatches(plan, routed, 2, [0, 1, 3, 6], dp=2)
    names(e, "rank")


def test_empty_buffer_checksum():
    assert checksum(torch.zeros(0, dtype=torch.uint8)) == 0
    assert checksum(torch.zeros(1, dtype=torch.uint8)) != 0  # the length counts
