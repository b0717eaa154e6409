//! [`Options`], the knobs of routepack's placement, and their defaults: the one place every
//! default of this stage is written (the bindings and Python read them from here, through
//! `Options::default()`). A leaf module, so that the stage's parts can take the options
//! without importing the stage's entry point.

use std::time::Duration;

use crate::error::{invalid, Result};

/// Default microbatch-phase budget per layer ([`Options::fluct_evals`]). It keeps a placement
/// of DeepSeek-V3's size (58 layers × 256 experts, 288 slots on 32 ranks in 4 nodes) under
/// 5 ms on two cores. Larger budgets lower the per-microbatch peaks of the placement taken
/// alone (on `flash` with sequential packing, simulated step time 1.5% lower at 8000 for about
/// twice the time); behind the full routepack policy, whose packing, layout and replication
/// balance each microbatch again, the measured step time did not change.
pub const DEFAULT_FLUCT_EVALS: usize = 1_000;

/// Default [`Options::exchanges`]: 0, one exchange per chunk.
pub const DEFAULT_EXCHANGES: usize = 0;

/// Default [`Options::slack`]: the final placement's largest bin load within 0.005% of the
/// balanced maximum.
pub const DEFAULT_SLACK: f64 = 5e-5;

/// Default room of [`Options::explore`]: the first fluctuation pass may go 1% above the
/// balanced maximum (or as far as the slack, where that is more: [`Options::explore`]).
pub const DEFAULT_EXPLORE: f64 = 0.01;

/// Default [`Options::migration_aware`]: weigh keeping and incremental candidates.
pub const DEFAULT_MIGRATION_AWARE: bool = true;

/// Knobs of routepack's placement (Python: `plan_window(..., placement_<name>=...)`).
#[derive(Clone, Debug, PartialEq)]
pub struct Options {
    /// Exchanges of one layer the window will run as (EP groups × steps: one dispatch/combine
    /// per (group, microbatch) pair), the granularity of the predicted-time proxy: the chunks are
    /// merged into this many consecutive runs, each priced as one exchange. 0 = one exchange
    /// per chunk. (Python: `placement_cells`, its historical name.)
    pub exchanges: usize,
    /// How far above the balanced maximum (a fraction) the final placement may leave a bin's
    /// aggregate load.
    pub slack: f64,
    /// How far above it the first fluctuation pass may go before the tightening pass brings
    /// the maximum back to `slack` (a fraction, >= slack): room to reorganise. A fraction of a
    /// rank's load: the node level explores the same absolute band (`explore` / ranks per node).
    /// None, the default: [`DEFAULT_EXPLORE`] or `slack`, whichever is larger
    /// ([`Options::explore`], the one home of that rule).
    pub explore: Option<f64>,
    /// Candidate swaps the fluctuation phase prices per layer (its time budget, counted).
    pub fluct_evals: usize,
    /// With `previous`: weigh keeping and incremental candidates against migration time.
    /// false = always the fresh placement, relabelled against `previous`.
    pub migration_aware: bool,
    /// Optional wall-clock cap of the whole stage (None, the default: no cap, and the clock is
    /// never read, so the placement is deterministic). When it passes, each layer not yet
    /// searched stops improving at its next phase boundary: the greedy packing stands
    /// without min-max search or fluctuation phases, and the incremental candidates are
    /// skipped (the fresh placement, relabelled against `previous`, is always there). The
    /// placement stays valid; the proxy times and migration choice are computed as usual.
    pub time_budget: Option<Duration>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            exchanges: DEFAULT_EXCHANGES,
            slack: DEFAULT_SLACK,
            explore: None,
            fluct_evals: DEFAULT_FLUCT_EVALS,
            migration_aware: DEFAULT_MIGRATION_AWARE,
            time_budget: None,
        }
    }
}

impl Options {
    /// The room the first fluctuation pass explores: `explore` where set, else the larger of
    /// [`DEFAULT_EXPLORE`] and `slack` (so a slack above the default room never makes the
    /// default invalid).
    pub fn explore(&self) -> f64 {
        self.explore.unwrap_or_else(|| DEFAULT_EXPLORE.max(self.slack))
    }

    /// Refuses a `slack` outside [0, 1] or an `explore` outside [slack, 1] (named by their
    /// Python option names).
    pub fn check(&self) -> Result<()> {
        if !(self.slack.is_finite() && (0.0..=1.0).contains(&self.slack)) {
            return Err(invalid("placement_slack", format!("must be in [0, 1], got {}", self.slack)));
        }
        let explore = self.explore();
        if !(explore.is_finite() && (self.slack..=1.0).contains(&explore)) {
            return Err(invalid("placement_explore", format!("must be in [slack={}, 1], got {explore}", self.slack)));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn explore_defaults_to_the_default_room_or_the_slack() {
        assert_eq!(Options::default().explore(), DEFAULT_EXPLORE);
        let wide = Options { slack: 0.5, ..Options::default() };
        assert_eq!(wide.explore(), 0.5);
        assert!(wide.check().is_ok());
        assert_eq!(Options { explore: Some(0.75), ..wide.clone() }.explore(), 0.75);
        let e = Options { explore: Some(0.25), ..wide }.check().unwrap_err();
        assert!(e.to_string().contains("placement_explore"), "{e}");
    }
}
