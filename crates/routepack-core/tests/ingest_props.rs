//! Property tests of `ingest`: counts equal a naive count for every id type, a bad id is named
//! exactly, malformed input gives `Err`, never a panic.

mod common;

use common::{usizes, Mix};
use proptest::prelude::*;
use routepack_core::ingest::{check_cu_seqlens, expert_tokens_from_routed, ExpertId};

fn naive_count<T: ExpertId>(routed: &[T], layers: usize, k: usize, cu: &[i64], experts: usize) -> Vec<i32> {
    let s_n = cu.len() - 1;
    let mut out = vec![0i32; s_n * layers * experts];
    for s in 0..s_n {
        for t in cu[s] as usize..cu[s + 1] as usize {
            for l in 0..layers {
                for j in 0..k {
                    let id = routed[(t * layers + l) * k + j].value() as usize;
                    out[(s * layers + l) * experts + id] += 1;
                }
            }
        }
    }
    out
}

fn check_ingest<T: ExpertId + std::fmt::Debug>(ids: &[T], layers: usize, k: usize, cu: &[i64], experts: usize) -> Result<(), TestCaseError> {
    let (lens, counts) = expert_tokens_from_routed(ids, layers, k, cu, experts).map_err(|e| TestCaseError::fail(e.to_string()))?;
    prop_assert_eq!(lens, cu.windows(2).map(|w| w[1] - w[0]).collect::<Vec<_>>());
    prop_assert_eq!(counts, naive_count(ids, layers, k, cu, experts));
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn ingest_equals_naive_count(seed in any::<u64>(), tokens in 1usize..60, layers in 1usize..4, k in 1usize..5, experts in 1usize..200, dtype in 0usize..4) {
        let mut mix = Mix(seed);
        let experts = if dtype == 0 { experts.min(256) } else { experts };
        let raw: Vec<usize> = (0..tokens * layers * k).map(|_| mix.below(experts)).collect();
        let mut cuts: Vec<i64> = (1..tokens as i64).filter(|_| mix.unit() < 0.3).collect();
        cuts.insert(0, 0);
        cuts.push(tokens as i64);
        match dtype {
            0 => check_ingest(&raw.iter().map(|&x| x as u8).collect::<Vec<_>>(), layers, k, &cuts, experts)?,
            1 => check_ingest(&raw.iter().map(|&x| x as i16).collect::<Vec<_>>(), layers, k, &cuts, experts)?,
            2 => check_ingest(&raw.iter().map(|&x| x as i32).collect::<Vec<_>>(), layers, k, &cuts, experts)?,
            _ => check_ingest(&raw.iter().map(|&x| x as i64).collect::<Vec<_>>(), layers, k, &cuts, experts)?,
        }
    }

    #[test]
    fn ingest_names_a_bad_id(tokens in 1usize..30, layers in 1usize..4, k in 1usize..4, at in any::<prop::sample::Index>(), bad in prop_oneof![Just(-1i64), Just(i64::MIN), 8i64..1000]) {
        let mut ids = vec![0i64; tokens * layers * k];
        let i = at.index(ids.len());
        ids[i] = bad;
        let e = expert_tokens_from_routed(&ids, layers, k, &[0, tokens as i64], 8).unwrap_err();
        let (t, l) = (i / (layers * k), (i / k) % layers);
        prop_assert!(e.to_string().contains(&format!("expert id {bad} at token {t} (sample 0), layer {l}")), "{}", e);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn ingest_never_panics(ids in prop::collection::vec(-2i32..6, 0..40), layers in usizes(), k in usizes(), cu in prop::collection::vec(-2i64..45, 0..5), experts in prop_oneof![0usize..8, Just(usize::MAX)]) {
        let _ = check_cu_seqlens(&cu, ids.len());
        if let Ok((lens, counts)) = expert_tokens_from_routed(&ids, layers, k, &cu, experts) {
            prop_assert_eq!(counts.len(), lens.len() * layers * experts);
        }
    }
}
