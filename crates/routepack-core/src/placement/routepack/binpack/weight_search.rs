//! Searches in ascending (or descending) weight lists: where a window of partner weights
//! starts and ends. The min-max, fluctuation and tightening searches find swap partners
//! with these; each returns exactly what `partition_point` would, only faster for the
//! lists' shapes (short bins, successive queries close together).

/// The first index of `xs` where `pred` (true on a prefix, false after) is false, searched
/// outwards from `hint` (same result as `xs.partition_point(pred)`).
#[inline]
pub(super) fn seek(xs: &[f64], hint: usize, pred: impl Fn(f64) -> bool) -> usize {
    let n = xs.len();
    let k = hint.min(n);
    if k < n && pred(xs[k]) {
        // forwards: the answer is in (k, n]
        let (mut lo, mut step) = (k + 1, 1);
        loop {
            let probe = k + step;
            if probe >= n || !pred(xs[probe]) {
                let end = probe.min(n);
                return lo + xs[lo..end].partition_point(|&x| pred(x));
            }
            lo = probe + 1;
            step *= 2;
        }
    }
    // backwards: the answer is in [0, k]
    let (mut hi, mut step) = (k, 1);
    loop {
        if step > k {
            return xs[..hi].partition_point(|&x| pred(x));
        }
        let probe = k - step;
        if pred(xs[probe]) {
            return probe + 1 + xs[probe + 1..hi].partition_point(|&x| pred(x));
        }
        hi = probe;
        step *= 2;
    }
}

/// How many of the ascending `ws` are below `x` (bins hold few items: a branchless count
/// beats bisection; same result as `partition_point(|y| y < x)`).
#[inline]
pub(super) fn count_below(ws: &[f64], x: f64) -> usize {
    if ws.len() > 32 {
        return ws.partition_point(|&y| y < x);
    }
    ws.iter().map(|&y| (y < x) as usize).sum()
}

/// How many of the ascending `ws` are at most `x`.
#[inline]
pub(super) fn count_at_most(ws: &[f64], x: f64) -> usize {
    if ws.len() > 32 {
        return ws.partition_point(|&y| y <= x);
    }
    ws.iter().map(|&y| (y <= x) as usize).sum()
}
