//! Inputs shared by the criterion benches and the examples (each includes this file as
//! `mod support`): the flash profile's cost coefficients and synthetic skewed loads.
#![allow(dead_code)] // each bench uses a subset

use rand::{RngExt, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use routepack_core::placement::demand::Demand;
use routepack_core::{CostModel, Topology};

/// H200-like coefficients of the flash profile, as `CostModel.from_model(flash, Hardware.h200())`
/// computes them (python/routepack/model.py): H = 4096, I = 1024, one full-attention layer in six.
pub fn flash_cost(layers: usize) -> CostModel {
    let rate = 989e12 * 0.5;
    let (h, i) = (4096.0f64, 1024.0f64);
    let expert = 3.0 * h * i;
    CostModel {
        a_lin: 2.0 * (4.0 * h * h + expert) / rate,
        a_quad: (0..layers).map(|l| if l % 6 == 5 { 2.0 * h / rate } else { 0.0 }).collect(),
        c_tok: 2.0 * expert / rate,
        c_exp: 2e-6,
        token_bytes: h * 2.0,
        bw_intra: 450e9 * 0.8,
        bw_inter: 50e9 * 0.8,
        expert_weight_bytes: expert * 2.0,
        expert_grad_bytes: expert * 4.0,
        expert_state_bytes: expert * 14.0,
        ..CostModel::default()
    }
}

/// Standard normal by Box–Muller (the bench only needs a skewed, reproducible shape).
pub fn normal(rng: &mut Xoshiro256PlusPlus) -> f64 {
    let u: f64 = rng.random::<f64>().max(1e-12);
    let v: f64 = rng.random::<f64>();
    (-2.0f64 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
}

/// Chunks per window in the placement bench and examples.
pub const PLACEMENT_CHUNKS: usize = 32;

/// Two successive windows of synthetic placement demand ([`synthetic`], seeds 7 and 8): the
/// window planned and the one before it, whose placement is in force in migration runs.
pub struct PlacementDemand {
    pub layers: usize,
    pub experts: usize,
    pub loads: Vec<f64>,
    pub chunks: Vec<f64>,
    pub loads_before: Vec<f64>,
    pub chunks_before: Vec<f64>,
}

impl PlacementDemand {
    pub fn new(layers: usize, experts: usize) -> Self {
        let (loads, chunks) = synthetic(layers, experts, PLACEMENT_CHUNKS, 7);
        let (loads_before, chunks_before) = synthetic(layers, experts, PLACEMENT_CHUNKS, 8);
        Self { layers, experts, loads, chunks, loads_before, chunks_before }
    }

    /// `(this window, the window before)` as the placement takes them.
    pub fn demands(&self) -> (Demand<'_>, Demand<'_>) {
        let (l, e, b) = (self.layers, self.experts, PLACEMENT_CHUNKS);
        (Demand::new(&self.loads, &self.chunks, l, e, b).unwrap(), Demand::new(&self.loads_before, &self.chunks_before, l, e, b).unwrap())
    }
}

/// The placement sizes the checksum example and the golden test use: `(name, layers,
/// experts, topology)`. EPLB's reference (58 × 256, 288 slots on 32 ranks in 4 nodes), flash
/// (32 × 512, 544 slots on 32 ranks in 4 nodes) and a small one (6 × 40 on 8 ranks in 2 nodes).
pub fn placement_sizes() -> [(&'static str, usize, usize, Topology); 3] {
    [
        ("reference", 58, 256, Topology::new(64, 32, 8, 9).unwrap()),
        ("flash", 32, 512, Topology::new(64, 32, 8, 17).unwrap()),
        ("small", 6, 40, Topology::new(8, 8, 4, 6).unwrap()),
    ]
}

/// 64-bit FNV-1a of a phy2log table's entries as little-endian bytes: a digest that, unlike
/// `DefaultHasher`, is the same on every Rust version and machine, so it can be committed.
pub fn fnv1a_i32(xs: &[i32]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in xs.iter().flat_map(|x| x.to_le_bytes()) {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// `(loads [L, E], chunks [L, E, B])`: per-layer lognormal popularity (spread 0.4–1.4),
/// 16 topics boosting 6% of the experts each, every chunk a random mix of 4 topics.
pub fn synthetic(layers: usize, experts: usize, chunks: usize, seed: u64) -> (Vec<f64>, Vec<f64>) {
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

/// The flash packing size: samples, MoE layers, experts, top-k, token cap.
pub const FLASH_S: usize = 4096;
pub const FLASH_L: usize = 32;
pub const FLASH_E: usize = 512;
pub const FLASH_K: i64 = 8;
pub const FLASH_CAP: i64 = 65536;

/// Lengths ~ prompt + lognormal response, clipped at 32768 + prompt; expert demand of each
/// (sample, layer) split over experts by popularity × topic affinity (deterministic rounding).
pub fn flash_window(seed: u64) -> (Vec<i64>, Vec<i32>) {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let lens: Vec<i64> = (0..FLASH_S)
        .map(|_| {
            let prompt = (800.0 * (0.5 * normal(&mut rng)).exp()).clamp(16.0, 8192.0);
            let resp = (4000.0 * (0.9 * normal(&mut rng)).exp()).clamp(1.0, 32768.0);
            ((prompt + resp).round() as i64).min(FLASH_CAP)
        })
        .collect();
    let topics = 16;
    let pop: Vec<f64> = (0..FLASH_L * FLASH_E).map(|_| (normal(&mut rng) * 0.9).exp()).collect();
    let affinity: Vec<f64> = (0..topics * FLASH_L * FLASH_E).map(|_| if rng.random::<f64>() < 0.06 { 6.0 } else { 1.0 }).collect();
    let topic: Vec<usize> = (0..FLASH_S).map(|s| (s / 16 * 7) % topics).collect();
    let mut tok = vec![0i32; FLASH_S * FLASH_L * FLASH_E];
    let mut w = vec![0f64; FLASH_E];
    for s in 0..FLASH_S {
        for l in 0..FLASH_L {
            let mut total = 0.0;
            for e in 0..FLASH_E {
                w[e] = pop[l * FLASH_E + e] * affinity[(topic[s] * FLASH_L + l) * FLASH_E + e];
                total += w[e];
            }
            let routed = FLASH_K * lens[s];
            let row = &mut tok[(s * FLASH_L + l) * FLASH_E..(s * FLASH_L + l + 1) * FLASH_E];
            let mut given = 0i64;
            for e in 0..FLASH_E {
                let x = ((routed as f64 * w[e] / total) as i64).min(lens[s]);
                row[e] = x as i32;
                given += x;
            }
            let mut e = (s * 31 + l) % FLASH_E;
            while given < routed {
                if (row[e] as i64) < lens[s] {
                    row[e] += 1;
                    given += 1;
                }
                e = (e + 1) % FLASH_E;
            }
        }
    }
    (lens, tok)
}

/// CPU time of all the process's threads in ns (an anneal runs its chains on rayon's
/// threads), from /proc/self/task/*/schedstat (time on CPU is the first field).
pub fn process_cpu_ns() -> u64 {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task is readable on Linux")
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next().and_then(|x| x.parse::<u64>().ok()))
        .sum()
}
