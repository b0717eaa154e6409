//! The hot loop of the layout search: all layers of one (group, step) after a move, evaluated
//! (or, when the move is accepted, stored) in one pass over EP ranks with eight layers per
//! SIMD vector.
//!
//! Per (layer, EP rank p) the state keeps five whole numbers of tokens (its "values"): received
//! `tok`, received from the other ranks of p's node `r_in` (same − diag in the terms of
//! `proxy`'s demand vectors), received
//! from other nodes `x_in` (tok − same), sent to the other ranks of p's node `s_in`
//! (onode − diag) and sent to other nodes `s_ex` (otot − onode). The layer's cost is
//!   max_p (ct·tok + hexp) + max_p (ki·max(s_in, r_in) + ke·max(s_ex, x_in)),
//! which is `simulate`'s expert work plus all-to-all (see `proxy` for what it approximates).
//!
//! Every move changes a (group, step) by one source vector r = add − sub (the projected
//! demand of a sample, of the difference of two samples, or of two whole cells) entering or
//! leaving at most two EP ranks (the "ends", with signs σ). With ts ∈ {−1, 0, 1} the change of
//! the step's received tokens (0 when the samples stay in the step) and cm = Σ_ends σ·[p on the
//! end's node], the new values are
//!   tok'  = tok  + ts·r
//!   r_in' = r_in + (cm − σ_p)·r          (σ_p = 0 unless p is an end)
//!   x_in' = x_in + (ts − cm)·r
//!   s_in' = s_in + σ_p·(ON − r)          (ON = r summed over p's node)
//!   s_ex' = s_ex + σ_p·(OT − ON)         (OT = r summed over all ranks)
//! On a node without an end only one of r_in, x_in changes, and sent tokens change at the
//! ends only. Every coefficient is a small integer: the values stay exact in f32.
//!
//! Why layers go in the lanes: with eight layers per vector the max over ranks is a plain
//! lane-wise max as the loop walks the ranks (no horizontal reductions), a rank that is an end
//! takes its patch for all eight layers at once (the loop is split at the ends, so no branch
//! per rank), and the loop body is the same for every EP size. All arrays the kernel reads
//! are therefore blocked by eight layers ("layer blocks", `Shape::blocks`): state
//! `[blocks, ep, VALUES, 8]`, demand vectors `[blocks, ep, 8] ++ [blocks, 8] ++ [blocks, nodes, 8]`,
//! hexp `[blocks, ep, 8]`.
//! Lanes past the last layer hold zeros and are not summed. When every rank of a layer hosts
//! as many experts (the usual case), max_p (ct·tok + hexp) = ct·max_p tok + hexp exactly
//! (rounding is monotonic), and the loop skips hexp.
//!
//! What makes it fast (each change measured with `cargo bench --bench packing` and kept only
//! when it gave the same plans bit for bit):
//! * a move between two steps prices (and applies) both in one pass (`gm_cost_pair`), so the
//!   demand vectors are read once; a missing one (a move of one sample) is not read at all;
//! * samples' demand vectors are usually u16 (`Demand::U16`): half the bytes of a random
//!   sample's demand from L3;
//! * coefficients are exact products, not branches in the loop, and on a move between steps a
//!   rank that is not an end takes two adds (`rank_shift`).
//!
//! The loop is then bound by streaming the two steps' state (20 KiB each at the flash size)
//! from L2.
//!
//! The body is written once over `Lanes` and built twice: scalar (`[f32; 8]`, `lanes`) and
//! AVX2 (`avx2`). Both do the same IEEE operations in the same order (separate multiply and
//! add, `x > y ? x : y` as max), so they give the same bits (`tests` checks both against the
//! formula, bit for bit).
//!
//! Files: `lanes` (the `Lanes` vector type and its scalar build), `avx2` (its AVX2 build and
//! the `#[target_feature]` entry), `pass` (the loop), this file (shapes, inputs and the safe
//! entry points). The kernel is crate-private. Its safe functions check every length the
//! pass reads and reach the AVX2 build only through a `crate::cpu::Avx2` token, which exists
//! only on a CPU with AVX2.

use crate::cpu::Avx2;

