//! The poller: the protocol state machine that keeps the shared-data index in
//! step with the validator.
//!
//! Driven by [`crate::root`]: [`Poller::next_request`] says what to ask the
//! validator, if anything; [`Poller::on_response`] judges an answer (in
//! sequence? held by the guard?) and has [`crate::store::write::Writer`] write
//! it to shared data; [`Poller::on_failure`] schedules a retry after a
//! [`crate::backoff`] delay; [`Poller::wake_at_ms`] says when the poller next
//! has something to do, so the root arms its timer for that moment instead of
//! waiting for the next lease tick; [`Poller::watchdog`] gives up on a call
//! that has been out longer than any answer can take. The cursor (epoch,
//! generation, load) is taken from `meta` when the poller starts, so a context
//! that takes the lease over from a dead poller continues with deltas instead
//! of reloading everything.
//!
//! A reset, an epoch that is not ours (a restarted validator, or another
//! replica behind the same Service), or a delta that does not start at our
//! generation all lead to a full snapshot under a new load id (see
//! [`crate::store`]).

use staleguard_core::wire::{Delta, WireError};
use staleguard_core::{Changes, Policy, Snapshot};

use crate::backoff::Backoff;
use crate::buckets::CompactRecord;
use crate::guard::{Answer, Guard, GuardConfig, GuardEvent};
use crate::host::{SharedData, StoreError};
use crate::store::write::Writer;
use crate::store::{Meta, META_KEY};

/// Why an answer could not be applied.
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    /// The validator answered with a non-200 status (503 also covers Envoy's
    /// own answer when it cannot reach the validator).
    #[error("validator answered HTTP {0}")]
    Status(u32),
    /// The request could not be sent or got no answer.
    #[error("validator request failed: {0}")]
    Transport(String),
    /// The body is not a document of the expected kind or version.
    #[error("validator answer unreadable: {0}")]
    Decode(#[source] WireError),
    /// A delta that does not continue from our generation.
    #[error("delta from generation {since} does not continue ours ({ours})")]
    Sequence {
        /// Where the delta starts.
        since: u64,
        /// Where we are.
        ours: u64,
    },
    /// Shared data refused a write.
    #[error("shared data: {0}")]
    Store(#[from] StoreError),
    /// The request was out longer than any answer can take (a validator that
    /// accepted the connection and never answered, or a host that never
    /// called back): the watchdog gave up on it.
    #[error("no answer after {0} ms: the watchdog gave up on the request")]
    Timeout(u64),
}

impl SyncError {
    /// A bounded label for the sync error counter.
    pub fn kind(&self) -> &'static str {
        match self {
            SyncError::Status(_) => "status",
            SyncError::Transport(_) => "transport",
            SyncError::Decode(_) => "decode",
            SyncError::Sequence { .. } => "sequence",
            SyncError::Store(_) => "store",
            SyncError::Timeout(_) => "timeout",
        }
    }
}

/// Knobs of the sync loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyncConfig {
    /// Long-poll wait in seconds.
    pub wait_s: u32,
    /// First retry delay.
    pub backoff_initial_ms: u64,
    /// Largest retry delay.
    pub backoff_max_ms: u64,
    /// Least time between two requests, even when answers come at once (a
    /// burst of changes, replicas answering resets in turn).
    pub min_interval_ms: u64,
}

/// What the host's timeout of a long poll adds to its wait: the validator
/// answers an idle long poll after `wait` seconds, so an answer later than
/// this is not coming.
pub const LONG_POLL_SLACK_MS: u64 = 5_000;

/// The host's timeout of a snapshot request: building, sending and receiving
/// a 150k-IP snapshot takes about a second (docs/benchmarks.md).
pub const SNAPSHOT_TIMEOUT_MS: u64 = 30_000;

/// How much of an answer's body the poller reads at a time.
pub const BODY_CHUNK: usize = 64 * 1024;

/// What the watchdog adds to the host's timeout before it gives up itself.
pub const WATCHDOG_SLACK_MS: u64 = 2_000;

impl SyncConfig {
    /// The timeout to give the host for `request`.
    pub fn request_timeout_ms(&self, request: &Request) -> u64 {
        match request {
            Request::Snapshot => SNAPSHOT_TIMEOUT_MS,
            Request::Changes { wait_s, .. } => u64::from(*wait_s) * 1_000 + LONG_POLL_SLACK_MS,
        }
    }

    /// How long `request` may be out before the watchdog gives up on it: the
    /// host's timeout plus slack, so the host's own timeout normally fires
    /// first and the watchdog only catches a call the host never reports.
    pub fn watchdog_ms(&self, request: &Request) -> u64 {
        self.request_timeout_ms(request) + WATCHDOG_SLACK_MS
    }
}

/// A request to the validator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Request {
    /// `GET /v1/snapshot?v=1`.
    Snapshot,
    /// `GET /v1/changes?v=1&epoch=E&since=G&wait=S`.
    Changes {
        /// Our epoch.
        epoch: u64,
        /// Our generation.
        since: u64,
        /// Long-poll wait in seconds.
        wait_s: u32,
    },
}

impl Request {
    /// The request path.
    pub fn path(&self) -> String {
        match self {
            // The verdict view: what `decide` needs and no more, which keeps a
            // large snapshot under Envoy's 32 MiB callout limit.
            Request::Snapshot => "/v1/snapshot?v=1&view=verdict".to_owned(),
            Request::Changes {
                epoch,
                since,
                wait_s,
            } => format!("/v1/changes?v=1&view=verdict&epoch={epoch}&since={since}&wait={wait_s}"),
        }
    }
}

/// What an applied answer did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// A full snapshot replaced the index.
    Reset {
        /// IPs in the index now.
        entries: u64,
    },
    /// A delta was applied (possibly empty).
    Delta {
        /// IPs written or cleared.
        changed: u64,
    },
    /// The blast-radius guard held the answer: nothing but its additions
    /// was written and the previous data keeps serving, synced as of this
    /// answer (see [`crate::guard`]).
    Held,
    /// An answer to the watch of a held answer: the validator still serves
    /// it unchanged. Nothing was written but the time of the sync.
    StillHeld,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Cursor {
    load: u64,
    epoch: u64,
    generation: u64,
}

