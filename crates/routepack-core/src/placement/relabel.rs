//! Relabelling a new placement against the one in force, so that as few experts move as
//! possible without changing any load: nodes are interchangeable, ranks inside a node are
//! interchangeable, and slots inside a rank are interchangeable (the cost model sees only
//! which rank and node hosts what). A new rank bin goes to the old rank it overlaps most
//! (maximum-weight assignment, nested: ranks within nodes, then nodes), and an expert that
//! stays on its rank keeps the very slot it occupies.

/// Minimum-cost perfect assignment of an `n × n` cost matrix (row-major), O(n³)
/// (Hungarian method with potentials). Returns `col_of_row`. Deterministic: ties go to the
/// lowest column index scanned first.
pub fn assign_min_cost(cost: &[i64], n: usize) -> Vec<usize> {
    debug_assert_eq!(cost.len(), n * n);
    if n == 0 {
        return Vec::new();
    }
    const INF: i64 = i64::MAX / 4;
    // 1-based rows/columns; column 0 is the virtual start
    let mut u = vec![0i64; n + 1];
    let mut v = vec![0i64; n + 1];
    let mut row_of_col = vec![0usize; n + 1];
    let mut way = vec![0usize; n + 1];
    for i in 1..=n {
        row_of_col[0] = i;
        let mut j0 = 0usize;
        let mut minv = vec![INF; n + 1];
        let mut used = vec![false; n + 1];
        loop {
            used[j0] = true;
            let i0 = row_of_col[j0];
            let mut delta = INF;
            let mut j1 = 0usize;
            for j in 1..=n {
                if !used[j] {
                    let cur = cost[(i0 - 1) * n + (j - 1)] - u[i0] - v[j];
                    if cur < minv[j] {
                        minv[j] = cur;
                        way[j] = j0;
                    }
                    if minv[j] < delta {
                        delta = minv[j];
                        j1 = j;
                    }
                }
            }
            for j in 0..=n {
                if used[j] {
                    u[row_of_col[j]] += delta;
                    v[j] -= delta;
                } else {
                    minv[j] -= delta;
                }
            }
            j0 = j1;
            if row_of_col[j0] == 0 {
                break;
            }
        }
        loop {
            let j1 = way[j0];
            row_of_col[j0] = row_of_col[j1];
            j0 = j1;
            if j0 == 0 {
                break;
            }
        }
    }
    let mut col_of_row = vec![0usize; n];
    for j in 1..=n {
        col_of_row[row_of_col[j] - 1] = j - 1;
    }
    col_of_row
}

/// Σ_e min(copies in a, copies in b) of two expert lists sorted ascending (−1 = empty).
fn overlap(a: &[i32], b: &[i32]) -> i64 {
    let (mut i, mut j, mut n) = (0, 0, 0);
    while i < a.len() && j < b.len() {
        if a[i] < 0 || a[i] < b[j] {
            i += 1;
        } else if b[j] < 0 || b[j] < a[i] {
            j += 1;
        } else {
            n += 1;
            i += 1;
            j += 1;
        }
    }
    n
}

/// Maps new rank bins to old ranks. `new_bins[r]` / `old_bins[r]` are the experts of rank r
/// (`ranks_per_node` consecutive ranks form a node). Returns `old_rank_of_new[r]`, a
/// permutation that keeps node boundaries and maximises the number of (rank, expert) copies
/// already in place.
pub fn match_ranks(new_bins: &[Vec<i32>], old_bins: &[Vec<i32>], ranks_per_node: usize) -> Vec<usize> {
    let ep = new_bins.len();
    let rpn = ranks_per_node.min(ep).max(1);
    let nodes = ep / rpn;
    let sorted = |v: &[Vec<i32>]| -> Vec<Vec<i32>> {
        v.iter()
            .map(|b| {
                let mut s = b.clone();
                s.sort_unstable();
                s
            })
            .collect()
    };
    let (sn, so) = (sorted(new_bins), sorted(old_bins));
    let ov: Vec<i64> = (0..ep * ep).map(|k| overlap(&sn[k / ep], &so[k % ep])).collect();
    // best rank matching for every (new node, old node) pair
    let mut inner: Vec<Vec<usize>> = Vec::with_capacity(nodes * nodes);
    let mut node_cost = vec![0i64; nodes * nodes];
    for a in 0..nodes {
        for b in 0..nodes {
            let c: Vec<i64> = (0..rpn * rpn).map(|k| -ov[(a * rpn + k / rpn) * ep + b * rpn + k % rpn]).collect();
            let m = assign_min_cost(&c, rpn);
            node_cost[a * nodes + b] = m.iter().enumerate().map(|(i, &j)| c[i * rpn + j]).sum();
            inner.push(m);
        }
    }
    let node_map = assign_min_cost(&node_cost, nodes);
    let mut out = vec![0usize; ep];
    for a in 0..nodes {
        let b = node_map[a];
        for (i, &j) in inner[a * nodes + b].iter().enumerate() {
            out[a * rpn + i] = b * rpn + j;
        }
    }
    out
}

