//! A move as each (group, microbatch) it touches sees it: which demand enters and leaves, at which
//! EP ranks (`Delta`), with its sources named (`Src`).

/// Where a source vector comes from: nothing, one sample, or all samples of a cell (its
/// demand vector in the caller's per-cell table, `[cells, demand_len]`, kept by
/// `Proxy::add_sample`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Src {
    /// No demand.
    Zero,
    /// One sample's demand.
    Sample(u32),
    /// The demand of every sample of a cell.
    Cell(usize),
}

/// A move as one (group, microbatch) sees it: the demand of `add` minus that of `sub` enters EP
/// rank `ends[i].0` with sign `ends[i].1` (at most two ends), and the step's received tokens
/// change by `tok` (±1) times it, or not at all (0) when the samples stay in the step.
#[derive(Clone, Copy, Debug)]
pub struct Delta {
    /// Demand entering.
    pub add: Src,
    /// Demand leaving.
    pub sub: Src,
    /// Change of the step's received tokens: ±1 or 0.
    pub tok: f32,
    /// End ranks and their signs.
    pub ends: [(usize, f32); 2],
    /// How many of `ends` are used.
    pub n_ends: usize,
}

impl Delta {
    /// The delta of `add − sub` entering rank p with `sign`, received tokens changing by `tok`.
    pub fn one(add: Src, sub: Src, p: usize, sign: f32, tok: f32) -> Self {
        Self { add, sub, tok, ends: [(p, sign), (0, 0.0)], n_ends: 1 }
    }
    /// `add − sub` moving from rank `from` to rank `to` inside the step.
    pub fn shift(add: Src, sub: Src, from: usize, to: usize) -> Self {
        Self { add, sub, tok: 0.0, ends: [(from, -1.0), (to, 1.0)], n_ends: 2 }
    }
    /// No change (prices the state as it is).
    pub fn none() -> Self {
        Self { add: Src::Zero, sub: Src::Zero, tok: 0.0, ends: [(0, 0.0); 2], n_ends: 0 }
    }
}
