//! Packing replicas onto bins (the nodes of an EP group, or the ranks of a node) with exactly
//! `cap` replicas per bin, the cardinality constraint of physical slots.
//!
//! Three phases, each deterministic:
//! 1. [`Pack::lpt`]: heaviest replica first, to the lightest bin with room (EPLB's greedy),
//!    except that a bin already holding its share of copies of the same expert is skipped
//!    while another bin has room ([`Pack::repair`] fixes what the greedy could not avoid);
//! 2. [`Pack::improve_max`]: local search on the heaviest bin: the swap with another bin that
//!    lowers the larger of the two loads the most, until no swap lowers the maximum;
//! 3. [`Pack::improve_fluct`]: microbatch fluctuation. Each replica carries a vector of its
//!    load in each chunk of the window (consecutive samples); swaps lower Σ_bins |V_bin|², the
//!    sum over chunks of squared bin loads, i.e. the spread of bin loads chunk by chunk, which
//!    co-locates experts whose demand is anti-correlated. No swap may lift a bin's aggregate
//!    load above `cap_load`, so phase 2's balance is kept (up to the slack the caller allows).
//!
//! Copies of one expert: at most ceil(copies / bins) per bin (the fewest any arrangement can
//! achieve), so two copies never share a bin while another arrangement exists.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// Spreading swaps a min-max search that settles a final packing may make when stuck (see
/// [`Pack::improve_max`]).
pub const SETTLING_SPREADS: usize = 4;

/// One packing problem. Items are replicas; `n = bins · cap`.
pub struct Problem<'a> {
    /// `[n]` aggregate load of each replica.
    pub weight: &'a [f64],
    /// `[n]` logical expert of each replica, `< num_experts`.
    pub expert: &'a [u32],
    pub num_experts: usize,
    /// `[n · dim]` per-chunk load of each replica (dim may be 0: no fluctuation phase).
    /// float32: only compared, never accumulated, and half the memory traffic.
    pub vecs: &'a [f32],
    pub dim: usize,
    pub bins: usize,
    pub cap: usize,
    /// `[n]` items heaviest first (ties: lower index), from [`order_and_norm`]: every phase
    /// visits items in this order, so it is sorted once per layer, not once per phase.
    pub order: &'a [u32],
    /// `[n]` |v_i|² of each item (float64 sum of the float32 entries, in order).
    pub norm: &'a [f64],
}

/// `([n] items heaviest first, ties lower index; [n] |v_i|²)` of items with weights `weight`
/// and chunk vectors `vecs` (`[n · dim]`): what [`Problem::order`] and [`Problem::norm`] hold.
pub fn order_and_norm(weight: &[f64], vecs: &[f32], dim: usize) -> (Vec<u32>, Vec<f64>) {
    let mut order: Vec<u32> = (0..weight.len() as u32).collect();
    order.sort_unstable_by(|&x, &y| weight[y as usize].total_cmp(&weight[x as usize]).then(x.cmp(&y)));
    let norm = (0..weight.len())
        .map(|i| vecs[i * dim..(i + 1) * dim].iter().map(|&x| x as f64 * x as f64).sum())
        .collect();
    (order, norm)
}

impl Problem<'_> {
    #[inline]
    fn v(&self, i: usize) -> &[f32] {
        &self.vecs[i * self.dim..(i + 1) * self.dim]
    }
    pub fn len(&self) -> usize {
        self.weight.len()
    }
    pub fn is_empty(&self) -> bool {
        self.weight.is_empty()
    }
}

/// A (partial or full) assignment of items to bins with its running sums.
#[derive(Clone)]
pub struct Pack<'a> {
    p: &'a Problem<'a>,
    /// `[n]` bin of each item (`usize::MAX` while unplaced).
    pub bin_of: Vec<usize>,
    /// Items of each bin, sorted by (weight, index), so partners are found by bisection.
    pub members: BinLists<usize>,
    /// `members`' weights, in the same order: the window searches bisect these contiguous
    /// values instead of chasing `weight[members[b][k]]`.
    wts: BinLists<f64>,
    /// `[bins]` aggregate load.
    pub load: Vec<f64>,
    /// `[bins · dim]` per-chunk load, accumulated in float64 ...
    vload: Vec<f64>,
    /// ... and its float32 copy, what swaps are priced with.
    vl32: Vec<f32>,
    /// `[bins · E]` copies of each expert per bin.
    mult: Vec<u16>,
    /// `[E]` most copies of an expert one bin should hold.
    limit: Vec<u16>,
    /// Swaps applied so far (each moves two replicas).
    pub swaps: usize,
    /// `members` and `wts` lag behind `bin_of` (see [`Pack::swap_loads`]).
    stale: bool,
}

