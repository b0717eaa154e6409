//! The fewest token-capped rows, with a certificate.
//!
//! Rows must come in multiples of `step` (dp, so every DP rank runs the same number of
//! microbatches; `step = 1` asks for the plain bin-packing minimum). The target starts at the
//! lower bound (`bounds`). FFD and BFD are tried first; if neither fits the target, the exact
//! search (`exact`) either finds a packing (certified), proves the target impossible (the
//! bound rises by one step, and the search repeats), or runs out of nodes (then the best
//! heuristic packing is returned with its gap to the bound). Finally the rows are split until
//! there are exactly as many as the count reached (splitting never breaks the cap).

use std::time::Instant;

use super::bounds::{l1, l2};
use super::exact::{pack_into, Outcome};
use super::heuristics::{bfd, ffd};
use super::{check_cap, within_cap};
use crate::error::{invalid, Error, Result};

/// How far a row count is from optimal: the lower bounds, whether the count is certified
/// optimal, and how it was found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowCertificate {
    /// The continuous lower bound ceil(Σ n / cap).
    pub l1: usize,
    /// Martello and Toth's lower bound.
    pub l2: usize,
    /// The lower bound on the count: step · ceil(L2 / step), raised by each impossibility
    /// the exact search proved.
    pub lower_bound: usize,
    /// True when the count equals `lower_bound`: no feasible plan has fewer rows.
    pub certified: bool,
    /// count − lower_bound.
    pub gap: usize,
    /// Which method produced the rows: "ffd", "bfd" or "exact".
    pub method: &'static str,
    /// Rows the packing used before splitting to a multiple of `step`.
    pub bins: usize,
    /// Nodes the exact search visited (0 when a heuristic reached the bound).
    pub nodes: u64,
}

/// Rows and how far they are from optimal.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CertifiedRows {
    /// Exactly `certificate.lower_bound + certificate.gap` non-empty rows, each within the
    /// cap, every sample once.
    pub rows: Vec<Vec<usize>>,
    /// The row count's certificate.
    pub certificate: RowCertificate,
}

/// Splits rows (heaviest splittable row first, its samples dealt alternately largest first)
/// until there are `count`. Needs count <= number of samples.
pub fn split_to(rows: &mut Vec<Vec<usize>>, seq_lens: &[i64], count: usize) {
    let split = super::split_heaviest_until(rows, seq_lens, count);
    assert!(split, "fewer rows than samples, so some row has two");
}

/// The fewest rows in multiples of `step` (see the module comment). `node_limit` bounds the
/// exact search per target; `deadline` optionally caps its wall time. The one entry that checks
/// the lengths against the cap (`check_cap`); [`certified_rows_from`] takes them checked.
pub fn certified_rows(seq_lens: &[i64], token_cap: i64, step: usize, node_limit: u64, deadline: Option<Instant>) -> Result<CertifiedRows> {
    check_cap(seq_lens, token_cap)?;
    certified_rows_from(seq_lens, token_cap, step, step, node_limit, deadline)
}

