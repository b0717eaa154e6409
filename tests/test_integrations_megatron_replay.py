"""R3 with a plan (issue 31, item 5): Megatron-Core's ``RouterReplay`` and verl's patched one
(``verl.utils.megatron.router_replay_patch``) both see one registry entry per MoE layer of a
model built with `plan_layer_spec`, with ``layer_number`` set (verl's model walk,
``iter_model_routers``, finds every router), and the replayed logical top-k is what the layer
computes: each token's physical experts hold exactly its replayed experts, and the model's
loss and gradients equal the stock model's under the same replay. One gloo rank, EP 1, 8
experts in 10 placement slots + 2 replica buffers; each check in its own process (verl's patch
changes ``TopKRouter`` for the process)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core", reason="megatron-core (pip install --no-deps megatron-core) not importable")

import megatron_cpu  # noqa: E402
from routepack.torch.spawn import run_ranks  # noqa: E402


def check_replay(rank, world, device, flavour):
    megatron_cpu.install()
    from megatron.core import parallel_state

    if flavour == "verl":
        pytest.importorskip("verl")
        from verl.utils.megatron.router_replay_patch import RouterReplay, RouterReplayAction, apply_router_replay_patch

        apply_router_replay_patch()
        registry = RouterReplay.router_instances
    else:
        from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

        registry = RouterReplay.global_router_replay_instances
    import megatron_selfcheck as ms
    from routepack.integrations import megatron as rm

    parallel_state.initialize_model_parallel()
    case = ms.MegatronCase(dp=1, ep=1, gpus_per_node=1, slots_per_rank=10, replica_slots=2, layers=2)
    registry.clear()
    kw = {"enable_routing_replay": True} if flavour == "verl" else {}
    plan_model = ms.build_model(case, True, **kw)
    out = {"entries": len(registry)}
    routers = [m for m in plan_model.modules() if getattr(m, "router_replay", None) is not None]
    out["layer_numbers"] = [r.layer_number for r in routers]
    out["router_class"] = type(routers[0]).__name__
    out["router_keys"] = sorted(k for k in plan_model.state_dict() if ".router." in k)
    if flavour == "verl":
        from verl.utils.megatron.router_replay_utils import iter_model_routers

        out["walk"] = [n for n, _ in iter_model_routers(plan_model)]
    stock = ms.build_model(case, False, **kw)
    rng = np.random.default_rng(0)
    t = 12
    ids = torch.from_numpy(np.argsort(rng.random((case.layers, t, case.experts)), axis=2)[:, :, : case.top_k].copy())
    tokens = torch.from_numpy(rng.integers(0, case.vocab, t))
    pos = torch.arange(t).unsqueeze(0)
    mask = torch.triu(torch.ones(t, t), diagonal=1).bool()[None, None]
    losses, grads = [], []
    for model in (stock, plan_model):
        rs = [m for m in model.modules() if getattr(m, "router_replay", None) is not None]
        for l, r in enumerate(rs):
            r.router_replay.clear_indices()
            r.router_replay.set_target_indices(ids[l])
            r.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        loss = model(tokens.unsqueeze(0), pos, mask, labels=torch.roll(tokens, -1).unsqueeze(0)).sum()
        loss.backward()
        losses.append(float(loss))
        grads.append(model.embedding.word_embeddings.weight.grad.clone())
    out["loss_diff"] = abs(losses[0] - losses[1])
    out["grad_diff"] = float((grads[0] - grads[1]).abs().max())
    # the physical routing of layer 0: every token's experts hold its replayed ones
    layer = [m for m in plan_model.modules() if isinstance(m, rm.PlanMoELayer)][0]
    hidden = torch.randn(t, 1, case.hidden)
    layer.router.router_replay.clear_indices()
    layer.router.router_replay.set_target_indices(ids[0])
    _, rmap = layer.router(hidden)
    owner = np.full(rmap.shape[1], -1)
    spr, per = case.slots_per_rank, case.slots_per_rank + case.replica_slots
    owner[:spr] = layer.phy2log[:spr]
    tok, phys = torch.nonzero(rmap, as_tuple=True)
    out["replayed"] = (
        all(sorted(owner[phys[tok == i].numpy()].tolist()) == sorted(ids[0, i].tolist()) for i in range(t))
        and rmap.shape[1] == per
    )
    return out


@pytest.mark.parametrize("flavour", ["mcore", "verl"])
def test_router_replay_with_a_plan(flavour):
    if flavour == "verl":
        pytest.importorskip("verl")
    out = run_ranks(check_replay, 1, flavour, join_timeout_s=300, pg_timeout_s=60)[0]
    assert out["entries"] == 2 and out["layer_numbers"] == [1, 2], out  # one per MoE layer, numbered
    assert out["router_class"] == "PlanTopKRouter"
    assert out["router_keys"] == [f"decoder.layers.{i}.mlp.router.weight" for i in range(2)], out  # stock keys
    if flavour == "verl":
        assert out["walk"] == [1, 2], out
    assert out["loss_diff"] <= 1e-4 and out["grad_diff"] <= 1e-5, out
    assert out["replayed"], out
