//! routepack-core: the planning algorithms of routepack, in pure Rust (no Python needed for
//! `cargo test` / `cargo bench`). The design, the cost model and the public contract are in
//! the repository's `docs/design.md`.
//!
//! # Where things are
//! * [`plan`]        the data model every stage builds and every checker reads: [`Plan`],
//!   [`Placement`], [`Replica`], [`ExpertMove`] (with [`topology`], [`window`] and [`cost`]'s
//!   [`CostModel`], the inputs); no stage folder owns a type another module uses
//! * [`ingest`]      routing replay → per-sample, per-layer expert demand
//! * [`counts`]      that demand borrowed in its stored type (int32, uint16, uint8)
//! * [`placement`]   stage 1, expert placement: `static`, the baselines ([`placement::eplb`],
//!   [`placement::relibra`]) and routepack's ([`placement::routepack`], whose bin packing of
//!   replicas onto ranks is `placement::routepack::binpack`); [`placement::replica_counts`]
//!   decides how many slots each expert gets
//! * [`packing`]     stage 2, every packing of samples: [`packing::sequential`] (Megatron),
//!   [`packing::kk`] (verl), [`packing::routepack`] (certified rows, then the layout search);
//!   [`packing::rows`] finds the fewest rows with a certificate
//! * [`layout`]      stage 3, the layout search: rows onto (DP rank, microbatch) cells by population
//!   annealing, against a proxy of the cost model (`layout::proxy`, its hot loop `layout::kernel`);
//!   under a pipeline, each EP group's order of microbatches ([`layout::order`])
//! * [`replication`] stage 4, intra-batch replicas per exchange: `hot_n` (MindSpeed), `relibra`,
//!   `routepack`
//! * [`migration`]   expert moves (weights + optimizer state) from the placement in force
//! * [`oversize`]    samples longer than the token cap: refused, run alone, or split over a
//!   context-parallel group ([`split`]: the window's pieces, their alignment)
//! * [`cost`]        the cost model: coefficients, the shared terms every proxy calls, and
//!   one EP rank's time and an exchange's ([`cost::LayerCost`]) in one place, exact, as a
//!   lower bound or linearised ([`cost::ExpertLine`]) for the proxies
//! * [`bound`]       the lower bound on every valid plan's step time (`SimReport::lower_bound_time`)
//! * [`simulate`]    the simulator that scores every plan by composing [`cost`]'s terms per
//!   exchange ([`cell_grid`]: which samples run in each cell), under a pipeline by Megatron's
//!   1F1B schedule ([`simulate::pipeline`])
//! * [`flow`]        where each expert's tokens go under a plan (simulator and torch remap)
//! * [`validate`]    the invariants every plan must satisfy
//! * [`request`]     a plan request (window, topology, cost model, cap, `oversize`) checked
//!   once ([`PlanRequest`]): the stages' entry points take it and check nothing again
//! * [`cpu`]         CPU capability tokens for the SIMD kernels, detected once
//! * [`budget`]      wall-clock budgets (`time_budget_s`) to deadlines, without overflow
//! * [`sizes`]       tables sized by an argument, checked before they are allocated
//! * [`rounding`]    `f64::round` without the math library's call, bit for bit
//!
//! # Words
//! Each word (sample, row, microbatch, step, stage, cell, exchange, chunk, slot, replica,
//! replica buffers) means one thing, in code and docs, as the one glossary defines it: the
//! repository's `docs/design.md`, section "Glossary". In short: a *microbatch* (`micro`, m) is
//! a row's place in every DP rank's execution order, a *step* one training step, a *cell*
//! (DP rank, microbatch), an *exchange* (EP group, microbatch, layer).
//!
//! Inputs are borrowed views ([`WindowView`]) so numpy arrays cross the FFI without copies.
//! Every function is deterministic for its inputs and seed: a plan is byte-identical across
//! runs, processes and thread counts (the golden digests in `tests/placement_golden.rs` and
//! the Python `tests/test_golden_digest.py` guard it).

#![deny(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod bound;
pub mod budget;
pub mod cell_grid;
pub mod cost;
pub mod counts;
pub mod cpu;
pub mod error;
pub mod flow;
#[cfg(test)]
mod guard_counts;
pub mod ingest;
pub mod layout;
pub mod migration;
pub mod oversize;
pub mod packing;
pub mod placement;
pub mod plan;
pub mod replication;
pub mod request;
pub mod rounding;
pub mod simulate;
pub mod sizes;
pub mod split;
pub mod topology;
pub mod validate;
pub mod window;

pub use cost::CostModel;
pub use counts::{Counts, OwnedCounts};
pub use error::{Error, Result};
pub use plan::Placement;
pub use plan::{ExpertMove, Plan, Replica};
pub use request::PlanRequest;
pub use topology::Topology;
pub use window::WindowView;
