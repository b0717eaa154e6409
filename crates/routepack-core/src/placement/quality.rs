//! How balanced a placement is over a window, and how balanced any placement could be:
//! the figures the placement benchmarks and tests compare.

use super::replica_counts::rank_load_lower_bound;
use super::Placement;
use crate::error::{invalid, Result};

/// `[L]` aggregate imbalance: max / mean over EP ranks of the rank load, where a rank's load
/// is Σ over its slots of load_e / count_e (each expert's tokens split evenly over its
/// replicas, as `flow` routes them). `loads` is `[L, E]`. 1.0 for a layer without load.
pub fn aggregate_imbalance(placement: &Placement, loads: &[f64]) -> Result<Vec<f64>> {
    let (l_n, e_n) = (placement.num_layers, placement.num_experts);
    if loads.len() != l_n * e_n {
        return Err(invalid("loads", format!("has {} entries; the placement needs L*E = {l_n}*{e_n}", loads.len())));
    }
    let cnt = placement.logcnt();
    let ranks = placement.num_ranks();
    let spr = placement.slots_per_rank;
    Ok((0..l_n)
        .map(|l| {
            let rank: Vec<f64> = (0..ranks)
                .map(|r| {
                    placement.layer(l)[r * spr..(r + 1) * spr]
                        .iter()
                        .filter(|&&e| e >= 0)
                        .map(|&e| loads[l * e_n + e as usize] / cnt[l * e_n + e as usize] as f64)
                        .sum()
                })
                .collect();
            let mean = rank.iter().sum::<f64>() / ranks as f64;
            if mean > 0.0 {
                rank.iter().copied().fold(0.0, f64::max) / mean
            } else {
                1.0
            }
        })
        .collect())
}

/// `[L]` the lowest aggregate imbalance any placement with `num_slots` slots over `ranks`
/// ranks can reach: max(mean rank load, optimal largest per-replica load) / mean.
pub fn imbalance_lower_bound(loads: &[f64], num_layers: usize, num_experts: usize, num_slots: usize, ranks: usize) -> Result<Vec<f64>> {
    if loads.len() != num_layers * num_experts {
        return Err(invalid("loads", format!("has {} entries; expected L*E = {num_layers}*{num_experts}", loads.len())));
    }
    (0..num_layers)
        .map(|l| {
            let w = &loads[l * num_experts..(l + 1) * num_experts];
            let mean = w.iter().sum::<f64>() / ranks as f64;
            Ok(if mean > 0.0 { rank_load_lower_bound(w, num_slots, ranks)? / mean } else { 1.0 })
        })
        .collect()
}
