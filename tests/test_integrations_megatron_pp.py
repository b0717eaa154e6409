"""routepack's plans inside Megatron-Core under a pipeline, on CPU with gloo (issue 35's glue
acceptance): 4 ranks as pp = 2 x ep = 2 (tp = 1, dp = 2 a stage), a small ``GPTModel`` of 4
MoE layers (2 a stage; local spec, fp32, 8 experts top-2, the stock all-to-all dispatcher,
Megatron's DDP and optimizer), every step run by Megatron's own 1F1B schedule
(``get_forward_backward_func()`` = ``forward_backward_pipelining_without_interleaving``,
microbatches of different lengths: ``variable_seq_lengths``) over >= 2 microbatches a DP rank.
Three windows of plans by `routepack.plan_window` (EPLB placement with redundant experts,
routepack's packing; without replicas, and with ``hot_n`` replicas in every cell) migrate
experts of every layer in every window; next to it, the stock model (Megatron's ``MoELayer``,
static placement) on the same data:

* every plan validates (the planner and the runner check), the digest of each window's plan is
  the same on all 4 ranks (both stages), each stage's runner holds its own MoE layers and
  applies exactly the plan's migration rows of those layers, and every rank's experts receive
  the tokens the plan predicts in every (microbatch, layer) cell of its stage;
* losses per microbatch (the last stage's), grad norms and the logical weights of each stage
  equal the stock model's to 1e-5;
* a checkpoint (Megatron's ``dist_checkpointing``) saved under one placement loads under
  another, and into the stock model, with the same next losses;
* with replicas (2 replica buffers a rank): losses, grad norms and weights equal the stock
  model's to 1e-5 too, every (micro, layer) cell of both stages has copies that received
  tokens, and the first stage, which runs the forward of micro m + 1 before the backward of
  micro m, put micro m's copies back before its experts' backward; without that the weights
  drift from the stock model's (checked: the test can fail);
* refused on every rank, nothing moved: a plan with more copies than the layers' replica
  buffers, stages holding different plans (one digest per window), a plan one stage refuses;
* the runner works over the process groups it is given (`MegatronGroups`): the planned model
  trains over communicators of its own with the ranks of Megatron's EP and pipeline groups,
  and groups that are not the model's (an EP group of other ranks, a pipeline size without
  a group, not a `MegatronGroups`) are refused naming the field.

CUDA-only calls are stood in for by tests/megatron_cpu.py (the only place; each with its reason)."""

import dataclasses
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

import megatron_cpu  # noqa: E402
import routepack as rp  # noqa: E402
from routepack.torch.replay import rank_microbatches  # noqa: E402
from routepack.torch.spawn import run_ranks  # noqa: E402

TOL = 1e-5
#: EPLB's placement (redundant copies of the window's hot experts, moved every window),
#: routepack's packing, no intra-batch replicas
POLICY = rp.Policy(placement="eplb", packing="routepack", replication="none", loads="window")
#: the same with intra-batch replicas of the hot experts in every (micro, layer) cell
REPLICA_POLICY = rp.Policy(placement="eplb", packing="routepack", replication="hot_n", loads="window")


def _case(pp, ep, replica_slots=0):
    """pp stages of 2 MoE layers (pp = 2: dp = ep = 2; pp = 3: dp = ep = 1, a middle stage),
    2 redundant slots a layer, ``replica_slots`` replica buffers a rank (0: plans without
    replicas); token_cap 24 a DP rank of 2, 48 alone: >= pp microbatches (samples of 4-23
    tokens)."""
    import megatron_selfcheck as ms

    return ms.MegatronCase(
        dp=ep,
        ep=ep,
        gpus_per_node=ep,
        pp=pp,
        layers=2 * pp,
        slots_per_rank=10 // ep,
        replica_slots=replica_slots,
        replicas=replica_slots > 0,
        token_cap=48 // ep,
    )


def _raised(fn):
    try:
        fn()
    except rp.RoutepackError as e:
        return f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001
        return f"OTHER {type(e).__name__}: {e}"
    return "nothing"


