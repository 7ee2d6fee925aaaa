//! The proxy-wasm host glue: thin on purpose. Everything it decides is decided
//! by [`crate::check`], [`crate::sync`] and [`crate::lease`]; this module only
//! moves bytes between them and Envoy, through `proxy_wasm::hostcalls` (whose
//! errors are values) rather than the trait methods (which unwrap).

use std::cell::RefCell;
use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::{Duration, UNIX_EPOCH};

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType, MetricType, Status};

use crate::cache::Cache;
use crate::check::{header_value, judge, Effect, Lazy, Outcome, Upstream};
use crate::config::Config;
use crate::guard::{Guard, GuardEvent};
use crate::lease::{Lease, LeaseState};
use crate::members;
use crate::metrics::{self, Count, Counted, LabelId, Tally};
use crate::replay::{
    self, CallResult, Ineligible, Outcome as ReplayOutcome, Replay, Step, TwinConfig,
};
use crate::store::{SharedData, StoreError, View};
use crate::sync::{Applied, Poller, SyncConfig, SyncError};
use crate::throttle::Throttle;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    // Replaces the SDK's hook (which unwraps): log the panic at critical, since
    // the VM is about to die and take every request of its worker with it.
    std::panic::set_hook(Box::new(|info| {
        let _ = hostcalls::log(LogLevel::Critical, &format!("staleguard: panic: {info}"));
    }));
    proxy_wasm::set_root_context(|context_id| -> Box<dyn RootContext> {
        Box::new(Root::new(context_id))
    });
}}

/// Verdict log lines allowed per VM per second (the counters count all).
const VERDICT_LOGS_PER_SECOND: u32 = 5;

/// Least time between two validator requests (see `SyncConfig`): answers that
/// come at once cannot become a busy loop (at most 20 requests a second), and
/// a change that follows another within milliseconds (one cluster event often
/// makes two or three index generations) waits at most this long.
const MIN_POLL_INTERVAL_MS: u64 = 50;

// === impl HostStore ===

/// Envoy shared data through hostcalls.
struct HostStore;

impl SharedData for HostStore {
    fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, u32), StoreError> {
        hostcalls::get_shared_data(key)
            .map(|(value, cas)| (value, cas.unwrap_or(0)))
            .map_err(|s| StoreError::Host(format!("{s:?}")))
    }

    fn set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        match hostcalls::set_shared_data(key, Some(value), cas.filter(|c| *c != 0)) {
            Ok(()) => Ok(()),
            Err(Status::CasMismatch) => Err(StoreError::CasMismatch),
            Err(s) => Err(StoreError::Host(format!("{s:?}"))),
        }
    }
}

fn now_ms() -> u64 {
    now_us() / 1000
}

fn now_us() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

fn random_u64() -> u64 {
    // RandomState is seeded from WASI random_get: good enough for owner ids
    // and jitter seeds.
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(now_ms());
    h.finish()
}

fn property(path: Vec<&str>) -> Option<String> {
    match hostcalls::get_property(path) {
        Ok(Some(bytes)) => String::from_utf8(bytes).ok(),
        _ => None,
    }
}

/// The reads a request makes only when it needs them (see `check::judge`).
struct HostLazy;

impl Lazy for HostLazy {
    fn istio_service_host(&self) -> Option<String> {
        // Istio lists the services a cluster serves in its metadata; the
        // first one is the service (a cluster per service and port).
        property(vec![
            "xds",
            "cluster_metadata",
            "filter_metadata",
            "istio",
            "services",
            "0",
            "host",
        ])
    }

    fn now_ms(&self) -> u64 {
        now_ms()
    }
}

// === impl Metrics ===

/// Metric ids of this VM, defined on first use, and the per-request counts
/// not yet added to Envoy's counters (`metrics::Tally`).
#[derive(Default)]
struct Metrics {
    ids: HashMap<String, Option<u32>>,
    services: metrics::ServiceLabels,
    tally: Tally,
    count_ids: HashMap<Count, Option<u32>>,
}

impl Metrics {
    /// Counts a request in VM memory; flushes when enough are pending.
    fn count(&mut self, count: Count) {
        if self.tally.add(count) {
            self.flush();
        }
    }

