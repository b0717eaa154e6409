//! How a plan treats a sample longer than the token cap (docs/design.md, "Samples over the
//! cap"): refused, or run alone in a microbatch of its own. The packers (`packing::cells`),
//! `validate` and the simulator read it. (Splitting such a sample over a context-parallel
//! group is not built.)

use crate::error::{invalid, Result};

/// What a packer does with a sample longer than the token cap.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Oversize {
    /// Refuse the window (`Error::Infeasible` naming the sample): the default.
    #[default]
    Refuse,
    /// Run it alone in a microbatch of its own (priced at its real length).
    Alone,
}

impl Oversize {
    /// "refuse" or "alone" (what Python passes); an error names `oversize` and the value.
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "refuse" => Ok(Oversize::Refuse),
            "alone" => Ok(Oversize::Alone),
            _ => Err(invalid("oversize", format!("{name:?} is not one of \"refuse\", \"alone\""))),
        }
    }
}
