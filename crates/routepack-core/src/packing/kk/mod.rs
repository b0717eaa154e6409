//! `kk`: verl's sequence balancing, the baseline of the `eplb` preset, implemented from its
//! published behaviour (REFERENCES.md, `verl/utils/seqlen_balancing.py`):
//!
//! 1. Workload per sample: 24576·n + n² (12·h²·n + 2·h·n² over 2h for h = 4096).
//! 2. DP balance: Karmarkar–Karp (largest differencing) over the workloads into dp partitions
//!    with equal sample counts; partition i goes to DP rank i. (verl requires S % dp == 0; we
//!    pad with zero-workload placeholders, so counts differ by at most one.)
//! 3. Microbatches per rank: k = ceil(tokens / cap) (at most the rank's sample count),
//!    all-reduced to the max over DP ranks; each rank's samples are split into k microbatches
//!    by Karmarkar–Karp on workload without the equal-count constraint.
//! 4. Overflow fix (verl 2026): when a microbatch exceeds the cap, repartition with k + 1. We
//!    retry on every rank with the same k, so counts stay equal (the retry is all-reduced).
//! 5. Order: microbatches sorted by workload descending (ties by their smallest sample index,
//!    descending), then the even positions reversed followed by the odd ones, which puts small
//!    microbatches at both ends.

mod partition;

pub use partition::karmarkar_karp;

use super::cells::{Cells, Oversize};
use super::rows::bounds::l2;
use super::rows::fallback::fallback_rows_in;
use super::rows::within_cap;
use super::Packing;
use crate::error::{Error, Result};
use crate::request::PlanRequest;
use partition::Load;

/// verl's workload of a sample of length n >= 0: 24576·n + n², exact (below 2^127 for every
/// i64 length).
#[inline]
pub fn workload(n: i64) -> u128 {
    let n = n.max(0) as u128;
    24576 * n + n * n
}

/// Tokens of some samples, in i128 (a sum of i64 lengths overflows i64 long before this does).
fn tokens(seq_lens: &[i64], items: &[usize]) -> i128 {
    items.iter().map(|&s| seq_lens[s] as i128).sum()
}

/// What `kk` did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KkReport {
    /// Microbatches per rank before any overflow retry: max over ranks of ceil(tokens / cap).
    pub first_micro: usize,
    /// Microbatches per rank in the plan.
    pub micro: usize,
    /// Repartitions forced by a microbatch over the cap (with `fallback`, the ones verl would
    /// make before it runs out: up to one microbatch per sample of the smallest rank).
    pub retries: usize,
    /// Tokens of the fullest microbatch.
    pub max_row_tokens: i64,
    /// verl's procedure ended with a microbatch over the cap at one sample per microbatch on
    /// some rank, although the window fits: the plan lays out the certified rows
    /// (`rows::fallback`) instead of refusing a feasible window.
    pub fallback: bool,
}

/// Rank `r`'s samples split into `k` microbatches by Karmarkar–Karp on workload.
fn split_rank(rank: &[usize], wl: &[u128], k: usize) -> Vec<Vec<usize>> {
    let w: Vec<u128> = rank.iter().map(|&s| wl[s]).collect();
    karmarkar_karp(&w, k, false).into_iter().map(|p| p.into_iter().map(|i| rank[i]).collect()).collect()
}

/// verl's `kk` packing on `dp` ranks (see the module comment). Where verl's procedure refuses
/// a window that fits (every sample within the cap, rows for every cell), the certified rows
/// are laid out instead and the report says `fallback`.
pub fn verl_kk(seq_lens: &[i64], token_cap: i64, dp: usize) -> Result<(Packing, KkReport)> {
    verl_kk_in(seq_lens, token_cap, &Cells::plain(dp))
}

/// [`verl_kk`] into `cells`: every microbatch count it tries meets the pipeline's rule
/// (`MicroRule::fit`, as verl rounds its count up to Megatron's virtual-pipeline group), and a
/// sample over the cap runs alone where `cells.oversize` says so (its length counted as the
/// cap, `Cells::row_lens`), or is split over a CP group (`cells::pack_split`).
/// The lengths are checked once, here (`Cells::check_lengths`).
pub fn verl_kk_in(seq_lens: &[i64], token_cap: i64, cells: &Cells) -> Result<(Packing, KkReport)> {
    cells.check_lengths(seq_lens, token_cap)?;
    verl_kk_checked(seq_lens, token_cap, cells)
}

