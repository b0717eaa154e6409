//! [`Placement`]: which physical slot of each EP rank holds which logical expert, per MoE
//! layer, and the tables derived from it. Part of the plan's data model (stage 1 decides it,
//! every later stage, the simulator, validation and migration read it); the placement
//! policies that build one are in `crate::placement`.

use crate::error::{bad_plan, invalid, Result};
use crate::sizes;
use crate::topology::Topology;

/// `phy2log[l * num_slots + p]` = logical expert in physical slot p of layer l, or -1 for an
/// empty slot. Slot p lives on EP-local rank p / slots_per_rank. Every EP group uses the same
/// placement.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    /// MoE layers L.
    pub num_layers: usize,
    /// Logical experts E per layer.
    pub num_experts: usize,
    /// Physical slots per layer (`ep · slots_per_rank`).
    pub num_slots: usize,
    /// Slots on each EP rank.
    pub slots_per_rank: usize,
    /// `[L, num_slots]` logical expert in each slot (-1: empty).
    pub phy2log: Vec<i32>,
}

impl Placement {
    /// Wraps and checks a phy2log table `[L, num_slots]`.
    pub fn new(phy2log: Vec<i32>, num_layers: usize, num_experts: usize, slots_per_rank: usize) -> Result<Self> {
        let num_slots = Self::check_shape(phy2log.len(), num_layers, num_experts, slots_per_rank)?;
        let p = Self { num_layers, num_experts, num_slots, slots_per_rank, phy2log };
        p.check()?;
        Ok(p)
    }

    /// [`Placement::new`] of a borrowed table (what the bindings read from numpy): its shape
    /// checked first, then what the copy and its tables take ([`Placement::tables_bytes`])
    /// reserved ([`sizes::check_call`], naming `placement.phy2log`), then the table copied
    /// fallibly.
    pub fn from_slice(phy2log: &[i32], num_layers: usize, num_experts: usize, slots_per_rank: usize) -> Result<Self> {
        let num_slots = Self::check_shape(phy2log.len(), num_layers, num_experts, slots_per_rank)?;
        let r = max_replicas_of(phy2log, num_layers, num_experts);
        let what = format!("placement.phy2log [{num_layers}, {num_slots}], copied, with its tables (up to {r} copies of an expert),");
        sizes::check_call("placement.phy2log", &what, Self::tables_bytes(num_layers, num_slots, num_experts, r))?;
        Self::new(sizes::copied("placement.phy2log", "a copy of phy2log", phy2log)?, num_layers, num_experts, slots_per_rank)
    }

    /// The slots per layer of a phy2log of `len` entries over `num_layers` layers, checked
    /// against the experts and the slots per rank (nothing allocated).
    fn check_shape(len: usize, num_layers: usize, num_experts: usize, slots_per_rank: usize) -> Result<usize> {
        if num_layers == 0 || slots_per_rank == 0 || !len.is_multiple_of(num_layers) {
            return Err(invalid("placement.phy2log", format!("has {len} entries, not a multiple of L={num_layers}")));
        }
        let num_slots = len / num_layers;
        if num_experts == 0 || num_experts > num_slots {
            return Err(invalid(
                "num_experts",
                format!("{num_experts} logical experts do not fit {num_slots} slots per layer (each needs at least one)"),
            ));
        }
        if num_layers > i32::MAX as usize || num_slots > i32::MAX as usize {
            return Err(invalid("placement.phy2log", format!("shape [{num_layers}, {num_slots}] does not fit the int32 ids of a plan")));
        }
        if !num_slots.is_multiple_of(slots_per_rank) {
            return Err(invalid(
                "placement.phy2log",
                format!("{num_slots} slots per layer is not a multiple of slots_per_rank={slots_per_rank}"),
            ));
        }
        Ok(num_slots)
    }

