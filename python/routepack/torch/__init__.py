"""routepack.torch: carries routepack plans out with torch.distributed (docs/design.md stage 5).

With `routepack.integrations` and `routepack.calibrate`, the only code of routepack that
imports torch. Backend-neutral: gloo on CPU (tests), NCCL on GPUs (``tools/gpu_check.py``).

* `EPMoE`: reference expert-parallel MoE layer (stacked slot weights, replayed top-k routing,
  all-to-all dispatch/combine); `dense_moe` is its single-process reference.
* `route_tokens` / `flow_table`: logical ids → physical slots and replica copies, by the
  plan's own routing rule (``flow::route_exchange``).
* `migrate`: plan.migration with the state of any ``torch.optim`` optimizer keyed by parameter
  (per-slot tensors move, scalars such as ``step`` stay; unmappable state is refused naming
  the parameter and key), transferred, verified and committed atomically;
  ``max_bytes_in_flight=`` moves a few layers at a time, in waves, under that ceiling
  (`routepack.torch.waves`).
* `ReplicaExchange`: per-microbatch hot-expert copies, sent as the simulator's chain
  (owner → same node → others), and their fp32 gradients reduced back along it.
* `plan_window_distributed`: `routepack.plan_window` computed by the ranks of a group together
  (replication's exchanges spread over them), the same plan byte for byte on every rank;
  `window_from_ranks` / `gather_window`: the window assembled from each DP rank's own
  samples' compact histograms (`GatheredWindow` says the bytes on the wire vs raw ids).
* `PlanRunner`: one window end to end; `broadcast_plan` / `load_plan` (one rank's plan or plan
  file to every rank, confirmed on each); `rank_microbatches` (replay order).
  ``begin_window(..., microbatches=rank_microbatches(...))`` precomputes every layer's route
  for the window (`routepack.torch.routes`: no host sync or all-gather in the forward; the
  ids fed are checked once per step in ``finish_step``); ``max_bytes_in_flight=`` moves
  the migration in waves. Under a pipeline (``topo.pp`` > 1) a rank passes its stage's layers and
  ``pipeline_group``: the plan is agreed over every stage (one digest per window) and each
  stage carries out its own layers' rows (`stage_plan`, shared with the Megatron runner);
  intra-batch replicas are refused there.
* `export_logical(layers)` → ``[(w1 [E, H, 2I], w2 [E, I, H])]`` per layer in logical order
  (collective); `import_logical(layers, weights)` its inverse; ``EPMoE.state_dict()`` keeps the
  placement (``_extra_state``), so a checkpoint round trip keeps placement and weights.

Gradients: each `EPMoE` backward returns the slots' gradient of that microbatch (local +
replica copies, in fp32, rounded once; `routepack.torch.slot_link`) before the parameters'
hooks fire (DDP, Megatron ``main_grad``); slots of redundant experts (one expert in several
slots) get 0 until the step's last microbatch, whose backward returns their whole step's
gradient summed over the EP group (one all-reduce a layer and step).
`PlanRunner.finish_step(reduce_edp=True)` then only sums over EP groups.
"""

try:
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("routepack.torch needs PyTorch >= 2.1: pip install 'routepack[torch]'") from e

from routepack.torch.broadcast import (
    AgreementError,
    agree_on_plan,
    broadcast_plan,
    gather_ints,
    load_plan,
    plan_digest,
)
from routepack.torch.distributed_plan import plan_window_distributed
from routepack.torch.grads import sync_redundant_grads
from routepack.torch.logical import export_logical, import_logical
from routepack.torch.migrate import (
    FAULT_POINTS,
    MigrationError,
    MigrationReport,
    check_migration,
    checksum,
    expert_state,
    migrate,
)
from routepack.torch.moe import EPMoE, dense_moe, swiglu
from routepack.torch.pipeline import stage_plan
from routepack.torch.remap import FLOW_DTYPE, TokenRoute, expert_counts, flow_table, route_tokens
from routepack.torch.replay import Microbatch, rank_microbatches
from routepack.torch.replicate import ReplicaExchange
from routepack.torch.runner import PlanRunner
from routepack.torch.window_gather import GatheredWindow, gather_window, window_from_ranks

__all__ = [
    "AgreementError",
    "EPMoE",
    "FAULT_POINTS",
    "FLOW_DTYPE",
    "GatheredWindow",
    "Microbatch",
    "MigrationError",
    "MigrationReport",
    "PlanRunner",
    "ReplicaExchange",
    "TokenRoute",
    "agree_on_plan",
    "broadcast_plan",
    "check_migration",
    "checksum",
    "dense_moe",
    "expert_counts",
    "expert_state",
    "export_logical",
    "flow_table",
    "gather_ints",
    "gather_window",
    "import_logical",
    "load_plan",
    "migrate",
    "plan_digest",
    "plan_window_distributed",
    "rank_microbatches",
    "route_tokens",
    "stage_plan",
    "swiglu",
    "sync_redundant_grads",
    "window_from_ranks",
]
