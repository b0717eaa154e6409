"""Redundant experts' gradients are summed over the EP group once per step, in the backward of
the step's last microbatch (`routepack.torch.slot_link.StepSums`), not in every microbatch:
2 gloo processes (dp = ep = 2), a plan with redundant slots, replicas and 3 microbatches.

* the all-reduce of the redundant experts runs once per layer and step (counted), and every
  slot's gradient still equals the dense single-process gradient of its logical expert;
* it counts backwards, not microbatch indices: with every forward first and the backwards in
  reverse order (a GPipe-like schedule) the gradients are the same;
* a step whose last backward never ran is refused by `finish_step` on every rank, naming the
  microbatch (the execution audit; an optimizer step would miss the redundant experts'
  gradients); one left part-way on every rank is refused by the next `begin_window`, and
  `discard_step` abandons it."""

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is required", allow_module_level=True)

import torch.distributed as dist  # noqa: E402

from routepack.errors import RoutepackError  # noqa: E402
from routepack.plan import Placement, Plan  # noqa: E402
import selfcheck as sc  # noqa: E402
from routepack.torch import slot_link  # noqa: E402
from routepack.torch.moe import dense_moe  # noqa: E402
from routepack.torch.replay import rank_microbatches  # noqa: E402

CASE = sc.Case(dp=2, ep=2, gpus_per_node=2, slots_per_rank=6, experts=8, micro=3, windows=1, samples=12)
TOL = 1e-5


def _reference(case, weights, batches, device):
    ref_w1 = weights.w1.clone().requires_grad_(True)
    ref_w2 = weights.w2.clone().requires_grad_(True)
    loss = 0.0
    for d, mbs in batches.items():
        for mb in mbs:
            x, r = sc.model.inputs(case, 0, d, mb.micro, mb.routed.shape[0], device)
            y = sc.forward(
                x, mb.routed, list(weights.router), lambda l, a, i, g: dense_moe(a, i, g, ref_w1[l], ref_w2[l])
            )
            loss = loss + (y * r).sum()
    loss.backward()
    return ref_w1.grad, ref_w2.grad


def _worst(model, want1, want2):
    worst = 0.0
    for l, mod in enumerate(model.layers):
        for s, e in enumerate(mod.local_experts().tolist()):
            if e >= 0:
                worst = max(worst, sc.rel_err(mod.w1.grad[s], want1[l, e]), sc.rel_err(mod.w2.grad[s], want2[l, e]))
    return worst


def _loss(case, model, rank, mb, device):
    """This rank's microbatch ``mb`` through the EP model (made current first): its loss."""
    model.runner.start_micro(mb.micro)
    x, r = sc.model.inputs(case, 0, rank, mb.micro, mb.routed.shape[0], device)
    return (model(x, mb.routed) * r).sum()


def check_once_per_step(rank, world, device):
    case = CASE
    topo = case.topology()
    weights = sc.Weights(case, device)
    plan, _static, window, routed, cu = sc.make_plans(case, 0, Placement.static(case.layers, case.experts, topo))
    batches = {d: rank_microbatches(plan, routed, d, cu) for d in range(topo.dp)}
    want1, want2 = _reference(case, weights, batches, device)
    redundant = [
        int(slot_link.redundant_experts(plan.placement.phy2log[l], case.experts).size) for l in range(case.layers)
    ]
    out = {"redundant": redundant, "replicas": int(plan.replicas.size), "micro": plan.num_micro}

    calls = []
    real = slot_link.dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tuple(tensor.shape))
        return real(tensor, *args, **kwargs)

    slot_link.dist.all_reduce = counting
    try:
        # in order: forward + backward per microbatch
        model = sc.EPModel(case, weights, device)
        model.runner.begin_window(plan, window, model.opt)
        per_micro = []
        for mb in batches[rank]:
            before = len(calls)
            _loss(case, model, rank, mb, device).backward()
            per_micro.append(len(calls) - before)
        model.runner.finish_step()
        out["calls_per_micro"] = per_micro
        out["in_order"] = _worst(model, want1, want2)

        # every forward first, the backwards in reverse order
        model = sc.EPModel(case, weights, device)
        model.runner.begin_window(plan, window, model.opt)
        losses = [_loss(case, model, rank, mb, device) for mb in batches[rank]]
        for loss in reversed(losses):
            loss.backward()
        model.runner.finish_step()
        out["reversed"] = _worst(model, want1, want2)

        # the last backward never runs: finish_step refuses the step on every rank (the audit)
        model = sc.EPModel(case, weights, device)
        model.runner.begin_window(plan, window, model.opt)
        errors = []

        def attempt(call):
            try:
                call()
                errors.append("")
            except RoutepackError as e:
                errors.append(str(e))

        for mb in batches[rank][:-1]:
            _loss(case, model, rank, mb, device).backward()
        attempt(model.runner.finish_step)
        # the same plan without its migration, which has been carried out
        again = Plan(plan.placement, plan.sample_rank, plan.sample_micro, plan.num_micro, plan.replicas)
        # a step left part-way on every rank: the next begin_window refuses it on every rank
        for mb in batches[rank][:-1]:
            _loss(case, model, rank, mb, device).backward()
        attempt(lambda: model.runner.begin_window(again, window, model.opt))
        # ... and abandoned on purpose: accepted
        for mb in batches[rank][:-1]:
            _loss(case, model, rank, mb, device).backward()
        model.runner.discard_step()
        model.runner.begin_window(again, window, model.opt)
        out["errors"] = errors
    finally:
        slot_link.dist.all_reduce = real
    dist.barrier()
    return out


def test_redundant_gradients_are_summed_once_per_step():
    out = sc.run_ranks(check_once_per_step, 2, join_timeout_s=240, pg_timeout_s=60)
    with_copies = sum(1 for n in out[0]["redundant"] if n)
    assert with_copies == CASE.layers and out[0]["replicas"] > 0 and out[0]["micro"] == 3, out[0]
    for rank, f in out.items():
        # no sum before the last microbatch, then one per layer with redundant experts
        assert f["calls_per_micro"] == [0, 0, with_copies], (rank, f)
        assert f["in_order"] <= TOL and f["reversed"] <= TOL, (rank, f)
        finish, begin = f["errors"]
        # both ranks are named, each for the microbatch whose backward never came
        assert finish.startswith("finish_step: a planned microbatch never ran: microbatch 2 on DP rank 0"), finish
        assert "microbatch 2 on DP rank 1" in finish, finish
        assert "nothing was summed" in finish, finish
        assert "begin_window: every rank left step" in begin and "discard_step" in begin, begin
