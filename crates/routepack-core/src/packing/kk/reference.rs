//! verl's Karmarkar–Karp as it was before states kept only their non-empty sets (k sets per
//! state, i128 sums): the reference the sparse states must match on every input it handled.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use crate::error::{Error, Result};
use crate::packing::rows::check_cap;
use crate::packing::Packing;

fn workload_i128(n: i64) -> i128 {
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
pub fn karmarkar_karp_full(weights: &[i128], k: usize, equal_size: bool) -> Vec<Vec<usize>> {
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

/// verl's `kk` packing on `dp` ranks (see the module comment).
pub fn verl_kk_full(seq_lens: &[i64], token_cap: i64, dp: usize) -> Result<(Packing, [usize; 3], i64)> {
    check_cap(seq_lens, token_cap)?;
    let s_n = seq_lens.len();
    if dp == 0 {
        return Err(crate::error::invalid("dp", "must be >= 1, got 0"));
    }
    if s_n < dp {
        return Err(Error::Infeasible(format!("window: {s_n} samples cannot fill topo.dp = {dp} DP ranks with non-empty microbatches")));
    }
    let wl: Vec<i128> = seq_lens.iter().map(|&n| workload_i128(n)).collect();
    let ranks = karmarkar_karp_full(&wl, dp, true);
    let tokens = |items: &[usize]| items.iter().map(|&s| seq_lens[s]).sum::<i64>();
    let fewest = ranks.iter().map(|r| r.len()).min().unwrap();
    let first = ranks.iter().map(|r| (tokens(r) as u64).div_ceil(token_cap as u64) as usize).max().unwrap().min(fewest).max(1);
    let mut k = first;
    let micro_parts = loop {
        let parts: Vec<Vec<Vec<usize>>> = ranks
            .iter()
            .map(|r| {
                let w: Vec<i128> = r.iter().map(|&s| wl[s]).collect();
                karmarkar_karp_full(&w, k, false).into_iter().map(|p| p.into_iter().map(|i| r[i]).collect::<Vec<usize>>()).collect()
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
    Ok((Packing { sample_rank, sample_micro, num_micro: k }, [first, k, k - first], max_row))
}
