//! Exact row search: can the samples be packed into `k` rows of capacity `cap`?
//!
//! Depth-first branch and bound over samples in decreasing length (the classic bin-packing
//! search, Martello–Toth style). At each depth the sample goes into an open row with room,
//! fullest row first; rows with equal load are interchangeable, so only one of them is tried
//! (this also means at most one empty row is tried). If the sample fills some row exactly,
//! only that row is tried (a perfect fit dominates). A node is cut when the room that can still
//! be used (room of rows that fit at least the smallest remaining sample) is less than the
//! tokens left. The search stops after `node_limit` nodes (deterministic) or at `deadline`
//! (wall clock, not deterministic) and then says it does not know.

use std::time::Instant;

use super::bounds::l2;
use super::heuristics::decreasing;

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
    let order = decreasing(seq_lens);
    let size: Vec<i64> = order.iter().map(|&s| seq_lens[s]).collect();
    let smallest = size[n - 1];
    let mut suffix = vec![0i64; n + 1];
    for i in (0..n).rev() {
        suffix[i] = suffix[i + 1] + size[i];
    }
    let mut load = vec![0i64; k];
    let mut assign = vec![usize::MAX; n];
    let mut cand: Vec<Vec<usize>> = vec![Vec::new(); n];
    let mut next = vec![0usize; n];
    let mut nodes = 0u64;

    // Fills cand[i] for depth i; returns false when the node is cut.
    let expand = |i: usize, load: &[i64], cand: &mut Vec<usize>| -> bool {
        cand.clear();
        let usable: i64 = load.iter().map(|&l| cap - l).filter(|&r| r >= smallest).sum();
        if usable < suffix[i] {
            return false;
        }
        let need = size[i];
        let mut bins: Vec<usize> = (0..k).filter(|&b| cap - load[b] >= need).collect();
        if let Some(&b) = bins.iter().find(|&&b| cap - load[b] == need) {
            cand.push(b);
            return true;
        }
        bins.sort_by(|&a, &b| load[b].cmp(&load[a]).then(a.cmp(&b)));
        bins.dedup_by(|a, b| load[*a] == load[*b]);
        cand.extend(bins);
        !cand.is_empty()
    };

    let mut depth = 0usize;
    let mut ok = expand(0, &load, &mut cand[0]);
    next[0] = 0;
    loop {
        if ok && next[depth] < cand[depth].len() {
            let b = cand[depth][next[depth]];
            next[depth] += 1;
            load[b] += size[depth];
            assign[depth] = b;
            nodes += 1;
            if depth + 1 == n {
                let mut rows: Vec<Vec<usize>> = vec![Vec::new(); k];
                for (i, &b) in assign.iter().enumerate() {
                    rows[b].push(order[i]);
                }
                rows.retain(|r| !r.is_empty());
                return (Outcome::Packed(rows), nodes);
            }
            if nodes >= node_limit || (nodes.is_multiple_of(1024) && deadline.is_some_and(|d| Instant::now() >= d)) {
                return (Outcome::Unknown, nodes);
            }
            depth += 1;
            ok = expand(depth, &load, &mut cand[depth]);
            next[depth] = 0;
        } else {
            // every choice at this depth failed: undo the parent's choice
            if depth == 0 {
                return (Outcome::Impossible, nodes);
            }
            depth -= 1;
            load[assign[depth]] -= size[depth];
            ok = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
