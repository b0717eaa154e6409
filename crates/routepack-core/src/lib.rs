//! routepack-core: the planning algorithms of routepack, in pure Rust.
//!
//! Stages (DESIGN.md), one module each:
//! * [`ingest`]     routing replay → per-sample per-layer expert demand
//! * [`placement`]  expert placement (static, EPLB baseline, routepack)
//! * [`packing`]    token-capped rows: bounds, heuristics, exact search, baselines
//! * [`layout`]     routepack's packing: rows laid out on (rank, step) by population annealing
//! * [`replication`] intra-batch hot-expert replicas per (micro, group, layer): hot_n, relibra, routepack
//! * [`migration`]  moves (weights + optimizer state) from the placement in force to a new one
//! * [`simulate`]   the cost model that scores every plan ([`cell_grid`]: per-cell demand it shares)
//! * [`flow`]       where each expert's tokens go under a plan (shared by simulator and remapper)
//! * [`validate`]   the invariants every plan must satisfy
//!
//! Inputs are borrowed views ([`WindowView`]) so numpy arrays cross the FFI without copies.
//! Every function is deterministic for its inputs and seed.

pub mod cell_grid;
pub mod cost;
pub mod cpu;
pub mod error;
pub mod flow;
pub mod ingest;
pub mod layout;
pub mod migration;
pub mod packing;
pub mod plan;
pub mod replication;
pub mod placement;
pub mod simulate;
pub mod topology;
pub mod validate;
pub mod window;

pub use cost::CostModel;
pub use error::{Error, Result};
pub use placement::Placement;
pub use plan::{MigrationRow, Plan, ReplicaRow};
pub use topology::Topology;
pub use window::WindowView;
