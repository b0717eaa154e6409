"""A DeepSeek-V3-shaped model under routepack plans inside Megatron-Core, on CPU with gloo:
the layer pattern and router of DeepSeek-V3 as Megatron-LM's example scripts configure it
(``examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh``: ``--moe-layer-freq [0]*3+[1]*58``,
expert groups ``--moe-router-num-groups`` / ``--moe-router-group-topk``, sigmoid scores with
``--moe-router-topk-scaling-factor 2.5`` and ``--moe-router-pre-softmax``, an expert bias
updated every step, ``seq_aux_loss``, shared experts, ``--moe-grouped-gemm``, one MTP layer
``--mtp-num-layers 1``), at toy size: 3 decoder layers of which the first is dense, 8 experts in
4 groups, top-2, 2 gloo ranks at EP 2, Megatron's decoder block spec
(``get_gpt_decoder_block_spec``, local: ``GroupedMLP`` through stand-in 10, or
``SequentialMLP``) and MTP block spec (``get_gpt_mtp_block_spec`` from the decoder's last layer
spec, the stock one or the plan's).

Routes come in verl's layout, one row per decoder layer with zeros on the dense layer 0 (what
verl, vLLM, SGLang and slime record); the window counts the MoE rows (decoder layers 1 and 2:
plan layers 0 and 1), which a window over every row refuses. Three windows of
`routepack.plan_window` plans (EPLB placement with redundant experts, routepack's packing,
``hot_n`` replicas) migrate experts; next to it the stock model on the same data:

* the runner keys plan layer 0 to Megatron layer 2 and plan layer 1 to layer 3 (the dense layer
  1 has none); the MTP layer (Megatron layer 4) routes live and is left out of the plan, named
  in ``runner.unplanned`` with the reason where its MoE layer is a `PlanMoELayer`;
* losses, grad norms and the exported logical weights (MTP layer and expert bias included)
  equal the stock model's to 1e-5; every rank receives the tokens the plan predicts in every
  (micro, MoE layer) cell.
"""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core (pip install --no-deps megatron-core) not importable", allow_module_level=True)
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is required", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))

import routepack as rp  # noqa: E402
from routepack.torch.spawn import run_ranks  # noqa: E402

TOL = 1e-5
#: DeepSeek-V3's router (module docstring), 8 experts in 4 groups of 2
ROUTER = (
    ("moe_router_num_groups", 4),
    ("moe_router_group_topk", 2),
    ("moe_router_score_function", "sigmoid"),
    ("moe_router_pre_softmax", True),
    ("moe_router_topk_scaling_factor", 2.5),
    ("moe_router_enable_expert_bias", True),
    ("moe_router_bias_update_rate", 1e-3),
    ("moe_router_dtype", "fp32"),
    ("moe_router_load_balancing_type", "seq_aux_loss"),
    ("moe_aux_loss_coeff", 1e-4),
    ("moe_shared_expert_intermediate_size", 8),
    ("mtp_loss_scaling_factor", 0.1),
)
POLICY = rp.Policy(placement="eplb", packing="routepack", replication="hot_n", loads="window")


def deepseek_toy(rank, world, device, module, mtp_from_plan):
    import megatron_cpu

    megatron_cpu.install(optimizers=True, kernels=True)
    from megatron.core import parallel_state

    import megatron_selfcheck as ms

    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    case = ms.MegatronCase(
        dp=world,
        ep=2,
        gpus_per_node=2,
        slots_per_rank=5,
        replica_slots=2,
        layers=3,
        moe_layer_freq=[0, 1, 1],
        mtp_layers=1,
        mtp_from_plan=mtp_from_plan,
        router=ROUTER,
        experts_module=module,
    )
    plans = ms.planned(case, POLICY)
    out = {"received_ok": [], "keys": None}

    def record(w, ddp, opt, runner):
        runner.recording = True
        out["keys"] = {m.layer_number: m.moe_index for m in runner.layers}
        out["unplanned"] = dict(runner.unplanned)

    def check(w, ddp, opt, runner):
        pred = runner.predicted_received()
        got = np.zeros_like(pred)
        for (m, l), counts in runner.received.items():
            got[m, l] = sum(counts)
        out["received_ok"].append(bool(np.array_equal(got, pred)) and len(runner.received) == pred.size)

    window, routed, cu = ms.synthetic_window(case, 0)
    out["dense_row_zero"] = bool((routed[:, 0] == 0).all()) and routed.shape[1] == 3
    try:
        rp.Window.from_routed_experts(routed, cu, case.experts)
        out["every_row"] = "nothing"
    except rp.RoutepackError as e:
        out["every_row"] = str(e)
    out["window_layers"] = window.num_layers
    static = ms.train(case, False, rank, plans=plans)
    planned = ms.train(case, True, rank, plans=plans, before_step=record, after_window=check)
    out.update({k: planned[k] for k in ("migrated", "replicated", "redundant", "experts")})
    out["cmp"] = ms.compare(static, planned)
    out["mtp_weights"] = sorted(k for k in planned["weights"] if k.startswith("mtp."))[:3]
    out["expert_bias"] = sorted(k for k in planned["weights"] if k.endswith("expert_bias"))
    return out


@pytest.mark.parametrize("module, mtp_from_plan", [("grouped", False), ("sequential", True)])
def test_deepseek_v3_toy_plans_equal_stock_model(module, mtp_from_plan):
    out = run_ranks(deepseek_toy, 2, module, mtp_from_plan, join_timeout_s=900, pg_timeout_s=300)
    for rank, f in sorted(out.items()):
        c = f["cmp"]
        print(
            f"rank {rank} {module}: {c}, migration rows {f['migrated']}, redundant slots {f['redundant']}, "
            f"replica rows {f['replicated']}, keys {f['keys']}, unplanned {sorted(f['unplanned'])}"
        )
        assert c["missing"] == 0 and c["loss"] <= TOL and c["weights"] <= TOL and c["grad_norm"] <= TOL, (rank, c)
        assert f["migrated"] > 0 and f["redundant"] > 0 and f["replicated"] > 0, f
        assert f["received_ok"] == [True] * 3, f["received_ok"]
        assert f["keys"] == {2: 0, 3: 1}, f["keys"]  # Megatron layer number -> plan layer
        assert f["dense_row_zero"] and f["window_layers"] == 2
        assert "lists expert 0 twice" in f["every_row"], f["every_row"]
        assert f["mtp_weights"] and len(f["expert_bias"]) == 3, (f["mtp_weights"], f["expert_bias"])
        if mtp_from_plan:
            assert list(f["unplanned"]) == [4] and "an MTP layer" in f["unplanned"][4], f["unplanned"]
        else:
            assert f["unplanned"] == {}, f["unplanned"]
