//! `ExchangeState`: the simulator's cost of one exchange (EP group, microbatch, layer), kept up to
//! date as the replicas of one expert at a time change, so a planner can price a candidate
//! in O(ep) instead of re-pricing the whole exchange in O(ep · E).
//!
//! The exchange's cost (`simulate::ExchangePricer`) is a function of per-rank sums over
//! experts: tokens and active experts per rank (expert term), tokens sent/received per rank
//! and link (all-to-all), replica hops sent/received per rank and link (replication chains,
//! one per (expert, src)). Each expert's part is computed with `flow::route_expert` from its
//! replicas, exactly as the simulator routes it, and kept in integers, so swapping an
//! expert's part in and out is exact.
//!
//! Pricing a candidate is O(ep) integer work plus float work only on the ranks the
//! candidate changes: per-rank values (expert time, all-to-all time, replica hops) and the
//! ranks sorted by each are cached, so the max over unchanged ranks is read off the order.
//! `append` prices the commonest candidate, a new copy of a one-slot expert, sparser still;
//! `cache` keeps the parts of multi-slot experts' candidates until the expert changes; `bound`
//! bounds a candidate's price from below so most are never priced; `part` routes one
//! expert's part (and loads an unreplicated one-slot expert without routing).
//!
//! # What it shares with `simulate`, and what it approximates
//! * Shared, bit for bit: the expert term ([`crate::cost::CostModel::expert_time`], plus
//!   [`crate::cost::CostModel::weights_bound_extra`] of each active expert, summed in expert
//!   order as the simulator sums it), the all-to-all passes
//!   ([`crate::cost::CostModel::all_to_all_of_link_time`]), the exposed replication
//!   ([`crate::cost::CostModel::exposed_replication`]), the attention it hides behind (the exchange's
//!   `attn_max`, from `CellGrid::attention_max` like the simulator's) and the sum of the
//!   parts (`LayerCost::new`, `LayerCost::total`, overlap included).
//! * Approximated by rounding order only: link times. The simulator adds each flow's bytes
//!   (`n · token_bytes`, a hop's `expert_weight_bytes`) in f64 and divides the slowest
//!   rank's per-link max by the bandwidth; this state keeps integer token and hop counts and
//!   multiplies their max by a precomputed seconds-per-unit (`token_bytes / bw`,
//!   `1 / bw` then × bytes), and prices the backward gradient reduction from the same hop
//!   counts (a reversed chain has the same per-rank max(sent, received)).
//!
//! The test that ties it to the simulator, and fails if they drift:
//! `replication::tests::incremental_cost_matches_the_simulator` prices every exchange of
//! every planner's plan both ways and requires agreement within 1e-12 relative. routepack
//! keeps its replicas only when they beat no replication by 1e-9 relative, far above that
//! noise, so a planned exchange is never slower on the simulator's scale
//! (`replication::tests::routepack_never_slower_than_none`).

use crate::cost::LayerCost;
use crate::plan::Replica;

use super::exchange::{share_for, Exchange};

mod append;
mod bound;
mod cache;
mod part;

/// Per rank and link: [send intra, recv intra, send inter, recv inter].
type Links = [i64; 4];

/// One replica of an expert: `dst` computes `n` tokens (share `share` of the expert's
/// exchange total), its weights coming from `src`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ReplicaShare {
    /// EP-local rank in `0..ep` that holds the copy and computes its tokens.
    pub dst: usize,
    /// EP-local rank in `0..ep` that hosts the expert and sends the weights (`!= dst`).
    pub src: usize,
    /// Tokens the copy computes in this exchange (what `share` rounds to, see
    /// `exchange::share_for`).
    pub n: i64,
    /// Fraction in [0, 1] of the expert's exchange total, as the plan stores it
    /// (`plan::Replica::share`).
    pub share: f32,
}

/// One expert's part of the per-rank sums.
#[derive(Clone, Debug, Default)]
pub struct Part {
    /// `[ep]` tokens of the expert computed on each EP rank (its slots and copies).
    pub tok: Vec<i64>,
    /// `[ep]` the expert's all-to-all tokens per rank and link: [send intra, recv intra,
    /// send inter, recv inter] (tokens a rank computes for itself cross no link).
    pub links: Vec<Links>,
}

impl Part {
    fn new(ep: usize) -> Self {
        Self { tok: vec![0; ep], links: vec![[0; 4]; ep] }
    }
}

