//! Property tests of the cost model's execution terms: what a rank pays for replicas, migration
//! and the redundant experts' sum beyond their links' time (`replica_prefetch`, `c_replica`,
//! `c_migrate`, `migration_latency`, `reduce_latency`). Each is written out here from the plan and compared
//! with `simulate`'s part; 0 / `true` (the defaults) change no bit; the lower bound stays below
//! the step; and routepack's migration-aware placement moves nothing when a window's migration
//! costs more than any saving.

mod common;

#[path = "../benches/support/mod.rs"]
mod support;

use common::{close, random_case, topologies, Mix};
use proptest::prelude::*;
use routepack_core::cost::CostModel;
use routepack_core::placement::routepack::{routepack_placement, Options};
use routepack_core::simulate::simulate;
use routepack_core::Topology;
use support::PlacementDemand;

/// Per EP rank of the plan's migration: (bytes sent + received, per-link max(sent, received)
/// over the link's bandwidth), written out from the moves.
fn migration_by_rank(plan: &routepack_core::Plan, topo: &Topology, cost: &CostModel) -> Vec<(f64, f64)> {
    let mut io = vec![[0.0f64; 5]; topo.ep]; // send intra, recv intra, send inter, recv inter, local x2
    for mv in &plan.migration {
        let (s, d) = (mv.src_rank as usize, mv.dst_rank as usize);
        if s == d {
            // a copy between two slots of one rank: packed and unpacked there, over no link
            io[s][4] += 2.0 * cost.expert_state_bytes; // the row carries 0 bytes: no link moves it
            continue;
        }
        let k = if topo.local_node_of(s) == topo.local_node_of(d) { 0 } else { 2 };
        io[s][k] += mv.bytes;
        io[d][k + 1] += mv.bytes;
    }
    io.iter().map(|b| (b.iter().sum(), b[0].max(b[1]) / cost.bw_intra + b[2].max(b[3]) / cost.bw_inter)).collect()
}

