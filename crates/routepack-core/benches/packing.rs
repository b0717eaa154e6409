//! Benchmarks of packing and layout at the `flash` size (S = 4096, L = 32, E = 512,
//! dp 64 / ep 32 / 8 GPUs per node / 17 slots, cap 65536): row bounds, certified rows, the
//! exact search on an instance the heuristics miss, and annealing throughput (moves per second
//! on one core). The window is synthetic (lognormal lengths, skewed per-layer expert
//! popularity with per-topic hot experts), built in Rust so `cargo bench` needs no Python.
//!
//! Annealing throughput is measured in CPU time (the process's threads' time on CPU, from
//! `/proc/self/task/*/schedstat`) as well as wall time: the shared 2-core machine is usually
//! oversubscribed, and "moves per second per core" is a CPU-time figure. Two figures: one
//! chain at a fixed early-schedule temperature (where most moves are accepted, so most of
//! them also update the state), and a whole schedule as `routepack_packing` runs it, with
//! one chain.

use std::hint::black_box;

use criterion::measurement::{Measurement, ValueFormatter};
use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use rand::SeedableRng;
use rand_xoshiro::Xoshiro256PlusPlus;
use routepack_core::layout::chain::Chain;
use routepack_core::layout::{anneal, init, AnnealParams, Proxy};
use routepack_core::packing::routepack::Options;
use routepack_core::packing::rows::bounds::{l1, l2};
use routepack_core::packing::rows::certified::certified_rows;
use routepack_core::packing::rows::exact::pack_into;
use routepack_core::placement::static_placement;
use routepack_core::{Topology, WindowView};

mod support;
use support::{flash_window, process_cpu_ns};

use support::{FLASH_CAP as CAP, FLASH_E as E, FLASH_L as L};

fn benches(c: &mut Criterion) {
    let (lens, tok) = flash_window(1);
    let topo = Topology::new(64, 32, 8, 17).unwrap();
    let cost = support::flash_cost(L);
    let w = WindowView::new(&lens, &tok, L, E).unwrap();
    let pl = static_placement(L, E, &topo).unwrap();

    c.bench_function("bounds_l1_l2_flash", |b| b.iter(|| (l1(black_box(&lens), CAP), l2(black_box(&lens), CAP))));
    c.bench_function("certified_rows_flash", |b| {
        b.iter(|| certified_rows(black_box(&lens), CAP, topo.dp, 200_000, None).unwrap().rows.len())
    });
    // an instance where FFD and BFD need a row more than the optimum: pairs (4,3,3) scaled
    let hard: Vec<i64> = (0..60).map(|i| if i % 3 == 0 { 4000 } else { 3000 }).collect();
    c.bench_function("exact_rows_60_items", |b| b.iter(|| pack_into(black_box(&hard), 10_000, 20, 1_000_000, None).0));

    c.bench_function("proxy_build_flash", |b| b.iter(|| Proxy::new(&w, &topo, &cost, &pl, CAP, 8, 0.1).unwrap().num_samples));
}

/// Annealing on the flash window: one chain at a fixed temperature, `MOVES` proposals per
/// iteration, and a whole schedule (`SCHEDULE` proposals, one chain).
fn anneal<M: Measurement>(c: &mut Criterion<M>, label: &str) {
    let (lens, tok) = flash_window(1);
    let topo = Topology::new(64, 32, 8, 17).unwrap();
    let cost = support::flash_cost(L);
    let w = WindowView::new(&lens, &tok, L, E).unwrap();
    let pl = static_placement(L, E, &topo).unwrap();
    let rows = certified_rows(&lens, CAP, topo.dp, 200_000, None).unwrap();
    let micro = rows.rows.len() / topo.dp;
    let px = Proxy::new(&w, &topo, &cost, &pl, CAP, micro, 0.1).unwrap();
    let start = init::worst_fit(&px).unwrap_or_else(|| init::from_rows(&px, &rows.rows));
    let base = Chain::new(&px, &start, Xoshiro256PlusPlus::seed_from_u64(0), Options::default().anneal.mix);
    // an early-schedule temperature (a schedule starts near 7e-3 on this window): about 45%
    // of evaluated moves are accepted
    let temp = 2e-3;
    const MOVES: u64 = 20_000;
    let mut g = c.benchmark_group(format!("anneal_flash_{label}"));
    g.throughput(Throughput::Elements(MOVES));
    g.sample_size(20);
    g.bench_function("chain_moves_one_core", |b| {
        b.iter_batched(|| base.clone(), |mut ch| ch.run(&px, MOVES, temp, None), BatchSize::LargeInput)
    });
    g.finish();
    const SCHEDULE: u64 = 200_000;
    let params = AnnealParams { moves: SCHEDULE, chains: 1, ..Options::default().anneal };
    let mut g = c.benchmark_group(format!("anneal_flash_{label}"));
    g.throughput(Throughput::Elements(SCHEDULE));
    g.sample_size(10);
    g.bench_function("schedule_one_chain", |b| b.iter(|| anneal::anneal(&px, &start, &params).expect("sizes within the caps").moves_done));
    g.finish();
}

fn anneal_wall(c: &mut Criterion) {
    anneal(c, "wall");
}

fn anneal_cpu(c: &mut Criterion<ProcessCpu>) {
    anneal(c, "cpu");
}

/// Criterion measured in `support::process_cpu_ns`.
struct ProcessCpu;

impl Measurement for ProcessCpu {
    type Intermediate = u64;
    type Value = u64;
    fn start(&self) -> u64 {
        process_cpu_ns()
    }
    fn end(&self, i: u64) -> u64 {
        process_cpu_ns() - i
    }
    fn add(&self, a: &u64, b: &u64) -> u64 {
        a + b
    }
    fn zero(&self) -> u64 {
        0
    }
    fn to_f64(&self, v: &u64) -> f64 {
        *v as f64
    }
    fn formatter(&self) -> &dyn ValueFormatter {
        &CpuFormatter
    }
}

struct CpuFormatter;

impl ValueFormatter for CpuFormatter {
    fn scale_values(&self, ns: f64, values: &mut [f64]) -> &'static str {
        let (f, unit) = if ns < 1e3 {
            (1.0, "ns cpu")
        } else if ns < 1e6 {
            (1e-3, "µs cpu")
        } else if ns < 1e9 {
            (1e-6, "ms cpu")
        } else {
            (1e-9, "s cpu")
        };
        values.iter_mut().for_each(|v| *v *= f);
        unit
    }
    fn scale_throughputs(&self, typical: f64, t: &Throughput, values: &mut [f64]) -> &'static str {
        let n = match *t {
            Throughput::Elements(n) => n as f64,
            Throughput::ElementsAndBytes { elements, .. } => elements as f64,
            Throughput::Bytes(n) | Throughput::BytesDecimal(n) => n as f64,
            Throughput::Bits(n) => n as f64,
        };
        let per_s = n * 1e9 / typical;
        let (d, unit) = if per_s < 1e6 { (1e3, "K/s per core") } else { (1e6, "M/s per core") };
        values.iter_mut().for_each(|v| *v = n * 1e9 / *v / d);
        unit
    }
    fn scale_for_machines(&self, _values: &mut [f64]) -> &'static str {
        "ns"
    }
}

criterion_group!(packing, benches, anneal_wall);
criterion_group! {
    name = packing_cpu;
    config = Criterion::default().with_measurement(ProcessCpu);
    targets = anneal_cpu
}
criterion_main!(packing, packing_cpu);
