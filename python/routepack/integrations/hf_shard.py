"""`routepack.integrations.hf_shard`, the public path of expert-parallel training of a Hugging
Face transformers MoE model under routepack plans: its code lives in
`routepack.integrations.hf.sharding` (the ``hf`` backend's folder); every name it exported is
served from there, so ``from routepack.integrations.hf_shard import shard`` works as before.
Needs transformers and PyTorch (``pip install 'routepack[hf]'``)."""

from __future__ import annotations

from routepack.integrations.hf.sharding import SHARDABLE, EPExperts, MoEBlock, ShardedMoE, moe_blocks, shard

__all__ = ["EPExperts", "MoEBlock", "SHARDABLE", "ShardedMoE", "moe_blocks", "shard"]
