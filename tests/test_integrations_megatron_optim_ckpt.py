"""Optimizer state in Megatron distributed checkpoints of a model under a plan, keyed by
logical expert (docs/megatron.md, "Checkpoints"): Megatron's own calls,
``optimizer.sharded_state_dict(model_sd)`` and ``dist_checkpointing.save/load`` (torch_dist),
on CPU with gloo, EP 2, 8 experts in 5 slots a rank (redundant copies, an empty slot) and 2
replica buffers a rank, Megatron's Adam (a ``ChainedOptimizer``): ``FP32Optimizer`` on 2 ranks,
and ``DistributedOptimizer`` in its ``fully_reshardable`` format on 2 and 4 ranks (the
experts' state sharded over 2 ranks; its default format fails for the stock model too in
Megatron 0.16.1: ``flattened_range``).

Run A trains windows 0 and 1 (placement 1), saves model + optimizer, and continues with
window 2 (placement 2). Run B builds another model, trains a step of its own, moves to
placement 2 (from placement 0), loads the checkpoint and steps window 2; so does the stock
model (static placement). The next
loss and the weights after the step equal run A's, and every copy of an expert holds that
expert's Adam state (``exp_avg``, ``exp_avg_sq``, ``step``); slots without an expert hold
zeros. Formats that store optimizer state by physical buffer are refused. CUDA-only calls (and
two faults of DistributedOptimizer's load without Apex) are stood in for by tests/megatron_cpu.py."""

import multiprocessing
import types
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core", reason="megatron-core (pip install --no-deps megatron-core) not importable")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is required", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent / "torch"))  # tests/torch/selfcheck

import megatron_cpu  # noqa: E402
from routepack.plan import Placement  # noqa: E402
from routepack.torch.replay import rank_microbatches  # noqa: E402
from routepack.torch.spawn import run_ranks  # noqa: E402
from test_integrations_megatron_train import _raised, hand_plans  # noqa: E402

TOL = 1e-6
KEYS = ("exp_avg", "exp_avg_sq")


def _adam_state(opt, p):
    """The Adam state of model parameter ``p``, whole: Megatron's FP32 optimizer keys it by the
    parameter; ``DistributedOptimizer`` by its fp32 main shard, this rank's range of ``p`` (the
    ranges of its data-parallel group are summed into the whole)."""
    import torch.distributed as dist

    for o in getattr(opt, "chained_optimizers", [opt]):
        if hasattr(o, "model_param_group_index_map"):
            if not any(p in b.param_index_map for b in o.buffers):  # not this optimizer's parameter
                continue
            mine = o._get_main_param_and_optimizer_states(p) if p in o.model_param_group_index_map else None
            out = {}
            for k in KEYS:
                whole = torch.zeros(p.numel(), dtype=torch.float32)
                if mine is not None:
                    rng = o._get_model_param_range_map(p)["param"]
                    whole[rng.start : rng.end] = mine[k].reshape(-1)
                dist.all_reduce(whole, group=o.data_parallel_group)
                out[k] = whole
            step = torch.tensor([-1.0 if mine is None else float(mine.get("step", -1))])
            dist.all_reduce(step, op=dist.ReduceOp.MAX, group=o.data_parallel_group)
            out["step"] = step
            return out
        elif p in o.optimizer.state:
            return o.optimizer.state[p]
    raise KeyError("no optimizer state for a parameter")


