//! The hot loop of the layout search: all layers of one (group, step) after a move, evaluated
//! (or, when the move is accepted, stored) in one pass over EP ranks with eight layers per
//! SIMD vector.
//!
//! Per (layer, EP rank p) the state keeps five whole numbers of tokens: received `tok`,
//! received from the other ranks of p's node `r_in` (same − diag in `cost`'s terms), received
//! from other nodes `x_in` (tok − same), sent to the other ranks of p's node `s_in`
//! (onode − diag) and sent to other nodes `s_ex` (otot − onode). The layer's cost is
//!   max_p (ct·tok + hexp) + max_p (ki·max(s_in, r_in) + ke·max(s_ex, x_in)),
//! which is `simulate`'s expert work plus all-to-all (see `cost`).
//!
//! Every move changes a (group, step) by one source vector r = add − sub (the projected
//! demand of a sample, of the difference of two samples, or of two whole cells) entering or
//! leaving at most two EP ranks (the "ends", with signs σ). With ts ∈ {−1, 0, 1} the change of
//! the step's received tokens (0 when the samples stay in the step) and cm = Σ_ends σ·[p on the
//! end's node], the new rows are
//!   tok'  = tok  + ts·r
//!   r_in' = r_in + (cm − σ_p)·r          (σ_p = 0 unless p is an end)
//!   x_in' = x_in + (ts − cm)·r
//!   s_in' = s_in + σ_p·(ON − r)          (ON = r summed over p's node)
//!   s_ex' = s_ex + σ_p·(OT − ON)         (OT = r summed over all ranks)
//! On a node without an end only one of r_in, x_in changes, and sent tokens change at the
//! ends only. Every coefficient is a small integer: the rows stay exact in f32.
//!
//! Why layers go in the lanes: with eight layers per vector the max over ranks is a plain
//! lane-wise max as the loop walks the ranks (no horizontal reductions), a rank that is an end
//! takes its patch for all eight layers at once (the loop is split at the ends, so no branch
//! per rank), and the loop body is the same for every EP size. All arrays the kernel reads
//! are therefore blocked by eight layers ("chunks", `Shape`): state `[chunks, ep, ROWS, 8]`,
//! demand rows `[chunks, ep, 8] ++ [chunks, 8] ++ [chunks, nodes, 8]`, hexp `[chunks, ep, 8]`.
//! Lanes past the last layer hold zeros and are not summed. When every rank of a layer hosts
//! as many experts (the usual case), max_p (ct·tok + hexp) = ct·max_p tok + hexp exactly
//! (rounding is monotonic), and the loop skips hexp.
//!
//! What makes it fast (each change measured with `cargo bench --bench packing` and kept only
//! when it gave the same plans bit for bit):
//! * a move between two steps prices (and applies) both in one pass (`gm_cost_pair`), so the
//!   demand rows are read once; a missing row (a move of one sample) is not read at all;
//! * samples' rows are usually u16 (`Rows::U16`): half the bytes of a random row from L3;
//! * coefficients are exact products, not branches in the loop, and on a move between steps a
//!   rank that is not an end takes two adds (`rank_shift`).
//! The loop is then bound by streaming the two steps' state (20 KiB each at the flash size)
//! from L2.
//!
//! The body is written once over `Lanes` and built twice: plain (`[f32; 8]`) and AVX2. Both
//! do the same IEEE operations in the same order (separate multiply and add, `x > y ? x : y`
//! as max), so they give the same bits.

