//! The layout proxy: the objective the layout search minimises, and its incremental
//! evaluation. It re-derives `simulate`'s cost model for a packing without replicas, in a
//! form that a move updates in O(L·ep).
//!
//! Cost of EP group g (an EDP shard) = Σ over its microbatches m of
//! * attention: Σ_l 3 · max_{ranks p of g} (a_lin·lin(p,m) + a_quad_l·quad(p,m)), with lin and
//!   quad the Σ n and Σ n² of the samples of rank p at microbatch m (layers grouped by their a_quad,
//!   so this is O(kinds · ep));
//! * per layer l: expert work 3 · max_p (per_token·tok(p) + per_expert·hosted(p)) plus
//!   all-to-all 2·2·token_bytes · max_p (max(sent, received) intra-node / bw_intra +
//!   max(sent, received) inter-node / bw_inter), as `simulate` prices it. The coefficients
//!   come from the cost model's shared terms: the expert curve's line
//!   (`CostModel::expert_line`: `(c_tok, c_exp)` for the linear model) and
//!   `CostModel::all_to_all_time`.
//!
//! Routing is approximated through the placement: each sample's tokens for expert e are split
//! evenly over e's replicas, giving proj[s, l, p], the tokens sample s sends to EP rank p in
//! layer l (`demand::project`). A sample's demand vector holds proj, its sum over ranks (otot)
//! and its sums over each node's ranks (onode), blocked by eight layers as `kernel::Shape`
//! lays them out; a cell's demand vector is the sum of its samples'. For each (group, microbatch,
//! layer) the state keeps, per EP rank p, tokens received, and tokens received and sent within
//! p's node and across nodes (`kernel` has these values and their updates). Moving a sample
//! touches two (group, microbatch)s: O(L·ep), one pass each. Attention keeps the three largest rank
//! values per (group, microbatch) and kind (`attention`), so a move prices it in O(kinds) (only its
//! end ranks change).
//!
//! The energy the annealer minimises is max_g C_g + λ · mean_g C_g: the slowest shard's
//! accumulated cost (what `simulate`'s step time is), plus a small pull on the other shards
//! so that moves there are not free random walks.
//!
//! # Approximations relative to `simulate`
//! * **No intra-batch replication** (and no migration): the proxy prices the packing before
//!   the replication stage runs, so replica copies, their traffic and their exposed time are
//!   not in it.
//! * **Placement's even split**: a replicated expert's tokens are split evenly over its
//!   replicas and rounded to whole tokens per (sample, layer, rank). Under a placement without
//!   replicated experts the projection is exact. `flow` gives every copy the load of that
//!   split (to under a token per sample and rank) but feeds it node first: its own rank, its
//!   node, then the surplus of the other nodes. So the per-rank loads the proxy sees are
//!   `simulate`'s, while where a replicated expert's copies span nodes the proxy counts more
//!   inter-node traffic than `simulate` does (never less on any rank's inter-node link, up to
//!   rounding; intra-node traffic rises by part of that). It over-estimates the all-to-all:
//!   measured +0.2–0.3% of the step on `flash` (`routepack_no_replication`, 3 windows) and
//!   +0.6–1.5% per group in `proxy_tracks_simulate_with_replicated_experts`. The error does
//!   not depend on the layout much: node-first feeding depends on the node a sample runs on,
//!   so a move that changes a sample's node changes its projection; the proxy keeps one
//!   projection per sample (per-node ones would need every kernel pass to read one demand
//!   vector per end node). On `flash` after node-first feeding the slowest rank of every
//!   exchange is a receiver, and its inter-node tokens are all for experts with one copy,
//!   which the projection routes exactly; counting every replicated expert's tokens as
//!   node-local would not lower that rank's time (measured: +1.5%, the intra-node term
//!   rises), so a node-aware projection has nothing to gain for the layout there.
//! * **Hosted experts count as active**: `c_exp` is charged for every expert a rank hosts;
//!   `simulate` charges the experts that receive tokens (the same with thousands of tokens
//!   per microbatch).
//! * **The expert curve linearised**: a rank's expert work is `CostModel::expert_line`'s
//!   line at the window's mean tokens of one expert copy in one exchange (`tokens_per_copy`),
//!   per token and per hosted expert, where `simulate` prices each active expert on its own
//!   curve (roofline floor `c_weights`, GEMM step `c_gemm`, `expert_table`). Exact for the
//!   linear model; under a calibrated model the line follows the curve near the mean (below a
//!   roofline's knee the slope is 0: tokens cost nothing more, experts do), so the layout
//!   balances what the step pays (`tests::proxy_ranks_layouts_as_simulate_under_a_calibrated_model`).
//!   The rank's kernel call and the exchange's all-to-all latency are left out: every layout
//!   pays them alike.
//! * **f32 state**: the token counts are whole numbers, exact in f32 (no drift over millions
//!   of moves), but the kernel multiplies them by f32 coefficients and takes the max over
//!   ranks in f32; `simulate` works in f64. Layer costs are summed in f64.
//! * **Attention summation order**: a_lin·Σn + a_quad·Σn² per cell rather than Σ attention(n)
//!   per sample (rounding only).
//!
//! Tests that tie it to `simulate`: `proxy::tests::proxy_matches_simulate_under_static_placement`
//! (every group's cost within 1e-5), `proxy::tests::proxy_tracks_simulate_with_replicated_experts`
//! (a placement with replicated experts: from 0.1% under to 3% over `simulate`, twice the gap
//! measured there) and
//! `packing::routepack::tests::annealing_improves_and_the_proxy_tracks_simulate` (the
//! annealed layout's `proxy_step_time` within 1e-3 of `simulate`'s step time).
//!
//! Files: `demand` (samples' demand vectors and the projection), `delta` (a move as each
//! (group, microbatch) sees it), `state` (`Shards`: the incremental state, built, evaluated and
//! updated through `kernel`), `attention` (the attention ranking).