/// Lays one rank's experts into its slots given what the slots held: an expert already in a
/// slot stays there; the others fill the freed slots in ascending slot order.
pub fn fill_slots(new_experts: &[i32], old_slots: &[i32]) -> Vec<i32> {
    let mut out = vec![-1i32; old_slots.len()];
    let mut left: Vec<i32> = new_experts.to_vec();
    for (k, &e) in old_slots.iter().enumerate() {
        if e >= 0 {
            if let Some(pos) = left.iter().position(|&x| x == e) {
                out[k] = e;
                left.swap_remove(pos);
            }
        }
    }
    left.sort_unstable();
    let mut it = left.into_iter();
    for slot in out.iter_mut().filter(|x| **x < 0) {
        match it.next() {
            Some(e) => *slot = e,
            None => break,
        }
    }
    out
}

/// One layer's phy2log from new rank bins, relabelled against `old` (that layer's phy2log)
/// when given. Without `old`, ranks keep their bin index and slots hold experts ascending.
pub fn layout_layer(new_bins: &[Vec<i32>], old: Option<&[i32]>, slots_per_rank: usize, ranks_per_node: usize) -> Vec<i32> {
    let ep = new_bins.len();
    let mut out = vec![-1i32; ep * slots_per_rank];
    match old {
        None => {
            for (r, bin) in new_bins.iter().enumerate() {
                let mut v = bin.clone();
                v.sort_unstable();
                out[r * slots_per_rank..r * slots_per_rank + v.len()].copy_from_slice(&v);
            }
        }
        Some(old) => {
            let old_bins: Vec<Vec<i32>> = (0..ep).map(|r| old[r * slots_per_rank..(r + 1) * slots_per_rank].to_vec()).collect();
            let map = match_ranks(new_bins, &old_bins, ranks_per_node);
            for (r, bin) in new_bins.iter().enumerate() {
                let t = map[r];
                let filled = fill_slots(bin, &old_bins[t]);
                out[t * slots_per_rank..(t + 1) * slots_per_rank].copy_from_slice(&filled);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn brute(cost: &[i64], n: usize) -> i64 {
        fn rec(cost: &[i64], n: usize, i: usize, used: &mut Vec<bool>) -> i64 {
            if i == n {
                return 0;
            }
            let mut best = i64::MAX;
            for j in 0..n {
                if !used[j] {
                    used[j] = true;
                    best = best.min(cost[i * n + j] + rec(cost, n, i + 1, used));
                    used[j] = false;
                }
            }
            best
        }
        rec(cost, n, 0, &mut vec![false; n])
    }

    proptest! {
        #[test]
        fn hungarian_is_optimal(n in 1usize..6, seed in prop::collection::vec(-50i64..50, 36)) {
            let cost = &seed[..n * n];
            let m = assign_min_cost(cost, n);
            let mut seen = vec![false; n];
            for &j in &m { prop_assert!(!seen[j]); seen[j] = true; }
            let got: i64 = m.iter().enumerate().map(|(i, &j)| cost[i * n + j]).sum();
            prop_assert_eq!(got, brute(cost, n));
        }
    }

    #[test]
    fn permuted_ranks_and_slots_map_back() {
        // old: 2 nodes × 2 ranks × 2 slots; new = same bins, nodes and ranks shuffled
        let old = vec![0, 1, 2, 3, 4, 5, 6, 7];
        let new_bins = vec![vec![7, 6], vec![5, 4], vec![3, 2], vec![1, 0]];
        assert_eq!(layout_layer(&new_bins, Some(&old), 2, 2), old);
    }

    #[test]
    fn stayers_keep_their_slot() {
        assert_eq!(fill_slots(&[9, 3, 5], &[5, 1, 3]), vec![5, 9, 3]);
    }
}
