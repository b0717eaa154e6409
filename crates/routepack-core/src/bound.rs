//! A true lower bound on the step time of every valid plan for a window: whatever the
//! placement, the packing into rows, the layout of rows onto cells, the replicas and the
//! migration, `simulate` cannot score a plan below [`lower_bound_time`] (for the same window,
//! topology, cost model and token cap). docs/design.md ("The cost model", "Lower bound") carries
//! the same derivation; `tests/bound_props.rs` checks it on more than 10⁴ plans from every
//! planner of the core and random valid plans.
//!
//! # Derivation
//! `simulate` prices each exchange (group g, microbatch m, layer l) as
//! `T = 3·α + 4·max_r lt(r) + (F − α)⁺ + (B − 2α)⁺ + 3·max_p X_p`, with α the slowest rank's
//! attention, lt(r) rank r's dispatch link time, F and B the forward/backward replication link
//! times and X_p = c_tok·tokens(p) + c_exp·active(p). Step time = max_g Σ_m Σ_l T + migration;
//! migration ≥ 0 is bounded by 0. Every term is non-negative, and:
//!
//! 1. **Steps.** Every cell holds ≤ cap tokens and no cell is empty, so
//!    M ≥ M_lb = ⌈⌈Σn/cap⌉/dp⌉ and every exchange has at least u_min(l) active experts
//!    (the fewest distinct experts one sample uses in layer l).
//! 2. **Expert work.** `max_p X_p ≥ mean_p X_p`; Σ_p tokens(p) is the exchange's routed tokens
//!    (every token is computed once, on a slot or a replica) and Σ_p active(p) ≥ the
//!    distinct experts used, ≥ u_min(l) per exchange and, summed over all exchanges of the
//!    layer, ≥ U(l), the experts the window uses. So Σ_m 3·max_p X ≥ (3/ep)(c_tok·N_g(l) +
//!    c_exp·Σ_m U_gm(l)).
//! 3. **Replication, linearised.** For μ, ν ∈ [0, 1], `x⁺ ≥ μ·x`, so with 3 − μ − 2ν ≥ 0:
//!    `T ≥ (3 − μ − 2ν)·α + (1/ep)·Σ_r [4·lt(r) + μ·F_r + ν·B_r] + 3·mean_p X_p`, F_r ≥
//!    |R_r|·w/bw and B_r ≥ |R_r|·g/bw (R_r: experts with a replica on r; w, g: weight and
//!    gradient bytes; bw the fastest link), and a replica of an expert its node does not host
//!    enters the node once over the inter-node link (the chain's first destination there
//!    receives from outside it and sends the gradient back): `(w + g)·(1/bw_inter −
//!    1/bw_intra)⁺` more per (expert, node) over the node's ranks. And α ≥ mean_r of the
//!    cells' attention.
//! 4. **Traffic.** A token of expert e from rank r stays on r only if r hosts e (≤ spr experts,
//!    the set H_r) or holds a replica of it; it stays in r's node only if the node hosts e
//!    (≤ rpn·spr experts) or a replica of it is on the node. Per rank,
//!    `lt(r) ≥ s_intra/bw_intra + s_inter/bw_inter`, which over a node's ranks is ≥
//!    `Z/bw_fast + Y·(1/bw_inter − 1/bw_intra)⁺` (Z: tokens that must leave their rank, Y:
//!    those that must leave their node, × token bytes). Splitting the replicas' rank price
//!    (μw + νg)/bw as θ at rank level and 1 − θ at node level (Σ_r |R_r| ≥ |R_node|), plus
//!    the node-entry price of 3 at node level, each expert's tokens of a
//!    cell either pay the traffic price or one replica: `min(q·t, c) ≥ t·min(q, c/U)` for
//!    `t ≤ U`, where U bounds the tokens of e in one cell (≤ ρ_e·cap, ρ_e the largest
//!    share of a sample's tokens e takes, and ≤ the window's tokens of e) or one node-microbatch
//!    (≤ rpn·ρ_e·cap). Then `Σ_{e ∉ H} t_e ≥ Σ t − top_k(t)` and `Σ t − top_k(t)` is
//!    superadditive, so a cell's bound is at least the sum of its samples' bounds.
//!    **The replica buffers.** A rank receives copies of at most R = `Topology::replica_slots`
//!    distinct experts in one exchange (`validate` refuses more), so a cell's tokens outside
//!    its spr + R most used experts leave the rank whatever the replicas, and a node-cell's
//!    outside its rpn·(spr + R) leave the node: with H the hosted and Q the copied experts
//!    (|Q| ≤ R), a cell pays `Σ_{e ∉ H∪Q} q·t_e + Σ_{e ∈ Q} κ_e·t_e ≥ [Σ_e κ_e·t_e −
//!    κ_max·top_spr(t)] + (q − κ_max)·(Σ t − top_{spr+R}(t))` (κ_e = min(q, c/U_e) ≤ q),
//!    and both brackets are superadditive over the cell's samples. These tokens pay even at
//!    μ = ν = 0, where a copy costs nothing: the buffers, not the copies' link time, are
//!    what keeps a plan from copying every expert it needs. The top-k sums are bounded from
//!    above, never computed short: `top_k(t) ≤ k·τ + Σ_e (t_e − τ)⁺` for every τ ≥ 0
//!    ([`tops`]).
//! 5. **Mean over ranks and groups.** After 2–4 every term is a sum over samples of the
//!    group divided by ep (plus the c_exp term); the maximum over groups is at least the mean,
//!    so the bound is the window's sums divided by dp. The expert count uses
//!    mean_g Σ_m U_gm(l) ≥ max(M_lb·u_min(l), U(l)/G).
//! 6. **One sample.** The group holding sample s pays, at s's microbatch, α ≥ a_l(n_s) and the
//!    traffic of s's rank (rank level only, θ = 1, the fastest link), plus the expert term of
//!    2 with Σ_m U ≥ u(s, l) + (M_lb − 1)·u_min(l).
//!
//! 7. **The cost model's options.** The passes (`CostModel::compute_passes` = P,
//!    `CostModel::comm_passes` = K) stand for 3 and 2 above; a (μ, ν) whose attention
//!    coefficient P − μ − 2ν is negative is skipped. The roofline floor and the GEMM step
//!    add `(c_weights − c_tok·t)⁺ + c_gemm·[t ≥ 2] ≥ 0` per active expert to X_p, so every
//!    bound on the linear X_p bounds it (the bound drops that extra, and the kernel call: it
//!    prices X_p with `CostModel::expert_time`, the linear part, `cost::rank`'s lower-bound view). Under `Overlap::DispatchCombine` an exchange costs
//!    `max(C, A) + (F − α)⁺ + (B − 2α)⁺` (C = P·α + P·max_p X_p, A the all-to-all), and
//!    `max(C, A) ≥ λ·C + (1 − λ)·A` for λ ∈ [0, 1]: the derivation above goes through with the
//!    compute terms scaled by λ and the traffic prices by 1 − λ, the attention coefficient
//!    becoming λ·P − μ − 2ν. Without overlap λ·C + A (λ = 1, traffic ×1) is the exact sum.
//!    `tests/bound_props.rs` draws all three options.
//! 8. **The pipeline** (`Topology::pp` > 1, `crate::simulate::pipeline`). A group's pipeline
//!    time is at least its busiest stage's work, which is at least the mean over its pp
//!    stages; the stages' work adds up to the group's Σ_m Σ_l T (each exchange's time split by
//!    pass, the parts adding up to T), and migration and the gradient sum are ≥ 0. So the
//!    bound of 1–7 divided by pp bounds the pipelined step (the sends and the bubble only add).
//!
//! The bound is the largest of these over a grid of μ, ν, θ ∈ {0, ¼, ½, ¾, 1} (and λ in the
//! same grid under overlap). μ = ν = 0 is "attention + expert work at the mean, and the
//! tokens no slot or buffer can hold" (copies hidden behind attention serve the rest);
//! μ = ν = 1 charges every replica its full link time and drops attention. Without a cap the
//! weakest one is used (cap = Σ n: M_lb = 1).
//!
//! 9. **What it cannot see.** Each sample is granted its own best spr + R experts at its rank
//!    and rpn·(spr + R) at its node; a plan's samples on one rank or node share one set for
//!    the whole window (the placement is per layer, not per sample), and every expert needs
//!    a slot somewhere. The bound that knows this (a configuration LP whose dual is
//!    `Σ_s top_{k+R}(t_s + (n_s/C)·π) + (N − Σn/C)·top_k(π) − Σ_e π_e`, π ≥ 0, C a node's
//!    capacity) depends on C, i.e. on M, and more microbatches cost a plan almost nothing in
//!    the cost model (`c_exp` per active expert), so it must hold for every M, where its gain
//!    vanishes (measured on `flash` layer 0: the node-level charge 23.7% of the routed tokens
//!    per sample, 31.4% at M_lb, 27.5% at M_lb + 2); it is not used. docs/design.md ("Lower
//!    bound") measures what separates the bound from the plans.
//!
//! # In floating point
//! The derivation holds for exact sums; the bound and the simulator each round theirs, in
//! different orders. Where a plan sits at the bound, the two computed values then differ by a
//! few ulps either way (measured: up to 20 ulps, 4.4·10⁻¹⁵ relative, above the step time in
//! 102 of 32,900 plans, e.g. 14 samples of 1,438 tokens, 3 layers, 1 expert, dp = ep = 1,
//! pricing `a_lin` and `c_exp` alone). So the bound returned is the largest candidate less a
//! relative margin ([`rounding_margin`]) that covers both roundings: a sum of n non-negative
//! terms rounds to within (n − 1)·u of itself (u = 2⁻⁵³), the bound adds at most S + L terms
//! (and a few products), the simulator at most M·L ≤ S·L exchange times of sums over at most
//! E·(ep + 1) flows and per-expert terms; the margin is 2u times all of these (plus 64), and
//! never below 2⁻⁴⁰ ≈ 9.1·10⁻¹³, 200 times the largest excess seen. It moves the bound by
//! 10⁻¹² of itself on small windows and about 10⁻¹⁰ on `flash`'s, far below any figure it
//! reports. `tests/bound_props.rs` checks `lower_bound_time <= step_time` with no tolerance.

