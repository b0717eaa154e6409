//! `relibra` placement: ReLibra's inter-batch expert reordering (seed 001), as far as it is
//! published.
//!
//! ReLibra "performs expert reordering to redistribute experts for batch-level cross-node
//! balancing" at the inter-batch timescale (once per window, from the batch's replayed
//! routing), leaving intra-node fluctuation to its intra-batch replication
//! (`replication::relibra`). Reordering permutes experts over slots: no redundant copies are
//! made, and every rank keeps its slot count.
//!
//! Per layer, starting from the placement in force (or the static one):
//! 1. across nodes (the published part): while some swap of two slots between the heaviest
//!    node and another node lowers the larger of the two node loads, make the swap that
//!    brings them closest to their mean (largest reduction of the pair's maximum);
//! 2. within each node (our assumption: the abstract does not say how a node orders its
//!    experts over its GPUs; balancing them the same way can only help the baseline):
//!    the same swaps between the ranks of the node.
//!
//! A slot's load is its expert's load divided by the expert's slot count (an empty slot
//! weighs 0); a swap never puts two slots of one expert on one rank. Swaps start from the
//! previous placement, so only experts that must move do.

use rayon::prelude::*;

use super::{static_placement, Placement};
use crate::error::{invalid, Result};
use crate::topology::Topology;

/// Reorders experts per layer. `loads` `[L * E]` (float64, >= 0): tokens per logical expert
/// that the placement balances. `previous`: the placement in force (same shape), or None for
/// the static placement.
pub fn relibra_placement(
    loads: &[f64],
    num_layers: usize,
    num_experts: usize,
    topo: &Topology,
    previous: Option<&Placement>,
) -> Result<Placement> {
    topo.check_experts(num_experts)?;
    if loads.len() != num_layers * num_experts {
        return Err(invalid("loads", format!("has {} entries, expected L*E = {num_layers}*{num_experts}", loads.len())));
    }
    if let Some(i) = loads.iter().position(|x| !x.is_finite() || *x < 0.0) {
        return Err(invalid(
            "loads",
            format!("layer {}, expert {} has {}; loads must be finite and >= 0", i / num_experts, i % num_experts, loads[i]),
        ));
    }
    // the start placement, each layer's reordered copy and the result (12 bytes a slot), and
    // the placement's tables
    Placement::check_policy_call("ReLibra's placement", num_layers, topo.num_slots(), num_experts, 12)?;
    let start = match previous {
        Some(p) => {
            if p.num_layers != num_layers || p.num_experts != num_experts {
                return Err(invalid(
                    "previous",
                    format!("placement is for L={}, E={}, expected L={num_layers}, E={num_experts}", p.num_layers, p.num_experts),
                ));
            }
            p.check_topology(topo)?;
            p.clone()
        }
        None => static_placement(num_layers, num_experts, topo)?,
    };
    let ns = topo.num_slots();
    let layers: Vec<Vec<i32>> = (0..num_layers)
        .into_par_iter()
        .map(|l| {
            let mut phy = start.layer(l).to_vec();
            reorder_layer(&mut phy, &loads[l * num_experts..(l + 1) * num_experts], topo);
            phy
        })
        .collect();
    let mut phy2log = Vec::with_capacity(num_layers * ns);
    layers.into_iter().for_each(|v| phy2log.extend(v));
    Placement::new(phy2log, num_layers, num_experts, topo.slots_per_rank)
}

/// Swaps within one layer's `phy` `[ep * slots_per_rank]`: across nodes, then within nodes.
fn reorder_layer(phy: &mut [i32], load: &[f64], topo: &Topology) {
    let spr = topo.slots_per_rank;
    let mut count = vec![0usize; load.len()];
    for &e in phy.iter() {
        if e >= 0 {
            count[e as usize] += 1;
        }
    }
    let rpn = topo.ranks_per_group_node();
    let nodes = topo.ep / rpn;
    // bins: nodes (slots of rpn ranks each), then the ranks of each node
    if nodes > 1 {
        let bins: Vec<Vec<usize>> = (0..nodes).map(|n| (n * rpn * spr..(n + 1) * rpn * spr).collect()).collect();
        balance(phy, load, &count, &bins, spr);
    }
    for n in 0..nodes {
        let bins: Vec<Vec<usize>> = (n * rpn..(n + 1) * rpn).map(|r| (r * spr..(r + 1) * spr).collect()).collect();
        balance(phy, load, &count, &bins, spr);
    }
}

