//! Where the tokens of one logical expert go in one exchange (EP group, microbatch, MoE
//! layer: one dispatch/combine all-to-all).
//!
//! This is the single definition of token routing under a plan: the simulator prices it and
//! the torch remapper (`routepack.torch`) carries it out through the same function, so the
//! load every physical rank receives is exactly the one the plan predicted.
//!
//! Rule, for expert e with `origin[r]` tokens coming from EP-local rank r (T = Σ origin):
//! 1. Replicas of this exchange and expert, in table order: row i takes
//!    `n_i = min(round(share_i · T), tokens not yet taken)`, drawn first from its own rank's
//!    tokens, then from ranks on its node (ascending), then from the other ranks (ascending).
//!    Those tokens are computed on `dst_rank` by its temporary copy.
//! 2. What is left of each origin's tokens, `rem_r` (R = Σ rem_r), goes to e's c placement
//!    slots (ascending slot order), node first (`feed`):
//!    * **quotas**: slot j computes `q_j = Σ_r (rem_r / c + [(j − r) mod c < rem_r mod c])`
//!      tokens: what an even split of every origin's tokens would give it, the remainder
//!      rotating with the origin so it spreads (Σ_j q_j = R; each q_j is R / c to within one
//!      token per origin). These are exactly the per-slot loads of the even split routepack
//!      used before node-first feeding, so a copy's expert work does not depend on where its
//!      tokens come from;
//!    * **across nodes**: node n, with `S_n` of the tokens and slots whose quotas sum to
//!      `D_n`, keeps `min(S_n, D_n)` inside itself, the most any feeding of these quotas can.
//!      A node with `S_n > D_n` sends `S_n − D_n`, shared by its ranks in proportion to their
//!      tokens; a node with `D_n > S_n` receives `D_n − S_n`, shared by its slots in
//!      proportion to their quotas; each receiving slot (ascending) draws its share from every
//!      sending rank in proportion to what that rank has still to send;
//!    * **inside nodes**: each slot takes what its quota still lacks from its own rank first
//!      (those tokens cross no link), then from the ranks of its node in proportion to what
//!      each has left.
//!
//!    Every share is integer: ⌊need · w_i / Σ w⌋, the units left over one each to the first
//!    (ascending) whose share had a fraction. Sharing in proportion is what keeps each rank's
//!    inter-node traffic at or under the even split's (up to rounding): what must leave a node
//!    leaves from all its ranks alike, and what must enter spreads over all its copies.
//!    Drawing origins in ascending order instead (own rank, node, other nodes, each rank
//!    drained before the next) keeps as much inside nodes but piles the crossing tokens on a
//!    node's lowest ranks and on the copies whose own ranks had the fewest tokens; measured
//!    on `flash` it made EPLB's plans up to 2% slower than the even split, the busiest rank
//!    setting the all-to-all. This rule was measured no slower than the even split on any
//!    preset of `tiny` or `flash`.
//!
//!    With one slot (the common case) it takes everything left. Real dispatchers also prefer
//!    the copy nearest a token (SGLang's static dispatch map sends a GPU's tokens to the copy
//!    on that GPU, else on its node). Integer, deterministic, O(ep · c).

use rayon::prelude::*;

mod feed;

use crate::error::{bad_plan, invalid, Result};
use crate::plan::{bucket_replicas, cell_members, Plan};
use crate::topology::Topology;
use crate::validate::validate_plan;
use crate::window::WindowView;
use feed::feed_slots;

/// Destination of a batch of tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dest {
    /// A placement slot (global physical slot index within the EP group).
    Slot(usize),
    /// The temporary replica on EP-local rank `rank`: entry `index` of the exchange's replicas.
    Replica {
        /// EP-local rank in `0..ep` that holds the copy (the replica's `dst_rank`).
        rank: usize,
        /// Position of the replica in the list the router was given: the expert's
        /// `(dst_rank, share)` list in [`route_expert`], the exchange's `reps` in
        /// [`route_exchange`].
        index: usize,
    },
}

