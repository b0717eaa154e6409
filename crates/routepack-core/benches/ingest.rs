//! Routing-replay ingestion throughput: routed top-k ids [T, L, k] → expert_tokens [S, L, E].
//! Reported in bytes of ids per second (criterion's Throughput::Bytes).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use rand::{RngExt, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use routepack_core::ingest::{expert_tokens_from_routed, ExpertId};
use std::hint::black_box;

const L: usize = 32;
const K: usize = 8;
const E: usize = 256;

/// K distinct ids per (token, layer), as a router picks them (a repeat is refused): K
/// consecutive experts from a random start, scrambled by an odd multiplier (a bijection mod E
/// = 256).
fn input<T: Copy>(tokens: usize, samples: usize, conv: impl Fn(u64) -> T) -> (Vec<T>, Vec<i64>) {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(7);
    let e = E as u64;
    let ids = (0..tokens * L)
        .flat_map(|_| {
            let (start, mult) = (rng.random_range(0..e), 2 * rng.random_range(0..e / 2) + 1);
            (0..K as u64).map(move |j| (start + j) * mult % e)
        })
        .map(conv)
        .collect();
    let cu = (0..=samples).map(|i| (i * tokens / samples) as i64).collect();
    (ids, cu)
}

fn bench_one<T: ExpertId + Copy>(c: &mut Criterion, name: &str, conv: impl Fn(u64) -> T) {
    let (tokens, samples) = (64 * 1024, 32);
    let (ids, cu) = input(tokens, samples, conv);
    let mut g = c.benchmark_group("ingest");
    g.throughput(Throughput::Bytes((ids.len() * std::mem::size_of::<T>()) as u64));
    g.bench_with_input(BenchmarkId::new(name, format!("{tokens}tok_L{L}_k{K}_E{E}")), &ids, |b, ids| {
        b.iter(|| black_box(expert_tokens_from_routed(ids, L, K, &cu, E, None).unwrap()))
    });
    g.finish();
}

/// int16 ids (verl's layout) of a model whose first 3 of L layers are dense (zero rows, as
/// verl, vLLM and SGLang record them): the MoE rows counted through `moe_layers`.
fn bench_dense_rows(c: &mut Criterion) {
    let (tokens, samples) = (64 * 1024, 32);
    let (mut ids, cu) = input(tokens, samples, |x| x as i16);
    for tok in ids.chunks_exact_mut(L * K) {
        tok[..3 * K].fill(0);
    }
    let moe: Vec<usize> = (3..L).collect();
    let mut g = c.benchmark_group("ingest");
    g.throughput(Throughput::Bytes((ids.len() * 2) as u64));
    g.bench_with_input(BenchmarkId::new("int16_moe_layers", format!("{tokens}tok_L{L}_3dense_k{K}_E{E}")), &ids, |b, ids| {
        b.iter(|| black_box(expert_tokens_from_routed(ids, L, K, &cu, E, Some(&moe)).unwrap()))
    });
    g.finish();
}

fn ingest(c: &mut Criterion) {
    bench_dense_rows(c);
    bench_one(c, "uint8", |x| x as u8);
    bench_one(c, "int16", |x| x as i16);
    bench_one(c, "int32", |x| x as i32);
    bench_one(c, "int64", |x| x as i64);
}

criterion_group!(benches, ingest);
criterion_main!(benches);
