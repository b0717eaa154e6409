//! What one training step runs: its passes (forward, backward) and whether a layer's
//! dispatch/combine all-to-all overlaps its computation. Both default to what the cost model
//! priced before they existed (one forward and one backward pass, no overlap), so a cost
//! model that leaves them unset prices every plan bit for bit as before.

use crate::error::{invalid, Result};

/// Whether a layer's dispatch/combine all-to-all runs while computation runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Overlap {
    /// Communication and computation add up (the default).
    #[default]
    None,
    /// The all-to-all of one microbatch runs behind the attention and expert computation of
    /// another, as DeepSeek's DualPipe, DeepEP's two-microbatch overlap, MegaScale-MoE and
    /// Megatron's `moe_fb_overlap` schedule it: an exchange costs
    /// `max(compute, all_to_all) + exposed replication` (see
    /// [`crate::cost::CostModel::hidden_communication`]).
    DispatchCombine,
}

impl Overlap {
    /// The name the JSON and Python use: "none" or "dispatch_combine".
    pub fn name(self) -> &'static str {
        match self {
            Overlap::None => "none",
            Overlap::DispatchCombine => "dispatch_combine",
        }
    }

    /// The overlap named `name` ([`Overlap::name`]); an error names `cost.overlap` and the value.
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "none" => Ok(Overlap::None),
            "dispatch_combine" => Ok(Overlap::DispatchCombine),
            _ => Err(invalid("cost.overlap", format!("{name:?} is not one of \"none\", \"dispatch_combine\""))),
        }
    }
}

/// One pass of a training step over every MoE layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    /// A forward pass: one unit of compute, one dispatch + combine. RL's recompute of the old
    /// log-probabilities is one more forward pass before the update's.
    Forward,
    /// A backward pass: about twice the forward's compute (gradients of activations and of
    /// weights), one dispatch + combine of gradients.
    Backward,
}

/// The passes of a step unless the cost model says otherwise: the update's forward and
/// backward (compute ×3, communication ×2).
pub const DEFAULT_PASSES: [Pass; 2] = [Pass::Forward, Pass::Backward];

impl Pass {
    /// The name the JSON and Python use: "forward" or "backward".
    pub fn name(self) -> &'static str {
        match self {
            Pass::Forward => "forward",
            Pass::Backward => "backward",
        }
    }

    /// The pass named `name`; an error names `cost.passes[i]` and the value.
    pub fn parse(i: usize, name: &str) -> Result<Self> {
        match name {
            "forward" => Ok(Pass::Forward),
            "backward" => Ok(Pass::Backward),
            _ => Err(invalid(format!("cost.passes[{i}]"), format!("{name:?} is not one of \"forward\", \"backward\""))),
        }
    }

    /// Multiplier of this pass on the one-pass compute terms (attention, expert work).
    #[inline]
    pub fn compute(self) -> f64 {
        match self {
            Pass::Forward => 1.0,
            Pass::Backward => 2.0,
        }
    }

    /// Multiplier of this pass on one dispatch + combine.
    #[inline]
    pub fn communication(self) -> f64 {
        1.0
    }
}
