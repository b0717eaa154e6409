//! The pipeline (docs/design.md, "Pipeline parallelism"): a step's time under Megatron-Core's
//! 1F1B schedule, and its interleaved form where a stage holds several model chunks.
//!
//! * **Chunks.** `pp` stages of `vpp` model chunks each: chunk `c = v·pp + s` (virtual stage
//!   v of stage s) holds consecutive MoE layers ([`Topology::chunk_bounds`]); a microbatch's
//!   forward visits chunks 0, 1, …, its backward the reverse.
//! * **Operations.** An EP group's DP ranks run each microbatch together (its exchanges wait
//!   for the slowest rank), so within one group a stage is one server. The forward of
//!   microbatch m on chunk c costs Σ over the chunk's layers of each exchange's forward-pass
//!   time ([`Pipeline::pass_times`]: the exchange's parts split by pass, `Pass::compute` and
//!   `Pass::communication` of each; the hidden all-to-all shared in proportion; the exposed
//!   replica copies on the update's forward and their gradient reduction on its backward),
//!   the backward likewise. EP groups run apart (nothing but the optimizer step joins them).
//! * **Order.** Each stage runs its operations one at a time in Megatron's order
//!   ([`stage_order`], from `megatron/core/pipeline_parallel/schedules.py`): warm-up
//!   forwards (`pp − s − 1` plain; `2·(pp − s − 1) + (vpp − 1)·pp` interleaved, at most all),
//!   then pairs (forward `k + warm-up`, backward `k`), then the cool-down backwards; virtual
//!   microbatch k is the k-th entry of Megatron's schedule table (groups of pp microbatches
//!   through every chunk), a backward visiting the chunks in reverse.
//! * **Dependencies.** An operation starts when its stage is free and its input has arrived:
//!   the forward of (m, c) after the forward of (m, c − 1) plus one point-to-point send of the
//!   microbatch's activations, the backward of (m, c) after the backward of (m, c + 1) plus one
//!   send of their gradients, the last chunk's backward after its own forward (the loss). A
//!   send moves `token_bytes` per token of the rank's microbatch from DP rank d of one stage to
//!   DP rank d of the next (global ranks `s·dp + d`), over the intra-node link when both are on
//!   one node, else the inter-node one; a group's send takes its slowest rank's time. A send
//!   delays only the receiving operation (it runs beside computation, as Megatron's batched
//!   isend/irecv do when the receiver is ready).
//! * **Passes.** [`runs_of`]: each backward pass pairs with the latest forward before it into
//!   one 1F1B run; a forward left unpaired (RL's recompute of log-probabilities) is a
//!   forward-only run (Megatron's `forward_only`: every forward in table order); a backward
//!   left unpaired a backward-only run. Runs follow one another (the pipeline drains between
//!   them); the group's time is the sum of their makespans.
//!
//! The step is the slowest group's pipeline time plus the exposed migration and the redundant
//! experts' gradient sum, each taken per stage (a stage moves and sums its own layers' experts
//! on its own ranks, at the same time as the other stages) and the slowest stage's counted.
//! `SimReport::pipeline_bubble` is that group's pipeline time less its busiest stage's work.
//! `tests/pipeline_reference.py` re-implements the schedule from Megatron's own functions as
//! an event loop; `tests/test_pipeline.py` checks the two agree.

use crate::cell_grid::CellGrid;
use crate::cost::links::LinkBytes;
use crate::cost::{CostModel, LayerCost, Pass};
use crate::error::{invalid, Result};
use crate::plan::Plan;
use crate::topology::Topology;

/// What a run of the pipeline executes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunKind {
    /// Forward and backward of every microbatch, 1F1B (interleaved where vpp > 1).
    OneFOneB,
    /// Forwards only, in schedule-table order (Megatron's `forward_only`).
    Forward,
    /// Backwards only, in schedule-table order.
    Backward,
}

