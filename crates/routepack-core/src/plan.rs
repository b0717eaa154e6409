//! The plan for one window: placement, the (DP rank, microbatch step) of every sample,
//! intra-batch replicas and migration moves. Field meanings follow DESIGN.md's table.

use crate::placement::Placement;

/// One intra-batch replica: in microbatch `micro` of EP group `group`, layer `layer`, the
/// weights of logical `expert` go from EP-local rank `src_rank` (which hosts it) to `dst_rank`,
/// which computes `share` of that expert's tokens in that exchange (see `flow`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Replica {
    pub micro: i32,
    pub group: i32,
    pub layer: i32,
    pub expert: i32,
    pub src_rank: i32,
    pub dst_rank: i32,
    pub share: f32,
}

/// One expert moved between windows: its weights and optimizer state go from physical slot
/// `src_slot` (on EP-local rank `src_rank`) to `dst_slot` (on `dst_rank`) in `layer`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ExpertMove {
    pub layer: i32,
    pub expert: i32,
    pub src_rank: i32,
    pub dst_rank: i32,
    pub src_slot: i32,
    pub dst_slot: i32,
    pub bytes: f64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    pub placement: Placement,
    /// `[S]` DP rank that runs sample s.
    pub sample_rank: Vec<i32>,
    /// `[S]` microbatch step (execution order) of sample s on its rank.
    pub sample_micro: Vec<i32>,
    /// M, the same on every DP rank.
    pub num_micro: usize,
    pub replicas: Vec<Replica>,
    pub migration: Vec<ExpertMove>,
}

/// Samples of every cell (DP rank d, step m), cell index d·M + m, as CSR (offsets, samples),
/// samples in ascending index inside a cell. Assumes ranks and steps are in range
/// (`validate` checks that first).
pub fn cell_members(sample_rank: &[i32], sample_micro: &[i32], dp: usize, num_micro: usize) -> (Vec<usize>, Vec<usize>) {
    let cells = dp * num_micro;
    let mut off = vec![0usize; cells + 1];
    for (&d, &m) in sample_rank.iter().zip(sample_micro) {
        off[d as usize * num_micro + m as usize + 1] += 1;
    }
    for c in 0..cells {
        off[c + 1] += off[c];
    }
    let mut fill = off.clone();
    let mut members = vec![0usize; sample_rank.len()];
    for (s, (&d, &m)) in sample_rank.iter().zip(sample_micro).enumerate() {
        let c = d as usize * num_micro + m as usize;
        members[fill[c]] = s;
        fill[c] += 1;
    }
    (off, members)
}

/// Replicas bucketed by exchange (EP group g, step m, layer l), bucket index
/// `(g·M + m)·L + l`, table order kept inside a bucket: what the simulator prices and the
/// router routes one exchange at a time.
pub fn bucket_replicas(rows: &[Replica], groups: usize, micro: usize, layers: usize) -> Vec<Vec<Replica>> {
    let mut b = vec![Vec::new(); groups * micro * layers];
    for r in rows {
        b[(r.group as usize * micro + r.micro as usize) * layers + r.layer as usize].push(*r);
    }
    b
}
