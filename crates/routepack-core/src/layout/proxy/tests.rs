//! The proxy against `simulate`, its incremental evaluation against a rebuild, and the
//! compact sample demand.

use super::*;
use crate::layout::kernel::{Demand, Shape};
use crate::placement::static_placement;
use crate::plan::Plan;
use crate::simulate::simulate;

/// A small window with skewed expert demand.
pub(crate) fn window(s_n: usize, l_n: usize, e_n: usize, seed: u64) -> (Vec<i64>, Vec<i32>) {
    use rand::{RngExt, SeedableRng};
    let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(seed);
    let lens: Vec<i64> = (0..s_n).map(|_| rng.random_range(50..900i64)).collect();
    let mut tok = vec![0i32; s_n * l_n * e_n];
    for s in 0..s_n {
        for l in 0..l_n {
            for _ in 0..lens[s] * 2 {
                let e = (rng.random_range(0..e_n * e_n) as f64).sqrt() as usize;
                tok[(s * l_n + l) * e_n + e] += 1;
            }
        }
    }
    (lens, tok)
}

#[test]
fn proxy_matches_simulate_under_static_placement() {
    let (s_n, l_n, e_n) = (48, 4, 16);
    let (lens, tok) = window(s_n, l_n, e_n, 3);
    let w = WindowView::new(&lens, &tok, l_n, e_n).unwrap();
    let topo = Topology::new(8, 4, 2, 4).unwrap();
    let cost = CostModel::for_tests(l_n);
    let pl = static_placement(l_n, e_n, &topo).unwrap();
    let m_n = 3;
    let px = Proxy::new(&w, &topo, &cost, &pl, 4000, m_n, 0.0).unwrap();
    let cell_of: Vec<u32> = (0..s_n as u32).map(|s| s % (8 * m_n as u32)).collect();
    let sh = px.build(&cell_of);
    let plan = Plan {
        placement: pl,
        sample_rank: cell_of.iter().map(|&c| (c as usize / m_n) as i32).collect(),
        sample_micro: cell_of.iter().map(|&c| (c as usize % m_n) as i32).collect(),
        num_micro: m_n,
        replicas: vec![],
        migration: vec![],
    };
    let rep = simulate(&plan, &w, &topo, &cost, None).unwrap();
    for g in 0..2 {
        let rel = (sh.group_cost[g] - rep.group_times[g]).abs() / rep.group_times[g];
        assert!(rel < 1e-5, "group {g}: proxy {} vs simulate {}", sh.group_cost[g], rep.group_times[g]);
    }
}

#[test]
fn proxy_tracks_simulate_with_replicated_experts() {
    // EPLB replicates the hot experts: the proxy splits their tokens evenly over the replicas
    // (rounded per sample, layer and rank), `simulate` routes them through `flow`, which feeds
    // each copy from its own node first. That takes tokens off the inter-node links of every
    // rank, so the proxy over-estimates the all-to-all where copies span nodes (see the
    // module's approximations): here by 1.5% (measured; +0.2–0.3% on `flash`), half of what
    // is allowed. Under the even split `flow` used before, this test held within 1e-3.
    let (s_n, l_n, e_n) = (48, 4, 16);
    let (lens, tok) = window(s_n, l_n, e_n, 7);
    let w = WindowView::new(&lens, &tok, l_n, e_n).unwrap();
    let topo = Topology::new(8, 4, 2, 5).unwrap();
    let cost = CostModel::for_tests(l_n);
    let mut loads = vec![0f64; l_n * e_n];
    for s in 0..s_n {
        for l in 0..l_n {
            for (e, n) in w.tokens(s, l).iter().enumerate() {
                loads[l * e_n + e] += n as f64;
            }
        }
    }
    let groups = crate::placement::eplb::node_groups(e_n, &topo);
    let pl = crate::placement::eplb::eplb_placement(&loads, l_n, e_n, &topo, groups).unwrap();
    assert!(pl.max_replicas() > 1, "the test needs replicated experts");
    let m_n = 3;
    let px = Proxy::new(&w, &topo, &cost, &pl, 4000, m_n, 0.0).unwrap();
    let cell_of: Vec<u32> = (0..s_n as u32).map(|s| (s * 5) % (8 * m_n as u32)).collect();
    let sh = px.build(&cell_of);
    let plan = Plan {
        placement: pl,
        sample_rank: cell_of.iter().map(|&c| (c as usize / m_n) as i32).collect(),
        sample_micro: cell_of.iter().map(|&c| (c as usize % m_n) as i32).collect(),
        num_micro: m_n,
        replicas: vec![],
        migration: vec![],
    };
    let rep = simulate(&plan, &w, &topo, &cost, None).unwrap();
    let within = |proxy: f64, sim: f64| (-1e-3..3e-2).contains(&((proxy - sim) / sim));
    for g in 0..2 {
        assert!(within(sh.group_cost[g], rep.group_times[g]), "group {g}: proxy {} vs simulate {}", sh.group_cost[g], rep.group_times[g]);
    }
    // the redundant copies' once-per-step gradient sum is the placement's, the same for every
    // layout: the proxy leaves it out
    assert!(rep.redundant_grads > 0.0);
    let layout_part = rep.step_time - rep.redundant_grads;
    assert!(within(px.step_time(&sh), layout_part), "proxy {} vs simulate {}", px.step_time(&sh), layout_part);
}

