//! The EPLB baseline: DeepSeek's expert-parallel load balancer (deepseek-ai/EPLB, `eplb.py`),
//! ported from its published algorithm (REFERENCES.md) without changes to its decisions:
//!
//! * replication: each redundant slot goes to argmax(load / count), lowest index on ties;
//! * balanced packing: items by weight descending (stable: equal weights keep index order),
//!   each to the lightest pack (lowest index on ties) that still has room; every pack gets
//!   the same number of items;
//! * hierarchical policy when `num_groups % num_nodes == 0`: expert groups (`E / num_groups`
//!   consecutive experts) are packed onto nodes, every node gets `(R − E) / num_nodes` extra
//!   replicas whatever its load, replicas are made within the node and packed onto its GPUs;
//!   otherwise the global policy (the same with one group and one node).
//!
//! Output in EPLB's convention: `phy2log [L, R]` (slot p on GPU p / (R / num_gpus)),
//! `log2phy [L, E, X]` padded with −1 (index = replica rank, X = the largest count),
//! `logcnt [L, E]`. Weights are float64 (the original casts to float32).
//! Its known defects are kept on purpose (two replicas of one expert may share a GPU; no
//! migration cost): it is the baseline.

use rayon::prelude::*;

use super::Placement;
use crate::error::{invalid, Result};
use crate::sizes;
use crate::topology::Topology;

/// `rebalance_experts`' three tables, int64 like the original.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EplbTables {
    /// MoE layers L.
    pub num_layers: usize,
    /// Logical experts E per layer.
    pub num_experts: usize,
    /// Physical slots R per layer.
    pub num_replicas: usize,
    /// X: the largest replica count over all layers (width of `log2phy`).
    pub max_count: usize,
    /// `[L, R]` logical expert of each physical slot.
    pub phy2log: Vec<i64>,
    /// `[L, E, X]` slot of each (expert, replica rank), −1 padded.
    pub log2phy: Vec<i64>,
    /// `[L, E]` replicas per expert.
    pub logcnt: Vec<i64>,
}

/// `balanced_packing` for one row: `(pack_index [n], rank_in_pack [n])`.
pub fn balanced_packing(weight: &[f64], num_packs: usize) -> (Vec<usize>, Vec<usize>) {
    let n = weight.len();
    let per_pack = n / num_packs;
    if per_pack == 1 {
        return ((0..n).collect(), vec![0; n]);
    }
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| weight[b].total_cmp(&weight[a]));
    let mut pack_index = vec![0usize; n];
    let mut rank_in_pack = vec![0usize; n];
    let mut pack_weight = vec![0.0f64; num_packs];
    let mut pack_items = vec![0usize; num_packs];
    for g in order {
        let mut best = usize::MAX;
        for p in 0..num_packs {
            if pack_items[p] < per_pack && (best == usize::MAX || pack_weight[p] < pack_weight[best]) {
                best = p;
            }
        }
        pack_index[g] = best;
        rank_in_pack[g] = pack_items[best];
        pack_weight[best] += weight[g];
        pack_items[best] += 1;
    }
    (pack_index, rank_in_pack)
}

/// `replicate_experts` for one row: `(phy2log [num_phy], rank [num_phy], logcnt [n])`.
pub fn replicate_experts(weight: &[f64], num_phy: usize) -> (Vec<usize>, Vec<usize>, Vec<usize>) {
    let n = weight.len();
    let mut phy2log: Vec<usize> = (0..n).collect();
    let mut rank = vec![0usize; n];
    let mut logcnt = vec![1usize; n];
    for _ in n..num_phy {
        let mut best = 0;
        for e in 1..n {
            if weight[e] / logcnt[e] as f64 > weight[best] / logcnt[best] as f64 {
                best = e;
            }
        }
        phy2log.push(best);
        rank.push(logcnt[best]);
        logcnt[best] += 1;
    }
    (phy2log, rank, logcnt)
}

