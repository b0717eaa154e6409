//! Replication planner latency on a flash-shaped window (E = 512, ep = 32 over 4 nodes of 8,
//! dp = 64, 17 slots per rank, static placement, sequential packing at a 65536-token cap),
//! with 4 MoE layers instead of 32 to keep the input small: time scales with layers. A
//! DeepSeek-V3-shaped group (E = 256, ep = 64 over 8 nodes, dp = 256, 5 slots per rank, 8192
//! samples) times routepack where an exchange has twice the ranks (issue 18's scale).
//! Demand: each sample sends a third of its k·n routed tokens to one of 16 topic experts per
//! layer, the rest spread uniformly.

use criterion::{criterion_group, criterion_main, Criterion};
use rand::{RngExt, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use routepack_core::packing::sequential::sequential;
use routepack_core::placement::static_placement;
use routepack_core::replication::hot_n::DEFAULT_HOT_EXPERTS;
use routepack_core::replication::routepack::DEFAULT_REPLICATION_SLOTS;
use routepack_core::replication::{hot_n, relibra, routepack, Packed};
use routepack_core::{Topology, WindowView};
use std::hint::black_box;

mod support;

const L: usize = 4;
const K: usize = 8;

fn window(s_n: usize, e_n: usize) -> (Vec<i64>, Vec<i32>) {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(11);
    let lens: Vec<i64> = (0..s_n).map(|_| 200 + rng.random_range(0..12_000i64)).collect();
    let mut tokens = vec![0i32; s_n * L * e_n];
    for s in 0..s_n {
        let topic = rng.random_range(0..16usize);
        for l in 0..L {
            let row = &mut tokens[(s * L + l) * e_n..(s * L + l + 1) * e_n];
            let routed = lens[s] as usize * K;
            let hot = (topic * 31 + l * 7) % e_n;
            row[hot] += (routed / 3) as i32;
            // the rest in chunks of 32 tokens to uniform experts
            for _ in 0..(routed - routed / 3) / 32 {
                row[rng.random_range(0..e_n)] += 32;
            }
        }
    }
    (lens, tokens)
}

fn replication(c: &mut Criterion) {
    let topo = Topology::new(64, 32, 8, 17).unwrap();
    let (lens, tokens) = window(4096, 512);
    let w = WindowView::new(&lens, &tokens, L, 512).unwrap();
    let cost = support::flash_cost(L);
    let placement = static_placement(L, 512, &topo).unwrap();
    let p = sequential(&lens, 65536, topo.dp).unwrap();
    let packed = Packed { sample_rank: &p.sample_rank, sample_micro: &p.sample_micro, num_micro: p.num_micro };
    let mut g = c.benchmark_group(format!("replication_flash_L{L}_M{}", p.num_micro));
    g.sample_size(10);
    g.bench_function("hot_n", |b| b.iter(|| black_box(hot_n(&w, &topo, &cost, &placement, packed, DEFAULT_HOT_EXPERTS).unwrap())));
    g.bench_function("relibra", |b| {
        b.iter(|| black_box(relibra(&w, &topo, &cost, &placement, packed, DEFAULT_REPLICATION_SLOTS).unwrap()))
    });
    let opts = routepack::Options::default();
    g.bench_function("routepack", |b| b.iter(|| black_box(routepack(&w, &topo, &cost, &placement, packed, &opts).unwrap())));
    g.finish();
}

fn replication_ep64(c: &mut Criterion) {
    let topo = Topology::new(256, 64, 8, 5).unwrap();
    let (lens, tokens) = window(8192, 256);
    let w = WindowView::new(&lens, &tokens, L, 256).unwrap();
    let cost = support::flash_cost(L);
    let placement = static_placement(L, 256, &topo).unwrap();
    let p = sequential(&lens, 65536, topo.dp).unwrap();
    let packed = Packed { sample_rank: &p.sample_rank, sample_micro: &p.sample_micro, num_micro: p.num_micro };
    let mut g = c.benchmark_group(format!("replication_dsv3_L{L}_M{}", p.num_micro));
    g.sample_size(10);
    let opts = routepack::Options::default();
    g.bench_function("routepack", |b| b.iter(|| black_box(routepack(&w, &topo, &cost, &placement, packed, &opts).unwrap())));
    g.finish();
}

criterion_group!(benches, replication, replication_ep64);
criterion_main!(benches);