/// Swaps slots between `bins` (each a list of slot indices) until no swap between the
/// heaviest bin and another lowers the pair's larger load.
fn balance(phy: &mut [i32], load: &[f64], count: &[usize], bins: &[Vec<usize>], spr: usize) {
    let w = |e: i32| if e < 0 { 0.0 } else { load[e as usize] / count[e as usize] as f64 };
    let mut bin_load: Vec<f64> = bins.iter().map(|b| b.iter().map(|&p| w(phy[p])).sum()).collect();
    // a swap lowers a potential (Σ bin load²) strictly, so this ends; the cap is a backstop
    let cap = 4 * bins.iter().map(Vec::len).sum::<usize>();
    for _ in 0..cap {
        let h = (0..bins.len()).fold(0, |b, i| if bin_load[i] > bin_load[b] { i } else { b });
        let mut others: Vec<usize> = (0..bins.len()).filter(|&i| i != h).collect();
        others.sort_by(|&a, &b| bin_load[a].total_cmp(&bin_load[b]).then(a.cmp(&b)));
        let mut done = None;
        for &o in &others {
            let gap = bin_load[h] - bin_load[o];
            if gap <= 0.0 {
                break;
            }
            // best swap: transfer d = w(a) - w(b) in (0, gap), as close to gap / 2 as possible
            let mut best: Option<(f64, usize, usize)> = None;
            for &a in &bins[h] {
                let wa = w(phy[a]);
                if wa <= 0.0 {
                    continue;
                }
                for &b in &bins[o] {
                    let d = wa - w(phy[b]);
                    if d <= 0.0 || d >= gap || phy[a] == phy[b] {
                        continue;
                    }
                    let score = (d - gap / 2.0).abs();
                    if !matches!(best, Some((s, _, _)) if score >= s) && !dup_after_swap(phy, a, b, spr) {
                        best = Some((score, a, b));
                    }
                }
            }
            if let Some((_, a, b)) = best {
                done = Some((o, a, b));
                break;
            }
        }
        let Some((o, a, b)) = done else { break };
        let d = w(phy[a]) - w(phy[b]);
        phy.swap(a, b);
        bin_load[h] -= d;
        bin_load[o] += d;
    }
}

/// Whether swapping slots a and b would put two slots of one expert on one rank.
fn dup_after_swap(phy: &[i32], a: usize, b: usize, spr: usize) -> bool {
    let (ra, rb) = (a / spr, b / spr);
    if ra == rb {
        return false;
    }
    let on = |r: usize, e: i32, skip: usize| e >= 0 && (r * spr..(r + 1) * spr).any(|p| p != skip && phy[p] == e);
    on(rb, phy[a], b) || on(ra, phy[b], a)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node_loads(p: &Placement, l: usize, loads: &[f64], topo: &Topology) -> Vec<f64> {
        let cnt = p.logcnt();
        let e_n = p.num_experts;
        let per_node = topo.ranks_per_group_node() * topo.slots_per_rank;
        let mut out = vec![0.0; topo.ep / topo.ranks_per_group_node()];
        for (s, &e) in p.layer(l).iter().enumerate() {
            if e >= 0 {
                out[s / per_node] += loads[l * e_n + e as usize] / cnt[l * e_n + e as usize] as f64;
            }
        }
        out
    }

    #[test]
    fn balances_nodes_and_keeps_a_permutation() {
        let topo = Topology::new(16, 16, 4, 4).unwrap();
        let (l_n, e_n) = (2, 64);
        // hot experts all on node 0 under the static placement
        let loads: Vec<f64> = (0..l_n * e_n).map(|i| if i % e_n < 8 { 100.0 } else { 1.0 + (i % 7) as f64 }).collect();
        let st = static_placement(l_n, e_n, &topo).unwrap();
        let p = relibra_placement(&loads, l_n, e_n, &topo, None).unwrap();
        for l in 0..l_n {
            let before = node_loads(&st, l, &loads, &topo);
            let after = node_loads(&p, l, &loads, &topo);
            let spread = |v: &[f64]| v.iter().cloned().fold(f64::MIN, f64::max) - v.iter().cloned().fold(f64::MAX, f64::min);
            assert!(spread(&after) < 0.2 * spread(&before), "{before:?} -> {after:?}");
            let mut seen: Vec<i32> = p.layer(l).iter().copied().filter(|&e| e >= 0).collect();
            seen.sort_unstable();
            assert_eq!(seen, (0..e_n as i32).collect::<Vec<_>>());
        }
        // per-rank slot use is unchanged (a permutation of slots)
        assert_eq!(p.phy2log.iter().filter(|&&e| e < 0).count(), st.phy2log.iter().filter(|&&e| e < 0).count());
    }

    #[test]
    fn balanced_start_does_not_move() {
        let topo = Topology::new(8, 8, 4, 2).unwrap();
        let loads = vec![5.0; 16];
        let st = static_placement(1, 16, &topo).unwrap();
        assert_eq!(relibra_placement(&loads, 1, 16, &topo, Some(&st)).unwrap(), st);
    }

    #[test]
    fn bad_loads_are_named() {
        let topo = Topology::new(8, 8, 4, 2).unwrap();
        let e = relibra_placement(&[1.0; 15], 1, 16, &topo, None).unwrap_err();
        assert!(e.to_string().contains("loads"), "{e}");
        let mut l = vec![1.0; 16];
        l[3] = f64::NAN;
        let e = relibra_placement(&l, 1, 16, &topo, None).unwrap_err();
        assert!(e.to_string().contains("expert 3"), "{e}");
    }
}
