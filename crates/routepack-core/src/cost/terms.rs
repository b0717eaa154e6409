//! The terms of DESIGN.md's cost model, written once. `simulate` composes them exactly; every
//! planner proxy (layout, replication, placement prediction, the `ideal` reference) calls the
//! same methods, so a change to a term changes every user of it. Where a proxy approximates
//! (for instance placement's uniform all-to-all), the approximation is named in that proxy's
//! docs together with the test that ties it to `simulate`.

use super::links::LinkBytes;
use super::{CostModel, Overlap};
use crate::topology::Topology;

impl CostModel {
    /// Expert work of one EP rank in one pass, its linear part: `c_tok · tokens + c_exp ·
    /// active experts`. With `c_weights > 0` or `c_gemm > 0` each active expert adds
    /// [`CostModel::weights_bound_extra`] of its own tokens.
    #[inline]
    pub fn expert_time(&self, tokens: f64, active_experts: f64) -> f64 {
        self.c_tok * tokens + self.c_exp * active_experts
    }

    /// Whether the expert-time curve has a per-expert part beyond the linear term (a
    /// weights-bound floor, `c_weights > 0`, a GEMM step, `c_gemm > 0`, or a table,
    /// `expert_table` not empty); without one,
    /// [`CostModel::expert_time`] is the whole expert term (and the linear model's bits stay
    /// as they were: callers add the extra only when this is true).
    #[inline]
    pub fn roofline(&self) -> bool {
        self.c_weights > 0.0 || self.c_gemm > 0.0 || !self.expert_table.is_empty()
    }

    /// What one active expert with `tokens` (> 0) tokens on a rank costs beyond the linear
    /// term, one pass: `(c_weights − c_tok · tokens)⁺ + c_gemm · [tokens ≥ 2] + table(tokens)`,
    /// so that the expert's time is `c_exp + max(c_tok · tokens, c_weights) + c_gemm ·
    /// [tokens ≥ 2] + table(tokens)`: weights-bound below the knee `c_weights / c_tok`,
    /// FLOP-bound above it, a matrix-matrix kernel's fixed cost from 2 tokens on, and what the
    /// tabulated part adds ([`CostModel::table_extra`]). Never negative, so every bound on the
    /// linear term bounds this one; but with `c_gemm > 0` or a table it is not monotone in
    /// tokens (it steps up at 2), so a bound may not assume fewer tokens cost no less.
    #[inline]
    pub fn weights_bound_extra(&self, tokens: f64) -> f64 {
        let floor = (self.c_weights - self.c_tok * tokens).max(0.0);
        let stepped = if tokens >= 2.0 { floor + self.c_gemm } else { floor };
        // (added only where there is a table, so a model without one keeps its bits)
        if self.expert_table.is_empty() {
            stepped
        } else {
            stepped + self.table_extra(tokens)
        }
    }

    /// `expert_table` at `tokens` tokens per expert: the knots' seconds linearly interpolated
    /// between the two knots around it, the first knot's below the first and the last's above
    /// the last (0 without knots).
    #[inline]
    pub fn table_extra(&self, tokens: f64) -> f64 {
        let knots = &self.expert_table;
        // the first knot at or above `tokens` (knots' tokens increase: `check`)
        let k = knots.partition_point(|&(t, _)| t < tokens);
        match (k, knots.get(k)) {
            (_, None) => knots.last().map_or(0.0, |&(_, s)| s),
            (0, Some(&(_, s))) => s,
            (_, Some(&(t1, s1))) if t1 == tokens => s1,
            (_, Some(&(t1, s1))) => {
                let (t0, s0) = knots[k - 1];
                s0 + (s1 - s0) * (tokens - t0) / (t1 - t0)
            }
        }
    }

    /// Seconds of a rank's grouped expert kernel call in one pass: `c_call` where the rank
    /// computes `tokens` > 0, else 0 (a rank without tokens calls no kernel).
    #[inline]
    pub fn call_time(&self, tokens: f64) -> f64 {
        if tokens > 0.0 {
            self.c_call
        } else {
            0.0
        }
    }

    /// One EP rank's whole expert time in one pass, X of DESIGN.md: the linear term
    /// ([`CostModel::expert_time`]), plus `extra`, the sum of its active experts'
    /// [`CostModel::weights_bound_extra`], where the model has one ([`CostModel::roofline`]),
    /// plus its kernel call ([`CostModel::call_time`]). The simulator and replication's exact
    /// state both price a rank with it, so their values are the same bits; with the options
    /// at 0 it is `expert_time` exactly (the extra is not added, and adding a zero call keeps
    /// a non-negative sum's bits).
    #[inline]
    pub fn rank_expert_time(&self, tokens: f64, active_experts: f64, extra: f64) -> f64 {
        let x = self.expert_time(tokens, active_experts);
        let x = if self.roofline() { x + extra } else { x };
        x + self.call_time(tokens)
    }

