//! Property tests of the cost model's options (`c_weights`, `overlap`, `passes`,
//! `a2a_latency`) in `simulate`: the roofline expert term equals an independent count from the
//! routing rule's flow tables; a floor below every active expert's load changes no bit; overlap
//! hides at most the all-to-all and at most the compute, and never slows a plan; RL's extra
//! forward scales each part by its pass multipliers; the all-to-all latency adds the same to
//! every exchange. (`bound_props.rs` checks the lower bound under all the options,
//! `call_props.rs` the call's cost, `gemm_step_props.rs` the GEMM step; the golden digests and
//! `tests/test_cost_options.py` check that unset options price and plan every window as before.)

mod common;

use common::{check_expert_term, close, random_case, topologies, Mix};
use proptest::prelude::*;
use routepack_core::cost::{CostModel, Overlap, Pass};
use routepack_core::simulate::simulate;

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, failure_persistence: None, ..ProptestConfig::default() })]

    /// With only expert work priced, every group's time is the roofline expert term counted
    /// from the flow tables.
    #[test]
    fn roofline_expert_term_is_the_flow_tables(topo in topologies(), seed in any::<u64>(), micro in 1usize..3, extra in 0usize..8) {
        let mut mix = Mix(seed);
        let (w, plan) = random_case(&mut mix, &topo, micro, extra, 40);
        let layers = w.layers;
        let mut cost = CostModel::for_tests(layers);
        cost.c_weights = cost.c_tok * [0.5, 3.0, 20.0, 1e3][mix.below(4)];
        let mut plan = plan;
        plan.migration.clear();
        check_expert_term(&plan, &w, &topo, &cost)?;
    }

    /// A floor no higher than one token's work (every active expert has a token) changes no
    /// bit of the report; a higher one never lowers any group's time or the step. (Not the
    /// report's `expert` part: that is the critical group's, and a higher floor can make a
    /// group with less expert work the critical one.)
    #[test]
    fn a_floor_below_every_load_changes_nothing(topo in topologies(), seed in any::<u64>(), micro in 1usize..3, extra in 0usize..8) {
        let mut mix = Mix(seed);
        let (w, plan) = random_case(&mut mix, &topo, micro, extra, 40);
        let layers = w.layers;
        let linear = CostModel::for_tests(layers);
        let base = simulate(&plan, &w.view(), &topo, &linear, None).unwrap();
        let low = CostModel { c_weights: linear.c_tok * mix.unit(), ..linear.clone() };
        prop_assert_eq!(&simulate(&plan, &w.view(), &topo, &low, None).unwrap(), &base);
        let high = CostModel { c_weights: linear.c_tok * 50.0, ..linear.clone() };
        let r = simulate(&plan, &w.view(), &topo, &high, None).unwrap();
        prop_assert!(r.step_time >= base.step_time);
        for (x, y) in base.group_times.iter().zip(&r.group_times) {
            prop_assert!(y >= x, "a group got faster under a higher floor: {} -> {}", x, y);
        }
        prop_assert!(r.lower_bound_time <= r.step_time * (1.0 + 1e-12));
    }

    /// Overlap hides at most the all-to-all and at most the compute of the critical group, the
    /// parts minus the hidden seconds add up to the step, and no group gets slower.
    #[test]
    fn overlap_hides_what_it_can(topo in topologies(), seed in any::<u64>(), micro in 1usize..3, extra in 0usize..8, bytes in 0usize..3) {
        let mut mix = Mix(seed);
        let (w, plan) = random_case(&mut mix, &topo, micro, extra, 40);
        let layers = w.layers;
        let mut none = CostModel::for_tests(layers);
        none.token_bytes = [64.0, 4096.0, 1e6][bytes];
        let over = CostModel { overlap: Overlap::DispatchCombine, ..none.clone() };
        let a = simulate(&plan, &w.view(), &topo, &none, None).unwrap();
        let b = simulate(&plan, &w.view(), &topo, &over, None).unwrap();
        prop_assert_eq!(a.hidden, 0.0);
        // (sums over exchanges, so up to rounding: Σ min(C, A) against Σ C summed part by part)
        let slack = 1.0 + 1e-12;
        prop_assert!(b.hidden >= 0.0 && b.hidden <= b.all_to_all * slack && b.hidden <= (b.attention + b.expert) * slack);
        let parts = b.attention + b.expert + b.all_to_all + b.replication + b.migration + b.redundant_grads - b.hidden;
        prop_assert!(close(parts, b.step_time), "{} vs {}", parts, b.step_time);
        for (x, y) in a.group_times.iter().zip(&b.group_times) {
            prop_assert!(y <= x);
        }
        // every exchange costs at least its compute and at least its all-to-all
        prop_assert!(b.step_time * (1.0 + 1e-12) >= (b.attention + b.expert).max(b.all_to_all));
        prop_assert!(b.lower_bound_time <= b.step_time * (1.0 + 1e-12));
    }

    /// The once-per-step sum of redundant experts' gradients is the formula written out: per
    /// layer, the experts held by more than one slot, each `expert_grad_bytes` through a ring
    /// all-reduce (2·(ep−1)/ep of the bytes per rank) over the slowest link of the group; 0
    /// without redundant copies; the rest of the step does not depend on it.
    #[test]
    fn redundant_grads_are_the_ring_all_reduce(topo in topologies(), seed in any::<u64>(), micro in 1usize..3, extra in 0usize..8) {
        let mut mix = Mix(seed);
        let (w, plan) = random_case(&mut mix, &topo, micro, extra, 40);
        let layers = w.layers;
        let cost = CostModel::for_tests(layers);
        let r = simulate(&plan, &w.view(), &topo, &cost, None).unwrap();
        let mut redundant = 0usize;
        for l in 0..layers {
            let row = plan.placement.layer(l);
            redundant += (0..w.experts as i32).filter(|&e| row.iter().filter(|&&x| x == e).count() > 1).count();
        }
        let ep = topo.ep as f64;
        let bw = if topo.nodes_per_group() > 1 { cost.bw_inter } else { cost.bw_intra };
        let want = if topo.ep > 1 { 2.0 * (ep - 1.0) / ep * redundant as f64 * cost.expert_grad_bytes / bw } else { 0.0 };
        prop_assert!(close(r.redundant_grads, want), "{} vs {}", r.redundant_grads, want);
        let free = CostModel { expert_grad_bytes: 0.0, ..cost.clone() };
        let z = simulate(&plan, &w.view(), &topo, &free, None).unwrap();
        prop_assert_eq!(z.redundant_grads, 0.0);
        // expert_grad_bytes prices intra-batch replicas too: compare on a plan without them
        if plan.replicas.is_empty() {
            prop_assert!(close(r.step_time, z.step_time + want), "{} vs {} + {}", r.step_time, z.step_time, want);
        }
        prop_assert!(r.lower_bound_time <= r.step_time * (1.0 + 1e-12));
    }

    /// RL's step (recompute forward + update forward/backward) prices compute ×4 and
    /// communication ×3 where the default prices ×3 and ×2; replication is unchanged.
    #[test]
    fn passes_scale_their_parts(topo in topologies(), seed in any::<u64>(), micro in 1usize..3, extra in 0usize..8) {
        let mut mix = Mix(seed);
        let (w, plan) = random_case(&mut mix, &topo, micro, extra, 40);
        let layers = w.layers;
        let base = CostModel::for_tests(layers);
        let rl = CostModel { passes: vec![Pass::Forward, Pass::Forward, Pass::Backward], ..base.clone() };
        let a = simulate(&plan, &w.view(), &topo, &base, None).unwrap();
        let b = simulate(&plan, &w.view(), &topo, &rl, None).unwrap();
        // the critical group may change; compare per part only where it did not
        if a.critical_group == b.critical_group {
            prop_assert!(close(b.attention, a.attention * 4.0 / 3.0));
            prop_assert!(close(b.expert, a.expert * 4.0 / 3.0));
            prop_assert!(close(b.all_to_all, a.all_to_all * 1.5));
            prop_assert!(close(b.replication, a.replication));
        }
        prop_assert!(b.step_time >= a.step_time);
        prop_assert!(b.lower_bound_time <= b.step_time * (1.0 + 1e-12));
    }

    /// Without overlap, the all-to-all latency adds 2·K·a2a_latency to every exchange of every
    /// group (its collectives run whatever they move), RL's extra forward included; under
    /// overlap it never lowers the step; the lower bound stays below it; 0 changes no bit.
    #[test]
    fn latency_adds_to_every_exchange(topo in topologies(), seed in any::<u64>(), micro in 1usize..3, extra in 0usize..8) {
        let mut mix = Mix(seed);
        let (w, plan) = random_case(&mut mix, &topo, micro, extra, 40);
        let layers = w.layers;
        let mut base = CostModel::for_tests(layers);
        if mix.below(2) == 0 {
            base.passes = vec![Pass::Forward, Pass::Forward, Pass::Backward];
        }
        let lat = CostModel { a2a_latency: base.c_exp * [0.1, 2.0, 50.0][mix.below(3)], ..base.clone() };
        let a = simulate(&plan, &w.view(), &topo, &base, None).unwrap();
        let b = simulate(&plan, &w.view(), &topo, &lat, None).unwrap();
        let per_exchange = 2.0 * lat.comm_passes() * lat.a2a_latency;
        prop_assert!(close(lat.all_to_all_latency(), per_exchange));
        for (g, (&x, &y)) in a.group_times.iter().zip(&b.group_times).enumerate() {
            let want = x + per_exchange * (plan.num_micro * layers) as f64;
            prop_assert!(close(y, want), "group {}: {} with latency vs {}", g, y, want);
        }
        prop_assert!(b.lower_bound_time <= b.step_time * (1.0 + 1e-12));
        let ov = |c: &CostModel| CostModel { overlap: Overlap::DispatchCombine, ..c.clone() };
        let (c, d) = (simulate(&plan, &w.view(), &topo, &ov(&base), None).unwrap(), simulate(&plan, &w.view(), &topo, &ov(&lat), None).unwrap());
        prop_assert!(d.step_time >= c.step_time && d.lower_bound_time <= d.step_time * (1.0 + 1e-12));
        let zero = CostModel { a2a_latency: 0.0, ..lat };
        prop_assert_eq!(&simulate(&plan, &w.view(), &topo, &zero, None).unwrap(), &a);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 120, failure_persistence: None, ..ProptestConfig::default() })]

    /// `bw_reduce` prices the once-per-step sum of redundant experts' gradients inside a node
    /// (and only that): its time is the same bytes at the other bandwidth; a group spanning
    /// nodes keeps the inter-node link; 0 changes no bit.
    #[test]
    fn reduce_bandwidth_prices_the_redundant_sum(topo in topologies(), seed in any::<u64>(), micro in 1usize..3, extra in 0usize..8) {
        let mut mix = Mix(seed);
        let (w, plan) = random_case(&mut mix, &topo, micro, extra, 40);
        let base = CostModel::for_tests(w.layers);
        let factor = [0.01, 0.5, 4.0][mix.below(3)];
        let slow = CostModel { bw_reduce: base.bw_intra * factor, ..base.clone() };
        let a = simulate(&plan, &w.view(), &topo, &base, None).unwrap();
        let b = simulate(&plan, &w.view(), &topo, &slow, None).unwrap();
        let want = if topo.nodes_per_group() < 2 { a.redundant_grads / factor } else { a.redundant_grads };
        prop_assert!(close(b.redundant_grads, want), "{} vs {}", b.redundant_grads, want);
        prop_assert!(close(b.step_time - a.step_time, b.redundant_grads - a.redundant_grads));
        prop_assert!(close(b.expert, a.expert) && close(b.all_to_all, a.all_to_all));
        prop_assert!(b.lower_bound_time <= b.step_time * (1.0 + 1e-12));
        let zero = CostModel { bw_reduce: 0.0, ..slow };
        prop_assert_eq!(&simulate(&plan, &w.view(), &topo, &zero, None).unwrap(), &a);
    }
}

