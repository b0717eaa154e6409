//! Placement latency (issue 3): the EPLB baseline and routepack's placement at the `flash`
//! size (32 layers × 512 experts, 544 slots over 32 ranks, 4 nodes) and at EPLB's reference
//! size (58 layers × 256 experts, 288 slots over 32 ranks, 4 nodes). Loads are synthetic and
//! skewed: lognormal expert popularity per layer, and per-chunk demand where each chunk mixes
//! a few topics that boost their own experts (as `routepack.traces.synthetic` does).
//! Measured from loads (and chunk demand) to placement; building the demand from a window is
//! a separate pass over the window (`chunk_demand`). `examples/placement_cpu.rs` gives the
//! CPU time of the same calls, for reading these on a shared machine.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use routepack_core::placement::eplb::rebalance_experts;
use routepack_core::placement::routepack::{routepack_placement, Options};
use routepack_core::{CostModel, Topology};

mod support;
use support::PlacementDemand;

struct Size {
    name: &'static str,
    layers: usize,
    experts: usize,
    topo: Topology,
    eplb_groups: usize,
}

fn sizes() -> Vec<Size> {
    vec![
        // EPLB's reference: 58 × 256, 288 slots over 32 GPUs in 4 nodes, 8 expert groups
        Size { name: "reference_58x256", layers: 58, experts: 256, topo: Topology::new(64, 32, 8, 9).unwrap(), eplb_groups: 8 },
        // flash: 32 × 512, 544 slots over 32 ranks in 4 nodes
        Size { name: "flash_32x512", layers: 32, experts: 512, topo: Topology::new(64, 32, 8, 17).unwrap(), eplb_groups: 4 },
    ]
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("placement");
    g.sample_size(20);
    for s in sizes() {
        let demand = PlacementDemand::new(s.layers, s.experts);
        let (d, d2) = demand.demands();
        let loads = &demand.loads;
        let cost = CostModel::for_tests(s.layers);
        let opts = Options { exchanges: 12, ..Options::default() };
        let t = s.topo;
        g.bench_function(BenchmarkId::new("eplb", s.name), |b| {
            b.iter(|| rebalance_experts(loads, s.layers, s.experts, t.num_slots(), s.eplb_groups, t.nodes_per_group(), t.ep).unwrap())
        });
        g.bench_function(BenchmarkId::new("routepack", s.name), |b| b.iter(|| routepack_placement(&d, &t, &cost, None, &opts).unwrap()));
        // the latency/quality knob: a larger microbatch-phase budget (placement_fluct_evals)
        let rich = Options { fluct_evals: 6000, ..opts.clone() };
        g.bench_function(BenchmarkId::new("routepack_fluct6000", s.name), |b| {
            b.iter(|| routepack_placement(&d, &t, &cost, None, &rich).unwrap())
        });
        // with a placement in force (drifted loads): relabelling, incremental candidates, choice
        let prev = routepack_placement(&d2, &t, &cost, None, &opts).unwrap().placement;
        g.bench_function(BenchmarkId::new("routepack_migration", s.name), |b| {
            b.iter(|| routepack_placement(&d, &t, &cost, Some(&prev), &opts).unwrap())
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
