//! The writer of the shared-data index: a snapshot or a delta, once the
//! poller ([`crate::sync`]) has judged it in sequence and the guard has let it
//! through, laid out into buckets, services, member lists and `meta`. The
//! reader is [`super::IndexReader`]; the layout is described in [`super`].

use std::collections::{BTreeMap, HashSet};
use std::net::IpAddr;

use staleguard_core::wire::Delta;
use staleguard_core::{ServiceKey, Snapshot};

use super::{encode_service, next_id, service_key, IndexReader, Meta, LOADS_KEY, META_KEY};
use crate::buckets::{self, Bucket, CompactRecord};
use crate::entry::Entry;
use crate::host::{SharedData, StoreError};
use crate::members;

/// What the writer knows of the index it wrote: the layout in use, and
/// which buckets and services it filled (to clear them on a reset).
#[derive(Debug, Clone)]
pub struct Writer {
    entries: u64,
    /// The bucket count of the layout in use (see [`crate::buckets`]).
    buckets: u32,
    /// Buckets of that layout this writer wrote non-empty, to clear on a
    /// reset; and services likewise.
    known_buckets: HashSet<u32>,
    known_services: HashSet<ServiceKey>,
    /// Keys the last snapshot left behind (buckets of a replaced layout or
    /// that it left empty, services it lacks), cleared at the next write:
    /// by then no reader is still between reading the `meta` of before and
    /// reading them (see [`Writer::write_snapshot`]).
    retired: Vec<String>,
}

impl Default for Writer {
    fn default() -> Self {
        Self {
            entries: 0,
            buckets: buckets::MIN_BUCKETS,
            known_buckets: HashSet::new(),
            known_services: HashSet::new(),
            retired: Vec::new(),
        }
    }
}

impl Writer {
    /// Continues an index another writer left (a successor reads `meta`):
    /// its size and layout, without knowing which buckets it filled.
    pub fn adopt(&mut self, meta: &Meta) {
        self.entries = meta.entries;
        self.buckets = meta.buckets;
    }

    /// IPs in the index.
    pub fn entries(&self) -> u64 {
        self.entries
    }

    /// True when the index has more IPs than its layout serves well: the
    /// next load should be a snapshot, laid out with more buckets.
    pub fn outgrown(&self) -> bool {
        buckets::outgrown(self.entries, self.buckets)
    }

    /// Writes `snapshot` as a new load and flips `meta` to it; returns
    /// `meta`. Sorts the snapshot's records by bucket.
    ///
    /// Until the flip, readers on other workers keep reading the index of
    /// before through its `meta`: nothing of it is cleared before the flip
    /// (a bucket of the old layout read empty would reject its live pods as
    /// destroyed). What the new load leaves behind is cleared at the next
    /// write, only to give its memory back: once `meta` names the new load,
    /// every entry of an older load is invalid for readers anyway. When the
    /// flip fails, the writer keeps describing the index of before, which
    /// `meta` still names.
    pub fn write_snapshot(
        &mut self,
        store: &mut dyn SharedData,
        now_ms: u64,
        snapshot: &mut Snapshot<CompactRecord>,
    ) -> Result<Meta, StoreError> {
        self.clear_retired(store);
        let load = next_id(store, LOADS_KEY)?;
        // Lay the IPs out bucket by bucket: sorted by bucket, each bucket is
        // built and written once, and only one is held at a time.
        let layout = buckets::bucket_count(snapshot.records.len() as u64);
        snapshot
            .records
            .sort_by_cached_key(|r| buckets::bucket_of(&r.ip, layout));
        let Snapshot {
            v: _,
            epoch,
            generation,
            freshness,
            services,
            records,
        } = &*snapshot;
        let mut written = HashSet::new();
        let mut entries = 0u64;
        let mut current: Option<(u32, Bucket)> = None;
        for record in records {
            let index = buckets::bucket_of(&record.ip, layout);
            if current.as_ref().is_some_and(|(i, _)| *i != index) {
                if let Some((i, bucket)) = current.take() {
                    entries += write_bucket(store, load, layout, i, &bucket, &mut written)?;
                }
            }
            current
                .get_or_insert_with(|| (index, Bucket::default()))
                .1
                .put(record);
        }
        if let Some((i, bucket)) = current.take() {
            entries += write_bucket(store, load, layout, i, &bucket, &mut written)?;
        }
        members::write_snapshot(store, load, records)?;
        let services: HashSet<ServiceKey> = services.iter().cloned().collect();
        for service in &services {
            store.set(&service_key(service), &encode_service(load), None)?;
        }
        let before = std::mem::replace(
            self,
            Writer {
                entries,
                buckets: layout,
                known_buckets: written,
                known_services: services,
                retired: Vec::new(),
            },
        );
        let meta = match self.write_meta(store, load, now_ms, *epoch, *generation, freshness.fresh)
        {
            Ok(meta) => meta,
            Err(e) => {
                *self = before;
                return Err(e);
            }
        };
        self.retired = before
            .known_buckets
            .iter()
            .filter(|i| layout != before.buckets || !self.known_buckets.contains(i))
            .map(|i| buckets::bucket_key(before.buckets, *i))
            .chain(
                before
                    .known_services
                    .difference(&self.known_services)
                    .map(service_key),
            )
            .collect();
        Ok(meta)
    }

