//! The hot loop of the layout search: all layers of one (group, step) after a move, evaluated
//! (and, when the move is accepted, stored in place) in one pass over layers and EP ranks.
//!
//! Every move changes a (group, step) by one source vector r = add − sub (the projected
//! demand of a sample, of the difference of two samples, or of two whole cells) entering or
//! leaving at most two EP ranks. Per layer and rank p the new rows are
//!   tok'  = tok  + ts · r            (ts ∈ {−1, 0, 1}: 0 when the samples stay in the step)
//!   same' = same + cm · r            (cm = Σ_ends sign · [p on the end's node])
//!   otot' = otot + ch · OT           (ch = Σ_ends sign · [p = end rank], OT = Σ_p r)
//!   onode'= (onode + oh1 · k1) + oh2 · k2   (k_i = sign_i · r summed over end i's node)
//!   diag' = diag + ch · r
//! The point rows (otot, onode, diag) change at the end ranks only: they are patched in
//! scalar code before a layer's pass (and restored after it when only evaluating).
//! The layer's cost is max_p (ct·tok' + hexp) + max_p (ki·(max(onode', same') − diag') +
//! ke·max(otot' − onode', tok' − same')) (see `cost`). Ranks go eight at a time into eight
//! lanes (rank p < ⌊ep/8⌋·8 to lane p mod 8, the tail to lane 0), with AVX2 when the CPU has
//! it and plain code otherwise: the same operations in the same order (separate multiply and
//! add, `x > y ? x : y` as max), so both give the same bits. Row values are whole numbers
//! (tokens), exact in f32.

/// Rows kept per (group, step, layer), each `ep` long.
pub const ROWS: usize = 5;
pub const TOK: usize = 0;
pub const SAME: usize = 1;
pub const OTOT: usize = 2;
pub const ONODE: usize = 3;
pub const DIAG: usize = 4;

/// Cost coefficients per token (all passes included).
#[derive(Clone, Copy, Debug)]
pub struct Coeffs {
    pub ct: f32,
    pub ki: f32,
    pub ke: f32,
}

/// Sizes: layers, EP ranks, nodes per group.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub layers: usize,
    pub ep: usize,
    pub nodes: usize,
}

/// A source's demand: proj `[L, ep]`, otot `[L]`, onode `[L, nodes]`.
#[derive(Clone, Copy)]
pub struct SrcView<'a> {
    pub proj: &'a [f32],
    pub otot: &'a [f32],
    pub onode: &'a [f32],
}

/// One (group, step)'s view of a move (see the module comment): `cm` (`[ep]`) the signed
/// same-node indicator, `ends[..n_ends]` the (rank, sign) of the end ranks (distinct).
#[derive(Clone, Copy)]
pub struct GmDelta<'a> {
    pub add: SrcView<'a>,
    pub sub: SrcView<'a>,
    pub cm: &'a [f32],
    pub ts: f32,
    pub ends: [(usize, f32); 2],
    pub n_ends: usize,
}

impl GmDelta<'_> {
    fn check(&self, rows: usize, hexp: usize, s: Shape) {
        assert!(rows >= s.layers * ROWS * s.ep && hexp >= s.layers * s.ep);
        for v in [self.add, self.sub] {
            assert!(v.proj.len() >= s.layers * s.ep && v.otot.len() >= s.layers && v.onode.len() >= s.layers * s.nodes);
        }
        assert!(self.cm.len() >= s.ep && s.nodes >= 1 && s.ep % s.nodes == 0);
        assert!(self.n_ends <= 2 && self.ends[..self.n_ends].iter().all(|e| e.0 < s.ep));
        assert!(self.n_ends < 2 || self.ends[0].0 != self.ends[1].0);
    }
}

/// x86's maxps: `a` if a > b, else `b`.
#[inline(always)]
fn fmax(a: f32, b: f32) -> f32 {
    if a > b {
        a
    } else {
        b
    }
}

