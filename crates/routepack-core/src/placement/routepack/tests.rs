//! Tests of the whole stage: plans validate and beat EPLB, migration is consistent and
//! deterministic, costly moves keep the placement in force, and bad inputs are named.

use super::test_windows::window_data;
use super::*;
use crate::migration::diff_nodes;
use crate::packing::sequential::sequential;
use crate::placement::demand::{chunk_demand, window_loads};
use crate::placement::eplb::eplb_placement;
use crate::placement::quality::{aggregate_imbalance, imbalance_lower_bound};
use crate::plan::{ExpertMove, Plan};
use crate::validate::validate_plan;
use crate::window::WindowView;
use proptest::prelude::*;

/// Does some rank hold more copies of an expert than ceil(copies / ranks), the fewest any
/// arrangement can manage (so two copies share a rank only when unavoidable)?
fn avoidable_duplicate(p: &Placement, l: usize) -> bool {
    let cnt = p.logcnt();
    let (spr, ranks) = (p.slots_per_rank, p.num_ranks());
    (0..ranks).any(|r| {
        let on = &p.layer(l)[r * spr..(r + 1) * spr];
        on.iter().filter(|&&e| e >= 0).any(|&e| {
            let here = on.iter().filter(|&&x| x == e).count();
            here > (cnt[l * p.num_experts + e as usize] as usize).div_ceil(ranks)
        })
    })
}

/// The heaviest rank of layer `l` in the packer's weights: each copy carries its expert's
/// load times `shares[copies]` (`copy_cost::copy_shares`, what a copy costs its rank).
fn weighted_peak(p: &Placement, loads: &[f64], l: usize, shares: &[f64]) -> f64 {
    let (cnt, spr, e_n) = (p.logcnt(), p.slots_per_rank, p.num_experts);
    (0..p.num_ranks())
        .map(|r| {
            p.layer(l)[r * spr..(r + 1) * spr]
                .iter()
                .filter(|&&e| e >= 0)
                .map(|&e| loads[l * e_n + e as usize] * shares[cnt[l * e_n + e as usize] as usize])
                .sum::<f64>()
        })
        .fold(0.0, f64::max)
}

fn plan_with(p: Placement, w: &WindowView, topo: &Topology, cap: i64, migration: Vec<ExpertMove>) -> Plan {
    let pk = sequential(w.seq_lens, cap, topo.dp).unwrap();
    Plan { placement: p, sample_rank: pk.sample_rank, sample_micro: pk.sample_micro, num_micro: pk.num_micro, replicas: vec![], migration }
}

