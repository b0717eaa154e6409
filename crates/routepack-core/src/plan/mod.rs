//! The plan for one window, routepack's data model: placement ([`Placement`], in
//! `placement`), the (DP rank, microbatch) of every sample, intra-batch replicas and
//! migration moves. Field meanings follow docs/design.md's table. The stages (`crate::placement`,
//! `crate::packing`, `crate::layout`, `crate::replication`) build these types; the
//! simulator, validation, flow and migration read them; none of them owns one.

mod placement;

pub use placement::{max_replicas_of, Placement};

/// One intra-batch replica: in microbatch `micro` of EP group `group`, layer `layer`, the
/// weights of logical `expert` go from EP-local rank `src_rank` (which hosts it) to `dst_rank`,
/// which computes `share` of that expert's tokens in that exchange (see `flow`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Replica {
    /// Microbatch m in `0..num_micro` of the exchange.
    pub micro: i32,
    /// EP group g in `0..dp / ep` of the exchange.
    pub group: i32,
    /// MoE layer l in `0..L` of the exchange.
    pub layer: i32,
    /// Logical expert e in `0..E` that is copied.
    pub expert: i32,
    /// EP-local rank in `0..ep` that sends the weights; it holds a placement slot of `expert`.
    pub src_rank: i32,
    /// EP-local rank in `0..ep` that holds the temporary copy and computes its share; never
    /// `src_rank`.
    pub dst_rank: i32,
    /// Fraction in [0, 1] of the expert's tokens in this exchange (Σ over EP ranks) that the
    /// copy computes; the shares of one (exchange, expert) sum to at most 1, the rest stays on
    /// the placement slots.
    pub share: f32,
}

/// When a plan's intra-batch copies can move ([`crate::cost::CostModel::exposed_replication`]
/// prices them by it). A planner that knows every exchange's routing before the step (routing
/// replay: routepack, ReLibra, MindSpeed's rule on replayed routes) posts a layer's copies while
/// its attention runs; one that plans each exchange from the router's live output (MoonEP,
/// UltraEP) can fetch the weights only after that layer's router has run, so the forward copies
/// wait on nothing to hide behind; both return the copies' gradients during the backward pass.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ReplicaTiming {
    /// Copies planned before the step: fetched while the layer's attention runs.
    #[default]
    Prefetched,
    /// Copies planned from the router's output: fetched after the layer's router, exposed in
    /// the forward pass; their gradients still return behind the backward pass's attention.
    AfterRouter,
}

impl ReplicaTiming {
    /// `"prefetch"` or `"after_router"` (Python's `Plan.replica_timing`); another raises naming
    /// `plan.replica_timing`.
    pub fn parse(name: &str) -> crate::error::Result<Self> {
        match name {
            "prefetch" => Ok(Self::Prefetched),
            "after_router" => Ok(Self::AfterRouter),
            other => Err(crate::error::invalid("plan.replica_timing", format!("{other:?} is not one of \"prefetch\", \"after_router\""))),
        }
    }
}

/// One expert moved between windows: its weights and optimizer state go from physical slot
/// `src_slot` (on EP-local rank `src_rank`) to `dst_slot` (on `dst_rank`) in `layer`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ExpertMove {
    /// MoE layer l in `0..L`.
    pub layer: i32,
    /// Logical expert e in `0..E` that the new placement puts in `dst_slot`.
    pub expert: i32,
    /// EP-local rank of `src_slot` (`src_slot / slots_per_rank`).
    pub src_rank: i32,
    /// EP-local rank of `dst_slot` (`dst_slot / slots_per_rank`).
    pub dst_rank: i32,
    /// Physical slot in `0..num_slots` of the placement in force that holds `expert` and
    /// sends it.
    pub src_slot: i32,
    /// Physical slot in `0..num_slots` of the new placement that receives `expert`.
    pub dst_slot: i32,
    /// Bytes sent: `CostModel::expert_state_bytes` (weights plus optimizer state), or 0 when
    /// the source slot is on the destination rank (a local copy).
    pub bytes: f64,
}

/// Everything routepack decides for one window, as the trainer carries it out: where the
/// experts live, where and when each sample runs, the intra-batch replicas per exchange and
/// the expert moves from the placement in force. `validate::validate_plan` checks it.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// Stage 1: logical expert of every physical slot, per layer (the same in every EP group).
    pub placement: Placement,
    /// `[S]` DP rank that runs sample s.
    pub sample_rank: Vec<i32>,
    /// `[S]` microbatch (execution order) of sample s on its rank.
    pub sample_micro: Vec<i32>,
    /// M, the same on every DP rank.
    pub num_micro: usize,
    /// Stage 4: intra-batch replicas. Table order matters inside one (exchange, expert):
    /// `flow::route_expert` serves the copies in that order. The planners emit them grouped
    /// by exchange in exchange order (group, microbatch, layer); empty when nothing is replicated.
    pub replicas: Vec<Replica>,
    /// Expert moves that turn the placement in force into `placement`, applied in every EP
    /// group before the window runs; empty on the first window or when nothing moves.
    pub migration: Vec<ExpertMove>,
}

/// Samples of every cell (DP rank d, microbatch m), cell index d·M + m, as CSR (offsets, samples),
/// samples in ascending index inside a cell. Assumes ranks and microbatches are in range
/// (`validate` checks that first).
pub fn cell_members(sample_rank: &[i32], sample_micro: &[i32], dp: usize, num_micro: usize) -> (Vec<usize>, Vec<usize>) {
    let cells = dp * num_micro;
    let mut off = vec![0usize; cells + 1];
    for (&d, &m) in sample_rank.iter().zip(sample_micro) {
        off[d as usize * num_micro + m as usize + 1] += 1;
    }
    for c in 0..cells {
        off[c + 1] += off[c];
    }
    let mut fill = off.clone();
    let mut members = vec![0usize; sample_rank.len()];
    for (s, (&d, &m)) in sample_rank.iter().zip(sample_micro).enumerate() {
        let c = d as usize * num_micro + m as usize;
        members[fill[c]] = s;
        fill[c] += 1;
    }
    (off, members)
}

/// Replicas bucketed by exchange (EP group g, microbatch m, layer l), bucket index
/// `(g·M + m)·L + l`, table order kept inside a bucket: what the simulator prices and the
/// router routes one exchange at a time.
pub fn bucket_replicas(replicas: &[Replica], groups: usize, micro: usize, layers: usize) -> Vec<Vec<Replica>> {
    let mut b = vec![Vec::new(); groups * micro * layers];
    for r in replicas {
        b[(r.group as usize * micro + r.micro as usize) * layers + r.layer as usize].push(*r);
    }
    b
}