/// Rows kept per (group, step, layer, rank).
pub const ROWS: usize = 5;
pub const TOK: usize = 0;
pub const R_IN: usize = 1;
pub const X_IN: usize = 2;
pub const S_IN: usize = 3;
pub const S_EX: usize = 4;
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
    /// Length of a demand row's proj part (the rest, otot and onode, is its "tail").
    #[inline]
    pub fn proj_len(&self) -> usize {
        self.chunks * self.ep * LANES
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

/// A demand row as the kernel reads it: one f32 row (proj ++ tail, `Shape`), or a compact
/// one, proj in u16 (whole numbers of tokens that fit, half the bytes to stream) and the
/// tail (otot, onode: larger sums) in f32.
#[derive(Clone, Copy)]
pub enum Rows<'a> {
    F32(&'a [f32]),
    U16 { proj: &'a [u16], tail: &'a [f32] },
}

impl Rows<'_> {
    fn check(&self, s: Shape) -> bool {
        match self {
            Rows::F32(r) => r.len() >= s.row_len(),
            Rows::U16 { proj, tail } => proj.len() >= s.proj_len() && tail.len() >= s.row_len() - s.proj_len(),
        }
    }
    fn compact(&self) -> bool {
        matches!(self, Rows::U16 { .. })
    }
    /// Where the proj part and the tail start (tail offsets are `Shape::otot_at` and
    /// `onode_at` minus `proj_len`).
    fn ptrs(&self, s: Shape) -> (*const u8, *const f32) {
        match self {
            Rows::F32(r) => (r.as_ptr() as *const u8, r[s.proj_len()..].as_ptr()),
            Rows::U16 { proj, tail } => (proj.as_ptr() as *const u8, tail.as_ptr()),
        }
    }
}

/// One (group, step)'s view of a move: the demand rows `add` and `sub` (None: zeros; both of
/// one kind), the change of its received tokens `ts` (±1 or 0), and the end ranks
/// `ends[..n_ends]` (distinct) with signs.
#[derive(Clone, Copy)]
pub struct StepDelta<'a> {
    pub add: Option<Rows<'a>>,
    pub sub: Option<Rows<'a>>,
    pub ts: f32,
    pub ends: [(usize, f32); 2],
    pub n_ends: usize,
}

/// Hosted-expert cost: per (layer, rank) `[chunks, ep, 8]`, and, when it is the same for
/// every rank of each layer, that value per layer `[chunks · 8]`.
#[derive(Clone, Copy)]
pub struct Hosted<'a> {
    pub per_rank: &'a [f32],
    pub per_layer: Option<&'a [f32]>,
}

impl StepDelta<'_> {
    fn check(&self, state: usize, h: &Hosted, s: Shape) {
        assert!(state >= s.state_len() && h.per_rank.len() >= s.hexp_len());
        assert!(h.per_layer.is_none_or(|x| x.len() >= s.chunks * LANES));
        assert!(self.add.is_none_or(|r| r.check(s)) && self.sub.is_none_or(|r| r.check(s)));
        assert!(self.add.is_none() || self.sub.is_none() || self.add.is_some_and(|a| a.compact()) == self.sub.is_some_and(|b| b.compact()));
        assert!(s.nodes >= 1 && s.ep.is_multiple_of(s.nodes) && s.chunks * LANES >= s.layers);
        assert!(self.n_ends <= 2 && self.ends[..self.n_ends].iter().all(|e| e.0 < s.ep));
        assert!(self.n_ends < 2 || self.ends[0].0 != self.ends[1].0);
        assert!([self.ts].iter().chain(self.ends[..self.n_ends].iter().map(|e| &e.1)).all(|&x| x == 0.0 || x == 1.0 || x == -1.0));
    }
    /// Whether the rows are compact (u16 proj).
    fn compact(&self) -> bool {
        self.add.or(self.sub).is_some_and(|r| r.compact())
    }
    /// Which rows the kernel reads: both (0), `add` only (1), `sub` only (2), none (3).
    fn rows(&self) -> u8 {
        match (self.add.is_some(), self.sub.is_some()) {
            (true, true) => 0,
            (true, false) => 1,
            (false, true) => 2,
            (false, false) => 3,
        }
    }
}

/// Σ_l cost of layer l of the state `rows` after `d`; `rows` is not changed.
pub fn gm_cost(rows: &[f32], h: &Hosted, d: &StepDelta, c: Coeffs, s: Shape, avx2: bool) -> f64 {
    d.check(rows.len(), h, s);
    // SAFETY: lengths checked above; without WRITE nothing is written through the pointer.
    unsafe { dispatch::<false, 1>([rows.as_ptr() as *mut f32], h, [d], c, s, avx2)[0] }
}

