//! The simulator: docs/design.md's cost model, the one scale every plan and baseline is scored on.
//!
//! For each exchange (EP group g, microbatch m, MoE layer l):
//! * attention of DP rank d: `A = Σ_{s∈cell(d,m)} a_lin·n_s + a_quad_l·n_s²`;
//! * tokens of logical expert e from EP-local rank r, routed by [`crate::flow::route_expert`]
//!   to replica copies, then to placement slots (each slot's load that of an even split, fed
//!   from its own rank, then its node, then the other nodes);
//! * expert work of EP rank p:
//!   `X = Σ_{e active on p} c_exp + max(c_tok·t(p, e), c_weights) + c_gemm·[t(p, e) ≥ 2]`
//!   (`CostModel::weights_bound_extra`), which is `c_tok·tokens(p) + c_exp·active_experts(p)`
//!   for the linear model (`c_weights = c_gemm = 0`)
//!   (active = distinct logical experts with tokens on p);
//! * all-to-all: per rank, max(sent, received) routed tokens × token_bytes over each link
//!   (intra-/inter-node); the slowest rank sets the time; dispatch + combine;
//! * replication: each replicated (expert, src) is a chain broadcast src → dsts (same node
//!   first, then ascending rank) of the weights in forward and a chain reduce of fp32
//!   gradients in backward; per rank max(sent, received) per link; what exceeds that layer's
//!   attention (forward: 1×, backward: 2×) is exposed;
//! * `T = 3·max_d A + 2·2·a2a + 3·max_p X + exposed replication` for the default step (its
//!   passes' multipliers `CostModel::compute_passes`, `CostModel::comm_passes` in place of 3
//!   and 2); under `Overlap::DispatchCombine` the all-to-all hides behind the compute:
//!   `T = max(3·max_d A + 3·max_p X, 2·2·a2a) + exposed replication`.
//!
//! Alongside the time it counts the routed-token bytes of every exchange's all-to-all (the
//! ones its `a2a` term prices), split by link: `intra_node_bytes` and `cross_node_bytes`.
//!
//! Step time = max_g Σ_m Σ_l T + exposed migration (per rank max(sent, received) bytes of
//! moved experts over each link) + the once-per-step sum of redundant experts' gradients over
//! the EP group ([`redundant_grad_time`]). `ideal` replaces every max by the mean at the lower-bound
//! microbatch count, with uniform all-to-all and no replication or migration: the *balanced*
//! reference, not a bound (a plan that keeps tokens inside their node beats it).
//! `lower_bound_time` is the true bound ([`crate::bound`]): no valid plan scores below it.

use rayon::prelude::*;

use crate::bound::{lower_bound_of_sums, BoundTops, DemandSums};
use crate::cell_grid::CellGrid;
use crate::cost::links::LinkBytes;
use crate::cost::CostModel;
use crate::error::Result;
use crate::flow::{route_expert, Dest};
use crate::plan::{bucket_replicas, Plan, Replica, ReplicaTiming};
use crate::topology::Topology;
use crate::window::WindowView;

mod bytes;
mod entry;
mod ideal;
pub mod pipeline;
mod split;
mod terms;

pub use entry::{simulate, simulate_in, simulate_request, simulate_terms, Scoring};
pub use terms::ExchangeTerms;

pub use ideal::ideal_time;
use ideal::ideal_time_of;

