//! Tests of the packing phases together: greedy start, min-max, fluctuation (cardinality
//! limits, caps and balance kept). The SIMD kernels' bit-identity tests are in `simd`.

use super::simd::Scalar;
use super::*;
use proptest::prelude::*;

/// A problem with its order and norms (leaked: tests only).
fn problem<'a>(w: &'a [f64], e: &'a [u32], ne: usize, v: &'a [f32], dim: usize, bins: usize) -> Problem<'a> {
    let (order, norm) = order_and_norm(w, v, dim);
    let (order, norm) = (Box::leak(order.into_boxed_slice()), Box::leak(norm.into_boxed_slice()));
    Problem { weight: w, expert: e, num_experts: ne, vecs: v, dim, bins, cap: w.len() / bins, order, norm }
}

#[test]
fn lpt_then_swaps_balance_and_spread_copies() {
    // expert 0 has 2 copies of 5; LPT alone would pair them on an empty bin otherwise
    let w = [5.0, 5.0, 4.0, 3.0, 2.0, 1.0];
    let e = [0, 0, 1, 2, 3, 4];
    let p = problem(&w, &e, 5, &[], 0, 2);
    let mut s = Pack::lpt(&p);
    assert_eq!(s.violations(), 0);
    assert_ne!(s.bin_of[0], s.bin_of[1]);
    s.improve_max(f64::NEG_INFINITY, usize::MAX, SETTLING_SPREADS);
    assert_eq!(s.max_load(), 10.0);
}

#[test]
fn fluct_pairs_anti_correlated_items() {
    // two chunks; items 0,1 are hot in chunk 0, items 2,3 in chunk 1; same aggregate.
    let w = [2.0, 2.0, 2.0, 2.0];
    let e = [0, 1, 2, 3];
    let v = [2.0, 0.0, 2.0, 0.0, 0.0, 2.0, 0.0, 2.0];
    let p = problem(&w, &e, 4, &v, 2, 2);
    let mut s = Pack::from_assignment(&p, &[0, 0, 1, 1]);
    let before = s.fluct_objective();
    let mut evals = 0;
    assert!(s.improve_fluct(4.0, usize::MAX, &mut evals, usize::MAX));
    assert!(s.fluct_objective() < before);
    assert_ne!(s.bin_of[0], s.bin_of[1]);
    assert_eq!(s.max_load(), 4.0);
}

proptest! {
    #[test]
    fn phases_keep_cardinality_limits_and_caps(
        raw in prop::collection::vec((0u32..1000, 0u32..12), 2..60),
        bins in 1usize..6,
        dim in 0usize..4,
        seed in 0u64..1000,
    ) {
        let n = raw.len() / bins * bins;
        prop_assume!(n >= bins);
        let w: Vec<f64> = raw[..n].iter().map(|x| x.0 as f64).collect();
        let e: Vec<u32> = raw[..n].iter().map(|x| x.1).collect();
        let v: Vec<f32> = (0..n * dim).map(|k| ((k as u64 * 2654435761 + seed) % 97) as f32).collect();
        let p = problem(&w, &e, 12, &v, dim, bins);
        let mut s = Pack::lpt(&p);
        prop_assert_eq!(s.violations(), 0);
        let lpt_max = s.max_load();
        s.improve_max(f64::NEG_INFINITY, usize::MAX, SETTLING_SPREADS);
        let m = s.max_load();
        prop_assert!(m <= lpt_max + 1e-9);
        let mut evals = 0;
        s.improve_fluct(m, usize::MAX, &mut evals, 100_000);
        prop_assert!(s.max_load() <= m * (1.0 + 1e-12) + 1e-9);
        prop_assert_eq!(s.violations(), 0);
        s.fresh_members();
        for b in 0..bins {
            prop_assert_eq!(s.members[b].len(), n / bins);
            let l: f64 = s.members[b].iter().map(|&i| w[i]).sum();
            prop_assert!((l - s.load[b]).abs() <= 1e-6 * (1.0 + l));
        }
    }

    /// The dispatched fluctuation and tightening searches (their AVX2 builds where the CPU
    /// has AVX2) end in the very packing their scalar builds reach, with the same counts.
    #[test]
    fn avx2_searches_match_scalar_searches(
        raw in prop::collection::vec((0u32..1000, 0u32..12), 4..80),
        bins in 2usize..8,
        dim in 1usize..20,
        seed in 0u64..1000,
    ) {
        let n = raw.len() / bins * bins;
        prop_assume!(n >= 2 * bins);
        let w: Vec<f64> = raw[..n].iter().map(|x| x.0 as f64).collect();
        let e: Vec<u32> = raw[..n].iter().map(|x| x.1).collect();
        let v: Vec<f32> = (0..n * dim).map(|k| ((k as u64 * 2654435761 + seed) % 97) as f32 / 3.0).collect();
        let p = problem(&w, &e, 12, &v, dim, bins);
        let mut start = Pack::lpt(&p);
        start.improve_max(f64::NEG_INFINITY, usize::MAX, 0);
        let m = start.max_load();
        let (mut a, mut b) = (start.clone(), start);
        let (mut ea, mut eb) = (0, 0);
        let ra = a.improve_fluct(m * 1.05, usize::MAX, &mut ea, 5_000);
        let rb = b.improve_fluct_body(Scalar, m * 1.05, usize::MAX, &mut eb, 5_000);
        prop_assert_eq!((ra, ea, a.swaps), (rb, eb, b.swaps));
        let ra = a.tighten(m, usize::MAX, &mut ea, 10_000);
        let rb = b.tighten_body(Scalar, m, usize::MAX, &mut eb, 10_000);
        prop_assert_eq!((ra, ea, a.swaps), (rb, eb, b.swaps));
        prop_assert_eq!(&a.bin_of, &b.bin_of);
        prop_assert_eq!(a.fluct_objective().to_bits(), b.fluct_objective().to_bits());
    }
}
