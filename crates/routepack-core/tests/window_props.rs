//! Property tests of `WindowView::new`: arbitrary arrays give `Err` or a consistent view,
//! never a panic.

mod common;

use common::usizes;
use proptest::prelude::*;
use routepack_core::window::WindowView;

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn window_view_never_panics(lens in prop::collection::vec(-2i64..5, 0..6), tokens in prop::collection::vec(-1i32..5, 0..30), layers in usizes(), experts in usizes()) {
        if let Ok(w) = WindowView::new(&lens, &tokens, layers, experts) {
            prop_assert_eq!(tokens.len(), lens.len() * layers * experts);
            prop_assert!(lens.iter().all(|&n| n >= 1) && tokens.iter().all(|&x| x >= 0));
            let _ = w.layer_expert_load();
        }
    }
}