/// Calls `emit(origin_rank, dst_rank, dest, count)` for every non-empty flow of one expert.
///
/// * `origin`   `[ep]` tokens of the expert from each EP-local rank.
/// * `slots`    the expert's placement slots, ascending (non-empty).
/// * `replicas` `(dst_rank, share)` of the exchange's replicas for this expert, table order.
/// * `scratch`  reused buffer (tokens left per origin, and step 2's quotas and shares).
pub fn route_expert(
    origin: &[i64],
    slots: &[usize],
    replicas: &[(usize, f32)],
    topo: &Topology,
    scratch: &mut Vec<i64>,
    mut emit: impl FnMut(usize, usize, Dest, i64),
) {
    let ep = origin.len();
    scratch.clear();
    scratch.extend_from_slice(origin);
    let rem = scratch;
    if !replicas.is_empty() {
        let total: i64 = origin.iter().sum();
        let mut left = total;
        for (row, &(dst, share)) in replicas.iter().enumerate() {
            let want = crate::rounding::round((share as f64) * (total as f64)) as i64;
            let mut need = want.clamp(0, left);
            left -= need;
            // own rank, then same node ascending, then the others ascending (a node's ranks
            // are the contiguous block [lo, hi))
            let rpn = topo.ranks_per_group_node();
            let lo = topo.local_node_of(dst) * rpn;
            let hi = (lo + rpn).min(ep);
            let order = std::iter::once(dst).chain((lo..hi).filter(|&r| r != dst)).chain((0..lo).chain(hi..ep));
            for r in order {
                if need == 0 {
                    break;
                }
                let take = rem[r].min(need);
                if take > 0 {
                    rem[r] -= take;
                    need -= take;
                    emit(r, dst, Dest::Replica { rank: dst, index: row }, take);
                }
            }
        }
    }
    if slots.len() == 1 {
        // one slot takes everything left (the common case: no redundant copy)
        let (p, rank) = (slots[0], topo.rank_of_slot(slots[0]));
        for (r, &left) in rem.iter().enumerate() {
            if left > 0 {
                emit(r, rank, Dest::Slot(p), left);
            }
        }
        return;
    }
    feed_slots(rem, slots, topo, |o, d, p, n| emit(o, d, Dest::Slot(p), n));
}

/// One batch of an exchange's flow table: `count` tokens of logical `expert` from EP-local rank
/// `origin` to EP-local rank `dst_rank`, into placement slot `Dest::Slot(p)` or the temporary
/// copy of replica `Dest::Replica { index, .. }` (`index` indexes the exchange's replica list).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Flow {
    /// EP-local rank in `0..ep` whose samples the tokens come from.
    pub origin: usize,
    /// EP-local rank in `0..ep` that computes them (the slot's rank or the copy's rank).
    pub dst_rank: usize,
    /// Logical expert e in `0..E` the tokens are routed to.
    pub expert: usize,
    /// Placement slot or replica copy on `dst_rank` that computes them.
    pub dest: Dest,
    /// Tokens in the batch, > 0.
    pub count: i64,
}

/// One replica of an exchange as routing needs it: `(expert, dst_rank, share)`.
pub type ExchangeReplica = (usize, usize, f32);

/// Checks the inputs of [`route_exchange`] coming from outside a validated plan: `origin` `[ep*E]`
/// non-negative, the layer's CSR non-empty for every expert, replicas in range.
pub fn check_exchange(origin: &[i64], num_experts: usize, slot_off: &[usize], reps: &[ExchangeReplica], topo: &Topology) -> Result<()> {
    if origin.len() != topo.ep * num_experts {
        return Err(invalid("origin", format!("has {} entries, expected ep*E = {}*{num_experts}", origin.len(), topo.ep)));
    }
    if let Some(i) = origin.iter().position(|&x| x < 0) {
        return Err(invalid("origin", format!("negative count {} at rank {}, expert {}", origin[i], i / num_experts, i % num_experts)));
    }
    if slot_off.len() != num_experts + 1 {
        return Err(invalid("placement", format!("slot table has {} offsets, expected E+1", slot_off.len())));
    }
    if let Some(e) = (0..num_experts).find(|&e| slot_off[e] == slot_off[e + 1]) {
        return Err(bad_plan(format!("placement has no slot for logical expert {e}")));
    }
    for (i, &(e, dst, share)) in reps.iter().enumerate() {
        if e >= num_experts {
            return Err(invalid("replicas.expert", format!("row {i}: expert {e} outside [0, {num_experts})")));
        }
        if dst >= topo.ep {
            return Err(invalid("replicas.dst_rank", format!("row {i}: rank {dst} outside [0, {})", topo.ep)));
        }
        if !(share.is_finite() && (0.0..=1.0).contains(&share)) {
            return Err(invalid("replicas.share", format!("row {i}: share {share} outside [0, 1]")));
        }
    }
    Ok(())
}

