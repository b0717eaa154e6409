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
//! evenly over e's replicas, giving proj[s, l, p], the tokens sample s sends to EP rank p in
//! layer l (rounded to whole tokens, so every sum is exact in f32 whatever the placement: no
//! drift over millions of moves; under the static placement the projection is exact, with
//! replicas it differs from `flow`'s integer split by under a token per sample and rank). A
//! sample's "demand row" holds proj, its sum over ranks (otot) and its sums over each node's
//! ranks (onode), blocked by eight layers as `kernel::Shape` lays them out; a cell's demand
//! row is the sum of its samples' rows. For each (group, step, layer) the state keeps, per EP
//! rank p, tokens received, and tokens received and sent within p's node and across nodes
//! (`kernel` has the rows and their updates). Moving a sample touches two (group, step)
//! cells: O(L·ep), one pass each. Attention keeps the three largest rank values per (group, step)
//! and kind, so a move prices it in O(kinds) (only its end ranks change).
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

use super::kernel::{detect_avx2, gm_apply, gm_apply_pair, gm_cost, gm_cost_pair, Coeffs, Hosted, Rows, Shape, StepDelta, LANES};

/// Rank values kept per (group, step, attention kind): the largest three.
const TOP: usize = 3;

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
    /// `[dp·M]` (group, step) and EP rank of each cell.
    cell_gm: Vec<u32>,
    cell_rank: Vec<u32>,
    /// `[S]` samples in increasing length (ties by index), and each sample's place in it.
    pub by_len: Vec<u32>,
    pub len_rank: Vec<u32>,
    /// Where values live in demand rows and state (layers blocked by eight).
    pub shape: Shape,
    /// The demand row of each sample (see the module comment).
    pub demand: SampleRows,
    /// `[chunks, ep, 8]` 3 · c_exp · experts hosted by rank p in layer l (the simulator counts
    /// active experts; with thousands of tokens per microbatch every hosted expert is active).
    pub hexp: Vec<f32>,
    /// `[chunks · 8]` hexp of each layer when every rank of the layer has the same.
    pub hexp_layer: Option<Vec<f32>>,
    /// Distinct attention kinds: (3 · a_quad, number of layers with it).
    pub kinds: Vec<(f64, f64)>,
    pub att_lin: f64,
    pub ct: f32,
    pub ki: f32,
    pub ke: f32,
    pub lambda: f64,
    /// The CPU has AVX2 (the hot loop has a build for it).
    avx2: bool,
}

/// The samples' demand rows: `[S, row_len]` f32, or, when every proj value fits in 16 bits
/// (tokens one sample sends one rank in one layer: almost always), proj `[S, proj_len]` in
/// u16 and the tails (otot, onode) `[S, row_len − proj_len]` in f32. The annealer streams
/// random samples' rows from a table of tens of MiB; half the bytes is a faster move.
pub enum SampleRows {
    F32(Vec<f32>),
    U16 { proj: Vec<u16>, tail: Vec<f32> },
}

impl SampleRows {
    /// Compact rows of `full` (`[S, row_len]`) when they fit, else `full` itself.
    fn new(full: Vec<f32>, shape: Shape) -> Self {
        let (len, pl) = (shape.row_len(), shape.proj_len());
        if full.chunks_exact(len).any(|r| r[..pl].iter().any(|&x| x > u16::MAX as f32)) {
            return SampleRows::F32(full);
        }
        let proj = full.chunks_exact(len).flat_map(|r| r[..pl].iter().map(|&x| x as u16)).collect();
        let tail = full.chunks_exact(len).flat_map(|r| r[pl..].iter().copied()).collect();
        SampleRows::U16 { proj, tail }
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        match self {
            SampleRows::F32(x) => x.len() * 4,
            SampleRows::U16 { proj, tail } => proj.len() * 2 + tail.len() * 4,
        }
    }

