//! Replica counts: how many physical slots each logical expert of one layer gets (placement's
//! first step; not the `replication` stage, which copies experts within one exchange).
//!
//! Each extra slot goes to the expert with the largest load per replica, lowest index on ties
//! (DeepSeek EPLB's `replicate_experts`). This greedy water-filling minimises the largest
//! per-replica load `max_e load_e / count_e` over all count vectors with `count_e >= 1` and
//! `Σ count_e = num_slots`: the k-th extra slot always lowers the current maximum, and an
//! exchange argument shows no other allocation of k slots reaches a smaller maximum.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use crate::error::{invalid, Result};

/// Heap entry: the expert with the largest `load / count` first, then the lowest index.
#[derive(PartialEq)]
struct Entry {
    per_replica: f64,
    expert: usize,
}

impl Eq for Entry {}

impl Ord for Entry {
    fn cmp(&self, other: &Self) -> Ordering {
        self.per_replica.total_cmp(&other.per_replica).then(other.expert.cmp(&self.expert))
    }
}

impl PartialOrd for Entry {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// Checks one layer's loads: finite and non-negative.
pub fn check_loads(loads: &[f64], arg: &str) -> Result<()> {
    if let Some((e, v)) = loads.iter().enumerate().find(|(_, v)| !v.is_finite() || **v < 0.0) {
        return Err(invalid(arg, format!("entry {e} is {v}; loads must be finite and >= 0")));
    }
    Ok(())
}

/// `[E]` replica counts (each >= 1, summing to `num_slots`) minimising the largest per-replica
/// load. O(num_slots · log E). Equal to EPLB's argmax loop (same tie rule), which is
/// O((num_slots − E) · E).
pub fn count_replicas(loads: &[f64], num_slots: usize) -> Result<Vec<u32>> {
    let e_n = loads.len();
    if num_slots < e_n {
        return Err(invalid("num_slots", format!("{num_slots} slots cannot hold {e_n} experts once each")));
    }
    check_loads(loads, "loads")?;
    let mut counts = vec![1u32; e_n];
    // Only experts with a load of at least the mean per slot can get a copy: the largest
    // per-replica load never rises and ends at least at that mean (Σ load = Σ count ·
    // load / count), so any lighter expert stays below every entry popped. The margin covers
    // the rounding of the sum and divisions; the pops, hence the counts, are the same.
    let floor = loads.iter().sum::<f64>() / num_slots as f64 * (1.0 - 1e-9);
    let mut heap: BinaryHeap<Entry> =
        loads.iter().enumerate().filter(|&(_, &w)| w >= floor).map(|(e, &w)| Entry { per_replica: w, expert: e }).collect();
    for _ in e_n..num_slots {
        let top = heap.pop().expect("E >= 1 when extra slots exist");
        counts[top.expert] += 1;
        heap.push(Entry { per_replica: loads[top.expert] / counts[top.expert] as f64, expert: top.expert });
    }
    Ok(counts)
}

/// Largest per-replica load of a count vector.
pub fn max_replica_load(loads: &[f64], counts: &[u32]) -> f64 {
    loads.iter().zip(counts).map(|(&w, &c)| w / c as f64).fold(0.0, f64::max)
}

/// Lower bound of the largest rank load of any placement of `loads` on `ranks` ranks with
/// `num_slots` slots in all: max(mean rank load, optimal largest per-replica load).
pub fn rank_load_lower_bound(loads: &[f64], num_slots: usize, ranks: usize) -> Result<f64> {
    let counts = count_replicas(loads, num_slots)?;
    let mean = loads.iter().sum::<f64>() / ranks as f64;
    Ok(mean.max(max_replica_load(loads, &counts)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// EPLB's literal loop, for comparison.
    fn argmax_loop(loads: &[f64], num_slots: usize) -> Vec<u32> {
        let mut c = vec![1u32; loads.len()];
        for _ in loads.len()..num_slots {
            let mut best = 0;
            for e in 1..loads.len() {
                if loads[e] / c[e] as f64 > loads[best] / c[best] as f64 {
                    best = e;
                }
            }
            c[best] += 1;
        }
        c
    }

    /// Smallest achievable max per-replica load by brute force over all count vectors.
    fn brute_min_max(loads: &[f64], extra: usize) -> f64 {
        fn rec(loads: &[f64], i: usize, left: usize, c: &mut Vec<u32>, best: &mut f64) {
            if i == loads.len() {
                if left == 0 {
                    *best = best.min(max_replica_load(loads, c));
                }
                return;
            }
            for k in 0..=left {
                c[i] = 1 + k as u32;
                rec(loads, i + 1, left - k, c, best);
            }
        }
        let mut best = f64::INFINITY;
        rec(loads, 0, extra, &mut vec![1; loads.len()], &mut best);
        best
    }

    #[test]
    fn hot_expert_gets_the_spares() {
        assert_eq!(count_replicas(&[10.0, 1.0, 1.0], 5).unwrap(), vec![3, 1, 1]);
        assert_eq!(count_replicas(&[4.0, 4.0], 3).unwrap(), vec![2, 1]);
    }

    #[test]
    fn bad_input_is_named() {
        assert!(count_replicas(&[1.0, f64::NAN], 3).unwrap_err().to_string().contains("entry 1"));
        assert!(count_replicas(&[1.0, 2.0], 1).unwrap_err().to_string().contains("num_slots"));
    }

    proptest! {
        #[test]
        fn heap_equals_argmax_loop_and_is_optimal(
            loads in prop::collection::vec(0u32..1000, 1..7),
            extra in 0usize..6,
        ) {
            let loads: Vec<f64> = loads.into_iter().map(f64::from).collect();
            let c = count_replicas(&loads, loads.len() + extra).unwrap();
            prop_assert_eq!(&c, &argmax_loop(&loads, loads.len() + extra));
            prop_assert_eq!(c.iter().sum::<u32>() as usize, loads.len() + extra);
            let got = max_replica_load(&loads, &c);
            prop_assert!((got - brute_min_max(&loads, extra)).abs() <= 1e-9 * got.max(1.0));
        }
    }
}