/// Σ_l cost of layer l of `rows` (`[L, ROWS, ep]`) after `d`. `hexp` is `[L, ep]`. The
/// rows are left as they were (the two end ranks are patched during the pass and restored).
pub fn gm_cost(rows: &mut [f32], hexp: &[f32], d: &GmDelta, c: Coeffs, s: Shape, avx2: bool) -> f64 {
    d.check(rows.len(), hexp.len(), s);
    // SAFETY: lengths checked above.
    unsafe { dispatch::<false>(rows.as_mut_ptr(), hexp, d, c, s, avx2) }
}

/// Writes the rows after `d` into `rows`, with the arithmetic of `gm_cost`.
pub fn gm_apply(rows: &mut [f32], hexp: &[f32], d: &GmDelta, c: Coeffs, s: Shape, avx2: bool) {
    d.check(rows.len(), hexp.len(), s);
    // SAFETY: lengths checked above; every element is read before it is written, by the
    // same lane.
    unsafe { dispatch::<true>(rows.as_mut_ptr(), hexp, d, c, s, avx2) };
}

unsafe fn dispatch<const WRITE: bool>(rows: *mut f32, hexp: &[f32], d: &GmDelta, c: Coeffs, s: Shape, avx2: bool) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if avx2 {
        return pass_avx2::<WRITE>(rows, hexp, d, c, s);
    }
    let _ = avx2;
    pass_plain::<WRITE>(rows, hexp, d, c, s)
}

/// Patches the point rows (otot, onode, diag) of the end ranks of layer l at `b`, returning
/// the old values. otot' = otot + sign·OT, onode' = onode + k, diag' = diag + sign·r[p].
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn patch(b: *mut f32, ep: usize, ra: &[f32], rs: &[f32], d: &GmDelta, l: usize, nodes: usize) -> [[f32; 3]; 2] {
    let ot = d.add.otot[l] - d.sub.otot[l];
    let rpn = ep / nodes;
    let mut old = [[0f32; 3]; 2];
    for (i, &(p, sign)) in d.ends[..d.n_ends].iter().enumerate() {
        let node = p / rpn;
        let k = sign * (d.add.onode[l * nodes + node] - d.sub.onode[l * nodes + node]);
        old[i] = [*b.add(OTOT * ep + p), *b.add(ONODE * ep + p), *b.add(DIAG * ep + p)];
        *b.add(OTOT * ep + p) = old[i][0] + sign * ot;
        *b.add(ONODE * ep + p) = old[i][1] + k;
        *b.add(DIAG * ep + p) = old[i][2] + sign * (ra[p] - rs[p]);
    }
    old
}

#[inline(always)]
unsafe fn restore(b: *mut f32, ep: usize, d: &GmDelta, old: &[[f32; 3]; 2]) {
    for i in (0..d.n_ends).rev() {
        let p = d.ends[i].0;
        *b.add(OTOT * ep + p) = old[i][0];
        *b.add(ONODE * ep + p) = old[i][1];
        *b.add(DIAG * ep + p) = old[i][2];
    }
}

/// Ranks lo..ep of layer l in plain code (point rows already patched), lanes as in the
/// module comment.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn tail<const WRITE: bool>(b: *mut f32, h: &[f32], ra: &[f32], rs: &[f32], d: &GmDelta, c: Coeffs, ep: usize, lo: usize, em: &mut [f32; 8], am: &mut [f32; 8]) {
    let full = ep / 8 * 8;
    for p in lo..ep {
        let j = if p < full { p % 8 } else { 0 };
        let r = ra[p] - rs[p];
        let t = *b.add(TOK * ep + p) + d.ts * r;
        let sm = *b.add(SAME * ep + p) + d.cm[p] * r;
        let (a, n, dg) = (*b.add(OTOT * ep + p), *b.add(ONODE * ep + p), *b.add(DIAG * ep + p));
        em[j] = fmax(em[j], c.ct * t + h[p]);
        am[j] = fmax(am[j], c.ki * (fmax(n, sm) - dg) + c.ke * fmax(a - n, t - sm));
        if WRITE {
            *b.add(TOK * ep + p) = t;
            *b.add(SAME * ep + p) = sm;
        }
    }
}