def check_pipeline(rank, world, device, ckpt_root, pp, ep):
    megatron_cpu.install(optimizers=True)
    # Megatron's torch_dist checkpoint writer forks writer processes; run_ranks starts its
    # ranks as daemons, which multiprocessing forbids to have children
    multiprocessing.current_process()._config["daemon"] = False
    from megatron.core import dist_checkpointing, parallel_state

    import megatron_selfcheck as ms
    from routepack.torch.broadcast import digest_int

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp, expert_model_parallel_size=ep)
    case = _case(pp, ep)
    dp_rank = parallel_state.get_data_parallel_rank()
    plans = ms.planned(case, POLICY)
    seen = {
        "digests": [],
        "rows": [],
        "expected_rows": [],
        "num_micro": [],
        "redundant": [],
        "layers": None,
        "received_ok": [],
        "own_groups": [],
    }
    groups = ms.own_groups()

    def record(w, ddp, opt, runner):
        plan = runner.plan
        seen["own_groups"].append(runner.group is groups.ep and runner.pp_group is groups.pp)
        mine = [m.moe_index for m in runner.layers]
        seen["layers"] = mine
        seen["digests"].append(digest_int(plan))
        seen["num_micro"].append(plan.num_micro)
        seen["rows"].append(0 if runner.last_migration is None else runner.last_migration.rows)
        seen["expected_rows"].append(int(np.isin(plan.migration["layer"], mine).sum()))
        seen["redundant"].append(int(sum(np.unique(r[r >= 0]).size < (r >= 0).sum() for r in plan.placement.phy2log)))
        for i, m in enumerate(runner.layers):  # the stage's layers hold the plan's rows of its layers
            assert np.array_equal(m.phy2log, plan.placement.phy2log[mine[i]])
        runner.recording = True

    def received(w, ddp, opt, runner):
        # every local expert of the stage's layers received the tokens the plan predicts, every micro
        pred = runner.predicted_received()[:, seen["layers"]]
        got = np.zeros_like(pred)
        for (m, l), counts in runner.received.items():
            got[m, seen["layers"].index(l)] = sum(counts)
        seen["received_ok"].append(bool(np.array_equal(got, pred)) and len(runner.received) == pred.size)
        if w == 1 and ckpt_root is not None:
            dist_checkpointing.save(ddp.module.sharded_state_dict(), os.path.join(ckpt_root, "plan"))

    def save_static(w, ddp, opt, runner):
        if w == 1 and ckpt_root is not None:
            dist_checkpointing.save(ddp.module.sharded_state_dict(), os.path.join(ckpt_root, "static"))

    static = ms.train(case, False, dp_rank, plans=plans, after_window=save_static)
    planned = ms.train(case, True, dp_rank, plans=plans, before_step=record, after_window=received, groups=groups)
    out = {
        "stage": parallel_state.get_pipeline_model_parallel_rank(),
        "cmp": ms.compare(static, planned),
        "losses": [len(w) for w in planned["losses"]],
        "static_losses": [len(w) for w in static["losses"]],
        "migrated": planned["migrated"],
    }
    out.update(seen)
    out["next_loss"] = planned["losses"][2]
    if ckpt_root is not None:
        out.update(check_checkpoints(case, dp_rank, plans, ckpt_root))
        out["errors"] = check_refusals(case, dp_rank, plans)
    return out


