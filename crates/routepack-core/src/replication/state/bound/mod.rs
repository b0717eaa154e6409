//! Lower bounds on a candidate move's price, tight enough to skip pricing most candidates.
//!
//! A move changes one expert e's replicas. Whatever it does, a rank p it changes keeps the
//! other experts' part, and the rank values (`values`) grow with each of its integer sums,
//! rounding included. So the slowest rank after the move is at least, over ranks p, a bound
//! on p's new values where the move may change p and the cached values elsewhere:
//! * expert time: e's hosts with the least their slots compute (the tokens no copy takes,
//!   R, are split over the c slots by quotas of at least Σ_r ⌊rem_r / c⌋ ≥ (R − ep·(c−1)) / c
//!   each, `flow`'s rule); the destination with its copy's new tokens;
//!   e's other copies as now (every copy computes exactly its `n`: shares round back
//!   exactly below 2^23 tokens and the `n` of an expert's copies never sum above its
//!   total, so moving one copy's share changes no other copy's tokens; above 2^23 they
//!   count as changed, without e's tokens);
//! * all-to-all: a rank that hosts no slot of e sends every token of e it does not compute
//!   itself, at least its tokens less its copy's `n`, over links unknown: the cheapest
//!   split of them between the intra- and inter-node link (convex in the split, so one of
//!   four integer points) bounds it; a host without e's part, and receiving at least what
//!   its slots compute (`k` slots of at least the quota above) beyond its own tokens of e,
//!   over links unknown (the cheapest split again). Without that last term a move of an
//!   expert whose hosts are the all-to-all bottleneck was bounded as if they received none
//!   of its tokens, and nearly every such move was priced (a `feed_slots` each).
//!
//! Bounding the changed ranks by 0 instead (what the planner did before) dropped the whole
//! all-to-all term for experts with several slots (whose feeding may change any rank), and
//! pricing those moves exactly (each a `flow::feed_slots`, ep · c integer divisions) was most
//! of replication's time at ep = 64. The bound is scaled by 1 − 1e-12 (the split's points
//! and the true split are different sums, so their roundings may differ); a bound never
//! above the price skips only moves that cannot win, so the plan is the same
//! (`routepack::plan_exchange`; `debug_assert`ed against every price in debug builds).
//!
//! Preparing an expert reads only what its moves can change, not every rank: its hosts and
//! copies (marked sparsely, unmarked at the next expert), and the largest all-to-all values
//! without its part, found by walking the ranks in the state's all-to-all order. A rank's
//! value without e's part is at most its value now (its sums only lose e's part, and what it
//! must still send is no more than it sends now), so the walk stops at the first rank whose
//! value now is below the second largest found (with a margin for rounding): the ranks left
//! cannot enter the top two. Values of the moved rank's node mates are computed when a move
//! asks for them and kept until the next expert. The full scan this replaced is
//! `reference.rs`, which `state::tests` requires to give the same bits.

use super::{ExchangeState, Links};
use crate::replication::exchange::Exchange;

#[cfg(test)]
pub(crate) mod reference;

/// A rank's one-pass all-to-all time from its link sums (as `ExchangeState::values`).
#[inline]
fn a2a(kt: [f64; 2], l: &Links) -> f64 {
    l[0].max(l[1]) as f64 * kt[0] + l[2].max(l[3]) as f64 * kt[1]
}

/// The least all-to-all time of a rank with link sums `l` that sends `s` more tokens, split
/// between its intra- and inter-node link in any way.
fn a2a_sending(kt: [f64; 2], l: &Links, s: i64) -> f64 {
    if s <= 0 {
        return a2a(kt, l);
    }
    [0, s, (l[1] - l[0]).clamp(0, s), (s - (l[3] - l[2])).clamp(0, s)]
        .into_iter()
        .map(|s0| a2a(kt, &[l[0] + s0, l[1], l[2] + s - s0, l[3]]))
        .fold(f64::INFINITY, f64::min)
}

/// The least all-to-all time of a rank with link sums `l` that receives `r` more tokens,
/// split between its intra- and inter-node link in any way (`a2a_sending` with the roles of
/// sent and received swapped).
fn a2a_receiving(kt: [f64; 2], l: &Links, r: i64) -> f64 {
    if r <= 0 {
        return a2a(kt, l);
    }
    [0, r, (l[0] - l[1]).clamp(0, r), (r - (l[2] - l[3])).clamp(0, r)]
        .into_iter()
        .map(|r0| a2a(kt, &[l[0], l[1] + r0, l[2], l[3] + r - r0]))
        .fold(f64::INFINITY, f64::min)
}

