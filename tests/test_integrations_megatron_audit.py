"""The execution audit in `MegatronRunner` (issue 40), Megatron-Core's own schedule on CPU with
gloo: 2 ranks at EP 2 (pp = 1), a small ``GPTModel`` built with `plan_layer_spec` (8 experts,
2 MoE layers, redundant experts and replicas in every cell: tests/torch/selfcheck's plans),
Megatron's DDP, FP32 optimizer and ``forward_backward_func``:

* a planned step (the data iterator wrapped in ``runner.microbatches``, router replay on): the
  audit is clean and every local expert computed the plan's tokens in every cell;
* finding 3, the data iterator not wrapped at pp = 1: on main no error, losses 4e-5 and
  weights 5.4e-2 from the stock model after 3 windows. Now ``finish_step`` raises on every
  rank, naming the microbatches that never ran and asking whether the iterator is wrapped;
  the runner summed nothing (no redundant-expert sum ran);
* finding 4, router replay off (the model routes with its own top-k; verl's
  ``router_replay.mode: disabled``): on main 0 of 12 cells received the planned tokens and
  nothing said so. Now ``finish_step`` raises on every rank, "routes differ from the plan's
  ... is router replay on?"; under ``audit="warn"`` it is logged and the step goes on;
* a rank that skips ``finish_step``: its Megatron ``optimizer.step()`` joins its peer's
  ``finish_step`` exchange before the step's own collectives, and both raise naming it.
"""

import logging
import sys
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
from routepack.plan import Placement  # noqa: E402
from routepack.torch.replay import rank_microbatches  # noqa: E402
from routepack.torch.spawn import run_ranks  # noqa: E402
from test_integrations_megatron_train import hand_plans  # noqa: E402


def _raised(fn):
    try:
        fn()
    except rp.RoutepackError as e:
        return f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001
        return f"OTHER {type(e).__name__}: {e}"
    return "nothing"


def check_audit(rank, world, device):
    megatron_cpu.install(optimizers=True)
    from megatron.core import parallel_state
    import megatron_selfcheck as ms
    from routepack.integrations import megatron as rm

    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    case = ms.MegatronCase(dp=world, ep=2, gpus_per_node=2, slots_per_rank=5)
    topo = ms.topology(case)
    plans = hand_plans(case)
    plan, _, window, routed, cu = plans(0, Placement.static(case.layers, case.experts, topo))
    mbs = rank_microbatches(plan, routed, rank, cu, dp=case.dp)
    logged = []

    class Keep(logging.Handler):
        def emit(self, record):
            logged.append(record.getMessage())

    logging.getLogger("routepack.torch.audit").addHandler(Keep())
    out = {"micro": plan.num_micro, "replicas": int(plan.replicas.size)}

    def model_and_runner(audit="raise"):
        model = ms.build_model(case, True)
        ddp, opt = ms.wrap(model, case)
        runner = rm.MegatronRunner(ddp, topo, audit=audit)
        runner.begin_window(plan, window, opt)
        sums = []
        real = runner._sum_redundant
        runner._sum_redundant = lambda layer: (sums.append(layer.moe_index), real(layer))[1]
        return ddp, opt, runner, sums

    def step(ddp, opt, runner, replay=True, wrap=True, finish=True):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        from megatron.core.pipeline_parallel import get_forward_backward_func

        it = runner.microbatches(iter(mbs)) if wrap else iter(mbs)
        get_forward_backward_func()(
            forward_step_func=ms._forward_step(case, 0, cu, ms.routers(ddp), "cpu", replay=replay),
            data_iterator=it,
            model=[ddp],
            num_microbatches=len(mbs),
            seq_length=0,
            micro_batch_size=1,
            forward_only=False,
        )
        if finish:
            runner.finish_step()

    # a planned step: clean, every local expert computed the plan's tokens
    ddp, opt, runner, sums = model_and_runner()
    step(ddp, opt, runner)
    rep = runner.last_audit()
    out["planned_verdict"] = rep.verdict
    out["planned_equal"] = bool(np.array_equal(rep.measured_per_forward(), rep.planned))
    out["planned_sums"] = len(sums)
    out["planned_cells"] = int(rep.forwards.size)

    # finding 3: the data iterator not wrapped (pp = 1)
    sums.clear()
    out["unwrapped"] = _raised(lambda: step(ddp, opt, runner, wrap=False))
    out["unwrapped_sums"] = len(sums)

    # finding 4: router replay off
    out["replay_off"] = _raised(lambda: step(ddp, opt, runner, replay=False))
    rep = runner.last_audit()
    out["off_plan_cells"] = int((rep.measured_per_forward() != rep.planned).any(axis=2).sum())
    out["cells"] = int(rep.forwards.size)
    ddp_w, opt_w, runner_w, _ = model_and_runner(audit="warn")
    out["warned"] = _raised(lambda: step(ddp_w, opt_w, runner_w, replay=False))
    out["logged"] = list(logged)

    # a skipped finish_step on rank 1: its optimizer.step joins rank 0's finish_step exchange
    before = {k: v.clone() for k, v in rm.export_weights(ddp)}
    if rank == 0:
        out["skipped"] = _raised(lambda: step(ddp, opt, runner))
    else:
        step(ddp, opt, runner, finish=False)
        out["skipped"] = _raised(opt.step)
    after = dict(rm.export_weights(ddp))
    out["stepped"] = any(not torch.equal(before[k], after[k]) for k in before)
    # and the job goes on: a clean step after all of it
    step(ddp, opt, runner)
    out["after"] = runner.last_audit().verdict
    return out


