//! The one handle the sources and the API share: the index behind a lock, a
//! generation channel, and per-watch health counters.
//!
//! Sources write through [`SharedIndex::apply_pod`] (and friends), which count
//! the event, apply it and wake every subscriber when the generation moved.
//! Readers take [`SharedIndex::read`] briefly; nothing awaits while holding it.
//!
//! Freshness never takes the lock (a snapshot build holding it for a large
//! index must not stall every handler that asks how fresh the data is), and it
//! is never claimed once the index can no longer be trusted to move: after a
//! source task stopped ([`SharedIndex::fail`]) or a writer panicked with the
//! lock held (a poisoned lock), every answer says not fresh and `/healthz`
//! fails.

use std::collections::HashSet;
use std::net::IpAddr;
use std::ops::Deref;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant, SystemTime};

use k8s_openapi::api::core::v1::{Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::watcher::Event;
use staleguard_core::{Freshness, IpRecord, Snapshot};
use tokio::sync::watch;

use crate::index::{Index, Kind};

/// How many records a snapshot copies per hold of the lock: a few
/// milliseconds, the longest a watch event waits for a snapshot.
pub const SNAPSHOT_CHUNK: usize = 2048;

/// The index, shared. Cheap to clone.
#[derive(Debug, Clone)]
pub struct SharedIndex {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    index: RwLock<Index>,
    generation: watch::Sender<u64>,
    max_staleness: Duration,
    /// Reference point for the `last_heard` atomics.
    started: Instant,
    watches: [WatchCounters; 3],
    /// Every kind finished its initial list, as of the last update; kept out
    /// of the lock so freshness never waits for it.
    synced: AtomicBool,
    /// The same per kind, for the health of each watch.
    kinds_synced: [AtomicBool; 3],
    /// Why the index can no longer be trusted to move, once it cannot.
    failure: OnceLock<String>,
    /// The index's epoch, which never changes.
    epoch: u64,
    /// The change log's floor, as of the last update; kept out of the lock so
    /// that choosing between a delta and a reset never waits for a writer.
    change_log_floor: AtomicU64,
}

/// Counters of one watch. Plain atomics: metrics read them at scrape time.
#[derive(Debug, Default)]
struct WatchCounters {
    applies: AtomicU64,
    deletes: AtomicU64,
    inits: AtomicU64,
    init_applies: AtomicU64,
    init_dones: AtomicU64,
    errors: AtomicU64,
    /// Milliseconds after `started` plus one when the watch last delivered
    /// anything; 0 = never.
    last_heard: AtomicU64,
}

/// The health of one watch (one resource kind).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchHealth {
    /// `pod`, `service` or `endpointslice`.
    pub kind: &'static str,
    /// The watch finished its initial list.
    pub synced: bool,
    /// `Apply` events.
    pub applies: u64,
    /// `Delete` events.
    pub deletes: u64,
    /// `Init` events (one per list).
    pub inits: u64,
    /// `InitApply` events.
    pub init_applies: u64,
    /// `InitDone` events.
    pub init_dones: u64,
    /// Errors the watch reported (it retries with backoff).
    pub errors: u64,
    /// Lists, the first one included (= `inits`).
    pub relists: u64,
    /// Time since the watch last delivered an event or a sign of life; `None`
    /// when it never did.
    pub last_event_age: Option<Duration>,
}

impl WatchHealth {
    /// Event counts by type: `apply`, `delete`, `init`, `init_apply`, `init_done`.
    pub fn events(&self) -> impl Iterator<Item = (&'static str, u64)> {
        [
            ("apply", self.applies),
            ("delete", self.deletes),
            ("init", self.inits),
            ("init_apply", self.init_applies),
            ("init_done", self.init_dones),
        ]
        .into_iter()
    }
}

// === impl SharedIndex ===

impl SharedIndex {
    /// Shares `index`; a watch silent for longer than `max_staleness` makes the
    /// data stale.
    pub fn new(index: Index, max_staleness: Duration) -> Self {
        let (generation, _) = watch::channel(index.generation());
        let synced = AtomicBool::new(index.synced());
        let kinds_synced = Kind::ALL.map(|k| AtomicBool::new(index.kind_synced(k)));
        let epoch = index.epoch();
        let change_log_floor = AtomicU64::new(index.change_log_floor());
        Self {
            inner: Arc::new(Inner {
                index: RwLock::new(index),
                generation,
                max_staleness,
                started: Instant::now(),
                watches: Default::default(),
                synced,
                kinds_synced,
                failure: OnceLock::new(),
                epoch,
                change_log_floor,
            }),
        }
    }

