//! One poller per Envoy process: a lease in shared data.
//!
//! Every root context (one per worker VM, plus the main thread's) runs
//! [`Lease::tick`] on its timer. The lease is the value `OWNER EXPIRES_MS` under
//! [`crate::store::LEASE_KEY`]; a context takes it when it is free or expired
//! and renews it while it holds it, always with compare-and-swap, so of any
//! number of contenders exactly one write wins. A holder that dies (VM torn
//! down, config reloaded) stops renewing; another takes over one TTL later.
//!
//! Shared data has no "create if absent": a write with no cas token always
//! succeeds. So a contender first makes the key exist (writing an empty value,
//! harmless if two do it), then competes with the cas of what it read. One
//! window remains: a slow contender's "make it exist" write can land after the
//! winner's lease and erase it. [`LeaseState::Acquired`] therefore does not
//! permit polling yet; only a lease still ours on the next tick
//! ([`LeaseState::Held`]) does. The cost is one tick of delay at start-up.

use crate::host::{SharedData, StoreError};
use crate::store::LEASE_KEY;

/// The outcome of one tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseState {
    /// Someone else holds the lease.
    NotHeld,
    /// Taken this tick: wait one more tick before acting on it.
    Acquired,
    /// Held since an earlier tick and renewed: this context is the poller.
    Held,
}

/// This context's side of the lease.
#[derive(Debug, Clone)]
pub struct Lease {
    owner: u64,
    ttl_ms: u64,
    held: bool,
}

/// Parses `OWNER EXPIRES_MS`; anything else reads as free.
fn parse(value: &[u8]) -> Option<(u64, u64)> {
    let text = std::str::from_utf8(value).ok()?;
    let (owner, expires) = text.split_once(' ')?;
    Some((owner.parse().ok()?, expires.parse().ok()?))
}

impl Lease {
    /// A contender with a process-unique `owner` id.
    pub fn new(owner: u64, ttl_ms: u64) -> Self {
        Self {
            owner,
            ttl_ms,
            held: false,
        }
    }

    /// This contender's id.
    pub fn owner(&self) -> u64 {
        self.owner
    }

    /// True when the last tick left the lease with this context.
    pub fn is_held(&self) -> bool {
        self.held
    }

    /// Takes, renews, or observes the lease at `now_ms`.
    pub fn tick(&mut self, store: &mut dyn SharedData, now_ms: u64) -> LeaseState {
        match self.try_tick(store, now_ms) {
            Ok(state) => {
                self.held = state != LeaseState::NotHeld;
                state
            }
            Err(_) => {
                self.held = false;
                LeaseState::NotHeld
            }
        }
    }

    fn try_tick(&self, store: &mut dyn SharedData, now_ms: u64) -> Result<LeaseState, StoreError> {
        let (mut value, mut cas) = store.get(LEASE_KEY)?;
        if value.is_none() || cas == 0 {
            store.set(LEASE_KEY, b"", None)?;
            (value, cas) = store.get(LEASE_KEY)?;
        }
        let current = value.as_deref().and_then(parse);
        let takeable = match current {
            Some((owner, _)) if owner == self.owner => true,
            Some((_, expires)) => expires < now_ms,
            None => true,
        };
        if !takeable {
            return Ok(LeaseState::NotHeld);
        }
        let mine = format!("{} {}", self.owner, now_ms.saturating_add(self.ttl_ms));
        match store.set(LEASE_KEY, mine.as_bytes(), Some(cas)) {
            Ok(()) if self.held => Ok(LeaseState::Held),
            Ok(()) => Ok(LeaseState::Acquired),
            Err(StoreError::CasMismatch) => Ok(LeaseState::NotHeld),
            Err(e) => Err(e),
        }
    }

    /// Gives the lease up at once (on shutdown), so a successor need not wait
    /// for the TTL.
    pub fn release(&mut self, store: &mut dyn SharedData) {
        if !self.held {
            return;
        }
        self.held = false;
        if let Ok((Some(value), cas)) = store.get(LEASE_KEY) {
            if parse(&value).is_some_and(|(owner, _)| owner == self.owner) {
                let _ = store.set(LEASE_KEY, format!("{} 0", self.owner).as_bytes(), Some(cas));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;

    #[test]
    fn one_of_many_contenders_holds_the_lease() {
        let mut store = MemoryStore::default();
        let mut leases: Vec<Lease> = (1..=4).map(|o| Lease::new(o, 1_000)).collect();
        for now in [0, 100, 200, 300] {
            let states: Vec<_> = leases.iter_mut().map(|l| l.tick(&mut store, now)).collect();
            let holders = states.iter().filter(|s| **s != LeaseState::NotHeld).count();
            assert_eq!(holders, 1, "at {now}: {states:?}");
        }
        assert!(leases[0].is_held());
    }

    #[test]
    fn acquiring_takes_a_confirming_tick_before_polling() {
        let mut store = MemoryStore::default();
        let mut a = Lease::new(1, 1_000);
        assert_eq!(a.tick(&mut store, 0), LeaseState::Acquired);
        assert_eq!(a.tick(&mut store, 100), LeaseState::Held);
    }

    #[test]
    fn an_expired_lease_is_taken_over() {
        let mut store = MemoryStore::default();
        let mut a = Lease::new(1, 1_000);
        let mut b = Lease::new(2, 1_000);
        a.tick(&mut store, 0);
        assert_eq!(b.tick(&mut store, 500), LeaseState::NotHeld);
        // a stops ticking (its VM died); b takes over after the TTL.
        assert_eq!(b.tick(&mut store, 1_001), LeaseState::Acquired);
        assert_eq!(b.tick(&mut store, 1_100), LeaseState::Held);
        // a comes back: it sees b's lease and stands down.
        assert_eq!(a.tick(&mut store, 1_200), LeaseState::NotHeld);
        assert!(!a.is_held());
    }

    #[test]
    fn a_released_lease_is_free_at_once() {
        let mut store = MemoryStore::default();
        let mut a = Lease::new(1, 10_000);
        let mut b = Lease::new(2, 10_000);
        a.tick(&mut store, 0);
        a.release(&mut store);
        assert_eq!(b.tick(&mut store, 10), LeaseState::Acquired);
    }

    #[test]
    fn an_erased_lease_is_noticed_on_the_next_tick() {
        let mut store = MemoryStore::default();
        let mut a = Lease::new(1, 1_000);
        let mut b = Lease::new(2, 1_000);
        assert_eq!(a.tick(&mut store, 0), LeaseState::Acquired);
        // A slow contender's "make it exist" write lands after a's lease.
        store.set(LEASE_KEY, b"", None).unwrap();
        assert_eq!(b.tick(&mut store, 1), LeaseState::Acquired);
        // a never reached Held, so it never polled; now it stands down.
        assert_eq!(a.tick(&mut store, 100), LeaseState::NotHeld);
        assert_eq!(b.tick(&mut store, 100), LeaseState::Held);
    }

    #[test]
    fn garbage_in_the_lease_key_reads_as_free() {
        let mut store = MemoryStore::default();
        store.set(LEASE_KEY, b"\xff nonsense", None).unwrap();
        let mut a = Lease::new(1, 1_000);
        assert_eq!(a.tick(&mut store, 0), LeaseState::Acquired);
    }
}