    /// Sample s's row.
    #[inline]
    fn row(&self, s: usize, shape: Shape) -> Rows<'_> {
        let (len, pl) = (shape.row_len(), shape.proj_len());
        match self {
            SampleRows::F32(x) => Rows::F32(&x[s * len..(s + 1) * len]),
            SampleRows::U16 { proj, tail } => Rows::U16 { proj: &proj[s * pl..(s + 1) * pl], tail: &tail[s * (len - pl)..(s + 1) * (len - pl)] },
        }
    }
}

/// Where a source vector comes from: nothing, one sample, or all samples of a cell (its row
/// of the caller's per-cell table, `[cells, row_len]`, kept by `Proxy::add_sample`).
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
    /// No change (prices the state as it is).
    pub fn none() -> Self {
        Self { add: Src::Zero, sub: Src::Zero, tok: 0.0, ends: [(0, 0.0); 2], n_ends: 0 }
    }
}

/// Incremental state of one layout: per (group, step) the rows above, per cell (DP rank d,
/// step m; index d·M + m) Σ n and Σ n², and the costs.
#[derive(Clone, Debug, PartialEq)]
pub struct Shards {
    /// `[G·M, state_len]` (`kernel::Shape::state_at`)
    pub gm: Vec<f32>,
    /// `[dp·M]`
    pub lin: Vec<i64>,
    pub quad: Vec<i64>,
    /// `[G·M, kinds, 3]` the three largest attention values of the step's ranks (value,
    /// rank), largest first; missing entries are (0, u32::MAX).
    pub att_top: Vec<[(f64, u32); TOP]>,
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
        let shape = Shape::new(l_n, ep, nodes);
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
        let row_len = shape.row_len();
        let mut demand = vec![0f32; s_n * row_len];
        demand.par_chunks_mut(row_len).enumerate().for_each(|(s, out)| {
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
                let (mut sent, mut node_sent) = (0f32, 0f32);
                for p in 0..ep {
                    let v = (whole[p] as f64 + part[p]).round() as f32;
                    out[shape.proj_at(l, p)] = v;
                    sent += v;
                    node_sent += v;
                    if (p + 1) % rpn == 0 {
                        out[shape.onode_at(l, p / rpn)] = node_sent;
                        node_sent = 0.0;
                    }
                }
                out[shape.otot_at(l)] = sent;
            }
        });
        let mut hexp = vec![0f32; shape.hexp_len()];
        for l in 0..l_n {
            let layer = placement.layer(l);
            for p in 0..ep {
                let mut hosted: Vec<i32> =
                    layer[p * topo.slots_per_rank..(p + 1) * topo.slots_per_rank].iter().copied().filter(|&e| e >= 0).collect();
                hosted.sort_unstable();
                hosted.dedup();
                hexp[shape.proj_at(l, p)] = (COMPUTE_PASSES * cost.c_exp * hosted.len() as f64) as f32;
            }
        }
        let mut hexp_layer = vec![0f32; shape.chunks * LANES];
        for (l, h) in hexp_layer.iter_mut().enumerate().take(l_n) {
            *h = hexp[shape.proj_at(l, 0)];
        }
        let uniform = (0..l_n).all(|l| (0..ep).all(|p| hexp[shape.proj_at(l, p)] == hexp_layer[l]));
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
        let cells = topo.dp * micro;
        let cell_gm = (0..cells).map(|c| ((c / micro / ep) * micro + c % micro) as u32).collect();
        let cell_rank = (0..cells).map(|c| ((c / micro) % ep) as u32).collect();
        Ok(Self {
            cell_gm,
            cell_rank,
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
            shape,
            demand: SampleRows::new(demand, shape),
            hexp,
            hexp_layer: uniform.then_some(hexp_layer),
            kinds,
            att_lin: COMPUTE_PASSES * cost.a_lin,
            ct: (COMPUTE_PASSES * cost.c_tok) as f32,
            ki: (a2a / cost.bw_intra) as f32,
            ke: (a2a / cost.bw_inter) as f32,
            lambda,
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
        self.cell_gm[cell] as usize
    }
    /// EP-local rank of cell c.
    #[inline]
    pub fn rank_of(&self, cell: usize) -> usize {
        self.cell_rank[cell] as usize
    }
    /// Length of a demand row (a sample's or a cell's).
    #[inline]
    pub fn row_len(&self) -> usize {
        self.shape.row_len()
    }
    /// Tokens sample s sends in layer l.
    #[inline]
    pub fn sent(&self, s: usize, l: usize) -> f32 {
        match self.demand.row(s, self.shape) {
            Rows::F32(r) => r[self.shape.otot_at(l)],
            Rows::U16 { tail, .. } => tail[self.shape.otot_at(l) - self.shape.proj_len()],
        }
    }

    /// Adds (`sign` = 1) or removes (−1) sample s's demand row to/from `row`. Values are
    /// whole numbers, so the row always equals the sum over the cell's samples.
    pub fn add_sample(&self, row: &mut [f32], s: usize, sign: f32) {
        match self.demand.row(s, self.shape) {
            Rows::F32(r) => {
                for (x, &y) in row.iter_mut().zip(r) {
                    *x += sign * y;
                }
            }
            Rows::U16 { proj, tail } => {
                let (rp, rt) = row.split_at_mut(proj.len());
                for (x, &y) in rp.iter_mut().zip(proj) {
                    *x += sign * y as f32;
                }
                for (x, &y) in rt.iter_mut().zip(tail) {
                    *x += sign * y;
                }
            }
        }
    }

    /// `row_a` loses sample s and gains t, `row_b` the other way round: one pass over each
    /// row (the values are whole numbers, so this is exactly four `add_sample`s).
    pub fn swap_samples(&self, row_a: &mut [f32], row_b: &mut [f32], s: usize, t: usize) {
        let swap = |x: &mut f32, y: &mut f32, vs: f32, vt: f32| {
            let d = vt - vs;
            *x += d;
            *y -= d;
        };
        match (self.demand.row(s, self.shape), self.demand.row(t, self.shape)) {
            (Rows::F32(rs), Rows::F32(rt)) => {
                for (((x, y), &vs), &vt) in row_a.iter_mut().zip(row_b.iter_mut()).zip(rs).zip(rt) {
                    swap(x, y, vs, vt);
                }
            }
            (Rows::U16 { proj: ps, tail: ts }, Rows::U16 { proj: pt, tail: tt }) => {
                let pl = ps.len();
                let (pa, ta) = row_a.split_at_mut(pl);
                let (pb, tb) = row_b.split_at_mut(pl);
                for (((x, y), &vs), &vt) in pa.iter_mut().zip(pb.iter_mut()).zip(ps).zip(pt) {
                    swap(x, y, vs as f32, vt as f32);
                }
                for (((x, y), &vs), &vt) in ta.iter_mut().zip(tb.iter_mut()).zip(ts).zip(tt) {
                    swap(x, y, vs, vt);
                }
            }
            _ => unreachable!("all samples' rows are of one kind"),
        }
    }

    /// The per-cell table `[cells, row_len]` of a layout.
    pub fn cell_table(&self, cell_of: &[u32]) -> Vec<f32> {
        let len = self.row_len();
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

    /// A source's demand row (None: zeros).
    #[inline]
    fn row<'a>(&'a self, src: Src, cells: &'a [f32]) -> Option<Rows<'a>> {
        let len = self.row_len();
        match src {
            Src::Zero => None,
            Src::Sample(s) => Some(self.demand.row(s as usize, self.shape)),
            Src::Cell(c) => Some(Rows::F32(&cells[c * len..(c + 1) * len])),
        }
    }

    #[inline]
    fn coeffs(&self) -> Coeffs {
        Coeffs { ct: self.ct, ki: self.ki, ke: self.ke }
    }

    #[inline]
    fn hosted(&self) -> Hosted<'_> {
        Hosted { per_rank: &self.hexp, per_layer: self.hexp_layer.as_deref() }
    }

    #[inline]
    fn step_delta<'a>(&'a self, d: &Delta, cells: &'a [f32]) -> StepDelta<'a> {
        StepDelta { add: self.row(d.add, cells), sub: self.row(d.sub, cells), ts: d.tok, ends: d.ends, n_ends: d.n_ends }
    }

    /// Cost of (group, step) `gm` after `d` (`cells`: the per-cell table, read by cell
    /// sources). The state is not changed.
    pub fn eval_gm(&self, sh: &Shards, gm: usize, d: &Delta, cells: &[f32]) -> f64 {
        let len = self.shape.state_len();
        let att = self.attention(sh, gm, d);
        att + gm_cost(&sh.gm[gm * len..(gm + 1) * len], &self.hosted(), &self.step_delta(d, cells), self.coeffs(), self.shape, self.avx2)
    }

    /// `eval_gm` of a move between two different (group, step)s, `da` on `gm_a` and `db` on
    /// `gm_b` (the same sources), in one pass over the sources.
    #[allow(clippy::too_many_arguments)]
    pub fn eval_pair(&self, sh: &Shards, gm_a: usize, da: &Delta, gm_b: usize, db: &Delta, cells: &[f32]) -> (f64, f64) {
        debug_assert!(gm_a != gm_b && da.add == db.add && da.sub == db.sub);
        let len = self.shape.state_len();
        let (x, y) = gm_cost_pair(
            &sh.gm[gm_a * len..(gm_a + 1) * len],
            &sh.gm[gm_b * len..(gm_b + 1) * len],
            &self.hosted(),
            &self.step_delta(da, cells),
            &self.step_delta(db, cells),
            self.coeffs(),
            self.shape,
            self.avx2,
        );
        (self.attention(sh, gm_a, da) + x, self.attention(sh, gm_b, db) + y)
    }

    /// `apply_gm` of a move between two different (group, step)s (see `eval_pair`).
    #[allow(clippy::too_many_arguments)]
    pub fn apply_pair(&self, sh: &mut Shards, gm_a: usize, da: &Delta, gm_b: usize, db: &Delta, cells: &[f32], costs: (f64, f64)) {
        debug_assert!(gm_a != gm_b && da.add == db.add && da.sub == db.sub);
        let len = self.shape.state_len();
        let (lo, hi) = (gm_a.min(gm_b), gm_a.max(gm_b));
        let (head, tail) = sh.gm.split_at_mut(hi * len);
        let (rows_lo, rows_hi) = (&mut head[lo * len..(lo + 1) * len], &mut tail[..len]);
        let (rows_a, rows_b) = if gm_a < gm_b { (rows_lo, rows_hi) } else { (rows_hi, rows_lo) };
        let (sa, sb) = (self.step_delta(da, cells), self.step_delta(db, cells));
        gm_apply_pair(rows_a, rows_b, &self.hosted(), &sa, &sb, self.coeffs(), self.shape, self.avx2);
        self.record(sh, gm_a, da, costs.0);
        self.record(sh, gm_b, db, costs.1);
    }

    /// After `d` was applied to `gm`'s rows: its attention ranking, cost and group total.
    fn record(&self, sh: &mut Shards, gm: usize, d: &Delta, cost: f64) {
        self.update_attention(sh, gm, &d.ends[..d.n_ends]);
        sh.gm_cost[gm] = cost;
        let g = gm / self.micro;
        sh.group_cost[g] = sh.gm_cost[g * self.micro..(g + 1) * self.micro].iter().sum();
    }

    /// Applies `d` to `gm`'s rows with the same arithmetic as `eval_gm` (so the state is what
    /// was evaluated, bit for bit) and records `cost`. The caller updates Σ n and Σ n² of the
    /// cells first (the attention ranking is refreshed from them).
    pub fn apply_gm(&self, sh: &mut Shards, gm: usize, d: &Delta, cells: &[f32], cost: f64) {
        let len = self.shape.state_len();
        gm_apply(&mut sh.gm[gm * len..(gm + 1) * len], &self.hosted(), &self.step_delta(d, cells), self.coeffs(), self.shape, self.avx2);
        self.record(sh, gm, d, cost);
    }

    /// Cell of EP rank p in (group, step) gm.
    #[inline]
    fn cell_at(&self, gm: usize, p: usize) -> usize {
        let (g, m) = (gm / self.micro, gm % self.micro);
        (g * self.ep + p) * self.micro + m
    }

    /// Recomputes the three largest attention values per kind of (group, step) gm.
    fn rank_attention(&self, sh: &mut Shards, gm: usize) {
        for k in 0..self.kinds.len() {
            self.rank_kind(sh, gm, k);
        }
    }

    /// The attention value of EP rank p of (group, step) gm for kind k.
    #[inline]
    fn att_value(&self, sh: &Shards, gm: usize, k: usize, p: usize) -> f64 {
        let c = self.cell_at(gm, p);
        self.att_lin * sh.lin[c] as f64 + self.kinds[k].0 * sh.quad[c] as f64
    }

    /// `rank_attention` for one kind: the three best ranks by (value descending, rank
    /// ascending); missing entries are (0, u32::MAX).
    fn rank_kind(&self, sh: &mut Shards, gm: usize, k: usize) {
        let mut top = [(f64::NEG_INFINITY, u32::MAX); TOP];
        for p in 0..self.ep {
            let v = self.att_value(sh, gm, k, p);
            if v > top[TOP - 1].0 {
                let mut i = TOP - 1;
                while i > 0 && v > top[i - 1].0 {
                    top[i] = top[i - 1];
                    i -= 1;
                }
                top[i] = (v, p as u32);
            }
        }
        for t in top.iter_mut().filter(|t| t.1 == u32::MAX) {
            t.0 = 0.0;
        }
        sh.att_top[gm * self.kinds.len() + k] = top;
    }

    /// `rank_attention` after only the ranks of `ends` changed: a kind whose three best hold
    /// none of them only takes the changed ranks in where they now rank (the same order a
    /// full ranking gives); otherwise it is ranked again.
    fn update_attention(&self, sh: &mut Shards, gm: usize, ends: &[(usize, f32)]) {
        let k_n = self.kinds.len();
        for k in 0..k_n {
            let idx = gm * k_n + k;
            if sh.att_top[idx].iter().any(|t| ends.iter().any(|e| e.0 as u32 == t.1)) || sh.att_top[idx][TOP - 1].1 == u32::MAX {
                self.rank_kind(sh, gm, k);
                continue;
            }
            for &(p, _) in ends {
                let v = (self.att_value(sh, gm, k, p), p as u32);
                let top = &mut sh.att_top[idx];
                let better = |a: (f64, u32), b: (f64, u32)| a.0 > b.0 || (a.0 == b.0 && a.1 < b.1);
                if better(v, top[TOP - 1]) {
                    let mut i = TOP - 1;
                    while i > 0 && better(v, top[i - 1]) {
                        top[i] = top[i - 1];
                        i -= 1;
                    }
                    top[i] = v;
                }
            }
        }
    }

    /// Attention part of a (group, step)'s cost after `d`: Σ_kinds count · max_p. Only the
    /// end ranks change, so the peak is the largest value of a rank that is not an end
    /// (from the ranking) or an end's new value.
    fn attention(&self, sh: &Shards, gm: usize, d: &Delta) -> f64 {
        let (la, qa) = self.lin_quad(d.add, sh);
        let (ls, qs) = self.lin_quad(d.sub, sh);
        let ends = &d.ends[..d.n_ends];
        let k_n = self.kinds.len();
        let mut cost = 0.0f64;
        for (k, &(q3, count)) in self.kinds.iter().enumerate() {
            let top = &sh.att_top[gm * k_n + k];
            let mut peak = top.iter().find(|t| !ends.iter().any(|e| e.0 as u32 == t.1)).map_or(0.0, |t| t.0);
            for &(p, sign) in ends {
                let c = self.cell_at(gm, p);
                let s = sign as i64;
                let (lin, quad) = (sh.lin[c] + s * (la - ls), sh.quad[c] + s * (qa - qs));
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
            gm: vec![0.0; gms * self.shape.state_len()],
            lin: vec![0; self.cells()],
            quad: vec![0; self.cells()],
            att_top: vec![[(0.0, u32::MAX); TOP]; gms * self.kinds.len()],
            gm_cost: vec![0.0; gms],
            group_cost: vec![0.0; self.groups],
        };
        let len = self.shape.state_len();
        for (s, &c) in cell_of.iter().enumerate() {
            let c = c as usize;
            let d = Delta::one(Src::Sample(s as u32), Src::Zero, self.rank_of(c), 1.0, 1.0);
            let gm = self.gm_of(c);
            gm_apply(&mut sh.gm[gm * len..(gm + 1) * len], &self.hosted(), &self.step_delta(&d, &[]), self.coeffs(), self.shape, self.avx2);
            sh.lin[c] += self.lens[s];
            sh.quad[c] += self.sq[s];
        }
        for gm in 0..gms {
            self.rank_attention(&mut sh, gm);
            sh.gm_cost[gm] = self.eval_gm(&sh, gm, &Delta::none(), &[]);
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
        let sh = px.build(&cell_of);
        // move sample 0 from cell 0 (rank 0, step 0) to cell 7 (rank 3, step 1): another group
        let (ga, gb) = (px.gm_of(0), px.gm_of(7));
        let da = Delta::one(Src::Sample(0), Src::Zero, 0, -1.0, -1.0);
        let db = Delta::one(Src::Sample(0), Src::Zero, 1, 1.0, 1.0);
        let ca = px.eval_gm(&sh, ga, &da, &[]);
        let cb = px.eval_gm(&sh, gb, &db, &[]);
        let mut inc = sh.clone();
        inc.lin[0] -= lens[0];
        inc.quad[0] -= lens[0] * lens[0];
        inc.lin[7] += lens[0];
        inc.quad[7] += lens[0] * lens[0];
        px.apply_gm(&mut inc, ga, &da, &[], ca);
        px.apply_gm(&mut inc, gb, &db, &[], cb);
        cell_of[0] = 7;
        let fresh = px.build(&cell_of);
        assert_eq!(fresh.gm, inc.gm);
        assert_eq!(fresh.att_top, inc.att_top);
        assert!((fresh.gm_cost[ga] - ca).abs() <= 1e-12 * ca.abs().max(1.0));
        assert!((fresh.gm_cost[gb] - cb).abs() <= 1e-12 * cb.abs().max(1.0));
    }

    #[test]
    fn sample_rows_are_compact_only_when_every_value_fits() {
        let shape = Shape::new(3, 4, 2);
        let mut full: Vec<f32> = (0..2 * shape.row_len()).map(|i| (i % 50) as f32).collect();
        let otot = shape.otot_at(1);
        full[otot] = 1e6; // tails may exceed 16 bits
        let rows = SampleRows::new(full.clone(), shape);
        assert!(matches!(rows, SampleRows::U16 { .. }));
        for s in 0..2 {
            match rows.row(s, shape) {
                Rows::U16 { proj, tail } => {
                    let back: Vec<f32> = proj.iter().map(|&x| x as f32).chain(tail.iter().copied()).collect();
                    assert_eq!(back, full[s * shape.row_len()..(s + 1) * shape.row_len()]);
                }
                Rows::F32(_) => unreachable!(),
            }
        }
        full[shape.proj_at(2, 3) + shape.row_len()] = 70_000.0;
        assert!(matches!(SampleRows::new(full, shape), SampleRows::F32(_)));
    }
}

