//! The bound's top-k sums: how many experts a rank and a node can hold in one exchange
//! ([`Holds`]), and for each row (sample, layer) an upper bound on its tokens on its k most
//! used experts for each of those k ([`LayerTops`]).
//!
//! # Why an upper bound, and which
//! The bound needs Σ_s top_k(t_s) from above (it charges the tokens outside, Σ t − top_k).
//! For every τ ≥ 0, `top_k(t) ≤ k·τ + Σ_e (t_e − τ)⁺` (the k largest are each τ plus their
//! excess over τ, and the excess of the others is ≥ 0), with equality at τ = the k-th
//! largest value: the LP dual of the top-k sum. Any τ keeps the bound true; a τ near the k-th
//! largest keeps it tight. A layer's rows are alike in shape (their k-th largest count is
//! about a fixed share of the sample's length), so each row takes τ = m·q·n_s for the
//! layer's share q (the median, over up to [`PROBES`] rows spread over the window, of the
//! exact k-th largest count over n_s) and each multiplier m of [`MULTIPLIERS`], and keeps the
//! least. One pass over a row serves the four k and both τ (integer sums, exact), in the
//! pass that reads the row anyway (`simulate`'s over the exchanges, or
//! [`super::DemandSums::of_window`]). On `flash` (window 1, seed 0) the bound is 64.355 s
//! with these sums and 64.421 s with the exact per-row selection (99.9%), which cost 0.33 s
//! of CPU in a second pass over the demand; these cost about 0.05 s (a `simulate` of the
//! window 0.14 s without a binding replica limit, 0.19 s with; 2 cores, loaded).

use rayon::prelude::*;

use crate::counts::{Count, Counts};
use crate::topology::Topology;
use crate::window::WindowView;

/// How many experts a rank or a node can hold in one exchange, the k of the bound's top-k
/// sums: a rank's `spr` slots and its `R` replica buffers, a node's `rpn` times as many
/// (capped at the window's experts: a larger k keeps every token).
#[derive(Clone, Copy)]
pub(super) struct Holds {
    /// `[rank, rank_plus, node, node_plus]`: spr, spr + R, rpn·spr, rpn·(spr + R).
    pub(super) k: [usize; 4],
}

impl Holds {
    pub(super) fn new(topo: &Topology, e_n: usize) -> Self {
        let (spr, rpn) = (topo.slots_per_rank, topo.ranks_per_group_node());
        let plus = spr.saturating_add(topo.replica_slots);
        Holds { k: [spr, plus, rpn.saturating_mul(spr), rpn.saturating_mul(plus)].map(|k| k.min(e_n)) }
    }

    /// Whether a rank's slots and buffers hold every expert: then no token has to leave
    /// for want of room (the `_plus` sums are every token) and the bound is the one without a
    /// replica limit.
    pub(super) fn unlimited(&self, e_n: usize) -> bool {
        self.k[1] >= e_n
    }

    /// The smallest k: a row on at most this many experts keeps all its tokens at every level.
    fn least(&self) -> usize {
        self.k.into_iter().min().unwrap_or(0)
    }
}

/// Rows of a layer whose exact k-th largest counts set its thresholds' share.
const PROBES: usize = 32;
/// The thresholds each row tries per k, as multiples of `q·n_s`: the layer's share itself
/// (exact for a row shaped like the median probe) and a little below it, where a row's
/// excess grows slowest. Measured on `flash` (layers 0, 5, 17), the tokens charged outside
/// the k largest: 99.4–99.8% of what the exact selection charges with 1.0 alone,
/// 99.8–99.95% with both, 99.9–99.96% with a third (0.85, 1.0, 1.15); each costs a sum per
/// row entry.
const MULTIPLIERS: [f64; 2] = [1.0, 0.9];
const TAUS: usize = 4 * MULTIPLIERS.len();

/// The thresholds of every layer of one window and topology: what the bound's top-k sums of
/// each row are computed with ([`BoundTops::row`]), by whichever pass reads the row (the
/// bound's own, or `simulate`'s, which reads the demand anyway), with the same result.
pub struct BoundTops {
    holds: Holds,
    layers: Vec<LayerTops>,
}