/// The flow table of one exchange (group, microbatch, layer): every expert in ascending order, each
/// routed by [`route_expert`] (so in its emission order), exactly as the simulator routes it.
///
/// * `origin`  `[ep * E]` rank-major: tokens of expert e from EP-local rank r at `r*E + e`.
/// * `slot_off`, `slots`  the layer's placement as CSR ([`crate::Placement::replicas_of_layer`]).
/// * `reps`    the exchange's replicas in table order; a flow's `Dest::Replica { index }` is an
///   index into `reps`.
///
/// Inputs must satisfy [`check_exchange`] (a validated plan does).
pub fn route_exchange(
    origin: &[i64],
    num_experts: usize,
    slot_off: &[usize],
    slots: &[usize],
    reps: &[ExchangeReplica],
    topo: &Topology,
    out: &mut Vec<Flow>,
) {
    let ep = topo.ep;
    let mut column = vec![0i64; ep];
    let mut scratch = Vec::with_capacity(ep);
    let mut args: Vec<(usize, f32)> = Vec::new();
    let mut index: Vec<usize> = Vec::new();
    for e in 0..num_experts {
        for (r, c) in column.iter_mut().enumerate() {
            *c = origin[r * num_experts + e];
        }
        // the simulator skips an expert with no tokens before routing; so do we
        if column.iter().all(|&x| x == 0) {
            continue;
        }
        args.clear();
        index.clear();
        for (i, &(re, dst, share)) in reps.iter().enumerate() {
            if re == e {
                args.push((dst, share));
                index.push(i);
            }
        }
        route_expert(&column, &slots[slot_off[e]..slot_off[e + 1]], &args, topo, &mut scratch, |o, d, dest, n| {
            let dest = match dest {
                Dest::Replica { rank, index: k } => Dest::Replica { rank, index: index[k] },
                s => s,
            };
            out.push(Flow { origin: o, dst_rank: d, expert: e, dest, count: n });
        });
    }
}

