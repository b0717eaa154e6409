//! Exact row search: can the samples be packed into `k` rows of capacity `cap`?
//!
//! Depth-first branch and bound over samples in decreasing length (the classic bin-packing
//! search, Martello–Toth style). At each depth the sample goes into an open row with room,
//! fullest row first; rows with equal load are interchangeable, so only one of them is tried
//! (the lowest index; this also means at most one empty row is tried). If the sample fills
//! some row exactly, only that row is tried (a perfect fit dominates). A node is cut when the
//! room that can still be used (room of rows that fit at least the smallest remaining sample)
//! is less than the tokens left. The search stops after `node_limit` nodes (deterministic) or
//! at `deadline` (wall clock, not deterministic) and then says it does not know.
//!
//! Rows are kept ordered by load, and the usable room as a running sum, so a node costs
//! O(log k), not O(k): with thousands of rows (one DP rank, a long window) the scan over every
//! row at every node was most of the search. A depth's next candidate is the next lighter
//! distinct load, found when it is needed: the loads are restored when the search comes back
//! to a depth, so this is the order a list made at the depth's first visit would have.
//! Token sums (the room of every row, the tokens left) are i128: k rows of a cap near 2^63
//! overflow i64.

use std::collections::BTreeSet;
use std::time::Instant;

use super::bounds::l2;
use super::heuristics::decreasing;

/// Node limit of the exact search wherever no option sets one: routepack packing's default
/// `exact_nodes`, and the baselines' fallback rows (`super::fallback`).
pub const DEFAULT_NODE_LIMIT: u64 = 200_000;

/// What the search found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// A packing into at most `k` rows (empty rows dropped).
    Packed(Vec<Vec<usize>>),
    /// Proved: no packing into `k` rows exists.
    Impossible,
    /// Stopped by the node limit or the deadline.
    Unknown,
}

/// Rows' loads, ordered, with the room of rows that can still take the smallest sample.
struct Rows {
    cap: i64,
    smallest: i64,
    load: Vec<i64>,
    /// (load, row) of every row.
    by_load: BTreeSet<(i64, usize)>,
    /// Σ over rows with room >= smallest of their room.
    usable: i128,
}

impl Rows {
    fn new(k: usize, cap: i64, smallest: i64) -> Self {
        let usable = if cap >= smallest { k as i128 * cap as i128 } else { 0 };
        Self { cap, smallest, load: vec![0; k], by_load: (0..k).map(|b| (0, b)).collect(), usable }
    }

    fn usable_room(&self, load: i64) -> i128 {
        let room = self.cap - load;
        if room >= self.smallest {
            room as i128
        } else {
            0
        }
    }

    fn add(&mut self, b: usize, n: i64) {
        let old = self.load[b];
        self.by_load.remove(&(old, b));
        self.usable -= self.usable_room(old);
        self.load[b] = old + n;
        self.by_load.insert((old + n, b));
        self.usable += self.usable_room(old + n);
    }

    /// The lowest-index row of the heaviest load <= `max_load`.
    fn heaviest_up_to(&self, max_load: i64) -> Option<(i64, usize)> {
        let &(load, _) = self.by_load.range(..=(max_load, usize::MAX)).next_back()?;
        let &(_, b) = self.by_load.range((load, 0)..).next()?;
        Some((load, b))
    }

    /// The lowest-index row with exactly `load`.
    fn with_load(&self, load: i64) -> Option<usize> {
        self.by_load.range((load, 0)..=(load, usize::MAX)).next().map(|&(_, b)| b)
    }
}

/// Where a depth is in its candidates.
#[derive(Clone, Copy)]
enum Next {
    /// Cut: no candidate.
    Cut,
    /// Only this row (a perfect fit), not tried yet.
    Perfect(usize),
    /// Rows with load <= this, heaviest first.
    UpTo(i64),
    /// Nothing left to try.
    Done,
}