impl BoundTops {
    /// The thresholds for `w` on `topo` (a few rows of each layer read), or None where a
    /// rank's slots and replica buffers hold every expert (no top-k sum is needed then).
    pub fn new(w: &WindowView, topo: &Topology) -> Option<Self> {
        let holds = Holds::new(topo, w.num_experts);
        (!holds.unlimited(w.num_experts)).then(|| Self::with_holds(w, holds))
    }

    /// The thresholds for `w` and the k of `holds` (layers in parallel).
    pub(super) fn with_holds(w: &WindowView, holds: Holds) -> Self {
        BoundTops { holds, layers: (0..w.num_layers).into_par_iter().map(|l| LayerTops::new(w, l, holds)).collect() }
    }

    /// The k the sums are for: `[spr, spr + R, rpn·spr, rpn·(spr + R)]`, each at most E.
    pub fn k(&self) -> [usize; 4] {
        self.holds.k
    }

    /// Upper bounds on the tokens of row (s, l) on its k most used experts, for the four
    /// [`BoundTops::k`] in order: `t` the row, of a sample of `seq_len` tokens with `tokens`
    /// routed tokens on `experts` distinct experts (what [`super::row_sums`] returns for it).
    /// Always inlined, so a caller compiled for AVX2 (`simulate`'s pass over the demand) gets
    /// the pass so (integer sums: the same bits either way).
    #[inline(always)]
    pub fn row(&self, l: usize, t: Counts<'_>, seq_len: i64, tokens: f64, experts: usize) -> [f64; 4] {
        self.layers[l].row(t, seq_len, tokens, experts)
    }
}

/// One layer's thresholds: `share[i]` for k = `holds.k[i]`.
struct LayerTops {
    holds: Holds,
    share: [f64; 4],
}

impl LayerTops {
    /// The shares of layer `l` from up to [`PROBES`] rows spread evenly over the samples (a
    /// probe on at most the least k experts, which keeps all its tokens, sets no share).
    fn new(w: &WindowView, l: usize, holds: Holds) -> Self {
        let least = holds.least();
        let step = w.num_samples.div_ceil(PROBES).max(1);
        let mut ratios: [Vec<f64>; 4] = Default::default();
        let mut buf = vec![0i32; w.num_experts];
        // the k in descending order, each selection on the prefix the previous one left
        let mut order = [0usize, 1, 2, 3];
        order.sort_by_key(|&i| std::cmp::Reverse(holds.k[i]));
        for s in (0..w.num_samples).step_by(step) {
            w.tokens(s, l).copy_to_i32(&mut buf);
            if buf.iter().filter(|&&x| x > 0).count() <= least {
                continue;
            }
            let n = w.seq_lens[s] as f64;
            let mut prefix = buf.len();
            for &i in &order {
                let k = holds.k[i];
                // the k-th largest, at k − 1 of a descending selection
                buf[..prefix].select_nth_unstable_by(k - 1, |a, b| b.cmp(a));
                ratios[i].push(buf[k - 1] as f64 / n);
                prefix = k;
            }
        }
        let share = ratios.map(|mut r| {
            if r.is_empty() {
                return 0.0;
            }
            r.sort_unstable_by(f64::total_cmp);
            r[r.len() / 2]
        });
        LayerTops { holds, share }
    }

    /// Upper bounds on the tokens of row `t` (a sample of `seq_len` tokens with `tokens`
    /// routed tokens on `experts` distinct experts) on its k most used experts, for the four
    /// k of [`Holds`] in their order; each at most `tokens`, and exactly `tokens` for a row on
    /// at most k experts.
    #[inline(always)]
    fn row(&self, t: Counts<'_>, seq_len: i64, tokens: f64, experts: usize) -> [f64; 4] {
        if experts <= self.holds.least() {
            return [tokens; 4];
        }
        let n = seq_len as f64;
        let mut taus = [0i64; TAUS];
        for i in 0..4 {
            for (j, &m) in MULTIPLIERS.iter().enumerate() {
                // any τ >= 0 is valid; beyond the type's largest count it only loosens
                taus[i * MULTIPLIERS.len() + j] = (m * self.share[i] * n).floor().clamp(0.0, i32::MAX as f64) as i64;
            }
        }
        let excess = crate::with_counts!(t, x => excess_sums(x, &taus));
        let mut out = [tokens; 4];
        for (i, o) in out.iter_mut().enumerate() {
            let k = self.holds.k[i];
            if experts <= k {
                continue;
            }
            for j in 0..MULTIPLIERS.len() {
                let tau = taus[i * MULTIPLIERS.len() + j];
                *o = o.min((k as i64).saturating_mul(tau).saturating_add(excess[j + i * MULTIPLIERS.len()]) as f64);
            }
        }
        out
    }
}

