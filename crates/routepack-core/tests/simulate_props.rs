//! Property tests of `simulate`: arbitrary (also malformed) plans and cost models give `Err`,
//! never a panic, and a plan it prices has a finite positive step time; its intra- and
//! cross-node bytes are the routed tokens' bytes, split by link.

mod common;

use common::{for_each_exchange_flows, random_phy2log, random_plan, topologies, window, Mix};
use proptest::prelude::*;
use routepack_core::bound::lower_bound_time;
use routepack_core::cost::CostModel;
use routepack_core::placement::Placement;
use routepack_core::plan::{ExpertMove, Plan, Replica};
use routepack_core::simulate::{ideal_time, simulate, simulate_in, Scoring};
use routepack_core::topology::Topology;
use routepack_core::validate::validate_plan;

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn validate_and_simulate_never_panic(
        topo in topologies(),
        seed in any::<u64>(),
        sample_rank in prop::collection::vec(-1i32..9, 1..12),
        sample_micro in prop::collection::vec(-1i32..3, 1..12),
        num_micro in 0usize..3,
        reps in prop::collection::vec((-1i32..3, -1i32..3, -1i32..3, -1i32..4, -1i32..9, -1i32..9, prop_oneof![-1.0f32..2.0, Just(f32::NAN)]), 0..4),
        migs in prop::collection::vec((-1i32..3, -1i32..4, -1i32..9, -1i32..9, -1i32..40, -1i32..40, prop_oneof![-1.0f64..9.0, Just(f64::NAN)]), 0..4),
        bad_cost in 0usize..4,
    ) {
        let mut mix = Mix(seed);
        let layers = 1 + mix.below(2);
        let experts = 1 + mix.below(topo.num_slots());
        let w = window(&mut mix, sample_rank.len(), layers, experts, 30);
        let placement = Placement::new(random_phy2log(&mut mix, layers, experts, &topo), layers, experts, topo.slots_per_rank).unwrap();
        let plan = Plan {
            placement,
            sample_rank,
            sample_micro,
            num_micro,
            replicas: reps.iter().map(|&(micro, group, layer, expert, src_rank, dst_rank, share)| Replica { micro, group, layer, expert, src_rank, dst_rank, share }).collect(),
            migration: migs.iter().map(|&(layer, expert, src_rank, dst_rank, src_slot, dst_slot, bytes)| ExpertMove { layer, expert, src_rank, dst_rank, src_slot, dst_slot, bytes }).collect(),
        };
        let view = w.view();
        let _ = validate_plan(&plan, &view, &topo, 50);
        let mut cost = CostModel::for_tests(layers);
        match bad_cost {
            1 => cost.a_quad.push(0.0),
            2 => cost.bw_inter = f64::NAN,
            3 => cost.c_tok = -1.0,
            _ => {}
        }
        if let Ok(rep) = simulate(&plan, &view, &topo, &cost, Some(1 + mix.below(3))) {
            prop_assert!(bad_cost == 0 && validate_plan(&plan, &view, &topo, i64::MAX).is_ok());
            prop_assert!(rep.step_time.is_finite() && rep.step_time > 0.0);
        }
    }
}

