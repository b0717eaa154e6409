//! The simulator's fast paths against the plain rule they shortcut: an exchange priced with
//! every expert routed by `route_expert` (as it was priced before the one-slot shortcut), and
//! the lower bound's demand sums gathered on the exchanges' pass against the bound's own pass.

use super::*;
use crate::bound::DemandSums;
use crate::cost::Overlap;
use crate::plan::Placement;

struct Mix(u64);

impl Mix {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((self.0 >> 33) % n as u64) as usize
    }
}

/// `price_exchange` as it was: every expert through `route_expert`, activation by stamp,
/// each expert's replicas found by scanning the exchange's.
#[allow(clippy::too_many_arguments)]
fn reference_price(
    topo: &Topology,
    cost: &CostModel,
    e_n: usize,
    origin: &[i64],
    attn_max: f64,
    slot_off: &[usize],
    slots: &[usize],
    reps: &[Replica],
) -> (LayerCost, (f64, f64)) {
    let ep = topo.ep;
    let (mut tokens, mut active, mut extra) = (vec![0i64; ep], vec![0u32; ep], vec![0.0f64; ep]);
    let mut stamp = vec![false; ep * e_n];
    let mut a2a = vec![LinkBytes::default(); ep];
    let mut rem = Vec::new();
    for e in 0..e_n {
        let column: Vec<i64> = (0..ep).map(|r| origin[r * e_n + e]).collect();
        let args: Vec<(usize, f32)> = reps.iter().filter(|x| x.expert as usize == e).map(|x| (x.dst_rank as usize, x.share)).collect();
        if column.iter().all(|&x| x == 0) {
            continue;
        }
        let mut etok = vec![0i64; ep];
        let mut touched = Vec::new();
        route_expert(&column, &slots[slot_off[e]..slot_off[e + 1]], &args, topo, &mut rem, |o, p, _, n| {
            tokens[p] += n;
            if !stamp[p * e_n + e] {
                stamp[p * e_n + e] = true;
                active[p] += 1;
                touched.push(p);
            }
            etok[p] += n;
            if o != p {
                let same = topo.local_node_of(o) == topo.local_node_of(p);
                LinkBytes::add(&mut a2a, o, p, n as f64 * cost.token_bytes, same);
            }
        });
        for &p in &touched {
            if cost.roofline() {
                extra[p] += cost.weights_bound_extra(etok[p] as f64);
            }
        }
    }
    let x_of = |p: usize| {
        let x = cost.expert_time(tokens[p] as f64, active[p] as f64);
        let x = if cost.roofline() { x + extra[p] } else { x };
        // one kernel call on a rank that computes a token
        if tokens[p] > 0 {
            x + cost.c_call
        } else {
            x
        }
    };
    let x_max = (0..ep).map(x_of).fold(0.0, f64::max);
    let total: i64 = tokens.iter().sum();
    let imbalance = if total > 0 { *tokens.iter().max().unwrap() as f64 * ep as f64 / total as f64 } else { 1.0 };
    let a2a_time = cost.all_to_all_time(&a2a);
    // the replication term is not shortcut: the pricer's own
    let mut pricer = ExchangePricer::new(ep, e_n);
    let replication = pricer.price(topo, cost, origin, attn_max, slot_off, slots, reps).replication;
    (LayerCost::new(cost, attn_max, x_max, a2a_time, replication, imbalance), LinkBytes::sent_totals(&a2a))
}

