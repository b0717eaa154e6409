//! The order of microbatches under a pipeline (docs/design.md, "Pipeline parallelism"): which
//! of a layout's microbatches each EP group runs first.
//!
//! Without a pipeline the order of a DP rank's microbatches changes nothing the cost model
//! prices. Under 1F1B it does: the first microbatches' forwards fill the pipeline and the last
//! ones' backwards drain it, so a long microbatch there leaves the other stages idle, while
//! in the steady state its extra time overlaps the neighbours' work (what verl issue 2452 asks
//! of its dynamic batches: long microbatches where the schedule hides them). The order is
//! chosen per EP group (its ranks run each microbatch together, and groups run apart), by
//! permuting the group's microbatches as a whole, so every exchange, its tokens and its cost stay the same.
//!
//! Each microbatch's operations are priced once, exactly as [`crate::simulate`] prices them, without
//! replicas (replication is planned after the order, per exchange, and never slows one);
//! then the group's pipeline time ([`crate::simulate::pipeline`]) is minimised over orders:
//! every order where M! fits the budget of evaluations (the optimum), else from the best of the
//! layout's own order, longest first, shortest first, the longest in the middle and verl's
//! (heaviest in the middle, light ones at both ends), improved by exchanging two microbatches or moving
//! one elsewhere while that shortens the pipeline (first improvement, within a counted budget).
//! Deterministic: no randomness, ties keep the order found first.

use crate::cell_grid::CellGrid;
use crate::cost::{CostModel, LayerCost};
use crate::error::Result;
use crate::plan::Placement;
use crate::simulate::pipeline::{run_makespan, OpTimes, Pipeline};
use crate::simulate::ExchangePricer;
use crate::topology::Topology;
use crate::window::WindowView;

/// Pipeline-time evaluations one group's search may spend (the starts included): enough to try
/// every order of up to 8 microbatches (8! = 40,320), the counts RL steps run under a pipeline
/// (pp to 2·pp microbatches).
pub const DEFAULT_EVALUATIONS: usize = 50_000;

/// What the ordering did.
#[derive(Clone, Debug, PartialEq)]
pub struct OrderReport {
    /// The slowest group's pipeline time in the layout's order (seconds, no replicas).
    pub before: f64,
    /// The same in the chosen order.
    pub after: f64,
    /// Pipeline-time evaluations spent, all groups.
    pub evaluations: usize,
    /// Groups whose order changed.
    pub groups_reordered: usize,
}

/// One group's operations per microbatch: for each run, forward and backward seconds `[M, chunks]`,
/// and the sends `[M, chunks − 1]`.
struct GroupOps {
    runs: Vec<(Vec<f64>, Vec<f64>)>,
    sends: Vec<f64>,
    work: Vec<f64>,
}

/// The layout `(sample_rank, sample_micro)` of `m_n` microbatches (ranks and microbatches in range)
/// with each EP group's microbatches reordered to shorten its pipeline under `topo` (see the module docs): the
/// new `sample_micro`; unchanged without a pipeline. `budget`: evaluations per group.
#[allow(clippy::too_many_arguments)]
pub fn order_microbatches(
    w: &WindowView,
    topo: &Topology,
    cost: &CostModel,
    placement: &Placement,
    sample_rank: &[i32],
    sample_micro: &[i32],
    m_n: usize,
    budget: usize,
) -> Result<(Vec<i32>, OrderReport)> {
    let mut report = OrderReport { before: 0.0, after: 0.0, evaluations: 0, groups_reordered: 0 };
    if topo.pp < 2 || m_n < 2 {
        return Ok((sample_micro.to_vec(), report));
    }
    let pipe = Pipeline::new(topo, cost, w.num_layers)?;
    let grid = CellGrid::new(sample_rank, sample_micro, m_n, w.seq_lens, topo);
    let slots = placement.slot_tables()?;
    let mut pricer = ExchangePricer::new(topo.ep, w.num_experts);
    let mut origin = vec![0i64; topo.ep * w.num_experts];
    let mut new_micro = vec![0usize; topo.num_groups() * m_n];
    for g in 0..topo.num_groups() {
        let ops = group_ops(w, topo, cost, &pipe, &grid, &slots, &mut pricer, &mut origin, g);
        let identity: Vec<usize> = (0..m_n).collect();
        let (order, before, after, used) = search(&pipe, &ops, m_n, budget)?;
        report.before = report.before.max(before);
        report.after = report.after.max(after);
        report.evaluations += used;
        if order != identity {
            report.groups_reordered += 1;
        }
        // order[k] is the old microbatch run at position k
        for (k, &old) in order.iter().enumerate() {
            new_micro[g * m_n + old] = k;
        }
    }
    let out = sample_rank.iter().zip(sample_micro).map(|(&d, &m)| new_micro[d as usize / topo.ep * m_n + m as usize] as i32).collect();
    Ok((out, report))
}