#[cfg(target_arch = "x86_64")]
mod avx2;
mod lanes;
mod pass;
#[cfg(test)]
mod tests;

/// Values kept per (group, step, layer, EP rank), at these offsets.
pub const VALUES: usize = 5;
/// Tokens the rank receives.
pub const TOK: usize = 0;
/// Tokens received from the other ranks of the rank's node.
pub const R_IN: usize = 1;
/// Tokens received from other nodes.
pub const X_IN: usize = 2;
/// Tokens sent to the other ranks of the rank's node.
pub const S_IN: usize = 3;
/// Tokens sent to other nodes.
pub const S_EX: usize = 4;
/// Layers per vector (and per layer block).
pub const LANES: usize = 8;


/// Cost coefficients per token (all passes included).
#[derive(Clone, Copy, Debug)]
pub struct Coeffs {
    /// Expert work per received token.
    pub ct: f32,
    /// All-to-all seconds per token over the intra-node link.
    pub ki: f32,
    /// All-to-all seconds per token over the inter-node link.
    pub ke: f32,
}

/// Sizes, and where each value lives in the blocked arrays (see the module comment).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    /// MoE layers.
    pub layers: usize,
    /// Layer blocks: ⌈layers / 8⌉.
    pub blocks: usize,
    /// EP ranks per group.
    pub ep: usize,
    /// Nodes per group (ep is a multiple).
    pub nodes: usize,
}

impl Shape {
    /// The shape of `layers` layers on `ep` ranks over `nodes` nodes.
    pub fn new(layers: usize, ep: usize, nodes: usize) -> Self {
        Self { layers, blocks: layers.div_ceil(LANES), ep, nodes }
    }
    /// Length of a demand vector (a sample's or a cell's).
    #[inline]
    pub fn demand_len(&self) -> usize {
        self.blocks * LANES * (self.ep + 1 + self.nodes)
    }
    /// Length of one (group, step)'s state.
    #[inline]
    pub fn state_len(&self) -> usize {
        self.blocks * self.ep * VALUES * LANES
    }
    /// Length of hexp.
    #[inline]
    pub fn hexp_len(&self) -> usize {
        self.blocks * self.ep * LANES
    }
    /// Demand vector: tokens for EP rank p in layer l (also hexp's index).
    #[inline]
    pub fn proj_at(&self, l: usize, p: usize) -> usize {
        (l / LANES * self.ep + p) * LANES + l % LANES
    }
    /// Length of a demand vector's proj part (the rest, otot and onode, is its "tail").
    #[inline]
    pub fn proj_len(&self) -> usize {
        self.blocks * self.ep * LANES
    }
    /// Demand vector: tokens sent in layer l.
    #[inline]
    pub fn otot_at(&self, l: usize) -> usize {
        self.blocks * self.ep * LANES + l
    }
    /// Demand vector: tokens for the ranks of node n in layer l.
    #[inline]
    pub fn onode_at(&self, l: usize, n: usize) -> usize {
        self.blocks * LANES * (self.ep + 1) + (l / LANES * self.nodes + n) * LANES + l % LANES
    }
    /// State: value `value` (`TOK`, …, `S_EX`) of rank p in layer l (the pass forms these
    /// offsets incrementally; the tests build states with this).
    #[cfg(test)]
    #[inline]
    pub fn state_at(&self, value: usize, l: usize, p: usize) -> usize {
        ((l / LANES * self.ep + p) * VALUES + value) * LANES + l % LANES
    }
}

/// A demand vector as the kernel reads it: one f32 vector (proj ++ tail, `Shape`), or a
/// compact one, proj in u16 (whole numbers of tokens that fit, half the bytes to stream) and
/// the tail (otot, onode: larger sums) in f32.
#[derive(Clone, Copy)]
pub enum Demand<'a> {
    /// proj ++ tail in f32.
    F32(&'a [f32]),
    /// proj in u16, the tail in f32.
    U16 {
        /// `[proj_len]`
        proj: &'a [u16],
        /// `[demand_len − proj_len]`
        tail: &'a [f32],
    },
}

