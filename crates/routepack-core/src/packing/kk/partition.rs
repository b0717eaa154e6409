//! Karmarkar–Karp k-way partitioning (largest differencing), as verl runs it.
//!
//! A state is k sets kept in decreasing order; the heap repeatedly merges the two states with
//! the largest spread (largest set minus smallest), pairing one's largest set with the
//! other's smallest. verl keeps all k sets of every state, so starting from one state per
//! item costs n·k sets (quadratic when k grows with n: S = 8192 samples on one rank held
//! 0.8 GB, S = 32768 did not fit). Here a state keeps only its non-empty sets: an empty set
//! (sum 0, no items) sorts below every non-empty one (a placeholder's set has sum 0 but one
//! item), so the first `len` of verl's k sets are exactly these and the rest are empty.
//!
//! The sets are kept ordered (a short sorted vector, a B-tree once a state has many), and a
//! merge moves the state with fewer sets into the other: it pairs the smaller state's sets
//! with the other's smallest (taken out, joined, put back) and inserts the rest, in
//! O(min(p, q) · log k) instead of re-sorting k sets; two joined sets keep verl's item order
//! (the first state's items, then the second's) by appending or prepending the shorter list.
//! Every comparison and merge gives what verl's full state gives, in memory linear in the
//! items.
//!
//! Sums are exact: a workload 24576·n + n² of an i64 length is below 2^127, so a [`Load`] of
//! 192 bits holds the sum of up to 2^64 of them (i128 wrapped from a few samples near 2^62
//! tokens, where verl's Python integers do not).

use std::cmp::Ordering;
use std::collections::{BTreeSet, BinaryHeap, VecDeque};

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
    /// In verl's order (a joined set: the first state's items, then the second's).
    items: VecDeque<usize>,
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

/// `x` (from the state merged into) joined with `y`: x's items then y's, moving the shorter.
fn join(mut x: Set, mut y: Set) -> Set {
    let sum = x.sum.plus(y.sum);
    if x.items.len() >= y.items.len() {
        x.items.extend(y.items);
        Set { sum, items: x.items }
    } else {
        for i in x.items.into_iter().rev() {
            y.items.push_front(i);
        }
        Set { sum, items: y.items }
    }
}

/// Sets kept below this count in a sorted vector (a B-tree node holds 11 sets' room).
const FEW: usize = 16;

/// A state's non-empty sets, ascending. No two are equal (their items differ), so the order
/// is the one verl's sort gives.
enum Sets {
    Few(Vec<Set>),
    Many(BTreeSet<Set>),
}

impl Sets {
    fn len(&self) -> usize {
        match self {
            Sets::Few(v) => v.len(),
            Sets::Many(t) => t.len(),
        }
    }
    fn largest(&self) -> &Set {
        match self {
            Sets::Few(v) => v.last(),
            Sets::Many(t) => t.last(),
        }
        .expect("a state has a set")
    }
    fn smallest(&self) -> &Set {
        match self {
            Sets::Few(v) => v.first(),
            Sets::Many(t) => t.first(),
        }
        .expect("a state has a set")
    }
    fn pop_smallest(&mut self) -> Set {
        match self {
            Sets::Few(v) => v.remove(0),
            Sets::Many(t) => t.pop_first().expect("a set to pop"),
        }
    }
    fn insert(&mut self, s: Set) {
        match self {
            Sets::Few(v) => {
                let at = v.partition_point(|x| *x < s);
                v.insert(at, s);
                if v.len() > FEW {
                    *self = Sets::Many(std::mem::take(v).into_iter().collect());
                }
            }
            Sets::Many(t) => {
                t.insert(s);
            }
        }
    }
    /// Largest first.
    fn into_decreasing(self) -> Vec<Set> {
        match self {
            Sets::Few(mut v) => {
                v.reverse();
                v
            }
            Sets::Many(t) => t.into_iter().rev().collect(),
        }
    }
}

/// The non-empty sets of a state of k sets (at least one, at most k), with what the heap
/// compares (a state does not change while it is in the heap).
struct State {
    sets: Sets,
    /// k: how many sets the state has, counting the empty ones not stored.
    k: usize,
    id: usize,
    /// Largest set minus smallest (an empty one, of sum 0, when fewer than k are stored).
    spread: Load,
    /// The largest set's sum and item count (its items break the rarer ties).
    top: (Load, usize),
}

impl State {
    fn new(sets: Sets, k: usize, id: usize) -> Self {
        let last = if sets.len() == k { sets.smallest().sum } else { Load::default() };
        let largest = sets.largest();
        let (spread, top) = (largest.sum.minus(last), (largest.sum, largest.items.len()));
        Self { sets, k, id, spread, top }
    }

    /// verl's merge of `a` (popped first) and `b`: a's set of rank i (0 = largest, empty sets
    /// last) joins b's set of rank k−1−i. With p and q stored sets, the pairs are a's ranks
    /// k−q..p against b's ranks q−1 down to k−p (b's p+q−k smallest); the others stand alone.
    fn merge(a: State, b: State) -> Sets {
        let (k, p, q) = (a.k, a.sets.len(), b.sets.len());
        let pairs = (p + q).saturating_sub(k);
        if p <= q {
            // a's sets into b: b's smallest come out, a's by rank
            let mut into = b.sets;
            let theirs: Vec<Set> = (0..pairs).map(|_| into.pop_smallest()).collect(); // b ranks q−1, q−2, …
            let mut mine = a.sets.into_decreasing().into_iter();
            for x in mine.by_ref().take((k - q).min(p)) {
                into.insert(x);
            }
            for (x, y) in mine.zip(theirs) {
                into.insert(join(x, y));
            }
            into
        } else {
            // b's sets into a: a's smallest come out, b's by rank
            let mut into = a.sets;
            let mine: Vec<Set> = (0..pairs).map(|_| into.pop_smallest()).collect(); // a ranks p−1, p−2, …
            let mut theirs = b.sets.into_decreasing().into_iter();
            for y in theirs.by_ref().take((k - p).min(q)) {
                into.insert(y);
            }
            for (x, y) in mine.into_iter().zip(theirs) {
                into.insert(join(x, y));
            }
            into
        }
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
        self.spread
            .cmp(&o.spread)
            .then(self.top.cmp(&o.top))
            .then_with(|| self.sets.largest().items.cmp(&o.sets.largest().items))
            .then(o.id.cmp(&self.id))
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
        let mut sets = Sets::Few(Vec::new());
        for &i in items {
            sets.insert(Set { sum: Load::of(w(i)), items: VecDeque::from([i]) });
        }
        State::new(sets, k, id)
    };
    let mut heap = BinaryHeap::new();
    let chunk = if equal_size { k } else { 1 };
    for (id, items) in order.chunks(chunk).enumerate() {
        heap.push(new_state(items, id));
    }
    let mut next_id = heap.len();
    while heap.len() > 1 {
        let a = heap.pop().expect("two states");
        let b = heap.pop().expect("two states");
        heap.push(State::new(State::merge(a, b), k, next_id));
        next_id += 1;
    }
    let mut parts: Vec<Vec<usize>> = match heap.pop() {
        Some(last) => last
            .sets
            .into_decreasing()
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
