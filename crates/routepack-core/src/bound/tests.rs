//! Unit tests of the bound's evaluation (its soundness: `tests/bound_props.rs`).

use super::*;

/// The shortcut (no top-k sums when no traffic-charging candidate can win) returns what
/// the full evaluation does.
#[test]
fn the_shortcut_changes_nothing() {
    let mut state = 7u64;
    let mut next = |n: u64| {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (state >> 33) % n
    };
    let (mut shortcuts, mut unlimited) = (0, 0);
    for case in 0..200 {
        let (dp, ep, gpn, spr) = [(4, 2, 2, 2), (8, 4, 2, 3), (4, 4, 4, 2), (2, 2, 1, 4)][case % 4];
        // replica buffers for every expert (the shortcut's case), none, the default
        let topo = Topology::new(dp, ep, gpn, spr).unwrap().with_replica_slots([64, 0, 3][(case / 4) % 3]).unwrap();
        let (s_n, l_n, e_n) = (4 + next(12) as usize, 1 + next(3) as usize, 1 + next(topo.num_slots() as u64) as usize);
        let seq: Vec<i64> = (0..s_n).map(|_| 1 + next(50) as i64).collect();
        let tok: Vec<i32> = (0..s_n * l_n * e_n).map(|i| next(seq[i / (l_n * e_n)] as u64 + 1) as i32).collect();
        let w = WindowView::new(&seq, &tok, l_n, e_n).unwrap();
        let mut cost = CostModel::for_tests(l_n);
        cost.token_bytes = [1.0, 4096.0, 1e6][case % 3];
        cost.expert_weight_bytes = [1e3, 6e6, 1e9][(case / 3) % 3];
        let cap = *seq.iter().max().unwrap() + next(40) as i64;
        let got = lower_bound_time(&w, &topo, &cost, Some(cap)).unwrap();
        let c = cap.min(w.total_tokens()) as f64;
        let bound = Bound {
            w: &w,
            topo: &topo,
            cost: &cost,
            prices: Prices::new(&topo, &cost),
            micro: MicroRule::NONE.fewest(w.total_tokens() as u64, c as u64, topo.dp) as f64,
            cap: c,
        };
        let (sums, per) = bound.layers_with_tops(&DemandSums::of_window(&w, Some(&BoundTops::with_holds(&w, Holds::new(&topo, e_n)))));
        let full = bound.best(&sums, &per, false);
        assert_eq!(got, full * (1.0 - rounding_margin(s_n, l_n, e_n, topo.ep)), "case {case}");
        if Holds::new(&topo, e_n).unlimited(e_n) {
            unlimited += 1;
            let (sums0, per0) = bound.layers_of(&DemandSums::of_window(&w, None));
            shortcuts += usize::from(bound.best(&sums0, &per0, false) <= bound.best(&sums0, &per0, true));
        }
    }
    assert!(shortcuts > 0 && shortcuts < unlimited, "both paths taken ({shortcuts} shortcuts of {unlimited} unlimited cases)");
}
