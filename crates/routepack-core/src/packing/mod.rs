//! Packing (docs/design.md stages 2 and 3): samples into token-capped rows, and rows onto
//! (DP rank, microbatch) cells with equal counts per rank and no empty cell. Every packer is here:
//!
//! * [`routepack`]   routepack's packing: certified rows, then the layout search (`crate::layout`)
//! * [`sequential`]  arrival order, first fit (the Megatron/`static` baseline)
//! * [`kk`]          verl's Karmarkar–Karp balancing (the `eplb` preset's packing)
//! * [`rows`]        the fewest rows with a certificate (bounds, heuristics, exact search) and
//!   the row helpers every packer shares (cap checks, equalising counts)
//! * [`cells`]       what a packing fills: DP ranks, Megatron's microbatch rule under a
//!   pipeline, samples over the cap (`Oversize`)

pub mod cells;
pub mod kk;
pub mod routepack;
pub mod rows;
pub mod sequential;

/// A packed window: where each sample runs. `sample_rank[s]` is sample s's DP rank and
/// `sample_micro[s]` its microbatch, in `0..num_micro`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Packing {
    /// `[S]` DP rank of each sample.
    pub sample_rank: Vec<i32>,
    /// `[S]` microbatch (its index on its rank) of each sample.
    pub sample_micro: Vec<i32>,
    /// Microbatches per DP rank (M).
    pub num_micro: usize,
}