/// What a plan costs on a window. Times in seconds.
#[derive(Clone, Debug, PartialEq)]
pub struct SimReport {
    /// Seconds of one training step under the plan: the slowest group's Σ_m Σ_l T plus the
    /// exposed migration.
    pub step_time: f64,
    /// Seconds of the *balanced* reference ([`ideal_time`]): every max replaced by the mean,
    /// uniform all-to-all, no replication or migration. Not a bound: a plan that keeps tokens
    /// inside their node can beat it.
    pub ideal_time: f64,
    /// [`crate::bound::lower_bound_time`] for the window, topology, cost and the cap (see
    /// [`Scoring::token_cap`]): no valid plan's `step_time` is below it.
    pub lower_bound_time: f64,
    /// Tokens per second: Σ n_s of the window / `step_time`; `+inf` for a step of 0 s (a
    /// window with none of the work the cost model prices), never NaN (Σ n_s >= 1).
    pub throughput: f64,
    /// Tokens per second of the balanced reference: Σ n_s / `ideal_time` (`+inf` for 0 s).
    pub ideal_throughput: f64,
    /// Seconds of attention/dense work in the slowest group, all passes (the slowest rank of
    /// each exchange). This, the next four and `redundant_grads` are the parts of `step_time`: they add up to it.
    pub attention: f64,
    /// Seconds of expert compute in the slowest group, all passes (the busiest EP rank of
    /// each exchange).
    pub expert: f64,
    /// Seconds of dispatch + combine all-to-all in the slowest group, all passes, hidden or not.
    pub all_to_all: f64,
    /// Seconds of that all-to-all hidden behind computation (0 without overlap): the parts
    /// add up to `step_time` with this one subtracted.
    pub hidden: f64,
    /// Seconds of intra-batch replication in the slowest group that attention does not hide.
    pub replication: f64,
    /// Seconds of exposed migration ([`migration_time`]); every group moves its experts at
    /// the same time, so it is added once.
    pub migration: f64,
    /// Seconds of the once-per-step sum of redundant experts' gradients over the EP group
    /// ([`redundant_grad_time`]); every group sums its own at the same time, so it is added once.
    pub redundant_grads: f64,
    /// Seconds of the slowest group's pipeline time in which its busiest stage waits (warm-up
    /// and cool-down, sends between stages, stages waiting on each other): 0 without a pipeline
    /// (`Topology::pp` = 1). With one, `step_time` is the busiest stage's parts (`attention` …
    /// `replication`, less `hidden`) plus this, `migration` and `redundant_grads`
    /// ([`pipeline`]).
    pub pipeline_bubble: f64,
    /// Index in `0..G` of the slowest EP group (the first one on ties): the group whose time
    /// is `step_time`.
    pub critical_group: usize,
    /// `[G]` Σ_m Σ_l T of each group.
    pub group_times: Vec<f64>,
    /// `[G, M, L]` max / mean over EP ranks of expert tokens.
    pub imbalance: Vec<f64>,
    /// Mean of `imbalance` over every exchange (1.0: perfectly balanced).
    pub mean_imbalance: f64,
    /// Routed-token bytes the all-to-all moves between EP ranks of the same node, over the whole
    /// window (every EP group, microbatch and MoE layer), counted as the cost model counts them: a
    /// token computed on a rank other than its origin moves `token_bytes` in dispatch and again
    /// in combine, in the forward and in the backward pass (4 × its dispatch bytes,
    /// [`CostModel::all_to_all_bytes`]); a token computed on its origin rank moves nothing.
    /// Replica weights and gradients and migration are not counted (they are not tokens).
    pub intra_node_bytes: f64,
    /// The same for tokens whose origin and computing rank are on different nodes (zero when an
    /// EP group fits in one node).
    pub cross_node_bytes: f64,
    /// `cross_node_bytes` per token of the window (Σ n_s over its samples).
    pub cross_node_bytes_per_token: f64,
}

/// An exchange's cost split into its parts: moved to [`crate::cost`], the one place the cost
/// terms are combined; kept here under its old path.
pub use crate::cost::LayerCost;

/// Scratch buffers for one worker, reused across exchanges.
struct Scratch {
    column: Vec<i64>,    // [ep]
    rem: Vec<i64>,       // [ep]
    tokens: Vec<i64>,    // [ep] tokens per destination rank
    active: Vec<u32>,    // [ep]
    extra: Vec<f64>,     // [ep] roofline extra of the rank's active experts
    etok: Vec<i64>,      // [ep] tokens of the expert being routed, per rank
    touched: Vec<usize>, // ranks with tokens of the expert being routed
    a2a: Vec<LinkBytes>,
    repl_fwd: Vec<LinkBytes>,
    repl_bwd: Vec<LinkBytes>,
    rep_args: Vec<(usize, f32)>,
    rep_order: Vec<usize>, // the exchange's replicas, stably sorted by expert
    node: Vec<usize>,      // [ep] node of each EP-local rank
    rep_parts: (f64, f64), // the last exchange's exposed replication: (forward copies, gradient reduction)
    timing: ReplicaTiming, // when the plan's copies move
    rank_x: Vec<f64>,      // [ep] the last exchange's one-pass expert time X of each rank
}

