//! Intra-batch replication (docs/design.md stage 4): per exchange (EP group, microbatch, layer), copies of hot
//! experts on other EP ranks, each computing a planned share of that expert's tokens
//! (`plan::Replica`; routed by `flow::route_expert`).
//!
//! * [`hot_n`](mod@hot_n)     MindSpeed's balanced MoE (baseline): N hot experts broadcast to every rank
//! * [`relibra`](mod@relibra)   ReLibra's intra-node replication (baseline)
//! * [`moonep`](mod@moonep)    MoonEP's exact per-microbatch balance inside an NVLink domain (baseline)
//! * [`ultraep`](mod@ultraep)   UltraEP's quota-driven exact-load balance (baseline)
//! * [`routepack`](mod@routepack) ours: replicas and shares minimising each exchange's simulated time
//! * [`exchange`]  one exchange's inputs, the parallel driver, blocks of exchanges, share rounding
//! * [`state`]     the simulator's exchange cost, updated one expert at a time
//!
//! Every planner is deterministic: exchanges are planned independently (in parallel) and their
//! replicas concatenated in exchange order. [`plan_block`] runs one of them on a [`Block`] of
//! the exchanges only (distributed planning: rank i of n plans block i, and the blocks'
//! replicas, concatenated in block order, are the full run's).

pub mod exchange;
pub mod hot_n;
pub mod live;
pub mod moonep;
pub mod relibra;
pub mod routepack;
pub mod state;
pub mod ultraep;

use crate::cost::CostModel;
use crate::error::{invalid, Result};
use crate::plan::Placement;
use crate::plan::{Replica, ReplicaTiming};
use crate::topology::Topology;
use crate::window::WindowView;

use exchange::plan_exchange_block;
pub use exchange::Block;
use state::ExchangeState;

/// The packing replication plans for: `sample_rank`, `sample_micro` `[S]`, `num_micro` M.
#[derive(Clone, Copy, Debug)]
pub struct Packed<'a> {
    /// `[S]` DP rank in `0..dp` that runs sample s (`Plan::sample_rank`).
    pub sample_rank: &'a [i32],
    /// `[S]` microbatch in `0..num_micro` of sample s on its rank (`Plan::sample_micro`).
    pub sample_micro: &'a [i32],
    /// M, the microbatches of every DP rank.
    pub num_micro: usize,
}

/// A replication planner with its options: what [`plan_block`] runs. Every budget is capped
/// by the topology's replica buffers: no rank receives copies of more than
/// `Topology::replica_slots` experts in one exchange (`hot_n` broadcasts at most that many hot
/// experts, `relibra` and `routepack` use at most that many copies a rank).
#[derive(Clone, Debug)]
pub enum Planner {
    /// MindSpeed's rule ([`hot_n`](fn@hot_n)) with this many hot experts per exchange.
    HotN(usize),
    /// ReLibra's intra-node replication ([`relibra`](fn@relibra)) with this many copies per rank.
    Relibra(usize),
    /// routepack's replication ([`routepack`](fn@routepack)).
    Routepack(routepack::Options),
    /// MoonEP's exact balance ([`moonep`](mod@moonep)) with this many prefetch buffers a rank.
    MoonEp(usize),
    /// UltraEP's quota planner ([`ultraep`](mod@ultraep)): spare slots a rank, least tokens a
    /// replica.
    UltraEp(usize, i64),
}

impl Planner {
    /// When this planner's copies move: MoonEP and UltraEP plan each exchange from the
    /// router's output ([`ReplicaTiming::AfterRouter`]), the others before the step.
    pub fn timing(&self) -> ReplicaTiming {
        match self {
            Planner::MoonEp(_) | Planner::UltraEp(..) => ReplicaTiming::AfterRouter,
            _ => ReplicaTiming::Prefetched,
        }
    }
}

