//! Shared generators of the core's property tests (one test file per module: `*_props.rs`).
//!
//! Derived randomness (placements, layouts, replicas) comes from a splitmix64 stream
//! seeded by a proptest-drawn u64, so a failing case shrinks to its seed.

// each test file uses only some of these
#![allow(dead_code)]

use proptest::prelude::*;
use routepack_core::cost::CostModel;
use routepack_core::error::Error;
use routepack_core::flow::{route_exchange, ExchangeReplica, Flow};
use routepack_core::migration::diff;
use routepack_core::placement::Placement;
use routepack_core::plan::{Plan, Replica};
use routepack_core::topology::Topology;
use routepack_core::window::WindowView;

/// splitmix64: a small deterministic stream for derived choices.
pub struct Mix(pub u64);

impl Mix {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, n), n >= 1.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    pub fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i + 1));
        }
    }
}

/// (dp, ep, gpus_per_node, slots_per_rank, replica_slots): groups inside a node, spanning
/// nodes, ep = 1; replica buffers from none to more than any exchange can use (mostly the
/// default).
pub fn topologies() -> impl Strategy<Value = Topology> {
    let buffers = prop::sample::select(vec![0usize, 1, 2, 3, 3, 3, 5, 64]);
    (prop::sample::select(vec![1usize, 2, 4, 8]), 1usize..=3, 0usize..4, 1usize..=4, buffers).prop_map(|(ep, mult, g, spr, r)| {
        let gpn = [1usize, 2, 4, 8, 16].iter().copied().filter(|x| x % ep == 0 || ep % x == 0).nth(g % 3).unwrap_or(ep);
        Topology::new(ep * mult, ep, gpn, spr).unwrap().with_replica_slots(r).unwrap()
    })
}

/// An owned window: seq_lens [S] in 1..=max_len, expert_tokens [S, L, E] in 0..=n_s.
#[derive(Clone, Debug)]
pub struct OwnedWindow {
    pub seq_lens: Vec<i64>,
    pub expert_tokens: Vec<i32>,
    pub layers: usize,
    pub experts: usize,
}

impl OwnedWindow {
    pub fn view(&self) -> WindowView<'_> {
        WindowView::new(&self.seq_lens, &self.expert_tokens, self.layers, self.experts).unwrap()
    }
}

pub fn window(mix: &mut Mix, samples: usize, layers: usize, experts: usize, max_len: i64) -> OwnedWindow {
    let seq_lens: Vec<i64> = (0..samples).map(|_| 1 + mix.below(max_len as usize) as i64).collect();
    let mut expert_tokens = vec![0i32; samples * layers * experts];
    for s in 0..samples {
        for x in &mut expert_tokens[s * layers * experts..(s + 1) * layers * experts] {
            if mix.unit() < 0.6 {
                *x = mix.below(seq_lens[s] as usize + 1) as i32;
            }
        }
    }
    OwnedWindow { seq_lens, expert_tokens, layers, experts }
}

/// Random phy2log [L, num_slots]: every expert once, surplus slots empty or redundant copies.
pub fn random_phy2log(mix: &mut Mix, layers: usize, experts: usize, topo: &Topology) -> Vec<i32> {
    let slots = topo.num_slots();
    let mut out = Vec::with_capacity(layers * slots);
    for _ in 0..layers {
        let mut layer: Vec<i32> = (0..experts as i32).collect();
        for _ in experts..slots {
            layer.push(if mix.unit() < 0.6 { mix.below(experts) as i32 } else { -1 });
        }
        mix.shuffle(&mut layer);
        out.extend(layer);
    }
    out
}

/// Random (sample_rank, sample_micro) with every (rank, micro) cell non-empty; S >= dp·M.
pub fn random_layout(mix: &mut Mix, samples: usize, dp: usize, micro: usize) -> (Vec<i32>, Vec<i32>) {
    let cells = dp * micro;
    let mut cell: Vec<usize> = (0..samples).map(|s| if s < cells { s } else { mix.below(cells) }).collect();
    mix.shuffle(&mut cell);
    (cell.iter().map(|&c| (c / micro) as i32).collect(), cell.iter().map(|&c| (c % micro) as i32).collect())
}

