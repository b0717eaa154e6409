"""`routepack.calibrate.exchange`: one `EPMoE` layer timed on two ranks, its kernel apart."""

from __future__ import annotations

import pytest

import routepack as rp
from routepack.calibrate.exchange import ROUTINGS
from routepack.calibrate.sweeps import Sweeps
from synthetic import HAS_TORCH, check_report


@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
def test_the_exchange_times_an_epmoe_layer_on_two_ranks():
    """Five experts on two ranks (three slots each, the last one empty), top-2: the layer runs
    forward and backward on both ranks at every point, its kernel timed apart."""
    shape = rp.ModelShape(2, 5, 2, 32, 16, attention=("linear", "linear"), shared_experts=0)
    cal = rp.calibrate(
        model=shape, kernels=["links", "exchange"], quick=True, threads=1, links_clock="cpu", progress=False
    )
    k = cal.report["kernels"]["exchange"]
    tokens = Sweeps.default("cpu", quick=True).exchange_tokens
    assert [(p["tokens"], p["routing"]) for p in k["sweep"]] == [(t, r) for t in tokens for r in ROUTINGS]
    for p, m, layer, kern in zip(k["sweep"], k["measured_s"], k["layer_s"], k["kernel_s"]):
        assert p["routed"] == 2 * p["tokens"]
        # three experts on rank 0, two on rank 1: rank 1's own take only two copies a token
        want = {"local": 0, "remote": p["routed"]}.get(p["routing"])
        if want is not None:
            assert p["remote_rows"] == want
        assert p["remote_bytes"] == 4 * 32 * p["remote_rows"]
        assert 0 < m < layer and 0 < kern < layer
    assert cal.cost.bw_intra == k["cost_fields"]["bw_intra"]
    assert k["clock"] == "cpu" and k["backend"] == "gloo" and k["ranks"] == 2
    assert cal.cost.a2a_latency == k["cost_fields"]["a2a_latency"]
    assert cal.report["sources"]["a2a_latency"] == "measured: exchange"
    check_report(cal.report, kinds=("links", "exchange"))