def check_checkpoints(case, dp_rank, plans, ckpt_root):
    """Window 1's checkpoints (placement 1, static) load under window 2's placement (planned
    from the static one) and into the stock model: window 2's losses, forward only, are the
    trained model's before its step (`next_loss`); the last stage's (the first has none)."""
    from megatron.core import dist_checkpointing

    import megatron_selfcheck as ms
    from routepack.integrations import megatron as rm
    from routepack.plan import Placement

    static = Placement.static(case.layers, case.experts, ms.topology(case))
    fresh, _, window, routed, cu = plans(2, static)
    out = {}
    for name, is_plan, src in (
        ("plan<-plan", True, "plan"),
        ("plan<-static", True, "static"),
        ("stock<-plan", False, "plan"),
    ):
        model = ms.build_model(case, is_plan)
        ddp, _ = ms.wrap(model, case)
        runner = None
        if is_plan:
            runner = rm.MegatronRunner(ddp, ms.topology(case))
            runner.begin_window(fresh, window)  # placement 2 from the static one (no optimizer state yet)
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), os.path.join(ckpt_root, src)))
        use = fresh if is_plan else plans(2, fresh.placement)[1]
        out[name] = ms.evaluate(
            case, 2, ddp, rank_microbatches(use, routed, dp_rank, cu, dp=case.dp), cu, runner, "cpu"
        )
    return out


def check_refusals(case, dp_rank, plans):
    """Plans a pipelined job cannot carry out, refused on every rank before anything moves."""
    from megatron.core import parallel_state

    import megatron_selfcheck as ms
    from routepack.integrations import megatron as rm
    from routepack.plan import Placement

    stage = parallel_state.get_pipeline_model_parallel_rank()
    topo = ms.topology(case)
    static = Placement.static(case.layers, case.experts, topo)
    model = ms.build_model(case, True)
    ddp, opt = ms.wrap(model, case)
    runner = rm.MegatronRunner(ddp, topo)
    before = {k: v.clone() for k, v in rm.export_weights(ddp)}
    rows = [m.phy2log.copy() for m in runner.layers]
    plan0, _, window0, _, _ = plans(0, static)
    plan1, _, window1, _, _ = plans(1, static)
    errors = {}
    # intra-batch replicas on layers built without replica buffers (replica_slots=0)
    replicated = ms.planned(case, REPLICA_POLICY)(0, static)[0]
    errors["replicas_size"] = int(replicated.replicas.size)
    errors["replicas"] = _raised(lambda: runner.begin_window(replicated, window0, opt))
    # ... and on any layers when Megatron reruns the MoE layers' forward in backward
    runner.config.recompute_granularity = "full"
    errors["recompute"] = _raised(lambda: runner.begin_window(replicated, window0, opt))
    runner.config.recompute_granularity = None
    # stage 1 holds window 1's plan, stage 0 window 0's: each valid, each stage's EP group agrees
    mine, window = (plan0, window0) if stage == 0 else (plan1, window1)
    errors["stages_differ"] = _raised(lambda: runner.begin_window(mine, window, opt))
    # stage 1 refuses (its token cap is below the plan's microbatches), stage 0 accepts
    errors["stage_refuses"] = _raised(lambda: runner.begin_window(plan0, window0, opt, token_cap=1 if stage else None))
    # global rank 3 (stage 1, EP rank 1) holds window 1's plan, every other rank window 0's
    mine, window = (
        (plan1, window1) if parallel_state.get_pipeline_model_parallel_rank() and dp_rank else (plan0, window0)
    )
    errors["ep_differs"] = _raised(lambda: runner.begin_window(mine, window, opt))
    after = dict(rm.export_weights(ddp))
    errors["intact"] = all(torch.equal(before[k], after[k]) for k in before) and all(
        np.array_equal(a, m.phy2log) for a, m in zip(rows, runner.layers)
    )
    # a stage whose forwards bypass runner.microbatches is caught at finish_step
    _, _, _, routed0, cu0 = plans(0, static)
    runner.begin_window(plan0, window0, opt)
    mbs = rank_microbatches(plan0, routed0, dp_rank, cu0, dp=case.dp)
    errors["bypass"] = _raised(lambda: _bypass(case, ddp, opt, mbs, cu0, runner))
    # process groups that are not the model's: refused at once, naming the field
    groups = rm.groups_from_parallel_state()
    pipe = parallel_state.get_pipeline_model_parallel_group()  # as many ranks as EP, other ones
    errors["groups_ep"] = _raised(lambda: rm.MegatronRunner(ddp, topo, groups=dataclasses.replace(groups, ep=pipe)))
    errors["groups_pp"] = _raised(lambda: rm.MegatronRunner(ddp, topo, groups=dataclasses.replace(groups, pp=None)))
    errors["groups_type"] = _raised(lambda: rm.MegatronRunner(ddp, topo, groups=pipe))
    # Megatron's virtual pipeline size set, the plan's topo without it: refused at once
    parallel_state.set_virtual_pipeline_model_parallel_world_size(2)
    errors["vpp"] = _raised(lambda: rm.MegatronRunner(ddp, topo))
    parallel_state.set_virtual_pipeline_model_parallel_world_size(None)
    # a topo that does not describe Megatron's pipeline (the layers built for it): refused at once
    layers = list(runner.layers)
    for name, bad in (
        ("no_pp", dataclasses.replace(topo, pp=1)),
        ("split", dataclasses.replace(topo, layers_per_stage=(1, 3))),
    ):
        for m in layers:
            m.topo = bad
        errors[name] = _raised(lambda: rm.MegatronRunner(ddp, bad))
    return errors


