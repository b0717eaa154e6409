//! What a packing must fill beyond the window: the DP ranks, Megatron's rule for the microbatch
//! count under a pipeline, and what to do with a sample longer than the token cap.
//!
//! **Samples over the cap** (docs/design.md, "Samples over the cap"). By default such a sample
//! makes the window infeasible (`rows::check_cap` names it). With [`Oversize::Alone`] it runs in
//! a microbatch of its own, as slime does: every packer builds its rows from [`Cells::row_lens`],
//! where such a sample counts as exactly the cap. Every other sample has at least one token, so
//! no row can hold anything beside it, and the rows, their count and its certificate are those
//! of the problem in which the sample must run alone: the row lower bounds (L1, L2) count it as
//! one full row, which it is in every valid plan. The layout then places the samples at their
//! real lengths (a cell over the cap holds one sample, and no move adds to it or moves it into
//! an occupied cell), and `validate` accepts a cell over the cap only when it holds one sample.
//! With [`Oversize::Split`] it is split over a context-parallel group of [`Cells::cp`] ranks:
//! every packer packs the window's pieces (`crate::split`), where such a sample is cp pieces
//! each counted as the cap (cp full rows), then its pieces are aligned onto one CP group at one
//! microbatch ([`pack_split`]).

use std::borrow::Cow;

use super::Packing;
use crate::error::Result;
pub use crate::oversize::Oversize;
use crate::split::{self, Pieces};
use crate::topology::{MicroRule, Topology};

/// The cells a packing fills: `dp` ranks running a microbatch count that meets `rule`, and
/// the treatment of samples over the cap.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cells {
    /// DP ranks.
    pub dp: usize,
    /// Megatron's rule for the microbatch count ([`MicroRule::NONE`] without a pipeline).
    pub rule: MicroRule,
    /// Samples over the cap.
    pub oversize: Oversize,
    /// Ranks of a context-parallel group (`Topology::cp`): what [`Oversize::Split`] splits a
    /// sample over (1: none).
    pub cp: usize,
}

impl Cells {
    /// `dp` ranks, any microbatch count, samples over the cap refused: what the packers did
    /// before pipelines and `oversize`.
    pub fn plain(dp: usize) -> Self {
        Self { dp, rule: MicroRule::NONE, oversize: Oversize::Refuse, cp: 1 }
    }

    /// The cells of `topo` (its DP ranks, pipeline rule and CP groups) with `oversize`.
    pub fn of(topo: &Topology, oversize: Oversize) -> Self {
        Self { dp: topo.dp, rule: topo.micro_rule(), oversize, cp: topo.cp }
    }

    /// Rows come in multiples of this: dp × the rule's multiple.
    #[inline]
    pub fn step(&self) -> usize {
        self.dp * self.rule.multiple
    }

    /// The fewest rows: dp × the rule's minimum.
    #[inline]
    pub fn min_rows(&self) -> usize {
        self.dp * self.rule.min
    }

    /// The smallest row count >= `rows` the cells allow: dp × [`MicroRule::fit`] of the
    /// microbatches those rows need.
    #[inline]
    pub fn rows_for(&self, rows: usize) -> usize {
        self.dp * self.rule.fit(rows.div_ceil(self.dp.max(1)))
    }

    /// The lengths rows are built from: `seq_lens` itself, or with [`Oversize::Alone`] every
    /// sample over the cap counted as the cap (see the module docs). Not checked here: a packer's
    /// entry checks them once ([`Cells::check_lengths`], through `rows::check_cap`: a
    /// sample over the cap otherwise is `Infeasible`, named).
    pub fn row_lens<'a>(&self, seq_lens: &'a [i64], token_cap: i64) -> Cow<'a, [i64]> {
        self.oversize.row_lens(seq_lens, token_cap)
    }

    /// The one check of `seq_lens` against `token_cap` for these cells
    /// (`crate::oversize::check_lengths`): what a packer's entry runs once.
    pub fn check_lengths(&self, seq_lens: &[i64], token_cap: i64) -> Result<()> {
        crate::oversize::check_lengths(seq_lens, token_cap, self.oversize, self.dp, self.cp)
    }
}

/// A packing of `seq_lens` into `cells` (whose `oversize` is `Split`) by `inner`, a packer of
/// lengths within the cap: the pieces packed (`Pieces::row_lens`), aligned (`split::align`)
/// and collapsed (`Pieces::collapse`).
/// The lengths were checked at the packer's entry ([`Cells::check_lengths`]: the
/// pieces, and `cells.cp` dividing `cells.dp`); nothing is checked again here.
pub fn pack_split<R>(
    seq_lens: &[i64],
    token_cap: i64,
    cells: &Cells,
    inner: impl FnOnce(&[i64], &Cells) -> Result<(Packing, R)>,
) -> Result<(Packing, R)> {
    debug_assert!(cells.dp.is_multiple_of(cells.cp));
    let pieces = Pieces::of_checked(seq_lens, token_cap, cells.cp);
    let plain = Cells { oversize: Oversize::Refuse, ..*cells };
    let (mut p, r) = inner(&pieces.row_lens(token_cap), &plain)?;
    split::align(&mut p.sample_rank, &mut p.sample_micro, p.num_micro, &pieces, cells.dp);
    let (sample_rank, sample_micro) = pieces.collapse(&p.sample_rank, &p.sample_micro);
    Ok((Packing { sample_rank, sample_micro, num_micro: p.num_micro }, r))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_meet_the_rule() {
        let topo = Topology::new(4, 2, 2, 2).unwrap();
        let plain = Cells::of(&topo, Oversize::Refuse);
        assert_eq!((plain.rows_for(1), plain.rows_for(5), plain.step()), (4, 8, 4));
        let pp = Cells::of(&topo.clone().with_pipeline(3, 1, None).unwrap(), Oversize::Refuse);
        assert_eq!((pp.rows_for(1), pp.rows_for(13), pp.rows_for(16), pp.step(), pp.min_rows()), (12, 16, 16, 4, 12));
        let vpp = Cells::of(&topo.with_pipeline(2, 2, None).unwrap(), Oversize::Refuse);
        assert_eq!((vpp.rows_for(1), vpp.rows_for(9), vpp.step()), (8, 16, 8));
    }

    #[test]
    fn alone_counts_an_over_cap_sample_as_the_cap() {
        let alone = Cells { oversize: Oversize::Alone, ..Cells::plain(2) };
        assert_eq!(&*alone.row_lens(&[3, 25, 7], 10), &[3, 10, 7]);
        assert!(matches!(alone.row_lens(&[3, 7], 10), Cow::Borrowed(_)));
        let plain = Cells::plain(2);
        let e = crate::packing::rows::check_cap(&plain.row_lens(&[3, 25, 7], 10), 10).unwrap_err().to_string();
        assert!(e.contains("sample 1 has 25 tokens") && e.contains("oversize=\"alone\"") && e.contains("oversize=\"split\""), "{e}");
    }
}
