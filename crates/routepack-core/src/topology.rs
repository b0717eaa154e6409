//! The cluster's shape: data-parallel ranks, expert-parallel groups, nodes, expert slots, the
//! replica buffers a rank holds for intra-batch copies, and the pipeline (stages, model chunks)
//! and context-parallel groups a trainer runs.

use crate::error::{invalid, Result};

/// The cluster's shape, checked by [`Topology::new`] / [`Topology::check`]:
///
/// * `dp` data-parallel ranks, each running its own microbatches.
/// * EP groups are consecutive blocks of `ep` DP ranks (group g = ranks g·ep .. g·ep+ep-1).
/// * nodes are consecutive blocks of `gpus_per_node` global ranks; NVLink domains (the GPUs that
///   reach one another over NVLink at `bw_intra`) are blocks of `nvlink_domain` GPUs, a node
///   unless a rack-scale system joins several (GB200 NVL72: 18 nodes of 4). Everything the cost
///   model and the planners call a "node" (`node_of`, `local_node_of`, ...) is a domain: the
///   only thing about a node that prices a plan is which link joins two ranks.
/// * each EP rank has `slots_per_rank` physical expert slots per MoE layer; physical slot p
///   lives on EP-local rank p / slots_per_rank (DeepSeek EPLB convention).
/// * each EP rank holds `replica_slots` spare expert buffers per MoE layer for the intra-batch
///   copies of one microbatch: in one exchange (EP group, microbatch, layer) a rank receives
///   copies of at most that many distinct experts (`validate` refuses a plan over it; the
///   replication planners plan within it; the lower bound relies on it).
/// * `pp` pipeline stages hold consecutive MoE layers (`vpp` model chunks each under
///   interleaved 1F1B, Megatron's virtual pipeline); every stage has its own `dp` ranks, EP
///   groups and nodes: DP rank d of stage s is global rank `s·dp + d` (pipeline outermost, as in
///   Megatron's default order). A microbatch flows through the stages of its DP rank.
/// * `cp` consecutive DP ranks (inside one EP group) form a context-parallel group: what
///   `Oversize::Split` splits a sample over the cap over (`crate::split`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    /// Data-parallel ranks (global GPUs), a multiple of `ep`.
    pub dp: usize,
    /// EP ranks per EP group; `ep` and `gpus_per_node` divide one another.
    pub ep: usize,
    /// GPUs per node (host); an EP group spans whole nodes or lies inside one.
    pub gpus_per_node: usize,
    /// GPUs per NVLink domain: ranks of one domain talk over the fast link (`bw_intra`), ranks
    /// of two over `bw_inter`. [`Topology::new`] sets it to `gpus_per_node` (a node is a
    /// domain); [`Topology::with_nvlink_domain`] sets a rack-scale one (a multiple of
    /// `gpus_per_node`). Where it is at least `ep` it holds ⌊nvlink_domain / ep⌋ whole EP groups
    /// (its other GPUs run no rank of the plan: an EP group never straddles two domains), else
    /// an EP group spans whole domains (`ep` a multiple of it).
    pub nvlink_domain: usize,
    /// Physical expert slots per EP rank per MoE layer (the placement's memory budget).
    pub slots_per_rank: usize,
    /// Spare expert buffers per EP rank per MoE layer for intra-batch copies: the most
    /// distinct experts one rank receives copies of in one exchange (the replication's memory
    /// budget). [`DEFAULT_REPLICA_SLOTS`] unless set ([`Topology::with_replica_slots`]).
    pub replica_slots: usize,
    /// Pipeline stages ([`DEFAULT_PP`]: no pipeline).
    pub pp: usize,
    /// Model chunks (virtual stages) per pipeline stage: interleaved 1F1B where > 1
    /// ([`DEFAULT_VPP`]: plain 1F1B). Needs `pp` > 1.
    pub vpp: usize,
    /// DP ranks of one context-parallel group ([`DEFAULT_CP`]: none); divides `ep`. A sample
    /// over the cap is split over one under `Oversize::Split` (`crate::split`).
    pub cp: usize,
    /// MoE layers of each model chunk in chunk order (chunk `v·pp + s` is virtual stage v of
    /// stage s), `pp·vpp` entries >= 1 summing to the model's MoE layers; None: Megatron's even
    /// split of consecutive layers ([`Topology::chunk_bounds`]).
    pub layers_per_stage: Option<Vec<usize>>,
}

