//! Expert counts in the dtype they are stored in: a window's demand `[S, L, E]` (and each of
//! its `[E]` rows) borrowed as int32, uint16 or uint8, so a window whose counts fit 16 or 8
//! bits is never widened to int32 (a Kimi-K2-like window is 3 GB of int32, 1.5 GB of uint16).
//!
//! Loops over counts are monomorphised per stored type: [`with_counts!`] expands its body once
//! per variant (the match runs once per slice, never per element), and the helpers here
//! (`add_to`, `sum`, ...) are built on it. Every helper widens each count exactly (to i64 or
//! f64), so results are bit-identical whichever dtype carries the same values.

use rayon::prelude::*;

/// Expands `$body` once per variant of a [`Counts`] value, with `$x` bound to the typed slice
/// (`&[i32]`, `&[u16]` or `&[u8]`): the way to write a hot loop over counts that compiles to
/// one specialised loop per stored type. Inside, widen with `as i64` / `as f64` (exact for
/// every variant).
#[macro_export]
macro_rules! with_counts {
    ($counts:expr, $x:ident => $body:expr) => {
        match $counts {
            $crate::counts::Counts::I32($x) => $body,
            $crate::counts::Counts::U16($x) => $body,
            $crate::counts::Counts::U8($x) => $body,
        }
    };
}

/// Expert counts borrowed in their stored integer type: a whole window `[S, L, E]`
/// ([`crate::WindowView::expert_tokens`]) or one `[E]` row of it
/// ([`crate::WindowView::tokens`]).
#[derive(Clone, Copy, Debug)]
pub enum Counts<'a> {
    /// int32 counts (the only signed variant; [`crate::WindowView::new`] refuses negatives).
    I32(&'a [i32]),
    /// uint16 counts: every count <= 65,535.
    U16(&'a [u16]),
    /// uint8 counts: every count <= 255.
    U8(&'a [u8]),
}

/// Counts owned in the narrowest type that holds them (what ingestion returns).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OwnedCounts {
    /// int32 counts.
    I32(Vec<i32>),
    /// uint16 counts.
    U16(Vec<u16>),
    /// uint8 counts.
    U8(Vec<u8>),
}

/// Entries per parallel task of the whole-array scans (`max`, narrowing): large enough that a
/// task outweighs its scheduling.
pub(crate) const SCAN_CHUNK: usize = 1 << 16;

/// The stored count types. `MAX` is the largest count the type holds.
pub trait Count: Copy + Send + Sync + Default + Ord + 'static {
    /// Largest value of the type, as i64.
    const MAX: i64;
    /// Largest value of the type.
    const HIGHEST: Self;
    /// Smallest value of the type.
    const LOWEST: Self;
    /// The count as i64 (exact).
    fn wide(self) -> i64;
    /// `v` in this type; the caller guarantees `0 <= v <= MAX`.
    fn narrow(v: i64) -> Self;
}

macro_rules! count_type {
    ($($t:ty),*) => {$(
        impl Count for $t {
            const MAX: i64 = <$t>::MAX as i64;
            const HIGHEST: Self = <$t>::MAX;
            const LOWEST: Self = <$t>::MIN;
            #[inline(always)]
            fn wide(self) -> i64 { self as i64 }
            #[inline(always)]
            fn narrow(v: i64) -> Self { v as $t }
        }
    )*};
}
count_type!(i32, u16, u8);

impl<'a> Counts<'a> {
    /// Entries held.
    #[inline]
    pub fn len(&self) -> usize {
        with_counts!(*self, x => x.len())
    }

    /// Whether no entry is held.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The entries `off..off + len`, in the same type. Panics when out of bounds (a caller bug:
    /// views are checked once at construction).
    #[inline]
    pub fn slice(&self, off: usize, len: usize) -> Counts<'a> {
        match *self {
            Counts::I32(x) => Counts::I32(&x[off..off + len]),
            Counts::U16(x) => Counts::U16(&x[off..off + len]),
            Counts::U8(x) => Counts::U8(&x[off..off + len]),
        }
    }

    /// Entry `i`, widened. One match per call: for loops use [`with_counts!`] or the helpers.
    #[inline]
    pub fn get(&self, i: usize) -> i64 {
        with_counts!(*self, x => i64::from(x[i]))
    }

    /// `acc[i] += self[i]` over the shorter of the two.
    #[inline]
    pub fn add_to(&self, acc: &mut [i64]) {
        with_counts!(*self, x => for (a, &c) in acc.iter_mut().zip(x.iter()) {
            *a += i64::from(c);
        })
    }

    /// `acc[i] += self[i] as f64` over the shorter of the two.
    #[inline]
    pub fn add_to_f64(&self, acc: &mut [f64]) {
        with_counts!(*self, x => for (a, &c) in acc.iter_mut().zip(x.iter()) {
            *a += f64::from(c);
        })
    }

    /// Σ entries (exact in i64: at most 2^31 per entry, far fewer than 2^32 entries per row).
    #[inline]
    pub fn sum(&self) -> i64 {
        with_counts!(*self, x => x.iter().map(|&c| i64::from(c)).sum::<i64>())
    }

    /// `out[i] = self[i]` as int32 over the shorter of the two (every stored value fits).
    #[inline]
    // the macro's int32 arm converts i32 to itself; the other arms need the conversion
    #[allow(clippy::useless_conversion)]
    pub fn copy_to_i32(&self, out: &mut [i32]) {
        with_counts!(*self, x => for (o, &c) in out.iter_mut().zip(x.iter()) {
            *o = i32::from(c);
        })
    }

    /// The entries widened, in order. One match per element: for tests and cold paths; hot
    /// loops use [`with_counts!`] or the helpers.
    pub fn iter(&self) -> impl Iterator<Item = i64> + 'a {
        let c = *self;
        (0..c.len()).map(move |i| c.get(i))
    }

    /// Largest entry (0 when empty), in parallel over the whole slice.
    pub fn max(&self) -> i64 {
        with_counts!(*self, x => x.par_chunks(SCAN_CHUNK).map(|c| c.iter().copied().max().map_or(0, i64::from)).max().unwrap_or(0).max(0))
    }

    /// The narrowest type's copy of these counts when it is narrower than the stored one,
    /// given `max`, their largest entry (>= 0); None when the stored type is already the
    /// narrowest, or when the copy cannot be allocated (the stored counts serve as they are).
    pub fn narrowed(&self, max: i64) -> Option<OwnedCounts> {
        let want = Width::of(max);
        if want >= Width::of_counts(self) {
            return None;
        }
        with_counts!(*self, x => narrow_into(x, want))
    }
}