/// `rebalance_experts_hierarchical` for one layer: `(phy2log [R], phyrank [R], logcnt [E])`.
fn hierarchical_layer(
    weight: &[f64],
    num_replicas: usize,
    num_groups: usize,
    num_nodes: usize,
    num_gpus: usize,
) -> (Vec<usize>, Vec<usize>, Vec<usize>) {
    let e_n = weight.len();
    let group_size = e_n / num_groups;
    let groups_per_node = num_groups / num_nodes;
    let phy_per_gpu = num_replicas / num_gpus;
    let log_per_node = e_n / num_nodes;
    let phy_per_node = num_replicas / num_nodes;

    // step 1: expert groups onto nodes; mlog = node-major relabelling of logical experts
    let tokens_per_group: Vec<f64> = (0..num_groups).map(|g| weight[g * group_size..(g + 1) * group_size].iter().sum()).collect();
    let (gpack, grank) = balanced_packing(&tokens_per_group, num_nodes);
    let mut log2mlog = vec![0usize; e_n];
    let mut mlog2log = vec![0usize; e_n];
    for (e, to) in log2mlog.iter_mut().enumerate() {
        let g = e / group_size;
        let m = (gpack[g] * groups_per_node + grank[g]) * group_size + e % group_size;
        *to = m;
        mlog2log[m] = e;
    }

    let mut phy2log = vec![0usize; num_replicas];
    let mut phyrank = vec![0usize; num_replicas];
    let mut mlogcnt_all = vec![0usize; e_n];
    for node in 0..num_nodes {
        // step 2: replicas within the node, from its own (R − E) / num_nodes spare slots
        let tokens_per_mlog: Vec<f64> = (0..log_per_node).map(|j| weight[mlog2log[node * log_per_node + j]]).collect();
        let (phy2mlog, rank, mlogcnt) = replicate_experts(&tokens_per_mlog, phy_per_node);
        // step 3: the node's replicas onto its GPUs
        let tokens_per_phy: Vec<f64> = phy2mlog.iter().map(|&m| tokens_per_mlog[m] / mlogcnt[m] as f64).collect();
        let (pack, rip) = balanced_packing(&tokens_per_phy, num_gpus / num_nodes);
        for p in 0..phy_per_node {
            let pphy = pack[p] * phy_per_gpu + rip[p];
            let m = phy2mlog[p] + node * log_per_node;
            phy2log[node * phy_per_node + pphy] = mlog2log[m];
            phyrank[node * phy_per_node + pphy] = rank[p];
        }
        for j in 0..log_per_node {
            mlogcnt_all[node * log_per_node + j] = mlogcnt[j];
        }
    }
    let logcnt = (0..e_n).map(|e| mlogcnt_all[log2mlog[e]]).collect();
    (phy2log, phyrank, logcnt)
}

/// DeepSeek's `rebalance_experts(weight [L, E], num_replicas, num_groups, num_nodes, num_gpus)`.
/// Layers run in parallel (each is independent, results kept in layer order).
pub fn rebalance_experts(
    weight: &[f64],
    num_layers: usize,
    num_experts: usize,
    num_replicas: usize,
    num_groups: usize,
    num_nodes: usize,
    num_gpus: usize,
) -> Result<EplbTables> {
    check_args(weight, num_layers, num_experts, num_replicas, num_groups, num_nodes, num_gpus)?;
    let (groups, nodes) = if num_groups.is_multiple_of(num_nodes) { (num_groups, num_nodes) } else { (1, 1) };
    let per_layer: Vec<(Vec<usize>, Vec<usize>, Vec<usize>)> = (0..num_layers)
        .into_par_iter()
        .map(|l| hierarchical_layer(&weight[l * num_experts..(l + 1) * num_experts], num_replicas, groups, nodes, num_gpus))
        .collect();
    let max_count = per_layer.iter().flat_map(|x| x.2.iter().copied()).max().unwrap_or(1);
    // log2phy's width is known only now: check it before allocating it (fallibly)
    let log2phy = sizes::filled("num_replicas", "log2phy", (num_layers * num_experts).saturating_mul(max_count), -1)?;
    let mut t = EplbTables {
        num_layers,
        num_experts,
        num_replicas,
        max_count,
        phy2log: Vec::with_capacity(num_layers * num_replicas),
        log2phy,
        logcnt: Vec::with_capacity(num_layers * num_experts),
    };
    for (l, (p2l, rank, cnt)) in per_layer.into_iter().enumerate() {
        for (p, (&e, &r)) in p2l.iter().zip(&rank).enumerate() {
            t.log2phy[(l * num_experts + e) * max_count + r] = p as i64;
        }
        t.phy2log.extend(p2l.into_iter().map(|e| e as i64));
        t.logcnt.extend(cnt.into_iter().map(|c| c as i64));
    }
    Ok(t)
}