use rayon::prelude::*;

mod sums;
mod tops;

pub use sums::{row_sums, DemandSums};
pub use tops::BoundTops;
use tops::Holds;

use crate::cost::{CostModel, Overlap};
use crate::error::{invalid, Result};
use crate::topology::{MicroRule, Topology};
use crate::window::WindowView;

/// The fewest microbatches per DP rank any plan of `w` under `token_cap` can run on `topo`:
/// ⌈⌈Σ n / cap⌉ / dp⌉, raised to the pipeline's rule ([`MicroRule::fewest`] of
/// [`Topology::micro_rule`]).
pub fn lower_bound_micro(w: &WindowView, topo: &Topology, token_cap: i64) -> usize {
    topo.micro_rule().fewest(w.total_tokens() as u64, token_cap.max(1) as u64, topo.dp)
}

/// The multipliers of the grid (μ, ν, θ each take every value).
const GRID: [f64; 5] = [0.0, 0.25, 0.5, 0.75, 1.0];

/// The least relative margin of [`rounding_margin`], 2⁻⁴⁰ ≈ 9.1·10⁻¹³.
pub const MIN_ROUNDING_MARGIN: f64 = 1.0 / (1u64 << 40) as f64;

/// The relative margin the bound is lowered by to be a bound as computed, for a window of
/// `samples` samples, `layers` layers and `experts` experts on EP groups of `ep` ranks: 2u
/// times the terms the bound and the simulator add up (see the module docs, "In floating
/// point"), at least [`MIN_ROUNDING_MARGIN`].
pub fn rounding_margin(samples: usize, layers: usize, experts: usize, ep: usize) -> f64 {
    let terms = samples as f64 + layers as f64 + samples as f64 * layers as f64 + experts as f64 * (ep as f64 + 1.0) + 64.0;
    (terms * f64::EPSILON).max(MIN_ROUNDING_MARGIN)
}

