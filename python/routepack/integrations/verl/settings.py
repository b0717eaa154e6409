"""What routepack reads from verl's trainer config (`settings_from_config`), refusing at install
(`RoutepackError` naming the option) what it cannot follow, and naming in ``blocked`` the parts of
a plan the configured model cannot run, with the setting that enables each."""

from __future__ import annotations

from typing import Any, Dict, Mapping

from routepack._checks import positive_int
from routepack.errors import RoutepackError
from routepack.integrations.verl import megatron_engine as vm


def _get(config: Any, path: str, default: Any = None) -> Any:
    """``config``'s value at dotted ``path`` (OmegaConf, dicts or attributes), or ``default``
    where a part is missing or None."""
    node = config
    for part in path.split("."):
        if isinstance(node, Mapping) or hasattr(node, "keys"):
            try:
                node = node.get(part)
            except Exception:  # OmegaConf in struct mode, a missing interpolation
                node = None
        else:
            node = getattr(node, part, None)
        if node is None:
            return default
    return node


def settings_from_config(config: Any) -> Dict[str, Any]:
    """What routepack reads from verl's trainer config, refusing (`RoutepackError` naming the
    option) a setting it cannot follow: keys backend, minibatch_size, epochs, token_cap,
    multiple (VPP's microbatch group), ep, gpus_per_node, mode."""
    actor = "actor_rollout_ref.actor"
    strategy = _get(config, f"{actor}.strategy", "fsdp")
    if strategy not in ("fsdp", "fsdp2", "megatron"):
        raise RoutepackError(f"{actor}.strategy: routepack plans for fsdp, fsdp2 and megatron, got {strategy!r}")
    megatron = strategy == "megatron"
    for option, bad, why in (
        ("trainer.balance_batch", not _get(config, "trainer.balance_batch", True), "the DP split is made there"),
        (f"{actor}.use_dynamic_bsz", not _get(config, f"{actor}.use_dynamic_bsz", False), "plans are token-capped"),
        (f"{actor}.shuffle", bool(_get(config, f"{actor}.shuffle", False)), "it reshuffles mini-batches every epoch"),
        (f"{actor}.use_prefix_grouper", bool(_get(config, f"{actor}.use_prefix_grouper", False)), "it groups by uid"),
        (
            f"{actor}.megatron.dynamic_context_parallel",
            megatron and bool(_get(config, f"{actor}.megatron.dynamic_context_parallel", False)),
            "it schedules microbatches itself",
        ),
    ):
        if bad:
            raise RoutepackError(
                f"{option}: routepack cannot plan with this setting ({why}); set it the other way or do not install routepack"
            )
    n = positive_int(int(_get(config, "actor_rollout_ref.rollout.n", 1)), "actor_rollout_ref.rollout.n")
    mbs = positive_int(int(_get(config, f"{actor}.ppo_mini_batch_size", 0) or 0), f"{actor}.ppo_mini_batch_size") * n
    sp = (
        _get(config, f"{actor}.megatron.context_parallel_size", 1)
        if megatron
        else _get(config, f"{actor}.ulysses_sequence_parallel_size", 1)
    )
    cap = positive_int(
        int(_get(config, f"{actor}.ppo_max_token_len_per_gpu", 0) or 0), f"{actor}.ppo_max_token_len_per_gpu"
    )
    multiple = 1
    vpp = _get(config, f"{actor}.megatron.virtual_pipeline_model_parallel_size") if megatron else None
    if vpp is not None and int(vpp) > 1:
        group = _get(config, f"{actor}.megatron.override_transformer_config.microbatch_group_size_per_vp_stage")
        multiple = int(group or _get(config, f"{actor}.megatron.pipeline_model_parallel_size", 1))
    mode = _get(config, f"{actor}.megatron.router_replay.mode", "disabled") if megatron else "disabled"
    if not _get(config, "actor_rollout_ref.rollout.enable_rollout_routing_replay", False) and mode != "R2":
        raise RoutepackError(
            "actor_rollout_ref.rollout.enable_rollout_routing_replay=False: the rollout records no routes, so no step "
            "can be planned; set it True (or, on Megatron, actor_rollout_ref.actor.megatron.router_replay.mode=R2)"
        )
    blocked: Dict[str, str] = {}
    layout_ = {"slots_per_rank": None, "replica_slots": 0}
    if megatron:
        layout_ = vm.layout(_get(config, f"{actor}.megatron.override_mcore_model_config"))
        values = {k: _get(config, f"{actor}.megatron.{k}") for k in vm.LIMIT_KEYS}
        limit = (
            "; ".join(
                r
                for r in (
                    vm.limits(values),
                    *vm.expert_limits(
                        _get(config, f"{actor}.megatron.override_transformer_config.moe_grouped_gemm"), mode
                    ),
                )
                if r
            )
            or None
        )
        if limit is not None:
            blocked["placement"] = limit
        elif not layout_["replica_slots"]:
            blocked["replicas"] = (
                f"{actor}.megatron.override_mcore_model_config.{vm.LAYOUT_KEY}.replica_slots is 0: the MoE layers "
                "hold no replica buffers"
            )
        epochs = int(_get(config, f"{actor}.ppo_epochs", 1) or 1)
        if limit is None and epochs > 1:
            blocked["placement"] = (
                f"{actor}.ppo_epochs={epochs}: each mini-batch's plan moves experts from the previous mini-batch's "
                "placement, and later epochs run the mini-batches again in another order"
            )
        contents = list(_get(config, f"{actor}.checkpoint.save_contents", []) or [])
        saves = (
            "placement" not in blocked
            and int(_get(config, "trainer.save_freq", -1) or -1) > 0
            and "optimizer" in contents
        )
        if saves and not _get(config, f"{actor}.megatron.dist_ckpt_optim_fully_reshardable", False):
            raise RoutepackError(
                f"{actor}.megatron.dist_ckpt_optim_fully_reshardable=False with trainer.save_freq > 0: the default "
                "dp_reshardable optimizer format cannot save a model whose experts routepack moves; set it True, "
                f"or drop 'optimizer' from {actor}.checkpoint.save_contents"
            )
        if saves:
            blocked["optimizer_ckpt"] = (
                f"{actor}.checkpoint.save_contents holds 'optimizer' and trainer.save_freq > 0: optimizer state of "
                "a model with redundant slots or replica buffers is not placement-independent yet"
            )
    if mode not in ("R2", "R3"):
        mode = "R3"  # routes recorded by the rollout (enable_rollout_routing_replay), or none: then refused per step
    return {
        "backend": "megatron" if megatron else "fsdp",
        "minibatch_size": mbs,
        "epochs": positive_int(int(_get(config, f"{actor}.ppo_epochs", 1)), f"{actor}.ppo_epochs"),
        "token_cap": cap * positive_int(int(sp or 1), "sequence/context parallel size"),
        "multiple": positive_int(
            multiple, f"{actor}.megatron.override_transformer_config.microbatch_group_size_per_vp_stage"
        ),
        "ep": int(_get(config, f"{actor}.megatron.expert_model_parallel_size", 1) or 1) if megatron else 1,
        "gpus_per_node": int(_get(config, "trainer.n_gpus_per_node", 8) or 8),
        "mode": mode,
        "layout": layout_,
        "blocked": blocked,
    }


__all__ = ["settings_from_config"]
