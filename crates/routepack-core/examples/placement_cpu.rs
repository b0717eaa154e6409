//! CPU time of one placement call, for reading the latency targets on a shared machine:
//! run it under `RAYON_NUM_THREADS=1 perf stat -e task-clock` (or `time`) and divide by the
//! call count. Same synthetic loads as `benches/placement.rs`.
//!
//!     cargo run --release --example placement_cpu -- <reference|flash> <calls> [fluct_evals] [eplb|routepack|migration]

use rand::{RngExt, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use routepack_core::placement::demand::Demand;
use routepack_core::placement::eplb::rebalance_experts;
use routepack_core::placement::routepack::{routepack_placement, Options};
use routepack_core::{CostModel, Topology};

const CHUNKS: usize = 32;

fn normal(rng: &mut Xoshiro256PlusPlus) -> f64 {
    let u: f64 = rng.random::<f64>().max(1e-12);
    let v: f64 = rng.random::<f64>();
    (-2.0f64 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
}

/// The bench's loads: `(loads [L, E], chunks [L, E, B])` (see `benches/placement.rs`).
fn synthetic(layers: usize, experts: usize, chunks: usize, seed: u64) -> (Vec<f64>, Vec<f64>) {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let topics = 16;
    let mut loads = vec![0.0; layers * experts];
    let mut demand = vec![0.0; layers * experts * chunks];
    for l in 0..layers {
        let spread = 0.4 + rng.random::<f64>();
        let base: Vec<f64> = (0..experts).map(|_| normal(&mut rng) * spread).collect();
        let boost: Vec<Vec<f64>> = (0..topics)
            .map(|_| (0..experts).map(|_| if rng.random::<f64>() < 0.06 { 2.2 * (0.5 + 0.5 * rng.random::<f64>()) } else { 0.0 }).collect())
            .collect();
        for b in 0..chunks {
            let mix: Vec<usize> = (0..4).map(|_| rng.random_range(0..topics)).collect();
            let mut p: Vec<f64> = (0..experts).map(|e| mix.iter().map(|&t| (base[e] + boost[t][e]).exp()).sum::<f64>()).collect();
            let z: f64 = p.iter().sum();
            p.iter_mut().for_each(|x| *x *= 1.0e6 / z);
            for e in 0..experts {
                demand[(l * experts + e) * chunks + b] = p[e].round();
                loads[l * experts + e] += p[e].round();
            }
        }
    }
    (loads, demand)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let usage = "usage: placement_cpu <reference|flash> <calls> [fluct_evals] [eplb|routepack|migration]";
    let (size, calls) = match (args.get(1), args.get(2).and_then(|x| x.parse::<usize>().ok())) {
        (Some(s), Some(c)) => (s.as_str(), c),
        _ => {
            eprintln!("{usage}");
            std::process::exit(2);
        }
    };
    let evals: usize = args.get(3).and_then(|x| x.parse().ok()).unwrap_or(Options::default().fluct_evals);
    let what = args.get(4).map(String::as_str).unwrap_or("routepack");
    let (layers, experts, topo, groups) = match size {
        "reference" => (58, 256, Topology::new(64, 32, 8, 9).unwrap(), 8),
        "flash" => (32, 512, Topology::new(64, 32, 8, 17).unwrap(), 4),
        _ => {
            eprintln!("{usage}");
            std::process::exit(2);
        }
    };
    let (loads, chunks) = synthetic(layers, experts, CHUNKS, 7);
    let (loads2, chunks2) = synthetic(layers, experts, CHUNKS, 8);
    let cost = CostModel::for_tests(layers);
    let d = Demand::new(&loads, &chunks, layers, experts, CHUNKS).unwrap();
    let d2 = Demand::new(&loads2, &chunks2, layers, experts, CHUNKS).unwrap();
    let opts = Options { cells: 12, fluct_evals: evals, ..Options::default() };
    let prev = routepack_placement(&d2, &topo, &cost, None, &opts).unwrap().placement;
    let t0 = std::time::Instant::now();
    for _ in 0..calls {
        match what {
            "eplb" => {
                std::hint::black_box(rebalance_experts(&loads, layers, experts, topo.num_slots(), groups, topo.nodes_per_group(), topo.ep).unwrap());
            }
            "migration" => {
                std::hint::black_box(routepack_placement(&d, &topo, &cost, Some(&prev), &opts).unwrap());
            }
            _ => {
                std::hint::black_box(routepack_placement(&d, &topo, &cost, None, &opts).unwrap());
            }
        }
    }
    println!("{size} {what} fluct_evals={evals}: {:.2} ms wall per call", t0.elapsed().as_secs_f64() * 1e3 / calls as f64);
}
