//! One expert's part of the per-rank sums: routed by `flow::route_expert` from its
//! replicas, swapped in and out of the sums, and the direct form of an expert with one
//! slot and no replicas (what `reset` loads for most experts).

use super::{ExchangeState, Part, ReplicaShare};
use crate::flow::route_expert;
use crate::replication::exchange::Exchange;

impl ExchangeState {
    /// Expert e's part of the sums if its replicas were `reps` (computed by `route_expert`).
    pub fn part_into(&mut self, c: &Exchange, e: usize, reps: &[ReplicaShare], out: &mut Part) {
        let ep = self.ep;
        out.tok.iter_mut().for_each(|x| *x = 0);
        out.links.iter_mut().for_each(|x| *x = [0; 4]);
        self.args.clear();
        self.args.extend(reps.iter().map(|r| (r.dst, r.share)));
        let origin = &self.origin_t[e * ep..(e + 1) * ep];
        let node = &self.node;
        route_expert(origin, c.expert_slots(e), &self.args, c.topo, &mut self.rem, |o, p, _, n| {
            out.tok[p] += n;
            if o != p {
                let k = if node[o] == node[p] { 0 } else { 2 };
                out.links[o][k] += n;
                out.links[p][k + 1] += n;
            }
        });
    }

    /// Swaps `part` in as expert e's part of the sums (the old one out).
    pub(super) fn install(&mut self, e: usize, part: &Part) {
        let ep = self.ep;
        for p in 0..ep {
            let old = self.etok[e * ep + p];
            let new = part.tok[p];
            self.tok[p] += new - old;
            self.active[p] += i64::from(new > 0) - i64::from(old > 0);
            self.etok[e * ep + p] = new;
            let ol = self.elinks[e * ep + p];
            for (k, l) in self.links[p].iter_mut().enumerate() {
                *l += part.links[p][k] - ol[k];
            }
            self.elinks[e * ep + p] = part.links[p];
        }
    }

    /// [`Self::install`] of the part of expert e with no replicas and one slot, on rank
    /// `host`, into a freshly reset state (e's part still zero): every origin's tokens go to
    /// `host` (what `route_expert` gives with one slot and no replicas, without routing).
    pub(super) fn install_unreplicated(&mut self, e: usize, host: usize) {
        let base = e * self.ep;
        let t = self.total[e];
        debug_assert!(t > 0 && self.etok[base..base + self.ep].iter().all(|&x| x == 0));
        self.etok[base + host] = t;
        self.tok[host] += t;
        self.active[host] += 1;
        let nh = self.node[host];
        let mut recv = [0i64; 2];
        for o in 0..self.ep {
            let x = self.origin_t[base + o];
            if x == 0 || o == host {
                continue;
            }
            let k = usize::from(self.node[o] != nh);
            self.elinks[base + o][2 * k] += x;
            self.links[o][2 * k] += x;
            recv[k] += x;
        }
        for (k, &x) in recv.iter().enumerate() {
            self.elinks[base + host][2 * k + 1] += x;
            self.links[host][2 * k + 1] += x;
        }
    }
}
