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
use crate::request::PlanRequest;
use crate::split::Pieces;
use crate::topology::Topology;
use crate::validate::validate_checked;
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
/// every option, which `simulate` and the Python binding call. The cost model and the topology
/// are checked here, once; the plan is validated (`validate_plan_in`'s checks of the plan).
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

/// The entry of [`simulate_in`] and [`simulate_terms`]: the cost model and the topology checked
/// here, once, then [`simulate_checked`].
fn scored(
    plan: &Plan,
    w: &WindowView,
    topo: &Topology,
    cost: &CostModel,
    scoring: &Scoring,
    detail: bool,
) -> Result<(SimReport, Option<ExchangeTerms>)> {
    cost.check(w.num_layers)?;
    topo.check_experts(w.num_experts)?;
    simulate_checked(plan, w, topo, cost, scoring, false, detail)
}

/// Validates and scores `plan` for the checked request `req` (nothing of it checked again):
/// `Plan.validate` against the request's cap under its `oversize`, then the simulator with the
/// lower bound at that cap (`Scoring { token_cap, plan_cap }` both the request's cap). What
/// `plan_window`'s final step computes.
pub fn simulate_request(plan: &Plan, req: &PlanRequest, ideal_micro: Option<usize>, timing: ReplicaTiming) -> Result<SimReport> {
    let cap = Some(req.token_cap());
    let scoring = Scoring { ideal_micro, token_cap: cap, plan_cap: cap, oversize: req.oversize(), timing, step_only: false };
    Ok(simulate_checked(plan, req.window(), req.topo(), req.cost(), &scoring, true, false)?.0)
}

/// [`simulate_in`] on a cost model and topology checked for `w`; `lengths_checked`: the
/// window's lengths were checked against `scoring.plan_cap` too (a request's); `detail`: the
/// exchanges' terms too ([`simulate_terms`]).
#[allow(clippy::too_many_arguments)]
fn simulate_checked(
    plan: &Plan,
    w: &WindowView,
    topo: &Topology,
    cost: &CostModel,
    scoring: &Scoring,
    lengths_checked: bool,
    detail: bool,
) -> Result<(SimReport, Option<ExchangeTerms>)> {
    let Scoring { ideal_micro, token_cap, plan_cap, oversize, timing, step_only } = *scoring;
    if oversize == Oversize::Split {
        // the cap that says which samples are split: what the plan was checked against
        let Some(split_cap) = plan_cap.or(token_cap) else {
            return Err(invalid("token_cap", "oversize=\"split\": pricing needs the cap the plan splits samples at"));
        };
        validate_checked(plan, w, topo, split_cap, oversize, lengths_checked && plan_cap.is_some())?;
        // the validation checked the pieces
        let pieces = Pieces::of_checked(w.seq_lens, split_cap, topo.cp);
        if pieces.any_split() {
            return split::simulate_pieces(plan, w, topo, cost, ideal_micro, token_cap, &pieces, timing, detail);
        }
    } else {
        validate_checked(plan, w, topo, plan_cap.unwrap_or(i64::MAX), oversize, lengths_checked)?;
    }
    let grid = CellGrid::new(&plan.sample_rank, &plan.sample_micro, plan.num_micro, w.seq_lens, topo);
    score(plan, w, topo, cost, ideal_micro, token_cap, grid, timing, step_only, detail)
}