/// The part cache (`cache`): parts by (expert, destination, share bits) of the trial "expert e's replicas with the
/// replica on `dst` set to `share`".
#[derive(Default)]
struct PartCache {
    /// Entry i: its key and part; free entries are listed in `free`.
    keys: Vec<(usize, usize, u32)>,
    parts: Vec<Part>,
    free: Vec<usize>,
    /// `[E]` the live entries of each expert.
    by_expert: Vec<Vec<usize>>,
}

/// The simulator's cost of one exchange under its current replicas, kept as integer per-rank
/// sums that one expert's part can be swapped in and out of exactly (see the module docs).
/// Load an exchange with [`ExchangeState::reset`]; make one per worker and reuse it, its
/// buffers keep their capacity.
#[derive(Default)]
pub struct ExchangeState {
    ep: usize,
    e_n: usize,
    /// `[E * ep]` expert-major copy of the exchange's origin tokens.
    origin_t: Vec<i64>,
    /// `[E]` exchange total of each expert.
    total: Vec<i64>,
    /// Replicas of each expert, in table order.
    pub replicas: Vec<Vec<ReplicaShare>>,
    /// `[E * ep]` tokens expert e is computed for on rank p (slots and copies).
    etok: Vec<i64>,
    /// `[E * ep]` expert e's all-to-all tokens per rank and link.
    elinks: Vec<Links>,
    /// `[ep]` tokens each EP rank computes, summed over experts (slots and copies).
    pub tok: Vec<i64>,
    /// `[ep]` active experts of each EP rank: distinct logical experts it computes tokens for
    /// (what `c_exp` is charged for).
    pub active: Vec<i64>,
    links: Vec<Links>,
    /// `[ep]` replica hops (forward direction) per rank and link.
    hops: Vec<Links>,
    /// `[ep]` distinct experts copied onto each rank (its replica slots in use).
    pub used: Vec<usize>,
    /// Scratch for candidates.
    scratch_part: Part,
    dhops: Vec<Links>,
    touched: Vec<usize>,
    rem: Vec<i64>,
    args: Vec<(usize, f32)>,
    srcs: Vec<usize>,
    old_dsts: Vec<usize>,
    new_dsts: Vec<usize>,
    /// `[ep]` node of each EP-local rank (no division in the hot loops).
    node: Vec<usize>,
    /// Seconds per unit: a2a token over intra/inter link, replica hop over intra/inter link
    /// (weights; gradients scale by grad/weight bytes).
    k_tok: [f64; 2],
    k_hop: [f64; 2],
    /// `[ep]` cached per-rank values: one-pass expert time, all-to-all time, hop time per byte.
    xv: Vec<f64>,
    av: Vec<f64>,
    hv: Vec<f64>,
    /// `[ep]` ranks by each value, largest first (index breaks ties).
    xo: Vec<usize>,
    ao: Vec<usize>,
    ho: Vec<usize>,
    /// Ranks a candidate changes: `mark[p] == stamp`.
    mark: Vec<u32>,
    stamp: u32,
    changed: Vec<usize>,
    /// Sparse change of an appended copy: per changed rank (tokens, active, links);
    /// `pos[p]` is p's entry when `mark[p] == stamp`.
    delta: Vec<(usize, i64, i64, Links)>,
    pos: Vec<usize>,
    trial: Vec<ReplicaShare>,
    /// Scratch of `refresh_changed`: per value (expert, all-to-all, hops), the ranks whose
    /// value changed.
    moved: [Vec<usize>; 3],
    /// `bound`'s per-expert scratch: `[ep]` all-to-all values without the expert's part
    /// (valid where `wo_seen[p] == b_stamp`), ranks whose expert time any move changes, the
    /// copies' tokens (both set sparsely at the ranks in `b_marked`), and the maxima.
    wo_a: Vec<f64>,
    wo_seen: Vec<u32>,
    b_stamp: u32,
    flag: Vec<bool>,
    own: Vec<i64>,
    b_marked: Vec<usize>,
    b_x_flag: f64,
    b_a_top: [(f64, usize); 2],
    b_a_host: f64,
    /// e's hosts with their slot counts, and the tokens its copies take (Σ n).
    b_hosts: Vec<(usize, i64)>,
    b_taken: i64,
    b_expert: usize,
    /// Parts of the multi-slot candidates priced since their expert last changed.
    cache: PartCache,
}

