//! The hot loop of the layout search: all layers of one (group, step) after a move, evaluated
//! (and, when the move is accepted, stored) in one pass over EP ranks with eight layers per
//! SIMD vector.
//!
//! Every move changes a (group, step) by one source vector r = add − sub (the projected
//! demand of a sample, of the difference of two samples, or of two whole cells) entering or
//! leaving at most two EP ranks (the "ends"). Per layer and rank p the new rows are
//!   tok'  = tok  + ts · r            (ts ∈ {−1, 0, 1}: 0 when the samples stay in the step)
//!   same' = same + cm · r            (cm = Σ_ends sign · [p on the end's node])
//!   otot' = otot + sign · OT         at an end rank only (OT = Σ_p r)
//!   onode'= onode + sign · ON        at an end rank only (ON = r summed over its node)
//!   diag' = diag + sign · r          at an end rank only
//! The layer's cost is max_p (ct·tok' + hexp) + max_p (ki·(max(onode', same') − diag') +
//! ke·max(otot' − onode', tok' − same')) (see `cost`).
//!
//! Why layers go in the lanes: with eight layers per vector the max over ranks is a plain
//! lane-wise max as the loop walks the ranks (no horizontal reductions), a rank that is an end
//! takes its patch for all eight layers at once (the loop is split at the ends, so no branch
//! per rank), and the loop body is the same for every EP size. All arrays the kernel reads
//! are therefore blocked by eight layers ("chunks", `Shape`): state `[chunks, ep, ROWS, 8]`,
//! demand rows `[chunks, ep, 8] ++ [chunks, 8] ++ [chunks, nodes, 8]`, hexp `[chunks, ep, 8]`.
//! Lanes past the last layer hold zeros and are not summed.
//!
//! The body is written once over `Lanes` and built twice: plain (`[f32; 8]`) and AVX2. Both
//! do the same IEEE operations in the same order (separate multiply and add, `x > y ? x : y`
//! as max), so they give the same bits. Row values are whole numbers (tokens), exact in f32.

/// Rows kept per (group, step, layer, rank).
pub const ROWS: usize = 5;
pub const TOK: usize = 0;
pub const SAME: usize = 1;
pub const OTOT: usize = 2;
pub const ONODE: usize = 3;
pub const DIAG: usize = 4;
/// Layers per vector.
pub const LANES: usize = 8;

/// Cost coefficients per token (all passes included).
#[derive(Clone, Copy, Debug)]
pub struct Coeffs {
    pub ct: f32,
    pub ki: f32,
    pub ke: f32,
}

/// Sizes, and where each value lives in the blocked arrays (see the module comment).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    pub layers: usize,
    /// ⌈layers / 8⌉
    pub chunks: usize,
    pub ep: usize,
    /// Nodes per group (ep is a multiple).
    pub nodes: usize,
}

impl Shape {
    pub fn new(layers: usize, ep: usize, nodes: usize) -> Self {
        Self { layers, chunks: layers.div_ceil(LANES), ep, nodes }
    }
    /// Length of a demand row (a sample's or a cell's).
    #[inline]
    pub fn row_len(&self) -> usize {
        self.chunks * LANES * (self.ep + 1 + self.nodes)
    }
    /// Length of one (group, step)'s state.
    #[inline]
    pub fn state_len(&self) -> usize {
        self.chunks * self.ep * ROWS * LANES
    }
    /// Length of hexp.
    #[inline]
    pub fn hexp_len(&self) -> usize {
        self.chunks * self.ep * LANES
    }
    /// Demand row: tokens for EP rank p in layer l (also hexp's index).
    #[inline]
    pub fn proj_at(&self, l: usize, p: usize) -> usize {
        (l / LANES * self.ep + p) * LANES + l % LANES
    }
    /// Demand row: tokens sent in layer l.
    #[inline]
    pub fn otot_at(&self, l: usize) -> usize {
        self.chunks * self.ep * LANES + l
    }
    /// Demand row: tokens for the ranks of node n in layer l.
    #[inline]
    pub fn onode_at(&self, l: usize, n: usize) -> usize {
        self.chunks * LANES * (self.ep + 1) + (l / LANES * self.nodes + n) * LANES + l % LANES
    }
    /// State: row `row` of rank p in layer l.
    #[inline]
    pub fn state_at(&self, row: usize, l: usize, p: usize) -> usize {
        ((l / LANES * self.ep + p) * ROWS + row) * LANES + l % LANES
    }
}