/// The stored widths, narrowest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Width {
    U8,
    U16,
    I32,
}

impl Width {
    /// The narrowest width holding every count in `0..=max`.
    fn of(max: i64) -> Self {
        if max <= u8::MAX as i64 {
            Width::U8
        } else if max <= u16::MAX as i64 {
            Width::U16
        } else {
            Width::I32
        }
    }

    fn of_counts(c: &Counts<'_>) -> Self {
        match c {
            Counts::I32(_) => Width::I32,
            Counts::U16(_) => Width::U16,
            Counts::U8(_) => Width::U8,
        }
    }
}

/// `x` converted to `want` (every entry in range: the caller checked the maximum); None when
/// the copy cannot be allocated.
fn narrow_into<T: Count>(x: &[T], want: Width) -> Option<OwnedCounts> {
    fn conv<T: Count, U: Count>(x: &[T]) -> Option<Vec<U>> {
        let mut out = Vec::new();
        out.try_reserve_exact(x.len()).ok()?;
        out.resize(x.len(), U::default());
        out.par_chunks_mut(SCAN_CHUNK).zip(x.par_chunks(SCAN_CHUNK)).for_each(|(o, i)| {
            for (d, &s) in o.iter_mut().zip(i) {
                *d = U::narrow(s.wide());
            }
        });
        Some(out)
    }
    Some(match want {
        Width::U8 => OwnedCounts::U8(conv(x)?),
        Width::U16 => OwnedCounts::U16(conv(x)?),
        Width::I32 => OwnedCounts::I32(conv(x)?),
    })
}

impl OwnedCounts {
    /// A borrowed view of these counts.
    pub fn view(&self) -> Counts<'_> {
        match self {
            OwnedCounts::I32(v) => Counts::I32(v),
            OwnedCounts::U16(v) => Counts::U16(v),
            OwnedCounts::U8(v) => Counts::U8(v),
        }
    }

    /// An int32 copy (for tests and small tables: the planner never widens a window).
    pub fn to_i32_vec(&self) -> Vec<i32> {
        let v = self.view();
        let mut out = vec![0i32; v.len()];
        v.copy_to_i32(&mut out);
        out
    }

    /// These counts in the narrowest type that holds them (every count must be >= 0).
    pub fn into_narrowest(self) -> OwnedCounts {
        let v = self.view();
        v.narrowed(v.max()).unwrap_or(self)
    }
}

impl<'a> From<&'a [i32]> for Counts<'a> {
    fn from(x: &'a [i32]) -> Self {
        Counts::I32(x)
    }
}

impl<'a> From<&'a [u16]> for Counts<'a> {
    fn from(x: &'a [u16]) -> Self {
        Counts::U16(x)
    }
}

impl<'a> From<&'a [u8]> for Counts<'a> {
    fn from(x: &'a [u8]) -> Self {
        Counts::U8(x)
    }
}

impl<'a> From<&'a Vec<i32>> for Counts<'a> {
    fn from(x: &'a Vec<i32>) -> Self {
        Counts::I32(x)
    }
}

impl<'a> From<&'a Vec<u16>> for Counts<'a> {
    fn from(x: &'a Vec<u16>) -> Self {
        Counts::U16(x)
    }
}

impl<'a> From<&'a Vec<u8>> for Counts<'a> {
    fn from(x: &'a Vec<u8>) -> Self {
        Counts::U8(x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn narrowing_picks_the_narrowest_and_keeps_values() {
        let v = vec![0i32, 3, 255];
        let n = OwnedCounts::I32(v.clone()).into_narrowest();
        assert_eq!(n, OwnedCounts::U8(vec![0, 3, 255]));
        let n = OwnedCounts::I32(vec![0, 256, 65535]).into_narrowest();
        assert_eq!(n, OwnedCounts::U16(vec![0, 256, 65535]));
        let n = OwnedCounts::I32(vec![65536]).into_narrowest();
        assert_eq!(n, OwnedCounts::I32(vec![65536]));
        assert_eq!(OwnedCounts::U16(vec![7]).into_narrowest(), OwnedCounts::U8(vec![7]));
        let c = Counts::from(&v);
        assert_eq!((c.sum(), c.max(), c.get(2), c.len()), (258, 255, 255, 3));
        let mut acc = vec![1i64; 3];
        Counts::U8(&[1, 2, 3]).add_to(&mut acc);
        assert_eq!(acc, vec![2, 3, 4]);
        assert_eq!(Counts::U16(&[4, 5, 6]).slice(1, 2).iter().collect::<Vec<_>>(), vec![5, 6]);
    }
}