def slot_states(model, opt):
    """Every local expert of the group: (layer, logical expert or -1, Adam state flattened in
    ``SequentialMLP``'s layout, whatever the expert module: `megatron_selfcheck.expert_slots`)."""
    import torch.distributed as dist
    import megatron_selfcheck as ms
    from routepack.integrations import megatron as rm

    layers = [m for m in model.modules() if any(c.__name__ == "MoELayer" for c in type(m).__mro__)]
    out = []
    for li, layer in enumerate(layers):
        per_slot = {}
        for name, p in layer.experts.named_parameters():
            state = _adam_state(opt, p)
            for i, tail, _, transposed in ms.expert_slots(layer.experts, name, p):
                views = {}
                for k in KEYS:
                    v = ms.expert_slots(layer.experts, name, state[k].view(p.shape))
                    t = next(t for j, _, t, _ in v if j == i)
                    views[k] = (t.t() if transposed else t).reshape(-1)
                per_slot.setdefault(i, []).append((tail, views, float(state.get("step", -1))))
        for i, e in enumerate(rm.slot_experts(layer).tolist()):
            parts = sorted(per_slot[i], key=lambda x: x[0])
            st = {k: torch.cat([v[k] for _, v, _ in parts]).clone() for k in KEYS}
            st["step"] = torch.tensor([s for _, _, s in parts])
            out.append((li, int(e), st))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out)
    return [row for rows in gathered for row in rows]


def state_diffs(rows, ref):
    """Largest difference of any copy's state from its expert's in ``ref``; largest |state| of
    a slot without an expert; how many copies were compared."""
    copy = empty = 0.0
    n = 0
    for li, e, st in rows:
        if e < 0:
            empty = max([empty] + [float(st[k].abs().max()) for k in KEYS])
            continue
        n += 1
        copy = max([copy] + [float((st[k] - ref[(li, e)][k]).abs().max()) for k in (*KEYS, "step")])
    return copy, empty, n


def _save(ddp, opt, directory, meta):
    from megatron.core import dist_checkpointing

    model_sd = ddp.module.sharded_state_dict(metadata=meta)
    dist_checkpointing.save(
        {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, metadata=meta)}, directory
    )


def _load(ddp, opt, directory, meta, stale=False):
    """Megatron's load of model + optimizer; ``stale``: every Adam moment holds 7 before the load."""
    from megatron.core import dist_checkpointing

    model_sd = ddp.module.sharded_state_dict(metadata=meta)
    sd = {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading=True, metadata=meta)}
    if stale:
        for o in getattr(opt, "chained_optimizers", [opt]):
            for st in o.optimizer.state.values():
                for k in KEYS:
                    st[k].fill_(7.0)
    state = dist_checkpointing.load(sd, directory)
    ddp.module.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])


