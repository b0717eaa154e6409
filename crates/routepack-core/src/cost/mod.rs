//! Coefficients of docs/design.md's cost model. Python derives them from the model shape and the
//! hardware (`CostModel.from_model`) or loads calibrated ones; the core only consumes them.

use crate::error::{invalid, Result};

mod finite;
pub(crate) mod links;
pub(crate) mod rank;
mod step;
mod terms;

pub use finite::MAX_UNIT_SECONDS;
pub use rank::{ExpertLine, LayerCost};
pub use step::{Overlap, Pass, DEFAULT_PASSES};

/// Compute multiplier of the default step ([`DEFAULT_PASSES`]: forward + backward, the
/// backward costing about twice the forward); a cost model's own is
/// [`CostModel::compute_passes`].
pub const COMPUTE_PASSES: f64 = 3.0;
/// Communication multiplier of the default step; a cost model's own is
/// [`CostModel::comm_passes`].
pub const COMM_PASSES: f64 = 2.0;

/// All times in seconds, sizes in bytes, bandwidths in bytes per second.
#[derive(Clone, Debug, PartialEq)]
pub struct CostModel {
    /// Linear attention/dense work per token per layer (projections, shared experts).
    pub a_lin: f64,
    /// Quadratic attention work per layer: `[L]`, 0 for linear-attention layers.
    pub a_quad: Vec<f64>,
    /// Expert compute per routed token (one token to one expert).
    pub c_tok: f64,
    /// Fixed cost per active expert on a rank (kernel and GEMM-tile overhead).
    pub c_exp: f64,
    /// Bytes of one routed token's hidden state (H · activation bytes), sent once per
    /// (token, expert) in dispatch and again in combine.
    pub token_bytes: f64,
    /// Per-GPU bandwidth inside a node (one direction).
    pub bw_intra: f64,
    /// Per-GPU bandwidth between nodes (one direction).
    pub bw_inter: f64,
    /// Weights of one expert (3·H·I·weight bytes): what replication sends in forward.
    pub expert_weight_bytes: f64,
    /// fp32 gradient of one expert (3·H·I·4): what replication reduces back in backward.
    pub expert_grad_bytes: f64,
    /// Everything migration moves per expert: weights plus optimizer state
    /// (fp32 master weights and Adam's two moments).
    pub expert_state_bytes: f64,
    /// Seconds one active expert's GEMM takes at least, one pass: the time to stream its
    /// weights, below which a small grouped GEMM cannot go however few tokens it has. The
    /// expert's time is `c_exp + max(c_tok · tokens, c_weights)` (a roofline whose knee is
    /// at `c_weights / c_tok` tokens); 0, the default, is the linear model.
    pub c_weights: f64,
    /// Seconds one active expert's GEMM costs beyond a matrix-vector product, one pass, when
    /// it has ≥ 2 tokens on a rank: the fixed cost of a matrix-matrix kernel (a CPU BLAS's
    /// GEMM set-up and packing, which a single token's matrix-vector product and outer-product
    /// weight gradient skip). The expert's time is `c_exp + max(c_tok · tokens, c_weights) +
    /// c_gemm · [tokens ≥ 2]`, a step up at 2 tokens. 0, the default, prices no step; on a
    /// GPU, where a grouped GEMM of one token is as dear as one of a few, calibration fits it
    /// at about 0 (`c_weights` is its floor there).
    pub c_gemm: f64,
    /// Seconds one active expert costs beyond the roofline and the GEMM step, one pass, as a
    /// table of knots `(tokens per expert, seconds)`: tokens strictly increasing and >= 1,
    /// seconds >= 0; linearly interpolated between knots and constant beyond the first and the
    /// last ([`CostModel::table_extra`]). What a kernel does that no closed form follows: a CPU
    /// BLAS that switches kernels at a few rows (on this project's CPU the time climbs from 2
    /// to 4 tokens per expert and then levels off), a per-token cost that rises once a tile
    /// leaves the cache, a GPU's tile quantization. Non-negative, so the lower bound's argument
    /// (a rank's extra is >= 0) holds; not monotone in tokens. Empty, the default, prices none;
    /// `routepack calibrate` fits it where it earns its knots.
    pub expert_table: Vec<(f64, f64)>,
    /// Seconds of one EP rank's grouped expert kernel call in one pass, whatever its experts
    /// and tokens: the kernel's launch and set-up, the framework's per-operator work around
    /// it (sorting tokens by expert, the activation, the backward's bookkeeping), the zero
    /// gradients of a stack's idle slots. Charged once per rank and exchange where the rank
    /// computes at least one token ([`CostModel::call_time`]). 0, the default, prices none;
    /// a CPU calibrates it at about a millisecond a pass (`routepack calibrate`), where a
    /// per-expert cost alone (`c_exp`) prices one expert's call as cheap as a share of eight.
    pub c_call: f64,
    /// Seconds of one all-to-all beyond its bytes' link time (one dispatch or one combine of
    /// one pass): the collective's start-up and synchronisation, paid by every exchange
    /// whatever it moves, so an exchange's all-to-all is
    /// `2·K·(a2a_latency + slowest rank's link time)` ([`CostModel::all_to_all_latency`]).
    /// 0, the default, prices none; `routepack calibrate` fits it with the links (about
    /// 0.2 ms for a bare gloo all-to-all between local processes), or in an EPMoE layer where
    /// it measures the `exchange` (the layer's routing, split sizes and launches too: about
    /// 1 ms an all-to-all on the measured run's CPU ranks).
    pub a2a_latency: f64,
    /// Bytes/s at which an all-reduce inside a node moves a rank's bytes (a ring all-reduce
    /// of `n` bytes sends `2·(ep−1)/ep·n` from every rank): what the once-per-step sum of
    /// redundant experts' gradients costs ([`CostModel::redundant_grad_time`]). 0, the
    /// default, prices it at `bw_intra` (as an all-to-all's bytes); `routepack calibrate`
    /// measures it with the links where it times the `exchange` in the layer, whose bytes
    /// then set `bw_intra` (a gloo all-reduce between local CPU processes moves 1–2 GB/s where
    /// the layer's all-to-all moves 3–13).
    pub bw_reduce: f64,
    /// Seconds of one all-reduce beyond its bytes' time: its start-up and synchronisation. The
    /// once-per-step sum of redundant experts' gradients pays it once per layer that holds a
    /// redundant expert ([`CostModel::redundant_grad_time`]). 0, the default, prices none;
    /// `routepack calibrate` fits it with the links (the all-reduce's latency).
    pub reduce_latency: f64,
    /// Whether replica weights are fetched, and their gradients returned, while the layer's
    /// attention runs (`routepack.torch` posts them asynchronously: on a GPU they overlap it):
    /// replication is then exposed only beyond the attention
    /// ([`CostModel::exposed_replication`]). `false` exposes it in full, as on a clock that
    /// counts the transfers' work whenever it runs (a CPU rank's CPU time, gloo's threads
    /// included: `routepack measure`). `true`, the default, prices every plan as before.
    pub replica_prefetch: bool,
    /// Seconds per byte of a replica's weights or gradient an EP rank sends or receives,
    /// beyond the link's time: posting the copy's weights into its buffer, relaying them down
    /// the chain, and receiving, adding and forwarding its gradient in fp32
    /// (`routepack.torch`'s replica exchange). Charged per rank on the bytes of its hops
    /// ([`LinkBytes::replica_time`](links::LinkBytes)), in the forward copies and the backward
    /// return alike. 0, the default, prices the link alone; `routepack calibrate` fits it where
    /// it times the `replication` (about a nanosecond a byte on a CPU rank under gloo).
    pub c_replica: f64,
    /// Seconds per byte of expert state an EP rank migrates, sent or received, beyond the
    /// link's time: packing the slot and its optimizer state, checksumming it on both sides,
    /// backing up the slot it overwrites and unpacking it (`routepack.torch.migrate`). 0, the
    /// default, prices the link alone; `routepack calibrate` fits it where it times the
    /// `migration` (about a nanosecond a byte on a CPU rank).
    pub c_migrate: f64,
    /// Seconds of a window's migration whatever it moves, where it moves anything: the
    /// agreement and verification rounds between the EP ranks (`routepack.torch.migrate`).
    /// 0, the default, prices none; `routepack calibrate` fits it with `c_migrate`.
    pub migration_latency: f64,
    /// Whether a layer's all-to-all overlaps its computation ([`Overlap::None`] by default).
    pub overlap: Overlap,
    /// The passes of one step ([`DEFAULT_PASSES`] by default; RL adds the recompute's
    /// forward: `[Forward, Forward, Backward]`). Never empty.
    pub passes: Vec<Pass>,
}

