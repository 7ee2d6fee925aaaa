//! The local index in Envoy shared data: layout, encoding, and the host trait.
//!
//! One poller writes, every worker reads, with a per-request cost that does not
//! depend on the size of the index (at most three `get_shared_data` calls, each
//! copying one small value; one, of `meta`, when [`crate::cache`] has the rest):
//!
//! | key                            | value                                                    |
//! |--------------------------------|----------------------------------------------------------|
//! | `staleguard/meta`              | [`Meta`]: `m4 LOAD EPOCH GEN SYNCED_MS FRESH ENTRIES BUCKETS` |
//! | `staleguard/ipb/<B>/<i>`       | bucket `i` of `B`: `LOAD` and a line per IP, in binary (see [`crate::buckets`]), or empty |
//! | `staleguard/svc/<ns>/<name>`   | `LOAD`, or empty (absent)                                |
//! | `staleguard/lease`             | `OWNER EXPIRES_MS` (see [`crate::lease`])                |
//! | `staleguard/loads`             | last load id handed out                                  |
//! | `staleguard/members/<id>`      | a service's live members, for the replay (see [`crate::members`]) |
//!
//! Shared data cannot delete keys, so "absent" is an empty value, and IPs share
//! hash buckets so that the keys are reused as IPs come and go. Every entry
//! carries the *load* (one per full snapshot) that wrote it; readers accept an
//! entry only when its load is at least the load in `meta`. A full resync takes
//! a fresh load id, writes every bucket of the new snapshot, and then flips
//! `meta`: entries the new snapshot does not have are invalid from that moment,
//! even those the poller cannot clear (a poller that took over from a dead one
//! does not know which buckets its predecessor wrote).

use std::collections::HashMap;
use std::net::IpAddr;

use staleguard_core::{IpRecord, ServiceKey};

use crate::buckets;
use crate::entry::Entry;
use crate::host::{SharedData, StoreError};

pub mod write;

/// An in-memory [`SharedData`] with Envoy's cas semantics, for tests and fuzzing.
#[derive(Debug, Default, Clone)]
pub struct MemoryStore {
    entries: HashMap<String, (Vec<u8>, u32)>,
    next_cas: u32,
}

impl MemoryStore {
    /// Every key's value, to compare two stores (answers in pages against
    /// the same answer whole).
    #[cfg(all(test, feature = "pages"))]
    pub(crate) fn values(&self) -> std::collections::BTreeMap<String, Vec<u8>> {
        self.entries
            .iter()
            .map(|(k, (v, _))| (k.clone(), v.clone()))
            .collect()
    }

    /// Number of keys ever written (shared data never forgets a key).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when nothing was ever written.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

impl SharedData for MemoryStore {
    fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, u32), StoreError> {
        Ok(match self.entries.get(key) {
            Some((v, cas)) => (Some(v.clone()), *cas),
            None => (None, 0),
        })
    }

    fn set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        let current = self.entries.get(key).map_or(0, |(_, c)| *c);
        if let Some(cas) = cas {
            if cas != 0 && cas != current {
                return Err(StoreError::CasMismatch);
            }
        }
        self.next_cas = self.next_cas.wrapping_add(1).max(1);
        self.entries
            .insert(key.to_owned(), (value.to_vec(), self.next_cas));
        Ok(())
    }
}

/// Key of the sync state.
pub const META_KEY: &str = "staleguard/meta";
/// Key of the poller lease.
pub const LEASE_KEY: &str = "staleguard/lease";
/// Key of the load id counter.
pub const LOADS_KEY: &str = "staleguard/loads";

/// Key of one service's entry.
pub fn service_key(service: &ServiceKey) -> String {
    format!("staleguard/svc/{service}")
}

/// What the poller last achieved, as workers read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Meta {
    /// The load (full snapshot) the index belongs to.
    pub load: u64,
    /// The validator epoch.
    pub epoch: u64,
    /// The validator generation applied.
    pub generation: u64,
    /// When the last successful answer arrived (ms since the Unix epoch).
    pub synced_ms: u64,
    /// The validator called its data fresh in that answer.
    pub fresh: bool,
    /// IPs in the index.
    pub entries: u64,
    /// The bucket count of the IP entries' layout (see [`crate::buckets`]).
    pub buckets: u32,
}

