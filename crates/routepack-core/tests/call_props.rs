//! Property tests of the kernel call's fixed cost (`CostModel::c_call`: once per EP rank and
//! exchange where the rank computes a token) in `simulate`, the lower bound and replication
//! planning: the simulator's expert term equals a direct sum from the routing rule's flow
//! tables; each group's time rises by exactly P·c_call per exchange that computes a token
//! (no overlap); `lower_bound_time` stays below every plan's step; every replication
//! planner's plans validate, and routepack's replicas never make a group slower than none.
//! `c_call = 0` changing no bit is checked by the golden digests
//! (tests/test_golden_digest.py) and `c_call_zero_changes_nothing`.

mod common;

use common::{check_expert_term, close, random_case, topologies, Mix};
use proptest::prelude::*;
use routepack_core::cost::{CostModel, Overlap};
use routepack_core::plan::Plan;
use routepack_core::simulate::simulate;
use routepack_core::topology::Topology;
use std::collections::BTreeSet;

/// `[G]` the exchanges (step, layer) of each EP group in which some sample routes a token:
/// the ones where a rank computes tokens, so pays `c_call`.
fn busy_exchanges(plan: &Plan, w: &common::OwnedWindow, topo: &Topology) -> Vec<usize> {
    let mut seen = BTreeSet::new();
    for s in 0..w.seq_lens.len() {
        let g = plan.sample_rank[s] as usize / topo.ep;
        for l in 0..w.layers {
            let row = &w.expert_tokens[(s * w.layers + l) * w.experts..(s * w.layers + l + 1) * w.experts];
            if row.iter().any(|&x| x > 0) {
                seen.insert((g, plan.sample_micro[s], l));
            }
        }
    }
    let mut out = vec![0; topo.num_groups()];
    for (g, _, _) in seen {
        out[g] += 1;
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, failure_persistence: None, ..ProptestConfig::default() })]

    /// With only expert work priced, every group's time is the direct sum over its exchanges
    /// of the slowest rank's call plus its experts, floor and GEMM step included.
    #[test]
    fn simulate_is_the_direct_sum_with_the_call(topo in topologies(), seed in any::<u64>(), micro in 1usize..3, extra in 0usize..8) {
        let mut mix = Mix(seed);
        let max_len = [6, 40][mix.below(2)];
        let (w, mut plan) = random_case(&mut mix, &topo, micro, extra, max_len);
        let layers = w.layers;
        plan.migration.clear();
        let mut cost = CostModel::for_tests(layers);
        cost.c_call = cost.c_exp * [0.1, 1.0, 30.0][mix.below(3)];
        cost.c_gemm = cost.c_tok * [0.0, 5.0][mix.below(2)];
        cost.c_weights = cost.c_tok * [0.0, 3.0][mix.below(2)];
        check_expert_term(&plan, &w, &topo, &cost)?;
    }

    /// Without overlap, each group's time rises by P·c_call for every exchange in which it
    /// computes a token (the slowest rank computes tokens, so it pays the call), whatever the
    /// plan's replicas; the step never falls, and the lower bound stays below it.
    #[test]
    fn each_busy_exchange_pays_one_call(topo in topologies(), seed in any::<u64>(), micro in 1usize..3, extra in 0usize..8) {
        let mut mix = Mix(seed);
        let (w, plan) = random_case(&mut mix, &topo, micro, extra, 40);
        let layers = w.layers;
        let base = CostModel::for_tests(layers);
        let cost = CostModel { c_call: base.c_exp * [0.5, 4.0, 100.0][mix.below(3)], ..base.clone() };
        let without = simulate(&plan, &w.view(), &topo, &base, None).unwrap();
        let with = simulate(&plan, &w.view(), &topo, &cost, None).unwrap();
        let busy = busy_exchanges(&plan, &w, &topo);
        for (g, ((&a, &b), &n)) in without.group_times.iter().zip(&with.group_times).zip(&busy).enumerate() {
            let want = a + cost.compute_passes() * cost.c_call * n as f64;
            prop_assert!(close(b, want), "group {}: {} with the call vs {} + {} exchanges' calls", g, b, a, n);
        }
        prop_assert!(with.step_time >= without.step_time && with.expert >= without.expert);
        prop_assert!(with.lower_bound_time <= with.step_time * (1.0 + 1e-12));
        let hidden = CostModel { overlap: Overlap::DispatchCombine, ..cost };
        let r = simulate(&plan, &w.view(), &topo, &hidden, None).unwrap();
        prop_assert!(r.lower_bound_time <= r.step_time * (1.0 + 1e-12));
    }

    /// `c_call = 0` prices every plan bit for bit as the model without the field did.
    #[test]
    fn c_call_zero_changes_nothing(topo in topologies(), seed in any::<u64>(), micro in 1usize..3, extra in 0usize..8) {
        let mut mix = Mix(seed);
        let (w, plan) = random_case(&mut mix, &topo, micro, extra, 40);
        let layers = w.layers;
        let cost = CostModel::for_tests(layers);
        prop_assert_eq!(cost.c_call, 0.0);
        for t in [0.0, 1.0, 17.0] {
            let x = cost.expert_time(t, 1.0 + t);
            prop_assert_eq!(cost.rank_expert_time(t, 1.0 + t, 0.0).to_bits(), x.to_bits());
        }
        let r = simulate(&plan, &w.view(), &topo, &cost, None).unwrap();
        prop_assert!(r.lower_bound_time <= r.step_time * (1.0 + 1e-12));
    }
}

/// Every replication planner's plans under a kernel call's cost validate, stay above the
/// lower bound, and routepack's never make a group slower than the same plan without
/// replicas (its exact exchange state prices the call as the simulator does).
#[test]
fn replication_plans_under_a_call_cost() {
    // a call from a fraction of an expert's overhead to a thousand of them (a copy on a rank
    // without tokens then costs the call)
    common::check_replication_planners(|mix, layers| {
        let cost = CostModel::for_tests(layers);
        CostModel { c_call: cost.c_exp * [0.3, 5.0, 1e3][mix.below(3)], ..cost }
    });
}

/// `check` names `cost.c_call` for a negative, NaN or infinite call cost.
#[test]
fn check_names_c_call() {
    for bad in [-1.0, -1e-300, f64::NAN, f64::INFINITY] {
        let c = CostModel { c_call: bad, ..CostModel::for_tests(2) };
        let msg = c.check(2).unwrap_err().to_string();
        assert!(msg.contains("cost.c_call"), "{msg}");
    }
    assert!(CostModel { c_call: 1e-3, ..CostModel::for_tests(2) }.check(2).is_ok());
}
