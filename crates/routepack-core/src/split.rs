//! A sample longer than the token cap split over a context-parallel group
//! ([`crate::oversize::Oversize::Split`], docs/design.md "Samples over the cap").
//!
//! Such a sample (n > token_cap) runs at one microbatch on every rank of one CP group, the
//! `cp` consecutive DP ranks g·cp .. g·cp + cp − 1 (a CP group lies inside one EP group:
//! `Topology::cp` divides `ep`). Rank j of the group holds *piece* j: ⌊n / cp⌋ tokens, one
//! more for j < n mod cp, and nothing else runs in those cp cells. The plan records the sample
//! at the group's first rank (`sample_rank`); the other cp − 1 cells hold no sample of the
//! plan's arrays and belong to it. It needs cp <= n <= cp·token_cap: every piece within the
//! cap, none empty.
//!
//! Its routed tokens are split over the pieces in proportion to their tokens,
//! deterministically: with T_j the tokens of pieces 0..j, piece j sends
//! ⌊c·T_{j+1} / n⌋ − ⌊c·T_j / n⌋ of a count c, so the pieces' counts sum to c exactly.
//!
//! [`Pieces`] is the window of pieces: a sample within the cap is one piece, a split sample
//! cp. A packer packs the pieces with a split sample's counted as the cap
//! ([`Pieces::row_lens`]), so each fills a row alone and the rows, their count and its
//! certificate are those of the problem in which the sample takes cp full rows, which it does
//! in every valid plan. [`align`] then swaps whole cells so that each split sample's pieces sit
//! on one CP group at one microbatch (any cells can be swapped: every invariant of a packing is
//! per cell), and [`Pieces::collapse`] gives the plan's arrays (`packing::cells::pack_split`). `simulate` prices a plan on its
//! pieces ([`Pieces::expand`], [`Pieces::counts`]) with ring attention (`cost::terms`).

use crate::error::{invalid, Error, Result};
use crate::window::WindowView;

/// The pieces of a window whose samples over the cap are split over CP groups of `cp` ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pieces {
    /// Ranks of a CP group (>= 2).
    pub cp: usize,
    /// `[S + 1]` sample s has pieces `first[s] .. first[s + 1]` (one, or cp when split).
    pub first: Vec<usize>,
    /// `[S']` tokens of each piece.
    pub lens: Vec<i64>,
    /// `[S']` the sample each piece is of.
    pub sample: Vec<usize>,
}

impl Pieces {
    /// The pieces of `seq_lens` under `token_cap` and CP groups of `cp` ranks: [`Pieces::check`],
    /// then [`Pieces::of_checked`]. Errors: cp < 2 (`topo.cp`, named: there is no group to split
    /// over), a cap < 1, and a sample over the cap longer than cp·token_cap or shorter than cp
    /// (`Infeasible`, naming it).
    pub fn new(seq_lens: &[i64], token_cap: i64, cp: usize) -> Result<Self> {
        Self::check(seq_lens, token_cap, cp)?;
        Ok(Self::of_checked(seq_lens, token_cap, cp))
    }

    /// The one check of a split (`oversize::check_lengths` and [`Pieces::new`] run it): the
    /// errors [`Pieces::new`] lists, in that order.
    pub fn check(seq_lens: &[i64], token_cap: i64, cp: usize) -> Result<()> {
        #[cfg(test)]
        crate::guard_counts::add("pieces");
        if cp < 2 {
            return Err(invalid(
                "topo.cp",
                format!("oversize=\"split\" splits a sample over a context-parallel group: needs cp >= 2, got {cp}"),
            ));
        }
        if token_cap < 1 {
            return Err(invalid("token_cap", format!("must be >= 1, got {token_cap}")));
        }
        for (s, &n) in seq_lens.iter().enumerate().filter(|(_, &n)| n > token_cap) {
            if n as i128 > cp as i128 * token_cap as i128 {
                return Err(Error::Infeasible(format!(
                    "sample {s} has {n} tokens, more than topo.cp x token_cap = {cp} x {token_cap}: no context-parallel \
                     group holds it; raise the cap or topo.cp"
                )));
            }
            if n < cp as i64 {
                return Err(Error::Infeasible(format!(
                    "sample {s} has {n} tokens, fewer than topo.cp = {cp}: a split gives each rank of its group at least one"
                )));
            }
        }
        Ok(())
    }