def check_optimizer_checkpoint(rank, world, device, root, distopt, experts_module="sequential"):
    megatron_cpu.install(optimizers=True)
    multiprocessing.current_process()._config["daemon"] = False  # the torch_dist writer forks
    from megatron.core import parallel_state
    import megatron_selfcheck as ms
    from routepack.integrations import megatron as rm

    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    case = ms.MegatronCase(
        dp=world, ep=2, gpus_per_node=2, slots_per_rank=5, distributed_optimizer=distopt, experts_module=experts_module
    )
    meta = None
    if distopt:  # gathers over gloo on the CPU ("mem_efficient"; the default gathers on the GPU)
        meta = {
            "distrib_optim_sharding_type": "fully_reshardable",
            "distrib_optim_fully_reshardable_mem_efficient": True,
        }
    topo = ms.topology(case)
    plans = hand_plans(case)
    static = Placement.static(case.layers, case.experts, topo)
    out = {}

    # run A: windows 0, 1, checkpoint, window 2
    model = ms.build_model(case, True)
    ddp, opt = ms.wrap(model, case)
    # the trainers' default DistributedOptimizer formats are refused when the runner is built
    defaults = {
        "dp_reshardable": types.SimpleNamespace(dist_ckpt_optim_fully_reshardable=False),  # verl's, Megatron-LM's
        "fully_sharded_model_space": {"distrib_optim_sharding_type": "fully_sharded_model_space"},  # Megatron-Core's
    }
    out["runner_refusals"] = {
        f: _raised(lambda: rm.MegatronRunner(ddp, topo, checkpoint=s)) for f, s in defaults.items()
    }
    runner = rm.MegatronRunner(ddp, topo, checkpoint=meta)  # fully_reshardable (distopt) or None: accepted
    previous = static
    for w in range(3):
        plan, _, window, routed, cu = plans(w, previous)
        previous = plan.placement
        runner.begin_window(plan, window, opt)
        losses, _ = ms.run_step(
            case, w, ddp, opt, rank_microbatches(plan, routed, rank, cu, dp=case.dp), cu, runner, "cpu"
        )
        if w == 1:
            placement1 = plan.placement
            saved = slot_states(ddp, opt)
            ref = {(li, e): st for li, e, st in saved if e >= 0}  # the last copy of each: any copy
            out["saved_copies"] = state_diffs(saved, ref)[0]  # copies are equal in training
            _save(ddp, opt, root, meta)
    out["loss"] = losses
    weights = {k: v.clone() for k, v in rm.export_weights(ddp)}

    # runs B: a plan model under placement 2 and the stock model, each after one step of its own
    # (window 0; DistributedOptimizer.state_dict needs a step without Apex), load window 1's checkpoint
    plan0, static0, window0, routed0, cu0 = plans(0, static)
    plan2, static2, window, routed, cu = plans(2, plan0.placement)
    out["placements_differ"] = not np.array_equal(plan2.placement.phy2log, placement1.phy2log)
    out["held"] = int((plan2.placement.phy2log >= 0).sum())  # placement slots holding an expert
    out["second_local"] = {  # placements 1 and 2: copies of an expert after its first on one rank
        p: sum(int((row >= 0).sum()) - len(set(row[row >= 0].tolist())) for row in ph.reshape(-1, case.slots_per_rank))
        for p, ph in ((1, placement1.phy2log), (2, plan2.placement.phy2log))
    }
    for name, is_plan in (("plan", True), ("stock", False)):
        model = ms.build_model(case, is_plan)
        ddp, opt = ms.wrap(model, case)
        runner = rm.MegatronRunner(ddp, topo) if is_plan else None
        use = plan0 if is_plan else static0
        if runner is not None:
            runner.begin_window(plan0, window0, opt)
        ms.run_step(case, 0, ddp, opt, rank_microbatches(use, routed0, rank, cu0, dp=case.dp), cu0, runner, "cpu")
        if runner is not None:
            runner.begin_window(plan2, window, opt)  # placement 2, migrated from placement 0
        if distopt:  # Megatron's default format, stock model included
            out[f"{name}_default_format"] = _raised(lambda: _save(ddp, opt, root + "-default", None))
        _load(ddp, opt, root, meta, stale=is_plan)
        out[f"{name}_states"] = state_diffs(slot_states(ddp, opt), ref)
        use = plan2 if is_plan else static2
        losses, _ = ms.run_step(
            case, 2, ddp, opt, rank_microbatches(use, routed, rank, cu, dp=case.dp), cu, runner, "cpu"
        )
        out[f"{name}_loss"] = float(np.abs(np.asarray(losses) - np.asarray(out["loss"])).max())
        got = dict(rm.export_weights(ddp))
        out[f"{name}_weights"] = max(float((got[k] - weights[k]).abs().max()) for k in weights)
        out[f"{name}_missing"] = sorted(set(weights) ^ set(got))

    # placement-dependent DistributedOptimizer formats are refused when the model's state dict is built
    placed = {"distrib_optim_sharding_type": "dp_reshardable"}
    out["refused"] = _raised(lambda: ddp.module.sharded_state_dict(metadata=placed))
    plan_model = ms.build_model(case, True)
    out["refused_plan"] = _raised(lambda: plan_model.sharded_state_dict(metadata=placed))
    return out


@pytest.mark.parametrize(
    "world, distopt", [(2, False), (2, True), (4, True)], ids=["fp32", "distributed", "distributed-4ranks"]
)
def test_optimizer_checkpoint_loads_under_another_placement(world, distopt):
    with tempfile.TemporaryDirectory() as root:
        for d in ("ckpt", "ckpt-default"):
            os.makedirs(os.path.join(root, d))
        out = run_ranks(
            check_optimizer_checkpoint, world, os.path.join(root, "ckpt"), distopt, join_timeout_s=600, pg_timeout_s=180
        )
    assert_checkpoint_ok(out, world, distopt)