impl<'a> Pack<'a> {
    fn empty(p: &'a Problem<'a>) -> Self {
        let mut copies = vec![0usize; p.num_experts];
        for &e in p.expert {
            copies[e as usize] += 1;
        }
        let limit = copies.iter().map(|&c| c.div_ceil(p.bins).max(1) as u16).collect();
        Self {
            p,
            bin_of: vec![usize::MAX; p.len()],
            members: BinLists::new(p.bins, p.cap),
            wts: BinLists::new(p.bins, p.cap),
            load: vec![0.0; p.bins],
            vload: vec![0.0; p.bins * p.dim],
            vl32: vec![0.0; p.bins * p.dim],
            mult: vec![0; p.bins * p.num_experts],
            limit,
            swaps: 0,
            stale: false,
        }
    }

    /// Position of item x in bin b, sorted by (weight, index): the weights are compared in
    /// the contiguous `wts`, the index only among equal weights (copies of one expert).
    #[inline]
    fn rank_in(&self, b: usize, x: usize) -> usize {
        let wx = self.p.weight[x];
        let (m, ws) = (&self.members[b], &self.wts[b]);
        let lo = ws.partition_point(|&y| y.total_cmp(&wx).is_lt());
        let mut k = lo;
        while k < m.len() && ws[k].total_cmp(&wx).is_eq() && m[k] < x {
            k += 1;
        }
        k
    }

    /// Rebuilds `members` and `wts` from `bin_of`, each bin ascending by (weight, index):
    /// the problem's `order` read backwards, runs of equal weight (copies of one expert)
    /// turned round so that lower indices come first.
    fn sort_members(&mut self) {
        let (w, order) = (self.p.weight, self.p.order);
        self.members.clear();
        self.wts.clear();
        let mut end = order.len();
        while end > 0 {
            let wt = w[order[end - 1] as usize];
            let mut start = end - 1;
            while start > 0 && w[order[start - 1] as usize].total_cmp(&wt).is_eq() {
                start -= 1;
            }
            for &i in &order[start..end] {
                let b = self.bin_of[i as usize];
                if b != usize::MAX {
                    self.members.push(b, i as usize);
                    self.wts.push(b, wt);
                }
            }
            end = start;
        }
    }

    fn insert(&mut self, b: usize, x: usize) {
        let pos = self.rank_in(b, x);
        self.members.insert(b, pos, x);
        self.wts.insert(b, pos, self.p.weight[x]);
    }

    fn remove(&mut self, b: usize, x: usize) {
        let pos = self.rank_in(b, x);
        debug_assert_eq!(self.members[b][pos], x);
        self.members.remove(b, pos);
        self.wts.remove(b, pos);
    }

    /// Puts item i into bin b; `members` is rebuilt by [`Pack::sort_members`] and the
    /// float32 loads refreshed by [`Pack::sync_all`] once all items are placed.
    fn place(&mut self, i: usize, b: usize) {
        let p = self.p;
        self.bin_of[i] = b;
        self.load[b] += p.weight[i];
        add_widened(&mut self.vload[b * p.dim..(b + 1) * p.dim], p.v(i));
        self.mult[b * p.num_experts + p.expert[i] as usize] += 1;
    }

    fn sync_all(&mut self) {
        for b in 0..self.p.bins {
            self.sync(b);
        }
    }

    /// Refreshes the float32 copy of bin b's per-chunk load.
    #[inline]
    fn sync(&mut self, b: usize) {
        let d = self.p.dim;
        for (x, &y) in self.vl32[b * d..(b + 1) * d].iter_mut().zip(&self.vload[b * d..(b + 1) * d]) {
            *x = y as f32;
        }
    }