/// `gm_cost` of two (group, step)s that see the same demand rows (a move between steps), in
/// one pass that reads the rows once.
#[allow(clippy::too_many_arguments)]
pub fn gm_cost_pair(rows_a: &[f32], rows_b: &[f32], h: &Hosted, da: &StepDelta, db: &StepDelta, c: Coeffs, s: Shape, avx2: bool) -> (f64, f64) {
    da.check(rows_a.len(), h, s);
    db.check(rows_b.len(), h, s);
    assert!(same_rows(da, db));
    // SAFETY: lengths checked above; without WRITE nothing is written through the pointers.
    let [x, y] = unsafe { dispatch::<false, 2>([rows_a.as_ptr() as *mut f32, rows_b.as_ptr() as *mut f32], h, [da, db], c, s, avx2) };
    (x, y)
}

fn same_rows(a: &StepDelta, b: &StepDelta) -> bool {
    let p = |r: Option<Rows>| {
        r.map(|x| match x {
            Rows::F32(r) => r.as_ptr() as *const u8,
            Rows::U16 { proj, .. } => proj.as_ptr() as *const u8,
        })
    };
    p(a.add) == p(b.add) && p(a.sub) == p(b.sub) && a.compact() == b.compact()
}

/// Writes the state after `d` into `rows` (the rows `gm_cost` priced).
pub fn gm_apply(rows: &mut [f32], h: &Hosted, d: &StepDelta, c: Coeffs, s: Shape, avx2: bool) {
    d.check(rows.len(), h, s);
    // SAFETY: lengths checked above; each element is read before it is written.
    unsafe { dispatch::<true, 1>([rows.as_mut_ptr()], h, [d], c, s, avx2) };
}

/// `gm_apply` to two (group, step)s that see the same demand rows, in one pass.
#[allow(clippy::too_many_arguments)]
pub fn gm_apply_pair(rows_a: &mut [f32], rows_b: &mut [f32], h: &Hosted, da: &StepDelta, db: &StepDelta, c: Coeffs, s: Shape, avx2: bool) {
    da.check(rows_a.len(), h, s);
    db.check(rows_b.len(), h, s);
    assert!(same_rows(da, db));
    // SAFETY: lengths checked above; the two states are distinct borrows; each element is
    // read before it is written.
    unsafe { dispatch::<true, 2>([rows_a.as_mut_ptr(), rows_b.as_mut_ptr()], h, [da, db], c, s, avx2) };
}