#[test]
fn incremental_evaluation_equals_rebuild() {
    let (s_n, l_n, e_n) = (40, 3, 8);
    let (lens, tok) = window(s_n, l_n, e_n, 5);
    let w = WindowView::new(&lens, &tok, l_n, e_n).unwrap();
    let topo = Topology::new(4, 2, 1, 5).unwrap();
    let cost = CostModel::for_tests(l_n);
    let pl = static_placement(l_n, e_n, &topo).unwrap();
    let px = Proxy::new(&w, &topo, &cost, &pl, 100_000, 2, 0.1).unwrap();
    let mut cell_of: Vec<u32> = (0..s_n as u32).map(|s| s % 8).collect();
    let sh = px.build(&cell_of);
    // move sample 0 from cell 0 (rank 0, microbatch 0) to cell 7 (rank 3, microbatch 1): another group
    let (ga, gb) = (px.gm_of(0), px.gm_of(7));
    let da = Delta::one(Src::Sample(0), Src::Zero, 0, -1.0, -1.0);
    let db = Delta::one(Src::Sample(0), Src::Zero, 1, 1.0, 1.0);
    let ca = px.eval_gm(&sh, ga, &da, &[]);
    let cb = px.eval_gm(&sh, gb, &db, &[]);
    let mut inc = sh.clone();
    inc.lin[0] -= lens[0];
    inc.quad[0] -= lens[0] as i128 * lens[0] as i128;
    inc.lin[7] += lens[0];
    inc.quad[7] += lens[0] as i128 * lens[0] as i128;
    px.apply_gm(&mut inc, ga, &da, &[], ca);
    px.apply_gm(&mut inc, gb, &db, &[], cb);
    cell_of[0] = 7;
    let fresh = px.build(&cell_of);
    assert_eq!(fresh.gm, inc.gm);
    assert_eq!(fresh.att_top, inc.att_top);
    assert!((fresh.gm_cost[ga] - ca).abs() <= 1e-12 * ca.abs().max(1.0));
    assert!((fresh.gm_cost[gb] - cb).abs() <= 1e-12 * cb.abs().max(1.0));
}

#[test]
fn sample_demand_is_compact_only_when_every_value_fits() {
    let shape = Shape::new(3, 4, 2);
    let mut full: Vec<f32> = (0..2 * shape.demand_len()).map(|i| (i % 50) as f32).collect();
    let otot = shape.otot_at(1);
    full[otot] = 1e6; // tails may exceed 16 bits
    let demand = SampleDemand::new(full.clone(), shape);
    assert!(matches!(demand, SampleDemand::U16 { .. }));
    for s in 0..2 {
        match demand.of(s, shape) {
            Demand::U16 { proj, tail } => {
                let back: Vec<f32> = proj.iter().map(|&x| x as f32).chain(tail.iter().copied()).collect();
                assert_eq!(back, full[s * shape.demand_len()..(s + 1) * shape.demand_len()]);
            }
            Demand::F32(_) => unreachable!(),
        }
    }
    full[shape.proj_at(2, 3) + shape.demand_len()] = 70_000.0;
    assert!(matches!(SampleDemand::new(full, shape), SampleDemand::F32(_)));
}

