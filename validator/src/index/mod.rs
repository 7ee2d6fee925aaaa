//! The identity index: pod IP -> who holds it, as a pure state machine.
//!
//! [`Index`] is fed with kube-runtime [`watcher::Event`]s for Pods, Services and
//! EndpointSlices and a `now`; it does no I/O and knows nothing about tokio, so
//! every ordering of events can be replayed in a unit test. The rules it
//! implements are written down for users in `docs/index.md`; in short:
//!
//! - a pod holds the IPs in its `status.podIPs` until it is deleted or has
//!   `Succeeded`/`Failed`; with a `deletionTimestamp` it holds them as
//!   *terminating*;
//! - a pod is a member of a service when a slice of the service lists one of its
//!   IPs with the pod as `targetRef`, or when the service's selector matches its
//!   labels (so a new pod never looks foreign before its slice arrives);
//! - a slice entry naming a pod that does not hold the IP is stale and ignored,
//!   unless the pod has no IP yet: then its update with the IP is on its way
//!   (the slice watch outran the pod watch) and the pod holds the IP
//!   *provisionally*, so a brand-new pod never looks destroyed;
//! - an entry without `targetRef` makes the IP a bare member of the service;
//! - an IP that loses its last holder keeps a tombstone for a while.
//!
//! Internally the index keeps compact facts per object (see [`objects`]): pods
//! and slices in [`table`]s, by id, and one map from IP to the ids of the pods
//! holding it and the slice entries listing it (each entry is stored there
//! only). An event changes facts, marks the IPs it touched, and only those IPs
//! are re-derived; a record whose fingerprint changed bumps the generation and
//! enters the change log.

mod log;
mod objects;
mod table;

/// The index's maps and sets. Their keys (IPs, names) come from the cluster, so
/// the hash is keyed, with a random key per process: aHash, which is built to
/// resist collision attacks without knowledge of the key, and is 3-4 times
/// faster than std's SipHash on the short keys the index uses.
type HashMap<K, V> = std::collections::HashMap<K, V, ahash::RandomState>;
type HashSet<K> = std::collections::HashSet<K, ahash::RandomState>;

#[cfg(test)]
pub(crate) mod fixtures;
#[cfg(test)]
mod model;
#[cfg(test)]
mod tests;

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, BTreeSet};
use std::hash::{BuildHasher, Hash, Hasher};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use hashbrown::HashTable;
use k8s_openapi::api::core::v1::{Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::watcher::Event;
use smallvec::SmallVec;
use staleguard_core::wire::{
    Delta, EndpointConditions, EndpointPort, Membership, PodHolder, Tombstone, Via, WIRE_VERSION,
};
use staleguard_core::{Freshness, IpRecord, ServiceKey, Snapshot};

use self::log::{ChangeKey, ChangeLog};
pub(crate) use self::objects::SERVICE_NAME_LABEL;
use self::objects::{
    canonical, name_parts, obj_name, pod_facts, service_facts, slice_facts, EntryFacts, Interner,
    Ips, Labels, ObjName, PodFacts, ServiceFacts, SliceFacts, Target, Uid,
};
pub use self::objects::{Kind, Skip};
use self::table::{Id, Named, Table};
use crate::scope::PodScope;

/// How the index behaves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexConfig {
    /// How long an IP that lost its last holder keeps its tombstone.
    pub tombstone_ttl: Duration,
    /// How many keys (IPs and services) the change log remembers; a client
    /// further behind gets a reset.
    pub change_log_capacity: usize,
    /// Which pods the watches cover: services that may have members outside
    /// it are out of scope, treated as unknown (see [`crate::scope`]).
    pub scope: PodScope,
}

impl Default for IndexConfig {
    fn default() -> Self {
        Self {
            tombstone_ttl: Duration::from_secs(600),
            change_log_capacity: 100_000,
            scope: PodScope::default(),
        }
    }
}

/// Counts that describe the index, for summaries and metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IndexStats {
    /// The current generation.
    pub generation: u64,
    /// Pods known (with or without an IP).
    pub pods: usize,
    /// IPs with a record (live holders, bare members or a tombstone).
    pub ips: usize,
    /// Services known.
    pub services: usize,
    /// IPs that only a tombstone remembers... and IPs whose tombstone is still
    /// kept.
    pub tombstones: usize,
    /// EndpointSlices known.
    pub slices: usize,
    /// (IP, slice entry) pairs known.
    pub slice_entries: usize,
    /// Keys in the change log.
    pub change_log: usize,
    /// Objects (or parts of them) skipped as malformed, by kind and reason.
    pub skipped: BTreeMap<(Kind, Skip), u64>,
}

/// A pod as the index keeps it: its facts and the services that select it.
#[derive(Debug)]
struct PodState {
    name: ObjName,
    facts: PodFacts,
    /// Sorted; services of the pod's namespace whose selector matches it.
    selected: SmallVec<[Arc<ServiceKey>; 1]>,
    /// Where the pod's id sits in its namespace's list.
    ns_slot: usize,
}

impl Named for PodState {
    fn name(&self) -> &ObjName {
        &self.name
    }
}

impl PodState {
    /// True when slice entry `e` names this pod.
    fn listed_by(&self, e: &IpEntry) -> bool {
        e.target.is(&self.name, &self.facts.uid)
    }
}

/// A slice as the index keeps it. Its entries live under their IPs only; the
/// slice remembers which IPs it listed, to diff the next version against.
#[derive(Debug)]
struct SliceState {
    name: ObjName,
    service: Arc<ServiceKey>,
    ports: Arc<[EndpointPort]>,
    /// Sorted, without duplicates.
    ips: Box<[IpAddr]>,
}

impl Named for SliceState {
    fn name(&self) -> &ObjName {
        &self.name
    }
}

