//! A per-VM cache of what requests read from shared data, so that a request
//! costs one shared-data read (`meta`) when nothing changed.
//!
//! Three maps, each bounded by [`MAX_ENTRIES`] (a map that would grow past it
//! is cleared first):
//!
//! - cluster name -> service (`judgement::resolve_service`), the Istio metadata
//!   property read only on a miss. It depends on the configuration and the
//!   cluster, not on the index; [`Cache::clear_clusters`] empties it on every
//!   root tick, so a cluster whose metadata changes under the same name is
//!   seen within a tick;
//! - service -> its entry, and IP -> its record, both valid for one write of
//!   `meta`: the poller writes every entry first and `meta` last (its commit
//!   point), and each write of `meta` gets a new cas token. [`Cache::align`]
//!   is given the `meta` and token a request just read and forgets every entry
//!   when they differ from those the entries were filled under. Entries are
//!   read after the `meta` they are filed under, so they are at least that
//!   new: a cached record is never older than what `meta` has committed.
//!
//! One write does not move `meta`: while the blast-radius guard holds an
//! answer, the poller writes the records that only *add* (IPs allowed for no
//! service, `Guard::gains`). So a cached record may reject a pod that a gain
//! now allows; [`crate::judgement::judge`] therefore never rejects on a cached
//! record: a rejecting verdict re-reads the IP's bucket ([`Cache::reread`]).
//! Allowed IPs are never the target of a gain.
//!
//! Undecodable entries are not cached (they are stale data, and may be a
//! passing state).
//!
//! Over the two entry maps, the allowing verdicts themselves, by service id
//! and IP ([`Cache::allowed`]): a request to a host allowed before looks up
//! one map instead of two (three with the record's double lookup) and runs
//! no rule. A verdict depends on the configuration's policy and on the two
//! entries, so it is forgotten with the entries (a new `meta` write) and with
//! the clusters (a new configuration, every tick). Only allowing verdicts on
//! readable entries are kept: a rejection is never served from a cache.
//!
//! A host that asks for them ([`Cache::keep_passes`]: the native module, with
//! the engine's `passes` feature) also gets the requests allowed before, by
//! the texts Envoy named them with ([`Cache::pass`]): the upstream address and
//! the cluster, with the store's write count they were judged at and until
//! when the data they were judged on is fresh. A request that matches all four is counted as the one before it
//! was, without parsing its address or resolving its cluster
//! ([`crate::root::Root::pass_known`]). Passes go with the allowing verdicts
//! and with any write to the store.

use std::collections::HashMap;
use std::hash::Hash;
use std::net::IpAddr;
use std::rc::Rc;

use staleguard_core::{Action, IpRecord, Reason, ServiceKey, Verdict};

use crate::buckets;
use crate::entry::Entry;
use crate::host::SharedData;
use crate::store::{IndexReader, Meta};

/// Entries per map (clusters, services, IPs) before the map is cleared. An IP
/// record of the verdict view is a few hundred bytes: at most a few MiB per
/// VM, and a gateway's working set of upstream hosts (the endpoints its
/// clusters balance over) fits unless it fronts a very large mesh, where the
/// cost is one refill per IP after each clear.
pub const MAX_ENTRIES: usize = 16_384;

/// What the cached entries were filled under: `meta` and its cas token.
type Stamp = (Meta, u32);