impl Meta {
    /// Encodes as `m4 LOAD EPOCH GEN SYNCED_MS FRESH ENTRIES BUCKETS`.
    pub fn encode(&self) -> Vec<u8> {
        format!(
            "m4 {} {} {} {} {} {} {}",
            self.load,
            self.epoch,
            self.generation,
            self.synced_ms,
            u8::from(self.fresh),
            self.entries,
            self.buckets
        )
        .into_bytes()
    }

    /// Decodes [`Meta::encode`]'s output; anything else is `None` (also the
    /// `m1` of releases with a key per IP, the `m2` of releases with JSON
    /// bucket lines and the `m3` of releases with text bucket lines and
    /// member lists: no data until the new poller's first load, which the
    /// failure policy covers).
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        let text = std::str::from_utf8(bytes).ok()?;
        let mut parts = text.split(' ');
        if parts.next()? != "m4" {
            return None;
        }
        let mut num = || parts.next()?.parse::<u64>().ok();
        let meta = Self {
            load: num()?,
            epoch: num()?,
            generation: num()?,
            synced_ms: num()?,
            fresh: match num()? {
                0 => false,
                1 => true,
                _ => return None,
            },
            entries: num()?,
            buckets: u32::try_from(num()?).ok().filter(|b| b.is_power_of_two())?,
        };
        parts.next().is_none().then_some(meta)
    }

    /// True when the data may be trusted at `now_ms`.
    pub fn is_fresh(&self, now_ms: u64, max_staleness_ms: u64) -> bool {
        self.fresh && now_ms.saturating_sub(self.synced_ms) <= max_staleness_ms
    }
}

/// Splits `LOAD rest` and checks the load against `meta_load` (service
/// entries are the bare load).
fn split_load(bytes: &[u8], meta_load: u64) -> Entry<&[u8]> {
    if bytes.is_empty() {
        return Entry::Absent;
    }
    let Some(space) = bytes.iter().position(|b| *b == b' ') else {
        // A service entry is the bare load.
        return match std::str::from_utf8(bytes)
            .ok()
            .and_then(|s| s.parse::<u64>().ok())
        {
            Some(load) if load >= meta_load => Entry::Present(&[]),
            Some(_) => Entry::Absent,
            None => Entry::Corrupt,
        };
    };
    let (load, rest) = bytes.split_at(space);
    match std::str::from_utf8(load)
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
    {
        Some(load) if load >= meta_load => Entry::Present(rest.get(1..).unwrap_or_default()),
        Some(_) => Entry::Absent,
        None => Entry::Corrupt,
    }
}

/// Encodes a service entry (present).
pub fn encode_service(load: u64) -> Vec<u8> {
    load.to_string().into_bytes()
}

/// Decodes a service entry: is the service known?
pub fn decode_service(bytes: &[u8], meta_load: u64) -> Entry<()> {
    match split_load(bytes, meta_load) {
        Entry::Present([]) => Entry::Present(()),
        Entry::Present(_) | Entry::Corrupt => Entry::Corrupt,
        Entry::Absent => Entry::Absent,
    }
}

/// Takes the next value of a counter key with compare-and-swap (ids that are
/// unique across every VM sharing the data).
pub fn next_id(store: &mut dyn SharedData, key: &str) -> Result<u64, StoreError> {
    for _ in 0..64 {
        let (value, cas) = store.get(key)?;
        let current = value
            .as_deref()
            .and_then(|v| std::str::from_utf8(v).ok())
            .and_then(|s| s.parse::<u64>().ok())
            .unwrap_or(0);
        let next = current.saturating_add(1);
        match store.set(key, next.to_string().as_bytes(), Some(cas)) {
            Ok(()) => return Ok(next),
            Err(StoreError::CasMismatch) => continue,
            Err(e) => return Err(e),
        }
    }
    Err(StoreError::CasMismatch)
}

/// The index's reader: reads only the keys one request needs.
#[derive(Debug)]
pub struct IndexReader<'a, S: ?Sized> {
    store: &'a S,
}

/// What a worker reads for one request, in one value (tests only: requests
/// read through [`IndexReader::meta`], [`IndexReader::service`] and
/// [`IndexReader::record`]).
#[cfg(test)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Lookup {
    /// The sync state, `None` before the first sync.
    pub(crate) meta: Option<Meta>,
    /// Whether the service is known.
    pub(crate) service: Entry<()>,
    /// The IP's record as the verdict about the asked service needs it
    /// ([`buckets::Holders::record_for`]: other services and pod names are
    /// placeholders).
    pub(crate) record: Entry<IpRecord>,
}