/// One run of the pipeline: its kind and the passes (indices into `CostModel::passes`) whose
/// times its forward and backward operations take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    /// What the run executes.
    pub kind: RunKind,
    /// The forward pass its forwards price.
    pub forward: Option<usize>,
    /// The backward pass its backwards price.
    pub backward: Option<usize>,
}

/// The runs of a step's passes (see the module docs), in the order of their first pass.
pub fn runs_of(passes: &[Pass]) -> Vec<Run> {
    let mut open: Vec<usize> = Vec::new();
    let mut runs: Vec<(usize, Run)> = Vec::new();
    for (i, p) in passes.iter().enumerate() {
        match p {
            Pass::Forward => open.push(i),
            Pass::Backward => match open.pop() {
                Some(f) => runs.push((f, Run { kind: RunKind::OneFOneB, forward: Some(f), backward: Some(i) })),
                None => runs.push((i, Run { kind: RunKind::Backward, forward: None, backward: Some(i) })),
            },
        }
    }
    runs.extend(open.into_iter().map(|f| (f, Run { kind: RunKind::Forward, forward: Some(f), backward: None })));
    runs.sort_by_key(|&(first, _)| first);
    runs.into_iter().map(|(_, r)| r).collect()
}

/// One operation of a stage: a forward or backward of microbatch `micro` on the stage's
/// model chunk `local` (its virtual stage; global chunk `local·pp + stage`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Op {
    /// A backward (else a forward).
    pub backward: bool,
    /// The microbatch.
    pub micro: usize,
    /// The stage's model chunk (virtual stage), 0..vpp.
    pub local: usize,
}

/// Megatron's schedule table: the (microbatch, model chunk) of every virtual microbatch, in
/// groups of `group` microbatches that visit every chunk before the next group (the last group
/// takes the rest); plain 1F1B (one chunk) is the microbatches in order.
pub fn schedule_table(micro: usize, vpp: usize, group: usize) -> Vec<(usize, usize)> {
    let mut table = Vec::with_capacity(micro * vpp);
    let mut lo = 0;
    while lo < micro {
        let hi = if lo + group >= micro { micro } else { lo + group };
        for v in 0..vpp {
            table.extend((lo..hi).map(|m| (m, v)));
        }
        lo = hi;
    }
    table
}

/// Stage `stage`'s operations in Megatron's order for a run of `kind` (see the module docs).
pub fn stage_order(pp: usize, vpp: usize, micro: usize, stage: usize, kind: RunKind) -> Vec<Op> {
    let table = schedule_table(micro, vpp, pp.max(1));
    let total = table.len();
    let fwd = |k: usize| Op { backward: false, micro: table[k].0, local: table[k].1 };
    let bwd = |k: usize| Op { backward: true, micro: table[k].0, local: vpp - 1 - table[k].1 };
    match kind {
        RunKind::Forward => (0..total).map(fwd).collect(),
        RunKind::Backward => (0..total).map(bwd).collect(),
        RunKind::OneFOneB => {
            let warmup = if vpp > 1 { 2 * (pp - stage - 1) + (vpp - 1) * pp } else { pp - stage - 1 }.min(total);
            let steady = total - warmup;
            let mut ops: Vec<Op> = (0..warmup).map(fwd).collect();
            for k in 0..steady {
                ops.push(fwd(warmup + k));
                ops.push(bwd(k));
            }
            ops.extend((steady..total).map(bwd));
            ops
        }
    }
}

/// Seconds of one group's operations: `fwd`, `bwd` `[M · chunks]` of each (microbatch, model
/// chunk), `p2p` `[M · (chunks − 1)]` of one send across the boundary after chunk c.
pub struct OpTimes<'a> {
    /// Forward seconds, index m·chunks + c.
    pub fwd: &'a [f64],
    /// Backward seconds, index m·chunks + c.
    pub bwd: &'a [f64],
    /// Send seconds, index m·(chunks − 1) + c.
    pub p2p: &'a [f64],
}

