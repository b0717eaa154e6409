//! The incremental state of one layout (`Shards`): built from scratch, priced after a move
//! and updated when the move is accepted, through `kernel` (expert work and all-to-all) and
//! `attention`.

use super::{Delta, Proxy, Src};
use crate::layout::kernel::{gm_apply, gm_apply_pair, gm_cost, gm_cost_pair, Coeffs, Hosted, StepDelta};

/// Rank values kept per (group, microbatch, attention kind): the largest three.
pub(super) const TOP: usize = 3;

/// Incremental state of one layout: per (group, microbatch) the kernel's values, per cell (DP rank
/// d, microbatch m; index d·M + m) Σ n and Σ n², and the costs.
///
/// A group's cost is the sum of its microbatches' costs in microbatch order (`f64` addition, so the order
/// is part of the result). `group_prefix` keeps that sum's partial sums, so a move that
/// changes microbatch m re-adds only microbatches m.. (with thousands of microbatches on one DP rank, re-adding
/// every microbatch for every proposal was most of the search); the sums are the same bits.
#[derive(Clone, Debug, PartialEq)]
pub struct Shards {
    /// `[G·M, state_len]` (`kernel::Shape::state_at`)
    pub gm: Vec<f32>,
    /// `[dp·M]` Σ n of each cell.
    pub lin: Vec<i64>,
    /// `[dp·M]` Σ n² of each cell (i128: n² overflows i64 above 3·10⁹ tokens).
    pub quad: Vec<i128>,
    /// `[G·M, kinds, 3]` the three largest attention values of the step's ranks (value,
    /// rank), largest first; missing entries are (0, u32::MAX).
    pub att_top: Vec<[(f64, u32); TOP]>,
    /// `[G·M]` cost of each (group, microbatch).
    pub gm_cost: Vec<f64>,
    /// `[G]` Σ_m gm_cost.
    pub group_cost: Vec<f64>,
    /// `[G, M + 1]` partial sums: entry (g, m) is the sum of group g's first m microbatch costs in
    /// microbatch order, from −0.0 as `Iterator::sum` starts (entry (g, M) is `group_cost[g]`).
    pub group_prefix: Vec<f64>,
}

