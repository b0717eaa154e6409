use super::reference::{karmarkar_karp_full, verl_kk_full};
use super::*;
use rand::{RngExt, SeedableRng};

#[test]
fn kk_two_way_is_the_textbook_answer() {
    // largest differencing on {8,7,6,5,4} ends with a difference of 2 (sums 16 and 14)
    let parts = karmarkar_karp(&[8, 7, 6, 5, 4], 2, false);
    let sums: Vec<u128> = parts.iter().map(|p| p.iter().map(|&i| [8, 7, 6, 5, 4][i]).sum()).collect();
    assert_eq!(sums.iter().sum::<u128>(), 30);
    assert_eq!(sums, vec![16, 14]);
}

#[test]
fn equal_size_counts_and_padding() {
    let w: Vec<u128> = (1..=10).map(|x| x * x).collect();
    let parts = karmarkar_karp(&w, 5, true);
    assert!(parts.iter().all(|p| p.len() == 2));
    let parts = karmarkar_karp(&w[..9], 4, true);
    let mut lens: Vec<usize> = parts.iter().map(|p| p.len()).collect();
    lens.sort();
    assert_eq!(lens, vec![2, 2, 2, 3]);
}

#[test]
fn verl_kk_respects_cap_and_orders_small_at_ends() {
    let lens: Vec<i64> = (0..64).map(|i| 100 + (i * 37) % 900).collect();
    let (p, rep) = verl_kk(&lens, 1000, 4).unwrap();
    assert_eq!(p.num_micro, rep.micro);
    assert!(rep.max_row_tokens <= 1000);
    for r in 0..4 {
        let wl: Vec<u128> = (0..p.num_micro)
            .map(|m| (0..64).filter(|&s| p.sample_rank[s] == r && p.sample_micro[s] == m as i32).map(|s| workload(lens[s])).sum())
            .collect();
        assert!(wl.iter().all(|&x| x > 0));
        let peak = wl.iter().enumerate().max_by_key(|x| x.1).unwrap().0;
        // the heaviest microbatch is in the middle, never at an end (when there are 3+)
        if wl.len() >= 3 {
            assert!(peak != 0 && peak != wl.len() - 1 || wl.iter().all(|&x| x == wl[peak]), "{wl:?}");
        }
    }
}

/// The sparse states partition as verl's full states did: the same parts in the same order,
/// for item counts around k, with ties (equal weights) and zero weights, with and without
/// equal sizes.
#[test]
fn sparse_states_partition_as_full_states_did() {
    let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(5);
    for case in 0..660 {
        // the last cases have states of many sets (a B-tree each)
        let n = if case < 600 { rng.random_range(1..60usize) } else { rng.random_range(100..400usize) };
        let k = if case < 600 { rng.random_range(1..=n.min(24) + 3) } else { rng.random_range(17..n / 2) };
        let top = [3u64, 50, 1 << 40][rng.random_range(0..3usize)];
        let w: Vec<u128> = (0..n).map(|_| rng.random_range(0..=top) as u128).collect();
        let wi: Vec<i128> = w.iter().map(|&x| x as i128).collect();
        for equal in [false, true] {
            assert_eq!(karmarkar_karp(&w, k, equal), karmarkar_karp_full(&wi, k, equal), "{w:?} k {k} equal {equal}");
        }
    }
}

/// verl_kk plans as before wherever it planned before (lengths far below i64 limits).
#[test]
fn verl_kk_plans_as_before() {
    let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(9);
    let mut planned = 0;
    for _ in 0..300 {
        let dp = rng.random_range(1..5usize);
        let s_n = dp + rng.random_range(0..40usize);
        let cap = rng.random_range(20..400i64);
        let near = rng.random_range(0..3u32) == 0;
        let lens: Vec<i64> = (0..s_n).map(|_| if near { cap - rng.random_range(0..4i64) } else { rng.random_range(1..=cap) }).collect();
        match (verl_kk(&lens, cap, dp), verl_kk_full(&lens, cap, dp)) {
            (Ok((p, r)), Ok((q, [first, micro, retries], max_row))) => {
                planned += 1;
                assert_eq!(p, q, "{lens:?} cap {cap} dp {dp}");
                assert_eq!((r.first_micro, r.micro, r.retries, r.max_row_tokens, r.fallback), (first, micro, retries, max_row, false));
            }
            (Ok((_, r)), Err(_)) => assert!(r.fallback, "{lens:?} cap {cap} dp {dp}"),
            // refused by both: the window does not fit (the fallback's certified rows say why)
            (Err(e), Err(_)) => assert!(matches!(e, Error::Infeasible(_)), "{e}"),
            (Err(e), Ok(_)) => panic!("{lens:?} cap {cap} dp {dp}: {e}"),
        }
    }
    assert!(planned > 100, "{planned}");
}

/// The window of issue 13 that verl's procedure refuses: it fits 6 rows of 1867 tokens.
#[test]
fn a_refused_feasible_window_falls_back_to_certified_rows() {
    let lens = [1209, 1867, 306, 668, 1833, 959, 1189, 1682, 781, 277];
    assert!(verl_kk_full(&lens, 1867, 6).is_err());
    let (p, r) = verl_kk(&lens, 1867, 6).unwrap();
    assert!(r.fallback && p.num_micro == 1 && r.max_row_tokens <= 1867, "{r:?}");
}

/// Lengths near 2^61 under a cap of 2^63 − 1: no microbatch over the cap (an i64 sum wrapped
/// to one of 1.15·10^19 tokens), and the workload sums stay exact.
#[test]
fn lengths_near_the_i64_limit_stay_under_the_cap() {
    let lens: Vec<i64> = (0..8).map(|i| (1i64 << 61) + i).collect();
    for dp in [1, 2] {
        let (p, r) = verl_kk(&lens, i64::MAX, dp).unwrap();
        for d in 0..dp as i32 {
            for m in 0..p.num_micro as i32 {
                let t: i128 = (0..8).filter(|&s| p.sample_rank[s] == d && p.sample_micro[s] == m).map(|s| lens[s] as i128).sum();
                assert!(t > 0 && t <= i64::MAX as i128, "dp {dp} cell ({d}, {m}) holds {t}");
            }
        }
        assert!(r.max_row_tokens > 0);
    }
}
