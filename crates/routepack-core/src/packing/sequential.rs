//! `sequential`: Megatron-style packing. Samples in arrival order, each into the first open
//! row with room (first fit), rows made a multiple of dp, then dealt round-robin to ranks.
//!
//! First fit finds "the first row with room" in a max-tree over the rows' free room
//! (`heuristics::RoomTree`, as first-fit decreasing does), O(log S) per sample: a scan of the
//! open rows was quadratic (S = 2^20 did not finish in 180 s). Where first fit opens more rows
//! than the cells can take (more than dp·⌊S/dp⌋, so some cell would be empty), the window may
//! still fit: the certified rows are laid out instead (`rows::fallback`), and the report says so.

use super::cells::{Cells, Oversize};
use super::rows::fallback::fallback_rows_in;
use super::rows::heuristics::RoomTree;
use super::rows::{equalise_rows_in, round_robin, within_cap};
use super::Packing;
use crate::error::Result;
use crate::request::PlanRequest;

/// First-fit rows in arrival order. Needs every length in [1, token_cap] (`check_cap`).
pub fn first_fit_rows(seq_lens: &[i64], token_cap: i64) -> Vec<Vec<usize>> {
    let mut tree = RoomTree::new(seq_lens.len(), token_cap);
    let mut rows: Vec<Vec<usize>> = Vec::new();
    let mut room: Vec<i64> = Vec::new();
    for (s, &n) in seq_lens.iter().enumerate() {
        // open rows come first in the tree; the first unopened leaf is the next new row
        let r = tree.first_fit(n).expect("every length is <= cap, and there is one leaf per sample");
        if r == rows.len() {
            rows.push(Vec::new());
            room.push(token_cap);
        }
        rows[r].push(s);
        room[r] -= n;
        tree.set(r, room[r]);
    }
    rows
}

/// What `sequential` did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SequentialReport {
    /// Rows in the plan (dp · M).
    pub rows: usize,
    /// First fit opened more rows than there are cells for; the certified rows were laid out.
    pub fallback: bool,
}

/// Megatron-style packing of `seq_lens` `[S]` into rows of at most `token_cap` tokens on
/// `dp` ranks: first-fit rows in arrival order, grown to a multiple of dp by splitting the
/// heaviest rows (`rows::equalise_rows`), then dealt round-robin to ranks; when first fit
/// opens more rows than the cells can take, the certified rows instead (`fallback`). Errors
/// name a sample longer than the cap, or say that there are fewer samples than dp.
pub fn sequential_report(seq_lens: &[i64], token_cap: i64, dp: usize) -> Result<(Packing, SequentialReport)> {
    sequential_in(seq_lens, token_cap, &Cells::plain(dp))
}

/// [`sequential_report`] into `cells`: the rows grown to a count its pipeline rule allows
/// (`Cells::rows_for`), a sample over the cap alone in its row where `cells.oversize` says so
/// (its length counted as the cap, `Cells::row_lens`), or split over a CP group
/// (`cells::pack_split`: its pieces packed in its place in arrival order).
/// The lengths are checked once, here (`Cells::check_lengths`).
pub fn sequential_in(seq_lens: &[i64], token_cap: i64, cells: &Cells) -> Result<(Packing, SequentialReport)> {
    cells.check_lengths(seq_lens, token_cap)?;
    sequential_checked(seq_lens, token_cap, cells)
}

/// [`sequential_in`] of a checked request: its window's lengths into its cells
/// (`Cells::of` its topology and `oversize`), nothing checked again.
pub fn sequential_of(req: &PlanRequest) -> Result<(Packing, SequentialReport)> {
    sequential_checked(req.window().seq_lens, req.token_cap(), &Cells::of(req.topo(), req.oversize()))
}

/// [`sequential_in`] on lengths checked for `cells` (`Cells::check_lengths`).
fn sequential_checked(seq_lens: &[i64], token_cap: i64, cells: &Cells) -> Result<(Packing, SequentialReport)> {
    if cells.oversize == Oversize::Split {
        return super::cells::pack_split(seq_lens, token_cap, cells, |lens, plain| sequential_checked(lens, token_cap, plain));
    }
    let seq_lens = &*cells.row_lens(seq_lens, token_cap);
    let dp = cells.dp;
    debug_assert!(within_cap(seq_lens, token_cap) && dp >= 1, "lengths not checked at the entry");
    let mut rows = first_fit_rows(seq_lens, token_cap);
    let s_n = seq_lens.len();
    if s_n >= dp && rows.len() > s_n / dp * dp {
        let (p, _) = fallback_rows_in(seq_lens, token_cap, cells)?;
        let report = SequentialReport { rows: p.num_micro * dp, fallback: true };
        return Ok((p, report));
    }
    equalise_rows_in(&mut rows, seq_lens, cells)?;
    let report = SequentialReport { rows: rows.len(), fallback: false };
    Ok((round_robin(&rows, s_n, dp), report))
}

/// Megatron-style packing on `dp` ranks (see the module comment).
pub fn sequential(seq_lens: &[i64], token_cap: i64, dp: usize) -> Result<Packing> {
    sequential_report(seq_lens, token_cap, dp).map(|(p, _)| p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fills_in_order_and_equalises() {
        let lens = [6, 5, 4, 3, 2, 1];
        let p = sequential(&lens, 10, 4).unwrap();
        assert_eq!(p.num_micro, 1);
        let mut per_rank = [0i64; 4];
        for (s, &r) in p.sample_rank.iter().enumerate() {
            per_rank[r as usize] += lens[s];
        }
        assert!(per_rank.iter().all(|&t| t > 0 && t <= 10), "{per_rank:?}");
    }

    #[test]
    fn too_long_sample_is_named() {
        let e = sequential(&[3, 11], 10, 1).unwrap_err();
        assert!(e.to_string().contains("sample 1 has 11 tokens"), "{e}");
    }

    /// The rows the scan over open rows gave, on windows with many rows.
    #[test]
    fn first_fit_rows_as_the_scan_gave() {
        fn scan(seq_lens: &[i64], token_cap: i64) -> Vec<Vec<usize>> {
            let (mut rows, mut room): (Vec<Vec<usize>>, Vec<i64>) = (Vec::new(), Vec::new());
            for (s, &n) in seq_lens.iter().enumerate() {
                match room.iter().position(|&r| r >= n) {
                    Some(i) => {
                        rows[i].push(s);
                        room[i] -= n;
                    }
                    None => {
                        rows.push(vec![s]);
                        room.push(token_cap - n);
                    }
                }
            }
            rows
        }
        let mut x = 7u64;
        for cap in [1i64, 2, 10, 97, 1000] {
            for s_n in [1usize, 5, 64, 700] {
                let lens: Vec<i64> = (0..s_n)
                    .map(|_| {
                        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                        1 + ((x >> 33) as i64 % cap)
                    })
                    .collect();
                assert_eq!(first_fit_rows(&lens, cap), scan(&lens, cap), "cap {cap} S {s_n}");
            }
        }
    }

    /// Issue 13's window: first fit opens 7 rows for 6 DP ranks and 10 samples, yet 6 rows fit.
    #[test]
    fn a_feasible_window_first_fit_cannot_fill_falls_back() {
        let lens = [1209, 1867, 306, 668, 1833, 959, 1189, 1682, 781, 277];
        assert_eq!(first_fit_rows(&lens, 1867).len(), 7);
        let (p, r) = sequential_report(&lens, 1867, 6).unwrap();
        assert_eq!((p.num_micro, r.rows, r.fallback), (1, 6, true));
    }
}
