//! One EP rank's time in one exchange (EP group, microbatch, layer), and the exchange's time
//! from its ranks: the one place the cost model's terms are combined. Every pricer calls it,
//! in one of three views of a rank's expert work:
//! * **exact**: [`CostModel::rank_expert_time`] of the rank's tokens, active experts and the
//!   sum of their [`CostModel::weights_bound_extra`] (roofline floor, GEMM step, table), plus
//!   its kernel call; then [`LayerCost::new`] from the exchange's slowest ranks and
//!   [`LayerCost::total`]. The simulator (`simulate::ExchangePricer`) and replication's
//!   incremental state price with these, so their values are the same bits.
//! * **lower bound**: the linear part [`CostModel::expert_time`] (`c_tok · tokens + c_exp ·
//!   active`); the extras and the call are >= 0, so what bounds it bounds the exact term. The
//!   step-time bound (`crate::bound`), the `ideal` reference and replication's pruning bound
//!   use it.
//! * **linearised**: [`CostModel::expert_line`], the exact curve of one active expert
//!   replaced by a line (seconds per token, seconds per active expert) fitted around an
//!   operating point, the mean tokens of one expert copy in one exchange. The proxies that
//!   count a rank's tokens but not each expert's (the layout proxy, placement's predictor and
//!   its copy weights) price a rank with it, so that under a calibrated model (`c_weights`,
//!   `c_gemm`, `expert_table` set) they optimise the curve `simulate` scores; for the linear
//!   model the line is `(c_tok, c_exp)` exactly and they are what they were.

use super::CostModel;

/// The expert curve of one pass as a line: one active expert with t tokens on a rank costs
/// about `per_expert + per_token · t` ([`CostModel::expert_line`]); both are >= 0, so a rank's
/// linearised time never falls as its tokens or experts grow. A rank's kernel call (`c_call`)
/// and an exchange's all-to-all latencies are not in it: every layout and placement that
/// gives each rank tokens pays them alike, so the proxies leave them out.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ExpertLine {
    /// Seconds per routed token, one pass: `c_tok` plus the slope of the extras around the
    /// operating point.
    pub per_token: f64,
    /// Seconds per active expert, one pass: `c_exp` plus what the extras add at the operating
    /// point beyond the slope's share.
    pub per_expert: f64,
}

impl ExpertLine {
    /// One rank's linearised expert time, one pass: `per_token · tokens + per_expert · active`.
    #[inline]
    pub fn time(&self, tokens: f64, active_experts: f64) -> f64 {
        self.per_token * tokens + self.per_expert * active_experts
    }
}

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

    /// One EP rank's whole expert time in one pass, X of docs/design.md: the linear term
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

    /// One active expert's exact time with `tokens` (> 0) tokens on a rank, one pass, without
    /// the rank's kernel call: `c_exp + c_tok · tokens + weights_bound_extra(tokens)` (for the
    /// linear model, the extra is not added: `c_exp + c_tok · tokens`).
    #[inline]
    pub fn active_expert_time(&self, tokens: f64) -> f64 {
        let x = self.expert_time(tokens, 1.0);
        if self.roofline() {
            x + self.weights_bound_extra(tokens)
        } else {
            x
        }
    }

    /// The expert curve linearised around `tokens_per_expert` (t0, the mean tokens of one
    /// active expert copy in one exchange), the proxies' view of it ([`ExpertLine`]). For the
    /// linear model (no [`CostModel::roofline`]) it is `(c_tok, c_exp)`, bit for bit, whatever
    /// t0. Otherwise, with f(t) = `c_tok · t + weights_bound_extra(t)` (an active expert's time
    /// beyond `c_exp`, [`CostModel::active_expert_time`]): the slope is the
    /// chord of f over [t0 / 2, 2 · t0] (taken from 1 token up and at least one token wide:
    /// the tokens one expert's copies typically hold around the mean, and a chord follows a
    /// roofline's knee or a table's knots where a tangent would jump), at least 0; the
    /// per-expert cost is what makes the line meet the curve at t0, `max(c_exp + f(t0) −
    /// slope · t0, 0)`. Below a roofline's knee the slope is 0 and an expert costs `c_exp + c_weights`: a proxy then
    /// balances active experts, not tokens, as the simulator's step does. A t0 that is not
    /// finite or below 1 is taken as 1.
    pub fn expert_line(&self, tokens_per_expert: f64) -> ExpertLine {
        if !self.roofline() {
            return ExpertLine { per_token: self.c_tok, per_expert: self.c_exp };
        }
        let t0 = if tokens_per_expert.is_finite() { tokens_per_expert.max(1.0) } else { 1.0 };
        let f = |t: f64| self.c_tok * t + self.weights_bound_extra(t);
        let lo = (t0 / 2.0).max(1.0);
        let hi = (2.0 * t0).max(lo + 1.0);
        let per_token = ((f(hi) - f(lo)) / (hi - lo)).max(0.0);
        let per_expert = (self.c_exp + f(t0) - per_token * t0).max(0.0);
        ExpertLine { per_token, per_expert }
    }
}

