//! Phase 4, tightening: after a fluctuation pass allowed above the balanced maximum,
//! [`Pack::tighten`] brings the heaviest bin back to the target with the swaps that raise
//! Σ|V|² least, handing over to the min-max search when no single swap reaches the target.

use super::minmax::SETTLING_SPREADS;
use super::pack::Pack;
use super::simd::{Pricing, Scalar};
use super::weight_search::{count_at_most, count_below};
use crate::cpu::Avx2;

impl<'a> Pack<'a> {
    /// Phase 4, after a fluctuation phase that was allowed above the balanced maximum: brings
    /// the heaviest bin back to `target` with the swaps that hurt Σ|V|² least. For the heaviest
    /// bin a and every other bin b, the swaps that put both at or below `target` (partner
    /// weights in a window found by bisection) are priced by their change of Σ|V|²; the
    /// cheapest is applied. When no such swap exists, or once `evals` (candidates priced plus
    /// windows searched) has reached `max_evals`, [`Pack::improve_max`] finishes the job.
    /// Stops at the target, when nothing lowers the maximum, or after `max_swaps` swaps (then
    /// returns false).
    pub fn tighten(&mut self, target: f64, max_swaps: usize, evals: &mut usize, max_evals: usize) -> bool {
        #[cfg(target_arch = "x86_64")]
        if let Some(cpu) = Avx2::detect() {
            // SAFETY: the token exists, so the CPU has AVX2 (tighten_avx2's precondition);
            // its pricing gives the scalar bits (see `simd`), so the result is the same
            return unsafe { self.tighten_avx2(cpu, target, max_swaps, evals, max_evals) };
        }
        self.tighten_body(Scalar, target, max_swaps, evals, max_evals)
    }

    /// The whole search compiled for AVX2, so that pricing inlines into its loop.
    ///
    /// # Safety
    /// The CPU must support AVX2 (`cpu` is the token that says so).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn tighten_avx2(&mut self, cpu: Avx2, target: f64, max_swaps: usize, evals: &mut usize, max_evals: usize) -> bool {
        self.tighten_body(cpu, target, max_swaps, evals, max_evals)
    }

    /// The search, pricing swaps with `pricing` (the [`Avx2`] token only inside
    /// [`Pack::tighten_avx2`], whose AVX2 build it is inlined into).
    #[inline(always)]
    pub(super) fn tighten_body<P: Pricing>(
        &mut self,
        pricing: P,
        target: f64,
        max_swaps: usize,
        evals: &mut usize,
        max_evals: usize,
    ) -> bool {
        self.fresh_members();
        let p = self.p;
        let (w, dim) = (p.weight, p.dim);
        let mut done = 0;
        loop {
            let a = self.argmax_bin();
            let top = self.load[a];
            if top <= target {
                return true;
            }
            if done >= max_swaps {
                return false;
            }
            let mut best: Option<(f64, usize, usize)> = None;
            let va = &self.vl32[a * dim..(a + 1) * dim];
            for b in (0..p.bins).filter(|&b| b != a) {
                // d = w_i − w_j must lie in [top − target, target − load_b]
                let (dlo, dhi) = (top - target, target - self.load[b]);
                if dlo > dhi || *evals >= max_evals {
                    continue;
                }
                let (sb, wb) = (&self.members[b], &self.wts[b]);
                let vb = &self.vl32[b * dim..(b + 1) * dim];
                // members[a] ascend by weight, so over a long list both window ends only move
                // right (a walk instead of two bisections per item; same windows)
                let (mut lo, mut hi) = (0, 0);
                for &i in &self.members[a] {
                    *evals += 1;
                    if wb.len() > 32 {
                        while lo < wb.len() && wb[lo] < w[i] - dhi {
                            lo += 1;
                        }
                        hi = hi.max(lo);
                        while hi < wb.len() && wb[hi] <= w[i] - dlo {
                            hi += 1;
                        }
                    } else {
                        lo = count_below(wb, w[i] - dhi);
                        hi = lo + count_at_most(&wb[lo..], w[i] - dlo);
                    }
                    for &j in &sb[lo..hi] {
                        if !self.can_swap(i, j) {
                            continue;
                        }
                        *evals += 1;
                        let delta = pricing.swap_delta(va, vb, p.v(i), p.v(j));
                        if best.is_none_or(|(bd, _, _)| delta < bd) {
                            best = Some((delta, i, j));
                        }
                    }
                }
            }
            match best {
                Some((_, i, j)) => {
                    self.swap(i, j);
                    done += 1;
                }
                // no single swap reaches the target from here: plain min-max search (with its
                // spreading escape) for the rest
                None => return self.improve_max(target, max_swaps - done, SETTLING_SPREADS),
            }
        }
    }
}
