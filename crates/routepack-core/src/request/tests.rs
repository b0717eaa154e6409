//! A request checked once is not checked again: every argument guard counts its runs on this
//! thread (`counted`), and a plan built from one request (packing, then validation and the
//! simulator) runs each exactly once, at `PlanRequest::new`; the entries that take the parts
//! run them once too, where before they ran several times a call.

use std::collections::BTreeMap;

use super::*;
use crate::guard_counts as counted;
use crate::packing::cells::Cells;
use crate::packing::kk::verl_kk_of;
use crate::packing::routepack::{routepack_packing, routepack_packing_in, Options};
use crate::packing::sequential::{sequential_in, sequential_of};
use crate::placement::static_placement;
use crate::plan::{Plan, ReplicaTiming};
use crate::simulate::{simulate_in, simulate_request, Scoring};

const L: usize = 2;
const E: usize = 8;

/// 24 samples of 5..64 tokens (every 7th over the cap of 40 by up to 2x), 2 tokens a token
/// routed round-robin over the experts.
fn window() -> (Vec<i64>, Vec<i32>) {
    let lens: Vec<i64> = (0..24).map(|s| if s % 7 == 3 { 41 + (s as i64 * 5) % 39 } else { 5 + (s as i64 * 13) % 35 }).collect();
    let mut tok = vec![0i32; lens.len() * L * E];
    for (s, &n) in lens.iter().enumerate() {
        for l in 0..L {
            for t in 0..2 * n as usize {
                tok[(s * L + l) * E + (s + l + t) % E] += 1;
            }
        }
    }
    (lens, tok)
}

fn counts(pairs: &[(&'static str, usize)]) -> BTreeMap<&'static str, usize> {
    pairs.iter().copied().collect()
}

fn plan_of(pl: &crate::Placement, p: &crate::packing::Packing) -> Plan {
    Plan {
        placement: pl.clone(),
        sample_rank: p.sample_rank.clone(),
        sample_micro: p.sample_micro.clone(),
        num_micro: p.num_micro,
        replicas: vec![],
        migration: vec![],
    }
}

#[test]
fn a_request_is_checked_once_and_the_stages_that_take_it_check_nothing_again() {
    let (lens, tok) = window();
    let topo = Topology::new(4, 2, 2, 4).unwrap().with_cp(2).unwrap();
    let cost = CostModel::for_tests(L);
    let w = WindowView::new(&lens, &tok, L, E).unwrap();
    let pl = static_placement(L, E, &topo).unwrap();
    let mut opts = Options::default();
    opts.anneal.moves = 500;
    for oversize in [Oversize::Alone, Oversize::Split] {
        counted::take();
        let req = PlanRequest::new(w, &topo, &cost, 40, oversize).unwrap();
        let split = usize::from(oversize == Oversize::Split);
        let once = counts(&[("cost", 1), ("pieces", split), ("request", 1), ("token_cap", 1), ("topo", 1)]);
        let once: BTreeMap<_, _> = once.into_iter().filter(|&(_, n)| n > 0).collect();
        assert_eq!(counted::take(), once, "{oversize:?}: the request's one check");
        let (packed, _) = routepack_packing_in(&req, &pl, &opts).unwrap();
        let (seq, _) = sequential_of(&req).unwrap();
        let (kk, _) = verl_kk_of(&req).unwrap();
        for p in [&packed, &seq, &kk] {
            simulate_request(&plan_of(&pl, p), &req, None, ReplicaTiming::Prefetched).unwrap();
        }
        assert_eq!(counted::take(), BTreeMap::new(), "{oversize:?}: three packings and three scores checked nothing again");
    }
}

#[test]
fn the_entries_that_take_the_parts_check_them_once() {
    let (lens, tok) = window();
    let lens: Vec<i64> = lens.iter().map(|&n| n.min(40)).collect();
    let topo = Topology::new(4, 2, 2, 4).unwrap().with_cp(2).unwrap();
    let cost = CostModel::for_tests(L);
    let w = WindowView::new(&lens, &tok, L, E).unwrap();
    let pl = static_placement(L, E, &topo).unwrap();
    let mut opts = Options::default();
    opts.anneal.moves = 500;
    counted::take();
    let (p, _) = routepack_packing(&w, &topo, &cost, &pl, 40, &opts).unwrap();
    // before: the topology twice (the packing and the proxy), the cost model once (the proxy)
    assert_eq!(counted::take(), counts(&[("cost", 1), ("request", 1), ("token_cap", 1), ("topo", 1)]));
    let (seq, _) = sequential_in(&lens, 40, &Cells::of(&topo, Oversize::Split)).unwrap();
    // as before: the pieces, then the cap on the pieces' rows (now at the entry, none inside)
    assert_eq!(counted::take(), counts(&[("pieces", 1), ("token_cap", 1)]));
    let scoring = Scoring { token_cap: Some(40), plan_cap: Some(40), ..Scoring::default() };
    for p in [&p, &seq] {
        simulate_in(&plan_of(&pl, p), &w, &topo, &cost, &scoring).unwrap();
        // before: the cost model 3 times (the entry, the score, the bound), the topology 3 (the validation, the score, the bound)
        assert_eq!(counted::take(), counts(&[("cost", 1), ("topo", 1)]));
    }
}

#[test]
fn the_request_refuses_with_the_messages_the_stages_gave() {
    let (lens, tok) = window();
    let topo = Topology::new(4, 2, 2, 4).unwrap().with_cp(2).unwrap();
    let cost = CostModel::for_tests(L);
    let w = WindowView::new(&lens, &tok, L, E).unwrap();
    let err = |t: &Topology, c: &CostModel, cap: i64, o: Oversize| PlanRequest::new(w, t, c, cap, o).unwrap_err().to_string();
    assert_eq!(err(&topo, &cost, 0, Oversize::Alone), "token_cap: must be >= 1, got 0");
    assert!(err(&topo, &cost, 40, Oversize::Refuse).starts_with("infeasible: sample 3 has 56 tokens, more than token_cap = 40"));
    assert!(err(&topo, &cost, 20, Oversize::Split).contains("more than topo.cp x token_cap = 2 x 20"));
    let no_cp = Topology::new(4, 2, 2, 4).unwrap();
    assert!(err(&no_cp, &cost, 40, Oversize::Split).starts_with("topo.cp: oversize=\"split\""));
    assert!(err(&topo, &CostModel::for_tests(L + 1), 40, Oversize::Alone).starts_with("cost.a_quad: has 3 entries"));
    let small = Topology::new(4, 2, 2, 3).unwrap();
    assert!(err(&small, &cost, 40, Oversize::Alone).starts_with("topo: ep*slots_per_rank = 2*3 = 6 < num_experts = 8"));
    // the same message as the packers gave
    let seq = sequential_in(&lens, 40, &Cells::of(&topo, Oversize::Refuse)).unwrap_err().to_string();
    assert_eq!(seq, err(&topo, &cost, 40, Oversize::Refuse));
}
