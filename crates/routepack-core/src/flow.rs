//! Where the tokens of one logical expert go in one (EP group, microbatch, layer) cell.
//!
//! This is the single definition of token routing under a plan: the simulator prices it and
//! the torch remapper (`routepack.torch`) carries it out through the same function, so the
//! load every physical rank receives is exactly the one the plan predicted.
//!
//! Rule, for expert e with `origin[r]` tokens coming from EP-local rank r (T = Σ origin):
//! 1. Replica rows of this cell and expert, in table order: row i takes
//!    `n_i = min(round(share_i · T), tokens not yet taken)`, drawn first from its own rank's
//!    tokens, then from ranks on its node (ascending), then from the other ranks (ascending).
//!    Those tokens are computed on `dst_rank` by its temporary copy.
//! 2. What is left of each origin's tokens, `rem_r`, is split evenly over e's c placement
//!    slots (ascending slot order): slot j gets `rem_r / c` plus one if
//!    `(j - r) mod c < rem_r mod c` (the remainder rotates with the origin so it spreads).

use crate::topology::Topology;

/// Destination of a batch of tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dest {
    /// A placement slot (global physical slot index within the EP group).
    Slot(usize),
    /// The temporary replica on an EP-local rank named by replica row `row` of the cell.
    Replica { rank: usize, row: usize },
}

/// Calls `emit(origin_rank, dst_rank, dest, count)` for every non-empty flow of one expert.
///
/// * `origin`   `[ep]` tokens of the expert from each EP-local rank.
/// * `slots`    the expert's placement slots, ascending (non-empty).
/// * `replicas` `(dst_rank, share)` of the cell's replica rows for this expert, table order.
/// * `scratch`  reused buffer of length ep (remaining tokens per origin).
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
            let want = ((share as f64) * (total as f64)).round() as i64;
            let mut need = want.clamp(0, left);
            left -= need;
            // own rank, then same node ascending, then the others ascending (a node's ranks
            // are the contiguous block [lo, hi))
            let rpn = topo.ranks_per_group_node();
            let lo = topo.local_node_of(dst) * rpn;
            let hi = (lo + rpn).min(ep);
            let order = std::iter::once(dst)
                .chain((lo..hi).filter(|&r| r != dst))
                .chain((0..lo).chain(hi..ep));
            for r in order {
                if need == 0 {
                    break;
                }
                let take = rem[r].min(need);
                if take > 0 {
                    rem[r] -= take;
                    need -= take;
                    emit(r, dst, Dest::Replica { rank: dst, row }, take);
                }
            }
        }
    }
    let c = slots.len() as i64;
    if c == 1 {
        // one slot takes everything left (the common case: no redundant copy)
        let (p, rank) = (slots[0], topo.rank_of_slot(slots[0]));
        for (r, &left) in rem.iter().enumerate() {
            if left > 0 {
                emit(r, rank, Dest::Slot(p), left);
            }
        }
        return;
    }
    for (r, &left) in rem.iter().enumerate() {
        if left == 0 {
            continue;
        }
        let (base, extra) = (left / c, left % c);
        let rr = r as i64 % c;
        for (j, &p) in slots.iter().enumerate() {
            let n = base + i64::from((j as i64 - rr).rem_euclid(c) < extra);
            if n > 0 {
                emit(r, topo.rank_of_slot(p), Dest::Slot(p), n);
            }
        }
    }
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
    fn even_split_rotates_remainder() {
        let topo = Topology::new(2, 2, 2, 2).unwrap();
        let flows = collect(&[1, 1], &[0, 2], &[], &topo);
        // origin 0's single token goes to slot 0, origin 1's to slot 2
        assert_eq!(flows, vec![(0, 0, Dest::Slot(0), 1), (1, 1, Dest::Slot(2), 1)]);
    }
}