unsafe fn dispatch<const WRITE: bool, const N: usize>(rows: [*mut f32; N], h: &Hosted, d: [&StepDelta; N], c: Coeffs, s: Shape, avx2: bool) -> [f64; N] {
    #[cfg(target_arch = "x86_64")]
    if avx2 {
        return pass_avx2::<WRITE, N>(rows, h, d, c, s);
    }
    let _ = avx2;
    choose::<Plain, WRITE, N>(rows, h, d, c, s)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn pass_avx2<const WRITE: bool, const N: usize>(rows: [*mut f32; N], h: &Hosted, d: [&StepDelta; N], c: Coeffs, s: Shape) -> [f64; N] {
    choose::<avx::V8, WRITE, N>(rows, h, d, c, s)
}

/// The pass built for the rows the move reads (which, and their kind) and for uniform hexp
/// (only a cost needs it).
#[inline(always)]
unsafe fn choose<V: Lanes, const WRITE: bool, const N: usize>(rows: [*mut f32; N], h: &Hosted, d: [&StepDelta; N], c: Coeffs, s: Shape) -> [f64; N] {
    if d[0].compact() {
        choose_rows::<V, WRITE, N, u16>(rows, h, d, c, s)
    } else {
        choose_rows::<V, WRITE, N, f32>(rows, h, d, c, s)
    }
}

#[inline(always)]
unsafe fn choose_rows<V: Lanes, const WRITE: bool, const N: usize, E: Elem>(
    rows: [*mut f32; N],
    h: &Hosted,
    d: [&StepDelta; N],
    c: Coeffs,
    s: Shape,
) -> [f64; N] {
    let uniform = !WRITE && h.per_layer.is_some();
    match (d[0].rows(), uniform) {
        (0, false) => pass::<V, WRITE, false, 0, N, E>(rows, h, d, c, s),
        (1, false) => pass::<V, WRITE, false, 1, N, E>(rows, h, d, c, s),
        (2, false) => pass::<V, WRITE, false, 2, N, E>(rows, h, d, c, s),
        (_, false) => pass::<V, WRITE, false, 3, N, E>(rows, h, d, c, s),
        (0, true) => pass::<V, WRITE, true, 0, N, E>(rows, h, d, c, s),
        (1, true) => pass::<V, WRITE, true, 1, N, E>(rows, h, d, c, s),
        (2, true) => pass::<V, WRITE, true, 2, N, E>(rows, h, d, c, s),
        (_, true) => pass::<V, WRITE, true, 3, N, E>(rows, h, d, c, s),
    }
}

/// The element type of a demand row's proj part.
trait Elem: Copy {
    /// Eight values at `p` as f32 lanes.
    unsafe fn load8<V: Lanes>(p: *const Self) -> V;
}

impl Elem for f32 {
    #[inline(always)]
    unsafe fn load8<V: Lanes>(p: *const f32) -> V {
        V::load(p)
    }
}

impl Elem for u16 {
    #[inline(always)]
    unsafe fn load8<V: Lanes>(p: *const u16) -> V {
        V::load_u16(p)
    }
}

/// Eight f32 lanes.
trait Lanes: Copy {
    unsafe fn load(p: *const f32) -> Self;
    /// Eight u16 at `p`, converted (exactly) to f32.
    unsafe fn load_u16(p: *const u16) -> Self;
    unsafe fn store(self, p: *mut f32);
    fn splat(x: f32) -> Self;
    fn add(self, o: Self) -> Self;
    fn sub(self, o: Self) -> Self;
    fn mul(self, o: Self) -> Self;
    /// `self + a·b` (a multiply, then an add).
    #[inline(always)]
    fn add_exact(self, a: Self, b: Self) -> Self {
        self.add(a.mul(b))
    }
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
    unsafe fn load_u16(p: *const u16) -> Self {
        Plain(std::ptr::read_unaligned(p as *const [u16; LANES]).map(f32::from))
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
        unsafe fn load_u16(p: *const u16) -> Self {
            V8(_mm256_cvtepi32_ps(_mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i))))
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

/// What a move does to one rank's rows in a chunk: received-row coefficients (ts for tok,
/// dr for r_in, dx for x_in, all small integers as vectors) and, at an end, the sent-row
/// patch (−σ, σ·ON, σ·(OT − ON)). Every product c·r is exact (whole numbers), so
/// `x + c·r` gives the bits of an add, a subtract or nothing when c is ±1 or 0, without a
/// branch in the loop.
#[derive(Clone, Copy)]
struct Step<V> {
    ts: V,
    dr: V,
    dx: V,
    nsign: V,
    on: V,
    oton: V,
}

/// add − sub at offset i of the rows' proj parts (element type E) or, for `tail`, at offset i
/// of the f32 rows `add`/`sub`; R says which rows exist (see `StepDelta::rows`). A missing
/// row reads as +0, with the same bits as loading zeros.
#[inline(always)]
unsafe fn diff<V: Lanes, const R: u8, E: Elem>(add: *const E, sub: *const E, i: usize) -> V {
    let zero = V::splat(0.0);
    match R {
        0 => E::load8::<V>(add.add(i)).sub(E::load8::<V>(sub.add(i))),
        1 => E::load8::<V>(add.add(i)),
        2 => zero.sub(E::load8::<V>(sub.add(i))),
        _ => zero,
    }
}

/// One rank of one chunk with its demand difference r: reads its rows at `st`, and either
/// folds its costs into `ve`/`va` (not WRITE) or stores its new rows (WRITE). END: the rank
/// is an end of the move. UNIFORM: hexp is the same on every rank (`ve` then takes tok, see
/// the module comment).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn rank<V: Lanes, const WRITE: bool, const END: bool, const UNIFORM: bool>(
    st: *mut f32,
    h: *const f32,
    r: V,
    m: &Step<V>,
    k: (V, V, V),
    ve: &mut V,
    va: &mut V,
) {
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

/// Folds a rank's compute value (tok when UNIFORM, else ct·tok + hexp) into `ve` and its
/// all-to-all value into `va`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn fold<V: Lanes, const UNIFORM: bool>(t: V, ri: V, xi: V, si: V, se: V, h: *const f32, k: (V, V, V), ve: &mut V, va: &mut V) {
    let (ct, ki, ke) = k;
    *ve = if UNIFORM { ve.max(t) } else { ve.max(ct.mul(t).add(V::load(h))) };
    *va = va.max(ki.mul(si.max(ri)).add(ke.mul(se.max(xi))));
}

/// `rank` for a move whose step tokens change by u = ts·r with ts = ±1 on a rank that is not
/// an end: on the end's node (END_NODE) the received-within-node row takes u, elsewhere the
/// received-across-nodes row does; the other is unchanged. Two adds instead of three
/// multiply-adds, the same bits (every coefficient product is exact).
#[inline(always)]
unsafe fn rank_shift<V: Lanes, const WRITE: bool, const UNIFORM: bool, const END_NODE: bool>(
    st: *mut f32,
    h: *const f32,
    u: V,
    k: (V, V, V),
    ve: &mut V,
    va: &mut V,
) {
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

/// The move's coefficients on node `node` for ranks that are not ends (`end_nodes`: the
/// node of each end, usize::MAX past `n_ends`).
#[inline(always)]
fn node_step<V: Lanes>(d: &StepDelta, end_nodes: &[usize; 2], node: usize) -> Step<V> {
    let cm: f32 = (0..d.n_ends).filter(|&i| end_nodes[i] == node).map(|i| d.ends[i].1).sum();
    let zero = V::splat(0.0);
    Step { ts: V::splat(d.ts), dr: V::splat(cm), dx: V::splat(d.ts - cm), nsign: zero, on: zero, oton: zero }
}

/// Every rank of every chunk of N (group, step)s that see the same demand rows: their costs
/// after the move, or (WRITE) their new states. R: which demand rows exist.
#[inline(always)]
unsafe fn pass<V: Lanes, const WRITE: bool, const UNIFORM: bool, const R: u8, const N: usize, E: Elem>(
    rows: [*mut f32; N],
    h: &Hosted,
    d: [&StepDelta; N],
    c: Coeffs,
    s: Shape,
) -> [f64; N] {
    let (ep, nodes) = (s.ep, s.nodes);
    let rpn = ep / nodes;
    let k = (V::splat(c.ct), V::splat(c.ki), V::splat(c.ke));
    let ptrs = |r: Option<Rows>| r.map_or((std::ptr::null(), std::ptr::null()), |r| r.ptrs(s));
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
    let end_nodes: [[usize; 2]; N] = std::array::from_fn(|t| std::array::from_fn(|i| if i < d[t].n_ends { d[t].ends[i].0 / rpn } else { usize::MAX }));
    let zero = V::splat(0.0);
    let mut cost = [0.0f64; N];
    for ch in 0..s.chunks {
        let ot = diff::<V, R, f32>(add_t, sub_t, s.otot_at(ch * LANES) - s.proj_len());
        let (mut ve, mut va) = ([zero; N], [zero; N]);
        let row = |p: usize| (ch * ep + p) * LANES;
        let mut next = 0;
        for node in 0..nodes {
            let m: [Step<V>; N] = std::array::from_fn(|i| node_step(d[i], &end_nodes[i], node));
            // a move between steps (ts = ±1, one end): `rank_shift` applies on this node
            let shift: [Option<bool>; N] = std::array::from_fn(|i| {
                (d[i].ts != 0.0 && d[i].n_ends == 1 && d[i].ends[0].1 == d[i].ts).then_some(end_nodes[i][0] == node)
            });
            let (mut p, hi) = (node * rpn, (node + 1) * rpn);
            loop {
                let stop = if next < n_stops && stops[next] < hi { stops[next] } else { hi };
                while p < stop {
                    let i = row(p);
                    let r = diff::<V, R, E>(add, sub, i);
                    for t in 0..N {
                        let (st, h) = (rows[t].add(i * ROWS), hexp.add(i));
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
                let i = row(p);
                let r = diff::<V, R, E>(add, sub, i);
                for t in 0..N {
                    match d[t].ends[..d[t].n_ends].iter().find(|e| e.0 == p) {
                        Some(&(_, sign)) => {
                            let on = diff::<V, R, f32>(add_t, sub_t, s.onode_at(ch * LANES, node) - s.proj_len());
                            let sv = V::splat(sign);
                            let mut e = m[t];
                            e.dr = e.dr.sub(sv);
                            e.nsign = V::splat(-sign);
                            e.on = sv.mul(on);
                            e.oton = sv.mul(ot.sub(on));
                            rank::<V, WRITE, true, UNIFORM>(rows[t].add(i * ROWS), hexp.add(i), r, &e, k, &mut ve[t], &mut va[t]);
                        }
                        None => rank::<V, WRITE, false, UNIFORM>(rows[t].add(i * ROWS), hexp.add(i), r, &m[t], k, &mut ve[t], &mut va[t]),
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
                e = k.0.mul(e).add(V::load(hl.as_ptr().add(ch * LANES)));
            }
            let (e, a) = (e.lanes(), va[t].lanes());
            for j in 0..LANES.min(s.layers - ch * LANES) {
                cost[t] += (e[j] + a[j]) as f64;
            }
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

    /// Per (layer, rank) received, received from the node (incl. itself), sent, sent to the
    /// node (incl. itself) and sent to itself: whole numbers with same ≤ tok, diag ≤ onode ≤
    /// otot, diag ≤ same.
    fn raw(layers: usize, ep: usize, seed: usize) -> Vec<[f32; 5]> {
        (0..layers * ep)
            .map(|i| {
                let v = |k: usize| ((i * 37 + seed * 11 + k * 53) % 97) as f32;
                let diag = v(0);
                let same = diag + v(1) * 3.0;
                let tok = same + v(2) * 5.0;
                let onode = diag + v(3) * 3.0;
                let otot = onode + v(4) * 5.0;
                [tok, same, otot, onode, diag]
            })
            .collect()
    }

    /// The kernel's state of `raw` values (zeros in the padding lanes).
    fn state(raw: &[[f32; 5]], s: Shape) -> Vec<f32> {
        let mut st = vec![0f32; s.state_len()];
        for l in 0..s.layers {
            for p in 0..s.ep {
                let [tok, same, otot, onode, diag] = raw[l * s.ep + p];
                for (row, v) in [(TOK, tok), (R_IN, same - diag), (X_IN, tok - same), (S_IN, onode - diag), (S_EX, otot - onode)] {
                    st[s.state_at(row, l, p)] = v;
                }
            }
        }
        st
    }

    /// A demand row of whole numbers, otot and onode consistent with proj.
    fn demand(s: Shape, seed: usize) -> Vec<f32> {
        let mut d = vec![0f32; s.row_len()];
        let rpn = s.ep / s.nodes;
        for l in 0..s.layers {
            for p in 0..s.ep {
                let v = ((l * 31 + p * 7 + seed * 13) % 23) as f32;
                d[s.proj_at(l, p)] = v;
                d[s.otot_at(l)] += v;
                d[s.onode_at(l, p / rpn)] += v;
            }
        }
        d
    }

    fn hexp(s: Shape, uniform: bool) -> (Vec<f32>, Vec<f32>) {
        let mut per_rank = vec![0f32; s.hexp_len()];
        let mut per_layer = vec![0f32; s.chunks * LANES];
        for l in 0..s.layers {
            per_layer[l] = 0.01 * (l % 5) as f32;
            for p in 0..s.ep {
                per_rank[s.proj_at(l, p)] = if uniform { per_layer[l] } else { 0.01 * ((l + p) % 5) as f32 };
            }
        }
        (per_rank, per_layer)
    }

    /// `simulate`'s formula on the raw values after the move, one (layer, rank) at a time.
    fn formula(raw: &[[f32; 5]], h: &[f32], d: &StepDelta, c: Coeffs, s: Shape) -> (f64, Vec<[f32; 5]>) {
        let rpn = s.ep / s.nodes;
        let zero = vec![0f32; s.row_len()];
        let full = |r: Option<Rows>| match r {
            None => zero.clone(),
            Some(Rows::F32(x)) => x.to_vec(),
            Some(Rows::U16 { proj, tail }) => proj[..s.proj_len()].iter().map(|&v| v as f32).chain(tail.iter().copied()).collect(),
        };
        let (fa, fs) = (full(d.add), full(d.sub));
        let d = Row2 { add: &fa, sub: &fs, d };
        let mut cost = 0.0f64;
        let mut after = raw.to_vec();
        for l in 0..s.layers {
            let (mut em, mut am) = (0f32, 0f32);
            let ot = d.add[s.otot_at(l)] - d.sub[s.otot_at(l)];
            for p in 0..s.ep {
                let r = d.add[s.proj_at(l, p)] - d.sub[s.proj_at(l, p)];
                let cm: f32 = d.ends[..d.n_ends].iter().filter(|e| e.0 / rpn == p / rpn).map(|e| e.1).sum();
                let [mut tok, mut same, mut otot, mut onode, mut diag] = raw[l * s.ep + p];
                tok += d.ts * r;
                same += cm * r;
                if let Some(&(_, sign)) = d.ends[..d.n_ends].iter().find(|e| e.0 == p) {
                    let on = d.add[s.onode_at(l, p / rpn)] - d.sub[s.onode_at(l, p / rpn)];
                    otot += sign * ot;
                    onode += sign * on;
                    diag += sign * r;
                }
                after[l * s.ep + p] = [tok, same, otot, onode, diag];
                em = em.max(c.ct * tok + h[s.proj_at(l, p)]);
                am = am.max(c.ki * (onode.max(same) - diag) + c.ke * (otot - onode).max(tok - same));
            }
            cost += (em + am) as f64;
        }
        (cost, after)
    }

    /// A move's rows with zeros for missing ones (for `formula`).
    struct Row2<'a> {
        add: &'a [f32],
        sub: &'a [f32],
        d: &'a StepDelta<'a>,
    }

    impl<'a> std::ops::Deref for Row2<'a> {
        type Target = StepDelta<'a>;
        fn deref(&self) -> &StepDelta<'a> {
            self.d
        }
    }

    #[test]
    fn kernel_matches_the_formula_on_both_builds() {
        let c = Coeffs { ct: 1e-3, ki: 2e-4, ke: 3e-3 };
        for (layers, ep, nodes) in [(3usize, 1usize, 1usize), (9, 7, 7), (8, 8, 2), (5, 13, 1), (17, 16, 1), (11, 12, 3), (32, 32, 4)] {
            let s = Shape::new(layers, ep, nodes);
            let raw = raw(layers, ep, layers + ep);
            let rows = state(&raw, s);
            let (ra, rs) = (demand(s, 2), demand(s, 5));
            let two = ep > 1;
            let deltas = [
                StepDelta { add: Some(Rows::F32(&ra)), sub: Some(Rows::F32(&rs)), ts: 1.0, ends: [(ep / 2, 1.0), (0, 0.0)], n_ends: 1 },
                StepDelta { add: Some(Rows::F32(&ra)), sub: None, ts: -1.0, ends: [(ep - 1, -1.0), (0, 0.0)], n_ends: 1 },
                StepDelta { add: None, sub: Some(Rows::F32(&rs)), ts: 1.0, ends: [(0, 1.0), (0, 0.0)], n_ends: 1 },
                StepDelta { add: Some(Rows::F32(&ra)), sub: Some(Rows::F32(&rs)), ts: 0.0, ends: [(ep - 1, 1.0), (0, -1.0)], n_ends: if two { 2 } else { 0 } },
                StepDelta { add: Some(Rows::F32(&ra)), sub: Some(Rows::F32(&rs)), ts: 0.0, ends: [(0, 1.0), (ep - 1, -1.0)], n_ends: if two { 2 } else { 0 } },
                StepDelta { add: None, sub: None, ts: 0.0, ends: [(0, 0.0); 2], n_ends: 0 },
            ];
            for uniform in [false, true] {
                let (per_rank, per_layer) = hexp(s, uniform);
                let hosted = Hosted { per_rank: &per_rank, per_layer: uniform.then_some(&per_layer[..]) };
                for d in &deltas {
                    let (want, after) = formula(&raw, &per_rank, d, c, s);
                    let mut got = Vec::new();
                    for avx2 in [false, detect_avx2()] {
                        let x = gm_cost(&rows, &hosted, d, c, s, avx2);
                        assert_eq!(x.to_bits(), want.to_bits(), "layers {layers} ep {ep} avx2 {avx2}");
                        let mut r1 = rows.clone();
                        gm_apply(&mut r1, &hosted, d, c, s, avx2);
                        assert_eq!(r1, state(&after, s), "layers {layers} ep {ep} avx2 {avx2}");
                        got.push(r1);
                    }
                    assert_eq!(got[0], got[1]);
                }
                // a move between two steps, priced and applied in one pass
                let rows_b = state(&raw.iter().rev().copied().collect::<Vec<_>>(), s);
                let compact = |r: &[f32]| (r[..s.proj_len()].iter().map(|&v| v as u16).collect::<Vec<u16>>(), r[s.proj_len()..].to_vec());
                let ((pa, ta), (ps, tsl)) = (compact(&ra), compact(&rs));
                let (ca, cs) = (Rows::U16 { proj: &pa, tail: &ta }, Rows::U16 { proj: &ps, tail: &tsl });
                let (fa, fs) = (Rows::F32(&ra), Rows::F32(&rs));
                for (add, sub) in [(Some(fa), Some(fs)), (None, Some(fs)), (Some(fa), None), (Some(ca), Some(cs)), (None, Some(cs)), (Some(ca), None)] {
                    let da = StepDelta { add, sub, ts: 1.0, ends: [(ep / 3, 1.0), (0, 0.0)], n_ends: 1 };
                    let db = StepDelta { add, sub, ts: -1.0, ends: [(ep - 1 - ep / 3, -1.0), (0, 0.0)], n_ends: 1 };
                    let (want_a, _) = formula(&raw, &per_rank, &da, c, s);
                    for avx2 in [false, detect_avx2()] {
                        assert_eq!(gm_cost(&rows, &hosted, &da, c, s, avx2).to_bits(), want_a.to_bits());
                        let (x, y) = gm_cost_pair(&rows, &rows_b, &hosted, &da, &db, c, s, avx2);
                        assert_eq!(x.to_bits(), gm_cost(&rows, &hosted, &da, c, s, avx2).to_bits());
                        assert_eq!(y.to_bits(), gm_cost(&rows_b, &hosted, &db, c, s, avx2).to_bits());
                        let (mut a1, mut b1, mut a2, mut b2) = (rows.clone(), rows_b.clone(), rows.clone(), rows_b.clone());
                        gm_apply_pair(&mut a1, &mut b1, &hosted, &da, &db, c, s, avx2);
                        gm_apply(&mut a2, &hosted, &da, c, s, avx2);
                        gm_apply(&mut b2, &hosted, &db, c, s, avx2);
                        assert_eq!((a1, b1), (a2, b2));
                    }
                }
            }
        }
    }
}
