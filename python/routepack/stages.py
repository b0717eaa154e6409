"""The baseline stage implementations of the foundation: `static` placement, `sequential`
packing, no replication. Later stages register themselves in their own modules."""

from __future__ import annotations

import numpy as np

from routepack import _core
from routepack.plan import Placement, empty_replicas
from routepack.policies import PACKINGS, PLACEMENTS, REPLICATIONS, PlanContext, PackingResult


def static_placement(ctx: PlanContext) -> Placement:
    w = ctx.window
    return Placement.static(w.num_layers, w.num_experts, ctx.topo)


def sequential_packing(ctx: PlanContext, placement: Placement) -> PackingResult:
    rank, micro, m = _core.pack_sequential(ctx.window.seq_lens, int(ctx.token_cap), ctx.topo.dp)
    return rank, micro, m, {"rows": m * ctx.topo.dp}


def no_replication(ctx: PlanContext, placement: Placement, sample_rank: np.ndarray,
                   sample_micro: np.ndarray, num_micro: int) -> np.ndarray:
    return empty_replicas()


PLACEMENTS["static"] = static_placement
PACKINGS["sequential"] = sequential_packing
REPLICATIONS["none"] = no_replication