impl ExchangeState {
    /// An empty state; [`ExchangeState::reset`] loads an exchange into it.
    pub fn new() -> Self {
        Self::default()
    }

    /// Loads an exchange with no replicas.
    pub fn reset(&mut self, c: &Exchange) {
        let (ep, e_n) = (c.ep(), c.num_experts());
        self.ep = ep;
        self.e_n = e_n;
        self.origin_t.resize(e_n * ep, 0);
        self.total.resize(e_n, 0);
        for e in 0..e_n {
            let mut t = 0;
            for r in 0..ep {
                let x = c.origin[r * e_n + e];
                self.origin_t[e * ep + r] = x;
                t += x;
            }
            self.total[e] = t;
        }
        self.replicas.iter_mut().for_each(Vec::clear);
        self.replicas.resize_with(e_n, Vec::new);
        self.etok.clear();
        self.etok.resize(e_n * ep, 0);
        self.elinks.clear();
        self.elinks.resize(e_n * ep, [0; 4]);
        for v in [&mut self.tok, &mut self.active] {
            v.clear();
            v.resize(ep, 0);
        }
        for v in [&mut self.links, &mut self.hops, &mut self.dhops] {
            v.clear();
            v.resize(ep, [0; 4]);
        }
        self.used.clear();
        self.used.resize(ep, 0);
        self.node.clear();
        self.node.extend((0..ep).map(|r| c.topo.local_node_of(r)));
        let cost = c.cost;
        self.k_tok = [cost.token_bytes / cost.bw_intra, cost.token_bytes / cost.bw_inter];
        self.k_hop = [1.0 / cost.bw_intra, 1.0 / cost.bw_inter];
        if self.scratch_part.tok.len() != ep {
            self.scratch_part = Part::new(ep);
        }
        self.mark.clear();
        self.mark.resize(ep, 0);
        self.pos.clear();
        self.pos.resize(ep, 0);
        self.stamp = 0;
        self.cache.clear(e_n);
        let mut part = std::mem::take(&mut self.scratch_part);
        for e in 0..e_n {
            if self.total[e] == 0 {
                continue;
            }
            match c.expert_slots(e) {
                &[slot] => self.install_unreplicated(e, c.topo.rank_of_slot(slot)),
                _ => {
                    self.part_into(c, e, &[], &mut part);
                    self.install(e, &part);
                }
            }
        }
        self.scratch_part = part;
        self.refresh(c);
    }

    /// Rank p's roofline extra (`CostModel::weights_bound_extra` summed over its active
    /// experts in expert order, as the simulator sums it) with expert e's tokens on p taken as
    /// `e_tok`; 0 for the linear model. O(E), only with a weights-bound floor.
    fn extra(&self, c: &Exchange, p: usize, e: usize, e_tok: i64) -> f64 {
        if !c.cost.roofline() {
            return 0.0;
        }
        let mut x = 0.0;
        for k in 0..self.e_n {
            let t = if k == e { e_tok } else { self.etok[k * self.ep + p] };
            if t > 0 {
                x += c.cost.weights_bound_extra(t as f64);
            }
        }
        x
    }

    /// Rank values from tokens, active experts, the roofline extra, links and hops (one
    /// formula everywhere, so cached and fresh values are bit-identical). A rank's hop time
    /// per byte is its link time and, with `c_replica`, `CostModel::replica_overhead` of every
    /// byte its hops send or receive (as `LinkBytes::replica_time` in the simulator).
    #[inline]
    fn values(&self, c: &Exchange, tok: i64, act: i64, extra: f64, l: &Links, h: &Links) -> (f64, f64, f64) {
        let (kt, kh) = (self.k_tok, self.k_hop);
        let mut hop = h[0].max(h[1]) as f64 * kh[0] + h[2].max(h[3]) as f64 * kh[1];
        if c.cost.c_replica > 0.0 {
            hop += c.cost.replica_overhead((h[0] + h[1] + h[2] + h[3]) as f64);
        }
        (c.cost.rank_expert_time(tok as f64, act as f64, extra), l[0].max(l[1]) as f64 * kt[0] + l[2].max(l[3]) as f64 * kt[1], hop)
    }

