//! Bytes each EP rank sends and receives over the two links (inside a node, between nodes):
//! the one accounting that the simulator's all-to-all, replication and migration terms and
//! placement's migration pricing all use, so they cannot drift apart.

use super::CostModel;
use crate::plan::ExpertMove;
use crate::topology::Topology;

/// Per-rank bytes over the two links, sent and received.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct LinkBytes {
    send_intra: f64,
    recv_intra: f64,
    send_inter: f64,
    recv_inter: f64,
    /// Bytes of a migration's moves within this rank (a slot copied to another slot of the
    /// same rank): no link carries them, but `routepack.torch.migrate` packs, checksums and
    /// unpacks them as it does bytes it sends and receives (staging, [`CostModel::c_migrate`]).
    local: f64,
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

    /// Adds a migration move: its bytes over a link as [`Self::add`], or, for a copy between two
    /// slots of one rank, the expert's state (`cost.expert_state_bytes`: the plan's row
    /// carries 0 bytes there, since no link moves it) as that rank's local bytes.
    pub(crate) fn add_move(v: &mut [LinkBytes], mv: &ExpertMove, topo: &Topology, cost: &CostModel) {
        let (s, d) = (mv.src_rank as usize, mv.dst_rank as usize);
        if s == d {
            v[s].local += cost.expert_state_bytes;
        } else {
            Self::add(v, s, d, mv.bytes, topo.local_node_of(s) == topo.local_node_of(d));
        }
    }

    /// Adds `sign` times another rank's bytes.
    pub(crate) fn merge(&mut self, o: &LinkBytes, sign: f64) {
        self.send_intra += sign * o.send_intra;
        self.recv_intra += sign * o.recv_intra;
        self.send_inter += sign * o.send_inter;
        self.recv_inter += sign * o.recv_inter;
        self.local += sign * o.local;
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

    /// The slowest rank's replication time: its link time ([`Self::rank_time`]) plus
    /// [`CostModel::replica_overhead`] of the bytes it sends or receives (at both ends of every
    /// hop); the link time alone where `c_replica` is 0 (same bits).
    pub(crate) fn replica_time(v: &[LinkBytes], cost: &CostModel) -> f64 {
        if cost.c_replica > 0.0 {
            v.iter().map(|b| b.rank_time(cost) + cost.replica_overhead(b.total())).fold(0.0, f64::max)
        } else {
            Self::time(v, cost)
        }
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

    /// Bytes this rank stages in a migration: what it sends and receives, and its local moves
    /// twice (packed from one slot, unpacked into the other).
    #[inline]
    pub(crate) fn staged(&self) -> f64 {
        self.total() + 2.0 * self.local
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A copy between two slots of one rank uses no link but is staged twice (packed, then
    /// unpacked); alone it still pays the migration's fixed cost.
    #[test]
    fn a_local_move_is_staged_twice_over_no_link() {
        let topo = Topology::new(2, 2, 2, 4).unwrap();
        let cost = CostModel { c_migrate: 1e-3, migration_latency: 0.5, expert_state_bytes: 100.0, ..CostModel::default() };
        let mv = |s: i32, d: i32, bytes: f64| ExpertMove {
            layer: 0,
            expert: 1,
            src_rank: s,
            dst_rank: d,
            src_slot: 4 * s,
            dst_slot: 4 * d + 1,
            bytes,
        };
        let mut v = vec![LinkBytes::default(); 2];
        LinkBytes::add_move(&mut v, &mv(1, 1, 0.0), &topo, &cost);
        assert_eq!(v[1].rank_time(&cost), 0.0);
        assert_eq!(v[1].staged(), 200.0);
        assert!((cost.migration_time(&v) - 0.7).abs() < 1e-12, "{}", cost.migration_time(&v));
        LinkBytes::add_move(&mut v, &mv(0, 1, 50.0), &topo, &cost);
        assert_eq!((v[0].staged(), v[1].staged()), (50.0, 250.0));
        let unpriced = CostModel::default();
        assert_eq!(unpriced.migration_time(&[LinkBytes { local: 1e9, ..LinkBytes::default() }]), 0.0);
    }
}