/// One slice entry, as seen from its IP.
#[derive(Debug, Clone, PartialEq, Eq)]
struct IpEntry {
    slice: Id,
    target: Target,
    conditions: EndpointConditions,
    /// True while the entry names a uid that no holder of the IP has, and is
    /// listed in `Index::unmatched` for it.
    unmatched: bool,
}

/// Everything the index knows about one IP but its tombstone.
#[derive(Debug, Default)]
struct IpState {
    /// Pods holding the IP.
    holders: SmallVec<[Id; 1]>,
    /// Slice entries listing the IP, sorted by slice name (stable within a
    /// slice), so which slice's conditions win does not depend on the order
    /// events arrived in.
    entries: SmallVec<[IpEntry; 1]>,
    /// The pod that held the IP last, once nobody does.
    tomb: Option<Box<TombState>>,
    /// The fingerprint of the IP's record; 0 when it has none.
    fingerprint: u64,
}

impl IpState {
    fn is_empty(&self) -> bool {
        self.holders.is_empty()
            && self.entries.is_empty()
            && self.tomb.is_none()
            && self.fingerprint == 0
    }
}

#[derive(Debug, Clone)]
struct TombState {
    pod: ObjName,
    uid: Uid,
    /// Sorted.
    services: Vec<Arc<ServiceKey>>,
    since_ms: u64,
}

/// Objects listed since the last `Init`, waiting for `InitDone`.
#[derive(Debug, Default)]
struct Relists {
    pods: Option<Vec<(ObjName, PodFacts)>>,
    services: Option<Vec<ServiceFacts>>,
    slices: Option<Vec<SliceFacts>>,
}

/// The pod IP -> identity index. See the module docs.
#[derive(Debug)]
pub struct Index {
    epoch: u64,
    generation: u64,
    config: IndexConfig,
    interner: Interner,
    pods: Table<PodState>,
    /// Pod ids by uid.
    pods_by_uid: HashTable<Id>,
    /// Per uid, the IPs of slice entries naming it that no holder of theirs
    /// has (a stale entry, or one that outran its pod). When the pod with
    /// that uid appears or changes, these IPs are re-derived.
    unmatched: HashMap<Uid, SmallVec<[IpAddr; 1]>>,
    /// Per namespace, its pods' ids.
    ns_pods: HashMap<Arc<str>, Vec<Id>>,
    services: HashMap<Arc<ServiceKey>, ServiceFacts>,
    /// Services the scope excludes, with the reason (not in `services`).
    out_of_scope: HashMap<Arc<ServiceKey>, Arc<str>>,
    /// Per namespace, the services that have a selector.
    ns_selectors: HashMap<Arc<str>, Vec<Arc<ServiceKey>>>,
    slices: Table<SliceState>,
    ips: HashMap<IpAddr, IpState>,
    /// IPs with a record (a non-zero fingerprint).
    records: usize,
    slice_entries: usize,
    /// Every tombstone, oldest first.
    tomb_queue: BTreeSet<(u64, IpAddr)>,
    log: ChangeLog,
    synced: [bool; 3],
    relists: Relists,
    skipped: BTreeMap<(Kind, Skip), u64>,
    // Scratch state of the event being applied.
    touched: Vec<IpAddr>,
    pending_tombs: HashMap<IpAddr, TombState>,
    services_touched: HashMap<Arc<ServiceKey>, bool>,
    skips: Vec<Skip>,
    changed: Vec<ChangeKey>,
    /// Keys the record fingerprints, so a change cannot be hidden by a
    /// collision crafted in advance.
    fingerprints: ahash::RandomState,
}

// === impl Index ===

impl Index {
    /// An empty index. `epoch` should be random per process start.
    pub fn new(epoch: u64, config: IndexConfig) -> Self {
        Self {
            epoch,
            generation: 0,
            log: ChangeLog::new(config.change_log_capacity),
            config,
            interner: Interner::default(),
            pods: Table::default(),
            pods_by_uid: HashTable::new(),
            unmatched: HashMap::default(),
            ns_pods: HashMap::default(),
            services: HashMap::default(),
            out_of_scope: HashMap::default(),
            ns_selectors: HashMap::default(),
            slices: Table::default(),
            ips: HashMap::default(),
            records: 0,
            slice_entries: 0,
            tomb_queue: BTreeSet::new(),
            synced: [false; 3],
            relists: Relists::default(),
            skipped: BTreeMap::new(),
            touched: Vec::new(),
            pending_tombs: HashMap::default(),
            services_touched: HashMap::default(),
            skips: Vec::new(),
            changed: Vec::new(),
            fingerprints: ahash::RandomState::new(),
        }
    }

    /// The epoch this index was created with.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The generation: bumped once by every event that changed a record or the
    /// set of services.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The configuration.
    pub fn config(&self) -> &IndexConfig {
        &self.config
    }

    /// True once `kind` finished its first list (`InitDone`).
    pub fn kind_synced(&self, kind: Kind) -> bool {
        self.synced[kind.slot()]
    }

    /// True once every kind finished its first list.
    pub fn synced(&self) -> bool {
        self.synced.iter().all(|s| *s)
    }