use crate::cost::links::LinkBytes;
use crate::cost::CostModel;
use crate::cpu::Avx2;
use crate::error::{bad_plan, invalid, Result};
use crate::plan::Placement;
use crate::sizes;
use crate::topology::Topology;
use crate::window::WindowView;

use super::kernel::{Shape, LANES};

mod attention;
mod delta;
mod demand;
mod state;
#[cfg(test)]
mod tests;

pub use delta::{Delta, Src};
pub use demand::SampleDemand;
pub use state::Shards;

/// Per-sample demand projected onto EP ranks, and the cost coefficients. Built once per
/// window, placement and microbatch count; shared read-only by every chain.
pub struct Proxy {
    /// Samples (S).
    pub num_samples: usize,
    /// MoE layers (L).
    pub num_layers: usize,
    /// EP ranks per group.
    pub ep: usize,
    /// DP ranks.
    pub dp: usize,
    /// EP groups (dp / ep).
    pub groups: usize,
    /// Microbatches per DP rank (M).
    pub micro: usize,
    /// EP ranks per node inside a group.
    pub rpn: usize,
    /// Nodes per group.
    pub nodes: usize,
    /// Tokens a cell may hold.
    pub token_cap: i64,
    /// `[S]` sample lengths n.
    pub lens: Vec<i64>,
    /// `[S]` n² (i128: it overflows i64 above 3·10⁹ tokens).
    pub sq: Vec<i128>,
    /// `[dp·M]` (group, microbatch) and EP rank of each cell.
    cell_gm: Vec<u32>,
    cell_rank: Vec<u32>,
    /// `[S]` samples in increasing length (ties by index).
    pub by_len: Vec<u32>,
    /// `[S]` each sample's place in `by_len`.
    pub len_rank: Vec<u32>,
    /// Where values live in demand vectors and state (layers blocked by eight).
    pub(crate) shape: Shape,
    /// The demand vector of each sample (see the module docs).
    pub demand: SampleDemand,
    /// `[blocks, ep, 8]` 3 · c_exp · experts hosted by rank p in layer l.
    pub hexp: Vec<f32>,
    /// `[blocks · 8]` hexp of each layer when every rank of the layer has the same.
    pub hexp_layer: Option<Vec<f32>>,
    /// Distinct attention kinds: (3 · a_quad, number of layers with it).
    pub kinds: Vec<(f64, f64)>,
    /// 3 · a_lin.
    pub att_lin: f64,
    /// Expert work per received token, all passes (3 · c_tok).
    pub ct: f32,
    /// All-to-all seconds per token over the intra-node link, all passes.
    pub ki: f32,
    /// All-to-all seconds per token over the inter-node link, all passes.
    pub ke: f32,
    /// Weight of the mean group cost in the energy.
    pub lambda: f64,
    /// The AVX2 capability when the CPU has it (the kernel then runs its AVX2 build).
    avx2: Option<Avx2>,
}

