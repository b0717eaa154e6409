//! exp and ln from IEEE additions, multiplications and divisions only.
//!
//! The annealer's decisions (Metropolis acceptance, resampling weights, the temperature
//! schedule) go through exp and ln. The platform's libm may round those differently from
//! one machine or library version to the next, which would break "byte-identical across
//! machines". These versions use only correctly rounded basic operations in a fixed order,
//! so they give the same bits everywhere; they are accurate to a few ulp, which is all the
//! annealer needs.

// ln 2 split so that k · LN2_HI is exact for |k| < 2^20 (fdlibm's constants)
const LN2_HI: f64 = 0.693_147_180_369_123_8; // bits 0x3FE62E42FEE00000
const LN2_LO: f64 = 1.908_214_929_270_587_7e-10; // bits 0x3DEA39EF35793C76
const LN2: f64 = std::f64::consts::LN_2;
const LOG2E: f64 = std::f64::consts::LOG2_E;

/// e^x. Underflows to 0 below −745 and overflows to +∞ above 709.7; NaN stays NaN.
pub fn exp(x: f64) -> f64 {
    if x.is_nan() {
        return x;
    }
    if x < -745.0 {
        return 0.0;
    }
    if x > 709.7 {
        return f64::INFINITY;
    }
    // x = k·ln2 + r with |r| <= ln2/2 (Cody–Waite split of ln2 keeps r exact enough)
    let k = (x * LOG2E).round();
    let r = (x - k * LN2_HI) - k * LN2_LO;
    // Taylor series of e^r to degree 14, Horner form: the tail is below 1e-17 for |r| <= 0.35
    let mut p = 1.0;
    for n in (1..=14).rev() {
        p = 1.0 + p * r / n as f64;
    }
    scale2(p, k as i32)
}

/// y · 2^k for |k| <= 1100, through exact powers of two (two steps keep subnormals right).
fn scale2(y: f64, k: i32) -> f64 {
    let pow2 = |e: i32| f64::from_bits(((e + 1023) as u64) << 52);
    if k > 1023 {
        y * pow2(1023) * pow2(k - 1023)
    } else if k < -1022 {
        y * pow2(-1022) * pow2((k + 1022).max(-1022))
    } else {
        y * pow2(k)
    }
}

/// ln x for x > 0 (−∞ at 0, NaN below 0 or for NaN, +∞ at +∞).
pub fn ln(x: f64) -> f64 {
    if x.is_nan() || x < 0.0 {
        return f64::NAN;
    }
    if x == 0.0 {
        return f64::NEG_INFINITY;
    }
    if x.is_infinite() {
        return x;
    }
    // x = m · 2^e with m in [1, 2); subnormals are first scaled into the normal range
    let (mut x, mut e) = (x, 0i32);
    if x < f64::MIN_POSITIVE {
        x *= f64::from_bits((1023u64 + 64) << 52);
        e -= 64;
    }
    let bits = x.to_bits();
    e += ((bits >> 52) & 0x7ff) as i32 - 1023;
    let mut m = f64::from_bits((bits & ((1u64 << 52) - 1)) | (1023u64 << 52));
    if m > std::f64::consts::SQRT_2 {
        m /= 2.0;
        e += 1;
    }
    // ln m = 2 atanh(s), s = (m − 1)/(m + 1), |s| <= 0.1716: odd series to s^25
    let s = (m - 1.0) / (m + 1.0);
    let s2 = s * s;
    let mut p = 0.0;
    for n in (0..=12).rev() {
        p = 1.0 / (2 * n + 1) as f64 + s2 * p;
    }
    e as f64 * LN2 + 2.0 * s * p
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ln2_split_is_fdlibms() {
        assert_eq!(LN2_HI.to_bits(), 0x3FE6_2E42_FEE0_0000);
        assert_eq!(LN2_LO.to_bits(), 0x3DEA_39EF_3579_3C76);
    }

    #[test]
    fn close_to_libm() {
        let mut x = -744.0;
        while x < 709.0 {
            let (a, b) = (exp(x), x.exp());
            // relative accuracy for normal results; subnormals carry fewer bits
            assert!((a - b).abs() <= 4e-16 * b.abs() + 2.0 * 5e-324, "exp({x}) = {a} vs {b}");
            x += 0.37;
        }
        for &x in &[1e-300, 1e-10, 0.3, 0.999, 1.0, 1.5, 2.0, 10.0, 1e10, 1e300, 5e-320] {
            let (a, b) = (ln(x), x.ln());
            assert!((a - b).abs() <= 4e-16 * b.abs().max(1e-300) + 1e-300, "ln({x}) = {a} vs {b}");
        }
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(ln(1.0), 0.0);
        assert_eq!(exp(-800.0), 0.0);
        assert!(ln(-1.0).is_nan() && ln(0.0) == f64::NEG_INFINITY);
    }
}