/// What one sample contributes in one layer.
#[derive(Clone, Copy, Default)]
struct SampleLayer {
    /// Σ_e tokens (routed tokens of the sample in the layer).
    tokens: f64,
    /// Distinct experts used.
    experts: usize,
    /// Tokens on the sample's spr most used experts (what its rank may host).
    top_rank: f64,
    /// Tokens on its spr + R most used experts (what its rank may host or hold copies of).
    top_rank_plus: f64,
}

/// Window sums per layer.
struct LayerSums {
    /// Σ_s attention (one pass).
    attention: f64,
    tokens: f64,
    /// Σ_s tokens on s's k most used experts, for k = spr (`top_rank`), spr + R
    /// (`top_rank_plus`), rpn·spr (`top_node`) and rpn·(spr + R) (`top_node_plus`).
    top_rank: f64,
    top_rank_plus: f64,
    top_node: f64,
    top_node_plus: f64,
    /// Fewest distinct experts of one sample.
    min_experts: usize,
    /// Distinct experts the window uses.
    used_experts: usize,
    /// `[E]` tokens of each expert over the window.
    expert_tokens: Vec<f64>,
    /// `[E]` largest fraction of one sample's length routed to each expert.
    expert_share: Vec<f64>,
}

impl LayerSums {
    /// Sums of no sample yet over the given per-expert `[E]` tokens and shares (the rest is
    /// accumulated sample by sample).
    fn empty(expert_tokens: Vec<f64>, expert_share: Vec<f64>) -> Self {
        Self {
            attention: 0.0,
            tokens: 0.0,
            top_rank: 0.0,
            top_rank_plus: 0.0,
            top_node: 0.0,
            top_node_plus: 0.0,
            min_experts: usize::MAX,
            used_experts: 0,
            expert_tokens,
            expert_share,
        }
    }
}

