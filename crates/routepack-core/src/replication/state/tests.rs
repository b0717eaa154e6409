//! Properties of the state's fast paths, on random windows and random moves: the direct load
//! of unreplicated one-slot experts equals `route_expert`'s part, cached moves price and apply
//! exactly as uncached ones, and the bounds never exceed the price and equal the full scan's.

use proptest::prelude::*;
use rand::{RngExt, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;

use super::bound::reference as bound_reference;
use super::{ExchangeState, Part};
use crate::cost::CostModel;
use crate::replication::exchange::{plan_exchanges, Exchange};
use crate::replication::test_case::Case;

/// Runs `check(exchange, state, twin, rng)` on every exchange of `case`'s sequential packing.
fn each_exchange(
    case: &Case,
    seed: u64,
    check: impl Fn(&Exchange, &mut ExchangeState, &mut ExchangeState, &mut Xoshiro256PlusPlus) + Sync,
) {
    let base = case.plan(Vec::new());
    let w = case.window();
    let cost = CostModel::for_tests(case.layers);
    plan_exchanges(
        &w,
        &case.topo,
        &cost,
        &case.placement,
        &base.sample_rank,
        &base.sample_micro,
        base.num_micro,
        None,
        || (ExchangeState::new(), ExchangeState::new()),
        |c: &Exchange, (st, twin)| {
            let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed ^ ((c.group * 1000 + c.micro) * 1000 + c.layer) as u64);
            check(c, st, twin, &mut rng);
            Vec::new()
        },
    )
    .unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn reset_loads_each_expert_as_route_expert_routes_it(seed in 0u64..1_000_000, shape in 0usize..4) {
        let case = Case::new(seed, shape);
        each_exchange(&case, seed, |c, st, _, _| {
            st.reset(c);
            let (ep, e_n) = (c.ep(), c.num_experts());
            let mut part = Part::new(ep);
            let (mut tok, mut active, mut links) = (vec![0i64; ep], vec![0i64; ep], vec![[0i64; 4]; ep]);
            for e in 0..e_n {
                st.part_into(c, e, &[], &mut part);
                assert_eq!(&st.etok[e * ep..(e + 1) * ep], &part.tok[..], "expert {e} tokens");
                assert_eq!(&st.elinks[e * ep..(e + 1) * ep], &part.links[..], "expert {e} links");
                for p in 0..ep {
                    tok[p] += part.tok[p];
                    active[p] += i64::from(part.tok[p] > 0);
                    (0..4).for_each(|k| links[p][k] += part.links[p][k]);
                }
            }
            assert_eq!((&st.tok, &st.active, &st.links), (&tok, &active, &links));
        });
    }

    #[test]
    fn cached_moves_and_bounds_match_full_pricing(seed in 0u64..1_000_000, shape in 0usize..4) {
        let case = Case::new(seed, shape);
        each_exchange(&case, seed, |c, st, twin, rng| {
            st.reset(c);
            twin.reset(c);
            let (ep, e_n) = (c.ep(), c.num_experts());
            let rpn = c.topo.ranks_per_group_node();
            for _ in 0..40 {
                let e = rng.random_range(0..e_n);
                let total = st.total(e);
                let hosted: Vec<bool> = (0..ep).map(|r| c.hosts(e, r)).collect();
                let dsts: Vec<usize> = (0..ep).filter(|&r| !hosted[r]).collect();
                if total == 0 || dsts.is_empty() {
                    continue;
                }
                let dst = dsts[rng.random_range(0..dsts.len())];
                let existing = st.replicas[e].iter().find(|r| r.dst == dst).copied();
                let others: i64 = st.replicas[e].iter().filter(|r| r.dst != dst).map(|r| r.n).sum();
                if others >= total {
                    continue;
                }
                let n = rng.random_range(0..=total - others);
                let src = existing.map_or_else(|| c.source_for(e, dst), |r| r.src);
                let rep = st.make_replica(e, src, dst, n);
                let mut reps = st.replicas[e].clone();
                match reps.iter_mut().find(|r| r.dst == dst) {
                    Some(r) => *r = rep,
                    None => reps.push(rep),
                }
                let full = twin.try_replicas(c, e, &reps);
                let price = st.try_move(c, e, rep);
                assert_eq!(price.to_bits(), full.to_bits(), "cached price of {e} on {dst}");
                // again, from the cache when e has several slots
                assert_eq!(st.try_move(c, e, rep).to_bits(), full.to_bits());
                st.prepare_bound(c, e, &hosted);
                let lb = st.bound(c, dst, src, n, existing.is_none(), None, &hosted, rpn);
                assert!(lb <= price, "bound {lb} above price {price}");
                let full_lb = bound_reference::bound(st, c, e, &hosted, dst, src, n, existing.is_none(), None, rpn);
                assert_eq!(lb.to_bits(), full_lb.to_bits(), "lazy bound of {e} on {dst}");
                let node = dst / rpn;
                let node_tokens: i64 = st.origin(e)[node * rpn..((node + 1) * rpn).min(ep)].iter().sum();
                let mine = existing.map_or(0, |r| r.n);
                let alone = st.replicas[e].iter().all(|x| x.dst == dst) && c.expert_slots(e).len() == 1;
                if alone && n.max(mine) <= node_tokens {
                    let lb = st.bound(c, dst, src, n, existing.is_none(), Some(node), &hosted, rpn);
                    assert!(lb <= price, "local bound {lb} above price {price}");
                    let full_lb = bound_reference::bound(st, c, e, &hosted, dst, src, n, existing.is_none(), Some(node), rpn);
                    assert_eq!(lb.to_bits(), full_lb.to_bits(), "lazy local bound of {e} on {dst}");
                }
                if rng.random_range(0..2) == 0 {
                    st.apply_move(c, e, rep);
                    twin.set_replicas(c, e, reps);
                    assert_eq!((&st.tok, &st.active, &st.links, &st.hops), (&twin.tok, &twin.active, &twin.links, &twin.hops));
                    assert_eq!(st.time(c).to_bits(), twin.time(c).to_bits());
                }
            }
        });
    }
}
