//! Lower bounds on a candidate move's price, tight enough to skip pricing most candidates.
//!
//! A move changes one expert e's replicas. Whatever it does, a rank p it changes keeps
//! everything but e's part: its tokens, active experts and links are at least its current
//! ones less e's (e's new part is non-negative), and the rank values (`values`) grow with each
//! of them, rounding included. So the slowest rank after the move is at least, over ranks
//! p, e's-part-removed values where the move may change p and the cached values elsewhere.
//! Bounding the changed ranks by 0 instead (what the planner did before) dropped the whole
//! all-to-all term for experts with several slots (whose feeding may change any rank), and
//! pricing those moves exactly (each a `flow::feed_slots`, ep · c integer divisions) was most
//! of replication's time at ep = 64. A bound never above the price skips only moves that
//! cannot win, so the plan is the same (`routepack::plan_exchange`; checked in debug builds).

use super::ExchangeState;
use crate::replication::exchange::Exchange;

impl ExchangeState {
    /// Loads the bounds of moves of expert e: per rank, the expert and all-to-all values
    /// without e's part, and which ranks host e or hold a copy (their expert time changes
    /// with any move of e). `hosted` `[ep]`: whether rank p hosts a slot of e. O(ep).
    pub fn prepare_bound(&mut self, c: &Exchange, e: usize, hosted: &[bool]) {
        let ep = self.ep;
        let base = e * ep;
        let (kt, mut wo_x, mut wo_a, mut flag) =
            (self.k_tok, std::mem::take(&mut self.wo_x), std::mem::take(&mut self.wo_a), std::mem::take(&mut self.flag));
        wo_x.clear();
        wo_a.clear();
        flag.clear();
        flag.extend_from_slice(&hosted[..ep]);
        for r in &self.replicas[e] {
            flag[r.dst] = true;
        }
        let (mut x_flag, mut a_all, mut a_host) = (0.0f64, 0.0f64, 0.0f64);
        for p in 0..ep {
            let t = self.etok[base + p];
            let x = c.cost.expert_time((self.tok[p] - t) as f64, (self.active[p] - i64::from(t > 0)) as f64);
            let (l, el) = (self.links[p], self.elinks[base + p]);
            let l = [l[0] - el[0], l[1] - el[1], l[2] - el[2], l[3] - el[3]];
            let a = l[0].max(l[1]) as f64 * kt[0] + l[2].max(l[3]) as f64 * kt[1];
            if flag[p] {
                x_flag = x_flag.max(x);
            }
            if hosted[p] {
                a_host = a_host.max(a);
            }
            a_all = a_all.max(a);
            wo_x.push(x);
            wo_a.push(a);
        }
        (self.wo_x, self.wo_a, self.flag) = (wo_x, wo_a, flag);
        (self.b_x_flag, self.b_a_all, self.b_a_host) = (x_flag, a_all, a_host);
        self.b_expert = e;
    }

    /// Lower bound on the exchange's time after a move of the expert of the last
    /// [`Self::prepare_bound`] that puts or changes its copy on rank `dst`:
    /// * its expert time changes on `dst`, e's hosts and e's copies;
    /// * its all-to-all on e's hosts and the ranks of node `local` when `local` is given (the
    ///   caller knows the tokens stay there), else on any rank;
    /// * its replica hops on `src`, `dst` and the other copies sent from `src` when the move
    ///   adds a copy (`new_copy`), on no rank when it only changes a copy's share (the chains
    ///   stay).
    ///
    /// `hosted` `[ep]` as given to `prepare_bound`, `rpn` ranks per node.
    pub fn bound(&self, c: &Exchange, dst: usize, src: usize, new_copy: bool, local: Option<usize>, hosted: &[bool], rpn: usize) -> f64 {
        let first = |order: &[usize], v: &[f64], skip: &dyn Fn(usize) -> bool| order.iter().find(|&&p| !skip(p)).map_or(0.0, |&p| v[p]);
        let flag = &self.flag;
        let x = self.b_x_flag.max(self.wo_x[dst]).max(first(&self.xo, &self.xv, &|p| flag[p] || p == dst));
        let a = match local {
            Some(n) => {
                let (lo, hi) = (n * rpn, ((n + 1) * rpn).min(self.ep));
                let node = self.wo_a[lo..hi].iter().fold(0.0f64, |m, &v| m.max(v));
                self.b_a_host.max(node).max(first(&self.ao, &self.av, &|p| hosted[p] || (lo..hi).contains(&p)))
            }
            None => self.b_a_all,
        };
        let h = if new_copy {
            let reps = &self.replicas[self.b_expert];
            first(&self.ho, &self.hv, &|p| p == src || p == dst || reps.iter().any(|r| r.src == src && r.dst == p))
        } else {
            self.ho.first().map_or(0.0, |&p| self.hv[p])
        };
        Self::total_time(c, x, a, h)
    }
}
