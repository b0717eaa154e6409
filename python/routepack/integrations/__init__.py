"""routepack.integrations: glue to the frameworks a trainer's model comes from, one package per
framework.

Execution backends (they carry a plan out in a model):

* `routepack.integrations.megatron`: the whole plan (placement, migration, redundant experts,
  intra-batch replicas) in Megatron-Core's MoE layer (`plan_layer_spec`, `MegatronRunner`,
  checkpoints in logical experts) and the numpy-only index helpers. Its modules: ``layer``,
  ``tables``, ``runner``, ``groups``, ``microbatch``, ``slot_state``, ``experts``,
  ``checkpoint``, ``stock``, ``handoff`` (a plan shipped to the workers), ``router``, ``slots``.
* `routepack.integrations.hf`: Hugging Face transformers MoE models: routing captured during
  a forward pass (`capture` → `routepack.Window`) and replayed (`replay_routing`), and their
  MoE blocks run expert-parallel under plans (``hf.sharding``, also served as
  `routepack.integrations.hf_shard`). Needs ``pip install 'routepack[hf]'``.

Trainers (they read the trainer's batch, plan its steps and hand the plans to a backend):

* `routepack.integrations.verl`: a `routepack.Window` from verl's ``routed_experts`` batch, a
  plan per PPO mini-batch, and verl's ``_balance_batch`` / ``prepare_micro_batches`` hooked so
  that the plans run (``window``, ``split``, ``plans``, ``hooks``, ``megatron_engine``).
* `routepack.integrations.slime`: a Window from slime's ``rollout_routed_experts`` and, from
  plans, ``build_dp_schedule``'s schedule; ``slime.actor`` carries the plans out in slime's
  Megatron actor.

``shared``: what they share (`TrainerPlanner`, the trainer layouts, numpy conversions).

The layering (tests/test_integrations_layering.py checks it on the import graph): a trainer
package may import a backend package and ``shared``, never another trainer; a backend never
imports a trainer; ``shared`` imports neither (it reads the Megatron backend's ``EXECUTES``
declaration by name when a trainer asks what that backend runs, `shared.trainer.megatron_executes`).

Nothing here is imported by ``import routepack``; each package imports its framework only
when a function that needs it runs (``hf``: on import).
"""