def test_megatron_runner_audits_every_step():
    out = run_ranks(check_audit, 2, join_timeout_s=900, pg_timeout_s=180)
    for rank, f in sorted(out.items()):
        assert f["replicas"] > 0 and f["micro"] >= 2, f
        assert f["planned_verdict"] == "ok" and f["planned_equal"] and f["planned_sums"] > 0, (rank, f)
        msg = f["unwrapped"]
        assert msg.startswith("AuditError: finish_step: a planned microbatch never ran: microbatch 0 on DP rank 0"), msg
        assert "microbatch 0 on DP rank 1" in msg and "is the data iterator wrapped" in msg, msg
        assert f["unwrapped_sums"] == 0, f  # the runner summed nothing
        msg = f["replay_off"]
        assert msg.startswith("AuditError: finish_step: routes differ from the plan's: DP rank 0's MoE layer"), msg
        assert "is router replay on" in msg and "DP rank 1's MoE layer" in msg, msg
        print(f"rank {rank}: replay off, {f['off_plan_cells']} of {f['cells']} cells off the plan")
        assert f["off_plan_cells"] > 0, f
        assert f["warned"] == "nothing" and any("audit='warn'" in m for m in f["logged"]), f
        msg = f["skipped"]
        assert msg.startswith("AuditError: ") and "DP rank 1 skipped finish_step of step" in msg, msg
        assert "it reached optimizer.step without it" in msg, msg
        assert not f["stepped"], f  # no rank's optimizer stepped
        assert f["after"] == "ok", f


def test_trainer_glue_audits_by_default_and_reads_the_environment(monkeypatch):
    """verl's and slime's hand-off (`Handoff`) builds its runner with `audit_mode()`: on
    ("raise") unless the workers' environment says ``ROUTEPACK_AUDIT=warn`` or ``off``;
    another value is refused naming the variable."""
    from routepack.integrations.megatron.handoff import AUDIT_VAR, audit_mode

    monkeypatch.delenv(AUDIT_VAR, raising=False)
    assert audit_mode() == "raise"
    for mode in ("warn", "off", "raise"):
        monkeypatch.setenv(AUDIT_VAR, mode)
        assert audit_mode() == mode
    monkeypatch.setenv(AUDIT_VAR, "loud")
    with pytest.raises(rp.RoutepackError, match="ROUTEPACK_AUDIT='loud': the step audit takes one of"):
        audit_mode()