impl<'a, S: SharedData + ?Sized> IndexReader<'a, S> {
    /// A reader over `store`.
    pub fn new(store: &'a S) -> Self {
        Self { store }
    }

    /// Reads the sync state.
    pub fn meta(&self) -> Option<Meta> {
        self.meta_and_cas().map(|(meta, _)| meta)
    }

    /// Reads the sync state with the cas token of that write: every write of
    /// `meta` (the poller's commit point) gives it a new token, so an equal
    /// token means nothing was committed since (see `crate::cache`).
    pub fn meta_and_cas(&self) -> Option<(Meta, u32)> {
        let mut meta = None;
        self.store.peek(META_KEY, &mut |answer| {
            if let Ok((Some(value), cas)) = answer {
                meta = Meta::decode(value).map(|m| (m, cas));
            }
        });
        meta
    }

    /// Whether `service` is known in the index `meta` describes.
    pub fn service(&self, meta: &Meta, service: &ServiceKey) -> Entry<()> {
        let mut entry = Entry::Corrupt;
        self.store.peek(&service_key(service), &mut |answer| {
            if let Ok((value, _)) = answer {
                entry = decode_service(value.unwrap_or_default(), meta.load);
            }
        });
        entry
    }

    /// The record of `ip` in the index `meta` describes, with every service
    /// in it a [`buckets::placeholder`] of its id: one record serves a
    /// verdict about any service, asked as
    /// `placeholder(service_id(service))` (what `crate::judgement` does).
    pub fn record(&self, meta: &Meta, ip: &IpAddr) -> Entry<IpRecord> {
        // The bucket line is read lent where the store lends it; only the
        // IP's record is built from it.
        let mut entry = Entry::Corrupt;
        self.store
            .peek(&buckets::key_of(ip, meta.buckets), &mut |answer| {
                if let Ok((value, _)) = answer {
                    entry = match buckets::find(value.unwrap_or_default(), ip, meta.load) {
                        Entry::Present(holders) => Entry::Present(holders.record_by_ids(*ip)),
                        Entry::Absent => Entry::Absent,
                        Entry::Corrupt => Entry::Corrupt,
                    };
                }
            });
        entry
    }