/// Searches for a packing of `seq_lens` (each in [1, cap]) into `k` rows. Returns the outcome
/// and the number of nodes visited.
pub fn pack_into(seq_lens: &[i64], cap: i64, k: usize, node_limit: u64, deadline: Option<Instant>) -> (Outcome, u64) {
    let n = seq_lens.len();
    if n == 0 {
        return (Outcome::Packed(Vec::new()), 0);
    }
    if k == 0 || l2(seq_lens, cap) > k {
        return (Outcome::Impossible, 0);
    }
    // Rows beyond the n-th are never tried: at depth i at most i rows are used, so an empty row
    // of lower index is always there (and the unused room never cuts a node with k >= n).
    let k = k.min(n);
    let order = decreasing(seq_lens);
    let size: Vec<i64> = order.iter().map(|&s| seq_lens[s]).collect();
    let smallest = size[n - 1];
    let mut suffix = vec![0i128; n + 1];
    for i in (0..n).rev() {
        suffix[i] = suffix[i + 1] + size[i] as i128;
    }
    let mut rows = Rows::new(k, cap, smallest);
    let mut assign = vec![usize::MAX; n];
    let mut next = vec![Next::Cut; n];
    let mut nodes = 0u64;

    // The candidates of depth i at the current loads (see the module docs).
    let expand = |i: usize, rows: &Rows| -> Next {
        if rows.usable < suffix[i] {
            return Next::Cut;
        }
        let need = size[i];
        match rows.with_load(cap - need) {
            Some(b) => Next::Perfect(b),
            None => Next::UpTo(cap - need),
        }
    };
    // The next row to try at a depth, advancing its cursor.
    let take = |at: &mut Next, rows: &Rows| -> Option<usize> {
        match *at {
            Next::Cut | Next::Done => None,
            Next::Perfect(b) => {
                *at = Next::Done;
                Some(b)
            }
            Next::UpTo(max_load) => match rows.heaviest_up_to(max_load) {
                Some((load, b)) => {
                    *at = if load == 0 { Next::Done } else { Next::UpTo(load - 1) };
                    Some(b)
                }
                None => {
                    *at = Next::Done;
                    None
                }
            },
        }
    };

    let mut depth = 0usize;
    next[0] = expand(0, &rows);
    loop {
        if let Some(b) = take(&mut next[depth], &rows) {
            rows.add(b, size[depth]);
            assign[depth] = b;
            nodes += 1;
            if depth + 1 == n {
                let mut packed: Vec<Vec<usize>> = vec![Vec::new(); k];
                for (i, &b) in assign.iter().enumerate() {
                    packed[b].push(order[i]);
                }
                packed.retain(|r| !r.is_empty());
                return (Outcome::Packed(packed), nodes);
            }
            if nodes >= node_limit || (nodes.is_multiple_of(1024) && deadline.is_some_and(|d| Instant::now() >= d)) {
                return (Outcome::Unknown, nodes);
            }
            depth += 1;
            next[depth] = expand(depth, &rows);
        } else {
            // every choice at this depth failed: undo the parent's choice
            if depth == 0 {
                return (Outcome::Impossible, nodes);
            }
            depth -= 1;
            rows.add(assign[depth], -size[depth]);
        }
    }
}

#[cfg(test)]
mod reference;

#[cfg(test)]
mod tests {
    use super::*;

    /// The ordered search visits the nodes the scanning search did, in the same order: the same
    /// outcome, rows and node count, under node limits too.
    #[test]
    fn ordered_rows_search_as_the_scan_did() {
        use rand::{RngExt, SeedableRng};
        let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(11);
        for _ in 0..400 {
            let n = rng.random_range(1..40usize);
            let cap = rng.random_range(5..60i64);
            let lens: Vec<i64> = (0..n).map(|_| rng.random_range(1..=cap)).collect();
            let lb = l2(&lens, cap);
            for k in [lb.saturating_sub(1), lb, lb + 1, lb + 3, n + 2] {
                for limit in [1u64, 7, 100, 5_000] {
                    let a = pack_into(&lens, cap, k, limit, None);
                    let b = reference::pack_into_scan(&lens, cap, k, limit, None);
                    assert_eq!(a, b, "{lens:?} cap {cap} k {k} limit {limit}");
                }
            }
        }
    }