/// Where the validator's held answer stands: the poller long-polls from
/// here, so it hears at once when that answer changes or another validator
/// (a new epoch) answers instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct HeldAt {
    epoch: u64,
    generation: u64,
}

/// The longest the poller waits to ask again after the guard held an
/// answer: a correct validator replacing a wrong one is heard within a
/// second, whatever backoff the wrong one ran up.
pub const HOLD_RETRY_MAX_MS: u64 = 1_000;

/// The poller's state.
#[derive(Debug, Clone)]
pub struct Poller {
    config: SyncConfig,
    cursor: Option<Cursor>,
    /// Adopt the cursor from `meta` before the first request.
    adopted: bool,
    in_flight: Option<Request>,
    /// When the watchdog gives up on the request in flight.
    deadline_ms: u64,
    next_at_ms: u64,
    last_sent_ms: Option<u64>,
    backoff: Backoff,
    /// What applying an answer writes to shared data.
    writer: Writer,
    guard: Guard,
    /// The held answer being watched, while the guard holds one.
    held: Option<HeldAt>,
    /// The request in flight watches the held answer (set with the request,
    /// taken with its answer).
    watching: bool,
    /// A hold wrote additions into the index: if a delta ends the hold, the
    /// next request is a snapshot, which replaces them with the truth.
    gains_written: bool,
}

impl Poller {
    /// A poller; `seed` feeds the backoff jitter.
    pub fn new(config: SyncConfig, seed: u64) -> Self {
        Self {
            config,
            cursor: None,
            adopted: false,
            in_flight: None,
            deadline_ms: 0,
            next_at_ms: 0,
            last_sent_ms: None,
            backoff: Backoff::new(config.backoff_initial_ms, config.backoff_max_ms, seed),
            writer: Writer::default(),
            guard: Guard::new(GuardConfig::default(), Policy::default()),
            held: None,
            watching: false,
            gains_written: false,
        }
    }

    /// Replaces the blast-radius guard (the default one judges under the
    /// default policy).
    pub fn with_guard(mut self, guard: Guard) -> Self {
        self.guard = guard;
        self
    }

    /// What the guard did with the last answer, once.
    pub fn take_guard_event(&mut self) -> Option<GuardEvent> {
        self.guard.take_event()
    }

    /// True while the guard holds an answer back.
    pub fn guard_holding(&self) -> bool {
        self.guard.holding()
    }

    /// The blast-radius guard, for its gauges.
    pub fn guard(&self) -> &Guard {
        &self.guard
    }

    /// The request to send now, if one is due and none is in flight. The
    /// caller must report its fate through `on_response` or `on_failure`.
    pub fn next_request(&mut self, now_ms: u64, store: &dyn SharedData) -> Option<Request> {
        if self.in_flight.is_some() || now_ms < self.next_at_ms {
            return None;
        }
        if let Some(last) = self.last_sent_ms {
            if now_ms < last.saturating_add(self.config.min_interval_ms) {
                return None;
            }
        }
        if !self.adopted {
            self.adopted = true;
            if let Ok((Some(value), _)) = store.get(META_KEY) {
                if let Some(meta) = Meta::decode(&value) {
                    self.cursor = Some(Cursor {
                        load: meta.load,
                        epoch: meta.epoch,
                        generation: meta.generation,
                    });
                    self.writer.adopt(&meta);
                }
            }
        }
        let request = match (self.held, self.cursor) {
            (Some(HeldAt { epoch, generation }), _) => Request::Changes {
                epoch,
                since: generation,
                wait_s: self.config.wait_s,
            },
            (None, None) => Request::Snapshot,
            (None, Some(c)) => Request::Changes {
                epoch: c.epoch,
                since: c.generation,
                wait_s: self.config.wait_s,
            },
        };
        self.watching = self.held.is_some();
        self.in_flight = Some(request);
        self.deadline_ms = now_ms.saturating_add(self.config.watchdog_ms(&request));
        self.last_sent_ms = Some(now_ms);
        Some(request)
    }

    /// The knobs this poller runs with.
    pub fn config(&self) -> &SyncConfig {
        &self.config
    }

    /// True while a request is out.
    pub fn in_flight(&self) -> bool {
        self.in_flight.is_some()
    }

    /// When the poller next has something to do: the moment the next request
    /// may go out (after a backoff, or the least interval after the previous
    /// request), or, while a request is out, the moment the watchdog gives up
    /// on it. The root arms its timer for this instant, so neither a quick
    /// answer nor a backoff waits for a lease tick.
    pub fn wake_at_ms(&self) -> u64 {
        if self.in_flight.is_some() {
            return self.deadline_ms;
        }
        let interval = self
            .last_sent_ms
            .map_or(0, |last| last.saturating_add(self.config.min_interval_ms));
        self.next_at_ms.max(interval)
    }

    /// Gives up on a request that has been out past its watchdog deadline
    /// ([`SyncConfig::watchdog_ms`]; its answer, should it ever come, must then
    /// be ignored by the caller) and schedules the next attempt like any
    /// failure. Returns the error to count.
    pub fn watchdog(&mut self, now_ms: u64) -> Option<SyncError> {
        let request = self.in_flight?;
        if now_ms < self.deadline_ms {
            return None;
        }
        let out_for = now_ms.saturating_sub(
            self.deadline_ms
                .saturating_sub(self.config.watchdog_ms(&request)),
        );
        let error = SyncError::Timeout(out_for);
        self.on_failure(now_ms, &error);
        Some(error)
    }

    /// Forgets the request in flight without judging it (the lease was lost:
    /// its answer will be ignored) and the adopted cursor (a later holder
    /// re-reads `meta`).
    pub fn stand_down(&mut self) {
        self.in_flight = None;
        self.adopted = false;
        self.cursor = None;
        self.backoff.reset();
        self.next_at_ms = 0;
        self.guard.reset();
        self.held = None;
        self.watching = false;
        self.gains_written = false;
    }

