//! The memory [`super::simulate_in`] reserves before it allocates: its estimate of the
//! bytes it holds at once, checked against the process's limit (`crate::sizes::check_call`).

use crate::topology::Topology;

/// Bytes [`super::simulate_in`] holds at once for a window of `s_n` samples × `l_n` layers ×
/// `e_n` experts under a plan of `m_n` microbatches (the estimate it reserves, naming
/// `window`, whose layers and experts size the largest part): every exchange's part of the
/// demand sums (`[L * E]` totals and shares, `GmSums`) and its layers' costs, each sample's
/// rows, each worker's origin `[ep * E]` and scratch, the gathered `DemandSums`, the
/// bound's own per-sample and per-expert tables, the replica buckets, the imbalance, the
/// placement's slot tables ([`crate::plan::Placement::slot_tables`], which also reserves them
/// on its own) and the plan's placement as the binding copied it, with the tables its checks
/// derive. Rows are pushed into growing vectors: twice their size.
pub(super) fn simulate_bytes(s_n: usize, topo: &Topology, m_n: usize, l_n: usize, e_n: usize) -> u128 {
    use crate::plan::Placement;
    use crate::sizes::table_bytes;
    let exchanges = table_bytes(&[topo.num_groups(), m_n, l_n], 1);
    // its [E] totals and shares, its cost (LayerCost, dispatch bytes, replication parts), its
    // replica bucket and imbalance
    let per_exchange = table_bytes(&[e_n], 16).saturating_add(64 + 16 + 16 + 24 + 8);
    // map_init makes a worker's scratch once per split of the (group, microbatch) tasks: at
    // most once a task
    let workers = table_bytes(&[topo.num_groups(), m_n], 1);
    let per_worker = table_bytes(&[topo.ep, e_n], 8).saturating_add(table_bytes(&[topo.ep], 160)).saturating_add(table_bytes(&[e_n], 28));
    exchanges
        .saturating_mul(per_exchange)
        .saturating_add(workers.saturating_mul(per_worker))
        // a row (sample, layer, tokens, experts, its top-k sums) pushed, then kept in DemandSums
        // with its top-k sums, and the bound's per-sample part
        .saturating_add(table_bytes(&[s_n, l_n], 2 * 64 + 16 + 32 + 24))
        // the gathered DemandSums, the bound's layer sums twice (without and with the top-k
        // sums, both alive in lower_bound_of_sums) and the window's sums read again where the
        // gathered top-k sums are not the ones the bound needs (DemandSums::of_window)
        .saturating_add(table_bytes(&[l_n, e_n], 16 + 2 * 16 + 2 * 16))
        .saturating_add(table_bytes(&[l_n, e_n.saturating_add(1).saturating_add(topo.num_slots())], 8))
        .saturating_add(Placement::tables_bytes(l_n, topo.num_slots(), e_n, 1))
        .saturating_add(table_bytes(&[topo.dp, m_n], 24))
}
