//! Tests of the replication planners: every plan through `validate_plan`, exactness of the
//! incremental exchange cost, the baselines' rules, routepack never slower than no replication,
//! determinism across thread counts.

use proptest::prelude::*;

use super::exchange::{plan_exchanges, Exchange};
use super::state::ExchangeState;
use super::test_case::Case;
use super::{hot_n, relibra, routepack, Packed};
use crate::cost::CostModel;
use crate::flow::route_expert;
use crate::placement::static_placement;
use crate::plan::{bucket_replicas, Plan, Replica};
use crate::simulate::{simulate, ExchangePricer};
use crate::topology::Topology;
use crate::validate::validate_plan;

fn run(case: &Case, which: &str, slots: usize) -> (Plan, Vec<Replica>) {
    let base = case.plan(Vec::new());
    let packed = Packed { sample_rank: &base.sample_rank, sample_micro: &base.sample_micro, num_micro: base.num_micro };
    let w = case.window();
    let cost = CostModel::for_tests(case.layers);
    let replicas = match which {
        "hot_n" => hot_n(&w, &case.topo, &cost, &case.placement, packed, hot_n::DEFAULT_HOT_EXPERTS),
        "relibra" => relibra(&w, &case.topo, &cost, &case.placement, packed, slots),
        _ => routepack(
            &w,
            &case.topo,
            &cost,
            &case.placement,
            packed,
            &routepack::Options { replication_slots: slots, ..Default::default() },
        ),
    }
    .unwrap();
    (base, replicas)
}

/// Copies per (group, micro, layer, dst rank).
fn copies_per_rank(replicas: &[Replica]) -> std::collections::HashMap<(i32, i32, i32, i32), usize> {
    let mut m = std::collections::HashMap::new();
    for r in replicas {
        *m.entry((r.group, r.micro, r.layer, r.dst_rank)).or_default() += 1;
    }
    m
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn every_plan_is_valid(seed in 0u64..1_000_000, shape in 0usize..4, slots in 0usize..4) {
        let case = Case::new(seed, shape);
        let w = case.window();
        for which in ["hot_n", "relibra", "routepack"] {
            let (mut plan, replicas) = run(&case, which, slots);
            for r in &replicas {
                prop_assert!((0.0..=1.0).contains(&r.share), "{which}: {r:?}");
                prop_assert!(r.src_rank != r.dst_rank, "{which}: {r:?}");
                prop_assert!(case.placement.layer(r.layer as usize)
                    [r.src_rank as usize * case.topo.slots_per_rank..(r.src_rank as usize + 1) * case.topo.slots_per_rank]
                    .contains(&r.expert), "{which}: src does not host: {r:?}");
            }
            if which != "hot_n" {
                prop_assert!(copies_per_rank(&replicas).values().all(|&n| n <= slots), "{which}: over the slot budget");
            }
            plan.replicas = replicas;
            validate_plan(&plan, &w, &case.topo, case.cap).map_err(|e| TestCaseError::fail(format!("{which}: {e}")))?;
        }
    }

    #[test]
    fn routepack_never_slower_than_none(seed in 0u64..1_000_000, shape in 0usize..4, slots in 1usize..4) {
        let case = Case::new(seed, shape);
        let w = case.window();
        let cost = CostModel::for_tests(case.layers);
        let (mut plan, replicas) = run(&case, "routepack", slots);
        let none = simulate(&plan, &w, &case.topo, &cost, None).unwrap();
        plan.replicas = replicas;
        let with = simulate(&plan, &w, &case.topo, &cost, None).unwrap();
        prop_assert!(with.step_time <= none.step_time, "{} > {}", with.step_time, none.step_time);
        for (g, (a, b)) in with.group_times.iter().zip(&none.group_times).enumerate() {
            prop_assert!(a <= b, "group {g}: {a} > {b}");
        }
    }

    #[test]
    fn incremental_cost_matches_the_simulator(seed in 0u64..1_000_000, shape in 0usize..4) {
        // price every exchange of every planner's plan both ways
        let case = Case::new(seed, shape);
        let w = case.window();
        // half the cases with a kernel call's fixed cost per rank with tokens (c_call), and
        // independently half with the copies' staging per byte (c_replica)
        let cost = CostModel {
            c_call: [0.0, 3e-6][(seed % 2) as usize],
            c_replica: [0.0, 2e-12][((seed / 2) % 2) as usize],
            ..CostModel::for_tests(case.layers)
        };
        for which in ["hot_n", "relibra", "routepack"] {
            let (base, replicas) = run(&case, which, 2);
            let (g_n, m_n, l_n) = (case.topo.num_groups(), base.num_micro, case.layers);
            let buckets = bucket_replicas(&replicas, g_n, m_n, l_n);
            let bad = plan_exchanges(&w, &case.topo, &cost, &case.placement, &base.sample_rank, &base.sample_micro, base.num_micro, None,
                || (ExchangeState::new(), ExchangePricer::new(case.topo.ep, case.experts)),
                |c: &Exchange, (st, pricer)| {
                    let reps = &buckets[(c.group * m_n + c.micro) * l_n + c.layer];
                    let exact = pricer.price(c.topo, c.cost, c.origin, c.attn_max, c.slot_off, c.slots, reps).total();
                    st.reset(c);
                    let mut by_e: Vec<Vec<super::state::ReplicaShare>> = vec![Vec::new(); c.num_experts()];
                    for r in reps {
                        by_e[r.expert as usize].push(super::state::ReplicaShare { dst: r.dst_rank as usize, src: r.src_rank as usize, n: 0, share: r.share });
                    }
                    for (e, replicas) in by_e.into_iter().enumerate() {
                        if !replicas.is_empty() { st.set_replicas(c, e, replicas); }
                    }
                    let inc = st.time(c);
                    if (inc - exact).abs() > 1e-12 * exact.max(1e-30) { vec![c.replica(0, 0, 0, inc as f32)] } else { Vec::new() }
                }).unwrap();
            prop_assert!(bad.is_empty(), "{which}: {} exchanges differ", bad.len());
        }
    }
}