impl Scratch {
    fn new(ep: usize) -> Self {
        Self {
            column: vec![0; ep],
            rem: Vec::with_capacity(ep),
            tokens: vec![0; ep],
            active: vec![0; ep],
            extra: vec![0.0; ep],
            etok: vec![0; ep],
            touched: Vec::with_capacity(ep),
            a2a: vec![LinkBytes::default(); ep],
            repl_fwd: vec![LinkBytes::default(); ep],
            repl_bwd: vec![LinkBytes::default(); ep],
            rep_args: Vec::new(),
            rep_order: Vec::new(),
            node: Vec::with_capacity(ep),
            rep_parts: (0.0, 0.0),
            timing: ReplicaTiming::Prefetched,
            rank_x: vec![0.0; ep],
        }
    }
}

/// Prices single exchanges (EP group, microbatch, layer) exactly as [`simulate`] does; what
/// per-exchange planners (replication) use to compare their choices on the simulator's own scale.
/// Holds scratch buffers: make one per worker thread and reuse it.
pub struct ExchangePricer {
    sc: Scratch,
    ep: usize,
    num_experts: usize,
}

impl ExchangePricer {
    /// A pricer for exchanges of `ep` EP ranks and `num_experts` logical experts (its
    /// scratch is sized for them; [`ExchangePricer::price`] panics on another shape).
    pub fn new(ep: usize, num_experts: usize) -> Self {
        Self { sc: Scratch::new(ep), ep, num_experts }
    }

    /// This pricer for a plan whose copies move as `timing` says (the plan's
    /// `replica_timing`); [`ReplicaTiming::Prefetched`] unless set.
    pub fn with_timing(mut self, timing: ReplicaTiming) -> Self {
        self.sc.timing = timing;
        self
    }

    /// Cost of one exchange.
    /// * `origin`   `[ep * E]` rank-major: tokens for expert e sent by EP-local rank r
    ///   (see [`crate::cell_grid::CellGrid::origin`]);
    /// * `attn_max` the slowest rank's one-pass attention time in this exchange;
    /// * `slot_off`, `slots` the layer's placement as CSR (`Placement::replicas_of_layer`);
    /// * `reps`     this exchange's replicas, table order (their micro/group/layer are not read).
    #[allow(clippy::too_many_arguments)]
    pub fn price(
        &mut self,
        topo: &Topology,
        cost: &CostModel,
        origin: &[i64],
        attn_max: f64,
        slot_off: &[usize],
        slots: &[usize],
        reps: &[Replica],
    ) -> LayerCost {
        assert_eq!(topo.ep, self.ep, "ExchangePricer built for another ep");
        assert_eq!(origin.len(), self.ep * self.num_experts, "origin must be [ep * E]");
        price_exchange(topo, cost, self.num_experts, origin, attn_max, slot_off, slots, reps, &mut self.sc)
    }

    /// Dispatch bytes of the exchange priced last, summed over its ranks: `(inside nodes,
    /// between nodes)`, one way (see [`CostModel::all_to_all_bytes`] for the whole count).
    pub fn dispatch_bytes(&self) -> (f64, f64) {
        LinkBytes::sent_totals(&self.sc.a2a)
    }

    /// The exposed replication of the exchange priced last, split: (forward weight copies not
    /// hidden by one attention pass, backward gradient reduction not hidden by two); their sum
    /// is its `LayerCost::replication` but for rounding. The pipeline charges them to the
    /// update's forward and backward.
    pub fn replication_parts(&self) -> (f64, f64) {
        self.sc.rep_parts
    }

    /// `[ep]` one-pass expert time X of each EP rank in the exchange priced last
    /// ([`CostModel::rank_expert_time`]: the slowest is its `LayerCost::expert` over the passes).
    pub fn rank_expert(&self) -> &[f64] {
        &self.sc.rank_x
    }
}