/// `(intra, cross)` one-way dispatch bytes of every exchange of a valid plan, from the flow
/// tables of `flow::route_exchange` (the routing rule), not from the simulator.
fn routed_bytes(plan: &Plan, w: &common::OwnedWindow, topo: &Topology, token_bytes: f64) -> (f64, f64) {
    let (mut intra, mut cross) = (0.0, 0.0);
    for_each_exchange_flows(plan, w, topo, |_, _, flows| {
        for f in flows {
            let bytes = f.count as f64 * token_bytes;
            if f.origin == f.dst_rank {
                continue;
            }
            if topo.local_node_of(f.origin) == topo.local_node_of(f.dst_rank) {
                intra += bytes;
            } else {
                cross += bytes;
            }
        }
    });
    (intra, cross)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, failure_persistence: None, ..ProptestConfig::default() })]

    /// intra + cross is every routed token sent off its rank, ×4 (dispatch and combine, forward
    /// and backward), each on its link; an EP group inside one node sends nothing across nodes.
    #[test]
    fn node_bytes_are_the_routed_bytes_split_by_link(
        topo in topologies(),
        seed in any::<u64>(),
        micro in 1usize..3,
        extra in 0usize..8,
    ) {
        let mut mix = Mix(seed);
        let layers = 1 + mix.below(3);
        let experts = 1 + mix.below(topo.num_slots());
        let w = window(&mut mix, topo.dp * micro + extra, layers, experts, 40);
        let plan = random_plan(&mut mix, &w, &topo, micro);
        let cost = CostModel::for_tests(layers);
        let rep = simulate(&plan, &w.view(), &topo, &cost, None).unwrap();
        let (intra, cross) = routed_bytes(&plan, &w, &topo, cost.token_bytes);
        // token_bytes is a power of two and the counts are small: every sum is exact
        prop_assert_eq!(rep.intra_node_bytes, 4.0 * intra);
        prop_assert_eq!(rep.cross_node_bytes, 4.0 * cross);
        prop_assert_eq!(rep.intra_node_bytes + rep.cross_node_bytes, 4.0 * (intra + cross));
        let tokens: i64 = w.seq_lens.iter().sum();
        prop_assert_eq!(rep.cross_node_bytes_per_token, rep.cross_node_bytes / tokens as f64);
        if topo.gpus_per_node >= topo.ep {
            prop_assert_eq!(rep.cross_node_bytes, 0.0);
        }
        // the same plan with the whole EP group on one node: nothing crosses (replicas and a
        // replicated expert's slots draw their tokens node-first, so which tokens move can
        // change with the node layout)
        let one_node = Topology::new(topo.dp, topo.ep, topo.ep.max(topo.gpus_per_node), topo.slots_per_rank).unwrap().with_replica_slots(topo.replica_slots).unwrap();
        let rep1 = simulate(&plan, &w.view(), &one_node, &cost, None).unwrap();
        let (intra1, cross1) = routed_bytes(&plan, &w, &one_node, cost.token_bytes);
        prop_assert_eq!(cross1, 0.0);
        prop_assert_eq!(rep1.cross_node_bytes, 0.0);
        prop_assert_eq!(rep1.intra_node_bytes, 4.0 * intra1);
        // without replicas and with one slot per expert, which tokens move does not depend on
        // the nodes (node-first feeding of a replicated expert's slots does)
        if plan.replicas.is_empty() && plan.placement.logcnt().iter().all(|&c| c == 1) {
            prop_assert_eq!(intra1, intra + cross);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, failure_persistence: None, ..ProptestConfig::default() })]

    /// The simulator gathers the lower bound's demand sums on its own pass over the demand:
    /// its `lower_bound_time` and `ideal_time` are, bit for bit, the standalone functions' (at
    /// the cap or the plan's largest row, whichever is larger), with and without a cap.
    #[test]
    fn simulate_reports_the_standalone_bound_and_ideal_exactly(
        topo in topologies(),
        seed in any::<u64>(),
        micro in 1usize..3,
        extra in 0usize..8,
        capped in any::<bool>(),
    ) {
        let mut mix = Mix(seed);
        let layers = 1 + mix.below(3);
        let experts = 1 + mix.below(topo.num_slots());
        let w = window(&mut mix, topo.dp * micro + extra, layers, experts, 40);
        let plan = random_plan(&mut mix, &w, &topo, micro);
        let mut cost = CostModel::for_tests(layers);
        cost.token_bytes = [4096.0, 1.7][mix.below(2)];
        cost.c_weights = [0.0, 5e-8][mix.below(2)];
        let view = w.view();
        let longest = *w.seq_lens.iter().max().unwrap();
        let cap = if capped { Some(longest + mix.below(60) as i64) } else { None };
        let rep = simulate_in(&plan, &view, &topo, &cost, &Scoring { ideal_micro: Some(1), token_cap: cap, ..Scoring::default() }).unwrap();
        let largest = common::cell_tokens(&plan, &w.seq_lens, topo.dp).into_iter().max().unwrap();
        let bound = lower_bound_time(&view, &topo, &cost, cap.map(|c| c.max(largest))).unwrap();
        prop_assert_eq!(rep.lower_bound_time.to_bits(), bound.to_bits());
        prop_assert_eq!(rep.ideal_time.to_bits(), ideal_time(&view, &topo, &cost, 1).to_bits());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, failure_persistence: None, ..ProptestConfig::default() })]

    /// `Scoring::step_only` (what the preset's choice among candidates runs) prices every
    /// exchange as the full pass does: the step time, its parts, group times and bytes the same
    /// bits, only the bound and the balanced reference left out (NaN).
    #[test]
    fn step_only_scores_the_same_step_bit_for_bit(
        topo in topologies(),
        seed in any::<u64>(),
        micro in 1usize..3,
        extra in 0usize..8,
    ) {
        let mut mix = Mix(seed);
        let layers = 1 + mix.below(3);
        let experts = 1 + mix.below(topo.num_slots());
        let w = window(&mut mix, topo.dp * micro + extra, layers, experts, 40);
        let plan = random_plan(&mut mix, &w, &topo, micro);
        let cost = CostModel::for_tests(layers);
        let view = w.view();
        let cap = Some(*w.seq_lens.iter().max().unwrap());
        let full = simulate_in(&plan, &view, &topo, &cost, &Scoring { token_cap: cap, ..Scoring::default() }).unwrap();
        let probe = simulate_in(&plan, &view, &topo, &cost, &Scoring { token_cap: cap, step_only: true, ..Scoring::default() }).unwrap();
        prop_assert!(probe.lower_bound_time.is_nan() && probe.ideal_time.is_nan());
        let bits = |r: &routepack_core::simulate::SimReport| {
            let mut v = vec![r.step_time, r.attention, r.expert, r.all_to_all, r.hidden, r.replication, r.migration,
                r.redundant_grads, r.pipeline_bubble, r.intra_node_bytes, r.cross_node_bytes, r.mean_imbalance];
            v.extend(&r.group_times);
            v.extend(&r.imbalance);
            (v.into_iter().map(f64::to_bits).collect::<Vec<_>>(), r.critical_group)
        };
        prop_assert_eq!(bits(&probe), bits(&full));
    }
}
