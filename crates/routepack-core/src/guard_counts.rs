//! How often each argument check ran on this thread (test builds only): what shows that a
//! request checked once (`crate::request::PlanRequest`) is not checked again by the stages that
//! take it. Each guard adds its name: `request` (`PlanRequest::new`), `token_cap`
//! (`packing::rows::check_cap`), `pieces` (`split::Pieces::check`), `cost` (`CostModel::check`),
//! `topo` (`Topology::check_experts`). A leaf: it uses no other module, so the guards that
//! count themselves add no edge back to the modules they guard.

use std::cell::RefCell;
use std::collections::BTreeMap;

thread_local! {
    static COUNTS: RefCell<BTreeMap<&'static str, usize>> = const { RefCell::new(BTreeMap::new()) };
}

/// One more run of the check `name` on this thread.
pub(crate) fn add(name: &'static str) {
    COUNTS.with(|c| *c.borrow_mut().entry(name).or_default() += 1);
}

/// The counts on this thread since the last call, reset.
pub(crate) fn take() -> BTreeMap<&'static str, usize> {
    COUNTS.with(|c| std::mem::take(&mut *c.borrow_mut()))
}
