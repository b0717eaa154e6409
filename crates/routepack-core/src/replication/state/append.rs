//! Sparse pricing of the commonest candidate: a new copy of an expert with one placement
//! slot, appended after its replicas. Only the ranks it draws tokens from, its destination,
//! the expert's host and the replication chain change, so only they are recomputed; the
//! result equals [`ExchangeState::try_replicas`] with the replica appended (checked in debug
//! builds).

use super::{ExchangeState, Links, ReplicaShare};
use crate::flow::{route_expert, Dest};
use crate::replication::exchange::Exchange;

impl ExchangeState {
    /// Tokens of expert e per origin rank that no copy takes now (they go to e's slots):
    /// the pool a copy appended after e's replicas draws from.
    pub fn pool_into(&mut self, c: &Exchange, e: usize, out: &mut Vec<i64>) {
        out.clear();
        out.resize(self.ep, 0);
        self.args.clear();
        self.args.extend(self.replicas[e].iter().map(|r| (r.dst, r.share)));
        let origin = &self.origin_t[e * self.ep..(e + 1) * self.ep];
        route_expert(origin, c.expert_slots(e), &self.args, c.topo, &mut self.rem, |o, _, d, n| {
            if let Dest::Slot(_) = d {
                out[o] += n;
            }
        });
    }

    /// The exchange's time if `rep` (a new dst) were appended to expert e's replicas, for an expert
    /// with one slot, on rank `host`: only the ranks it draws tokens from, dst, host and the
    /// replication chain change, so only they are recomputed. `pool` from [`Self::pool_into`].
    /// Same result as [`Self::try_replicas`] with the replica appended (checked in debug builds).
    pub fn try_append(&mut self, c: &Exchange, e: usize, host: usize, pool: &[i64], rep: ReplicaShare) -> f64 {
        let (ep, r) = (self.ep, rep.dst);
        let total = self.total[e];
        debug_assert!(c.expert_slots(e).len() == 1 && !self.has_copy(e, r) && r != host);
        // what route_expert gives the appended replica: round(share · T), capped by what is left
        let taken: i64 = self.replicas[e].iter().map(|x| x.n).sum();
        let want = crate::rounding::round((rep.share as f64) * (total as f64)) as i64;
        let mut need = want.clamp(0, (total - taken).max(0));
        self.stamp = self.stamp.wrapping_add(1);
        if self.stamp == 0 {
            self.mark.iter_mut().for_each(|m| *m = 0);
            self.stamp = 1;
        }
        let stamp = self.stamp;
        self.delta.clear();
        let node = &self.node;
        let (mark, pos, delta) = (&mut self.mark, &mut self.pos, &mut self.delta);
        fn at(mark: &mut [u32], pos: &mut [usize], delta: &mut Vec<(usize, i64, i64, Links)>, stamp: u32, p: usize) -> usize {
            if mark[p] != stamp {
                mark[p] = stamp;
                pos[p] = delta.len();
                delta.push((p, 0, 0, [0; 4]));
            }
            pos[p]
        }
        let rpn = c.topo.ranks_per_group_node();
        let lo = (r / rpn) * rpn;
        let hi = (lo + rpn).min(ep);
        let order = std::iter::once(r).chain((lo..hi).filter(|&o| o != r)).chain((0..lo).chain(hi..ep));
        let mut moved = 0;
        for o in order {
            if need == 0 {
                break;
            }
            let t = pool[o].min(need);
            if t == 0 {
                continue;
            }
            need -= t;
            moved += t;
            // o's t tokens leave host's slot and go to r's copy
            if o != host {
                let k = if node[o] == node[host] { 0 } else { 2 };
                let (io, ih) = (at(mark, pos, delta, stamp, o), at(mark, pos, delta, stamp, host));
                delta[io].3[k] -= t;
                delta[ih].3[k + 1] -= t;
            }
            if o != r {
                let k = if node[o] == node[r] { 0 } else { 2 };
                let (io, ir) = (at(mark, pos, delta, stamp, o), at(mark, pos, delta, stamp, r));
                delta[io].3[k] += t;
                delta[ir].3[k + 1] += t;
            }
        }
        if moved > 0 {
            let (ir, ih) = (at(mark, pos, delta, stamp, r), at(mark, pos, delta, stamp, host));
            delta[ir].1 += moved;
            delta[ir].2 += 1;
            delta[ih].1 -= moved;
            delta[ih].2 -= i64::from(self.etok[e * ep + host] == moved);
        }
        // the replication chain of (e, src) gains r
        self.trial.clear();
        self.trial.extend_from_slice(&self.replicas[e]);
        self.trial.push(rep);
        let reps = std::mem::take(&mut self.trial);
        self.hop_delta(e, &reps);
        self.trial = reps;
        for i in 0..self.touched.len() {
            let p = self.touched[i];
            if self.mark[p] != stamp {
                self.mark[p] = stamp;
                self.pos[p] = self.delta.len();
                self.delta.push((p, 0, 0, [0; 4]));
            }
        }
        let first = |order: &[usize], v: &[f64]| order.iter().find(|&&p| self.mark[p] != stamp).map_or(0.0, |&p| v[p]);
        let (mut x_max, mut a_max, mut h_max) = (first(&self.xo, &self.xv), first(&self.ao, &self.av), first(&self.ho, &self.hv));
        for &(p, dt, da, dl) in &self.delta {
            let mut l = self.links[p];
            let mut h = self.hops[p];
            for k in 0..4 {
                l[k] += dl[k];
                h[k] += self.dhops[p][k];
            }
            let extra = self.extra(c, p, e, self.etok[e * ep + p] + dt);
            let (x, a, hh) = self.values(c, self.tok[p] + dt, self.active[p] + da, extra, &l, &h);
            x_max = x_max.max(x);
            a_max = a_max.max(a);
            h_max = h_max.max(hh);
        }
        self.clear_dhops();
        let t = Self::total_time(c, x_max, a_max, h_max);
        #[cfg(debug_assertions)]
        {
            let mut reps = self.replicas[e].clone();
            reps.push(rep);
            let full = self.try_replicas(c, e, &reps);
            debug_assert!((full - t).abs() <= 1e-12 * full.abs(), "append {t} vs full {full}");
        }
        t
    }
}
