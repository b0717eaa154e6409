//! Packing (DESIGN.md stage 2): samples into token-capped execution rows, and rows onto
//! (DP rank, microbatch step) cells with equal counts per rank and no empty cell.
//!
//! * [`rows`]        row-level helpers shared by every packer (cap checks, equalising counts)
//! * [`sequential`]  arrival order, first fit (the Megatron/`static` baseline)

pub mod rows;
pub mod sequential;

/// A packed window: `rows[i]` lists the samples of row i; `sample_rank`/`sample_micro` say
/// where each sample runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Packing {
    pub sample_rank: Vec<i32>,
    pub sample_micro: Vec<i32>,
    pub num_micro: usize,
}