/// See [`ExchangePricer::price`].
#[allow(clippy::too_many_arguments)]
fn price_exchange(
    topo: &Topology,
    cost: &CostModel,
    e_n: usize,
    origin: &[i64],
    attn_max: f64,
    slot_off: &[usize],
    slots: &[usize],
    reps: &[Replica],
    sc: &mut Scratch,
) -> LayerCost {
    let ep = topo.ep;
    sc.tokens.iter_mut().for_each(|x| *x = 0);
    sc.active.iter_mut().for_each(|x| *x = 0);
    sc.extra.iter_mut().for_each(|x| *x = 0.0);
    let roofline = cost.roofline();
    sc.a2a.iter_mut().for_each(|x| *x = LinkBytes::default());
    // each rank's node, once (not a division per routed batch)
    sc.node.clear();
    sc.node.extend((0..ep).map(|r| topo.local_node_of(r)));
    // the exchange's replicas by expert, each expert's in table order
    sc.rep_order.clear();
    sc.rep_order.extend(0..reps.len());
    // (as usize, as the match below reads it: an expert outside 0..E is never routed, as before)
    sc.rep_order.sort_by_key(|&i| reps[i].expert as usize);
    let mut next_rep = 0;
    for e in 0..e_n {
        for r in 0..ep {
            sc.column[r] = origin[r * e_n + e];
        }
        sc.rep_args.clear();
        while next_rep < sc.rep_order.len() && reps[sc.rep_order[next_rep]].expert as usize == e {
            let x = &reps[sc.rep_order[next_rep]];
            sc.rep_args.push((x.dst_rank as usize, x.share));
            next_rep += 1;
        }
        let expert_slots = &slots[slot_off[e]..slot_off[e + 1]];
        let node = &sc.node;
        if expert_slots.len() == 1 && sc.rep_args.is_empty() {
            // one slot and no replica (the common case): every token goes to the slot's rank,
            // the flows `route_expert` emits, added in the same (ascending origin) order
            let p = topo.rank_of_slot(expert_slots[0]);
            let mut t = 0i64;
            for (o, &n) in sc.column.iter().enumerate() {
                if n > 0 {
                    t += n;
                    if o != p {
                        LinkBytes::add(&mut sc.a2a, o, p, n as f64 * cost.token_bytes, node[o] == node[p]);
                    }
                }
            }
            if t > 0 {
                sc.tokens[p] += t;
                sc.active[p] += 1;
                if roofline {
                    sc.extra[p] += cost.weights_bound_extra(t as f64);
                }
            }
            continue;
        }
        if sc.column.iter().all(|&x| x == 0) {
            continue;
        }
        let (tokens, active, a2a) = (&mut sc.tokens, &mut sc.active, &mut sc.a2a);
        let (etok, touched) = (&mut sc.etok, &mut sc.touched);
        route_expert(&sc.column, expert_slots, &sc.rep_args, topo, &mut sc.rem, |o, p, _d: Dest, n| {
            tokens[p] += n;
            // every flow holds n > 0 tokens: a rank with none of this expert's yet is new
            if etok[p] == 0 {
                active[p] += 1;
                touched.push(p);
            }
            etok[p] += n;
            if o != p {
                LinkBytes::add(a2a, o, p, n as f64 * cost.token_bytes, node[o] == node[p]);
            }
        });
        for &p in &sc.touched {
            if roofline {
                sc.extra[p] += cost.weights_bound_extra(sc.etok[p] as f64);
            }
            sc.etok[p] = 0;
        }
        sc.touched.clear();
    }
    // the linear model's bits stay as they were: the extra is added only with a floor
    for p in 0..ep {
        sc.rank_x[p] = cost.rank_expert_time(sc.tokens[p] as f64, sc.active[p] as f64, sc.extra[p]);
    }
    let x_max = sc.rank_x.iter().copied().fold(0.0, f64::max);
    let total: i64 = sc.tokens.iter().sum();
    let imbalance = if total > 0 { *sc.tokens.iter().max().unwrap() as f64 * ep as f64 / total as f64 } else { 1.0 };
    let a2a = cost.all_to_all_time(&sc.a2a);

    let mut replication = 0.0;
    sc.rep_parts = (0.0, 0.0);
    if !reps.is_empty() {
        sc.repl_fwd.iter_mut().for_each(|x| *x = LinkBytes::default());
        sc.repl_bwd.iter_mut().for_each(|x| *x = LinkBytes::default());
        // one chain per (expert, src): src → dsts ordered same-node-first, then by rank
        let mut keys: Vec<(i32, i32)> = reps.iter().map(|r| (r.expert, r.src_rank)).collect();
        keys.sort_unstable();
        keys.dedup();
        for (e, src) in keys {
            let src = src as usize;
            let node = topo.local_node_of(src);
            let mut dsts: Vec<usize> =
                reps.iter().filter(|r| r.expert == e && r.src_rank as usize == src).map(|r| r.dst_rank as usize).collect();
            dsts.sort_unstable_by_key(|&d| (topo.local_node_of(d) != node, d));
            dsts.dedup();
            let mut prev = src;
            for d in dsts {
                let same = topo.local_node_of(prev) == topo.local_node_of(d);
                LinkBytes::add(&mut sc.repl_fwd, prev, d, cost.expert_weight_bytes, same);
                LinkBytes::add(&mut sc.repl_bwd, d, prev, cost.expert_grad_bytes, same);
                prev = d;
            }
        }
        let fwd = LinkBytes::replica_time(&sc.repl_fwd, cost);
        let bwd = LinkBytes::replica_time(&sc.repl_bwd, cost);
        if sc.timing == ReplicaTiming::Prefetched {
            replication = cost.exposed_replication(fwd, bwd, attn_max);
            sc.rep_parts = ((fwd - attn_max).max(0.0), (bwd - 2.0 * attn_max).max(0.0));
        } else {
            sc.rep_parts = cost.exposed_replication_parts(fwd, bwd, attn_max, sc.timing);
            replication = sc.rep_parts.0 + sc.rep_parts.1;
        }
    }
    LayerCost::new(cost, attn_max, x_max, a2a, replication, imbalance)
}