/// The per-VM cache (see the module docs).
#[derive(Debug)]
pub struct Cache {
    limit: usize,
    clusters: FastMap<Rc<str>, Option<Rc<Resolved>>>,
    /// The cluster a request named last and its service: a gateway's
    /// requests come in runs to one cluster, and comparing its name costs
    /// less than hashing it.
    last_cluster: Option<(Rc<str>, Option<Rc<Resolved>>)>,
    stamp: Option<Stamp>,
    /// The store's write count ([`SharedData::writes`]) `read` was read at,
    /// and what it read: `meta` and its token.
    read: Option<(u64, Option<Stamp>)>,
    /// The write count at which [`Cache::current`] last aligned the
    /// entries with what it read: at the same count, nothing to compare.
    aligned_at: Option<u64>,
    /// Whether a service is known, by its id ([`Resolved::id`]).
    services: FastMap<u64, bool>,
    records: FastMap<IpAddr, Option<IpRecord>>,
    /// Allowing verdicts by service id and IP (see the module docs).
    allowed: FastMap<(u64, IpAddr), Verdict>,
    /// Requests allowed before, by upstream address text; `None` unless the
    /// host asked for them (see the module docs).
    passes: Option<FastMap<Box<str>, Pass>>,
}

/// A request allowed before (see [`Cache::pass`]).
#[derive(Debug)]
struct Pass {
    /// The cluster it was sent to: the same address in another cluster is
    /// another service's host.
    cluster: Rc<str>,
    service: Rc<Resolved>,
    reason: Reason,
    /// The store's write count ([`SharedData::writes`]) it was judged at.
    writes: u64,
    /// The last instant (ms) the data it was judged on is fresh at.
    fresh_until_ms: u64,
}

/// A cluster's service, resolved once per cluster name while the cache
/// keeps it: its key, its id, and the key records read from the index name
/// it by.
#[derive(Debug, PartialEq, Eq)]
pub struct Resolved {
    /// The service.
    pub key: ServiceKey,
    /// Its id ([`buckets::service_id`]), as the index's records name it:
    /// what the per-request maps key it by (the cache's services, the
    /// metric labels), cheaper to hash than its two names.
    pub id: u64,
    /// `key` as a record read from the index names it: by its id
    /// ([`buckets::placeholder`]), which a verdict compares against.
    pub by_id: ServiceKey,
}

impl Resolved {
    /// `key`, with its id worked out once.
    pub fn new(key: ServiceKey) -> Self {
        let id = buckets::service_id(&key);
        Self {
            key,
            id,
            by_id: buckets::placeholder(id),
        }
    }
}

impl Default for Cache {
    fn default() -> Self {
        Self::with_limit(MAX_ENTRIES)
    }
}

/// A map read on every request: foldhash, seeded per map, instead of
/// SipHash. Its keys (cluster names, services, upstream IPs) come from the
/// control plane, not from clients, and every map is bounded.
pub(crate) type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// Inserts, clearing the map first when it is full.
fn bounded_insert<K: Hash + Eq, V>(map: &mut FastMap<K, V>, limit: usize, key: K, value: V) {
    if map.len() >= limit {
        map.clear();
    }
    map.insert(key, value);
}

impl Cache {
    /// A cache of at most `limit` entries per map.
    pub fn with_limit(limit: usize) -> Self {
        Self {
            limit: limit.max(1),
            clusters: FastMap::default(),
            last_cluster: None,
            stamp: None,
            read: None,
            aligned_at: None,
            services: FastMap::default(),
            records: FastMap::default(),
            allowed: FastMap::default(),
            passes: None,
        }
    }

    /// Keeps the requests allowed before by their texts from now on (see
    /// the module docs): for a host whose texts are lent, not copied, and
    /// whose store counts its writes.
    pub fn keep_passes(&mut self) {
        if cfg!(feature = "passes") {
            self.passes.get_or_insert_with(FastMap::default);
        }
    }

    /// Whether [`Cache::keep_passes`] was asked for.
    pub fn keeps_passes(&self) -> bool {
        cfg!(feature = "passes") && self.passes.is_some()
    }

    /// The service and reason of the request allowed before to `address`
    /// in `cluster`, if it was judged at the store's write count `writes`
    /// on data still fresh at `now_ms`.
    pub fn pass(
        &self,
        cluster: &str,
        address: &str,
        writes: u64,
        now_ms: u64,
    ) -> Option<(&Rc<Resolved>, Reason)> {
        if !self.keeps_passes() {
            return None;
        }
        let pass = self.passes.as_ref()?.get(address)?;
        (pass.writes == writes && now_ms <= pass.fresh_until_ms && *pass.cluster == *cluster)
            .then_some((&pass.service, pass.reason))
    }

