//! A plan with samples split over context-parallel groups ([`crate::split`]), priced on its
//! pieces: piece j of a split sample runs on rank j of its CP group with its share of the
//! sample's tokens and routed tokens, and its cell's attention is ring attention's
//! ([`CostModel::ring_quad`], [`CostModel::ring_kv_time`]). Every other term is `simulate`'s
//! on the pieces' window. The lower bound is that window's: a split plan is a valid plan of it
//! (each piece alone in a cell within the cap), priced no lower here, since ring attention
//! only adds to a cell's attention (n²/cp >= piece² for n >= cp, plus the KV blocks) and the
//! step is nondecreasing in attention.

use super::{score, ExchangeTerms, SimReport};
use crate::cell_grid::CellGrid;
use crate::cost::CostModel;
use crate::error::Result;
use crate::plan::{Plan, ReplicaTiming};
use crate::split::Pieces;
use crate::topology::Topology;
use crate::window::WindowView;

/// `simulate` of `plan` (validated under `Oversize::Split`) whose split samples `pieces` gives.
#[allow(clippy::too_many_arguments)]
pub(super) fn simulate_pieces(
    plan: &Plan,
    w: &WindowView,
    topo: &Topology,
    cost: &CostModel,
    ideal_micro: Option<usize>,
    token_cap: Option<i64>,
    pieces: &Pieces,
    timing: ReplicaTiming,
    detail: bool,
) -> Result<(SimReport, Option<ExchangeTerms>)> {
    let (sample_rank, sample_micro) = pieces.expand(&plan.sample_rank, &plan.sample_micro);
    let counts = pieces.counts(w)?;
    let wp = WindowView::new(&pieces.lens, &counts, w.num_layers, w.num_experts)?;
    let expanded = Plan { sample_rank, sample_micro, ..plan.clone() };
    let mut grid = CellGrid::new(&expanded.sample_rank, &expanded.sample_micro, plan.num_micro, &pieces.lens, topo);
    let cp = pieces.cp;
    for s in (0..pieces.num_samples()).filter(|&s| pieces.is_split(s)) {
        let (d, m, n) = (plan.sample_rank[s] as usize, plan.sample_micro[s] as usize, w.seq_lens[s]);
        // the group's EP-local ranks: consecutive, so on one node when its first and last are
        let first = d % topo.ep;
        let same_node = topo.local_node_of(first) == topo.local_node_of(first + cp - 1);
        let (quad, kv) = (CostModel::ring_quad(n as f64, cp), cost.ring_kv_time(n, cp, same_node));
        for j in 0..cp {
            grid.set_ring(d + j, m, quad, kv);
        }
    }
    score(&expanded, &wp, topo, cost, ideal_micro, token_cap, grid, timing, false, detail)
}
