//! Migration: the moves that turn the placement in force into a new one. Each move carries
//! an expert's weights and optimizer state from a slot that holds it now to a slot that
//! will hold it.

use crate::error::Result;
use crate::placement::Placement;
use crate::plan::MigrationRow;

/// Moves from `previous` to `next`, layer by layer, slot by slot. A slot whose expert is
/// unchanged costs nothing. Otherwise the source is a previous slot of that expert, chosen
/// on the destination rank if one exists (a local copy, 0 network bytes), else the lowest
/// such slot. `bytes_per_expert` is weights + optimizer state.
pub fn diff(previous: &Placement, next: &Placement, bytes_per_expert: f64) -> Result<Vec<MigrationRow>> {
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
    let spr = next.slots_per_rank;
    let mut rows = Vec::new();
    for l in 0..next.num_layers {
        let (old, new) = (previous.layer(l), next.layer(l));
        let (off, slots) = previous.replicas_of_layer(l);
        for (p, &e) in new.iter().enumerate() {
            if e < 0 || old[p] == e {
                continue;
            }
            let src_slots = &slots[off[e as usize]..off[e as usize + 1]];
            let dst_rank = p / spr;
            let src = src_slots.iter().copied().find(|&q| q / spr == dst_rank).unwrap_or(src_slots[0]);
            let src_rank = src / spr;
            rows.push(MigrationRow {
                layer: l as i32,
                expert: e,
                src_rank: src_rank as i32,
                dst_rank: dst_rank as i32,
                src_slot: src as i32,
                dst_slot: p as i32,
                bytes: if src_rank == dst_rank { 0.0 } else { bytes_per_expert },
            });
        }
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unchanged_is_free_and_moves_are_listed() {
        let a = Placement::new(vec![0, 1, 2, 3], 1, 4, 2).unwrap();
        assert!(diff(&a, &a, 1.0).unwrap().is_empty());
        let b = Placement::new(vec![0, 2, 1, 3], 1, 4, 2).unwrap();
        let rows = diff(&a, &b, 7.0).unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!((rows[0].expert, rows[0].src_slot, rows[0].dst_slot, rows[0].bytes), (2, 2, 1, 7.0));
    }
}