#[test]
fn hot_n_keeps_hot_tokens_local_and_shrinks_the_all_to_all() {
    let case = Case::new(7, 0);
    let case = Case { placement: static_placement(case.layers, case.experts, &case.topo).unwrap(), ..case };
    let w = case.window();
    let cost = CostModel::for_tests(case.layers);
    let (base, replicas) = run(&case, "hot_n", 2);
    assert!(!replicas.is_empty());
    let (g_n, m_n, l_n) = (case.topo.num_groups(), base.num_micro, case.layers);
    let buckets = bucket_replicas(&replicas, g_n, m_n, l_n);
    plan_exchanges(
        &w,
        &case.topo,
        &cost,
        &case.placement,
        &base.sample_rank,
        &base.sample_micro,
        base.num_micro,
        None,
        || ExchangePricer::new(case.topo.ep, case.experts),
        |c: &Exchange, pricer| {
            let reps = &buckets[(c.group * m_n + c.micro) * l_n + c.layer];
            let mut hot: Vec<i32> = reps.iter().map(|r| r.expert).collect();
            hot.dedup();
            assert!(hot.len() <= hot_n::DEFAULT_HOT_EXPERTS);
            for &e in &hot {
                let e = e as usize;
                // a copy on every other rank, each computing exactly its own tokens
                assert_eq!(reps.iter().filter(|r| r.expert as usize == e).count(), c.ep() - 1);
                let col: Vec<i64> = (0..c.ep()).map(|r| c.origin_of(r, e)).collect();
                let args: Vec<(usize, f32)> =
                    reps.iter().filter(|r| r.expert as usize == e).map(|r| (r.dst_rank as usize, r.share)).collect();
                let mut scratch = Vec::new();
                route_expert(&col, c.expert_slots(e), &args, c.topo, &mut scratch, |o, p, _, n| {
                    assert_eq!(o, p, "expert {e}: {n} tokens of rank {o} computed on {p}");
                });
            }
            let with = pricer.price(c.topo, c.cost, c.origin, c.attn_max, c.slot_off, c.slots, reps);
            let none = pricer.price(c.topo, c.cost, c.origin, c.attn_max, c.slot_off, c.slots, &[]);
            assert!(with.all_to_all <= none.all_to_all, "{} > {}", with.all_to_all, none.all_to_all);
            Vec::new()
        },
    )
    .unwrap();
}

