//! Bin packing of replicas onto bins (the nodes of an EP group, or the ranks of a node) with
//! exactly `cap` replicas per bin, the cardinality constraint of physical slots. (Not sample
//! packing: that is `packing/` and `layout/`.)
//!
//! Phases, each deterministic, each in its own file:
//! 1. `greedy`: [`Pack::lpt`], heaviest replica first, to the lightest bin with room (EPLB's
//!    greedy), except that a bin already holding its share of copies of the same expert is
//!    skipped while another bin has room ([`Pack::repair`] fixes what the greedy could not
//!    avoid);
//! 2. `minmax`: [`Pack::improve_max`], local search on the heaviest bin: the swap with another
//!    bin that lowers the larger of the two loads the most, until no swap lowers the maximum;
//! 3. `fluctuation`: [`Pack::improve_fluct`], microbatch fluctuation. Each replica carries a
//!    vector of its load in each chunk of the window (consecutive samples); swaps lower
//!    Σ_bins |V_bin|², the sum over chunks of squared bin loads, i.e. the spread of bin loads
//!    chunk by chunk, which co-locates experts whose demand is anti-correlated. No swap may
//!    lift a bin's aggregate load above `cap_load`, so phase 2's balance is kept (up to the
//!    slack the caller allows);
//! 4. `tighten`: [`Pack::tighten`], back to the balanced maximum after a fluctuation pass
//!    that was allowed above it, at the least cost in fluctuation.
//!
//! Copies of one expert: at most ceil(copies / bins) per bin (the fewest any arrangement can
//! achieve), so two copies never share a bin while another arrangement exists.
//!
//! Beside the phases: `problem` (the input), `pack` (the state and its moves), `bin_lists`
//! (bins' sorted members in one allocation), `weight_search` (partner windows in sorted
//! weights) and `simd` (the AVX2 kernels and their scalar twins, reached through
//! [`crate::cpu::Avx2`]).

mod bin_lists;
mod fluctuation;
mod greedy;
mod minmax;
mod pack;
mod problem;
mod simd;
mod tighten;
mod weight_search;

pub use bin_lists::BinLists;
pub use minmax::SETTLING_SPREADS;
pub use pack::Pack;
pub(crate) use pack::{total_key, with_capacities};
pub use problem::{order_and_norm, Problem};

#[cfg(test)]
mod tests;
