//! The pass: every rank of every layer block of one or two (group, microbatch)s after a move, built
//! (by monomorphisation) for the demand vectors the move reads, their element type, and
//! whether hexp is uniform. The module docs of `super` give the formulas.
//!
//! Every function here is `unsafe` for one reason: it reads (and with WRITE writes) through
//! raw pointers into the state, demand and hexp arrays. The contract, checked by the safe
//! entry points (`StepDelta::check`) before `dispatch`, is that every offset the pass forms
//! (`Shape`'s indexing of `blocks × ep × VALUES × LANES` state values, `demand_len` demand
//! values, `blocks × ep × LANES` hexp values) is in bounds, and that with WRITE the states are
//! writable and not aliased. V's build must also be enabled (`super::avx2`).

use super::inputs::{Coeffs, Demand, Hosted, Shape, StepDelta, LANES, R_IN, S_EX, S_IN, TOK, VALUES, X_IN};
use super::lanes::{Elem, Lanes};

/// The pass built for the demand vectors the move reads (which, and their kind) and for
/// uniform hexp (only a cost needs it).
///
/// # Safety
/// The module's contract.
#[inline(always)]
pub(super) unsafe fn choose<V: Lanes, const WRITE: bool, const N: usize>(
    state: [*mut f32; N],
    h: &Hosted,
    d: [&StepDelta; N],
    c: Coeffs,
    s: Shape,
) -> [f64; N] {
    // SAFETY: the caller's contract is forwarded; the element type follows the demand's kind.
    unsafe {
        if d[0].compact() {
            choose_sources::<V, WRITE, N, u16>(state, h, d, c, s)
        } else {
            choose_sources::<V, WRITE, N, f32>(state, h, d, c, s)
        }
    }
}

/// `choose` for one element type.
///
/// # Safety
/// The module's contract.
#[inline(always)]
unsafe fn choose_sources<V: Lanes, const WRITE: bool, const N: usize, E: Elem>(
    state: [*mut f32; N],
    h: &Hosted,
    d: [&StepDelta; N],
    c: Coeffs,
    s: Shape,
) -> [f64; N] {
    let uniform = !WRITE && h.per_layer.is_some();
    // SAFETY: the caller's contract is forwarded; R matches the sources that exist.
    unsafe {
        match (d[0].sources(), uniform) {
            (0, false) => pass::<V, WRITE, false, 0, N, E>(state, h, d, c, s),
            (1, false) => pass::<V, WRITE, false, 1, N, E>(state, h, d, c, s),
            (2, false) => pass::<V, WRITE, false, 2, N, E>(state, h, d, c, s),
            (_, false) => pass::<V, WRITE, false, 3, N, E>(state, h, d, c, s),
            (0, true) => pass::<V, WRITE, true, 0, N, E>(state, h, d, c, s),
            (1, true) => pass::<V, WRITE, true, 1, N, E>(state, h, d, c, s),
            (2, true) => pass::<V, WRITE, true, 2, N, E>(state, h, d, c, s),
            (_, true) => pass::<V, WRITE, true, 3, N, E>(state, h, d, c, s),
        }
    }
}

/// What a move does to one rank's values in a layer block: received-value coefficients (ts
/// for tok, dr for r_in, dx for x_in, all small integers as vectors) and, at an end, the
/// sent-value patch (−σ, σ·ON, σ·(OT − ON)). Every product c·r is exact (whole numbers), so
/// `x + c·r` gives the bits of an add, a subtract or nothing when c is ±1 or 0, without a
/// branch in the loop.
#[derive(Clone, Copy)]
struct Patch<V> {
    ts: V,
    dr: V,
    dx: V,
    nsign: V,
    on: V,
    oton: V,
}

/// add − sub at offset i of the demand vectors' proj parts (element type E) or, for the tail,
/// at offset i of the f32 tails `add`/`sub`; R says which vectors exist (see
/// `StepDelta::sources`). A missing vector reads as +0, with the same bits as loading zeros.
///
/// # Safety
/// Eight elements at offset i of each vector R names are readable.
#[inline(always)]
unsafe fn diff<V: Lanes, const R: u8, E: Elem>(add: *const E, sub: *const E, i: usize) -> V {
    let zero = V::splat(0.0);
    // SAFETY: the caller guarantees the eight elements at i of the vectors R names; the
    // others (null) are not touched.
    unsafe {
        match R {
            0 => E::load8::<V>(add.add(i)).sub(E::load8::<V>(sub.add(i))),
            1 => E::load8::<V>(add.add(i)),
            2 => zero.sub(E::load8::<V>(sub.add(i))),
            _ => zero,
        }
    }
}

