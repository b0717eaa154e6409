"""EPLB runs as its users run it: ``num_groups`` is the model's own expert-group count
(`ModelShape.expert_groups`, carried by `CostModel.expert_groups`), so a model without
group-limited routing gets EPLB's global policy; ``eplb_num_groups`` still overrides, and the
hierarchical configuration (one group per node) is its own, explicitly named preset."""

from __future__ import annotations

import json
from dataclasses import replace
from functools import lru_cache

import numpy as np
import pytest

import routepack as rp
from routepack.placement import rebalance_experts

#: the golden digest test's flash-shaped profile: flash's 512 experts, ep 32 over 4 nodes
FLASH_SMALL = replace(
    rp.traces.profile("flash"), name="flash_small", num_layers=6, attention=("linear",) * 5 + ("full",), samples=1024
)
PROFILES = {"tiny": rp.traces.profile("tiny"), "flash_small": FLASH_SMALL}


@lru_cache(maxsize=None)
def _window(name: str) -> rp.Window:
    return next(rp.traces.synthetic(PROFILES[name], 1, seed=3))


def _phy2log(name: str, policy: str, **options) -> np.ndarray:
    prof = PROFILES[name]
    w = _window(name)
    plan = rp.plan_window(
        w, prof.topology(), prof.cost(), token_cap=prof.token_cap, policy=policy, previous_window=w, **options
    )
    return plan.placement.phy2log


@pytest.mark.parametrize("name", sorted(PROFILES))
@pytest.mark.parametrize("policy", ["eplb", "eplb_oracle"])
def test_eplb_is_the_global_policy_for_a_model_without_groups(name, policy):
    """The acceptance check of issue 12: the default equals ``eplb_num_groups=1``, which is
    DeepSeek's ``rebalance_experts`` with one group (its global policy)."""
    assert PROFILES[name].model().expert_groups == 1
    default = _phy2log(name, policy)
    assert np.array_equal(default, _phy2log(name, policy, eplb_num_groups=1))
    prof = PROFILES[name]
    topo = prof.topology()
    expect = rebalance_experts(_window(name).layer_expert_load(), topo.num_slots, 1, topo.nodes_per_group, topo.ep)[0]
    assert np.array_equal(default, expect)


def test_the_hierarchical_preset_is_one_group_per_node():
    topo = FLASH_SMALL.topology()
    assert topo.nodes_per_group == 4
    hier = _phy2log("flash_small", "eplb_hierarchical_oracle")
    assert np.array_equal(hier, _phy2log("flash_small", "eplb_oracle", eplb_num_groups=4))
    assert not np.array_equal(hier, _phy2log("flash_small", "eplb_oracle"))
    # one node: one group, the global policy
    assert np.array_equal(_phy2log("tiny", "eplb_hierarchical_oracle"), _phy2log("tiny", "eplb_oracle"))


def test_a_grouped_model_passes_its_groups():
    """A DeepSeek-V3-like model (8 groups, which the 4 nodes divide) gets the hierarchical
    policy on its own groups; the planner reads them from the cost model."""
    model = replace(FLASH_SMALL.model(), expert_groups=8)
    cost = rp.CostModel.from_model(model, rp.Hardware.h200())
    assert cost.expert_groups == 8
    w = _window("flash_small")
    topo = FLASH_SMALL.topology()
    plan = rp.plan_window(w, topo, cost, token_cap=FLASH_SMALL.token_cap, policy="eplb_oracle")
    expect = rebalance_experts(w.layer_expert_load(), topo.num_slots, 8, 4, topo.ep)[0]
    assert np.array_equal(plan.placement.phy2log, expect)
    assert plan.report["stage_reports"]["placement"] == {"eplb_num_groups": 8}
    # the option still overrides the model
    glob = rp.plan_window(w, topo, cost, token_cap=FLASH_SMALL.token_cap, policy="eplb_oracle", eplb_num_groups=1)
    assert np.array_equal(glob.placement.phy2log, _phy2log("flash_small", "eplb_oracle"))


def test_expert_groups_are_checked():
    base = rp.traces.profile("tiny").model()
    with pytest.raises(rp.RoutepackError, match="model.expert_groups: 3 does not divide num_experts = 128"):
        replace(base, expert_groups=3)
    with pytest.raises(rp.RoutepackError, match="model.expert_groups"):
        replace(base, expert_groups=0)
    with pytest.raises(rp.RoutepackTypeError, match="cost.expert_groups"):
        replace(rp.traces.profile("tiny").cost(), expert_groups=2.0)


def test_cost_model_keeps_expert_groups_in_json(tmp_path):
    cost = rp.CostModel.from_model(replace(rp.traces.profile("tiny").model(), expert_groups=4), rp.Hardware.h200())
    assert rp.CostModel.from_json(cost.to_json()) == cost
    cost.save(tmp_path / "c.json")
    assert rp.CostModel.load(tmp_path / "c.json").expert_groups == 4
    # a file written before expert_groups existed still loads, with 1 group
    old = json.loads(cost.to_json())
    del old["expert_groups"]
    back = rp.CostModel.from_json(json.dumps(old))
    assert back.expert_groups == 1 and back == replace(cost, expert_groups=1)
    # a hand-built cost model routes without groups
    assert rp.CostModel(1e-9, [0.0], 1e-9, 1e-6, 10.0, 1e9, 1e8, 1e3, 1e3, 1e3).expert_groups == 1