    /// The generation applied last, if any.
    pub fn generation(&self) -> Option<u64> {
        self.cursor.map(|c| c.generation)
    }

    /// IPs in the index.
    pub fn entries(&self) -> u64 {
        self.writer.entries()
    }

    /// Applies an answer (`status`, `body`) to the request in flight.
    pub fn on_response(
        &mut self,
        now_ms: u64,
        status: u32,
        body: &[u8],
        store: &mut dyn SharedData,
    ) -> Result<Applied, SyncError> {
        self.on_response_from(now_ms, status, &mut &body[..], store)
    }

    /// Like [`Poller::on_response`], decoding the body as `body` yields it:
    /// the root reads a large answer from the host in chunks instead of
    /// copying all of it into the VM first.
    pub fn on_response_from(
        &mut self,
        now_ms: u64,
        status: u32,
        body: &mut dyn std::io::Read,
        store: &mut dyn SharedData,
    ) -> Result<Applied, SyncError> {
        let request = self.in_flight.take();
        let watching = std::mem::take(&mut self.watching);
        let result = self.apply(now_ms, request, watching, status, body, store);
        match &result {
            // Ask again soon: the answer may be corrected, replaced by another
            // validator's, or persist until the guard confirms it. The next
            // request watches the held answer, which the validator holds
            // until something changes; the backoff only spaces out answers
            // that come back at once.
            Ok(Applied::Held) => {
                let delay = self.backoff.fail().min(HOLD_RETRY_MAX_MS);
                self.next_at_ms = now_ms.saturating_add(delay);
            }
            Ok(Applied::StillHeld) => {
                self.next_at_ms = now_ms;
            }
            Ok(_) => {
                self.backoff.reset();
                self.next_at_ms = now_ms;
            }
            Err(e) => self.fail(now_ms, e),
        }
        result
    }

    /// Records that the request in flight failed without an answer.
    pub fn on_failure(&mut self, now_ms: u64, error: &SyncError) {
        self.in_flight = None;
        self.fail(now_ms, error);
    }

    fn fail(&mut self, now_ms: u64, error: &SyncError) {
        if matches!(error, SyncError::Sequence { .. } | SyncError::Decode(_)) {
            // We may be out of step: the next attempt starts over.
            self.cursor = None;
            self.held = None;
        }
        self.next_at_ms = now_ms.saturating_add(self.backoff.fail());
    }

    fn apply(
        &mut self,
        now_ms: u64,
        request: Option<Request>,
        watching: bool,
        status: u32,
        body: &mut dyn std::io::Read,
        store: &mut dyn SharedData,
    ) -> Result<Applied, SyncError> {
        if status != 200 {
            return Err(SyncError::Status(status));
        }
        // serde_json reads a byte at a time; a buffer makes that a copy out
        // of memory, and asks `body` for large pieces.
        let body = std::io::BufReader::with_capacity(BODY_CHUNK, body);
        match request {
            Some(Request::Snapshot) | None => {
                let snapshot = Snapshot::decode_from(body).map_err(SyncError::Decode)?;
                self.load_snapshot(now_ms, snapshot, store)
            }
            Some(Request::Changes { .. }) => {
                match Changes::decode_from(body).map_err(SyncError::Decode)? {
                    Changes::Reset(snapshot) => self.load_snapshot(now_ms, snapshot, store),
                    Changes::Delta(delta) if watching => self.watch_delta(now_ms, &delta, store),
                    Changes::Delta(delta) => self.apply_delta(now_ms, delta, store),
                }
            }
        }
    }

    /// A delta answering the watch of a held answer. Unchanged, and not yet
    /// due for confirmation: the hold goes on and the data it keeps serving
    /// counts as synced now. Otherwise the next request asks from the
    /// applied generation again, so the guard judges the validator's whole
    /// answer anew (released, held again, or confirmed).
    fn watch_delta(
        &mut self,
        now_ms: u64,
        delta: &Delta<CompactRecord>,
        store: &mut dyn SharedData,
    ) -> Result<Applied, SyncError> {
        let continues = self
            .held
            .is_some_and(|h| delta.epoch == h.epoch && delta.since == h.generation);
        if continues && delta.is_empty() && !self.guard.confirm_due(now_ms) {
            self.held = Some(HeldAt {
                epoch: delta.epoch,
                generation: delta.generation,
            });
            self.writer.refresh(store, now_ms, delta.freshness.fresh)?;
            return Ok(Applied::StillHeld);
        }
        self.held = None;
        Ok(Applied::Held)
    }

    fn load_snapshot(
        &mut self,
        now_ms: u64,
        mut snapshot: Snapshot<CompactRecord>,
        store: &mut dyn SharedData,
    ) -> Result<Applied, SyncError> {
        // The decoder grew the records by doubling: give the spare capacity
        // (up to half of it) to what applying builds next, the guard's baseline
        // and the member lists, instead of growing the VM further.
        snapshot.records.shrink_to_fit();
        let answer = Answer::Reset(&snapshot);
        if !self.guard.admit(now_ms, answer) {
            let at = HeldAt {
                epoch: snapshot.epoch,
                generation: snapshot.generation,
            };
            return self.hold(now_ms, answer, at, snapshot.freshness.fresh, store);
        }
        self.held = None;
        self.gains_written = false;
        let meta = self.writer.write_snapshot(store, now_ms, &mut snapshot)?;
        self.cursor = Some(Cursor {
            load: meta.load,
            epoch: meta.epoch,
            generation: meta.generation,
        });
        self.guard.applied(now_ms, Answer::Reset(&snapshot));
        Ok(Applied::Reset {
            entries: meta.entries,
        })
    }

