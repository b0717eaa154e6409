//! Expert placement: which physical slot of each EP rank holds which logical expert, per MoE
//! layer (docs/design.md stage 1): the policies that build a [`Placement`] (the type itself is
//! part of the plan's data model, `crate::plan`, and re-exported here). The `static` policy
//! lives here; beside it: `demand` (the loads and chunk demand placement works from), `replica_counts` (how
//! many slots each expert gets), `eplb` (the EPLB baseline), `relibra` (ReLibra's placement),
//! `relabel` (slot layout against a placement in force), `quality` (balance figures) and
//! `routepack/` (routepack's own placement, with its bin packing of replicas onto ranks).

pub mod demand;
pub mod eplb;
pub mod quality;
pub mod relabel;
pub mod relibra;
pub mod replica_counts;
pub mod routepack;

use crate::error::{invalid, Result};
use crate::sizes;
use crate::topology::Topology;

/// The data model's placement, under the path it had before it moved to `crate::plan`.
pub use crate::plan::Placement;

/// Megatron-LM's default: expert e on EP rank e / ceil(E/ep), in its rank's slots in order;
/// redundant slots stay empty (-1).
pub fn static_placement(num_layers: usize, num_experts: usize, topo: &Topology) -> Result<Placement> {
    topo.check_experts(num_experts)?;
    let per_rank = num_experts.div_ceil(topo.ep);
    if per_rank > topo.slots_per_rank {
        return Err(invalid(
            "topo.slots_per_rank",
            format!("static placement puts ceil(E/ep) = {per_rank} experts on a rank but slots_per_rank = {}", topo.slots_per_rank),
        ));
    }
    if num_layers == 0 || num_layers > i32::MAX as usize {
        return Err(invalid("num_layers", format!("must be in [1, 2^31), got {num_layers}")));
    }
    // the whole table is sized by the arguments: the call's estimate (the table and what its
    // checked tables take, `Placement::tables_bytes`) is reserved before anything is allocated,
    // blaming the larger of the two factors
    let slots = topo.num_slots();
    let what = format!("phy2log [num_layers, topo.ep * topo.slots_per_rank] = [{num_layers}, {slots}] of int32");
    let arg = if num_layers >= slots { "num_layers" } else { "topo.slots_per_rank" };
    sizes::check_bytes(arg, &what, sizes::table_bytes(&[num_layers, slots], 4))?;
    let call = sizes::table_bytes(&[num_layers, slots], 4).saturating_add(Placement::tables_bytes(num_layers, slots, num_experts, 1));
    sizes::check_call(arg, &format!("the static placement with its tables, {what},"), call)?;
    let mut phy2log = sizes::with_capacity::<i32>(arg, &what, num_layers * slots)?;
    phy2log.resize(slots, -1);
    for e in 0..num_experts {
        let r = e / per_rank;
        let j = e % per_rank;
        phy2log[r * topo.slots_per_rank + j] = e as i32;
    }
    for _ in 1..num_layers {
        phy2log.extend_from_within(..slots);
    }
    Placement::new(phy2log, num_layers, num_experts, topo.slots_per_rank)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn static_tiny() {
        let topo = Topology::new(16, 8, 8, 17).unwrap();
        let p = static_placement(2, 128, &topo).unwrap();
        assert_eq!(p.layer(0)[0], 0);
        assert_eq!(p.layer(0)[16], -1);
        assert_eq!(p.layer(1)[17], 16);
        assert!(p.logcnt().iter().all(|&c| c == 1));
        let (l2p, r) = p.log2phy().unwrap();
        assert_eq!(r, 1);
        assert_eq!(l2p[16], 17);
    }
}
