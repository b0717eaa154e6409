//! Wall-clock budgets of the searching stages (`time_budget_s` in Python): seconds to an
//! optional [`Duration`], and a budget to an optional deadline, without the panics of
//! `Duration::from_secs_f64` (too large or NaN) and `Instant + Duration` (overflow).
//!
//! A budget only ever cuts a search short: every stage still returns a valid result when its
//! deadline has passed (see each stage's `time_budget`). Without a budget (None) no stage reads
//! the clock, so plans stay deterministic.

use std::time::{Duration, Instant};

use crate::error::{invalid, Result};

/// Budgets above this many seconds (about 31 years) mean no deadline: no search runs that
/// long, and larger values would overflow `Duration` or `Instant` arithmetic.
pub const UNLIMITED_S: f64 = 1e9;

/// `seconds` as a budget: None for None or anything above [`UNLIMITED_S`]; 0 is a deadline
/// already passed (each stage does its least). Negative or non-finite values are refused,
/// naming `arg`.
pub fn from_secs(arg: &str, seconds: Option<f64>) -> Result<Option<Duration>> {
    match seconds {
        None => Ok(None),
        Some(s) if !s.is_finite() || s < 0.0 => Err(invalid(arg, format!("must be finite and >= 0, got {s}"))),
        Some(s) if s > UNLIMITED_S => Ok(None),
        // -0.0 included: `from_secs_f64` refuses a negative sign
        Some(s) if s <= 0.0 => Ok(Some(Duration::ZERO)),
        Some(s) => Ok(Some(Duration::from_secs_f64(s))),
    }
}

/// The instant `budget` after `start`; None without a budget or where the sum would overflow
/// (a budget that long never ends a search).
pub fn deadline(start: Instant, budget: Option<Duration>) -> Option<Instant> {
    budget.and_then(|b| start.checked_add(b))
}

/// Whether `deadline` has passed (never without one; only then is the clock read).
#[inline]
pub fn passed(deadline: Option<Instant>) -> bool {
    deadline.is_some_and(|d| Instant::now() >= d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn huge_budgets_mean_no_deadline() {
        for s in [1e20, 3e19, 1.8e19, 1e10, UNLIMITED_S * 1.0001, f64::MAX] {
            assert_eq!(from_secs("time_budget_s", Some(s)).unwrap(), None, "{s}");
        }
        assert_eq!(from_secs("time_budget_s", None).unwrap(), None);
        assert_eq!(from_secs("time_budget_s", Some(UNLIMITED_S)).unwrap(), Some(Duration::from_secs(1_000_000_000)));
        assert_eq!(from_secs("time_budget_s", Some(0.0)).unwrap(), Some(Duration::ZERO));
        assert_eq!(from_secs("time_budget_s", Some(-0.0)).unwrap(), Some(Duration::ZERO));
        assert_eq!(from_secs("time_budget_s", Some(0.25)).unwrap(), Some(Duration::from_millis(250)));
    }

    #[test]
    fn bad_budgets_are_named() {
        for s in [-1.0, -0.0 - 1e-300, f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            let e = from_secs("time_budget_s", Some(s)).unwrap_err();
            assert!(e.to_string().starts_with("time_budget_s: must be finite and >= 0"), "{e}");
        }
    }

    #[test]
    fn deadlines_never_overflow() {
        let now = Instant::now();
        assert_eq!(deadline(now, None), None);
        assert_eq!(deadline(now, Some(Duration::MAX)), None);
        let d = deadline(now, Some(Duration::from_secs(1_000_000_000))).expect("31 years fit");
        assert!(!passed(Some(d)));
        assert!(passed(deadline(now, Some(Duration::ZERO))));
        assert!(!passed(None));
    }
}