/// The makespan of one run (seconds from its first operation's start to its last one's end),
/// adding each stage's work to `busy` `[pp]`. Each stage runs its operations in order, each as
/// soon as the stage is free and its input has arrived (the module docs' rules).
pub fn run_makespan(pp: usize, vpp: usize, micro: usize, kind: RunKind, t: &OpTimes, busy: &mut [f64]) -> Result<f64> {
    let chunks = pp * vpp;
    assert!(t.fwd.len() == micro * chunks && t.bwd.len() == micro * chunks, "op times must be [M * chunks]");
    assert!(t.p2p.len() == micro * chunks.saturating_sub(1), "sends must be [M * (chunks - 1)]");
    let orders: Vec<Vec<Op>> = (0..pp).map(|s| stage_order(pp, vpp, micro, s, kind)).collect();
    let (mut done_f, mut done_b) = (vec![f64::NAN; micro * chunks], vec![f64::NAN; micro * chunks]);
    let mut free = vec![0.0f64; pp];
    let mut next = vec![0usize; pp];
    let send = |m: usize, c: usize| t.p2p[m * (chunks - 1) + c];
    loop {
        let mut moved = false;
        for s in 0..pp {
            while let Some(op) = orders[s].get(next[s]) {
                let c = op.local * pp + s;
                let i = op.micro * chunks + c;
                // when the input is there (None: not yet)
                let ready = match (op.backward, kind) {
                    (false, _) if c == 0 => Some(0.0),
                    (false, _) => Some(done_f[i - 1] + send(op.micro, c - 1)),
                    (true, RunKind::OneFOneB) if c == chunks - 1 => Some(done_f[i]),
                    (true, _) if c == chunks - 1 => Some(0.0),
                    (true, _) => Some(done_b[i + 1] + send(op.micro, c)),
                }
                .filter(|x| !x.is_nan());
                let Some(ready) = ready else { break };
                let dur = if op.backward { t.bwd[i] } else { t.fwd[i] };
                let end = free[s].max(ready) + dur;
                if op.backward {
                    done_b[i] = end;
                } else {
                    done_f[i] = end;
                }
                free[s] = end;
                busy[s] += dur;
                next[s] += 1;
                moved = true;
            }
        }
        if (0..pp).all(|s| next[s] == orders[s].len()) {
            return Ok(free.iter().copied().fold(0.0, f64::max));
        }
        if !moved {
            // Megatron's orders never wait on each other where its rules hold (validation
            // enforces them on plans); an order that does cannot run
            return Err(invalid(
                "num_micro",
                format!("{micro} microbatches deadlock the {kind:?} schedule of pp = {pp}, vpp = {vpp} (Megatron refuses such counts)"),
            ));
        }
    }
}

/// A pipeline over a model's MoE layers: its chunks, the runs of the cost model's passes and
/// where the exposed replication is charged.
#[derive(Clone, Debug)]
pub struct Pipeline {
    /// Stages.
    pub pp: usize,
    /// Model chunks per stage.
    pub vpp: usize,
    /// `[L]` model chunk of each layer.
    pub chunk_of_layer: Vec<usize>,
    /// The runs of the step's passes.
    pub runs: Vec<Run>,
    /// The pass whose time carries the exposed forward replica copies: the update's forward
    /// (paired with the first backward), else the first forward, else the first pass.
    rep_forward: usize,
    /// The pass whose time carries the exposed gradient reduction: the first backward, else
    /// the last pass.
    rep_backward: usize,
}

impl Pipeline {
    /// The pipeline of `topo` over `num_layers` MoE layers priced by `cost` (its chunks from
    /// [`Topology::chunk_bounds`], whose errors it returns).
    pub fn new(topo: &Topology, cost: &CostModel, num_layers: usize) -> Result<Self> {
        let bounds = topo.chunk_bounds(num_layers)?;
        let mut chunk_of_layer = vec![0; num_layers];
        for c in 0..topo.num_chunks() {
            chunk_of_layer[bounds[c]..bounds[c + 1]].iter_mut().for_each(|x| *x = c);
        }
        let runs = runs_of(&cost.passes);
        let first_backward = cost.passes.iter().position(|p| *p == Pass::Backward);
        let paired = runs.iter().find(|r| r.kind == RunKind::OneFOneB && r.backward == first_backward).and_then(|r| r.forward);
        let rep_forward = paired.or_else(|| cost.passes.iter().position(|p| *p == Pass::Forward)).unwrap_or(0);
        let rep_backward = first_backward.unwrap_or(cost.passes.len() - 1);
        Ok(Self { pp: topo.pp, vpp: topo.vpp, chunk_of_layer, runs, rep_forward, rep_backward })
    }

