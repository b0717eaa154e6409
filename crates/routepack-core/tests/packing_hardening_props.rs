//! Property tests of issue 13's packing classes, for every packer (`sequential`, `kk`,
//! routepack's) and `validate_plan`:
//!
//! * class 3: lengths near the i64 limit under caps up to 2^63 − 1 give a plan whose every cell
//!   is within the cap (summed exactly) and that validates, or an infeasibility the certified
//!   rows share; `validate_plan` refuses a cell whose tokens overflow i64, naming it;
//! * class 4: a window that fits (planted rows within the cap, enough samples for dp·M cells)
//!   is planned by every packer, baselines included, and the plan validates.

mod common;

use common::Mix;
use proptest::prelude::*;
use routepack_core::error::Error;
use routepack_core::packing::kk::verl_kk;
use routepack_core::packing::routepack::{routepack_packing, Options};
use routepack_core::packing::rows::certified::certified_rows;
use routepack_core::packing::rows::exact::DEFAULT_NODE_LIMIT;
use routepack_core::packing::sequential::sequential;
use routepack_core::packing::Packing;
use routepack_core::placement::static_placement;
use routepack_core::validate::validate_plan;
use routepack_core::{CostModel, Plan, Topology, WindowView};

const L: usize = 1;
const E: usize = 4;

fn topology(dp: usize) -> Topology {
    if dp.is_multiple_of(2) {
        Topology::new(dp, 2, 2, 2).unwrap()
    } else {
        Topology::new(dp, 1, 1, E).unwrap()
    }
}

fn opts() -> Options {
    let mut o = Options::default();
    o.anneal.moves = 1_500;
    o.anneal.steps = 3;
    o
}

fn plan_of(p: &Packing, topo: &Topology) -> Plan {
    Plan {
        placement: static_placement(L, E, topo).unwrap(),
        sample_rank: p.sample_rank.clone(),
        sample_micro: p.sample_micro.clone(),
        num_micro: p.num_micro,
        replicas: vec![],
        migration: vec![],
    }
}

/// Every packer's result on a window: Ok packings (each checked: cells non-empty, exact token
/// sums within the cap, `validate_plan`), or errors.
fn pack_all(lens: &[i64], cap: i64, topo: &Topology) -> Vec<(&'static str, Result<Packing, Error>)> {
    let tok = vec![0i32; lens.len() * L * E];
    let w = WindowView::new(lens, &tok, L, E).unwrap();
    let pl = static_placement(L, E, topo).unwrap();
    vec![
        ("sequential", sequential(lens, cap, topo.dp)),
        ("kk", verl_kk(lens, cap, topo.dp).map(|x| x.0)),
        ("routepack", routepack_packing(&w, topo, &CostModel::for_tests(L), &pl, cap, &opts()).map(|x| x.0)),
    ]
}

fn check_packing(name: &str, p: &Packing, lens: &[i64], cap: i64, topo: &Topology) -> Result<(), TestCaseError> {
    let mut tokens = vec![0i128; topo.dp * p.num_micro];
    let mut count = vec![0usize; topo.dp * p.num_micro];
    for (s, &n) in lens.iter().enumerate() {
        let c = p.sample_rank[s] as usize * p.num_micro + p.sample_micro[s] as usize;
        tokens[c] += n as i128;
        count[c] += 1;
    }
    prop_assert!(count.iter().all(|&c| c > 0), "{name}: an empty cell {count:?}");
    prop_assert!(tokens.iter().all(|&t| t <= cap as i128), "{name}: a cell over the cap {cap}: {tokens:?}");
    let tok = vec![0i32; lens.len() * L * E];
    let w = WindowView::new(lens, &tok, L, E).unwrap();
    let v = validate_plan(&plan_of(p, topo), &w, topo, cap);
    prop_assert!(v.is_ok(), "{name}: {v:?}");
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, failure_persistence: None, ..ProptestConfig::default() })]

    /// Class 3: lengths of 2^59..2^63 tokens (where i64 sums of two or more wrap).
    #[test]
    fn lengths_near_the_i64_limit_stay_under_the_cap(dp in 1usize..5, extra in 0usize..10, seed in any::<u64>(), cap_kind in 0usize..3) {
        let mut mix = Mix(seed);
        let cap = [i64::MAX, i64::MAX - 1, (1i64 << 62) + 12_345][cap_kind];
        let topo = topology(dp);
        let s_n = dp + extra;
        let lens: Vec<i64> = (0..s_n)
            .map(|_| match mix.below(4) {
                0 => cap - mix.below(3) as i64,
                k => (cap >> k) + mix.below(1 << 20) as i64,
            })
            .collect();
        let rows = certified_rows(&lens, cap, dp, DEFAULT_NODE_LIMIT, None);
        for (name, r) in pack_all(&lens, cap, &topo) {
            match r {
                Ok(p) => check_packing(name, &p, &lens, cap, &topo)?,
                // refused only where the certified rows are refused too (more rows than samples)
                Err(Error::Infeasible(msg)) => prop_assert!(rows.is_err(), "{name} refused a window that fits: {msg}"),
                Err(e) => return Err(TestCaseError::fail(format!("{name}: {e}"))),
            }
        }
    }

    /// Class 3: a hand-made cell of k samples of 2^62..2^63 tokens (an i64 sum wraps) is
    /// refused as over the cap, naming the cell.
    #[test]
    fn validate_refuses_a_cell_whose_sum_overflows_i64(k in 2usize..9, others in 0usize..4, seed in any::<u64>()) {
        let mut mix = Mix(seed);
        let mut lens: Vec<i64> = (0..k).map(|_| (1i64 << 62) + mix.below(1 << 30) as i64).collect();
        lens.extend((0..others).map(|_| 1 + mix.below(100) as i64));
        let topo = Topology::new(1, 1, 1, E).unwrap();
        // the big samples share step 0; each other sample has a step of its own
        let micro: Vec<i32> = (0..lens.len()).map(|s| if s < k { 0 } else { (s - k + 1) as i32 }).collect();
        let p = Packing { sample_rank: vec![0; lens.len()], sample_micro: micro, num_micro: others + 1 };
        let tok = vec![0i32; lens.len() * L * E];
        let w = WindowView::new(&lens, &tok, L, E).unwrap();
        let total: i128 = lens[..k].iter().map(|&n| n as i128).sum();
        match validate_plan(&plan_of(&p, &topo), &w, &topo, i64::MAX) {
            Err(Error::InvalidPlan(msg)) => {
                prop_assert!(msg.contains("cell (rank 0, micro 0)") && msg.contains(&total.to_string()), "{msg}");
            }
            other => return Err(TestCaseError::fail(format!("accepted: {other:?}"))),
        }
    }
}

