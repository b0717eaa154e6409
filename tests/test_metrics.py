"""`routepack.metrics`: the names the trainer's logger receives.

* verl's own MoE balance metrics (``verl.trainer.ppo.metric_utils``) on the window's loads
  equal ours (``moe/*_vio/*``);
* a `plan_window` plan gives every name but the runner's measured ones, finite; imbalance
  under the plan is at most the static placement's on the skewed tiny profile;
* `log_metrics` delivers to a writer (``add_scalar``), a ``log(data, step=)`` logger (verl's
  ``Tracking`` with its console backend, wandb) and a callable, and refuses anything else;
* docs/metrics.md lists exactly `METRICS`."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest

import routepack as rp
from routepack.errors import RoutepackError, RoutepackTypeError
from routepack.metrics import METRICS, NAMES, log_metrics, plan_metrics, vio_metrics

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def planned():
    prof = rp.traces.profile("tiny")
    windows = list(rp.traces.synthetic("tiny", 2, 3))
    topo, cost = prof.topology(), prof.cost()
    plan = rp.plan_window(windows[1], topo, cost, token_cap=prof.token_cap, previous_window=windows[0])
    return plan, windows[1], topo, cost


def test_vio_is_verls():
    torch = pytest.importorskip("torch")
    metric_utils = pytest.importorskip("verl.trainer.ppo.metric_utils")
    rng = np.random.default_rng(0)
    w = rp.Window(rng.integers(30, 50, 6), rng.integers(0, 30, (6, 3, 8)).astype(np.int32))
    theirs = metric_utils._compute_rollout_moe_load_balance_metrics_from_counts(
        torch.tensor(w.counts.sum(axis=0)), prefix="moe"
    )
    ours = vio_metrics(w)
    assert ours and all(ours[k] == pytest.approx(theirs[k], rel=1e-6, abs=1e-7) for k in ours)


def test_plan_metrics_of_a_plan(planned):
    plan, window, topo, cost = planned
    got = plan_metrics(plan, window, topo, cost)
    assert set(got) == set(NAMES) - {"routepack/measured_step_s", "routepack/measured_over_predicted"}
    assert all(math.isfinite(v) for v in got.values()), got
    assert got["routepack/predicted_step_s"] == plan.report["predicted"]["step_time"]
    assert got["routepack/imbalance_after/mean"] <= got["routepack/imbalance_before/mean"]
    for when in ("before", "after"):
        q = [got[f"routepack/imbalance_{when}/{k}"] for k in ("p50", "p90", "max")]
        assert 1.0 <= q[0] <= q[1] <= q[2]
    assert got["routepack/replicas"] == plan.replicas.size
    assert got["routepack/migration_bytes"] == plan.migration.size * cost.expert_state_bytes
    # a plan that records no prediction needs a cost model
    bare = rp.Plan(plan.placement, plan.sample_rank, plan.sample_micro, plan.num_micro)
    with pytest.raises(RoutepackError, match="cost: the plan records no predicted step time"):
        plan_metrics(bare, window, topo)
    again = plan_metrics(bare, window, topo, cost)
    assert again["routepack/predicted_step_s"] == rp.simulate(bare, window, topo, cost).step_time


def test_log_metrics_delivers_to_each_kind_of_logger(capsys):
    data = {"routepack/predicted_step_s": 1.5, "moe/max_vio/max": 0.25}
    seen = []

    class Writer:
        def add_scalar(self, tag, value, step):
            seen.append(("writer", tag, value, step))

    log_metrics(Writer(), data, 7)
    log_metrics(lambda m, s: seen.append(("callable", m, s)), data, 8)
    assert seen == [
        ("writer", "routepack/predicted_step_s", 1.5, 7),
        ("writer", "moe/max_vio/max", 0.25, 7),
        ("callable", data, 8),
    ]
    tracking = pytest.importorskip("verl.utils.tracking")
    log_metrics(tracking.Tracking("routepack", "metrics", default_backend="console"), data, 9)
    out = capsys.readouterr().out
    assert "routepack/predicted_step_s" in out and "step:9" in out.replace(" ", "")
    with pytest.raises(RoutepackTypeError, match="logger: expected"):
        log_metrics(object(), data, 1)


def test_docs_list_every_name():
    text = (ROOT / "docs" / "metrics.md").read_text()
    listed = re.findall(r"^\| `([^`]+)` \|", text, flags=re.M)
    assert listed == list(NAMES) and len(NAMES) == len(METRICS)
