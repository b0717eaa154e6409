//! Property tests of `oversize = "split"` (`routepack_core::split`): on random windows with
//! samples over the cap (up to cp × cap), every packing gives a plan `validate` accepts under
//! split and refuses under the other modes; each split sample sits alone at the first rank of a
//! CP group with the group's other cells at its microbatch empty; routepack's row certificate
//! is true against a brute-force minimum; and `simulate` scores every such plan at or above its
//! lower bound.

use proptest::prelude::*;
use routepack_core::oversize::Oversize;
use routepack_core::packing::cells::Cells;
use routepack_core::packing::kk::verl_kk_in;
use routepack_core::packing::routepack::{routepack_packing_in, Options};
use routepack_core::packing::sequential::sequential_in;
use routepack_core::packing::Packing;
use routepack_core::placement::static_placement;
use routepack_core::simulate::{simulate_in, Scoring};
use routepack_core::validate::validate_plan_in;
use routepack_core::{CostModel, Plan, Topology, WindowView};

const L: usize = 2;
const E: usize = 8;

/// (dp, ep, gpus_per_node, slots_per_rank, cp): CP groups inside a node and spanning two.
const TOPOS: [(usize, usize, usize, usize, usize); 4] = [(2, 2, 2, 4, 2), (4, 2, 2, 4, 2), (4, 4, 2, 2, 4), (8, 4, 4, 2, 2)];

#[derive(Clone, Debug)]
struct Case {
    lens: Vec<i64>,
    tok: Vec<i32>,
    cap: i64,
    topo: Topology,
}