    /// Adds the pending counts to Envoy's counters: a hostcall per series
    /// that moved, names built once per series and VM.
    fn flush(&mut self) {
        for (count, n) in self.tally.drain() {
            let id = match self.count_ids.get(&count) {
                Some(id) => *id,
                None => {
                    let id =
                        hostcalls::define_metric(MetricType::Counter, &count.name(&self.services))
                            .ok();
                    self.count_ids.insert(count, id);
                    id
                }
            };
            if let Some(id) = id {
                let _ = hostcalls::increment_metric(id, i64::try_from(n).unwrap_or(i64::MAX));
            }
        }
    }

    fn id(&mut self, kind: MetricType, name: &str) -> Option<u32> {
        if let Some(id) = self.ids.get(name) {
            return *id;
        }
        let id = hostcalls::define_metric(kind, name).ok();
        self.ids.insert(name.to_owned(), id);
        id
    }

    fn inc(&mut self, name: &str, by: u64) {
        if let Some(id) = self.id(MetricType::Counter, name) {
            let _ = hostcalls::increment_metric(id, i64::try_from(by).unwrap_or(i64::MAX));
        }
    }

    fn gauge(&mut self, name: &str, value: u64) {
        if let Some(id) = self.id(MetricType::Gauge, name) {
            let _ = hostcalls::record_metric(id, value);
        }
    }
}

// === impl Root ===

struct Root {
    id: u32,
    config: Option<Rc<Config>>,
    metrics: Rc<RefCell<Metrics>>,
    cache: Rc<RefCell<Cache>>,
    log_budget: Rc<RefCell<Throttle>>,
    lease: Option<Lease>,
    poller: Option<Poller>,
    in_flight: Option<u32>,
    /// When the lease is next renewed (every `tick_ms`).
    lease_due_ms: u64,
    /// The timer period last set: the timer is re-armed for whatever comes
    /// first, the lease or the poller's next step.
    timer_ms: u64,
    twin: Option<Rc<TwinConfig>>,
}

impl Root {
    fn new(id: u32) -> Self {
        Self {
            id,
            config: None,
            metrics: Rc::new(RefCell::new(Metrics::default())),
            cache: Rc::new(RefCell::new(Cache::default())),
            log_budget: Rc::new(RefCell::new(Throttle::new(1_000, VERDICT_LOGS_PER_SECOND))),
            lease: None,
            poller: None,
            in_flight: None,
            lease_due_ms: 0,
            timer_ms: 0,
            twin: None,
        }
    }

    /// Arms the root context's timer for the next thing to do: the lease
    /// renewal (every `tick_ms`) or, while this context polls, the poller's
    /// next step (the next long poll, a backoff's end, the watchdog). Envoy
    /// re-creates the timer from now when the period changes, and a period
    /// that stays the same keeps the running timer, which can then only fire
    /// early (a harmless extra tick), never late.
    fn arm_timer(&mut self, now: u64) {
        let Some(config) = &self.config else { return };
        let mut due = self.lease_due_ms;
        if self.lease.as_ref().is_some_and(Lease::is_held) {
            if let Some(poller) = &self.poller {
                due = due.min(poller.wake_at_ms());
            }
        }
        let period = due.saturating_sub(now).clamp(1, config.raw.tick_ms);
        if period != self.timer_ms
            && hostcalls::set_tick_period(Duration::from_millis(period)).is_ok()
        {
            self.timer_ms = period;
        }
    }

    /// Gives up on a call that has been out too long (its answer, if it ever
    /// comes, is ignored) and counts it.
    fn watchdog(&mut self, now: u64) {
        let Some(poller) = self.poller.as_mut() else {
            return;
        };
        if let Some(error) = poller.watchdog(now) {
            self.in_flight = None;
            self.sync_error(&error);
        }
    }

