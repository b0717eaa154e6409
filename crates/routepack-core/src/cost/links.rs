//! Bytes each EP rank sends and receives over the two links (inside a node, between nodes):
//! the one accounting that the simulator's all-to-all, replication and migration terms and
//! placement's migration pricing all use, so they cannot drift apart.

use super::CostModel;

/// Per-rank bytes over the two links, sent and received.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct LinkBytes {
    send_intra: f64,
    recv_intra: f64,
    send_inter: f64,
    recv_inter: f64,
}

impl LinkBytes {
    /// Adds `bytes` sent by rank `from` to rank `to` (`same_node`: over the intra-node link).
    pub(crate) fn add(v: &mut [LinkBytes], from: usize, to: usize, bytes: f64, same_node: bool) {
        if same_node {
            v[from].send_intra += bytes;
            v[to].recv_intra += bytes;
        } else {
            v[from].send_inter += bytes;
            v[to].recv_inter += bytes;
        }
    }

    /// Adds `sign` times another rank's bytes.
    pub(crate) fn merge(&mut self, o: &LinkBytes, sign: f64) {
        self.send_intra += sign * o.send_intra;
        self.recv_intra += sign * o.recv_intra;
        self.send_inter += sign * o.send_inter;
        self.recv_inter += sign * o.recv_inter;
    }

    /// Bytes sent over each link summed over all ranks: `(inside nodes, between nodes)`.
    /// Every byte is counted once, at its sender (a rank's received bytes are another's sent).
    pub(crate) fn sent_totals(v: &[LinkBytes]) -> (f64, f64) {
        v.iter().fold((0.0, 0.0), |(intra, inter), b| (intra + b.send_intra, inter + b.send_inter))
    }

    /// The slowest rank's time: per link max(sent, received) over that link's bandwidth.
    pub(crate) fn time(v: &[LinkBytes], cost: &CostModel) -> f64 {
        v.iter().map(|b| b.rank_time(cost)).fold(0.0, f64::max)
    }

    /// This rank's time: per link max(sent, received) over that link's bandwidth.
    #[inline]
    pub(crate) fn rank_time(&self, cost: &CostModel) -> f64 {
        self.send_intra.max(self.recv_intra) / cost.bw_intra + self.send_inter.max(self.recv_inter) / cost.bw_inter
    }

    /// Bytes this rank sends and receives, both links.
    #[inline]
    pub(crate) fn total(&self) -> f64 {
        self.send_intra + self.recv_intra + self.send_inter + self.recv_inter
    }
}
