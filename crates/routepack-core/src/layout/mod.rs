//! The layout search (docs/design.md stage 3): token-capped rows → (DP rank, microbatch) cells.
//!
//! Given the number of microbatches M (fixed by the certified rows, see `crate::packing::routepack`,
//! which drives this search), a layout puts every sample in one cell of the dp × M grid. The
//! search minimises the slowest EP group's accumulated cost under the layout proxy (`proxy`,
//! a re-derivation of the cost model that can be updated in O(L·ep) per move), by parallel
//! population annealing (`anneal`, `chain`) from a worst-fit start (`init`). The annealer moves
//! samples between cells, so a row's membership is the search's to choose; the cap holds in
//! every cell after every move.
//!
//! * [`proxy`]   the objective and its incremental evaluation
//! * `kernel`    the proxy's per-layer hot loop (scalar and AVX2, bit-identical; crate-private)
//! * [`detmath`] exp and ln that give the same bits on every machine
//! * [`init`]    the starting layout
//! * [`chain`]   one Metropolis chain and its invariant-keeping moves
//! * [`anneal`]  the population, temperature schedule and resampling
//! * [`order`]   under a pipeline, which step each EP group runs first

pub mod anneal;
pub mod chain;
pub mod detmath;
pub mod init;
pub(crate) mod kernel;
pub mod order;
pub mod proxy;

pub use anneal::{AnnealParams, AnnealResult, TemperatureStep};
pub use proxy::Proxy;
