//! Lower bounds on the number of token-capped rows (bins of capacity `token_cap`).
//!
//! * L1 = ceil(Σ n_s / cap), the continuous bound.
//! * L2, Martello and Toth's bound (1990): for every threshold α in [0, cap/2], items larger
//!   than cap − α each need their own row, items in (cap/2, cap − α] too, and items in
//!   [α, cap/2] can only use the room those middle rows leave plus new rows. L2 >= L1.
//! * The plan's row count must also be a positive multiple of dp (every DP rank runs the same
//!   number of microbatches) and at most S (no empty cell), so the bound on rows is
//!   dp · ceil(L2 / dp), at least dp.

use crate::error::{Error, Result};

use super::check_cap;

/// L1 = ceil(Σ n / cap). `cap` must be >= 1 (checked by callers via `check_cap`).
pub fn l1(seq_lens: &[i64], cap: i64) -> usize {
    let total: i128 = seq_lens.iter().map(|&n| n as i128).sum();
    (total + cap as i128 - 1).div_euclid(cap as i128) as usize
}

/// Martello–Toth L2, in O(S log S). Requires every length in [1, cap].
pub fn l2(seq_lens: &[i64], cap: i64) -> usize {
    if seq_lens.is_empty() {
        return 0;
    }
    let mut v: Vec<i64> = seq_lens.to_vec();
    v.sort_unstable();
    let mut prefix = Vec::with_capacity(v.len() + 1);
    prefix.push(0i128);
    for &n in &v {
        prefix.push(prefix.last().unwrap() + n as i128);
    }
    let sum = |a: usize, b: usize| prefix[b] - prefix[a];
    let s = v.len();
    // first index of an item larger than cap/2 (2n > cap handles odd caps exactly; in i128,
    // as 2n overflows i64 for n above 2^62)
    let half = v.partition_point(|&n| 2 * n as i128 <= cap as i128);
    let mut best = l1(seq_lens, cap);
    // α = 0 and every distinct small size: the bound only changes at item sizes
    let mut candidates: Vec<i64> = std::iter::once(0).chain(v[..half].iter().copied()).collect();
    candidates.dedup();
    for alpha in candidates {
        let big = v.partition_point(|&n| n <= cap - alpha); // J1 = [big, s)
        let lo = v.partition_point(|&n| n < alpha); // J3 = [lo, half)
        let j1 = s - big;
        let j2 = big - half; // (cap/2, cap - α]
        let free = j2 as i128 * cap as i128 - sum(half, big);
        let small = sum(lo.min(half), half);
        let extra = if small > free { (small - free + cap as i128 - 1) / cap as i128 } else { 0 };
        best = best.max(j1 + j2 + extra as usize);
    }
    best
}

/// The bounds a packing is certified against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowBounds {
    /// L1 = ceil(Σ n_s / cap), the continuous bound on rows ([`l1`]).
    pub l1: usize,
    /// Martello and Toth's L2 >= L1 ([`l2`]).
    pub l2: usize,
    /// Fewest rows a plan can have: dp · ceil(max(L1, L2) / dp), at least dp.
    pub rows: usize,
    /// rows / dp: the fewest microbatches per DP rank.
    pub micro: usize,
}

/// Bounds for `seq_lens` under `token_cap` on `dp` ranks. Errors name a sample longer than
/// the cap, or say why no plan exists (fewer samples than the rows the bound needs).
pub fn row_bounds(seq_lens: &[i64], token_cap: i64, dp: usize) -> Result<RowBounds> {
    check_cap(seq_lens, token_cap)?;
    if dp == 0 {
        return Err(crate::error::invalid("dp", "must be >= 1, got 0"));
    }
    let (a, b) = (l1(seq_lens, token_cap), l2(seq_lens, token_cap));
    let micro = a.max(b).div_ceil(dp).max(1);
    let rows = micro * dp;
    if rows > seq_lens.len() {
        return Err(Error::Infeasible(format!(
            "window: {} samples cannot fill {rows} non-empty rows ({micro} microbatches on each of {dp} DP ranks, the fewest token_cap = {token_cap} allows)",
            seq_lens.len()
        )));
    }
    Ok(RowBounds { l1: a, l2: b, rows, micro })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn l2_beats_l1_on_big_items() {
        // three items just over half the cap: L1 = 2, but no two share a row
        let lens = [6, 6, 6];
        assert_eq!(l1(&lens, 10), 2);
        assert_eq!(l2(&lens, 10), 3);
    }

    #[test]
    fn l2_counts_room_left_by_middle_items() {
        // 7s need their own rows and leave room 3 each; the 4s cannot use it
        let lens = [7, 7, 4, 4, 4];
        assert_eq!(l1(&lens, 10), 3);
        assert_eq!(l2(&lens, 10), 4);
    }

    #[test]
    fn rows_round_to_dp_and_refuse_too_few_samples() {
        let b = row_bounds(&[5, 5, 5, 5, 5], 10, 2).unwrap();
        assert_eq!((b.l1, b.rows, b.micro), (3, 4, 2));
        let e = row_bounds(&[10, 10, 10], 10, 2).unwrap_err();
        assert!(e.to_string().contains("3 samples cannot fill 4"), "{e}");
        let e = row_bounds(&[3, 12], 10, 1).unwrap_err();
        assert!(e.to_string().contains("sample 1 has 12 tokens"), "{e}");
    }
}