def _bypass(case, ddp, opt, mbs, cu, runner):
    import megatron_selfcheck as ms

    ms.run_step(case, 0, ddp, opt, mbs, cu, None, "cpu")  # no runner.microbatches around the iterator
    runner.finish_step()


def _assert_trained(out, pp):
    """3 windows: one digest per window on every rank, each stage its own layers and exactly
    their migration rows, redundant experts, the plan's tokens received, equal to the stock model."""
    digests = {tuple(f["digests"]) for f in out.values()}
    assert len(digests) == 1 and len(next(iter(digests))) == 3, digests  # one digest per window, all ranks
    assert len(set(next(iter(digests)))) == 3  # three different plans
    assert sorted({f["stage"] for f in out.values()}) == list(range(pp))
    for rank, f in sorted(out.items()):
        c = f["cmp"]
        assert c["missing"] == 0 and c["loss"] <= TOL and c["weights"] <= TOL and c["grad_norm"] <= TOL, (rank, c)
        assert f["layers"] == [2 * f["stage"], 2 * f["stage"] + 1], (rank, f["layers"])
        assert all(m >= pp for m in f["num_micro"]), (rank, f["num_micro"])
        if f["stage"] == pp - 1:  # the last stage computes the losses: one per microbatch
            assert f["losses"] == f["num_micro"] == f["static_losses"], (rank, f["losses"], f["num_micro"])
        else:
            assert f["losses"] == [0, 0, 0], (rank, f["losses"])
        assert f["rows"] == f["expected_rows"] and all(r > 0 for r in f["rows"]), (rank, f["rows"])
        assert all(r > 0 for r in f["redundant"]), (rank, f["redundant"])
        assert f["received_ok"] == [True] * 3, (rank, f["received_ok"])
        assert f["own_groups"] == [True] * 3, (rank, f["own_groups"])  # the runner ran over the groups given
    assert sum(f["migrated"] for f in out.values()) > 0
    for r, f in sorted(out.items()):
        print(f"rank {r} stage {f['stage']}: {f['cmp']}, micro {f['num_micro']}, migration rows {f['rows']}")