fn place(w: &WindowView, topo: &Topology, prev: Option<&Placement>, chunks: usize) -> Outcome {
    let loads = window_loads(w);
    let ch = chunk_demand(w, chunks).unwrap();
    let d = Demand::new(&loads, &ch, w.num_layers, w.num_experts, chunks).unwrap();
    routepack_placement(&d, topo, &CostModel::for_tests(w.num_layers), prev, &Options::default()).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    /// Random loads, slot counts and node shapes: every plan validates, fills every slot,
    /// never puts two copies of an expert on one rank when avoidable, and, where an EP group
    /// fits in one node, is at least as balanced over the window as EPLB given the same loads
    /// (within float noise) wherever EPLB's own layout keeps copies apart. Across nodes the
    /// packer balances what a copy costs its rank, not its tokens (`copy_cost`), so there it
    /// may trade token balance for the receivers' all-to-all.
    #[test]
    fn plans_validate_and_beat_eplb(
        ep_pow in 0u32..4, gpn_pow in 0u32..4, extra in 0usize..5, e in 2usize..40,
        seed in 0u64..1000, chunks in 0usize..6,
    ) {
        let (ep, gpn) = (1usize << ep_pow, 1usize << gpn_pow);
        let spr = e.div_ceil(ep) + extra;
        let topo = Topology::new(ep * 2, ep, gpn, spr).unwrap();
        let (lens, x) = window_data(24, 2, e, seed);
        let w = WindowView::new(&lens, &x, 2, e).unwrap();
        let out = place(&w, &topo, None, chunks);
        let p = out.placement.clone();
        prop_assert!(p.phy2log.iter().all(|&x| x >= 0), "every slot is filled");
        for l in 0..2 {
            prop_assert!(!avoidable_duplicate(&p, l), "layer {l}: two copies of an expert share a rank");
        }
        validate_plan(&plan_with(p.clone(), &w, &topo, 400, vec![]), &w, &topo, 400).unwrap();
        let loads = window_loads(&w);
        let ours = aggregate_imbalance(&p, &loads).unwrap();
        let lb = imbalance_lower_bound(&loads, 2, e, topo.num_slots(), ep).unwrap();
        let base = eplb_placement(&loads, 2, e, &topo, 1).unwrap();
        let theirs = aggregate_imbalance(&base, &loads).unwrap();
        for l in 0..2 {
            prop_assert!(ours[l] >= lb[l] - 1e-9);
            // EPLB may buy balance with duplicates on one rank (its known defect), which
            // routepack refuses; compare where EPLB's layout is a legal one for us
            if topo.nodes_per_group() == 1 && !avoidable_duplicate(&base, l) {
                prop_assert!(ours[l] <= theirs[l] * (1.0 + 1e-9), "layer {l}: {} > eplb {}", ours[l], theirs[l]);
            }
            // across nodes: within 1% of EPLB in what it balances there (a heuristic both; no
            // case of 100,000 was further off, 0.3% the worst seen)
            if topo.nodes_per_group() > 1 && !avoidable_duplicate(&base, l) {
                let shares = {
                    let cost = CostModel::for_tests(2);
                    super::copy_cost::copy_shares(topo.num_slots(), &topo, &cost, &cost.expert_line(0.0))
                };
                let (o, t) = (weighted_peak(&p, &loads, l, &shares), weighted_peak(&base, &loads, l, &shares));
                prop_assert!(o <= t * 1.01, "layer {l}: weighted peak {} > 1.01 × eplb {}", o, t);
            }
        }
    }

    /// With a placement in force: moves validate against the plan, unchanged loads move
    /// nothing, and the result is deterministic.
    #[test]
    fn migration_is_consistent(ep_pow in 1u32..4, gpn_pow in 0u32..3, e in 4usize..40, seed in 0u64..1000) {
        let (ep, gpn) = (1usize << ep_pow, 1usize << gpn_pow);
        let spr = e.div_ceil(ep) + 1;
        let topo = Topology::new(ep, ep, gpn, spr).unwrap();
        let (lens, x) = window_data(24, 2, e, seed);
        let w = WindowView::new(&lens, &x, 2, e).unwrap();
        let first = place(&w, &topo, None, 4).placement;
        let again = place(&w, &topo, Some(&first), 4);
        prop_assert_eq!(&again.placement, &first, "unchanged loads keep the placement");
        prop_assert_eq!(again.migration_time, 0.0);
        let (lens2, x2) = window_data(24, 2, e, seed + 1);
        let w2 = WindowView::new(&lens2, &x2, 2, e).unwrap();
        let next = place(&w2, &topo, Some(&first), 4);
        prop_assert_eq!(&next.placement, &place(&w2, &topo, Some(&first), 4).placement);
        let moves = diff_nodes(&first, &next.placement, topo.ranks_per_group_node(), 1.0).unwrap();
        validate_plan(&plan_with(next.placement.clone(), &w2, &topo, 400, moves.clone()), &w2, &topo, 400).unwrap();
        let reported: usize = next.layers.iter().map(|r| r.moves).sum();
        prop_assert_eq!(reported, moves.iter().filter(|m| m.bytes > 0.0).count());
    }
}

#[test]
fn costly_migration_keeps_the_old_placement() {
    let topo = Topology::new(8, 8, 4, 3).unwrap();
    let (lens, x) = window_data(32, 3, 16, 1);
    let w = WindowView::new(&lens, &x, 3, 16).unwrap();
    let (lens2, x2) = window_data(32, 3, 16, 2);
    let w2 = WindowView::new(&lens2, &x2, 3, 16).unwrap();
    let first = place(&w, &topo, None, 4).placement;
    let loads = window_loads(&w2);
    let ch = chunk_demand(&w2, 4).unwrap();
    let d = Demand::new(&loads, &ch, 3, 16, 4).unwrap();
    let mut cost = CostModel::for_tests(3);
    cost.expert_state_bytes = 1e15; // moving anything costs hours
    let out = routepack_placement(&d, &topo, &cost, Some(&first), &Options::default()).unwrap();
    assert_eq!(out.placement, first);
    assert!(out.layers.iter().all(|r| r.choice == Choice::Keep));
    cost.expert_state_bytes = 0.0; // free moves: every layer takes its best candidate
    let out = routepack_placement(&d, &topo, &cost, Some(&first), &Options::default()).unwrap();
    for r in &out.layers {
        assert!(r.predicted <= r.predicted_keep && r.predicted <= r.predicted_fresh + 1e-12, "{r:?}");
    }
}

