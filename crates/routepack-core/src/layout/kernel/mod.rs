//! The hot loop of the layout search: all layers of one (group, microbatch) after a move, evaluated
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
//! Every move changes a (group, microbatch) by one source vector r = add − sub (the projected
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
//! * a move between two microbatches prices (and applies) both in one pass (`gm_cost_pair`), so the
//!   demand vectors are read once; a missing one (a move of one sample) is not read at all;
//! * samples' demand vectors are usually u16 (`Demand::U16`): half the bytes of a random
//!   sample's demand from L3;
//! * coefficients are exact products, not branches in the loop, and on a move between microbatches a
//!   rank that is not an end takes two adds (`rank_shift`).
//!
//! The loop is then bound by streaming the two microbatches' state (20 KiB each at the flash size)
//! from L2.
//!
//! The body is written once over `Lanes` and built twice: scalar (`[f32; 8]`, `lanes`) and
//! AVX2 (`avx2`). Both do the same IEEE operations in the same order (separate multiply and
//! add, `x > y ? x : y` as max), so they give the same bits (`tests` checks both against the
//! formula, bit for bit).
//!
//! Files: `lanes` (the `Lanes` vector type and its scalar build), `avx2` (its AVX2 build and
//! the `#[target_feature]` entry), `pass` (the loop), `inputs` (shapes and inputs), this file (the safe
//! entry points). The kernel is crate-private. Its safe functions check every length the
//! pass reads and reach the AVX2 build only through a `crate::cpu::Avx2` token, which exists
//! only on a CPU with AVX2.

use crate::cpu::Avx2;

pub use inputs::{Coeffs, Demand, Hosted, Shape, StepDelta, LANES};

#[cfg(target_arch = "x86_64")]
mod avx2;
mod inputs;
mod lanes;
mod pass;
#[cfg(test)]
mod tests;

/// Σ_l cost of layer l of the state `state` after `d`; `state` is not changed. `avx2`: the
/// AVX2 build runs when given (same bits).
pub fn gm_cost(state: &[f32], h: &Hosted, d: &StepDelta, c: Coeffs, s: Shape, avx2: Option<Avx2>) -> f64 {
    d.check(state.len(), h, s);
    // SAFETY: `check` bounded every read by the lengths of `state`, the demand and `h`;
    // without WRITE nothing is written through the pointer (the cast to *mut only unifies
    // the signature).
    unsafe { dispatch::<false, 1>([state.as_ptr() as *mut f32], h, [d], c, s, avx2)[0] }
}

/// `gm_cost` of two (group, microbatch)s that see the same demand vectors (a move between microbatches),
/// in one pass that reads the demand once.
#[allow(clippy::too_many_arguments)]
pub fn gm_cost_pair(
    state_a: &[f32],
    state_b: &[f32],
    h: &Hosted,
    da: &StepDelta,
    db: &StepDelta,
    c: Coeffs,
    s: Shape,
    avx2: Option<Avx2>,
) -> (f64, f64) {
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

/// `gm_apply` to two (group, microbatch)s that see the same demand vectors, in one pass.
#[allow(clippy::too_many_arguments)]
pub fn gm_apply_pair(
    state_a: &mut [f32],
    state_b: &mut [f32],
    h: &Hosted,
    da: &StepDelta,
    db: &StepDelta,
    c: Coeffs,
    s: Shape,
    avx2: Option<Avx2>,
) {
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
unsafe fn dispatch<const WRITE: bool, const N: usize>(
    state: [*mut f32; N],
    h: &Hosted,
    d: [&StepDelta; N],
    c: Coeffs,
    s: Shape,
    avx2: Option<Avx2>,
) -> [f64; N] {
    #[cfg(target_arch = "x86_64")]
    if let Some(token) = avx2 {
        // SAFETY: the caller's bounds contract is forwarded; the token proves AVX2.
        return unsafe { self::avx2::pass::<WRITE, N>(token, state, h, d, c, s) };
    }
    let _ = avx2;
    // SAFETY: the caller's bounds contract is forwarded; the scalar build needs no feature.
    unsafe { pass::choose::<lanes::Scalar, WRITE, N>(state, h, d, c, s) }
}