/// The least all-to-all time of e's hosts after a move that leaves each slot at least `quota`
/// tokens: host h with k slots computes at least k·quota, of which at most its own tokens of
/// e arrive without a link, so it receives the rest (its links without e's part, `base` =
/// e·ep).
fn hosts_receiving(st: &ExchangeState, base: usize, quota: i64) -> f64 {
    st.b_hosts.iter().fold(0.0f64, |m, &(h, k)| {
        let (l, el) = (st.links[h], st.elinks[base + h]);
        let l = [l[0] - el[0], l[1] - el[1], l[2] - el[2], l[3] - el[3]];
        m.max(a2a_receiving(st.k_tok, &l, k.saturating_mul(quota) - st.origin_t[base + h]))
    })
}

/// How far below the second largest value without the expert's part a rank's value now must
/// be for the walk to stop (`prepare_bound`): far above the rounding by which the value
/// without the part can exceed the value now (the cheapest split is a different sum).
const WALK_MARGIN: f64 = 1e-9;

impl ExchangeState {
    /// Rank p's one-pass all-to-all time without expert e's part (e from the last
    /// [`Self::prepare_bound`]): a host's without the part, another rank's at least what it
    /// must still send (its tokens of e less its copy's `n`), cheapest split. Kept until the
    /// next expert is prepared.
    fn without(&mut self, p: usize, hosted: &[bool]) -> f64 {
        if self.wo_seen[p] == self.b_stamp {
            return self.wo_a[p];
        }
        let (base, kt) = (self.b_expert * self.ep, self.k_tok);
        let (l, el) = (self.links[p], self.elinks[base + p]);
        let l = [l[0] - el[0], l[1] - el[1], l[2] - el[2], l[3] - el[3]];
        let a = if hosted[p] { a2a(kt, &l) } else { a2a_sending(kt, &l, self.origin_t[base + p] - self.own[p]) };
        self.wo_a[p] = a;
        self.wo_seen[p] = self.b_stamp;
        a
    }

    /// Loads the bounds of moves of expert e (O(its slots and copies), plus the ranks of the
    /// walk). `hosted` `[ep]`: whether rank p hosts a slot of e.
    pub fn prepare_bound(&mut self, c: &Exchange, e: usize, hosted: &[bool]) {
        let (ep, base) = (self.ep, e * self.ep);
        let exact = self.total[e] < 1 << 23;
        if self.flag.len() != ep {
            self.flag.clear();
            self.flag.resize(ep, false);
            self.own.clear();
            self.own.resize(ep, 0);
            self.wo_a.clear();
            self.wo_a.resize(ep, 0.0);
            self.wo_seen.clear();
            self.wo_seen.resize(ep, 0);
            self.b_marked.clear();
        }
        for &p in &self.b_marked {
            self.flag[p] = false;
            self.own[p] = 0;
        }
        self.b_marked.clear();
        self.b_stamp = self.b_stamp.wrapping_add(1);
        if self.b_stamp == 0 {
            self.wo_seen.iter_mut().for_each(|s| *s = 0);
            self.b_stamp = 1;
        }
        self.b_expert = e;
        self.b_hosts.clear();
        for &slot in c.expert_slots(e) {
            let h = c.topo.rank_of_slot(slot);
            self.flag[h] = true;
            self.b_marked.push(h);
            match self.b_hosts.last_mut() {
                Some((r, k)) if *r == h => *k += 1,
                _ => self.b_hosts.push((h, 1)),
            }
        }
        // e's copies: their tokens, and (above 2^23 tokens, where a share may not round back)
        // their expert time counted as changed
        let mut x_flag = 0.0f64;
        self.b_taken = 0;
        for i in 0..self.replicas[e].len() {
            let r = self.replicas[e][i];
            self.own[r.dst] = r.n;
            self.b_taken += r.n;
            self.b_marked.push(r.dst);
            if !exact {
                self.flag[r.dst] = true;
                if !hosted[r.dst] {
                    let t = self.etok[base + r.dst];
                    x_flag = x_flag.max(c.cost.expert_time((self.tok[r.dst] - t) as f64, (self.active[r.dst] - i64::from(t > 0)) as f64));
                }
            }
        }
        let mut a_host = 0.0f64;
        for i in 0..self.b_hosts.len() {
            let h = self.b_hosts[i].0;
            a_host = a_host.max(self.without(h, hosted));
        }
        // the two largest values without e's part: the walk down the all-to-all order
        let mut top = [(f64::NEG_INFINITY, usize::MAX); 2];
        for i in 0..ep {
            let p = self.ao[i];
            if self.av[p] < top[1].0 * (1.0 - WALK_MARGIN) {
                break;
            }
            let a = self.without(p, hosted);
            if a > top[0].0 {
                top = [(a, p), top[0]];
            } else if a > top[1].0 {
                top[1] = (a, p);
            }
        }
        (self.b_x_flag, self.b_a_host, self.b_a_top) = (x_flag, a_host, top);
    }

