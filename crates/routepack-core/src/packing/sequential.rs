//! `sequential`: Megatron-style packing. Samples in arrival order, each into the first open
//! row with room (first fit), rows made a multiple of dp, then dealt round-robin to ranks.

use super::rows::{check_cap, equalise_rows, round_robin};
use super::Packing;
use crate::error::Result;

/// First-fit rows in arrival order.
pub fn first_fit_rows(seq_lens: &[i64], token_cap: i64) -> Vec<Vec<usize>> {
    let mut rows: Vec<Vec<usize>> = Vec::new();
    let mut room: Vec<i64> = Vec::new();
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

/// Megatron-style packing of `seq_lens` `[S]` into rows of at most `token_cap` tokens on
/// `dp` ranks: first-fit rows in arrival order, grown to a multiple of dp by splitting the
/// heaviest rows (`rows::equalise_rows`), then dealt round-robin to ranks. Errors name a
/// sample longer than the cap, or say that there are fewer samples than dp.
pub fn sequential(seq_lens: &[i64], token_cap: i64, dp: usize) -> Result<Packing> {
    check_cap(seq_lens, token_cap)?;
    let mut rows = first_fit_rows(seq_lens, token_cap);
    equalise_rows(&mut rows, seq_lens, dp)?;
    Ok(round_robin(&rows, seq_lens.len(), dp))
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
}