#[test]
fn compact_projection_equals_the_full_table_compacted() {
    // placements with one copy per expert and with replicated experts (the even split), and a
    // window whose proj values overflow 16 bits (then both are the f32 table)
    let (l_n, e_n) = (3, 16);
    let topo = Topology::new(8, 4, 2, 5).unwrap();
    let static_pl = static_placement(l_n, e_n, &topo).unwrap();
    let mut replicated = static_pl.clone();
    for l in 0..l_n {
        // the spare slot of every rank hosts expert l (a hot expert copied on every rank)
        for p in 0..topo.ep {
            replicated.phy2log[l * topo.num_slots() + p * topo.slots_per_rank + topo.slots_per_rank - 1] = l as i32;
        }
    }
    for (seed, big) in [(1u64, false), (2, false), (3, true)] {
        let (mut lens, mut tok) = window(40, l_n, e_n, seed);
        if big {
            lens[5] = 200_000;
            tok[(5 * l_n + 1) * e_n + 2] = 150_000;
        }
        let w = WindowView::new(&lens, &tok, l_n, e_n).unwrap();
        for pl in [&static_pl, &replicated] {
            let shape = Shape::new(l_n, topo.ep, topo.ep / topo.ranks_per_group_node());
            let want = SampleDemand::new(demand::project(&w, &topo, pl, shape), shape);
            let got = demand::project_compact(&w, &topo, pl, shape);
            assert_eq!(matches!(got, SampleDemand::U16 { .. }), !big, "seed {seed}");
            for s in 0..w.num_samples {
                let flat = |d: Demand| match d {
                    Demand::F32(r) => r.to_vec(),
                    Demand::U16 { proj, tail } => proj.iter().map(|&x| x as f32).chain(tail.iter().copied()).collect(),
                };
                assert_eq!(flat(got.of(s, shape)), flat(want.of(s, shape)), "seed {seed} sample {s}");
            }
        }
    }
}

#[test]
fn projection_by_rank_sums_equals_the_plain_scatter() {
    // the projection sums each rank's single-copy experts apart; the plain rule scatters
    // every expert's tokens onto its rank and splits a replicated one evenly over its copies
    use rand::{RngExt, SeedableRng};
    let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(9);
    for case in 0..40 {
        let (dp, ep, gpn, spr) = [(8, 4, 2, 5), (8, 8, 4, 3), (4, 4, 4, 2)][case % 3];
        let topo = Topology::new(dp, ep, gpn, spr).unwrap();
        let (l_n, e_n) = (1 + case % 3, 1 + rng.random_range(0..topo.num_slots()));
        let mut phy2log = Vec::new();
        for _ in 0..l_n {
            let mut layer: Vec<i32> =
                (0..topo.num_slots()).map(|p| if p < e_n { p as i32 } else { rng.random_range(0..e_n) as i32 }).collect();
            for i in (1..layer.len()).rev() {
                layer.swap(i, rng.random_range(0..i + 1));
            }
            phy2log.extend(layer);
        }
        let pl = Placement::new(phy2log, l_n, e_n, spr).unwrap();
        let (lens, tok) = window(12, l_n, e_n, case as u64);
        let w = WindowView::new(&lens, &tok, l_n, e_n).unwrap();
        let shape = Shape::new(l_n, topo.ep, topo.ep / topo.ranks_per_group_node());
        let got = demand::project(&w, &topo, &pl, shape);
        let len = shape.demand_len();
        for s in 0..w.num_samples {
            for l in 0..l_n {
                let (off, slots) = pl.replicas_of_layer(l);
                let (mut whole, mut part) = (vec![0i64; ep], vec![0.0f64; ep]);
                let x = w.tokens(s, l);
                for e in 0..e_n {
                    let sl = &slots[off[e]..off[e + 1]];
                    if sl.len() == 1 {
                        whole[topo.rank_of_slot(sl[0])] += x.get(e);
                    }
                }
                // replicated experts: the module's merged (expert, rank, share) order
                let mut multi: Vec<(usize, usize, f64)> = Vec::new();
                for e in 0..e_n {
                    let sl = &slots[off[e]..off[e + 1]];
                    if sl.len() > 1 {
                        let start = multi.len();
                        for &slot in sl {
                            let p = topo.rank_of_slot(slot);
                            match multi[start..].iter_mut().find(|m| m.1 == p) {
                                Some(m) => m.2 += 1.0 / sl.len() as f64,
                                None => multi.push((e, p, 1.0 / sl.len() as f64)),
                            }
                        }
                    }
                }
                for &(e, p, sh) in &multi {
                    part[p] += x.get(e) as f64 * sh;
                }
                for p in 0..ep {
                    let want = (whole[p] as f64 + part[p]).round() as f32;
                    assert_eq!(got[s * len + shape.proj_at(l, p)], want, "case {case} sample {s} layer {l} rank {p}");
                }
            }
        }
    }
}