impl CostModel {
    /// Checks the coefficients against a model of `num_layers` MoE layers: `a_quad` has one
    /// entry per layer, every coefficient is finite and >= 0, bandwidths > 0, and no unit of a
    /// step's work costs more than [`MAX_UNIT_SECONDS`] (so no step time overflows:
    /// `finite.rs`). Errors name the field (`cost.<name>`) and its value.
    pub fn check(&self, num_layers: usize) -> Result<()> {
        #[cfg(test)]
        crate::guard_counts::add("cost");
        if self.a_quad.len() != num_layers {
            return Err(invalid("cost.a_quad", format!("has {} entries, expected one per MoE layer ({num_layers})", self.a_quad.len())));
        }
        let scalars = [
            ("cost.a_lin", self.a_lin),
            ("cost.c_tok", self.c_tok),
            ("cost.c_exp", self.c_exp),
            ("cost.token_bytes", self.token_bytes),
            ("cost.expert_weight_bytes", self.expert_weight_bytes),
            ("cost.expert_grad_bytes", self.expert_grad_bytes),
            ("cost.expert_state_bytes", self.expert_state_bytes),
            ("cost.c_weights", self.c_weights),
            ("cost.c_gemm", self.c_gemm),
            ("cost.c_call", self.c_call),
            ("cost.a2a_latency", self.a2a_latency),
            ("cost.bw_reduce", self.bw_reduce),
            ("cost.reduce_latency", self.reduce_latency),
            ("cost.c_replica", self.c_replica),
            ("cost.c_migrate", self.c_migrate),
            ("cost.migration_latency", self.migration_latency),
        ];
        for (name, v) in scalars {
            if !v.is_finite() || v < 0.0 {
                return Err(invalid(name, format!("must be finite and >= 0, got {v}")));
            }
        }
        for (name, v) in [("cost.bw_intra", self.bw_intra), ("cost.bw_inter", self.bw_inter)] {
            if !v.is_finite() || v <= 0.0 {
                return Err(invalid(name, format!("must be finite and > 0, got {v}")));
            }
        }
        self.check_expert_table()?;
        if self.passes.is_empty() {
            return Err(invalid("cost.passes", "must name at least one pass, got none"));
        }
        if let Some((l, v)) = self.a_quad.iter().enumerate().find(|(_, v)| !v.is_finite() || **v < 0.0) {
            return Err(invalid("cost.a_quad", format!("layer {l} has {v}; must be finite and >= 0")));
        }
        finite::check_finite_step(self)
    }