/// Up to 9 samples within the cap and 1-3 over it (cap < n <= cp·cap), each routing 2 tokens
/// a token over experts by a per-sample hash.
fn case() -> impl Strategy<Value = Case> {
    (0..TOPOS.len(), 8i64..60, 1usize..4, 1usize..10, any::<u64>()).prop_flat_map(|(t, cap, over, within, seed)| {
        let (dp, ep, gpn, slots, cp) = TOPOS[t];
        let n = over + within.max(dp);
        prop::collection::vec(0u32..10_000, n).prop_map(move |raw| {
            let lens: Vec<i64> = raw
                .iter()
                .enumerate()
                .map(|(i, &x)| {
                    if i % (n / over) == 0 && i / (n / over) < over {
                        cap + 1 + (x as i64 % ((cp as i64 - 1) * cap))
                    } else {
                        1 + (x as i64 % cap)
                    }
                })
                .collect();
            let mut tok = vec![0i32; lens.len() * L * E];
            for (s, &n) in lens.iter().enumerate() {
                for l in 0..L {
                    let mut h = seed ^ ((s * 31 + l) as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                    for _ in 0..2 * n {
                        h ^= h << 13;
                        h ^= h >> 7;
                        h ^= h << 17;
                        tok[(s * L + l) * E + (h % E as u64) as usize] += 1;
                    }
                }
            }
            let topo = Topology::new(dp, ep, gpn, slots).unwrap().with_cp(cp).unwrap();
            Case { lens, tok, cap, topo }
        })
    })
}

fn plan_of(c: &Case, p: &Packing) -> Plan {
    Plan {
        placement: static_placement(L, E, &c.topo).unwrap(),
        sample_rank: p.sample_rank.clone(),
        sample_micro: p.sample_micro.clone(),
        num_micro: p.num_micro,
        replicas: vec![],
        migration: vec![],
    }
}

/// Every check a split plan must pass (see the module docs).
fn check(c: &Case, p: &Packing) -> Result<(), TestCaseError> {
    let w = WindowView::new(&c.lens, &c.tok, L, E).unwrap();
    let plan = plan_of(c, p);
    let v = validate_plan_in(&plan, &w, &c.topo, c.cap, Oversize::Split);
    prop_assert!(v.is_ok(), "{v:?}");
    for other in [Oversize::Refuse, Oversize::Alone] {
        prop_assert!(validate_plan_in(&plan, &w, &c.topo, c.cap, other).is_err());
    }
    let (cp, m_n) = (c.topo.cp, p.num_micro);
    let mut held = vec![0usize; c.topo.dp * m_n];
    for (s, &n) in c.lens.iter().enumerate() {
        let (d, m) = (p.sample_rank[s] as usize, p.sample_micro[s] as usize);
        held[d * m_n + m] += 1;
        if n > c.cap {
            prop_assert_eq!(d % cp, 0);
            for j in 1..cp {
                held[(d + j) * m_n + m] += 1;
            }
        }
    }
    for s in (0..c.lens.len()).filter(|&s| c.lens[s] > c.cap) {
        let (d, m) = (p.sample_rank[s] as usize, p.sample_micro[s] as usize);
        prop_assert!((0..cp).all(|j| held[(d + j) * m_n + m] == 1), "split sample {s} shares its cells: {p:?}");
    }
    prop_assert!(held.iter().all(|&h| h >= 1), "an empty cell: {p:?}");
    let cost = CostModel::for_tests(L);
    let r = simulate_in(
        &plan,
        &w,
        &c.topo,
        &cost,
        &Scoring { token_cap: Some(c.cap), plan_cap: Some(c.cap), oversize: Oversize::Split, ..Scoring::default() },
    )
    .unwrap();
    prop_assert!(r.lower_bound_time <= r.step_time * (1.0 + 1e-12), "bound {} > step {}", r.lower_bound_time, r.step_time);
    Ok(())
}

/// The fewest bins of capacity `cap` holding `items` (each <= cap), exhaustively.
fn min_bins(items: &[i64], cap: i64) -> usize {
    fn go(items: &[i64], i: usize, bins: &mut Vec<i64>, cap: i64, best: &mut usize) {
        if bins.len() >= *best {
            return;
        }
        if i == items.len() {
            *best = bins.len();
            return;
        }
        for b in 0..bins.len() {
            if bins[b] + items[i] <= cap {
                bins[b] += items[i];
                go(items, i + 1, bins, cap, best);
                bins[b] -= items[i];
            }
        }
        bins.push(items[i]);
        go(items, i + 1, bins, cap, best);
        bins.pop();
    }
    let mut best = items.len() + 1;
    go(items, 0, &mut Vec::new(), cap, &mut best);
    best.min(items.len())
}

/// The fewest rows of any valid split plan: cp full rows per split sample, the rest's fewest
/// bins, all a multiple of dp; None where the rest cannot fill the rows that leaves (every
/// row non-empty).
fn true_min_rows(c: &Case) -> Option<usize> {
    let (dp, cp) = (c.topo.dp, c.topo.cp);
    let rest: Vec<i64> = c.lens.iter().copied().filter(|&n| n <= c.cap).collect();
    let split = (c.lens.len() - rest.len()) * cp;
    let mut r = dp;
    while r < split + min_bins(&rest, c.cap) {
        r += dp;
    }
    (r - split <= rest.len()).then_some(r)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn every_packing_splits_validly(c in case(), seed in 0u64..4) {
        let cells = Cells::of(&c.topo, Oversize::Split);
        let Some(best) = true_min_rows(&c) else {
            // too few samples to fill the cells: every packing refuses
            prop_assert!(sequential_in(&c.lens, c.cap, &cells).is_err());
            prop_assert!(verl_kk_in(&c.lens, c.cap, &cells).is_err());
            return Ok(());
        };
        let (p, _) = sequential_in(&c.lens, c.cap, &cells).unwrap();
        check(&c, &p)?;
        let (p, _) = verl_kk_in(&c.lens, c.cap, &cells).unwrap();
        check(&c, &p)?;
        let w = WindowView::new(&c.lens, &c.tok, L, E).unwrap();
        let cost = CostModel::for_tests(L);
        let placement = static_placement(L, E, &c.topo).unwrap();
        let mut o = Options::default();
        o.anneal.moves = 2_000;
        o.anneal.steps = 4;
        o.anneal.seed = seed;
        let (p, rep) = routepack_packing_in(&w, &c.topo, &cost, &placement, c.cap, &o, Oversize::Split).unwrap();
        check(&c, &p)?;
        // the certificate is true: no valid split plan has fewer rows
        prop_assert_eq!(rep.rows.num_rows, c.topo.dp * p.num_micro);
        prop_assert!(rep.rows.num_rows >= best && rep.rows.certificate.lower_bound <= best, "{:?} vs {best}", rep.rows);
        if rep.rows.certificate.certified {
            prop_assert_eq!(rep.rows.num_rows, best);
        }
    }
}

#[test]
fn bad_splits_are_refused_by_name() {
    let topo = Topology::new(4, 2, 2, 4).unwrap().with_cp(2).unwrap();
    let lens = [12i64, 3, 4, 5, 6, 7, 2, 1];
    let tok = vec![1i32; lens.len() * L * E];
    let w = WindowView::new(&lens, &tok, L, E).unwrap();
    let cells = Cells::of(&topo, Oversize::Split);
    let (p, _) = sequential_in(&lens, 10, &cells).unwrap();
    let mut plan = Plan {
        placement: static_placement(L, E, &topo).unwrap(),
        sample_rank: p.sample_rank.clone(),
        sample_micro: p.sample_micro.clone(),
        num_micro: p.num_micro,
        replicas: vec![],
        migration: vec![],
    };
    validate_plan_in(&plan, &w, &topo, 10, Oversize::Split).unwrap();
    // longer than cp × cap, and cp = 1
    let e = sequential_in(&[25, 3, 4, 5, 6], 10, &cells).unwrap_err().to_string();
    assert!(e.contains("sample 0 has 25 tokens") && e.contains("topo.cp x token_cap = 2 x 10"), "{e}");
    let e = sequential_in(&lens, 10, &Cells::of(&Topology::new(4, 2, 2, 4).unwrap(), Oversize::Split)).unwrap_err().to_string();
    assert!(e.contains("topo.cp") && e.contains("got 1"), "{e}");
    // the split sample at an odd rank: named
    let (d, m) = (plan.sample_rank[0], plan.sample_micro[0]);
    let t = (0..lens.len()).find(|&s| plan.sample_rank[s] == d + 1 && plan.sample_micro[s] == m);
    assert!(t.is_none(), "the group's other cell is empty");
    let other = (1..lens.len()).find(|&s| plan.sample_rank[s] != d).unwrap();
    plan.sample_rank[other] = d + 1;
    plan.sample_micro[other] = m;
    let e = validate_plan_in(&plan, &w, &topo, 10, Oversize::Split).unwrap_err().to_string();
    assert!(e.contains("runs a piece of sample 0") || e.contains("is empty"), "{e}");
}