    /// Model chunks: pp · vpp.
    #[inline]
    pub fn chunks(&self) -> usize {
        self.pp * self.vpp
    }

    /// The stage holding layer `l`.
    #[inline]
    pub fn stage_of_layer(&self, l: usize) -> usize {
        self.chunk_of_layer[l] % self.pp
    }

    /// One exchange's seconds in each pass of `cost.passes`: its compute (attention + expert,
    /// all passes) and all-to-all split by each pass's multipliers, less its share of the
    /// hidden all-to-all (in proportion), plus the exposed replication `rep = (forward copies,
    /// backward reduction)` on the passes that carry it. They add up to `lc.total()` but for
    /// rounding.
    pub fn pass_times(&self, cost: &CostModel, lc: &LayerCost, rep: (f64, f64), out: &mut Vec<f64>) {
        let (cp, kp) = (cost.compute_passes(), cost.comm_passes());
        let compute = lc.attention + lc.expert;
        let whole = compute + lc.all_to_all;
        let kept = if lc.hidden > 0.0 && whole > 0.0 { 1.0 - lc.hidden / whole } else { 1.0 };
        out.clear();
        for (i, p) in cost.passes.iter().enumerate() {
            let own = compute * p.compute() / cp + lc.all_to_all * p.communication() / kp;
            let mut t = if kept < 1.0 { own * kept } else { own };
            if i == self.rep_forward {
                t += rep.0;
            }
            if i == self.rep_backward {
                t += rep.1;
            }
            out.push(t);
        }
    }

    /// One EP group's pipeline time and each stage's work `[pp]`: `pass_time(m, l, p)` the
    /// seconds of exchange (m, l) in pass p, `p2p` `[M · (chunks − 1)]` the sends.
    pub fn group_time(&self, micro: usize, pass_time: impl Fn(usize, usize, usize) -> f64, p2p: &[f64]) -> Result<(f64, Vec<f64>)> {
        let chunks = self.chunks();
        let mut busy = vec![0.0; self.pp];
        let mut total = 0.0;
        let (mut fwd, mut bwd) = (vec![0.0; micro * chunks], vec![0.0; micro * chunks]);
        for run in &self.runs {
            for (slot, pass) in [(&mut fwd, run.forward), (&mut bwd, run.backward)] {
                slot.iter_mut().for_each(|x| *x = 0.0);
                if let Some(p) = pass {
                    for m in 0..micro {
                        // layers in order: each chunk's sum in a fixed order
                        for (l, &c) in self.chunk_of_layer.iter().enumerate() {
                            slot[m * chunks + c] += pass_time(m, l, p);
                        }
                    }
                }
            }
            let t = OpTimes { fwd: &fwd, bwd: &bwd, p2p };
            total += run_makespan(self.pp, self.vpp, micro, run.kind, &t, &mut busy)?;
        }
        Ok((total, busy))
    }

    /// `[M · (chunks − 1)]` seconds of group g's send across each chunk boundary: the slowest
    /// rank's microbatch tokens × `token_bytes` over the link between its two stages' ranks.
    pub fn sends(&self, grid: &CellGrid, topo: &Topology, cost: &CostModel, g: usize) -> Vec<f64> {
        let chunks = self.chunks();
        let m_n = grid.num_micro;
        let mut out = vec![0.0; m_n * chunks.saturating_sub(1)];
        for c in 0..chunks.saturating_sub(1) {
            let (s0, s1) = (c % self.pp, (c + 1) % self.pp);
            for r in 0..topo.ep {
                let d = g * topo.ep + r;
                let same = topo.node_of(s0 * topo.dp + d) == topo.node_of(s1 * topo.dp + d);
                for m in 0..m_n {
                    let t = cost.link_time(grid.tokens(d, m) * cost.token_bytes, same);
                    let x: &mut f64 = &mut out[m * (chunks - 1) + c];
                    *x = x.max(t);
                }
            }
        }
        out
    }

