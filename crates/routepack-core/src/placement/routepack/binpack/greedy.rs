//! Phase 1, the starting packing: [`Pack::lpt`] (heaviest replica first to the lightest bin
//! with room that has not reached the expert's copy limit, EPLB's greedy with that limit) or a
//! given assignment ([`Pack::from_assignment`]), then [`Pack::repair`] of the copies the
//! greedy could not keep apart.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::pack::{total_key, Pack};
use super::problem::Problem;

impl<'a> Pack<'a> {
    /// Greedy: items by weight descending (ties: lower index first), each to the lightest
    /// bin with room (ties: lower bin) that has not reached the expert's copy limit.
    pub fn lpt(p: &'a Problem<'a>) -> Self {
        let mut s = Self::empty(p);
        let mut fill = vec![0usize; p.bins];
        // many bins: the bins with room in a min-heap by (load, index), the order the scan
        // below picks them in, instead of a scan of every bin per item
        let mut heap: Option<BinaryHeap<Reverse<(i64, usize)>>> =
            (p.bins >= 16).then(|| (0..p.bins).filter(|_| p.cap > 0).map(|b| Reverse((total_key(0.0), b))).collect());
        let mut popped = Vec::new();
        for i in p.order.iter().map(|&i| i as usize) {
            let e = p.expert[i] as usize;
            // the lightest bin with room (ties: lower index); usually it takes the copy too
            let mut best = usize::MAX;
            if let Some(h) = heap.as_mut() {
                // the lightest bin with room whose copy limit admits e, else the lightest
                popped.clear();
                while let Some(Reverse((k, b))) = h.pop() {
                    popped.push((k, b));
                    if s.room_for(b, e) {
                        best = b;
                        break;
                    }
                }
                if best == usize::MAX {
                    best = popped.first().map_or(usize::MAX, |x| x.1);
                }
                for &(k, b) in &popped {
                    if b != best {
                        h.push(Reverse((k, b)));
                    }
                }
            } else {
                for (b, &f) in fill.iter().enumerate() {
                    if f < p.cap && (best == usize::MAX || s.load[b] < s.load[best]) {
                        best = b;
                    }
                }
                if !s.room_for(best, e) {
                    let fallback = best;
                    best = usize::MAX;
                    for (b, &f) in fill.iter().enumerate() {
                        if f < p.cap && s.room_for(b, e) && (best == usize::MAX || s.load[b] < s.load[best]) {
                            best = b;
                        }
                    }
                    if best == usize::MAX {
                        best = fallback;
                    }
                }
            }
            fill[best] += 1;
            s.place(i, best);
            if let Some(h) = heap.as_mut() {
                if fill[best] < p.cap {
                    h.push(Reverse((total_key(s.load[best]), best)));
                }
            }
        }
        s.sort_members();
        s.sync_all();
        s.repair();
        s
    }

    /// A given assignment (`bin_of[i] < bins`, exactly `cap` items per bin); then repaired.
    pub fn from_assignment(p: &'a Problem<'a>, bin_of: &[usize]) -> Self {
        let mut s = Self::empty(p);
        for (i, &b) in bin_of.iter().enumerate() {
            s.place(i, b);
        }
        s.sort_members();
        s.sync_all();
        s.repair();
        s
    }

    /// Copies over their bin's limit.
    pub fn violations(&self) -> usize {
        let e_n = self.p.num_experts;
        (0..self.p.bins * e_n).map(|k| self.mult[k].saturating_sub(self.limit[k % e_n]) as usize).sum()
    }

    /// Swaps each copy over its bin's limit with an item of another bin that takes it without
    /// breaking a limit, choosing the swap that changes the loads least. With limits of
    /// ceil(copies / bins) such a swap exists for every excess copy (some bin holds fewer
    /// copies than the limit and, holding the same number of items, an item whose expert
    /// has room in the first bin); the loop is bounded anyway.
    pub fn repair(&mut self) {
        self.fresh_members();
        let (p, e_n) = (self.p, self.p.num_experts);
        let clean = (0..p.len()).all(|i| {
            self.bin_of[i] == usize::MAX || self.mult[self.bin_of[i] * e_n + p.expert[i] as usize] <= self.limit[p.expert[i] as usize]
        });
        if clean {
            return;
        }
        for _ in 0..p.len() {
            let Some(k) = (0..p.bins * e_n).find(|&k| self.mult[k] > self.limit[k % e_n]) else {
                return;
            };
            let (a, e) = (k / e_n, k % e_n);
            let i = *self.members[a].iter().find(|&&i| p.expert[i] as usize == e).expect("counted copy");
            let mut best: Option<(f64, usize)> = None;
            for b in (0..p.bins).filter(|&b| b != a && self.room_for(b, e)) {
                for &j in &self.members[b] {
                    let f = p.expert[j] as usize;
                    if f != e && self.room_for(a, f) {
                        let d = (p.weight[i] - p.weight[j]).abs();
                        if best.is_none_or(|(bd, _)| d < bd) {
                            best = Some((d, j));
                        }
                    }
                }
            }
            match best {
                Some((_, j)) => self.swap(i, j),
                None => return,
            }
        }
    }
}
