"""routepack.integrations.megatron with Megatron-Core's own router on CPU (megatron-core
0.16.1 from PyPI, ``--no-deps``; skipped where it does not import): a ``TopKRouter`` over the
E logical experts replays logical top-k through ``RouterReplay`` (REPLAY_FORWARD), and
`PlanRouter` turns its ``(probs, routing_map)`` into the physical slots' (``num_moe_experts``
= ep * slots_per_rank, a config Megatron accepts). What cannot run here: ``MoELayer`` with
the all-to-all dispatcher (it creates a CUDA stream at construction) and the router's own
``forward`` (its gating moves the weight to ``torch.cuda.current_device()``): the routing
step is called directly, and tools/gpu_megatron.py runs the whole layer on GPUs."""

import os
import socket

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core", reason="megatron-core (pip install --no-deps megatron-core) not importable")
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.transformer.moe.router import TopKRouter  # noqa: E402
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

import routepack as rp  # noqa: E402
from routepack.integrations import megatron as rm  # noqa: E402
from random_plans import random_phy2log  # noqa: E402
from verl_batches import distinct_topk  # noqa: E402


@pytest.fixture(scope="module")
def single_rank():
    """A one-process gloo world with Megatron's model-parallel state (all sizes 1), torn down
    afterwards: later tests in the same process (the README's blocks) start their own."""
    owns_world = not dist.is_initialized()
    if owns_world:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=0, world_size=1)
    owns_mpu = not parallel_state.model_parallel_is_initialized()
    if owns_mpu:
        parallel_state.initialize_model_parallel()
    yield
    RouterReplay.clear_global_router_replay_instances()
    if owns_mpu:
        parallel_state.destroy_model_parallel()
    if owns_world:
        dist.destroy_process_group()


def logical_router(experts, k):
    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=2,
        num_moe_experts=experts,
        moe_router_topk=k,
        use_cpu_initialization=True,
        moe_enable_routing_replay=True,
        moe_router_load_balancing_type="none",
        moe_router_pre_softmax=k == 1,
    )
    return TopKRouter(config=cfg, pg_collection=ProcessGroupCollection.use_mpu_process_groups())


@settings(
    max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(seed=st.integers(0, 2**32 - 1), spr=st.integers(2, 5))
def test_replayed_logical_topk_lands_on_the_plans_slots(single_rank, seed, spr):
    rng = np.random.default_rng(seed)
    topo = rp.Topology(dp=1, ep=1, gpus_per_node=1, slots_per_rank=spr)
    experts = int(rng.integers(2, spr + 1))
    k = int(rng.integers(1, experts + 1))
    placement = rp.Placement(random_phy2log(rng, 1, experts, topo), experts, spr)
    RouterReplay.clear_global_router_replay_instances()
    router = logical_router(experts, k)
    # the stock layer's config under the plan: one expert per physical slot
    TransformerConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=2,
        num_moe_experts=rm.num_moe_experts(placement),
        moe_router_topk=k,
        moe_router_pre_softmax=k == 1,
    )
    tokens = int(rng.integers(1, 12))
    replay = torch.from_numpy(distinct_topk(rng, tokens, 1, k, experts)[:, 0, :])
    RouterReplay.set_replay_data([replay])
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    plan_router = rm.plan_router(lambda logits: router.routing(logits), placement, 0, topo)
    logits = torch.randn(tokens, 1, experts)
    probs, rmap = plan_router(logits)
    RouterReplay.clear_global_router_replay_action()
    assert rmap.shape == (tokens, spr) and probs.shape == (tokens, spr)
    tok, slot = torch.nonzero(rmap, as_tuple=True)
    logical = torch.from_numpy(placement.phy2log[0]).long()[slot]
    for t in range(tokens):  # the replayed experts, each in a slot holding it
        assert sorted(logical[tok == t].tolist()) == sorted(replay[t].tolist())
    assert torch.all(probs[tok, slot] > 0) and torch.all(probs[~rmap] == 0)
    # the probabilities are the logical router's under replay (scores gathered at the replayed ids)
    RouterReplay.set_replay_data([replay])
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    want_probs, want_map = router.routing(logits)
    RouterReplay.clear_global_router_replay_action()
    torch.testing.assert_close(probs[tok, slot], want_probs.view(tokens, experts)[tok, logical])
