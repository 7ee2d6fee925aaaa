//! Retry delays after failures: exponential in the failures in a row,
//! capped, with "equal jitter" (half fixed, half random) so a fleet of
//! gateways does not retry in lockstep.

/// The failures in a row and the jitter's random state.
#[derive(Debug, Clone)]
pub struct Backoff {
    initial_ms: u64,
    max_ms: u64,
    failures: u32,
    rng: u64,
}

impl Backoff {
    /// Delays from `initial_ms` doubling up to `max_ms`; `seed` feeds the
    /// jitter.
    pub fn new(initial_ms: u64, max_ms: u64, seed: u64) -> Self {
        Self {
            initial_ms,
            max_ms,
            failures: 0,
            // xorshift never leaves 0.
            rng: seed | 1,
        }
    }

    /// Counts a failure; returns the delay before the next attempt.
    pub fn fail(&mut self) -> u64 {
        self.failures = self.failures.saturating_add(1);
        let exp = self.failures.saturating_sub(1).min(32);
        let base = self.initial_ms.saturating_mul(1u64 << exp).min(self.max_ms);
        let half = base / 2;
        half + self.random() % (base - half).saturating_add(1)
    }

    /// A success: the next failure starts from `initial_ms` again.
    pub fn reset(&mut self) {
        self.failures = 0;
    }

    /// Failures in a row so far.
    pub fn failures(&self) -> u32 {
        self.failures
    }

    fn random(&mut self) -> u64 {
        // xorshift64: jitter needs spread, not secrecy.
        let mut x = self.rng;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.rng = x;
        x
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_double_within_equal_jitter_up_to_the_cap() {
        let mut b = Backoff::new(100, 1_000, 7);
        for (attempt, base) in [100u64, 200, 400, 800, 1_000, 1_000, 1_000]
            .into_iter()
            .enumerate()
        {
            let delay = b.fail();
            assert!(
                (base / 2..=base).contains(&delay),
                "attempt {attempt}: {delay} not in [{}, {base}]",
                base / 2
            );
        }
        assert_eq!(b.failures(), 7);
    }

    #[test]
    fn a_reset_starts_again_from_the_initial_delay() {
        let mut b = Backoff::new(100, 30_000, 7);
        for _ in 0..10 {
            b.fail();
        }
        b.reset();
        assert_eq!(b.failures(), 0);
        assert!((50..=100).contains(&b.fail()));
    }

    #[test]
    fn jitter_spreads_gateways_with_different_seeds() {
        let delays: std::collections::HashSet<u64> = (1..50u64)
            .map(|seed| Backoff::new(1_000, 30_000, seed * 7_919).fail())
            .collect();
        assert!(delays.len() > 10, "{delays:?}");
        assert!(delays.iter().all(|d| (500..=1_000).contains(d)));
    }

    #[test]
    fn huge_failure_counts_neither_overflow_nor_exceed_the_cap() {
        let mut b = Backoff::new(u64::MAX / 4, u64::MAX / 2, 3);
        for _ in 0..100 {
            assert!(b.fail() <= u64::MAX / 2);
        }
        let mut b = Backoff::new(500, 30_000, 3);
        for _ in 0..1_000 {
            assert!(b.fail() <= 30_000);
        }
    }
}
