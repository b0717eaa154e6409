//! [`Pack`]: a (partial or full) assignment of replicas to bins with its running sums (bin
//! loads, per-chunk loads, copies of each expert per bin, bins' sorted members) and the moves
//! every phase is made of (placing an item, swapping two). The phases that decide the moves
//! live beside it: `greedy` (the start), `minmax`, `fluctuation`, `tighten`.

use super::bin_lists::BinLists;
use super::problem::Problem;
use super::simd::{add_widened, trade_widened};

/// A (partial or full) assignment of items to bins with its running sums.
#[derive(Clone)]
pub struct Pack<'a> {
    pub(super) p: &'a Problem<'a>,
    /// `[n]` bin of each item (`usize::MAX` while unplaced).
    pub bin_of: Vec<usize>,
    /// Items of each bin, sorted by (weight, index), so partners are found by bisection.
    pub members: BinLists<usize>,
    /// `members`' weights, in the same order: the window searches bisect these contiguous
    /// values instead of chasing `weight[members[b][k]]`.
    pub(super) wts: BinLists<f64>,
    /// `[bins]` aggregate load.
    pub load: Vec<f64>,
    /// `[bins · dim]` per-chunk load, accumulated in float64 ...
    pub(super) vload: Vec<f64>,
    /// ... and its float32 copy, what swaps are priced with.
    pub(super) vl32: Vec<f32>,
    /// `[bins · E]` copies of each expert per bin.
    pub(super) mult: Vec<u16>,
    /// `[E]` most copies of an expert one bin should hold.
    pub(super) limit: Vec<u16>,
    /// Swaps applied so far (each moves two replicas).
    pub swaps: usize,
    /// `members` and `wts` lag behind `bin_of` (see [`Pack::swap_loads`]).
    pub(super) stale: bool,
}

impl<'a> Pack<'a> {
    pub(super) fn empty(p: &'a Problem<'a>) -> Self {
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
    pub(super) fn rank_in(&self, b: usize, x: usize) -> usize {
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
    pub(super) fn sort_members(&mut self) {
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

    pub(super) fn insert(&mut self, b: usize, x: usize) {
        let pos = self.rank_in(b, x);
        self.members.insert(b, pos, x);
        self.wts.insert(b, pos, self.p.weight[x]);
    }

    pub(super) fn remove(&mut self, b: usize, x: usize) {
        let pos = self.rank_in(b, x);
        debug_assert_eq!(self.members[b][pos], x);
        self.members.remove(b, pos);
        self.wts.remove(b, pos);
    }

    /// Puts item i into bin b; `members` is rebuilt by [`Pack::sort_members`] and the
    /// float32 loads refreshed by [`Pack::sync_all`] once all items are placed.
    pub(super) fn place(&mut self, i: usize, b: usize) {
        let p = self.p;
        self.bin_of[i] = b;
        self.load[b] += p.weight[i];
        add_widened(&mut self.vload[b * p.dim..(b + 1) * p.dim], p.v(i));
        self.mult[b * p.num_experts + p.expert[i] as usize] += 1;
    }

    pub(super) fn sync_all(&mut self) {
        for b in 0..self.p.bins {
            self.sync(b);
        }
    }

    /// Refreshes the float32 copy of bin b's per-chunk load.
    #[inline]
    pub(super) fn sync(&mut self, b: usize) {
        let d = self.p.dim;
        for (x, &y) in self.vl32[b * d..(b + 1) * d].iter_mut().zip(&self.vload[b * d..(b + 1) * d]) {
            *x = y as f32;
        }
    }

    #[inline]
    pub(super) fn room_for(&self, b: usize, e: usize) -> bool {
        self.mult[b * self.p.num_experts + e] < self.limit[e]
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
    pub(super) fn swap_loads(&mut self, i: usize, j: usize) {
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
    pub(super) fn can_swap(&self, i: usize, j: usize) -> bool {
        let p = self.p;
        let (ei, ej) = (p.expert[i] as usize, p.expert[j] as usize);
        if ei == ej {
            return false; // same expert: the swap changes nothing
        }
        let (a, b) = (self.bin_of[i], self.bin_of[j]);
        self.room_for(b, ei) && self.room_for(a, ej)
    }

    /// The heaviest bin's aggregate load.
    pub fn max_load(&self) -> f64 {
        self.load.iter().copied().fold(f64::NEG_INFINITY, f64::max)
    }

    pub(super) fn argmax_bin(&self) -> usize {
        (0..self.p.bins).fold(0, |best, b| if self.load[b] > self.load[best] { b } else { best })
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