    /// Keeps the request to `address` in `cluster`, allowed as `service`'s
    /// host for `reason` on data fresh until `fresh_until_ms`. The caller
    /// judged it on readable entries under the `meta` of the last
    /// [`Cache::current`]; the pass holds at the write count that read
    /// `meta` at, which was taken before: a write that landed since has
    /// moved the count past it. Nothing is kept for a store that does not
    /// count its writes.
    pub fn keep_pass(
        &mut self,
        cluster: &str,
        address: &str,
        service: &Rc<Resolved>,
        reason: Reason,
        fresh_until_ms: u64,
    ) {
        let Some(writes) = self.aligned_at else {
            return;
        };
        let limit = self.limit;
        let cluster = match &self.last_cluster {
            Some((name, _)) if **name == *cluster => name.clone(),
            _ => Rc::from(cluster),
        };
        if let Some(passes) = &mut self.passes {
            let pass = Pass {
                cluster,
                service: service.clone(),
                reason,
                writes,
                fresh_until_ms,
            };
            bounded_insert(passes, limit, Box::from(address), pass);
        }
    }

    /// Forgets every pass, keeping them from now on if they were kept.
    fn clear_passes(&mut self) {
        if let Some(passes) = &mut self.passes {
            passes.clear();
        }
    }

    /// The service of `cluster`, resolved with `resolve` on a miss; shared,
    /// not copied, on a hit.
    pub fn service_of(
        &mut self,
        cluster: &str,
        resolve: impl FnOnce() -> Option<ServiceKey>,
    ) -> Option<Rc<Resolved>> {
        if let Some((name, service)) = &self.last_cluster {
            if **name == *cluster {
                return service.clone();
            }
        }
        let (name, service) = match self.clusters.get_key_value(cluster) {
            Some((name, service)) => (name.clone(), service.clone()),
            None => {
                let service = resolve().map(|key| Rc::new(Resolved::new(key)));
                let name: Rc<str> = Rc::from(cluster);
                bounded_insert(
                    &mut self.clusters,
                    self.limit,
                    name.clone(),
                    service.clone(),
                );
                (name, service)
            }
        };
        self.last_cluster = Some((name, service.clone()));
        service
    }

    /// Forgets the cluster resolutions (on every root tick, and with a new
    /// configuration), and the verdicts, which depend on the configuration.
    pub fn clear_clusters(&mut self) {
        self.clusters.clear();
        self.last_cluster = None;
        self.allowed.clear();
        self.clear_passes();
    }

    /// The allowing verdict kept for `service`'s host `ip` under the
    /// current `meta` write, if any.
    pub fn allowed(&self, service: u64, ip: &IpAddr) -> Option<Verdict> {
        self.allowed.get(&(service, *ip)).copied()
    }

    /// Keeps `verdict` for `service`'s host `ip` when it allows; the caller
    /// derived it from readable entries under the current `meta` write.
    pub fn keep(&mut self, service: u64, ip: IpAddr, verdict: Verdict) {
        if verdict.action == Action::Allow {
            bounded_insert(&mut self.allowed, self.limit, (service, ip), verdict);
        }
    }

    /// `meta` and its cas token from `store` (see
    /// [`IndexReader::meta_and_cas`]), read again only when the store's
    /// write count moved since the last read, or when the store keeps none.
    pub fn stamp(&mut self, store: &dyn SharedData) -> Option<(Meta, u32)> {
        let Some(writes) = store.writes() else {
            return IndexReader::new(store).meta_and_cas();
        };
        if let Some((at, stamp)) = self.read {
            if at == writes {
                return stamp;
            }
        }
        // Read after the count: a write that lands meanwhile moves the count
        // again, and the next request reads it.
        let stamp = IndexReader::new(store).meta_and_cas();
        self.read = Some((writes, stamp));
        stamp
    }