#[test]
fn hot_n_follows_mindspeeds_counting_rule() {
    // ep 4, one expert per slot, experts 0-3 on ranks 0-3 (one each)
    let topo = Topology::new(4, 4, 4, 1).unwrap();
    let cost = CostModel::for_tests(1);
    // origin[r][e]: rank 0 hosts expert 0 with 40 tokens, rank 1 expert 1 with 35...
    let origin: Vec<i64> = vec![
        10, 5, 1, 1, //
        10, 10, 1, 1, //
        10, 10, 1, 8, //
        10, 10, 1, 8, //
    ];
    let slot_off = vec![0, 1, 2, 3, 4];
    let slots = vec![0, 1, 2, 3];
    let c = Exchange {
        group: 0,
        micro: 0,
        layer: 0,
        topo: &topo,
        cost: &cost,
        origin: &origin,
        attn_max: 1.0,
        slot_off: &slot_off,
        slots: &slots,
    };
    let mut st = ExchangeState::new();
    let replicas = super::hot_n::plan_exchange(&c, &mut st, 2);
    // loads [40, 35, 4, 18] → rank 0's expert 0 is hot; each rank computes its own tokens
    // of it: [10, 45, 14, 28] → rank 1's expert 1 is hot: [15, 20, 24, 38]
    let hot: Vec<i32> = replicas.iter().map(|r| r.expert).collect();
    assert_eq!(hot, vec![0, 0, 0, 1, 1, 1]);
    assert_eq!(st.tok, vec![15, 20, 24, 38]);
    assert_eq!(replicas.iter().map(|r| r.dst_rank).collect::<Vec<_>>(), vec![1, 2, 3, 0, 2, 3]);
}

#[test]
fn relibra_stays_inside_nodes_and_levels_them() {
    for seed in 0..6 {
        let case = Case::new(seed, 1); // ep 8 over nodes of 4
        let w = case.window();
        let cost = CostModel::for_tests(case.layers);
        let (base, replicas) = run(&case, "relibra", 2);
        for r in &replicas {
            assert_eq!(case.topo.local_node_of(r.src_rank as usize), case.topo.local_node_of(r.dst_rank as usize), "{r:?}");
        }
        let (g_n, m_n, l_n) = (case.topo.num_groups(), base.num_micro, case.layers);
        let buckets = bucket_replicas(&replicas, g_n, m_n, l_n);
        plan_exchanges(
            &w,
            &case.topo,
            &cost,
            &case.placement,
            &base.sample_rank,
            &base.sample_micro,
            base.num_micro,
            None,
            ExchangeState::new,
            |c: &Exchange, st| {
                st.reset(c);
                let before = st.tok.clone();
                let reps = &buckets[(c.group * m_n + c.micro) * l_n + c.layer];
                for e in 0..c.num_experts() {
                    let rs: Vec<_> = reps
                        .iter()
                        .filter(|r| r.expert as usize == e)
                        .map(|r| super::state::ReplicaShare { dst: r.dst_rank as usize, src: r.src_rank as usize, n: 0, share: r.share })
                        .collect();
                    if !rs.is_empty() {
                        st.set_replicas(c, e, rs);
                    }
                }
                let rpn = c.topo.ranks_per_group_node();
                for n in 0..c.ep() / rpn {
                    let mx = |v: &[i64]| v[n * rpn..(n + 1) * rpn].iter().copied().max().unwrap();
                    assert!(mx(&st.tok) <= mx(&before), "node {n}: {:?} -> {:?}", before, st.tok);
                }
                Vec::new()
            },
        )
        .unwrap();
    }
}

#[test]
fn plans_are_identical_across_thread_counts() {
    let case = Case::new(11, 1);
    let pool = |n| rayon::ThreadPoolBuilder::new().num_threads(n).build().unwrap();
    for which in ["hot_n", "relibra", "routepack"] {
        let a = pool(1).install(|| run(&case, which, 2).1);
        let b = pool(3).install(|| run(&case, which, 2).1);
        assert_eq!(a, b, "{which}");
    }
}