    fn poll(&mut self, now: u64) {
        let (Some(config), Some(poller)) = (self.config.clone(), self.poller.as_mut()) else {
            return;
        };
        let Some(request) = poller.next_request(now, &HostStore) else {
            return;
        };
        let path = request.path();
        let bearer = config
            .raw
            .token
            .as_ref()
            .map(|t| format!("Bearer {}", t.expose()));
        let mut headers = vec![
            (":method", "GET"),
            (":path", path.as_str()),
            (":authority", config.authority()),
            ("accept", "application/json"),
        ];
        if let Some(b) = &bearer {
            headers.push(("authorization", b.as_str()));
        }
        let timeout = Duration::from_millis(poller.config().request_timeout_ms(&request));
        match hostcalls::dispatch_http_call(
            &config.raw.validator_cluster,
            headers,
            None,
            vec![],
            timeout,
        ) {
            Ok(token) => {
                self.in_flight = Some(token);
                self.metrics.borrow_mut().inc(metrics::SYNC_POLLS, 1);
                log::debug!("[ctx {}] staleguard: sync request {path}", self.id);
            }
            Err(status) => {
                let error = SyncError::Transport(format!("dispatch failed: {status:?}"));
                poller.on_failure(now, &error);
                self.sync_error(&error);
            }
        }
    }

    /// Renews (or takes, or observes) the lease; the holder polls.
    fn lease_tick(&mut self, now: u64) {
        let Some(lease) = self.lease.as_mut() else {
            return;
        };
        match lease.tick(&mut HostStore, now) {
            LeaseState::NotHeld => {
                if let Some(p) = self.poller.as_mut() {
                    if p.in_flight() || p.generation().is_some() {
                        log::info!("[ctx {}] staleguard: not the poller any more", self.id);
                    }
                    if p.guard_holding() {
                        // A successor starts without a hold.
                        self.metrics.borrow_mut().gauge(metrics::GUARD_HOLDING, 0);
                    }
                    p.stand_down();
                }
                self.in_flight = None;
            }
            LeaseState::Acquired => {
                self.metrics
                    .borrow_mut()
                    .inc(metrics::SYNC_LEASE_ACQUIRED, 1);
                log::info!(
                    "[ctx {}] staleguard: took the poller lease (owner {})",
                    self.id,
                    lease.owner()
                );
            }
            LeaseState::Held => {
                self.watchdog(now);
                self.poll(now);
            }
        }
        self.publish_gauges(now);
    }

    fn sync_error(&self, error: &SyncError) {
        self.metrics
            .borrow_mut()
            .inc(&metrics::sync_errors(error.kind()), 1);
        log::warn!("[ctx {}] staleguard: sync failed: {error}", self.id);
    }

    fn guard_event(&self, event: Option<GuardEvent>) {
        let mut m = self.metrics.borrow_mut();
        match event {
            None => {}
            Some(GuardEvent::Held(blast)) => {
                m.inc(metrics::GUARD_HELD_TOTAL, 1);
                m.gauge(metrics::GUARD_HOLDING, 1);
                m.gauge(metrics::GUARD_HELD_IPS, blast.lost_ips);
                log::warn!(
                    "[ctx {}] staleguard: guard held a validator answer ({}): it would reject {} of {} allowed IPs without tombstone or new holder; the previous data keeps serving",
                    self.id,
                    blast.tripped.as_ref().map_or_else(String::new, ToString::to_string),
                    blast.lost_ips,
                    blast.allowed_ips
                );
            }
            Some(GuardEvent::Confirmed(blast)) => {
                m.inc(metrics::GUARD_CONFIRMED_TOTAL, 1);
                m.gauge(metrics::GUARD_HOLDING, 0);
                log::warn!(
                    "[ctx {}] staleguard: guard confirmed a held change that persisted: applying it ({} of {} allowed IPs now rejected)",
                    self.id,
                    blast.lost_ips,
                    blast.allowed_ips
                );
            }
            Some(GuardEvent::Released) => {
                m.inc(metrics::GUARD_RELEASED_TOTAL, 1);
                m.gauge(metrics::GUARD_HOLDING, 0);
                log::info!(
                    "[ctx {}] staleguard: guard released: the validator's answer no longer trips it",
                    self.id
                );
            }
        }
    }