#[test]
fn the_one_slot_shortcut_prices_exchanges_bit_for_bit() {
    let mut mix = Mix(11);
    let mut paths = (0, 0);
    for case in 0..400 {
        let (dp, ep, gpn, spr) = [(4, 4, 2, 2), (8, 8, 4, 3), (4, 4, 4, 2), (6, 6, 2, 2), (2, 2, 1, 4)][case % 5];
        let topo = Topology::new(dp, ep, gpn, spr).unwrap();
        let e_n = 1 + mix.below(topo.num_slots());
        // each expert once, the spare slots on random experts (some replicated), shuffled
        let mut phy2log: Vec<i32> = (0..topo.num_slots()).map(|p| if p < e_n { p as i32 } else { mix.below(e_n) as i32 }).collect();
        for i in (1..phy2log.len()).rev() {
            phy2log.swap(i, mix.below(i + 1));
        }
        let placement = Placement::new(phy2log, 1, e_n, spr).unwrap();
        let (so, sl) = placement.replicas_of_layer(0);
        let zero_odds = 1 + mix.below(4);
        let origin: Vec<i64> = (0..ep * e_n).map(|_| if mix.below(zero_odds) == 0 { 0 } else { mix.below(60) as i64 }).collect();
        let reps: Vec<Replica> = (0..mix.below(6))
            .map(|_| Replica {
                micro: 0,
                group: 0,
                layer: 0,
                expert: mix.below(e_n) as i32,
                src_rank: 0,
                dst_rank: mix.below(ep) as i32,
                share: mix.below(5) as f32 / 8.0,
            })
            .collect();
        let mut cost = CostModel::for_tests(1);
        cost.token_bytes = [4096.0, 7168.0 * 2.0, 1.3, 0.1][case % 4];
        cost.c_weights = [0.0, 3e-8][(case / 4) % 2];
        cost.overlap = [Overlap::None, Overlap::DispatchCombine][(case / 8) % 2];
        cost.c_gemm = [0.0, 2e-7][(case / 16) % 2];
        cost.c_call = [0.0, 5e-7][(case / 32) % 2];
        let attn_max = mix.below(100) as f64 * 1e-7;
        let mut pricer = ExchangePricer::new(ep, e_n);
        let got = pricer.price(&topo, &cost, &origin, attn_max, &so, &sl, &reps);
        let want = reference_price(&topo, &cost, e_n, &origin, attn_max, &so, &sl, &reps);
        assert_eq!((got, pricer.dispatch_bytes()), want, "case {case}");
        let has_reps = |e: usize| reps.iter().any(|r| r.expert as usize == e);
        paths.0 += usize::from((0..e_n).any(|e| so[e + 1] - so[e] == 1 && !has_reps(e)));
        paths.1 += usize::from((0..e_n).any(|e| so[e + 1] - so[e] > 1 || has_reps(e)));
    }
    assert!(paths.0 > 100 && paths.1 > 100, "both paths taken: {paths:?}");
}

#[test]
fn the_exchanges_pass_gathers_the_bounds_demand_sums() {
    let mut mix = Mix(5);
    for case in 0..120 {
        let (dp, ep, gpn, spr) = [(4, 2, 2, 2), (8, 4, 2, 3), (4, 4, 4, 2)][case % 3];
        let topo = Topology::new(dp, ep, gpn, spr).unwrap();
        let m_n = 1 + mix.below(3);
        let s_n = dp * m_n + mix.below(9);
        let (l_n, e_n) = (1 + mix.below(3), 1 + mix.below(topo.num_slots()));
        let seq: Vec<i64> = (0..s_n).map(|_| 1 + mix.below(40) as i64).collect();
        let tok: Vec<i32> = (0..s_n * l_n * e_n).map(|i| mix.below(seq[i / (l_n * e_n)] as usize + 1) as i32).collect();
        let w = WindowView::new(&seq, &tok, l_n, e_n).unwrap();
        // every cell non-empty: the first dp·M samples one per cell, the rest anywhere
        let cells: Vec<usize> = (0..s_n).map(|s| if s < dp * m_n { s } else { mix.below(dp * m_n) }).collect();
        let rank: Vec<i32> = cells.iter().map(|&c| (c / m_n) as i32).collect();
        let micro: Vec<i32> = cells.iter().map(|&c| (c % m_n) as i32).collect();
        let grid = CellGrid::new(&rank, &micro, m_n, &seq, &topo);
        let topo = topo.with_replica_slots(mix.below(3)).unwrap();
        let tops = crate::bound::BoundTops::new(&w, &topo);
        let mut got = DemandSums::with_tops(s_n, l_n, e_n, tops.as_ref());
        let mut origin = vec![0i64; ep * e_n];
        for gm in 0..topo.num_groups() * m_n {
            for l in 0..l_n {
                let mut share = vec![0.0; e_n];
                let mut rows = Vec::new();
                grid.origin_and_sums(&w, gm / m_n, gm % m_n, l, &mut origin, &mut share, tops.as_ref(), |s, t, x, top| {
                    rows.push((s, t, x, top))
                });
                if let Some(b) = &tops {
                    for &(s, t, x, top) in &rows {
                        assert_eq!(top, b.row(l, w.tokens(s, l), seq[s], t as f64, x), "case {case}: the pass's top-k sums");
                        got.set_row_tops(s, l, top);
                    }
                }
                let mut totals = vec![0i64; e_n];
                for o in origin.chunks_exact(e_n) {
                    totals.iter_mut().zip(o).for_each(|(t, &x)| *t += x);
                }
                let mut plain = vec![0i64; ep * e_n];
                grid.origin(&w, gm / m_n, gm % m_n, l, &mut plain);
                assert_eq!(origin, plain, "case {case}: the origins");
                for (s, t, x, _) in rows {
                    got.set_row(s, l, t, x);
                }
                got.add_layer_part(l, &totals, &share);
            }
        }
        assert_eq!(got, DemandSums::of_window(&w, tops.as_ref()), "case {case}");
    }
}
