//! `kk`: verl's sequence balancing, the baseline of the `eplb` preset, implemented from its
//! published behaviour (REFERENCES.md, `verl/utils/seqlen_balancing.py`):
//!
//! 1. Workload per sample: 24576·n + n² (12·h²·n + 2·h·n² over 2h for h = 4096).
//! 2. DP balance: Karmarkar–Karp (largest differencing) over the workloads into dp partitions
//!    with equal sample counts; partition i goes to DP rank i. (verl requires S % dp == 0; we
//!    pad with zero-workload placeholders, so counts differ by at most one.)
//! 3. Microbatches per rank: k = ceil(tokens / cap) (at most the rank's sample count),
//!    all-reduced to the max over DP ranks; each rank's samples are split into k microbatches
//!    by Karmarkar–Karp on workload without the equal-count constraint.
//! 4. Overflow fix (verl 2026): when a microbatch exceeds the cap, repartition with k + 1. We
//!    retry on every rank with the same k, so counts stay equal (the retry is all-reduced).
//! 5. Order: microbatches sorted by workload descending (ties by their smallest sample index,
//!    descending), then the even positions reversed followed by the odd ones, which puts small
//!    microbatches at both ends.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use super::rows::check_cap;
use super::Packing;
use crate::error::{Error, Result};

