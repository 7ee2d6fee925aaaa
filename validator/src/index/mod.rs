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
//! - a slice entry naming a pod that does not hold the IP is stale and ignored;
//!   an entry without `targetRef` makes the IP a bare member of the service;
//! - an IP that loses its last holder keeps a tombstone for a while.
//!
//! Internally the index keeps compact facts per object (see [`objects`]) and
//! reverse maps from IP to pods and slice entries. An event changes facts, marks
//! the IPs it touched, and only those IPs are re-derived; a record whose
//! fingerprint changed bumps the generation and enters the change log.

mod log;
mod objects;

#[cfg(test)]
pub(crate) mod fixtures;
#[cfg(test)]
mod model;
#[cfg(test)]
mod tests;

use std::collections::hash_map::{DefaultHasher, Entry};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use k8s_openapi::api::core::v1::{Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::watcher::Event;
use staleguard_core::wire::{
    Delta, EndpointConditions, EndpointPort, Membership, PodHolder, Tombstone, Via, WIRE_VERSION,
};
use staleguard_core::{Freshness, IpRecord, ServiceKey, Snapshot};

use self::log::{ChangeKey, ChangeLog};
pub(crate) use self::objects::SERVICE_NAME_LABEL;
use self::objects::{
    obj_name, pod_facts, service_facts, slice_facts, Interner, Labels, ObjName, PodFacts,
    ServiceFacts, SliceFacts, Target, Uid,
};
pub use self::objects::{Kind, Skip};

/// How the index behaves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexConfig {
    /// How long an IP that lost its last holder keeps its tombstone.
    pub tombstone_ttl: Duration,
    /// How many keys (IPs and services) the change log remembers; a client
    /// further behind gets a reset.
    pub change_log_capacity: usize,
}

impl Default for IndexConfig {
    fn default() -> Self {
        Self {
            tombstone_ttl: Duration::from_secs(600),
            change_log_capacity: 100_000,
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
    facts: PodFacts,
    /// Sorted; services of the pod's namespace whose selector matches it.
    selected: Vec<Arc<ServiceKey>>,
}

/// One slice entry, as seen from one of its IPs.
#[derive(Debug, Clone)]
struct IpEntry {
    slice: Arc<ObjName>,
    service: Arc<ServiceKey>,
    target: Target,
    conditions: EndpointConditions,
    ports: Arc<[EndpointPort]>,
}

#[derive(Debug, Clone)]
struct TombState {
    pod: String,
    uid: Uid,
    services: Vec<ServiceKey>,
    since_ms: u64,
}

/// Objects listed since the last `Init`, waiting for `InitDone`.
#[derive(Debug, Default)]
struct Relists {
    pods: Option<Vec<PodFacts>>,
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
    pods: HashMap<Arc<ObjName>, PodState>,
    ns_pods: HashMap<Arc<str>, HashSet<Arc<ObjName>>>,
    services: HashMap<Arc<ServiceKey>, ServiceFacts>,
    /// Per namespace, the services that have a selector.
    ns_selectors: HashMap<Arc<str>, Vec<Arc<ServiceKey>>>,
    slices: HashMap<Arc<ObjName>, SliceFacts>,
    ip_pods: HashMap<IpAddr, Vec<Arc<ObjName>>>,
    /// Per IP, slice entries listing it, sorted by slice name.
    ip_entries: HashMap<IpAddr, Vec<IpEntry>>,
    slice_entries: usize,
    tombstones: HashMap<IpAddr, TombState>,
    tomb_queue: BTreeSet<(u64, IpAddr)>,
    /// IPs with a record, and the fingerprint of that record.
    fingerprints: HashMap<IpAddr, u64>,
    log: ChangeLog,
    synced: [bool; 3],
    relists: Relists,
    skipped: BTreeMap<(Kind, Skip), u64>,
    // Scratch state of the event being applied.
    touched: Vec<IpAddr>,
    pending_tombs: HashMap<IpAddr, TombState>,
    services_touched: HashMap<Arc<ServiceKey>, bool>,
    skips: Vec<Skip>,
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
            pods: HashMap::new(),
            ns_pods: HashMap::new(),
            services: HashMap::new(),
            ns_selectors: HashMap::new(),
            slices: HashMap::new(),
            ip_pods: HashMap::new(),
            ip_entries: HashMap::new(),
            slice_entries: 0,
            tombstones: HashMap::new(),
            tomb_queue: BTreeSet::new(),
            fingerprints: HashMap::new(),
            synced: [false; 3],
            relists: Relists::default(),
            skipped: BTreeMap::new(),
            touched: Vec::new(),
            pending_tombs: HashMap::new(),
            services_touched: HashMap::new(),
            skips: Vec::new(),
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
            Event::InitApply(pod) => {
                if let Some(facts) = pod_facts(&pod, &mut self.interner, &mut self.skips) {
                    self.relists.pods.get_or_insert_with(Vec::new).push(facts);
                }
            }
            Event::InitDone => {
                self.synced[Kind::Pod.slot()] = true;
                if let Some(listed) = self.relists.pods.take() {
                    let keep: HashSet<Arc<ObjName>> =
                        listed.iter().map(|f| f.name.clone()).collect();
                    let gone: Vec<_> = self
                        .pods
                        .keys()
                        .filter(|k| !keep.contains(*k))
                        .cloned()
                        .collect();
                    for name in gone {
                        self.remove_pod(&name);
                    }
                    for facts in listed {
                        self.upsert_pod(facts);
                    }
                }
            }
            Event::Apply(pod) => {
                if let Some(facts) = pod_facts(&pod, &mut self.interner, &mut self.skips) {
                    self.upsert_pod(facts);
                }
            }
            Event::Delete(pod) => match obj_name(&pod, &mut self.interner) {
                Some(name) => self.remove_pod(&name),
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
                    let keep: HashSet<Arc<ObjName>> =
                        listed.iter().map(|f| f.name.clone()).collect();
                    let gone: Vec<_> = self
                        .slices
                        .keys()
                        .filter(|k| !keep.contains(*k))
                        .cloned()
                        .collect();
                    for name in gone {
                        self.remove_slice(&name);
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
                        if let Some(name) = obj_name(&slice, &mut self.interner) {
                            self.remove_slice(&name);
                        }
                    }
                }
            }
            Event::Delete(slice) => match obj_name(&slice, &mut self.interner) {
                Some(name) => self.remove_slice(&name),
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
            if self
                .tombstones
                .get(&ip)
                .is_some_and(|t| t.since_ms == since_ms)
            {
                self.tombstones.remove(&ip);
                self.touched.push(ip);
            }
        }
        self.finish(Kind::Pod, now);
    }

