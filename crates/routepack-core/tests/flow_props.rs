//! Property tests of `flow`: `route_expert` follows its documented rule (replicas take
//! round(share·T) in table order, locality-first; the rest fills the quotas of an even split
//! with a rotating remainder, own rank → own node → other nodes, drawing in proportion);
//! `route_exchange` and `rank_tokens` give the per-rank loads `simulate` prices
//! (same imbalance, bit for bit), and tokens are conserved.

mod common;

use common::{topologies, Mix};
use proptest::prelude::*;
use rand::{RngExt, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use routepack_core::cost::CostModel;
use routepack_core::flow::{check_exchange, rank_tokens, route_exchange, route_expert, Dest, ExchangeReplica};
use routepack_core::placement::Placement;
use routepack_core::plan::{cell_members, Plan, Replica};
use routepack_core::simulate::simulate;
use routepack_core::topology::Topology;
use routepack_core::window::WindowView;

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn route_expert_follows_its_rule(topo in topologies(), seed in any::<u64>()) {
        let mut mix = Mix(seed);
        let ep = topo.ep;
        let origin: Vec<i64> = (0..ep).map(|_| if mix.unit() < 0.3 { 0 } else { mix.below(40) as i64 }).collect();
        // 1..=3 slots, ascending, possibly two on one rank
        let mut slots: Vec<usize> = (0..topo.num_slots()).collect();
        mix.shuffle(&mut slots);
        slots.truncate(1 + mix.below(3.min(topo.num_slots())));
        slots.sort_unstable();
        let mut reps: Vec<(usize, f32)> = Vec::new();
        let mut left = 1.0f64;
        for _ in 0..mix.below(4) {
            let share = [0.5, 0.25, left, left * mix.unit(), 0.0][mix.below(5)].min(left) as f32;
            left = (left - share as f64).max(0.0);
            reps.push((mix.below(ep), share));
        }
        let mut flows = Vec::new();
        let mut scratch = Vec::new();
        route_expert(&origin, &slots, &reps, &topo, &mut scratch, |o, p, d, n| flows.push((o, p, d, n)));

        let total: i64 = origin.iter().sum();
        prop_assert_eq!(flows.iter().map(|f| f.3).sum::<i64>(), total);
        prop_assert!(flows.iter().all(|f| f.3 > 0));
        // replay the flows in emission order against the rule
        let mut rem = origin.clone();
        let mut taken_total = 0i64;
        for (row, &(dst, share)) in reps.iter().enumerate() {
            let want = ((share as f64) * (total as f64)).round() as i64;
            let need = want.clamp(0, total - taken_total);
            let mine: Vec<_> = flows.iter().filter(|f| f.2 == Dest::Replica { rank: dst, index: row }).collect();
            prop_assert_eq!(mine.iter().map(|f| f.3).sum::<i64>(), need, "row {} share {}", row, share);
            prop_assert!(mine.iter().all(|f| f.1 == dst));
            // origins in order: dst itself, its node ascending, the others ascending; each drained before the next
            let node = topo.local_node_of(dst);
            let order: Vec<usize> = std::iter::once(dst)
                .chain((0..ep).filter(|&r| r != dst && topo.local_node_of(r) == node))
                .chain((0..ep).filter(|&r| topo.local_node_of(r) != node))
                .collect();
            let mut pos = 0usize;
            for (k, f) in mine.iter().enumerate() {
                let at = order.iter().position(|&r| r == f.0).unwrap();
                prop_assert!(at >= pos, "row {} drew from rank {} out of order", row, f.0);
                for &skipped in &order[pos..at] {
                    prop_assert_eq!(rem[skipped], 0, "row {} skipped rank {} that still had tokens", row, skipped);
                }
                prop_assert!(rem[f.0] >= f.3);
                rem[f.0] -= f.3;
                if k + 1 < mine.len() {
                    prop_assert_eq!(rem[f.0], 0);
                }
                pos = at + 1;
            }
            taken_total += need;
        }
        // the rest: quotas of an even split with a remainder that rotates with the origin,
        // fed own rank → own node → other nodes
        let c = slots.len() as i64;
        let node = |r: usize| topo.local_node_of(r);
        let quota: Vec<i64> = (0..slots.len())
            .map(|j| rem.iter().enumerate().map(|(r, &x)| x / c + i64::from((j as i64 - r as i64).rem_euclid(c) < x % c)).sum())
            .collect();
        let to_slots: Vec<_> = flows.iter().filter(|f| matches!(f.2, Dest::Slot(_))).copied().collect();
        for (j, &p) in slots.iter().enumerate() {
            // every copy's load is that of the even split
            let got: i64 = to_slots.iter().filter(|f| f.2 == Dest::Slot(p)).map(|f| f.3).sum();
            prop_assert_eq!(got, quota[j], "slot {}", p);
            prop_assert!(to_slots.iter().filter(|f| f.2 == Dest::Slot(p)).all(|f| f.1 == topo.rank_of_slot(p)));
        }
        for (r, &left) in rem.iter().enumerate() {
            prop_assert_eq!(to_slots.iter().filter(|f| f.0 == r).map(|f| f.3).sum::<i64>(), left, "origin {}", r);
        }
        // the flows, in emission order, are those of the three passes
        let mut expect = Vec::new();
        if slots.len() == 1 {
            for (r, &left) in rem.iter().enumerate() {
                if left > 0 {
                    expect.push((r, topo.rank_of_slot(slots[0]), Dest::Slot(slots[0]), left));
                }
            }
        } else {
            // the rule, written out plainly: per node, what leaves (shared by its ranks in
            // proportion to their tokens) or comes in (shared by its slots in proportion to
            // their quotas); across nodes each slot draws its inflow from every outflow in
            // proportion; inside nodes own rank first, then the node's ranks in proportion
            let (mut q, mut left) = (quota.clone(), rem.clone());
            let mut out = vec![0i64; ep];
            let mut inflow = vec![0i64; slots.len()];
            let slot_node = |j: usize| node(topo.rank_of_slot(slots[j]));
            for n in 0..topo.nodes_per_group() {
                let ranks: Vec<usize> = (0..ep).filter(|&r| node(r) == n).collect();
                let js: Vec<usize> = (0..slots.len()).filter(|&j| slot_node(j) == n).collect();
                let supply: i64 = ranks.iter().map(|&r| left[r]).sum();
                let demand: i64 = js.iter().map(|&j| q[j]).sum();
                if supply > demand {
                    for (r, k) in apportioned(supply - demand, &ranks.iter().map(|&r| left[r]).collect::<Vec<_>>()).into_iter().enumerate() {
                        out[ranks[r]] = k;
                    }
                } else if demand > supply {
                    for (i, k) in apportioned(demand - supply, &js.iter().map(|&j| q[j]).collect::<Vec<_>>()).into_iter().enumerate() {
                        inflow[js[i]] = k;
                    }
                }
            }
            for (j, &p) in slots.iter().enumerate() {
                let dst = topo.rank_of_slot(p);
                if inflow[j] == 0 {
                    continue;
                }
                for (r, k) in apportioned(inflow[j], &out).into_iter().enumerate() {
                    if k > 0 {
                        out[r] -= k;
                        left[r] -= k;
                        expect.push((r, dst, Dest::Slot(p), k));
                    }
                }
                q[j] -= inflow[j];
            }
            prop_assert!(out.iter().all(|&x| x == 0));
            for (j, &p) in slots.iter().enumerate() {
                let dst = topo.rank_of_slot(p);
                let n = left[dst].min(q[j]);
                if n > 0 {
                    left[dst] -= n;
                    q[j] -= n;
                    expect.push((dst, dst, Dest::Slot(p), n));
                }
            }
            for (j, &p) in slots.iter().enumerate() {
                let dst = topo.rank_of_slot(p);
                if q[j] == 0 {
                    continue;
                }
                let mates: Vec<usize> = (0..ep).filter(|&r| node(r) == node(dst)).collect();
                for (i, k) in apportioned(q[j], &mates.iter().map(|&r| left[r]).collect::<Vec<_>>()).into_iter().enumerate() {
                    if k > 0 {
                        left[mates[i]] -= k;
                        expect.push((mates[i], dst, Dest::Slot(p), k));
                    }
                }
                q[j] = 0;
            }
            prop_assert!(left.iter().all(|&x| x == 0));
        }
        prop_assert_eq!(&to_slots, &expect);
        // each node keeps min(its tokens, its slots' quotas) inside itself: the most any
        // feeding of these quotas can
        for n in 0..topo.nodes_per_group() {
            let supply: i64 = (0..ep).filter(|&r| node(r) == n).map(|r| rem[r]).sum();
            let demand: i64 = slots.iter().zip(&quota).filter(|(&p, _)| node(topo.rank_of_slot(p)) == n).map(|(_, &q)| q).sum();
            let local: i64 = to_slots.iter().filter(|f| node(f.0) == n && node(f.1) == n).map(|f| f.3).sum();
            prop_assert_eq!(local, supply.min(demand), "node {}", n);
        }
    }
}