/// Link prices of the topology: which links an EP group's traffic can use.
#[derive(Clone, Copy)]
struct Prices {
    /// Seconds per routed token that must leave its rank (dispatch + combine, both passes).
    rank: f64,
    /// Extra seconds per routed token that must leave its node (0 inside one node).
    node: f64,
    /// Seconds per byte a replica's destination receives (sends) on the fastest link.
    replica_rank: f64,
    /// Extra seconds per byte of a replica entering a node that does not host its expert:
    /// the first destination of a chain in that node receives from outside it.
    replica_node: f64,
}

impl Prices {
    fn new(topo: &Topology, cost: &CostModel) -> Self {
        let per_token = 2.0 * cost.comm_passes() * cost.token_bytes;
        let (bw, extra) = if topo.nodes_per_group() == 1 {
            (cost.bw_intra, 0.0)
        } else if topo.ranks_per_group_node() == 1 {
            (cost.bw_inter, 0.0)
        } else {
            (cost.bw_intra.max(cost.bw_inter), (1.0 / cost.bw_inter - 1.0 / cost.bw_intra).max(0.0))
        };
        Self { rank: per_token / bw, node: per_token * extra, replica_rank: 1.0 / bw, replica_node: extra }
    }
}

/// `min(q, c / u)`: the per-token price of tokens that either cross a link at `q` each or are
/// served by one replica costing `c`, when at most `u` of them share the replica.
#[inline]
fn rate(q: f64, c: f64, u: f64) -> f64 {
    if u > 0.0 {
        q.min(c / u)
    } else {
        q
    }
}