impl Demand<'_> {
    fn check(&self, s: Shape) -> bool {
        match self {
            Demand::F32(r) => r.len() >= s.demand_len(),
            Demand::U16 { proj, tail } => proj.len() >= s.proj_len() && tail.len() >= s.demand_len() - s.proj_len(),
        }
    }
    fn compact(&self) -> bool {
        matches!(self, Demand::U16 { .. })
    }
    /// Where the proj part and the tail start (tail offsets are `Shape::otot_at` and
    /// `onode_at` minus `proj_len`).
    pub(super) fn ptrs(&self, s: Shape) -> (*const u8, *const f32) {
        match self {
            Demand::F32(r) => (r.as_ptr() as *const u8, r[s.proj_len()..].as_ptr()),
            Demand::U16 { proj, tail } => (proj.as_ptr() as *const u8, tail.as_ptr()),
        }
    }
}

/// One (group, step)'s view of a move: the demand vectors `add` and `sub` (None: zeros; both
/// of one kind), the change of its received tokens `ts` (±1 or 0), and the end ranks
/// `ends[..n_ends]` (distinct) with signs.
#[derive(Clone, Copy)]
pub struct StepDelta<'a> {
    /// Demand entering (None: zeros).
    pub add: Option<Demand<'a>>,
    /// Demand leaving (None: zeros).
    pub sub: Option<Demand<'a>>,
    /// Change of the step's received tokens: ±1 or 0.
    pub ts: f32,
    /// End ranks and their signs (±1).
    pub ends: [(usize, f32); 2],
    /// How many of `ends` are used (at most 2).
    pub n_ends: usize,
}

/// Hosted-expert cost: per (layer, rank) `[blocks, ep, 8]`, and, when it is the same for
/// every rank of each layer, that value per layer `[blocks · 8]`.
#[derive(Clone, Copy)]
pub struct Hosted<'a> {
    /// `[blocks, ep, 8]`
    pub per_rank: &'a [f32],
    /// `[blocks · 8]`, when uniform over the ranks of every layer.
    pub per_layer: Option<&'a [f32]>,
}

impl StepDelta<'_> {
    /// Panics unless a pass over a state of `state` values may read every input: the bounds
    /// the safe entry points rely on.
    fn check(&self, state: usize, h: &Hosted, s: Shape) {
        assert!(state >= s.state_len() && h.per_rank.len() >= s.hexp_len());
        assert!(h.per_layer.is_none_or(|x| x.len() >= s.blocks * LANES));
        assert!(self.add.is_none_or(|r| r.check(s)) && self.sub.is_none_or(|r| r.check(s)));
        assert!(self.add.is_none() || self.sub.is_none() || self.add.is_some_and(|a| a.compact()) == self.sub.is_some_and(|b| b.compact()));
        assert!(s.nodes >= 1 && s.ep.is_multiple_of(s.nodes) && s.blocks * LANES >= s.layers);
        assert!(self.n_ends <= 2 && self.ends[..self.n_ends].iter().all(|e| e.0 < s.ep));
        assert!(self.n_ends < 2 || self.ends[0].0 != self.ends[1].0);
        assert!([self.ts].iter().chain(self.ends[..self.n_ends].iter().map(|e| &e.1)).all(|&x| x == 0.0 || x == 1.0 || x == -1.0));
    }
    /// Whether the demand vectors are compact (u16 proj).
    pub(super) fn compact(&self) -> bool {
        self.add.or(self.sub).is_some_and(|r| r.compact())
    }
    /// Which demand vectors the kernel reads: both (0), `add` only (1), `sub` only (2),
    /// none (3).
    pub(super) fn sources(&self) -> u8 {
        match (self.add.is_some(), self.sub.is_some()) {
            (true, true) => 0,
            (true, false) => 1,
            (false, true) => 2,
            (false, false) => 3,
        }
    }
}

/// Σ_l cost of layer l of the state `state` after `d`; `state` is not changed. `avx2`: the
/// AVX2 build runs when given (same bits).
pub fn gm_cost(state: &[f32], h: &Hosted, d: &StepDelta, c: Coeffs, s: Shape, avx2: Option<Avx2>) -> f64 {
    d.check(state.len(), h, s);
    // SAFETY: `check` bounded every read by the lengths of `state`, the demand and `h`;
    // without WRITE nothing is written through the pointer (the cast to *mut only unifies
    // the signature).
    unsafe { dispatch::<false, 1>([state.as_ptr() as *mut f32], h, [d], c, s, avx2)[0] }
}

