"""The execution audit (issue 40, `routepack.torch.audit`): every step of a `PlanRunner` shows
that what ran is what was planned, or raises on every rank naming the cause, before anything is
summed across EP groups. 2 gloo processes each.

* finding 2, dp 2 x ep 1: rank 1 skips ``finish_step`` once. On main rank 0's step-0 gradient
  was then summed with rank 1's step 1 (2.919 + (-62.409)) and rank 1 never raised. Now rank
  1's ``optimizer.step`` (or, without one, its next ``start_micro``) joins rank 0's
  ``finish_step`` exchange: both raise "DP rank 1 skipped finish_step of step 0", rank 0's
  gradients are not summed and rank 1's optimizer does not step. A repeated ``finish_step``
  raises on the rank that repeats it, exchanging nothing.
* a microbatch that never ran (``start_micro`` forgotten: micro 0 runs twice, micro 1 never):
  both ranks raise naming it.
* finding 4, router replay off (dp = ep = 2, routes computed in the forward): the model routes
  with its own top-k while the plan was made from the recorded routes; the result is correct,
  but no cell received the planned tokens and nothing said so. Now every rank raises "routes
  differ from the plan's ... is router replay on?"; with ``audit="warn"`` it is logged and the
  step goes on (gradients equal the dense model's under the live routes); `last_audit` reports
  each unit's tokens against the plan's.
"""

import datetime
import logging

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is required", allow_module_level=True)

import torch.distributed as dist  # noqa: E402

import routepack as rp  # noqa: E402
import selfcheck as sc  # noqa: E402
from routepack.plan import Placement  # noqa: E402
from routepack.torch import AuditError, PlanRunner  # noqa: E402
from routepack.torch.moe import dense_moe  # noqa: E402
from routepack.torch.replay import rank_microbatches  # noqa: E402

TIMEOUT = datetime.timedelta(seconds=60)


def _outcome(call):
    try:
        call()
        return "nothing"
    except rp.RoutepackError as e:
        return f"{type(e).__name__}: {e}"


def _step(case, model, rank, mbs, device, w=0):
    """Every microbatch's forward and backward, as the runner's loop asks."""
    for mb in mbs:
        model.runner.start_micro(mb.micro)
        x, r = sc.model.inputs(case, w, rank, mb.micro, mb.routed.shape[0], device)
        (model(x, mb.routed) * r).sum().backward()


def _grads(model):
    return [p.grad.detach().clone() for mod in model.layers for p in (mod.w1, mod.w2)]


def check_skipped_finish(rank, world, device):
    case = sc.Case(dp=2, ep=1, gpus_per_node=1, slots_per_rank=8, experts=8, micro=2, samples=8, windows=1)
    topo = case.topology()
    groups = sc.make_groups(topo)
    weights = sc.Weights(case, device)
    plan, _static, window, routed, cu = sc.make_plans(case, 0, Placement.static(case.layers, case.experts, topo))
    mbs = rank_microbatches(plan, routed, rank, cu)
    model = sc.EPModel(case, weights, device, groups)
    model.runner.begin_window(plan, window, model.opt)
    out = {}

    # finding 2: rank 1 skips finish_step and steps its optimizer; rank 0 finishes the step
    _step(case, model, rank, mbs, device)
    grads = _grads(model)
    weights_before = [p.detach().clone() for p in model.parameters()]
    if rank == 0:
        out["skip_step"] = _outcome(model.runner.finish_step)
    else:
        out["skip_step"] = _outcome(model.opt.step)
    out["summed"] = any(not torch.equal(a, b) for a, b in zip(grads, _grads(model)))
    out["stepped"] = any(not torch.equal(a, p) for a, p in zip(weights_before, model.parameters()))
    model.opt.zero_grad(set_to_none=True)

    # the same, found at the next step's start_micro (no optimizer step in between)
    _step(case, model, rank, mbs, device)
    if rank == 0:
        out["skip_micro"] = _outcome(model.runner.finish_step)
    else:
        out["skip_micro"] = _outcome(lambda: _step(case, model, rank, mbs, device))
    model.opt.zero_grad(set_to_none=True)

    # finish_step twice on rank 1: raised there alone, nothing exchanged or summed
    _step(case, model, rank, mbs, device)
    model.runner.finish_step()
    out["repeat"] = _outcome(model.runner.finish_step) if rank == 1 else "not repeated"
    model.opt.zero_grad(set_to_none=True)
    dist.barrier()

    # micro 1 never runs: start_micro(1) forgotten, micro 0's data run twice
    for _ in range(2):
        model.runner.start_micro(0)
        x, r = sc.model.inputs(case, 0, rank, 0, mbs[0].routed.shape[0], device)
        (model(x, mbs[0].routed) * r).sum().backward()
    out["missing"] = _outcome(model.runner.finish_step)
    model.opt.zero_grad(set_to_none=True)

    # a clean step after all of it: the ranks agree again (same step numbers)
    _step(case, model, rank, mbs, device)
    model.runner.finish_step()
    out["clean"] = model.runner.last_audit().verdict
    out["step"] = model.runner.last_audit().step
    return out


