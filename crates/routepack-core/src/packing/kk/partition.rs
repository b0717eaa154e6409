//! Karmarkar–Karp k-way partitioning (largest differencing), as verl runs it.
//!
//! A state is k sets kept in decreasing order; the heap repeatedly merges the two states with
//! the largest spread (largest set minus smallest), pairing one's largest set with the
//! other's smallest. verl keeps all k sets of every state, so starting from one state per
//! item costs n·k sets (quadratic when k grows with n: S = 8192 samples on one rank held
//! 0.8 GB, S = 32768 did not fit). Here a state keeps only its non-empty sets: an empty set
//! (sum 0, no items) sorts below every non-empty one (a placeholder's set has sum 0 but one
//! item), so the first `sets.len()` of verl's k sets are exactly these and the rest are empty.
//! Every comparison and merge gives what verl's full state gives, in memory linear in the items.
//!
//! Sums are exact: a workload 24576·n + n² of an i64 length is below 2^127, so a [`Load`] of
//! 192 bits holds the sum of up to 2^64 of them (i128 wrapped from a few samples near 2^62
//! tokens, where verl's Python integers do not).

use std::cmp::Ordering;
use std::collections::BinaryHeap;

/// An exact non-negative sum of u128 weights: (hi, lo) is hi·2^128 + lo, ordered as numbers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Load {
    hi: u64,
    lo: u128,
}

impl Load {
    /// One weight.
    pub(crate) fn of(w: u128) -> Self {
        Self { hi: 0, lo: w }
    }

    /// self + o (exact below 2^192, far beyond any window).
    pub(crate) fn plus(self, o: Self) -> Self {
        let (lo, carry) = self.lo.overflowing_add(o.lo);
        Self { hi: self.hi + o.hi + carry as u64, lo }
    }

    /// self − o, for self >= o.
    fn minus(self, o: Self) -> Self {
        let (lo, borrow) = self.lo.overflowing_sub(o.lo);
        Self { hi: self.hi - o.hi - borrow as u64, lo }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Set {
    sum: Load,
    items: Vec<usize>,
}

impl Ord for Set {
    /// verl's order: by sum, then by item count, then by the items.
    fn cmp(&self, o: &Self) -> Ordering {
        self.sum.cmp(&o.sum).then(self.items.len().cmp(&o.items.len())).then_with(|| self.items.cmp(&o.items))
    }
}
impl PartialOrd for Set {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}

/// The non-empty sets of a state of k sets, in decreasing order (at least one, at most k).
struct State {
    sets: Vec<Set>,
    /// k: how many sets the state has, counting the empty ones not stored.
    k: usize,
    id: usize,
}

impl State {
    /// Largest set minus smallest (an empty one, of sum 0, when fewer than k are stored).
    fn spread(&self) -> Load {
        let last = if self.sets.len() == self.k { self.sets[self.k - 1].sum } else { Load::default() };
        self.sets[0].sum.minus(last)
    }

    /// verl's merge: set i of `self` takes set k−1−i of `o` (empty sets included), then the
    /// sets are sorted again. Only the positions where either side is non-empty are touched.
    fn absorb(&mut self, o: State) {
        let (k, p, q) = (self.k, self.sets.len(), o.sets.len());
        let mut theirs: Vec<Option<Set>> = o.sets.into_iter().map(Some).collect();
        // positions i < p with k−1−i < q: both non-empty, o's set appended to ours
        for i in k.saturating_sub(q)..p {
            let other = theirs[k - 1 - i].take().expect("each of o's sets is used once");
            let mine = &mut self.sets[i];
            mine.sum = mine.sum.plus(other.sum);
            mine.items.extend(other.items);
        }
        // o's sets facing our empty positions (i >= p) stand alone
        self.sets.extend(theirs.into_iter().flatten());
        debug_assert!(self.sets.len() <= k);
        // no two non-empty sets are equal (their items differ), so this order is verl's
        self.sets.sort_by(|x, y| y.cmp(x));
    }
}

impl PartialEq for State {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for State {}
impl Ord for State {
    /// The heap pops the largest spread first, then the state with the largest first set,
    /// then (for determinism) the older state.
    fn cmp(&self, o: &Self) -> Ordering {
        self.spread().cmp(&o.spread()).then_with(|| self.sets[0].cmp(&o.sets[0])).then(o.id.cmp(&self.id))
    }
}
impl PartialOrd for State {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}

/// Karmarkar–Karp k-way partition of `weights` (indices into it). With `equal_size`, the
/// items sorted ascending are taken k at a time as the starting states, so every partition
/// gets the same count (placeholders of weight 0 make up a remainder and are dropped). Without
/// it, every item starts its own state. Partitions come out in decreasing order of sum (k of
/// them, the empty ones last). Memory is linear in the items (see the module docs).
pub fn karmarkar_karp(weights: &[u128], k: usize, equal_size: bool) -> Vec<Vec<usize>> {
    assert!(k >= 1, "karmarkar_karp: k must be >= 1");
    let n = weights.len();
    let padded = if equal_size { n.div_ceil(k) * k } else { n };
    // placeholders (index >= n) have weight 0 and sort first among equal weights
    let w = |i: usize| if i < n { weights[i] } else { 0 };
    let mut order: Vec<usize> = (0..padded).collect();
    order.sort_by(|&a, &b| w(a).cmp(&w(b)).then(((a < n) as u8).cmp(&((b < n) as u8))).then(a.cmp(&b)));
    let new_state = |items: &[usize], id: usize| {
        let mut sets: Vec<Set> = items.iter().map(|&i| Set { sum: Load::of(w(i)), items: vec![i] }).collect();
        sets.sort_by(|a, b| b.cmp(a));
        State { sets, k, id }
    };
    let mut heap = BinaryHeap::new();
    let chunk = if equal_size { k } else { 1 };
    for (id, items) in order.chunks(chunk).enumerate() {
        heap.push(new_state(items, id));
    }
    let mut next_id = heap.len();
    while heap.len() > 1 {
        let mut a = heap.pop().expect("two states");
        let b = heap.pop().expect("two states");
        a.absorb(b);
        a.id = next_id;
        next_id += 1;
        heap.push(a);
    }
    let mut parts: Vec<Vec<usize>> = match heap.pop() {
        Some(last) => last
            .sets
            .into_iter()
            .map(|s| {
                let mut items: Vec<usize> = s.items.into_iter().filter(|&i| i < n).collect();
                items.sort_unstable();
                items
            })
            .collect(),
        None => Vec::new(),
    };
    parts.resize_with(k, Vec::new);
    parts
}
