//! Rows for a baseline packing whose own procedure found none that fit the cells (first fit
//! opening more rows than dp·⌊S/dp⌋, verl's retries running out): the certified rows
//! (`certified::certified_rows`, a multiple of dp and at most S whenever the search finds
//! such a count), laid out in order. Deterministic: a fixed node limit, no deadline. A
//! baseline refuses a window only when this does too, which is when the exact search proved
//! it needs more rows than samples or could not find a count within its node limit.

use super::certified::certified_rows_from;
use super::exact::DEFAULT_NODE_LIMIT;
use super::round_robin;
use crate::error::Result;
use crate::packing::cells::Cells;
use crate::packing::Packing;

/// The certified rows in multiples of `dp` on (rank i % dp, microbatch i / dp), and the tokens of
/// the fullest row. Checks the lengths once (`Cells::check_lengths`).
pub fn fallback_rows(seq_lens: &[i64], token_cap: i64, dp: usize) -> Result<(Packing, i64)> {
    let cells = Cells::plain(dp);
    cells.check_lengths(seq_lens, token_cap)?;
    fallback_rows_in(seq_lens, token_cap, &cells)
}

/// [`fallback_rows`] in the counts `cells` allows (`seq_lens` the row lengths, `Cells::row_lens`,
/// checked by the packer's entry: `Cells::check_lengths`).
pub fn fallback_rows_in(seq_lens: &[i64], token_cap: i64, cells: &Cells) -> Result<(Packing, i64)> {
    let dp = cells.dp;
    let rows = certified_rows_from(seq_lens, token_cap, cells.step(), cells.min_rows(), DEFAULT_NODE_LIMIT, None)?.rows;
    let fullest = rows.iter().map(|r| r.iter().map(|&s| seq_lens[s] as i128).sum::<i128>()).max().unwrap_or(0);
    // every certified row is within the cap, so this fits i64
    Ok((round_robin(&rows, seq_lens.len(), dp), fullest as i64))
}