/// verl's workload of a sample of length n.
#[inline]
pub fn workload(n: i64) -> i128 {
    24576 * n as i128 + (n as i128) * (n as i128)
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Set {
    sum: i128,
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

/// k sets kept in decreasing order.
struct State {
    sets: Vec<Set>,
    id: usize,
}

impl State {
    fn spread(&self) -> i128 {
        self.sets[0].sum - self.sets[self.sets.len() - 1].sum
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
/// it, every item starts its own state. Partitions come out in decreasing order of sum.
pub fn karmarkar_karp(weights: &[i128], k: usize, equal_size: bool) -> Vec<Vec<usize>> {
    assert!(k >= 1, "karmarkar_karp: k must be >= 1");
    let n = weights.len();
    let padded = if equal_size { n.div_ceil(k) * k } else { n };
    // placeholders (index >= n) have weight 0 and sort first among equal weights
    let w = |i: usize| if i < n { weights[i] } else { 0 };
    let mut order: Vec<usize> = (0..padded).collect();
    order.sort_by(|&a, &b| w(a).cmp(&w(b)).then(((a < n) as u8).cmp(&((b < n) as u8))).then(a.cmp(&b)));
    let new_state = |items: &[usize], id: usize| {
        let mut sets: Vec<Set> = (0..k).map(|_| Set { sum: 0, items: Vec::new() }).collect();
        for (j, &i) in items.iter().enumerate() {
            sets[j] = Set { sum: w(i), items: vec![i] };
        }
        sets.sort_by(|a, b| b.cmp(a));
        State { sets, id }
    };
    let mut heap = BinaryHeap::new();
    let chunk = if equal_size { k } else { 1 };
    for (id, items) in order.chunks(chunk).enumerate() {
        heap.push(new_state(items, id));
    }
    let mut next_id = heap.len();
    while heap.len() > 1 {
        let mut a = heap.pop().unwrap();
        let mut b = heap.pop().unwrap();
        for i in 0..k {
            let other = std::mem::replace(&mut b.sets[k - 1 - i], Set { sum: 0, items: Vec::new() });
            a.sets[i].sum += other.sum;
            a.sets[i].items.extend(other.items);
        }
        a.sets.sort_by(|x, y| y.cmp(x));
        a.id = next_id;
        next_id += 1;
        heap.push(a);
    }
    let last = heap.pop().expect("at least one state");
    last.sets
        .into_iter()
        .map(|s| {
            let mut items: Vec<usize> = s.items.into_iter().filter(|&i| i < n).collect();
            items.sort_unstable();
            items
        })
        .collect()
}

/// What `kk` did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KkReport {
    /// Microbatches per rank before any overflow retry: max over ranks of ceil(tokens / cap).
    pub first_micro: usize,
    /// Microbatches per rank in the plan.
    pub micro: usize,
    /// Repartitions forced by a microbatch over the cap.
    pub retries: usize,
    /// Tokens of the fullest microbatch.
    pub max_row_tokens: i64,
}

/// verl's `kk` packing on `dp` ranks (see the module comment).
pub fn verl_kk(seq_lens: &[i64], token_cap: i64, dp: usize) -> Result<(Packing, KkReport)> {
    check_cap(seq_lens, token_cap)?;
    let s_n = seq_lens.len();
    if dp == 0 {
        return Err(crate::error::invalid("dp", "must be >= 1, got 0"));
    }
    if s_n < dp {
        return Err(Error::Infeasible(format!("{s_n} samples cannot fill {dp} DP ranks with non-empty microbatches")));
    }
    let wl: Vec<i128> = seq_lens.iter().map(|&n| workload(n)).collect();
    let ranks = karmarkar_karp(&wl, dp, true);
    let tokens = |items: &[usize]| items.iter().map(|&s| seq_lens[s]).sum::<i64>();
    let fewest = ranks.iter().map(|r| r.len()).min().unwrap();
    let first = ranks
        .iter()
        .map(|r| (tokens(r) as u64).div_ceil(token_cap as u64) as usize)
        .max()
        .unwrap()
        .min(fewest)
        .max(1);
    let mut k = first;
    let micro_parts = loop {
        let parts: Vec<Vec<Vec<usize>>> = ranks
            .iter()
            .map(|r| {
                let w: Vec<i128> = r.iter().map(|&s| wl[s]).collect();
                karmarkar_karp(&w, k, false)
                    .into_iter()
                    .map(|p| p.into_iter().map(|i| r[i]).collect::<Vec<usize>>())
                    .collect()
            })
            .collect();
        let fits = parts.iter().flatten().all(|p| !p.is_empty() && tokens(p) <= token_cap);
        if fits {
            break parts;
        }
        if k >= fewest {
            // with one sample per microbatch nothing overflows, so this is unreachable unless a
            // rank has fewer samples than k
            return Err(Error::Infeasible(format!(
                "kk: a microbatch overflows token_cap = {token_cap} with {k} microbatches per rank, and a rank has only {fewest} samples"
            )));
        }
        k += 1;
    };
    let mut sample_rank = vec![0i32; s_n];
    let mut sample_micro = vec![0i32; s_n];
    let mut max_row = 0i64;
    for (r, mut parts) in micro_parts.into_iter().enumerate() {
        let load = |p: &Vec<usize>| p.iter().map(|&s| wl[s]).sum::<i128>();
        parts.sort_by(|a, b| load(b).cmp(&load(a)).then(b[0].cmp(&a[0])));
        let evens: Vec<Vec<usize>> = parts.iter().step_by(2).cloned().collect();
        let odds: Vec<Vec<usize>> = parts.iter().skip(1).step_by(2).cloned().collect();
        let ordered = evens.into_iter().rev().chain(odds);
        for (m, p) in ordered.enumerate() {
            max_row = max_row.max(tokens(&p));
            for s in p {
                sample_rank[s] = r as i32;
                sample_micro[s] = m as i32;
            }
        }
    }
    let report = KkReport { first_micro: first, micro: k, retries: k - first, max_row_tokens: max_row };
    Ok((Packing { sample_rank, sample_micro, num_micro: k }, report))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kk_two_way_is_the_textbook_answer() {
        // largest differencing on {8,7,6,5,4} ends with a difference of 2 (sums 16 and 14)
        let parts = karmarkar_karp(&[8, 7, 6, 5, 4], 2, false);
        let sums: Vec<i128> = parts.iter().map(|p| p.iter().map(|&i| [8, 7, 6, 5, 4][i]).sum()).collect();
        assert_eq!(sums.iter().sum::<i128>(), 30);
        assert_eq!(sums, vec![16, 14]);
    }

    #[test]
    fn equal_size_counts_and_padding() {
        let w: Vec<i128> = (1..=10).map(|x| x * x).collect();
        let parts = karmarkar_karp(&w, 5, true);
        assert!(parts.iter().all(|p| p.len() == 2));
        let parts = karmarkar_karp(&w[..9], 4, true);
        let mut lens: Vec<usize> = parts.iter().map(|p| p.len()).collect();
        lens.sort();
        assert_eq!(lens, vec![2, 2, 2, 3]);
    }

    #[test]
    fn verl_kk_respects_cap_and_orders_small_at_ends() {
        let lens: Vec<i64> = (0..64).map(|i| 100 + (i * 37) % 900).collect();
        let (p, rep) = verl_kk(&lens, 1000, 4).unwrap();
        assert_eq!(p.num_micro, rep.micro);
        assert!(rep.max_row_tokens <= 1000);
        for r in 0..4 {
            let wl: Vec<i128> = (0..p.num_micro)
                .map(|m| (0..64).filter(|&s| p.sample_rank[s] == r && p.sample_micro[s] == m as i32).map(|s| workload(lens[s])).sum())
                .collect();
            assert!(wl.iter().all(|&x| x > 0));
            let peak = wl.iter().enumerate().max_by_key(|x| x.1).unwrap().0;
            // the heaviest microbatch is in the middle, never at an end (when there are 3+)
            if wl.len() >= 3 {
                assert!(peak != 0 && peak != wl.len() - 1 || wl.iter().all(|&x| x == wl[peak]), "{wl:?}");
            }
        }
    }
}
