//! Property tests of `packing::rows`: `equalise_rows` on random partitions never panics and,
//! when it accepts, leaves a multiple of dp non-empty rows.

mod common;

use common::Mix;
use proptest::prelude::*;
use routepack_core::packing::rows::equalise_rows;

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn equalise_rows_never_panics(lens in prop::collection::vec(1i64..40, 1..12), dp in 0usize..6, seed in any::<u64>()) {
        // rows: a random partition of the samples
        let mut mix = Mix(seed);
        let mut rows: Vec<Vec<usize>> = Vec::new();
        for s in 0..lens.len() {
            if rows.is_empty() || mix.unit() < 0.4 { rows.push(vec![s]) } else { let i = mix.below(rows.len()); rows[i].push(s) }
        }
        if equalise_rows(&mut rows, &lens, dp).is_ok() {
            prop_assert!(dp >= 1 && rows.len() >= dp && rows.len() / dp * dp == rows.len() && rows.iter().all(|r| !r.is_empty()));
        }
    }
}
