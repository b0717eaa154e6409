//! The AVX2 build of the pass: `Lanes` on `__m256`, and the `#[target_feature]` entry.
//!
//! `V8` is private to this file and named only by [`pass`], which is compiled with AVX2
//! enabled and takes a `crate::cpu::Avx2` token (so it is entered only on a CPU with AVX2).
//! Every `V8` value therefore lives inside code running with AVX2 enabled, which is what
//! makes the intrinsics in its safe methods sound.

use std::arch::x86_64::*;

use super::inputs::{Coeffs, Hosted, Shape, StepDelta, LANES};
use super::lanes::Lanes;
use super::pass::choose;
use crate::cpu::Avx2;

/// The pass on AVX2 vectors.
///
/// # Safety
/// The bounds contract of `kernel::dispatch`; the token proves the CPU has AVX2.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn pass<const WRITE: bool, const N: usize>(
    _token: Avx2,
    state: [*mut f32; N],
    h: &Hosted,
    d: [&StepDelta; N],
    c: Coeffs,
    s: Shape,
) -> [f64; N] {
    // SAFETY: the caller's bounds contract is forwarded; AVX2 is enabled here, so V8's
    // intrinsics may run.
    unsafe { choose::<V8, WRITE, N>(state, h, d, c, s) }
}

/// Eight f32 lanes in one AVX register.
#[derive(Clone, Copy)]
struct V8(__m256);

// Every method inlines into `pass` (AVX2 enabled), the only code that names V8 (see the
// module docs): that is the SAFETY argument of each intrinsic below.
impl Lanes for V8 {
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        // SAFETY: the caller guarantees 8 readable f32 at p (unaligned load); AVX is enabled.
        V8(unsafe { _mm256_loadu_ps(p) })
    }
    #[inline(always)]
    unsafe fn load_u16(p: *const u16) -> Self {
        // SAFETY: the caller guarantees 8 readable u16 (16 bytes) at p (unaligned load); AVX2
        // is enabled.
        V8(unsafe { _mm256_cvtepi32_ps(_mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i))) })
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        // SAFETY: the caller guarantees 8 writable f32 at p (unaligned store); AVX is enabled.
        unsafe { _mm256_storeu_ps(p, self.0) }
    }
    #[inline(always)]
    fn splat(x: f32) -> Self {
        // SAFETY: AVX is enabled wherever V8 exists (module docs).
        unsafe { V8(_mm256_set1_ps(x)) }
    }
    #[inline(always)]
    fn add(self, o: Self) -> Self {
        // SAFETY: AVX is enabled wherever V8 exists (module docs).
        unsafe { V8(_mm256_add_ps(self.0, o.0)) }
    }
    #[inline(always)]
    fn sub(self, o: Self) -> Self {
        // SAFETY: AVX is enabled wherever V8 exists (module docs).
        unsafe { V8(_mm256_sub_ps(self.0, o.0)) }
    }
    #[inline(always)]
    fn mul(self, o: Self) -> Self {
        // SAFETY: AVX is enabled wherever V8 exists (module docs).
        unsafe { V8(_mm256_mul_ps(self.0, o.0)) }
    }
    #[inline(always)]
    fn max(self, o: Self) -> Self {
        // maxps returns the second operand unless the first is greater: `a > b ? a : b`
        // SAFETY: AVX is enabled wherever V8 exists (module docs).
        unsafe { V8(_mm256_max_ps(self.0, o.0)) }
    }
    #[inline(always)]
    fn lanes(self) -> [f32; LANES] {
        let mut x = [0f32; LANES];
        // SAFETY: x holds 8 writable f32; AVX is enabled wherever V8 exists (module docs).
        unsafe { _mm256_storeu_ps(x.as_mut_ptr(), self.0) };
        x
    }
}
