"""NVLink domains apart from nodes (`Topology.nvlink_domain`, docs/design.md "NVLink domains"):
the cost model prices a link by whether its two ranks share a domain, so a rack-scale domain
of several nodes prices exactly as one big node; the topology checks the domain against the
nodes and the EP groups, naming the field; GB200 NVL72's hardware preset and profiles."""

from __future__ import annotations

import dataclasses

import pytest

import routepack as rp
from routepack import traces
from routepack.hardware import NVL72_DOMAIN, NVL72_GPUS_PER_NODE
from test_replication import make_case


def test_checks_name_the_field():
    assert rp.Topology(64, 64, 4, 9, nvlink_domain=72).domain == 72  # 64 of a rack's 72 GPUs
    assert rp.Topology(16, 8, 8, 17).domain == 8  # None: a node
    assert rp.Topology(128, 64, 4, 9, nvlink_domain=72).nodes_per_group == 1
    assert rp.Topology(64, 32, 4, 9, nvlink_domain=16).nodes_per_group == 2
    for kwargs, why in (
        (dict(nvlink_domain=6), "multiple of gpus_per_node"),  # nodes of 4
        (dict(nvlink_domain=24), "divide ep"),  # below ep = 32 and not a divisor
        (dict(nvlink_domain=0), "nvlink_domain"),
    ):
        with pytest.raises(rp.RoutepackError, match="topo.nvlink_domain"):
            rp.Topology(64, 32, 4, 9, **kwargs)
        with pytest.raises(rp.RoutepackError, match=why):
            rp.Topology(64, 32, 4, 9, **kwargs)


@pytest.mark.parametrize("policy", ["static", "eplb_oracle", "moonep", "routepack"])
def test_a_domain_of_nodes_prices_as_one_node(policy):
    """ep 4 over nodes of 2 joined into one domain: every plan and score as on nodes of 4."""
    window, topo, cost, cap = make_case(2, 1)  # dp 8, ep 4, nodes of 2
    topo = dataclasses.replace(topo, replica_slots=8)
    domain = dataclasses.replace(topo, nvlink_domain=4)
    node = dataclasses.replace(topo, gpus_per_node=4)
    a = rp.plan_window(window, domain, cost, cap, policy=policy)
    b = rp.plan_window(window, node, cost, cap, policy=policy)
    assert a.digest() == b.digest()
    sa, sb = rp.simulate(a, window, domain, cost, cap), rp.simulate(b, window, node, cost, cap)
    assert sa.step_time == sb.step_time and sa.lower_bound_time == sb.lower_bound_time
    assert sa.cross_node_bytes == 0.0
    # the same plan on nodes that are their own domains pays the inter-node link
    split = rp.simulate(a, window, topo, cost, cap)
    assert split.cross_node_bytes > 0.0 and split.all_to_all > sa.all_to_all


def test_default_domain_changes_nothing():
    window, topo, cost, cap = make_case(4, 2)
    same = dataclasses.replace(topo, nvlink_domain=topo.gpus_per_node)
    for policy in ("eplb_oracle", "routepack"):
        a = rp.plan_window(window, topo, cost, cap, policy=policy)
        b = rp.plan_window(window, same, cost, cap, policy=policy)
        assert a.digest() == b.digest()


def test_gb200_nvl72_preset_and_profiles():
    hw = rp.Hardware.gb200_nvl72()
    assert (hw.flops, hw.bw_intra, hw.bw_inter) == (2.5e15, 900e9, 50e9)
    assert NVL72_DOMAIN == 72 and NVL72_GPUS_PER_NODE == 4
    for name, ep in (("nvl72_ep32", 32), ("nvl72_ep64", 64)):
        prof = traces.profile(name)
        topo = prof.topology()
        assert (topo.ep, topo.gpus_per_node, topo.domain, topo.nodes_per_group) == (ep, 4, 72, 1)
        cost = prof.cost()
        assert cost.bw_intra == pytest.approx(900e9 * hw.comm_efficiency)
