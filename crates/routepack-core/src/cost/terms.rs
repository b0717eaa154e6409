//! The terms of docs/design.md's cost model, written once: attention, links, all-to-all, overlap,
//! replication and the redundant experts' gradient sum (a rank's expert work and how an
//! exchange's parts combine are `rank`). `simulate` composes them exactly; every planner proxy
//! (layout, replication, placement prediction, the `ideal` reference) calls the same methods,
//! so a change to a term changes every user of it. Where a proxy approximates (for instance
//! placement's uniform all-to-all), the approximation is named in that proxy's docs together
//! with the test that ties it to `simulate`.

use super::links::LinkBytes;
use super::{CostModel, Overlap};
use crate::plan::ReplicaTiming;
use crate::topology::Topology;

impl CostModel {
    /// Seconds of an exchange's communication that its computation hides, given its
    /// compute (attention + expert work, all passes) and its all-to-all (all passes):
    /// 0 without overlap; `min(compute, all_to_all)` under [`Overlap::DispatchCombine`],
    /// so that `compute + all_to_all − hidden = max(compute, all_to_all)`.
    #[inline]
    pub fn hidden_communication(&self, compute: f64, all_to_all: f64) -> f64 {
        match self.overlap {
            Overlap::None => 0.0,
            Overlap::DispatchCombine => compute.min(all_to_all),
        }
    }

    /// All-to-all time of one exchange (EP group, microbatch, layer), given the dispatch bytes each
    /// rank sends and receives: the slowest rank's link time, twice (dispatch and combine) per
    /// communication pass (forward and backward).
    #[inline]
    pub(crate) fn all_to_all_time(&self, dispatch: &[LinkBytes]) -> f64 {
        self.all_to_all_of_link_time(LinkBytes::time(dispatch, self))
    }

    /// Seconds of an exchange's all-to-all latencies: `a2a_latency` for each of its
    /// all-to-alls (dispatch and combine, once per communication pass), whatever they move.
    /// [`crate::cost::LayerCost::new`] adds it to the link time of every exchange.
    #[inline]
    pub fn all_to_all_latency(&self) -> f64 {
        2.0 * self.comm_passes() * self.a2a_latency
    }

    /// All-to-all time from the slowest rank's one-way dispatch link time: dispatch and
    /// combine, forward and backward (the link part: the latencies are
    /// [`CostModel::all_to_all_latency`]).
    #[inline]
    pub fn all_to_all_of_link_time(&self, link_time: f64) -> f64 {
        2.0 * self.comm_passes() * link_time
    }

    /// Bytes an exchange's all-to-all moves in the cost model's count, given the bytes its
    /// dispatch sends (summed over ranks): dispatch and combine, forward and backward, the
    /// same multiplier as [`CostModel::all_to_all_of_link_time`] puts on the time.
    #[inline]
    pub fn all_to_all_bytes(&self, dispatch_bytes: f64) -> f64 {
        2.0 * self.comm_passes() * dispatch_bytes
    }

    /// Attention/dense work of layer l of a group of samples in one pass, given their
    /// `Σ n` (`lin`) and `Σ n²` (`quad`): what one rank's cell costs.
    #[inline]
    pub fn attention_of_sums(&self, l: usize, lin: f64, quad: f64) -> f64 {
        self.a_lin * lin + self.a_quad[l] * quad
    }

    /// One rank's quadratic attention term under ring attention ([`crate::split`]): a sample of
    /// `n` tokens split over `cp` ranks by a load-balanced causal ring (each rank holding two
    /// mirrored chunks of the sequence) costs every rank a cp-th of its n², n²/cp. (Each
    /// rank's piece of ⌈n/cp⌉ or ⌊n/cp⌋ tokens would cost at most that alone, for n >= cp.)
    #[inline]
    pub fn ring_quad(n: f64, cp: usize) -> f64 {
        n * n / cp as f64
    }

    /// Seconds one pass of ring attention spends passing KV blocks around a CP group of `cp`
    /// ranks, one layer: cp − 1 steps, each every rank sending a block of ⌈n/cp⌉ tokens (the
    /// largest piece) to the next, at `token_bytes` a token (K and V of a token priced as its
    /// hidden state's bytes), over the group's links (`same_node`: all its ranks on one node),
    /// not overlapped with the ring's compute.
    #[inline]
    pub fn ring_kv_time(&self, n: i64, cp: usize, same_node: bool) -> f64 {
        let block = (n as f64 / cp as f64).ceil();
        (cp.saturating_sub(1)) as f64 * self.link_time(block * self.token_bytes, same_node)
    }

    /// [`CostModel::attention_of_sums`] of one rank's cell plus `kv`, its ring's
    /// [`CostModel::ring_kv_time`], on a layer with quadratic attention (`a_quad[l] > 0`; a
    /// layer without one passes no KV blocks).
    #[inline]
    pub fn ring_attention(&self, l: usize, lin: f64, quad: f64, kv: f64) -> f64 {
        let a = self.attention_of_sums(l, lin, quad);
        if kv > 0.0 && self.a_quad[l] > 0.0 {
            a + kv
        } else {
            a
        }
    }

    /// Seconds per byte a rank sends when its traffic is spread uniformly over the EP group:
    /// the share `(ranks per node − 1) / ep` goes over the intra-node link, the rest
    /// `(ep − ranks per node) / ep` between nodes. The uniform-traffic approximation of the
    /// `ideal` reference and of placement's time predictor.
    #[inline]
    pub fn uniform_seconds_per_byte(&self, topo: &Topology) -> f64 {
        let (ep, rpn) = (topo.ep as f64, topo.ranks_per_group_node() as f64);
        (rpn - 1.0) / ep / self.bw_intra + (ep - rpn) / ep / self.bw_inter
    }

