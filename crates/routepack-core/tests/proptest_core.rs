//! Property tests of the core over random windows, topologies and plans:
//! * sequential packing never exceeds the cap, and plans built from the static placement and
//!   sequential packing pass `validate_plan` (and price under `simulate`);
//! * `flow::route_expert` conserves tokens and follows its documented rule (replica rows take
//!   round(share·T) in table order, locality-first; the rest splits evenly with a rotating
//!   remainder);
//! * ingestion equals a naive count;
//! * `validate_plan` rejects corrupted plans;
//! * malformed inputs to the public functions that return `Result` give `Err`, never a panic.
//!
//! Derived randomness (placements, layouts, replica rows) comes from a splitmix64 stream
//! seeded by a proptest-drawn u64, so a failing case shrinks to its seed.

use proptest::prelude::*;
use routepack_core::cost::CostModel;
use routepack_core::error::Error;
use routepack_core::flow::{route_expert, Dest};
use routepack_core::ingest::{check_cu_seqlens, expert_tokens_from_routed, ExpertId};
use routepack_core::migration::diff;
use routepack_core::packing::rows::{check_cap, equalise_rows};
use routepack_core::packing::sequential::sequential;
use routepack_core::placement::{static_placement, Placement};
use routepack_core::plan::{MigrationRow, Plan, ReplicaRow};
use routepack_core::simulate::simulate;
use routepack_core::topology::Topology;
use routepack_core::validate::validate_plan;
use routepack_core::window::WindowView;

// ------------------------------------------------------------------ helpers

/// splitmix64: a small deterministic stream for derived choices.
struct Mix(u64);

impl Mix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, n), n >= 1.
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i + 1));
        }
    }
}

/// (dp, ep, gpus_per_node, slots_per_rank): groups inside a node, spanning nodes, ep = 1.
fn topologies() -> impl Strategy<Value = Topology> {
    (prop::sample::select(vec![1usize, 2, 4, 8]), 1usize..=3, 0usize..4, 1usize..=4).prop_map(|(ep, mult, g, spr)| {
        let gpn = [1usize, 2, 4, 8, 16].iter().copied().filter(|x| x % ep == 0 || ep % x == 0).nth(g % 3).unwrap_or(ep);
        Topology::new(ep * mult, ep, gpn, spr).unwrap()
    })
}

/// An owned window: seq_lens [S] in 1..=max_len, expert_tokens [S, L, E] in 0..=n_s.
#[derive(Clone, Debug)]
struct OwnedWindow {
    seq_lens: Vec<i64>,
    expert_tokens: Vec<i32>,
    layers: usize,
    experts: usize,
}

impl OwnedWindow {
    fn view(&self) -> WindowView<'_> {
        WindowView::new(&self.seq_lens, &self.expert_tokens, self.layers, self.experts).unwrap()
    }
}

