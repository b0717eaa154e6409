//! The layout objective and its incremental evaluation.
//!
//! Cost of EP group g (an EDP shard) = Σ over its microbatch steps m of
//! * attention: Σ_l 3 · max_{ranks p of g} (a_lin·lin(p,m) + a_quad_l·quad(p,m)), with lin and
//!   quad the Σ n and Σ n² of the samples of rank p at step m (layers grouped by their a_quad,
//!   so this is O(kinds · ep));
//! * per layer l: expert work 3 · max_p (c_tok·tok(p) + c_exp·hosted(p)) plus all-to-all
//!   2·2·token_bytes · max_p (max(sent, received) intra-node / bw_intra + max(sent, received)
//!   inter-node / bw_inter), as `simulate` prices it.
//!
//! Routing is approximated through the placement: each sample's tokens for expert e are split
//! evenly over e's replicas, giving `proj[s, l, p]`, the tokens sample s sends to EP rank p in
//! layer l (rounded to whole tokens, so every sum is exact in f32 whatever the placement: no
//! drift over millions of moves; under the static placement the projection is exact, with
//! replicas it differs from `flow`'s integer split by under a token per sample and rank). For each (group, step, layer) the state keeps,
//! per EP rank p: tokens received `tok`, tokens received from ranks on p's own node `same`,
//! tokens sent `otot`, tokens sent to p's own node `onode`, and tokens p sends to itself `diag`.
//! Then sent_intra = onode − diag, received_intra = same − diag, sent_inter = otot − onode,
//! received_inter = tok − same. Moving a sample touches two (group, step) cells: O(L·ep),
//! one fused pass per layer (`kernel`).
//!
//! The energy the annealer minimises is max_g C_g + λ · mean_g C_g: the slowest shard's
//! accumulated cost (what `simulate`'s step time is), plus a small pull on the other shards
//! so that moves there are not free random walks.

use rayon::prelude::*;

use crate::cost::{CostModel, COMM_PASSES, COMPUTE_PASSES};
use crate::error::{bad_plan, invalid, Result};
use crate::placement::Placement;
use crate::topology::Topology;
use crate::window::WindowView;

use super::kernel::{detect_avx2, gm_apply, gm_cost, Coeffs, GmDelta, Shape, SrcView, ROWS};

/// Per-sample demand projected onto EP ranks, and the cost coefficients. Built once per
/// window, placement and microbatch count; shared read-only by every chain.
pub struct Proxy {
    pub num_samples: usize,
    pub num_layers: usize,
    pub ep: usize,
    pub dp: usize,
    pub groups: usize,
    pub micro: usize,
    /// EP ranks per node inside a group, and nodes per group.
    pub rpn: usize,
    pub nodes: usize,
    pub token_cap: i64,
    pub lens: Vec<i64>,
    pub sq: Vec<i64>,
    /// `[S]` samples in increasing length (ties by index), and each sample's place in it.
    pub by_len: Vec<u32>,
    pub len_rank: Vec<u32>,
    /// `[S, L, ep]` tokens of sample s for EP rank p in layer l.
    pub proj: Vec<f32>,
    /// `[S, L]` Σ_p proj (tokens sample s sends in layer l).
    pub otot: Vec<f32>,
    /// `[S, L, nodes]` Σ over the ranks of each node of proj.
    pub onode: Vec<f32>,
    /// `[L, ep]` 3 · c_exp · experts hosted by rank p (the simulator counts active experts;
    /// with thousands of tokens per microbatch every hosted expert is active).
    pub hexp: Vec<f32>,
    /// Distinct attention kinds: (3 · a_quad, number of layers with it).
    pub kinds: Vec<(f64, f64)>,
    pub att_lin: f64,
    pub ct: f32,
    pub ki: f32,
    pub ke: f32,
    pub lambda: f64,
    /// Zeros laid out like a row of the per-cell table (`Src::Zero`).
    zero: Vec<f32>,
    /// The CPU has AVX2 (the hot loop has a build for it).
    avx2: bool,
}

/// Where a source vector comes from: nothing, one sample, or all samples of a cell (its row
/// of the caller's per-cell table, `[cells, agg_len]`, kept by `Proxy::add_sample`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Src {
    Zero,
    Sample(u32),
    Cell(usize),
}

