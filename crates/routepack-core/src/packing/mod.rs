//! Packing (DESIGN.md stage 2): samples into token-capped execution rows, and rows onto
//! (DP rank, microbatch step) cells with equal counts per rank and no empty cell.
//!
//! * [`rows`]        row-level helpers shared by every packer (cap checks, equalising counts)
//! * [`sequential`]  arrival order, first fit (the Megatron/`static` baseline)
//! * [`bounds`]      L1, Martello–Toth L2, rounded to a multiple of dp
//! * [`heuristics`]  first-fit and best-fit decreasing
//! * [`exact`]       branch and bound: pack into k rows, or prove it impossible
//! * [`certified`]   the fewest rows with a certificate (bounds + heuristics + exact)
//! * [`kk`]          verl's Karmarkar–Karp balancing (the `eplb` preset's packing)
//!
//! routepack's own packing (certified rows, then the annealed layout) is in `crate::layout`.

pub mod bounds;
pub mod certified;
pub mod exact;
pub mod heuristics;
pub mod kk;
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