#[inline(always)]
fn reduce(em: &[f32; 8], am: &[f32; 8]) -> f32 {
    let (mut e, mut a) = (0f32, 0f32);
    for j in 0..8 {
        e = fmax(e, em[j]);
        a = fmax(a, am[j]);
    }
    e + a
}

unsafe fn pass_plain<const WRITE: bool>(rows: *mut f32, hexp: &[f32], d: &GmDelta, c: Coeffs, s: Shape) -> f64 {
    let ep = s.ep;
    let mut cost = 0.0f64;
    for l in 0..s.layers {
        let b = rows.add(l * ROWS * ep);
        let (h, ra, rs) = (&hexp[l * ep..(l + 1) * ep], &d.add.proj[l * ep..(l + 1) * ep], &d.sub.proj[l * ep..(l + 1) * ep]);
        let old = patch(b, ep, ra, rs, d, l, s.nodes);
        let (mut em, mut am) = ([0f32; 8], [0f32; 8]);
        tail::<WRITE>(b, h, ra, rs, d, c, ep, 0, &mut em, &mut am);
        if !WRITE {
            restore(b, ep, d, &old);
        }
        cost += reduce(&em, &am) as f64;
    }
    cost
}

/// `pass_plain` with AVX2 for the first ⌊ep/8⌋·8 ranks (`_mm256_max_ps(x, y)` is
/// `x > y ? x : y`). tok' and same' use add/sub/copy for the signs ±1/0, which gives the same
/// bits as the multiply by ±1.0/0.0 of the plain code (rows are >= +0).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn pass_avx2<const WRITE: bool>(rows: *mut f32, hexp: &[f32], d: &GmDelta, c: Coeffs, s: Shape) -> f64 {
    use std::arch::x86_64::*;
    let ep = s.ep;
    let full = ep / 8 * 8;
    let rpn = ep / s.nodes;
    // the same-node sign of each 8-rank chunk, when chunks do not straddle nodes
    let aligned = rpn % 8 == 0;
    let (vct, vki, vke) = (_mm256_set1_ps(c.ct), _mm256_set1_ps(c.ki), _mm256_set1_ps(c.ke));
    let ts = d.ts;
    let mut cost = 0.0f64;
    for l in 0..s.layers {
        let b = rows.add(l * ROWS * ep);
        let (h, ra, rs) = (&hexp[l * ep..(l + 1) * ep], &d.add.proj[l * ep..(l + 1) * ep], &d.sub.proj[l * ep..(l + 1) * ep]);
        let old = patch(b, ep, ra, rs, d, l, s.nodes);
        let mut ve = _mm256_setzero_ps();
        let mut va = _mm256_setzero_ps();
        let mut p = 0;
        while p < full {
            let r = _mm256_sub_ps(_mm256_loadu_ps(ra.as_ptr().add(p)), _mm256_loadu_ps(rs.as_ptr().add(p)));
            let tok = _mm256_loadu_ps(b.add(TOK * ep + p));
            let t = if ts > 0.0 {
                _mm256_add_ps(tok, r)
            } else if ts < 0.0 {
                _mm256_sub_ps(tok, r)
            } else {
                tok
            };
            let same = _mm256_loadu_ps(b.add(SAME * ep + p));
            let sm = if aligned {
                let cmv = d.cm[p];
                if cmv > 0.0 {
                    _mm256_add_ps(same, r)
                } else if cmv < 0.0 {
                    _mm256_sub_ps(same, r)
                } else {
                    same
                }
            } else {
                _mm256_add_ps(same, _mm256_mul_ps(_mm256_loadu_ps(d.cm.as_ptr().add(p)), r))
            };
            let a = _mm256_loadu_ps(b.add(OTOT * ep + p));
            let nn = _mm256_loadu_ps(b.add(ONODE * ep + p));
            let dg = _mm256_loadu_ps(b.add(DIAG * ep + p));
            ve = _mm256_max_ps(ve, _mm256_add_ps(_mm256_mul_ps(vct, t), _mm256_loadu_ps(h.as_ptr().add(p))));
            let intra = _mm256_sub_ps(_mm256_max_ps(nn, sm), dg);
            let inter = _mm256_max_ps(_mm256_sub_ps(a, nn), _mm256_sub_ps(t, sm));
            va = _mm256_max_ps(va, _mm256_add_ps(_mm256_mul_ps(vki, intra), _mm256_mul_ps(vke, inter)));
            if WRITE {
                _mm256_storeu_ps(b.add(TOK * ep + p), t);
                _mm256_storeu_ps(b.add(SAME * ep + p), sm);
            }
            p += 8;
        }
        let layer = if full == ep {
            // max is exact on these values (all >= +0), so a lane tree gives `reduce`'s bits
            hmax(ve) + hmax(va)
        } else {
            let (mut em, mut am) = ([0f32; 8], [0f32; 8]);
            _mm256_storeu_ps(em.as_mut_ptr(), ve);
            _mm256_storeu_ps(am.as_mut_ptr(), va);
            tail::<WRITE>(b, h, ra, rs, d, c, ep, full, &mut em, &mut am);
            reduce(&em, &am)
        };
        if !WRITE {
            restore(b, ep, d, &old);
        }
        cost += layer as f64;
    }
    cost
}