/// Cost of one exchange (group, microbatch, layer), split into its parts (all passes
/// included); [`LayerCost::new`] combines them, [`LayerCost::total`] sums them.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LayerCost {
    /// Seconds: 3 × the slowest rank's one-pass attention (`COMPUTE_PASSES · attn_max`).
    pub attention: f64,
    /// Seconds of dispatch + combine, forward and backward: their link time
    /// (`CostModel::all_to_all_time`) plus their latencies (`CostModel::all_to_all_latency`).
    pub all_to_all: f64,
    /// Seconds: 3 × the busiest EP rank's expert time (`COMPUTE_PASSES · max_p X`).
    pub expert: f64,
    /// Seconds of replica broadcast and gradient reduction not hidden behind attention
    /// (`CostModel::exposed_replication`); 0 without replicas.
    pub replication: f64,
    /// Seconds of the all-to-all hidden behind attention and expert work
    /// (`CostModel::hidden_communication`); 0 without overlap.
    pub hidden: f64,
    /// Max / mean over EP ranks of the expert tokens they compute (1.0 when there are none);
    /// a figure of balance, not a time, so not part of [`LayerCost::total`].
    pub imbalance: f64,
}

impl LayerCost {
    /// The exchange's cost from its one-pass maxima: the slowest rank's attention
    /// `attn_max` and expert time `x_max`, the all-to-all's link time `all_to_all` (all
    /// passes; its latencies, `CostModel::all_to_all_latency`, are added here) and the
    /// exposed `replication`. The one place the parts are put together (the simulator and
    /// replication's incremental state both call it).
    pub fn new(cost: &CostModel, attn_max: f64, x_max: f64, all_to_all: f64, replication: f64, imbalance: f64) -> Self {
        // every exchange runs its all-to-alls, whatever they move (+ 0.0 keeps the bits)
        let all_to_all = all_to_all + cost.all_to_all_latency();
        let passes = cost.compute_passes();
        let (attention, expert) = (passes * attn_max, passes * x_max);
        let hidden = cost.hidden_communication(attention + expert, all_to_all);
        LayerCost { attention, all_to_all, expert, replication, hidden, imbalance }
    }

    /// Seconds of the exchange, T: attention + all-to-all + expert + replication − hidden.
    /// With something hidden that is `max(attention + expert, all_to_all) + replication`,
    /// computed as the max so that T never falls when a part grows (rounding included: the
    /// planners' bounds on T rely on it); without, the plain sum, bit for bit as before overlap.
    pub fn total(&self) -> f64 {
        if self.hidden > 0.0 {
            (self.attention + self.expert).max(self.all_to_all) + self.replication
        } else {
            self.attention + self.all_to_all + self.expert + self.replication
        }
    }
}

/// What the proxies' ranking tests share: a calibrated model and a rank correlation.
#[cfg(test)]
pub(crate) mod test_support {
    use super::CostModel;

    /// `CostModel::for_tests` with the curve a calibration fits (the shape of
    /// `docs/calibrate_tiny_cpu.json`'s expert kernel, a GPU's weights-bound floor): a
    /// roofline knee at 2,000 tokens per expert, a GEMM step, a table that climbs from 1 to
    /// 16 tokens and falls back by 4,096, and a kernel call per rank. Its per-token compute is
    /// dear next to the all-to-all, so a proxy that prices tokens at `c_tok` weighs what the
    /// step does not pay below the knee.
    pub(crate) fn calibrated(layers: usize) -> CostModel {
        let base = CostModel::for_tests(layers);
        let c_tok = 2e-8;
        CostModel {
            c_tok,
            c_weights: 2_000.0 * c_tok,
            c_gemm: 2e-6,
            expert_table: vec![(1.0, 0.0), (4.0, 4e-6), (16.0, 8e-6), (4096.0, 0.0)],
            c_call: 5e-6,
            ..base
        }
    }

    /// Spearman's rank correlation of `a` and `b` (ties by their mean rank).
    pub(crate) fn spearman(a: &[f64], b: &[f64]) -> f64 {
        fn ranks(v: &[f64]) -> Vec<f64> {
            let mut idx: Vec<usize> = (0..v.len()).collect();
            idx.sort_by(|&i, &j| v[i].total_cmp(&v[j]));
            let mut r = vec![0.0; v.len()];
            let mut i = 0;
            while i < idx.len() {
                let mut j = i;
                while j + 1 < idx.len() && v[idx[j + 1]] == v[idx[i]] {
                    j += 1;
                }
                for &k in &idx[i..=j] {
                    r[k] = (i + j) as f64 / 2.0;
                }
                i = j + 1;
            }
            r
        }
        let (ra, rb) = (ranks(a), ranks(b));
        let n = a.len() as f64;
        let (ma, mb) = (ra.iter().sum::<f64>() / n, rb.iter().sum::<f64>() / n);
        let cov: f64 = ra.iter().zip(&rb).map(|(x, y)| (x - ma) * (y - mb)).sum();
        let va: f64 = ra.iter().map(|x| (x - ma) * (x - ma)).sum();
        let vb: f64 = rb.iter().map(|y| (y - mb) * (y - mb)).sum();
        cov / (va * vb).sqrt()
    }
}