    fn publish_gauges(&self, now: u64) {
        let Some(config) = &self.config else { return };
        let mut m = self.metrics.borrow_mut();
        if self.lease.as_ref().is_some_and(Lease::is_held) {
            // Pages of 64 KiB, of this VM: the one that decodes the answers.
            let pages = core::arch::wasm32::memory_size(0) as u64;
            m.gauge(metrics::GAUGE_VM_MEMORY_BYTES, pages * 65_536);
        }
        match View::new(&HostStore).meta() {
            Some(meta) => {
                m.gauge(metrics::GAUGE_GENERATION, meta.generation);
                m.gauge(metrics::GAUGE_ENTRIES, meta.entries);
                m.gauge(
                    metrics::GAUGE_DATA_AGE_S,
                    now.saturating_sub(meta.synced_ms) / 1000,
                );
                let fresh = meta.is_fresh(now, config.raw.max_staleness_ms);
                m.gauge(metrics::GAUGE_FRESH, u64::from(fresh));
            }
            None => m.gauge(metrics::GAUGE_FRESH, 0),
        }
    }
}

/// The body of the poller's call, read from the host a piece at a time.
struct CallBody {
    offset: usize,
    size: usize,
}

impl std::io::Read for CallBody {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let wanted = buf.len().min(self.size.saturating_sub(self.offset));
        if wanted == 0 {
            return Ok(0);
        }
        let piece = hostcalls::get_buffer(BufferType::HttpCallResponseBody, self.offset, wanted)
            .map_err(|status| std::io::Error::other(format!("get_buffer: {status:?}")))?
            .unwrap_or_default();
        let n = piece.len().min(wanted);
        match (buf.get_mut(..n), piece.get(..n)) {
            (Some(to), Some(from)) => to.copy_from_slice(from),
            _ => return Ok(0),
        }
        self.offset += n;
        Ok(n)
    }
}

impl Context for Root {
    fn on_done(&mut self) -> bool {
        self.metrics.borrow_mut().flush();
        if let Some(lease) = self.lease.as_mut() {
            lease.release(&mut HostStore);
        }
        true
    }

