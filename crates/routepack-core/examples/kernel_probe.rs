use rand::SeedableRng;
use rand_xoshiro::Xoshiro256PlusPlus;
use routepack_core::layout::chain::{Chain, MoveMix};
use routepack_core::layout::cost::{Delta, Src};
use routepack_core::layout::{init, Proxy};
use routepack_core::packing::certified::certified_rows;
use routepack_core::placement::static_placement;
use routepack_core::{Topology, WindowView};
#[path = "../benches/support/mod.rs"]
mod support;
use support::{flash_window, FLASH_CAP, FLASH_E, FLASH_L};
fn cpu() -> f64 { std::fs::read_to_string("/proc/thread-self/schedstat").unwrap().split_whitespace().next().unwrap().parse::<f64>().unwrap() * 1e-9 }
fn main() {
    if std::env::args().nth(1).as_deref() == Some("calib") { calib(); return; }
    let (lens, tok) = flash_window(1);
    let topo = Topology::new(64, 32, 8, 17).unwrap();
    let cost = support::flash_cost(FLASH_L);
    let w = WindowView::new(&lens, &tok, FLASH_L, FLASH_E).unwrap();
    let pl = static_placement(FLASH_L, FLASH_E, &topo).unwrap();
    let rows = certified_rows(&lens, FLASH_CAP, topo.dp, 200_000, None).unwrap();
    let micro = rows.rows.len() / topo.dp;
    let px = Proxy::new(&w, &topo, &cost, &pl, FLASH_CAP, micro, 0.1).unwrap();
    let start = init::worst_fit(&px).unwrap_or_else(|| init::from_rows(&px, &rows.rows));
    let ch = Chain::new(&px, &start, Xoshiro256PlusPlus::seed_from_u64(0), MoveMix::default());
    let n = 1_000_000;
    for (name, same_sample) in [("hot: same gm, same sample", true), ("same gm, random samples", false)] {
        let c0 = cpu();
        let mut acc = 0.0;
        for i in 0..n {
            let s = if same_sample { 5 } else { (i * 2654435761usize) % 4096 };
            let d = Delta::one(Src::Sample(s as u32), Src::Zero, 3, 1.0, 1.0);
            acc += px.eval_gm(&ch.sh, 0, &d, &[]);
        }
        let t = cpu() - c0;
        println!("{name}: {:.1} ns per pass ({acc:.1})", t / n as f64 * 1e9);
    }
    let c0 = cpu();
    let mut acc = 0.0;
    for i in 0..n {
        let s = (i * 2654435761usize) % 4096;
        let d = Delta::one(Src::Sample(s as u32), Src::Zero, 3, 1.0, 1.0);
        acc += px.eval_gm(&ch.sh, i % 14, &d, &[]);
    }
    println!("random gm, random samples: {:.1} ns per pass ({acc:.1})", (cpu() - c0) / n as f64 * 1e9);
}
#[allow(dead_code)]
fn calib() {
    for kib in [16usize, 28, 40, 64, 256] {
        let v = vec![1.0f32; kib * 256];
        let n = 200_000_000 / v.len();
        let c0 = cpu();
        let mut acc = [0f32; 8];
        for _ in 0..n {
            for c in v.chunks_exact(8) {
                for j in 0..8 { acc[j] += c[j]; }
            }
            std::hint::black_box(&acc);
        }
        let t = cpu() - c0;
        println!("{kib} KiB: {:.3} ns per 32 B", t / (n * v.len() / 8) as f64 * 1e9);
    }
}