def test_a_skipped_finish_step_raises_on_every_rank_with_nothing_summed():
    assert issubclass(AuditError, rp.RoutepackError)  # every input error and audit failure: one except
    out = sc.run_ranks(check_skipped_finish, 2, join_timeout_s=240, pg_timeout_s=60)
    for rank, f in out.items():
        msg = f["skip_step"]
        assert msg.startswith("AuditError: "), (rank, msg)
        assert "step numbers differ: DP rank 1 skipped finish_step of step 0 (it reached optimizer.step" in msg, msg
        assert "nothing was summed" in msg, msg
        assert not f["summed"] and not f["stepped"], (rank, f)
        assert "DP rank 1 skipped finish_step of step 1 (it reached start_micro of its next step" in f["skip_micro"]
        msg = f["missing"]
        assert "a planned microbatch never ran: microbatch 1 on DP rank 0" in msg, msg
        assert "a microbatch ran again after its backward, before the step's others: microbatch 0 on DP rank 0" in msg
        assert "microbatch 1 on DP rank 1" in msg and "microbatch 0 on DP rank 1" in msg, msg
        assert "call runner.start_micro(m)" in msg, msg
        assert f["clean"] == "ok" and f["step"] == 4, (rank, f)
    assert out[1]["repeat"].startswith("AuditError: finish_step: no MoE layer ran backward on this rank (DP rank 1)")
    assert "called twice" in out[1]["repeat"]


def live_forward(model, x, k):
    """The model routing with its own top-k (router replay off): returns (output, ids [T, L, k])."""
    h, used = x, []
    for l, router in enumerate(model.routers):
        a = torch.tanh(h)
        scores = torch.softmax(a @ router, dim=-1)
        gate, ids = scores.topk(k, dim=-1)
        used.append(ids)
        h = h + model.layers[l](a, ids, gate)
    return h, torch.stack(used, dim=1)


def check_live_routing(rank, world, device):
    case = sc.Case(dp=2, ep=2, gpus_per_node=2, slots_per_rank=6, experts=8, micro=2, samples=8, windows=1)
    topo = case.topology()
    weights = sc.Weights(case, device)
    plan, _static, window, routed, cu = sc.make_plans(case, 0, Placement.static(case.layers, case.experts, topo))
    mbs = rank_microbatches(plan, routed, rank, cu)
    out = {}
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("routepack.torch.audit").addHandler(Keep())
    for mode in ("raise", "warn"):
        model = sc.EPModel(case, weights, device)
        model.runner = PlanRunner(model.layers, topo, timeout=TIMEOUT, audit=mode)
        model.runner.begin_window(plan, window, model.opt)
        used = {}
        for mb in mbs:
            model.runner.start_micro(mb.micro)
            x, r = sc.model.inputs(case, 0, rank, mb.micro, mb.routed.shape[0], device)
            y, used[mb.micro] = live_forward(model, x, case.top_k)
            (y * r).sum().backward()
        out[mode] = _outcome(model.runner.finish_step)
        rep = model.runner.last_audit()
        out[f"{mode}_cells_off_plan"] = int((rep.measured_per_forward() != rep.planned).any(axis=2).sum())
        out[f"{mode}_cells"] = int(rep.forwards.size)
        out[f"{mode}_tokens"] = int(rep.tokens.sum())
        out[f"{mode}_planned"] = int(rep.planned.sum())
        if mode == "warn":
            # the step went on and its gradients are the dense model's under the live routes
            every = [None] * world
            dist.all_gather_object(every, {m: u.numpy() for m, u in used.items()})
            ref1 = weights.w1.clone().requires_grad_(True)
            ref2 = weights.w2.clone().requires_grad_(True)
            total = 0.0
            for d in range(world):
                for m, ids in every[d].items():
                    x, r = sc.model.inputs(case, 0, d, m, ids.shape[0], device)
                    y = sc.forward(
                        x,
                        torch.from_numpy(ids),
                        list(weights.router),
                        lambda l, a, i, g: dense_moe(a, i, g, ref1[l], ref2[l]),
                    )
                    total = total + (y * r).sum()
            total.backward()
            worst = 0.0
            for l, mod in enumerate(model.layers):
                for s, e in enumerate(mod.local_experts().tolist()):
                    if e >= 0:
                        worst = max(worst, sc.rel_err(mod.w1.grad[s], ref1.grad[l, e]))
            out["warn_grad_err"] = worst
    out["logged"] = records
    return out


def test_routes_other_than_the_plans_raise_or_warn():
    out = sc.run_ranks(check_live_routing, 2, join_timeout_s=240, pg_timeout_s=60)
    for rank, f in out.items():
        msg = f["raise"]
        assert msg.startswith("AuditError: finish_step: routes differ from the plan's: DP rank 0's MoE layer"), msg
        assert "is router replay on" in msg and "nothing was summed" in msg, msg
        for d in range(2):
            assert f"DP rank {d}'s MoE layer" in msg, msg
        # every cell off the plan, as measured on main (0 of 12 cells had the planned counts)
        assert f["raise_cells_off_plan"] == f["raise_cells"] > 0, f
        assert f["raise_tokens"] == f["raise_planned"] or f["raise_tokens"] > 0, f
        assert f["warn"] == "nothing", f
        assert len(f["logged"]) == 1 and "routes differ from the plan's" in f["logged"][0], f["logged"]
        assert "audit='warn': logged, the step goes on" in f["logged"][0]
        assert f["warn_grad_err"] <= 1e-5, f
