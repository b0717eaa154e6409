"""``runner.metrics()`` on the PlanRunner (2 gloo processes, dp = ep = 2): after each of two
windows' steps the trainer's logger (verl ``Tracking``'s ``log(data, step)`` and a Megatron
writer's ``add_scalar``, `routepack.metrics.log_metrics`) receives every documented name
(`routepack.metrics.NAMES`, less ``plan_s``, which hand-made plans do not record) with a
finite value, and the measured step time is the runner's own (`StepTimer`), inside the wall
time the test took around the step."""

import math
import time

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is required", allow_module_level=True)

import torch.distributed as dist  # noqa: E402

import routepack as rp  # noqa: E402
from routepack.metrics import NAMES, log_metrics  # noqa: E402
from routepack.plan import Placement  # noqa: E402
import selfcheck as sc  # noqa: E402
from routepack.torch.replay import rank_microbatches  # noqa: E402

CASE = sc.Case(dp=2, ep=2, gpus_per_node=1, slots_per_rank=6, experts=8, micro=3, windows=2, samples=12)


class Tracking:
    """verl's ``Tracking.log(data, step, backend=None)``, recording."""

    def __init__(self):
        self.calls = []

    def log(self, data, step, backend=None):
        self.calls.append((step, dict(data)))


class Writer:
    """Megatron's tensorboard writer (``add_scalar(tag, value, global_step)``), recording."""

    def __init__(self):
        self.calls = []

    def add_scalar(self, tag, value, global_step):
        self.calls.append((global_step, tag, value))


def cost_model(layers):
    return rp.CostModel(
        a_lin=1e-6,
        a_quad=[1e-9] * layers,
        c_tok=2e-6,
        c_exp=1e-4,
        token_bytes=4096.0,
        bw_intra=2e11,
        bw_inter=2.5e10,
        expert_weight_bytes=1e6,
        expert_grad_bytes=2e6,
        expert_state_bytes=4e6,
    )


def check_metrics(rank, world, device):
    case = CASE
    topo = case.topology()
    weights = sc.Weights(case, device)
    model = sc.EPModel(case, weights, device)
    tracking, writer = Tracking(), Writer()
    previous = Placement.static(case.layers, case.experts, topo)
    out = {"timer": [], "wall": [], "moved": []}
    for w in range(case.windows):
        plan, _static, window, routed, cu = sc.make_plans(case, w, previous)
        previous = plan.placement
        model.runner.begin_window(plan, window, model.opt)
        t0 = time.perf_counter()
        for mb in rank_microbatches(plan, routed, rank, cu):
            model.runner.start_micro(mb.micro)
            x, r = sc.model.inputs(case, w, rank, mb.micro, mb.routed.shape[0], device)
            (model(x, mb.routed) * r).sum().backward()
        model.runner.finish_step()
        out["wall"].append(time.perf_counter() - t0)
        model.opt.step()
        model.opt.zero_grad()
        metrics = model.runner.metrics(cost_model(case.layers))
        log_metrics(tracking, metrics, step=w)
        log_metrics(writer, metrics, step=w)
        out["timer"].append(model.runner.timer.seconds())
        out["moved"].append(int(plan.migration.size))
    out["tracking"] = tracking.calls
    out["writer"] = writer.calls
    dist.barrier()
    return out


def test_runner_metrics_reach_the_trainers_logger():
    out = sc.run_ranks(check_metrics, 2, join_timeout_s=240, pg_timeout_s=60)
    want = set(NAMES) - {"routepack/plan_s"}
    for rank, f in out.items():
        assert [s for s, _ in f["tracking"]] == [0, 1], rank
        for w, (step, data) in enumerate(f["tracking"]):
            assert set(data) == want, (rank, set(data) ^ want)
            assert all(math.isfinite(v) for v in data.values()), (rank, data)
            assert data["routepack/measured_step_s"] == f["timer"][w]
            assert 0 < data["routepack/measured_step_s"] <= f["wall"][w]
            assert data["routepack/experts_moved"] == f["moved"][w]
            assert data["routepack/imbalance_before/max"] >= data["routepack/imbalance_before/p90"] >= 1.0
            assert data["routepack/measured_over_predicted"] == pytest.approx(
                data["routepack/measured_step_s"] / data["routepack/predicted_step_s"]
            )
        # the writer got the same values, one scalar a name and step
        scalars = {(s, t): v for s, t, v in f["writer"]}
        assert len(scalars) == len(f["writer"]) == 2 * len(want)
        assert all(scalars[(s, k)] == v for s, data in f["tracking"] for k, v in data.items())
    assert out[0]["moved"][0] > 0 or out[0]["moved"][1] > 0