#[test]
fn layers_without_load_still_place_every_expert() {
    let topo = Topology::new(4, 4, 2, 3).unwrap();
    let loads = vec![0.0; 2 * 10];
    let chunks = vec![0.0; 2 * 10 * 3];
    let d = Demand::new(&loads, &chunks, 2, 10, 3).unwrap();
    let out = routepack_placement(&d, &topo, &CostModel::for_tests(2), None, &Options::default()).unwrap();
    assert!(out.placement.logcnt().iter().all(|&c| c >= 1));
    assert!(out.placement.phy2log.iter().all(|&e| e >= 0));
    let again = routepack_placement(&d, &topo, &CostModel::for_tests(2), Some(&out.placement), &Options::default()).unwrap();
    assert_eq!(again.placement, out.placement);
}

#[test]
fn bad_options_and_shapes_are_named() {
    let topo = Topology::new(2, 2, 2, 2).unwrap();
    let loads = vec![1.0; 4];
    let d = Demand::new(&loads, &[], 1, 4, 0).unwrap();
    let cost = CostModel::for_tests(1);
    let bad = Options { slack: -1.0, ..Options::default() };
    assert!(routepack_placement(&d, &topo, &cost, None, &bad).unwrap_err().to_string().contains("placement_slack"));
    let prev = Placement::new(vec![0, 1, 2, 3, 0, 1, 2, 3], 2, 4, 2).unwrap();
    let e = routepack_placement(&d, &topo, &cost, Some(&prev), &Options::default()).unwrap_err();
    assert!(e.to_string().contains("previous"), "{e}");
    assert!(Demand::new(&[1.0, f64::NAN], &[], 1, 2, 0).unwrap_err().to_string().contains("loads"));
}

/// A budget already spent still gives a valid placement of every expert (the greedy packing,
/// no search), with and without a placement in force; a budget too long to end (31 years)
/// changes nothing.
#[test]
fn a_spent_budget_still_places_every_expert() {
    use std::time::Duration;
    let topo = Topology::new(8, 8, 4, 3).unwrap();
    let (lens, x) = window_data(48, 3, 20, 7);
    let w = WindowView::new(&lens, &x, 3, 20).unwrap();
    let loads = window_loads(&w);
    let ch = chunk_demand(&w, 4).unwrap();
    let d = Demand::new(&loads, &ch, 3, 20, 4).unwrap();
    let cost = CostModel::for_tests(3);
    let none = routepack_placement(&d, &topo, &cost, None, &Options::default()).unwrap();
    let spent = Options { time_budget: Some(Duration::ZERO), ..Options::default() };
    let long = Options { time_budget: Some(Duration::from_secs(1_000_000_000)), ..Options::default() };
    for prev in [None, Some(&none.placement)] {
        let out = routepack_placement(&d, &topo, &cost, prev, &spent).unwrap();
        let pk = sequential(w.seq_lens, 1000, topo.dp).unwrap();
        let plan = Plan {
            placement: out.placement.clone(),
            sample_rank: pk.sample_rank,
            sample_micro: pk.sample_micro,
            num_micro: pk.num_micro,
            replicas: vec![],
            migration: vec![],
        };
        validate_plan(&plan, &w, &topo, 1000).unwrap();
        assert!(out.placement.logcnt().iter().all(|&c| c >= 1));
        assert!(out.placement.phy2log.iter().all(|&e| e >= 0));
        assert!(out.layers.iter().all(|r| r.choice != Choice::Incremental), "no incremental search past the deadline");
        let (a, b) = (
            routepack_placement(&d, &topo, &cost, prev, &long).unwrap(),
            routepack_placement(&d, &topo, &cost, prev, &Options::default()).unwrap(),
        );
        assert_eq!(a.placement, b.placement);
        assert_eq!(
            a.layers.iter().map(|r| (r.choice, r.swaps)).collect::<Vec<_>>(),
            b.layers.iter().map(|r| (r.choice, r.swaps)).collect::<Vec<_>>()
        );
    }
}