    /// Replication traffic not hidden by the layer's attention: with
    /// [`CostModel::replica_prefetch`] the forward weight copies (`fwd` seconds) overlap one
    /// attention pass and the backward gradient reduction (`bwd`) the two backward attention
    /// passes; without it both are exposed in full.
    #[inline]
    pub fn exposed_replication(&self, fwd: f64, bwd: f64, attention_max: f64) -> f64 {
        if self.replica_prefetch {
            (fwd - attention_max).max(0.0) + (bwd - 2.0 * attention_max).max(0.0)
        } else {
            fwd + bwd
        }
    }

    /// Seconds one EP rank spends on the replica copies' bytes beyond its link time:
    /// [`CostModel::c_replica`] per byte its hops send or receive (posting, relaying and
    /// receiving a copy's weights, adding and forwarding its fp32 gradient), `bytes` their sum
    /// over both links. The one statement of the term: the simulator
    /// (`LinkBytes::replica_time`) and replication's priced state add it to a rank's hop time.
    #[inline]
    pub fn replica_overhead(&self, bytes: f64) -> f64 {
        self.c_replica * bytes
    }

    /// [`CostModel::exposed_replication`] of copies moved as `timing` says, split into (forward
    /// copies, backward gradient return): copies planned from the router's output
    /// ([`ReplicaTiming::AfterRouter`]) cannot overlap the layer's attention in the forward
    /// pass, which ran before them; their gradients overlap the backward attention as any
    /// copy's do. Prefetched copies: `exposed_replication`'s two parts.
    #[inline]
    pub fn exposed_replication_parts(&self, fwd: f64, bwd: f64, attention_max: f64, timing: ReplicaTiming) -> (f64, f64) {
        match (self.replica_prefetch, timing) {
            (false, _) => (fwd, bwd),
            (true, ReplicaTiming::Prefetched) => ((fwd - attention_max).max(0.0), (bwd - 2.0 * attention_max).max(0.0)),
            (true, ReplicaTiming::AfterRouter) => (fwd, (bwd - 2.0 * attention_max).max(0.0)),
        }
    }

    /// Seconds of a window's migration from the bytes each EP rank sends and receives
    /// (`links`): where anything moves, [`CostModel::migration_latency`] plus the slowest
    /// rank's link time (per link max(sent, received) over its bandwidth) and staging
    /// ([`CostModel::c_migrate`] per byte it sends or receives, and twice per byte it copies
    /// between its own slots: `LinkBytes::staged`); 0 where nothing moves.
    /// Exposed: the simulator adds it to the step, and placement weighs its moves with it.
    pub(crate) fn migration_time(&self, links: &[LinkBytes]) -> f64 {
        let staged = |b: &LinkBytes| {
            let t = b.rank_time(self);
            // (added only where set, so a model without it keeps its bits)
            if self.c_migrate > 0.0 {
                t + self.c_migrate * b.staged()
            } else {
                t
            }
        };
        let slowest = links.iter().map(staged).fold(0.0, f64::max);
        if self.migration_latency > 0.0 && links.iter().any(|b| b.staged() > 0.0) {
            self.migration_latency + slowest
        } else {
            slowest
        }
    }

    /// Seconds of summing `redundant` experts' fp32 gradients (`expert_grad_bytes` each) over
    /// the EP group, once per step: what `routepack.torch.slot_link` does in the backward of
    /// the step's last microbatch for every expert a placement holds in more than one slot
    /// (one all-reduce a layer, in the `layers` layers that hold one, summed here over
    /// layers). Priced as a ring all-reduce: every rank sends and receives `2·(ep−1)/ep` of
    /// the bytes, over the inter-node link where the group spans nodes (the ring's slowest
    /// hop), else inside the node (at `bw_reduce` where it is set, else `bw_intra`), plus
    /// [`CostModel::reduce_latency`] per all-reduce; exposed (it sits at the end of the
    /// backward, where nothing of the step is left to hide it behind).
    #[inline]
    pub fn redundant_grad_time(&self, redundant: f64, layers: f64, topo: &Topology) -> f64 {
        let ep = topo.ep as f64;
        if topo.ep < 2 || redundant <= 0.0 {
            return 0.0;
        }
        let bytes = 2.0 * (ep - 1.0) / ep * redundant * self.expert_grad_bytes;
        let same_node = topo.nodes_per_group() < 2;
        let t = if same_node && self.bw_reduce > 0.0 { bytes / self.bw_reduce } else { self.link_time(bytes, same_node) };
        // (added only where set, so a model without it keeps its bits)
        if self.reduce_latency > 0.0 {
            t + layers * self.reduce_latency
        } else {
            t
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_after_the_router_expose_their_forward_part() {
        let c = CostModel::for_tests(1);
        let (fwd, bwd, attn) = (3.0, 5.0, 2.0);
        // prefetched: the forward copies hide behind one attention pass, the backward behind two
        assert_eq!(c.exposed_replication_parts(fwd, bwd, attn, ReplicaTiming::Prefetched), (1.0, 1.0));
        assert_eq!(c.exposed_replication(fwd, bwd, attn), 2.0);
        // after the router: the forward copies wait on nothing to hide behind
        assert_eq!(c.exposed_replication_parts(fwd, bwd, attn, ReplicaTiming::AfterRouter), (3.0, 1.0));
        // without prefetching every copy is exposed, whenever it was planned
        let off = CostModel { replica_prefetch: false, ..c };
        for t in [ReplicaTiming::Prefetched, ReplicaTiming::AfterRouter] {
            assert_eq!(off.exposed_replication_parts(fwd, bwd, attn, t), (3.0, 5.0));
        }
    }
}
