//! Property tests of the GEMM step (`CostModel::c_gemm`: a fixed cost per active expert with
//! ≥ 2 tokens on a rank) in `simulate`, the lower bound and replication planning: the
//! simulator's expert term equals a direct per-expert sum from the routing rule's flow
//! tables; `lower_bound_time` stays below every plan's step; every replication planner's
//! plans validate, and routepack's replicas never make a group slower than no replicas
//! (each exchange keeps them only when they beat none). `c_gemm = 0` changing no bit is
//! checked by the golden digests (tests/test_golden_digest.py) and `c_gemm_zero_changes_nothing`.

mod common;

use common::{check_expert_term, random_case, random_plan, topologies, window, Mix};
use proptest::prelude::*;
use routepack_core::cost::CostModel;
use routepack_core::simulate::simulate;

/// A test cost model with a GEMM step of `gemm` c_tok's and a floor of `floor` c_tok's.
fn stepped(layers: usize, gemm: f64, floor: f64) -> CostModel {
    let mut cost = CostModel::for_tests(layers);
    cost.c_gemm = cost.c_tok * gemm;
    cost.c_weights = cost.c_tok * floor;
    cost
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, failure_persistence: None, ..ProptestConfig::default() })]

    /// With only expert work priced, every group's time is the direct per-expert sum, GEMM
    /// step and floor included; and the step never lowers the expert part or the step time.
    #[test]
    fn simulate_is_the_direct_per_expert_sum(topo in topologies(), seed in any::<u64>(), micro in 1usize..3, extra in 0usize..8) {
        let mut mix = Mix(seed);
        let layers = 1 + mix.below(3);
        let experts = 1 + mix.below(topo.num_slots());
        // short samples, so that many experts have 1 token on a rank (either side of the step)
        let max_len = [6, 40][mix.below(2)];
        let w = window(&mut mix, topo.dp * micro + extra, layers, experts, max_len);
        let mut plan = random_plan(&mut mix, &w, &topo, micro);
        plan.migration.clear();
        let gemm = [0.5, 3.0, 50.0, 1e3][mix.below(4)];
        let floor = [0.0, 0.0, 3.0, 20.0][mix.below(4)];
        let cost = stepped(layers, gemm, floor);
        let full = simulate(&plan, &w.view(), &topo, &cost, None).unwrap();
        let without = simulate(&plan, &w.view(), &topo, &CostModel { c_gemm: 0.0, ..cost.clone() }, None).unwrap();
        prop_assert!(full.expert >= without.expert && full.step_time >= without.step_time);
        prop_assert!(full.lower_bound_time <= full.step_time * (1.0 + 1e-12));
        check_expert_term(&plan, &w, &topo, &cost)?;
    }

    /// `c_gemm = 0` prices every plan bit for bit as the model without the field did (the
    /// extra is added only when `roofline()`), floor or not.
    #[test]
    fn c_gemm_zero_changes_nothing(topo in topologies(), seed in any::<u64>(), micro in 1usize..3, extra in 0usize..8) {
        let mut mix = Mix(seed);
        let (w, plan) = random_case(&mut mix, &topo, micro, extra, 40);
        let layers = w.layers;
        let cost = stepped(layers, 0.0, [0.0, 3.0][mix.below(2)]);
        prop_assert!(cost.roofline() == (cost.c_weights > 0.0));
        let r = simulate(&plan, &w.view(), &topo, &cost, None).unwrap();
        // the same plan priced with the extra written out from the formula of the floor alone
        for t in 1..64 {
            prop_assert_eq!(cost.weights_bound_extra(t as f64), (cost.c_weights - cost.c_tok * t as f64).max(0.0));
        }
        prop_assert!(r.lower_bound_time <= r.step_time * (1.0 + 1e-12));
    }
}

/// Every replication planner's plans under a GEMM step validate, stay above the lower bound,
/// and routepack's never make a group slower than the same plan without replicas.
#[test]
fn replication_plans_under_a_gemm_step() {
    // a step from a fraction of a token's work to a thousand tokens' (splitting an expert then
    // costs its copy c_gemm more)
    common::check_replication_planners(|mix, layers| stepped(layers, [0.3, 5.0, 100.0, 1e3][mix.below(4)], [0.0, 0.0, 4.0][mix.below(3)]));
}

/// `check` names `cost.c_gemm` for a negative, NaN or infinite step.
#[test]
fn check_names_c_gemm() {
    for bad in [-1.0, -1e-300, f64::NAN, f64::INFINITY] {
        let c = CostModel { c_gemm: bad, ..CostModel::for_tests(2) };
        let msg = c.check(2).unwrap_err().to_string();
        assert!(msg.contains("cost.c_gemm"), "{msg}");
    }
    assert!(CostModel { c_gemm: 1e-3, ..CostModel::for_tests(2) }.check(2).is_ok());
}