/// [`certified_rows`] with at least `min_rows` rows (a pipeline's microbatch minimum: dp · pp);
/// the bound and the certificate are those of counts that are multiples of `step` and at
/// least `min_rows`. `seq_lens` were checked against `token_cap` by the caller's entry
/// (`Cells::check_lengths`, a `PlanRequest`, or [`certified_rows`]); debug builds assert it.
pub fn certified_rows_from(
    seq_lens: &[i64],
    token_cap: i64,
    step: usize,
    min_rows: usize,
    node_limit: u64,
    deadline: Option<Instant>,
) -> Result<CertifiedRows> {
    debug_assert!(within_cap(seq_lens, token_cap), "lengths not checked against the cap at the entry");
    if step == 0 {
        return Err(invalid("step", "must be >= 1, got 0"));
    }
    let s_n = seq_lens.len();
    let (a, b) = (l1(seq_lens, token_cap), l2(seq_lens, token_cap));
    let round = |x: usize| x.max(min_rows).div_ceil(step).max(1) * step;
    let mut lower_bound = round(a.max(b));
    let (f, g) = (ffd(seq_lens, token_cap), bfd(seq_lens, token_cap));
    let (mut best, mut method) = if g.len() < f.len() { (g, "bfd") } else { (f, "ffd") };
    let mut nodes = 0u64;
    while round(best.len()) > lower_bound {
        let (out, used) = pack_into(seq_lens, token_cap, lower_bound, node_limit, deadline);
        nodes += used;
        match out {
            Outcome::Packed(rows) => {
                best = rows;
                method = "exact";
                break;
            }
            Outcome::Impossible => lower_bound += step,
            Outcome::Unknown => break,
        }
    }
    // More rows than samples leaves a cell empty. The count that fits most loosely is
    // k = step·⌊S/step⌋: when the search stopped (node limit) short of the bound, try k itself
    // before refusing, so a window that fits is not refused for want of a tighter packing.
    let loosest = s_n / step * step;
    if round(best.len()) > s_n && loosest >= lower_bound.max(step) {
        let (out, used) = pack_into(seq_lens, token_cap, loosest, node_limit, deadline);
        nodes += used;
        match out {
            Outcome::Packed(rows) => {
                best = rows;
                method = "exact";
            }
            Outcome::Impossible => lower_bound = loosest + step,
            Outcome::Unknown => {}
        }
    }
    let bins = best.len();
    let count = round(bins);
    if count > s_n {
        let why = if lower_bound > s_n {
            format!("every packing under token_cap = {token_cap} needs at least {lower_bound} rows (a multiple of {step})")
        } else {
            format!(
                "the fewest rows found under token_cap = {token_cap} in multiples of {step} are {count}; the exact search stopped at its node limit ({node_limit}) or deadline before finding {loosest} or fewer"
            )
        };
        return Err(Error::Infeasible(format!("window: {s_n} samples cannot fill {count} non-empty rows: {why}")));
    }
    split_to(&mut best, seq_lens, count);
    let certificate =
        RowCertificate { l1: a, l2: b, lower_bound, certified: count == lower_bound, gap: count - lower_bound, method, bins, nodes };
    Ok(CertifiedRows { rows: best, certificate })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packing::rows::heuristics::row_tokens;

    #[test]
    fn certifies_at_the_dp_rounded_bound() {
        let lens = [9, 8, 7, 6, 5, 4, 3, 2, 1];
        let c = certified_rows(&lens, 10, 3, 10_000, None).unwrap();
        assert_eq!((c.certificate.l1, c.certificate.lower_bound, c.rows.len()), (5, 6, 6));
        assert!(c.certificate.certified);
        assert!(c.rows.iter().all(|r| !r.is_empty() && row_tokens(r, &lens) <= 10));
    }

    #[test]
    fn exact_search_raises_the_bound_when_it_proves_impossibility() {
        let lens = [34i64; 7];
        let c = certified_rows(&lens, 100, 1, 1_000_000, None).unwrap();
        assert_eq!((c.certificate.l2, c.certificate.lower_bound, c.rows.len()), (3, 4, 4));
        assert!(c.certificate.certified);
    }

    #[test]
    fn exact_search_closes_a_heuristic_gap() {
        // FFD and BFD put the two 4s together and need 3 rows; 4+3+3 twice fits 2
        let lens = [4, 4, 3, 3, 3, 3];
        assert_eq!((ffd(&lens, 10).len(), bfd(&lens, 10).len()), (3, 3));
        let c = certified_rows(&lens, 10, 1, 1_000_000, None).unwrap();
        assert_eq!((c.rows.len(), c.certificate.method), (2, "exact"));
        assert!(c.certificate.certified);
        assert!(c.rows.iter().all(|r| row_tokens(r, &lens) == 10));
    }
}
