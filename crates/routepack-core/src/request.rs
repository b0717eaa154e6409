//! One plan request, checked once: the window, the topology, the cost model, the token cap and
//! what to do with a sample over it ([`Oversize`]), checked together by [`PlanRequest::new`].
//! The stages' entry points that take a [`PlanRequest`] (`packing::routepack::routepack_packing_in`,
//! `packing::sequential::sequential_of`, `packing::kk::verl_kk_of`, `simulate::simulate_request`)
//! read its fields and check none of them again; their convenience entries that take the parts
//! (`routepack_packing`, `sequential_in`, `verl_kk_in`, `simulate_in`, ...) check them once at
//! the entry with the same checks and messages, and their inner stages check nothing again
//! (`debug_assert!`s keep the internal invariants in debug builds). docs/design.md, "Errors",
//! says where each argument is checked.
//!
//! A window's lengths against the cap have one check, `oversize::check_lengths`: every length
//! at least 1 and within the cap, or (`Oversize::Alone`) counted as the cap, or
//! (`Oversize::Split`) within `topo.cp` × the cap and split into pieces within it
//! (`split::Pieces::check`).

use crate::cost::CostModel;
use crate::error::Result;
use crate::oversize::{check_lengths, Oversize};
use crate::topology::Topology;
use crate::window::WindowView;

/// A checked plan request: the window (borrowed), its topology and cost model, the token cap and
/// the treatment of samples over it. Built only by [`PlanRequest::new`] (its fields are private),
/// so holding one means every check passed: the topology holds every expert
/// (`Topology::check_experts`), the cost model has one `a_quad` per layer and valid
/// coefficients (`CostModel::check`), the cap is >= 1 and every sample fits it as `oversize`
/// says (`oversize::check_lengths`).
#[derive(Clone, Copy, Debug)]
pub struct PlanRequest<'a> {
    window: WindowView<'a>,
    topo: &'a Topology,
    cost: &'a CostModel,
    token_cap: i64,
    oversize: Oversize,
}

impl<'a> PlanRequest<'a> {
    /// The one check of a request, in the order its errors name the arguments: the topology
    /// against the window's experts (`topo`), the cost model against its layers (`cost.<field>`),
    /// then the cap and the lengths (`oversize::check_lengths`: `token_cap`, `seq_lens`, `topo.cp`, or
    /// `Infeasible` naming the sample over the cap).
    pub fn new(window: WindowView<'a>, topo: &'a Topology, cost: &'a CostModel, token_cap: i64, oversize: Oversize) -> Result<Self> {
        #[cfg(test)]
        crate::guard_counts::add("request");
        topo.check_experts(window.num_experts)?;
        cost.check(window.num_layers)?;
        check_lengths(window.seq_lens, token_cap, oversize, topo.dp, topo.cp)?;
        Ok(Self { window, topo, cost, token_cap, oversize })
    }

    /// The same request on `window`, a window the stages derived from this one's (the pieces of
    /// its split samples, each within the cap): not checked again, so `window` must have this
    /// one's layers and experts and lengths in [1, cap] (debug builds assert it).
    pub(crate) fn derived<'b>(&self, window: WindowView<'b>, oversize: Oversize) -> PlanRequest<'b>
    where
        'a: 'b,
    {
        debug_assert!(window.num_layers == self.window.num_layers && window.num_experts == self.window.num_experts);
        debug_assert!(window.seq_lens.iter().all(|&n| (1..=self.token_cap).contains(&n)) || oversize != Oversize::Refuse);
        PlanRequest { window, topo: self.topo, cost: self.cost, token_cap: self.token_cap, oversize }
    }

    /// The window: `seq_lens [S]`, `expert_tokens [S, L, E]`.
    #[inline]
    pub fn window(&self) -> &WindowView<'a> {
        &self.window
    }

    /// The topology (it holds every expert of the window).
    #[inline]
    pub fn topo(&self) -> &'a Topology {
        self.topo
    }

    /// The cost model (one `a_quad` per layer of the window, every coefficient checked).
    #[inline]
    pub fn cost(&self) -> &'a CostModel {
        self.cost
    }

    /// The token cap, >= 1.
    #[inline]
    pub fn token_cap(&self) -> i64 {
        self.token_cap
    }

    /// What a sample over the cap does.
    #[inline]
    pub fn oversize(&self) -> Oversize {
        self.oversize
    }
}

#[cfg(test)]
mod tests;