    #[inline]
    fn room_for(&self, b: usize, e: usize) -> bool {
        self.mult[b * self.p.num_experts + e] < self.limit[e]
    }

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
                for b in 0..p.bins {
                    if fill[b] < p.cap && (best == usize::MAX || s.load[b] < s.load[best]) {
                        best = b;
                    }
                }
                if !s.room_for(best, e) {
                    let fallback = best;
                    best = usize::MAX;
                    for b in 0..p.bins {
                        if fill[b] < p.cap && s.room_for(b, e) && (best == usize::MAX || s.load[b] < s.load[best]) {
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
        let clean = (0..p.len()).all(|i| self.bin_of[i] == usize::MAX || self.mult[self.bin_of[i] * e_n + p.expert[i] as usize] <= self.limit[p.expert[i] as usize]);
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

    /// Exchanges items i and j (in different bins).
    pub fn swap(&mut self, i: usize, j: usize) {
        self.fresh_members();
        let (a, b) = (self.bin_of[i], self.bin_of[j]);
        self.swap_loads(i, j);
        self.remove(a, i);
        self.remove(b, j);
        self.insert(a, j);
        self.insert(b, i);
        self.stale = false;
    }

    /// [`Pack::swap`] but for `members`, which go stale until [`Pack::fresh_members`]: the
    /// fluctuation search finds partners through the problem's order, not bin by bin, and
    /// makes most of the swaps.
    fn swap_loads(&mut self, i: usize, j: usize) {
        let p = self.p;
        let (a, b) = (self.bin_of[i], self.bin_of[j]);
        debug_assert_ne!(a, b);
        let d = p.weight[i] - p.weight[j];
        self.load[a] -= d;
        self.load[b] += d;
        let (va, vb) = two_rows(&mut self.vload, a, b, p.dim);
        let (a32, b32) = two_rows(&mut self.vl32, a, b, p.dim);
        trade_widened(va, vb, a32, b32, p.v(i), p.v(j));
        let (ei, ej) = (p.expert[i] as usize, p.expert[j] as usize);
        self.mult[a * p.num_experts + ei] -= 1;
        self.mult[b * p.num_experts + ei] += 1;
        self.mult[b * p.num_experts + ej] -= 1;
        self.mult[a * p.num_experts + ej] += 1;
        self.bin_of[i] = b;
        self.bin_of[j] = a;
        self.swaps += 1;
        self.stale = true;
    }

    /// Rebuilds `members` after [`Pack::swap_loads`] (O(n)); a no-op when they are current.
    #[inline]
    pub(crate) fn fresh_members(&mut self) {
        if self.stale {
            self.sort_members();
            self.stale = false;
        }
    }

    /// Can i and j trade bins without breaking a copy limit?
    #[inline(always)]
    fn can_swap(&self, i: usize, j: usize) -> bool {
        let p = self.p;
        let (ei, ej) = (p.expert[i] as usize, p.expert[j] as usize);
        if ei == ej {
            return false; // same expert: the swap changes nothing
        }
        let (a, b) = (self.bin_of[i], self.bin_of[j]);
        self.room_for(b, ei) && self.room_for(a, ej)
    }

    pub fn max_load(&self) -> f64 {
        self.load.iter().copied().fold(f64::NEG_INFINITY, f64::max)
    }

    fn argmax_bin(&self) -> usize {
        (0..self.p.bins).fold(0, |best, b| if self.load[b] > self.load[best] { b } else { best })
    }

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
    /// `spreads`: when no swap helps, up to this many spreading swaps ([`Pack::spread_step`])
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
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (see `swap_delta`: bit-identical results)
            return unsafe { self.improve_fluct_avx2(cap_load, max_swaps, evals, max_evals) };
        }
        self.improve_fluct_body::<false>(cap_load, max_swaps, evals, max_evals)
    }

    /// The whole search compiled for AVX2, so that pricing inlines into its loop.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn improve_fluct_avx2(&mut self, cap_load: f64, max_swaps: usize, evals: &mut usize, max_evals: usize) -> bool {
        self.improve_fluct_body::<true>(cap_load, max_swaps, evals, max_evals)
    }

    /// `AVX2`: compiled inside an AVX2 function (pricing by [`swap_delta_avx2`]).
    #[inline(always)]
    fn improve_fluct_body<const AVX2: bool>(&mut self, cap_load: f64, max_swaps: usize, evals: &mut usize, max_evals: usize) -> bool {
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
                            let delta = 2.0 * swap_delta::<AVX2>(va, vb, vi, p.v(j));
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
                        let delta = 2.0 * swap_delta::<AVX2>(va, vb, vi, p.v(j));
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
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (see `swap_delta`: bit-identical results)
            return unsafe { self.tighten_avx2(target, max_swaps, evals, max_evals) };
        }
        self.tighten_body::<false>(target, max_swaps, evals, max_evals)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn tighten_avx2(&mut self, target: f64, max_swaps: usize, evals: &mut usize, max_evals: usize) -> bool {
        self.tighten_body::<true>(target, max_swaps, evals, max_evals)
    }

