//! The bounded change log: which IP or service changed at which generation.
//!
//! Only the *latest* generation of each key is kept (a key that changed ten
//! times since a client's generation is sent once, in its current state), and at
//! most `capacity` keys. Dropping the oldest key raises the floor: a client whose
//! generation is below it may have missed that change and must reset.

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::Arc;

use staleguard_core::ServiceKey;

/// What changed.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum ChangeKey {
    Ip(IpAddr),
    Service(Arc<ServiceKey>),
}

/// Changes in generation order. A key that changes again leaves its older
/// place in the queue behind, stale (its generation is no longer the key's
/// latest); readers skip stale places, and the queue is compacted when they
/// outnumber the live ones. Appending is amortised O(1), where a sorted set
/// paid a tree insert and a tree removal per change.
#[derive(Debug)]
pub(crate) struct ChangeLog {
    queue: VecDeque<(u64, ChangeKey)>,
    latest: HashMap<ChangeKey, u64, ahash::RandomState>,
    capacity: usize,
    /// Clients at a generation below this may have missed a dropped change.
    floor: u64,
}

impl ChangeLog {
    /// A log of at most `capacity` keys. Its map is sized for them up front:
    /// growing it while the cluster churns would rehash on the event path.
    pub(crate) fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        Self {
            queue: VecDeque::new(),
            latest: HashMap::with_capacity_and_hasher(
                capacity.min(1 << 20),
                ahash::RandomState::new(),
            ),
            capacity,
            floor: 0,
        }
    }

    /// Records that `key` changed at `generation`, which is never below the
    /// generation of an earlier call.
    pub(crate) fn record(&mut self, key: ChangeKey, generation: u64) {
        self.latest.insert(key.clone(), generation);
        self.queue.push_back((generation, key));
        while self.latest.len() > self.capacity {
            let Some((dropped, key)) = self.queue.pop_front() else {
                break;
            };
            if self.latest.get(&key) == Some(&dropped) {
                self.latest.remove(&key);
                self.floor = self.floor.max(dropped);
            }
        }
        if self.queue.len() > 2 * self.latest.len() + 64 {
            let latest = &self.latest;
            self.queue.retain(|(g, k)| latest.get(k) == Some(g));
        }
    }

    /// Keys changed after `since`, or `None` when some may have been dropped.
    pub(crate) fn since(&self, since: u64) -> Option<impl Iterator<Item = &ChangeKey> + '_> {
        if since < self.floor {
            return None;
        }
        let start = self.queue.partition_point(|(g, _)| *g <= since);
        Some(
            self.queue
                .range(start..)
                .filter(|(g, k)| self.latest.get(k) == Some(g))
                .map(|(_, k)| k),
        )
    }

    /// The oldest generation [`Self::since`] can answer for: no key changed
    /// after it was dropped.
    pub(crate) fn floor(&self) -> u64 {
        self.floor
    }

    pub(crate) fn len(&self) -> usize {
        self.latest.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> ChangeKey {
        ChangeKey::Ip(IpAddr::from([10, 0, 0, last]))
    }

    #[test]
    fn keeps_the_latest_generation_per_key_and_raises_the_floor_when_full() {
        let mut log = ChangeLog::new(2);
        log.record(ip(1), 1);
        log.record(ip(2), 2);
        log.record(ip(1), 3);
        assert_eq!(log.len(), 2);
        let keys: Vec<_> = log.since(1).unwrap().cloned().collect();
        assert_eq!(keys, vec![ip(2), ip(1)]);
        log.record(ip(3), 4); // drops ip(2)@2
        assert!(log.since(1).is_none());
        let keys: Vec<_> = log.since(2).unwrap().cloned().collect();
        assert_eq!(keys, vec![ip(1), ip(3)]);
        assert_eq!(log.since(4).unwrap().count(), 0);
    }

    #[test]
    fn a_key_changing_over_and_over_keeps_the_queue_short() {
        let mut log = ChangeLog::new(10);
        for g in 1..=10_000 {
            log.record(ip(1), g);
        }
        log.record(ip(2), 10_001);
        assert_eq!(log.len(), 2);
        assert!(log.queue.len() <= 2 * 2 + 64 + 1, "{}", log.queue.len());
        let keys: Vec<_> = log.since(0).unwrap().cloned().collect();
        assert_eq!(keys, vec![ip(1), ip(2)]);
        let keys: Vec<_> = log.since(10_000).unwrap().cloned().collect();
        assert_eq!(keys, vec![ip(2)]);
    }
}
