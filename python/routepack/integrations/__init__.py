"""routepack.integrations: glue to the frameworks a trainer's model comes from.

* `routepack.integrations.hf`: Hugging Face transformers MoE models: routing captured
  during a forward pass (`capture` → `routepack.Window`) and replayed (`replay_routing`).
  Needs ``pip install 'routepack[hf]'``.

Nothing here is imported by ``import routepack``; each submodule imports its framework.
"""