/// One (group, step)'s view of a move: the demand rows `add` and `sub`, the change of its
/// received tokens `ts` (±1 or 0), and the end ranks `ends[..n_ends]` (distinct) with signs.
#[derive(Clone, Copy)]
pub struct StepDelta<'a> {
    pub add: &'a [f32],
    pub sub: &'a [f32],
    pub ts: f32,
    pub ends: [(usize, f32); 2],
    pub n_ends: usize,
}

impl StepDelta<'_> {
    fn check(&self, state: usize, hexp: usize, s: Shape) {
        assert!(state >= s.state_len() && hexp >= s.hexp_len());
        assert!(self.add.len() >= s.row_len() && self.sub.len() >= s.row_len());
        assert!(s.nodes >= 1 && s.ep % s.nodes == 0 && s.chunks * LANES >= s.layers);
        assert!(self.n_ends <= 2 && self.ends[..self.n_ends].iter().all(|e| e.0 < s.ep));
        assert!(self.n_ends < 2 || self.ends[0].0 != self.ends[1].0);
    }
}

/// Σ_l cost of layer l of the state `rows` after `d`; `rows` is not changed.
pub fn gm_cost(rows: &[f32], hexp: &[f32], d: &StepDelta, c: Coeffs, s: Shape, avx2: bool) -> f64 {
    d.check(rows.len(), hexp.len(), s);
    // SAFETY: lengths checked above; with WRITE = false nothing is written through the pointer.
    unsafe { dispatch::<false>(rows.as_ptr() as *mut f32, hexp, d, c, s, avx2) }
}

/// Writes the state after `d` into `rows`, with the arithmetic of `gm_cost`, and returns the
/// same cost.
pub fn gm_apply(rows: &mut [f32], hexp: &[f32], d: &StepDelta, c: Coeffs, s: Shape, avx2: bool) -> f64 {
    d.check(rows.len(), hexp.len(), s);
    // SAFETY: lengths checked above; each element is read before it is written.
    unsafe { dispatch::<true>(rows.as_mut_ptr(), hexp, d, c, s, avx2) }
}

unsafe fn dispatch<const WRITE: bool>(rows: *mut f32, hexp: &[f32], d: &StepDelta, c: Coeffs, s: Shape, avx2: bool) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if avx2 {
        return pass_avx2::<WRITE>(rows, hexp, d, c, s);
    }
    let _ = avx2;
    pass::<Plain, WRITE>(rows, hexp, d, c, s)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn pass_avx2<const WRITE: bool>(rows: *mut f32, hexp: &[f32], d: &StepDelta, c: Coeffs, s: Shape) -> f64 {
    pass::<avx::V8, WRITE>(rows, hexp, d, c, s)
}

/// Eight f32 lanes.
trait Lanes: Copy {
    unsafe fn load(p: *const f32) -> Self;
    unsafe fn store(self, p: *mut f32);
    fn splat(x: f32) -> Self;
    fn add(self, o: Self) -> Self;
    fn sub(self, o: Self) -> Self;
    fn mul(self, o: Self) -> Self;
    /// `self > o ? self : o`, lane by lane.
    fn max(self, o: Self) -> Self;
    fn lanes(self) -> [f32; LANES];
}

#[derive(Clone, Copy)]
struct Plain([f32; LANES]);

impl Plain {
    #[inline(always)]
    fn zip(self, o: Self, f: impl Fn(f32, f32) -> f32) -> Self {
        let mut x = self.0;
        for j in 0..LANES {
            x[j] = f(self.0[j], o.0[j]);
        }
        Plain(x)
    }
}