    #[inline(always)]
    fn tighten_body<const AVX2: bool>(&mut self, target: f64, max_swaps: usize, evals: &mut usize, max_evals: usize) -> bool {
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
                        let delta = swap_delta::<AVX2>(va, vb, p.v(i), p.v(j));
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

    /// Σ_bins |V_bin|²: what phase 3 lowers.
    pub fn fluct_objective(&self) -> f64 {
        self.vload.iter().map(|x| x * x).sum()
    }

    /// `[n]` bin of each item.
    pub fn into_assignment(self) -> Vec<usize> {
        self.bin_of
    }
}

/// A list of at most `cap` values per bin, all in one allocation (bin b's at `b · cap`):
/// packings are built, rebuilt and cloned per layer, a vector per bin showed in profiles as
/// allocator time. `lists[b]` is bin b's list.
#[derive(Clone)]
pub struct BinLists<T> {
    data: Vec<T>,
    len: Vec<usize>,
    cap: usize,
}

impl<T: Copy + Default> BinLists<T> {
    fn new(bins: usize, cap: usize) -> Self {
        Self { data: vec![T::default(); bins * cap], len: vec![0; bins], cap }
    }

    fn clear(&mut self) {
        self.len.fill(0);
    }

    /// Bin b's `cap` places (its list, then unused ones).
    #[inline]
    fn room(&mut self, b: usize) -> &mut [T] {
        &mut self.data[b * self.cap..(b + 1) * self.cap]
    }

    /// Appends x to bin b's list (panics when it is full).
    #[inline]
    fn push(&mut self, b: usize, x: T) {
        let n = self.len[b];
        self.room(b)[n] = x;
        self.len[b] = n + 1;
    }

    /// Inserts x at position `pos` of bin b's list (panics when it is full).
    #[inline]
    fn insert(&mut self, b: usize, pos: usize, x: T) {
        let n = self.len[b];
        let r = self.room(b);
        r.copy_within(pos..n, pos + 1);
        r[pos] = x;
        self.len[b] = n + 1;
    }

    /// Removes position `pos` of bin b's list.
    #[inline]
    fn remove(&mut self, b: usize, pos: usize) {
        let n = self.len[b];
        assert!(pos < n, "position {pos} of a list of {n}");
        self.room(b).copy_within(pos + 1..n, pos);
        self.len[b] = n - 1;
    }
}

impl<T> std::ops::Index<usize> for BinLists<T> {
    type Output = [T];

