"""The preset is the best of its own stages (`routepack.choice`): no combination of routepack's
placement with any packing and replication beats the ``routepack`` preset by more than 0.5%,
under the datasheet cost model and a calibrated one, on a balanced workload across nodes (where
redundant copies buy nothing but cost their once-per-step gradient sum) as on the trace; and
without the choice the same policy loses there (so these tests can fail)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

import routepack as rp
from routepack import traces, workloads
from routepack.compare import compare
from routepack.policies import Policy, resolve

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 0.005
HYBRIDS = [
    Policy("routepack", packing, replication)
    for packing in ("sequential", "kk", "routepack")
    for replication in ("none", "hot_n", "relibra", "routepack", "moonep", "ultraep")
]
ABLATIONS = ("routepack_placement", "routepack_packing", "routepack_no_replication")

#: flash's EP shape (ep 32 over 4 nodes, 512 experts top-8), 6 layers and 1024 samples
FLASH6 = dataclasses.replace(
    traces.profile("flash"), name="flash6", num_layers=6, attention=("linear",) * 5 + ("full",), samples=1024
)


def calibrated() -> rp.CostModel:
    data = json.loads((ROOT / "docs" / "calibrate_tiny_cpu.json").read_text())["cost_model"]
    return rp.CostModel(**{k: v for k, v in data.items() if k in rp.CostModel.__dataclass_fields__})


def steps(windows, prof, cost, policies):
    topo = dataclasses.replace(prof.topology(), replica_slots=-(-prof.num_experts // prof.ep))
    rows = compare(windows, topo, cost, prof.token_cap, policies=policies)
    out: dict = {}
    for r in rows:
        out.setdefault(r.window, {})[r.policy] = r.step_time
    return out


def check_best_of_stages(by_window, extra=()):
    for w, d in by_window.items():
        preset = d["routepack"]
        for name, t in d.items():
            if name != "routepack" and name not in extra:
                assert preset <= t * (1 + TOLERANCE), f"window {w}: {name} {t:.4f} s beats the preset's {preset:.4f} s"


def test_balanced_workload_across_nodes():
    """W0 on flash's EP shape: routepack's placement fills its redundant slots and pays their
    gradient sum over the inter-node link for nothing; the preset keeps the static placement."""
    prof, cost = FLASH6, FLASH6.cost()
    wins = list(workloads.windows(prof, "W0", 3, 0))
    unchosen = Policy("routepack", "routepack", "routepack")
    d = steps(wins, prof, cost, ["routepack", *HYBRIDS, *ABLATIONS])
    check_best_of_stages(d, extra=())
    for w, row in d.items():
        # the same stages without the choice lose by more than the tolerance
        assert row[resolve(unchosen)[0]] > row["routepack"] * (1 + TOLERANCE)


@pytest.mark.parametrize("model", ["datasheet", "calibrated"])
def test_tiny_trace(model):
    prof = traces.profile("tiny")
    cost = prof.cost() if model == "datasheet" else calibrated()
    wins = list(traces.synthetic(prof, 3, seed=5))
    check_best_of_stages(steps(wins, prof, cost, ["routepack", *HYBRIDS]))


def test_calibrated_model_on_a_balanced_workload():
    prof = traces.profile("tiny")
    wins = list(workloads.windows(prof, "W0", 2, 0))
    check_best_of_stages(steps(wins, prof, calibrated(), ["routepack", *HYBRIDS, *ABLATIONS]))


def test_the_choice_is_reported_and_deterministic():
    prof, cost = FLASH6, FLASH6.cost()
    (w,) = list(workloads.windows(prof, "W0", 1, 0))
    topo = prof.topology()
    a = rp.plan_window(w, topo, cost, prof.token_cap, policy="routepack")
    b = rp.plan_window(w, topo, cost, prof.token_cap, policy="routepack")
    assert a.digest() == b.digest()
    choice = a.report["choice"]
    assert choice["placement"] == "in_force" and set(choice["probes"]) >= {"policy+own", "in_force+own"}
    assert a.report["stage_seconds"]["choice"] >= 0.0
    # a budgeted plan keeps the policy's own stages (no clock-bound probing)
    c = rp.plan_window(w, topo, cost, prof.token_cap, policy="routepack", time_budget_s=60.0)
    assert "choice" not in c.report
    assert resolve("routepack")[1].choose is True


def test_probes_score_the_full_simulates_step():
    """The choice's probes run `score(..., step_only=True)`: the step time each probe reports
    is, bit for bit, the full simulate's of the same unreplicated plan (only the bound and the
    balanced reference are left out, as NaN)."""
    from routepack.plan import Plan, empty_migration, empty_replicas
    from routepack.simulate import score

    prof, cost = FLASH6, FLASH6.cost()
    (w,) = list(traces.synthetic(prof, 1, seed=3))
    topo = prof.topology()
    plan = rp.plan_window(w, topo, cost, prof.token_cap, policy="routepack")
    probes = plan.report["choice"]["probes"]
    bare = Plan(
        plan.placement, plan.sample_rank, plan.sample_micro, plan.num_micro, empty_replicas(), empty_migration()
    )
    full = score(bare, w, topo, cost, prof.token_cap)
    probe = score(bare, w, topo, cost, prof.token_cap, step_only=True)
    assert probe.step_time == full.step_time and probe.all_to_all == full.all_to_all
    assert np.isnan(probe.lower_bound_time) and np.isnan(probe.ideal_time) and not np.isnan(full.lower_bound_time)
    chosen = f"{plan.report['choice']['placement']}+{plan.report['choice']['packing']}"
    assert probes[chosen] == full.step_time
