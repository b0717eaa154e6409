//! What the per-microbatch exact balancers ([`moonep`](super::moonep), [`ultraep`](super::ultraep))
//! share: an exchange's load per EP rank under its placement alone, as segments (expert, tokens
//! the rank computes for it), by NVLink domain; and their copies as the plan's replica rows.
//!
//! Both planners work from the router's output of one exchange, as their runtimes do on the
//! device, and move weights inside one NVLink domain only (MoonEP's kernels reach its domain's
//! peers through NVSwitch multicast; UltraEP confines replication to the scale-up domain), so
//! each domain of an EP group is balanced over its own ranks and the experts homed there. Their
//! copies are planned after the router runs: the plans say so (`ReplicaTiming::AfterRouter`),
//! and the simulator exposes their forward weight copies.

use crate::plan::Replica;

use super::exchange::{share_for, Exchange};

/// Per-rank segments of one exchange: `seg[r]` lists (expert, tokens r computes for it on its
/// placement slots) in expert order, `load[r]` their sum; `total[e]` each expert's tokens.
#[derive(Default)]
pub struct Segments {
    /// `[ep]` tokens each EP-local rank computes under the placement alone.
    pub load: Vec<i64>,
    /// `[ep]` the rank's (expert, tokens) with tokens > 0, experts ascending.
    pub seg: Vec<Vec<(usize, i64)>>,
    /// `[E]` exchange total of each expert (Σ over origins).
    pub total: Vec<i64>,
    quota: Vec<i64>,
}

impl Segments {
    /// Loads exchange `c`: an expert with one slot puts all its tokens on that slot's rank; with
    /// c slots, slot j takes `flow`'s even-split quota `Σ_r (x_r / c + [(j − r) mod c < x_r mod
    /// c])` (what `flow::route_expert` computes there without replicas).
    pub fn reset(&mut self, c: &Exchange) {
        let (ep, e_n) = (c.ep(), c.num_experts());
        self.load.clear();
        self.load.resize(ep, 0);
        self.seg.iter_mut().for_each(Vec::clear);
        self.seg.resize_with(ep, Vec::new);
        self.total.clear();
        self.total.resize(e_n, 0);
        for r in 0..ep {
            for (e, t) in self.total.iter_mut().enumerate() {
                *t += c.origin_of(r, e);
            }
        }
        for e in 0..e_n {
            let t = self.total[e];
            if t == 0 {
                continue;
            }
            let slots = c.expert_slots(e);
            if let &[slot] = slots {
                self.add(c.topo.rank_of_slot(slot), e, t);
                continue;
            }
            let n = slots.len();
            self.quota.clear();
            self.quota.resize(n, 0);
            for r in 0..ep {
                let x = c.origin_of(r, e);
                let (base, extra) = (x / n as i64, (x % n as i64) as usize);
                for (j, q) in self.quota.iter_mut().enumerate() {
                    *q += base + i64::from((j + n - r % n) % n < extra);
                }
            }
            for (j, &slot) in slots.iter().enumerate() {
                let q = self.quota[j];
                self.add(c.topo.rank_of_slot(slot), e, q);
            }
        }
    }

    fn add(&mut self, r: usize, e: usize, t: i64) {
        if t <= 0 {
            return;
        }
        self.load[r] += t;
        match self.seg[r].last_mut() {
            Some(last) if last.0 == e => last.1 += t,
            _ => self.seg[r].push((e, t)),
        }
    }

    /// The NVLink domains of the exchange's group: `(first rank, ranks)` each.
    pub fn domains(c: &Exchange) -> impl Iterator<Item = (usize, usize)> {
        let rpn = c.topo.ranks_per_group_node();
        (0..c.ep() / rpn).map(move |d| (d * rpn, rpn))
    }
}

/// The replica rows of `copies` (expert, src, dst, tokens), merged per (expert, dst) (the
/// first source kept) and sorted by expert then dst; copies onto a rank that holds a slot of
/// the expert are dropped (those tokens stay with the placement).
pub fn replica_rows(c: &Exchange, seg: &Segments, copies: &mut [(usize, usize, usize, i64)]) -> Vec<Replica> {
    copies.sort_by_key(|&(e, _, dst, _)| (e, dst));
    let mut rows: Vec<Replica> = Vec::with_capacity(copies.len());
    let mut i = 0;
    while i < copies.len() {
        let (e, src, dst, mut n) = copies[i];
        let mut j = i + 1;
        while j < copies.len() && copies[j].0 == e && copies[j].2 == dst {
            n += copies[j].3;
            j += 1;
        }
        i = j;
        let t = seg.total[e];
        if n > 0 && t > 0 && !c.hosts(e, dst) {
            rows.push(c.replica(e, src, dst, share_for(n.min(t), t)));
        }
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::CostModel;
    use crate::topology::Topology;

    #[test]
    fn segments_split_a_multi_slot_expert_as_flow_does() {
        // 2 ranks, 2 slots each; expert 0 in slots 0 and 2 (ranks 0 and 1), expert 1 in slot 1
        let topo = Topology::new(2, 2, 2, 2).unwrap();
        let cost = CostModel::for_tests(1);
        // origin [ep * E] rank-major: rank 0 sends 5 of e0 and 2 of e1, rank 1 sends 4 of e0
        let origin = [5i64, 2, 4, 0];
        let slot_off = [0usize, 2, 3];
        let slots = [0usize, 2, 1];
        let c = Exchange {
            group: 0,
            micro: 0,
            layer: 0,
            topo: &topo,
            cost: &cost,
            origin: &origin,
            attn_max: 0.0,
            slot_off: &slot_off,
            slots: &slots,
        };
        let mut s = Segments::default();
        s.reset(&c);
        assert_eq!(s.total, vec![9, 2]);
        // quotas: rank 0's 5 → 3 + 2 (remainder to j with (j - 0) mod 2 < 1: slot j=0),
        // rank 1's 4 → 2 + 2: slot 0 gets 5, slot 2 gets 4
        assert_eq!(s.seg[0], vec![(0, 5), (1, 2)]);
        assert_eq!(s.seg[1], vec![(0, 4)]);
        assert_eq!(s.load, vec![7, 4]);
    }
}
