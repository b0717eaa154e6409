//! The cluster's shape: data-parallel ranks, expert-parallel groups, nodes, expert slots and
//! the replica buffers a rank holds for intra-batch copies.

use crate::error::{invalid, Result};

/// The cluster's shape, checked by [`Topology::new`] / [`Topology::check`]:
///
/// * `dp` data-parallel ranks, each running its own microbatches.
/// * EP groups are consecutive blocks of `ep` DP ranks (group g = ranks g·ep .. g·ep+ep-1).
/// * nodes are consecutive blocks of `gpus_per_node` global ranks.
/// * each EP rank has `slots_per_rank` physical expert slots per MoE layer; physical slot p
///   lives on EP-local rank p / slots_per_rank (DeepSeek EPLB convention).
/// * each EP rank holds `replica_slots` spare expert buffers per MoE layer for the intra-batch
///   copies of one microbatch: in one exchange (EP group, microbatch, layer) a rank receives
///   copies of at most that many distinct experts (`validate` refuses a plan over it; the
///   replication planners plan within it; the lower bound relies on it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Topology {
    /// Data-parallel ranks (global GPUs), a multiple of `ep`.
    pub dp: usize,
    /// EP ranks per EP group; `ep` and `gpus_per_node` divide one another.
    pub ep: usize,
    /// GPUs per node: ranks on one node talk over the fast intra-node link (`bw_intra`).
    pub gpus_per_node: usize,
    /// Physical expert slots per EP rank per MoE layer (the placement's memory budget).
    pub slots_per_rank: usize,
    /// Spare expert buffers per EP rank per MoE layer for intra-batch copies: the most
    /// distinct experts one rank receives copies of in one exchange (the replication's memory
    /// budget). [`DEFAULT_REPLICA_SLOTS`] unless set ([`Topology::with_replica_slots`]).
    pub replica_slots: usize,
}

/// Replica buffers per rank and layer unless a topology says otherwise: 3, the most copies any
/// built-in replication puts on one rank in one exchange with its defaults (MindSpeed's rule
/// broadcasts its N = 3 hot experts to every rank, `replication::hot_n::DEFAULT_HOT_EXPERTS`;
/// ReLibra's and routepack's replication use 2, `replication::routepack::DEFAULT_REPLICA_SLOTS`),
/// so that no plan of a built-in policy with default options changes.
pub const DEFAULT_REPLICA_SLOTS: usize = 3;

impl Topology {
    /// A checked topology (see [`Topology::check`]) with [`DEFAULT_REPLICA_SLOTS`] replica
    /// buffers a rank; errors name the field and its value.
    pub fn new(dp: usize, ep: usize, gpus_per_node: usize, slots_per_rank: usize) -> Result<Self> {
        let t = Self { dp, ep, gpus_per_node, slots_per_rank, replica_slots: DEFAULT_REPLICA_SLOTS };
        t.check()?;
        Ok(t)
    }

    /// This topology with `replica_slots` replica buffers a rank (0: no intra-batch copies),
    /// checked.
    pub fn with_replica_slots(self, replica_slots: usize) -> Result<Self> {
        let t = Self { replica_slots, ..self };
        t.check()?;
        Ok(t)
    }

    /// Consistency of the numbers on their own (not against a model).
    pub fn check(&self) -> Result<()> {
        if self.dp == 0 {
            return Err(invalid("topo.dp", "must be >= 1, got 0"));
        }
        if self.ep == 0 {
            return Err(invalid("topo.ep", "must be >= 1, got 0"));
        }
        if self.gpus_per_node == 0 {
            return Err(invalid("topo.gpus_per_node", "must be >= 1, got 0"));
        }
        if self.slots_per_rank == 0 {
            return Err(invalid("topo.slots_per_rank", "must be >= 1, got 0"));
        }
        if !self.dp.is_multiple_of(self.ep) {
            return Err(invalid("topo", format!("dp={} is not a multiple of ep={}", self.dp, self.ep)));
        }
        if !self.ep.is_multiple_of(self.gpus_per_node) && !self.gpus_per_node.is_multiple_of(self.ep) {
            return Err(invalid(
                "topo",
                format!(
                    "ep={} and gpus_per_node={} must divide one another (an EP group spans whole nodes or lies inside one)",
                    self.ep, self.gpus_per_node
                ),
            ));
        }
        // plans store DP ranks and physical slots as int32
        if self.dp > i32::MAX as usize {
            return Err(invalid("topo.dp", format!("{} does not fit the int32 rank ids of a plan", self.dp)));
        }
        if self.ep.checked_mul(self.slots_per_rank).is_none_or(|n| n > i32::MAX as usize) {
            return Err(invalid(
                "topo",
                format!("ep*slots_per_rank = {}*{} does not fit the int32 slot ids of a plan", self.ep, self.slots_per_rank),
            ));
        }
        // a rank's experts in one exchange, slots_per_rank + replica_slots, count in usize
        if self.replica_slots > i32::MAX as usize {
            return Err(invalid("topo.replica_slots", format!("{} is more buffers than a plan's int32 ids can name", self.replica_slots)));
        }
        Ok(())
    }

    /// Checks that the slots can hold every logical expert at least once.
    pub fn check_experts(&self, num_experts: usize) -> Result<()> {
        self.check()?;
        if self.num_slots() < num_experts {
            return Err(invalid(
                "topo",
                format!("ep*slots_per_rank = {}*{} = {} < num_experts = {}", self.ep, self.slots_per_rank, self.num_slots(), num_experts),
            ));
        }
        Ok(())
    }

    /// EP groups: dp / ep.
    #[inline]
    pub fn num_groups(&self) -> usize {
        self.dp / self.ep
    }
    /// Physical slots per layer in one EP group: ep · slots_per_rank.
    #[inline]
    pub fn num_slots(&self) -> usize {
        self.ep * self.slots_per_rank
    }
    /// EP-local rank that holds physical slot p.
    #[inline]
    pub fn rank_of_slot(&self, p: usize) -> usize {
        p / self.slots_per_rank
    }
    /// Node of global rank d.
    #[inline]
    pub fn node_of(&self, global_rank: usize) -> usize {
        global_rank / self.gpus_per_node
    }
    /// Node index, within its EP group, of EP-local rank r (same for every group because
    /// groups start on node boundaries or lie inside one node).
    #[inline]
    pub fn local_node_of(&self, ep_rank: usize) -> usize {
        ep_rank / self.gpus_per_node.min(self.ep)
    }
    /// Nodes spanned by one EP group.
    #[inline]
    pub fn nodes_per_group(&self) -> usize {
        self.ep.div_ceil(self.gpus_per_node).max(1)
    }
    /// EP ranks of one group that share a node.
    #[inline]
    pub fn ranks_per_group_node(&self) -> usize {
        self.gpus_per_node.min(self.ep)
    }
}