impl Lanes for Plain {
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        Plain(std::ptr::read_unaligned(p as *const [f32; LANES]))
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        std::ptr::write_unaligned(p as *mut [f32; LANES], self.0)
    }
    #[inline(always)]
    fn splat(x: f32) -> Self {
        Plain([x; LANES])
    }
    #[inline(always)]
    fn add(self, o: Self) -> Self {
        self.zip(o, |a, b| a + b)
    }
    #[inline(always)]
    fn sub(self, o: Self) -> Self {
        self.zip(o, |a, b| a - b)
    }
    #[inline(always)]
    fn mul(self, o: Self) -> Self {
        self.zip(o, |a, b| a * b)
    }
    #[inline(always)]
    fn max(self, o: Self) -> Self {
        self.zip(o, |a, b| if a > b { a } else { b })
    }
    #[inline(always)]
    fn lanes(self) -> [f32; LANES] {
        self.0
    }
}

#[cfg(target_arch = "x86_64")]
mod avx {
    use super::{Lanes, LANES};
    use std::arch::x86_64::*;

    #[derive(Clone, Copy)]
    pub struct V8(__m256);

    // Only reached from `pass_avx2` (AVX2 enabled), where these inline.
    impl Lanes for V8 {
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            V8(_mm256_loadu_ps(p))
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32) {
            _mm256_storeu_ps(p, self.0)
        }
        #[inline(always)]
        fn splat(x: f32) -> Self {
            unsafe { V8(_mm256_set1_ps(x)) }
        }
        #[inline(always)]
        fn add(self, o: Self) -> Self {
            unsafe { V8(_mm256_add_ps(self.0, o.0)) }
        }
        #[inline(always)]
        fn sub(self, o: Self) -> Self {
            unsafe { V8(_mm256_sub_ps(self.0, o.0)) }
        }
        #[inline(always)]
        fn mul(self, o: Self) -> Self {
            unsafe { V8(_mm256_mul_ps(self.0, o.0)) }
        }
        #[inline(always)]
        fn max(self, o: Self) -> Self {
            // maxps returns the second operand unless the first is greater: `a > b ? a : b`
            unsafe { V8(_mm256_max_ps(self.0, o.0)) }
        }
        #[inline(always)]
        fn lanes(self) -> [f32; LANES] {
            let mut x = [0f32; LANES];
            unsafe { _mm256_storeu_ps(x.as_mut_ptr(), self.0) };
            x
        }
    }
}

/// What an end rank adds to its point rows in one chunk: sign, sign·OT, sign·ON.
#[derive(Clone, Copy)]
struct EndPatch<V> {
    sign: V,
    ot: V,
    on: V,
}

/// One rank of one chunk: reads its rows at `st`, folds its costs into `ve`/`va`, and with
/// WRITE stores the new rows. END: the rank is an end of the move.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn rank<V: Lanes, const WRITE: bool, const END: bool>(
    st: *mut f32,
    h: *const f32,
    ra: *const f32,
    rs: *const f32,
    ts: f32,
    cm: V,
    k: (V, V, V),
    end: EndPatch<V>,
    ve: &mut V,
    va: &mut V,
) {
    let (ct, ki, ke) = k;
    let r = V::load(ra).sub(V::load(rs));
    let tok = V::load(st.add(TOK * LANES));
    let t = if ts > 0.0 {
        tok.add(r)
    } else if ts < 0.0 {
        tok.sub(r)
    } else {
        tok
    };
    let sm = V::load(st.add(SAME * LANES)).add(cm.mul(r));
    let (mut a, mut nn, mut dg) = (V::load(st.add(OTOT * LANES)), V::load(st.add(ONODE * LANES)), V::load(st.add(DIAG * LANES)));
    if END {
        a = a.add(end.ot);
        nn = nn.add(end.on);
        dg = dg.add(end.sign.mul(r));
    }
    *ve = ve.max(ct.mul(t).add(V::load(h)));
    let intra = nn.max(sm).sub(dg);
    let inter = a.sub(nn).max(t.sub(sm));
    *va = va.max(ki.mul(intra).add(ke.mul(inter)));
    if WRITE {
        t.store(st.add(TOK * LANES));
        sm.store(st.add(SAME * LANES));
        if END {
            a.store(st.add(OTOT * LANES));
            nn.store(st.add(ONODE * LANES));
            dg.store(st.add(DIAG * LANES));
        }
    }
}