    /// Reads the index. Hold the guard briefly and never across an `.await`.
    pub fn read(&self) -> impl Deref<Target = Index> + '_ {
        self.read_guard()
    }

    fn read_guard(&self) -> RwLockReadGuard<'_, Index> {
        // A writer panicked with the lock held: the index may be half-updated
        // and its source is gone. Keep answering (operators can still look),
        // but never as fresh again.
        self.inner.index.read().unwrap_or_else(|poisoned| {
            self.poisoned();
            poisoned.into_inner()
        })
    }

    fn write_guard(&self) -> RwLockWriteGuard<'_, Index> {
        self.inner.index.write().unwrap_or_else(|poisoned| {
            self.poisoned();
            poisoned.into_inner()
        })
    }

    fn poisoned(&self) {
        self.fail("a writer panicked while updating the index (poisoned lock)");
    }

    /// Marks the index as no longer moving (a source task stopped): from now on
    /// it is never fresh and `/healthz` fails. The first reason sticks. Wakes
    /// every subscriber, so waiting long polls answer `fresh: false` at once.
    pub fn fail(&self, reason: impl Into<String>) {
        let reason = reason.into();
        if self.inner.failure.set(reason.clone()).is_ok() {
            tracing::error!(%reason, "the index is no longer fresh");
            self.inner.generation.send_modify(|_| {});
        }
    }

    /// Why the index can no longer be trusted to move, if it cannot.
    pub fn failure(&self) -> Option<&str> {
        if self.inner.index.is_poisoned() {
            self.poisoned();
        }
        self.inner.failure.get().map(String::as_str)
    }

    /// The epoch, without taking the lock (it never changes).
    pub fn epoch(&self) -> u64 {
        self.inner.epoch
    }

    /// The current generation, without taking the lock.
    pub fn generation(&self) -> u64 {
        *self.inner.generation.borrow()
    }

    /// True when the change log can answer a client at generation `since` with
    /// a delta (it is neither ahead of the index nor compacted away), without
    /// taking the lock. The build checks again under the lock.
    pub fn has_changes_since(&self, since: u64) -> bool {
        since <= self.generation() && since >= self.inner.change_log_floor.load(Ordering::Acquire)
    }

    /// The current generation, notified on every effective change.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.inner.generation.subscribe()
    }

    /// Changes the index and notifies subscribers if the generation moved.
    pub fn update<R>(&self, f: impl FnOnce(&mut Index) -> R) -> R {
        let (result, generation) = {
            let mut index = self.write_guard();
            let result = f(&mut index);
            self.inner.synced.store(index.synced(), Ordering::Release);
            self.inner
                .change_log_floor
                .store(index.change_log_floor(), Ordering::Release);
            for kind in Kind::ALL {
                self.inner.kinds_synced[kind.slot()]
                    .store(index.kind_synced(kind), Ordering::Release);
            }
            (result, index.generation())
        };
        self.inner.generation.send_if_modified(|current| {
            let moved = *current != generation;
            *current = generation;
            moved
        });
        result
    }

    /// Applies a Pod watch event.
    pub fn apply_pod(&self, event: Event<Pod>, now: SystemTime) {
        self.count(Kind::Pod, &event);
        self.update(|index| index.apply_pod(event, now));
    }

    /// Applies a Service watch event.
    pub fn apply_service(&self, event: Event<Service>, now: SystemTime) {
        self.count(Kind::Service, &event);
        self.update(|index| index.apply_service(event, now));
    }

    /// Applies an EndpointSlice watch event.
    pub fn apply_slice(&self, event: Event<EndpointSlice>, now: SystemTime) {
        self.count(Kind::EndpointSlice, &event);
        self.update(|index| index.apply_slice(event, now));
    }

    /// Feeds complete lists of every kind, as the first lists of the watches
    /// would: Services, then Pods, then EndpointSlices, each a relist
    /// (`Init`, an `InitApply` per object, `InitDone`).
    pub(crate) fn relist_all(
        &self,
        services: impl IntoIterator<Item = Service>,
        pods: impl IntoIterator<Item = Pod>,
        slices: impl IntoIterator<Item = EndpointSlice>,
        now: SystemTime,
    ) {
        self.relist(services, now, Self::apply_service);
        self.relist(pods, now, Self::apply_pod);
        self.relist(slices, now, Self::apply_slice);
    }

    fn relist<K>(
        &self,
        objects: impl IntoIterator<Item = K>,
        now: SystemTime,
        apply: fn(&Self, Event<K>, SystemTime),
    ) {
        apply(self, Event::Init, now);
        for object in objects {
            apply(self, Event::InitApply(object), now);
        }
        apply(self, Event::InitDone, now);
    }

    /// The whole index, copied without holding the lock for long: records are
    /// copied [`SNAPSHOT_CHUNK`] at a time, releasing the lock in between so
    /// watch events are applied meanwhile, and at the end everything that
    /// changed since the copy began is taken from the change log, under the
    /// lock, so the result is exactly the index at one generation. Should the
    /// log have dropped those changes meanwhile, the copy is made again in one
    /// piece. Freshness is taken at that last step.
    pub fn snapshot(&self) -> Snapshot {
        self.snapshot_in_chunks(SNAPSHOT_CHUNK, || {})
    }

    fn snapshot_in_chunks(&self, chunk: usize, mut between: impl FnMut()) -> Snapshot {
        let (start, ips) = {
            let index = self.read_guard();
            (index.generation(), index.record_ips())
        };
        let mut records: Vec<IpRecord> = Vec::with_capacity(ips.len());
        for part in ips.chunks(chunk.max(1)) {
            between();
            let index = self.read_guard();
            records.extend(part.iter().filter_map(|ip| index.record(*ip)));
        }
        let index = self.read_guard();
        let freshness = self.freshness();
        let Some(delta) = index.changes_since(start, freshness.clone()) else {
            return index.snapshot(freshness);
        };
        let services = index.services();
        drop(index);
        if !delta.upserts.is_empty() || !delta.removed.is_empty() {
            let changed: HashSet<IpAddr> = delta
                .removed
                .iter()
                .copied()
                .chain(delta.upserts.iter().map(|r| r.ip))
                .collect();
            records.retain(|r| !changed.contains(&r.ip));
            records.extend(delta.upserts);
            records.sort_unstable_by_key(|r| r.ip);
        }
        Snapshot {
            v: delta.v,
            epoch: delta.epoch,
            generation: delta.generation,
            freshness,
            services,
            records,
        }
    }

    /// Drops expired tombstones.
    pub fn expire_tombstones(&self, now: SystemTime) {
        self.update(|index| index.expire_tombstones(now));
    }

    /// Records a sign of life of `kind`'s source that carried no event (a
    /// bookmark, a file that was checked and had not changed).
    pub fn heard(&self, kind: Kind) {
        let ms = u64::try_from(self.inner.started.elapsed().as_millis()).unwrap_or(u64::MAX - 1);
        self.inner.watches[kind.slot()]
            .last_heard
            .store(ms + 1, Ordering::Relaxed);
    }

    /// Records an error of `kind`'s source.
    pub fn watch_error(&self, kind: Kind) {
        self.inner.watches[kind.slot()]
            .errors
            .fetch_add(1, Ordering::Relaxed);
    }

    fn count<K>(&self, kind: Kind, event: &Event<K>) {
        let w = &self.inner.watches[kind.slot()];
        let counter = match event {
            Event::Apply(_) => &w.applies,
            Event::Delete(_) => &w.deletes,
            Event::Init => &w.inits,
            Event::InitApply(_) => &w.init_applies,
            Event::InitDone => &w.init_dones,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        // `Init` is the watcher starting a (re)list, before any request has
        // been answered: it comes again on every retry against an API server
        // that cannot be reached, so it is no sign of life.
        if !matches!(event, Event::Init) {
            self.heard(kind);
        }
    }

    fn age(&self, kind: Kind) -> Option<Duration> {
        let heard = self.inner.watches[kind.slot()]
            .last_heard
            .load(Ordering::Relaxed);
        let heard = Duration::from_millis(heard.checked_sub(1)?);
        Some(self.inner.started.elapsed().saturating_sub(heard))
    }

    /// How current the data is: fresh when every kind finished its initial list
    /// and none was silent for longer than the staleness bound; the age is that
    /// of the least recently heard-from watch.
    pub fn freshness(&self) -> Freshness {
        let synced = self.inner.synced.load(Ordering::Acquire);
        let failed = self.failure().is_some();
        let ages: Vec<Option<Duration>> = Kind::ALL.iter().map(|k| self.age(*k)).collect();
        let oldest = ages.iter().flatten().max().copied();
        let all_recent = ages
            .iter()
            .all(|a| a.is_some_and(|a| a <= self.inner.max_staleness));
        Freshness {
            fresh: synced && all_recent && !failed,
            age_ms: if synced {
                oldest.map(|a| u64::try_from(a.as_millis()).unwrap_or(u64::MAX))
            } else {
                None
            },
        }
    }

    /// True once every kind finished its initial list and the data is fresh.
    pub fn ready(&self) -> bool {
        self.freshness().fresh
    }

    /// The health of each watch, in the order pod, service, endpointslice.
    pub fn watch_health(&self) -> Vec<WatchHealth> {
        Kind::ALL
            .iter()
            .map(|kind| {
                let w = &self.inner.watches[kind.slot()];
                let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
                WatchHealth {
                    kind: kind.as_str(),
                    synced: self.inner.kinds_synced[kind.slot()].load(Ordering::Acquire),
                    applies: load(&w.applies),
                    deletes: load(&w.deletes),
                    inits: load(&w.inits),
                    init_applies: load(&w.init_applies),
                    init_dones: load(&w.init_dones),
                    errors: load(&w.errors),
                    relists: load(&w.inits),
                    last_event_age: self.age(*kind),
                }
            })
            .collect()
    }

    /// The staleness bound.
    pub fn max_staleness(&self) -> Duration {
        self.inner.max_staleness
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::IndexConfig;

    fn shared(max_staleness: Duration) -> SharedIndex {
        SharedIndex::new(Index::new(1, IndexConfig::default()), max_staleness)
    }

    fn sync_all(s: &SharedIndex) {
        s.relist_all([], [], [], SystemTime::now());
    }

    #[test]
    fn fresh_only_after_every_kind_synced_and_stale_when_a_watch_goes_quiet() {
        let s = shared(Duration::from_millis(50));
        assert!(!s.ready());
        assert_eq!(s.freshness().age_ms, None);
        sync_all(&s);
        assert!(s.ready());
        assert!(s.freshness().age_ms.is_some());
        std::thread::sleep(Duration::from_millis(80));
        s.heard(Kind::Pod);
        s.heard(Kind::Service);
        let f = s.freshness();
        assert!(!f.fresh, "the slice watch is quiet");
        assert!(f.age_ms.unwrap() >= 50);
        s.heard(Kind::EndpointSlice);
        assert!(s.ready());
    }

    #[test]
    fn a_watch_that_only_starts_lists_was_never_heard_from() {
        let s = shared(Duration::from_secs(60));
        // What the watcher emits while the API server cannot be reached.
        for _ in 0..3 {
            s.apply_pod(Event::Init, SystemTime::now());
            s.watch_error(Kind::Pod);
        }
        let pod = &s.watch_health()[0];
        assert_eq!((pod.inits, pod.errors), (3, 3));
        assert_eq!(pod.last_event_age, None);
        assert_eq!(s.freshness().age_ms, None);
    }

    #[test]
    fn counts_events_errors_and_relists_per_kind() {
        let s = shared(Duration::from_secs(60));
        sync_all(&s);
        s.apply_pod(Event::Init, SystemTime::now());
        s.watch_error(Kind::Service);
        let health = s.watch_health();
        assert_eq!(health[0].kind, "pod");
        assert_eq!(health[0].inits, 2);
        assert_eq!(health[0].relists, 2);
        assert_eq!(health[0].init_dones, 1);
        assert_eq!(health[1].errors, 1);
        assert!(health.iter().all(|h| h.synced));
        assert_eq!(health[2].events().map(|(_, n)| n).sum::<u64>(), 2);
    }

    #[test]
    fn a_failed_source_is_never_fresh_again() {
        let s = shared(Duration::from_secs(60));
        sync_all(&s);
        assert!(s.ready());
        let mut rx = s.subscribe();
        rx.borrow_and_update();
        s.fail("the pod watch ended");
        assert!(!s.freshness().fresh);
        assert_eq!(s.failure(), Some("the pod watch ended"));
        assert!(rx.has_changed().unwrap(), "waiting long polls are woken");
        s.heard(Kind::Pod);
        sync_all(&s);
        assert!(!s.ready(), "events after the failure do not revive it");
        s.fail("another reason");
        assert_eq!(
            s.failure(),
            Some("the pod watch ended"),
            "the first reason sticks"
        );
    }

    #[test]
    fn a_poisoned_lock_never_yields_a_fresh_answer() {
        let s = shared(Duration::from_secs(60));
        sync_all(&s);
        assert!(s.ready());
        let s2 = s.clone();
        let panicked = std::thread::spawn(move || {
            s2.update(|_| panic!("a bug while applying an event"));
        })
        .join();
        assert!(panicked.is_err());
        assert!(!s.freshness().fresh);
        assert!(!s.ready());
        assert!(s.failure().is_some_and(|f| f.contains("poisoned")));
        // Reading still works, for operators, but says not fresh.
        assert_eq!(s.read().epoch(), 1);
    }

    #[test]
    fn a_snapshot_copied_in_chunks_while_events_land_is_the_index_at_one_generation() {
        use crate::index::fixtures::{pod, service};
        let s = shared(Duration::from_secs(60));
        sync_all(&s);
        let now = SystemTime::now();
        let svc = service("a", "web").selector(&[("app", "web")]).build();
        s.apply_service(Event::Apply(svc), now);
        let web = |i: usize| {
            pod("a", &format!("web-{i}"))
                .ip(&format!("10.1.{}.{}", i / 200, i % 200 + 1))
                .labels(&[("app", "web")])
        };
        for i in 0..100 {
            s.apply_pod(Event::Apply(web(i).build()), now);
        }
        // Between chunks: delete a pod already copied and one not yet copied,
        // add a new IP, turn one pod terminating, add a service.
        let mut step = 0;
        let snapshot = s.snapshot_in_chunks(7, || {
            match step {
                1 => s.apply_pod(Event::Delete(web(0).build()), now),
                2 => s.apply_pod(Event::Delete(web(99).build()), now),
                3 => s.apply_pod(Event::Apply(web(150).build()), now),
                4 => s.apply_pod(Event::Apply(web(3).terminating().build()), now),
                5 => s.apply_service(Event::Apply(service("a", "new").build()), now),
                _ => {}
            }
            step += 1;
        });
        assert!(step > 6, "the copy took several chunks");
        let mut whole = s.read().snapshot(s.freshness());
        whole.freshness = snapshot.freshness.clone();
        assert_eq!(snapshot, whole);
        assert_eq!(snapshot.generation, s.generation());
        // 101 IPs: the two deleted pods' IPs remain, held by nobody (tombstones).
        assert_eq!(snapshot.records.len(), 101);
        let held = snapshot
            .records
            .iter()
            .filter(|r| !r.pods.is_empty())
            .count();
        assert_eq!(held, 99);
    }

    #[test]
    fn a_chunked_copy_outrun_by_the_change_log_starts_over_in_one_piece() {
        use crate::index::fixtures::pod;
        let s = SharedIndex::new(
            Index::new(
                1,
                IndexConfig {
                    change_log_capacity: 2,
                    ..IndexConfig::default()
                },
            ),
            Duration::from_secs(60),
        );
        sync_all(&s);
        let now = SystemTime::now();
        let p = |i: usize| pod("a", &format!("p{i}")).ip(&format!("10.2.0.{}", i + 1));
        for i in 0..20 {
            s.apply_pod(Event::Apply(p(i).build()), now);
        }
        let mut step = 0;
        let snapshot = s.snapshot_in_chunks(3, || {
            if step == 1 {
                for i in 20..30 {
                    s.apply_pod(Event::Apply(p(i).build()), now);
                }
            }
            step += 1;
        });
        let mut whole = s.read().snapshot(s.freshness());
        whole.freshness = snapshot.freshness.clone();
        assert_eq!(snapshot, whole);
        assert_eq!(snapshot.records.len(), 30);
    }

    #[tokio::test]
    async fn subscribers_hear_every_effective_change_and_only_those() {
        use k8s_openapi::api::core::v1::{Pod, PodIP, PodStatus};
        let s = shared(Duration::from_secs(60));
        let mut rx = s.subscribe();
        let mut pod = Pod::default();
        pod.metadata.namespace = Some("a".into());
        pod.metadata.name = Some("p".into());
        pod.status = Some(PodStatus {
            pod_ips: Some(vec![PodIP {
                ip: "10.1.1.1".into(),
            }]),
            ..PodStatus::default()
        });
        s.apply_pod(Event::Apply(pod.clone()), SystemTime::now());
        tokio::time::timeout(Duration::from_secs(1), rx.changed())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(*rx.borrow_and_update(), 1);
        s.apply_pod(Event::Apply(pod), SystemTime::now());
        assert!(!rx.has_changed().unwrap(), "a replay is not a change");
    }
}