    /// Every entry in [-1, E) and every logical expert with at least one slot in every layer.
    pub fn check(&self) -> Result<()> {
        let mut seen = vec![false; self.num_experts];
        for l in 0..self.num_layers {
            seen.iter_mut().for_each(|x| *x = false);
            for (p, &e) in self.layer(l).iter().enumerate() {
                if e < -1 || e >= self.num_experts as i32 {
                    return Err(bad_plan(format!("placement.phy2log[{l}, {p}] = {e} is outside [-1, {})", self.num_experts)));
                }
                if e >= 0 {
                    seen[e as usize] = true;
                }
            }
            if let Some(e) = seen.iter().position(|x| !x) {
                return Err(bad_plan(format!("placement: layer {l} has no slot for logical expert {e}")));
            }
        }
        Ok(())
    }

    /// Checks the placement fits the topology (same EP size and slots per rank).
    pub fn check_topology(&self, topo: &Topology) -> Result<()> {
        if self.num_slots != topo.num_slots() || self.slots_per_rank != topo.slots_per_rank {
            return Err(bad_plan(format!(
                "placement has {} slots ({} per rank) but topology has ep*slots_per_rank = {}*{}",
                self.num_slots, self.slots_per_rank, topo.ep, topo.slots_per_rank
            )));
        }
        Ok(())
    }

    /// Layer l's row of `phy2log`.
    #[inline]
    pub fn layer(&self, l: usize) -> &[i32] {
        &self.phy2log[l * self.num_slots..(l + 1) * self.num_slots]
    }

    /// EP ranks the slots are spread over.
    #[inline]
    pub fn num_ranks(&self) -> usize {
        self.num_slots / self.slots_per_rank
    }

    /// `[L, E]` replicas of each logical expert.
    pub fn logcnt(&self) -> Vec<i32> {
        let mut cnt = vec![0i32; self.num_layers * self.num_experts];
        for l in 0..self.num_layers {
            for &e in self.layer(l) {
                if e >= 0 {
                    cnt[l * self.num_experts + e as usize] += 1;
                }
            }
        }
        cnt
    }

    /// Largest replica count over all (layer, expert).
    pub fn max_replicas(&self) -> usize {
        max_replicas_of(&self.phy2log, self.num_layers, self.num_experts)
    }

    /// Bytes a placement policy's call holds at once for `num_layers` layers of `num_slots`
    /// slots and `num_experts` experts: the tables it builds (`per_slot` bytes a slot of a
    /// layer, every layer at once: its phy2log, candidates and working copies) plus
    /// [`Placement::tables_bytes`] with the most copies one expert can have. The estimate
    /// [`crate::placement`]'s policies reserve, blaming `topo.slots_per_rank`.
    pub fn policy_bytes(num_layers: usize, num_slots: usize, num_experts: usize, per_slot: usize) -> u128 {
        let most = num_slots.saturating_sub(num_experts).saturating_add(1);
        sizes::table_bytes(&[num_layers, num_slots], per_slot).saturating_add(Self::tables_bytes(num_layers, num_slots, num_experts, most))
    }

    /// Reserves [`Placement::policy_bytes`] for the policy `what` ([`sizes::check_call`],
    /// naming `topo.slots_per_rank`, which sizes every table of the call).
    pub fn check_policy_call(what: &str, num_layers: usize, num_slots: usize, num_experts: usize, per_slot: usize) -> Result<()> {
        let what = format!("{what} of [L, slots] = [{num_layers}, {num_slots}] (its tables included)");
        sizes::check_call("topo.slots_per_rank", &what, Self::policy_bytes(num_layers, num_slots, num_experts, per_slot))
    }

    /// Every layer's [`Placement::replicas_of_layer`], built fallibly after reserving them
    /// ([`sizes::check_call`], naming `plan`): what the simulator, the router and replication
    /// index the placement with.
    pub fn slot_tables(&self) -> Result<Vec<(Vec<usize>, Vec<usize>)>> {
        let per_layer = sizes::bytes_of::<usize>(self.num_experts + 1 + self.num_slots);
        let what = format!("the placement's slot tables, L = {} layers of {} slots,", self.num_layers, self.num_slots);
        sizes::check_call("plan", &what, per_layer.saturating_mul(self.num_layers as u128))?;
        Ok((0..self.num_layers).map(|l| self.replicas_of_layer(l)).collect())
    }