/// `need` (≤ Σ weights) shared in proportion to `weights`: floors first, then one more to
/// each of the first entries whose share had a fraction until `need` is met.
fn apportioned(need: i64, weights: &[i64]) -> Vec<i64> {
    let total: i64 = weights.iter().sum();
    assert!(need <= total);
    let mut shares: Vec<(i64, bool)> = weights.iter().map(|&w| (need * w / total, (need * w) % total != 0)).collect();
    let mut over = need - shares.iter().map(|s| s.0).sum::<i64>();
    for s in shares.iter_mut() {
        if s.1 && over > 0 {
            s.0 += 1;
            over -= 1;
        }
    }
    assert_eq!(over, 0);
    shares.into_iter().map(|s| s.0).collect()
}

// ------------------ route_exchange and rank_tokens against the simulator

/// A random valid plan on a random window: redundant placement slots, every cell
/// non-empty, replicas from a hosting rank with shares summing to at most 1.
fn random_case(seed: u64) -> (Topology, Vec<i64>, Vec<i32>, usize, usize, Plan) {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let (l_n, e_n, m_n) = (2usize, 9usize, 2usize);
    // a buffer for every expert: the replicas below copy any of them to any rank
    let topo = Topology::new(8, 4, 2, 3).unwrap().with_replica_slots(e_n).unwrap();
    let s_n = topo.dp * m_n + rng.random_range(0..6usize);
    let lens: Vec<i64> = (0..s_n).map(|_| rng.random_range(1..20i64)).collect();
    let mut et = vec![0i32; s_n * l_n * e_n];
    for s in 0..s_n {
        for l in 0..l_n {
            for _ in 0..2 * lens[s] {
                et[(s * l_n + l) * e_n + rng.random_range(0..e_n)] += 1;
            }
        }
    }
    let mut phy = Vec::new();
    for _ in 0..l_n {
        let mut layer: Vec<i32> = (0..e_n as i32).collect();
        while layer.len() < topo.num_slots() {
            layer.push(if rng.random_bool(0.3) { -1 } else { rng.random_range(0..e_n as i32) });
        }
        for i in (1..layer.len()).rev() {
            layer.swap(i, rng.random_range(0..=i));
        }
        phy.extend(layer);
    }
    let placement = Placement::new(phy, l_n, e_n, topo.slots_per_rank).unwrap();
    let sample_rank: Vec<i32> =
        (0..s_n).map(|s| if s < topo.dp * m_n { (s % topo.dp) as i32 } else { rng.random_range(0..topo.dp as i32) }).collect();
    let sample_micro: Vec<i32> =
        (0..s_n).map(|s| if s < topo.dp * m_n { (s / topo.dp) as i32 } else { rng.random_range(0..m_n as i32) }).collect();
    let mut replicas = Vec::new();
    for g in 0..topo.num_groups() {
        for m in 0..m_n {
            for l in 0..l_n {
                for e in 0..e_n {
                    if !rng.random_bool(0.3) {
                        continue;
                    }
                    let layer = placement.layer(l);
                    let src = layer.iter().position(|&x| x == e as i32).unwrap() / topo.slots_per_rank;
                    let mut left = 1.0f32;
                    for dst in 0..topo.ep {
                        if dst == src || !rng.random_bool(0.5) {
                            continue;
                        }
                        let share = (rng.random_range(0.0..0.6f32)).min(left);
                        left -= share;
                        replicas.push(Replica {
                            micro: m as i32,
                            group: g as i32,
                            layer: l as i32,
                            expert: e as i32,
                            src_rank: src as i32,
                            dst_rank: dst as i32,
                            share,
                        });
                    }
                }
            }
        }
    }
    let plan = Plan { placement, sample_rank, sample_micro, num_micro: m_n, replicas, migration: Vec::new() };
    (topo, lens, et, l_n, e_n, plan)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn rank_tokens_are_what_simulate_prices(seed in any::<u64>()) {
        let (topo, lens, et, l_n, e_n, plan) = random_case(seed);
        let w = WindowView::new(&lens, &et, l_n, e_n).unwrap();
        let tokens = rank_tokens(&plan, &w, &topo).unwrap();
        let rep = simulate(&plan, &w, &topo, &CostModel::for_tests(l_n), None).unwrap();
        let ep = topo.ep;
        prop_assert_eq!(tokens.len(), rep.imbalance.len() * ep);
        let (off, members) = cell_members(&plan.sample_rank, &plan.sample_micro, topo.dp, plan.num_micro);
        for (c, per_rank) in tokens.chunks(ep).enumerate() {
            let total: i64 = per_rank.iter().sum();
            // the same expression as the simulator's imbalance
            let imb = if total > 0 { *per_rank.iter().max().unwrap() as f64 * ep as f64 / total as f64 } else { 1.0 };
            prop_assert_eq!(imb.to_bits(), rep.imbalance[c].to_bits());
            // conservation: every routed token of the cell's samples lands somewhere
            let (gm, l) = (c / l_n, c % l_n);
            let (g, m) = (gm / plan.num_micro, gm % plan.num_micro);
            let want: i64 = (0..ep)
                .flat_map(|r| members[off[(g * ep + r) * plan.num_micro + m]..off[(g * ep + r) * plan.num_micro + m + 1]].iter())
                .map(|&s| w.tokens(s, l).sum())
                .sum();
            prop_assert_eq!(total, want);
        }
    }

    #[test]
    fn route_exchange_conserves_each_origin(seed in any::<u64>()) {
        let (topo, _, _, _, e_n, plan) = random_case(seed);
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed ^ 0x5eed);
        let origin: Vec<i64> = (0..topo.ep * e_n).map(|_| rng.random_range(0..7i64)).collect();
        let (so, sl) = plan.placement.replicas_of_layer(0);
        let reps: Vec<ExchangeReplica> = plan.replicas.iter().filter(|r| r.layer == 0 && r.micro == 0 && r.group == 0)
            .map(|r| (r.expert as usize, r.dst_rank as usize, r.share)).collect();
        check_exchange(&origin, e_n, &so, &reps, &topo).unwrap();
        let mut flows = Vec::new();
        route_exchange(&origin, e_n, &so, &sl, &reps, &topo, &mut flows);
        let mut got = vec![0i64; topo.ep * e_n];
        let mut last_e = 0;
        for f in &flows {
            prop_assert!(f.count > 0);
            prop_assert!(f.expert >= last_e, "experts ascending");
            last_e = f.expert;
            got[f.origin * e_n + f.expert] += f.count;
            match f.dest {
                Dest::Slot(p) => {
                    prop_assert_eq!(plan.placement.layer(0)[p], f.expert as i32);
                    prop_assert_eq!(topo.rank_of_slot(p), f.dst_rank);
                }
                Dest::Replica { rank, index: row } => {
                    prop_assert_eq!(reps[row].0, f.expert);
                    prop_assert_eq!(reps[row].1, rank);
                    prop_assert_eq!(rank, f.dst_rank);
                }
            }
        }
        prop_assert_eq!(got, origin);
    }
}

#[test]
fn check_exchange_names_the_bad_argument() {
    let topo = Topology::new(4, 4, 2, 2).unwrap();
    let p = Placement::new(vec![0, 1, 2, 3, -1, -1, -1, -1], 1, 4, 2).unwrap();
    let (so, _) = p.replicas_of_layer(0);
    let origin = vec![1i64; 16];
    assert!(check_exchange(&origin[..15], 4, &so, &[], &topo).unwrap_err().to_string().contains("origin"));
    let e = check_exchange(&origin, 4, &so, &[(1, 3, 1.5)], &topo).unwrap_err();
    assert!(e.to_string().contains("share 1.5"), "{e}");
    let e = check_exchange(&origin, 4, &so, &[(1, 4, 0.5)], &topo).unwrap_err();
    assert!(e.to_string().contains("dst_rank"), "{e}");
    let mut neg = origin.clone();
    neg[5] = -2;
    assert!(check_exchange(&neg, 4, &so, &[], &topo).unwrap_err().to_string().contains("rank 1, expert 1"));
}