#[test]
fn routepack_uses_replication_when_it_pays() {
    // with copies cheap next to the expert work they move, routepack must use them
    let mut gains = 0;
    for seed in 0..8 {
        let case = Case::new(seed, 0);
        let w = case.window();
        let cost = CostModel { expert_weight_bytes: 1e4, expert_grad_bytes: 2e4, ..CostModel::for_tests(case.layers) };
        let base = case.plan(Vec::new());
        let packed = Packed { sample_rank: &base.sample_rank, sample_micro: &base.sample_micro, num_micro: base.num_micro };
        let replicas = routepack(&w, &case.topo, &cost, &case.placement, packed, &routepack::Options::default()).unwrap();
        let mut plan = base.clone();
        let none = simulate(&plan, &w, &case.topo, &cost, None).unwrap().step_time;
        plan.replicas = replicas;
        let with = simulate(&plan, &w, &case.topo, &cost, None).unwrap().step_time;
        gains += usize::from(with < none * 0.999);
    }
    assert!(gains >= 4, "routepack replication helped on only {gains} of 8 windows");
}

#[test]
fn bad_arguments_are_named() {
    let case = Case::new(1, 0);
    let base = case.plan(Vec::new());
    let w = case.window();
    let cost = CostModel::for_tests(case.layers);
    let packed = Packed { sample_rank: &base.sample_rank, sample_micro: &base.sample_micro, num_micro: base.num_micro };
    let e = hot_n(&w, &case.topo, &cost, &case.placement, packed, 0).unwrap_err();
    assert!(e.to_string().contains("hot_experts"), "{e}");
    let bad_rank = vec![99; base.sample_rank.len()];
    let packed = Packed { sample_rank: &bad_rank, ..packed };
    let e = relibra(&w, &case.topo, &cost, &case.placement, packed, 2).unwrap_err();
    assert!(e.to_string().contains("DP rank 99"), "{e}");
}

/// routepack's replication past its deadline plans no exchange (valid, and no replicas);
/// a budget too long to end (31 years) gives the plan of no budget.
#[test]
fn a_spent_budget_plans_no_exchange() {
    use std::time::Duration;
    for seed in 0..4 {
        let case = Case::new(seed, seed as usize);
        let base = case.plan(Vec::new());
        let w = case.window();
        let cost = CostModel::for_tests(case.layers);
        let packed = Packed { sample_rank: &base.sample_rank, sample_micro: &base.sample_micro, num_micro: base.num_micro };
        let spent = routepack::Options { time_budget: Some(Duration::ZERO), ..Default::default() };
        assert!(routepack(&w, &case.topo, &cost, &case.placement, packed, &spent).unwrap().is_empty());
        let long = routepack::Options { time_budget: Some(Duration::from_secs(1_000_000_000)), ..Default::default() };
        let replicas = routepack(&w, &case.topo, &cost, &case.placement, packed, &long).unwrap();
        assert_eq!(replicas, routepack(&w, &case.topo, &cost, &case.placement, packed, &Default::default()).unwrap());
        validate_plan(&case.plan(replicas), &w, &case.topo, case.cap).unwrap();
    }
}

/// A cost model with no per-token expert cost (`c_tok = 0`): levelling a rank with the busiest
/// host then asks for "all the tokens", which must saturate, not overflow; the plan stays valid.
#[test]
fn routepack_with_zero_token_cost() {
    for seed in 0..24u64 {
        let mut case = Case::new(seed, seed as usize);
        // experts without tokens leave their hosts idle, so ranks differ in expert time
        let e_n = case.experts;
        case.expert_tokens.iter_mut().enumerate().filter(|(i, _)| (i % e_n).is_multiple_of(3)).for_each(|(_, t)| *t = 0);
        let w = case.window();
        let cost = CostModel { c_tok: 0.0, c_exp: 1e-9, token_bytes: 1e6, ..CostModel::for_tests(case.layers) };
        let mut plan = case.plan(Vec::new());
        let packed = Packed { sample_rank: &plan.sample_rank, sample_micro: &plan.sample_micro, num_micro: plan.num_micro };
        let opts = routepack::Options { replication_slots: 1 + seed as usize % 3, ..Default::default() };
        let replicas = routepack(&w, &case.topo, &cost, &case.placement, packed, &opts).unwrap();
        plan.replicas = replicas;
        validate_plan(&plan, &w, &case.topo, case.cap).unwrap();
    }
}