/// [`verl_kk_in`] of a checked request: its window's lengths into its cells
/// (`Cells::of` its topology and `oversize`), nothing checked again.
pub fn verl_kk_of(req: &PlanRequest) -> Result<(Packing, KkReport)> {
    verl_kk_checked(req.window().seq_lens, req.token_cap(), &Cells::of(req.topo(), req.oversize()))
}

/// [`verl_kk_in`] on lengths checked for `cells` (`Cells::check_lengths`).
fn verl_kk_checked(seq_lens: &[i64], token_cap: i64, cells: &Cells) -> Result<(Packing, KkReport)> {
    if cells.oversize == Oversize::Split {
        return super::cells::pack_split(seq_lens, token_cap, cells, |lens, plain| verl_kk_checked(lens, token_cap, plain));
    }
    let seq_lens = &*cells.row_lens(seq_lens, token_cap);
    let (dp, rule) = (cells.dp, cells.rule);
    let s_n = seq_lens.len();
    debug_assert!(within_cap(seq_lens, token_cap) && dp >= 1, "lengths not checked at the entry");
    if s_n < dp {
        return Err(Error::Infeasible(format!("window: {s_n} samples cannot fill topo.dp = {dp} DP ranks with non-empty microbatches")));
    }
    let cap = token_cap as i128;
    let wl: Vec<u128> = seq_lens.iter().map(|&n| workload(n)).collect();
    let ranks = karmarkar_karp(&wl, dp, true);
    let fewest = ranks.iter().map(|r| r.len()).min().expect("dp >= 1 ranks");
    let first =
        ranks.iter().map(|r| (tokens(seq_lens, r) + cap - 1) / cap).max().expect("dp >= 1 ranks").min(fewest as i128).max(1) as usize;
    // No k below a rank's bin-packing bound (Martello–Toth L2 of its lengths) can fit it, so
    // verl's retries up to there are skipped: the same k, without a partition per retry (all
    // lengths just over half the cap took S/2 partitions of S samples each).
    let hopeless = ranks.iter().map(|r| l2(&r.iter().map(|&s| seq_lens[s]).collect::<Vec<_>>(), token_cap)).max().expect("dp >= 1 ranks");
    let mut k = rule.fit(first.max(hopeless));
    let micro_parts = loop {
        if k > fewest {
            // one sample per microbatch on the smallest rank still overflows elsewhere: verl
            // gives up here, although the window may fit
            return fallback(seq_lens, token_cap, cells, first, fewest);
        }
        let parts: Vec<Vec<Vec<usize>>> = ranks.iter().map(|r| split_rank(r, &wl, k)).collect();
        let fits = parts.iter().flatten().all(|p| !p.is_empty() && tokens(seq_lens, p) <= cap);
        if fits {
            break parts;
        }
        k = rule.fit(k + 1);
    };
    let mut sample_rank = vec![0i32; s_n];
    let mut sample_micro = vec![0i32; s_n];
    let mut max_row = 0i128;
    for (r, mut parts) in micro_parts.into_iter().enumerate() {
        let load = |p: &Vec<usize>| p.iter().fold(Load::default(), |acc, &s| acc.plus(Load::of(wl[s])));
        parts.sort_by(|a, b| load(b).cmp(&load(a)).then(b[0].cmp(&a[0])));
        let evens: Vec<Vec<usize>> = parts.iter().step_by(2).cloned().collect();
        let odds: Vec<Vec<usize>> = parts.iter().skip(1).step_by(2).cloned().collect();
        let ordered = evens.into_iter().rev().chain(odds);
        for (m, p) in ordered.enumerate() {
            max_row = max_row.max(tokens(seq_lens, &p));
            for s in p {
                sample_rank[s] = r as i32;
                sample_micro[s] = m as i32;
            }
        }
    }
    let report = KkReport {
        first_micro: first,
        micro: k,
        retries: k - first,
        // every microbatch is within the cap, so this fits i64
        max_row_tokens: max_row as i64,
        fallback: false,
    };
    Ok((Packing { sample_rank, sample_micro, num_micro: k }, report))
}

/// The certified rows on the ranks in order, where verl's procedure gave up.
fn fallback(seq_lens: &[i64], token_cap: i64, cells: &Cells, first: usize, fewest: usize) -> Result<(Packing, KkReport)> {
    let (packing, max_row_tokens) = fallback_rows_in(seq_lens, token_cap, cells)?;
    let micro = packing.num_micro;
    let report = KkReport { first_micro: first, micro, retries: fewest.saturating_sub(first), max_row_tokens, fallback: true };
    Ok((packing, report))
}

#[cfg(test)]
mod reference;
#[cfg(test)]
mod tests;
