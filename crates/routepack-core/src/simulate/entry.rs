//! The simulator's entry points: [`simulate`] and its variants that validate the plan first,
//! take a token cap for the lower bound, price samples split over a CP group, or price copies
//! planned from the router's output ([`simulate_timed`]).

use super::{score, split, SimReport};
use crate::cell_grid::CellGrid;
use crate::cost::CostModel;
use crate::error::{invalid, Result};
use crate::oversize::Oversize;
use crate::plan::{Plan, ReplicaTiming};
use crate::split::Pieces;
use crate::topology::Topology;
use crate::validate::validate_plan_in;
use crate::window::WindowView;

/// Scores `plan` on `w`. `ideal_micro`: the microbatch count of the balanced reference (see
/// [`lower_bound_micro`]); None uses the plan's own count. The lower bound is the one without
/// a cap (see [`simulate_with_cap`]).
pub fn simulate(plan: &Plan, w: &WindowView, topo: &Topology, cost: &CostModel, ideal_micro: Option<usize>) -> Result<SimReport> {
    simulate_with_cap(plan, w, topo, cost, ideal_micro, None)
}

/// [`simulate`], with `lower_bound_time` computed for plans of at most `token_cap` tokens per
/// row. The plan itself is not checked against the cap: where one of its rows holds more, the
/// bound is taken at that row's size instead, so it still bounds this plan (and every plan
/// valid under the larger cap). None: no cap (Σ n, the weakest bound).
pub fn simulate_with_cap(
    plan: &Plan,
    w: &WindowView,
    topo: &Topology,
    cost: &CostModel,
    ideal_micro: Option<usize>,
    token_cap: Option<i64>,
) -> Result<SimReport> {
    simulate_validated(plan, w, topo, cost, ideal_micro, token_cap, i64::MAX)
}

/// [`simulate_with_cap`] after [`validate_plan`] with `plan_cap` (tokens per cell; `i64::MAX`
/// checks no cap): `Plan.validate` and the simulator in one call, the window viewed once
/// (what `plan_window` runs on the plan it assembles).
pub fn simulate_validated(
    plan: &Plan,
    w: &WindowView,
    topo: &Topology,
    cost: &CostModel,
    ideal_micro: Option<usize>,
    token_cap: Option<i64>,
    plan_cap: i64,
) -> Result<SimReport> {
    simulate_validated_in(plan, w, topo, cost, ideal_micro, token_cap, plan_cap, Oversize::Refuse)
}

/// [`simulate_validated`], validating with `oversize` ([`validate_plan_in`]: with
/// `Oversize::Alone` a cell over `plan_cap` may hold one sample). With `Oversize::Split` the
/// plan is checked against `plan_cap`, else `token_cap` (required: the cap says which samples
/// are split), and priced on its pieces with ring attention (`simulate::split`).
#[allow(clippy::too_many_arguments)]
pub fn simulate_validated_in(
    plan: &Plan,
    w: &WindowView,
    topo: &Topology,
    cost: &CostModel,
    ideal_micro: Option<usize>,
    token_cap: Option<i64>,
    plan_cap: i64,
    oversize: Oversize,
) -> Result<SimReport> {
    simulate_timed(plan, w, topo, cost, ideal_micro, token_cap, plan_cap, oversize, ReplicaTiming::Prefetched)
}

/// [`simulate_validated_in`] of a plan whose intra-batch copies move as `timing` says
/// ([`ReplicaTiming`]: the plan's `replica_timing`).
#[allow(clippy::too_many_arguments)]
pub fn simulate_timed(
    plan: &Plan,
    w: &WindowView,
    topo: &Topology,
    cost: &CostModel,
    ideal_micro: Option<usize>,
    token_cap: Option<i64>,
    plan_cap: i64,
    oversize: Oversize,
    timing: ReplicaTiming,
) -> Result<SimReport> {
    cost.check(w.num_layers)?;
    if oversize == Oversize::Split {
        // the cap that says which samples are split: what the plan was checked against
        let split_cap = match (plan_cap, token_cap) {
            (i64::MAX, Some(cap)) => cap,
            (i64::MAX, None) => return Err(invalid("token_cap", "oversize=\"split\": pricing needs the cap the plan splits samples at")),
            (cap, _) => cap,
        };
        validate_plan_in(plan, w, topo, split_cap, oversize)?;
        let pieces = Pieces::new(w.seq_lens, split_cap, topo.cp)?;
        if pieces.any_split() {
            return split::simulate_pieces(plan, w, topo, cost, ideal_micro, token_cap, &pieces, timing);
        }
    } else {
        validate_plan_in(plan, w, topo, plan_cap, oversize)?;
    }
    let grid = CellGrid::new(&plan.sample_rank, &plan.sample_micro, plan.num_micro, w.seq_lens, topo);
    score(plan, w, topo, cost, ideal_micro, token_cap, grid, timing)
}