    /// Applies one Pod watch event.
    pub fn apply_pod(&mut self, event: Event<Pod>, now: SystemTime) {
        match event {
            Event::Init => self.relists.pods = Some(Vec::new()),
            Event::InitApply(pod) => match obj_name(&pod, &mut self.interner) {
                Some(name) => {
                    let before = self.pods.find(&name).and_then(|id| self.pods.get(id));
                    let labels_before = before.map(|p| &p.facts.labels);
                    let facts = pod_facts(&pod, &mut self.interner, &mut self.skips, labels_before);
                    self.relists
                        .pods
                        .get_or_insert_with(Vec::new)
                        .push((name, facts));
                }
                None => self.skips.push(Skip::MissingName),
            },
            Event::InitDone => {
                self.synced[Kind::Pod.slot()] = true;
                if let Some(listed) = self.relists.pods.take() {
                    let keep: HashSet<&ObjName> = listed.iter().map(|(name, _)| name).collect();
                    let gone: Vec<Id> = self
                        .pods
                        .iter()
                        .filter(|(_, p)| !keep.contains(&p.name))
                        .map(|(id, _)| id)
                        .collect();
                    for id in gone {
                        self.remove_pod(id);
                    }
                    for (name, facts) in listed {
                        match self.pods.find(&name) {
                            Some(id) => self.update_pod(id, facts),
                            None => self.insert_pod(name, facts),
                        }
                    }
                }
            }
            // The hot path: look the pod up by borrowed name, and allocate a
            // name only for a pod the index has not seen.
            Event::Apply(pod) => match name_parts(&pod) {
                Some((namespace, name)) => {
                    let id = self.pods.find_parts(namespace, name);
                    let before = id.and_then(|id| self.pods.get(id));
                    let labels_before = before.map(|p| &p.facts.labels);
                    let facts = pod_facts(&pod, &mut self.interner, &mut self.skips, labels_before);
                    match id {
                        Some(id) => self.update_pod(id, facts),
                        None => {
                            let name = ObjName {
                                namespace: self.interner.get(namespace),
                                name: name.into(),
                            };
                            self.insert_pod(name, facts);
                        }
                    }
                }
                None => self.skips.push(Skip::MissingName),
            },
            Event::Delete(pod) => match name_parts(&pod) {
                Some((namespace, name)) => {
                    if let Some(id) = self.pods.find_parts(namespace, name) {
                        self.remove_pod(id);
                    }
                }
                None => self.skips.push(Skip::MissingName),
            },
        }
        self.finish(Kind::Pod, now);
    }

    /// Applies one Service watch event.
    pub fn apply_service(&mut self, event: Event<Service>, now: SystemTime) {
        match event {
            Event::Init => self.relists.services = Some(Vec::new()),
            Event::InitApply(service) => {
                if let Some(facts) = service_facts(&service, &mut self.interner, &mut self.skips) {
                    self.relists
                        .services
                        .get_or_insert_with(Vec::new)
                        .push(facts);
                }
            }
            Event::InitDone => {
                self.synced[Kind::Service.slot()] = true;
                if let Some(listed) = self.relists.services.take() {
                    let keep: HashSet<Arc<ServiceKey>> =
                        listed.iter().map(|f| f.key.clone()).collect();
                    let gone: Vec<_> = self
                        .services
                        .keys()
                        .filter(|k| !keep.contains(*k))
                        .cloned()
                        .collect();
                    for key in gone {
                        self.remove_service(&key);
                    }
                    self.out_of_scope.retain(|k, _| keep.contains(k));
                    for facts in listed {
                        self.upsert_service(facts);
                    }
                }
            }
            Event::Apply(service) => {
                if let Some(facts) = service_facts(&service, &mut self.interner, &mut self.skips) {
                    self.upsert_service(facts);
                }
            }
            Event::Delete(service) => match obj_name(&service, &mut self.interner) {
                Some(name) => {
                    let key = ServiceKey::new(&*name.namespace, &*name.name);
                    self.remove_service(&key);
                }
                None => self.skips.push(Skip::MissingName),
            },
        }
        self.finish(Kind::Service, now);
    }

    /// Applies one EndpointSlice watch event.
    pub fn apply_slice(&mut self, event: Event<EndpointSlice>, now: SystemTime) {
        match event {
            Event::Init => self.relists.slices = Some(Vec::new()),
            Event::InitApply(slice) => {
                if let Some(facts) = slice_facts(&slice, &mut self.interner, &mut self.skips) {
                    self.relists.slices.get_or_insert_with(Vec::new).push(facts);
                }
            }
            Event::InitDone => {
                self.synced[Kind::EndpointSlice.slot()] = true;
                if let Some(listed) = self.relists.slices.take() {
                    let keep: HashSet<&ObjName> = listed.iter().map(|f| &f.name).collect();
                    let gone: Vec<Id> = self
                        .slices
                        .iter()
                        .filter(|(_, s)| !keep.contains(&s.name))
                        .map(|(id, _)| id)
                        .collect();
                    for id in gone {
                        self.remove_slice(id);
                    }
                    for facts in listed {
                        self.upsert_slice(facts);
                    }
                }
            }
            Event::Apply(slice) => {
                match slice_facts(&slice, &mut self.interner, &mut self.skips) {
                    Some(facts) => self.upsert_slice(facts),
                    // A slice that lost its service label lists nobody now.
                    None => {
                        if let Some(id) = obj_name(&slice, &mut self.interner)
                            .and_then(|name| self.slices.find(&name))
                        {
                            self.remove_slice(id);
                        }
                    }
                }
            }
            Event::Delete(slice) => match obj_name(&slice, &mut self.interner) {
                Some(name) => {
                    if let Some(id) = self.slices.find(&name) {
                        self.remove_slice(id);
                    }
                }
                None => self.skips.push(Skip::MissingName),
            },
        }
        self.finish(Kind::EndpointSlice, now);
    }

    /// Drops tombstones older than the configured TTL.
    pub fn expire_tombstones(&mut self, now: SystemTime) {
        let now_ms = unix_ms(now);
        let ttl_ms = u64::try_from(self.config.tombstone_ttl.as_millis()).unwrap_or(u64::MAX);
        while let Some(&(since_ms, ip)) = self.tomb_queue.first() {
            if since_ms.saturating_add(ttl_ms) > now_ms {
                break;
            }
            self.tomb_queue.pop_first();
            if let Some(state) = self.ips.get_mut(&ip) {
                if state.tomb.as_ref().is_some_and(|t| t.since_ms == since_ms) {
                    state.tomb = None;
                    self.touched.push(ip);
                }
            }
        }
        self.finish(Kind::Pod, now);
    }