/// A move as one (group, step) sees it: the demand of `add` minus that of `sub` enters EP
/// rank `ends[i].0` with sign `ends[i].1` (at most two ends), and the step's received tokens
/// change by `tok` (±1) times it, or not at all (0) when the samples stay in the step.
#[derive(Clone, Copy, Debug)]
pub struct Delta {
    pub add: Src,
    pub sub: Src,
    pub tok: f32,
    pub ends: [(usize, f32); 2],
    pub n_ends: usize,
}

impl Delta {
    /// The delta of `add − sub` entering rank p with `sign`, received tokens changing by `tok`.
    pub fn one(add: Src, sub: Src, p: usize, sign: f32, tok: f32) -> Self {
        Self { add, sub, tok, ends: [(p, sign), (0, 0.0)], n_ends: 1 }
    }
    /// `add − sub` moving from rank `from` to rank `to` inside the step.
    pub fn shift(add: Src, sub: Src, from: usize, to: usize) -> Self {
        Self { add, sub, tok: 0.0, ends: [(from, -1.0), (to, 1.0)], n_ends: 2 }
    }
}

/// Per-move scratch: the signed same-node indicator `[ep]` of a delta.
#[derive(Clone, Debug)]
pub struct Scratch {
    cm: Vec<f32>,
}

/// Incremental state of one layout: per (group, step) the rows above, per cell (DP rank d,
/// step m; index d·M + m) Σ n and Σ n², and the costs.
#[derive(Clone, Debug, PartialEq)]
pub struct Shards {
    /// `[G·M, L, ROWS, ep]`
    pub gm: Vec<f32>,
    /// `[dp·M]`
    pub lin: Vec<i64>,
    pub quad: Vec<i64>,
    /// `[G·M]` cost of each (group, step).
    pub gm_cost: Vec<f64>,
    /// `[G]` Σ_m gm_cost.
    pub group_cost: Vec<f64>,
}

