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
//!   under a pipeline, each EP group's order of steps ([`layout::order`])
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
//! * [`cpu`]         CPU capability tokens for the SIMD kernels, detected once
//! * [`budget`]      wall-clock budgets (`time_budget_s`) to deadlines, without overflow
//! * [`sizes`]       tables sized by an argument, checked before they are allocated
//! * [`rounding`]    `f64::round` without the math library's call, bit for bit
//!
//! # Glossary
//! Each word means one thing, in code and docs:
//! * **sample**: one sequence of the window.
//! * **row**: a set of samples of at most `token_cap` tokens that runs as one microbatch on one
//!   DP rank (packing's unit).
//! * **microbatch** (`micro`, index m in 0..M−1): a row's place in the execution order,
//!   the same M on every DP rank (`Plan::sample_micro`, `Plan::num_micro`).
//! * **step**: one training step, what `step_time` prices: every microbatch of the window,
//!   its passes (forward, backward), plus migration and the once-per-step gradient sum of
//!   redundant experts. Other steps are named with their kind: the annealer's *temperature*
//!   steps, replication's *greedy* steps, the expert curve's *GEMM step*.
//! * **cell**: (DP rank, microbatch), where one row runs; no cell is empty.
//! * **exchange**: (EP group, microbatch, layer), one dispatch/combine all-to-all: the unit the
//!   simulator prices, tokens are routed in and replication plans for.
//! * **chunk**: a run of consecutive samples that placement balances per-microbatch demand over
//!   (`placement_chunks`); the layout kernel groups layers in *layer blocks*.
//! * **slot**: a physical expert slot of an EP rank; **replica**: a copy of an expert in a slot
//!   (placement) or, for one exchange, on another rank ([`Replica`]).
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
pub mod ingest;
pub mod layout;
pub mod migration;
pub mod oversize;
pub mod packing;
pub mod placement;
pub mod plan;
pub mod replication;
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
pub use topology::Topology;
pub use window::WindowView;
