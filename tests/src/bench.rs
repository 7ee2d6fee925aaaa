//! What the examples under `tests/examples` share to read their knobs and
//! report their runs.

use std::cmp::Ordering;

/// The whole number in the environment variable `name`, or `default` when it
/// is unset or not a number (the examples' knobs: `ROUNDS`, `PODS`, ...).
pub fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The median of `v` (the upper one of an even count), sorting `v` in place.
/// Panics on an empty slice: a run that measured nothing has no median.
pub fn median<T: Copy + PartialOrd>(v: &mut [T]) -> T {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(Ordering::Equal));
    v[v.len() / 2]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_is_the_middle_or_the_upper_middle() {
        assert_eq!(median(&mut [3u64, 1, 2]), 2);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 3.0);
    }
}
