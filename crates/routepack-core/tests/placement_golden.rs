//! Golden digests of routepack's placement: the phy2log of a fresh placement and of a
//! migration-aware one (the window before's placement in force), at the sizes of
//! `examples/placement_checksum.rs` (EPLB's reference 58 × 256, flash 32 × 512, small 6 × 40;
//! `support::placement_sizes`), on the synthetic loads of `benches/placement.rs`. The
//! constants were computed on the code before the placement was restructured (issue 11); the
//! migration-aware ones changed once since, on purpose, when the flat packings began spreading
//! an expert's copies over nodes (issue 14), and all of them once more, on purpose, when a
//! replica began to weigh what it costs its rank (compute plus its receiving all-to-all per
//! link, `placement::routepack::copy_cost`; issue 14). A change of one slot of one layer fails here. FNV-1a (`support::fnv1a_i32`), not
//! `DefaultHasher`, whose output may change between Rust versions. All three take about two
//! seconds in a debug build.

use routepack_core::placement::routepack::{routepack_placement, Options};
use routepack_core::{CostModel, Topology};

#[path = "../benches/support/mod.rs"]
mod support;
use support::{fnv1a_i32, placement_sizes, PlacementDemand};

/// `(fresh digest, migration-aware digest)` of one size with the bench's options (12
/// exchanges per layer, the default fluctuation budget).
fn digests(layers: usize, experts: usize, topo: &Topology) -> (u64, u64) {
    let demand = PlacementDemand::new(layers, experts);
    let (d, before) = demand.demands();
    let cost = CostModel::for_tests(layers);
    let opts = Options { exchanges: 12, ..Options::default() };
    let fresh = routepack_placement(&d, topo, &cost, None, &opts).unwrap();
    let previous = routepack_placement(&before, topo, &cost, None, &opts).unwrap().placement;
    let migrated = routepack_placement(&d, topo, &cost, Some(&previous), &opts).unwrap();
    (fnv1a_i32(&fresh.placement.phy2log), fnv1a_i32(&migrated.placement.phy2log))
}

/// One size of `placement_sizes` by name against its committed digests.
fn check(name: &str, want: (u64, u64)) {
    let (_, layers, experts, topo) = placement_sizes().into_iter().find(|s| s.0 == name).expect("a size of placement_sizes");
    let got = digests(layers, experts, &topo);
    assert_eq!(got, want, "{name}: placement digests (fresh, migrated) = ({:#018x}, {:#018x}) changed", got.0, got.1);
}

/// EPLB's reference: 58 layers × 256 experts in 288 slots over 32 ranks in 4 nodes.
#[test]
fn reference_placement_is_unchanged() {
    check("reference", (0xb411a2be1fb80c05, 0x436fdc50214af5a5));
}

/// flash: 32 layers × 512 experts in 544 slots over 32 ranks in 4 nodes.
#[test]
fn flash_placement_is_unchanged() {
    check("flash", (0x70daf27955d9630a, 0x41bec8e717ba6c66));
}

/// small: 6 layers × 40 experts in 48 slots over 8 ranks in 2 nodes.
#[test]
fn small_placement_is_unchanged() {
    check("small", (0xb3c7ec088719eb8d, 0xaf982078c90d32ad));
}
