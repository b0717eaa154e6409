//! `routepack` replication: per exchange (EP group, microbatch, layer), the replicas and token
//! shares that minimise that exchange's time as the simulator prices it (expert max, all-to-all,
//! replication traffic and the part of it that that layer's attention cannot hide), with at
//! most `replication_slots` copies on any rank.
//!
//! Greedy with exact re-evaluation. Each greedy step scans candidate moves "a copy of expert e on
//! rank r computes n of e's tokens in this exchange", for
//! * experts hosted on the rank with the largest expert time (moving work off it),
//! * experts hosted on the rank with the largest all-to-all time, by tokens it receives,
//! * experts that rank sends the most tokens to (a copy on it keeps them local),
//!
//! each on a few destinations (the ranks with most own tokens of e, the least loaded ranks,
//! the all-to-all bottleneck) with two shares (all of e's tokens on r's node, or the share
//! that levels r with e's busiest host when that is less); a move to a rank that already has
//! a copy of e changes its share. Every candidate is priced exactly (`ExchangeState`, the
//! simulator's formula), most promising lower bound first (`ExchangeState::bound`), skipping
//! those whose bound cannot beat the best so far; the best move is taken while it lowers
//! the exchange's time. The result is kept only if it beats no replication, so an exchange
//! never gets slower (it may get no replicas). With [`Options::time_budget`], exchanges whose
//! turn comes after the deadline get no replicas (`exchange::plan_exchanges_until`).

use std::time::Duration;

use crate::plan::Replica;

use super::exchange::Exchange;
use super::state::ExchangeState;

/// Copies a rank may hold per exchange by default (also ReLibra's budget, `relibra`). MindSpeed's default
/// (`hot_n` with N = 3) puts up to 3 copies on every rank; routepack gets fewer.
pub const DEFAULT_REPLICATION_SLOTS: usize = 2;

/// Options of routepack's replication planner; `Default` holds every default (the bindings
/// fill unset arguments from it).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Options {
    /// Copies a rank may receive per exchange: the memory budget.
    pub replication_slots: usize,
    /// Experts taken from each bottleneck list per greedy step.
    pub experts: usize,
    /// Destinations tried per expert from each destination list.
    pub dsts: usize,
    /// Optional wall-clock cap of the stage (None, the default: every exchange is planned and
    /// the clock is never read). Exchanges not begun when it passes get no replicas.
    pub time_budget: Option<Duration>,
}

/// Experts and destinations tried per bottleneck list and greedy step by default
/// (`replication_candidates`): 1 keeps a `flash` plan near 1 s; 2 finds a little more on
/// static placements at about twice the time.
pub const DEFAULT_CANDIDATES: usize = 1;

impl Default for Options {
    fn default() -> Self {
        Self { replication_slots: DEFAULT_REPLICATION_SLOTS, experts: DEFAULT_CANDIDATES, dsts: DEFAULT_CANDIDATES, time_budget: None }
    }
}

/// Per-worker scratch. Tables by expert are filled when an expert first becomes a candidate
/// in an exchange (`stamp` tells the exchange they were filled in).
#[derive(Default)]
pub struct Worker {
    state: ExchangeState,
    rank_experts: Vec<Vec<usize>>,
    /// `[E * ep]` whether rank r hosts a slot of expert e.
    hosted: Vec<bool>,
    cands: Vec<usize>,
    dsts: Vec<usize>,
    keyed: Vec<(i64, usize)>,
    moves: Vec<Move>,
    /// Per rank, the experts it sends most tokens to (computed on first use in a exchange).
    sent_top: Vec<Vec<usize>>,
    /// The exchange's number (for the tables by expert below).
    stamp: u32,
    /// `[E]` per expert: the ranks with its tokens, most first (index ascending on ties), and
    /// its tokens per node: fixed for the exchange; filled where `static_at[e] == stamp`.
    by_origin: Vec<Vec<usize>>,
    node_tokens: Vec<Vec<i64>>,
    static_at: Vec<u32>,
    /// `[E]` per one-slot expert: what copies appended after its replicas draw from (for the
    /// sparse pricing of a new copy); valid where `pool_at[e] == stamp`, until its replicas
    /// change.
    pools: Vec<Vec<i64>>,
    pool_at: Vec<u32>,
}

