"""`MegatronGroups`: the process groups and ranks `MegatronRunner` works over, and
`groups_from_parallel_state`, which reads them from Megatron's ``parallel_state`` (what a job
initialised with ``parallel_state.initialize_model_parallel`` has).

The runner takes them as an argument so that a job whose groups are not Megatron's globals
(its own ``ProcessGroupCollection``, a test) says which ones it runs on; without one it reads
the globals, as Megatron's own ``get_default_pg_collection`` does for its MoE layers. The
expert-data-parallel group is not among them: the optimizer state that moves with an expert
is sharded over the optimizer's own ``data_parallel_group`` (`slot_state`), read from the
optimizer so the two cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

from routepack.errors import RoutepackError
from routepack.model import Topology


@dataclass(frozen=True)
class MegatronGroups:
    """``ep``: the expert-parallel group (its ranks must be the `PlanMoELayer` layers' own);
    ``pp``: the pipeline group of this rank's stages, None at ``pp_size == 1``; ``pp_rank``:
    this rank's pipeline stage; ``pp_size`` / ``vpp_size``: Megatron's pipeline size and model
    chunks per rank (1: not interleaved); ``dp_rank`` / ``dp_size``: this rank in the
    data-parallel group of its stage (routepack's EP groups are consecutive blocks of ``ep``
    DP ranks)."""

    ep: Any
    pp: Any = None
    pp_rank: int = 0
    pp_size: int = 1
    vpp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1

    def check(self) -> "MegatronGroups":
        """Self, after refusing fields that contradict each other (named)."""
        for name in ("pp_rank", "pp_size", "vpp_size", "dp_rank", "dp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if "rank" in name else 1):
                raise RoutepackError(f"groups.{name}: expected an int >= {0 if 'rank' in name else 1}, got {value!r}")
        if self.ep is None:
            raise RoutepackError("groups.ep: the expert-parallel process group is required")
        if (self.pp is None) != (self.pp_size == 1):
            raise RoutepackError(f"groups.pp: a pipeline group exactly when pp_size > 1 (pp_size={self.pp_size})")
        if self.pp_rank >= self.pp_size or self.dp_rank >= self.dp_size:
            raise RoutepackError(
                f"groups: pp_rank={self.pp_rank} of pp_size={self.pp_size}, dp_rank={self.dp_rank} of "
                f"dp_size={self.dp_size}"
            )
        return self

    def pipeline_stage(self, topo: Topology, num_moe_layers: int, held: List[int]) -> Tuple[int, Any]:
        """(this rank's pipeline stage, the pipeline group or None at pp = 1), after checking
        that ``topo`` describes the job's pipeline (``pp_size`` and, interleaved, ``vpp_size``)
        and that this stage holds the MoE layers ``held`` that ``topo`` gives it
        (`Topology.stage_layers`: under vpp > 1 the layers of all its chunks)."""
        pp, vpp = self.pp_size, self.vpp_size
        if topo.pp != pp or topo.vpp != vpp:
            raise RoutepackError(
                f"topo: pp={topo.pp}, vpp={topo.vpp}; Megatron runs pipeline_model_parallel_size={pp} with {vpp} "
                "model chunk(s) per rank (plan with the job's pipeline: Topology(..., pp=..., vpp=...))"
            )
        if pp == 1:
            return 0, None
        want = topo.stage_layers(self.pp_rank, num_moe_layers)
        if held != want:
            raise RoutepackError(
                f"topo: gives pipeline stage {self.pp_rank} MoE layers {want} (layers_per_stage="
                f"{topo.layers_per_stage}), the model's stage holds {held}; plan with "
                "Topology(layers_per_stage=...) as Megatron splits them"
            )
        return self.pp_rank, self.pp

    def ep_group_index(self, topo: Topology, ep_rank: int) -> int:
        """Which of the plan's EP groups this rank is in (``dp_rank // ep``), after checking that
        ``topo.dp`` is the DP size and that this rank's EP rank (``ep_rank``) is its place in a
        block of ``ep`` consecutive DP ranks, as routepack's EP groups are."""
        if self.dp_size != topo.dp or self.dp_rank % topo.ep != ep_rank:
            raise RoutepackError(
                f"topo: dp={topo.dp}, ep={topo.ep}; Megatron has DP size {self.dp_size}, this rank DP "
                f"{self.dp_rank}, EP {ep_rank} (routepack's EP groups are consecutive blocks of ep DP ranks)"
            )
        return self.dp_rank // topo.ep


def groups_from_parallel_state(parallel_state: Optional[Any] = None) -> MegatronGroups:
    """`MegatronGroups` read from Megatron's ``parallel_state`` (``megatron.core.parallel_state``
    when None): its expert-parallel group, its pipeline group, rank and size (the group None
    at size 1), its virtual pipeline size (None there: 1) and its data-parallel rank and size."""
    ps: Any = parallel_state
    if ps is None:
        import megatron.core.parallel_state

        ps = megatron.core.parallel_state
    pp = ps.get_pipeline_model_parallel_world_size()
    return MegatronGroups(
        ep=ps.get_expert_model_parallel_group(),
        pp=ps.get_pipeline_model_parallel_group() if pp > 1 else None,
        pp_rank=ps.get_pipeline_model_parallel_rank() if pp > 1 else 0,
        pp_size=pp,
        vpp_size=ps.get_virtual_pipeline_model_parallel_world_size() or 1,
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
    ).check()


__all__ = ["MegatronGroups", "groups_from_parallel_state"]