    #[inline]
    fn index(&self, b: usize) -> &[T] {
        &self.data[b * self.cap..b * self.cap + self.len[b]]
    }
}

/// `acc[k] += v[k] as f64` for each k: a bin's per-chunk load taking an item, once per
/// placed item. Compiled for AVX2 where the CPU has it (twice the lanes); each element's
/// single add is the same either way, so the sums are bit-identical.
#[inline]
fn add_widened(acc: &mut [f64], v: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2
        return unsafe { add_widened_avx2(acc, v) };
    }
    add_widened_body(acc, v)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn add_widened_avx2(acc: &mut [f64], v: &[f32]) {
    add_widened_body(acc, v)
}

#[inline(always)]
fn add_widened_body(acc: &mut [f64], v: &[f32]) {
    for (x, &y) in acc.iter_mut().zip(v) {
        *x += y as f64;
    }
}

/// Rows a and b (a ≠ b) of the row-major `xs` with rows of `d`, both mutable.
#[inline]
fn two_rows<T>(xs: &mut [T], a: usize, b: usize, d: usize) -> (&mut [T], &mut [T]) {
    assert_ne!(a, b);
    let (lo, hi) = (a.min(b), a.max(b));
    let (head, tail) = xs.split_at_mut(hi * d);
    let (x, y) = (&mut head[lo * d..(lo + 1) * d], &mut tail[..d]);
    if a < b {
        (x, y)
    } else {
        (y, x)
    }
}

/// Bin a hands item i to bin b for item j: per chunk `va -= vi − vj` and `vb += vi − vj`
/// (the difference taken in float64), then both bins' float32 copies refreshed
/// ([`Pack::sync`]'s conversion). Compiled for AVX2 where the CPU has it, as
/// [`add_widened`] is: element-wise, so bit-identical.
#[inline]
fn trade_widened(va: &mut [f64], vb: &mut [f64], a32: &mut [f32], b32: &mut [f32], vi: &[f32], vj: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2
        return unsafe { trade_widened_avx2(va, vb, a32, b32, vi, vj) };
    }
    trade_widened_body(va, vb, a32, b32, vi, vj)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn trade_widened_avx2(va: &mut [f64], vb: &mut [f64], a32: &mut [f32], b32: &mut [f32], vi: &[f32], vj: &[f32]) {
    trade_widened_body(va, vb, a32, b32, vi, vj)
}

#[inline(always)]
fn trade_widened_body(va: &mut [f64], vb: &mut [f64], a32: &mut [f32], b32: &mut [f32], vi: &[f32], vj: &[f32]) {
    let n = va.len();
    let (vb, a32, b32, vi, vj) = (&mut vb[..n], &mut a32[..n], &mut b32[..n], &vi[..n], &vj[..n]);
    for k in 0..n {
        let dv = vi[k] as f64 - vj[k] as f64;
        va[k] -= dv;
        vb[k] += dv;
        a32[k] = va[k] as f32;
        b32[k] = vb[k] as f32;
    }
}

/// `n` empty vectors with room for `cap` items each (`vec![Vec::with_capacity(cap); n]`
/// would clone the capacity away: clones of an empty vector allocate nothing).
pub(crate) fn with_capacities<T>(n: usize, cap: usize) -> Vec<Vec<T>> {
    (0..n).map(|_| Vec::with_capacity(cap)).collect()
}

/// An integer ordered as `f64::total_cmp` orders `x` (the transform `total_cmp` applies), so
/// bins sort by (load, index) as plain integer pairs.
#[inline]
pub(crate) fn total_key(x: f64) -> i64 {
    let b = x.to_bits() as i64;
    b ^ ((((b >> 63) as u64) >> 1) as i64)
}

/// The first index of `xs` where `pred` (true on a prefix, false after) is false, searched
/// outwards from `hint` (same result as `xs.partition_point(pred)`).
#[inline]
fn seek(xs: &[f64], hint: usize, pred: impl Fn(f64) -> bool) -> usize {
    let n = xs.len();
    let k = hint.min(n);
    if k < n && pred(xs[k]) {
        // forwards: the answer is in (k, n]
        let (mut lo, mut step) = (k + 1, 1);
        loop {
            let probe = k + step;
            if probe >= n || !pred(xs[probe]) {
                let end = probe.min(n);
                return lo + xs[lo..end].partition_point(|&x| pred(x));
            }
            lo = probe + 1;
            step *= 2;
        }
    }
    // backwards: the answer is in [0, k]
    let (mut hi, mut step) = (k, 1);
    loop {
        if step > k {
            return xs[..hi].partition_point(|&x| pred(x));
        }
        let probe = k - step;
        if pred(xs[probe]) {
            return probe + 1 + xs[probe + 1..hi].partition_point(|&x| pred(x));
        }
        hi = probe;
        step *= 2;
    }
}

/// How many of the ascending `ws` are below `x` (bins hold few items: a branchless count
/// beats bisection; same result as `partition_point(|y| y < x)`).
#[inline]
fn count_below(ws: &[f64], x: f64) -> usize {
    if ws.len() > 32 {
        return ws.partition_point(|&y| y < x);
    }
    ws.iter().map(|&y| (y < x) as usize).sum()
}

/// How many of the ascending `ws` are at most `x`.
#[inline]
fn count_at_most(ws: &[f64], x: f64) -> usize {
    if ws.len() > 32 {
        return ws.partition_point(|&y| y <= x);
    }
    ws.iter().map(|&y| (y <= x) as usize).sum()
}

/// Half the change of Σ|V|² when items i (in bin a) and j (in bin b) trade bins:
/// <V_a − V_b, v_j − v_i> + |v_j − v_i|². Eight independent float32 accumulators in a fixed
/// order, reproducible on every machine: the searches that call it are compiled twice
/// (`improve_fluct`, `tighten`), plain with [`swap_delta_lanes`] and for AVX2 with
/// [`swap_delta_avx2`], the same operations lane by lane (Rust never fuses a multiply and an
/// add), so bit-identical results.
#[inline(always)]
fn swap_delta<const AVX2: bool>(va: &[f32], vb: &[f32], vi: &[f32], vj: &[f32]) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if AVX2 {
        // SAFETY: instantiated with AVX2 = true only inside the AVX2 builds of the searches,
        // which run after the CPU was found to have AVX2
        return unsafe { swap_delta_avx2(va, vb, vi, vj) };
    }
    swap_delta_lanes(va, vb, vi, vj)
}

