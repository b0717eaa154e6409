//! Tables whose size an argument implies, checked before they are allocated.
//!
//! Rust's infallible allocation aborts the process when it fails, and no caller (least of
//! all Python, across the FFI) can catch an abort. So a table whose length comes from an
//! argument (layers × slots of a placement, experts × replicas of `log2phy`, EPLB's replica
//! tables) is refused past [`MAX_TABLE_BYTES`], naming the argument and the bytes it would
//! take, and allocated fallibly below it: an allocation the machine cannot satisfy becomes an
//! [`Error`](crate::Error) too.
//!
//! Below the ceiling a process may still be unable to hold what a call needs (an address-space
//! limit, `RLIMIT_AS`, as containers and schedulers set; memory the system will not commit).
//! An entry point whose buffers an argument sizes therefore states what the whole call holds
//! at once, its estimate, and [`check_call`] refuses it before anything is allocated when
//! that much cannot be reserved now: the reservation is tried (address space only, never
//! touched) and released. Each estimate is written beside its call and a test compares it
//! with the call's measured peak (`tests/test_memory_limit.py`).

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

/// Refuses a call whose buffers would hold `bytes` at once (`what`: the call and its tables,
/// sized by the argument `arg`): over [`MAX_TABLE_BYTES`], or more than this process can
/// reserve now. The reservation is made fallibly, never written, and released at once (so it
/// costs address space for an instant, no memory); a call that passes allocates no more than
/// its estimate, so its own allocations then succeed unless something else took the memory
/// meanwhile (and those are fallible too).
pub fn check_call(arg: &str, what: &str, bytes: u128) -> Result<()> {
    check_bytes(arg, what, bytes)?;
    let mut probe: Vec<u8> = Vec::new();
    probe.try_reserve_exact(bytes as usize).map_err(|_| {
        invalid(
            arg,
            format!("{what} would take {bytes} bytes, which this process cannot allocate (a memory limit, or the system's memory)"),
        )
    })?;
    Ok(())
}

/// A copy of `src` as table `what` (sized by `arg`), allocated fallibly ([`with_capacity`]).
pub fn copied<T: Clone>(arg: &str, what: &str, src: &[T]) -> Result<Vec<T>> {
    let mut v = with_capacity(arg, what, src.len())?;
    v.extend_from_slice(src);
    Ok(v)
}

/// Bytes of `n` elements of `T`, exact in u128 (what an estimate adds up).
pub fn bytes_of<T>(n: usize) -> u128 {
    table_bytes(&[n], std::mem::size_of::<T>())
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
        assert_eq!(copied("x", "t", &[1, 2]).unwrap(), vec![1, 2]);
        assert!(check_call("x", "t", 1 << 20).is_ok());
        let e = check_call("num_layers", "a placement", MAX_TABLE_BYTES + 1).unwrap_err().to_string();
        assert!(e.starts_with("num_layers: a placement would take") && e.contains("ceiling"), "{e}");
    }
}