impl Proxy {
    /// (Σ n, Σ n²) of a source.
    #[inline]
    pub(super) fn lin_quad(&self, src: Src, sh: &Shards) -> (i64, i128) {
        match src {
            Src::Zero => (0, 0),
            Src::Sample(s) => (self.lens[s as usize], self.sq[s as usize]),
            Src::Cell(c) => (sh.lin[c], sh.quad[c]),
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
        StepDelta { add: self.source(d.add, cells), sub: self.source(d.sub, cells), ts: d.tok, ends: d.ends, n_ends: d.n_ends }
    }

    /// Cost of (group, microbatch) `gm` after `d` (`cells`: the per-cell table, read by cell
    /// sources). The state is not changed.
    pub fn eval_gm(&self, sh: &Shards, gm: usize, d: &Delta, cells: &[f32]) -> f64 {
        let len = self.shape.state_len();
        let att = self.attention(sh, gm, d);
        att + gm_cost(&sh.gm[gm * len..(gm + 1) * len], &self.hosted(), &self.step_delta(d, cells), self.coeffs(), self.shape, self.avx2)
    }

    /// `eval_gm` of a move between two different (group, microbatch)s, `da` on `gm_a` and `db` on
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

    /// `apply_gm` of a move between two different (group, microbatch)s (see `eval_pair`).
    #[allow(clippy::too_many_arguments)]
    pub fn apply_pair(&self, sh: &mut Shards, gm_a: usize, da: &Delta, gm_b: usize, db: &Delta, cells: &[f32], costs: (f64, f64)) {
        debug_assert!(gm_a != gm_b && da.add == db.add && da.sub == db.sub);
        let len = self.shape.state_len();
        let (lo, hi) = (gm_a.min(gm_b), gm_a.max(gm_b));
        let (head, tail) = sh.gm.split_at_mut(hi * len);
        let (state_lo, state_hi) = (&mut head[lo * len..(lo + 1) * len], &mut tail[..len]);
        let (state_a, state_b) = if gm_a < gm_b { (state_lo, state_hi) } else { (state_hi, state_lo) };
        let (sa, sb) = (self.step_delta(da, cells), self.step_delta(db, cells));
        gm_apply_pair(state_a, state_b, &self.hosted(), &sa, &sb, self.coeffs(), self.shape, self.avx2);
        self.record_cost(sh, gm_a, da, costs.0);
        self.record_cost(sh, gm_b, db, costs.1);
        let m_n = self.micro;
        if gm_a / m_n == gm_b / m_n {
            // one pass over the group from the earlier microbatch
            self.resum_from(sh, gm_a.min(gm_b));
        } else {
            self.resum_from(sh, gm_a);
            self.resum_from(sh, gm_b);
        }
    }

    /// After `d` was applied to `gm`'s values: its attention ranking and cost (the group
    /// total is the caller's: `resum_from`).
    fn record_cost(&self, sh: &mut Shards, gm: usize, d: &Delta, cost: f64) {
        self.update_attention(sh, gm, &d.ends[..d.n_ends]);
        sh.gm_cost[gm] = cost;
    }

    /// Group g's partial sums from microbatch m on, and its total, after microbatch (g, m)'s cost changed
    /// (gm = g·M + m): the microbatches before m keep their partial sums, so the total is the sum
    /// over every microbatch in microbatch order, as `Iterator::sum` gives it.
    pub(super) fn resum_from(&self, sh: &mut Shards, gm: usize) {
        let m_n = self.micro;
        let (g, m) = (gm / m_n, gm % m_n);
        let costs = &sh.gm_cost[g * m_n + m..(g + 1) * m_n];
        let prefix = &mut sh.group_prefix[g * (m_n + 1) + m..(g + 1) * (m_n + 1)];
        // the running sum in a register (not re-read from the table it is written to)
        let mut acc = prefix[0];
        for (p, &c) in prefix[1..].iter_mut().zip(costs) {
            acc += c;
            *p = acc;
        }
        sh.group_cost[g] = acc;
    }

    /// Group g's total if microbatches `changed` (gm indices; those outside g are ignored) had the
    /// costs given, the others theirs: the partial sum before the first changed microbatch, then the
    /// rest in microbatch order. The same bits as summing every microbatch (see `Shards`).
    pub fn group_total_with(&self, sh: &Shards, g: usize, changed: [(usize, f64); 2]) -> f64 {
        let m_n = self.micro;
        let base = g * m_n;
        let inside = |gm: usize| gm >= base && gm < base + m_n;
        let first = changed.iter().filter(|c| inside(c.0)).map(|c| c.0 - base).min();
        let Some(first) = first else {
            return sh.group_cost[g];
        };
        let mut acc = sh.group_prefix[g * (m_n + 1) + first];
        for m in first..m_n {
            let gm = base + m;
            acc += if gm == changed[0].0 {
                changed[0].1
            } else if gm == changed[1].0 {
                changed[1].1
            } else {
                sh.gm_cost[gm]
            };
        }
        acc
    }

    /// Applies `d` to `gm`'s values with the same arithmetic as `eval_gm` (so the state is what
    /// was evaluated, bit for bit) and records `cost`. The caller updates Σ n and Σ n² of the
    /// cells first (the attention ranking is refreshed from them).
    pub fn apply_gm(&self, sh: &mut Shards, gm: usize, d: &Delta, cells: &[f32], cost: f64) {
        let len = self.shape.state_len();
        gm_apply(&mut sh.gm[gm * len..(gm + 1) * len], &self.hosted(), &self.step_delta(d, cells), self.coeffs(), self.shape, self.avx2);
        self.record_cost(sh, gm, d, cost);
        self.resum_from(sh, gm);
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
            group_prefix: vec![-0.0; self.groups * (m_n + 1)],
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
            self.resum_from(&mut sh, g * m_n);
        }
        sh
    }
}