/// Under a calibrated model (roofline floor, GEMM step, table and kernel call set), the
/// proxy ranks layouts of a window as `simulate` does: rank correlation at least 0.95 over 40
/// layouts of each of three windows, each a balanced layout with one to three random swaps
/// (layouts as close as the ones the search compares). Before the proxy took the expert
/// curve's line (`CostModel::expert_line`) it priced tokens at `c_tok` and experts at
/// `c_exp`: that is the proxy of the same model without its curve, whose correlation is
/// lower by at least 0.02 on average (measured: 0.88–0.99, against 0.998–1.000).
#[test]
fn proxy_ranks_layouts_as_simulate_under_a_calibrated_model() {
    use crate::cost::rank::test_support::{calibrated, spearman};
    use rand::{RngExt, SeedableRng};
    let (s_n, l_n, e_n, m_n) = (48, 4, 16, 3);
    let topo = Topology::new(8, 4, 2, 4).unwrap();
    let cost = calibrated(l_n);
    let linear = CostModel { c_weights: 0.0, c_gemm: 0.0, expert_table: Vec::new(), ..cost.clone() };
    let (mut now, mut before) = (Vec::new(), Vec::new());
    for seed in 0..3u64 {
        let (lens, tok) = window(s_n, l_n, e_n, 11 + seed);
        let w = WindowView::new(&lens, &tok, l_n, e_n).unwrap();
        let pl = static_placement(l_n, e_n, &topo).unwrap();
        let px = Proxy::new(&w, &topo, &cost, &pl, i64::MAX, m_n, 0.0).unwrap();
        let old = Proxy::new(&w, &topo, &linear, &pl, i64::MAX, m_n, 0.0).unwrap();
        let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(seed);
        let (mut sim, mut new_p, mut old_p) = (Vec::new(), Vec::new(), Vec::new());
        // a balanced layout (samples by length, dealt to cells in snake order), then a few
        // random swaps: layouts as close as the ones the search compares
        let cells = topo.dp * m_n;
        let mut by_len: Vec<usize> = (0..s_n).collect();
        by_len.sort_by_key(|&s| std::cmp::Reverse(lens[s]));
        let mut base = vec![0u32; s_n];
        for (k, &s) in by_len.iter().enumerate() {
            let (round, i) = (k / cells, k % cells);
            base[s] = if round % 2 == 0 { i } else { cells - 1 - i } as u32;
        }
        for _ in 0..40 {
            let mut cell_of = base.clone();
            for _ in 0..rng.random_range(1..4) {
                let (a, b) = (rng.random_range(0..s_n), rng.random_range(0..s_n));
                cell_of.swap(a, b);
            }
            let plan = Plan {
                placement: pl.clone(),
                sample_rank: cell_of.iter().map(|&c| (c as usize / m_n) as i32).collect(),
                sample_micro: cell_of.iter().map(|&c| (c as usize % m_n) as i32).collect(),
                num_micro: m_n,
                replicas: vec![],
                migration: vec![],
            };
            sim.push(simulate(&plan, &w, &topo, &cost, None).unwrap().step_time);
            new_p.push(px.step_time(&px.build(&cell_of)));
            old_p.push(old.step_time(&old.build(&cell_of)));
        }
        let (a, b) = (spearman(&new_p, &sim), spearman(&old_p, &sim));
        assert!(a >= 0.95, "seed {seed}: rank correlation {a:.3} with simulate (linear proxy {b:.3})");
        now.push(a);
        before.push(b);
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    assert!(mean(&now) >= mean(&before) + 0.02, "with the curve {now:?}, without {before:?}");
}
