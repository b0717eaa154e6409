//! Checksums of routepack placements, for checking that a refactor leaves every placement
//! bit for bit as it was (run it before and after, and with `RAYON_NUM_THREADS` 1 and 2), with
//! two quality readings beside each: the summed predicted time of the fresh placement and its
//! mean aggregate imbalance. Same synthetic loads as `benches/placement.rs`.
//!
//!     cargo run --release -p routepack-core --example placement_checksum -- [fluct_evals]
//!
//! Per size: FNV-1a digests (stable across Rust versions, see `support::fnv1a_i32`) of the
//! fresh placement's phy2log and of the migration-aware placement's (the placement of the
//! window before in force), then the readings and the moves per layer. With the default
//! budget the digests are those `tests/placement_golden.rs` holds for these sizes.

use routepack_core::placement::quality::aggregate_imbalance;
use routepack_core::placement::routepack::{routepack_placement, Options};
use routepack_core::CostModel;

#[path = "../benches/support/mod.rs"]
mod support;
use support::{fnv1a_i32, placement_sizes, PlacementDemand};

fn main() {
    let evals: usize = std::env::args().nth(1).and_then(|x| x.parse().ok()).unwrap_or(Options::default().fluct_evals);
    for (name, layers, experts, topo) in placement_sizes() {
        let demand = PlacementDemand::new(layers, experts);
        let (d, d2) = demand.demands();
        let loads = &demand.loads;
        let cost = CostModel::for_tests(layers);
        let opts = Options { exchanges: 12, fluct_evals: evals, ..Options::default() };
        let fresh = routepack_placement(&d, &topo, &cost, None, &opts).unwrap();
        let predicted: f64 = fresh.layers.iter().map(|r| r.predicted).sum();
        let imbalance = aggregate_imbalance(&fresh.placement, loads).unwrap();
        let imbalance = imbalance.iter().sum::<f64>() / imbalance.len() as f64;
        let previous = routepack_placement(&d2, &topo, &cost, None, &opts).unwrap().placement;
        let migrated = routepack_placement(&d, &topo, &cost, Some(&previous), &opts).unwrap();
        let moves: usize = migrated.layers.iter().map(|r| r.moves).sum();
        println!(
            "{name:9} fresh {:016x}  migrated {:016x}  predicted {predicted:.6e}  imbalance {imbalance:.6}  moves/layer {:.1}",
            fnv1a_i32(&fresh.placement.phy2log),
            fnv1a_i32(&migrated.placement.phy2log),
            moves as f64 / layers as f64
        );
    }
}