def assert_checkpoint_ok(out, world, distopt):
    """`check_optimizer_checkpoint`'s results on every rank: the loads equal run A and every
    copy's optimizer state its expert's."""
    for rank, f in sorted(out.items()):
        assert f["placements_differ"] and min(f["second_local"].values()) > 0, (rank, f["second_local"])
        assert f["held"] < 2 * 2 * 5  # an empty slot, besides the replica buffers (2 layers, EP 2)
        assert f["saved_copies"] <= TOL, (rank, f["saved_copies"])
        for name in ("plan", "stock"):
            copy, empty, n = f[f"{name}_states"]
            # every copy (2 layers), once per expert-data-parallel rank
            assert n == (f["held"] if name == "plan" else 2 * 8) * (world // 2), (rank, name, n)
            assert copy <= TOL and empty == 0.0, (rank, name, copy, empty)
            assert f[f"{name}_loss"] <= TOL and f[f"{name}_weights"] <= TOL, (rank, name, f)
            assert not f[f"{name}_missing"], (rank, name, f[f"{name}_missing"])
        if distopt:  # Megatron's default format fails alike for the stock model (flattened ranges)
            for name in ("plan", "stock"):
                assert "flattened_range is not supported" in f[f"{name}_default_format"], (rank, name, f)
        for fmt, refusal in f["runner_refusals"].items():
            assert refusal.startswith("RoutepackError") and f"distrib_optim_sharding_type='{fmt}'" in refusal, refusal
            assert "dist_ckpt_optim_fully_reshardable=True" in refusal, refusal
        assert f["refused"] == "nothing"  # the stock model's state dict does not depend on a placement
        assert f["refused_plan"].startswith("RoutepackError") and "'fully_reshardable'" in f["refused_plan"], f


@pytest.mark.parametrize(
    "settings, fmt",
    [
        (types.SimpleNamespace(dist_ckpt_optim_fully_reshardable=False), "dp_reshardable"),  # verl's engine config
        (
            types.SimpleNamespace(use_distributed_optimizer=True, dist_ckpt_optim_fully_reshardable=False),
            "dp_reshardable",  # Megatron-LM's args, its default
        ),
        ({"distrib_optim_sharding_type": "fully_sharded_model_space"}, "fully_sharded_model_space"),
        (types.SimpleNamespace(use_megatron_fsdp=True, dist_ckpt_optim_fully_reshardable=True), "fsdp_dtensor"),
    ],
)
def test_runner_refuses_the_trainers_default_formats_when_built(settings, fmt):
    import routepack as rp
    from routepack.integrations.megatron.checkpoint import checkpoint_format
    from routepack.integrations.megatron.runner import MegatronRunner

    assert checkpoint_format(settings) == fmt
    with pytest.raises(
        rp.RoutepackError, match=f"distrib_optim_sharding_type='{fmt}'.*dist_ckpt_optim_fully_reshardable=True"
    ):
        MegatronRunner(torch.nn.Linear(2, 2), rp.Topology(2, 2, 2, 5), checkpoint=settings)


def test_the_formats_that_carry_a_plan_pass_the_check():
    import routepack as rp
    from routepack.integrations.megatron.checkpoint import checkpoint_format, refuse_checkpoint_format

    for settings in (
        types.SimpleNamespace(dist_ckpt_optim_fully_reshardable=True),
        {"distrib_optim_sharding_type": "fully_reshardable"},
        types.SimpleNamespace(use_distributed_optimizer=False),  # FP32 / mixed precision: state by parameter
    ):
        refuse_checkpoint_format(settings)
    assert checkpoint_format(types.SimpleNamespace(use_distributed_optimizer=False)) is None
    with pytest.raises(rp.RoutepackError, match="neither distrib_optim_sharding_type"):
        checkpoint_format(types.SimpleNamespace())