    /// The record of one IP, or `None` when the index knows nothing about it.
    pub fn record(&self, ip: IpAddr) -> Option<IpRecord> {
        let ip = canonical(ip);
        let mut pods: Vec<PodHolder> = Vec::new();
        let entries: &[IpEntry] = self.ip_entries.get(&ip).map_or(&[], Vec::as_slice);
        for name in self.ip_pods.get(&ip).into_iter().flatten() {
            let Some(state) = self.pods.get(name) else {
                continue;
            };
            let f = &state.facts;
            pods.push(PodHolder {
                namespace: f.name.namespace.to_string(),
                name: f.name.name.to_string(),
                uid: f.uid.to_string(),
                services: memberships(state, entries),
                ready: f.ready,
                terminating: f.terminating,
                host_network: f.host_network,
            });
        }
        sort_holders(&mut pods);
        let mut bare_services: Vec<ServiceKey> = entries
            .iter()
            .filter(|e| e.target == Target::Bare)
            .map(|e| (*e.service).clone())
            .collect();
        bare_services.sort();
        bare_services.dedup();
        let tombstone = self.tombstones.get(&ip).map(|t| Tombstone {
            pod: t.pod.clone(),
            uid: t.uid.to_string(),
            services: t.services.clone(),
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
    /// `None` exactly when `record(ip)` is `None`. A new field in the record
    /// must be derived from facts hashed here, or its changes would never
    /// reach clients (the property test compares deltas with snapshots).
    fn fingerprint(&self, ip: IpAddr) -> Option<u64> {
        let holders = self.ip_pods.get(&ip).map_or(&[][..], Vec::as_slice);
        let entries: &[IpEntry] = self.ip_entries.get(&ip).map_or(&[], Vec::as_slice);
        let tomb = self.tombstones.get(&ip);
        let has_bare = entries.iter().any(|e| e.target == Target::Bare);
        if holders.is_empty() && !has_bare && tomb.is_none() {
            return None;
        }
        let mut h = DefaultHasher::new();
        ip.hash(&mut h);
        // Holders are served sorted, so their order here must not matter.
        let mut holders_sum = 0u64;
        for state in holders.iter().filter_map(|n| self.pods.get(n)) {
            let mut ph = DefaultHasher::new();
            let f = &state.facts;
            (&*f.name.namespace, &*f.name.name, &f.uid).hash(&mut ph);
            (f.ready, f.terminating, f.host_network).hash(&mut ph);
            state.selected.len().hash(&mut ph);
            for s in &state.selected {
                s.hash(&mut ph);
            }
            for e in entries.iter().filter(|e| e.target.is(f)) {
                e.service.hash(&mut ph);
                hash_entry(e, &mut ph);
            }
            holders_sum = holders_sum.wrapping_add(ph.finish());
        }
        holders_sum.hash(&mut h);
        if has_bare {
            let mut bare: Vec<&ServiceKey> = entries
                .iter()
                .filter(|e| e.target == Target::Bare)
                .map(|e| &*e.service)
                .collect();
            bare.sort();
            bare.dedup();
            bare.hash(&mut h);
        }
        if let Some(t) = tomb {
            (&t.pod, &t.uid, &t.services, t.since_ms).hash(&mut h);
        }
        Some(h.finish())
    }

    /// True when a Service object `service` exists (in the watched scope).
    pub fn knows_service(&self, service: &ServiceKey) -> bool {
        self.services.contains_key(service)
    }

    /// Every service known, sorted.
    pub fn services(&self) -> Vec<ServiceKey> {
        let mut services: Vec<ServiceKey> = self.services.keys().map(|k| (**k).clone()).collect();
        services.sort();
        services
    }

    /// The whole index at the current generation.
    pub fn snapshot(&self, freshness: Freshness) -> Snapshot {
        let mut ips: Vec<IpAddr> = self.fingerprints.keys().copied().collect();
        ips.sort_unstable();
        Snapshot {
            v: WIRE_VERSION,
            epoch: self.epoch,
            generation: self.generation,
            freshness,
            services: self.services(),
            records: ips.into_iter().filter_map(|ip| self.record(ip)).collect(),
        }
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
            ips: self.fingerprints.len(),
            services: self.services.len(),
            tombstones: self.tombstones.len(),
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
        for state in self.pods.values() {
            if state.facts.terminating || state.facts.ips.is_empty() {
                continue;
            }
            let mut services: BTreeSet<&ServiceKey> = state.selected.iter().map(|s| &**s).collect();
            for ip in state.facts.ips.iter() {
                for e in self.ip_entries.get(ip).into_iter().flatten() {
                    if e.target.is(&state.facts) {
                        services.insert(&e.service);
                    }
                }
            }
            for s in services {
                *counts.entry(s.clone()).or_default() += 1;
            }
        }
        counts.into_iter().collect()
    }

    // --- pods ---

    fn upsert_pod(&mut self, facts: PodFacts) {
        let name = facts.name.clone();
        let old = match self.pods.remove(&name) {
            Some(old) if old.facts == facts => {
                self.pods.insert(name, old);
                return;
            }
            old => old,
        };
        let selected = self.select(&facts.name.namespace, &facts.labels);
        let new = PodState { facts, selected };
        if let Some(old) = &old {
            for ip in old.facts.ips.iter() {
                if new.facts.ips.contains(ip) {
                    self.touched.push(*ip);
                } else {
                    self.release(*ip, old);
                }
            }
        } else {
            self.ns_pods
                .entry(name.namespace.clone())
                .or_default()
                .insert(name.clone());
        }
        for ip in new.facts.ips.iter() {
            if old.as_ref().is_none_or(|o| !o.facts.ips.contains(ip)) {
                self.ip_pods.entry(*ip).or_default().push(name.clone());
                self.touched.push(*ip);
            }
        }
        self.pods.insert(name, new);
    }

    fn remove_pod(&mut self, name: &ObjName) {
        let Some(old) = self.pods.remove(name) else {
            return;
        };
        if let Entry::Occupied(mut e) = self.ns_pods.entry(old.facts.name.namespace.clone()) {
            e.get_mut().remove(name);
            if e.get().is_empty() {
                e.remove();
            }
        }
        for ip in old.facts.ips.iter() {
            self.release(*ip, &old);
        }
    }

    /// `old` no longer holds `ip`; remember a tombstone if it was the last holder.
    fn release(&mut self, ip: IpAddr, old: &PodState) {
        self.touched.push(ip);
        let Entry::Occupied(mut holders) = self.ip_pods.entry(ip) else {
            return;
        };
        holders.get_mut().retain(|n| **n != *old.facts.name);
        if !holders.get().is_empty() {
            return;
        }
        holders.remove();
        let entries: &[IpEntry] = self.ip_entries.get(&ip).map_or(&[], Vec::as_slice);
        let services = memberships(old, entries)
            .into_iter()
            .map(|m| m.service)
            .collect();
        self.pending_tombs.insert(
            ip,
            TombState {
                pod: old.facts.name.to_string(),
                uid: old.facts.uid.clone(),
                services,
                since_ms: 0,
            },
        );
    }

    /// Services of `namespace` whose selector matches `labels`, sorted.
    fn select(&self, namespace: &str, labels: &Labels) -> Vec<Arc<ServiceKey>> {
        let mut out: Vec<Arc<ServiceKey>> = self
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
        let Some(names) = self.ns_pods.get(&namespace) else {
            return;
        };
        for name in names {
            let Some(state) = self.pods.get_mut(name) else {
                continue;
            };
            let matches = selector
                .as_ref()
                .is_some_and(|s| selects(s, &state.facts.labels));
            let position = state.selected.binary_search(key);
            match (matches, position) {
                (true, Err(at)) => state.selected.insert(at, key.clone()),
                (false, Ok(at)) => {
                    state.selected.remove(at);
                }
                _ => continue,
            }
            self.touched.extend(state.facts.ips.iter().copied());
        }
    }

    // --- slices ---

    fn upsert_slice(&mut self, facts: SliceFacts) {
        let Some(old) = self.slices.remove(&facts.name) else {
            for entry in &facts.entries {
                for ip in entry.ips.iter() {
                    self.insert_entry(*ip, &facts, &entry.target, entry.conditions);
                }
            }
            self.slices.insert(facts.name.clone(), facts);
            return;
        };
        if old == facts {
            self.slices.insert(old.name.clone(), old);
            return;
        }
        if old.service != facts.service || old.ports != facts.ports {
            // Every entry changes: replace them all.
            self.slices.insert(old.name.clone(), old);
            self.remove_slice(&facts.name.clone());
            self.upsert_slice(facts);
            return;
        }
        // The common update (one endpoint of a hundred changed): touch only
        // the IPs whose entries differ. Both sides sorted by IP, then walked.
        let old_ips = entries_by_ip(&old);
        let new_ips = entries_by_ip(&facts);
        let (mut i, mut j) = (0, 0);
        let mut changed: Vec<(IpAddr, std::ops::Range<usize>)> = Vec::new();
        while i < old_ips.len() || j < new_ips.len() {
            let ip = match (old_ips.get(i), new_ips.get(j)) {
                (Some(a), Some(b)) => a.0.min(b.0),
                (Some(a), None) => a.0,
                (None, Some(b)) => b.0,
                (None, None) => break,
            };
            let run = |list: &[(IpAddr, usize)], from: usize| {
                from + list[from..].iter().take_while(|(x, _)| *x == ip).count()
            };
            let (i_end, j_end) = (run(&old_ips, i), run(&new_ips, j));
            let same = i_end - i == j_end - j
                && old_ips[i..i_end]
                    .iter()
                    .zip(&new_ips[j..j_end])
                    .all(|((_, a), (_, b))| {
                        let (a, b) = (&old.entries[*a], &facts.entries[*b]);
                        a.target == b.target && a.conditions == b.conditions
                    });
            if !same {
                changed.push((ip, j..j_end));
            }
            (i, j) = (i_end, j_end);
        }
        for (ip, run) in changed {
            self.drop_entries(ip, &facts.name);
            for &(_, at) in &new_ips[run] {
                let entry = &facts.entries[at];
                self.insert_entry(ip, &facts, &entry.target, entry.conditions);
            }
            self.touched.push(ip);
        }
        self.slices.insert(facts.name.clone(), facts);
    }

    /// Adds one entry of `slice` at `ip`, keeping the IP's entries sorted by
    /// slice name (stable within a slice) so that which slice's conditions win
    /// does not depend on the order events arrived in.
    fn insert_entry(
        &mut self,
        ip: IpAddr,
        slice: &SliceFacts,
        target: &Target,
        conditions: EndpointConditions,
    ) {
        let list = self.ip_entries.entry(ip).or_default();
        let at = list.partition_point(|e| e.slice <= slice.name);
        list.insert(
            at,
            IpEntry {
                slice: slice.name.clone(),
                service: slice.service.clone(),
                target: target.clone(),
                conditions,
                ports: slice.ports.clone(),
            },
        );
        self.slice_entries += 1;
        self.touched.push(ip);
    }

    /// Removes the entries of slice `name` at `ip`.
    fn drop_entries(&mut self, ip: IpAddr, name: &ObjName) {
        if let Entry::Occupied(mut list) = self.ip_entries.entry(ip) {
            let before = list.get().len();
            list.get_mut().retain(|e| *e.slice != *name);
            self.slice_entries -= before - list.get().len();
            if list.get().is_empty() {
                list.remove();
            }
        }
        self.touched.push(ip);
    }

    fn remove_slice(&mut self, name: &ObjName) {
        let Some(old) = self.slices.remove(name) else {
            return;
        };
        for entry in &old.entries {
            for ip in entry.ips.iter() {
                self.drop_entries(*ip, name);
            }
        }
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
        let mut changed: Vec<ChangeKey> = Vec::new();
        for &ip in &touched {
            let held = self.ip_pods.contains_key(&ip);
            if held {
                if let Some(old) = self.tombstones.remove(&ip) {
                    self.tomb_queue.remove(&(old.since_ms, ip));
                }
            } else if let Some(mut tomb) = self.pending_tombs.remove(&ip) {
                tomb.since_ms = now_ms;
                if let Some(old) = self.tombstones.insert(ip, tomb) {
                    self.tomb_queue.remove(&(old.since_ms, ip));
                }
                self.tomb_queue.insert((now_ms, ip));
            }
            let fingerprint = self.fingerprint(ip);
            let old = match fingerprint {
                Some(fp) => self.fingerprints.insert(ip, fp),
                None => self.fingerprints.remove(&ip),
            };
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
        if changed.is_empty() {
            return;
        }
        self.generation += 1;
        for key in changed {
            self.log.record(key, self.generation);
        }
    }
}

/// A slice's `(IP, entry index)` pairs, sorted by IP, in slice order per IP.
fn entries_by_ip(slice: &SliceFacts) -> Vec<(IpAddr, usize)> {
    let mut out: Vec<(IpAddr, usize)> = slice
        .entries
        .iter()
        .enumerate()
        .flat_map(|(at, e)| e.ips.iter().map(move |ip| (*ip, at)))
        .collect();
    out.sort_unstable();
    out
}

/// True when every `key=value` of `selector` is among `labels` (both sorted).
fn selects(selector: &Labels, labels: &Labels) -> bool {
    selector.iter().all(|(k, v)| {
        labels
            .binary_search_by(|(lk, _)| (**lk).cmp(&**k))
            .is_ok_and(|at| labels[at].1 == *v)
    })
}

/// The memberships of `pod` at an IP whose slice entries are `entries`.
fn memberships(pod: &PodState, entries: &[IpEntry]) -> Vec<Membership> {
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
    for entry in entries.iter().filter(|e| e.target.is(&pod.facts)) {
        match out.iter_mut().find(|m| m.service == *entry.service) {
            Some(m) => {
                if m.via == Via::Selector {
                    m.via = Via::Both;
                }
                m.ports.extend(entry.ports.iter().cloned());
                m.ports.sort();
                m.ports.dedup();
                m.conditions.get_or_insert(entry.conditions);
            }
            None => out.push(Membership {
                service: (*entry.service).clone(),
                via: Via::Slice,
                ports: entry.ports.to_vec(),
                conditions: Some(entry.conditions),
            }),
        }
    }
    out.sort_by(|a, b| a.service.cmp(&b.service));
    out
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
fn hash_entry(e: &IpEntry, h: &mut DefaultHasher) {
    e.ports.len().hash(h);
    for p in e.ports.iter() {
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

/// IPv4-mapped IPv6 addresses are looked up as the IPv4 address they map.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6
            .to_ipv4_mapped()
            .map(IpAddr::V4)
            .unwrap_or(IpAddr::V6(v6)),
        v4 => v4,
    }
}