/// One rank of one layer block with its demand difference r: reads its values at `st`, and
/// either folds its costs into `ve`/`va` (not WRITE) or stores its new values (WRITE). END:
/// the rank is an end of the move. UNIFORM: hexp is the same on every rank (`ve` then takes
/// tok, see `super`'s docs).
///
/// # Safety
/// `VALUES · LANES` f32 at `st` are readable (and with WRITE writable, unaliased); unless
/// UNIFORM, `LANES` f32 at `h` are readable.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn rank<V: Lanes, const WRITE: bool, const END: bool, const UNIFORM: bool>(
    st: *mut f32,
    h: *const f32,
    r: V,
    m: &Patch<V>,
    k: (V, V, V),
    ve: &mut V,
    va: &mut V,
) {
    // SAFETY: every offset is below VALUES · LANES (the caller's contract)
    unsafe {
        let t = V::load(st.add(TOK * LANES)).add_exact(m.ts, r);
        let ri = V::load(st.add(R_IN * LANES)).add_exact(m.dr, r);
        let xi = V::load(st.add(X_IN * LANES)).add_exact(m.dx, r);
        let (mut si, mut se) = (V::load(st.add(S_IN * LANES)), V::load(st.add(S_EX * LANES)));
        if END {
            si = si.add(m.on).add_exact(m.nsign, r);
            se = se.add(m.oton);
        }
        if WRITE {
            t.store(st.add(TOK * LANES));
            ri.store(st.add(R_IN * LANES));
            xi.store(st.add(X_IN * LANES));
            if END {
                si.store(st.add(S_IN * LANES));
                se.store(st.add(S_EX * LANES));
            }
            return;
        }
        fold::<V, UNIFORM>(t, ri, xi, si, se, h, k, ve, va);
    }
}

/// Folds a rank's compute value (tok when UNIFORM, else ct·tok + hexp) into `ve` and its
/// all-to-all value into `va`.
///
/// # Safety
/// Unless UNIFORM, `LANES` f32 at `h` are readable.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn fold<V: Lanes, const UNIFORM: bool>(t: V, ri: V, xi: V, si: V, se: V, h: *const f32, k: (V, V, V), ve: &mut V, va: &mut V) {
    let (ct, ki, ke) = k;
    // SAFETY: h is read only unless UNIFORM, when the caller guarantees it.
    *ve = if UNIFORM { ve.max(t) } else { ve.max(ct.mul(t).add(unsafe { V::load(h) })) };
    *va = va.max(ki.mul(si.max(ri)).add(ke.mul(se.max(xi))));
}

/// `rank` for a move whose microbatch's tokens change by u = ts·r with ts = ±1 on a rank that is not
/// an end: on the end's node (END_NODE) the received-within-node value takes u, elsewhere the
/// received-across-nodes value does; the other is unchanged. Two adds instead of three
/// multiply-adds, the same bits (every coefficient product is exact).
///
/// # Safety
/// `rank`'s.
#[inline(always)]
unsafe fn rank_shift<V: Lanes, const WRITE: bool, const UNIFORM: bool, const END_NODE: bool>(
    st: *mut f32,
    h: *const f32,
    u: V,
    k: (V, V, V),
    ve: &mut V,
    va: &mut V,
) {
    // SAFETY: every offset is below VALUES · LANES (the caller's contract)
    unsafe {
        let t = V::load(st.add(TOK * LANES)).add(u);
        let (mut ri, mut xi) = (V::load(st.add(R_IN * LANES)), V::load(st.add(X_IN * LANES)));
        if END_NODE {
            ri = ri.add(u);
        } else {
            xi = xi.add(u);
        }
        if WRITE {
            t.store(st.add(TOK * LANES));
            if END_NODE {
                ri.store(st.add(R_IN * LANES));
            } else {
                xi.store(st.add(X_IN * LANES));
            }
            return;
        }
        let (si, se) = (V::load(st.add(S_IN * LANES)), V::load(st.add(S_EX * LANES)));
        fold::<V, UNIFORM>(t, ri, xi, si, se, h, k, ve, va);
    }
}

/// The move's coefficients on node `node` for ranks that are not ends (`end_nodes`: the
/// node of each end, usize::MAX past `n_ends`).
#[inline(always)]
fn node_patch<V: Lanes>(d: &StepDelta, end_nodes: &[usize; 2], node: usize) -> Patch<V> {
    let cm: f32 = (0..d.n_ends).filter(|&i| end_nodes[i] == node).map(|i| d.ends[i].1).sum();
    let zero = V::splat(0.0);
    Patch { ts: V::splat(d.ts), dr: V::splat(cm), dx: V::splat(d.ts - cm), nsign: zero, on: zero, oton: zero }
}

