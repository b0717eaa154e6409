//! The parts of the candidates priced for experts with several slots, kept until the expert's
//! replicas change. Such an expert's part is routed through `flow::feed_slots` (ep · c integer
//! divisions), the costliest step of pricing a candidate, and the greedy search prices the
//! same candidate (expert, destination, share) again at later steps as long as that expert's
//! replicas stay: its part depends only on the exchange's origin, the expert's slots and its
//! replicas. The price itself (the other ranks' sums change) is always recomputed.

use super::{ExchangeState, Part, PartCache, ReplicaShare};
use crate::replication::exchange::Exchange;

impl PartCache {
    /// Forgets every entry (a new exchange with `e_n` experts); buffers are kept.
    pub(super) fn clear(&mut self, e_n: usize) {
        self.by_expert.iter_mut().for_each(Vec::clear);
        self.by_expert.resize_with(e_n, Vec::new);
        self.free.clear();
        self.free.extend(0..self.keys.len());
    }

    /// Forgets expert e's entries (its replicas changed).
    pub(super) fn forget(&mut self, e: usize) {
        if let Some(live) = self.by_expert.get_mut(e) {
            self.free.append(live);
        }
    }

    fn find(&self, key: (usize, usize, u32)) -> Option<usize> {
        self.by_expert[key.0].iter().copied().find(|&i| self.keys[i] == key)
    }
}

impl ExchangeState {
    /// `replicas[e]` with `rep` replacing the replica on its dst, or appended, in `trial`.
    fn trial_with(&mut self, e: usize, rep: ReplicaShare) {
        self.trial.clear();
        self.trial.extend_from_slice(&self.replicas[e]);
        match self.trial.iter_mut().find(|x| x.dst == rep.dst) {
            Some(x) => *x = rep,
            None => self.trial.push(rep),
        }
    }

    /// The cache entry holding e's part with `rep` set (in `trial`), routed now if missing.
    fn cached_part(&mut self, c: &Exchange, e: usize, rep: ReplicaShare, reps: &[ReplicaShare]) -> usize {
        let key = (e, rep.dst, rep.share.to_bits());
        if let Some(i) = self.cache.find(key) {
            return i;
        }
        let i = match self.cache.free.pop() {
            Some(i) => i,
            None => {
                self.cache.keys.push(key);
                self.cache.parts.push(Part::new(self.ep));
                self.cache.keys.len() - 1
            }
        };
        let mut part = std::mem::take(&mut self.cache.parts[i]);
        if part.tok.len() != self.ep {
            part = Part::new(self.ep);
        }
        self.part_into(c, e, reps, &mut part);
        self.cache.parts[i] = part;
        self.cache.keys[i] = key;
        self.cache.by_expert[e].push(i);
        i
    }

    /// The exchange's time if expert e's replica on `rep.dst` were `rep` (replacing the one
    /// there, or appended): [`Self::try_replicas`] of that list, with the parts of experts
    /// with several slots cached (see the module docs).
    pub fn try_move(&mut self, c: &Exchange, e: usize, rep: ReplicaShare) -> f64 {
        self.trial_with(e, rep);
        let reps = std::mem::take(&mut self.trial);
        let t = if c.expert_slots(e).len() > 1 {
            let i = self.cached_part(c, e, rep, &reps);
            let part = std::mem::take(&mut self.cache.parts[i]);
            self.hop_delta(e, &reps);
            let t = self.time_with(c, e, &part);
            self.clear_dhops();
            self.cache.parts[i] = part;
            t
        } else {
            self.try_replicas(c, e, &reps)
        };
        self.trial = reps;
        t
    }

    /// Makes expert e's replica on `rep.dst` `rep` (replacing the one there, or appended):
    /// [`Self::set_replicas`] of that list, the part taken from the cache when priced.
    pub fn apply_move(&mut self, c: &Exchange, e: usize, rep: ReplicaShare) {
        self.trial_with(e, rep);
        let reps = self.trial.clone();
        if c.expert_slots(e).len() > 1 {
            let i = self.cached_part(c, e, rep, &reps);
            let part = std::mem::take(&mut self.cache.parts[i]);
            self.commit(c, e, reps, &part);
            // commit forgot e's entries: entry i is free again, its buffer goes back
            self.cache.parts[i] = part;
        } else {
            self.set_replicas(c, e, reps);
        }
    }
}