/// `gm_cost` of two (group, step)s that see the same demand vectors (a move between steps),
/// in one pass that reads the demand once.
#[allow(clippy::too_many_arguments)]
pub fn gm_cost_pair(state_a: &[f32], state_b: &[f32], h: &Hosted, da: &StepDelta, db: &StepDelta, c: Coeffs, s: Shape, avx2: Option<Avx2>) -> (f64, f64) {
    da.check(state_a.len(), h, s);
    db.check(state_b.len(), h, s);
    assert!(same_sources(da, db));
    // SAFETY: `check` bounded every read of both states; the pass reads the demand through
    // `da`'s pointers, which `same_sources` showed are `db`'s too; without WRITE nothing is
    // written.
    let [x, y] = unsafe { dispatch::<false, 2>([state_a.as_ptr() as *mut f32, state_b.as_ptr() as *mut f32], h, [da, db], c, s, avx2) };
    (x, y)
}

/// Whether two deltas read the same demand vectors (the pair pass reads them once).
fn same_sources(a: &StepDelta, b: &StepDelta) -> bool {
    let p = |r: Option<Demand>| {
        r.map(|x| match x {
            Demand::F32(r) => r.as_ptr() as *const u8,
            Demand::U16 { proj, .. } => proj.as_ptr() as *const u8,
        })
    };
    p(a.add) == p(b.add) && p(a.sub) == p(b.sub) && a.compact() == b.compact()
}

/// Writes the state after `d` into `state` (the state `gm_cost` priced).
pub fn gm_apply(state: &mut [f32], h: &Hosted, d: &StepDelta, c: Coeffs, s: Shape, avx2: Option<Avx2>) {
    d.check(state.len(), h, s);
    // SAFETY: `check` bounded every read and write by the lengths; `state` is borrowed
    // mutably, so nothing else aliases it; each element is read before it is written.
    unsafe { dispatch::<true, 1>([state.as_mut_ptr()], h, [d], c, s, avx2) };
}

/// `gm_apply` to two (group, step)s that see the same demand vectors, in one pass.
#[allow(clippy::too_many_arguments)]
pub fn gm_apply_pair(state_a: &mut [f32], state_b: &mut [f32], h: &Hosted, da: &StepDelta, db: &StepDelta, c: Coeffs, s: Shape, avx2: Option<Avx2>) {
    da.check(state_a.len(), h, s);
    db.check(state_b.len(), h, s);
    assert!(same_sources(da, db));
    // SAFETY: `check` bounded every access; the two states are distinct mutable borrows (no
    // aliasing); each element is read before it is written.
    unsafe { dispatch::<true, 2>([state_a.as_mut_ptr(), state_b.as_mut_ptr()], h, [da, db], c, s, avx2) };
}

/// The AVX2 build when a token says the CPU has it, else the scalar build.
///
/// # Safety
/// Every element the pass reads (the `VALUES · LANES` values per rank and layer block of each
/// state, the demand vectors of `d[0]`, `h`) must be in bounds, as `StepDelta::check` asserts;
/// with WRITE the states must be writable and not aliased.
unsafe fn dispatch<const WRITE: bool, const N: usize>(state: [*mut f32; N], h: &Hosted, d: [&StepDelta; N], c: Coeffs, s: Shape, avx2: Option<Avx2>) -> [f64; N] {
    #[cfg(target_arch = "x86_64")]
    if let Some(token) = avx2 {
        // SAFETY: the caller's bounds contract is forwarded; the token proves AVX2.
        return unsafe { self::avx2::pass::<WRITE, N>(token, state, h, d, c, s) };
    }
    let _ = avx2;
    // SAFETY: the caller's bounds contract is forwarded; the scalar build needs no feature.
    unsafe { pass::choose::<lanes::Scalar, WRITE, N>(state, h, d, c, s) }
}