    /// The record of one IP, or `None` when the index knows nothing about it.
    pub fn record(&self, ip: IpAddr) -> Option<IpRecord> {
        let ip = canonical(ip);
        let state = self.ips.get(&ip);
        let entries: &[IpEntry] = state.map_or(&[], |s| &s.entries);
        let mut pods: Vec<PodHolder> = Vec::new();
        let holders = state.map(|s| self.holders(s)).unwrap_or_default();
        for pod in holders.iter().filter_map(|&id| self.pods.get(id)) {
            let f = &pod.facts;
            pods.push(PodHolder {
                namespace: pod.name.namespace.to_string(),
                name: pod.name.name.to_string(),
                uid: f.uid.to_string(),
                services: self.memberships(pod, entries),
                ready: f.ready,
                terminating: f.terminating,
                host_network: f.host_network,
            });
        }
        sort_holders(&mut pods);
        let mut bare_services: Vec<ServiceKey> = entries
            .iter()
            .filter(|e| e.target == Target::Bare)
            .filter_map(|e| self.slices.get(e.slice))
            .map(|s| (*s.service).clone())
            .collect();
        bare_services.sort();
        bare_services.dedup();
        let tombstone = state.and_then(|s| s.tomb.as_ref()).map(|t| Tombstone {
            pod: t.pod.to_string(),
            uid: t.uid.to_string(),
            services: t.services.iter().map(|s| (**s).clone()).collect(),
            since_ms: t.since_ms,
        });
        let record = IpRecord {
            ip,
            pods,
            bare_services,
            tombstone,
        };
        (!record.is_vacant()).then_some(record)
    }

    /// A hash of everything `record(ip)` would say, computed from the facts
    /// it is derived from without building it (the hot path of every event);
    /// 0 exactly when `record(ip)` is `None`. A new field in the record must
    /// be derived from facts hashed here, or its changes would never reach
    /// clients (the property test compares deltas with snapshots).
    fn fingerprint(&self, ip: IpAddr, state: Option<&IpState>) -> u64 {
        let holders = state.map(|s| self.holders(s)).unwrap_or_default();
        let entries: &[IpEntry] = state.map_or(&[], |s| &s.entries);
        let tomb = state.and_then(|s| s.tomb.as_ref());
        let has_bare = entries.iter().any(|e| e.target == Target::Bare);
        if holders.is_empty() && !has_bare && tomb.is_none() {
            return 0;
        }
        let mut h = self.fingerprints.build_hasher();
        ip.hash(&mut h);
        // Holders are served sorted, so their order here must not matter.
        let mut holders_sum = 0u64;
        for pod in holders.iter().filter_map(|&id| self.pods.get(id)) {
            let mut ph = self.fingerprints.build_hasher();
            let f = &pod.facts;
            (&pod.name, &f.uid).hash(&mut ph);
            (f.ready, f.terminating, f.host_network).hash(&mut ph);
            pod.selected.len().hash(&mut ph);
            for s in &pod.selected {
                s.hash(&mut ph);
            }
            for e in entries.iter().filter(|e| pod.listed_by(e)) {
                if let Some(slice) = self.slices.get(e.slice) {
                    slice.service.hash(&mut ph);
                    hash_entry(slice, e, &mut ph);
                }
            }
            holders_sum = holders_sum.wrapping_add(ph.finish());
        }
        holders_sum.hash(&mut h);
        if has_bare {
            let mut bare: Vec<&ServiceKey> = entries
                .iter()
                .filter(|e| e.target == Target::Bare)
                .filter_map(|e| self.slices.get(e.slice))
                .map(|s| &*s.service)
                .collect();
            bare.sort();
            bare.dedup();
            bare.hash(&mut h);
        }
        if let Some(t) = tomb {
            (&t.pod, &t.uid, &t.services, t.since_ms).hash(&mut h);
        }
        // 0 means "no record".
        h.finish().max(1)
    }

    /// The pods holding the IP of `state`: its holders, and the pods awaiting
    /// an IP that an unmatched entry there names.
    fn holders(&self, state: &IpState) -> SmallVec<[Id; 2]> {
        let mut out: SmallVec<[Id; 2]> = state.holders.iter().copied().collect();
        let provisional = state.entries.iter().filter(|e| e.unmatched);
        for e in provisional {
            let Target::Uid(uid) = &e.target else {
                continue;
            };
            for id in self.pods_with_uid(uid) {
                if self.pods.get(id).is_some_and(|p| p.facts.awaiting_ip) && !out.contains(&id) {
                    out.push(id);
                }
            }
        }
        out
    }

    /// The pods with `uid`: one, unless objects disagree.
    fn pods_with_uid<'a>(&'a self, uid: &'a Uid) -> impl Iterator<Item = Id> + 'a {
        self.pods_by_uid
            .iter_hash(self.fingerprints.hash_one(uid))
            .copied()
            .filter(move |&id| self.pods.get(id).is_some_and(|p| p.facts.uid == *uid))
    }

    /// Touches the IPs whose unmatched entries name `uid`.
    fn touch_unmatched(&mut self, uid: &Uid) {
        if let Some(ips) = self.unmatched.get(uid) {
            self.touched.extend(ips.iter().copied());
        }
    }

    /// True when a Service object `service` exists (in the watched scope).
    pub fn knows_service(&self, service: &ServiceKey) -> bool {
        self.services.contains_key(service)
    }

    /// Why `service` exists but is treated as unknown: it may have members
    /// the watches do not cover (see [`crate::scope`]).
    pub fn out_of_scope(&self, service: &ServiceKey) -> Option<&str> {
        self.out_of_scope.get(service).map(|why| &**why)
    }

