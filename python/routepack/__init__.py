"""routepack: load balancing for MoE reinforcement-learning training with routing replay.

Before a training step the trainer knows every sample's length and per-layer expert demand
(routing replay). `plan_window` turns that into a `Plan`: where each expert lives, how samples
are packed into token-capped microbatches and laid out over DP ranks, and which hot experts
to replicate per microbatch. `simulate` scores any plan under docs/design.md's cost model.
`routepack.torch` carries a plan out with torch.distributed. The stages, their options
and their registry are in `routepack.stages`. `calibrate` measures the cost model's
coefficients on this machine (imports torch only when called).
"""

from routepack._core import __version__
from routepack.errors import (
    InfeasibleError,
    InvalidPlanError,
    RoutepackError,
    RoutepackFileError,
    RoutepackInternalError,
    RoutepackTypeError,
)
from routepack.model import CostModel, Hardware, ModelShape, Topology
from routepack.plan import MIGRATION_DTYPE, REPLICA_DTYPE, Placement, Plan
from routepack.planner import plan_window
from routepack.policies import PRESETS, Policy
from routepack.simulate import SimResult, simulate
from routepack.window import Window
from routepack.calibrate import Calibration, calibrate
from routepack.measure import Measurement, measure
from routepack import rl_profiles, stages, traces

# the models RL users train and the rack-scale profiles join the built-in ones
rl_profiles.register()

__all__ = [
    "__version__",
    "Calibration",
    "CostModel",
    "Hardware",
    "InfeasibleError",
    "InvalidPlanError",
    "MIGRATION_DTYPE",
    "Measurement",
    "ModelShape",
    "PRESETS",
    "Placement",
    "Plan",
    "Policy",
    "REPLICA_DTYPE",
    "RoutepackError",
    "RoutepackFileError",
    "RoutepackInternalError",
    "RoutepackTypeError",
    "SimResult",
    "Topology",
    "Window",
    "calibrate",
    "measure",
    "plan_window",
    "simulate",
    "stages",
    "traces",
]