/// A move: expert e's copy on `dst` (weights from `src`) computes n tokens; `t` is its lower
/// bound, then its price; `idx` its place in scan order.
#[derive(Clone, Copy)]
struct Move {
    t: f64,
    idx: usize,
    e: usize,
    dst: usize,
    src: usize,
    n: i64,
}

/// Up to `k` items of `keyed` with the largest key (ties: smaller index), appended to `out`
/// in that order unless already there; items with key <= 0 are left out. One pass with an
/// insertion-sorted buffer (k is small).
fn take_top(keyed: &mut [(i64, usize)], k: usize, out: &mut Vec<usize>) {
    if k == 0 {
        return;
    }
    let before = |a: &(i64, usize), b: &(i64, usize)| a.0 > b.0 || (a.0 == b.0 && a.1 < b.1);
    let mut n = 0;
    for i in 0..keyed.len() {
        let item = keyed[i];
        if item.0 <= 0 || (n == k && !before(&item, &keyed[n - 1])) {
            continue;
        }
        // insert into the sorted prefix keyed[..n] (items already passed may be overwritten)
        let mut j = n.min(k - 1);
        if n < k {
            n += 1;
        }
        while j > 0 && before(&item, &keyed[j - 1]) {
            keyed[j] = keyed[j - 1];
            j -= 1;
        }
        keyed[j] = item;
    }
    for &(_, i) in &keyed[..n] {
        if !out.contains(&i) {
            out.push(i);
        }
    }
}

/// Fills expert e's tables that are fixed for the exchange (`Worker::by_origin`,
/// `Worker::node_tokens`) unless this exchange filled them already.
fn fill_static(wk: &mut Worker, e: usize, rpn: usize) {
    if wk.static_at[e] == wk.stamp {
        return;
    }
    let origin = wk.state.origin(e);
    let order = &mut wk.by_origin[e];
    order.clear();
    order.extend((0..origin.len()).filter(|&r| origin[r] > 0));
    order.sort_unstable_by(|&a, &b| origin[b].cmp(&origin[a]).then(a.cmp(&b)));
    let nodes = &mut wk.node_tokens[e];
    nodes.clear();
    nodes.extend(origin.chunks(rpn).map(|ch| ch.iter().sum::<i64>()));
    wk.static_at[e] = wk.stamp;
}

