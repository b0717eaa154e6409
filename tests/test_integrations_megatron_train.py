"""The whole plan inside Megatron-Core on CPU with gloo (issue 31's acceptance): a small
``GPTModel`` (local spec, no Transformer Engine, fp32, 8 experts top-2, the stock all-to-all
dispatcher, Megatron's DDP, optimizer and ``forward_backward_func``) trains 3 windows whose
plans migrate experts, hold redundant experts and replicate hot experts in every cell
(tests/torch/selfcheck's plans), next to the same model under Megatron's static placement on
the same data:

* losses, grad norms and the exported logical weights equal the static model's to 1e-5;
* every rank receives exactly the tokens the plan predicts in every (micro, layer) cell
  (`routepack._core.rank_tokens`, what `simulate` prices), replica buffers included;
* a checkpoint (Megatron's ``dist_checkpointing``, torch.distributed.checkpoint) saved under
  one placement loads under another, and into the stock model, with the same next loss;
* bad plans are refused on every rank before anything moves.

2 ranks at EP 2 (Megatron's FP32 optimizer), 4 ranks at EP 2 (``DistributedOptimizer``, its
state sharded over 2 expert-data-parallel ranks) and at EP 4. CUDA-only calls are stood in
for by tests/megatron_cpu.py (the only place; each with its reason)."""

import multiprocessing
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
import routepack as rp  # noqa: E402
from routepack.plan import Placement, Plan  # noqa: E402
from routepack.torch.replay import rank_microbatches  # noqa: E402
from routepack.torch.spawn import run_ranks  # noqa: E402

TOL = 1e-5


def hand_plans(case):
    """``plans(w, previous)`` from tests/torch/selfcheck: every window's placement has
    redundant experts and differs from the previous one; every cell has replica rows."""
    from selfcheck.case import Case, make_plans

    base = Case(
        dp=case.dp,
        ep=case.ep,
        gpus_per_node=case.gpus_per_node,
        slots_per_rank=case.slots_per_rank,
        layers=case.layers,
        experts=case.experts,
        top_k=case.top_k,
        hidden=case.hidden,
        ffn=case.ffn,
        micro=case.micro,
        samples=case.samples,
        windows=case.windows,
        seed=case.seed,
    )
    return lambda w, previous: make_plans(base, w, previous)


def _raised(fn):
    try:
        fn()
    except rp.RoutepackError as e:
        return f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001
        return f"OTHER {type(e).__name__}: {e}"
    return "nothing"


def _load(model, directory):
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load(model.sharded_state_dict(), directory)
    model.load_state_dict(state)


def check_training(rank, world, device, ep, distopt, ckpt_root, refusals, experts_module="sequential"):
    megatron_cpu.install(optimizers=True)
    # Megatron's torch_dist checkpoint writer forks writer processes; run_ranks starts its
    # ranks as daemons, which multiprocessing forbids to have children
    multiprocessing.current_process()._config["daemon"] = False
    from megatron.core import dist_checkpointing, parallel_state
    import megatron_selfcheck as ms
    from routepack.integrations import megatron as rm

    parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
    case = ms.MegatronCase(
        dp=world,
        ep=ep,
        gpus_per_node=2,
        slots_per_rank=5 if ep == 2 else 3,
        distributed_optimizer=distopt,
        experts_module=experts_module,
    )
    plans = hand_plans(case)
    seen = {"received_ok": [], "replica_tokens": 0, "buffers": 0}

    def record(w, model, opt, runner):
        runner.recording = True

    def check(w, model, opt, runner):
        pred = runner.predicted_received()
        got = np.zeros_like(pred)
        for (m, l), counts in runner.received.items():
            got[m, l] = sum(counts)
            seen["replica_tokens"] += sum(counts[case.slots_per_rank :])
        seen["received_ok"].append(bool(np.array_equal(got, pred)) and len(runner.received) == pred.size)
        if w == 1:
            dist_checkpointing.save(model.module.sharded_state_dict(), os.path.join(ckpt_root, "plan"))

    def save_static(w, model, opt, runner):
        if w == 1:
            dist_checkpointing.save(model.module.sharded_state_dict(), os.path.join(ckpt_root, "static"))

    static = ms.train(case, False, rank, plans=plans, after_window=save_static)
    planned = ms.train(case, True, rank, plans=plans, before_step=record, after_window=check)
    out = {k: planned[k] for k in ("migrated", "replicated", "redundant", "experts")}
    out["cmp"], out["stock_experts"] = ms.compare(static, planned), static["experts"]
    out.update(seen)
    out["migrations"] = planned["migrations"]

    # the checkpoints of window 1 (placement 1 / static) load under placement 2 and into the
    # stock model: the next losses (window 2's, before its step) are the trained model's
    _, _, window, routed, cu = plans(2, Placement.static(case.layers, case.experts, ms.topology(case)))
    fresh_plan, _, _, _, _ = plans(2, Placement.static(case.layers, case.experts, ms.topology(case)))
    out["next_loss"] = planned["losses"][2]
    for name, is_plan, src in (
        ("plan<-plan", True, "plan"),
        ("plan<-static", True, "static"),
        ("stock<-plan", False, "plan"),
    ):
        model = ms.build_model(case, is_plan)
        ddp, _ = ms.wrap(model, case)
        runner = rm.MegatronRunner(ddp, ms.topology(case)) if is_plan else None
        if runner is not None:
            runner.begin_window(fresh_plan, window, optimizer_state="none")  # placement 2 from the static one
            assert fresh_plan.migration.size and not np.array_equal(
                fresh_plan.placement.phy2log,
                plans(1, Placement.static(case.layers, case.experts, ms.topology(case)))[0].placement.phy2log,
            )
        _load(model, os.path.join(ckpt_root, src))
        use = fresh_plan if is_plan else plans(2, fresh_plan.placement)[1]
        mbs = rank_microbatches(use, routed, rank, cu, dp=case.dp)
        out[name] = ms.evaluate(case, 2, ddp, mbs, cu, runner, "cpu")
    if refusals:
        out["errors"] = check_refusals(case, rank, plans)
    return out


