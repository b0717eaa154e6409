//! Annealing throughput and move statistics of one chain on the flash window (the input of
//! `benches/packing.rs`'s `anneal_flash_*`), in CPU time of the process:
//!
//!     cargo run --release --example anneal_rate -- [moves] [temperature]
//!
//! Prints proposals, evaluated (feasible) proposals and accepted moves, and the rate of each
//! per CPU second.

use std::time::Instant;

use rand::SeedableRng;
use rand_xoshiro::Xoshiro256PlusPlus;
use routepack_core::layout::chain::Chain;
use routepack_core::layout::{anneal, init, AnnealParams, Proxy};
use routepack_core::packing::routepack::Options;
use routepack_core::packing::rows::certified::certified_rows;
use routepack_core::placement::static_placement;
use routepack_core::{Topology, WindowView};

#[path = "../benches/support/mod.rs"]
mod support;
use support::{flash_window, FLASH_CAP, FLASH_E, FLASH_L};

fn cpu_s() -> f64 {
    support::process_cpu_ns() as f64 * 1e-9
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let moves: u64 = args.get(1).and_then(|x| x.parse().ok()).unwrap_or(2_000_000);
    let temp: f64 = args.get(2).and_then(|x| x.parse().ok()).unwrap_or(2e-3);
    let (lens, tok) = flash_window(1);
    let topo = Topology::new(64, 32, 8, 17).unwrap();
    let cost = support::flash_cost(FLASH_L);
    let w = WindowView::new(&lens, &tok, FLASH_L, FLASH_E).unwrap();
    let pl = static_placement(FLASH_L, FLASH_E, &topo).unwrap();
    let rows = certified_rows(&lens, FLASH_CAP, topo.dp, 200_000, None).unwrap();
    let micro = rows.rows.len() / topo.dp;
    let t = Instant::now();
    let px = Proxy::new(&w, &topo, &cost, &pl, FLASH_CAP, micro, 0.1).unwrap();
    println!(
        "proxy: {:.3} s wall, micro {micro}, sample demand {:.1} MiB",
        t.elapsed().as_secs_f64(),
        px.demand.bytes() as f64 / (1 << 20) as f64
    );
    let start = init::worst_fit(&px).unwrap_or_else(|| init::from_rows(&px, &rows.rows));
    let mut ch = Chain::new(&px, &start, Xoshiro256PlusPlus::seed_from_u64(0), Options::default().anneal.mix);
    let moves_fixed = if std::env::var_os("SCHEDULE_ONLY").is_some() { 0 } else { moves };
    let e0 = ch.energy;
    let c0 = cpu_s();
    ch.run(&px, moves_fixed, temp, None);
    let cpu = cpu_s() - c0;
    println!(
        "{} proposals in {cpu:.3} s cpu: {:.0} K proposals/s, {:.0} K evaluated/s ({:.1}%), {:.0} K accepted/s ({:.1}% of evaluated); energy {e0:.4} -> {:.4}",
        ch.proposed,
        ch.proposed as f64 / cpu / 1e3,
        ch.evaluated as f64 / cpu / 1e3,
        100.0 * ch.evaluated as f64 / ch.proposed as f64,
        ch.accepted as f64 / cpu / 1e3,
        100.0 * ch.accepted as f64 / ch.evaluated as f64,
        ch.energy
    );
    assert!(ch.consistent(&px), "incremental state drifted");
    // a whole schedule, as `routepack_packing` runs it, on one chain
    let params = AnnealParams { moves, chains: 1, ..Options::default().anneal };
    let c0 = cpu_s();
    let res = anneal::anneal(&px, &start, &params).expect("sizes within the caps");
    let cpu = cpu_s() - c0;
    println!(
        "schedule ({} steps, start acceptance {}): {} proposals in {cpu:.3} s cpu: {:.0} K proposals/s, {:.1}% evaluated, {:.1}% of evaluated accepted; cost {:.4} -> {:.4}",
        res.steps,
        params.start_accept,
        res.moves_done,
        res.moves_done as f64 / cpu / 1e3,
        100.0 * res.evaluated as f64 / res.moves_done as f64,
        100.0 * res.accepted as f64 / res.evaluated as f64,
        res.initial_cost,
        res.best_cost
    );
}
