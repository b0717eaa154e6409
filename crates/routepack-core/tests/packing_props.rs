//! Property tests of packing and layout on random windows: no row over the cap (lengths near
//! the cap included), every invariant `validate_plan` checks, row certificates, and
//! thread-count determinism of the annealed layout.

use proptest::prelude::*;
use routepack_core::error::Error;
use routepack_core::packing::kk::verl_kk;
use routepack_core::packing::routepack::{routepack_packing, Options};
use routepack_core::packing::rows::certified::certified_rows;
use routepack_core::packing::rows::heuristics::row_tokens;
use routepack_core::packing::sequential::sequential;
use routepack_core::packing::Packing;
use routepack_core::placement::static_placement;
use routepack_core::validate::validate_plan;
use routepack_core::{CostModel, Plan, Topology, WindowView};

const L: usize = 2;
const E: usize = 8;

/// (dp, ep, gpus_per_node, slots_per_rank): one group inside a node, groups spanning nodes,
/// several groups.
const TOPOS: [(usize, usize, usize, usize); 4] = [(2, 2, 2, 4), (4, 2, 2, 4), (4, 4, 2, 2), (8, 4, 2, 3)];

#[derive(Clone, Debug)]
struct Case {
    lens: Vec<i64>,
    tok: Vec<i32>,
    cap: i64,
    topo: Topology,
}

