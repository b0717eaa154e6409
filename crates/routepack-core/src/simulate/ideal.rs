//! docs/design.md's `ideal`, the balanced reference of `SimReport::ideal_time` (not a bound).

use rayon::prelude::*;

use crate::cost::CostModel;
use crate::topology::Topology;
use crate::window::WindowView;

/// docs/design.md's `ideal` at `ideal_micro` microbatches per rank.
pub fn ideal_time(w: &WindowView, topo: &Topology, cost: &CostModel, ideal_micro: usize) -> f64 {
    // layers in parallel (a pass over the whole demand); integer sums are exact
    let layer_tokens: Vec<f64> =
        (0..w.num_layers).into_par_iter().map(|l| (0..w.num_samples).map(|s| w.tokens(s, l).sum()).sum::<i64>() as f64).collect();
    ideal_time_of(&layer_tokens, w, topo, cost, ideal_micro)
}

/// [`ideal_time`] given each layer's routed tokens `layer_tokens` `[L]` (Σ_s Σ_e).
pub(super) fn ideal_time_of(layer_tokens: &[f64], w: &WindowView, topo: &Topology, cost: &CostModel, ideal_micro: usize) -> f64 {
    let (dp, ep) = (topo.dp as f64, topo.ep as f64);
    let lin: f64 = w.seq_lens.iter().map(|&n| n as f64).sum();
    let quad: f64 = w.seq_lens.iter().map(|&n| (n as f64) * (n as f64)).sum();
    let passes = cost.compute_passes();
    // added in layer order: the same value for any thread count
    layer_tokens.iter().enumerate().fold(0.0, |total, (l, &tt)| {
        let attn = passes * cost.attention_of_sums(l, lin, quad) / dp;
        let expert = passes * cost.expert_time(tt / dp, ideal_micro as f64 * w.num_experts as f64 / ep);
        let per_rank_bytes = tt / dp * cost.token_bytes;
        let a2a = 2.0 * cost.comm_passes() * per_rank_bytes * cost.uniform_seconds_per_byte(topo);
        total + (attn + expert + a2a - cost.hidden_communication(attn + expert, a2a))
    })
}