/// One layer's sums and its samples' parts without the top-k sums (0; the `_plus` ones every
/// token), from `d`.
fn layer_of_sums(w: &WindowView, cost: &CostModel, d: &DemandSums, l: usize) -> (LayerSums, Vec<SampleLayer>) {
    let (s_n, e_n) = (w.num_samples, w.num_experts);
    let mut sums = LayerSums::empty(
        d.expert_tokens[l * e_n..(l + 1) * e_n].iter().map(|&x| x as f64).collect(),
        d.expert_share[l * e_n..(l + 1) * e_n].to_vec(),
    );
    // sample order
    let per = (0..s_n)
        .map(|s| {
            let tokens = d.row_tokens[l * s_n + s] as f64;
            let experts = d.row_experts[l * s_n + s];
            sums.attention += cost.attention(l, w.seq_lens[s] as f64);
            sums.tokens += tokens;
            sums.min_experts = sums.min_experts.min(experts);
            SampleLayer { tokens, experts, top_rank: 0.0, top_rank_plus: tokens }
        })
        .collect();
    // the `_plus` sums as every token: exact where a rank's slots and buffers hold every
    // expert (`Holds::unlimited`), the only case that reads them
    sums.top_rank_plus = sums.tokens;
    sums.top_node_plus = sums.tokens;
    sums.used_experts = sums.expert_tokens.iter().filter(|&&x| x > 0.0).count();
    (sums, per)
}

/// One layer's sums and its samples' parts with the top-k sums (upper bounds on them, see
/// [`tops`]), all from `d` (which holds them).
fn layer_with_tops(w: &WindowView, cost: &CostModel, d: &DemandSums, l: usize) -> (LayerSums, Vec<SampleLayer>) {
    let (mut sums, mut per) = layer_of_sums(w, cost, d, l);
    let s_n = w.num_samples;
    let [mut rank, mut rank_plus, mut node, mut node_plus] = [0.0; 4];
    // sample order: the sums are the same on every run
    for (p, t) in per.iter_mut().zip(&d.row_tops[l * s_n..(l + 1) * s_n]) {
        (p.top_rank, p.top_rank_plus) = (t[0], t[1]);
        rank += t[0];
        rank_plus += t[1];
        node += t[2];
        node_plus += t[3];
    }
    (sums.top_rank, sums.top_rank_plus, sums.top_node, sums.top_node_plus) = (rank, rank_plus, node, node_plus);
    (sums, per)
}

/// Lower bound of Σ_{cells} of one layer's traffic + replica price at one level (rank or
/// node): the larger of the uniform-rate form (the layer's largest cell bound U) and the
/// per-expert-rate form `Σ_e κ_e·T_e − κ_max·top` (both valid, see the module docs), each
/// plus `(q − κ)·(tokens − top_plus)`: the tokens outside what the level can hold at all
/// (slots and replica buffers), which no replica can serve and which pay the full price.
fn traffic(q: f64, c: f64, per_cell: f64, sums: &LayerSums, top: f64, top_plus: f64) -> f64 {
    if q <= 0.0 {
        return 0.0;
    }
    let bound_of = |e: usize| (sums.expert_share[e] * per_cell).min(sums.expert_tokens[e]);
    let u_max = (0..sums.expert_tokens.len()).map(bound_of).fold(0.0, f64::max);
    let beyond = (sums.tokens - top_plus).max(0.0);
    let k_u = rate(q, c, u_max);
    let uniform = k_u * (sums.tokens - top).max(0.0) + (q - k_u) * beyond;
    let mut linear = 0.0;
    let mut k_max: f64 = 0.0;
    for (e, &t) in sums.expert_tokens.iter().enumerate() {
        if t > 0.0 {
            let k = rate(q, c, bound_of(e));
            linear += k * t;
            k_max = k_max.max(k);
        }
    }
    uniform.max(linear - k_max * top + (q - k_max) * beyond)
}

/// The lower bound, in seconds, on `simulate`'s step time of every plan that is valid for `w`
/// and `topo` with at most `token_cap` tokens per row (None: no cap, i.e. Σ n, the weakest).
/// See the module docs for the derivation.
pub fn lower_bound_time(w: &WindowView, topo: &Topology, cost: &CostModel, token_cap: Option<i64>) -> Result<f64> {
    lower_bound_and_layer_tokens(w, topo, cost, token_cap).map(|(bound, _)| bound)
}