/// Replicas that `validate_plan` accepts: hosting src, dst != src, shares summing <= 1
/// per (micro, group, layer, expert), copies of at most `topo.replica_slots` experts on a rank
/// per exchange.
pub fn random_replicas(mix: &mut Mix, placement: &Placement, topo: &Topology, micro: usize) -> Vec<Replica> {
    let mut rows = Vec::new();
    if topo.ep < 2 {
        return rows;
    }
    let spr = topo.slots_per_rank;
    for m in 0..micro {
        for g in 0..topo.num_groups() {
            for l in 0..placement.num_layers {
                // the experts each rank holds copies of in this exchange
                let mut held: Vec<Vec<i32>> = vec![Vec::new(); topo.ep];
                for e in 0..placement.num_experts {
                    if mix.unit() > 0.3 {
                        continue;
                    }
                    let hosts: Vec<usize> =
                        placement.layer(l).iter().enumerate().filter(|(_, &x)| x == e as i32).map(|(p, _)| p / spr).collect();
                    let src = hosts[mix.below(hosts.len())];
                    let n = 1 + mix.below(3);
                    let mut left = 1.0f64;
                    for _ in 0..n {
                        let mut dst = mix.below(topo.ep - 1);
                        if dst >= src {
                            dst += 1;
                        }
                        let share = [0.0, 0.25, 0.5, left, left * mix.unit()][mix.below(5)].min(left) as f32;
                        if !held[dst].contains(&(e as i32)) {
                            if held[dst].len() >= topo.replica_slots {
                                continue;
                            }
                            held[dst].push(e as i32);
                        }
                        left = (left - share as f64).max(0.0); // f32 rounding may take a hair more
                        rows.push(Replica {
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
    mix.shuffle(&mut rows);
    rows
}

/// A valid plan with redundant copies, a random layout, replicas and migration.
pub fn random_plan(mix: &mut Mix, w: &OwnedWindow, topo: &Topology, micro: usize) -> Plan {
    let placement = Placement::new(random_phy2log(mix, w.layers, w.experts, topo), w.layers, w.experts, topo.slots_per_rank).unwrap();
    let previous = Placement::new(random_phy2log(mix, w.layers, w.experts, topo), w.layers, w.experts, topo.slots_per_rank).unwrap();
    let (sample_rank, sample_micro) = random_layout(mix, w.seq_lens.len(), topo.dp, micro);
    let replicas = random_replicas(mix, &placement, topo, micro);
    let migration = diff(&previous, &placement, 42.0).unwrap();
    Plan { placement, sample_rank, sample_micro, num_micro: micro, replicas, migration }
}

pub fn cell_tokens(plan: &Plan, seq_lens: &[i64], dp: usize) -> Vec<i64> {
    let mut t = vec![0i64; dp * plan.num_micro];
    for (s, &n) in seq_lens.iter().enumerate() {
        t[plan.sample_rank[s] as usize * plan.num_micro + plan.sample_micro[s] as usize] += n;
    }
    t
}

pub fn is_plan_error(r: &Result<(), Error>) -> bool {
    matches!(r, Err(Error::InvalidPlan(_)))
}

/// Sizes around the edges: small, and values whose products overflow.
pub fn usizes() -> impl Strategy<Value = usize> {
    prop_oneof![0usize..6, Just(usize::MAX), Just(usize::MAX / 2 + 1), Just(1usize << 32)]
}

/// Calls `f(g, l, flows)` for every exchange (group g, step, layer l) of a valid `plan` on `w`,
/// with the exchange's flow table from `flow::route_exchange` (the routing rule), built from the
/// window and the plan directly, not through the simulator: a reference the simulator's
/// prices and byte counts are checked against.
pub fn for_each_exchange_flows(plan: &Plan, w: &OwnedWindow, topo: &Topology, mut f: impl FnMut(usize, usize, &[Flow])) {
    let (e_n, ep) = (w.experts, topo.ep);
    let mut flows = Vec::new();
    for g in 0..topo.num_groups() {
        for m in 0..plan.num_micro {
            for l in 0..w.layers {
                let mut origin = vec![0i64; ep * e_n];
                for (s, (&d, &mm)) in plan.sample_rank.iter().zip(&plan.sample_micro).enumerate() {
                    let (d, mm) = (d as usize, mm as usize);
                    if d / ep == g && mm == m {
                        for e in 0..e_n {
                            origin[(d % ep) * e_n + e] += w.expert_tokens[(s * w.layers + l) * e_n + e] as i64;
                        }
                    }
                }
                let reps: Vec<ExchangeReplica> = plan
                    .replicas
                    .iter()
                    .filter(|x| (x.group, x.micro, x.layer) == (g as i32, m as i32, l as i32))
                    .map(|x| (x.expert as usize, x.dst_rank as usize, x.share))
                    .collect();
                let (so, sl) = plan.placement.replicas_of_layer(l);
                flows.clear();
                route_exchange(&origin, e_n, &so, &sl, &reps, topo, &mut flows);
                f(g, l, &flows);
            }
        }
    }
}

/// A random case of the cost-option tests: a window of `topo.dp · micro + extra` samples of up to
/// `max_len` tokens over 1–3 layers and 1..=slots experts, and a random valid plan of it (with
/// replicas and migration) in `micro` steps; `w.layers` is the layer count.
pub fn random_case(mix: &mut Mix, topo: &Topology, micro: usize, extra: usize, max_len: i64) -> (OwnedWindow, Plan) {
    let layers = 1 + mix.below(3);
    let experts = 1 + mix.below(topo.num_slots());
    let w = window(mix, topo.dp * micro + extra, layers, experts, max_len);
    let plan = random_plan(mix, &w, topo, micro);
    (w, plan)
}

/// `[G]` Σ_m Σ_l 3 · max_p (c_call·[p has tokens] + Σ_{e active on p} (c_exp + max(c_tok·t,
/// c_weights) + c_gemm·[t ≥ 2] + table(t))):
/// the expert term of every group written out from the formula over the flow tables
/// ([`for_each_exchange_flows`], the routing rule), not through the simulator or `CostModel`'s
/// methods.
pub fn expert_times_from_flows(plan: &Plan, w: &OwnedWindow, topo: &Topology, cost: &CostModel) -> Vec<f64> {
    let (e_n, ep) = (w.experts, topo.ep);
    let mut out = vec![0.0; topo.num_groups()];
    for_each_exchange_flows(plan, w, topo, |g, _, flows| {
        let mut t = vec![0i64; ep * e_n];
        for f in flows {
            t[f.dst_rank * e_n + f.expert] += f.count;
        }
        let x_max = (0..ep)
            .map(|p| {
                let experts = (0..e_n)
                    .map(|e| t[p * e_n + e])
                    .filter(|&n| n > 0)
                    .map(|n| {
                        let step = if n >= 2 { cost.c_gemm } else { 0.0 };
                        cost.c_exp + (cost.c_tok * n as f64).max(cost.c_weights) + step + table_at(cost, n as f64)
                    })
                    .sum::<f64>();
                let has_tokens = (0..e_n).any(|e| t[p * e_n + e] > 0);
                experts + if has_tokens { cost.c_call } else { 0.0 }
            })
            .fold(0.0, f64::max);
        out[g] += 3.0 * x_max;
    });
    out
}

/// `cost.expert_table` at `t` tokens per expert, written out from its definition (linear
/// between the two knots around t, the end knots' seconds outside them) by a linear scan, not
/// through `CostModel::table_extra`.
pub fn table_at(cost: &CostModel, t: f64) -> f64 {
    let knots = &cost.expert_table;
    match (knots.first(), knots.last()) {
        (None, _) | (_, None) => 0.0,
        (Some(&(t0, s0)), _) if t <= t0 => s0,
        (_, Some(&(t1, s1))) if t >= t1 => s1,
        _ => {
            let i = (1..knots.len()).find(|&i| knots[i].0 >= t).unwrap();
            let ((a, sa), (b, sb)) = (knots[i - 1], knots[i]);
            sa + (sb - sa) * (t - a) / (b - a)
        }
    }
}

/// `cost` with only expert work priced: no attention, no token, weight or gradient bytes.
pub fn expert_work_only(cost: &mut CostModel) {
    cost.a_lin = 0.0;
    cost.a_quad.iter_mut().for_each(|x| *x = 0.0);
    cost.token_bytes = 0.0;
    cost.expert_weight_bytes = 0.0;
    cost.expert_grad_bytes = 0.0;
}

/// Equal to within 1e-9 of the larger (floats summed in another order).
pub fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs())
}

/// With only expert work priced (`expert_work_only` on a copy of `cost`), every group's time
/// from `simulate` is the direct sum over the flow tables (`expert_times_from_flows`).
pub fn check_expert_term(plan: &Plan, w: &OwnedWindow, topo: &Topology, cost: &CostModel) -> Result<(), TestCaseError> {
    use routepack_core::simulate::simulate;

    let mut cost = cost.clone();
    expert_work_only(&mut cost);
    let rep = simulate(plan, &w.view(), topo, &cost, None).unwrap();
    let want = expert_times_from_flows(plan, w, topo, &cost);
    for (g, (&got, &want)) in rep.group_times.iter().zip(&want).enumerate() {
        prop_assert!(close(got, want), "group {}: simulate {} vs direct sum {}", g, got, want);
    }
    Ok(())
}

/// Every replication planner's plans, under the cost model `make_cost(mix, layers)` draws (cheap
/// copies half the time), validate, stay above the lower bound, and routepack's never make a
/// group slower than the same plan without replicas; 150 cases of random topologies, windows of
/// short samples, placements and layouts. Panics with the failing case.
pub fn check_replication_planners(make_cost: impl Fn(&mut Mix, usize) -> CostModel) {
    use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
    use routepack_core::replication::{plan_block, routepack::Options, Block, Packed, Planner};
    use routepack_core::simulate::simulate;
    use routepack_core::validate::validate_plan;
    let mut runner = TestRunner::new_with_rng(
        Config { cases: 150, failure_persistence: None, ..Config::default() },
        TestRng::deterministic_rng(RngAlgorithm::ChaCha),
    );
    let rows_seen = std::cell::Cell::new(0usize);
    runner
        .run(&(topologies(), any::<u64>()), |(topo, seed)| {
            let mut mix = Mix(seed);
            let micro = 1 + mix.below(3);
            let samples = topo.dp * micro + mix.below(2 * topo.dp + 3);
            let layers = 1 + mix.below(3);
            let experts = 1 + mix.below(topo.num_slots().min(12));
            let max_len = [8, 60][mix.below(2)];
            let w = window(&mut mix, samples, layers, experts, max_len);
            let view = w.view();
            let placement = Placement::new(random_phy2log(&mut mix, layers, experts, &topo), layers, experts, topo.slots_per_rank).unwrap();
            let (rank, step) = random_layout(&mut mix, samples, topo.dp, micro);
            let packed = Packed { sample_rank: &rank, sample_micro: &step, num_micro: micro };
            let mut cost = make_cost(&mut mix, layers);
            if mix.unit() < 0.5 {
                cost.expert_weight_bytes = 1e3;
                cost.expert_grad_bytes = 2e3;
                cost.c_exp = 1e-9;
            }
            let bare = Plan {
                placement: placement.clone(),
                sample_rank: rank.clone(),
                sample_micro: step.clone(),
                num_micro: micro,
                replicas: Vec::new(),
                migration: Vec::new(),
            };
            let base = simulate(&bare, &view, &topo, &cost, None).unwrap();
            let planners = [
                Planner::HotN(1 + mix.below(3)),
                Planner::Relibra(1 + mix.below(2)),
                Planner::Routepack(Options { replication_slots: 1 + mix.below(4), ..Options::default() }),
            ];
            for planner in &planners {
                let replicas = plan_block(&view, &topo, &cost, &placement, packed, planner, Block::ALL).unwrap();
                rows_seen.set(rows_seen.get() + replicas.len());
                let plan = Plan { replicas, ..bare.clone() };
                prop_assert!(validate_plan(&plan, &view, &topo, i64::MAX).is_ok(), "{:?}: invalid plan", planner);
                let r = simulate(&plan, &view, &topo, &cost, None).unwrap();
                prop_assert!(r.lower_bound_time <= r.step_time * (1.0 + 1e-12));
                if let Planner::Routepack(_) = planner {
                    for (g, (x, y)) in base.group_times.iter().zip(&r.group_times).enumerate() {
                        prop_assert!(*y <= x * (1.0 + 1e-12), "group {}: {} with replicas vs {} without", g, y, x);
                    }
                }
            }
            Ok(())
        })
        .unwrap();
    assert!(rows_seen.get() > 100, "only {} replica rows in all cases", rows_seen.get());
}