/// A window that fits by construction: dp·M rows, each of 1..=4 samples summing to at most the
/// cap (often exactly the cap, so first fit in arrival order opens too many rows), shuffled.
fn planted(mix: &mut Mix, dp: usize, micro: usize, cap: i64) -> Vec<i64> {
    let mut lens = Vec::new();
    for _ in 0..dp * micro {
        let parts = 1 + mix.below(4);
        let total = if mix.below(3) == 0 { parts as i64 + mix.below((cap - parts as i64) as usize + 1) as i64 } else { cap };
        // `parts` positive lengths summing to `total`
        let mut cuts: Vec<i64> = (0..parts - 1).map(|_| 1 + mix.below(total as usize - 1) as i64).collect();
        cuts.sort_unstable();
        cuts.dedup();
        let mut prev = 0;
        for c in cuts.into_iter().chain([total]) {
            lens.push(c - prev);
            prev = c;
        }
    }
    mix.shuffle(&mut lens);
    lens
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, failure_persistence: None, ..ProptestConfig::default() })]

    /// Class 4: every packer plans a window that fits.
    #[test]
    fn every_packer_plans_a_window_that_fits(dp in 1usize..7, micro in 1usize..4, cap in 8i64..3000, seed in any::<u64>()) {
        let mut mix = Mix(seed);
        let topo = topology(dp);
        let lens = planted(&mut mix, dp, micro, cap);
        for (name, r) in pack_all(&lens, cap, &topo) {
            match r {
                Ok(p) => check_packing(name, &p, &lens, cap, &topo)?,
                Err(e) => return Err(TestCaseError::fail(format!("{name} refused a window that fits ({lens:?}, cap {cap}, dp {dp}): {e}"))),
            }
        }
    }
}

/// Issue 13's window: `static` (first fit) refused it, routepack planned it with M = 1.
#[test]
fn the_issue_window_is_planned_by_every_packer() {
    let lens = [1209, 1867, 306, 668, 1833, 959, 1189, 1682, 781, 277];
    let topo = Topology::new(6, 6, 3, 1).unwrap();
    let tok = vec![0i32; lens.len() * 6];
    let w = WindowView::new(&lens, &tok, 1, 6).unwrap();
    let pl = static_placement(1, 6, &topo).unwrap();
    let cost = CostModel::for_tests(1);
    let packings = [
        sequential(&lens, 1867, 6).unwrap(),
        verl_kk(&lens, 1867, 6).unwrap().0,
        routepack_packing(&w, &topo, &cost, &pl, 1867, &opts()).unwrap().0,
    ];
    for p in packings {
        assert_eq!(p.num_micro, 1);
        let plan = Plan {
            placement: pl.clone(),
            sample_rank: p.sample_rank,
            sample_micro: p.sample_micro,
            num_micro: 1,
            replicas: vec![],
            migration: vec![],
        };
        validate_plan(&plan, &w, &topo, 1867).unwrap();
    }
}