/// Lengths are either within 3 tokens of the cap or anywhere in [1, cap]; expert demand is
/// 2 tokens per token, spread over experts by a per-sample hash (so demand is skewed).
fn case() -> impl Strategy<Value = Case> {
    (0..TOPOS.len(), 20i64..400, 1usize..5, any::<u64>()).prop_flat_map(|(t, cap, per_rank, seed)| {
        let (dp, ep, gpn, slots) = TOPOS[t];
        let n = dp * per_rank + (seed % dp as u64) as usize;
        prop::collection::vec((any::<bool>(), 0u32..10_000), n).prop_map(move |raw| {
            let lens: Vec<i64> = raw.iter().map(|&(near, x)| if near { cap - (x % 4) as i64 } else { 1 + (x as i64 % cap) }).collect();
            let mut tok = vec![0i32; lens.len() * L * E];
            for (s, &n) in lens.iter().enumerate() {
                for l in 0..L {
                    let mut h = seed ^ ((s * 31 + l) as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                    for _ in 0..2 * n {
                        h ^= h << 13;
                        h ^= h >> 7;
                        h ^= h << 17;
                        // squares skew the choice towards high expert ids
                        let e = ((h % (E * E) as u64) as f64).sqrt() as usize;
                        tok[(s * L + l) * E + e] += 1;
                    }
                }
            }
            Case { lens, tok, cap, topo: Topology::new(dp, ep, gpn, slots).unwrap() }
        })
    })
}

fn opts(seed: u64) -> Options {
    let mut o = Options::default();
    o.anneal.moves = 3_000;
    o.anneal.chains = 2;
    o.anneal.steps = 4;
    o.anneal.seed = seed;
    o
}

fn check(c: &Case, p: &Packing) -> Result<(), TestCaseError> {
    let w = WindowView::new(&c.lens, &c.tok, L, E).unwrap();
    let plan = Plan {
        placement: static_placement(L, E, &c.topo).unwrap(),
        sample_rank: p.sample_rank.clone(),
        sample_micro: p.sample_micro.clone(),
        num_micro: p.num_micro,
        replicas: vec![],
        migration: vec![],
    };
    prop_assert!(validate_plan(&plan, &w, &c.topo, c.cap).is_ok(), "{:?}", validate_plan(&plan, &w, &c.topo, c.cap));
    Ok(())
}

/// A packer may refuse a window only as infeasible (too few samples for its rows).
fn ok_or_infeasible(r: &Result<Packing, Error>) -> Result<(), TestCaseError> {
    if let Err(e) = r {
        prop_assert!(matches!(e, Error::Infeasible(_)), "unexpected error {e}");
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn no_row_over_the_cap_and_every_invariant(c in case()) {
        let w = WindowView::new(&c.lens, &c.tok, L, E).unwrap();
        let cost = CostModel::for_tests(L);
        let pl = static_placement(L, E, &c.topo).unwrap();
        let seq = sequential(&c.lens, c.cap, c.topo.dp);
        ok_or_infeasible(&seq)?;
        if let Ok(p) = &seq { check(&c, p)?; }
        let kk = verl_kk(&c.lens, c.cap, c.topo.dp).map(|x| x.0);
        ok_or_infeasible(&kk)?;
        if let Ok(p) = &kk { check(&c, p)?; }
        let rp = routepack_packing(&w, &c.topo, &cost, &pl, c.cap, &opts(1)).map(|x| x.0);
        ok_or_infeasible(&rp)?;
        if let Ok(p) = &rp {
            check(&c, p)?;
            // routepack uses the certified row count, never more rows than the heuristics'
            let rows = certified_rows(&c.lens, c.cap, c.topo.dp, 200_000, None).unwrap();
            prop_assert_eq!(p.num_micro * c.topo.dp, rows.rows.len());
        }
    }

    #[test]
    fn certified_rows_partition_and_bound(c in case()) {
        let step = c.topo.dp;
        match certified_rows(&c.lens, c.cap, step, 100_000, None) {
            Ok(r) => {
                let mut all: Vec<usize> = r.rows.concat();
                all.sort_unstable();
                prop_assert_eq!(all, (0..c.lens.len()).collect::<Vec<_>>());
                prop_assert!(r.rows.iter().all(|x| !x.is_empty() && row_tokens(x, &c.lens) <= c.cap as i128));
                prop_assert_eq!(r.rows.len() % step, 0);
                let c = &r.certificate;
                prop_assert!(c.l2 >= c.l1 && c.lower_bound >= c.l2 && r.rows.len() >= c.lower_bound);
                prop_assert_eq!(c.certified, r.rows.len() == c.lower_bound);
                prop_assert_eq!(c.gap, r.rows.len() - c.lower_bound);
            }
            Err(e) => prop_assert!(matches!(e, Error::Infeasible(_))),
        }
    }

    #[test]
    fn layout_is_the_same_on_one_and_two_threads(c in case(), seed in 0u64..1000) {
        let w = WindowView::new(&c.lens, &c.tok, L, E).unwrap();
        let cost = CostModel::for_tests(L);
        let pl = static_placement(L, E, &c.topo).unwrap();
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| routepack_packing(&w, &c.topo, &cost, &pl, c.cap, &opts(seed)).map(|x| (x.0, x.1.anneal.history)))
        };
        match (run(1), run(2)) {
            (Ok(a), Ok(b)) => prop_assert_eq!(a, b),
            (Err(a), Err(b)) => prop_assert_eq!(a, b),
            (a, b) => prop_assert!(false, "one thread: {:?}, two threads: {:?}", a.is_ok(), b.is_ok()),
        }
    }
}

#[test]
fn a_sample_longer_than_the_cap_is_named_by_every_packer() {
    let lens = vec![10i64, 30, 12, 9];
    let tok: Vec<i32> = lens.iter().flat_map(|&n| std::iter::repeat_n(0, L * E - 1).chain([2 * n as i32])).collect();
    let w = WindowView::new(&lens, &tok, L, E).unwrap();
    let topo = Topology::new(2, 2, 2, 4).unwrap();
    let pl = static_placement(L, E, &topo).unwrap();
    let errs = [
        sequential(&lens, 20, 2).unwrap_err(),
        verl_kk(&lens, 20, 2).unwrap_err(),
        routepack_packing(&w, &topo, &CostModel::for_tests(L), &pl, 20, &opts(0)).unwrap_err(),
    ];
    for e in errs {
        assert!(e.to_string().contains("sample 1 has 30 tokens"), "{e}");
    }
}