/// The largest of 8 lanes (`_mm_max_ps`, exact for values >= +0 in any order).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn hmax(v: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    let m = _mm_max_ss(m, _mm_shuffle_ps::<1>(m, m));
    _mm_cvtss_f32(m)
}

/// Whether the running CPU has AVX2.
pub fn detect_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn avx2_and_plain_agree_bit_for_bit() {
        if !detect_avx2() {
            return;
        }
        for (ep, nodes) in [(1usize, 1usize), (7, 7), (8, 2), (13, 1), (16, 1), (32, 4)] {
            let layers = 3;
            let v = |n: usize, k: usize| (0..n).map(|i| ((i * 37 + k * 11) % 97) as f32 * 3.0).collect::<Vec<f32>>();
            let rows = v(layers * ROWS * ep, 0);
            let hexp = v(layers * ep, 1);
            let (pa, oa, na) = (v(layers * ep, 2), v(layers, 3), v(layers * nodes, 4));
            let (ps, os, ns) = (v(layers * ep, 5), v(layers, 6), v(layers * nodes, 7));
            let mut cm = vec![0f32; ep];
            let rpn = ep / nodes;
            let end = ep / 2;
            cm[end / rpn * rpn..(end / rpn + 1) * rpn].iter_mut().for_each(|x| *x = 1.0);
            let d = GmDelta {
                add: SrcView { proj: &pa, otot: &oa, onode: &na },
                sub: SrcView { proj: &ps, otot: &os, onode: &ns },
                cm: &cm,
                ts: 1.0,
                ends: [(end, 1.0), (0, 0.0)],
                n_ends: 1,
            };
            let c = Coeffs { ct: 1e-3, ki: 2e-4, ke: 3e-3 };
            let s = Shape { layers, ep, nodes };
            let mut rows2 = rows.clone();
            let x = gm_cost(&mut rows2, &hexp, &d, c, s, true);
            let y = gm_cost(&mut rows2, &hexp, &d, c, s, false);
            assert_eq!(rows2, rows, "evaluation restores the rows");
            assert_eq!(x.to_bits(), y.to_bits(), "ep {ep}");
            let (mut r1, mut r2) = (rows.clone(), rows.clone());
            gm_apply(&mut r1, &hexp, &d, c, s, true);
            gm_apply(&mut r2, &hexp, &d, c, s, false);
            assert_eq!(r1, r2);
            assert_ne!(r1, rows);
        }
    }
}
