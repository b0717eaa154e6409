//! Phase 3, microbatch fluctuation: [`Pack::improve_fluct`] swaps items so that bins' loads
//! spread less chunk by chunk (lower Σ_bins |V_bin|²), co-locating experts whose demand is
//! anti-correlated, without lifting any bin's aggregate load above a cap.

use super::pack::Pack;
use super::simd::{Pricing, Scalar};
use super::weight_search::{count_at_most, count_below, seek};
use crate::cpu::Avx2;

impl<'a> Pack<'a> {
    /// Phase 3: first-improvement passes over the items, heaviest first; for each, the swap
    /// that lowers Σ_bins |V_bin|² the most among partners whose exchange keeps both bins'
    /// aggregate loads at most max(cap_load, their current load) (in each other bin, a window
    /// of partner weights: over few bins found by bisection in the bin, over many bins all
    /// windows at once as one range of the problem's descending weights). Stops when a pass
    /// finds nothing (returns true), after `max_swaps` swaps or when `evals` (candidate pairs
    /// priced, each O(dim), plus one per window searched: one per other bin over few bins,
    /// one per item over many) reaches `max_evals` (returns false).
    pub fn improve_fluct(&mut self, cap_load: f64, max_swaps: usize, evals: &mut usize, max_evals: usize) -> bool {
        #[cfg(target_arch = "x86_64")]
        if let Some(cpu) = Avx2::detect() {
            // SAFETY: the token exists, so the CPU has AVX2 (improve_fluct_avx2's precondition);
            // its pricing gives the scalar bits (see `simd`), so the result is the same
            return unsafe { self.improve_fluct_avx2(cpu, cap_load, max_swaps, evals, max_evals) };
        }
        self.improve_fluct_body(Scalar, cap_load, max_swaps, evals, max_evals)
    }

    /// The whole search compiled for AVX2, so that pricing inlines into its loop.
    ///
    /// # Safety
    /// The CPU must support AVX2 (`cpu` is the token that says so).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn improve_fluct_avx2(&mut self, cpu: Avx2, cap_load: f64, max_swaps: usize, evals: &mut usize, max_evals: usize) -> bool {
        self.improve_fluct_body(cpu, cap_load, max_swaps, evals, max_evals)
    }

    /// The search, pricing swaps with `pricing` (the [`Avx2`] token only inside
    /// [`Pack::improve_fluct_avx2`], whose AVX2 build it is inlined into).
    #[inline(always)]
    pub(super) fn improve_fluct_body<P: Pricing>(
        &mut self,
        pricing: P,
        cap_load: f64,
        max_swaps: usize,
        evals: &mut usize,
        max_evals: usize,
    ) -> bool {
        let p = self.p;
        let dim = p.dim;
        if dim == 0 || p.bins < 2 {
            return true;
        }
        if *evals >= max_evals || max_swaps == 0 {
            return false;
        }
        let w = p.weight;
        let (order, norm) = (p.order, p.norm);
        // weights in `order` (descending): the partners of every bin in one range
        let desc: Vec<f64> = order.iter().map(|&i| w[i as usize]).collect();
        // room of each bin under the cap, and the two largest (changed by swaps only)
        let mut head: Vec<f64> = self.load.iter().map(|&l| cap_load.max(l) - l).collect();
        let top2 = |head: &[f64]| {
            let (mut b1, mut h1, mut h2) = (usize::MAX, f64::NEG_INFINITY, f64::NEG_INFINITY);
            for (b, &h) in head.iter().enumerate() {
                if h > h1 {
                    (h2, h1, b1) = (h1, h, b);
                } else if h > h2 {
                    h2 = h;
                }
            }
            (b1, h1, h2)
        };
        let mut roomiest = top2(&head);
        let (mut lo, mut hi) = (0usize, 0usize);
        // few bins of many items (nodes): each bin's own window, found in its sorted members,
        // holds the partners without the wide range's misses (so those swaps keep members)
        let by_bin = p.bins <= 4;
        if by_bin {
            self.fresh_members();
        }
        let mut done = 0;
        loop {
            let mut improved = false;
            for i in order.iter().map(|&i| i as usize) {
                if done >= max_swaps || *evals >= max_evals {
                    return false;
                }
                let a = self.bin_of[i];
                let widest = if roomiest.0 == a { roomiest.2 } else { roomiest.1 };
                let (wi, vi) = (w[i], p.v(i));
                let va = &self.vl32[a * dim..(a + 1) * dim];
                // partners j in bin b with w_i − head_b <= w_j <= w_i + head_a keep both bins
                // in cap: over few bins, a window in each other bin (one eval each); over
                // many, one range of the descending weights holds them for every b, each then
                // checked against its own bin's head (one eval: counting it as one window per
                // other bin, as the bin-by-bin search was counted, spent most of an all-ranks
                // budget of 32 bins on windows never searched)
                *evals += if by_bin { p.bins - 1 } else { 1 };
                let mut best: Option<(f64, usize, usize)> = None;
                if by_bin {
                    for b in (0..p.bins).filter(|&b| b != a) {
                        let (sb, wb) = (&self.members[b], &self.wts[b]);
                        let l = count_below(wb, wi - head[b]);
                        let h = l + count_at_most(&wb[l..], wi + head[a]);
                        let vb = &self.vl32[b * dim..(b + 1) * dim];
                        for &j in &sb[l..h] {
                            if !self.can_swap(i, j) {
                                continue;
                            }
                            *evals += 1;
                            let delta = 2.0 * pricing.swap_delta(va, vb, vi, p.v(j));
                            if delta < -1e-9 * (norm[i] + norm[j]) && best.is_none_or(|(bd, _, _)| delta < bd) {
                                best = Some((delta, b, j));
                            }
                        }
                    }
                } else {
                    // successive items are close in weight: search from the last range
                    let (t_lo, t_hi) = (wi + head[a], wi - widest);
                    lo = seek(&desc, lo, |x| x > t_lo);
                    hi = lo.max(seek(&desc, hi, |x| x >= t_hi));
                    // the best candidate: lowest change, ties to the lowest (bin, weight,
                    // index), the first a bin-by-bin search in ascending weights would meet
                    for &j in &order[lo..hi] {
                        let j = j as usize;
                        let b = self.bin_of[j];
                        if b == a || w[j] < wi - head[b] || !self.can_swap(i, j) {
                            continue;
                        }
                        *evals += 1;
                        let vb = &self.vl32[b * dim..(b + 1) * dim];
                        let delta = 2.0 * pricing.swap_delta(va, vb, vi, p.v(j));
                        if delta < -1e-9 * (norm[i] + norm[j])
                            && best.is_none_or(|(bd, bb, bj)| {
                                delta < bd || (delta == bd && (b, w[j].total_cmp(&w[bj]), j) < (bb, std::cmp::Ordering::Equal, bj))
                            })
                        {
                            best = Some((delta, b, j));
                        }
                    }
                }
                if let Some((_, b, j)) = best {
                    // the bin-by-bin search reads members, so it keeps them current; the
                    // range search leaves them to be rebuilt once
                    if by_bin {
                        self.swap(i, j);
                    } else {
                        self.swap_loads(i, j);
                    }
                    for k in [a, b] {
                        head[k] = cap_load.max(self.load[k]) - self.load[k];
                    }
                    roomiest = top2(&head);
                    done += 1;
                    improved = true;
                }
            }
            if !improved {
                return true;
            }
        }
    }
}