/// `after` is `before` plus `delta`, to rounding of the larger step.
fn adds(before: f64, after: f64, delta: f64) -> bool {
    (after - before - delta).abs() <= 1e-12 * after.abs().max(before.abs())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 150, failure_persistence: None, ..ProptestConfig::default() })]

    /// Without prefetch, replication is its forward copies' and backward gradients' link time
    /// in full (at least what prefetch leaves exposed, never less), and the rest of the step is
    /// unchanged; the default changes no bit.
    #[test]
    fn replication_without_prefetch_is_exposed_in_full(topo in topologies(), seed in any::<u64>(), micro in 1usize..3, extra in 0usize..8) {
        let mut mix = Mix(seed);
        let (w, mut plan) = random_case(&mut mix, &topo, micro, extra, 40);
        plan.migration.clear();
        let mut base = CostModel::for_tests(w.layers);
        base.a_lin *= [0.0, 1.0, 1e3][mix.below(3)];
        let exposed = CostModel { replica_prefetch: false, ..base.clone() };
        let a = simulate(&plan, &w.view(), &topo, &base, None).unwrap();
        let b = simulate(&plan, &w.view(), &topo, &exposed, None).unwrap();
        prop_assert!(b.replication >= a.replication * (1.0 - 1e-12) || a.critical_group != b.critical_group);
        prop_assert!(b.step_time >= a.step_time * (1.0 - 1e-12));
        if plan.replicas.is_empty() {
            prop_assert_eq!(&b, &a);
        }
        // with no attention to hide behind, prefetch hides nothing: both price the same
        let bare = CostModel { a_lin: 0.0, a_quad: vec![0.0; w.layers], ..base.clone() };
        let (c, d) = (
            simulate(&plan, &w.view(), &topo, &bare, None).unwrap(),
            simulate(&plan, &w.view(), &topo, &CostModel { replica_prefetch: false, ..bare.clone() }, None).unwrap(),
        );
        prop_assert!(close(c.step_time, d.step_time), "{} vs {}", c.step_time, d.step_time);
        prop_assert!(b.lower_bound_time <= b.step_time * (1.0 + 1e-12));
        prop_assert_eq!(&simulate(&plan, &w.view(), &topo, &CostModel { replica_prefetch: true, ..exposed }, None).unwrap(), &a);
    }

    /// With only replication priced (no compute, no all-to-all bytes, prefetch off, links
    /// nearly free), each exchange's replication is `c_replica` times the bytes its busiest
    /// rank stages: per chain (one per expert and source, the copies ordered same-node first,
    /// then by rank) the source sends once, every copy receives once and all but the last
    /// send once more, weights forward and gradients back; the step is the slowest group's
    /// sum over its exchanges. 0 changes no bit, and more never prices a plan lower.
    #[test]
    fn replication_stages_every_hop_byte(topo in topologies(), seed in any::<u64>(), micro in 1usize..3, extra in 0usize..8) {
        prop_assume!(topo.pp == 1);
        let mut mix = Mix(seed);
        let (w, mut plan) = random_case(&mut mix, &topo, micro, extra, 40);
        plan.migration.clear();
        let layers = w.layers;
        let per_byte = [1e-9, 3e-6][mix.below(2)];
        let bare = CostModel {
            a_lin: 0.0,
            a_quad: vec![0.0; layers],
            c_tok: 0.0,
            c_exp: 0.0,
            token_bytes: 0.0,
            bw_intra: 1e30,
            bw_inter: 1e30,
            replica_prefetch: false,
            ..CostModel::for_tests(layers)
        };
        let priced = CostModel { c_replica: per_byte, ..bare.clone() };
        let r = simulate(&plan, &w.view(), &topo, &priced, None).unwrap();
        let groups = topo.dp / topo.ep;
        let mut want = vec![0.0f64; groups];
        for (g, slot) in want.iter_mut().enumerate() {
            for m in 0..plan.num_micro {
                for l in 0..layers {
                    let cell: Vec<_> = plan.replicas.iter().filter(|x| x.group as usize == g && x.micro as usize == m && x.layer as usize == l).collect();
                    let mut hops = vec![0.0f64; topo.ep];
                    let mut chains: Vec<(i32, i32)> = cell.iter().map(|x| (x.expert, x.src_rank)).collect();
                    chains.sort_unstable();
                    chains.dedup();
                    for (e, src) in chains {
                        let node = topo.local_node_of(src as usize);
                        let mut dsts: Vec<usize> = cell.iter().filter(|x| x.expert == e && x.src_rank == src).map(|x| x.dst_rank as usize).collect();
                        dsts.sort_unstable_by_key(|&d| (topo.local_node_of(d) != node, d));
                        dsts.dedup();
                        hops[src as usize] += 1.0;
                        for (i, &d) in dsts.iter().enumerate() {
                            hops[d] += if i + 1 < dsts.len() { 2.0 } else { 1.0 };
                        }
                    }
                    let most = hops.iter().cloned().fold(0.0, f64::max);
                    *slot += per_byte * most * (bare.expert_weight_bytes + bare.expert_grad_bytes);
                }
            }
        }
        let step = want.iter().cloned().fold(0.0, f64::max);
        prop_assert!((r.step_time - step).abs() <= 1e-9 * step.max(1e-300) + 1e-15, "{} vs {}", r.step_time, step);
        // 0 is the default's bits; a dearer byte never prices the plan lower
        let base = CostModel::for_tests(layers);
        prop_assert_eq!(
            &simulate(&plan, &w.view(), &topo, &CostModel { c_replica: 0.0, ..base.clone() }, None).unwrap(),
            &simulate(&plan, &w.view(), &topo, &base, None).unwrap()
        );
        let full = CostModel { c_replica: per_byte, ..base.clone() };
        let a = simulate(&plan, &w.view(), &topo, &base, None).unwrap();
        let b = simulate(&plan, &w.view(), &topo, &full, None).unwrap();
        prop_assert!(b.step_time >= a.step_time * (1.0 - 1e-12));
        prop_assert!(b.lower_bound_time <= b.step_time * (1.0 + 1e-12));
    }

    /// A window's migration is `migration_latency` (where anything moves) plus the slowest
    /// rank's link time and staging (`c_migrate` per byte it sends or receives, twice per byte
    /// it copies between its own slots), and it adds
    /// to the step exactly that; 0 changes no bit.
    #[test]
    fn migration_prices_its_staging_and_latency(topo in topologies(), seed in any::<u64>(), micro in 1usize..3, extra in 0usize..8) {
        let mut mix = Mix(seed);
        let (w, plan) = random_case(&mut mix, &topo, micro, extra, 40);
        let base = CostModel::for_tests(w.layers);
        let per_byte = [1e-12, 1e-9, 1e-6][mix.below(3)];
        let latency = [0.0, 1e-4, 1e-1][mix.below(3)];
        let priced = CostModel { c_migrate: per_byte, migration_latency: latency, ..base.clone() };
        let a = simulate(&plan, &w.view(), &topo, &base, None).unwrap();
        let b = simulate(&plan, &w.view(), &topo, &priced, None).unwrap();
        let ranks = migration_by_rank(&plan, &topo, &priced);
        let moved = ranks.iter().any(|&(bytes, _)| bytes > 0.0);
        let slowest = ranks.iter().map(|&(bytes, link)| link + per_byte * bytes).fold(0.0, f64::max);
        let want = if moved { latency + slowest } else { 0.0 };
        prop_assert!(close(b.migration, want), "{} vs {}", b.migration, want);
        prop_assert!(adds(a.step_time, b.step_time, b.migration - a.migration));
        prop_assert!(b.lower_bound_time <= b.step_time * (1.0 + 1e-12));
        let zero = CostModel { c_migrate: 0.0, migration_latency: 0.0, ..priced };
        prop_assert_eq!(&simulate(&plan, &w.view(), &topo, &zero, None).unwrap(), &a);
    }

    /// The redundant experts' sum pays `reduce_latency` once per layer holding a redundant
    /// expert (one all-reduce each), on a group of two ranks or more; 0 changes no bit.
    #[test]
    fn the_redundant_sum_pays_a_latency_per_layer(topo in topologies(), seed in any::<u64>(), micro in 1usize..3, extra in 0usize..8) {
        let mut mix = Mix(seed);
        let (w, plan) = random_case(&mut mix, &topo, micro, extra, 40);
        let base = CostModel::for_tests(w.layers);
        let lat = CostModel { reduce_latency: [1e-6, 1e-3][mix.below(2)], ..base.clone() };
        let a = simulate(&plan, &w.view(), &topo, &base, None).unwrap();
        let b = simulate(&plan, &w.view(), &topo, &lat, None).unwrap();
        let layers = (0..w.layers)
            .filter(|&l| {
                let row = plan.placement.layer(l);
                (0..w.experts as i32).any(|e| row.iter().filter(|&&x| x == e).count() > 1)
            })
            .count();
        let want = if topo.ep > 1 && a.redundant_grads > 0.0 { a.redundant_grads + layers as f64 * lat.reduce_latency } else { a.redundant_grads };
        prop_assert!(close(b.redundant_grads, want), "{} vs {}", b.redundant_grads, want);
        prop_assert!(adds(a.step_time, b.step_time, b.redundant_grads - a.redundant_grads));
        prop_assert!(b.lower_bound_time <= b.step_time * (1.0 + 1e-12));
        prop_assert_eq!(&simulate(&plan, &w.view(), &topo, &CostModel { reduce_latency: 0.0, ..lat }, None).unwrap(), &a);
    }
}