/// [`lower_bound_time`] and, from the same pass over the demand, each layer's routed tokens
/// `[L]` (Σ_s Σ_e, exact: what [`crate::simulate::ideal_time`] needs, so `simulate` reads the
/// demand once for both).
pub fn lower_bound_and_layer_tokens(w: &WindowView, topo: &Topology, cost: &CostModel, token_cap: Option<i64>) -> Result<(f64, Vec<f64>)> {
    check_bound_inputs(w, topo, cost, token_cap)?;
    let tops = BoundTops::new(w, topo);
    lower_bound_of_sums(w, topo, cost, token_cap, &DemandSums::of_window(w, tops.as_ref()))
}

/// The errors of [`lower_bound_time`]'s inputs: a cost model for another layer count, too few
/// slots for the experts, a cap below 1.
pub fn check_bound_inputs(w: &WindowView, topo: &Topology, cost: &CostModel, token_cap: Option<i64>) -> Result<()> {
    cost.check(w.num_layers)?;
    topo.check_experts(w.num_experts)?;
    match token_cap {
        Some(c) if c < 1 => Err(invalid("token_cap", format!("must be >= 1, got {c}"))),
        _ => Ok(()),
    }
}

/// [`lower_bound_and_layer_tokens`] given the window's [`DemandSums`] `d` (gathered by the
/// caller, e.g. `simulate` on its own pass over the demand, with the top-k sums of
/// [`BoundTops::new`] for `w` and `topo` where that is Some): the same result, bit for bit.
/// Where `d` lacks the top-k sums the bound needs, the demand is read again for them (only
/// when a candidate that charges traffic could beat the ones that do not, where a rank's slots
/// and buffers hold every expert).
pub fn lower_bound_of_sums(
    w: &WindowView,
    topo: &Topology,
    cost: &CostModel,
    token_cap: Option<i64>,
    d: &DemandSums,
) -> Result<(f64, Vec<f64>)> {
    check_bound_inputs(w, topo, cost, token_cap)?;
    assert!(
        d.num_samples == w.num_samples && d.num_experts == w.num_experts && d.row_tokens.len() == w.num_samples * w.num_layers,
        "DemandSums of another window"
    );
    let total = w.total_tokens();
    let cap = match token_cap {
        Some(c) => c.min(total),
        None => total,
    } as f64;
    // M* without the pipeline's rule: every valid plan runs at least this many (the derivation,
    // part 1, needs no more; a pipeline's work is shared by its stages in part 8 instead)
    let micro = MicroRule::NONE.fewest(total as u64, cap as u64, topo.dp) as f64;
    let bound = Bound { w, topo, cost, prices: Prices::new(topo, cost), micro, cap };
    // Where a rank's slots and replica buffers hold every expert, first without the top-k sums
    // (the costly part): every candidate is then over-estimated (its traffic only falls as
    // the hostable tokens rise) except the ones that charge no traffic (μ = ν = 0), which are
    // exact. When no estimate beats those, they are the bound. With a replica limit that
    // binds, every candidate charges traffic and the top-k sums are always needed.
    let (sums, per) = bound.layers_of(d);
    let layer_tokens = sums.iter().map(|s| s.tokens).collect();
    // part 8: a pipeline's stages share the work (÷ 1 keeps the bits without one)
    let scale = (1.0 - rounding_margin(w.num_samples, w.num_layers, w.num_experts, topo.ep)) / topo.pp as f64;
    let holds = Holds::new(topo, w.num_experts);
    if holds.unlimited(w.num_experts) {
        let free = bound.best(&sums, &per, true);
        if bound.best(&sums, &per, false) <= free {
            return Ok((free * scale, layer_tokens));
        }
    }
    let (sums, per) = if !d.row_tops.is_empty() && d.tops_k == holds.k {
        bound.layers_with_tops(d)
    } else {
        // the top-k sums, read now (the thresholds are the same whoever computes them)
        bound.layers_with_tops(&DemandSums::of_window(w, Some(&BoundTops::with_holds(w, holds))))
    };
    Ok((bound.best(&sums, &per, false) * scale, layer_tokens))
}