def test_pp2_ep2_plans_equal_stock_model():
    with tempfile.TemporaryDirectory() as root:
        for d in ("plan", "static"):
            os.makedirs(os.path.join(root, d))
        out = run_ranks(check_pipeline, 4, root, 2, 2, join_timeout_s=600, pg_timeout_s=180)
    _assert_trained(out, 2)
    for rank, f in sorted(out.items()):
        assert len(f["next_loss"]) == (f["num_micro"][2] if f["stage"] == 1 else 0), (rank, f["next_loss"])
        for name in ("plan<-plan", "plan<-static", "stock<-plan"):
            assert np.allclose(f[name], f["next_loss"], rtol=0, atol=TOL), (rank, name, f[name], f["next_loss"])
        e = f["errors"]
        assert e["replicas_size"] > 0
        assert e["replicas"].startswith("InvalidPlanError: plan.replicas") and "replica_slots=0" in e["replicas"], e
        assert e["recompute"].startswith("RoutepackError: config.recompute_granularity='full'"), e
        assert (
            e["stages_differ"].startswith("InvalidPlanError")
            and "pipeline stages hold different plans" in (e["stages_differ"])
        ), e
        if f["stage"] == 0:
            assert e["stage_refuses"] == "InvalidPlanError: pipeline stage(s) [1] refused the plan; nothing moved", e
        else:
            assert e["stage_refuses"].startswith("InvalidPlanError") and "over the cap 1" in e["stage_refuses"], e
        assert e["intact"], e
        if f["stage"] == 1:  # ranks 2 and 3 see it in their EP group
            assert e["ep_differs"].startswith("InvalidPlanError: EP ranks hold different plans"), e
        else:  # stage 0 learns it from the pipeline group
            want = "InvalidPlanError: the EP ranks of pipeline stage(s) [1] hold different plans; nothing moved"
            assert e["ep_differs"] == want, e
        assert e["vpp"].startswith(
            "RoutepackError: topo: pp=2, vpp=1; Megatron runs pipeline_model_parallel_size=2 with 2 model chunk(s)"
        ), e
        assert e["no_pp"].startswith(
            "RoutepackError: topo: pp=1, vpp=1; Megatron runs pipeline_model_parallel_size=2 with 1 model chunk(s)"
        ), e
        want = f"topo: gives pipeline stage {f['stage']} MoE layers {[[0], [1, 2, 3]][f['stage']]}"
        assert e["split"].startswith("RoutepackError") and want in e["split"] and "layers_per_stage" in e["split"], e
        assert e["bypass"].startswith("RoutepackError: finish_step") and "ran no planned microbatch" in e["bypass"], e
        assert (
            e["groups_ep"].startswith("RoutepackError: groups.ep: ranks")
            and "another expert-parallel" in (e["groups_ep"])
        ), e
        assert e["groups_pp"].startswith("RoutepackError: groups.pp: a pipeline group exactly when pp_size > 1"), e
        assert e["groups_type"].startswith("RoutepackTypeError: groups: expected MegatronGroups"), e
    for r, f in sorted(out.items()):
        ckpt = max(
            float(np.abs(np.subtract(f[n], f["next_loss"])).max(initial=0.0))
            for n in ("plan<-plan", "plan<-static", "stock<-plan")
        )
        print(f"rank {r}: checkpoint next loss {ckpt:.2e}; " + "; ".join(f"{k}: {v}" for k, v in f["errors"].items()))


def test_pp3_middle_stage_plans_equal_stock_model():
    """pp = 3 x ep = 1: stage 1 receives activations and sends gradients both ways, and its
    forward_step_func reads the data iterator like the others (the planned microbatch)."""
    out = run_ranks(check_pipeline, 3, None, 3, 1, join_timeout_s=600, pg_timeout_s=180)
    _assert_trained(out, 3)


