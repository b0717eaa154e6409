//! Tables whose size an argument implies, checked before they are allocated.
//!
//! Rust's infallible allocation aborts the process when it fails, and no caller (least of
//! all Python, across the FFI) can catch an abort. So a table whose length comes from an
//! argument (layers × slots of a placement, experts × replicas of `log2phy`, EPLB's replica
//! tables) is refused past [`MAX_TABLE_BYTES`], naming the argument and the bytes it would
//! take, and allocated fallibly below it: an allocation the machine cannot satisfy becomes an
//! [`Error`](crate::Error) too.

use crate::error::{invalid, Result};

/// Most bytes one table sized by an argument may take: a fixed ceiling (not a fraction of
/// this machine's memory, so whether a call is refused does not depend on the machine), far
/// above any real model's tables (a few MB) and below what a failed allocation would abort on.
pub const MAX_TABLE_BYTES: u128 = 16 << 30;

/// Bytes of a table of `dims` elements of `elem_bytes` each, exact in u128 (saturating, so
/// even absurd dimensions compare above the ceiling instead of wrapping).
pub fn table_bytes(dims: &[usize], elem_bytes: usize) -> u128 {
    dims.iter().fold(elem_bytes as u128, |acc, &d| acc.saturating_mul(d as u128))
}

/// Refuses a table `what` of `bytes` over [`MAX_TABLE_BYTES`], blaming the argument `arg`
/// that sized it.
pub fn check_bytes(arg: &str, what: &str, bytes: u128) -> Result<()> {
    if bytes > MAX_TABLE_BYTES {
        return Err(invalid(arg, format!("{what} would take {bytes} bytes, over the {MAX_TABLE_BYTES}-byte ceiling")));
    }
    Ok(())
}

/// An empty `Vec` with room for `n` elements of table `what` (sized by `arg`): refused past
/// the ceiling, and reserved fallibly below it.
pub fn with_capacity<T>(arg: &str, what: &str, n: usize) -> Result<Vec<T>> {
    let bytes = table_bytes(&[n], std::mem::size_of::<T>());
    check_bytes(arg, what, bytes)?;
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| invalid(arg, format!("{what} would take {bytes} bytes, which cannot be allocated")))?;
    Ok(v)
}

/// `n` copies of `value` as table `what` (sized by `arg`), checked as [`with_capacity`].
pub fn filled<T: Clone>(arg: &str, what: &str, n: usize, value: T) -> Result<Vec<T>> {
    let mut v = with_capacity(arg, what, n)?;
    v.resize(n, value);
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn absurd_sizes_are_refused_naming_the_argument() {
        let e = filled::<i32>("num_layers", "phy2log", usize::MAX, 0).unwrap_err().to_string();
        assert!(e.starts_with("num_layers: phy2log would take") && e.contains("ceiling"), "{e}");
        assert_eq!(table_bytes(&[usize::MAX, usize::MAX, usize::MAX], 8), u128::MAX);
        assert_eq!(filled("x", "t", 3, 7u8).unwrap(), vec![7, 7, 7]);
    }
}