    /// Recomputes the cached per-rank values and orders.
    fn refresh(&mut self, c: &Exchange) {
        let ep = self.ep;
        let (mut xv, mut av, mut hv) = (std::mem::take(&mut self.xv), std::mem::take(&mut self.av), std::mem::take(&mut self.hv));
        xv.clear();
        av.clear();
        hv.clear();
        for p in 0..ep {
            let extra = self.extra(c, p, usize::MAX, 0); // no expert replaced
            let (x, a, h) = self.values(c, self.tok[p], self.active[p], extra, &self.links[p], &self.hops[p]);
            xv.push(x);
            av.push(a);
            hv.push(h);
        }
        for (order, v) in [(&mut self.xo, &xv), (&mut self.ao, &av), (&mut self.ho, &hv)] {
            order.clear();
            order.extend(0..ep);
            order.sort_unstable_by(|&a, &b| v[b].total_cmp(&v[a]).then(a.cmp(&b)));
        }
        (self.xv, self.av, self.hv) = (xv, av, hv);
    }

    /// [`ExchangeState::refresh`] after a change: fresh values on every rank, and each order
    /// repaired by re-inserting only the ranks whose value changed (bitwise). The orders are
    /// sorted by a strict total order (value, then index), so the result is the one a full
    /// sort gives; a greedy step changes few ranks, and three sorts of `ep` ranks per
    /// accepted move were a large part of the planner's time at ep = 64.
    fn refresh_changed(&mut self, c: &Exchange) {
        let mut moved = std::mem::take(&mut self.moved);
        moved.iter_mut().for_each(Vec::clear);
        for p in 0..self.ep {
            let extra = self.extra(c, p, usize::MAX, 0); // no expert replaced
            let fresh = self.values(c, self.tok[p], self.active[p], extra, &self.links[p], &self.hops[p]);
            for (k, (new, old)) in
                [fresh.0, fresh.1, fresh.2].into_iter().zip([&mut self.xv[p], &mut self.av[p], &mut self.hv[p]]).enumerate()
            {
                if new.to_bits() != old.to_bits() {
                    *old = new;
                    moved[k].push(p);
                }
            }
        }
        for (k, (order, v)) in [(&mut self.xo, &self.xv), (&mut self.ao, &self.av), (&mut self.ho, &self.hv)].into_iter().enumerate() {
            if !moved[k].is_empty() {
                Self::reinsert(order, v, &moved[k], &mut self.mark, &mut self.stamp);
            }
        }
        self.moved = moved;
    }

    /// Whether the cached values and orders are those a full [`ExchangeState::refresh`] gives.
    #[cfg(test)]
    pub(crate) fn caches_match(&self, c: &Exchange) -> bool {
        let mut fresh = ExchangeState {
            ep: self.ep,
            tok: self.tok.clone(),
            active: self.active.clone(),
            links: self.links.clone(),
            hops: self.hops.clone(),
            k_tok: self.k_tok,
            k_hop: self.k_hop,
            ..ExchangeState::default()
        };
        fresh.refresh(c);
        let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        (bits(&fresh.xv), bits(&fresh.av), bits(&fresh.hv), &fresh.xo, &fresh.ao, &fresh.ho)
            == (bits(&self.xv), bits(&self.av), bits(&self.hv), &self.xo, &self.ao, &self.ho)
    }

    /// Repairs `order` (ranks by `v` descending, index ascending) after the values of the
    /// ranks in `moved` changed: takes them out and inserts each at its place.
    fn reinsert(order: &mut Vec<usize>, v: &[f64], moved: &[usize], mark: &mut [u32], stamp: &mut u32) {
        *stamp = stamp.wrapping_add(1);
        if *stamp == 0 {
            mark.iter_mut().for_each(|m| *m = 0);
            *stamp = 1;
        }
        let st = *stamp;
        for &p in moved {
            mark[p] = st;
        }
        order.retain(|&p| mark[p] != st);
        let before = |a: usize, b: usize| v[b].total_cmp(&v[a]).then(a.cmp(&b));
        for &p in moved {
            let at = order.partition_point(|&q| before(q, p) == std::cmp::Ordering::Less);
            order.insert(at, p);
        }
    }

    /// `[ep]` tokens of expert e sent by each EP-local rank's samples in this exchange.
    #[inline]
    pub fn origin(&self, e: usize) -> &[i64] {
        &self.origin_t[e * self.ep..(e + 1) * self.ep]
    }
    /// Tokens of expert e in this exchange, Σ over EP ranks of [`ExchangeState::origin`]:
    /// the total a replica's share is a fraction of.
    #[inline]
    pub fn total(&self, e: usize) -> i64 {
        self.total[e]
    }
    /// Tokens expert e is computed for on rank p now.
    #[inline]
    pub fn expert_tokens(&self, e: usize, p: usize) -> i64 {
        self.etok[e * self.ep + p]
    }
    /// Whether rank p already holds a copy of e in this exchange.
    pub fn has_copy(&self, e: usize, p: usize) -> bool {
        self.replicas[e].iter().any(|r| r.dst == p)
    }

