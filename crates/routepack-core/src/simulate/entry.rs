//! The simulator's entry points: [`simulate`] (well-formedness only, no cap) and
//! [`simulate_in`], the one entry with every option ([`Scoring`]): a token cap for the lower
//! bound, validation of the plan first, samples split over a CP group, and copies planned from
//! the router's output ([`ReplicaTiming`]).

use super::{score, split, ExchangeTerms, SimReport};
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
/// [`crate::bound::lower_bound_micro`]); None uses the plan's own count. The lower bound is the
/// one without a cap, and the plan is checked for well-formedness only ([`simulate_in`] says more).
pub fn simulate(plan: &Plan, w: &WindowView, topo: &Topology, cost: &CostModel, ideal_micro: Option<usize>) -> Result<SimReport> {
    simulate_in(plan, w, topo, cost, &Scoring { ideal_micro, ..Scoring::default() })
}

/// What [`simulate_in`] is told besides the plan, the window, the topology and the cost model.
/// `Scoring::default()`: the plan's own microbatch count, no cap, well-formedness only, copies
/// prefetched.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Scoring {
    /// The microbatch count of the balanced reference ([`crate::bound::lower_bound_micro`]; None: the plan's).
    pub ideal_micro: Option<usize>,
    /// The cap the lower bound assumes: `lower_bound_time` is computed for plans of at most this
    /// many tokens per row. The plan itself is not checked against it: where one of its rows
    /// holds more, the bound is taken at that row's size instead, so it still bounds this plan
    /// (and every plan valid under the larger cap). None: no cap (Σ n, the weakest bound).
    pub token_cap: Option<i64>,
    /// Validate the plan first as [`validate_plan_in`] does against this cap (tokens per cell;
    /// None: well-formedness only, no cap): `Plan.validate` and the simulator in one call, the
    /// window viewed once (what `plan_window` runs on the plan it assembles).
    pub plan_cap: Option<i64>,
    /// Samples over the cap ([`validate_plan_in`]: with `Oversize::Alone` a cell over the cap may
    /// hold one sample). With `Oversize::Split` the plan is checked against `plan_cap`, else
    /// `token_cap` (one of them required: the cap says which samples are split), and priced on
    /// its pieces with ring attention (`simulate::split`).
    pub oversize: Oversize,
    /// How the plan's intra-batch copies move ([`ReplicaTiming`]: the plan's `replica_timing`).
    pub timing: ReplicaTiming,
    /// The step time and its parts only: no lower bound and no balanced reference (both NaN),
    /// so the pass over the demand skips the bound's row sums (about half a `simulate` at
    /// `flash`). What a choice among candidate plans reads; the step time is the same bits.
    pub step_only: bool,
}

/// Scores `plan` on `w` as `scoring` says (see [`Scoring`]): the simulator's one entry with
/// every option, which `simulate` and the Python binding call.
pub fn simulate_in(plan: &Plan, w: &WindowView, topo: &Topology, cost: &CostModel, scoring: &Scoring) -> Result<SimReport> {
    Ok(scored(plan, w, topo, cost, scoring, false)?.0)
}

/// [`simulate_in`] and every exchange it priced, each rank's part in it ([`ExchangeTerms`]):
/// what a timeline of the step per rank is drawn from. The report is `simulate_in`'s, bit for bit.
pub fn simulate_terms(
    plan: &Plan,
    w: &WindowView,
    topo: &Topology,
    cost: &CostModel,
    scoring: &Scoring,
) -> Result<(SimReport, ExchangeTerms)> {
    let (report, terms) = scored(plan, w, topo, cost, scoring, true)?;
    Ok((report, terms.expect("asked for the exchanges' detail")))
}

fn scored(
    plan: &Plan,
    w: &WindowView,
    topo: &Topology,
    cost: &CostModel,
    scoring: &Scoring,
    detail: bool,
) -> Result<(SimReport, Option<ExchangeTerms>)> {
    let Scoring { ideal_micro, token_cap, plan_cap, oversize, timing, step_only } = *scoring;
    cost.check(w.num_layers)?;
    if oversize == Oversize::Split {
        // the cap that says which samples are split: what the plan was checked against
        let Some(split_cap) = plan_cap.or(token_cap) else {
            return Err(invalid("token_cap", "oversize=\"split\": pricing needs the cap the plan splits samples at"));
        };
        validate_plan_in(plan, w, topo, split_cap, oversize)?;
        let pieces = Pieces::new(w.seq_lens, split_cap, topo.cp)?;
        if pieces.any_split() {
            return split::simulate_pieces(plan, w, topo, cost, ideal_micro, token_cap, &pieces, timing, detail);
        }
    } else {
        validate_plan_in(plan, w, topo, plan_cap.unwrap_or(i64::MAX), oversize)?;
    }
    let grid = CellGrid::new(&plan.sample_rank, &plan.sample_micro, plan.num_micro, w.seq_lens, topo);
    score(plan, w, topo, cost, ideal_micro, token_cap, grid, timing, step_only, detail)
}