/// Group g's operation times per microbatch (exchanges priced as `simulate` prices them, no replicas).
#[allow(clippy::too_many_arguments)]
fn group_ops(
    w: &WindowView,
    topo: &Topology,
    cost: &CostModel,
    pipe: &Pipeline,
    grid: &CellGrid,
    slots: &[(Vec<usize>, Vec<usize>)],
    pricer: &mut ExchangePricer,
    origin: &mut [i64],
    g: usize,
) -> GroupOps {
    let (m_n, l_n, chunks) = (grid.num_micro, w.num_layers, pipe.chunks());
    let p_n = cost.passes.len();
    let mut times = vec![0.0; m_n * l_n * p_n];
    let mut buf = Vec::with_capacity(p_n);
    let mut work = vec![0.0; m_n];
    for m in 0..m_n {
        for l in 0..l_n {
            grid.origin(w, g, m, l, origin);
            let attn = grid.attention_max(cost, g, m, l);
            let (so, sl) = &slots[l];
            let lc: LayerCost = pricer.price(topo, cost, origin, attn, so, sl, &[]);
            pipe.pass_times(cost, &lc, (0.0, 0.0), &mut buf);
            times[(m * l_n + l) * p_n..(m * l_n + l + 1) * p_n].copy_from_slice(&buf);
            work[m] += lc.total();
        }
    }
    let runs = pipe
        .runs
        .iter()
        .map(|run| {
            let per = |pass: Option<usize>| {
                let mut t = vec![0.0; m_n * chunks];
                if let Some(p) = pass {
                    for m in 0..m_n {
                        for (l, &c) in pipe.chunk_of_layer.iter().enumerate() {
                            t[m * chunks + c] += times[(m * l_n + l) * p_n + p];
                        }
                    }
                }
                t
            };
            (per(run.forward), per(run.backward))
        })
        .collect();
    GroupOps { runs, sends: pipe.sends(grid, topo, cost, g), work }
}

/// The group's pipeline time with its microbatches run in `order` (order[k]: the microbatch at
/// position k).
fn time_of(pipe: &Pipeline, ops: &GroupOps, order: &[usize], scratch: &mut [Vec<f64>; 3]) -> Result<f64> {
    let chunks = pipe.chunks();
    let m_n = order.len();
    let mut busy = vec![0.0; pipe.pp];
    let mut total = 0.0;
    for (run, (f, b)) in pipe.runs.iter().zip(&ops.runs) {
        let [pf, pb, ps] = scratch;
        for (k, &m) in order.iter().enumerate() {
            pf[k * chunks..(k + 1) * chunks].copy_from_slice(&f[m * chunks..(m + 1) * chunks]);
            pb[k * chunks..(k + 1) * chunks].copy_from_slice(&b[m * chunks..(m + 1) * chunks]);
            let w = chunks - 1;
            ps[k * w..(k + 1) * w].copy_from_slice(&ops.sends[m * w..(m + 1) * w]);
        }
        total += run_makespan(pipe.pp, pipe.vpp, m_n, run.kind, &OpTimes { fwd: pf, bwd: pb, p2p: ps }, &mut busy)?;
    }
    Ok(total)
}