    /// Seconds of an exchange's communication that its computation hides, given its
    /// compute (attention + expert work, all passes) and its all-to-all (all passes):
    /// 0 without overlap; `min(compute, all_to_all)` under [`Overlap::DispatchCombine`],
    /// so that `compute + all_to_all − hidden = max(compute, all_to_all)`.
    #[inline]
    pub fn hidden_communication(&self, compute: f64, all_to_all: f64) -> f64 {
        match self.overlap {
            Overlap::None => 0.0,
            Overlap::DispatchCombine => compute.min(all_to_all),
        }
    }

    /// All-to-all time of one exchange (EP group, step, layer), given the dispatch bytes each
    /// rank sends and receives: the slowest rank's link time, twice (dispatch and combine) per
    /// communication pass (forward and backward).
    #[inline]
    pub(crate) fn all_to_all_time(&self, dispatch: &[LinkBytes]) -> f64 {
        self.all_to_all_of_link_time(LinkBytes::time(dispatch, self))
    }

    /// Seconds of an exchange's all-to-all latencies: `a2a_latency` for each of its
    /// all-to-alls (dispatch and combine, once per communication pass), whatever they move.
    /// [`crate::simulate::LayerCost::new`] adds it to the link time of every exchange.
    #[inline]
    pub fn all_to_all_latency(&self) -> f64 {
        2.0 * self.comm_passes() * self.a2a_latency
    }

    /// All-to-all time from the slowest rank's one-way dispatch link time: dispatch and
    /// combine, forward and backward (the link part: the latencies are
    /// [`CostModel::all_to_all_latency`]).
    #[inline]
    pub fn all_to_all_of_link_time(&self, link_time: f64) -> f64 {
        2.0 * self.comm_passes() * link_time
    }

    /// Bytes an exchange's all-to-all moves in the cost model's count, given the bytes its
    /// dispatch sends (summed over ranks): dispatch and combine, forward and backward, the
    /// same multiplier as [`CostModel::all_to_all_of_link_time`] puts on the time.
    #[inline]
    pub fn all_to_all_bytes(&self, dispatch_bytes: f64) -> f64 {
        2.0 * self.comm_passes() * dispatch_bytes
    }

    /// Attention/dense work of layer l of a group of samples in one pass, given their
    /// `Σ n` (`lin`) and `Σ n²` (`quad`): what one rank's cell costs.
    #[inline]
    pub fn attention_of_sums(&self, l: usize, lin: f64, quad: f64) -> f64 {
        self.a_lin * lin + self.a_quad[l] * quad
    }

    /// Seconds per byte a rank sends when its traffic is spread uniformly over the EP group:
    /// the share `(ranks per node − 1) / ep` goes over the intra-node link, the rest
    /// `(ep − ranks per node) / ep` between nodes. The uniform-traffic approximation of the
    /// `ideal` reference and of placement's time predictor.
    #[inline]
    pub fn uniform_seconds_per_byte(&self, topo: &Topology) -> f64 {
        let (ep, rpn) = (topo.ep as f64, topo.ranks_per_group_node() as f64);
        (rpn - 1.0) / ep / self.bw_intra + (ep - rpn) / ep / self.bw_inter
    }

    /// Replication traffic not hidden by the layer's attention: the forward weight copies
    /// (`fwd` seconds) overlap one attention pass, the backward gradient reduction (`bwd`)
    /// overlaps the two backward attention passes.
    #[inline]
    pub fn exposed_replication(&self, fwd: f64, bwd: f64, attention_max: f64) -> f64 {
        (fwd - attention_max).max(0.0) + (bwd - 2.0 * attention_max).max(0.0)
    }

    /// Seconds of summing `redundant` experts' fp32 gradients (`expert_grad_bytes` each) over
    /// the EP group, once per step: what `routepack.torch.slot_link` does in the backward of
    /// the step's last microbatch for every expert a placement holds in more than one slot
    /// (one all-reduce a layer, summed here over layers). Priced as a ring all-reduce: every
    /// rank sends and receives `2·(ep−1)/ep` of the bytes, over the inter-node link where the
    /// group spans nodes (the ring's slowest hop), else inside the node (at `bw_reduce` where
    /// it is set, else `bw_intra`); exposed (it sits at
    /// the end of the backward, where nothing of the step is left to hide it behind).
    #[inline]
    pub fn redundant_grad_time(&self, redundant: f64, topo: &Topology) -> f64 {
        let ep = topo.ep as f64;
        if topo.ep < 2 || redundant <= 0.0 {
            return 0.0;
        }
        let bytes = 2.0 * (ep - 1.0) / ep * redundant * self.expert_grad_bytes;
        let same_node = topo.nodes_per_group() < 2;
        if same_node && self.bw_reduce > 0.0 {
            bytes / self.bw_reduce
        } else {
            self.link_time(bytes, same_node)
        }
    }
}
