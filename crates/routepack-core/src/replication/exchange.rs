//! One exchange (EP group, microbatch, layer: one dispatch/combine all-to-all) as the replication
//! planners see it, and the driver that runs a planner over every exchange of a packed window
//! (or over one [`Block`] of them: distributed planning) in parallel.

use std::ops::Range;
use std::time::Instant;

use rayon::prelude::*;

use crate::budget;
use crate::cell_grid::CellGrid;
use crate::cost::CostModel;
use crate::error::{invalid, Result};
use crate::plan::Placement;
use crate::plan::{Plan, Replica};
use crate::topology::Topology;
use crate::validate::validate_plan;
use crate::window::WindowView;

/// Inputs of one exchange: EP group `group`, microbatch `micro`, MoE layer `layer`.
pub struct Exchange<'a> {
    /// EP group g in `0..G`.
    pub group: usize,
    /// Microbatch m in `0..M`.
    pub micro: usize,
    /// MoE layer l in `0..L`.
    pub layer: usize,
    /// The cluster (EP ranks, nodes, slots per rank).
    pub topo: &'a Topology,
    /// The cost model the exchange is priced with (checked by the driver).
    pub cost: &'a CostModel,
    /// `[ep * E]` rank-major: tokens for expert e sent by EP-local rank r.
    pub origin: &'a [i64],
    /// The slowest rank's one-pass attention time (what replication hides behind).
    pub attn_max: f64,
    /// The layer's placement as CSR: slots of expert e are `slots[slot_off[e]..slot_off[e+1]]`.
    pub slot_off: &'a [usize],
    /// Physical slots in `0..num_slots`, grouped by expert (see `slot_off`), ascending
    /// within an expert.
    pub slots: &'a [usize],
}

impl Exchange<'_> {
    /// EP ranks of the group (`Topology::ep`).
    #[inline]
    pub fn ep(&self) -> usize {
        self.topo.ep
    }
    /// Logical experts E of the layer (`slot_off.len() - 1`).
    #[inline]
    pub fn num_experts(&self) -> usize {
        self.slot_off.len() - 1
    }
    /// Placement slots of expert e in this layer, ascending (at least one).
    #[inline]
    pub fn expert_slots(&self, e: usize) -> &[usize] {
        &self.slots[self.slot_off[e]..self.slot_off[e + 1]]
    }
    /// Tokens for expert e sent by EP-local rank r's samples in this exchange.
    #[inline]
    pub fn origin_of(&self, r: usize, e: usize) -> i64 {
        self.origin[r * self.num_experts() + e]
    }
    /// Whether EP rank r holds a placement slot of expert e.
    pub fn hosts(&self, e: usize, r: usize) -> bool {
        self.expert_slots(e).iter().any(|&p| self.topo.rank_of_slot(p) == r)
    }
    /// The rank a copy of e for `dst` is sent from: a host on dst's node if there is one
    /// (the cheap link), else the host of e's first slot.
    pub fn source_for(&self, e: usize, dst: usize) -> usize {
        let node = self.topo.local_node_of(dst);
        let slots = self.expert_slots(e);
        slots
            .iter()
            .map(|&p| self.topo.rank_of_slot(p))
            .find(|&r| self.topo.local_node_of(r) == node)
            .unwrap_or_else(|| self.topo.rank_of_slot(slots[0]))
    }
    /// The replica of this exchange: a copy of e from `src` on `dst` computing `share`.
    pub fn replica(&self, e: usize, src: usize, dst: usize, share: f32) -> Replica {
        Replica {
            micro: self.micro as i32,
            group: self.group as i32,
            layer: self.layer as i32,
            expert: e as i32,
            src_rank: src as i32,
            dst_rank: dst as i32,
            share,
        }
    }
}

/// The f32 share whose rounding in `flow::route_expert` (`round(share · total)`) gives
/// `n` tokens: exactly whenever total < 2^23 (an f32 resolves 1 token then); beyond that, the
/// nearest f32 not above n/total. `0 <= n <= total`, `total > 0`.
pub fn share_for(n: i64, total: i64) -> f32 {
    debug_assert!(total > 0 && (0..=total).contains(&n));
    let hits = |s: f32| crate::rounding::round((s as f64) * (total as f64)) as i64;
    let s = ((n as f64) / (total as f64)) as f32;
    let down = f32::from_bits(s.to_bits().saturating_sub(1));
    let up = f32::from_bits(s.to_bits() + 1);
    let best = [s, down, up].into_iter().find(|&x| hits(x) == n).unwrap_or(if hits(s) > n { down } else { s });
    best.clamp(0.0, 1.0)
}

/// Block `index` of `count` contiguous, near-equal blocks of the flattened exchange index
/// `c = (g · M + m) · L + l` (group, microbatch, layer): what one of `count` planners (the ranks of
/// `routepack.torch.plan_window_distributed`) plans. Blocks `0..count` in order tile
/// `0..total` exactly, so their replicas, concatenated in block order, are the full run's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Block {
    /// This block, in `0..count`.
    pub index: usize,
    /// Blocks in all, >= 1.
    pub count: usize,
}

impl Block {
    /// Every exchange: block 0 of 1.
    pub const ALL: Block = Block { index: 0, count: 1 };