    /// How many services are out of scope.
    pub fn out_of_scope_count(&self) -> usize {
        self.out_of_scope.len()
    }

    /// Every service out of scope, with the reason, sorted.
    pub fn out_of_scope_services(&self) -> Vec<(ServiceKey, String)> {
        let mut all: Vec<(ServiceKey, String)> = self
            .out_of_scope
            .iter()
            .map(|(k, why)| ((**k).clone(), why.to_string()))
            .collect();
        all.sort();
        all
    }

    /// Every service known, sorted.
    pub fn services(&self) -> Vec<ServiceKey> {
        let mut services: Vec<ServiceKey> = self.services.keys().map(|k| (**k).clone()).collect();
        services.sort();
        services
    }

    /// The whole index at the current generation.
    pub fn snapshot(&self, freshness: Freshness) -> Snapshot {
        let ips = self.record_ips();
        Snapshot {
            v: WIRE_VERSION,
            epoch: self.epoch,
            generation: self.generation,
            freshness,
            services: self.services(),
            records: ips.into_iter().filter_map(|ip| self.record(ip)).collect(),
        }
    }

    /// The IPs [`Index::snapshot`] would list, sorted: what a copy made in
    /// chunks walks ([`crate::shared::SharedIndex::snapshot`]).
    pub fn record_ips(&self) -> Vec<IpAddr> {
        let mut ips: Vec<IpAddr> = self
            .ips
            .iter()
            .filter(|(_, s)| s.fingerprint != 0)
            .map(|(ip, _)| *ip)
            .collect();
        ips.sort_unstable();
        ips
    }

    /// What changed after generation `since`, compacted to the latest state per
    /// IP and service. `None` when `since` is ahead of the index or older than
    /// the change log remembers: the client must reset from a snapshot.
    pub fn changes_since(&self, since: u64, freshness: Freshness) -> Option<Delta> {
        if since > self.generation {
            return None;
        }
        let mut delta = Delta {
            v: WIRE_VERSION,
            epoch: self.epoch,
            since,
            generation: self.generation,
            freshness,
            services_added: Vec::new(),
            services_removed: Vec::new(),
            upserts: Vec::new(),
            removed: Vec::new(),
        };
        for key in self.log.since(since)? {
            match key {
                ChangeKey::Ip(ip) => match self.record(*ip) {
                    Some(record) => delta.upserts.push(record),
                    None => delta.removed.push(*ip),
                },
                ChangeKey::Service(service) if self.services.contains_key(service) => {
                    delta.services_added.push((**service).clone());
                }
                ChangeKey::Service(service) => delta.services_removed.push((**service).clone()),
            }
        }
        delta.upserts.sort_by_key(|r| r.ip);
        delta.removed.sort_unstable();
        delta.services_added.sort();
        delta.services_removed.sort();
        Some(delta)
    }

    /// Counts for summaries and metrics.
    pub fn stats(&self) -> IndexStats {
        IndexStats {
            generation: self.generation,
            pods: self.pods.len(),
            ips: self.records,
            services: self.services.len(),
            tombstones: self.tomb_queue.len(),
            slices: self.slices.len(),
            slice_entries: self.slice_entries,
            change_log: self.log.len(),
            skipped: self.skipped.clone(),
        }
    }

    /// Per service, how many live (non-terminating) pods are members, sorted by
    /// service; services without members are listed with 0.
    pub fn service_members(&self) -> Vec<(ServiceKey, usize)> {
        let mut counts: BTreeMap<ServiceKey, usize> =
            self.services.keys().map(|k| ((**k).clone(), 0)).collect();
        for (_, pod) in self.pods.iter() {
            if pod.facts.terminating || pod.facts.ips.is_empty() {
                continue;
            }
            let mut services: BTreeSet<&ServiceKey> = pod.selected.iter().map(|s| &**s).collect();
            for ip in pod.facts.ips.iter() {
                let entries = self.ips.get(ip).map_or(&[][..], |s| &s.entries);
                for e in entries.iter().filter(|e| pod.listed_by(e)) {
                    if let Some(slice) = self.slices.get(e.slice) {
                        services.insert(&slice.service);
                    }
                }
            }
            for s in services {
                *counts.entry(s.clone()).or_default() += 1;
            }
        }
        counts.into_iter().collect()
    }

    /// The memberships of `pod` at an IP whose slice entries are `entries`.
    fn memberships(&self, pod: &PodState, entries: &[IpEntry]) -> Vec<Membership> {
        let mut out: Vec<Membership> = pod
            .selected
            .iter()
            .map(|s| Membership {
                service: (**s).clone(),
                via: Via::Selector,
                ports: Vec::new(),
                conditions: None,
            })
            .collect();
        for entry in entries.iter().filter(|e| pod.listed_by(e)) {
            let Some(slice) = self.slices.get(entry.slice) else {
                continue;
            };
            match out.iter_mut().find(|m| m.service == *slice.service) {
                Some(m) => {
                    if m.via == Via::Selector {
                        m.via = Via::Both;
                    }
                    m.ports.extend(slice.ports.iter().cloned());
                    m.ports.sort();
                    m.ports.dedup();
                    m.conditions.get_or_insert(entry.conditions);
                }
                None => out.push(Membership {
                    service: (*slice.service).clone(),
                    via: Via::Slice,
                    ports: slice.ports.to_vec(),
                    conditions: Some(entry.conditions),
                }),
            }
        }
        out.sort_by(|a, b| a.service.cmp(&b.service));
        out
    }

    // --- pods ---

