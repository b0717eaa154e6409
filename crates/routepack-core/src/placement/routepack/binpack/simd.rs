//! The packing's vector arithmetic on per-chunk loads, each with an AVX2 build and its scalar
//! twin that computes the same bits (the tests below check it), so the CPU never changes a
//! placement:
//!
//! * [`add_widened`]: a bin's float64 per-chunk load taking an item's float32 vector;
//! * [`trade_widened`]: two bins trading items, with their float32 copies refreshed;
//! * [`Pricing::swap_delta`]: the change of Σ|V|² a swap would make, what the fluctuation and
//!   tightening searches price candidates with. Those searches are generic over [`Pricing`]
//!   and compiled twice: with [`Scalar`], and inside an AVX2 function with the
//!   [`crate::cpu::Avx2`] token, whose pricing is [`swap_delta_avx2`].
//!
//! Every AVX2 path is reached through [`Avx2::detect`] (a token exists only on a CPU with
//! AVX2): the `#[target_feature]` functions are `unsafe fn` whose one precondition is that
//! token's existence.

use crate::cpu::Avx2;

/// `acc[k] += v[k] as f64` for each k: a bin's per-chunk load taking an item, once per
/// placed item. Compiled for AVX2 where the CPU has it (twice the lanes); each element's
/// single add is the same either way, so the sums are bit-identical.
#[inline]
pub(super) fn add_widened(acc: &mut [f64], v: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if Avx2::detect().is_some() {
        // SAFETY: the token exists, so the CPU has AVX2 (add_widened_avx2's precondition)
        return unsafe { add_widened_avx2(acc, v) };
    }
    add_widened_body(acc, v)
}

/// [`add_widened_body`] compiled for AVX2.
///
/// # Safety
/// The CPU must support AVX2 (callers hold an [`Avx2`] token).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn add_widened_avx2(acc: &mut [f64], v: &[f32]) {
    add_widened_body(acc, v)
}

#[inline(always)]
fn add_widened_body(acc: &mut [f64], v: &[f32]) {
    for (x, &y) in acc.iter_mut().zip(v) {
        *x += y as f64;
    }
}

/// Bin a hands item i to bin b for item j: per chunk `va -= vi − vj` and `vb += vi − vj`
/// (the difference taken in float64), then both bins' float32 copies refreshed
/// (`Pack::sync`'s conversion). Compiled for AVX2 where the CPU has it, as [`add_widened`]
/// is: element-wise, so bit-identical.
#[inline]
pub(super) fn trade_widened(va: &mut [f64], vb: &mut [f64], a32: &mut [f32], b32: &mut [f32], vi: &[f32], vj: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if Avx2::detect().is_some() {
        // SAFETY: the token exists, so the CPU has AVX2 (trade_widened_avx2's precondition)
        return unsafe { trade_widened_avx2(va, vb, a32, b32, vi, vj) };
    }
    trade_widened_body(va, vb, a32, b32, vi, vj)
}

/// [`trade_widened_body`] compiled for AVX2.
///
/// # Safety
/// The CPU must support AVX2 (callers hold an [`Avx2`] token).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn trade_widened_avx2(va: &mut [f64], vb: &mut [f64], a32: &mut [f32], b32: &mut [f32], vi: &[f32], vj: &[f32]) {
    trade_widened_body(va, vb, a32, b32, vi, vj)
}

#[inline(always)]
fn trade_widened_body(va: &mut [f64], vb: &mut [f64], a32: &mut [f32], b32: &mut [f32], vi: &[f32], vj: &[f32]) {
    let n = va.len();
    let (vb, a32, b32, vi, vj) = (&mut vb[..n], &mut a32[..n], &mut b32[..n], &vi[..n], &vj[..n]);
    for k in 0..n {
        let dv = vi[k] as f64 - vj[k] as f64;
        va[k] -= dv;
        vb[k] += dv;
        a32[k] = va[k] as f32;
        b32[k] = vb[k] as f32;
    }
}

/// How a search prices a candidate swap: [`Scalar`] everywhere, the [`Avx2`] token inside
/// the searches' AVX2 builds. Both give the very bits of [`swap_delta_lanes`].
pub(super) trait Pricing: Copy {
    /// Half the change of Σ|V|² when items i (in bin a) and j (in bin b) trade bins:
    /// <V_a − V_b, v_j − v_i> + |v_j − v_i|² (`va`, `vb`: the bins' float32 per-chunk loads;
    /// `vi`, `vj`: the items' vectors).
    fn swap_delta(self, va: &[f32], vb: &[f32], vi: &[f32], vj: &[f32]) -> f64;
}

