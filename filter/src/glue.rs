//! The proxy-wasm host glue: thin on purpose. Everything it decides is decided
//! by [`crate::check`], [`crate::sync`] and [`crate::lease`]; this module only
//! moves bytes between them and Envoy, through `proxy_wasm::hostcalls` (whose
//! errors are values) rather than the trait methods (which unwrap).

use std::cell::RefCell;
use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::rc::Rc;
use std::time::{Duration, UNIX_EPOCH};

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType, MetricType, Status};

use crate::check::{header_value, judge, Effect, Outcome, Upstream};
use crate::config::Config;
use crate::lease::{Lease, LeaseState};
use crate::metrics;
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

/// Least time between two validator requests (see `SyncConfig`).
const MIN_POLL_INTERVAL_MS: u64 = 100;

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

// === impl Metrics ===

/// Metric ids of this VM, defined on first use.
#[derive(Default)]
struct Metrics {
    ids: HashMap<String, Option<u32>>,
    services: metrics::ServiceLabels,
}

impl Metrics {
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
    log_budget: Rc<RefCell<Throttle>>,
    lease: Option<Lease>,
    poller: Option<Poller>,
    in_flight: Option<u32>,
    /// When the lease is next renewed (every `tick_ms`).
    lease_due_ms: u64,
    /// The timer period last set: the timer is re-armed for whatever comes
    /// first, the lease or the poller's next step.
    timer_ms: u64,
}

impl Root {
    fn new(id: u32) -> Self {
        Self {
            id,
            config: None,
            metrics: Rc::new(RefCell::new(Metrics::default())),
            log_budget: Rc::new(RefCell::new(Throttle::new(1_000, VERDICT_LOGS_PER_SECOND))),
            lease: None,
            poller: None,
            in_flight: None,
            lease_due_ms: 0,
            timer_ms: 0,
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

impl Context for Root {
    fn on_done(&mut self) -> bool {
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
        let body = hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body_size)
            .ok()
            .flatten()
            .unwrap_or_default();
        self.metrics
            .borrow_mut()
            .inc(metrics::SYNC_BYTES, body.len() as u64);
        // The time this thread spends decoding the answer and writing shared
        // data: what a large snapshot costs the thread that holds the lease.
        let started_us = now_us();
        let applied = poller.on_response(now, status, &body, &mut HostStore);
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
                    body.len(),
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
            Err(error) => {
                self.sync_error(&error);
                self.arm_timer(now);
                return;
            }
        }
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
        self.poller = Some(Poller::new(sync, random_u64()));
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
        self.config = Some(Rc::new(config));
        true
    }

    fn on_tick(&mut self) {
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
            log_budget: self.log_budget.clone(),
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
    log_budget: Rc<RefCell<Throttle>>,
}

impl Context for Filter {}

impl HttpContext for Filter {
    fn on_http_request_headers(&mut self, _: usize, _: bool) -> Action {
        let Some(config) = self.config.clone() else {
            return Action::Continue;
        };
        let upstream = Upstream {
            cluster: property(vec!["xds", "cluster_name"]),
            // Istio lists the services a cluster serves in its metadata; the
            // first one is the service (a cluster per service and port).
            istio_service_host: if config.raw.istio {
                property(vec![
                    "xds",
                    "cluster_metadata",
                    "filter_metadata",
                    "istio",
                    "services",
                    "0",
                    "host",
                ])
            } else {
                None
            },
            address: property(vec!["upstream", "address"]),
        };
        let outcome = judge(&config, &HostStore, &upstream, now_ms());
        let mut m = self.metrics.borrow_mut();
        let (service, ip, verdict, effect) = match outcome {
            Outcome::Unmapped => {
                m.inc(metrics::REQUESTS_UNMAPPED, 1);
                return Action::Continue;
            }
            Outcome::NoAddress => {
                m.inc(metrics::REQUESTS_NO_ADDRESS, 1);
                return Action::Continue;
            }
            Outcome::Judged {
                service,
                ip,
                verdict,
                effect,
            } => (service, ip, verdict, effect),
        };
        let label = m.services.label(&service);
        m.inc(&metrics::requests(&label, verdict.reason, effect), 1);
        drop(m);
        if effect != Effect::Allow {
            if let Some(skipped) = self.log_budget.borrow_mut().allow(now_ms()) {
                let more = if skipped > 0 {
                    format!(" ({skipped} similar lines suppressed)")
                } else {
                    String::new()
                };
                log::info!(
                    "[ctx {}] staleguard: {} host {ip} of {service}: {}{more}",
                    self.id,
                    effect.as_str(),
                    verdict.reason.as_str()
                );
            }
        }
        match effect {
            Effect::Allow | Effect::Audit => Action::Continue,
            Effect::Reject { status } => {
                let reason = header_value(verdict.reason);
                let headers = vec![(config.raw.reject_header.as_str(), reason)];
                let body = format!("staleguard: {reason}\n");
                let _ = hostcalls::send_http_response(status, headers, Some(body.as_bytes()));
                Action::Pause
            }
        }
    }
}