/// Pipeline stages unless a topology says otherwise: 1, no pipeline (every figure as before).
pub const DEFAULT_PP: usize = 1;
/// Model chunks per stage unless a topology says otherwise: 1, plain 1F1B.
pub const DEFAULT_VPP: usize = 1;
/// Context-parallel ranks unless a topology says otherwise: 1, no context parallelism.
pub const DEFAULT_CP: usize = 1;

/// Megatron's rule for the microbatch count M of a pipeline (`Topology::micro_rule`): at least
/// `min` (pp: every stage busy in the steady state) and a multiple of `multiple` (pp under the
/// interleaved schedule, whose `microbatch_group_size_per_vp_stage` defaults to pp and whose
/// last group may not be shorter than pp).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MicroRule {
    /// The fewest microbatches per DP rank.
    pub min: usize,
    /// Microbatches per DP rank come in multiples of this.
    pub multiple: usize,
}

impl MicroRule {
    /// No rule: any M >= 1 (no pipeline).
    pub const NONE: MicroRule = MicroRule { min: 1, multiple: 1 };

    /// Megatron's rule for `pp` pipeline stages of `vpp` model chunks each: at least pp, in
    /// multiples of pp under the interleaved schedule (vpp > 1); [`MicroRule::NONE`] for pp < 2.
    /// The one statement of the rule (Python's `Topology.min_micro` / `micro_multiple` read it
    /// through `_core.micro_rule`).
    pub fn of_pipeline(pp: usize, vpp: usize) -> MicroRule {
        if pp < 2 {
            return MicroRule::NONE;
        }
        MicroRule { min: pp, multiple: if vpp > 1 { pp } else { 1 } }
    }

    /// The fewest microbatches per DP rank any plan of `tokens` tokens in rows of at most `cap`
    /// tokens on `dp` ranks can run under this rule: ⌈⌈tokens / cap⌉ / dp⌉, at least 1, raised to
    /// the rule ([`Self::fit`]). `cap` and `dp` below 1 count as 1. The one statement of the
    /// fewest-microbatches rule ([`crate::bound::lower_bound_micro`], Python's
    /// `routepack.simulate.lower_bound_micro` through `_core.lower_bound_micro`).
    pub fn fewest(&self, tokens: u64, cap: u64, dp: usize) -> usize {
        let rows = tokens.div_ceil(cap.max(1));
        let per_rank = usize::try_from(rows.div_ceil(dp.max(1) as u64)).unwrap_or(usize::MAX);
        self.fit(per_rank)
    }

    /// The smallest count >= `micro` (and >= 1) the rule allows.
    #[inline]
    pub fn fit(&self, micro: usize) -> usize {
        micro.max(self.min).max(1).div_ceil(self.multiple) * self.multiple
    }

    /// Whether `micro` meets the rule.
    #[inline]
    pub fn allows(&self, micro: usize) -> bool {
        micro >= self.min && micro.is_multiple_of(self.multiple)
    }
}

/// Replica buffers per rank and layer unless a topology says otherwise: 3, the most copies any
/// built-in replication puts on one rank in one exchange with its defaults (MindSpeed's rule
/// broadcasts its N = 3 hot experts to every rank, `replication::hot_n::DEFAULT_HOT_EXPERTS`;
/// ReLibra's and routepack's replication use 2, `replication::routepack::DEFAULT_REPLICATION_SLOTS`),
/// so that no plan of a built-in policy with default options changes.
pub const DEFAULT_REPLICA_SLOTS: usize = 3;