    /// [`Cache::stamp`] then [`Cache::align`], as a request does them; at
    /// the write count it last aligned at, neither `meta` nor the entries'
    /// stamp is looked at again.
    pub fn current(&mut self, store: &dyn SharedData) -> Option<(Meta, u32)> {
        if let Some(writes) = store.writes() {
            if self.aligned_at == Some(writes) {
                return self.stamp;
            }
        }
        let stamp = self.stamp(store);
        self.align(stamp);
        self.aligned_at = self.read.map(|(at, _)| at);
        stamp
    }

    /// Keeps the entries if they were filled under exactly this `meta` write,
    /// else forgets them and files new ones under it.
    pub fn align(&mut self, meta: Option<(Meta, u32)>) {
        if self.stamp != meta {
            self.aligned_at = None;
            self.services.clear();
            self.records.clear();
            self.allowed.clear();
            self.clear_passes();
            self.stamp = meta;
        }
    }

    /// Whether `service` is known, from the cache or from `store`.
    pub fn service(
        &mut self,
        store: &dyn SharedData,
        meta: &Meta,
        service: &Resolved,
    ) -> Entry<()> {
        if let Some(known) = self.services.get(&service.id) {
            return if *known {
                Entry::Present(())
            } else {
                Entry::Absent
            };
        }
        let entry = IndexReader::new(store).service(meta, &service.key);
        let known = match entry {
            Entry::Present(()) => true,
            Entry::Absent => false,
            Entry::Corrupt => return Entry::Corrupt,
        };
        bounded_insert(&mut self.services, self.limit, service.id, known);
        entry
    }

    /// The record of `ip`, from the cache or from `store`; the flag says it
    /// came from the cache.
    pub fn record(
        &mut self,
        store: &dyn SharedData,
        meta: &Meta,
        ip: &IpAddr,
    ) -> (Entry<&IpRecord>, bool) {
        let cached = self.records.contains_key(ip);
        if !cached {
            match IndexReader::new(store).record(meta, ip) {
                Entry::Corrupt => return (Entry::Corrupt, false),
                Entry::Absent => bounded_insert(&mut self.records, self.limit, *ip, None),
                Entry::Present(r) => bounded_insert(&mut self.records, self.limit, *ip, Some(r)),
            }
        }
        match self.records.get(ip) {
            Some(Some(record)) => (Entry::Present(record), cached),
            Some(None) | None => (Entry::Absent, cached),
        }
    }

    /// The record of `ip` read from `store` again, replacing the cached one.
    pub fn reread(&mut self, store: &dyn SharedData, meta: &Meta, ip: &IpAddr) -> Entry<&IpRecord> {
        self.records.remove(ip);
        self.record(store, meta, ip).0
    }