    /// Block `index` of `count`; `count >= 1` and `index < count`, else an error naming `block`.
    pub fn new(index: usize, count: usize) -> Result<Block> {
        if count == 0 || index >= count {
            return Err(invalid(
                "block",
                format!("expected (index, count) with count >= 1 and 0 <= index < count, got ({index}, {count})"),
            ));
        }
        Ok(Block { index, count })
    }

    /// The exchanges of this block among `total`: `[total·index/count, total·(index+1)/count)`
    /// (in u128, so no product overflows).
    pub fn range(&self, total: usize) -> Range<usize> {
        let at = |i: usize| ((total as u128 * i as u128) / self.count as u128) as usize;
        at(self.index)..at(self.index + 1)
    }
}

/// Runs `plan_exchange` on every exchange (group, microbatch, layer) of the packed window, in
/// parallel, and concatenates the replicas in exchange order (group, microbatch, layer), each
/// exchange's rows in the order the planner gave (which `flow::route_expert` honours). Checks placement and packing first.
///
/// * `sample_rank`, `sample_micro` `[S]`, `num_micro` M: the packing.
/// * `plan_exchange(exchange, worker_state)`: the planner; `W` is per-worker scratch built by `init`.
///
/// With a `deadline`, an exchange whose turn comes after it gets
/// no replicas (it is not even routed): valid, and for routepack, whose planned exchanges are
/// never slower than unreplicated ones, the plan is never slower than no replication at all.
/// Which exchanges are planned in time depends on the machine; the result keeps exchange
/// order. Without a deadline the clock is never read.
#[allow(clippy::too_many_arguments)]
pub fn plan_exchanges<W, I, F>(
    w: &WindowView,
    topo: &Topology,
    cost: &CostModel,
    placement: &Placement,
    sample_rank: &[i32],
    sample_micro: &[i32],
    num_micro: usize,
    deadline: Option<Instant>,
    init: I,
    plan_exchange: F,
) -> Result<Vec<Replica>>
where
    I: Fn() -> W + Sync + Send,
    F: Fn(&Exchange, &mut W) -> Vec<Replica> + Sync + Send,
{
    plan_exchange_block(w, topo, cost, placement, sample_rank, sample_micro, num_micro, deadline, Block::ALL, init, plan_exchange)
}

/// [`plan_exchanges`] on the exchanges of `block` only: the same checks (of the whole
/// placement and packing), and the replicas of the block's exchanges exactly as the full run
/// gives them, in exchange order. A deadline is read as in the full run.
#[allow(clippy::too_many_arguments)]
pub fn plan_exchange_block<W, I, F>(
    w: &WindowView,
    topo: &Topology,
    cost: &CostModel,
    placement: &Placement,
    sample_rank: &[i32],
    sample_micro: &[i32],
    num_micro: usize,
    deadline: Option<Instant>,
    block: Block,
    init: I,
    plan_exchange: F,
) -> Result<Vec<Replica>>
where
    I: Fn() -> W + Sync + Send,
    F: Fn(&Exchange, &mut W) -> Vec<Replica> + Sync + Send,
{
    let block = Block::new(block.index, block.count)?;
    cost.check(w.num_layers)?;
    let unreplicated = Plan {
        placement: placement.clone(),
        sample_rank: sample_rank.to_vec(),
        sample_micro: sample_micro.to_vec(),
        num_micro,
        replicas: Vec::new(),
        migration: Vec::new(),
    };
    validate_plan(&unreplicated, w, topo, i64::MAX)?;
    let (g_n, m_n, l_n, ep, e_n) = (topo.num_groups(), num_micro, w.num_layers, topo.ep, w.num_experts);
    let grid = CellGrid::new(sample_rank, sample_micro, num_micro, w.seq_lens, topo);
    let layer_slots = placement.slot_tables()?;
    let per_exchange: Vec<Vec<Replica>> = block
        .range(g_n * m_n * l_n)
        .into_par_iter()
        .map_init(
            || (init(), vec![0i64; ep * e_n]),
            |(state, origin), c| {
                if budget::passed(deadline) {
                    return Vec::new();
                }
                let (gm, l) = (c / l_n, c % l_n);
                let (g, m) = (gm / m_n, gm % m_n);
                grid.origin(w, g, m, l, origin);
                let exchange = Exchange {
                    group: g,
                    micro: m,
                    layer: l,
                    topo,
                    cost,
                    origin,
                    attn_max: grid.attention_max(cost, g, m, l),
                    slot_off: &layer_slots[l].0,
                    slots: &layer_slots[l].1,
                };
                plan_exchange(&exchange, state)
            },
        )
        .collect();
    Ok(per_exchange.into_iter().flatten().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn share_for_rounds_back_exactly() {
        for &total in &[1i64, 7, 1000, 65_537, 2_000_003, 8_388_607] {
            for n in [0, 1, total / 3, total / 2, total - 1, total] {
                if n < 0 {
                    continue;
                }
                let s = share_for(n, total);
                assert!((0.0..=1.0).contains(&s));
                assert_eq!(((s as f64) * (total as f64)).round() as i64, n, "n={n} total={total}");
            }
        }
    }
}