    /// The pieces of arguments that passed [`Pieces::check`] (a checked `crate::request::PlanRequest`'s
    /// window and cap, or [`Pieces::new`]'s): not checked again (debug builds assert the check).
    pub fn of_checked(seq_lens: &[i64], token_cap: i64, cp: usize) -> Self {
        debug_assert!(
            cp >= 2
                && token_cap >= 1
                && seq_lens.iter().all(|&n| n <= token_cap || (cp as i64 <= n && n as i128 <= cp as i128 * token_cap as i128))
        );
        let mut first = Vec::with_capacity(seq_lens.len() + 1);
        let (mut lens, mut sample) = (Vec::with_capacity(seq_lens.len()), Vec::with_capacity(seq_lens.len()));
        first.push(0);
        for (s, &n) in seq_lens.iter().enumerate() {
            if n <= token_cap {
                lens.push(n);
                sample.push(s);
            } else {
                let (q, r) = (n / cp as i64, n % cp as i64);
                for j in 0..cp as i64 {
                    lens.push(q + i64::from(j < r));
                    sample.push(s);
                }
            }
            first.push(lens.len());
        }
        Self { cp, first, lens, sample }
    }

    /// Samples of the window (S).
    #[inline]
    pub fn num_samples(&self) -> usize {
        self.first.len() - 1
    }

    /// Whether sample `s` is split.
    #[inline]
    pub fn is_split(&self, s: usize) -> bool {
        self.first[s + 1] - self.first[s] > 1
    }

    /// Whether any sample is split.
    pub fn any_split(&self) -> bool {
        self.lens.len() > self.num_samples()
    }

    /// The lengths a packer packs: every piece of a split sample counted as `token_cap`, so that
    /// nothing shares its row (every other piece has at least one token).
    pub fn row_lens(&self, token_cap: i64) -> Vec<i64> {
        (0..self.lens.len()).map(|k| if self.is_split(self.sample[k]) { token_cap } else { self.lens[k] }).collect()
    }

    /// `[S', L, E]` routed tokens of each piece: a sample's own, split in proportion to its
    /// pieces' tokens as the module docs say. A copy of the window's demand in int32: refused
    /// by name (`window`) where it cannot be allocated (`crate::sizes`).
    pub fn counts(&self, w: &WindowView) -> Result<Vec<i32>> {
        let (l_n, e_n) = (w.num_layers, w.num_experts);
        let row = l_n * e_n;
        let what = format!("the split pieces' routed tokens [S' = {}, L = {l_n}, E = {e_n}]", self.lens.len());
        let mut out = crate::sizes::filled("window", &what, self.lens.len().saturating_mul(row), 0i32)?;
        for s in 0..self.num_samples() {
            let src = w.expert_tokens.slice(s * row, row);
            let k0 = self.first[s];
            if !self.is_split(s) {
                src.copy_to_i32(&mut out[k0 * row..(k0 + 1) * row]);
                continue;
            }
            let n = w.seq_lens[s] as i128;
            let mut before = 0i128; // T_j
            for k in k0..self.first[s + 1] {
                let after = before + self.lens[k] as i128;
                for (i, o) in out[k * row..(k + 1) * row].iter_mut().enumerate() {
                    let c = src.get(i) as i128;
                    // within [0, c]: a count fits i32
                    *o = (c * after / n - c * before / n) as i32;
                }
                before = after;
            }
        }
        Ok(out)
    }

