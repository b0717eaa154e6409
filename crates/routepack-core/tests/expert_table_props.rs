//! Property tests of the tabulated expert extra (`CostModel::expert_table`: knots of seconds
//! per active expert beyond the roofline and the GEMM step, linear between knots, constant
//! outside them) in the cost model's terms, `simulate`, the lower bound and replication
//! planning: the table reads as its definition says; the simulator's expert term equals a
//! direct per-expert sum from the routing rule's flow tables, table included; the lower bound
//! stays below every plan's step; a table of zeros prices every plan as no table; every
//! replication planner's plans validate under a table; `check` names a bad knot. An empty
//! table (the default) changing no bit is checked by the golden digests
//! (tests/test_golden_digest.py).

mod common;

use common::{check_expert_term, random_case, random_plan, table_at, topologies, window, Mix};
use proptest::prelude::*;
use routepack_core::cost::CostModel;
use routepack_core::simulate::simulate;

/// A test cost model with a table of `knots` knots, tokens 1, then ×1.2–8 apart, each from 0
/// to `scale` c_tok's.
fn tabled(mix: &mut Mix, layers: usize, knots: usize, scale: f64) -> CostModel {
    let mut cost = CostModel::for_tests(layers);
    let mut tokens = 1.0;
    cost.expert_table = (0..knots)
        .map(|_| {
            let knot = (tokens, cost.c_tok * scale * mix.unit());
            tokens *= 1.2 + 6.8 * mix.unit();
            knot
        })
        .collect();
    cost
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, failure_persistence: None, ..ProptestConfig::default() })]

    /// `table_extra` is the knots' seconds at the knots, linear between them, the end knots'
    /// outside; `weights_bound_extra` adds it to the floor and the step; and never negative.
    #[test]
    fn the_table_reads_as_defined(seed in any::<u64>(), knots in 0usize..6) {
        let mut mix = Mix(seed);
        let mut cost = tabled(&mut mix, 1, knots, 50.0);
        cost.c_gemm = cost.c_tok * [0.0, 3.0][mix.below(2)];
        cost.c_weights = cost.c_tok * [0.0, 5.0][mix.below(2)];
        for &(t, s) in &cost.expert_table {
            prop_assert_eq!(cost.table_extra(t), s);
        }
        for t in 1..200 {
            let t = t as f64 * 0.5;
            let got = cost.table_extra(t);
            prop_assert!((got - table_at(&cost, t)).abs() <= 1e-12 * got.abs().max(1e-30), "{} at {}", got, t);
            prop_assert!(got >= 0.0);
            let floor = (cost.c_weights - cost.c_tok * t).max(0.0);
            let step = if t >= 2.0 { cost.c_gemm } else { 0.0 };
            let want = if knots == 0 { floor + step } else { floor + step + got };
            prop_assert_eq!(cost.weights_bound_extra(t), want);
        }
        prop_assert_eq!(cost.roofline(), knots > 0 || cost.c_gemm > 0.0 || cost.c_weights > 0.0);
    }

    /// With only expert work priced, every group's time is the direct per-expert sum, table
    /// included; the table never lowers the expert part or the step; the bound stays below.
    #[test]
    fn simulate_is_the_direct_per_expert_sum(topo in topologies(), seed in any::<u64>(), micro in 1usize..3, extra in 0usize..8) {
        let mut mix = Mix(seed);
        let layers = 1 + mix.below(3);
        let experts = 1 + mix.below(topo.num_slots());
        // short samples, so that experts have few tokens on a rank (the table's small knots)
        let max_len = [6, 40, 300][mix.below(3)];
        let w = window(&mut mix, topo.dp * micro + extra, layers, experts, max_len);
        let mut plan = random_plan(&mut mix, &w, &topo, micro);
        plan.migration.clear();
        let (knots, scale) = (1 + mix.below(5), [0.5, 20.0, 1e3][mix.below(3)]);
        let cost = tabled(&mut mix, layers, knots, scale);
        let full = simulate(&plan, &w.view(), &topo, &cost, None).unwrap();
        let without = simulate(&plan, &w.view(), &topo, &CostModel { expert_table: Vec::new(), ..cost.clone() }, None).unwrap();
        prop_assert!(full.expert >= without.expert && full.step_time >= without.step_time);
        prop_assert!(full.lower_bound_time <= full.step_time * (1.0 + 1e-12));
        check_expert_term(&plan, &w, &topo, &cost)?;
    }

    /// A table whose knots are all 0 prices every plan bit for bit as no table.
    #[test]
    fn a_table_of_zeros_changes_nothing(topo in topologies(), seed in any::<u64>(), micro in 1usize..3, extra in 0usize..8) {
        let mut mix = Mix(seed);
        let (w, plan) = random_case(&mut mix, &topo, micro, extra, 40);
        let knots = 1 + mix.below(4);
        let mut cost = tabled(&mut mix, w.layers, knots, 0.0);
        cost.c_gemm = cost.c_tok * [0.0, 3.0][mix.below(2)];
        let none = CostModel { expert_table: Vec::new(), ..cost.clone() };
        let (a, b) = (simulate(&plan, &w.view(), &topo, &cost, None).unwrap(), simulate(&plan, &w.view(), &topo, &none, None).unwrap());
        prop_assert_eq!(a.step_time.to_bits(), b.step_time.to_bits());
        prop_assert_eq!(a.expert.to_bits(), b.expert.to_bits());
        prop_assert_eq!(a.group_times.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), b.group_times.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
    }
}

/// Every replication planner's plans under a table validate, stay above the lower bound, and
/// routepack's never make a group slower than the same plan without replicas.
#[test]
fn replication_plans_under_a_table() {
    common::check_replication_planners(|mix, layers| {
        let (knots, scale) = (1 + mix.below(4), [0.3, 5.0, 100.0, 1e3][mix.below(4)]);
        tabled(mix, layers, knots, scale)
    });
}

/// `check` names the knot of a bad table: tokens below 1, not increasing, or not finite;
/// seconds negative or not finite.
#[test]
fn check_names_the_knot() {
    let bad: [(Vec<(f64, f64)>, &str); 6] = [
        (vec![(0.5, 1e-6)], "cost.expert_table[0]"),
        (vec![(1.0, 1e-6), (1.0, 2e-6)], "cost.expert_table[1]"),
        (vec![(2.0, 1e-6), (1.5, 2e-6)], "cost.expert_table[1]"),
        (vec![(1.0, 0.0), (f64::NAN, 2e-6)], "cost.expert_table[1]"),
        (vec![(1.0, -1e-6)], "cost.expert_table[0]"),
        (vec![(1.0, 0.0), (4.0, f64::INFINITY)], "cost.expert_table[1]"),
    ];
    for (table, name) in bad {
        let c = CostModel { expert_table: table.clone(), ..CostModel::for_tests(2) };
        let msg = c.check(2).unwrap_err().to_string();
        assert!(msg.contains(name), "{table:?}: {msg}");
    }
    let ok = CostModel { expert_table: vec![(1.0, 0.0), (2.0, 1e-3), (4.0, 5e-4)], ..CostModel::for_tests(2) };
    assert!(ok.check(2).is_ok());
}
