//! The bounded change log: which IP or service changed at which generation.
//!
//! Only the *latest* generation of each key is kept (a key that changed ten
//! times since a client's generation is sent once, in its current state), and at
//! most `capacity` keys. Dropping the oldest key raises the floor: a client whose
//! generation is below it may have missed that change and must reset.

use std::collections::{BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::Arc;

use staleguard_core::ServiceKey;

/// What changed.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum ChangeKey {
    Ip(IpAddr),
    Service(Arc<ServiceKey>),
}

#[derive(Debug)]
pub(crate) struct ChangeLog {
    by_generation: BTreeSet<(u64, ChangeKey)>,
    latest: HashMap<ChangeKey, u64>,
    capacity: usize,
    /// Clients at a generation below this may have missed a dropped change.
    floor: u64,
}

impl ChangeLog {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            by_generation: BTreeSet::new(),
            latest: HashMap::new(),
            capacity: capacity.max(1),
            floor: 0,
        }
    }

    pub(crate) fn record(&mut self, key: ChangeKey, generation: u64) {
        if let Some(old) = self.latest.insert(key.clone(), generation) {
            self.by_generation.remove(&(old, key.clone()));
        }
        self.by_generation.insert((generation, key));
        while self.latest.len() > self.capacity {
            let Some((dropped, key)) = self.by_generation.pop_first() else {
                break;
            };
            self.latest.remove(&key);
            self.floor = self.floor.max(dropped);
        }
    }

    /// Keys changed after `since`, or `None` when some may have been dropped.
    pub(crate) fn since(&self, since: u64) -> Option<impl Iterator<Item = &ChangeKey> + '_> {
        if since < self.floor {
            return None;
        }
        let start = since.checked_add(1)?;
        Some(
            self.by_generation
                .range((start, ChangeKey::Ip(IpAddr::from([0, 0, 0, 0])))..)
                .map(|(_, k)| k),
        )
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
}