    /// Clears the keys the last snapshot left behind. Best effort: a key left
    /// holds an older load, which readers ignore, so a failure costs memory,
    /// not correctness, and must not fail the write that follows.
    fn clear_retired(&mut self, store: &mut dyn SharedData) {
        for key in std::mem::take(&mut self.retired) {
            let _ = store.set(&key, b"", None);
        }
    }

    /// Writes `delta` into `load` (the poller checked that it continues the
    /// index) and moves `meta` to its generation; returns the IPs changed.
    pub fn write_delta(
        &mut self,
        store: &mut dyn SharedData,
        now_ms: u64,
        load: u64,
        delta: &Delta<CompactRecord>,
    ) -> Result<u64, StoreError> {
        self.clear_retired(store);
        let Delta {
            v: _,
            epoch,
            since: _,
            generation,
            freshness,
            services_added,
            services_removed,
            upserts,
            removed,
        } = delta;
        for service in services_added {
            store.set(&service_key(service), &encode_service(load), None)?;
            self.known_services.insert(service.clone());
        }
        for service in services_removed {
            store.set(&service_key(service), b"", None)?;
            self.known_services.remove(service);
        }
        // Edits grouped by bucket: each bucket read, edited and written once.
        let mut edits: BTreeMap<u32, Vec<Edit<'_>>> = BTreeMap::new();
        for record in upserts {
            let index = buckets::bucket_of(&record.ip, self.buckets);
            edits.entry(index).or_default().push(Edit::Put(record));
        }
        for ip in removed {
            let index = buckets::bucket_of(ip, self.buckets);
            edits.entry(index).or_default().push(Edit::Remove(ip));
        }
        let changed = (upserts.len() + removed.len()) as u64;
        for (index, edits) in edits {
            let key = buckets::bucket_key(self.buckets, index);
            let (value, _) = store.get(&key)?;
            let value = value.unwrap_or_default();
            // Member lists first: they need each IP's old record.
            for edit in &edits {
                let (ip, new) = match edit {
                    Edit::Put(record) => (record.ip, Some(*record)),
                    Edit::Remove(ip) => (**ip, None),
                };
                let old = match buckets::find(&value, &ip, load) {
                    Entry::Present(holders) => Some(holders),
                    Entry::Absent | Entry::Corrupt => None,
                };
                members::apply_change(store, load, ip, old.as_ref(), new)?;
            }
            // A bucket of an older load is empty for readers: start afresh.
            let mut bucket = Bucket::read(&value, load);
            let mut delta = 0i64;
            for edit in edits {
                delta += match edit {
                    Edit::Put(record) => bucket.put(record),
                    Edit::Remove(ip) => bucket.remove(ip),
                };
            }
            store.set(&key, &bucket.encode(load), None)?;
            if bucket.is_empty() {
                self.known_buckets.remove(&index);
            } else {
                self.known_buckets.insert(index);
            }
            self.entries = self.entries.saturating_add_signed(delta);
        }
        self.write_meta(store, load, now_ms, *epoch, *generation, freshness.fresh)?;
        Ok(changed)
    }