    /// Reads what one request needs: meta, the service, the IP.
    #[cfg(test)]
    pub(crate) fn lookup(&self, service: &ServiceKey, ip: &IpAddr) -> Lookup {
        let Some(meta) = self.meta() else {
            return Lookup {
                meta: None,
                service: Entry::Absent,
                record: Entry::Absent,
            };
        };
        let read = |key: String| match self.store.get(&key) {
            Ok((value, _)) => Ok(value.unwrap_or_default()),
            Err(_) => Err(()),
        };
        let known = match read(service_key(service)) {
            Ok(v) => decode_service(&v, meta.load),
            Err(()) => Entry::Corrupt,
        };
        let record = match read(buckets::key_of(ip, meta.buckets)) {
            Ok(v) => match buckets::find(&v, ip, meta.load) {
                Entry::Present(holders) => Entry::Present(holders.record_for(*ip, service)),
                Entry::Absent => Entry::Absent,
                Entry::Corrupt => Entry::Corrupt,
            },
            Err(()) => Entry::Corrupt,
        };
        Lookup {
            meta: Some(meta),
            service: known,
            record,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::Peeked;

    #[test]
    fn meta_round_trips_and_rejects_garbage() {
        let m = Meta {
            load: 3,
            epoch: u64::MAX,
            generation: 9,
            synced_ms: 1_700_000_000_000,
            fresh: true,
            entries: 12,
            buckets: 1_024,
        };
        assert_eq!(Meta::decode(&m.encode()), Some(m));
        for bad in [
            &b""[..],
            b"m4",
            b"m1 1 1 1 1 1 1",
            b"m2 1 1 1 1 1 1 1024",
            b"m3 1 1 1 1 1 1 1024",
            b"m4 1 1 1 1 1 1",
            b"m4 1 1 1 1 2 1 1024",
            b"m4 1 1 1 1 1 1 1000",
            b"m4 1 1 1 1 1 1 1024 1",
        ] {
            assert_eq!(
                Meta::decode(bad),
                None,
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn freshness_needs_the_flag_and_a_recent_sync() {
        let m = Meta {
            synced_ms: 10_000,
            fresh: true,
            ..Meta::default()
        };
        assert!(m.is_fresh(12_000, 3_000));
        assert!(!m.is_fresh(13_001, 3_000));
        assert!(
            m.is_fresh(5_000, 3_000),
            "a clock step back is not staleness"
        );
        assert!(!Meta { fresh: false, ..m }.is_fresh(10_000, 3_000));
    }

    #[test]
    fn services_are_valid_from_their_load_on() {
        assert_eq!(decode_service(&encode_service(2), 2), Entry::Present(()));
        assert_eq!(decode_service(&encode_service(2), 3), Entry::Absent);
        assert_eq!(decode_service(b"", 3), Entry::Absent);
        assert_eq!(decode_service(b"zz", 0), Entry::Corrupt);
    }

    /// A store that only lends: `get` fails, `peek` answers from `inner`.
    struct Lending(MemoryStore);

    impl SharedData for Lending {
        fn get(&self, _: &str) -> Result<(Option<Vec<u8>>, u32), StoreError> {
            Err(StoreError::Host("only peek".into()))
        }
        fn set(&mut self, _: &str, _: &[u8], _: Option<u32>) -> Result<(), StoreError> {
            Err(StoreError::Host("read only".into()))
        }
        fn peek(&self, key: &str, read: &mut dyn FnMut(Peeked<'_>)) {
            let (value, cas) = self.0.get(key).unwrap();
            read(Ok((value.as_deref(), cas)));
        }
    }

    #[test]
    fn a_request_reads_meta_services_and_records_through_peek() {
        let cart = ServiceKey::new("shop", "cart");
        let mut s = MemoryStore::default();
        let meta = Meta {
            load: 1,
            epoch: 1,
            generation: 1,
            synced_ms: 1_000,
            fresh: true,
            entries: 1,
            buckets: buckets::MIN_BUCKETS,
        };
        s.set(META_KEY, &meta.encode(), None).unwrap();
        s.set(&service_key(&cart), &encode_service(1), None)
            .unwrap();
        let ip: IpAddr = "10.0.0.1".parse().unwrap();
        let record = IpRecord::held_by(
            ip,
            vec![staleguard_core::PodHolder::ready_member(
                "shop",
                "p",
                "u",
                cart.clone(),
            )],
        );
        buckets::put(&mut s, 1, buckets::MIN_BUCKETS, &record).unwrap();
        let copied = IndexReader::new(&s);
        let lent = Lending(s.clone());
        let lent = IndexReader::new(&lent);
        assert_eq!(lent.meta_and_cas(), copied.meta_and_cas());
        assert_eq!(lent.meta(), Some(meta));
        assert_eq!(lent.service(&meta, &cart), Entry::Present(()));
        assert_eq!(lent.record(&meta, &ip), copied.record(&meta, &ip));
        assert!(matches!(lent.record(&meta, &ip), Entry::Present(_)));
        let gone: IpAddr = "10.0.0.2".parse().unwrap();
        assert_eq!(lent.record(&meta, &gone), Entry::Absent);
    }

    #[test]
    fn memory_store_honours_cas() {
        let mut s = MemoryStore::default();
        let (_, cas0) = s.get("k").unwrap();
        s.set("k", b"a", Some(cas0)).unwrap();
        let (v, cas1) = s.get("k").unwrap();
        assert_eq!(v.as_deref(), Some(&b"a"[..]));
        s.set("k", b"b", Some(cas1)).unwrap();
        assert_eq!(s.set("k", b"c", Some(cas1)), Err(StoreError::CasMismatch));
    }

    #[test]
    fn ids_are_unique() {
        let mut s = MemoryStore::default();
        assert_eq!(next_id(&mut s, "staleguard/test-counter").unwrap(), 1);
        assert_eq!(next_id(&mut s, "staleguard/test-counter").unwrap(), 2);
    }

    #[test]
    fn lookup_before_any_sync_has_no_meta() {
        let s = MemoryStore::default();
        let l =
            IndexReader::new(&s).lookup(&ServiceKey::new("a", "b"), &"10.0.0.1".parse().unwrap());
        assert_eq!(l.meta, None);
    }
}