/// Seconds of exposed migration ([`CostModel`]'s migration term of the bytes each EP rank
/// sends and receives: per link max(sent, received) over its bandwidth, plus staging and the
/// window's fixed cost where they are priced).
pub fn migration_time(plan: &Plan, topo: &Topology, cost: &CostModel) -> f64 {
    let mut links = vec![LinkBytes::default(); topo.ep];
    for mv in &plan.migration {
        LinkBytes::add_move(&mut links, mv, topo, cost);
    }
    cost.migration_time(&links)
}

/// Seconds of summing the gradients of every expert the placement holds in more than one
/// slot of a layer, over the EP group, once per step ([`CostModel::redundant_grad_time`] of
/// their count over all layers).
pub fn redundant_grad_time(plan: &Plan, topo: &Topology, cost: &CostModel) -> f64 {
    let counts = plan.placement.logcnt();
    let e_n = plan.placement.num_experts.max(1);
    let redundant = counts.iter().filter(|&&c| c > 1).count();
    let layers = counts.chunks(e_n).filter(|layer| layer.iter().any(|&c| c > 1)).count();
    cost.redundant_grad_time(redundant as f64, layers as f64, topo)
}

/// Moved to [`crate::bound`], which the bound needs it for; kept here under its old path.
pub use crate::bound::lower_bound_micro;