/// Portable pricing, [`swap_delta_lanes`].
#[derive(Clone, Copy, Debug)]
pub(super) struct Scalar;

impl Pricing for Scalar {
    #[inline(always)]
    fn swap_delta(self, va: &[f32], vb: &[f32], vi: &[f32], vj: &[f32]) -> f64 {
        swap_delta_lanes(va, vb, vi, vj)
    }
}

impl Pricing for Avx2 {
    #[inline(always)]
    fn swap_delta(self, va: &[f32], vb: &[f32], vi: &[f32], vj: &[f32]) -> f64 {
        #[cfg(target_arch = "x86_64")]
        {
            // SAFETY: `self` is an Avx2 token, which exists only on a CPU with AVX2
            unsafe { swap_delta_avx2(va, vb, vi, vj) }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            // no token is ever built off x86_64 (`Avx2::detect` returns None there)
            swap_delta_lanes(va, vb, vi, vj)
        }
    }
}

/// [`swap_delta_lanes`] in AVX2 registers (the compiler split those lanes over 128-bit
/// halves): per lane `acc += ((a − b) + dv) · dv` with `dv = j − i`, then the same tail and
/// the same tree of lane sums (Rust never fuses a multiply and an add, so bit-identical).
///
/// # Safety
/// The CPU must support AVX2 (callers hold an [`Avx2`] token).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn swap_delta_avx2(va: &[f32], vb: &[f32], vi: &[f32], vj: &[f32]) -> f64 {
    use std::arch::x86_64::*;
    const W: usize = 8;
    let n = va.len();
    let (va, vb, vi, vj) = (&va[..n], &vb[..n], &vi[..n], &vj[..n]);
    let full = n / W * W;
    let mut acc = _mm256_setzero_ps();
    let mut c = 0;
    while c < full {
        // SAFETY: c + 8 <= full <= n, the length of all four slices, so each unaligned load
        // reads eight floats inside its slice
        unsafe {
            let a = _mm256_loadu_ps(va.as_ptr().add(c));
            let b = _mm256_loadu_ps(vb.as_ptr().add(c));
            let i = _mm256_loadu_ps(vi.as_ptr().add(c));
            let j = _mm256_loadu_ps(vj.as_ptr().add(c));
            let dv = _mm256_sub_ps(j, i);
            acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_add_ps(_mm256_sub_ps(a, b), dv), dv));
        }
        c += W;
    }
    let mut lanes = [0.0f32; W];
    // SAFETY: `lanes` holds eight floats, what the unaligned store writes
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
    let mut tail = 0.0f32;
    for k in full..n {
        let dv = vj[k] - vi[k];
        tail += (va[k] - vb[k] + dv) * dv;
    }
    let s4 = [lanes[0] + lanes[4], lanes[1] + lanes[5], lanes[2] + lanes[6], lanes[3] + lanes[7]];
    let s2 = [s4[0] + s4[2], s4[1] + s4[3]];
    (s2[0] + s2[1]) as f64 + tail as f64
}