fn window(mix: &mut Mix, samples: usize, layers: usize, experts: usize, max_len: i64) -> OwnedWindow {
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
fn random_phy2log(mix: &mut Mix, layers: usize, experts: usize, topo: &Topology) -> Vec<i32> {
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
fn random_layout(mix: &mut Mix, samples: usize, dp: usize, micro: usize) -> (Vec<i32>, Vec<i32>) {
    let cells = dp * micro;
    let mut cell: Vec<usize> = (0..samples).map(|s| if s < cells { s } else { mix.below(cells) }).collect();
    mix.shuffle(&mut cell);
    (cell.iter().map(|&c| (c / micro) as i32).collect(), cell.iter().map(|&c| (c % micro) as i32).collect())
}

/// Replica rows that `validate_plan` accepts: hosting src, dst != src, shares summing <= 1
/// per (micro, group, layer, expert).
fn random_replicas(mix: &mut Mix, placement: &Placement, topo: &Topology, micro: usize) -> Vec<ReplicaRow> {
    let mut rows = Vec::new();
    if topo.ep < 2 {
        return rows;
    }
    let spr = topo.slots_per_rank;
    for m in 0..micro {
        for g in 0..topo.num_groups() {
            for l in 0..placement.num_layers {
                for e in 0..placement.num_experts {
                    if mix.unit() > 0.3 {
                        continue;
                    }
                    let hosts: Vec<usize> = placement
                        .layer(l)
                        .iter()
                        .enumerate()
                        .filter(|(_, &x)| x == e as i32)
                        .map(|(p, _)| p / spr)
                        .collect();
                    let src = hosts[mix.below(hosts.len())];
                    let n = 1 + mix.below(3);
                    let mut left = 1.0f64;
                    for _ in 0..n {
                        let mut dst = mix.below(topo.ep - 1);
                        if dst >= src {
                            dst += 1;
                        }
                        let share = [0.0, 0.25, 0.5, left, left * mix.unit()][mix.below(5)].min(left) as f32;
                        left = (left - share as f64).max(0.0); // f32 rounding may take a hair more
                        rows.push(ReplicaRow {
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
fn random_plan(mix: &mut Mix, w: &OwnedWindow, topo: &Topology, micro: usize) -> Plan {
    let placement = Placement::new(random_phy2log(mix, w.layers, w.experts, topo), w.layers, w.experts, topo.slots_per_rank).unwrap();
    let previous = Placement::new(random_phy2log(mix, w.layers, w.experts, topo), w.layers, w.experts, topo.slots_per_rank).unwrap();
    let (sample_rank, sample_micro) = random_layout(mix, w.seq_lens.len(), topo.dp, micro);
    let replicas = random_replicas(mix, &placement, topo, micro);
    let migration = diff(&previous, &placement, 42.0).unwrap();
    Plan { placement, sample_rank, sample_micro, num_micro: micro, replicas, migration }
}

fn cell_tokens(plan: &Plan, seq_lens: &[i64], dp: usize) -> Vec<i64> {
    let mut t = vec![0i64; dp * plan.num_micro];
    for (s, &n) in seq_lens.iter().enumerate() {
        t[plan.sample_rank[s] as usize * plan.num_micro + plan.sample_micro[s] as usize] += n;
    }
    t
}

fn is_plan_error(r: &Result<(), Error>) -> bool {
    matches!(r, Err(Error::InvalidPlan(_)))
}

// ------------------------------------------------------ packing and validate

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn sequential_respects_cap_and_static_plans_validate(
        topo in topologies(),
        seed in any::<u64>(),
        samples in 1usize..40,
        layers in 1usize..3,
        cap_extra in 0i64..200,
    ) {
        let mut mix = Mix(seed);
        let experts = 1 + mix.below(topo.num_slots().min(8));
        let w = window(&mut mix, samples, layers, experts, 100);
        let cap = *w.seq_lens.iter().max().unwrap() + cap_extra;
        let packed = sequential(&w.seq_lens, cap, topo.dp);
        let p = match packed {
            Err(Error::Infeasible(msg)) => {
                // refused only when the ranks cannot all be filled
                prop_assert!(samples < topo.dp || msg.contains("single-sample rows"), "{msg}");
                return Ok(());
            }
            Err(e) => return Err(TestCaseError::fail(format!("unexpected error {e}"))),
            Ok(p) => p,
        };
        prop_assert_eq!(p.sample_rank.len(), samples);
        let placement = static_placement(layers, experts, &topo).unwrap();
        let plan = Plan {
            placement,
            sample_rank: p.sample_rank.clone(),
            sample_micro: p.sample_micro.clone(),
            num_micro: p.num_micro,
            replicas: vec![],
            migration: vec![],
        };
        let tokens = cell_tokens(&plan, &w.seq_lens, topo.dp);
        prop_assert!(tokens.iter().all(|&t| t > 0 && t <= cap), "cells {:?} cap {}", tokens, cap);
        prop_assert_eq!(tokens.iter().sum::<i64>(), w.seq_lens.iter().sum::<i64>());
        let view = w.view();
        prop_assert!(validate_plan(&plan, &view, &topo, cap).is_ok());
        let rep = simulate(&plan, &view, &topo, &CostModel::for_tests(layers), None).unwrap();
        prop_assert!(rep.step_time.is_finite() && rep.step_time > 0.0);
        let parts = rep.attention + rep.expert + rep.all_to_all + rep.replication + rep.migration;
        prop_assert!((parts - rep.step_time).abs() <= 1e-9 * rep.step_time);
    }

    #[test]
    fn a_sample_over_the_cap_is_named(lens in prop::collection::vec(1i64..50, 1..20), pick in any::<prop::sample::Index>(), dp in 1usize..4) {
        let mut lens = lens;
        let s = pick.index(lens.len());
        lens[s] = 100;
        let first = lens.iter().position(|&n| n > 60).unwrap();
        match sequential(&lens, 60, dp) {
            Err(Error::Infeasible(msg)) => prop_assert!(msg.contains(&format!("sample {first} has 100 tokens")), "{msg}"),
            other => return Err(TestCaseError::fail(format!("expected Infeasible, got {other:?}"))),
        }
    }

    #[test]
    fn random_plans_validate_and_corruptions_are_rejected(
        topo in topologies(),
        seed in any::<u64>(),
        micro in 1usize..3,
        extra in 0usize..10,
        kind in 0usize..14,
    ) {
        let mut mix = Mix(seed);
        let layers = 1 + mix.below(3);
        let experts = 1 + mix.below(topo.num_slots());
        let w = window(&mut mix, topo.dp * micro + extra, layers, experts, 60);
        let view = w.view();
        let plan = random_plan(&mut mix, &w, &topo, micro);
        let cap = *cell_tokens(&plan, &w.seq_lens, topo.dp).iter().max().unwrap();
        let ok = validate_plan(&plan, &view, &topo, cap);
        prop_assert!(ok.is_ok(), "{:?}", ok);
        prop_assert!(simulate(&plan, &view, &topo, &CostModel::for_tests(layers), None).is_ok());

        let mut bad = plan.clone();
        let mut bad_cap = cap;
        let s = mix.below(w.seq_lens.len());
        match kind {
            0 => bad.sample_rank[s] = topo.dp as i32,
            1 => bad.sample_rank[s] = -1,
            2 => bad.sample_micro[s] = micro as i32,
            3 => bad.sample_micro[s] = -1,
            4 => bad.num_micro += 1,                     // a step with empty cells
            5 => { bad.sample_rank.pop(); }              // a sample missing
            6 => bad_cap = cap - 1,                       // the fullest cell is over the cap
            7..=11 => {
                if bad.replicas.is_empty() {
                    return Ok(());
                }
                let i = mix.below(bad.replicas.len());
                let spr = topo.slots_per_rank;
                let r = bad.replicas[i];
                match kind {
                    7 => bad.replicas[i].share = [-0.5f32, 1.5, f32::NAN, f32::INFINITY][mix.below(4)],
                    8 => bad.replicas[i].dst_rank = r.src_rank,
                    9 => {
                        let hosts: Vec<usize> = bad.placement.layer(r.layer as usize).iter().enumerate()
                            .filter(|(_, &x)| x == r.expert).map(|(p, _)| p / spr).collect();
                        match (0..topo.ep).find(|q| !hosts.contains(q) && *q != r.dst_rank as usize) {
                            Some(q) => bad.replicas[i].src_rank = q as i32,
                            None => return Ok(()),
                        }
                    }
                    10 => {
                        let mut twin = r;
                        twin.share = 1.0;
                        bad.replicas[i].share = 0.5;
                        bad.replicas.push(twin);
                    }
                    _ => bad.replicas[i].group = topo.num_groups() as i32,
                }
            }
            12 => {
                if bad.migration.is_empty() || experts < 2 {
                    return Ok(());
                }
                let i = mix.below(bad.migration.len());
                bad.migration[i].expert = (bad.migration[i].expert + 1) % experts as i32;
            }
            _ => {
                if bad.migration.is_empty() {
                    return Ok(());
                }
                let i = mix.below(bad.migration.len());
                bad.migration[i].bytes = [-1.0, f64::NAN][mix.below(2)];
            }
        }
        let r = validate_plan(&bad, &view, &topo, bad_cap);
        prop_assert!(is_plan_error(&r), "kind {} accepted: {:?}", kind, r);
        if kind != 6 {
            prop_assert!(simulate(&bad, &view, &topo, &CostModel::for_tests(layers), None).is_err());
        }
    }
}

// --------------------------------------------------------------------- flow

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
            let mine: Vec<_> = flows.iter().filter(|f| f.2 == Dest::Replica { rank: dst, row }).collect();
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
        // the rest: an even split with a remainder that rotates with the origin
        let c = slots.len() as i64;
        for (r, &left) in rem.iter().enumerate() {
            for (j, &p) in slots.iter().enumerate() {
                let got: i64 = flows.iter().filter(|f| f.0 == r && f.2 == Dest::Slot(p)).map(|f| f.3).sum();
                let extra = i64::from((j as i64 - r as i64).rem_euclid(c) < left % c);
                prop_assert_eq!(got, left / c + extra, "origin {} slot {}", r, p);
                if got > 0 {
                    prop_assert!(flows.iter().any(|f| f.0 == r && f.2 == Dest::Slot(p) && f.1 == topo.rank_of_slot(p)));
                }
            }
        }
    }
}

// ------------------------------------------------------------------- ingest

fn naive_count<T: ExpertId>(routed: &[T], layers: usize, k: usize, cu: &[i64], experts: usize) -> Vec<i32> {
    let s_n = cu.len() - 1;
    let mut out = vec![0i32; s_n * layers * experts];
    for s in 0..s_n {
        for t in cu[s] as usize..cu[s + 1] as usize {
            for l in 0..layers {
                for j in 0..k {
                    let id = routed[(t * layers + l) * k + j].value() as usize;
                    out[(s * layers + l) * experts + id] += 1;
                }
            }
        }
    }
    out
}

fn check_ingest<T: ExpertId + std::fmt::Debug>(ids: &[T], layers: usize, k: usize, cu: &[i64], experts: usize) -> Result<(), TestCaseError> {
    let (lens, counts) = expert_tokens_from_routed(ids, layers, k, cu, experts).map_err(|e| TestCaseError::fail(e.to_string()))?;
    prop_assert_eq!(lens, cu.windows(2).map(|w| w[1] - w[0]).collect::<Vec<_>>());
    prop_assert_eq!(counts, naive_count(ids, layers, k, cu, experts));
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn ingest_equals_naive_count(seed in any::<u64>(), tokens in 1usize..60, layers in 1usize..4, k in 1usize..5, experts in 1usize..200, dtype in 0usize..4) {
        let mut mix = Mix(seed);
        let experts = if dtype == 0 { experts.min(256) } else { experts };
        let raw: Vec<usize> = (0..tokens * layers * k).map(|_| mix.below(experts)).collect();
        let mut cuts: Vec<i64> = (1..tokens as i64).filter(|_| mix.unit() < 0.3).collect();
        cuts.insert(0, 0);
        cuts.push(tokens as i64);
        match dtype {
            0 => check_ingest(&raw.iter().map(|&x| x as u8).collect::<Vec<_>>(), layers, k, &cuts, experts)?,
            1 => check_ingest(&raw.iter().map(|&x| x as i16).collect::<Vec<_>>(), layers, k, &cuts, experts)?,
            2 => check_ingest(&raw.iter().map(|&x| x as i32).collect::<Vec<_>>(), layers, k, &cuts, experts)?,
            _ => check_ingest(&raw.iter().map(|&x| x as i64).collect::<Vec<_>>(), layers, k, &cuts, experts)?,
        }
    }

    #[test]
    fn ingest_names_a_bad_id(tokens in 1usize..30, layers in 1usize..4, k in 1usize..4, at in any::<prop::sample::Index>(), bad in prop_oneof![Just(-1i64), Just(i64::MIN), 8i64..1000]) {
        let mut ids = vec![0i64; tokens * layers * k];
        let i = at.index(ids.len());
        ids[i] = bad;
        let e = expert_tokens_from_routed(&ids, layers, k, &[0, tokens as i64], 8).unwrap_err();
        let (t, l) = (i / (layers * k), (i / k) % layers);
        prop_assert!(e.to_string().contains(&format!("expert id {bad} at token {t} (sample 0), layer {l}")), "{}", e);
    }
}

// -------------------------------------------------- malformed inputs: Err, no panic

fn usizes() -> impl Strategy<Value = usize> {
    prop_oneof![0usize..6, Just(usize::MAX), Just(usize::MAX / 2 + 1), Just(1usize << 32)]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn topology_and_static_placement_never_panic(dp in usizes(), ep in usizes(), gpn in usizes(), spr in usizes(), layers in 0usize..3, experts in 0usize..12) {
        if let Ok(topo) = Topology::new(dp, ep, gpn, spr) {
            prop_assert!(dp >= 1 && ep >= 1 && dp % ep == 0);
            let _ = topo.check_experts(experts);
            if topo.check_experts(experts).is_ok() && (spr as u128) * (ep as u128) <= 64 {
                let p = static_placement(layers, experts, &topo);
                prop_assert_eq!(p.is_ok(), layers >= 1 && experts >= 1);
            }
        }
    }

    #[test]
    fn placement_new_never_panics(vals in prop::collection::vec(-3i32..9, 0..24), layers in usizes(), experts in 1usize..10, spr in usizes()) {
        if let Ok(p) = Placement::new(vals.clone(), layers, experts, spr) {
            prop_assert!(layers >= 1 && spr >= 1 && vals.len() % layers == 0);
            prop_assert!(p.logcnt().iter().all(|&c| c >= 1));
        }
    }

    #[test]
    fn window_view_never_panics(lens in prop::collection::vec(-2i64..5, 0..6), tokens in prop::collection::vec(-1i32..5, 0..30), layers in usizes(), experts in usizes()) {
        if let Ok(w) = WindowView::new(&lens, &tokens, layers, experts) {
            prop_assert_eq!(tokens.len(), lens.len() * layers * experts);
            prop_assert!(lens.iter().all(|&n| n >= 1) && tokens.iter().all(|&x| x >= 0));
            let _ = w.layer_expert_load();
        }
    }

    #[test]
    fn ingest_never_panics(ids in prop::collection::vec(-2i32..6, 0..40), layers in usizes(), k in usizes(), cu in prop::collection::vec(-2i64..45, 0..5), experts in prop_oneof![0usize..8, Just(usize::MAX)]) {
        let _ = check_cu_seqlens(&cu, ids.len());
        if let Ok((lens, counts)) = expert_tokens_from_routed(&ids, layers, k, &cu, experts) {
            prop_assert_eq!(counts.len(), lens.len() * layers * experts);
        }
    }

    #[test]
    fn packing_never_panics(lens in prop::collection::vec(-3i64..40, 0..20), cap in prop_oneof![-2i64..60, Just(i64::MAX)], dp in 0usize..6) {
        let _ = check_cap(&lens, cap);
        if let Ok(p) = sequential(&lens, cap, dp) {
            prop_assert_eq!(p.sample_rank.len(), lens.len());
            prop_assert!(p.num_micro >= 1);
        }
    }

    #[test]
    fn equalise_rows_never_panics(lens in prop::collection::vec(1i64..40, 1..12), dp in 0usize..6, seed in any::<u64>()) {
        // rows: a random partition of the samples
        let mut mix = Mix(seed);
        let mut rows: Vec<Vec<usize>> = Vec::new();
        for s in 0..lens.len() {
            if rows.is_empty() || mix.unit() < 0.4 { rows.push(vec![s]) } else { let i = mix.below(rows.len()); rows[i].push(s) }
        }
        if equalise_rows(&mut rows, &lens, dp).is_ok() {
            prop_assert!(dp >= 1 && rows.len() >= dp && rows.len() / dp * dp == rows.len() && rows.iter().all(|r| !r.is_empty()));
        }
    }

    #[test]
    fn validate_and_simulate_never_panic(
        topo in topologies(),
        seed in any::<u64>(),
        sample_rank in prop::collection::vec(-1i32..9, 1..12),
        sample_micro in prop::collection::vec(-1i32..3, 1..12),
        num_micro in 0usize..3,
        reps in prop::collection::vec((-1i32..3, -1i32..3, -1i32..3, -1i32..4, -1i32..9, -1i32..9, prop_oneof![-1.0f32..2.0, Just(f32::NAN)]), 0..4),
        migs in prop::collection::vec((-1i32..3, -1i32..4, -1i32..9, -1i32..9, -1i32..40, -1i32..40, prop_oneof![-1.0f64..9.0, Just(f64::NAN)]), 0..4),
        bad_cost in 0usize..4,
    ) {
        let mut mix = Mix(seed);
        let layers = 1 + mix.below(2);
        let experts = 1 + mix.below(topo.num_slots());
        let w = window(&mut mix, sample_rank.len(), layers, experts, 30);
        let placement = Placement::new(random_phy2log(&mut mix, layers, experts, &topo), layers, experts, topo.slots_per_rank).unwrap();
        let plan = Plan {
            placement,
            sample_rank,
            sample_micro,
            num_micro,
            replicas: reps.iter().map(|&(micro, group, layer, expert, src_rank, dst_rank, share)| ReplicaRow { micro, group, layer, expert, src_rank, dst_rank, share }).collect(),
            migration: migs.iter().map(|&(layer, expert, src_rank, dst_rank, src_slot, dst_slot, bytes)| MigrationRow { layer, expert, src_rank, dst_rank, src_slot, dst_slot, bytes }).collect(),
        };
        let view = w.view();
        let _ = validate_plan(&plan, &view, &topo, 50);
        let mut cost = CostModel::for_tests(layers);
        match bad_cost {
            1 => cost.a_quad.push(0.0),
            2 => cost.bw_inter = f64::NAN,
            3 => cost.c_tok = -1.0,
            _ => {}
        }
        if let Ok(rep) = simulate(&plan, &view, &topo, &cost, Some(1 + mix.below(3))) {
            prop_assert!(bad_cost == 0 && validate_plan(&plan, &view, &topo, i64::MAX).is_ok());
            prop_assert!(rep.step_time.is_finite() && rep.step_time > 0.0);
        }
    }

    #[test]
    fn migration_diff_never_panics(topo in topologies(), seed in any::<u64>(), other in topologies()) {
        let mut mix = Mix(seed);
        let layers = 1 + mix.below(2);
        let experts = 1 + mix.below(topo.num_slots().min(other.num_slots()));
        let a = Placement::new(random_phy2log(&mut mix, layers, experts, &topo), layers, experts, topo.slots_per_rank).unwrap();
        let b = Placement::new(random_phy2log(&mut mix, layers, experts, &other), layers, experts, other.slots_per_rank).unwrap();
        match diff(&a, &b, 7.0) {
            Ok(rows) => {
                prop_assert_eq!(a.num_slots, b.num_slots);
                for r in rows {
                    prop_assert_eq!(b.layer(r.layer as usize)[r.dst_slot as usize], r.expert);
                    prop_assert_eq!(a.layer(r.layer as usize)[r.src_slot as usize], r.expert);
                    prop_assert_eq!(r.bytes == 0.0, r.src_rank == r.dst_rank);
                }
            }
            Err(e) => prop_assert!(a.num_slots != b.num_slots || a.slots_per_rank != b.slots_per_rank, "{}", e),
        }
    }
}

/// A placement must give every logical expert a slot (DESIGN.md): with no experts or no
/// slots there is nothing to place, and `check` would otherwise walk every (possibly
/// astronomically many) empty layer.
#[test]
fn empty_placements_are_refused() {
    assert!(Placement::new(vec![], 3, 0, 1).is_err(), "no experts");
    assert!(Placement::new(vec![0, 0], 2, 0, 1).is_err(), "num_experts = 0");
}