    /// Points readers at `load`, at the answer's epoch, generation and
    /// freshness, with the writer's size and layout: the commit of a
    /// snapshot or a delta, after all its entries.
    fn write_meta(
        &self,
        store: &mut dyn SharedData,
        load: u64,
        now_ms: u64,
        epoch: u64,
        generation: u64,
        fresh: bool,
    ) -> Result<Meta, StoreError> {
        let meta = Meta {
            load,
            epoch,
            generation,
            synced_ms: now_ms,
            fresh,
            entries: self.entries,
            buckets: self.buckets,
        };
        store.set(META_KEY, &meta.encode(), None)?;
        Ok(meta)
    }

    /// While an answer is held: writes the records that only add (see
    /// [`crate::guard::Guard::gains`]) into the current load and layout, and
    /// marks the previous data synced at `now_ms` with the answer's
    /// freshness ([`Writer::refresh`]). The next snapshot rewrites the gains
    /// (`entries` is corrected then).
    pub fn write_hold(
        &mut self,
        store: &mut dyn SharedData,
        now_ms: u64,
        fresh: bool,
        gains: &[&CompactRecord],
    ) -> Result<(), StoreError> {
        let Some(meta) = IndexReader::new(&*store).meta() else {
            return Ok(());
        };
        let mut edits: BTreeMap<u32, Vec<&CompactRecord>> = BTreeMap::new();
        for record in gains {
            let index = buckets::bucket_of(&record.ip, meta.buckets);
            edits.entry(index).or_default().push(record);
        }
        for (index, records) in edits {
            let key = buckets::bucket_key(meta.buckets, index);
            let (value, _) = store.get(&key)?;
            let value = value.unwrap_or_default();
            // The member lists follow, as for a delta: a later delta reads
            // this record as the IP's old one.
            for record in &records {
                let old = match buckets::find(&value, &record.ip, meta.load) {
                    Entry::Present(old) => Some(old),
                    Entry::Absent | Entry::Corrupt => None,
                };
                members::apply_change(store, meta.load, record.ip, old.as_ref(), Some(record))?;
            }
            let mut bucket = Bucket::read(&value, meta.load);
            for record in records {
                bucket.put(record);
            }
            store.set(&key, &bucket.encode(meta.load), None)?;
            if meta.buckets == self.buckets {
                self.known_buckets.insert(index);
            }
        }
        // The writes above leave `meta` as it was read.
        refreshed(store, meta, now_ms, fresh)
    }

    /// The validator answered, but nothing of the answer is applied (the
    /// guard holds it): the data `meta` names is as recent as this answer,
    /// and as fresh as the validator calls it. A hold must not age the data
    /// it keeps serving into the failure policy while the validator is
    /// reachable and fresh.
    pub fn refresh(
        &mut self,
        store: &mut dyn SharedData,
        now_ms: u64,
        fresh: bool,
    ) -> Result<(), StoreError> {
        let Some(meta) = IndexReader::new(&*store).meta() else {
            return Ok(());
        };
        refreshed(store, meta, now_ms, fresh)
    }
}

/// Writes `meta` as synced at `now_ms` with the validator's `fresh` flag.
fn refreshed(
    store: &mut dyn SharedData,
    meta: Meta,
    now_ms: u64,
    fresh: bool,
) -> Result<(), StoreError> {
    let meta = Meta {
        synced_ms: now_ms,
        fresh,
        ..meta
    };
    store.set(META_KEY, &meta.encode(), None)
}

/// Writes one bucket of a new load; returns its number of IPs.
fn write_bucket(
    store: &mut dyn SharedData,
    load: u64,
    layout: u32,
    index: u32,
    bucket: &Bucket,
    written: &mut HashSet<u32>,
) -> Result<u64, StoreError> {
    if bucket.is_empty() {
        return Ok(0);
    }
    store.set(
        &buckets::bucket_key(layout, index),
        &bucket.encode(load),
        None,
    )?;
    written.insert(index);
    Ok(bucket.len() as u64)
}

