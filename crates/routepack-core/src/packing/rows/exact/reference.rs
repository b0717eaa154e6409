//! The exact search as it was before its rows were kept ordered (one O(k) scan per node):
//! the reference the ordered search must match node for node.

use std::time::Instant;

use super::{l2, Outcome};
use crate::packing::rows::heuristics::decreasing;

pub fn pack_into_scan(seq_lens: &[i64], cap: i64, k: usize, node_limit: u64, deadline: Option<Instant>) -> (Outcome, u64) {
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
