"""Trainers that read expert gradients when their hooks fire (issue 16, item 2) see the replica
and redundant-slot gradients: 4 gloo processes, two EP groups of 2 (dp=4, ep=2), a plan with
migration, replicas and redundant slots.

* a Megatron-style trainer: ``register_post_accumulate_grad_hook`` adds ``p.grad`` into an
  fp32 ``main_grad`` and drops ``p.grad`` (as ``overlap_grad_reduce`` does); its expert-data-
  parallel sum runs on ``main_grad`` afterwards;
* ``torch.nn.parallel.DistributedDataParallel`` over the expert-data-parallel group, which
  reduces each bucket inside backward (it averages over the group's 2 ranks).

Neither calls anything of routepack after backward. Each slot's gradient must equal the
dense single-process gradient of its logical expert. On a glue that adds replica gradients
into ``p.grad`` after backward (routepack before issue 16) both fail. Only public API that
predates issue 16 is used here, so the file can run against an older package too."""

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is required", allow_module_level=True)

import torch.distributed as dist  # noqa: E402

from routepack.plan import Placement  # noqa: E402
import selfcheck as sc  # noqa: E402
from routepack.torch.moe import dense_moe  # noqa: E402
from routepack.torch.replay import rank_microbatches  # noqa: E402

CASE = sc.Case(dp=4, ep=2, gpus_per_node=2, slots_per_rank=5, windows=1, samples=8)
TOL = 1e-5


class _Experts(torch.nn.Module):
    """The EP model's expert slots as one module, so DDP can own them."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.slots = torch.nn.ParameterList([p for mod in model.layers for p in (mod.w1, mod.w2)])

    def forward(self, x, ids):
        return self.model(x, ids)


def check_hooks(rank, world, device):
    case = CASE
    topo = case.topology()
    weights = sc.Weights(case, device)
    groups = sc.make_groups(topo)
    edp = groups[1]
    plan, _static, window, routed, cu = sc.make_plans(case, 0, Placement.static(case.layers, case.experts, topo))
    batches = {d: rank_microbatches(plan, routed, d, cu) for d in range(topo.dp)}

    # dense reference gradient of every logical expert over every rank's microbatches
    ref_w1 = weights.w1.clone().requires_grad_(True)
    ref_w2 = weights.w2.clone().requires_grad_(True)
    loss = 0.0
    for d in range(topo.dp):
        for mb in batches[d]:
            x, r = sc.model.inputs(case, 0, d, mb.micro, mb.routed.shape[0], device)
            y = sc.forward(
                x, mb.routed, list(weights.router), lambda l, a, i, g: dense_moe(a, i, g, ref_w1[l], ref_w2[l])
            )
            loss = loss + (y * r).sum()
    loss.backward()

    out = {"replica_rows": int(plan.replicas.size), "moved_rows": int(plan.migration.size)}
    # Megatron-style: hooks move the gradient into fp32 main_grad as soon as it is accumulated
    mg = sc.EPModel(case, weights, device, groups)
    for mod in mg.layers:
        for p in (mod.w1, mod.w2):
            p.main_grad = torch.zeros_like(p, dtype=torch.float32)

            def hook(param):
                param.main_grad += param.grad.float()
                param.grad = None

            p.register_post_accumulate_grad_hook(hook)
    # DDP over the expert-data-parallel group: buckets reduced inside backward
    dp_model = sc.EPModel(case, weights, device, groups)
    ddp = torch.nn.parallel.DistributedDataParallel(_Experts(dp_model), process_group=edp, bucket_cap_mb=1)

    for name, model, run in (("main_grad", mg, mg), ("ddp", dp_model, ddp)):
        model.runner.begin_window(plan, window, model.opt)
        for mb in batches[rank]:
            model.runner.start_micro(mb.micro)
            x, r = sc.model.inputs(case, 0, rank, mb.micro, mb.routed.shape[0], device)
            (run(x, mb.routed) * r).sum().backward()
        if name == "main_grad":  # the trainer's own expert-data-parallel sum, after backward
            for mod in model.layers:
                for p in (mod.w1, mod.w2):
                    dist.all_reduce(p.main_grad, group=edp)
        worst = 0.0
        for l, mod in enumerate(model.layers):
            for s, e in enumerate(mod.local_experts().tolist()):
                if e < 0:
                    continue
                for p, want in ((mod.w1, ref_w1.grad[l, e]), (mod.w2, ref_w2.grad[l, e])):
                    got = p.main_grad[s] if name == "main_grad" else p.grad[s] * dist.get_world_size(edp)
                    worst = max(worst, sc.rel_err(got, want))
        out[name] = worst
    return out


def test_hooked_trainers_see_replica_and_redundant_gradients():
    out = sc.run_ranks(check_hooks, 4, join_timeout_s=240, pg_timeout_s=60)
    assert out[0]["replica_rows"] > 0 and out[0]["moved_rows"] > 0
    for rank, f in out.items():
        assert f["main_grad"] <= TOL, (rank, f)
        assert f["ddp"] <= TOL, (rank, f)