    fn insert_pod(&mut self, name: ObjName, facts: PodFacts) {
        let selected = self.select(&name.namespace, &facts.labels);
        let ns_list = self.ns_pods.entry(name.namespace.clone()).or_default();
        let ns_slot = ns_list.len();
        let ips = facts.ips.clone();
        let uid = facts.uid.clone();
        let id = self.pods.insert(PodState {
            name,
            facts,
            selected,
            ns_slot,
        });
        ns_list.push(id);
        self.index_uid(id, &uid);
        self.touch_unmatched(&uid);
        for ip in ips {
            self.ips.entry(ip).or_default().holders.push(id);
            self.touched.push(ip);
        }
    }

    fn update_pod(&mut self, id: Id, facts: PodFacts) {
        let Some(old) = self.pods.get(id) else {
            return;
        };
        if old.facts == facts {
            return;
        }
        // The IPs the pod gave up: settle them while the state is the old one,
        // which a tombstone remembers.
        let released: Ips = old
            .facts
            .ips
            .iter()
            .filter(|ip| !facts.ips.contains(ip))
            .copied()
            .collect();
        // Label sets are shared: the same set means the same labels.
        let selected = if Arc::ptr_eq(&old.facts.labels, &facts.labels) {
            None
        } else {
            Some(self.select(&old.name.namespace, &facts.labels))
        };
        for ip in released {
            self.release(ip, id);
        }
        let Some(pod) = self.pods.get_mut(id) else {
            return;
        };
        let new_uid = (pod.facts.uid != facts.uid).then(|| facts.uid.clone());
        let old = std::mem::replace(&mut pod.facts, facts);
        let old_ips = old.ips;
        if let Some(selected) = selected {
            pod.selected = selected;
        }
        self.touch_unmatched(&old.uid);
        if let Some(uid) = new_uid {
            self.unindex_uid(id, &old.uid);
            self.index_uid(id, &uid);
            self.touch_unmatched(&uid);
        }
        let Some(pod) = self.pods.get(id) else {
            return;
        };
        for &ip in pod.facts.ips.iter() {
            if !old_ips.contains(&ip) {
                self.ips.entry(ip).or_default().holders.push(id);
            }
            self.touched.push(ip);
        }
    }

    fn remove_pod(&mut self, id: Id) {
        let ips = match self.pods.get(id) {
            Some(pod) => pod.facts.ips.clone(),
            None => return,
        };
        for ip in ips {
            self.release(ip, id);
        }
        if let Some(uid) = self.pods.get(id).map(|p| p.facts.uid.clone()) {
            self.touch_unmatched(&uid);
            self.unindex_uid(id, &uid);
        }
        let Some(old) = self.pods.remove(id) else {
            return;
        };
        if let Entry::Occupied(mut list) = self.ns_pods.entry(old.name.namespace.clone()) {
            let list_ref = list.get_mut();
            if list_ref.get(old.ns_slot) == Some(&id) {
                list_ref.swap_remove(old.ns_slot);
                if let Some(&moved) = list_ref.get(old.ns_slot) {
                    if let Some(pod) = self.pods.get_mut(moved) {
                        pod.ns_slot = old.ns_slot;
                    }
                }
            }
            if list.get().is_empty() {
                list.remove();
            }
        }
    }

    fn index_uid(&mut self, id: Id, uid: &Uid) {
        let hash = self.fingerprints.hash_one(uid);
        let (pods, hasher) = (&self.pods, &self.fingerprints);
        self.pods_by_uid.insert_unique(hash, id, |&other| {
            pods.get(other).map_or(0, |p| hasher.hash_one(&p.facts.uid))
        });
    }

    fn unindex_uid(&mut self, id: Id, uid: &Uid) {
        let hash = self.fingerprints.hash_one(uid);
        if let Ok(entry) = self.pods_by_uid.find_entry(hash, |&other| other == id) {
            entry.remove();
        }
    }

    /// Pod `id` (still in its old state) no longer holds `ip`; remember a
    /// tombstone if it was the last holder.
    fn release(&mut self, ip: IpAddr, id: Id) {
        self.touched.push(ip);
        let Some(state) = self.ips.get_mut(&ip) else {
            return;
        };
        state.holders.retain(|h| *h != id);
        if !state.holders.is_empty() {
            return;
        }
        let (Some(old), Some(state)) = (self.pods.get(id), self.ips.get(&ip)) else {
            return;
        };
        // The services the pod was a member of at this IP, as `memberships`
        // would list them, without building the memberships.
        let mut services: Vec<Arc<ServiceKey>> = old.selected.to_vec();
        for e in state.entries.iter().filter(|e| old.listed_by(e)) {
            if let Some(slice) = self.slices.get(e.slice) {
                services.push(slice.service.clone());
            }
        }
        services.sort();
        services.dedup();
        self.pending_tombs.insert(
            ip,
            TombState {
                pod: old.name.clone(),
                uid: old.facts.uid.clone(),
                services,
                since_ms: 0,
            },
        );
    }

    /// Services of `namespace` whose selector matches `labels`, sorted.
    fn select(&self, namespace: &str, labels: &Labels) -> SmallVec<[Arc<ServiceKey>; 1]> {
        let mut out: SmallVec<[Arc<ServiceKey>; 1]> = self
            .ns_selectors
            .get(namespace)
            .into_iter()
            .flatten()
            .filter(|key| {
                self.services
                    .get(*key)
                    .and_then(|s| s.selector.as_ref())
                    .is_some_and(|sel| selects(sel, labels))
            })
            .cloned()
            .collect();
        out.sort();
        out
    }

    // --- services ---

