//! The writer of the shared-data index: a snapshot or a delta, once the
//! poller ([`crate::sync`]) has judged it in sequence and the guard has let it
//! through, laid out into buckets, services, member lists and `meta`. The
//! reader is [`super::View`]; the layout is described in [`super`].

use std::collections::{BTreeMap, HashSet};
use std::net::IpAddr;

use staleguard_core::wire::Delta;
use staleguard_core::{IpRecord, ServiceKey, Snapshot};

use super::{
    encode_service, next_id, service_key, Entry, Meta, SharedData, StoreError, View, LOADS_KEY,
    META_KEY,
};
use crate::buckets::{self, Bucket};
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
}

impl Default for Writer {
    fn default() -> Self {
        Self {
            entries: 0,
            buckets: buckets::MIN_BUCKETS,
            known_buckets: HashSet::new(),
            known_services: HashSet::new(),
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
    pub fn write_snapshot(
        &mut self,
        store: &mut dyn SharedData,
        now_ms: u64,
        snapshot: &mut Snapshot,
    ) -> Result<Meta, StoreError> {
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
        // Buckets the new snapshot leaves empty, or of a layout it replaces,
        // would be invalid anyway once meta names the new load; clearing them
        // gives their memory back.
        for index in &self.known_buckets {
            if layout != self.buckets || !written.contains(index) {
                store.set(&buckets::bucket_key(self.buckets, *index), b"", None)?;
            }
        }
        for service in self.known_services.difference(&services) {
            store.set(&service_key(service), b"", None)?;
        }
        self.buckets = layout;
        self.known_buckets = written;
        self.known_services = services;
        self.entries = entries;
        self.write_meta(store, load, now_ms, *epoch, *generation, freshness.fresh)
    }

    /// Writes `delta` into `load` (the poller checked that it continues the
    /// index) and moves `meta` to its generation; returns the IPs changed.
    pub fn write_delta(
        &mut self,
        store: &mut dyn SharedData,
        now_ms: u64,
        load: u64,
        delta: &Delta,
    ) -> Result<u64, StoreError> {
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
    /// [`crate::guard::Guard::gains`]) into the current load and layout,
    /// leaving `meta` as it is, so the previous data keeps serving and ages
    /// as before. The held answer, once applied, rewrites them (`entries` is
    /// corrected then).
    pub fn write_gains(
        &mut self,
        store: &mut dyn SharedData,
        gains: &[&IpRecord],
    ) -> Result<(), StoreError> {
        if gains.is_empty() {
            return Ok(());
        }
        let Some(meta) = View::new(&*store).meta() else {
            return Ok(());
        };
        let mut edits: BTreeMap<u32, Vec<&IpRecord>> = BTreeMap::new();
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
        Ok(())
    }
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
    Put(&'a IpRecord),
    Remove(&'a IpAddr),
}
