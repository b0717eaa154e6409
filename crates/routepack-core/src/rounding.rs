//! `f64::round` (half away from zero) without the call: on x86-64 without SSE4.1, which this
//! crate's default build targets, `f64::round` is a call into the math library, and the hot
//! loops that round (the layout proxy's projection, 125 M roundings at Kimi-K2-like size; a
//! replica's `round(share · T)` in every routing) spent a few percent of the plan in it.
//! [`round`] computes the same value, bit for bit, from a truncating conversion.

/// `x.round()`, bit for bit (±∞ pass through, NaN stays NaN, −0.3 rounds to −0.0), inlined.
#[inline(always)]
#[allow(clippy::neg_cmp_op_on_partial_ord)]
pub fn round(x: f64) -> f64 {
    let a = x.abs();
    // from 2^52 on every f64 is an integer (and NaN, ±∞ compare false): round is the identity;
    // the negated comparison is what takes NaN here (hence the allow)
    if !(a < 4_503_599_627_370_496.0) {
        return x;
    }
    // a < 2^52: the conversion truncates exactly, and a - t is exact (a's fraction bits)
    let t = (a as i64) as f64;
    let r = if a - t >= 0.5 { t + 1.0 } else { t };
    r.copysign(x)
}

#[cfg(test)]
mod tests {
    use super::round;

    #[test]
    fn rounds_as_std_does() {
        let mut xs: Vec<f64> = vec![
            0.0,
            -0.0,
            0.5,
            -0.5,
            1.5,
            2.5,
            -2.5,
            0.49999999999999994,
            -0.49999999999999994,
            4503599627370495.5,
            4503599627370496.0,
            9007199254740993.0,
            1e300,
            -1e300,
            f64::MIN_POSITIVE,
            f64::INFINITY,
            f64::NEG_INFINITY,
            f64::NAN,
        ];
        let mut s = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..200_000 {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            // random bit patterns, and random values near halves
            xs.push(f64::from_bits(s));
            let k = (s >> 20) as f64 / 4.0;
            xs.push(k + 0.5);
            xs.push(f64::from_bits((k + 0.5).to_bits().wrapping_sub(1)));
            xs.push(-(k / 3.0));
        }
        for x in xs {
            if x.is_nan() {
                assert!(round(x).is_nan());
                continue;
            }
            assert_eq!(round(x).to_bits(), x.round().to_bits(), "x = {x:e} ({:#x})", x.to_bits());
        }
    }
}