def check_replicas(rank, world, device, pp, ep, restore):
    """Trains the stock model and the planned one with replicas (``REPLICA_POLICY``) under
    Megatron's 1F1B; ``restore=False`` disables the backward's restore of the copies (what
    the test shows is needed)."""
    megatron_cpu.install(optimizers=True)
    from megatron.core import parallel_state

    import megatron_selfcheck as ms
    from routepack.integrations import megatron as rm
    from routepack.torch.broadcast import digest_int

    if not restore:  # the forwards still fill the buffers; the backwards leave them as they are
        rm.MegatronRunner.restore_replicas = lambda self, layer, micro: None
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp, expert_model_parallel_size=ep)
    case = _case(pp, ep, replica_slots=2)
    dp_rank = parallel_state.get_data_parallel_rank()
    plans = ms.planned(case, REPLICA_POLICY)  # each plan validated against its window
    seen = {"digests": [], "num_micro": [], "cells": [], "copy_tokens": [], "received_ok": [], "bytes": []}

    def record(w, ddp, opt, runner):
        plan = runner.plan
        mine = [m.moe_index for m in runner.layers]
        seen["layers"] = mine
        seen["digests"].append(digest_int(plan))
        seen["num_micro"].append(plan.num_micro)
        r = plan.replicas[np.isin(plan.replicas["layer"], mine)]
        seen["cells"].append(sorted({(int(m), int(l)) for m, l in zip(r["micro"], r["layer"])}))
        runner.recording = True
        runner.restores = 0

    def after(w, ddp, opt, runner):
        pred = runner.predicted_received()[:, seen["layers"]]
        got = np.zeros_like(pred)
        spr = case.slots_per_rank
        copies = {}  # (micro, layer) -> tokens this rank's replica buffers computed
        for (m, l), counts in runner.received.items():
            got[m, seen["layers"].index(l)] = sum(counts)
            copies[(m, l)] = sum(counts[spr:])
        seen["received_ok"].append(bool(np.array_equal(got, pred)) and len(runner.received) == pred.size)
        seen["copy_tokens"].append(sorted(copies.items()))
        ex = runner.exchange
        seen["bytes"].append((ex.sent_bytes, ex.received_bytes, runner.restores))

    static = ms.train(case, False, dp_rank, plans=plans)
    planned = ms.train(case, True, dp_rank, plans=plans, before_step=record, after_window=after)
    out = {"stage": parallel_state.get_pipeline_model_parallel_rank(), "cmp": ms.compare(static, planned)}
    out.update(seen)
    return out


def test_pp2_ep2_replicas_equal_stock_model():
    """pp = 2 x ep = 2 with ``hot_n`` replicas in every (micro, layer) cell, >= 3 microbatches
    a step under 1F1B (the first stage holds 2 in flight): every stage's copies ran, the first
    stage put back earlier microbatches' copies before their experts' backward, and the model
    equals the stock one. With that restore disabled it does not (the check can fail)."""
    out = run_ranks(check_replicas, 4, 2, 2, True, join_timeout_s=600, pg_timeout_s=180)
    digests = {tuple(f["digests"]) for f in out.values()}
    assert len(digests) == 1 and len(set(next(iter(digests)))) == 3, digests
    for rank, f in sorted(out.items()):
        c = f["cmp"]
        assert c["missing"] == 0 and c["loss"] <= TOL and c["weights"] <= TOL and c["grad_norm"] <= TOL, (rank, c)
        assert all(m >= 2 for m in f["num_micro"]), (rank, f["num_micro"])
        assert f["received_ok"] == [True] * 3, (rank, f["received_ok"])
        for w, cells in enumerate(f["cells"]):  # copies in both layers of the stage, in >= 2 microbatches
            assert {l for _, l in cells} == set(f["layers"]) and len({m for m, _ in cells}) >= 2, (rank, w, cells)
        sent, received, restores = zip(*f["bytes"])
        assert all(b > 0 for b in sent + received), (rank, f["bytes"])
        if f["stage"] == 0:  # 1F1B: forward of micro m + 1 before the backward of micro m, every step
            assert all(n > 0 for n in restores), (rank, restores)
        print(f"rank {rank} stage {f['stage']}: {c}, micro {f['num_micro']}, (sent, received, restores) {f['bytes']}")
    for stage in (0, 1):  # every window, the copies of each layer of the stage computed tokens
        ranks = [f for f in out.values() if f["stage"] == stage]
        for w in range(3):
            tokens = {l: 0 for l in ranks[0]["layers"]}
            for f in ranks:
                for (m, l), n in f["copy_tokens"][w]:
                    tokens[l] += n
            assert all(n > 0 for n in tokens.values()), (stage, w, tokens)
    broken = run_ranks(check_replicas, 4, 2, 2, False, join_timeout_s=600, pg_timeout_s=180)
    worst = max(f["cmp"]["weights"] for f in broken.values())
    print(
        f"without the backward's restore: weights differ by {worst:.2e}, losses by "
        f"{max(f['cmp']['loss'] for f in broken.values()):.2e}"
    )
    assert worst > 100 * TOL, worst