/// [`swap_delta_lanes`] in AVX2 registers (the compiler split those lanes over 128-bit
/// halves): per lane `acc += ((a − b) + dv) · dv` with `dv = j − i`, then the same tail and
/// the same tree of lane sums.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
fn swap_delta_avx2(va: &[f32], vb: &[f32], vi: &[f32], vj: &[f32]) -> f64 {
    use std::arch::x86_64::*;
    const W: usize = 8;
    let n = va.len();
    let (va, vb, vi, vj) = (&va[..n], &vb[..n], &vi[..n], &vj[..n]);
    let full = n / W * W;
    let mut acc = _mm256_setzero_ps();
    let mut c = 0;
    while c < full {
        // SAFETY: c + 8 <= full <= n, the length of all four slices
        unsafe {
            let a = _mm256_loadu_ps(va.as_ptr().add(c));
            let b = _mm256_loadu_ps(vb.as_ptr().add(c));
            let i = _mm256_loadu_ps(vi.as_ptr().add(c));
            let j = _mm256_loadu_ps(vj.as_ptr().add(c));
            let dv = _mm256_sub_ps(j, i);
            acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_add_ps(_mm256_sub_ps(a, b), dv), dv));
        }
        c += W;
    }
    let mut lanes = [0.0f32; W];
    // SAFETY: `lanes` holds eight floats
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
    let mut tail = 0.0f32;
    for k in full..n {
        let dv = vj[k] - vi[k];
        tail += (va[k] - vb[k] + dv) * dv;
    }
    let s4 = [lanes[0] + lanes[4], lanes[1] + lanes[5], lanes[2] + lanes[6], lanes[3] + lanes[7]];
    let s2 = [s4[0] + s4[2], s4[1] + s4[3]];
    (s2[0] + s2[1]) as f64 + tail as f64
}