/// The replicas (and their token shares) of one exchange.
pub fn plan_exchange(c: &Exchange, wk: &mut Worker, opts: &Options) -> Vec<Replica> {
    wk.state.reset(c);
    if opts.replication_slots == 0 {
        return Vec::new();
    }
    let (ep, e_n) = (c.ep(), c.num_experts());
    let topo = c.topo;
    let (spr, rpn) = (topo.slots_per_rank, topo.ranks_per_group_node());
    wk.rank_experts.iter_mut().for_each(Vec::clear);
    wk.rank_experts.resize_with(ep, Vec::new);
    wk.hosted.clear();
    wk.hosted.resize(e_n * ep, false);
    wk.sent_top.iter_mut().for_each(Vec::clear);
    wk.sent_top.resize_with(ep, Vec::new);
    wk.stamp = wk.stamp.wrapping_add(1);
    if wk.stamp == 0 || wk.static_at.len() != e_n {
        for v in [&mut wk.static_at, &mut wk.pool_at] {
            v.clear();
            v.resize(e_n, 0);
        }
        wk.stamp = 1;
    }
    wk.by_origin.resize_with(e_n, Vec::new);
    wk.node_tokens.resize_with(e_n, Vec::new);
    wk.pools.resize_with(e_n, Vec::new);
    for e in 0..e_n {
        for &p in c.expert_slots(e) {
            let r = topo.rank_of_slot(p);
            wk.hosted[e * ep + r] = true;
            if wk.rank_experts[r].last() != Some(&e) {
                wk.rank_experts[r].push(e);
            }
        }
    }
    let none = wk.state.time(c);
    let mut cur = none;
    let max_steps = 4 * ep * opts.replication_slots + 16;
    for _ in 0..max_steps {
        let st = &mut wk.state;
        let (px, pa) = st.bottlenecks();
        let cands = &mut wk.cands;
        cands.clear();
        let keyed = &mut wk.keyed;
        keyed.clear();
        keyed.extend(wk.rank_experts[px].iter().map(|&e| (st.expert_tokens(e, px), e)));
        take_top(keyed, opts.experts, cands);
        keyed.clear();
        keyed.extend(wk.rank_experts[pa].iter().map(|&e| (st.expert_tokens(e, pa) - st.origin(e)[pa], e)));
        take_top(keyed, opts.experts, cands);
        let sent_from = cands.len();
        keyed.clear();
        // experts pa sends most tokens to: the top (experts + slots) by origin tokens are
        // fixed for the exchange (computed once per rank); at most `slots` of them have a copy
        // on pa lowering their key, so the top `experts` by key are among them
        if wk.sent_top[pa].is_empty() {
            let hosted = &wk.hosted;
            keyed.clear();
            keyed.extend((0..e_n).filter(|&e| !hosted[e * ep + pa]).map(|e| (st.origin(e)[pa], e)));
            let mut top = Vec::new();
            take_top(keyed, opts.experts + opts.replication_slots, &mut top);
            top.push(usize::MAX); // marks "computed" even when empty
            wk.sent_top[pa] = top;
        }
        keyed.clear();
        keyed.extend(wk.sent_top[pa].iter().filter(|&&e| e != usize::MAX).map(|&e| (st.origin(e)[pa] - st.expert_tokens(e, pa), e)));
        take_top(keyed, opts.experts, cands);

        // 1. candidate moves, in scan order, each with a cheap lower bound on its price
        let bar = cur * (1.0 - 1e-12);
        wk.moves.clear();
        for ci in 0..wk.cands.len() {
            let e = wk.cands[ci];
            if wk.state.total(e) == 0 {
                continue;
            }
            fill_static(wk, e, rpn);
            let st = &mut wk.state;
            // what copies appended after e's replicas draw from (for the sparse pricing of a
            // one-slot expert's new copy; an expert with several slots is priced in full)
            if c.expert_slots(e).len() == 1 && wk.pool_at[e] != wk.stamp {
                st.pool_into(c, e, &mut wk.pools[e]);
                wk.pool_at[e] = wk.stamp;
            }
            let hosted = &wk.hosted[e * ep..(e + 1) * ep];
            st.prepare_bound(c, e, hosted);
            // destinations: most own tokens of e, least expert time, and the a2a bottleneck
            let dsts = &mut wk.dsts;
            dsts.clear();
            let eligible = |r: usize| !hosted[r] && (st.has_copy(e, r) || st.used[r] < opts.replication_slots);
            // most own tokens: the first eligible ranks of e's ranks by tokens (those with none
            // are not candidates)
            dsts.extend(wk.by_origin[e].iter().copied().filter(|&r| eligible(r)).take(opts.dsts));
            // least expert time: key = (largest expert time - the rank's) in ns, + 1 (> 0 for
            // every rank, as `take_top` needs), the largest keys first, index ascending on ties;
            // the key falls along the ranks by expert time ascending, so they are walked from
            // there until the key drops below the `dsts`-th found
            let x_max = st.expert_time(px);
            let key = |r: usize| (((x_max - st.expert_time(r)) * 1e9) as i64).saturating_add(1);
            let keyed = &mut wk.keyed;
            keyed.clear();
            for &r in st.expert_order().iter().rev() {
                if !eligible(r) {
                    continue;
                }
                let k = key(r);
                if keyed.len() >= opts.dsts && k < keyed[opts.dsts - 1].0 {
                    break;
                }
                keyed.push((k, r));
            }
            keyed.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
            for &(_, r) in keyed.iter().take(opts.dsts) {
                if !dsts.contains(&r) {
                    dsts.push(r);
                }
            }
            if ci >= sent_from && eligible(pa) && !dsts.contains(&pa) {
                dsts.push(pa);
            }
            // the busiest host of e (where its tokens come off)
            let host_x = c.expert_slots(e).iter().map(|&p| st.expert_time(p / spr)).fold(0.0, f64::max);
            for di in 0..wk.dsts.len() {
                let r = wk.dsts[di];
                let existing = st.replicas[e].iter().position(|x| x.dst == r);
                let mine = existing.map_or(0, |i| st.replicas[e][i].n);
                let others: i64 = st.replicas[e].iter().filter(|x| x.dst != r).map(|x| x.n).sum();
                let avail = st.total(e) - others;
                if avail <= 0 {
                    continue;
                }
                let src = existing.map_or_else(|| c.source_for(e, r), |i| st.replicas[e][i].src);
                // shares: all of e's tokens on r's node (they then stay inside the node), or
                // the tokens that level r with e's busiest host when that is less. (Taking only
                // r's own tokens, or levelling past the node, was tried: greedy then spends
                // slots on small gains, and the plans were slower on both profiles.)
                let node_tokens = wk.node_tokens[e][r / rpn];
                // with c_tok = 0 (or a huge gap) the share is "all of it": the float→int cast
                // saturates, and the sum must too (it overflowed i64 before)
                let level = mine.saturating_add(((host_x - st.expert_time(r)) / (2.0 * c.cost.c_tok.max(f64::MIN_POSITIVE))) as i64);
                let mut options = [node_tokens.clamp(1, avail), 0];
                let n_options = if level >= 1 && level < node_tokens {
                    options[1] = level.min(avail);
                    2
                } else {
                    1
                };
                // ranks a move of e onto r can change: expert time on r, e's hosts and e's
                // other copies; all-to-all also on the ranks tokens are drawn from, which is
                // r's node when e has no other copy, the copy's old and new n stay within
                // the node's tokens and e has one placement slot (otherwise any rank: the
                // slots of a replicated expert are fed node first, so taking tokens off one
                // node changes what every node sends and receives for it)
                let alone = st.replicas[e].iter().all(|x| x.dst == r) && c.expert_slots(e).len() == 1;
                let lo = (r / rpn) * rpn;
                for (k, &n) in options[..n_options].iter().enumerate() {
                    if n == mine || options[..k].contains(&n) {
                        continue;
                    }
                    let local = (alone && n.max(mine) <= node_tokens).then_some(lo / rpn);
                    let lb = st.bound(c, r, src, n, existing.is_none(), local, hosted, rpn);
                    if lb < bar {
                        let idx = wk.moves.len();
                        wk.moves.push(Move { t: lb, idx, e, dst: r, src, n });
                    }
                }
            }
        }
        // 2. price them exactly, most promising bound first; the best is the lowest price,
        // the earliest in scan order among equal prices (so the order of pricing does not
        // matter), and a move whose bound cannot beat the best is not priced
        wk.moves.sort_unstable_by(|a, b| a.t.total_cmp(&b.t).then(a.idx.cmp(&b.idx)));
        let st = &mut wk.state;
        let mut best: Option<Move> = None;
        for i in 0..wk.moves.len() {
            let m = wk.moves[i];
            let (best_t, best_idx) = best.map_or((bar, usize::MAX), |b| (b.t, b.idx));
            if m.t > best_t {
                break;
            }
            if m.t == best_t && m.idx > best_idx {
                continue;
            }
            let lb = m.t;
            let rep = st.make_replica(m.e, m.src, m.dst, m.n);
            let slots = c.expert_slots(m.e);
            // a new copy of a one-slot expert changes few ranks: priced sparsely (same result)
            let t = if slots.len() == 1 && !st.has_copy(m.e, m.dst) && st.total(m.e) < 1 << 23 {
                st.try_append(c, m.e, slots[0] / spr, &wk.pools[m.e], rep)
            } else {
                st.try_move(c, m.e, rep)
            };
            debug_assert!(t >= lb, "bound {lb} above the price {t}: {:?}", (m.e, m.dst, m.n));
            if t < best_t || (best.is_some() && t == best_t && m.idx < best_idx) {
                best = Some(Move { t, ..m });
            }
        }
        let Some(m) = best else { break };
        st.apply_move(c, m.e, st.make_replica(m.e, m.src, m.dst, m.n));
        // e's replicas changed: so does what a new copy of it draws from
        wk.pool_at[m.e] = 0;
        cur = m.t;
    }
    // keep the replicas only with a margin far above the float noise between this incremental
    // sum and the simulator's, so the simulated layer time never grows
    if cur < none * (1.0 - 1e-9) {
        wk.state.table(c)
    } else {
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::take_top;

    #[test]
    fn take_top_matches_a_full_sort() {
        let items: Vec<(i64, usize)> = vec![(5, 3), (0, 1), (7, 9), (5, 2), (-1, 4), (7, 0), (2, 8)];
        for k in 1..9 {
            let mut sorted = items.clone();
            sorted.sort_by_key(|&(key, i)| (std::cmp::Reverse(key), i));
            let want: Vec<usize> = sorted.iter().take(k).filter(|x| x.0 > 0).map(|x| x.1).collect();
            let mut got = vec![99];
            let mut keyed = items.clone();
            take_top(&mut keyed, k, &mut got);
            assert_eq!(got[1..], want[..], "k={k}");
        }
    }
}
