//! Synthetic windows for the stage's tests (compiled for tests only).

use rand::{RngExt, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;

/// A window of `s` samples with topic structure: each sample prefers a few experts.
pub(crate) fn window_data(s: usize, l: usize, e: usize, seed: u64) -> (Vec<i64>, Vec<i32>) {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let lens: Vec<i64> = (0..s).map(|_| rng.random_range(1..200)).collect();
    let mut x = vec![0i32; s * l * e];
    for si in 0..s {
        let hot: Vec<usize> = (0..3).map(|_| rng.random_range(0..e)).collect();
        for li in 0..l {
            for _ in 0..lens[si] * 2 {
                let ex = if rng.random::<f64>() < 0.5 { hot[rng.random_range(0..3)] } else { rng.random_range(0..e) };
                x[(si * l + li) * e + ex] += 1;
            }
        }
    }
    (lens, x)
}