def check_refusals(case, rank, plans):
    """Plans this job cannot carry out are refused on every rank before anything moves."""
    from megatron.core.distributed import DistributedDataParallelConfig
    import megatron_selfcheck as ms
    from routepack.integrations import megatron as rm

    topo = ms.topology(case)
    static = Placement.static(case.layers, case.experts, topo)
    model = ms.build_model(case, True)
    ddp, opt = ms.wrap(model, case)
    runner = rm.MegatronRunner(ddp, topo)
    plan0, _, window0, routed0, cu0 = plans(0, static)
    runner.begin_window(plan0, window0, opt)
    ms.run_step(case, 0, ddp, opt, rank_microbatches(plan0, routed0, rank, cu0, dp=case.dp), cu0, runner, "cpu")
    plan1, _, window1, _, _ = plans(1, plan0.placement)
    before = {k: v.clone() for k, v in rm.export_weights(ddp)}
    row_before = [m.phy2log.copy() for m in runner.layers]
    errors = {"optimizer_none": _raised(lambda: runner.begin_window(plan1, window1, None))}
    # a job that says it has no optimizer state, while Megatron's optimizer holds some: refused
    errors["state_none"] = _raised(lambda: runner.begin_window(plan1, window1, optimizer_state="none"))
    # more copies in one cell than replica buffers
    rows = plan1.replicas
    keep = rows[~((rows["micro"] == 0) & (rows["group"] == 0) & (rows["layer"] == 0))]
    on0 = [int(e) for e in dict.fromkeys(plan1.placement.phy2log[0, : case.slots_per_rank].tolist()) if e >= 0]
    cell = [(0, 0, 0, e, 0, 1, 0.1) for e in on0[: case.replica_slots + 1]]  # one copy too many on EP rank 1
    crowd = np.concatenate([keep, np.array(cell, dtype=rows.dtype)])
    crowded = Plan(plan1.placement, plan1.sample_rank, plan1.sample_micro, plan1.num_micro, crowd, plan1.migration)
    errors["buffers"] = _raised(lambda: runner.begin_window(crowded, window1, opt))
    saved = runner.ddp_configs
    runner.ddp_configs = [DistributedDataParallelConfig(overlap_grad_reduce=True)]
    errors["overlap"] = _raised(lambda: runner.begin_window(plan1, window1, opt))
    runner.ddp_configs = saved
    after = dict(rm.export_weights(ddp))
    errors["intact"] = all(torch.equal(before[k], after[k]) for k in before) and all(
        np.array_equal(a, m.phy2log) for a, m in zip(row_before, runner.layers)
    )
    return errors


def _run(world, ep, distopt, refusals, timeout):
    with tempfile.TemporaryDirectory() as root:
        for d in ("plan", "static"):
            os.makedirs(os.path.join(root, d))
        return run_ranks(check_training, world, ep, distopt, root, refusals, join_timeout_s=timeout, pg_timeout_s=180)


def _assert_ok(out, distopt_sharded=False):
    for rank, f in sorted(out.items()):
        c = f["cmp"]
        assert c["missing"] == 0 and c["loss"] <= TOL and c["weights"] <= TOL and c["grad_norm"] <= TOL, (rank, c)
        assert all(f["received_ok"]) and len(f["received_ok"]) == 3, (rank, f["received_ok"])
        assert all(m for m in f["migrations"][1:]), (rank, f["migrations"])  # windows 1, 2 moved experts
        for name in ("plan<-plan", "plan<-static", "stock<-plan"):
            assert np.allclose(f[name], f["next_loss"], rtol=0, atol=TOL), (rank, name, f[name], f["next_loss"])
    assert out[0]["migrated"] > 0 and out[0]["replicated"] > 0 and out[0]["redundant"] > 0
    assert sum(f["replica_tokens"] for f in out.values()) > 0  # replica buffers computed tokens


def test_two_ranks_ep2_plans_equal_static_placement():
    out = _run(2, 2, False, True, 600)
    _assert_ok(out)
    for rank, f in out.items():
        e = f["errors"]
        assert e["optimizer_none"].startswith("RoutepackError: optimizer: None; begin_window needs the optimizer"), e
        assert e["state_none"].startswith("RoutepackError") and "keeps state" in e["state_none"], e
        assert "InvalidPlanError" in e["buffers"] and "replica_slots=2" in e["buffers"], e
        assert "overlap_grad_reduce" in e["overlap"], e
        assert e["intact"], e


def test_four_ranks_ep2_distributed_optimizer():
    out = _run(4, 2, True, False, 900)
    _assert_ok(out)


def test_four_ranks_ep4():
    out = _run(4, 4, False, False, 900)
    _assert_ok(out)