/// One change to a bucket.
enum Edit<'a> {
    Put(&'a CompactRecord),
    Remove(&'a IpAddr),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;
    use staleguard_core::{Freshness, IpRecord, PodHolder};

    fn cart() -> ServiceKey {
        ServiceKey::new("shop", "cart")
    }

    /// `n` pods of shop/cart on 10.x.y.z.
    fn snapshot(generation: u64, n: u32) -> Snapshot<CompactRecord> {
        let records = (1..=n)
            .map(|i| {
                let ip: IpAddr = std::net::Ipv4Addr::from(0x0a00_0000 + i).into();
                CompactRecord::of(&IpRecord::held_by(
                    ip,
                    vec![PodHolder::ready_member(
                        "shop",
                        format!("cart-{i}"),
                        ip.to_string(),
                        cart(),
                    )],
                ))
            })
            .collect();
        Snapshot {
            v: 1,
            epoch: 1,
            generation,
            freshness: Freshness {
                fresh: true,
                age_ms: Some(0),
            },
            services: vec![cart()],
            records,
        }
    }

    /// A store that, after every write, checks that a reader on another
    /// worker finds each of `live` (pods in the index before and after)
    /// present, and that can refuse the `meta` write.
    struct Watched {
        store: MemoryStore,
        live: Vec<IpAddr>,
        refuse_meta: bool,
        writes: usize,
    }

    impl SharedData for Watched {
        fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, u32), StoreError> {
            self.store.get(key)
        }

        fn set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
            if self.refuse_meta && key == META_KEY {
                return Err(StoreError::Host("refused".into()));
            }
            self.store.set(key, value, cas)?;
            self.writes += 1;
            for ip in &self.live {
                let record = IndexReader::new(&self.store).lookup(&cart(), ip).record;
                assert!(
                    matches!(record, Entry::Present(_)),
                    "after write {} ({key}): {ip} reads {record:?}",
                    self.writes
                );
            }
            Ok(())
        }
    }

    fn watched(live: u32) -> Watched {
        Watched {
            store: MemoryStore::default(),
            live: snapshot(0, live)
                .records
                .iter()
                .map(|r| r.ip)
                .step_by(7)
                .collect(),
            refuse_meta: false,
            writes: 0,
        }
    }

    #[test]
    fn a_reader_finds_every_live_pod_at_every_write_of_a_snapshot_with_a_new_layout() {
        let mut store = watched(100);
        store.live.clear();
        let mut writer = Writer::default();
        writer
            .write_snapshot(&mut store, 1, &mut snapshot(1, 100))
            .unwrap();
        assert_eq!(writer.buckets, buckets::MIN_BUCKETS);
        store.live = watched(100).live;
        // 20,000 pods need more buckets: the old layout's keys must hold
        // until meta names the new one.
        let meta = writer
            .write_snapshot(&mut store, 2, &mut snapshot(2, 20_000))
            .unwrap();
        assert!(meta.buckets > buckets::MIN_BUCKETS, "{meta:?}");
        assert!(!writer.retired.is_empty(), "the old layout's keys wait");
        // The next write clears them, and readers still find every pod.
        let retired = writer.retired.clone();
        writer
            .write_delta(
                &mut store,
                3,
                meta.load,
                &Delta {
                    v: 1,
                    epoch: 1,
                    since: 2,
                    generation: 3,
                    freshness: Freshness {
                        fresh: true,
                        age_ms: Some(0),
                    },
                    services_added: vec![],
                    services_removed: vec![],
                    upserts: vec![],
                    removed: vec![],
                },
            )
            .unwrap();
        assert!(writer.retired.is_empty());
        for key in retired {
            assert_eq!(store.get(&key).unwrap().0.unwrap_or_default(), b"");
        }
    }

    #[test]
    fn a_refused_meta_write_leaves_the_writer_describing_the_index_meta_names() {
        let mut store = watched(100);
        let mut writer = Writer::default();
        store.live.clear();
        let first = writer
            .write_snapshot(&mut store, 1, &mut snapshot(1, 100))
            .unwrap();
        store.live = watched(100).live;
        store.refuse_meta = true;
        let err = writer.write_snapshot(&mut store, 2, &mut snapshot(2, 20_000));
        assert!(err.is_err());
        assert_eq!(writer.buckets, first.buckets, "still the layout meta names");
        assert_eq!(writer.entries, 100);
        assert_eq!(IndexReader::new(&store.store).meta(), Some(first));
    }
}