    /// Seconds of exposed migration: each stage moves its own layers' experts on its own ranks
    /// (per EP rank max(sent, received) per link, as [`super::migration_time`]), all at once;
    /// the slowest stage's.
    pub fn migration_time(&self, plan: &Plan, topo: &Topology, cost: &CostModel) -> f64 {
        let mut links = vec![vec![LinkBytes::default(); topo.ep]; self.pp];
        for mv in &plan.migration {
            LinkBytes::add_move(&mut links[self.stage_of_layer(mv.layer as usize)], mv, topo, cost);
        }
        links.iter().map(|l| cost.migration_time(l)).fold(0.0, f64::max)
    }

    /// Seconds of the redundant experts' gradient sum ([`super::redundant_grad_time`]), each
    /// stage summing its own layers' at the same time: the slowest stage's.
    pub fn redundant_grad_time(&self, plan: &Plan, topo: &Topology, cost: &CostModel) -> f64 {
        let e_n = plan.placement.num_experts.max(1);
        // per stage: redundant experts, and layers holding one (one all-reduce each)
        let mut per_stage = vec![(0usize, 0usize); self.pp];
        for (l, layer) in plan.placement.logcnt().chunks(e_n).enumerate() {
            let n = layer.iter().filter(|&&c| c > 1).count();
            let st = &mut per_stage[self.stage_of_layer(l)];
            st.0 += n;
            st.1 += usize::from(n > 0);
        }
        per_stage.iter().map(|&(n, layers)| cost.redundant_grad_time(n as f64, layers as f64, topo)).fold(0.0, f64::max)
    }
}

/// What the simulator reports of a pipelined step: every group's pipeline time, the slowest
/// group, its parts (those of its busiest stage: they add up to that stage's work), the bubble
/// and the per-stage migration and gradient sum.
pub(super) struct Pipelined {
    pub group_times: Vec<f64>,
    pub critical: usize,
    pub parts: LayerCost,
    pub bubble: f64,
    pub migration: f64,
    pub redundant_grads: f64,
}