impl Topology {
    /// A checked topology (see [`Topology::check`]) with [`DEFAULT_REPLICA_SLOTS`] replica
    /// buffers a rank; errors name the field and its value.
    pub fn new(dp: usize, ep: usize, gpus_per_node: usize, slots_per_rank: usize) -> Result<Self> {
        let t = Self {
            dp,
            ep,
            gpus_per_node,
            nvlink_domain: gpus_per_node,
            slots_per_rank,
            replica_slots: DEFAULT_REPLICA_SLOTS,
            pp: DEFAULT_PP,
            vpp: DEFAULT_VPP,
            cp: DEFAULT_CP,
            layers_per_stage: None,
        };
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

    /// This topology with NVLink domains of `nvlink_domain` GPUs (see the field), checked.
    pub fn with_nvlink_domain(self, nvlink_domain: usize) -> Result<Self> {
        let t = Self { nvlink_domain, ..self };
        t.check()?;
        Ok(t)
    }

    /// This topology with `pp` pipeline stages of `vpp` model chunks each and the chunks' MoE
    /// layers (None: the even split), checked.
    pub fn with_pipeline(self, pp: usize, vpp: usize, layers_per_stage: Option<Vec<usize>>) -> Result<Self> {
        let t = Self { pp, vpp, layers_per_stage, ..self };
        t.check()?;
        Ok(t)
    }

    /// This topology with context-parallel groups of `cp` DP ranks, checked.
    pub fn with_cp(self, cp: usize) -> Result<Self> {
        let t = Self { cp, ..self };
        t.check()?;
        Ok(t)
    }

    /// Megatron's rule for the microbatch count under this pipeline ([`MicroRule`]):
    /// [`MicroRule::NONE`] without one.
    pub fn micro_rule(&self) -> MicroRule {
        MicroRule::of_pipeline(self.pp, self.vpp)
    }

    /// Model chunks: pp · vpp.
    #[inline]
    pub fn num_chunks(&self) -> usize {
        self.pp * self.vpp
    }

    /// The first MoE layer of every model chunk and the end, `[pp·vpp + 1]`: chunk c holds
    /// layers `bounds[c]..bounds[c + 1]`, chunk `v·pp + s` being virtual stage v of stage s.
    /// `layers_per_stage` where given (its sum must be `num_layers`), else Megatron's even split
    /// of consecutive layers (`num_layers` a multiple of pp·vpp). Errors name
    /// `topo.layers_per_stage`.
    pub fn chunk_bounds(&self, num_layers: usize) -> Result<Vec<usize>> {
        let chunks = self.num_chunks();
        let sizes = match &self.layers_per_stage {
            Some(v) => {
                let total: usize = v.iter().sum();
                if total != num_layers {
                    return Err(invalid(
                        "topo.layers_per_stage",
                        format!("{v:?} holds {total} MoE layers, but the model has {num_layers}"),
                    ));
                }
                v.clone()
            }
            None if num_layers.is_multiple_of(chunks) && num_layers >= chunks => vec![num_layers / chunks; chunks],
            None => {
                return Err(invalid(
                    "topo.layers_per_stage",
                    format!(
                        "not given, and {num_layers} MoE layers do not split evenly over pp*vpp = {}*{} = {chunks} model chunks; \
                         give each chunk's layers",
                        self.pp, self.vpp
                    ),
                ))
            }
        };
        let mut bounds = Vec::with_capacity(chunks + 1);
        bounds.push(0);
        for n in sizes {
            bounds.push(bounds.last().copied().unwrap_or(0) + n);
        }
        Ok(bounds)
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
        self.check_domain()?;
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
        self.check_pipeline()?;
        // a rank's experts in one exchange, slots_per_rank + replica_slots, count in usize
        if self.replica_slots > i32::MAX as usize {
            return Err(invalid("topo.replica_slots", format!("{} is more buffers than a plan's int32 ids can name", self.replica_slots)));
        }
        Ok(())
    }

    /// `nvlink_domain` against the nodes and the EP groups.
    fn check_domain(&self) -> Result<()> {
        let d = self.nvlink_domain;
        if d == 0 {
            return Err(invalid("topo.nvlink_domain", "must be >= 1, got 0"));
        }
        if !d.is_multiple_of(self.gpus_per_node) {
            return Err(invalid(
                "topo.nvlink_domain",
                format!("{d} is not a multiple of gpus_per_node = {} (a domain holds whole nodes)", self.gpus_per_node),
            ));
        }
        if d < self.ep && !self.ep.is_multiple_of(d) {
            return Err(invalid(
                "topo.nvlink_domain",
                format!("{d} < ep = {} and does not divide it (an EP group spans whole domains or lies inside one)", self.ep),
            ));
        }
        Ok(())
    }

    /// `pp`, `vpp`, `cp` and `layers_per_stage` on their own.
    fn check_pipeline(&self) -> Result<()> {
        if self.pp == 0 {
            return Err(invalid("topo.pp", "must be >= 1, got 0"));
        }
        if self.vpp == 0 {
            return Err(invalid("topo.vpp", "must be >= 1, got 0"));
        }
        if self.vpp > 1 && self.pp < 2 {
            return Err(invalid(
                "topo.vpp",
                format!("{} model chunks per stage need a pipeline (pp >= 2), got pp = {}", self.vpp, self.pp),
            ));
        }
        if self.pp.checked_mul(self.vpp).is_none_or(|c| c > i32::MAX as usize) {
            return Err(invalid("topo", format!("pp*vpp = {}*{} model chunks is too many", self.pp, self.vpp)));
        }
        if self.cp == 0 {
            return Err(invalid("topo.cp", "must be >= 1, got 0"));
        }
        if !self.ep.is_multiple_of(self.cp) {
            return Err(invalid(
                "topo.cp",
                format!("{} must divide ep = {} (a context-parallel group lies inside one EP group)", self.cp, self.ep),
            ));
        }
        if let Some(v) = &self.layers_per_stage {
            if v.len() != self.num_chunks() {
                return Err(invalid(
                    "topo.layers_per_stage",
                    format!("has {} entries, expected one per model chunk, pp*vpp = {}", v.len(), self.num_chunks()),
                ));
            }
            if let Some(c) = v.iter().position(|&n| n == 0) {
                return Err(invalid("topo.layers_per_stage", format!("model chunk {c} holds no MoE layer; every chunk needs one")));
            }
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
    /// Node (NVLink domain: see the struct's note) of global rank d. A domain of at least `ep`
    /// GPUs holds ⌊nvlink_domain / ep⌋ whole EP groups.
    #[inline]
    pub fn node_of(&self, global_rank: usize) -> usize {
        if self.nvlink_domain >= self.ep {
            global_rank / self.ep / (self.nvlink_domain / self.ep)
        } else {
            global_rank / self.nvlink_domain
        }
    }
    /// Node (NVLink domain) index, within its EP group, of EP-local rank r (same for every
    /// group because groups start on domain boundaries or lie inside one domain).
    #[inline]
    pub fn local_node_of(&self, ep_rank: usize) -> usize {
        ep_rank / self.nvlink_domain.min(self.ep)
    }
    /// Nodes (NVLink domains) spanned by one EP group.
    #[inline]
    pub fn nodes_per_group(&self) -> usize {
        self.ep.div_ceil(self.nvlink_domain).max(1)
    }
    /// EP ranks of one group that share a node (an NVLink domain).
    #[inline]
    pub fn ranks_per_group_node(&self) -> usize {
        self.nvlink_domain.min(self.ep)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nvlink_domains_hold_whole_groups() {
        // GB200 NVL72: trays of 4, a 72-GPU domain; EP 64 uses 64 GPUs of each rack
        let t = Topology::new(128, 64, 4, 9).unwrap().with_nvlink_domain(72).unwrap();
        assert_eq!((t.node_of(0), t.node_of(63), t.node_of(64), t.node_of(127)), (0, 0, 1, 1));
        assert_eq!((t.nodes_per_group(), t.ranks_per_group_node(), t.local_node_of(63)), (1, 64, 0));
        // EP 32: two groups a rack, four racks' worth of groups over 256 ranks
        let t = Topology::new(256, 32, 4, 17).unwrap().with_nvlink_domain(72).unwrap();
        assert_eq!((t.node_of(63), t.node_of(64), t.node_of(255)), (0, 1, 3));
        // a domain smaller than the group: the group spans whole domains
        let t = Topology::new(64, 32, 4, 17).unwrap().with_nvlink_domain(16).unwrap();
        assert_eq!((t.nodes_per_group(), t.local_node_of(15), t.local_node_of(16), t.node_of(40)), (2, 0, 1, 2));
        // the default: a node is a domain, as before
        let t = Topology::new(64, 32, 8, 17).unwrap();
        assert_eq!((t.nvlink_domain, t.nodes_per_group(), t.node_of(9)), (8, 4, 1));
    }

    #[test]
    fn bad_domains_name_the_field() {
        let t = Topology::new(64, 32, 4, 17).unwrap();
        for d in [0, 6, 24] {
            let e = t.clone().with_nvlink_domain(d).unwrap_err().to_string();
            assert!(e.contains("topo.nvlink_domain"), "{e}");
        }
    }
}