    /// Adds (sign +1) or removes (-1) the replication chain of (e, src) over `dsts` to `acc`:
    /// src → dsts ordered same-node-first, then by rank (as the simulator chains them).
    fn chain(node: &[usize], src: usize, dsts: &mut Vec<usize>, sign: i64, acc: &mut [Links], touched: &mut Vec<usize>) {
        let home = node[src];
        dsts.sort_unstable_by_key(|&d| (node[d] != home, d));
        dsts.dedup();
        let mut prev = src;
        for &d in dsts.iter() {
            let k = if node[prev] == node[d] { 0 } else { 2 };
            acc[prev][k] += sign;
            acc[d][k + 1] += sign;
            touched.push(prev);
            touched.push(d);
            prev = d;
        }
    }

    /// Hop changes when e's replicas become `reps` (only copies added or removed change chains).
    fn hop_delta(&mut self, e: usize, reps: &[ReplicaShare]) {
        let mut srcs = std::mem::take(&mut self.srcs);
        let mut old = std::mem::take(&mut self.old_dsts);
        let mut new = std::mem::take(&mut self.new_dsts);
        srcs.clear();
        srcs.extend(self.replicas[e].iter().chain(reps).map(|r| r.src));
        srcs.sort_unstable();
        srcs.dedup();
        for &src in &srcs {
            old.clear();
            old.extend(self.replicas[e].iter().filter(|r| r.src == src).map(|r| r.dst));
            new.clear();
            new.extend(reps.iter().filter(|r| r.src == src).map(|r| r.dst));
            old.sort_unstable();
            new.sort_unstable();
            if old == new {
                continue;
            }
            Self::chain(&self.node, src, &mut old, -1, &mut self.dhops, &mut self.touched);
            Self::chain(&self.node, src, &mut new, 1, &mut self.dhops, &mut self.touched);
        }
        self.srcs = srcs;
        self.old_dsts = old;
        self.new_dsts = new;
    }

    fn clear_dhops(&mut self) {
        for &p in &self.touched {
            self.dhops[p] = [0; 4];
        }
        self.touched.clear();
    }

    /// The exchange's time (the simulator's `LayerCost::total`) from the three maxima: the
    /// slowest rank's one-pass expert time, one-way all-to-all link time and hop time per byte.
    fn total_time(c: &Exchange, x_max: f64, a_max: f64, h_max: f64) -> f64 {
        let cost = c.cost;
        let replication = if h_max > 0.0 {
            let fwd = h_max * cost.expert_weight_bytes;
            let bwd = h_max * cost.expert_grad_bytes;
            cost.exposed_replication(fwd, bwd, c.attn_max)
        } else {
            0.0
        };
        LayerCost::new(cost, c.attn_max, x_max, cost.all_to_all_of_link_time(a_max), replication, 0.0).total()
    }

    /// The exchange's time with expert e's part replaced by `part` and the hops changed by
    /// `self.dhops`: fresh values on the ranks that change, cached maxima elsewhere.
    fn time_with(&mut self, c: &Exchange, e: usize, part: &Part) -> f64 {
        let ep = self.ep;
        self.stamp = self.stamp.wrapping_add(1);
        if self.stamp == 0 {
            self.mark.iter_mut().for_each(|m| *m = 0);
            self.stamp = 1;
        }
        let stamp = self.stamp;
        self.changed.clear();
        let base = e * ep;
        for p in 0..ep {
            if part.tok[p] != self.etok[base + p] || part.links[p] != self.elinks[base + p] || self.dhops[p] != [0; 4] {
                self.mark[p] = stamp;
                self.changed.push(p);
            }
        }
        let first = |order: &[usize], v: &[f64]| order.iter().find(|&&p| self.mark[p] != stamp).map_or(0.0, |&p| v[p]);
        let (mut x_max, mut a_max, mut h_max) = (first(&self.xo, &self.xv), first(&self.ao, &self.av), first(&self.ho, &self.hv));
        for &p in &self.changed {
            let i = base + p;
            let (new, old) = (part.tok[p], self.etok[i]);
            let tok = self.tok[p] + new - old;
            let act = self.active[p] + i64::from(new > 0) - i64::from(old > 0);
            let mut l = self.links[p];
            let mut h = self.hops[p];
            for k in 0..4 {
                l[k] += part.links[p][k] - self.elinks[i][k];
                h[k] += self.dhops[p][k];
            }
            let extra = self.extra(c, p, e, new);
            let (x, a, hh) = self.values(c, tok, act, extra, &l, &h);
            x_max = x_max.max(x);
            a_max = a_max.max(a);
            h_max = h_max.max(hh);
        }
        Self::total_time(c, x_max, a_max, h_max)
    }

