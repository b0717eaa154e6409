//! [`BinLists`]: the items of every bin, kept sorted by the packing, in one allocation.

/// A list of at most `cap` values per bin, all in one allocation (bin b's at `b · cap`):
/// packings are built, rebuilt and cloned per layer, a vector per bin showed in profiles as
/// allocator time. `lists[b]` is bin b's list.
#[derive(Clone)]
pub struct BinLists<T> {
    data: Vec<T>,
    len: Vec<usize>,
    cap: usize,
}

impl<T: Copy + Default> BinLists<T> {
    pub(super) fn new(bins: usize, cap: usize) -> Self {
        Self { data: vec![T::default(); bins * cap], len: vec![0; bins], cap }
    }

    pub(super) fn clear(&mut self) {
        self.len.fill(0);
    }

    /// Bin b's `cap` places (its list, then unused ones).
    #[inline]
    fn room(&mut self, b: usize) -> &mut [T] {
        &mut self.data[b * self.cap..(b + 1) * self.cap]
    }

    /// Appends x to bin b's list (panics when it is full).
    #[inline]
    pub(super) fn push(&mut self, b: usize, x: T) {
        let n = self.len[b];
        self.room(b)[n] = x;
        self.len[b] = n + 1;
    }

    /// Inserts x at position `pos` of bin b's list (panics when it is full).
    #[inline]
    pub(super) fn insert(&mut self, b: usize, pos: usize, x: T) {
        let n = self.len[b];
        let r = self.room(b);
        r.copy_within(pos..n, pos + 1);
        r[pos] = x;
        self.len[b] = n + 1;
    }

    /// Removes position `pos` of bin b's list.
    #[inline]
    pub(super) fn remove(&mut self, b: usize, pos: usize) {
        let n = self.len[b];
        assert!(pos < n, "position {pos} of a list of {n}");
        self.room(b).copy_within(pos + 1..n, pos);
        self.len[b] = n - 1;
    }
}

impl<T> std::ops::Index<usize> for BinLists<T> {
    type Output = [T];

    #[inline]
    fn index(&self, b: usize) -> &[T] {
        &self.data[b * self.cap..b * self.cap + self.len[b]]
    }
}
