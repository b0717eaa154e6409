//! Property test of `replication::plan_block` (distributed planning: rank i of n plans block i
//! of the exchanges): on random windows, topologies, placements and layouts, for every planner
//! (hot_n, ReLibra, routepack, MoonEP, UltraEP) and every block count 1..=9 (more blocks than exchanges
//! included, so some blocks are empty), the blocks' replicas concatenated in block order are
//! byte for byte the full run's, and each block holds only exchanges of its range. Also:
//! `Block::range` tiles `0..total` for any total and count, and bad blocks are refused.

mod common;

use common::{random_layout, random_phy2log, topologies, window, Mix};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use routepack_core::cost::CostModel;
use routepack_core::placement::Placement;
use routepack_core::plan::Replica;
use routepack_core::replication::{plan_block, routepack::Options, Block, Packed, Planner};
use routepack_core::topology::Topology;
use std::cell::Cell;

/// The replicas as bytes (f32 shares by their bits: "equal" means identical, NaN-safe).
fn bytes(rows: &[Replica]) -> Vec<(i32, i32, i32, i32, i32, i32, u32)> {
    rows.iter().map(|r| (r.micro, r.group, r.layer, r.expert, r.src_rank, r.dst_rank, r.share.to_bits())).collect()
}

#[test]
fn blocks_concatenate_to_the_full_run() {
    let mut runner = TestRunner::new_with_rng(
        Config { cases: 120, failure_persistence: None, ..Config::default() },
        TestRng::deterministic_rng(RngAlgorithm::ChaCha),
    );
    let rows_seen = Cell::new(0usize);
    let checked = Cell::new(0usize);
    runner
        .run(&(topologies(), any::<u64>()), |(topo, seed): (Topology, u64)| {
            let mut mix = Mix(seed);
            let micro = 1 + mix.below(3);
            let samples = topo.dp * micro + mix.below(2 * topo.dp + 3);
            let layers = 1 + mix.below(3);
            let experts = 1 + mix.below(topo.num_slots().min(12));
            let w = window(&mut mix, samples, layers, experts, 60);
            let view = w.view();
            let placement = Placement::new(random_phy2log(&mut mix, layers, experts, &topo), layers, experts, topo.slots_per_rank).unwrap();
            let (rank, step) = random_layout(&mut mix, samples, topo.dp, micro);
            let packed = Packed { sample_rank: &rank, sample_micro: &step, num_micro: micro };
            let mut cost = CostModel::for_tests(layers);
            // cheap copies half the time, so that replication has something to do
            if mix.unit() < 0.5 {
                cost.expert_weight_bytes = 1e3;
                cost.c_exp = 1e-9;
            }
            let total = topo.num_groups() * micro * layers;
            let planners = [
                Planner::HotN(1 + mix.below(3)),
                Planner::Relibra(1 + mix.below(2)),
                Planner::Routepack(Options { replication_slots: 1 + mix.below(4), ..Options::default() }),
                Planner::MoonEp(1 + mix.below(4)),
                Planner::UltraEp(1 + mix.below(3), 1 + mix.below(20) as i64),
            ];
            for planner in &planners {
                let full = plan_block(&view, &topo, &cost, &placement, packed, planner, Block::ALL).unwrap();
                rows_seen.set(rows_seen.get() + full.len());
                for count in 1..=9 {
                    let mut joined = Vec::new();
                    for index in 0..count {
                        let block = Block::new(index, count).unwrap();
                        let part = plan_block(&view, &topo, &cost, &placement, packed, planner, block).unwrap();
                        let range = block.range(total);
                        for r in &part {
                            let c = ((r.group as usize) * micro + r.micro as usize) * layers + r.layer as usize;
                            prop_assert!(range.contains(&c), "{planner:?} block {index}/{count}: row of exchange {c} outside {range:?}");
                        }
                        joined.extend(part);
                    }
                    prop_assert_eq!(bytes(&joined), bytes(&full), "{:?} in {} blocks", planner, count);
                    checked.set(checked.get() + 1);
                }
            }
            Ok(())
        })
        .unwrap();
    // the property is not vacuous: the full runs planned copies
    assert!(rows_seen.get() > 100, "only {} replica rows in all cases", rows_seen.get());
    assert_eq!(checked.get(), 120 * 5 * 9);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn ranges_tile_the_exchanges(total in 0usize..100_000, count in 1usize..300) {
        let mut next = 0;
        for index in 0..count {
            let r = Block::new(index, count).unwrap().range(total);
            prop_assert_eq!(r.start, next);
            // near-equal: sizes differ by at most one
            prop_assert!(r.len() == total / count || r.len() == total / count + 1);
            next = r.end;
        }
        prop_assert_eq!(next, total);
    }

    #[test]
    fn bad_blocks_are_refused(index in 0usize..50, count in 0usize..50) {
        let got = Block::new(index, count);
        prop_assert_eq!(got.is_ok(), count >= 1 && index < count);
        if let Err(e) = got {
            prop_assert!(e.to_string().starts_with("block: "), "{}", e);
        }
    }
}

#[test]
fn huge_totals_do_not_overflow() {
    let b = Block::new(3, 4).unwrap();
    assert_eq!(b.range(usize::MAX).end, usize::MAX);
    assert_eq!(Block::ALL.range(7), 0..7);
}