/// Refuses a table of `bytes` over [`sizes::MAX_TABLE_BYTES`], blaming the argument that sized it.
fn check_bytes(arg: &str, bytes: u128, what: &str) -> Result<()> {
    sizes::check_bytes(arg, what, bytes)
}

#[allow(clippy::too_many_arguments)]
fn check_args(
    weight: &[f64],
    num_layers: usize,
    num_experts: usize,
    num_replicas: usize,
    num_groups: usize,
    num_nodes: usize,
    num_gpus: usize,
) -> Result<()> {
    if num_layers == 0 || num_experts == 0 || weight.len() != num_layers * num_experts {
        return Err(invalid(
            "weight",
            format!("has {} entries; expected L*E with L, E >= 1 (L={num_layers}, E={num_experts})", weight.len()),
        ));
    }
    super::replica_counts::check_loads(weight, "weight")?;
    for (name, v) in [("num_groups", num_groups), ("num_nodes", num_nodes), ("num_gpus", num_gpus)] {
        if v == 0 {
            return Err(invalid(name, "must be >= 1, got 0"));
        }
    }
    if num_replicas < num_experts {
        return Err(invalid("num_replicas", format!("{num_replicas} < num_experts = {num_experts}")));
    }
    // every layer's tables (phy2log, the physical ranks and their working copies, about
    // 48 bytes per replica) are built at once, layers in parallel
    check_bytes("num_replicas", num_layers as u128 * num_replicas as u128 * 48, "the per-layer tables")?;
    // below the ceiling: those, the results (phy2log, and log2phy at its even width, one
    // replica each) and logcnt must fit what this process can hold now
    let replicas = sizes::table_bytes(&[num_layers, num_replicas], 48 + 8 + 8);
    let call = replicas.saturating_add(sizes::table_bytes(&[num_layers, num_experts], 8));
    sizes::check_call("num_replicas", "EPLB's tables", call)?;
    if !num_replicas.is_multiple_of(num_gpus) {
        return Err(invalid("num_replicas", format!("{num_replicas} is not a multiple of num_gpus = {num_gpus}")));
    }
    if !num_gpus.is_multiple_of(num_nodes) {
        return Err(invalid("num_gpus", format!("{num_gpus} is not a multiple of num_nodes = {num_nodes}")));
    }
    if num_groups.is_multiple_of(num_nodes) {
        if !num_experts.is_multiple_of(num_groups) {
            return Err(invalid("num_groups", format!("num_experts = {num_experts} is not a multiple of num_groups = {num_groups}")));
        }
        if !num_experts.is_multiple_of(num_nodes) || !num_replicas.is_multiple_of(num_nodes) {
            return Err(invalid(
                "num_nodes",
                format!("{num_nodes} does not divide num_experts = {num_experts} and num_replicas = {num_replicas}"),
            ));
        }
    }
    Ok(())
}

/// One expert group per node of an EP group when the experts divide evenly (which selects
/// EPLB's hierarchical policy), else 1 (its global policy).
///
/// Not the default: the `eplb` stage passes the model's own group count
/// (`CostModel.expert_groups`, 1 for a model that routes without groups, as DeepSeek, vLLM and
/// SGLang do). This is the `eplb_hierarchical` configuration, run as a second, explicitly named
/// baseline: groups invented from consecutive expert ids, one per node.
pub fn node_groups(num_experts: usize, topo: &Topology) -> usize {
    let nodes = topo.nodes_per_group();
    if nodes > 1 && num_experts.is_multiple_of(nodes) {
        nodes
    } else {
        1
    }
}