    /// `expert_table`'s knots: tokens finite, >= 1 and strictly increasing; seconds finite and
    /// >= 0. Errors name the knot (`cost.expert_table[i]`) and its values.
    fn check_expert_table(&self) -> Result<()> {
        let mut last = f64::NEG_INFINITY;
        for (i, &(tokens, seconds)) in self.expert_table.iter().enumerate() {
            let name = format!("cost.expert_table[{i}]");
            if !tokens.is_finite() || tokens < 1.0 {
                return Err(invalid(name, format!("tokens must be finite and >= 1, got {tokens}")));
            }
            if tokens <= last {
                return Err(invalid(name, format!("tokens must increase from knot to knot, got {tokens} after {last}")));
            }
            if !seconds.is_finite() || seconds < 0.0 {
                return Err(invalid(name, format!("seconds must be finite and >= 0, got {seconds}")));
            }
            last = tokens;
        }
        Ok(())
    }

    /// Attention/dense work of one sample of length n in layer l (one pass).
    #[inline]
    pub fn attention(&self, l: usize, n: f64) -> f64 {
        self.a_lin * n + self.a_quad[l] * n * n
    }

    /// Compute multiplier of the step: Σ over its passes of [`Pass::compute`] (3 for the
    /// default forward + backward).
    #[inline]
    pub fn compute_passes(&self) -> f64 {
        self.passes.iter().map(|p| p.compute()).sum()
    }