/// The inputs of one bound.
struct Bound<'a> {
    w: &'a WindowView<'a>,
    topo: &'a Topology,
    cost: &'a CostModel,
    prices: Prices,
    /// M*, the fewest microbatches a valid plan has.
    micro: f64,
    cap: f64,
}

impl Bound<'_> {
    /// Every layer's sums and its samples' parts, top-k sums 0, from `d`.
    fn layers_of(&self, d: &DemandSums) -> (Vec<LayerSums>, Vec<Vec<SampleLayer>>) {
        (0..self.w.num_layers).into_par_iter().map(|l| layer_of_sums(self.w, self.cost, d, l)).unzip()
    }

    /// Every layer's sums and its samples' parts with the top-k sums (`d`'s sums and a pass
    /// over the demand).
    fn layers_with_tops(&self, d: &DemandSums) -> (Vec<LayerSums>, Vec<Vec<SampleLayer>>) {
        (0..self.w.num_layers).into_par_iter().map(|l| layer_with_tops(self.w, self.cost, d, l)).unzip()
    }

    /// The largest candidate over the grid (`free_only`: only μ = ν = 0).
    fn best(&self, sums: &[LayerSums], per: &[Vec<SampleLayer>], free_only: bool) -> f64 {
        let (w, topo, cost, prices, micro, cap) = (self.w, self.topo, self.cost, &self.prices, self.micro, self.cap);
        let (dp, ep, groups) = (topo.dp as f64, topo.ep as f64, topo.num_groups() as f64);
        let rpn = topo.ranks_per_group_node() as f64;
        let passes = cost.compute_passes();
        // expert work at the mean (2), the same for every multiplier but λ
        let expert: f64 = sums
            .iter()
            .map(|s| {
                let active = (micro * s.min_experts as f64).max(s.used_experts as f64 / groups);
                passes * cost.expert_time(s.tokens / dp, active / ep)
            })
            .sum();
        // (λ on compute, 1 − λ on traffic) under overlap (part 7); both 1 without
        let mixes: Vec<(f64, f64)> = match cost.overlap {
            Overlap::None => vec![(1.0, 1.0)],
            Overlap::DispatchCombine => GRID.iter().map(|&l| (l, 1.0 - l)).collect(),
        };
        let grid: &[f64] = if free_only { &GRID[..1] } else { &GRID };
        let tables = SampleTables::new(w, cost, per, sums, micro);
        let mut best: f64 = 0.0;
        for &(cf, kf) in &mixes {
            let mix = Mix { compute: cf, prices: Prices { rank: kf * prices.rank, node: kf * prices.node, ..*prices } };
            let expert_coef = mix.compute * passes;
            let expert_part: Vec<f64> = tables.work.iter().map(|&x| expert_coef * x / ep).collect();
            for &mu in grid {
                for &nu in grid {
                    let attn_coef = cf * passes - mu - 2.0 * nu;
                    if attn_coef < 0.0 {
                        continue;
                    }
                    let bytes = mu * cost.expert_weight_bytes + nu * cost.expert_grad_bytes;
                    let replica = bytes * prices.replica_rank;
                    let attention: f64 = sums.iter().map(|s| attn_coef * s.attention / dp).sum();
                    let p = &mix.prices;
                    for &theta in &GRID {
                        let node_replica = bytes * p.replica_node + (1.0 - theta) * replica;
                        let comm: f64 = sums
                            .iter()
                            .map(|s| {
                                traffic(p.rank, theta * replica, cap, s, s.top_rank, s.top_rank_plus)
                                    + traffic(p.node, node_replica, rpn * cap, s, s.top_node, s.top_node_plus)
                            })
                            .sum::<f64>()
                            / dp;
                        best = best.max(attention + comm + cf * expert);
                    }
                    best = best.max(single_sample(w, &tables, &expert_part, sums, &mix, cap, attn_coef, replica));
                }
            }
        }
        best
    }
}