    /// Bytes that checking a phy2log table `[num_layers, num_slots]` the caller holds and
    /// deriving its tables take at once, the estimate [`sizes::check_call`] reserves: its copy
    /// (a `Placement` owns its table), `logcnt` [L, E] and `log2phy` [L, E, R] in int32 with
    /// R = `max_replicas`, and the per-expert scratch. A call that also builds the table adds
    /// `num_layers · num_slots · 4` bytes for it.
    pub fn tables_bytes(num_layers: usize, num_slots: usize, num_experts: usize, max_replicas: usize) -> u128 {
        let per_expert = sizes::table_bytes(&[num_layers, num_experts], 4);
        sizes::table_bytes(&[num_layers, num_slots], 4)
            .saturating_add(per_expert.saturating_mul(1 + max_replicas as u128))
            .saturating_add(sizes::bytes_of::<usize>(num_experts).saturating_mul(2))
    }

    /// `[L, E, max_replicas]` physical slots of each expert in ascending order, padded with -1.
    /// Its size grows with E × the largest replica count (up to (slots / 2)² per layer from a
    /// small `phy2log`), so it is checked and allocated as a table sized by
    /// `placement.phy2log` ([`sizes`]).
    pub fn log2phy(&self) -> Result<(Vec<i32>, usize)> {
        let r = self.max_replicas();
        let n = (self.num_layers * self.num_experts).saturating_mul(r);
        let what = format!("log2phy [L, E, max_replicas] = [{}, {}, {r}] of int32", self.num_layers, self.num_experts);
        let mut out = sizes::filled("placement.phy2log", &what, n, -1i32)?;
        let mut fill = vec![0usize; self.num_experts];
        for l in 0..self.num_layers {
            fill.iter_mut().for_each(|x| *x = 0);
            for (p, &e) in self.layer(l).iter().enumerate() {
                if e >= 0 {
                    let e = e as usize;
                    out[(l * self.num_experts + e) * r + fill[e]] = p as i32;
                    fill[e] += 1;
                }
            }
        }
        Ok((out, r))
    }

    /// Per layer, the physical slots of every expert in ascending order, as a CSR table:
    /// `(offsets [E+1], slots)` for layer l. What the simulator and remapper iterate over.
    pub fn replicas_of_layer(&self, l: usize) -> (Vec<usize>, Vec<usize>) {
        let e_n = self.num_experts;
        let mut counts = vec![0usize; e_n + 1];
        for &e in self.layer(l) {
            if e >= 0 {
                counts[e as usize + 1] += 1;
            }
        }
        for i in 0..e_n {
            counts[i + 1] += counts[i];
        }
        let mut fill = counts.clone();
        let mut slots = vec![0usize; counts[e_n]];
        for (p, &e) in self.layer(l).iter().enumerate() {
            if e >= 0 {
                slots[fill[e as usize]] = p;
                fill[e as usize] += 1;
            }
        }
        (counts, slots)
    }
}

/// The largest copy count of one expert in one layer of `phy2log` `[L, ·]` (entries outside
/// `0..num_experts` ignored), at least 1: what sizes `log2phy`, read without building
/// `logcnt`.
pub fn max_replicas_of(phy2log: &[i32], num_layers: usize, num_experts: usize) -> usize {
    if num_layers == 0 || phy2log.is_empty() {
        return 1;
    }
    let mut cnt = vec![0usize; num_experts];
    let mut most = 1;
    for layer in phy2log.chunks_exact(phy2log.len() / num_layers) {
        cnt.iter_mut().for_each(|x| *x = 0);
        for &e in layer {
            if let Some(c) = usize::try_from(e).ok().and_then(|e| cnt.get_mut(e)) {
                *c += 1;
                most = most.max(*c);
            }
        }
    }
    most
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_replicas_counts_without_logcnt() {
        let p = Placement::new(vec![0, 1, 1, 1, 0, 1, -1, 0], 2, 2, 2).unwrap();
        assert_eq!(p.max_replicas(), 3);
        assert_eq!(p.max_replicas(), *p.logcnt().iter().max().unwrap() as usize);
        assert_eq!(max_replicas_of(&[], 0, 2), 1);
    }

    #[test]
    fn missing_expert_is_refused() {
        let e = Placement::new(vec![0, 0, -1, -1], 1, 2, 2).unwrap_err();
        assert!(e.to_string().contains("logical expert 1"), "{e}");
    }
}