    fn upsert_service(&mut self, facts: ServiceFacts) {
        let selector = facts
            .selector
            .as_deref()
            .map(|labels| labels.iter().map(|(k, v)| (&**k, &**v)));
        if let Some(why) = self.config.scope.excludes(&facts.key.namespace, selector) {
            // Judging it could call a live pod we do not watch destroyed.
            self.remove_service(&facts.key);
            self.out_of_scope.insert(facts.key, why.into());
            return;
        }
        self.out_of_scope.remove(&facts.key);
        let key = facts.key.clone();
        let old_selector = match self.services.get(&key) {
            Some(old) if *old == facts => return,
            Some(old) => Some(old.selector.clone()),
            None => {
                self.services_touched.entry(key.clone()).or_insert(false);
                None
            }
        };
        let new_selector = facts.selector.clone();
        self.services.insert(key.clone(), facts);
        if old_selector.as_ref() != Some(&new_selector) {
            self.reselect(&key, old_selector.flatten().is_some(), new_selector);
        }
    }

    fn remove_service(&mut self, key: &ServiceKey) {
        self.out_of_scope.remove(key);
        let Some(old) = self.services.remove(key) else {
            return;
        };
        self.services_touched.entry(old.key.clone()).or_insert(true);
        if old.selector.is_some() {
            self.reselect(&old.key, true, None);
        }
    }

    /// The selector of `key` changed to `selector`: update the selected services
    /// of every pod of its namespace, touching the IPs of pods that changed.
    fn reselect(&mut self, key: &Arc<ServiceKey>, had_selector: bool, selector: Option<Labels>) {
        let namespace = self.interner.get(&key.namespace);
        let list = self.ns_selectors.entry(namespace.clone()).or_default();
        match (had_selector, selector.is_some()) {
            (false, true) => list.push(key.clone()),
            (true, false) => list.retain(|k| k != key),
            _ => {}
        }
        if list.is_empty() {
            self.ns_selectors.remove(&namespace);
        }
        let Some(ids) = self.ns_pods.get(&namespace) else {
            return;
        };
        for &id in ids {
            let Some(pod) = self.pods.get_mut(id) else {
                continue;
            };
            let matches = selector
                .as_ref()
                .is_some_and(|s| selects(s, &pod.facts.labels));
            let position = pod.selected.binary_search(key);
            match (matches, position) {
                (true, Err(at)) => pod.selected.insert(at, key.clone()),
                (false, Ok(at)) => {
                    pod.selected.remove(at);
                }
                _ => continue,
            }
            self.touched.extend(pod.facts.ips.iter().copied());
            if let Some(ips) = self.unmatched.get(&pod.facts.uid) {
                self.touched.extend(ips.iter().copied());
            }
        }
    }

    // --- slices ---

    fn upsert_slice(&mut self, facts: SliceFacts) {
        let SliceFacts {
            name,
            service,
            ports,
            entries,
        } = facts;
        let id = match self.slices.find(&name) {
            Some(id) => {
                let replace = self
                    .slices
                    .get(id)
                    .is_some_and(|s| s.service != service || s.ports != ports);
                if replace {
                    // Every entry changes: drop them all, then list the new ones.
                    self.clear_slice(id);
                    if let Some(slice) = self.slices.get_mut(id) {
                        slice.service = service;
                        slice.ports = ports;
                    }
                }
                id
            }
            None => self.slices.insert(SliceState {
                name,
                service,
                ports,
                ips: Box::default(),
            }),
        };
        let old_ips = match self.slices.get_mut(id) {
            Some(slice) => std::mem::take(&mut slice.ips),
            None => return,
        };
        // The common update (one endpoint of a hundred changed) touches only
        // the IPs whose entries differ. Both sides are sorted by IP and walked
        // together.
        let mut new_ips: Vec<IpAddr> = Vec::with_capacity(entries.len());
        let (mut i, mut j) = (0, 0);
        while i < old_ips.len() || j < entries.len() {
            let ip = match (old_ips.get(i), entries.get(j)) {
                (Some(a), Some(b)) => (*a).min(b.ip),
                (Some(a), None) => *a,
                (None, Some(b)) => b.ip,
                (None, None) => break,
            };
            let listed_before = old_ips.get(i) == Some(&ip);
            if listed_before {
                i += 1;
            }
            let end = j + entries[j..].iter().take_while(|e| e.ip == ip).count();
            let run = &entries[j..end];
            j = end;
            if !run.is_empty() {
                new_ips.push(ip);
            }
            if listed_before && self.same_entries(ip, id, run) {
                continue;
            }
            if listed_before {
                self.drop_entries(ip, id);
            }
            for entry in run {
                self.insert_entry(ip, id, entry);
            }
        }
        if let Some(slice) = self.slices.get_mut(id) {
            slice.ips = new_ips.into_boxed_slice();
        }
    }

    /// True when slice `id`'s entries at `ip` are exactly `run`, in order.
    fn same_entries(&self, ip: IpAddr, id: Id, run: &[EntryFacts]) -> bool {
        let entries = self.ips.get(&ip).map_or(&[][..], |s| &s.entries);
        let mut mine = entries.iter().filter(|e| e.slice == id);
        run.iter().all(|new| {
            mine.next()
                .is_some_and(|e| e.target == new.target && e.conditions == new.conditions)
        }) && mine.next().is_none()
    }

    /// Adds one entry of slice `id` at `ip`, after the entries of slices whose
    /// names sort before or equal to its name.
    fn insert_entry(&mut self, ip: IpAddr, id: Id, entry: &EntryFacts) {
        let Some(name) = self.slices.get(id).map(|s| &s.name) else {
            return;
        };
        let slices = &self.slices;
        let list = &mut self.ips.entry(ip).or_default().entries;
        let at = list.partition_point(|e| slices.get(e.slice).is_some_and(|s| s.name <= *name));
        list.insert(
            at,
            IpEntry {
                slice: id,
                target: entry.target.clone(),
                conditions: entry.conditions,
                unmatched: false,
            },
        );
        self.slice_entries += 1;
        self.touched.push(ip);
    }