    /// The guard held `answer` (at `at`): its additions are written, the data
    /// it keeps serving is marked synced (fresh as the validator calls it),
    /// and the next request watches it.
    fn hold(
        &mut self,
        now_ms: u64,
        answer: Answer<'_>,
        at: HeldAt,
        fresh: bool,
        store: &mut dyn SharedData,
    ) -> Result<Applied, SyncError> {
        let gains = self.guard.gains(answer);
        self.writer.write_hold(store, now_ms, fresh, &gains)?;
        self.gains_written |= !gains.is_empty();
        self.held = Some(at);
        Ok(Applied::Held)
    }

    fn apply_delta(
        &mut self,
        now_ms: u64,
        delta: Delta<CompactRecord>,
        store: &mut dyn SharedData,
    ) -> Result<Applied, SyncError> {
        let (epoch, since, generation) = (delta.epoch, delta.since, delta.generation);
        let Some(cursor) = self.cursor else {
            return Err(SyncError::Sequence { since, ours: 0 });
        };
        if epoch != cursor.epoch || since != cursor.generation || generation < since {
            return Err(SyncError::Sequence {
                since,
                ours: cursor.generation,
            });
        }
        let answer = Answer::Delta(&delta);
        if !self.guard.admit(now_ms, answer) {
            let at = HeldAt { epoch, generation };
            return self.hold(now_ms, answer, at, delta.freshness.fresh, store);
        }
        self.held = None;
        let changed = self
            .writer
            .write_delta(store, now_ms, cursor.load, &delta)?;
        self.cursor = Some(Cursor {
            generation,
            ..cursor
        });
        if self.writer.outgrown() || std::mem::take(&mut self.gains_written) {
            // More than two IPs per bucket on average: readers' lookups grow.
            // Or a hold wrote additions this delta does not know of. The next
            // request is a snapshot, laid out anew.
            self.cursor = None;
        }
        self.guard.applied(now_ms, Answer::Delta(&delta));
        Ok(Applied::Delta { changed })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::buckets;
    use crate::entry::Entry;
    use crate::store::{MemoryStore, View};

    use staleguard_core::{Freshness, IpRecord, PodHolder, ServiceKey};
    use std::net::IpAddr;

    const CFG: SyncConfig = SyncConfig {
        wait_s: 5,
        backoff_initial_ms: 100,
        backoff_max_ms: 1_000,
        min_interval_ms: 0,
    };

    /// What the root builds from the shipped plugin configuration.
    const SHIPPED: SyncConfig = SyncConfig {
        wait_s: 30,
        backoff_initial_ms: 500,
        backoff_max_ms: 30_000,
        min_interval_ms: 50,
    };

    fn cart() -> ServiceKey {
        ServiceKey::new("shop", "cart")
    }

    fn rec(ip: &str) -> IpRecord {
        IpRecord::held_by(
            ip.parse().unwrap(),
            vec![PodHolder::ready_member(
                "shop",
                format!("cart-{ip}"),
                ip,
                cart(),
            )],
        )
    }

    fn snapshot(epoch: u64, generation: u64, ips: &[&str]) -> Snapshot {
        Snapshot {
            v: 1,
            epoch,
            generation,
            freshness: Freshness {
                fresh: true,
                age_ms: Some(5),
            },
            services: vec![cart()],
            records: ips.iter().map(|ip| rec(ip)).collect(),
        }
    }

    fn delta(epoch: u64, since: u64, generation: u64) -> Delta {
        Delta {
            v: 1,
            epoch,
            since,
            generation,
            freshness: Freshness {
                fresh: true,
                age_ms: None,
            },
            services_added: vec![],
            services_removed: vec![],
            upserts: vec![],
            removed: vec![],
        }
    }

    fn present(store: &MemoryStore, ip: &str) -> bool {
        matches!(
            View::new(store)
                .lookup(&cart(), &ip.parse().unwrap())
                .record,
            Entry::Present(_)
        )
    }

    fn json<T: serde::Serialize>(t: &T) -> Vec<u8> {
        serde_json::to_vec(t).unwrap()
    }

    /// A poller (id 7) that loaded a snapshot of `ips` (epoch 9, generation 3)
    /// at time 0, and the store it wrote.
    fn loaded(ips: &[&str]) -> (Poller, MemoryStore) {
        let mut store = MemoryStore::default();
        let mut p = Poller::new(CFG, 7);
        p.next_request(0, &store);
        p.on_response(0, 200, &json(&snapshot(9, 3, ips)), &mut store)
            .unwrap();
        (p, store)
    }

    /// 10.0.0.1 to 10.0.0.20.
    fn twenty_ips() -> Vec<String> {
        (1..=20).map(|i| format!("10.0.0.{i}")).collect()
    }

    #[test]
    fn starts_with_a_snapshot_then_long_polls() {
        let mut store = MemoryStore::default();
        let mut p = Poller::new(CFG, 7);
        assert_eq!(p.next_request(0, &store), Some(Request::Snapshot));
        assert_eq!(p.next_request(0, &store), None, "one request at a time");
        let applied = p
            .on_response(10, 200, &json(&snapshot(9, 3, &["10.0.0.1"])), &mut store)
            .unwrap();
        assert_eq!(applied, Applied::Reset { entries: 1 });
        assert!(present(&store, "10.0.0.1"));
        let req = p.next_request(10, &store).unwrap();
        assert_eq!(
            req.path(),
            "/v1/changes?v=1&view=verdict&epoch=9&since=3&wait=5"
        );
        let meta = View::new(&store).meta().unwrap();
        assert_eq!((meta.epoch, meta.generation, meta.synced_ms), (9, 3, 10));
        assert!(meta.fresh);
    }

    #[test]
    fn deltas_upsert_and_remove() {
        let (mut p, mut store) = loaded(&["10.0.0.1"]);
        p.next_request(0, &store);
        let mut d = delta(9, 3, 5);
        d.upserts = vec![rec("10.0.0.2")];
        d.removed = vec!["10.0.0.1".parse().unwrap()];
        let applied = p
            .on_response(20, 200, &json(&Changes::Delta(d)), &mut store)
            .unwrap();
        assert_eq!(applied, Applied::Delta { changed: 2 });
        assert!(!present(&store, "10.0.0.1"));
        assert!(present(&store, "10.0.0.2"));
        assert_eq!(p.generation(), Some(5));
        assert_eq!(p.entries(), 1);
        // An empty answer to a long poll still proves the validator is alive.
        p.next_request(20, &store);
        p.on_response(90, 200, &json(&Changes::Delta(delta(9, 5, 5))), &mut store)
            .unwrap();
        assert_eq!(View::new(&store).meta().unwrap().synced_ms, 90);
    }

    #[test]
    fn a_reset_invalidates_what_the_new_snapshot_lacks() {
        let (mut p, mut store) = loaded(&["10.0.0.1", "10.0.0.2"]);
        p.next_request(0, &store);
        let reset = Changes::Reset(snapshot(11, 1, &["10.0.0.2", "10.0.0.3"]));
        assert_eq!(
            p.on_response(5, 200, &json(&reset), &mut store).unwrap(),
            Applied::Reset { entries: 2 }
        );
        assert!(!present(&store, "10.0.0.1"));
        assert!(present(&store, "10.0.0.2"));
        assert!(present(&store, "10.0.0.3"));
        assert_eq!(
            p.next_request(5, &store).unwrap().path(),
            "/v1/changes?v=1&view=verdict&epoch=11&since=1&wait=5"
        );
    }

    #[test]
    fn a_successor_continues_from_meta_and_a_reset_hides_unknown_leftovers() {
        let mut store = MemoryStore::default();
        let mut first = Poller::new(CFG, 1);
        first.next_request(0, &store);
        first
            .on_response(0, 200, &json(&snapshot(9, 3, &["10.0.0.1"])), &mut store)
            .unwrap();
        // `first` dies; `second` adopts its cursor and asks for changes.
        let mut second = Poller::new(CFG, 2);
        assert_eq!(
            second.next_request(1, &store).unwrap().path(),
            "/v1/changes?v=1&view=verdict&epoch=9&since=3&wait=5"
        );
        let reset = Changes::Reset(snapshot(12, 1, &["10.0.0.5"]));
        second
            .on_response(2, 200, &json(&reset), &mut store)
            .unwrap();
        // second never knew 10.0.0.1's key, but the new load hides it.
        assert!(!present(&store, "10.0.0.1"));
        assert!(present(&store, "10.0.0.5"));
    }

    #[test]
    fn out_of_step_deltas_force_a_snapshot() {
        let (mut p, mut store) = loaded(&[]);
        for bad in [delta(9, 2, 4), delta(8, 3, 4), delta(9, 3, 2)] {
            p.next_request(u64::MAX / 2, &store);
            let err = p
                .on_response(0, 200, &json(&Changes::Delta(bad)), &mut store)
                .unwrap_err();
            assert_eq!(err.kind(), "sequence");
            assert_eq!(
                p.next_request(u64::MAX / 2, &store),
                Some(Request::Snapshot)
            );
            p.on_response(0, 200, &json(&snapshot(9, 3, &[])), &mut store)
                .unwrap();
        }
    }

    #[test]
    fn errors_back_off_exponentially_with_jitter_and_keep_the_data() {
        let (mut p, mut store) = loaded(&["10.0.0.1"]);
        let mut now = 0;
        let mut delays = vec![];
        for status in [503, 500, 401, 503, 503, 503] {
            assert!(p.next_request(now, &store).is_some());
            let err = p.on_response(now, status, b"", &mut store).unwrap_err();
            assert_eq!(err.kind(), "status");
            let before = now;
            while p.next_request(now, &store).is_none() {
                now += 1;
            }
            p.in_flight = None;
            delays.push(now - before);
        }
        assert!((50..=100).contains(&delays[0]), "{delays:?}");
        assert!((100..=200).contains(&delays[1]), "{delays:?}");
        assert!(delays[5] <= 1_000 && delays[5] >= 500, "{delays:?}");
        assert!(present(&store, "10.0.0.1"), "errors never clear data");
        // Garbage is an error too, and the next attempt starts over.
        p.next_request(now, &store);
        let err = p
            .on_response(now, 200, b"{not json", &mut store)
            .unwrap_err();
        assert_eq!(err.kind(), "decode");
        p.on_failure(now, &SyncError::Transport("x".into()));
        now += 10_000;
        assert_eq!(p.next_request(now, &store), Some(Request::Snapshot));
    }

    #[test]
    fn answers_that_come_at_once_do_not_make_a_busy_loop() {
        let mut store = MemoryStore::default();
        let mut p = Poller::new(
            SyncConfig {
                min_interval_ms: 100,
                ..CFG
            },
            7,
        );
        p.next_request(1_000, &store);
        p.on_response(1_000, 200, &json(&snapshot(9, 3, &[])), &mut store)
            .unwrap();
        assert_eq!(p.next_request(1_050, &store), None, "too soon");
        assert!(p.next_request(1_100, &store).is_some());
    }

    /// Drives the poller as the root does with a timer that fires only at
    /// `wake_at_ms` (and at `tick_ms` lease ticks): returns when each request
    /// went out.
    fn sends(p: &mut Poller, store: &MemoryStore, from: u64, until: u64, tick_ms: u64) -> Vec<u64> {
        let mut sent = vec![];
        let mut now = from;
        while now < until {
            if p.next_request(now, store).is_some() {
                sent.push(now);
                // Answered at once (a burst of changes).
                p.in_flight = None;
                p.backoff.reset();
                p.next_at_ms = now;
            }
            let next_tick = (now / tick_ms + 1) * tick_ms;
            now = p.wake_at_ms().max(now + 1).min(next_tick);
        }
        sent
    }

    #[test]
    fn a_quick_answer_is_followed_by_the_next_poll_at_the_least_interval_not_the_tick() {
        let store = MemoryStore::default();
        let mut p = Poller::new(SHIPPED, 7);
        // The shipped tick is 1 s; answers come at once; the next poll is due
        // the least interval (50 ms) after the previous one, every time.
        let sent = sends(&mut p, &store, 1_000, 2_000, 1_000);
        assert_eq!(sent, (20..40).map(|i| i * 50).collect::<Vec<_>>());
    }

    #[test]
    fn backoff_delays_are_honoured_to_the_millisecond() {
        let mut store = MemoryStore::default();
        let mut p = Poller::new(SHIPPED, 7);
        p.next_request(0, &store);
        p.on_response(0, 200, &json(&snapshot(9, 3, &[])), &mut store)
            .unwrap();
        let mut now = p.wake_at_ms();
        assert_eq!(now, 50, "the least interval after the snapshot request");
        for attempt in 0..6 {
            assert!(p.next_request(now, &store).is_some(), "attempt {attempt}");
            p.on_failure(now, &SyncError::Status(503));
            let due = p.wake_at_ms();
            assert!(due > now, "a backoff lies ahead");
            assert_eq!(
                p.next_request(due - 1, &store),
                None,
                "not before it is due"
            );
            now = due;
        }
        // The wake-up time is exactly when the poller sends again.
        assert!(p.next_request(now, &store).is_some());
    }

    #[test]
    fn while_a_request_is_out_the_poller_wakes_for_its_watchdog() {
        let store = MemoryStore::default();
        let mut p = Poller::new(SHIPPED, 7);
        assert_eq!(p.wake_at_ms(), 0, "a new poller is due at once");
        let snapshot = p.next_request(1_000, &store).unwrap();
        assert_eq!(
            p.wake_at_ms(),
            1_000 + SNAPSHOT_TIMEOUT_MS + WATCHDOG_SLACK_MS
        );
        assert_eq!(SHIPPED.watchdog_ms(&snapshot), 32_000);
        let poll = Request::Changes {
            epoch: 1,
            since: 1,
            wait_s: 30,
        };
        assert_eq!(SHIPPED.request_timeout_ms(&poll), 35_000);
        assert_eq!(SHIPPED.watchdog_ms(&poll), 37_000);
    }

    #[test]
    fn the_watchdog_gives_up_on_a_call_that_never_answers_and_backs_off() {
        let (mut p, store) = loaded(&["10.0.0.1"]);
        let poll = p.next_request(10, &store).unwrap();
        let limit = 10 + CFG.watchdog_ms(&poll);
        assert_eq!(limit, 10 + 5_000 + LONG_POLL_SLACK_MS + WATCHDOG_SLACK_MS);
        assert!(p.watchdog(limit - 1).is_none(), "not yet");
        assert!(p.in_flight());
        let error = p.watchdog(limit).unwrap();
        assert_eq!(error.kind(), "timeout");
        assert!(!p.in_flight(), "the call is forgotten");
        assert!(p.watchdog(u64::MAX).is_none(), "nothing left to give up on");
        // Retried after a backoff, from the same cursor: no reload.
        let due = p.wake_at_ms();
        assert!(due > limit);
        assert_eq!(
            p.next_request(due, &store).unwrap().path(),
            "/v1/changes?v=1&view=verdict&epoch=9&since=3&wait=5"
        );
        assert!(present(&store, "10.0.0.1"), "giving up keeps the data");
    }

    fn v6(n: u32) -> String {
        format!("fd00:10:244::{:x}:{:x}", n >> 16, n & 0xffff)
    }

    #[test]
    fn shared_data_stays_bounded_by_the_live_index_under_ipv6_churn() {
        // 100 live pods; 20,000 pods come and go, each with a new IPv6
        // address (IPv6 pod IPs are rarely reused). Shared data cannot delete
        // a key: what bounds it is reusing them. The guard is off: the resets
        // below replace every IP at once, which it would hold.
        let mut store = MemoryStore::default();
        let off = GuardConfig {
            enabled: false,
            ..GuardConfig::default()
        };
        let mut p = Poller::new(CFG, 7).with_guard(Guard::new(off, Policy::default()));
        let live: Vec<String> = (0..100).map(v6).collect();
        let live: Vec<&str> = live.iter().map(String::as_str).collect();
        p.next_request(0, &store);
        p.on_response(0, 200, &json(&snapshot(9, 1, &live)), &mut store)
            .unwrap();
        let keys_at_start = store.len();
        for n in 100..20_100u32 {
            let generation = u64::from(n) - 99;
            let mut d = delta(9, generation, generation + 1);
            d.upserts = vec![rec(&v6(n))];
            if n > 100 {
                d.removed = vec![v6(n - 1).parse().unwrap()];
            }
            p.next_request(u64::from(n) * 1_000, &store).unwrap();
            p.on_response(0, 200, &json(&Changes::Delta(d)), &mut store)
                .unwrap();
        }
        assert_eq!(p.entries(), 101);
        assert!(present(&store, &v6(20_099)));
        assert!(!present(&store, &v6(20_098)));
        assert!(present(&store, &v6(7)));
        let bound = buckets::MIN_BUCKETS as usize + 8;
        assert!(
            store.len() <= bound,
            "{} keys after 20,000 IPs came and went (started with {keys_at_start}, bound {bound})",
            store.len()
        );
        // Resets churn too: each new snapshot reuses the same buckets.
        for round in 0..5u32 {
            let ips: Vec<String> = (0..100).map(|i| v6(100_000 * (round + 1) + i)).collect();
            let ips: Vec<&str> = ips.iter().map(String::as_str).collect();
            p.next_request(u64::MAX / 2, &store).unwrap();
            let reset = Changes::Reset(snapshot(10 + u64::from(round), 1, &ips));
            p.on_response(0, 200, &json(&reset), &mut store).unwrap();
            assert!(present(&store, ips[0]));
        }
        assert!(store.len() <= bound, "{} keys after resets", store.len());
    }

    #[test]
    fn an_index_that_outgrows_its_buckets_is_laid_out_again_at_a_snapshot() {
        let mut store = MemoryStore::default();
        let mut p = Poller::new(CFG, 7);
        p.next_request(0, &store);
        p.on_response(0, 200, &json(&snapshot(9, 1, &[])), &mut store)
            .unwrap();
        // One IP more than twice the aimed-for density of the smallest layout.
        let n = 2 * buckets::IPS_PER_BUCKET as u32 * buckets::MIN_BUCKETS + 1;
        // Pods in no service: the member lists (one key per service, each
        // rewritten per change) are not what this test is about.
        let bare = |n: u32| {
            let mut r = rec(&v6(n));
            r.pods[0].services.clear();
            r
        };
        let grown: Vec<IpRecord> = (0..n).map(bare).collect();
        p.next_request(1_000, &store).unwrap();
        let mut d = delta(9, 1, 2);
        d.upserts = grown.clone();
        p.on_response(1_000, 200, &json(&Changes::Delta(d)), &mut store)
            .unwrap();
        assert_eq!(View::new(&store).meta().unwrap().buckets, 1_024);
        assert!(present(&store, &v6(n - 1)), "still served meanwhile");
        assert_eq!(p.next_request(2_000, &store), Some(Request::Snapshot));
        let ips: Vec<String> = (0..n).map(v6).collect();
        let ips: Vec<&str> = ips.iter().map(String::as_str).collect();
        p.on_response(2_000, 200, &json(&snapshot(9, 2, &ips)), &mut store)
            .unwrap();
        let meta = View::new(&store).meta().unwrap();
        assert_eq!((meta.buckets, meta.entries), (4_096, u64::from(n)));
        assert!(present(&store, &v6(n - 1)) && present(&store, &v6(0)));
    }

    #[test]
    fn the_guard_holds_an_empty_reset_and_the_old_data_keeps_serving() {
        let ips = twenty_ips();
        let (mut p, mut store) = loaded(&ips.iter().map(String::as_str).collect::<Vec<_>>());
        let before = View::new(&store).meta().unwrap();
        let mut empty = snapshot(10, 1, &[]);
        empty.services = vec![cart()];
        let empty = json(&Changes::Reset(empty));

        p.next_request(10, &store);
        assert_eq!(
            p.on_response(10, 200, &empty, &mut store).unwrap(),
            Applied::Held
        );
        assert!(matches!(
            p.take_guard_event(),
            Some(GuardEvent::Held(b)) if b.lost_ips == 20
        ));
        assert_eq!(
            View::new(&store).meta(),
            Some(Meta {
                synced_ms: 10,
                ..before
            }),
            "nothing written but the time of the sync"
        );
        assert!(present(&store, "10.0.0.1"));
        // The held answer is watched, soon: a long poll from its generation.
        assert_eq!(p.next_request(10, &store), None);
        let watch = p.next_request(200, &store).unwrap();
        assert_eq!(
            watch,
            Request::Changes {
                epoch: 10,
                since: 1,
                wait_s: 5
            }
        );
        // Unchanged after the wait: the hold goes on, the data counts as
        // synced, and the watch goes on at once.
        assert_eq!(
            p.on_response(
                5_200,
                200,
                &json(&Changes::Delta(delta(10, 1, 1))),
                &mut store
            )
            .unwrap(),
            Applied::StillHeld
        );
        assert_eq!(View::new(&store).meta().unwrap().synced_ms, 5_200);
        assert_eq!(p.next_request(5_200, &store), Some(watch));
        // The held answer changes: judged anew, from the applied generation.
        let mut changed = delta(10, 1, 2);
        changed.removed = vec!["10.0.0.1".parse().unwrap()];
        assert_eq!(
            p.on_response(6_000, 200, &json(&Changes::Delta(changed)), &mut store)
                .unwrap(),
            Applied::Held
        );
        let again = p.next_request(7_000, &store).unwrap();
        assert_eq!(
            again,
            Request::Changes {
                epoch: 9,
                since: 3,
                wait_s: 5
            }
        );
        p.on_response(7_000, 200, &empty, &mut store).unwrap();
        assert!(present(&store, "10.0.0.1"));
        // Still there after confirm_ms: the change is taken as real.
        p.next_request(60_010, &store);
        assert_eq!(
            p.on_response(60_010, 200, &empty, &mut store).unwrap(),
            Applied::Reset { entries: 0 }
        );
        assert!(matches!(
            p.take_guard_event(),
            Some(GuardEvent::Confirmed(_))
        ));
        assert!(!present(&store, "10.0.0.1"));
    }

    #[test]
    fn a_pod_that_appears_during_a_hold_is_written_and_nothing_else() {
        let ips = twenty_ips();
        let (mut p, mut store) = loaded(&ips.iter().map(String::as_str).collect::<Vec<_>>());
        let before = View::new(&store).meta().unwrap();
        // A wrong reset: 18 of 20 IPs gone, and one new pod (10.0.1.1).
        let held = Changes::Reset(snapshot(10, 1, &["10.0.0.1", "10.0.0.2", "10.0.1.1"]));
        p.next_request(10, &store);
        assert_eq!(
            p.on_response(10, 200, &json(&held), &mut store).unwrap(),
            Applied::Held
        );
        assert!(present(&store, "10.0.1.1"), "the new pod is not destroyed");
        let listed: Vec<IpAddr> = crate::members::read(&store, &cart(), before.load)
            .iter()
            .map(|m| m.ip)
            .collect();
        assert!(
            listed.contains(&"10.0.1.1".parse().unwrap()),
            "and is in cart's member list: {listed:?}"
        );
        assert!(
            present(&store, "10.0.0.20"),
            "the held losses are not written"
        );
        assert_eq!(
            View::new(&store).meta(),
            Some(Meta {
                synced_ms: 10,
                ..before
            }),
            "meta only synced"
        );
    }

    #[test]
    fn a_hold_keeps_the_data_fresh_only_while_the_validator_calls_it_fresh() {
        let ips = twenty_ips();
        let (mut p, mut store) = loaded(&ips.iter().map(String::as_str).collect::<Vec<_>>());
        let mut empty = snapshot(10, 1, &[]);
        empty.freshness.fresh = false;
        p.next_request(10, &store);
        assert_eq!(
            p.on_response(10, 200, &json(&Changes::Reset(empty)), &mut store)
                .unwrap(),
            Applied::Held
        );
        let meta = View::new(&store).meta().unwrap();
        assert!(!meta.fresh, "a validator that is not fresh is not trusted");
        assert!(!meta.is_fresh(20, 60_000));
    }

    /// The sequence of issue 23: a wrong validator serves a huge reset of one
    /// service that lacks its one live pod, then resets naming a single IP;
    /// then the correct validator answers. Its answer is enforced at once:
    /// the huge reset did not become the reference the guard holds the
    /// truth against.
    #[test]
    fn a_wrong_validator_cannot_make_the_guard_hold_the_correct_one() {
        let (mut p, mut store) = loaded(&["10.0.0.1"]);
        // 1. 20,000 members of cart, not 10.0.0.1: applied (one pod is under
        //    every threshold), its additions unconfirmed.
        let huge: Vec<String> = (0..20_000)
            .map(|i| format!("10.1.{}.{}", i / 250, i % 250))
            .collect();
        let huge: Vec<&str> = huge.iter().map(String::as_str).collect();
        p.next_request(1_000, &store);
        let answer = p
            .on_response(
                1_000,
                200,
                &json(&Changes::Reset(snapshot(66, 1, &huge))),
                &mut store,
            )
            .unwrap();
        assert_eq!(answer, Applied::Reset { entries: 20_000 });
        assert_eq!(p.take_guard_event(), None);
        assert_eq!(p.guard().unconfirmed_ips(), 20_000);
        // 2. Then a reset naming two other IPs: every IP of cart, by the
        //    guard's rules, if they were its reference.
        p.next_request(2_000, &store);
        let two = Changes::Reset(snapshot(67, 1, &["10.0.0.2", "10.0.0.3"]));
        assert_eq!(
            p.on_response(2_000, 200, &json(&two), &mut store).unwrap(),
            Applied::Reset { entries: 2 }
        );
        // 3. The correct validator: enforced at once, nothing held.
        p.next_request(3_000, &store);
        let truth = Changes::Reset(snapshot(70, 1, &["10.0.0.1"]));
        assert_eq!(
            p.on_response(3_000, 200, &json(&truth), &mut store)
                .unwrap(),
            Applied::Reset { entries: 1 }
        );
        assert!(!p.guard_holding());
        assert!(present(&store, "10.0.0.1") && !present(&store, "10.0.0.2"));
        assert!(View::new(&store).meta().unwrap().is_fresh(3_000, 5_000));
    }

    #[test]
    fn a_delta_that_ends_a_hold_with_written_gains_is_followed_by_a_snapshot() {
        let ips = twenty_ips();
        let (mut p, mut store) = loaded(&ips.iter().map(String::as_str).collect::<Vec<_>>());
        // Held: 18 of 20 gone, and a new pod whose gain is written.
        let held = Changes::Reset(snapshot(10, 1, &["10.0.0.1", "10.0.0.2", "10.0.1.1"]));
        p.next_request(10, &store);
        assert_eq!(
            p.on_response(10, 200, &json(&held), &mut store).unwrap(),
            Applied::Held
        );
        assert!(present(&store, "10.0.1.1"));
        // The held answer changes; asked again from our cursor, the first
        // validator answers an empty delta: released.
        p.next_request(1_000, &store);
        let mut changed = delta(10, 1, 2);
        changed.removed = vec!["10.0.0.2".parse().unwrap()];
        p.on_response(1_000, 200, &json(&Changes::Delta(changed)), &mut store)
            .unwrap();
        p.next_request(2_000, &store);
        assert!(matches!(
            p.on_response(
                2_000,
                200,
                &json(&Changes::Delta(delta(9, 3, 4))),
                &mut store
            ),
            Ok(Applied::Delta { .. })
        ));
        assert_eq!(p.take_guard_event(), Some(GuardEvent::Released));
        // The gain it knows nothing of goes with the next request, a snapshot.
        assert_eq!(p.next_request(3_000, &store), Some(Request::Snapshot));
    }

    #[test]
    fn the_guard_lets_a_delta_of_tombstones_through_at_once() {
        let ips: Vec<String> = (1..=250)
            .map(|i| format!("10.0.{}.{}", i / 200, i % 200))
            .collect();
        let (mut p, mut store) = loaded(&ips.iter().map(String::as_str).collect::<Vec<_>>());
        p.next_request(0, &store);
        let mut d = delta(9, 3, 233);
        d.upserts = ips[20..]
            .iter()
            .map(|ip| IpRecord {
                pods: vec![],
                tombstone: Some(staleguard_core::wire::Tombstone {
                    pod: format!("shop/cart-{ip}"),
                    uid: String::new(),
                    services: vec![cart()],
                    since_ms: 1,
                }),
                ..rec(ip)
            })
            .collect();
        assert_eq!(
            p.on_response(5, 200, &json(&Changes::Delta(d)), &mut store)
                .unwrap(),
            Applied::Delta { changed: 230 }
        );
        assert_eq!(p.take_guard_event(), None);
        let pods = |ip: &str| match View::new(&store)
            .lookup(&cart(), &ip.parse().unwrap())
            .record
        {
            Entry::Present(r) => r.pods.len(),
            _ => usize::MAX,
        };
        assert_eq!(pods(&ips[100]), 0, "written: only the tombstone is left");
        assert_eq!(pods(&ips[0]), 1);
    }

    #[test]
    fn unfresh_answers_are_recorded_as_not_fresh() {
        let mut store = MemoryStore::default();
        let mut p = Poller::new(CFG, 7);
        p.next_request(0, &store);
        let mut s = snapshot(1, 1, &[]);
        s.freshness.fresh = false;
        p.on_response(0, 200, &json(&s), &mut store).unwrap();
        assert!(!View::new(&store).meta().unwrap().fresh);
    }
}