impl Proxy {
    /// Checks the inputs against each other and precomputes the projections (O(S·L·E)).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        w: &WindowView,
        topo: &Topology,
        cost: &CostModel,
        placement: &Placement,
        token_cap: i64,
        micro: usize,
        lambda: f64,
    ) -> Result<Self> {
        topo.check_experts(w.num_experts)?;
        cost.check(w.num_layers)?;
        if placement.num_layers != w.num_layers || placement.num_experts != w.num_experts {
            return Err(bad_plan(format!(
                "placement is for L={}, E={} but the window has L={}, E={}",
                placement.num_layers, placement.num_experts, w.num_layers, w.num_experts
            )));
        }
        placement.check_topology(topo)?;
        placement.check()?;
        if micro == 0 {
            return Err(invalid("num_micro", "must be >= 1, got 0"));
        }
        if !(lambda.is_finite() && lambda >= 0.0) {
            return Err(invalid("lambda", format!("must be finite and >= 0, got {lambda}")));
        }
        let (s_n, l_n, ep) = (w.num_samples, w.num_layers, topo.ep);
        let rpn = topo.ranks_per_group_node();
        let nodes = ep / rpn;
        // per layer: the rank of each single-replica expert (u32::MAX if replicated), and the
        // (expert, rank, share) triples of replicated experts, shares on one rank merged
        type Routes = (Vec<u32>, Vec<(usize, usize, f64)>);
        let routes: Vec<Routes> = (0..l_n)
            .map(|l| {
                let (off, slots) = placement.replicas_of_layer(l);
                let mut single = vec![u32::MAX; w.num_experts];
                let mut multi: Vec<(usize, usize, f64)> = Vec::new();
                for e in 0..w.num_experts {
                    let sl = &slots[off[e]..off[e + 1]];
                    if sl.len() == 1 {
                        single[e] = topo.rank_of_slot(sl[0]) as u32;
                        continue;
                    }
                    let start = multi.len();
                    for &slot in sl {
                        let p = topo.rank_of_slot(slot);
                        match multi[start..].iter_mut().find(|x| x.1 == p) {
                            Some(x) => x.2 += 1.0 / sl.len() as f64,
                            None => multi.push((e, p, 1.0 / sl.len() as f64)),
                        }
                    }
                }
                (single, multi)
            })
            .collect();
        let mut proj = vec![0f32; s_n * l_n * ep];
        proj.par_chunks_mut(l_n * ep).enumerate().for_each(|(s, out)| {
            let mut whole = vec![0i64; ep + 1];
            let mut part = vec![0f64; ep];
            for (l, (single, multi)) in routes.iter().enumerate() {
                whole.iter_mut().for_each(|x| *x = 0);
                part.iter_mut().for_each(|x| *x = 0.0);
                let x = w.tokens(s, l);
                // replicated experts land in the spare entry `ep` here and are split below
                for (&r, &n) in single.iter().zip(x) {
                    whole[(r as usize).min(ep)] += n as i64;
                }
                for &(e, p, sh) in multi {
                    part[p] += x[e] as f64 * sh;
                }
                for p in 0..ep {
                    out[l * ep + p] = (whole[p] as f64 + part[p]).round() as f32;
                }
            }
        });
        let mut otot = vec![0f32; s_n * l_n];
        let mut onode = vec![0f32; s_n * l_n * nodes];
        for sl in 0..s_n * l_n {
            let row = &proj[sl * ep..(sl + 1) * ep];
            otot[sl] = row.iter().sum();
            for nd in 0..nodes {
                onode[sl * nodes + nd] = row[nd * rpn..(nd + 1) * rpn].iter().sum();
            }
        }
        let mut hexp = vec![0f32; l_n * ep];
        for l in 0..l_n {
            let layer = placement.layer(l);
            for p in 0..ep {
                let mut hosted: Vec<i32> =
                    layer[p * topo.slots_per_rank..(p + 1) * topo.slots_per_rank].iter().copied().filter(|&e| e >= 0).collect();
                hosted.sort_unstable();
                hosted.dedup();
                hexp[l * ep + p] = (COMPUTE_PASSES * cost.c_exp * hosted.len() as f64) as f32;
            }
        }
        let mut kinds: Vec<(f64, f64)> = Vec::new();
        for &q in &cost.a_quad {
            let q3 = COMPUTE_PASSES * q;
            match kinds.iter_mut().find(|k| k.0 == q3) {
                Some(k) => k.1 += 1.0,
                None => kinds.push((q3, 1.0)),
            }
        }
        let a2a = 2.0 * COMM_PASSES * cost.token_bytes;
        let mut by_len: Vec<u32> = (0..s_n as u32).collect();
        by_len.sort_by_key(|&s| (w.seq_lens[s as usize], s));
        let mut len_rank = vec![0u32; s_n];
        for (i, &s) in by_len.iter().enumerate() {
            len_rank[s as usize] = i as u32;
        }
        Ok(Self {
            num_samples: s_n,
            num_layers: l_n,
            ep,
            dp: topo.dp,
            groups: topo.num_groups(),
            micro,
            rpn,
            nodes,
            token_cap,
            lens: w.seq_lens.to_vec(),
            sq: w.seq_lens.iter().map(|&n| n * n).collect(),
            by_len,
            len_rank,
            proj,
            otot,
            onode,
            hexp,
            kinds,
            att_lin: COMPUTE_PASSES * cost.a_lin,
            ct: (COMPUTE_PASSES * cost.c_tok) as f32,
            ki: (a2a / cost.bw_intra) as f32,
            ke: (a2a / cost.bw_inter) as f32,
            lambda,
            zero: vec![0.0; l_n * (ep + 1 + nodes)],
            avx2: detect_avx2(),
        })
    }

    #[inline]
    pub fn cells(&self) -> usize {
        self.dp * self.micro
    }
    /// (group, step) index of cell c = d·M + m.
    #[inline]
    pub fn gm_of(&self, cell: usize) -> usize {
        let (d, m) = (cell / self.micro, cell % self.micro);
        (d / self.ep) * self.micro + m
    }
    /// EP-local rank of cell c.
    #[inline]
    pub fn rank_of(&self, cell: usize) -> usize {
        (cell / self.micro) % self.ep
    }
    #[inline]
    fn block(&self) -> usize {
        self.num_layers * ROWS * self.ep
    }
    /// Size of one cell's row of the per-cell table: proj `[L, ep]`, otot `[L]`, onode
    /// `[L, nodes]`.
    #[inline]
    pub fn agg_len(&self) -> usize {
        self.num_layers * (self.ep + 1 + self.nodes)
    }

    /// Adds (`sign` = 1) or removes (−1) sample s's demand to/from a per-cell row `[agg_len]`.
    /// Values are whole numbers, so the row always equals the sum over the cell's samples.
    pub fn add_sample(&self, row: &mut [f32], s: usize, sign: f32) {
        let (l_n, ep, nd) = (self.num_layers, self.ep, self.nodes);
        let (pr, rest) = row.split_at_mut(l_n * ep);
        let (ot, on) = rest.split_at_mut(l_n);
        for (x, &y) in pr.iter_mut().zip(&self.proj[s * l_n * ep..(s + 1) * l_n * ep]) {
            *x += sign * y;
        }
        for (x, &y) in ot.iter_mut().zip(&self.otot[s * l_n..(s + 1) * l_n]) {
            *x += sign * y;
        }
        for (x, &y) in on.iter_mut().zip(&self.onode[s * l_n * nd..(s + 1) * l_n * nd]) {
            *x += sign * y;
        }
    }

    /// The per-cell table `[cells, agg_len]` of a layout.
    pub fn cell_table(&self, cell_of: &[u32]) -> Vec<f32> {
        let len = self.agg_len();
        let mut t = vec![0f32; self.cells() * len];
        for (s, &c) in cell_of.iter().enumerate() {
            let c = c as usize;
            self.add_sample(&mut t[c * len..(c + 1) * len], s, 1.0);
        }
        t
    }

    /// (Σ n, Σ n²) of a source.
    #[inline]
    fn lin_quad(&self, src: Src, sh: &Shards) -> (i64, i64) {
        match src {
            Src::Zero => (0, 0),
            Src::Sample(s) => (self.lens[s as usize], self.sq[s as usize]),
            Src::Cell(c) => (sh.lin[c], sh.quad[c]),
        }
    }

    /// A source's demand as the kernel reads it.
    #[inline]
    fn view<'a>(&'a self, src: Src, agg: &'a [f32]) -> SrcView<'a> {
        let (l_n, ep, nd) = (self.num_layers, self.ep, self.nodes);
        let slot = |a: &'a [f32]| SrcView { proj: &a[..l_n * ep], otot: &a[l_n * ep..l_n * ep + l_n], onode: &a[l_n * (ep + 1)..l_n * (ep + 1 + nd)] };
        match src {
            Src::Zero => slot(&self.zero),
            Src::Sample(s) => {
                let s = s as usize;
                SrcView {
                    proj: &self.proj[s * l_n * ep..(s + 1) * l_n * ep],
                    otot: &self.otot[s * l_n..(s + 1) * l_n],
                    onode: &self.onode[s * l_n * nd..(s + 1) * l_n * nd],
                }
            }
            Src::Cell(c) => slot(&agg[c * self.agg_len()..(c + 1) * self.agg_len()]),
        }
    }

    /// Scratch for `eval_gm`/`apply_gm`.
    pub fn scratch(&self) -> Scratch {
        Scratch { cm: vec![0.0; self.ep] }
    }

    #[inline]
    fn shape(&self) -> Shape {
        Shape { layers: self.num_layers, ep: self.ep, nodes: self.nodes }
    }

    #[inline]
    fn coeffs(&self) -> Coeffs {
        Coeffs { ct: self.ct, ki: self.ki, ke: self.ke }
    }

    /// The kernel's view of `d` for one (group, step); fills the scratch vector.
    fn gm_delta<'a>(&'a self, d: &Delta, agg: &'a [f32], sc: &'a mut Scratch) -> GmDelta<'a> {
        sc.cm.iter_mut().for_each(|x| *x = 0.0);
        for &(p, sign) in &d.ends[..d.n_ends] {
            let node = p / self.rpn;
            sc.cm[node * self.rpn..(node + 1) * self.rpn].iter_mut().for_each(|x| *x += sign);
        }
        GmDelta { add: self.view(d.add, agg), sub: self.view(d.sub, agg), cm: &sc.cm, ts: d.tok, ends: d.ends, n_ends: d.n_ends }
    }

    /// Cost of (group, step) `gm` after `d`. The state is unchanged afterwards (it is
    /// borrowed mutably because the kernel patches and restores the end ranks in place).
    pub fn eval_gm(&self, sh: &mut Shards, gm: usize, d: &Delta, agg: &[f32], sc: &mut Scratch) -> f64 {
        let att = self.attention(sh, gm, d);
        let block = self.block();
        let gd = self.gm_delta(d, agg, sc);
        att + gm_cost(&mut sh.gm[gm * block..(gm + 1) * block], &self.hexp, &gd, self.coeffs(), self.shape(), self.avx2)
    }

    /// Applies `d` to `gm`'s rows with the same arithmetic as `eval_gm` (so the state is what
    /// was evaluated, bit for bit) and records `cost`. Σ n and Σ n² of cells are the caller's.
    pub fn apply_gm(&self, sh: &mut Shards, gm: usize, d: &Delta, agg: &[f32], cost: f64, sc: &mut Scratch) {
        let block = self.block();
        let gd = self.gm_delta(d, agg, sc);
        gm_apply(&mut sh.gm[gm * block..(gm + 1) * block], &self.hexp, &gd, self.coeffs(), self.shape(), self.avx2);
        sh.gm_cost[gm] = cost;
        let g = gm / self.micro;
        sh.group_cost[g] = sh.gm_cost[g * self.micro..(g + 1) * self.micro].iter().sum();
    }

    /// Attention part of a (group, step)'s cost after `d`: Σ_kinds count · max_p.
    fn attention(&self, sh: &Shards, gm: usize, d: &Delta) -> f64 {
        let (ep, m_n) = (self.ep, self.micro);
        let (g, m) = (gm / m_n, gm % m_n);
        let (la, qa) = self.lin_quad(d.add, sh);
        let (ls, qs) = self.lin_quad(d.sub, sh);
        let ends = &d.ends[..d.n_ends];
        let mut cost = 0.0f64;
        for &(q3, count) in &self.kinds {
            let mut peak = 0.0f64;
            for p in 0..ep {
                let c = (g * ep + p) * m_n + m;
                let (mut lin, mut quad) = (sh.lin[c], sh.quad[c]);
                for &(e, sign) in ends {
                    if e == p {
                        let k = sign as i64;
                        lin += k * (la - ls);
                        quad += k * (qa - qs);
                    }
                }
                peak = peak.max(self.att_lin * lin as f64 + q3 * quad as f64);
            }
            cost += count * peak;
        }
        cost
    }

    /// State of a layout from scratch. `cell_of[s]` = d·M + m.
    pub fn build(&self, cell_of: &[u32]) -> Shards {
        let m_n = self.micro;
        let gms = self.groups * m_n;
        let mut sh = Shards {
            gm: vec![0.0; gms * self.block()],
            lin: vec![0; self.cells()],
            quad: vec![0; self.cells()],
            gm_cost: vec![0.0; gms],
            group_cost: vec![0.0; self.groups],
        };
        let mut sc = self.scratch();
        for (s, &c) in cell_of.iter().enumerate() {
            let c = c as usize;
            let d = Delta::one(Src::Sample(s as u32), Src::Zero, self.rank_of(c), 1.0, 1.0);
            self.apply_gm(&mut sh, self.gm_of(c), &d, &[], 0.0, &mut sc);
            sh.lin[c] += self.lens[s];
            sh.quad[c] += self.sq[s];
        }
        for gm in 0..gms {
            let none = Delta { add: Src::Zero, sub: Src::Zero, tok: 0.0, ends: [(0, 0.0); 2], n_ends: 0 };
            sh.gm_cost[gm] = self.eval_gm(&mut sh, gm, &none, &[], &mut sc);
        }
        for g in 0..self.groups {
            sh.group_cost[g] = sh.gm_cost[g * m_n..(g + 1) * m_n].iter().sum();
        }
        sh
    }

    /// max_g C_g: the proxy's step time.
    pub fn step_time(&self, sh: &Shards) -> f64 {
        sh.group_cost.iter().copied().fold(0.0, f64::max)
    }

    /// The annealer's energy: max_g C_g + λ · mean_g C_g.
    pub fn energy(&self, group_cost: &[f64]) -> f64 {
        let max = group_cost.iter().copied().fold(0.0, f64::max);
        let mean = group_cost.iter().sum::<f64>() / group_cost.len() as f64;
        max + self.lambda * mean
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::static_placement;
    use crate::plan::Plan;
    use crate::simulate::simulate;

    /// A small window with skewed expert demand.
    pub(crate) fn window(s_n: usize, l_n: usize, e_n: usize, seed: u64) -> (Vec<i64>, Vec<i32>) {
        use rand::{RngExt, SeedableRng};
        let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(seed);
        let lens: Vec<i64> = (0..s_n).map(|_| rng.random_range(50..900i64)).collect();
        let mut tok = vec![0i32; s_n * l_n * e_n];
        for s in 0..s_n {
            for l in 0..l_n {
                for _ in 0..lens[s] * 2 {
                    let e = (rng.random_range(0..e_n * e_n) as f64).sqrt() as usize;
                    tok[(s * l_n + l) * e_n + e] += 1;
                }
            }
        }
        (lens, tok)
    }

    #[test]
    fn proxy_matches_simulate_under_static_placement() {
        let (s_n, l_n, e_n) = (48, 4, 16);
        let (lens, tok) = window(s_n, l_n, e_n, 3);
        let w = WindowView::new(&lens, &tok, l_n, e_n).unwrap();
        let topo = Topology::new(8, 4, 2, 4).unwrap();
        let cost = CostModel::for_tests(l_n);
        let pl = static_placement(l_n, e_n, &topo).unwrap();
        let m_n = 3;
        let px = Proxy::new(&w, &topo, &cost, &pl, 4000, m_n, 0.0).unwrap();
        let cell_of: Vec<u32> = (0..s_n as u32).map(|s| s % (8 * m_n as u32)).collect();
        let sh = px.build(&cell_of);
        let plan = Plan {
            placement: pl,
            sample_rank: cell_of.iter().map(|&c| (c as usize / m_n) as i32).collect(),
            sample_micro: cell_of.iter().map(|&c| (c as usize % m_n) as i32).collect(),
            num_micro: m_n,
            replicas: vec![],
            migration: vec![],
        };
        let rep = simulate(&plan, &w, &topo, &cost, None).unwrap();
        for g in 0..2 {
            let rel = (sh.group_cost[g] - rep.group_times[g]).abs() / rep.group_times[g];
            assert!(rel < 1e-5, "group {g}: proxy {} vs simulate {}", sh.group_cost[g], rep.group_times[g]);
        }
    }

    #[test]
    fn incremental_evaluation_equals_rebuild() {
        let (s_n, l_n, e_n) = (40, 3, 8);
        let (lens, tok) = window(s_n, l_n, e_n, 5);
        let w = WindowView::new(&lens, &tok, l_n, e_n).unwrap();
        let topo = Topology::new(4, 2, 1, 5).unwrap();
        let cost = CostModel::for_tests(l_n);
        let pl = static_placement(l_n, e_n, &topo).unwrap();
        let px = Proxy::new(&w, &topo, &cost, &pl, 100_000, 2, 0.1).unwrap();
        let mut cell_of: Vec<u32> = (0..s_n as u32).map(|s| s % 8).collect();
        let mut sh = px.build(&cell_of);
        // move sample 0 from cell 0 (rank 0, step 0) to cell 7 (rank 3, step 1): another group
        let mut sc = px.scratch();
        let (ga, gb) = (px.gm_of(0), px.gm_of(7));
        let da = Delta::one(Src::Sample(0), Src::Zero, 0, -1.0, -1.0);
        let db = Delta::one(Src::Sample(0), Src::Zero, 1, 1.0, 1.0);
        let ca = px.eval_gm(&mut sh, ga, &da, &[], &mut sc);
        let cb = px.eval_gm(&mut sh, gb, &db, &[], &mut sc);
        let mut inc = sh.clone();
        px.apply_gm(&mut inc, ga, &da, &[], ca, &mut sc);
        px.apply_gm(&mut inc, gb, &db, &[], cb, &mut sc);
        cell_of[0] = 7;
        let fresh = px.build(&cell_of);
        assert_eq!(fresh.gm, inc.gm);
        assert!((fresh.gm_cost[ga] - ca).abs() <= 1e-12 * ca.abs().max(1.0));
        assert!((fresh.gm_cost[gb] - cb).abs() <= 1e-12 * cb.abs().max(1.0));
    }
}