    fn on_http_call_response(&mut self, token: u32, headers: usize, body_size: usize, _: usize) {
        if self.in_flight != Some(token) {
            return;
        }
        self.in_flight = None;
        let now = now_ms();
        let held = self.lease.as_ref().is_some_and(Lease::is_held);
        let Some(poller) = self.poller.as_mut() else {
            return;
        };
        if !held {
            poller.stand_down();
            return;
        }
        // A call that failed (no answer, a reset, or a body over Envoy's async
        // client limit of 32 MiB) has no header map: asking for one makes the
        // host answer BadArgument, on which the SDK's wrapper panics.
        let status = (headers > 0)
            .then(|| hostcalls::get_map_value(MapType::HttpCallResponseHeaders, ":status"))
            .and_then(Result::ok)
            .flatten()
            .and_then(|s| s.parse::<u32>().ok());
        let Some(status) = status else {
            let error = SyncError::Transport("no answer (timeout or reset)".to_owned());
            poller.on_failure(now, &error);
            self.sync_error(&error);
            self.arm_timer(now);
            return;
        };
        self.metrics
            .borrow_mut()
            .inc(metrics::SYNC_BYTES, body_size as u64);
        // The time this thread spends decoding the answer and writing shared
        // data: what a large snapshot costs the thread that holds the lease.
        // The body is read from the host in chunks as the decoder goes: a
        // copy of a whole 150k-IP answer would be 21 MB of the VM's memory,
        // which a Wasm VM never gives back.
        let started_us = now_us();
        let mut body = CallBody {
            offset: 0,
            size: body_size,
        };
        let applied = poller.on_response_from(now, status, &mut body, &mut HostStore);
        let spent_us = now_us().saturating_sub(started_us);
        if applied.is_ok() {
            self.metrics
                .borrow_mut()
                .gauge(metrics::GAUGE_SYNC_APPLY_US, spent_us);
        }
        match applied {
            Ok(Applied::Reset { entries }) => {
                self.metrics.borrow_mut().inc(metrics::SYNC_RESETS, 1);
                log::info!(
                    "[ctx {}] staleguard: loaded a full snapshot: generation {:?}, {entries} IPs, {} bytes in {} ms",
                    self.id,
                    poller.generation(),
                    body_size,
                    spent_us / 1000
                );
            }
            Ok(Applied::Delta { changed }) => {
                self.metrics.borrow_mut().inc(metrics::SYNC_DELTAS, 1);
                if changed > 0 {
                    log::debug!(
                        "[ctx {}] staleguard: applied a delta: generation {:?}, {changed} IPs changed",
                        self.id,
                        poller.generation()
                    );
                }
            }
            Ok(Applied::Held) => {}
            Err(error) => {
                self.sync_error(&error);
                self.arm_timer(now);
                return;
            }
        }
        let event = poller.take_guard_event();
        self.guard_event(event);
        self.publish_gauges(now);
        self.poll(now);
        self.arm_timer(now);
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, size: usize) -> bool {
        let bytes = hostcalls::get_buffer(BufferType::PluginConfiguration, 0, size)
            .ok()
            .flatten()
            .unwrap_or_default();
        // A twin cluster's filter (docs/filter.md, "Retry"): no index, no
        // poller; it only checks its pick against the hosts the origin named.
        match TwinConfig::parse(&bytes) {
            Ok(Some(twin)) => {
                log::info!(
                    "[ctx {}] staleguard: configured as a replay twin (endpoint header {:?})",
                    self.id,
                    twin.endpoint_header
                );
                self.twin = Some(Rc::new(twin));
                return true;
            }
            Ok(None) => {}
            Err(e) => {
                log::error!("[ctx {}] staleguard: {e}", self.id);
                return false;
            }
        }
        let config = match Config::parse(&bytes) {
            Ok(c) => c,
            Err(e) => {
                log::error!("[ctx {}] staleguard: {e}", self.id);
                return false;
            }
        };
        let sync = SyncConfig {
            wait_s: config.raw.poll_wait_s,
            backoff_initial_ms: config.raw.backoff_initial_ms,
            backoff_max_ms: config.raw.backoff_max_ms,
            min_interval_ms: MIN_POLL_INTERVAL_MS,
        };
        let owner = self.lease.as_ref().map_or_else(random_u64, Lease::owner);
        let held = self.lease.as_ref().is_some_and(Lease::is_held);
        let mut lease = Lease::new(owner, config.raw.lease_ttl_ms);
        if held {
            // Keep going: the next tick renews the lease we already have.
            let _ = lease.tick(&mut HostStore, now_ms());
        }
        self.lease = Some(lease);
        self.poller = Some(
            Poller::new(sync, random_u64())
                .with_guard(Guard::new(config.raw.guard, config.raw.policy)),
        );
        self.in_flight = None;
        self.lease_due_ms = 0;
        if hostcalls::set_tick_period(Duration::from_millis(config.raw.tick_ms)).is_ok() {
            self.timer_ms = config.raw.tick_ms;
        }
        log::info!(
            "[ctx {}] staleguard: configured (mode {:?}, validator cluster {:?}, owner {owner})",
            self.id,
            config.raw.mode,
            config.raw.validator_cluster
        );
        if let Some(warning) = config.retry_warning() {
            log::warn!("[ctx {}] staleguard: {warning}", self.id);
        } else if let Some(retry) = config.replay() {
            log::info!(
                "[ctx {}] staleguard: rejected requests without a body are replayed to live members through the twin clusters (`<cluster>{}`), up to {} attempts",
                self.id,
                retry.twin_suffix,
                retry.attempts
            );
        }
        self.config = Some(Rc::new(config));
        // Cluster resolutions follow the configuration.
        self.cache.borrow_mut().clear_clusters();
        true
    }