/// The best order found for one group: (order, time in the layout's order, time in the
/// chosen order, evaluations).
fn search(pipe: &Pipeline, ops: &GroupOps, m_n: usize, budget: usize) -> Result<(Vec<usize>, f64, f64, usize)> {
    let chunks = pipe.chunks();
    let mut scratch = [vec![0.0; m_n * chunks], vec![0.0; m_n * chunks], vec![0.0; m_n * (chunks - 1)]];
    let mut used = 0usize;
    let mut eval = |order: &[usize], used: &mut usize| {
        *used += 1;
        time_of(pipe, ops, order, &mut scratch)
    };
    let identity: Vec<usize> = (0..m_n).collect();
    let before = eval(&identity, &mut used)?;
    // microbatches by their summed exchange time, heaviest first (ties: lower one first)
    let mut heavy: Vec<usize> = (0..m_n).collect();
    heavy.sort_by(|&a, &b| ops.work[b].total_cmp(&ops.work[a]).then(a.cmp(&b)));
    let light: Vec<usize> = heavy.iter().rev().copied().collect();
    // the heaviest in the middle: alternate the heavy list onto both sides of the centre
    let mut middle = std::collections::VecDeque::with_capacity(m_n);
    for (i, &m) in light.iter().enumerate() {
        if i % 2 == 0 {
            middle.push_back(m);
        } else {
            middle.push_front(m);
        }
    }
    let middle: Vec<usize> = middle.into_iter().collect();
    // verl's order: heaviest first, then the even positions reversed followed by the odd ones
    let evens: Vec<usize> = heavy.iter().step_by(2).copied().collect();
    let verl: Vec<usize> = evens.into_iter().rev().chain(heavy.iter().skip(1).step_by(2).copied()).collect();
    let (mut best, mut best_t) = (identity.clone(), before);
    for cand in [heavy, light, middle, verl] {
        let t = eval(&cand, &mut used)?;
        if t < best_t {
            (best, best_t) = (cand, t);
        }
    }
    if (2..=m_n).try_fold(1usize, |f, k| f.checked_mul(k)).is_some_and(|f| used + f <= budget) {
        // every order (Heap's algorithm), the best kept
        let mut perm: Vec<usize> = (0..m_n).collect();
        let mut c = vec![0usize; m_n];
        let mut i = 1;
        let t = eval(&perm, &mut used)?;
        if t < best_t {
            (best, best_t) = (perm.clone(), t);
        }
        while i < m_n {
            if c[i] < i {
                perm.swap(if i % 2 == 0 { 0 } else { c[i] }, i);
                let t = eval(&perm, &mut used)?;
                if t < best_t {
                    (best, best_t) = (perm.clone(), t);
                }
                c[i] += 1;
                i = 1;
            } else {
                c[i] = 0;
                i += 1;
            }
        }
        return Ok((best, before, best_t, used));
    }
    // exchanges of two positions, or one microbatch moved elsewhere, while one shortens the pipeline
    let mut improved = true;
    while improved && used < budget {
        improved = false;
        'sweep: for i in 0..m_n {
            for j in 0..m_n {
                if used >= budget {
                    break 'sweep;
                }
                if j > i {
                    best.swap(i, j);
                    let t = eval(&best, &mut used)?;
                    if t < best_t {
                        best_t = t;
                        improved = true;
                    } else {
                        best.swap(i, j);
                    }
                }
                if j != i && used < budget {
                    let mut moved = best.clone();
                    let m = moved.remove(i);
                    moved.insert(j, m);
                    let t = eval(&moved, &mut used)?;
                    if t < best_t {
                        (best, best_t) = (moved, t);
                        improved = true;
                    }
                }
            }
        }
    }
    Ok((best, before, best_t, used))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::static_placement;

    #[test]
    fn a_long_microbatch_moves_out_of_the_fill() {
        // one EP group of 2 ranks, 4 microbatches, pp = 2: microbatch 0 holds long samples
        let topo = Topology::new(2, 2, 2, 2).unwrap().with_pipeline(2, 1, None).unwrap();
        let (l_n, e_n) = (2, 4);
        let lens = vec![4000i64, 4000, 100, 100, 100, 100, 100, 100];
        let counts: Vec<i32> = lens.iter().flat_map(|&n| std::iter::repeat_n((n / 2) as i32, l_n * e_n)).collect();
        let w = WindowView::new(&lens, counts.as_slice(), l_n, e_n).unwrap();
        let cost = CostModel::for_tests(l_n);
        let pl = static_placement(l_n, e_n, &topo).unwrap();
        // samples 2k, 2k + 1 at microbatch k on ranks 0, 1
        let (rank, micro) = (vec![0, 1, 0, 1, 0, 1, 0, 1], vec![0, 0, 1, 1, 2, 2, 3, 3]);
        let (out, rep) = order_microbatches(&w, &topo, &cost, &pl, &rank, &micro, 4, DEFAULT_EVALUATIONS).unwrap();
        assert!(rep.after < rep.before, "{rep:?}");
        assert_ne!(out[0], 0, "the long microbatch left the first position");
        assert_eq!(out[0], out[1], "a microbatch moves whole");
        // a permutation of the microbatches: every one still used once per rank
        let mut micros = out.clone();
        micros.sort_unstable();
        assert_eq!(micros, vec![0, 0, 1, 1, 2, 2, 3, 3]);
        // and simulate agrees that it is faster
        let plan = |m: &[i32]| crate::plan::Plan {
            placement: pl.clone(),
            sample_rank: rank.clone(),
            sample_micro: m.to_vec(),
            num_micro: 4,
            replicas: vec![],
            migration: vec![],
        };
        let a = crate::simulate::simulate(&plan(&micro), &w, &topo, &cost, None).unwrap();
        let b = crate::simulate::simulate(&plan(&out), &w, &topo, &cost, None).unwrap();
        assert!((a.step_time - rep.before).abs() <= 1e-12 * a.step_time && (b.step_time - rep.after).abs() <= 1e-12 * b.step_time);
    }
}