#[inline(always)]
unsafe fn pass<V: Lanes, const WRITE: bool>(rows: *mut f32, hexp: &[f32], d: &StepDelta, c: Coeffs, s: Shape) -> f64 {
    let (ep, nodes) = (s.ep, s.nodes);
    let rpn = ep / nodes;
    let k = (V::splat(c.ct), V::splat(c.ki), V::splat(c.ke));
    let (add, sub) = (d.add.as_ptr(), d.sub.as_ptr());
    let mut ends = d.ends;
    if d.n_ends == 2 && ends[0].0 > ends[1].0 {
        ends.swap(0, 1);
    }
    let ends = &ends[..d.n_ends];
    let zero = V::splat(0.0);
    let none = EndPatch { sign: zero, ot: zero, on: zero };
    let mut cost = 0.0f64;
    for ch in 0..s.chunks {
        let ot_at = s.otot_at(ch * LANES);
        let ot = V::load(add.add(ot_at)).sub(V::load(sub.add(ot_at)));
        let (mut ve, mut va) = (zero, zero);
        let row = |p: usize| (ch * ep + p) * LANES;
        let mut next = 0;
        for node in 0..nodes {
            let cm: f32 = ends.iter().filter(|e| e.0 / rpn == node).map(|e| e.1).sum();
            let cm = V::splat(cm);
            let (mut p, hi) = (node * rpn, (node + 1) * rpn);
            loop {
                let stop = if next < ends.len() && ends[next].0 < hi { ends[next].0 } else { hi };
                while p < stop {
                    let i = row(p);
                    rank::<V, WRITE, false>(rows.add(i * ROWS), hexp.as_ptr().add(i), add.add(i), sub.add(i), d.ts, cm, k, none, &mut ve, &mut va);
                    p += 1;
                }
                if p == hi {
                    break;
                }
                // p is an end rank
                let sign = ends[next].1;
                let on_at = s.onode_at(ch * LANES, node);
                let on = V::load(add.add(on_at)).sub(V::load(sub.add(on_at)));
                let sv = V::splat(sign);
                let patch = EndPatch { sign: sv, ot: sv.mul(ot), on: sv.mul(on) };
                let i = row(p);
                rank::<V, WRITE, true>(rows.add(i * ROWS), hexp.as_ptr().add(i), add.add(i), sub.add(i), d.ts, cm, k, patch, &mut ve, &mut va);
                p += 1;
                next += 1;
            }
        }
        let (e, a) = (ve.lanes(), va.lanes());
        for j in 0..LANES.min(s.layers - ch * LANES) {
            cost += (e[j] + a[j]) as f64;
        }
    }
    cost
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

    /// Whole-number test data laid out as `s` wants.
    fn data(n: usize, k: usize) -> Vec<f32> {
        (0..n).map(|i| ((i * 37 + k * 11) % 97) as f32 * 3.0).collect()
    }

    #[test]
    fn avx2_and_plain_agree_bit_for_bit() {
        if !detect_avx2() {
            return;
        }
        for (layers, ep, nodes) in [(3usize, 1usize, 1usize), (9, 7, 7), (8, 8, 2), (5, 13, 1), (17, 16, 1), (32, 32, 4)] {
            let s = Shape::new(layers, ep, nodes);
            let mut rows = data(s.state_len(), 0);
            let mut hexp = data(s.hexp_len(), 1);
            // padding lanes hold zeros, as the proxy keeps them
            for ch_l in layers..s.chunks * LANES {
                for p in 0..ep {
                    hexp[s.proj_at(ch_l, p)] = 0.0;
                    for r in 0..ROWS {
                        rows[s.state_at(r, ch_l, p)] = 0.0;
                    }
                }
            }
            let (ra, rs) = (data(s.row_len(), 2), data(s.row_len(), 5));
            let c = Coeffs { ct: 1e-3, ki: 2e-4, ke: 3e-3 };
            let deltas = [
                StepDelta { add: &ra, sub: &rs, ts: 1.0, ends: [(ep / 2, 1.0), (0, 0.0)], n_ends: 1 },
                StepDelta { add: &ra, sub: &rs, ts: -1.0, ends: [(ep - 1, -1.0), (0, 0.0)], n_ends: 1 },
                StepDelta { add: &ra, sub: &rs, ts: 0.0, ends: [(ep - 1, 1.0), (0, -1.0)], n_ends: if ep > 1 { 2 } else { 0 } },
            ];
            for d in &deltas {
                let x = gm_cost(&rows, &hexp, d, c, s, true);
                let y = gm_cost(&rows, &hexp, d, c, s, false);
                assert_eq!(x.to_bits(), y.to_bits(), "ep {ep}");
                let (mut r1, mut r2) = (rows.clone(), rows.clone());
                let x2 = gm_apply(&mut r1, &hexp, d, c, s, true);
                let y2 = gm_apply(&mut r2, &hexp, d, c, s, false);
                assert_eq!(r1, r2);
                if d.ts != 0.0 || d.n_ends > 0 {
                    assert_ne!(r1, rows);
                }
                assert_eq!((x2.to_bits(), y2.to_bits()), (x.to_bits(), x.to_bits()));
            }
        }
    }

    /// The kernel against the formula of the module comment, one (layer, rank) at a time.
    #[test]
    fn kernel_matches_the_formula() {
        let (layers, ep, nodes) = (11usize, 12usize, 3usize);
        let s = Shape::new(layers, ep, nodes);
        let rpn = ep / nodes;
        let rows = data(s.state_len(), 3);
        let hexp = data(s.hexp_len(), 4);
        let (ra, rs) = (data(s.row_len(), 6), data(s.row_len(), 8));
        let c = Coeffs { ct: 1e-3, ki: 2e-4, ke: 3e-3 };
        let d = StepDelta { add: &ra, sub: &rs, ts: 0.0, ends: [(9, 1.0), (2, -1.0)], n_ends: 2 };
        let mut want = 0.0f64;
        for l in 0..layers {
            let (mut em, mut am) = (0f32, 0f32);
            let ot = ra[s.otot_at(l)] - rs[s.otot_at(l)];
            for p in 0..ep {
                let r = ra[s.proj_at(l, p)] - rs[s.proj_at(l, p)];
                let g = |row| rows[s.state_at(row, l, p)];
                let cm: f32 = d.ends[..2].iter().filter(|e| e.0 / rpn == p / rpn).map(|e| e.1).sum();
                let t = g(TOK);
                let sm = g(SAME) + cm * r;
                let (mut a, mut nn, mut dg) = (g(OTOT), g(ONODE), g(DIAG));
                if let Some(&(_, sign)) = d.ends[..2].iter().find(|e| e.0 == p) {
                    let on = ra[s.onode_at(l, p / rpn)] - rs[s.onode_at(l, p / rpn)];
                    a += sign * ot;
                    nn += sign * on;
                    dg += sign * r;
                }
                em = em.max(c.ct * t + hexp[s.proj_at(l, p)]);
                am = am.max(c.ki * (nn.max(sm) - dg) + c.ke * (a - nn).max(t - sm));
            }
            want += (em + am) as f64;
        }
        for avx2 in [false, detect_avx2()] {
            let got = gm_cost(&rows, &hexp, &d, c, s, avx2);
            assert!((got - want).abs() <= 1e-9 * want, "{got} vs {want}");
        }
    }
}
