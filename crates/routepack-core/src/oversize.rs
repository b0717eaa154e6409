//! How a plan treats a sample longer than the token cap (docs/design.md, "Samples over the
//! cap"): refused, run alone in a microbatch of its own, or split over a context-parallel
//! group ([`crate::split`]). The packers (`packing::cells`), `validate` and the simulator read it.

use crate::error::{invalid, Result};

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