impl Proxy {
    /// Checks the placement and the layout's sizes against the window and precomputes the
    /// projections (O(S·L·E)). The window, topology and cost model come checked (a
    /// `crate::request::PlanRequest`, or `proxy_step_time`'s entry): debug builds assert their shapes.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        w: &WindowView,
        topo: &Topology,
        cost: &CostModel,
        placement: &Placement,
        token_cap: i64,
        micro: usize,
        lambda: f64,
    ) -> Result<Self> {
        debug_assert!(topo.num_slots() >= w.num_experts && cost.a_quad.len() == w.num_layers, "window, topology and cost not checked");
        if placement.num_layers != w.num_layers || placement.num_experts != w.num_experts {
            return Err(bad_plan(format!(
                "placement is for L={}, E={} but the window has L={}, E={}",
                placement.num_layers, placement.num_experts, w.num_layers, w.num_experts
            )));
        }
        placement.check_topology(topo)?;
        placement.check()?;
        if micro == 0 {
            return Err(invalid("num_micro", "must be >= 1, got 0"));
        }
        if !(lambda.is_finite() && lambda >= 0.0) {
            return Err(invalid("anneal_lambda", format!("must be finite and >= 0, got {lambda}")));
        }
        let (s_n, l_n, ep) = (w.num_samples, w.num_layers, topo.ep);
        let rpn = topo.ranks_per_group_node();
        let nodes = ep / rpn;
        let shape = Shape::new(l_n, ep, nodes);
        // every sample's demand vector (EP ranks and nodes of every layer, at most 4 bytes a
        // value) and the per-rank tables: sized by the EP group, reserved first
        let per_sample = sizes::table_bytes(&[shape.demand_len()], 4).saturating_add(32);
        let what = format!("the layout proxy's demand vectors, {s_n} samples x {} values,", shape.demand_len());
        sizes::check_call(
            "topo.ep",
            &what,
            per_sample.saturating_mul(s_n as u128).saturating_add(sizes::table_bytes(&[shape.hexp_len()], 8)),
        )?;
        let demand = demand::project_compact(w, topo, placement, shape);
        // The expert-work term, linearised (`CostModel::expert_line`) at the window's mean
        // tokens of one expert copy in one exchange, split into its per-token part (`ct`,
        // multiplied in the kernel in f32) and its per-expert part (`hexp`). For the linear
        // model the line is (c_tok, c_exp) exactly, so these are the bits of 3·c_exp·hosted
        // and 3·c_tok (and the window is not read for the operating point).
        let passes = cost.compute_passes();
        let line = cost.expert_line(if cost.roofline() { tokens_per_copy(w, topo, placement, micro) } else { 0.0 });
        let per_expert = passes * line.per_expert;
        let per_token = passes * line.per_token;
        let mut hexp = vec![0f32; shape.hexp_len()];
        for l in 0..l_n {
            let layer = placement.layer(l);
            for p in 0..ep {
                let mut hosted: Vec<i32> =
                    layer[p * topo.slots_per_rank..(p + 1) * topo.slots_per_rank].iter().copied().filter(|&e| e >= 0).collect();
                hosted.sort_unstable();
                hosted.dedup();
                hexp[shape.proj_at(l, p)] = (per_expert * hosted.len() as f64) as f32;
            }
        }
        let mut hexp_layer = vec![0f32; shape.blocks * LANES];
        for (l, h) in hexp_layer.iter_mut().enumerate().take(l_n) {
            *h = hexp[shape.proj_at(l, 0)];
        }
        let uniform = (0..l_n).all(|l| (0..ep).all(|p| hexp[shape.proj_at(l, p)] == hexp_layer[l]));
        // Attention stays a_lin·Σn + a_quad_l·Σn² per cell, not `CostModel::attention` per
        // sample: a move changes a cell's Σn and Σn², so the proxy keeps those (the same
        // quantity summed in another order; see the approximations above).
        let mut kinds: Vec<(f64, f64)> = Vec::new();
        for &q in &cost.a_quad {
            let q3 = passes * q;
            match kinds.iter_mut().find(|k| k.0 == q3) {
                Some(k) => k.1 += 1.0,
                None => kinds.push((q3, 1.0)),
            }
        }
        // All-to-all seconds per routed token over each link: `CostModel::all_to_all_time` of
        // one token sent once, which is (2·2·token_bytes) / bw with the same bits (the factor
        // 2·2 is a power of two). The kernel multiplies it by token counts in f32.
        let a2a_per_token = |same_node: bool| {
            let mut links = [LinkBytes::default(); 2];
            LinkBytes::add(&mut links, 0, 1, cost.token_bytes, same_node);
            cost.all_to_all_time(&links) as f32
        };
        let mut by_len: Vec<u32> = (0..s_n as u32).collect();
        by_len.sort_by_key(|&s| (w.seq_lens[s as usize], s));
        let mut len_rank = vec![0u32; s_n];
        for (i, &s) in by_len.iter().enumerate() {
            len_rank[s as usize] = i as u32;
        }
        let cells = topo.dp * micro;
        let cell_gm = (0..cells).map(|c| ((c / micro / ep) * micro + c % micro) as u32).collect();
        let cell_rank = (0..cells).map(|c| ((c / micro) % ep) as u32).collect();
        Ok(Self {
            cell_gm,
            cell_rank,
            num_samples: s_n,
            num_layers: l_n,
            ep,
            dp: topo.dp,
            groups: topo.num_groups(),
            micro,
            rpn,
            nodes,
            token_cap,
            lens: w.seq_lens.to_vec(),
            sq: w.seq_lens.iter().map(|&n| n as i128 * n as i128).collect(),
            by_len,
            len_rank,
            shape,
            demand,
            hexp,
            hexp_layer: uniform.then_some(hexp_layer),
            kinds,
            att_lin: passes * cost.a_lin,
            ct: per_token as f32,
            ki: a2a_per_token(true),
            ke: a2a_per_token(false),
            lambda,
            avx2: Avx2::detect(),
        })
    }

    /// Cells: dp · M.
    #[inline]
    pub fn cells(&self) -> usize {
        self.dp * self.micro
    }
    /// (group, microbatch) index of cell c = d·M + m.
    #[inline]
    pub fn gm_of(&self, cell: usize) -> usize {
        self.cell_gm[cell] as usize
    }
    /// EP-local rank of cell c.
    #[inline]
    pub fn rank_of(&self, cell: usize) -> usize {
        self.cell_rank[cell] as usize
    }

    /// max_g C_g: the proxy's step time (without the placement's once-per-step terms, which
    /// no layout changes: `simulate::redundant_grad_time`).
    pub fn step_time(&self, sh: &Shards) -> f64 {
        sh.group_cost.iter().copied().fold(0.0, f64::max)
    }

    /// The annealer's energy: max_g C_g + λ · mean_g C_g.
    pub fn energy(&self, group_cost: &[f64]) -> f64 {
        let max = group_cost.iter().copied().fold(0.0, f64::max);
        let mean = group_cost.iter().sum::<f64>() / group_cost.len() as f64;
        max + self.lambda * mean
    }
}

/// The linearised expert curve's operating point (`CostModel::expert_line`): the window's
/// routed tokens over its exchanges' expert copies, G·M exchanges per layer, each with the
/// layer's placement copies (slots holding an expert). Read only for a model with a roofline
/// floor, GEMM step or table (one pass over the demand).
fn tokens_per_copy(w: &WindowView, topo: &Topology, placement: &Placement, micro: usize) -> f64 {
    let tokens: i64 = (0..w.num_samples).map(|s| (0..w.num_layers).map(|l| w.tokens(s, l).sum()).sum::<i64>()).sum();
    let copies: usize = (0..w.num_layers).map(|l| placement.layer(l).iter().filter(|&&e| e >= 0).count()).sum();
    tokens as f64 / (topo.num_groups() as f64 * micro as f64 * copies.max(1) as f64)
}