/// Every rank of every layer block of N (group, microbatch)s that see the same demand vectors:
/// their costs after the move, or (WRITE) their new states. R: which demand vectors exist.
///
/// # Safety
/// The module's contract.
#[inline(always)]
unsafe fn pass<V: Lanes, const WRITE: bool, const UNIFORM: bool, const R: u8, const N: usize, E: Elem>(
    state: [*mut f32; N],
    h: &Hosted,
    d: [&StepDelta; N],
    c: Coeffs,
    s: Shape,
) -> [f64; N] {
    let (ep, nodes) = (s.ep, s.nodes);
    let rpn = ep / nodes;
    let k = (V::splat(c.ct), V::splat(c.ki), V::splat(c.ke));
    let ptrs = |r: Option<Demand>| r.map_or((std::ptr::null(), std::ptr::null()), |r| r.ptrs(s));
    let ((add, add_t), (sub, sub_t)) = (ptrs(d[0].add), ptrs(d[0].sub));
    let (add, sub) = (add as *const E, sub as *const E);
    let hexp = h.per_rank.as_ptr();
    // the ranks where some target has an end, in order (at most 2 per target)
    let mut stops = [usize::MAX; 4];
    let mut n_stops = 0;
    for x in &d {
        for e in &x.ends[..x.n_ends] {
            if !stops[..n_stops].contains(&e.0) {
                stops[n_stops] = e.0;
                n_stops += 1;
            }
        }
    }
    stops[..n_stops].sort_unstable();
    let end_nodes: [[usize; 2]; N] =
        std::array::from_fn(|t| std::array::from_fn(|i| if i < d[t].n_ends { d[t].ends[i].0 / rpn } else { usize::MAX }));
    let zero = V::splat(0.0);
    let mut cost = [0.0f64; N];
    // SAFETY: every pointer offset below is one of `Shape`'s indices of the layer block `blk`
    // and a rank p < ep (the values of a rank at `at(p) · VALUES`, demand at `at(p)`, the
    // tails at `otot_at`/`onode_at` − proj_len, hexp at `at(p)`), in bounds by the module's
    // contract; with WRITE only the state is written.
    unsafe {
        for blk in 0..s.blocks {
            let ot = diff::<V, R, f32>(add_t, sub_t, s.otot_at(blk * LANES) - s.proj_len());
            let (mut ve, mut va) = ([zero; N], [zero; N]);
            let at = |p: usize| (blk * ep + p) * LANES;
            let mut next = 0;
            for node in 0..nodes {
                let m: [Patch<V>; N] = std::array::from_fn(|i| node_patch(d[i], &end_nodes[i], node));
                // a move between microbatches (ts = ±1, one end): `rank_shift` applies on this node
                let shift: [Option<bool>; N] = std::array::from_fn(|i| {
                    (d[i].ts != 0.0 && d[i].n_ends == 1 && d[i].ends[0].1 == d[i].ts).then_some(end_nodes[i][0] == node)
                });
                let (mut p, hi) = (node * rpn, (node + 1) * rpn);
                loop {
                    let stop = if next < n_stops && stops[next] < hi { stops[next] } else { hi };
                    while p < stop {
                        let i = at(p);
                        let r = diff::<V, R, E>(add, sub, i);
                        for t in 0..N {
                            let (st, h) = (state[t].add(i * VALUES), hexp.add(i));
                            match shift[t] {
                                Some(en) => {
                                    let u = if d[t].ts > 0.0 { r } else { zero.sub(r) };
                                    if en {
                                        rank_shift::<V, WRITE, UNIFORM, true>(st, h, u, k, &mut ve[t], &mut va[t]);
                                    } else {
                                        rank_shift::<V, WRITE, UNIFORM, false>(st, h, u, k, &mut ve[t], &mut va[t]);
                                    }
                                }
                                None => rank::<V, WRITE, false, UNIFORM>(st, h, r, &m[t], k, &mut ve[t], &mut va[t]),
                            }
                        }
                        p += 1;
                    }
                    if p == hi {
                        break;
                    }
                    // p is an end rank of some target
                    let i = at(p);
                    let r = diff::<V, R, E>(add, sub, i);
                    for t in 0..N {
                        match d[t].ends[..d[t].n_ends].iter().find(|e| e.0 == p) {
                            Some(&(_, sign)) => {
                                let on = diff::<V, R, f32>(add_t, sub_t, s.onode_at(blk * LANES, node) - s.proj_len());
                                let sv = V::splat(sign);
                                let mut e = m[t];
                                e.dr = e.dr.sub(sv);
                                e.nsign = V::splat(-sign);
                                e.on = sv.mul(on);
                                e.oton = sv.mul(ot.sub(on));
                                rank::<V, WRITE, true, UNIFORM>(state[t].add(i * VALUES), hexp.add(i), r, &e, k, &mut ve[t], &mut va[t]);
                            }
                            None => {
                                rank::<V, WRITE, false, UNIFORM>(state[t].add(i * VALUES), hexp.add(i), r, &m[t], k, &mut ve[t], &mut va[t])
                            }
                        }
                    }
                    p += 1;
                    next += 1;
                }
            }
            if WRITE {
                continue;
            }
            for t in 0..N {
                let mut e = ve[t];
                if let (true, Some(hl)) = (UNIFORM, h.per_layer) {
                    e = k.0.mul(e).add(V::load(hl.as_ptr().add(blk * LANES)));
                }
                let (e, a) = (e.lanes(), va[t].lanes());
                for j in 0..LANES.min(s.layers - blk * LANES) {
                    cost[t] += (e[j] + a[j]) as f64;
                }
            }
        }
    }
    cost
}
