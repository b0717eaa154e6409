"""slime's model-plugin specs kept: ``--spec routepack.integrations.slime layer_spec`` with the
run's own spec named once in the ``--custom-config-path`` YAML (``routepack_spec``), called as
slime's model provider calls a ``--spec`` function (``spec(args, config, vp_stage)``), its MoE
layers made routepack's; grouped experts (``--moe-grouped-gemm``, every shipped MoE script)
and MTP (``--mtp-num-layers``) keep the user's spec and are reported, naming the flag, as not
running the placement, on the driver (the planner's report) and in the actor alike."""

import sys
import types
from types import SimpleNamespace

import pytest

pytest.importorskip("megatron.core")

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402

import routepack as rp  # noqa: E402
from routepack.integrations import slime as rs  # noqa: E402
from routepack.integrations.megatron.layer import PlanMoELayer  # noqa: E402
from routepack.integrations.slime import actor  # noqa: E402
from verl_batches import cost_model  # noqa: E402

CALLS = []


def plugin_spec(args, config, vp_stage=None):
    """A model plugin's spec function as slime_plugins' are called."""
    CALLS.append((args, config, vp_stage))
    return get_gpt_layer_local_spec(num_experts=args.num_experts, moe_grouped_gemm=args.moe_grouped_gemm)


@pytest.fixture
def plugin(monkeypatch):
    module = types.ModuleType("my_plugins_models_moe")
    module.get_my_spec = plugin_spec
    monkeypatch.setitem(sys.modules, "my_plugins_models_moe", module)
    monkeypatch.setattr(
        actor,
        "actor_topology",
        lambda args: rp.Topology(dp=2, ep=2, gpus_per_node=2, slots_per_rank=5, replica_slots=2),
    )
    actor._SAID.clear()
    CALLS.clear()


def args(**extra):
    base = dict(
        num_experts=8,
        expert_model_parallel_size=2,
        num_gpus_per_node=2,
        spec=["routepack.integrations.slime", "layer_spec"],
        routepack_spec="my_plugins_models_moe get_my_spec",
        moe_grouped_gemm=False,
        train_backend="megatron",
    )
    return SimpleNamespace(**{**base, **extra})


def moe_module(spec):
    return spec.submodules.mlp.module


def test_their_spec_is_wrapped(plugin):
    a = args()
    spec = rs.layer_spec(a, "config", 1)
    assert CALLS == [(a, "config", 1)]  # called as slime calls a --spec function
    assert issubclass(moe_module(spec), PlanMoELayer)
    assert rs.limits(a) is None
    a.routepack_spec = ["my_plugins_models_moe", "get_my_spec"]  # the two words of slime's --spec, as a list
    assert issubclass(moe_module(rs.layer_spec(a, "config")), PlanMoELayer)
    with pytest.raises(rp.RoutepackError, match="args.routepack_spec: expected 'module function'"):
        rs.layer_spec(args(routepack_spec="my_plugins_models_moe"), "config")


@pytest.mark.parametrize(
    "flag, value, named", [("moe_grouped_gemm", True, "--moe-grouped-gemm"), ("mtp_num_layers", 1, "--mtp-num-layers")]
)
def test_grouped_and_mtp_keep_their_spec_and_say_so(plugin, flag, value, named, caplog):
    a = args(**{flag: value})
    spec = rs.layer_spec(a, "config")
    assert not issubclass(moe_module(spec), PlanMoELayer)  # their layers, as built without routepack
    assert named in caplog.text
    planner = rs.planner_from_args(a, cost_model(2, 8))
    runs = planner.runs.as_dict()
    assert runs["placement"] is False and runs["replicas"] is False and named in runs["why"]