/// The portable pricing: eight independent float32 accumulators in a fixed order,
/// reproducible on every machine, which [`swap_delta_avx2`] matches lane by lane.
#[inline(always)]
fn swap_delta_lanes(va: &[f32], vb: &[f32], vi: &[f32], vj: &[f32]) -> f64 {
    const W: usize = 8;
    let n = va.len();
    let (va, vb, vi, vj) = (&va[..n], &vb[..n], &vi[..n], &vj[..n]);
    let mut acc = [0.0f32; W];
    // fixed-size chunks: no bounds checks left in the loop, so the lanes become one register
    let chunks = va.chunks_exact(W).zip(vb.chunks_exact(W)).zip(vi.chunks_exact(W).zip(vj.chunks_exact(W)));
    for ((a, b), (i, j)) in chunks {
        let (a, b, i, j): (&[f32; W], &[f32; W], &[f32; W], &[f32; W]) =
            (a.try_into().unwrap(), b.try_into().unwrap(), i.try_into().unwrap(), j.try_into().unwrap());
        for lane in 0..W {
            let dv = j[lane] - i[lane];
            acc[lane] += (a[lane] - b[lane] + dv) * dv;
        }
    }
    let full = n / W * W;
    let mut tail = 0.0f32;
    for k in full..n {
        let dv = vj[k] - vi[k];
        tail += (va[k] - vb[k] + dv) * dv;
    }
    // lanes summed as a tree (three dependent adds, not eight), fixed order
    let s4 = [acc[0] + acc[4], acc[1] + acc[5], acc[2] + acc[6], acc[3] + acc[7]];
    let s2 = [s4[0] + s4[2], s4[1] + s4[3]];
    (s2[0] + s2[1]) as f64 + tail as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// `n` reproducible floats of both signs and many magnitudes.
    fn floats(seed: u64, n: usize) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9e3779b97f4a7c15) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % 20000) as f32 / 7.0 - 1000.0
            })
            .collect()
    }

    fn bits32(xs: &[f32]) -> Vec<u32> {
        xs.iter().map(|x| x.to_bits()).collect()
    }

    fn bits64(xs: &[f64]) -> Vec<u64> {
        xs.iter().map(|x| x.to_bits()).collect()
    }

    /// A load update of two bins' float64 and float32 per-chunk loads, as the tests run it.
    type Update<'a> = &'a dyn Fn(&mut [f64], &mut [f64], &mut [f32], &mut [f32]);

    proptest! {
        /// The AVX2 pricing gives the very bits of the portable one (plans do not depend on
        /// the CPU), for lengths with and without a tail.
        #[test]
        fn avx2_pricing_is_bit_identical(dim in 0usize..40, seed in 0u64..1000) {
            let v = floats(seed, 4 * dim);
            let vs: Vec<&[f32]> = (0..4).map(|k| &v[k * dim..(k + 1) * dim]).collect();
            let plain = Scalar.swap_delta(vs[0], vs[1], vs[2], vs[3]);
            prop_assert_eq!(plain.to_bits(), swap_delta_lanes(vs[0], vs[1], vs[2], vs[3]).to_bits());
            if let Some(cpu) = Avx2::detect() {
                let wide = cpu.swap_delta(vs[0], vs[1], vs[2], vs[3]);
                prop_assert_eq!(plain.to_bits(), wide.to_bits());
            }
            prop_assert!(plain.is_finite());
        }

        /// The AVX2 builds of the load updates give the bits of their scalar bodies.
        #[test]
        fn avx2_load_updates_are_bit_identical(dim in 0usize..40, seed in 0u64..1000) {
            let v = floats(seed, 4 * dim);
            let (vi, vj) = (&v[..dim], &v[dim..2 * dim]);
            let base: Vec<f64> = v[2 * dim..].iter().map(|&x| x as f64 * 3.1).collect();
            let (mut plain, mut dispatched) = (base[..dim].to_vec(), base[..dim].to_vec());
            add_widened_body(&mut plain, vi);
            add_widened(&mut dispatched, vi);
            prop_assert_eq!(bits64(&plain), bits64(&dispatched));
            let run = |f: Update| {
                let (mut va, mut vb) = (base[..dim].to_vec(), base[dim..].to_vec());
                let (mut a32, mut b32) = (vec![0f32; dim], vec![0f32; dim]);
                f(&mut va, &mut vb, &mut a32, &mut b32);
                (bits64(&va), bits64(&vb), bits32(&a32), bits32(&b32))
            };
            let want = run(&|va, vb, a, b| trade_widened_body(va, vb, a, b, vi, vj));
            prop_assert_eq!(&want, &run(&|va, vb, a, b| trade_widened(va, vb, a, b, vi, vj)));
            #[cfg(target_arch = "x86_64")]
            if Avx2::detect().is_some() {
                let mut wide = base[..dim].to_vec();
                // SAFETY: the token exists, so the CPU has AVX2
                unsafe { add_widened_avx2(&mut wide, vi) };
                prop_assert_eq!(bits64(&plain), bits64(&wide));
                // SAFETY: as above
                let got = run(&|va, vb, a, b| unsafe { trade_widened_avx2(va, vb, a, b, vi, vj) });
                prop_assert_eq!(&want, &got);
            }
        }
    }
}