    fn on_tick(&mut self) {
        self.metrics.borrow_mut().flush();
        self.cache.borrow_mut().clear_clusters();
        let now = now_ms();
        if now < self.lease_due_ms {
            // Woken for the poller, between two lease renewals.
            if self.lease.as_ref().is_some_and(Lease::is_held) {
                self.watchdog(now);
                self.poll(now);
            }
            self.arm_timer(now);
            return;
        }
        let tick_ms = self.config.as_ref().map_or(1_000, |c| c.raw.tick_ms);
        self.lease_due_ms = now.saturating_add(tick_ms);
        self.lease_tick(now);
        self.arm_timer(now);
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        // Never None: the SDK panics on None (and the VM dies). Without a
        // configuration the filter passes everything through.
        Some(Box::new(Filter {
            id: context_id,
            config: self.config.clone(),
            metrics: self.metrics.clone(),
            cache: self.cache.clone(),
            log_budget: self.log_budget.clone(),
            twin: self.twin.clone(),
            replay: None,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

// === impl Filter ===

struct Filter {
    id: u32,
    config: Option<Rc<Config>>,
    metrics: Rc<RefCell<Metrics>>,
    cache: Rc<RefCell<Cache>>,
    log_budget: Rc<RefCell<Throttle>>,
    /// Set in a twin cluster's VM: this instance only checks its pick.
    twin: Option<Rc<TwinConfig>>,
    /// A replay in flight (see `crate::replay`).
    replay: Option<Pending>,
}

/// What a paused request needs to go on replaying.
struct Pending {
    replay: Replay,
    /// The service's metric label.
    label: LabelId,
    token: Option<u32>,
    twin_cluster: String,
    headers: Vec<(String, String)>,
    reason: staleguard_core::Reason,
    /// Body size of the last answer.
    body_size: usize,
    /// Headers of the last answer.
    answer: Vec<(String, String)>,
}

impl Filter {
    /// The twin's whole job: let through a pick the origin named (without the
    /// endpoint header), fail any other at once.
    fn twin_request(&mut self, twin: &TwinConfig) -> Action {
        let named = hostcalls::get_map_value(MapType::HttpRequestHeaders, &twin.endpoint_header)
            .ok()
            .flatten();
        let address = property(vec!["upstream", "address"]);
        let ok = replay::twin_pick_is_named(named.as_deref(), address.as_deref());
        self.metrics.borrow_mut().inc(&metrics::twin_picks(ok), 1);
        if ok {
            let _ = hostcalls::remove_map_value(MapType::HttpRequestHeaders, &twin.endpoint_header);
            return Action::Continue;
        }
        log::debug!(
            "[ctx {}] staleguard twin: pick {address:?} not among {named:?}",
            self.id
        );
        let _ = hostcalls::send_http_response(503, vec![(replay::TWIN_MISS_HEADER, "1")], None);
        Action::Pause
    }

    fn reject(&self, config: &Config, status: u32, reason: staleguard_core::Reason) {
        let reason = header_value(reason);
        let headers = vec![(config.raw.reject_header.as_str(), reason)];
        let body = format!("staleguard: {reason}\n");
        let _ = hostcalls::send_http_response(status, headers, Some(body.as_bytes()));
    }

    /// Starts replaying a rejected request, or says why it cannot be.
    fn start_replay(
        &mut self,
        retry: &crate::config::RetryConfig,
        service: &staleguard_core::ServiceKey,
        cluster: &str,
        stale: Option<SocketAddr>,
        reason: staleguard_core::Reason,
        end_of_stream: bool,
    ) -> Result<Step, Ineligible> {
        replay::reason_allows_replay(reason)?;
        let raw = hostcalls::get_map_bytes(MapType::HttpRequestHeaders).unwrap_or_default();
        let headers = replay::text_headers(raw)?;
        replay::eligibility(retry, &headers, end_of_stream)?;
        let batches = match (View::new(&HostStore).meta(), stale) {
            (Some(meta), Some(stale)) => {
                let live = members::read(&HostStore, service, meta.load);
                replay::plan(retry, &live, stale, random_u64())
            }
            _ => Vec::new(),
        };
        let timeout = replay::timeout_ms(retry, &headers);
        let (state, step) = Replay::start(batches, now_ms(), timeout);
        self.replay = Some(Pending {
            replay: state,
            token: None,
            twin_cluster: format!("{cluster}{}", retry.twin_suffix),
            headers,
            reason,
            label: LabelId::default(),
            body_size: 0,
            answer: Vec::new(),
        });
        Ok(step)
    }

    /// Carries out `step`s until one waits for an answer (`Pause`) or ends the
    /// request.
    fn drive(&mut self, mut step: Step) {
        loop {
            let Some(config) = self.config.clone() else {
                return;
            };
            let Some(retry) = config.replay() else {
                return;
            };
            let Some(pending) = self.replay.as_mut() else {
                return;
            };
            match step {
                Step::Send { hosts, timeout_ms } => {
                    let headers =
                        replay::request_headers(&pending.headers, &retry.endpoint_header, &hosts);
                    let headers: Vec<(&str, &str)> = headers
                        .iter()
                        .map(|(k, v)| (k.as_str(), v.as_str()))
                        .collect();
                    match hostcalls::dispatch_http_call(
                        &pending.twin_cluster,
                        headers,
                        None,
                        vec![],
                        Duration::from_millis(timeout_ms),
                    ) {
                        Ok(token) => {
                            pending.token = Some(token);
                            return;
                        }
                        Err(status) => {
                            // No twin cluster (a deploy without one) or no
                            // room for a call: this batch failed. Logged
                            // within the verdict log budget: a missing twin
                            // fails every replay.
                            if self.log_budget.borrow_mut().allow(now_ms()).is_some() {
                                log::warn!(
                                    "[ctx {}] staleguard: cannot call the twin cluster {:?} ({status:?}): is it configured? (docs/filter.md, \"Retry\")",
                                    self.id,
                                    pending.twin_cluster
                                );
                            }
                            step = pending.replay.on_result(now_ms(), CallResult::Failed);
                        }
                    }
                }
                Step::Deliver => {
                    let body_size = pending.body_size;
                    let status =
                        hostcalls::get_map_value(MapType::HttpCallResponseHeaders, ":status")
                            .ok()
                            .flatten()
                            .and_then(|s| s.parse::<u32>().ok())
                            .unwrap_or(502);
                    let headers = std::mem::take(&mut pending.answer);
                    let filler = replay::head_filler(&pending.headers, &headers);
                    self.finish(ReplayOutcome::Answered);
                    let headers = replay::response_headers(&headers);
                    let headers: Vec<(&str, &str)> = headers
                        .iter()
                        .map(|(k, v)| (k.as_str(), v.as_str()))
                        .collect();
                    let body = match filler {
                        Some(n) => vec![b' '; n],
                        None => {
                            hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body_size)
                                .ok()
                                .flatten()
                                .unwrap_or_default()
                        }
                    };
                    let _ = hostcalls::send_http_response(status, headers, Some(&body));
                    return;
                }
                Step::Fail(ReplayOutcome::Timeout) => {
                    self.finish(ReplayOutcome::Timeout);
                    // What the router itself answers when a route times out.
                    let _ = hostcalls::send_http_response(
                        504,
                        vec![("content-type", "text/plain")],
                        Some(b"upstream request timeout"),
                    );
                    return;
                }
                Step::Fail(outcome) => {
                    let reason = pending.reason;
                    self.finish(outcome);
                    if let Effect::Reject { status } = reject_effect(&config) {
                        self.reject(&config, status, reason);
                    }
                    return;
                }
            }
        }
    }

    fn finish(&mut self, outcome: ReplayOutcome) {
        if let Some(pending) = self.replay.take() {
            // The verdict counter says what the client got: a replayed
            // answer (`retry`) or the rejection.
            let action = if replay::counts_as_retry(outcome) {
                Counted::Replayed
            } else {
                Counted::Effect(reject_effect_of(self.config.as_deref()))
            };
            self.metrics.borrow_mut().count(Count::Request {
                label: pending.label,
                reason: pending.reason,
                action,
            });
            if outcome != ReplayOutcome::Answered {
                log::debug!(
                    "[ctx {}] staleguard: replay ended {} after {} calls",
                    self.id,
                    outcome.as_str(),
                    pending.replay.attempts()
                );
            }
        }
        self.metrics.borrow_mut().inc(&metrics::retries(outcome), 1);
    }
}

fn reject_effect_of(config: Option<&Config>) -> Effect {
    Effect::Reject {
        status: config.map_or(503, |c| c.raw.reject_status),
    }
}

fn reject_effect(config: &Config) -> Effect {
    Effect::Reject {
        status: config.raw.reject_status,
    }
}

impl Context for Filter {
    fn on_http_call_response(&mut self, token: u32, headers: usize, body_size: usize, _: usize) {
        let Some(pending) = self.replay.as_mut() else {
            return;
        };
        if pending.token != Some(token) {
            return;
        }
        pending.token = None;
        pending.body_size = body_size;
        // A failed call has no header map (asking for one is BadArgument).
        let answer = (headers > 0).then(|| {
            hostcalls::get_map_bytes(MapType::HttpCallResponseHeaders)
                .unwrap_or_default()
                .into_iter()
                .map(|(k, v)| (k, String::from_utf8_lossy(&v).into_owned()))
                .collect::<Vec<_>>()
        });
        let result = replay::classify(answer.as_deref());
        pending.answer = answer.unwrap_or_default();
        let step = pending.replay.on_result(now_ms(), result);
        self.drive(step);
    }
}

impl HttpContext for Filter {
    fn on_http_request_headers(&mut self, _: usize, end_of_stream: bool) -> Action {
        if let Some(twin) = self.twin.clone() {
            return self.twin_request(&twin);
        }
        let Some(config) = self.config.clone() else {
            return Action::Continue;
        };
        let upstream = Upstream {
            cluster: property(vec!["xds", "cluster_name"]),
            address: property(vec!["upstream", "address"]),
        };
        let outcome = judge(
            &config,
            &mut self.cache.borrow_mut(),
            &HostStore,
            &upstream,
            &HostLazy,
        );
        let mut m = self.metrics.borrow_mut();
        let (service, ip, verdict, effect) = match outcome {
            Outcome::Unmapped => {
                m.count(Count::Unmapped);
                return Action::Continue;
            }
            Outcome::NoAddress => {
                m.count(Count::NoAddress);
                return Action::Continue;
            }
            Outcome::Judged {
                service,
                ip,
                verdict,
                effect,
            } => (service, ip, verdict, effect),
        };
        let label = m.services.id(&service);
        drop(m);
        // A rejection becomes a replay where one is configured and the
        // request is eligible; the decision is `crate::replay`'s.
        let mut replay_step = None;
        if let (Effect::Reject { .. }, Some(retry)) = (effect, config.replay()) {
            let stale = upstream
                .address
                .as_deref()
                .and_then(|a| a.parse::<SocketAddr>().ok());
            let cluster = upstream.cluster.as_deref().unwrap_or_default();
            match self.start_replay(
                retry,
                &service,
                cluster,
                stale,
                verdict.reason,
                end_of_stream,
            ) {
                Ok(step) => replay_step = Some(step),
                Err(cause) => self
                    .metrics
                    .borrow_mut()
                    .inc(&metrics::retries(ReplayOutcome::NotEligible(cause)), 1),
            }
        }
        // A replay counts its verdict when it ends (`finish`).
        if let Some(pending) = self.replay.as_mut() {
            pending.label = label;
        }
        if replay_step.is_none() {
            self.metrics.borrow_mut().count(Count::Request {
                label,
                reason: verdict.reason,
                action: Counted::Effect(effect),
            });
        }
        if effect != Effect::Allow {
            if let Some(skipped) = self.log_budget.borrow_mut().allow(now_ms()) {
                let more = if skipped > 0 {
                    format!(" ({skipped} similar lines suppressed)")
                } else {
                    String::new()
                };
                let action = if replay_step.is_some() {
                    "retry"
                } else {
                    effect.as_str()
                };
                log::info!(
                    "[ctx {}] staleguard: {action} host {ip} of {service}: {}{more}",
                    self.id,
                    verdict.reason.as_str()
                );
            }
        }
        if let Some(step) = replay_step {
            self.drive(step);
            return Action::Pause;
        }
        match effect {
            Effect::Allow | Effect::Audit => Action::Continue,
            Effect::Reject { status } => {
                self.reject(&config, status, verdict.reason);
                Action::Pause
            }
        }
    }
}