/// Runs `planner` on the exchanges of `block` (see [`Block`]): the replicas the full run
/// gives those exchanges, in the same order. Placement and packing are checked whole, so
/// every block of one call fails alike. With routepack's `time_budget`, the deadline starts
/// now and applies to this block only.
pub fn plan_block(
    w: &WindowView,
    topo: &Topology,
    cost: &CostModel,
    placement: &Placement,
    packed: Packed,
    planner: &Planner,
    block: Block,
) -> Result<Vec<Replica>> {
    let Packed { sample_rank, sample_micro, num_micro } = packed;
    // every planner's own budget is capped by the ranks' replica buffers (`topo.replica_slots`)
    let buffers = topo.replica_slots;
    match planner {
        Planner::HotN(hot_experts) => {
            if *hot_experts == 0 {
                return Err(invalid("replication_hot_experts", "must be >= 1 (MindSpeed's --balanced-moe-hot-expert-num), got 0"));
            }
            // each hot expert goes to every rank: N copies on a rank
            let n = (*hot_experts).min(buffers);
            plan_exchange_block(w, topo, cost, placement, sample_rank, sample_micro, num_micro, None, block, ExchangeState::new, |c, st| {
                hot_n::plan_exchange(c, st, n)
            })
        }
        Planner::Relibra(replication_slots) => {
            let k = (*replication_slots).min(buffers);
            plan_exchange_block(w, topo, cost, placement, sample_rank, sample_micro, num_micro, None, block, ExchangeState::new, |c, st| {
                relibra::plan_exchange(c, st, k)
            })
        }
        Planner::MoonEp(want) => {
            let b = (*want).min(buffers);
            plan_exchange_block(
                w,
                topo,
                cost,
                placement,
                sample_rank,
                sample_micro,
                num_micro,
                None,
                block,
                moonep::Worker::default,
                |c, wk| moonep::plan_exchange(c, wk, b),
            )
        }
        Planner::UltraEp(redundant, min_tokens) => {
            if *min_tokens < 1 {
                return Err(invalid(
                    "replication_min_tokens",
                    format!("must be >= 1 (UltraEP's ULTRA_EP_QUOTA_MIN_TOKENS_PER_REPLICA), got {min_tokens}"),
                ));
            }
            let r = (*redundant).min(buffers);
            plan_exchange_block(
                w,
                topo,
                cost,
                placement,
                sample_rank,
                sample_micro,
                num_micro,
                None,
                block,
                ultraep::Worker::default,
                |c, wk| ultraep::plan_exchange(c, wk, r, *min_tokens),
            )
        }
        Planner::Routepack(opts) => {
            if opts.experts == 0 || opts.dsts == 0 {
                return Err(invalid(
                    "routepack replication",
                    format!("candidate experts and destinations per step must be >= 1, got {} and {}", opts.experts, opts.dsts),
                ));
            }
            let deadline = crate::budget::deadline(std::time::Instant::now(), opts.time_budget);
            let opts = &routepack::Options { replication_slots: opts.replication_slots.min(buffers), ..*opts };
            plan_exchange_block(
                w,
                topo,
                cost,
                placement,
                sample_rank,
                sample_micro,
                num_micro,
                deadline,
                block,
                routepack::Worker::default,
                |c, wk| routepack::plan_exchange(c, wk, opts),
            )
        }
    }
}

/// MindSpeed's rule with `hot_experts` (N >= 1) hot experts per exchange
/// ([`hot_n::DEFAULT_HOT_EXPERTS`] is MindSpeed's default).
pub fn hot_n(
    w: &WindowView,
    topo: &Topology,
    cost: &CostModel,
    placement: &Placement,
    packed: Packed,
    hot_experts: usize,
) -> Result<Vec<Replica>> {
    plan_block(w, topo, cost, placement, packed, &Planner::HotN(hot_experts), Block::ALL)
}

/// ReLibra's intra-node replication with at most `replication_slots` copies per rank per exchange:
/// the same budget routepack gets ([`routepack::DEFAULT_REPLICATION_SLOTS`] by default).
pub fn relibra(
    w: &WindowView,
    topo: &Topology,
    cost: &CostModel,
    placement: &Placement,
    packed: Packed,
    replication_slots: usize,
) -> Result<Vec<Replica>> {
    plan_block(w, topo, cost, placement, packed, &Planner::Relibra(replication_slots), Block::ALL)
}

/// routepack's replication (see [`routepack`](mod@routepack)); `opts.time_budget` caps its
/// wall time (exchanges planned after it get no replicas).
pub fn routepack(
    w: &WindowView,
    topo: &Topology,
    cost: &CostModel,
    placement: &Placement,
    packed: Packed,
    opts: &routepack::Options,
) -> Result<Vec<Replica>> {
    plan_block(w, topo, cost, placement, packed, &Planner::Routepack(*opts), Block::ALL)
}

#[cfg(test)]
mod test_case;
#[cfg(test)]
mod tests;
