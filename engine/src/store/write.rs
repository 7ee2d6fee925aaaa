//! The writer of the shared-data index: a snapshot or a delta, once the
//! poller ([`crate::sync`]) has judged it in sequence and the guard has let it
//! through, laid out into buckets, services, member lists and `meta`. The
//! reader is [`super::IndexReader`]; the layout is described in [`super`].

use std::collections::HashSet;
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
    /// `meta`: [`Writer::begin_snapshot`], its records slice by slice, then
    /// [`Writer::commit_snapshot`], from records held whole (a JSON answer,
    /// a test's, the native module's seed).
    pub fn write_snapshot(
        &mut self,
        store: &mut dyn SharedData,
        now_ms: u64,
        snapshot: &mut Snapshot<CompactRecord>,
    ) -> Result<Meta, StoreError> {
        let Snapshot {
            v: _,
            epoch,
            generation,
            freshness,
            services,
            records,
        } = &*snapshot;
        let mut plan = Plan::new(records.len());
        for record in records {
            plan.measure(record);
        }
        let mut loading = self.begin_snapshot(store, plan)?;
        loop {
            for record in records {
                if loading.wants(&record.ip) {
                    loading.put(record);
                }
            }
            if !loading.finish_slice(store)? {
                break;
            }
        }
        let head = Head {
            epoch: *epoch,
            generation: *generation,
            fresh: freshness.fresh,
            services,
        };
        self.commit_snapshot(store, now_ms, loading, &head)
    }

    /// Begins writing a snapshot laid out as `plan` says, under a new load:
    /// the caller hands every record to the [`Loading`] once per slice
    /// ([`Loading::wants`], [`Loading::put`], [`Loading::finish_slice`]),
    /// then flips `meta` with [`Writer::commit_snapshot`].
    ///
    /// Until the flip, readers on other workers keep reading the index of
    /// before through its `meta`: nothing of it is cleared before the flip
    /// (a bucket of the old layout read empty would reject its live pods as
    /// destroyed), and each bucket of the new load is written once, whole.
    /// What the new load leaves behind is cleared at the next write, only to
    /// give its memory back: once `meta` names the new load, every entry of
    /// an older load is invalid for readers anyway.
    pub fn begin_snapshot(
        &mut self,
        store: &mut dyn SharedData,
        mut plan: Plan,
    ) -> Result<Loading, StoreError> {
        self.clear_retired(store);
        let load = next_id(store, LOADS_KEY)?;
        // Each list at its size at once (see [`members::Lists`]).
        let mut members = std::mem::take(&mut plan.members);
        members.reserve();
        let mut loading = Loading {
            load,
            plan,
            slice: 0,
            arena: Vec::new(),
            lines: Vec::new(),
            members: Some(members),
            written: HashSet::new(),
            entries: 0,
        };
        loading.reserve();
        Ok(loading)
    }

    /// Writes the services of the snapshot `loading` wrote and flips `meta`
    /// to its load (the commit); returns `meta`. When the flip fails, the
    /// writer keeps describing the index of before, which `meta` still
    /// names.
    pub fn commit_snapshot(
        &mut self,
        store: &mut dyn SharedData,
        now_ms: u64,
        loading: Loading,
        head: &Head<'_>,
    ) -> Result<Meta, StoreError> {
        let Loading {
            load,
            plan,
            written,
            entries,
            ..
        } = loading;
        let layout = plan.layout;
        let services: HashSet<ServiceKey> = head.services.iter().cloned().collect();
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
        let meta =
            match self.write_meta(store, load, now_ms, head.epoch, head.generation, head.fresh) {
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
        let all: Vec<Edit<'_>> = upserts
            .iter()
            .map(Edit::Put)
            .chain(removed.iter().map(Edit::Remove))
            .collect();
        let order = by_bucket(all.iter().map(|edit| {
            let ip = match edit {
                Edit::Put(record) => &record.ip,
                Edit::Remove(ip) => *ip,
            };
            buckets::bucket_of(ip, self.buckets)
        }));
        let changed = (upserts.len() + removed.len()) as u64;
        let mut lists = members::Updates::default();
        for (index, group) in groups(&order) {
            let edits: Vec<Edit<'_>> = group.filter_map(|i| all.get(i).copied()).collect();
            let key = buckets::bucket_key(self.buckets, index);
            let (value, _) = store.get(&key)?;
            let value = value.unwrap_or_default();
            // The member lists' changes first: they need each IP's old
            // record. They are written once per service, after the buckets.
            for edit in &edits {
                let (ip, new) = match edit {
                    Edit::Put(record) => (record.ip, Some(*record)),
                    Edit::Remove(ip) => (**ip, None),
                };
                let old = match buckets::find(&value, &ip, load) {
                    Entry::Present(holders) => Some(holders),
                    Entry::Absent | Entry::Corrupt => None,
                };
                lists.change(ip, old.as_ref(), new);
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
        // Entries (buckets, member lists) before `meta`, the commit.
        lists.write(store, load)?;
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
        let order = by_bucket(
            gains
                .iter()
                .map(|record| buckets::bucket_of(&record.ip, meta.buckets)),
        );
        let mut lists = members::Updates::default();
        for (index, group) in groups(&order) {
            let records: Vec<&CompactRecord> =
                group.filter_map(|i| gains.get(i).copied()).collect();
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
                lists.change(record.ip, old.as_ref(), Some(record));
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
        lists.write(store, meta.load)?;
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

/// The positions of a batch's records (given by their buckets, in the
/// batch's order) grouped by bucket: `(bucket, position)` sorted, so each
/// bucket's positions come together and in the batch's order. A sorted
/// `Vec` of the pairs the slice writer sorts too (`Plan`'s lines) rather
/// than a `BTreeMap` of groups: the Wasm module carries one sort and no
/// B-tree for it.
fn by_bucket(buckets: impl Iterator<Item = u32>) -> Vec<(u32, u32)> {
    let mut order: Vec<(u32, u32)> = buckets.zip(0..).collect();
    order.sort_unstable();
    order
}

/// Each bucket of `order` ([`by_bucket`]) with its records' positions.
fn groups(order: &[(u32, u32)]) -> impl Iterator<Item = (u32, impl Iterator<Item = usize> + '_)> {
    order.chunk_by(|a, b| a.0 == b.0).filter_map(|run| {
        let (bucket, _) = run.first()?;
        Some((*bucket, run.iter().map(|(_, i)| *i as usize)))
    })
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

/// What a snapshot's commit writes besides its records.
#[derive(Debug, Clone, Copy)]
pub struct Head<'a> {
    /// The validator's epoch.
    pub epoch: u64,
    /// The generation of the snapshot.
    pub generation: u64,
    /// The validator called its data fresh.
    pub fresh: bool,
    /// The services it knows.
    pub services: &'a [ServiceKey],
}

/// Bucket lines a slice of a snapshot's layout holds in the poller at
/// once, at most (unless that would take more than [`MAX_SLICES`] slices):
/// a slice's lines are all read before its buckets are written.
pub const SLICE_BYTES: usize = 1 << 20;

/// The most slices a snapshot is written in: each is one more reading of
/// the answer.
pub const MAX_SLICES: usize = 4;

/// How a snapshot is written: its layout (from its size), and the slices of
/// the layout written one after another, each from one reading of the
/// records, so that the poller holds one slice's bucket lines at a time
/// and never the whole answer; and each service's live members counted,
/// so that its member list is reserved once at its size.
#[derive(Debug, Clone)]
pub struct Plan {
    layout: u32,
    /// Per quarter of the layout: records, and bytes of bucket lines.
    quarters: [(usize, usize); MAX_SLICES],
    /// IPv4 and IPv6 records.
    families: (usize, usize),
    /// The member lists, counted and still empty ([`members::Lists::count`]).
    members: members::Lists,
}

impl Plan {
    /// The plan of a snapshot of `records` records, to be measured.
    pub fn new(records: usize) -> Self {
        Self {
            layout: buckets::bucket_count(records as u64),
            quarters: [(0, 0); MAX_SLICES],
            families: (0, 0),
            members: members::Lists::default(),
        }
    }

    /// Counts one record of the snapshot.
    pub fn measure(&mut self, record: &CompactRecord) {
        self.members.count(record);
        match record.ip {
            IpAddr::V4(_) => self.families.0 += 1,
            IpAddr::V6(_) => self.families.1 += 1,
        }
        if record.is_vacant() {
            return;
        }
        let quarter = self.quarter(buckets::bucket_of(&record.ip, self.layout));
        if let Some((records, bytes)) = self.quarters.get_mut(quarter) {
            *records += 1;
            *bytes += buckets::line_len(record);
        }
    }

    /// The snapshot's IPv4 and IPv6 records.
    pub fn families(&self) -> (usize, usize) {
        self.families
    }

    /// How many slices the snapshot is written in: 1, 2 or 4.
    pub fn slices(&self) -> usize {
        let bytes: usize = self.quarters.iter().map(|(_, b)| b).sum();
        bytes
            .div_ceil(SLICE_BYTES)
            .clamp(1, MAX_SLICES)
            .next_power_of_two()
    }

    fn quarter(&self, bucket: u32) -> usize {
        (u64::from(bucket) * MAX_SLICES as u64 / u64::from(self.layout)) as usize
    }

    /// The slice bucket `bucket` is written in.
    fn slice_of(&self, bucket: u32) -> usize {
        self.quarter(bucket) * self.slices() / MAX_SLICES
    }

    /// Records and bytes of bucket lines of slice `slice`.
    fn size_of(&self, slice: usize) -> (usize, usize) {
        let per = MAX_SLICES / self.slices();
        self.quarters
            .iter()
            .skip(slice * per)
            .take(per)
            .fold((0, 0), |(r, b), (records, bytes)| (r + records, b + bytes))
    }
}

/// A snapshot being written, a slice of its layout at a time (see
/// [`Writer::begin_snapshot`]).
#[derive(Debug)]
pub struct Loading {
    load: u64,
    plan: Plan,
    slice: usize,
    /// The bucket lines of the slice being read, `\n<ip> <holders>` each,
    /// in the order of the answer.
    arena: Vec<u8>,
    /// Each line's bucket and where it starts in `arena`.
    lines: Vec<(u32, u32)>,
    /// The member lists, gathered while the first slice is read (which
    /// reads every record).
    members: Option<members::Lists>,
    written: HashSet<u32>,
    entries: u64,
}

impl Loading {
    /// True when the slice being read needs the record of `ip`: every
    /// record in the first slice (for the member lists), then only its own.
    pub fn wants(&self, ip: &IpAddr) -> bool {
        self.slice == 0
            || self.plan.slice_of(buckets::bucket_of(ip, self.plan.layout)) == self.slice
    }

    /// True while the first slice is read (every record goes by).
    pub fn first_slice(&self) -> bool {
        self.slice == 0
    }

    /// One record of the snapshot.
    pub fn put(&mut self, record: &CompactRecord) {
        if let Some(members) = self.members.as_mut() {
            members.add(record);
        }
        if record.is_vacant() {
            return;
        }
        let bucket = buckets::bucket_of(&record.ip, self.plan.layout);
        if self.plan.slice_of(bucket) != self.slice {
            return;
        }
        let Ok(start) = u32::try_from(self.arena.len()) else {
            return;
        };
        self.lines.push((bucket, start));
        buckets::push_line(&mut self.arena, record);
    }

    /// Writes the buckets of the slice read (after the first, the member
    /// lists too) and moves to the next; false when none is left.
    pub fn finish_slice(&mut self, store: &mut dyn SharedData) -> Result<bool, StoreError> {
        // A bucket's lines together, each bucket's in the answer's order.
        self.lines.sort_unstable();
        let mut value = Vec::new();
        let mut at = 0;
        while let Some(&(bucket, _)) = self.lines.get(at) {
            let end = self.lines[at..]
                .iter()
                .position(|(b, _)| *b != bucket)
                .map_or(self.lines.len(), |n| at + n);
            let starts: Vec<usize> = self.lines[at..end]
                .iter()
                .map(|(_, start)| *start as usize)
                .collect();
            let ips = buckets::encode_lines(&mut value, self.load, &self.arena, &starts);
            store.set(&buckets::bucket_key(self.plan.layout, bucket), &value, None)?;
            self.written.insert(bucket);
            self.entries += ips as u64;
            at = end;
        }
        if let Some(members) = self.members.take() {
            members.write(store, self.load)?;
        }
        self.arena.clear();
        self.lines.clear();
        self.slice += 1;
        if self.slice >= self.plan.slices() {
            return Ok(false);
        }
        self.reserve();
        Ok(true)
    }

    /// Room for the slice about to be read, at once.
    fn reserve(&mut self) {
        let (records, bytes) = self.plan.size_of(self.slice);
        self.arena.reserve_exact(bytes);
        self.lines.reserve_exact(records);
    }
}

/// One change to a bucket.
#[derive(Clone, Copy)]
enum Edit<'a> {
    Put(&'a CompactRecord),
    Remove(&'a IpAddr),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;
    use staleguard_core::{Freshness, IpRecord, PodHolder};
    use std::collections::BTreeMap;

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
        // 40,000 pods need more buckets: the old layout's keys must hold
        // until meta names the new one.
        let meta = writer
            .write_snapshot(&mut store, 2, &mut snapshot(2, 40_000))
            .unwrap();
        assert!(meta.buckets > buckets::MIN_BUCKETS, "{meta:?}");
        assert!(!writer.retired.is_empty(), "the old layout's keys wait");
        // The next write clears them, and readers still find every pod.
        let retired = writer.retired.clone();
        writer
            .write_delta(&mut store, 3, meta.load, &delta(2, vec![]))
            .unwrap();
        assert!(writer.retired.is_empty());
        for key in retired {
            assert_eq!(store.get(&key).unwrap().0.unwrap_or_default(), b"");
        }
    }

    /// A delta from generation `since` to the next, removing `removed`.
    #[test]
    fn a_plan_counts_each_services_members_and_the_loading_reserves_each_list_at_its_size() {
        let snapshot = snapshot(1, 5_000);
        let mut plan = Plan::new(snapshot.records.len());
        for record in &snapshot.records {
            plan.measure(record);
        }
        let mut store = MemoryStore::default();
        let loading = Writer::default().begin_snapshot(&mut store, plan).unwrap();
        let members = loading.members.as_ref().unwrap();
        let id = buckets::service_id(&cart());
        assert_eq!(members.capacity(id), Some((5_000, 0)));
    }

    fn delta(since: u64, removed: Vec<IpAddr>) -> Delta<CompactRecord> {
        Delta {
            v: 1,
            epoch: 1,
            since,
            generation: since + 1,
            freshness: Freshness {
                fresh: true,
                age_ms: Some(0),
            },
            services_added: vec![],
            services_removed: vec![],
            upserts: vec![],
            removed,
        }
    }

    /// A delta removing `n` IPs of shop/cart from a snapshot of `n`.
    fn scale_down(n: u32) -> Delta<CompactRecord> {
        delta(1, snapshot(0, n).records.iter().map(|r| r.ip).collect())
    }

    /// Counts the writes of each key.
    #[derive(Default)]
    struct Counted {
        store: MemoryStore,
        writes: BTreeMap<String, usize>,
    }

    impl SharedData for Counted {
        fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, u32), StoreError> {
            self.store.get(key)
        }

        fn set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
            *self.writes.entry(key.to_owned()).or_default() += 1;
            self.store.set(key, value, cas)
        }
    }

    #[test]
    fn a_delta_writes_each_touched_member_list_once_as_one_ip_at_a_time_would() {
        let pay = ServiceKey::new("shop", "pay");
        let mut store = Counted::default();
        let mut writer = Writer::default();
        let meta = writer
            .write_snapshot(&mut store, 1, &mut snapshot(1, 300))
            .unwrap();
        // A scale-down of cart (300 -> 20), and one IP recycled into pay.
        let mut delta = scale_down(300);
        let recycled = delta.removed.remove(0);
        delta.removed.truncate(279);
        delta.upserts = vec![CompactRecord::of(&IpRecord::held_by(
            recycled,
            vec![PodHolder::ready_member(
                "shop",
                "pay-1",
                "pay-1",
                pay.clone(),
            )],
        ))];
        // The per-IP path: each IP's change written on its own, in the
        // delta's order, from the index before the delta.
        let mut per_ip = store.store.clone();
        let ips = delta
            .upserts
            .iter()
            .map(|r| (r.ip, Some(r)))
            .chain(delta.removed.iter().map(|ip| (*ip, None)));
        for (ip, new) in ips {
            let key = buckets::key_of(&ip, meta.buckets);
            let value = store.store.get(&key).unwrap().0.unwrap_or_default();
            let old = match buckets::find(&value, &ip, meta.load) {
                Entry::Present(holders) => Some(holders),
                Entry::Absent | Entry::Corrupt => None,
            };
            let mut one = members::Updates::default();
            one.change(ip, old.as_ref(), new);
            one.write(&mut per_ip, meta.load).unwrap();
        }

        store.writes.clear();
        writer
            .write_delta(&mut store, 2, meta.load, &delta)
            .unwrap();
        for service in [cart(), pay.clone()] {
            let key = members::members_key(&service);
            assert_eq!(
                store.writes.get(&key),
                Some(&1),
                "{key}: {:?}",
                store.writes
            );
            assert_eq!(
                store.store.get(&key).unwrap().0,
                per_ip.get(&key).unwrap().0
            );
        }
        let cart_left = members::read(&store.store, &cart(), meta.load);
        assert_eq!(cart_left.len(), 20);
        assert_eq!(
            members::read(&store.store, &pay, meta.load)
                .iter()
                .map(|m| m.ip)
                .collect::<Vec<_>>(),
            [recycled]
        );
    }

    /// The time a scale-down of one large service takes to write (see
    /// docs/benchmarks.md, "A delta of one large service"):
    /// `cargo test --release -p staleguard-engine --lib -- --ignored --nocapture delta_of_one_large_service`.
    #[test]
    #[ignore = "a measurement: run it in release mode"]
    fn delta_of_one_large_service() {
        let n: u32 = std::env::var("IPS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(20_000);
        let mut store = MemoryStore::default();
        let mut writer = Writer::default();
        let meta = writer
            .write_snapshot(&mut store, 1, &mut snapshot(1, n))
            .unwrap();
        let delta = scale_down(n);
        let started = std::time::Instant::now();
        writer
            .write_delta(&mut store, 2, meta.load, &delta)
            .unwrap();
        let took = started.elapsed();
        assert_eq!(writer.entries(), 0);
        println!("a delta removing {n} IPs of one service: {took:?}");
    }

    #[test]
    fn a_large_snapshot_is_written_in_slices_as_whole_buckets_of_its_lines() {
        // 15 bytes a line: 100,000 lines take two slices of 1 MiB.
        let mut snapshot = snapshot(1, 100_000);
        let mut plan = Plan::new(snapshot.records.len());
        for record in &snapshot.records {
            plan.measure(record);
        }
        assert_eq!(plan.slices(), 2, "{plan:?}");
        assert_eq!(plan.families(), (100_000, 0));
        let mut store = MemoryStore::default();
        let meta = Writer::default()
            .write_snapshot(&mut store, 1, &mut snapshot)
            .unwrap();
        assert_eq!(meta.entries, 100_000);
        // Each bucket is its load and its IPs' lines in the answer's order,
        // spelt out: a line is its header (10 bytes of holders, IPv4), the
        // address, a ready pod and its one service (`shop/cart`, id
        // computed apart) with no ports.
        const CART: [u8; 8] = [0xb8, 0x4e, 0xf0, 0xfe, 0x47, 0x3f, 0x10, 0xfc];
        let mut expected: BTreeMap<u32, Vec<u8>> = BTreeMap::new();
        for record in &snapshot.records {
            let index = buckets::bucket_of(&record.ip, meta.buckets);
            let value = expected
                .entry(index)
                .or_insert_with(|| vec![0xb4, meta.load as u8]);
            let IpAddr::V4(v4) = record.ip else {
                unreachable!()
            };
            value.push(10 << 1);
            value.extend(v4.octets());
            value.extend([0x01, 0x40]);
            value.extend(CART);
        }
        assert!(meta.load < 0x80, "a one-byte load");
        for (index, value) in expected {
            let key = buckets::bucket_key(meta.buckets, index);
            assert_eq!(store.get(&key).unwrap().0, Some(value));
        }
        // An IP listed twice keeps its last line.
        let mut twice = self::snapshot(2, 3);
        let mut last = twice.records[0].clone();
        last.line = vec![0x02].into_boxed_slice(); // a terminating pod
        twice.records.push(last);
        let meta = Writer::default()
            .write_snapshot(&mut store, 2, &mut twice)
            .unwrap();
        assert_eq!(meta.entries, 3);
        let ip = twice.records[0].ip;
        let value = store.get(&buckets::key_of(&ip, meta.buckets)).unwrap().0;
        let holders = buckets::find(&value.unwrap(), &ip, meta.load);
        assert_eq!(
            holders,
            Entry::Present(buckets::Holders::decode(&[0x02]).unwrap())
        );
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
