//! Property tests of the per-microbatch exact balancers (`replication::moonep`,
//! `replication::ultraep`) on random windows, topologies (NVLink domains of one node, of a
//! rack, several per EP group) and layouts, on the static placement their presets run:
//!
//! * their plans validate (each copy's source hosts the expert, shares sum to at most 1, at most
//!   `replica_slots` distinct experts copied onto a rank per exchange) and copy inside an NVLink
//!   domain only;
//! * MoonEP with its `⌈E / ep⌉` buffers gives every rank of a domain exactly its share of the
//!   domain's tokens in every exchange (max − min <= 1);
//! * UltraEP never puts more than `redundant` replicas on a rank, each of at least
//!   `min_tokens` tokens, and never raises a domain's largest load.

mod common;

use common::{random_layout, window, Mix};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use routepack_core::cost::CostModel;
use routepack_core::flow::rank_tokens;
use routepack_core::placement::static_placement;
use routepack_core::plan::{Plan, ReplicaTiming};
use routepack_core::replication::{plan_block, Block, Packed, Planner};
use routepack_core::topology::Topology;
use routepack_core::validate::validate_plan;

/// (dp, ep, gpus_per_node, nvlink_domain, slots_per_rank): domains of one node, of several
/// nodes holding a whole EP group, and several domains per EP group.
fn topologies() -> impl Strategy<Value = Topology> {
    (prop::sample::select(vec![(2usize, 2usize, 2usize), (4, 2, 4), (4, 4, 2), (8, 2, 8), (8, 8, 2), (4, 4, 4)]), 1usize..=2, 1usize..=3)
        .prop_map(|((ep, gpn, domain), mult, spr)| {
            let domain = domain.max(gpn);
            Topology::new(ep * mult, ep, gpn, spr).unwrap().with_nvlink_domain(domain).unwrap().with_replica_slots(64).unwrap()
        })
}

#[test]
fn exact_balancers_keep_their_contracts() {
    let mut runner = TestRunner::new_with_rng(
        Config { cases: 150, failure_persistence: None, ..Config::default() },
        TestRng::deterministic_rng(RngAlgorithm::ChaCha),
    );
    let copies = std::cell::Cell::new([0usize; 2]);
    runner
        .run(&(topologies(), any::<u64>()), |(topo, seed): (Topology, u64)| {
            let mut mix = Mix(seed);
            let micro = 1 + mix.below(2);
            let samples = topo.dp * micro + mix.below(topo.dp + 3);
            let layers = 1 + mix.below(2);
            let experts = 1 + mix.below(topo.num_slots());
            let w = window(&mut mix, samples, layers, experts, 300);
            let view = w.view();
            let placement = static_placement(layers, experts, &topo).unwrap();
            let (rank, step) = random_layout(&mut mix, samples, topo.dp, micro);
            let packed = Packed { sample_rank: &rank, sample_micro: &step, num_micro: micro };
            let cost = CostModel::for_tests(layers);
            let base = Plan {
                placement: placement.clone(),
                sample_rank: rank.clone(),
                sample_micro: step.clone(),
                num_micro: micro,
                replicas: vec![],
                migration: vec![],
            };
            let before = rank_tokens(&base, &view, &topo).unwrap();
            let rpn = topo.ranks_per_group_node();
            let per_rank = experts.div_ceil(topo.ep);
            let (redundant, min_tokens) = (1 + mix.below(3), 1 + mix.below(40) as i64);
            for (i, planner) in [Planner::MoonEp(per_rank), Planner::UltraEp(redundant, min_tokens)].into_iter().enumerate() {
                prop_assert_eq!(planner.timing(), ReplicaTiming::AfterRouter);
                let replicas = plan_block(&view, &topo, &cost, &placement, packed, &planner, Block::ALL).unwrap();
                let mut seen = copies.get();
                seen[i] += replicas.len();
                copies.set(seen);
                for r in &replicas {
                    prop_assert_eq!(
                        topo.local_node_of(r.src_rank as usize),
                        topo.local_node_of(r.dst_rank as usize),
                        "a copy left its domain: {:?}",
                        r
                    );
                }
                let plan = Plan { replicas: replicas.clone(), ..base.clone() };
                validate_plan(&plan, &view, &topo, i64::MAX).unwrap();
                let after = rank_tokens(&plan, &view, &topo).unwrap();
                for (x, (a, b)) in after.chunks(topo.ep).zip(before.chunks(topo.ep)).enumerate() {
                    for d in 0..topo.ep / rpn {
                        let (a, b) = (&a[d * rpn..(d + 1) * rpn], &b[d * rpn..(d + 1) * rpn]);
                        let (amax, amin, bmax) = (*a.iter().max().unwrap(), *a.iter().min().unwrap(), *b.iter().max().unwrap());
                        prop_assert!(amax <= bmax, "exchange {x} domain {d}: {a:?} from {b:?}");
                        if let Planner::MoonEp(_) = planner {
                            prop_assert!(amax - amin <= 1, "MoonEP left exchange {x} domain {d} at {a:?} (from {b:?})");
                        }
                    }
                }
                if let Planner::UltraEp(r, _) = planner {
                    let (l_n, m_n) = (layers, micro);
                    for g in 0..topo.num_groups() {
                        for m in 0..m_n {
                            for l in 0..l_n {
                                let rows: Vec<_> = replicas
                                    .iter()
                                    .filter(|x| x.group as usize == g && x.micro as usize == m && x.layer as usize == l)
                                    .collect();
                                for p in 0..topo.ep {
                                    prop_assert!(rows.iter().filter(|x| x.dst_rank as usize == p).count() <= r);
                                }
                            }
                        }
                    }
                }
            }
            Ok(())
        })
        .unwrap();
    // not vacuous: both planners copied experts
    assert!(copies.get().iter().all(|&n| n > 200), "copies made: {:?}", copies.get());
}