/// EPLB as a routepack `Placement`: `num_gpus = ep`, `num_nodes` = nodes of one EP group,
/// `num_replicas = ep · slots_per_rank` (every slot filled). `loads` is `[L, E]`.
pub fn eplb_placement(loads: &[f64], num_layers: usize, num_experts: usize, topo: &Topology, num_groups: usize) -> Result<Placement> {
    topo.check_experts(num_experts)?;
    // EPLB's tables (about 64 bytes a replica, all layers at once) and the placement's
    Placement::check_policy_call("EPLB's placement", num_layers, topo.num_slots(), num_experts, 64 + 4)?;
    let t = rebalance_experts(loads, num_layers, num_experts, topo.num_slots(), num_groups, topo.nodes_per_group(), topo.ep)?;
    let phy2log = t.phy2log.iter().map(|&e| e as i32).collect();
    Placement::new(phy2log, num_layers, num_experts, topo.slots_per_rank)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The worked example of EPLB's README (2 layers, 12 experts, 16 replicas, 4 groups,
    /// 2 nodes, 8 GPUs): its printed phy2log.
    #[test]
    fn readme_example() {
        let w = [
            90., 132., 40., 61., 104., 165., 39., 4., 73., 56., 183., 86., //
            20., 107., 104., 64., 19., 197., 187., 157., 172., 86., 16., 27.,
        ];
        let t = rebalance_experts(&w, 2, 12, 16, 4, 2, 8).unwrap();
        let expect: Vec<i64> = vec![
            5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1, //
            7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1,
        ];
        assert_eq!(t.phy2log, expect);
        let cnt: i64 = t.logcnt[..12].iter().sum();
        assert_eq!(cnt, 16);
        // log2phy is the inverse of phy2log
        for l in 0..2 {
            for e in 0..12 {
                for r in 0..t.max_count {
                    let p = t.log2phy[(l * 12 + e) * t.max_count + r];
                    assert_eq!(p >= 0, (r as i64) < t.logcnt[l * 12 + e]);
                    if p >= 0 {
                        assert_eq!(t.phy2log[l * 16 + p as usize], e as i64);
                    }
                }
            }
        }
    }

    #[test]
    fn packing_is_equal_count_heaviest_first() {
        let (pack, rank) = balanced_packing(&[5.0, 1.0, 4.0, 2.0], 2);
        assert_eq!(pack, vec![0, 0, 1, 1]); // 5→0, 4→1, 2→1 (lighter), 1→0 (1 is full)
        assert_eq!(rank, vec![0, 1, 0, 1]);
    }

    #[test]
    fn bad_arguments_are_named() {
        let w = vec![1.0; 12];
        assert!(rebalance_experts(&w, 1, 12, 10, 1, 1, 2).unwrap_err().to_string().contains("num_replicas"));
        assert!(rebalance_experts(&w, 1, 12, 15, 1, 1, 2).unwrap_err().to_string().contains("multiple of num_gpus"));
        assert!(rebalance_experts(&w, 1, 12, 16, 5, 5, 10).unwrap_err().to_string().contains("num_gpus"));
        assert!(rebalance_experts(&w, 2, 12, 16, 1, 1, 8).unwrap_err().to_string().contains("weight"));
    }

    /// A replica count no machine can hold is refused, with the bytes, before allocating.
    #[test]
    fn absurd_replica_counts_are_refused() {
        let w = vec![1.0; 16];
        let e = rebalance_experts(&w, 2, 8, 1 << 40, 4, 2, 4).unwrap_err().to_string();
        assert!(e.contains("num_replicas") && e.contains("bytes"), "{e}");
        assert!(rebalance_experts(&w, 2, 8, 1 << 20, 4, 2, 4).is_ok());
    }
}
