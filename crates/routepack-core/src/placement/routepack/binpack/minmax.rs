//! Phase 2, min-max search: [`Pack::improve_max`] swaps items of the heaviest bin with
//! lighter bins while that lowers the maximum bin load, with a few spreading swaps
//! ([`Pack::spread_step`]) to escape where it is stuck.

use super::pack::{total_key, Pack};
use super::weight_search::count_below;

/// Spreading swaps a min-max search that settles a final packing may make when stuck (see
/// [`Pack::improve_max`]).
pub const SETTLING_SPREADS: usize = 4;

impl<'a> Pack<'a> {
    /// Every bin as `(total_key(load), bin)`, ascending: lightest first, ties lower index.
    fn keyed_bins(&self) -> Vec<(i64, usize)> {
        let mut keyed: Vec<(i64, usize)> = (0..self.p.bins).map(|b| (total_key(self.load[b]), b)).collect();
        keyed.sort_unstable();
        keyed
    }

    /// [`Pack::keyed_bins`] brought up to date after the loads of bins `x` and `y` changed:
    /// their keys renewed, then an insertion sort, linear on the nearly sorted list (a full
    /// sort per min-max step showed in profiles).
    fn rekey(&self, keyed: &mut [(i64, usize)], x: usize, y: usize) {
        for e in keyed.iter_mut() {
            if e.1 == x || e.1 == y {
                e.0 = total_key(self.load[e.1]);
            }
        }
        for k in 1..keyed.len() {
            let v = keyed[k];
            let mut m = k;
            while m > 0 && keyed[m - 1] > v {
                keyed[m] = keyed[m - 1];
                m -= 1;
            }
            keyed[m] = v;
        }
    }

    /// The swap of an item of the heaviest bin `a` (load `top`) with an item of another bin
    /// that minimises the larger of the two new loads: `(new max of the pair, i, j)`.
    /// Bins are tried lightest first (`keyed`, from [`Pack::keyed_bins`]); a bin whose best
    /// conceivable result, the midpoint of the two loads, cannot beat the best found ends the
    /// search.
    fn best_max_swap(&self, a: usize, top: f64, tol: f64, keyed: &[(i64, usize)]) -> Option<(f64, usize, usize)> {
        const SCAN: usize = 6; // feasible-partner search depth on each side of the ideal weight
        let w = self.p.weight;
        let mut best: Option<(f64, usize, usize)> = None;
        for &(_, b) in keyed.iter().filter(|x| x.1 != a) {
            let lb = self.load[b];
            let gap = top - lb;
            if gap <= tol || best.is_some_and(|(m, _, _)| m <= top - gap / 2.0) {
                break;
            }
            let (sb, wb) = (&self.members[b], &self.wts[b]);
            // members[a] ascend by weight, so the ideal partner position only moves right
            let mut pos = 0;
            for &i in &self.members[a] {
                let wi = w[i];
                if wb.len() <= 32 {
                    // few partners: a branchless count (the stepping loop's exit mispredicts)
                    pos = count_below(wb, wi - gap / 2.0);
                } else {
                    while pos < sb.len() && wb[pos] < wi - gap / 2.0 {
                        pos += 1;
                    }
                }
                // d = w_i − w_j (wb holds the partners' weights)
                let mut consider = |d: f64, j: usize| {
                    let nm = (top - d).max(lb + d);
                    if best.is_none_or(|(m, _, _)| nm < m) {
                        best = Some((nm, i, j));
                    }
                };
                // below the ideal partner weight, d grows going down
                for k in (pos.saturating_sub(SCAN)..pos).rev() {
                    let d = wi - wb[k];
                    if d >= gap {
                        break;
                    }
                    if d > 0.0 && self.can_swap(i, sb[k]) {
                        consider(d, sb[k]);
                        break;
                    }
                }
                for k in pos..(pos + SCAN).min(sb.len()) {
                    let d = wi - wb[k];
                    if d <= 0.0 {
                        break;
                    }
                    if d < gap && self.can_swap(i, sb[k]) {
                        consider(d, sb[k]);
                        break;
                    }
                }
            }
        }
        best
    }