    /// Rank p's expert time, one pass: c_tok · tokens + c_exp · active experts (+ the
    /// roofline extra, + its kernel call: `CostModel::rank_expert_time`).
    #[inline]
    pub fn expert_time(&self, p: usize) -> f64 {
        self.xv[p]
    }

    /// Rank p's all-to-all time, one pass one direction (max of sent, received per link).
    #[inline]
    pub fn a2a_time(&self, p: usize) -> f64 {
        self.av[p]
    }

    /// The ranks by expert time, largest first (lowest index first among equal times).
    #[inline]
    pub fn expert_order(&self) -> &[usize] {
        &self.xo
    }

    /// The rank with the largest expert time, and the one with the largest all-to-all time
    /// (lowest index on ties).
    pub fn bottlenecks(&self) -> (usize, usize) {
        (self.xo[0], self.ao[0])
    }

    /// The exchange's time now.
    pub fn time(&self, c: &Exchange) -> f64 {
        let top = |order: &[usize], v: &[f64]| order.first().map_or(0.0, |&p| v[p]);
        Self::total_time(c, top(&self.xo, &self.xv), top(&self.ao, &self.av), top(&self.ho, &self.hv))
    }

    /// The exchange's time if expert e's replicas were `reps`.
    pub fn try_replicas(&mut self, c: &Exchange, e: usize, reps: &[ReplicaShare]) -> f64 {
        let mut part = std::mem::take(&mut self.scratch_part);
        self.part_into(c, e, reps, &mut part);
        self.hop_delta(e, reps);
        let t = self.time_with(c, e, &part);
        self.clear_dhops();
        self.scratch_part = part;
        t
    }

    /// Makes `reps` expert e's replicas.
    pub fn set_replicas(&mut self, c: &Exchange, e: usize, reps: Vec<ReplicaShare>) {
        let mut part = std::mem::take(&mut self.scratch_part);
        self.part_into(c, e, &reps, &mut part);
        self.commit(c, e, reps, &part);
        self.scratch_part = part;
    }

    /// Makes `reps` expert e's replicas, `part` their part (from [`Self::part_into`]).
    fn commit(&mut self, c: &Exchange, e: usize, reps: Vec<ReplicaShare>, part: &Part) {
        self.cache.forget(e);
        self.install(e, part);
        self.hop_delta(e, &reps);
        for &p in &self.touched {
            for k in 0..4 {
                self.hops[p][k] += self.dhops[p][k];
            }
            self.dhops[p] = [0; 4];
        }
        // `touched` may list a rank twice; the first visit applied and zeroed its delta
        self.touched.clear();
        for r in &self.replicas[e] {
            self.used[r.dst] -= 1;
        }
        for r in &reps {
            self.used[r.dst] += 1;
        }
        self.replicas[e] = reps;
        self.refresh_changed(c);
        // every test that plans with routepack checks the repaired orders against a full sort
        #[cfg(test)]
        assert!(self.caches_match(c), "incremental rank orders differ from a full refresh");
    }

    /// A replica of e on dst computing n tokens, weights from `src`.
    pub fn make_replica(&self, e: usize, src: usize, dst: usize, n: i64) -> ReplicaShare {
        let t = self.total[e];
        ReplicaShare { dst, src, n, share: if t > 0 { share_for(n.clamp(0, t), t) } else { 0.0 } }
    }

    /// The replicas as the plan table's replicas of this exchange: experts ascending, each
    /// expert's replicas in order.
    pub fn table(&self, c: &Exchange) -> Vec<Replica> {
        self.replicas.iter().enumerate().flat_map(|(e, reps)| reps.iter().map(move |r| c.replica(e, r.src, r.dst, r.share))).collect()
    }
}

#[cfg(test)]
mod tests;