/// Scores a plan's exchanges `exchange(g, m, l) -> (cost, (exposed forward copies, exposed
/// gradient reduction))` under `topo`'s pipeline.
pub(super) fn score(
    plan: &Plan,
    grid: &CellGrid,
    topo: &Topology,
    cost: &CostModel,
    num_layers: usize,
    exchange: impl Fn(usize, usize, usize) -> (LayerCost, (f64, f64)),
) -> Result<Pipelined> {
    let pipe = Pipeline::new(topo, cost, num_layers)?;
    let (g_n, m_n, l_n) = (topo.num_groups(), plan.num_micro, num_layers);
    let p_n = cost.passes.len();
    let mut group_times = vec![0.0; g_n];
    let mut busiest = vec![(0usize, 0.0f64); g_n];
    let mut times = vec![0.0; m_n * l_n * p_n];
    let mut buf = Vec::with_capacity(p_n);
    for g in 0..g_n {
        for m in 0..m_n {
            for l in 0..l_n {
                let (lc, rep) = exchange(g, m, l);
                pipe.pass_times(cost, &lc, rep, &mut buf);
                times[(m * l_n + l) * p_n..(m * l_n + l + 1) * p_n].copy_from_slice(&buf);
            }
        }
        let sends = pipe.sends(grid, topo, cost, g);
        let (t, busy) = pipe.group_time(m_n, |m, l, p| times[(m * l_n + l) * p_n + p], &sends)?;
        group_times[g] = t;
        busiest[g] = (0..pipe.pp).fold((0, busy[0]), |b, s| if busy[s] > b.1 { (s, busy[s]) } else { b });
    }
    let critical = (0..g_n).fold(0, |b, g| if group_times[g] > group_times[b] { g } else { b });
    let (stage, work) = busiest[critical];
    let mut parts = LayerCost::default();
    for m in 0..m_n {
        for l in (0..l_n).filter(|&l| pipe.stage_of_layer(l) == stage) {
            let (lc, _) = exchange(critical, m, l);
            parts.attention += lc.attention;
            parts.all_to_all += lc.all_to_all;
            parts.expert += lc.expert;
            parts.replication += lc.replication;
            parts.hidden += lc.hidden;
        }
    }
    Ok(Pipelined {
        bubble: (group_times[critical] - work).max(0.0),
        group_times,
        critical,
        parts,
        migration: pipe.migration_time(plan, topo, cost),
        redundant_grads: pipe.redundant_grad_time(plan, topo, cost),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn makespan(pp: usize, vpp: usize, m: usize, tf: f64, tb: f64, kind: RunKind) -> f64 {
        let c = pp * vpp;
        let (f, b, p) = (vec![tf; m * c], vec![tb; m * c], vec![0.0; m * (c - 1)]);
        let mut busy = vec![0.0; pp];
        run_makespan(pp, vpp, m, kind, &OpTimes { fwd: &f, bwd: &b, p2p: &p }, &mut busy).unwrap()
    }

    #[test]
    fn one_f_one_b_has_the_textbook_bubble() {
        // (M + pp - 1)·(tf + tb) for equal stages
        for (pp, m) in [(2, 4), (4, 4), (4, 8), (3, 7)] {
            assert_eq!(makespan(pp, 1, m, 1.0, 2.0, RunKind::OneFOneB), ((m + pp - 1) * 3) as f64, "pp {pp} M {m}");
        }
        // a forward-only run is a flow shop: (M + pp - 1)·tf
        assert_eq!(makespan(4, 1, 6, 1.0, 2.0, RunKind::Forward), 9.0);
    }

    #[test]
    fn interleaving_shrinks_the_bubble_by_vpp() {
        // per chunk tf/vpp, tb/vpp: bubble (pp - 1)·(tf + tb)/vpp
        let (pp, m) = (4, 8);
        let plain = makespan(pp, 1, m, 2.0, 4.0, RunKind::OneFOneB);
        let inter = makespan(pp, 2, m, 1.0, 2.0, RunKind::OneFOneB);
        assert_eq!(plain, (m + pp - 1) as f64 * 6.0);
        assert_eq!(inter, m as f64 * 6.0 + (pp - 1) as f64 * 3.0);
    }

    #[test]
    fn runs_pair_each_backward_with_the_latest_forward() {
        use Pass::{Backward as B, Forward as F};
        let kinds = |p: &[Pass]| runs_of(p).iter().map(|r| (r.kind, r.forward, r.backward)).collect::<Vec<_>>();
        assert_eq!(kinds(&[F, B]), vec![(RunKind::OneFOneB, Some(0), Some(1))]);
        assert_eq!(kinds(&[F, F, B]), vec![(RunKind::Forward, Some(0), None), (RunKind::OneFOneB, Some(1), Some(2))]);
        assert_eq!(kinds(&[B, F]), vec![(RunKind::Backward, None, Some(0)), (RunKind::Forward, Some(1), None)]);
    }

    #[test]
    fn the_table_matches_megatrons_example() {
        // schedules.py's comment: PP2, N3, M5, VP2 → microbatches 0 1 2 0 1 2 3 4 3 4
        let t = schedule_table(5, 2, 3);
        assert_eq!(t.iter().map(|x| x.0).collect::<Vec<_>>(), vec![0, 1, 2, 0, 1, 2, 3, 4, 3, 4]);
        assert_eq!(t.iter().map(|x| x.1).collect::<Vec<_>>(), vec![0, 0, 0, 1, 1, 1, 0, 0, 1, 1]);
    }
}