/// routepack's migration-aware placement weighs its moves with the migration term: priced at
/// what a CPU rank pays (staging and a fixed cost far above any saving), it keeps the placement
/// in force; priced by the links alone it moves experts on the bench's shifted loads.
#[test]
fn a_migration_dearer_than_any_saving_moves_nothing() {
    let topo = Topology::new(8, 8, 4, 6).unwrap();
    let demand = PlacementDemand::new(4, 40);
    let (d, before) = demand.demands();
    let cost = CostModel::for_tests(4);
    let opts = Options { exchanges: 12, ..Options::default() };
    let previous = routepack_placement(&before, &topo, &cost, None, &opts).unwrap().placement;
    let cheap = routepack_placement(&d, &topo, &cost, Some(&previous), &opts).unwrap();
    assert!(cheap.placement != previous && cheap.migration_time > 0.0, "the shifted loads should move experts");
    let dear = CostModel { migration_latency: 1e6, ..cost.clone() };
    let kept = routepack_placement(&d, &topo, &dear, Some(&previous), &opts).unwrap();
    assert_eq!(kept.placement, previous);
    assert_eq!(kept.migration_time, 0.0);
    let staged = CostModel { c_migrate: 1.0, ..cost };
    let fewer = routepack_placement(&d, &topo, &staged, Some(&previous), &opts).unwrap();
    assert_eq!(fewer.placement, previous, "at a second a byte no move pays");
}
