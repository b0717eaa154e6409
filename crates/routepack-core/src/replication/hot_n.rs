//! `hot_n`: MindSpeed's balanced MoE (seed 004; REFERENCES.md), the baseline as published.
//!
//! Per exchange (group, micro, layer), from the all-gathered per-rank per-expert token counts, repeat
//! N times (default 3): take the EP rank with the largest load, take that rank's largest
//! expert as hot, subtract its total from the owner and add back to each rank the tokens it
//! sent to it (those are now computed locally), and zero it so it is not picked again.
//! The hot experts' weights are broadcast from the owner to every other EP rank, and every
//! rank computes its own tokens for them: the replica for dst has
//! `share = (tokens of that expert originating at dst) / (its exchange total)`, which
//! `flow::route_expert` (own rank first) turns into exactly dst's own tokens, so those tokens
//! leave the all-to-all. Ranks with no tokens of a hot expert still receive its weights
//! (share 0): MindSpeed's broadcast goes to the whole EP group.
//!
//! MindSpeed assumes one slot per expert. With redundant placement slots the "owner" load is
//! the tokens routed to the rank's slots, copies go to ranks that host no slot of the
//! expert (from a host on their node if any), and the hosts' own tokens stay split over the
//! hosts as the placement routes them.

use crate::plan::Replica;

use super::exchange::Exchange;
use super::state::ExchangeState;

/// MindSpeed's default `--balanced-moe-hot-expert-num`.
pub const DEFAULT_HOT_EXPERTS: usize = 3;

/// Replicas of one exchange; `state` is scratch (reset here).
pub fn plan_exchange(c: &Exchange, state: &mut ExchangeState, hot_experts: usize) -> Vec<Replica> {
    state.reset(c);
    let (ep, e_n) = (c.ep(), c.num_experts());
    let mut hot = vec![false; e_n];
    for _ in 0..hot_experts {
        // the most loaded rank (lowest index on ties)
        let p = (0..ep).fold(0, |b, r| if state.tok[r] > state.tok[b] { r } else { b });
        // its largest expert that is not hot yet (lowest id on ties)
        let mut pick: Option<(usize, i64)> = None;
        for e in (0..e_n).filter(|&e| !hot[e]) {
            let t = state.expert_tokens(e, p);
            if t > 0 && !matches!(pick, Some((_, b)) if t <= b) {
                pick = Some((e, t));
            }
        }
        let Some((e, _)) = pick else { break };
        hot[e] = true;
        let reps = (0..ep).filter(|&r| !c.hosts(e, r)).map(|r| state.make_replica(e, c.source_for(e, r), r, state.origin(e)[r])).collect();
        state.set_replicas(c, e, reps);
    }
    state.table(c)
}