/// One λ of part 7: the factor on the compute terms and the link prices scaled for traffic.
struct Mix {
    compute: f64,
    prices: Prices,
}

/// What part 6 reads of every (sample, layer), the same for every candidate: sample-major
/// `[S * L]` tables, so each candidate is one pass of multiply-adds.
struct SampleTables {
    /// `cost.attention(l, n_s)`.
    attention: Vec<f64>,
    /// Tokens the sample's rank cannot host: `(tokens − top_rank)⁺`.
    unhosted: Vec<f64>,
    /// Tokens its rank can neither host nor hold copies of: `(tokens − top_rank_plus)⁺`.
    unheld: Vec<f64>,
    /// One pass of expert work at the mean: `c_tok·tokens + c_exp·active`, the linear part of
    /// the expert term (`CostModel::expert_time`, the cost helper's lower-bound view).
    work: Vec<f64>,
}

impl SampleTables {
    fn new(w: &WindowView, cost: &CostModel, per: &[Vec<SampleLayer>], sums: &[LayerSums], micro: f64) -> Self {
        let (s_n, l_n) = (w.num_samples, w.num_layers);
        let mut t = SampleTables {
            attention: vec![0.0; s_n * l_n],
            unhosted: vec![0.0; s_n * l_n],
            unheld: vec![0.0; s_n * l_n],
            work: vec![0.0; s_n * l_n],
        };
        for (s, &len) in w.seq_lens.iter().enumerate() {
            let n = len as f64;
            for (l, (layer, sum)) in per.iter().zip(sums).enumerate() {
                let p = &layer[s];
                let active = p.experts as f64 + (micro - 1.0) * sum.min_experts as f64;
                t.attention[s * l_n + l] = cost.attention(l, n);
                t.unhosted[s * l_n + l] = (p.tokens - p.top_rank).max(0.0);
                t.unheld[s * l_n + l] = (p.tokens - p.top_rank_plus).max(0.0);
                t.work[s * l_n + l] = cost.expert_time(p.tokens, active);
            }
        }
        t
    }
}

/// Part 6 of the derivation: the largest over samples of what the group holding it must pay.
/// `expert` `[S * L]`: the tables' `work` times this mix's expert coefficient, over ep.
#[allow(clippy::too_many_arguments)]
fn single_sample(
    w: &WindowView,
    tables: &SampleTables,
    expert: &[f64],
    sums: &[LayerSums],
    mix: &Mix,
    cap: f64,
    attn_coef: f64,
    replica: f64,
) -> f64 {
    let l_n = w.num_layers;
    let prices = &mix.prices;
    // per layer (κ, q − κ): the price of tokens a copy could serve, and the rest of the full
    // price for tokens beyond the rank's slots and buffers
    let rates: Vec<(f64, f64)> = sums
        .iter()
        .map(|s| {
            let u = (0..s.expert_tokens.len()).map(|e| (s.expert_share[e] * cap).min(s.expert_tokens[e])).fold(0.0, f64::max);
            let k = rate(prices.rank, replica, u);
            (k, prices.rank - k)
        })
        .collect();
    // each sample's layers added in layer order; the max over samples is the same in any order
    (0..w.num_samples)
        .into_par_iter()
        .with_min_len(1024)
        .map(|s| {
            let row = s * l_n..(s + 1) * l_n;
            let (a, x, y, e) = (&tables.attention[row.clone()], &tables.unhosted[row.clone()], &tables.unheld[row.clone()], &expert[row]);
            (0..l_n).map(|l| attn_coef * a[l] + rates[l].0 * x[l] + rates[l].1 * y[l] + e[l]).sum::<f64>()
        })
        .reduce(|| 0.0, f64::max)
}

#[cfg(test)]
mod tests;