    /// Phase 2: while the heaviest bin is above `target`, apply the swap between it and
    /// another bin that minimises the larger of their new loads, if that is below the current
    /// maximum. At most `max_swaps` swaps. Returns true when it stopped because no swap helps
    /// (or the target is met), false when the swap budget ran out.
    ///
    /// `spreads`: when no swap helps, up to this many spreading swaps (`Pack::spread_step`)
    /// even out the other bins first. They seldom lower the maximum, but they leave the other
    /// bins closer together: worth it where the search settles a final packing (tightening,
    /// incremental candidates), not before a fluctuation phase that reshapes every bin anyway
    /// (there they cost ~10% of a placement call at EPLB's reference size and changed nothing
    /// measurable).
    pub fn improve_max(&mut self, target: f64, max_swaps: usize, spreads: usize) -> bool {
        self.fresh_members();
        // no packing beats the mean bin load or the heaviest item: stop within 1e-6 of that
        let mean = self.load.iter().sum::<f64>() / self.p.bins as f64;
        let heaviest = self.p.weight.iter().copied().fold(0.0, f64::max);
        let target = target.max(mean.max(heaviest) * (1.0 + 1e-6));
        let mut done = 0;
        let mut spread_left = spreads; // each costs O(bins² · cap)
        let mut keyed = self.keyed_bins();
        loop {
            let a = self.argmax_bin();
            let top = self.load[a];
            if top <= target {
                return true;
            }
            if done >= max_swaps {
                return false;
            }
            let tol = 1e-12 * top.abs().max(1e-300);
            match self.best_max_swap(a, top, tol, &keyed) {
                Some((nm, i, j)) if nm < top - tol => {
                    let b = self.bin_of[j];
                    self.swap(i, j);
                    self.rekey(&mut keyed, a, b);
                    done += 1;
                }
                _ => {
                    // stuck: even out other pairs of bins (lower Σ load²), which can open a
                    // swap for the heaviest; give up when that does not lower the maximum
                    let before = self.swaps;
                    for _ in 0..self.p.bins {
                        if done >= max_swaps || spread_left == 0 || !self.spread_step(tol) {
                            break;
                        }
                        done += 1;
                        spread_left -= 1;
                    }
                    if self.swaps == before || self.max_load() >= top - tol {
                        return true;
                    }
                    keyed = self.keyed_bins();
                }
            }
        }
    }

    /// Applies the single swap that lowers Σ_bins load² the most (between any two bins, the
    /// partner weight nearest half their gap); false when none lowers it by more than `tol`.
    fn spread_step(&mut self, tol: f64) -> bool {
        let w = self.p.weight;
        let mut best: Option<(f64, usize, usize)> = None;
        // pairs by decreasing gap: heavy bins against light ones; a pair can gain at most
        // gap²/2, so scanning stops once that cannot beat the best found
        let mut keyed: Vec<(i64, usize)> = (0..self.p.bins).map(|b| (-total_key(self.load[b]), b)).collect();
        keyed.sort_unstable();
        let by_load: Vec<usize> = keyed.into_iter().map(|(_, b)| b).collect();
        let lightest = by_load[by_load.len() - 1];
        for (ka, &a) in by_load.iter().enumerate() {
            // the widest gap left is to the lightest bin, and it only narrows for lighter a
            let widest = self.load[a] - self.load[lightest];
            if widest <= tol || best.is_some_and(|(g, _, _)| g >= widest * widest / 2.0) {
                break;
            }
            for &b in by_load[ka + 1..].iter().rev() {
                let gap = self.load[a] - self.load[b];
                if gap <= tol || best.is_some_and(|(g, _, _)| g >= gap * gap / 2.0) {
                    break;
                }
                let (sb, wb) = (&self.members[b], &self.wts[b]);
                let mut pos = 0;
                for &i in &self.members[a] {
                    let wi = w[i];
                    while pos < sb.len() && wb[pos] < wi - gap / 2.0 {
                        pos += 1;
                    }
                    for &j in sb[pos.saturating_sub(1)..(pos + 1).min(sb.len())].iter() {
                        let d = wi - w[j];
                        // Σ load² falls by 2·d·(gap − d)
                        let gain = 2.0 * d * (gap - d);
                        if d > 0.0 && d < gap && self.can_swap(i, j) && best.is_none_or(|(g, _, _)| gain > g) {
                            best = Some((gain, i, j));
                        }
                    }
                }
            }
        }
        match best {
            Some((g, i, j)) if g > tol * tol => {
                self.swap(i, j);
                true
            }
            _ => false,
        }
    }
}