    /// Rows of a cap near 2^63: the room of k rows and the tokens left are summed without
    /// overflow, and a packing that exists is found.
    #[test]
    fn rows_near_the_i64_limit() {
        let cap = i64::MAX;
        let lens: Vec<i64> = (0..9).map(|i| (1i64 << 61) + i).collect();
        match pack_into(&lens, cap, 3, u64::MAX, None).0 {
            Outcome::Packed(rows) => assert!(rows.iter().all(|r| r.iter().map(|&s| lens[s] as i128).sum::<i128>() <= cap as i128)),
            other => panic!("{other:?}"),
        }
        assert_eq!(pack_into(&lens, cap, 2, u64::MAX, None).0, Outcome::Impossible);
    }

    /// Reference: plain exhaustive assignment, no pruning.
    fn brute_feasible(lens: &[i64], cap: i64, k: usize) -> bool {
        fn go(i: usize, lens: &[i64], cap: i64, load: &mut Vec<i64>) -> bool {
            if i == lens.len() {
                return true;
            }
            for b in 0..load.len() {
                if load[b] + lens[i] <= cap {
                    load[b] += lens[i];
                    if go(i + 1, lens, cap, load) {
                        return true;
                    }
                    load[b] -= lens[i];
                }
            }
            false
        }
        go(0, lens, cap, &mut vec![0; k])
    }

    #[test]
    fn agrees_with_brute_force() {
        use rand::{RngExt, SeedableRng};
        let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(7);
        for _ in 0..300 {
            let n = rng.random_range(1..9usize);
            let cap = rng.random_range(5..30i64);
            let lens: Vec<i64> = (0..n).map(|_| rng.random_range(1..=cap)).collect();
            for k in 1..=n {
                let (out, _) = pack_into(&lens, cap, k, u64::MAX, None);
                let want = brute_feasible(&lens, cap, k);
                match out {
                    Outcome::Packed(rows) => {
                        assert!(want, "{lens:?} cap {cap} k {k}");
                        assert!(rows.len() <= k);
                        let mut all: Vec<usize> = rows.concat();
                        all.sort();
                        assert_eq!(all, (0..n).collect::<Vec<_>>());
                        assert!(rows.iter().all(|r| r.iter().map(|&s| lens[s]).sum::<i64>() <= cap));
                    }
                    Outcome::Impossible => assert!(!want, "{lens:?} cap {cap} k {k}"),
                    Outcome::Unknown => panic!("no limit was set"),
                }
            }
        }
    }

    #[test]
    fn proves_a_gap_above_l2() {
        // seven items of 34 with cap 100: L1 = L2 = 3, but a row holds only two of them
        let lens = [34i64; 7];
        assert_eq!(l2(&lens, 100), 3);
        assert_eq!(pack_into(&lens, 100, 3, u64::MAX, None).0, Outcome::Impossible);
        assert!(matches!(pack_into(&lens, 100, 4, u64::MAX, None).0, Outcome::Packed(r) if r.len() == 4));
    }

    #[test]
    fn node_limit_says_unknown() {
        // 60 items that almost fit: a 1-node limit cannot finish
        let lens: Vec<i64> = (0..60).map(|i| 30 + (i * 7) % 11).collect();
        let k = super::super::bounds::l2(&lens, 100);
        let (out, nodes) = pack_into(&lens, 100, k, 1, None);
        assert_eq!(out, Outcome::Unknown);
        assert_eq!(nodes, 1);
    }
}
