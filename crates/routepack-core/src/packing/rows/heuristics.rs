//! Fast row heuristics: first-fit decreasing and best-fit decreasing.
//!
//! Both take samples longest first (ties by index, so results are deterministic) and return
//! rows as lists of sample indices, every row within the cap. They need every length to be in
//! [1, cap] (see `super::check_cap`). FFD keeps a max-segment tree over the rows' free room, so
//! "the first row with room" is O(log rows); BFD keeps rows ordered by room.

use std::collections::BTreeSet;

/// Sample indices, longest first, ties by index.
pub fn decreasing(seq_lens: &[i64]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..seq_lens.len()).collect();
    order.sort_by(|&a, &b| seq_lens[b].cmp(&seq_lens[a]).then(a.cmp(&b)));
    order
}

/// Max-tree over free room of up to `n` rows; unopened rows have room `cap` but are found
/// only after every open row (first fit opens rows in order).
pub(crate) struct RoomTree {
    size: usize,
    max: Vec<i64>,
}

impl RoomTree {
    pub(crate) fn new(n: usize, cap: i64) -> Self {
        let size = n.next_power_of_two().max(1);
        let mut max = vec![i64::MIN; 2 * size];
        for i in 0..n {
            max[size + i] = cap;
        }
        for i in (1..size).rev() {
            max[i] = max[2 * i].max(max[2 * i + 1]);
        }
        Self { size, max }
    }

    /// Leftmost leaf with room >= need.
    pub(crate) fn first_fit(&self, need: i64) -> Option<usize> {
        if self.max[1] < need {
            return None;
        }
        let mut i = 1;
        while i < self.size {
            i = if self.max[2 * i] >= need { 2 * i } else { 2 * i + 1 };
        }
        Some(i - self.size)
    }

    pub(crate) fn set(&mut self, leaf: usize, room: i64) {
        let mut i = leaf + self.size;
        self.max[i] = room;
        while i > 1 {
            i /= 2;
            self.max[i] = self.max[2 * i].max(self.max[2 * i + 1]);
        }
    }
}

/// First-fit decreasing: each sample into the first row (in opening order) with room.
pub fn ffd(seq_lens: &[i64], cap: i64) -> Vec<Vec<usize>> {
    let mut tree = RoomTree::new(seq_lens.len(), cap);
    let mut rows: Vec<Vec<usize>> = Vec::new();
    let mut room: Vec<i64> = Vec::new();
    for s in decreasing(seq_lens) {
        let n = seq_lens[s];
        let r = tree.first_fit(n).expect("every length is <= cap, and there is one leaf per sample");
        if r == rows.len() {
            rows.push(Vec::new());
            room.push(cap);
        }
        rows[r].push(s);
        room[r] -= n;
        tree.set(r, room[r]);
    }
    rows
}

/// Best-fit decreasing: each sample into the open row with the least room that still fits it
/// (lowest index on ties), or a new row.
pub fn bfd(seq_lens: &[i64], cap: i64) -> Vec<Vec<usize>> {
    let mut open: BTreeSet<(i64, usize)> = BTreeSet::new();
    let mut rows: Vec<Vec<usize>> = Vec::new();
    for s in decreasing(seq_lens) {
        let n = seq_lens[s];
        let (room, r) = match open.range((n, 0)..).next().copied() {
            Some(key) => {
                open.remove(&key);
                key
            }
            None => {
                rows.push(Vec::new());
                (cap, rows.len() - 1)
            }
        };
        rows[r].push(s);
        open.insert((room - n, r));
    }
    rows
}

/// Tokens of a row, in i128 (lengths near 2^62 overflow an i64 sum before any cap check).
pub fn row_tokens(row: &[usize], seq_lens: &[i64]) -> i128 {
    row.iter().map(|&s| seq_lens[s] as i128).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(rows: &[Vec<usize>], lens: &[i64], cap: i64) {
        let mut seen = vec![false; lens.len()];
        for r in rows {
            assert!(!r.is_empty());
            assert!(row_tokens(r, lens) <= cap as i128);
            for &s in r {
                assert!(!seen[s]);
                seen[s] = true;
            }
        }
        assert!(seen.iter().all(|&x| x));
    }

    #[test]
    fn ffd_and_bfd_fit_a_perfect_instance() {
        let lens = [6, 4, 7, 3, 5, 5, 2, 8];
        for rows in [ffd(&lens, 10), bfd(&lens, 10)] {
            check(&rows, &lens, 10);
            assert_eq!(rows.len(), 4);
        }
    }

    #[test]
    fn bfd_prefers_the_tightest_row() {
        // after 6 and 5 open two rows (room 4, 5), a 4 goes into the row with room 4
        let rows = bfd(&[6, 5, 4], 10);
        assert_eq!(rows, vec![vec![0, 2], vec![1]]);
        let rows = ffd(&[6, 5, 4], 10);
        assert_eq!(rows, vec![vec![0, 2], vec![1]]);
    }
}
