//! Checksums of routepack placements, for checking that a refactor leaves every placement
//! bit for bit as it was (run it before and after, and with `RAYON_NUM_THREADS` 1 and 2), with
//! two quality readings beside each: the summed predicted time of the fresh placement and its
//! mean aggregate imbalance. Same synthetic loads as `benches/placement.rs`.
//!
//!     cargo run --release -p routepack-core --example placement_checksum -- [fluct_evals]
//!
//! Per size: a checksum of the fresh placement of one window and of the migration-aware
//! placement of the next (the first in force), then the readings and the moves per layer.

use std::hash::{Hash, Hasher};

use routepack_core::placement::quality::aggregate_imbalance;
use routepack_core::placement::routepack::{routepack_placement, Options};
use routepack_core::{CostModel, Topology};

#[path = "../benches/support/mod.rs"]
mod support;
use support::PlacementDemand;

fn main() {
    let evals: usize = std::env::args().nth(1).and_then(|x| x.parse().ok()).unwrap_or(Options::default().fluct_evals);
    let sizes = [
        ("reference", 58, 256, Topology::new(64, 32, 8, 9).unwrap()),
        ("flash", 32, 512, Topology::new(64, 32, 8, 17).unwrap()),
        ("small", 6, 40, Topology::new(8, 8, 4, 6).unwrap()),
    ];
    for (name, layers, experts, topo) in sizes {
        let demand = PlacementDemand::new(layers, experts);
        let (d, d2) = demand.demands();
        let loads = &demand.loads;
        let cost = CostModel::for_tests(layers);
        let opts = Options { cells: 12, fluct_evals: evals, ..Options::default() };
        let fresh = routepack_placement(&d, &topo, &cost, None, &opts).unwrap();
        let predicted: f64 = fresh.layers.iter().map(|r| r.predicted).sum();
        let imbalance = aggregate_imbalance(&fresh.placement, loads).unwrap();
        let imbalance = imbalance.iter().sum::<f64>() / imbalance.len() as f64;
        let previous = routepack_placement(&d2, &topo, &cost, None, &opts).unwrap().placement;
        let migrated = routepack_placement(&d, &topo, &cost, Some(&previous), &opts).unwrap();
        let mut h = std::collections::hash_map::DefaultHasher::new();
        fresh.placement.phy2log.hash(&mut h);
        migrated.placement.phy2log.hash(&mut h);
        let moves: usize = migrated.layers.iter().map(|r| r.moves).sum();
        println!(
            "{name:9} {:016x}  predicted {predicted:.6e}  imbalance {imbalance:.6}  moves/layer {:.1}",
            h.finish(),
            moves as f64 / layers as f64
        );
    }
}