    /// Entries held (clusters, services, records), for tests and gauges.
    pub fn sizes(&self) -> (usize, usize, usize) {
        (self.clusters.len(), self.services.len(), self.records.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;
    use crate::sync::{Poller, SyncConfig};
    use staleguard_core::wire::Delta;

    use staleguard_core::{Changes, Freshness, PodHolder, Snapshot};

    /// Counts the reads that reach the store; with `writes` set, counts its
    /// writes too, as a host's store may ([`SharedData::writes`]).
    #[derive(Default)]
    struct Counting {
        inner: MemoryStore,
        reads: std::cell::Cell<usize>,
        writes: Option<u64>,
    }

    impl SharedData for Counting {
        fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, u32), crate::host::StoreError> {
            self.reads.set(self.reads.get() + 1);
            self.inner.get(key)
        }
        fn set(
            &mut self,
            key: &str,
            value: &[u8],
            cas: Option<u32>,
        ) -> Result<(), crate::host::StoreError> {
            let written = self.inner.set(key, value, cas);
            self.writes = self.writes.map(|n| n + 1);
            written
        }
        fn writes(&self) -> Option<u64> {
            self.writes
        }
    }

    fn cart() -> ServiceKey {
        ServiceKey::new("shop", "cart")
    }

    /// The IP held by pod `pod`, a member of a service of the same name:
    /// shared data keeps no pod names, so the tests tell holders apart by
    /// their service.
    fn record(ip: &str, pod: &str) -> IpRecord {
        IpRecord::held_by(
            ip.parse().unwrap(),
            vec![PodHolder::ready_member(
                "shop",
                pod,
                format!("uid-{pod}"),
                ServiceKey::new("shop", pod),
            )],
        )
    }

    fn fresh() -> Freshness {
        Freshness {
            fresh: true,
            age_ms: Some(0),
        }
    }

    fn poller() -> Poller {
        Poller::new(
            SyncConfig {
                wait_s: 1,
                backoff_initial_ms: 1,
                backoff_max_ms: 1,
                min_interval_ms: 0,
                page_bytes: None,
            },
            1,
        )
    }

    /// A store the poller writes and a cache reads, as in one VM.
    struct Vm {
        store: Counting,
        poller: Poller,
        cache: Cache,
    }

    impl Vm {
        /// Nothing synced yet.
        fn new(cache: Cache) -> Self {
            Self {
                store: Counting::default(),
                poller: poller(),
                cache,
            }
        }

        /// Synced with a snapshot of `records` (epoch 1).
        fn synced(cache: Cache, records: Vec<IpRecord>) -> Self {
            let mut vm = Self::new(cache);
            vm.snapshot(1, records);
            vm
        }

        /// The poller applies a snapshot of `records` at generation 1.
        fn snapshot(&mut self, epoch: u64, records: Vec<IpRecord>) {
            let s = Snapshot {
                v: 1,
                epoch,
                generation: 1,
                freshness: fresh(),
                services: vec![cart()],
                records,
            };
            // The first answer is a snapshot; a later one a reset (a new load).
            let body = match self.poller.next_request(0, &self.store.inner) {
                Some(crate::sync::Request::Snapshot) => serde_json::to_vec(&s),
                _ => serde_json::to_vec(&Changes::Reset(s)),
            };
            self.poller
                .on_response(0, 200, &body.unwrap(), &mut self.store.inner)
                .unwrap();
        }

        /// The poller applies a delta from `since` that rewrites `upserts`.
        fn delta(&mut self, since: u64, upserts: Vec<IpRecord>) {
            let d = Changes::Delta(Delta {
                v: 1,
                epoch: 1,
                since,
                generation: since + 1,
                freshness: fresh(),
                services_added: vec![],
                services_removed: vec![],
                upserts,
                removed: vec![],
            });
            self.poller.next_request(1, &self.store.inner);
            let body = serde_json::to_vec(&d).unwrap();
            self.poller
                .on_response(1, 200, &body, &mut self.store.inner)
                .unwrap();
        }

        fn meta(&self) -> Meta {
            IndexReader::new(&self.store).meta().unwrap()
        }

        /// One request's reads, as `judgement::judge` does them: meta, then
        /// entries.
        fn pod_of(&mut self, ip: &str) -> Option<ServiceKey> {
            let meta = IndexReader::new(&self.store).meta_and_cas();
            self.cache.align(meta);
            let (meta, _) = meta?;
            let ip = ip.parse().unwrap();
            match self.cache.record(&self.store, &meta, &ip).0 {
                Entry::Present(r) => held_for(r),
                _ => None,
            }
        }
    }

    /// The service (by id, as shared data names it) of the first pod that
    /// holds `ip`: what tells holders apart here (see `record`).
    fn by_id(pod: &str) -> ServiceKey {
        crate::buckets::placeholder(crate::buckets::service_id(&ServiceKey::new("shop", pod)))
    }

    fn held_for(r: &IpRecord) -> Option<ServiceKey> {
        Some(r.pods.first()?.services.first()?.service.clone())
    }

    /// Synced with 10.0.0.1 held by pod `a`, which the cache has read.
    fn serving_a() -> Vm {
        let mut vm = Vm::synced(Cache::default(), vec![record("10.0.0.1", "a")]);
        assert_eq!(vm.pod_of("10.0.0.1"), Some(by_id("a")));
        vm
    }

    #[test]
    fn a_hit_costs_one_read_of_meta() {
        let mut vm = Vm::synced(Cache::default(), vec![record("10.0.0.1", "a")]);
        vm.store.reads.set(0);
        assert_eq!(vm.pod_of("10.0.0.1"), Some(by_id("a")));
        assert_eq!(vm.store.reads.get(), 2, "meta and the bucket");
        assert_eq!(vm.pod_of("10.0.0.1"), Some(by_id("a")));
        assert_eq!(vm.store.reads.get(), 3, "meta only");
        let meta = vm.meta();
        assert_eq!(
            vm.cache.service(&vm.store, &meta, &Resolved::new(cart())),
            Entry::Present(())
        );
        assert_eq!(
            vm.cache.service(&vm.store, &meta, &Resolved::new(cart())),
            Entry::Present(())
        );
        assert_eq!(vm.store.reads.get(), 5, "meta above, then the service once");
    }

    #[test]
    fn meta_is_read_again_only_when_the_stores_write_count_moved() {
        let mut vm = serving_a();
        let meta = vm.meta();
        vm.store.reads.set(0);
        // A store that keeps no count: meta is read on every request.
        let first = vm.cache.stamp(&vm.store);
        assert!(first.is_some());
        assert_eq!(vm.cache.stamp(&vm.store), first);
        assert_eq!(vm.store.reads.get(), 2);
        // One that does: once per count.
        vm.store.writes = Some(7);
        assert_eq!(vm.cache.stamp(&vm.store), first);
        assert_eq!(vm.cache.stamp(&vm.store), first);
        assert_eq!(vm.store.reads.get(), 3, "read once at count 7");
        // A write through the store (meta rewritten as it was: a new token)
        // moves the count, and the next request sees it.
        vm.store
            .set(crate::store::META_KEY, &meta.encode(), None)
            .unwrap();
        let second = vm.cache.stamp(&vm.store);
        assert_eq!(vm.store.reads.get(), 4);
        assert_ne!(second, first, "a new cas token");
        assert_eq!(second.map(|(m, _)| m), Some(meta));
        assert_eq!(vm.cache.stamp(&vm.store), second);
        assert_eq!(vm.store.reads.get(), 4);
    }

    #[test]
    fn current_aligns_once_per_write_count() {
        let mut vm = serving_a();
        let meta = vm.meta();
        vm.store.writes = Some(1);
        let first = vm.cache.current(&vm.store);
        assert_eq!(first.map(|(m, _)| m), Some(meta));
        vm.store.reads.set(0);
        assert_eq!(vm.cache.current(&vm.store), first);
        assert_eq!(vm.store.reads.get(), 0, "same count: nothing read");
        // Entries aligned elsewhere under another stamp: current files them
        // under what the store holds again.
        vm.cache.align(None);
        assert_eq!(vm.cache.current(&vm.store), first);
        assert_eq!(vm.cache.stamp, first);
        // A write moves the count: meta is read again, the entries go.
        vm.store
            .set(crate::store::META_KEY, &meta.encode(), None)
            .unwrap();
        let second = vm.cache.current(&vm.store);
        assert_ne!(second, first, "a new cas token");
        assert_eq!(vm.cache.stamp, second);
    }

    #[test]
    fn a_new_generation_or_a_rewrite_of_the_same_ip_invalidates() {
        let mut vm = serving_a();
        assert_eq!(vm.pod_of("10.0.0.2"), None);
        // The same IP rewritten (a recycled IP), and a new one.
        vm.delta(1, vec![record("10.0.0.1", "b"), record("10.0.0.2", "c")]);
        assert_eq!(vm.pod_of("10.0.0.1"), Some(by_id("b")));
        assert_eq!(vm.pod_of("10.0.0.2"), Some(by_id("c")));
    }

    #[test]
    fn a_new_load_invalidates() {
        let mut vm = serving_a();
        let before = vm.meta();
        // A validator restart: another epoch, the same generation number.
        vm.snapshot(2, vec![record("10.0.0.1", "z")]);
        let after = vm.meta();
        assert_ne!(before.load, after.load);
        assert_eq!(before.generation, after.generation);
        assert_eq!(vm.pod_of("10.0.0.1"), Some(by_id("z")));
    }

    #[test]
    fn any_write_of_meta_invalidates_even_with_the_same_contents() {
        let mut vm = serving_a();
        // A bucket rewritten behind meta's back, then meta rewritten as it
        // was: the token moved, so the entries go.
        let meta = vm.meta();
        let ip: IpAddr = "10.0.0.1".parse().unwrap();
        crate::buckets::put(
            &mut vm.store.inner,
            meta.load,
            meta.buckets,
            &record("10.0.0.1", "q"),
        )
        .unwrap();
        assert_eq!(vm.pod_of("10.0.0.1"), Some(by_id("a")), "not committed yet");
        vm.store
            .inner
            .set(crate::store::META_KEY, &meta.encode(), None)
            .unwrap();
        assert_eq!(vm.pod_of("10.0.0.1"), Some(by_id("q")));
        assert!(matches!(
            vm.cache.reread(&vm.store, &meta, &ip),
            Entry::Present(r) if held_for(r) == Some(by_id("q"))
        ));
    }

    #[test]
    fn never_serves_a_record_after_meta_moved() {
        // Interleave deltas with reads of changing IPs: every read answers
        // exactly what an uncached read of the same moment answers.
        let mut vm = Vm::synced(Cache::with_limit(8), vec![]);
        let ips: Vec<String> = (1..=20).map(|i| format!("10.0.1.{i}")).collect();
        for g in 1..60u64 {
            let ip = &ips[(g as usize * 7) % ips.len()];
            vm.delta(g, vec![record(ip, &format!("p{g}"))]);
            for probe in &ips {
                let view = IndexReader::new(&vm.store.inner);
                let expected = match view.record(&view.meta().unwrap(), &probe.parse().unwrap()) {
                    Entry::Present(r) => held_for(&r),
                    _ => None,
                };
                assert_eq!(vm.pod_of(probe), expected, "{probe} at {g}");
            }
            assert!(vm.cache.sizes().2 <= 8);
        }
    }

    #[test]
    fn maps_are_bounded_and_clusters_resolve_once() {
        let mut vm = Vm::new(Cache::with_limit(3));
        let mut calls = 0;
        for round in 0..2 {
            for c in ["a", "b", "c"] {
                let got = vm.cache.service_of(c, || {
                    calls += 1;
                    (c != "c").then(cart)
                });
                assert_eq!(got.is_some(), c != "c", "{c} in round {round}");
            }
        }
        assert_eq!(
            calls, 3,
            "a miss resolves, unmapped clusters are cached too"
        );
        vm.cache.service_of("d", || None);
        assert_eq!(vm.cache.sizes().0, 1, "full: cleared before the insert");
        vm.cache.clear_clusters();
        assert_eq!(vm.cache.sizes().0, 0);
        // The last cluster named resolves again too, to what it maps to now.
        let now = vm.cache.service_of("d", || Some(cart()));
        assert_eq!(now.map(|r| r.key.clone()), Some(cart()));
        assert_eq!(
            vm.cache.service_of("d", || None).map(|r| r.key.clone()),
            Some(cart()),
            "and once only"
        );
        // Before any sync there is nothing to file entries under.
        assert_eq!(vm.pod_of("10.0.0.1"), None);
        assert_eq!(vm.cache.sizes().2, 0);
    }
}