    /// Lower bound on the exchange's time after the move "expert e's copy on `dst` (a rank
    /// that does not host e, weights from `src`) computes `n` tokens", e from the last
    /// [`Self::prepare_bound`]:
    /// * its all-to-all changes on e's hosts and the ranks of node `local` when `local` is
    ///   given (the caller knows the tokens stay there), else on any rank;
    /// * its replica hops on `src`, `dst` and the other copies sent from `src` when the move
    ///   adds a copy (`new_copy`), on no rank when it only changes a copy's share (the chains
    ///   stay).
    ///
    /// `hosted` `[ep]` as given to `prepare_bound`, `rpn` ranks per node.
    #[allow(clippy::too_many_arguments)]
    pub fn bound(
        &mut self,
        c: &Exchange,
        dst: usize,
        src: usize,
        n: i64,
        new_copy: bool,
        local: Option<usize>,
        hosted: &[bool],
        rpn: usize,
    ) -> f64 {
        let e = self.b_expert;
        let (ep, base, kt) = (self.ep, e * self.ep, self.k_tok);
        let mates = match local {
            Some(node) => {
                let (lo, hi) = (node * rpn, ((node + 1) * rpn).min(ep));
                (lo..hi).filter(|&p| p != dst).fold(0.0f64, |m, p| m.max(self.without(p, hosted)))
            }
            None => 0.0,
        };
        let first = |order: &[usize], v: &[f64], skip: &dyn Fn(usize) -> bool| order.iter().find(|&&p| !skip(p)).map_or(0.0, |&p| v[p]);
        let flag = &self.flag;
        // the destination computes n tokens of e (or, above 2^23 tokens, at least none)
        let t = self.etok[base + dst];
        let x_dst = if self.total[e] < 1 << 23 {
            c.cost.expert_time((self.tok[dst] - t + n) as f64, (self.active[dst] - i64::from(t > 0) + i64::from(n > 0)) as f64)
        } else {
            c.cost.expert_time((self.tok[dst] - t) as f64, (self.active[dst] - i64::from(t > 0)) as f64)
        };
        // what the slots compute: at least the copies' n less (stored n never below the
        // tokens a copy computes), spread by quotas
        let c_n = c.expert_slots(e).len() as i64;
        let left = self.total[e] - (self.b_taken - self.own[dst]) - n;
        let quota = ((left - ep as i64 * (c_n - 1)) / c_n).max(0);
        let x_host = self.b_hosts.iter().fold(0.0f64, |m, &(h, k)| {
            let (t, new) = (self.etok[base + h], k * quota);
            m.max(c.cost.expert_time((self.tok[h] - t + new) as f64, (self.active[h] - i64::from(t > 0) + i64::from(new > 0)) as f64))
        });
        let x = self.b_x_flag.max(x_host).max(x_dst).max(first(&self.xo, &self.xv, &|p| flag[p] || p == dst));
        let (l, el) = (self.links[dst], self.elinks[base + dst]);
        let a_dst = a2a_sending(kt, &[l[0] - el[0], l[1] - el[1], l[2] - el[2], l[3] - el[3]], self.origin_t[base + dst] - n);
        let a_recv = hosts_receiving(self, base, quota);
        let a = match local {
            Some(node) => {
                let (lo, hi) = (node * rpn, ((node + 1) * rpn).min(ep));
                self.b_a_host.max(mates).max(a_dst).max(a_recv).max(first(&self.ao, &self.av, &|p| hosted[p] || (lo..hi).contains(&p)))
            }
            None => {
                let [(a0, p0), (a1, _)] = self.b_a_top;
                (if p0 == dst { a1 } else { a0 }).max(a_dst).max(a_recv).max(0.0)
            }
        };
        let h = if new_copy {
            let reps = &self.replicas[e];
            first(&self.ho, &self.hv, &|p| p == src || p == dst || reps.iter().any(|r| r.src == src && r.dst == p))
        } else {
            self.ho.first().map_or(0.0, |&p| self.hv[p])
        };
        Self::total_time(c, x, a, h) * (1.0 - 1e-12)
    }
}
