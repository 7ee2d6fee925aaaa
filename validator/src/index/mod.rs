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
//! Internally the index keeps compact facts per object (see [`facts`]): pods
//! and slices in [`table`]s, by id, and one map from IP to the ids of the pods
//! holding it and the slice entries listing it (each entry is stored there
//! only). An event changes facts, marks the IPs it touched, and only those IPs
//! are re-derived; a record whose fingerprint changed bumps the generation and
//! enters the change log.
//!
//! Where each concern lives:
//!
//! | module | owns |
//! | --- | --- |
//! | [`facts`] | Kubernetes objects reduced to facts |
//! | [`pods`] | pods, by name, uid and namespace |
//! | [`services`] | services, in or out of scope, and which pods they select |
//! | [`slices`] | slice entries, kept under the IPs they list |
//! | [`relist`] | buffering a relist and swapping it in, for every kind |
//! | [`membership`] | which services a pod is a member of at an IP, and how |
//! | [`records`] | the records derived from those facts, fingerprints, `finish` |
//! | [`tombstones`] | what an IP remembers once nobody holds it |
//! | [`log`] | the change log |

mod facts;
mod log;
mod membership;
mod pods;
mod records;
mod relist;
mod services;
mod slices;
mod table;
mod tombstones;

/// The index's maps and sets. Their keys (IPs, names) come from the cluster, so
/// the hash is keyed, with a random key per process: aHash, which is built to
/// resist collision attacks without knowledge of the key, and is 3-4 times
/// faster than std's SipHash on the short keys the index uses.
type HashMap<K, V> = std::collections::HashMap<K, V, ahash::RandomState>;
type HashSet<K> = std::collections::HashSet<K, ahash::RandomState>;

#[cfg(test)]
pub(crate) mod fixtures;
#[cfg(test)]
mod reference_model;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use hashbrown::HashTable;
use k8s_openapi::api::core::v1::{Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::watcher::Event;
use smallvec::SmallVec;
use staleguard_core::wire::{Delta, WIRE_VERSION};
use staleguard_core::{Freshness, ServiceKey, Snapshot};

pub(crate) use self::facts::SERVICE_NAME_LABEL;
use self::facts::{Interner, ServiceFacts, Uid};
pub use self::facts::{Kind, Skip};
use self::log::{ChangeKey, ChangeLog};
use self::pods::PodState;
use self::records::IpState;
use self::relist::Relists;
use self::slices::SliceState;
use self::table::{Id, Table};
use self::tombstones::TombState;
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
        self.apply_event(event, now);
    }

    /// Applies one Service watch event.
    pub fn apply_service(&mut self, event: Event<Service>, now: SystemTime) {
        self.apply_event(event, now);
    }

    /// Applies one EndpointSlice watch event.
    pub fn apply_slice(&mut self, event: Event<EndpointSlice>, now: SystemTime) {
        self.apply_event(event, now);
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
    /// chunks walks ([`crate::live::SharedIndex::snapshot`]).
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

    /// The oldest generation [`Self::changes_since`] can still answer from.
    pub fn change_log_floor(&self) -> u64 {
        self.log.floor()
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
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}
