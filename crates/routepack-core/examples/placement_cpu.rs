//! CPU time of one placement call, for reading the latency targets on a shared machine:
//! run it under `RAYON_NUM_THREADS=1 perf stat -e task-clock` (or `time`) and divide by the
//! call count. Same synthetic loads as `benches/placement.rs`.
//!
//!     cargo run --release --example placement_cpu -- <reference|flash> <calls> [fluct_evals] [eplb|routepack|migration]

use routepack_core::placement::eplb::rebalance_experts;
use routepack_core::placement::routepack::{routepack_placement, Options};
use routepack_core::{CostModel, Topology};

#[path = "../benches/support/mod.rs"]
mod support;
use support::PlacementDemand;

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
    let demand = PlacementDemand::new(layers, experts);
    let (d, d2) = demand.demands();
    let loads = &demand.loads;
    let cost = CostModel::for_tests(layers);
    let opts = Options { exchanges: 12, fluct_evals: evals, ..Options::default() };
    let prev = routepack_placement(&d2, &topo, &cost, None, &opts).unwrap().placement;
    let t0 = std::time::Instant::now();
    for _ in 0..calls {
        match what {
            "eplb" => {
                std::hint::black_box(
                    rebalance_experts(loads, layers, experts, topo.num_slots(), groups, topo.nodes_per_group(), topo.ep).unwrap(),
                );
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
