"""routepack.integrations: glue to the frameworks a trainer's model comes from.

* `routepack.integrations.hf`: Hugging Face transformers MoE models: routing captured
  during a forward pass (`capture` → `routepack.Window`) and replayed (`replay_routing`).
  Needs ``pip install 'routepack[hf]'``.
* `routepack.integrations.verl`: a `routepack.Window` from verl's ``routed_experts`` batch
  and, from a plan, what ``_balance_batch`` / ``rearrange_micro_batches`` return.
* `routepack.integrations.slime`: a Window from slime's ``rollout_routed_experts`` and, from
  plans, ``build_dp_schedule``'s schedule.
* `routepack.integrations.megatron`: the plan's placement in Megatron-Core's MoE layer
  (``PlanRouter``, ``weight{i}`` and checkpoint mappings).
* `routepack.integrations.verl`: a `routepack.Window` from verl's ``routed_experts`` batch
  and, from a plan, what ``_balance_batch`` / ``rearrange_micro_batches`` return.
* `routepack.integrations.slime`: a Window from slime's ``rollout_routed_experts`` and, from
  plans, ``build_dp_schedule``'s schedule.
* `routepack.integrations.megatron`: the plan's placement in Megatron-Core's MoE layer
  (`PlanRouter`, ``weight{i}`` and checkpoint mappings).

Nothing here is imported by ``import routepack``; each submodule imports its framework.
"""
