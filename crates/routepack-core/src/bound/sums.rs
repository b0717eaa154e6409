//! What the lower bound reads of the demand ([`DemandSums`]), and the one per-row function
//! that gathers most of it ([`row_sums`]; the top-k sums are [`BoundTops::row`]), for the
//! bound's own pass and for a caller that reads the demand anyway (`simulate`).

use rayon::prelude::*;

use super::tops::BoundTops;
use crate::window::WindowView;

/// What the bound reads from the demand: every row's routed tokens, distinct experts and (with
/// a replica limit that binds) top-k sums, and every expert's total and largest share.
/// Whoever reads the demand anyway can gather it on the way ([`DemandSums::set_row`],
/// [`DemandSums::set_row_tops`], [`DemandSums::add_layer_part`]): `simulate` does, while it
/// builds the exchanges' origins, so the demand is read once for both.
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
    /// `[L * S]` layer-major, where gathered: each row's [`BoundTops::row`] for the top-k sums'
    /// k `tops_k` (empty: not gathered; the bound then reads the demand again for them).
    pub(super) row_tops: Vec<[f64; 4]>,
    pub(super) tops_k: [usize; 4],
}

/// One layer's part of [`DemandSums::of_window`]: its rows' (tokens, experts, top-k sums) by
/// sample, its experts' totals and largest shares.
type LayerPart = (Vec<(i64, usize, [f64; 4])>, Vec<i64>, Vec<f64>);

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
            row_tops: Vec::new(),
            tops_k: [0; 4],
        }
    }

    /// All zero as [`DemandSums::new`], with room for every row's top-k sums under `tops`
    /// ([`DemandSums::set_row_tops`]; None: none gathered).
    pub fn with_tops(num_samples: usize, num_layers: usize, num_experts: usize, tops: Option<&BoundTops>) -> Self {
        let mut out = Self::new(num_samples, num_layers, num_experts);
        if let Some(t) = tops {
            out.row_tops = vec![[0.0; 4]; num_layers * num_samples];
            out.tops_k = t.k();
        }
        out
    }

    /// The sums of a whole window, layers in parallel (what [`lower_bound_time`] reads), with
    /// every row's top-k sums under `tops` where given.
    pub fn of_window(w: &WindowView, tops: Option<&BoundTops>) -> Self {
        let (s_n, l_n, e_n) = (w.num_samples, w.num_layers, w.num_experts);
        let mut out = Self::with_tops(s_n, l_n, e_n, tops);
        let parts: Vec<LayerPart> = (0..l_n)
            .into_par_iter()
            .map(|l| {
                let mut totals = vec![0i64; e_n];
                let mut share = vec![0.0f64; e_n];
                let rows = (0..s_n)
                    .map(|s| {
                        let row = w.tokens(s, l);
                        let (t, x) = crate::with_counts!(row, t => row_sums(t, w.seq_lens[s], &mut totals, &mut share));
                        let top = tops.map_or([0.0; 4], |b| b.row(l, row, w.seq_lens[s], t as f64, x));
                        (t, x, top)
                    })
                    .collect();
                (rows, totals, share)
            })
            .collect();
        for (l, (rows, totals, share)) in parts.into_iter().enumerate() {
            for (s, (t, x, top)) in rows.into_iter().enumerate() {
                out.row_tokens[l * s_n + s] = t;
                out.row_experts[l * s_n + s] = x;
                if tops.is_some() {
                    out.row_tops[l * s_n + s] = top;
                }
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

    /// Records row (sample `s`, layer `l`)'s top-k sums (what [`BoundTops::row`] returns for
    /// it under the `tops` this was built [`DemandSums::with_tops`]).
    #[inline]
    pub fn set_row_tops(&mut self, s: usize, l: usize, tops: [f64; 4]) {
        self.row_tops[l * self.num_samples + s] = tops;
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