#[inline(always)]
fn swap_delta_lanes(va: &[f32], vb: &[f32], vi: &[f32], vj: &[f32]) -> f64 {
    const W: usize = 8;
    let n = va.len();
    let (va, vb, vi, vj) = (&va[..n], &vb[..n], &vi[..n], &vj[..n]);
    let mut acc = [0.0f32; W];
    // fixed-size chunks: no bounds checks left in the loop, so the lanes become one register
    let chunks = va.chunks_exact(W).zip(vb.chunks_exact(W)).zip(vi.chunks_exact(W).zip(vj.chunks_exact(W)));
    for ((a, b), (i, j)) in chunks {
        let (a, b, i, j): (&[f32; W], &[f32; W], &[f32; W], &[f32; W]) =
            (a.try_into().unwrap(), b.try_into().unwrap(), i.try_into().unwrap(), j.try_into().unwrap());
        for lane in 0..W {
            let dv = j[lane] - i[lane];
            acc[lane] += (a[lane] - b[lane] + dv) * dv;
        }
    }
    let full = n / W * W;
    let mut tail = 0.0f32;
    for k in full..n {
        let dv = vj[k] - vi[k];
        tail += (va[k] - vb[k] + dv) * dv;
    }
    // lanes summed as a tree (three dependent adds, not eight), fixed order
    let s4 = [acc[0] + acc[4], acc[1] + acc[5], acc[2] + acc[6], acc[3] + acc[7]];
    let s2 = [s4[0] + s4[2], s4[1] + s4[3]];
    (s2[0] + s2[1]) as f64 + tail as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A problem with its order and norms (leaked: tests only).
    fn problem<'a>(w: &'a [f64], e: &'a [u32], ne: usize, v: &'a [f32], dim: usize, bins: usize) -> Problem<'a> {
        let (order, norm) = order_and_norm(w, v, dim);
        let (order, norm) = (Box::leak(order.into_boxed_slice()), Box::leak(norm.into_boxed_slice()));
        Problem { weight: w, expert: e, num_experts: ne, vecs: v, dim, bins, cap: w.len() / bins, order, norm }
    }

    #[test]
    fn lpt_then_swaps_balance_and_spread_copies() {
        // expert 0 has 2 copies of 5; LPT alone would pair them on an empty bin otherwise
        let w = [5.0, 5.0, 4.0, 3.0, 2.0, 1.0];
        let e = [0, 0, 1, 2, 3, 4];
        let p = problem(&w, &e, 5, &[], 0, 2);
        let mut s = Pack::lpt(&p);
        assert_eq!(s.violations(), 0);
        assert_ne!(s.bin_of[0], s.bin_of[1]);
        s.improve_max(f64::NEG_INFINITY, usize::MAX, SETTLING_SPREADS);
        assert_eq!(s.max_load(), 10.0);
    }

    #[test]
    fn fluct_pairs_anti_correlated_items() {
        // two chunks; items 0,1 are hot in chunk 0, items 2,3 in chunk 1; same aggregate.
        let w = [2.0, 2.0, 2.0, 2.0];
        let e = [0, 1, 2, 3];
        let v = [2.0, 0.0, 2.0, 0.0, 0.0, 2.0, 0.0, 2.0];
        let p = problem(&w, &e, 4, &v, 2, 2);
        let mut s = Pack::from_assignment(&p, &[0, 0, 1, 1]);
        let before = s.fluct_objective();
        let mut evals = 0;
        assert!(s.improve_fluct(4.0, usize::MAX, &mut evals, usize::MAX));
        assert!(s.fluct_objective() < before);
        assert_ne!(s.bin_of[0], s.bin_of[1]);
        assert_eq!(s.max_load(), 4.0);
    }

    proptest! {
        /// The AVX2 pricing gives the very bits of the portable one (plans do not depend on
        /// the CPU), for lengths with and without a tail.
        #[test]
        fn avx2_pricing_is_bit_identical(dim in 0usize..40, seed in 0u64..1000) {
            let mut x = seed.wrapping_mul(0x9e3779b97f4a7c15) | 1;
            let mut v = || {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % 20000) as f32 / 7.0 - 1000.0
            };
            let vs: Vec<Vec<f32>> = (0..4).map(|_| (0..dim).map(|_| v()).collect()).collect();
            let plain = swap_delta::<false>(&vs[0], &vs[1], &vs[2], &vs[3]);
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU has AVX2
                let wide = unsafe { swap_delta_avx2(&vs[0], &vs[1], &vs[2], &vs[3]) };
                prop_assert_eq!(plain.to_bits(), wide.to_bits());
            }
            prop_assert!(plain.is_finite());
        }

        #[test]
        fn phases_keep_cardinality_limits_and_caps(
            raw in prop::collection::vec((0u32..1000, 0u32..12), 2..60),
            bins in 1usize..6,
            dim in 0usize..4,
            seed in 0u64..1000,
        ) {
            let n = raw.len() / bins * bins;
            prop_assume!(n >= bins);
            let w: Vec<f64> = raw[..n].iter().map(|x| x.0 as f64).collect();
            let e: Vec<u32> = raw[..n].iter().map(|x| x.1).collect();
            let v: Vec<f32> = (0..n * dim).map(|k| ((k as u64 * 2654435761 + seed) % 97) as f32).collect();
            let p = problem(&w, &e, 12, &v, dim, bins);
            let mut s = Pack::lpt(&p);
            prop_assert_eq!(s.violations(), 0);
            let lpt_max = s.max_load();
            s.improve_max(f64::NEG_INFINITY, usize::MAX, SETTLING_SPREADS);
            let m = s.max_load();
            prop_assert!(m <= lpt_max + 1e-9);
            let mut evals = 0;
            s.improve_fluct(m, usize::MAX, &mut evals, 100_000);
            prop_assert!(s.max_load() <= m * (1.0 + 1e-12) + 1e-9);
            prop_assert_eq!(s.violations(), 0);
            s.fresh_members();
            for b in 0..bins {
                prop_assert_eq!(s.members[b].len(), n / bins);
                let l: f64 = s.members[b].iter().map(|&i| w[i]).sum();
                prop_assert!((l - s.load[b]).abs() <= 1e-6 * (1.0 + l));
            }
        }
    }
}