    /// Removes the entries of slice `id` at `ip`.
    fn drop_entries(&mut self, ip: IpAddr, id: Id) {
        if let Some(state) = self.ips.get_mut(&ip) {
            let before = state.entries.len();
            let unmatched = &mut self.unmatched;
            state.entries.retain(|e| {
                if e.slice != id {
                    return true;
                }
                if let (true, Target::Uid(uid)) = (e.unmatched, &e.target) {
                    forget_unmatched(unmatched, uid, ip);
                }
                false
            });
            self.slice_entries -= before - state.entries.len();
        }
        self.touched.push(ip);
    }

    /// Removes every entry of slice `id`; the slice stays, listing nobody.
    fn clear_slice(&mut self, id: Id) {
        let ips = match self.slices.get_mut(id) {
            Some(slice) => std::mem::take(&mut slice.ips),
            None => return,
        };
        for ip in ips.iter() {
            self.drop_entries(*ip, id);
        }
    }

    fn remove_slice(&mut self, id: Id) {
        self.clear_slice(id);
        self.slices.remove(id);
    }

    // --- bookkeeping ---

    /// Ends an event: settles tombstones, re-derives the touched IPs and bumps
    /// the generation when anything changed.
    fn finish(&mut self, kind: Kind, now: SystemTime) {
        for skip in self.skips.drain(..) {
            *self.skipped.entry((kind, skip)).or_default() += 1;
        }
        let now_ms = unix_ms(now);
        let mut touched = std::mem::take(&mut self.touched);
        touched.sort_unstable();
        touched.dedup();
        let mut changed = std::mem::take(&mut self.changed);
        for &ip in &touched {
            self.match_entries(ip);
            let held = self
                .ips
                .get(&ip)
                .is_some_and(|s| !self.holders(s).is_empty());
            if held {
                if let Some(old) = self.ips.get_mut(&ip).and_then(|s| s.tomb.take()) {
                    self.tomb_queue.remove(&(old.since_ms, ip));
                }
            } else if let Some(mut tomb) = self.pending_tombs.remove(&ip) {
                tomb.since_ms = now_ms;
                let state = self.ips.entry(ip).or_default();
                if let Some(old) = state.tomb.replace(Box::new(tomb)) {
                    self.tomb_queue.remove(&(old.since_ms, ip));
                }
                self.tomb_queue.insert((now_ms, ip));
            }
            let fingerprint = self.fingerprint(ip, self.ips.get(&ip));
            let old = match self.ips.entry(ip) {
                Entry::Occupied(mut e) => {
                    let old = std::mem::replace(&mut e.get_mut().fingerprint, fingerprint);
                    if e.get().is_empty() {
                        e.remove();
                    }
                    old
                }
                Entry::Vacant(e) => {
                    if fingerprint != 0 {
                        e.insert(IpState {
                            fingerprint,
                            ..IpState::default()
                        });
                    }
                    0
                }
            };
            match (old != 0, fingerprint != 0) {
                (false, true) => self.records += 1,
                (true, false) => self.records -= 1,
                _ => {}
            }
            if old != fingerprint {
                changed.push(ChangeKey::Ip(ip));
            }
        }
        touched.clear();
        self.touched = touched;
        self.pending_tombs.clear();
        for (key, existed) in self.services_touched.drain() {
            if self.services.contains_key(&key) != existed {
                changed.push(ChangeKey::Service(key));
            }
        }
        if !changed.is_empty() {
            self.generation += 1;
            for key in changed.drain(..) {
                self.log.record(key, self.generation);
            }
        }
        self.changed = changed;
    }
}

impl Index {
    /// Marks which entries at `ip` name a uid none of its holders has, and
    /// keeps `unmatched` in step.
    fn match_entries(&mut self, ip: IpAddr) {
        let Some(state) = self.ips.get_mut(&ip) else {
            return;
        };
        let (pods, unmatched) = (&self.pods, &mut self.unmatched);
        for e in state.entries.iter_mut() {
            let Target::Uid(uid) = &e.target else {
                continue;
            };
            let matched = state
                .holders
                .iter()
                .any(|&h| pods.get(h).is_some_and(|p| p.facts.uid == *uid));
            if e.unmatched != matched {
                continue;
            }
            e.unmatched = !matched;
            if e.unmatched {
                unmatched.entry(uid.clone()).or_default().push(ip);
            } else {
                forget_unmatched(unmatched, uid, ip);
            }
        }
    }
}

/// Removes one `(uid, ip)` from `unmatched`.
fn forget_unmatched(unmatched: &mut HashMap<Uid, SmallVec<[IpAddr; 1]>>, uid: &Uid, ip: IpAddr) {
    if let Some(ips) = unmatched.get_mut(uid) {
        if let Some(at) = ips.iter().position(|x| *x == ip) {
            ips.swap_remove(at);
        }
        if ips.is_empty() {
            unmatched.remove(uid);
        }
    }
}

/// True when every `key=value` of `selector` is among `labels` (both sorted).
fn selects(selector: &Labels, labels: &Labels) -> bool {
    selector.iter().all(|(k, v)| {
        labels
            .binary_search_by(|(lk, _)| (**lk).cmp(&**k))
            .is_ok_and(|at| labels[at].1 == *v)
    })
}

/// Live holders first, then by name: the order records are served in.
fn sort_holders(pods: &mut [PodHolder]) {
    pods.sort_by(|a, b| {
        (a.terminating, &a.namespace, &a.name, &a.uid).cmp(&(
            b.terminating,
            &b.namespace,
            &b.name,
            &b.uid,
        ))
    });
}

/// Hashes what a slice entry contributes to a membership.
fn hash_entry(slice: &SliceState, e: &IpEntry, h: &mut impl Hasher) {
    slice.ports.len().hash(h);
    for p in slice.ports.iter() {
        (&p.name, p.port, &p.protocol).hash(h);
    }
    let EndpointConditions {
        ready,
        serving,
        terminating,
    } = e.conditions;
    (ready, serving, terminating).hash(h);
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}
