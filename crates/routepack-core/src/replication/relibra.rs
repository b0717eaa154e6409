//! `relibra`: ReLibra's intra-batch mechanism (seed 001), as far as it is published.
//!
//! ReLibra "dynamically performs expert replication within a node to absorb
//! micro-batch-level load fluctuations", using the routing known from replay; cross-node
//! balance is left to its inter-batch expert reordering (`placement::relibra`). The paper's
//! abstract gives no more detail, so this is the direct reading: per exchange (group, micro,
//! layer) and per node, while the node's expert load (tokens computed per rank) is uneven, copy the
//! hottest expert of the most loaded rank to the least loaded rank of the same node that has
//! a free replica slot, with the share that levels the two ranks (half their gap, at most
//! what the expert has); stop when a copy no longer narrows the gap or slots run out.
//! Copies take the dst's own tokens first, then its node-mates' (`flow::route_expert`).
//! The replica budget per rank is the same `replication_slots` routepack gets.

use crate::plan::Replica;

use super::exchange::Exchange;
use super::state::ExchangeState;

/// Replicas of one exchange; `state` is scratch (reset here).
pub fn plan_exchange(c: &Exchange, state: &mut ExchangeState, replication_slots: usize) -> Vec<Replica> {
    state.reset(c);
    let topo = c.topo;
    let (ep, e_n) = (c.ep(), c.num_experts());
    let rpn = topo.ranks_per_group_node();
    // each accepted copy adds a replica or grows one; bounded so a pathological exchange ends
    let max_steps = 4 * rpn * (replication_slots + 1);
    // experts of each rank (its placement slots)
    let mut rank_experts: Vec<Vec<usize>> = vec![Vec::new(); ep];
    for e in 0..e_n {
        for &s in c.expert_slots(e) {
            let r = topo.rank_of_slot(s);
            if rank_experts[r].last() != Some(&e) {
                rank_experts[r].push(e);
            }
        }
    }
    let mut hot: Vec<(i64, usize)> = Vec::new();
    for node in 0..ep / rpn {
        let ranks: Vec<usize> = (node * rpn..(node + 1) * rpn).collect();
        for _ in 0..max_steps {
            let p = ranks.iter().copied().fold(ranks[0], |b, r| if state.tok[r] > state.tok[b] { r } else { b });
            // p's experts by the tokens p computes for them, hottest first (id breaks ties)
            hot.clear();
            hot.extend(rank_experts[p].iter().filter(|&&e| state.expert_tokens(e, p) > 0).map(|&e| (-state.expert_tokens(e, p), e)));
            hot.sort_unstable();
            // under-loaded ranks, least loaded first (index breaks ties)
            let mut lows: Vec<usize> = ranks.iter().copied().filter(|&q| q != p).collect();
            lows.sort_by_key(|&q| (state.tok[q], q));
            let mut step = None;
            'find: for &q in &lows {
                let gap = state.tok[p] - state.tok[q];
                if gap < 2 {
                    break;
                }
                for &(_, e) in &hot {
                    if c.hosts(e, q) {
                        continue;
                    }
                    let has = state.has_copy(e, q);
                    if !has && state.used[q] >= replication_slots {
                        continue;
                    }
                    let taken: i64 = state.replicas[e].iter().filter(|r| r.dst != q).map(|r| r.n).sum();
                    let mine = state.replicas[e].iter().find(|r| r.dst == q).map_or(0, |r| r.n);
                    let avail = state.total(e) - taken - mine;
                    let delta = (gap / 2).min(avail).min(state.expert_tokens(e, p));
                    if delta <= 0 {
                        continue;
                    }
                    step = Some((e, q, mine + delta));
                    break 'find;
                }
            }
            let Some((e, q, n)) = step else { break };
            let mut reps = state.replicas[e].clone();
            match reps.iter_mut().find(|r| r.dst == q) {
                Some(r) => *r = state.make_replica(e, r.src, q, n),
                None => reps.push(state.make_replica(e, p, q, n)),
            }
            let before = state.replicas[e].clone();
            let old_p = state.tok[p];
            state.set_replicas(c, e, reps);
            // accept only if the pair's larger load dropped (the copy narrowed the gap)
            if state.tok[p].max(state.tok[q]) >= old_p {
                state.set_replicas(c, e, before);
                break;
            }
        }
    }
    state.table(c)
}