/// `check` names the new fields: an empty pass list, a negative or NaN floor or latency.
#[test]
fn check_names_the_options() {
    let mut c = CostModel::for_tests(2);
    c.passes.clear();
    assert!(c.check(2).unwrap_err().to_string().contains("cost.passes"));
    for bad in [-1.0, f64::NAN, f64::INFINITY] {
        let c = CostModel { c_weights: bad, ..CostModel::for_tests(2) };
        assert!(c.check(2).unwrap_err().to_string().contains("cost.c_weights"));
    }
    for bad in [-1e-9, f64::NAN, f64::INFINITY] {
        let c = CostModel { a2a_latency: bad, ..CostModel::for_tests(2) };
        assert!(c.check(2).unwrap_err().to_string().contains("cost.a2a_latency"));
        let c = CostModel { bw_reduce: bad, ..CostModel::for_tests(2) };
        assert!(c.check(2).unwrap_err().to_string().contains("cost.bw_reduce"));
    }
    assert!(Overlap::parse("both").unwrap_err().to_string().contains("cost.overlap"));
    assert!(Pass::parse(1, "recompute").unwrap_err().to_string().contains("cost.passes[1]"));
    assert_eq!(Overlap::parse("dispatch_combine").unwrap(), Overlap::DispatchCombine);
    assert_eq!(Pass::parse(0, Pass::Backward.name()).unwrap(), Pass::Backward);
}

/// The case that showed the report's `expert` part is not monotone in the floor: under the
/// higher floor the critical group changes from 0 to 1, whose expert part is smaller, while
/// every group's time and the step still rise.
#[test]
fn a_higher_floor_can_move_the_critical_group() {
    use routepack_core::topology::Topology;
    let topo = Topology {
        dp: 2,
        ep: 1,
        gpus_per_node: 1,
        nvlink_domain: 1,
        slots_per_rank: 1,
        replica_slots: 0,
        pp: 1,
        vpp: 1,
        cp: 1,
        layers_per_stage: None,
    };
    let mut mix = Mix(16621325469169001263);
    let (w, plan) = random_case(&mut mix, &topo, 1, 7, 40);
    let linear = CostModel::for_tests(w.layers);
    let base = simulate(&plan, &w.view(), &topo, &linear, None).unwrap();
    let high = CostModel { c_weights: linear.c_tok * 50.0, ..linear.clone() };
    let r = simulate(&plan, &w.view(), &topo, &high, None).unwrap();
    assert_ne!(r.critical_group, base.critical_group);
    assert!(r.expert < base.expert);
    assert!(r.step_time >= base.step_time);
    assert!(base.group_times.iter().zip(&r.group_times).all(|(x, y)| y >= x));
}
