//! Migration: the moves that turn the placement in force into a new one. Each move carries
//! an expert's weights and optimizer state from a slot that holds it now to a slot that
//! will hold it.

use crate::error::Result;
use crate::plan::ExpertMove;
use crate::plan::Placement;

/// Moves from `previous` to `next`, layer by layer, slot by slot (see [`diff_layer`]).
/// `bytes_per_expert` is weights + optimizer state. Without a topology every rank counts as
/// its own node; [`diff_nodes`] knows the node size.
pub fn diff(previous: &Placement, next: &Placement, bytes_per_expert: f64) -> Result<Vec<ExpertMove>> {
    diff_nodes(previous, next, 1, bytes_per_expert)
}

/// [`diff`] with `ranks_per_node` consecutive EP ranks per node (`Topology::ranks_per_group_node`),
/// so that sources on the destination's node are preferred.
pub fn diff_nodes(previous: &Placement, next: &Placement, ranks_per_node: usize, bytes_per_expert: f64) -> Result<Vec<ExpertMove>> {
    if previous.num_layers != next.num_layers
        || previous.num_slots != next.num_slots
        || previous.num_experts != next.num_experts
        || previous.slots_per_rank != next.slots_per_rank
    {
        return Err(crate::error::invalid(
            "previous",
            format!(
                "placement shape (L={}, E={}, slots={}, per rank={}) differs from the new one (L={}, E={}, slots={}, per rank={})",
                previous.num_layers,
                previous.num_experts,
                previous.num_slots,
                previous.slots_per_rank,
                next.num_layers,
                next.num_experts,
                next.num_slots,
                next.slots_per_rank
            ),
        ));
    }
    if ranks_per_node == 0 {
        return Err(crate::error::invalid("ranks_per_node", "must be >= 1, got 0"));
    }
    let rpn = ranks_per_node;
    let mut moves = Vec::new();
    for l in 0..next.num_layers {
        diff_layer(l, previous.layer(l), next.layer(l), next.slots_per_rank, rpn, bytes_per_expert, &mut moves);
    }
    Ok(moves)
}

/// Moves of one layer (`old`, `new`: that layer's phy2log), appended to `moves`.
///
/// A slot whose expert is unchanged costs nothing. Otherwise the source is a previous slot of
/// that expert, chosen in this order: on the destination rank (a local copy, 0 network
/// bytes); on the destination's node (`ranks_per_node` consecutive ranks), the rank that has
/// sent the fewest bytes so far in this layer; else any rank, again the least-loaded sender;
/// ties to the lowest slot. Spreading the sends keeps the slowest rank's migration time low.
pub fn diff_layer(
    layer: usize,
    old: &[i32],
    new: &[i32],
    slots_per_rank: usize,
    ranks_per_node: usize,
    bytes_per_expert: f64,
    moves: &mut Vec<ExpertMove>,
) {
    let spr = slots_per_rank;
    let rpn = ranks_per_node.max(1);
    let ranks = old.len() / spr;
    let mut sent = vec![0.0f64; ranks];
    // previous slots of each expert, ascending (CSR over the expert ids present)
    let top = old.iter().chain(new).copied().max().unwrap_or(-1).max(0) as usize + 1;
    let mut off = vec![0usize; top + 1];
    for &e in old.iter().filter(|&&e| e >= 0) {
        off[e as usize + 1] += 1;
    }
    for k in 0..top {
        off[k + 1] += off[k];
    }
    let mut fill = off.clone();
    let mut held = vec![0usize; off[top]];
    for (q, &e) in old.iter().enumerate().filter(|&(_, &e)| e >= 0) {
        held[fill[e as usize]] = q;
        fill[e as usize] += 1;
    }
    for (p, &e) in new.iter().enumerate() {
        if e < 0 || old[p] == e {
            continue;
        }
        let dst_rank = p / spr;
        let holders = held[off[e as usize]..off[e as usize + 1]].iter().copied();
        let mut best: Option<(u8, f64, usize)> = None;
        for q in holders {
            let r = q / spr;
            let tier = if r == dst_rank {
                0
            } else if r / rpn == dst_rank / rpn {
                1
            } else {
                2
            };
            let key = (tier, if tier == 0 { 0.0 } else { sent[r] }, q);
            if best.is_none_or(|b| (key.0, key.1) < (b.0, b.1)) {
                best = Some(key);
            }
        }
        let Some((_, _, src)) = best else {
            // an expert new to this layer has no source: impossible for checked placements
            continue;
        };
        let src_rank = src / spr;
        let bytes = if src_rank == dst_rank { 0.0 } else { bytes_per_expert };
        sent[src_rank] += bytes;
        moves.push(ExpertMove {
            layer: layer as i32,
            expert: e,
            src_rank: src_rank as i32,
            dst_rank: dst_rank as i32,
            src_slot: src as i32,
            dst_slot: p as i32,
            bytes,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unchanged_is_free_and_moves_are_listed() {
        let a = Placement::new(vec![0, 1, 2, 3], 1, 4, 2).unwrap();
        assert!(diff(&a, &a, 1.0).unwrap().is_empty());
        let b = Placement::new(vec![0, 2, 1, 3], 1, 4, 2).unwrap();
        let moves = diff(&a, &b, 7.0).unwrap();
        assert_eq!(moves.len(), 2);
        assert_eq!((moves[0].expert, moves[0].src_slot, moves[0].dst_slot, moves[0].bytes), (2, 2, 1, 7.0));
    }

    #[test]
    fn sources_prefer_local_then_node_then_least_loaded() {
        // 4 ranks × 1 slot, 2 ranks per node; expert 0 on ranks 0 and 2
        let old = [0, 1, 0, 2];
        let mut moves = Vec::new();
        // rank 3 wants expert 0: rank 2 is on its node
        diff_layer(0, &old, &[0, 1, 0, 0], 1, 2, 5.0, &mut moves);
        assert_eq!((moves[0].src_rank, moves[0].dst_rank), (2, 3));
        // ranks 1 and 3 both want expert 0 with one rank per node: the second send goes to the
        // rank that has not sent yet
        moves.clear();
        diff_layer(0, &old, &[0, 0, 0, 0], 1, 1, 5.0, &mut moves);
        assert_eq!(moves.iter().map(|r| r.src_rank).collect::<Vec<_>>(), vec![0, 2]);
    }
}