    /// Communication multiplier of the step: dispatch + combine rounds, one per pass (2 for
    /// the default).
    #[inline]
    pub fn comm_passes(&self) -> f64 {
        self.passes.iter().map(|p| p.communication()).sum()
    }

    /// Seconds to move `bytes` between two EP-local ranks (intra- or inter-node).
    #[inline]
    pub fn link_time(&self, bytes: f64, same_node: bool) -> f64 {
        bytes / if same_node { self.bw_intra } else { self.bw_inter }
    }

    /// A model with unit-ish coefficients for tests (every option at its default).
    pub fn for_tests(num_layers: usize) -> Self {
        Self {
            a_lin: 1e-9,
            a_quad: (0..num_layers).map(|l| if l % 4 == 3 { 1e-13 } else { 0.0 }).collect(),
            c_tok: 2e-9,
            c_exp: 1e-6,
            token_bytes: 4096.0,
            bw_intra: 4e11,
            bw_inter: 5e10,
            expert_weight_bytes: 6e6,
            expert_grad_bytes: 12e6,
            expert_state_bytes: 42e6,
            ..Self::default()
        }
    }
}

impl Default for CostModel {
    /// Every option at its default, the one place they are written (the bindings report them
    /// to Python from here): no roofline floor (`c_weights`), GEMM step (`c_gemm`), expert
    /// table, kernel call (`c_call`) or all-to-all latency, the all-reduce at `bw_intra`
    /// (`bw_reduce` 0) without latency, replication hidden behind attention
    /// (`replica_prefetch`) and priced by its links alone (`c_replica` 0), migration priced by its links alone (`c_migrate`,
    /// `migration_latency` 0), no overlap and the default passes (forward + backward): what
    /// prices every plan as before the options existed. The coefficients a model must set are those
    /// of a free model: 0 seconds and 0 bytes, both bandwidths 1 byte/s, no MoE layer
    /// (`a_quad` empty); set them with `CostModel { a_lin: …, ..CostModel::default() }`.
    fn default() -> Self {
        Self {
            a_lin: 0.0,
            a_quad: Vec::new(),
            c_tok: 0.0,
            c_exp: 0.0,
            token_bytes: 0.0,
            bw_intra: 1.0,
            bw_inter: 1.0,
            expert_weight_bytes: 0.0,
            expert_grad_bytes: 0.0,
            expert_state_bytes: 0.0,
            c_weights: 0.0,
            c_gemm: 0.0,
            expert_table: Vec::new(),
            c_call: 0.0,
            a2a_latency: 0.0,
            bw_reduce: 0.0,
            reduce_latency: 0.0,
            replica_prefetch: true,
            c_replica: 0.0,
            c_migrate: 0.0,
            migration_latency: 0.0,
            overlap: Overlap::default(),
            passes: DEFAULT_PASSES.to_vec(),
        }
    }
}
