"""Grouped experts under routepack plans inside Megatron-Core, on CPU with gloo: the expert
modules real runs build. ``GroupedMLP`` (Megatron's local spec with ``moe_grouped_gemm``: every
local expert in ``weight1`` / ``weight2``, ``grouped_gemm``'s ``gmm``) and ``TEGroupedMLP``
(the MoE spec of Megatron's Transformer Engine builders with ``moe_grouped_gemm``, what
mbridge builds for Qwen3-MoE: TE's ``GroupedLinear``, ``weight{i}`` a local expert), with
``ep * (slots_per_rank + replica_slots)`` physical local experts. Megatron's ``GroupedMLP`` /
``TEGroupedMLP`` / ``TEGroupedLinear`` code, their ``sharded_state_dict``, the all-to-all
dispatcher, DDP, the optimizers and ``forward_backward_func`` run stock; the two CUDA kernels
(``grouped_gemm.ops.gmm``, TE's ``GroupedLinear``) are stood in for by tests/megatron_cpu.py
(stand-ins 10 and 11, each with its reason), installed before Megatron is imported.

Each model trains 3 windows of tests/torch/selfcheck's plans (every window migrates experts,
holds redundant experts and replicates hot ones in every cell) next to the same stock grouped
model on the same data (tests/test_integrations_megatron_train.py's `check_training`):

* losses, grad norms (``clip_grad=1``: every logical expert counted once although
  ``GroupedMLP`` holds all slots in one parameter) and the exported logical weights equal to
  1e-5; every rank receives the tokens the plan predicts in every (micro, layer) cell;
* a ``dist_checkpointing`` checkpoint saved under placement 1 loads under placement 2 and into
  the stock grouped model with the same next loss;
* with Megatron's optimizer state (tests/test_integrations_megatron_optim_ckpt.py's
  `check_optimizer_checkpoint`, ``DistributedOptimizer`` on 4 ranks, the experts' state
  sharded over 2 expert-data-parallel ranks, so a slot of a grouped tensor is a range of
  flat buffers split across ranks): saved under one placement, loaded under another and into
  the stock model, every copy's Adam state equal to its expert's.

2 ranks at EP 2 and 4 ranks at EP 4 (FP32 optimizer), 4 ranks at EP 2 (``DistributedOptimizer``).
"""

import importlib.util
import os
import sys
import tempfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core (pip install --no-deps megatron-core) not importable", allow_module_level=True)
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is required", allow_module_level=True)

# megatron.core is not imported here: each rank installs the kernel stand-ins first (Megatron
# decides at import whether Transformer Engine and grouped_gemm are there)
sys.path.insert(0, str(Path(__file__).resolve().parent / "torch"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from routepack.torch.spawn import run_ranks  # noqa: E402

#: the expert module each case builds and the classes that proves it
MODULES = {
    "grouped": ["GroupedMLP"],
    "te_grouped": ["TEColumnParallelGroupedLinear", "TEGroupedMLP"],
}


def grouped_training(rank, world, device, ep, root, module):
    import megatron_cpu

    megatron_cpu.install(optimizers=True, kernels=True)
    from test_integrations_megatron_train import check_training

    return check_training(rank, world, device, ep, False, root, False, module)


def grouped_optimizer_checkpoint(rank, world, device, root, module):
    import megatron_cpu

    megatron_cpu.install(optimizers=True, kernels=True)
    from test_integrations_megatron_optim_ckpt import check_optimizer_checkpoint

    return check_optimizer_checkpoint(rank, world, device, root, True, module)


def _train(world, ep, module):
    from test_integrations_megatron_train import _assert_ok

    with tempfile.TemporaryDirectory() as root:
        for d in ("plan", "static"):
            os.makedirs(os.path.join(root, d))
        out = run_ranks(grouped_training, world, ep, root, module, join_timeout_s=900, pg_timeout_s=300)
    f = out[0]
    print(
        f"{module} world {world} ep {ep}: {f['cmp']}, migration rows {f['migrated']}, redundant slots "
        f"{f['redundant']}, replica rows {f['replicated']}, replica tokens {sum(g['replica_tokens'] for g in out.values())}"
    )
    _assert_ok(out)
    for g in out.values():
        assert g["experts"] == g["stock_experts"] == MODULES[module], (g["experts"], g["stock_experts"])


@pytest.mark.parametrize("module", sorted(MODULES))
def test_two_ranks_ep2(module):
    _train(2, 2, module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_four_ranks_ep4(module):
    _train(4, 4, module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_optimizer_checkpoint_distributed_four_ranks(module):
    from test_integrations_megatron_optim_ckpt import assert_checkpoint_ok

    with tempfile.TemporaryDirectory() as root:
        for d in ("ckpt", "ckpt-default"):
            os.makedirs(os.path.join(root, d))
        out = run_ranks(
            grouped_optimizer_checkpoint,
            4,
            os.path.join(root, "ckpt"),
            module,
            join_timeout_s=900,
            pg_timeout_s=300,
        )
    for rank, f in sorted(out.items()):
        print(rank, {k: f[k] for k in ("plan_states", "stock_states", "plan_loss", "stock_loss", "plan_weights")})
    assert_checkpoint_ok(out, 4, True)