/// `Σ_e (row[e] − τ_j)⁺` for each τ_j (>= 0, <= i32::MAX), exact: i32 partial sums over chunks
/// short enough that no partial sum can overflow (2^30 / the type's largest count entries:
/// 16 384 for uint16, 1 for int32), added into i64.
#[inline(always)]
fn excess_sums<T: Count + Into<i32>>(row: &[T], taus: &[i64; TAUS]) -> [i64; TAUS] {
    let chunk = ((1i64 << 30) / T::MAX).max(1) as usize;
    let mut total = [0i64; TAUS];
    if chunk == 1 {
        for &x in row {
            let x = x.wide();
            for (s, &tau) in total.iter_mut().zip(taus) {
                *s += (x - tau).max(0);
            }
        }
        return total;
    }
    // τ above the type's largest count: no excess (the clamp keeps the i32 arithmetic exact)
    let t32: [i32; TAUS] = taus.map(|t| t.min(T::MAX) as i32);
    for part in row.chunks(chunk) {
        let mut acc = [0i32; TAUS];
        for &x in part {
            let x: i32 = x.into();
            for (a, &tau) in acc.iter_mut().zip(&t32) {
                *a += (x - tau).max(0);
            }
        }
        for (s, a) in total.iter_mut().zip(acc) {
            *s += a as i64;
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sum of the k largest, by sorting.
    fn exact(v: &[i32], k: usize) -> i64 {
        let mut v = v.to_vec();
        v.sort_unstable_by(|a, b| b.cmp(a));
        v.iter().take(k).map(|&x| x as i64).sum()
    }

    /// Every row's bound is at least its exact top-k sum and at most its tokens, for every
    /// count type (the same bits).
    #[test]
    fn row_bounds_are_upper_bounds() {
        let mut state = 11u64;
        let mut next = |n: u64| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (state >> 33) % n
        };
        for case in 0..300 {
            let e_n = 1 + next(40) as usize;
            let s_n = 1 + next(9) as usize;
            let seq: Vec<i64> = (0..s_n).map(|_| 1 + next(300) as i64).collect();
            let tok: Vec<i32> = (0..s_n * e_n).map(|i| if next(3) == 0 { 0 } else { next(seq[i / e_n] as u64 + 1) as i32 }).collect();
            let w = WindowView::new(&seq, &tok, 1, e_n).unwrap();
            let topo =
                Topology::new(4, 4, [1, 2, 4][case % 3], 1 + next(4) as usize).unwrap().with_replica_slots(next(4) as usize).unwrap();
            let holds = Holds::new(&topo, e_n);
            let experts: Vec<usize> = (0..s_n).map(|s| tok[s * e_n..(s + 1) * e_n].iter().filter(|&&x| x > 0).count()).collect();
            let tops = LayerTops::new(&w, 0, holds);
            let narrow: Vec<u16> = tok.iter().map(|&x| x as u16).collect();
            for s in 0..s_n {
                let row = &tok[s * e_n..(s + 1) * e_n];
                let tokens = row.iter().map(|&x| x as f64).sum::<f64>();
                let got = tops.row(Counts::I32(row), seq[s], tokens, experts[s]);
                let same = tops.row(Counts::U16(&narrow[s * e_n..(s + 1) * e_n]), seq[s], tokens, experts[s]);
                assert_eq!(got, same, "case {case}");
                for (i, &k) in holds.k.iter().enumerate() {
                    assert!(got[i] >= exact(row, k) as f64 && got[i] <= tokens, "case {case} k {k}: {} vs {}", got[i], exact(row, k));
                }
            }
        }
    }
}
