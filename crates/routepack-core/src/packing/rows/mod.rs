//! Token-capped rows: the fewest rows with a certificate, and the helpers every packer shares.
//!
//! * [`bounds`]      L1, Martello–Toth L2, rounded to a multiple of dp
//! * [`heuristics`]  first-fit and best-fit decreasing
//! * [`exact`]       branch and bound: pack into k rows, or prove it impossible
//! * [`certified`]   the fewest rows with a certificate (bounds + heuristics + exact)
//! * [`fallback`]    the certified rows laid out in order, for a baseline whose own
//!   procedure finds no rows that fit the cells
//!
//! The helpers below: cap checks, making the row count a multiple of dp, and laying rows out
//! onto (DP rank, microbatch) cells in order.

pub mod bounds;
pub mod certified;
pub mod exact;
pub mod fallback;
pub mod heuristics;

use super::cells::Cells;
use super::Packing;
use crate::error::{Error, Result};

/// The cap checks every packer shares (one home: `crate::oversize`).
pub use crate::oversize::{check_cap, within_cap};

/// Grows the row count to a multiple of `dp` (and at least dp) by splitting the heaviest row
/// that has two or more samples: its samples are dealt alternately (largest first) into two
/// rows, which stay under the cap because the original was. Errors when there are fewer
/// samples than dp.
pub fn equalise_rows(rows: &mut Vec<Vec<usize>>, seq_lens: &[i64], dp: usize) -> Result<()> {
    equalise_rows_in(rows, seq_lens, &Cells::plain(dp))
}

/// [`equalise_rows`] to the count `cells` allows: a multiple of dp that also meets the
/// pipeline's microbatch rule (`Cells::rows_for`).
pub fn equalise_rows_in(rows: &mut Vec<Vec<usize>>, seq_lens: &[i64], cells: &Cells) -> Result<()> {
    let dp = cells.dp;
    if dp == 0 {
        return Err(crate::error::invalid("dp", "must be >= 1, got 0"));
    }
    if seq_lens.len() < dp {
        return Err(Error::Infeasible(format!(
            "window: {} samples cannot fill topo.dp = {dp} DP ranks with non-empty microbatches",
            seq_lens.len()
        )));
    }
    // the first count that is a multiple of dp, at least dp, and meets the rule
    let count = cells.rows_for(rows.len());
    if !split_heaviest_until(rows, seq_lens, count) {
        return Err(Error::Infeasible(format!(
            "{} single-sample rows cannot be split further into {count} rows ({} microbatches on each of dp = {dp} ranks{})",
            rows.len(),
            count / dp,
            if cells.rule.min > 1 {
                format!(", at least {} and a multiple of {} for the pipeline", cells.rule.min, cells.rule.multiple)
            } else {
                String::new()
            }
        )));
    }
    Ok(())
}

/// Splits the heaviest row with two or more samples (the lowest index among equals) until
/// there are `count` rows: its samples, largest first, are dealt to whichever half is
/// lighter, so both halves stay under the cap. Returns false when every row holds a single
/// sample first. The rows' tokens are summed once and kept in a heap (summing every row for
/// every split was most of `sequential` at S = 2^20 with 64 ranks); the splits are the ones
/// a scan for the heaviest row gives.
pub fn split_heaviest_until(rows: &mut Vec<Vec<usize>>, seq_lens: &[i64], count: usize) -> bool {
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;
    // i128: a row's samples are summed before anything says it is within the cap
    let load = |r: &[usize]| r.iter().map(|&s| seq_lens[s] as i128).sum::<i128>();
    let mut heap: BinaryHeap<(i128, Reverse<usize>)> =
        rows.iter().enumerate().filter(|(_, r)| r.len() >= 2).map(|(i, r)| (load(r), Reverse(i))).collect();
    while rows.len() < count {
        let Some((_, Reverse(pick))) = heap.pop() else {
            return false;
        };
        let mut members = std::mem::take(&mut rows[pick]);
        members.sort_by(|&a, &b| seq_lens[b].cmp(&seq_lens[a]).then(a.cmp(&b)));
        let (mut a, mut b, mut la, mut lb) = (Vec::new(), Vec::new(), 0i128, 0i128);
        for s in members {
            if la <= lb {
                la += seq_lens[s] as i128;
                a.push(s);
            } else {
                lb += seq_lens[s] as i128;
                b.push(s);
            }
        }
        for (i, half, tokens) in [(pick, a, la), (rows.len(), b, lb)] {
            if half.len() >= 2 {
                heap.push((tokens, Reverse(i)));
            }
            if i == rows.len() {
                rows.push(half);
            } else {
                rows[i] = half;
            }
        }
    }
    true
}

/// Lays rows out in order: row i runs on rank i % dp at microbatch i / dp. Requires
/// rows.len() to be a positive multiple of dp.
pub fn round_robin(rows: &[Vec<usize>], num_samples: usize, dp: usize) -> Packing {
    debug_assert!(!rows.is_empty() && rows.len().is_multiple_of(dp));
    let mut sample_rank = vec![0i32; num_samples];
    let mut sample_micro = vec![0i32; num_samples];
    for (i, row) in rows.iter().enumerate() {
        for &s in row {
            sample_rank[s] = (i % dp) as i32;
            sample_micro[s] = (i / dp) as i32;
        }
    }
    Packing { sample_rank, sample_micro, num_micro: rows.len() / dp }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One split as the scan for the heaviest row made it (the reference of the heap).
    fn split_by_scan(rows: &mut Vec<Vec<usize>>, seq_lens: &[i64]) -> bool {
        let load = |r: &Vec<usize>| r.iter().map(|&s| seq_lens[s]).sum::<i64>();
        let Some(pick) = rows
            .iter()
            .enumerate()
            .filter(|(_, r)| r.len() >= 2)
            .max_by(|a, b| load(a.1).cmp(&load(b.1)).then(b.0.cmp(&a.0)))
            .map(|(i, _)| i)
        else {
            return false;
        };
        let mut members = std::mem::take(&mut rows[pick]);
        members.sort_by(|&a, &b| seq_lens[b].cmp(&seq_lens[a]).then(a.cmp(&b)));
        let (mut a, mut b, mut la, mut lb) = (Vec::new(), Vec::new(), 0i64, 0i64);
        for s in members {
            if la <= lb {
                la += seq_lens[s];
                a.push(s);
            } else {
                lb += seq_lens[s];
                b.push(s);
            }
        }
        rows[pick] = a;
        rows.push(b);
        true
    }

    #[test]
    fn heap_splits_as_the_scan_did() {
        let mut x = 3u64;
        let mut next = |n: u64| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (x >> 33) % n
        };
        for _ in 0..300 {
            let s_n = 1 + next(60) as usize;
            // few distinct lengths, so equal row loads (ties by index) are common
            let lens: Vec<i64> = (0..s_n).map(|_| 1 + next(4) as i64).collect();
            let n_rows = 1 + next(s_n as u64) as usize;
            let mut rows: Vec<Vec<usize>> = vec![Vec::new(); n_rows];
            (0..s_n).for_each(|s| rows[next(n_rows as u64) as usize].push(s));
            let count = n_rows + next(s_n as u64 + 3) as usize;
            let mut want = rows.clone();
            let mut ok = true;
            while want.len() < count && ok {
                ok = split_by_scan(&mut want, &lens);
            }
            let mut got = rows.clone();
            assert_eq!(split_heaviest_until(&mut got, &lens, count), ok);
            assert_eq!(got, want);
        }
    }
}
