//! CPU capabilities, detected once and cached, handed to SIMD kernels as tokens.
//!
//! A SIMD kernel compiled with `#[target_feature(enable = "avx2")]` is undefined behaviour on
//! a CPU without AVX2. Safe code therefore never passes a `bool` that claims AVX2: it asks
//! [`Avx2::detect`] for a token, which exists only when the running CPU has the feature, and
//! the kernels that need AVX2 take that token. The scalar twin of every kernel computes the
//! same bits (each SIMD kernel's tests check this), so which path runs never changes a plan.

use std::sync::OnceLock;

/// Proof that the running CPU supports AVX2. It cannot be built outside this module except
/// through [`Avx2::detect`], so holding one makes calling an AVX2 kernel sound.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Avx2 {
    _private: (),
}

impl Avx2 {
    /// The token when the CPU has AVX2 (detected once per process, then cached).
    #[inline]
    pub fn detect() -> Option<Avx2> {
        static DETECTED: OnceLock<bool> = OnceLock::new();
        let has = *DETECTED.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                std::arch::is_x86_feature_detected!("avx2")
            }
            #[cfg(not(target_arch = "x86_64"))]
            {
                false
            }
        });
        has.then_some(Avx2 { _private: () })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detection_is_cached_and_agrees_with_std() {
        let a = Avx2::detect();
        assert_eq!(a, Avx2::detect());
        #[cfg(target_arch = "x86_64")]
        assert_eq!(a.is_some(), std::arch::is_x86_feature_detected!("avx2"));
        #[cfg(not(target_arch = "x86_64"))]
        assert!(a.is_none());
    }
}
