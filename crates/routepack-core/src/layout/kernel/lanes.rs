//! Eight f32 lanes (`Lanes`), the element types a demand vector's proj part is stored in
//! (`Elem`), and the scalar build of the lanes (`Scalar`, `[f32; 8]`). The AVX2 build is in
//! `super::avx2`.

use super::inputs::LANES;

/// The element type of a demand vector's proj part.
pub(super) trait Elem: Copy {
    /// Eight values at `p` as f32 lanes.
    ///
    /// # Safety
    /// Eight values at `p` must be readable, and V's build must be enabled (see `Lanes`).
    unsafe fn load8<V: Lanes>(p: *const Self) -> V;
}

impl Elem for f32 {
    #[inline(always)]
    unsafe fn load8<V: Lanes>(p: *const f32) -> V {
        // SAFETY: the caller's contract is `load`'s.
        unsafe { V::load(p) }
    }
}

impl Elem for u16 {
    #[inline(always)]
    unsafe fn load8<V: Lanes>(p: *const u16) -> V {
        // SAFETY: the caller's contract is `load_u16`'s.
        unsafe { V::load_u16(p) }
    }
}

/// Eight f32 lanes. An implementation whose operations need a CPU feature (`avx2::V8`) must
/// keep its values inside code compiled with that feature (it does: see its module docs).
pub(super) trait Lanes: Copy {
    /// Eight f32 at `p`.
    ///
    /// # Safety
    /// Eight f32 at `p` must be readable (no alignment needed).
    unsafe fn load(p: *const f32) -> Self;
    /// Eight u16 at `p`, converted (exactly) to f32.
    ///
    /// # Safety
    /// Eight u16 at `p` must be readable (no alignment needed).
    unsafe fn load_u16(p: *const u16) -> Self;
    /// Stores the lanes at `p`.
    ///
    /// # Safety
    /// Eight f32 at `p` must be writable (no alignment needed) and not aliased.
    unsafe fn store(self, p: *mut f32);
    /// All lanes `x`.
    fn splat(x: f32) -> Self;
    /// Lane-wise `+`.
    fn add(self, o: Self) -> Self;
    /// Lane-wise `−`.
    fn sub(self, o: Self) -> Self;
    /// Lane-wise `×`.
    fn mul(self, o: Self) -> Self;
    /// `self + a·b` (a multiply, then an add).
    #[inline(always)]
    fn add_exact(self, a: Self, b: Self) -> Self {
        self.add(a.mul(b))
    }
    /// `self > o ? self : o`, lane by lane.
    fn max(self, o: Self) -> Self;
    /// The lanes as an array.
    fn lanes(self) -> [f32; LANES];
}

/// The scalar build: eight f32 in an array, the same IEEE operations lane by lane.
#[derive(Clone, Copy)]
pub(super) struct Scalar([f32; LANES]);

impl Scalar {
    #[inline(always)]
    fn zip(self, o: Self, f: impl Fn(f32, f32) -> f32) -> Self {
        Scalar(std::array::from_fn(|j| f(self.0[j], o.0[j])))
    }
}

impl Lanes for Scalar {
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        // SAFETY: the caller guarantees 8 readable f32 at p; read_unaligned needs no alignment.
        Scalar(unsafe { std::ptr::read_unaligned(p as *const [f32; LANES]) })
    }
    #[inline(always)]
    unsafe fn load_u16(p: *const u16) -> Self {
        // SAFETY: the caller guarantees 8 readable u16 at p; read_unaligned needs no alignment.
        Scalar(unsafe { std::ptr::read_unaligned(p as *const [u16; LANES]) }.map(f32::from))
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        // SAFETY: the caller guarantees 8 writable, unaliased f32 at p; no alignment needed.
        unsafe { std::ptr::write_unaligned(p as *mut [f32; LANES], self.0) }
    }
    #[inline(always)]
    fn splat(x: f32) -> Self {
        Scalar([x; LANES])
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