    /// The plan's `(sample_rank, sample_micro)` of a packing of the pieces that [`align`] has
    /// aligned: each sample where its first piece is.
    pub fn collapse(&self, sample_rank: &[i32], sample_micro: &[i32]) -> (Vec<i32>, Vec<i32>) {
        let at = |f: &[i32]| (0..self.num_samples()).map(|s| f[self.first[s]]).collect();
        (at(sample_rank), at(sample_micro))
    }

    /// The pieces' `(rank, micro)` `[S']` of a plan's `sample_rank`, `sample_micro` `[S]`:
    /// piece j of a split sample on its rank + j.
    pub fn expand(&self, sample_rank: &[i32], sample_micro: &[i32]) -> (Vec<i32>, Vec<i32>) {
        let mut rank = Vec::with_capacity(self.lens.len());
        let mut micro = Vec::with_capacity(self.lens.len());
        for s in 0..self.num_samples() {
            for j in 0..self.first[s + 1] - self.first[s] {
                rank.push(sample_rank[s] + j as i32);
                micro.push(sample_micro[s]);
            }
        }
        (rank, micro)
    }
}

/// Swaps whole cells of a packing of `pieces` on `dp` ranks and `m_n` microbatches
/// (`sample_rank`, `sample_micro` `[S']`, in range) in which every piece of a split
/// sample is alone in its cell, so that split sample s's piece j sits on rank g·cp + j of one
/// CP group g, all at one microbatch. Samples in index order each take the free (group,
/// microbatch) that already holds most of its pieces in place (the first on ties, in piece
/// order), else the first free one (microbatch-major): one always is free, since the cells not
/// yet taken hold the remaining split samples' pieces.
pub fn align(sample_rank: &mut [i32], sample_micro: &mut [i32], m_n: usize, pieces: &Pieces, dp: usize) {
    let cp = pieces.cp;
    let cells = dp * m_n;
    let home: Vec<usize> = sample_rank.iter().zip(sample_micro.iter()).map(|(&d, &m)| d as usize * m_n + m as usize).collect();
    // at[q]: the original cell whose contents sit at q; pos[c]: where cell c's contents sit
    let mut at: Vec<usize> = (0..cells).collect();
    let mut pos: Vec<usize> = (0..cells).collect();
    let groups = dp / cp;
    let mut taken = vec![false; groups * m_n];
    let target = |g: usize, j: usize, m: usize| (g * cp + j) * m_n + m;
    for s in (0..pieces.num_samples()).filter(|&s| pieces.is_split(s)) {
        let ks = pieces.first[s]..pieces.first[s + 1];
        let placed = |pos: &[usize], g: usize, m: usize| ks.clone().enumerate().filter(|&(j, k)| pos[home[k]] == target(g, j, m)).count();
        let mut best: Option<(usize, usize, usize)> = None;
        for k in ks.clone() {
            let q = pos[home[k]];
            let (g, m) = (q / m_n / cp, q % m_n);
            if g < groups && !taken[g * m_n + m] {
                let n = placed(&pos, g, m);
                if best.is_none_or(|b| n > b.0) {
                    best = Some((n, g, m));
                }
            }
        }
        let (g, m) = match best {
            Some((_, g, m)) => (g, m),
            None => {
                let free = (0..groups * m_n).map(|i| (i % groups, i / groups)).find(|&(g, m)| !taken[g * m_n + m]);
                free.expect("a free (group, microbatch) for every split sample")
            }
        };
        taken[g * m_n + m] = true;
        for (j, k) in ks.enumerate() {
            let (from, to) = (pos[home[k]], target(g, j, m));
            if from != to {
                let (a, b) = (at[from], at[to]);
                at.swap(from, to);
                pos[a] = to;
                pos[b] = from;
            }
        }
    }
    for (k, &c) in home.iter().enumerate() {
        sample_rank[k] = (pos[c] / m_n) as i32;
        sample_micro[k] = (pos[c] % m_n) as i32;
    }
}

#[cfg(test)]
mod tests;