/// Tokens every EP rank receives under `plan` on `w`: `[G, M, L, ep]` row-major, i.e.
/// `tokens(p)` of the simulator's expert term for every (group, micro, layer). The torch
/// remapper must deliver exactly these counts.
pub fn rank_tokens(plan: &Plan, w: &WindowView, topo: &Topology) -> Result<Vec<i64>> {
    validate_plan(plan, w, topo, i64::MAX)?;
    let (g_n, m_n, l_n, ep, e_n) = (topo.num_groups(), plan.num_micro, w.num_layers, topo.ep, w.num_experts);
    let (off, members) = cell_members(&plan.sample_rank, &plan.sample_micro, topo.dp, m_n);
    let reps = bucket_replicas(&plan.replicas, g_n, m_n, l_n);
    let layer_slots = plan.placement.slot_tables()?;
    let per_gm: Vec<Vec<i64>> = (0..g_n * m_n)
        .into_par_iter()
        .map(|gm| {
            let (g, m) = (gm / m_n, gm % m_n);
            let mut out = vec![0i64; l_n * ep];
            let mut origin = vec![0i64; ep * e_n];
            let mut flows = Vec::new();
            for l in 0..l_n {
                origin.iter_mut().for_each(|x| *x = 0);
                for r in 0..ep {
                    let d = g * ep + r;
                    for &s in &members[off[d * m_n + m]..off[d * m_n + m + 1]] {
                        w.tokens(s, l).add_to(&mut origin[r * e_n..(r + 1) * e_n]);
                    }
                }
                let exchange: Vec<ExchangeReplica> =
                    reps[gm * l_n + l].iter().map(|x| (x.expert as usize, x.dst_rank as usize, x.share)).collect();
                flows.clear();
                let (so, sl) = &layer_slots[l];
                route_exchange(&origin, e_n, so, sl, &exchange, topo, &mut flows);
                for f in &flows {
                    out[l * ep + f.dst_rank] += f.count;
                }
            }
            out
        })
        .collect();
    Ok(per_gm.concat())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn collect(origin: &[i64], slots: &[usize], reps: &[(usize, f32)], topo: &Topology) -> Vec<(usize, usize, Dest, i64)> {
        let mut v = Vec::new();
        let mut scratch = Vec::new();
        route_expert(origin, slots, reps, topo, &mut scratch, |a, b, c, d| v.push((a, b, c, d)));
        v
    }

    #[test]
    fn conserves_tokens_and_prefers_local() {
        let topo = Topology::new(4, 4, 2, 2).unwrap();
        let origin = [5i64, 7, 0, 3];
        let flows = collect(&origin, &[1, 6], &[(2, 0.5)], &topo);
        let total: i64 = flows.iter().map(|f| f.3).sum();
        assert_eq!(total, 15);
        // the replica on rank 2 owns no tokens itself; its node-mate rank 3 gives first
        let rep: Vec<_> = flows.iter().filter(|f| matches!(f.2, Dest::Replica { .. })).collect();
        assert_eq!(rep[0].0, 3);
        assert_eq!(rep.iter().map(|f| f.3).sum::<i64>(), 8);
    }

    #[test]
    fn quotas_rotate_the_remainder() {
        let topo = Topology::new(2, 2, 2, 2).unwrap();
        let flows = collect(&[1, 1], &[0, 2], &[], &topo);
        // each slot's quota is one token, each rank's own token stays on it
        assert_eq!(flows, vec![(0, 0, Dest::Slot(0), 1), (1, 1, Dest::Slot(2), 1)]);
        // both slots on rank 0: quotas 1 and 1 again; rank 0's own token fills slot 0, and
        // slot 1 takes its node-mate rank 1's
        let flows = collect(&[1, 1], &[0, 1], &[], &topo);
        assert_eq!(flows, vec![(0, 0, Dest::Slot(0), 1), (1, 0, Dest::Slot(1), 1)]);
    }

    #[test]
    fn copies_feed_from_their_node_first() {
        // 4 ranks on 2 nodes, copies on rank 0 (node 0) and rank 2 (node 1), 1 slot per rank
        let topo = Topology::new(4, 4, 2, 1).unwrap();
        // node 0 sends 10 + 6, node 1 sends 0 + 4: quotas 10 and 10
        let flows = collect(&[10, 6, 0, 4], &[0, 2], &[], &topo);
        let cross: i64 = flows.iter().filter(|f| topo.local_node_of(f.0) != topo.local_node_of(f.1)).map(|f| f.3).sum();
        // node 1 keeps its 4 tokens; node 0's surplus of 6 has to cross (the least possible),
        // from its ranks in proportion to their tokens (3.75 : 2.25, rounded to 4 : 2)
        assert_eq!(cross, 6);
        let want = [
            (0, 2, Dest::Slot(2), 4),
            (1, 2, Dest::Slot(2), 2),
            (0, 0, Dest::Slot(0), 6),
            (1, 0, Dest::Slot(0), 4),
            (3, 2, Dest::Slot(2), 4),
        ];
        assert_eq!(flows, want);
        // quotas 12 and 12: node 0's surplus of 8 leaves as 4 + 4 (3.2 : 4.8 rounded)
        let flows = collect(&[8, 12, 0, 4], &[0, 2], &[], &topo);
        let want = [
            (0, 2, Dest::Slot(2), 4),
            (1, 2, Dest::Slot(2), 4),
            (0, 0, Dest::Slot(0), 4),
            (1, 0, Dest::Slot(0), 8),
            (3, 2, Dest::Slot(2), 4),
        ];
        assert_eq!(flows, want);
        // slots on ranks 1 and 3, quotas 12 and 12: 12 of node 0's 24 cross, 8 from rank 0 and
        // 4 from rank 1 (the copy's own rank sends its share too, so no rank sends more than
        // under the even split)
        let flows = collect(&[16, 8, 0, 0], &[1, 3], &[], &topo);
        assert_eq!(flows, vec![(0, 3, Dest::Slot(3), 8), (1, 3, Dest::Slot(3), 4), (1, 1, Dest::Slot(1), 4), (0, 1, Dest::Slot(1), 8)]);
    }

    #[test]
    fn crossing_tokens_leave_every_rank_of_a_node_alike() {
        // 4 ranks on one node hold the expert's tokens, its two copies sit on rank 0 and on
        // rank 4 of the other node: half crosses, a quarter of it from each rank
        let topo = Topology::new(8, 8, 4, 1).unwrap();
        let flows = collect(&[30, 30, 30, 30, 0, 0, 0, 0], &[0, 4], &[], &topo);
        let sent: Vec<i64> = (0..4).map(|r| flows.iter().filter(|f| f.0 == r && f.1 == 4).map(|f| f.3).sum()).collect();
        assert_eq!(sent, vec![15; 4]);
    }

    #[test]
    fn inflow_spreads_over_a_nodes_copies() {
        // copies on ranks 0 and 1 (node 0) with 2 and 10 tokens of their own, node 1 sends 20:
        // each copy takes half of node 1's tokens (10), and rank 1 gives rank 0 the 4 it lacks
        let topo = Topology::new(4, 4, 2, 1).unwrap();
        let flows = collect(&[2, 10, 12, 8], &[0, 1], &[], &topo);
        let inter =
            |p: usize| flows.iter().filter(|f| f.1 == p && topo.local_node_of(f.0) != topo.local_node_of(p)).map(|f| f.3).sum::<i64>();
        assert_eq!((inter(0), inter(1)), (10, 10));
        assert!(flows.contains(&(0, 0, Dest::Slot(0), 2)) && flows.contains(&(1, 0, Dest::Slot(0), 4)));
    }
}