/// [`simulate_in`] of a validated plan, whose cells `grid` holds.
#[allow(clippy::too_many_arguments)]
fn score(
    plan: &Plan,
    w: &WindowView,
    topo: &Topology,
    cost: &CostModel,
    ideal_micro: Option<usize>,
    token_cap: Option<i64>,
    grid: CellGrid,
    timing: ReplicaTiming,
    step_only: bool,
    detail: bool,
) -> Result<(SimReport, Option<ExchangeTerms>)> {
    // the entry checked the cost model and topology, and the plan is valid, so its largest
    // row has a token and the bound's cap is >= 1
    let bound_cap = token_cap.map(|cap| cap.max(largest_row(plan, w, topo)));
    debug_assert!(bound_cap.is_none_or(|c| c >= 1));
    let (g_n, m_n, l_n, ep, e_n) = (topo.num_groups(), plan.num_micro, w.num_layers, topo.ep, w.num_experts);
    let what = format!("simulating {g_n} x {m_n} exchanges (groups x microbatches) of [L, E] = [{l_n}, {e_n}]");
    crate::sizes::check_call("window", &what, bytes::simulate_bytes(w.num_samples, topo, m_n, l_n, e_n))?;
    let reps = bucket_replicas(&plan.replicas, g_n, m_n, l_n);
    let layer_slots = plan.placement.slot_tables()?;

    // every (g, m) independently; results kept in index order so the sum is deterministic:
    // each exchange's cost and its one-way dispatch bytes (inside nodes, between nodes), and
    // what the lower bound reads of the demand (its top-k sums too), gathered on the same
    // pass over it
    // (`step_only`: the origin alone, none of the bound's sums)
    let tops = if step_only { None } else { BoundTops::new(w, topo) };
    let per_gm: Vec<GmResult> = (0..g_n * m_n)
        .into_par_iter()
        .map_init(
            || (ExchangePricer::new(ep, e_n).with_timing(timing), vec![0i64; ep * e_n]),
            |(pricer, origin), gm| {
                let (g, m) = (gm / m_n, gm % m_n);
                let sums = if step_only { 0 } else { l_n * e_n };
                let mut part = GmSums { rows: Vec::new(), totals: vec![0; sums], share: vec![0.0; sums], ranks: Vec::new() };
                let costs = (0..l_n)
                    .map(|l| {
                        if step_only {
                            grid.origin(w, g, m, l, origin);
                        } else {
                            let share = &mut part.share[l * e_n..(l + 1) * e_n];
                            grid.origin_and_sums(w, g, m, l, origin, share, tops.as_ref(), |s, t, x, top| {
                                part.rows.push((s, l, t, x, top))
                            });
                            let totals = &mut part.totals[l * e_n..(l + 1) * e_n];
                            for o in origin.chunks_exact(e_n) {
                                totals.iter_mut().zip(o).for_each(|(t, &x)| *t += x);
                            }
                        }
                        let attn_max = grid.attention_max(cost, g, m, l);
                        let (so, sl) = &layer_slots[l];
                        let lc = pricer.price(topo, cost, origin, attn_max, so, sl, &reps[gm * l_n + l]);
                        if detail {
                            // each rank's own one-pass attention, then its expert time (`ExchangeTerms`)
                            part.ranks.extend((0..ep).map(|r| grid.attention_of(cost, g, m, l, r)));
                            part.ranks.extend_from_slice(pricer.rank_expert());
                        }
                        (lc, pricer.dispatch_bytes(), pricer.replication_parts())
                    })
                    .collect();
                (costs, part)
            },
        )
        .collect();
    let bound_and_layers = if step_only {
        None
    } else {
        let mut demand = DemandSums::with_tops(w.num_samples, l_n, e_n, tops.as_ref());
        for (_, part) in &per_gm {
            for &(s, l, t, x, top) in &part.rows {
                demand.set_row(s, l, t, x);
                if tops.is_some() {
                    demand.set_row_tops(s, l, top);
                }
            }
            for l in 0..l_n {
                demand.add_layer_part(l, &part.totals[l * e_n..(l + 1) * e_n], &part.share[l * e_n..(l + 1) * e_n]);
            }
        }
        Some(lower_bound_of_sums(w, topo, cost, bound_cap, &demand)?)
    };

    let mut imbalance = Vec::with_capacity(g_n * m_n * l_n);
    let (mut intra, mut cross) = (0.0, 0.0);
    for (layers, _) in &per_gm {
        for (lc, (i, c), _) in layers {
            imbalance.push(lc.imbalance);
            intra += i;
            cross += c;
        }
    }
    let (group_times, critical, parts, pipeline_bubble, migration, redundant_grads) = if topo.pp > 1 {
        let exchange = |g: usize, m: usize, l: usize| {
            let (lc, _, rep) = per_gm[g * m_n + m].0[l];
            (lc, rep)
        };
        let p = pipeline::score(plan, &grid, topo, cost, l_n, exchange)?;
        (p.group_times, p.critical, p.parts, p.bubble, p.migration, p.redundant_grads)
    } else {
        let mut group_times = vec![0.0; g_n];
        for (gm, (layers, _)) in per_gm.iter().enumerate() {
            for (lc, _, _) in layers {
                group_times[gm / m_n] += lc.total();
            }
        }
        let critical = (0..g_n).fold(0, |b, g| if group_times[g] > group_times[b] { g } else { b });
        let mut parts = LayerCost::default();
        for (layers, _) in &per_gm[critical * m_n..(critical + 1) * m_n] {
            for (lc, _, _) in layers {
                parts.attention += lc.attention;
                parts.all_to_all += lc.all_to_all;
                parts.expert += lc.expert;
                parts.replication += lc.replication;
                parts.hidden += lc.hidden;
            }
        }
        (group_times, critical, parts, 0.0, migration_time(plan, topo, cost), redundant_grad_time(plan, topo, cost))
    };
    let step_time = group_times[critical] + migration + redundant_grads;
    let terms = detail.then(|| ExchangeTerms::gather(&per_gm, (g_n, m_n, l_n, ep), cost));
    // a balanced pipeline without a bubble: each stage a pp-th of the work
    let (lower_bound, ideal) = match bound_and_layers {
        Some((bound, layer_tokens)) => (bound, ideal_time_of(&layer_tokens, w, topo, cost, ideal_micro.unwrap_or(m_n)) / topo.pp as f64),
        None => (f64::NAN, f64::NAN),
    };
    let tokens = w.total_tokens() as f64;
    let mean_imbalance = imbalance.iter().sum::<f64>() / imbalance.len() as f64;
    let report = SimReport {
        step_time,
        ideal_time: ideal,
        lower_bound_time: lower_bound,
        throughput: tokens / step_time,
        ideal_throughput: tokens / ideal,
        attention: parts.attention,
        expert: parts.expert,
        all_to_all: parts.all_to_all,
        hidden: parts.hidden,
        replication: parts.replication,
        migration,
        redundant_grads,
        pipeline_bubble,
        critical_group: critical,
        group_times,
        imbalance,
        mean_imbalance,
        intra_node_bytes: cost.all_to_all_bytes(intra),
        cross_node_bytes: cost.all_to_all_bytes(cross),
        cross_node_bytes_per_token: cost.all_to_all_bytes(cross) / tokens,
    };
    Ok((report, terms))
}

