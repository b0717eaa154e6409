//! How a plan treats a sample longer than the token cap (docs/design.md, "Samples over the
//! cap"): refused, run alone in a microbatch of its own, or split over a context-parallel
//! group ([`crate::split`]). The packers (`packing::cells`), `validate` and the simulator read it.
//!
//! A window's lengths against the cap have one check here, [`check_lengths`] (through
//! [`check_cap`]): what a plan request (`crate::request::PlanRequest::new`) and every packer's
//! entry that takes the lengths run once; the packers themselves check nothing again.

use std::borrow::Cow;

use crate::error::{invalid, Error, Result};
use crate::split::Pieces;

/// What a packer does with a sample longer than the token cap.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Oversize {
    /// Refuse the window (`Error::Infeasible` naming the sample): the default.
    #[default]
    Refuse,
    /// Run it alone in a microbatch of its own (priced at its real length).
    Alone,
    /// Split it over the `Topology::cp` ranks of one context-parallel group at one microbatch,
    /// a share of its tokens on each, nothing else in those cells ([`crate::split`]); priced
    /// as ring attention.
    Split,
}

impl Oversize {
    /// "refuse", "alone" or "split" (what Python passes); an error names `oversize` and the value.
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "refuse" => Ok(Oversize::Refuse),
            "alone" => Ok(Oversize::Alone),
            "split" => Ok(Oversize::Split),
            _ => Err(invalid("oversize", format!("{name:?} is not one of \"refuse\", \"alone\", \"split\""))),
        }
    }
}

impl Oversize {
    /// The lengths rows are built from: `seq_lens` itself, or with [`Oversize::Alone`] every
    /// sample over the cap counted as the cap (`packing::cells`' module docs say why).
    pub fn row_lens(self, seq_lens: &[i64], token_cap: i64) -> Cow<'_, [i64]> {
        if self == Oversize::Alone && token_cap >= 1 && seq_lens.iter().any(|&n| n > token_cap) {
            Cow::Owned(seq_lens.iter().map(|&n| n.min(token_cap)).collect())
        } else {
            Cow::Borrowed(seq_lens)
        }
    }
}

/// Refuses a cap below 1, a length below 1 and a sample longer than the cap, naming it (never a
/// silent overflow).
pub fn check_cap(seq_lens: &[i64], token_cap: i64) -> Result<()> {
    #[cfg(test)]
    crate::guard_counts::add("token_cap");
    if token_cap < 1 {
        return Err(invalid("token_cap", format!("must be >= 1, got {token_cap}")));
    }
    if let Some((s, &n)) = seq_lens.iter().enumerate().find(|(_, &n)| n < 1) {
        return Err(invalid("seq_lens", format!("sample {s} has length {n}; every length must be >= 1")));
    }
    if let Some((s, &n)) = seq_lens.iter().enumerate().find(|(_, &n)| n > token_cap) {
        return Err(Error::Infeasible(format!(
            "sample {s} has {n} tokens, more than token_cap = {token_cap}; raise the cap, or plan with \
             oversize=\"alone\" (it runs in a microbatch of its own) or oversize=\"split\" (split over a \
             context-parallel group, topo.cp >= 2)"
        )));
    }
    Ok(())
}

/// Whether [`check_cap`] passes, without its errors: what a stage's `debug_assert!` states of
/// lengths checked at its entry ([`check_lengths`]).
pub fn within_cap(seq_lens: &[i64], token_cap: i64) -> bool {
    token_cap >= 1 && seq_lens.iter().all(|&n| (1..=token_cap).contains(&n))
}

/// The one check of a window's lengths `seq_lens` against `token_cap` where samples over it go
/// as `oversize` says, on `dp` DP ranks in CP groups of `cp`: with [`Oversize::Split`], the
/// pieces ([`Pieces::check`]: `topo.cp` >= 2, cap >= 1, every sample over the cap within
/// cp × cap) and a CP group inside the DP ranks (`cp` divides `dp`), then the pieces' row
/// lengths; otherwise the row lengths ([`Oversize::row_lens`]): [`check_cap`] (cap >= 1, every
/// length >= 1 and within the cap, else `Infeasible` naming the sample); last, at least one DP
/// rank. The checks and messages the packers always gave, in their order.
pub fn check_lengths(seq_lens: &[i64], token_cap: i64, oversize: Oversize, dp: usize, cp: usize) -> Result<()> {
    if oversize == Oversize::Split {
        Pieces::check(seq_lens, token_cap, cp)?;
        if !dp.is_multiple_of(cp) {
            return Err(invalid("cp", format!("{cp} must divide dp = {dp} (a CP group is cp consecutive DP ranks)")));
        }
        // a piece's index names a length below 1, as the packers always said
        check_cap(&Pieces::of_checked(seq_lens, token_cap, cp).row_lens(token_cap), token_cap)?;
    } else {
        check_cap(&oversize.row_lens(seq_lens, token_cap), token_cap)?;
    }
    if dp == 0 {
        return Err(invalid("dp", "must be >= 1, got 0"));
    }
    Ok(())
}
