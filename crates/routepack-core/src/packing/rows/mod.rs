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
//! onto (DP rank, step) cells in order.

pub mod bounds;
pub mod certified;
pub mod exact;
pub mod fallback;
pub mod heuristics;

use super::Packing;
use crate::error::{Error, Result};

/// Refuses a sample longer than the cap, naming it (never a silent overflow).
pub fn check_cap(seq_lens: &[i64], token_cap: i64) -> Result<()> {
    if token_cap < 1 {
        return Err(crate::error::invalid("token_cap", format!("must be >= 1, got {token_cap}")));
    }
    if let Some((s, &n)) = seq_lens.iter().enumerate().find(|(_, &n)| n < 1) {
        return Err(crate::error::invalid("seq_lens", format!("sample {s} has length {n}; every length must be >= 1")));
    }
    if let Some((s, &n)) = seq_lens.iter().enumerate().find(|(_, &n)| n > token_cap) {
        return Err(Error::Infeasible(format!(
            "sample {s} has {n} tokens, more than token_cap = {token_cap}; raise the cap or split the sample"
        )));
    }
    Ok(())
}

/// Grows the row count to a multiple of `dp` (and at least dp) by splitting the heaviest row
/// that has two or more samples: its samples are dealt alternately (largest first) into two
/// rows, which stay under the cap because the original was. Errors when there are fewer
/// samples than dp.
pub fn equalise_rows(rows: &mut Vec<Vec<usize>>, seq_lens: &[i64], dp: usize) -> Result<()> {
    if dp == 0 {
        return Err(crate::error::invalid("dp", "must be >= 1, got 0"));
    }
    if seq_lens.len() < dp {
        return Err(Error::Infeasible(format!(
            "{} samples cannot fill {dp} DP ranks with non-empty microbatches",
            seq_lens.len()
        )));
    }
    while rows.len() < dp || !rows.len().is_multiple_of(dp) {
        if !split_heaviest(rows, seq_lens) {
            return Err(Error::Infeasible(format!(
                "{} single-sample rows cannot be split further into a multiple of dp = {dp} rows",
                rows.len()
            )));
        }
    }
    Ok(())
}

/// Splits the heaviest row with two or more samples (the lowest index among equals): its
/// samples, largest first, are dealt to whichever half is lighter, so both halves stay under
/// the cap. Returns false when every row holds a single sample.
pub fn split_heaviest(rows: &mut Vec<Vec<usize>>, seq_lens: &[i64]) -> bool {
    // i128: a row's samples are summed before anything says it is within the cap
    let load = |r: &Vec<usize>| r.iter().map(|&s| seq_lens[s] as i128).sum::<i128>();
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
    rows[pick] = a;
    rows.push(b);
    true
}

/// Lays rows out in order: row i runs on rank i % dp at step i / dp. Requires
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