/// What one (group, microbatch) task of [`simulate_in`] returns: each layer's exchange cost,
/// one-way dispatch bytes (inside nodes, between nodes) and exposed replication split into its
/// forward and backward parts, and its part of the demand sums.
type GmResult = (Vec<(LayerCost, (f64, f64), (f64, f64))>, GmSums);

/// What one (group, microbatch) task of [`simulate_in`] gathers for the lower bound
/// ([`DemandSums`]): its rows `(sample, layer, Σ_e tokens, distinct experts, top-k sums)` and,
/// per layer, its experts' totals and largest shares (`[L * E]` each); where the caller asked
/// for the exchanges' detail, `ranks` `[L * 2 * ep]`: per layer each EP rank's one-pass
/// attention, then each one's one-pass expert time (empty otherwise).
struct GmSums {
    rows: Vec<(usize, usize, i64, usize, [f64; 4])>,
    totals: Vec<i64>,
    share: Vec<f64>,
    ranks: Vec<f64>,
}

/// Tokens of the plan's largest row (cell).
fn largest_row(plan: &Plan, w: &WindowView, topo: &Topology) -> i64 {
    let mut cells = vec![0i64; topo.dp * plan.num_micro];
    for (s, &n) in w.seq_lens.iter().enumerate() {
        cells[plan.sample_rank[s] as usize * plan.num_micro + plan.sample_micro[s] as usize] += n;
    }
    cells.into_iter().max().unwrap_or(0)
}

#[cfg(test)]
mod tests;
