//! What the lower bound reads of the demand in its first pass ([`DemandSums`]), and the one
//! per-row function that gathers it ([`row_sums`]), for the bound's own pass and for a caller
//! that reads the demand anyway (`simulate`).

use rayon::prelude::*;

use crate::window::WindowView;

/// What the bound's first pass reads from the demand (the top-k sums aside): every row's
/// routed tokens and distinct experts and every expert's total and largest share. Whoever
/// reads the demand anyway can gather it on the way ([`DemandSums::add_row`]): `simulate`
/// does, while it builds the exchanges' origins, so the demand is read once for both.
#[derive(Clone, Debug, PartialEq)]
pub struct DemandSums {
    pub(super) num_samples: usize,
    pub(super) num_experts: usize,
    /// `[L * S]` layer-major: Σ_e tokens of sample s in layer l.
    pub(super) row_tokens: Vec<i64>,
    /// `[L * S]` layer-major: distinct experts sample s uses in layer l.
    pub(super) row_experts: Vec<usize>,
    /// `[L * E]` Σ_s tokens of expert e in layer l.
    pub(super) expert_tokens: Vec<i64>,
    /// `[L * E]` max_s tokens(s, l, e) · (1 / n_s).
    pub(super) expert_share: Vec<f64>,
}

/// One layer's part of [`DemandSums::of_window`]: its rows' (tokens, experts) by sample, its
/// experts' totals and largest shares.
type LayerPart = (Vec<(i64, usize)>, Vec<i64>, Vec<f64>);

impl DemandSums {
    /// All zero, for a window of `num_samples` × `num_layers` × `num_experts`.
    pub fn new(num_samples: usize, num_layers: usize, num_experts: usize) -> Self {
        Self {
            num_samples,
            num_experts,
            row_tokens: vec![0; num_layers * num_samples],
            row_experts: vec![0; num_layers * num_samples],
            expert_tokens: vec![0; num_layers * num_experts],
            expert_share: vec![0.0; num_layers * num_experts],
        }
    }

    /// The sums of a whole window, layers in parallel (what [`lower_bound_time`] reads).
    pub fn of_window(w: &WindowView) -> Self {
        let (s_n, l_n, e_n) = (w.num_samples, w.num_layers, w.num_experts);
        let mut out = Self::new(s_n, l_n, e_n);
        let parts: Vec<LayerPart> = (0..l_n)
            .into_par_iter()
            .map(|l| {
                let mut totals = vec![0i64; e_n];
                let mut share = vec![0.0f64; e_n];
                let rows = (0..s_n)
                    .map(|s| crate::with_counts!(w.tokens(s, l), t => row_sums(t, w.seq_lens[s], &mut totals, &mut share)))
                    .collect();
                (rows, totals, share)
            })
            .collect();
        for (l, (rows, totals, share)) in parts.into_iter().enumerate() {
            for (s, (t, x)) in rows.into_iter().enumerate() {
                out.row_tokens[l * s_n + s] = t;
                out.row_experts[l * s_n + s] = x;
            }
            out.expert_tokens[l * e_n..(l + 1) * e_n].copy_from_slice(&totals);
            out.expert_share[l * e_n..(l + 1) * e_n].copy_from_slice(&share);
        }
        out
    }

    /// Records row (sample `s`, layer `l`): its Σ_e tokens `tokens` and `experts` distinct
    /// experts (what [`row_sums`] returns for it).
    #[inline]
    pub fn set_row(&mut self, s: usize, l: usize, tokens: i64, experts: usize) {
        self.row_tokens[l * self.num_samples + s] = tokens;
        self.row_experts[l * self.num_samples + s] = experts;
    }

    /// Adds a part of layer `l`'s expert sums gathered apart: `totals` `[E]` Σ tokens and
    /// `share` `[E]` largest share of some samples (integer sums and maxima: any order, the
    /// same result).
    pub fn add_layer_part(&mut self, l: usize, totals: &[i64], share: &[f64]) {
        let e_n = self.num_experts;
        for (t, &x) in self.expert_tokens[l * e_n..(l + 1) * e_n].iter_mut().zip(totals) {
            *t += x;
        }
        for (t, &x) in self.expert_share[l * e_n..(l + 1) * e_n].iter_mut().zip(share) {
            *t = t.max(x);
        }
    }
}

/// One row's part of [`DemandSums`]: adds `row` `[E]` (the demand of a sample of `seq_len`
/// tokens in one layer) to `totals` `[E]` and raises `share` `[E]` to its `x / n`; returns
/// (Σ_e tokens, distinct experts). Always inlined, so a caller compiled for AVX2 gets it so.
#[inline(always)]
pub fn row_sums<T: Copy + Into<i64>>(row: &[T], seq_len: i64, totals: &mut [i64], share: &mut [f64]) -> (i64, usize) {
    // integer accumulators: every count is an integer below 2^53, so their f64 sums are exact
    // in any order and equal to these; integers let the loop vectorise
    let (mut tok, mut experts) = (0i64, 0usize);
    for (et, &x) in totals.iter_mut().zip(row) {
        let x: i64 = x.into();
        tok += x;
        experts += usize::from(x > 0);
        *et += x;
    }
    let inv = 1.0 / seq_len as f64;
    for (sh, &x) in share.iter_mut().zip(row) {
        let x: i64 = x.into();
        *sh = sh.max(x as f64 * inv);
    }
    (tok, experts)
}
