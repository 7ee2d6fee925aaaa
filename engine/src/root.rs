//! The root context of a VM: configuration, the lease, the poller's
//! schedule (timer arming, the watchdog), applying the validator's answers,
//! and the gauges. Every host operation goes through [`Host`], so all of it
//! is unit-tested with a double; an adapter (the Wasm filter's glue) only
//! forwards its host's callbacks here.

use std::cell::RefCell;
use std::fmt;
use std::rc::Rc;
use std::time::Duration;

use crate::cache::Cache;
use crate::config::{Config, ConfigError, Fallback};
use crate::guard::{Guard, GuardEvent};
use crate::host::Host;
use crate::judgement::Effect;
use crate::lease::{Lease, LeaseState};
use crate::log_budget::LogBudget;
use crate::metrics::{self, Count, Counted, VmMetrics};
use crate::replay::TwinConfig;
use crate::request::{Filter, VmState};
use crate::steer::SteerConfig;
use crate::store::IndexReader;
use crate::sync::{Applied, PageHeaders, Poller, SyncConfig, SyncError, WithBody};

/// Verdict log lines allowed per VM per second (the counters count all).
const VERDICT_LOGS_PER_SECOND: u32 = 5;

/// Least time between two validator requests (see `SyncConfig`): answers that
/// come at once cannot become a busy loop (at most 20 requests a second), and
/// a change that follows another within milliseconds (one cluster event often
/// makes two or three index generations) waits at most this long.
pub const MIN_POLL_INTERVAL_MS: u64 = 50;

/// The root context: one per VM.
pub struct Root {
    id: u32,
    /// Shared with every request's [`Filter`] as one `Rc`: making a
    /// request's filter moves one count, not one per field. Changed through
    /// [`Root::vm_mut`]: a filter alive then keeps the state it was made
    /// with, as it kept each field's before.
    vm: Rc<VmState>,
    lease: Option<Lease>,
    poller: Option<Poller>,
    in_flight: Option<u32>,
    /// When the lease is next renewed (every `tick_ms`).
    lease_due_ms: u64,
    /// The timer period last set: the timer is re-armed for whatever comes
    /// first, the lease or the poller's next step.
    timer_ms: u64,
    twin: Option<Rc<TwinConfig>>,
    steer: Option<Rc<SteerConfig>>,
    /// The page size of validator answers when the configuration gives
    /// none (`sync_page_bytes`): the host's choice.
    default_page_bytes: Option<u32>,
}

impl fmt::Debug for Root {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Root")
            .field("id", &self.id)
            .field("in_flight", &self.in_flight)
            .field("lease_due_ms", &self.lease_due_ms)
            .field("timer_ms", &self.timer_ms)
            .finish_non_exhaustive()
    }
}

impl Root {
    /// A root context without configuration.
    pub fn new(id: u32) -> Self {
        Self {
            id,
            vm: Rc::new(VmState {
                config: None,
                fallback: None,
                metrics: Rc::new(RefCell::new(VmMetrics::default())),
                cache: Rc::new(RefCell::new(Cache::default())),
                log_budget: Rc::new(RefCell::new(LogBudget::new(1_000, VERDICT_LOGS_PER_SECOND))),
            }),
            lease: None,
            poller: None,
            in_flight: None,
            lease_due_ms: 0,
            timer_ms: 0,
            twin: None,
            steer: None,
            default_page_bytes: None,
        }
    }

    /// The VM's state to change (a copy of its handles when a request's
    /// filter still holds the current one).
    fn vm_mut(&mut self) -> &mut VmState {
        Rc::make_mut(&mut self.vm)
    }

    /// Asks for validator answers in pages of `page_bytes` when the
    /// configuration does not say (`sync_page_bytes`); without this, whole
    /// answers: what a Wasm VM wants, as a reassembly buffer would grow its
    /// memory for good.
    pub fn with_sync_page_bytes(mut self, page_bytes: Option<u32>) -> Self {
        self.default_page_bytes = page_bytes;
        self
    }

    /// Keeps the requests allowed before by their upstream texts, for
    /// [`Root::pass_known`]: for a host that lends those texts and whose
    /// store counts its writes (the native module; a Wasm VM copies each
    /// text out of the host, and has no count).
    pub fn with_known_passes(self) -> Self {
        self.vm.cache.borrow_mut().keep_passes();
        self
    }

    /// A request whose headers end it, to a host allowed before: counted
    /// as that request was, and true, when its cluster and upstream address
    /// are those of a pass ([`crate::cache::Cache::pass`]) judged at the
    /// store's current write count on data still fresh. False for anything
    /// else: the request then needs its [`Filter`], which judges it in
    /// full. No `Filter` is made for a pass: an allowed request without a
    /// body has nothing left to do after its headers.
    pub fn pass_known<H: Host>(&self, host: &mut H) -> bool {
        if !cfg!(feature = "passes")
            || self.twin.is_some()
            || self.steer.is_some()
            || self.vm.config.is_none()
        {
            return false;
        }
        let Some(writes) = host.writes() else {
            return false;
        };
        let now_ms = host.coarse_now_ms();
        let mut m = self.vm.metrics.borrow_mut();
        let counted = {
            let (cluster, address) = host.upstream_texts();
            let (Some(cluster), Some(address)) = (cluster, address) else {
                return false;
            };
            let cache = self.vm.cache.borrow();
            let Some((service, reason)) = cache.pass(&cluster, &address, writes, now_ms) else {
                return false;
            };
            Count::Request {
                label: m.services.id(service),
                reason,
                action: Counted::Effect(Effect::Allow),
            }
        };
        m.count(host, counted);
        true
    }

    /// The HTTP context of a request, sharing this VM's state.
    pub fn filter(&self, context_id: u32) -> Filter {
        Filter::new(
            context_id,
            self.vm.clone(),
            self.twin.clone(),
            self.steer.clone(),
        )
    }

    /// The timer period last set, in ms.
    pub fn timer_ms(&self) -> u64 {
        self.timer_ms
    }

    /// Reads the plugin configuration. Always true: a configuration the
    /// filter refuses must not stop the gateway (Envoy does not start, or
    /// rejects the cluster or listener, whatever its `failure_policy`), so
    /// the problems are logged and counted and the VM runs with the
    /// [`Fallback`] until a good configuration arrives.
    pub fn configure<H: Host>(&mut self, host: &mut H, bytes: &[u8]) -> bool {
        // A twin cluster's filter (docs/filter.md, "Retry"): no index, no
        // poller; it only checks its pick against the hosts the origin named.
        // The body path's hop (docs/filter.md, "Requests with a body"): it
        // reads the index the guard's poller keeps, and polls nothing.
        match SteerConfig::parse(bytes) {
            Ok(Some(steer)) => {
                log::info!(
                    "[ctx {}] staleguard: configured to steer requests to live members of {}",
                    self.id,
                    steer.service
                );
                self.steer = Some(Rc::new(steer));
                return true;
            }
            Ok(None) => {}
            Err(e) => {
                log::error!("[ctx {}] staleguard: {e}", self.id);
                return false;
            }
        }
        match TwinConfig::parse(bytes) {
            Ok(Some(twin)) => {
                log::info!(
                    "[ctx {}] staleguard: configured as a replay twin (endpoint header {:?})",
                    self.id,
                    twin.endpoint_header
                );
                self.twin = Some(Rc::new(twin));
                self.vm_mut().fallback = None;
                return true;
            }
            Ok(None) => {}
            Err(e) => {
                self.refuse(host, bytes, &[e]);
                return true;
            }
        }
        let config = match Config::parse(bytes) {
            Ok(c) => c,
            Err(e) => {
                let problems = match &e {
                    ConfigError::Invalid(problems) => problems.clone(),
                    ConfigError::Malformed(_) => vec![e.to_string()],
                };
                self.refuse(host, bytes, &problems);
                return true;
            }
        };
        self.vm_mut().fallback = None;
        if !cfg!(feature = "pages") && config.sync_page_bytes.is_some_and(|b| b > 0) {
            log::warn!(
                "[ctx {}] staleguard: `sync_page_bytes` is not served by this build (the Wasm filter asks for whole answers): ignored",
                self.id
            );
        }
        let sync = SyncConfig {
            wait_s: config.poll_wait_s,
            backoff_initial_ms: config.backoff_initial_ms,
            backoff_max_ms: config.backoff_max_ms,
            min_interval_ms: MIN_POLL_INTERVAL_MS,
            page_bytes: match config.sync_page_bytes {
                Some(0) => None,
                Some(page_bytes) => Some(page_bytes),
                None => self.default_page_bytes,
            },
        };
        let owner = self
            .lease
            .as_ref()
            .map_or_else(|| host.random_u64(), Lease::owner);
        let held = self.lease.as_ref().is_some_and(Lease::is_held);
        let mut lease = Lease::new(owner, config.lease_ttl_ms);
        if held {
            // Keep going: the next tick renews the lease we already have.
            let now = host.now_ms();
            let _ = lease.tick(host, now);
        }
        self.lease = Some(lease);
        self.poller = Some(
            Poller::new(sync, host.random_u64())
                .with_guard(Guard::new(config.guard, config.policy))
                .with_seed_max_age(config.max_staleness_ms),
        );
        self.in_flight = None;
        self.lease_due_ms = 0;
        if host.set_tick_period(Duration::from_millis(config.tick_ms)) {
            self.timer_ms = config.tick_ms;
        }
        log::info!(
            "[ctx {}] staleguard: configured (mode {:?}, validator cluster {:?}, owner {owner})",
            self.id,
            config.mode,
            config.validator_cluster
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
        self.vm_mut().config = Some(Rc::new(config));
        // Cluster resolutions follow the configuration.
        self.vm.cache.borrow_mut().clear_clusters();
        true
    }

    /// Runs without a configuration: the previous one (if any) is dropped,
    /// the problems are logged and counted, and requests get the fallback.
    fn refuse<H: Host>(&mut self, host: &mut H, bytes: &[u8], problems: &[String]) {
        let fallback = Fallback::read(bytes);
        let first = self.first_to_refuse(host, bytes);
        let what = fallback.describe();
        if first {
            for problem in problems {
                log::error!(
                    "[ctx {}] staleguard: plugin configuration: {problem}",
                    self.id
                );
            }
            log::error!(
                "[ctx {}] staleguard: plugin configuration refused ({} problem{}); the plugin runs anyway and {what} (docs/filter.md, \"Plugin configuration\")",
                self.id,
                problems.len(),
                if problems.len() == 1 { "" } else { "s" }
            );
        } else {
            log::debug!(
                "[ctx {}] staleguard: plugin configuration refused (logged by another VM): {}",
                self.id,
                problems.join("; ")
            );
        }
        if let Some(lease) = self.lease.as_mut() {
            lease.release(host);
        }
        self.lease = None;
        self.poller = None;
        self.in_flight = None;
        self.twin = None;
        self.vm_mut().config = None;
        self.vm_mut().fallback = Some(Rc::new(fallback));
    }

    /// True for the first VM of the process to refuse this configuration
    /// (Envoy configures one VM per worker, and each problem is to be logged
    /// and counted once); that VM counts the refusal.
    fn first_to_refuse<H: Host>(&self, host: &mut H, bytes: &[u8]) -> bool {
        let key = format!("staleguard.config_refused.{:016x}", fnv1a(bytes));
        let first = match host.get(&key) {
            Ok((Some(_), _)) => false,
            Ok((None, cas)) => host.set(&key, b"1", Some(cas)).is_ok(),
            // Without shared data, each VM logs and counts.
            Err(_) => true,
        };
        if first {
            self.vm
                .metrics
                .borrow_mut()
                .inc(host, metrics::CONFIG_REFUSED, 1);
        }
        first
    }

    /// The timer fired: flush the request counters, and renew the lease or
    /// take the poller's next step, whichever is due.
    pub fn tick<H: Host>(&mut self, host: &mut H) {
        self.vm.metrics.borrow_mut().flush(host);
        self.vm.cache.borrow_mut().clear_clusters();
        let now = host.now_ms();
        if now < self.lease_due_ms {
            // Woken for the poller, between two lease renewals.
            if self.lease.as_ref().is_some_and(Lease::is_held) {
                self.watchdog(host, now);
                self.poll(host, now);
            }
            self.arm_timer(host, now);
            return;
        }
        let tick_ms = self.vm.config.as_ref().map_or(1_000, |c| c.tick_ms);
        self.lease_due_ms = now.saturating_add(tick_ms);
        self.lease_tick(host, now);
        self.arm_timer(host, now);
    }

    /// The VM is shutting down: flush, and let the lease go.
    pub fn done<H: Host>(&mut self, host: &mut H) {
        self.vm.metrics.borrow_mut().flush(host);
        if let Some(lease) = self.lease.as_mut() {
            lease.release(host);
        }
    }

    /// Arms the root context's timer for the next thing to do: the lease
    /// renewal (every `tick_ms`) or, while this context polls, the poller's
    /// next step (the next long poll, a backoff's end, the watchdog). Envoy
    /// re-creates the timer from now when the period changes, and a period
    /// that stays the same keeps the running timer, which can then only fire
    /// early (a harmless extra tick), never late.
    fn arm_timer<H: Host>(&mut self, host: &mut H, now: u64) {
        let Some(config) = &self.vm.config else {
            return;
        };
        let mut due = self.lease_due_ms;
        if self.lease.as_ref().is_some_and(Lease::is_held) {
            if let Some(poller) = &self.poller {
                due = due.min(poller.wake_at_ms());
            }
        }
        let period = due.saturating_sub(now).clamp(1, config.tick_ms);
        if period != self.timer_ms && host.set_tick_period(Duration::from_millis(period)) {
            self.timer_ms = period;
        }
    }

    /// Gives up on a call that has been out too long (its answer, if it ever
    /// comes, is ignored) and counts it.
    fn watchdog<H: Host>(&mut self, host: &mut H, now: u64) {
        let Some(poller) = self.poller.as_mut() else {
            return;
        };
        if let Some(error) = poller.watchdog(now) {
            self.in_flight = None;
            self.sync_error(host, &error);
        }
    }

    fn poll<H: Host>(&mut self, host: &mut H, now: u64) {
        let (Some(config), Some(poller)) = (self.vm.config.clone(), self.poller.as_mut()) else {
            return;
        };
        // A poller's first request seeds the guard from the index: the
        // time it takes is the takeover's cost to this thread.
        let started_us = host.now_us();
        let request = poller.next_request(now, &*host);
        if let Some(seeded) = poller.take_seeded() {
            log::info!(
                "[ctx {}] staleguard: the guard's baseline is the index's: {} IPs, {} allowed, {} unreadable buckets or lines, read in {} ms",
                self.id,
                seeded.ips,
                seeded.allowed_ips,
                seeded.unreadable,
                host.now_us().saturating_sub(started_us) / 1000
            );
        }
        let Some(request) = request else {
            return;
        };
        let path = poller.path(&request);
        let bearer = config
            .token
            .as_ref()
            .map(|t| format!("Bearer {}", t.expose()));
        let mut headers = vec![
            (":method", "GET"),
            (":path", path.as_str()),
            (":authority", config.authority.as_str()),
            ("accept", crate::sync::ACCEPT),
        ];
        if let Some(b) = &bearer {
            headers.push(("authorization", b.as_str()));
        }
        let timeout = Duration::from_millis(poller.config().request_timeout_ms(&request));
        match host.dispatch_call(&config.validator_cluster, &headers, timeout) {
            Ok(token) => {
                self.in_flight = Some(token);
                self.vm
                    .metrics
                    .borrow_mut()
                    .inc(host, metrics::SYNC_POLLS, 1);
                log::debug!("[ctx {}] staleguard: sync request {path}", self.id);
            }
            Err(status) => {
                let error = dispatch_failed(&config.validator_cluster, &status);
                poller.on_failure(now, &error);
                self.sync_error(host, &error);
            }
        }
    }

    /// Renews (or takes, or observes) the lease; the holder polls.
    fn lease_tick<H: Host>(&mut self, host: &mut H, now: u64) {
        let Some(lease) = self.lease.as_mut() else {
            return;
        };
        match lease.tick(host, now) {
            LeaseState::NotHeld => {
                if let Some(p) = self.poller.as_mut() {
                    if p.in_flight() || p.generation().is_some() {
                        log::info!("[ctx {}] staleguard: not the poller any more", self.id);
                    }
                    if p.guard_holding() {
                        // A successor starts without a hold.
                        let mut m = self.vm.metrics.borrow_mut();
                        m.gauge(host, metrics::GUARD_HOLDING, 0);
                        m.gauge(host, metrics::GUARD_HELD_SECONDS, 0);
                    }
                    p.stand_down();
                }
                self.in_flight = None;
            }
            LeaseState::Acquired => {
                self.vm
                    .metrics
                    .borrow_mut()
                    .inc(host, metrics::SYNC_LEASE_ACQUIRED, 1);
                log::info!(
                    "[ctx {}] staleguard: took the poller lease (owner {})",
                    self.id,
                    lease.owner()
                );
            }
            LeaseState::Held => {
                self.watchdog(host, now);
                self.poll(host, now);
            }
        }
        self.publish_gauges(host, now);
    }

    /// The answer to a call of this context arrived (or the call failed).
    pub fn call_response<H: Host>(
        &mut self,
        host: &mut H,
        token: u32,
        headers: usize,
        body_size: usize,
    ) {
        if self.in_flight != Some(token) {
            return;
        }
        self.in_flight = None;
        let now = host.now_ms();
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
        let status = if headers > 0 {
            host.call_status()
        } else {
            None
        };
        let Some(status) = status else {
            let error = SyncError::Transport("no answer (timeout or reset)".to_owned());
            poller.on_failure(now, &error);
            self.sync_error(host, &error);
            self.arm_timer(host, now);
            return;
        };
        self.vm
            .metrics
            .borrow_mut()
            .inc(host, metrics::SYNC_BYTES, body_size as u64);
        // The time this thread spends decoding the answer and writing shared
        // data: what a large snapshot costs the thread that holds the lease.
        // The body is read from the host in chunks as the decoder goes (a
        // reset more than once): a copy of a whole 150k-IP answer would be
        // 4.5 MB of the VM's memory, which a Wasm VM never gives back.
        let started_us = host.now_us();
        let page = if poller.pages() {
            PageHeaders::of(&host.call_headers())
        } else {
            PageHeaders::default()
        };
        let mut answer = WithBody {
            store: &mut *host,
            open: |host: &H| host.call_body_reader(body_size),
        };
        let applied = poller.on_answer(now, status, &page, &mut answer);
        let spent_us = host.now_us().saturating_sub(started_us);
        if applied.is_ok() {
            self.vm
                .metrics
                .borrow_mut()
                .gauge(host, metrics::GAUGE_SYNC_APPLY_US, spent_us);
        }
        match applied {
            Ok(Applied::Reset { entries }) => {
                self.vm
                    .metrics
                    .borrow_mut()
                    .inc(host, metrics::SYNC_RESETS, 1);
                log::info!(
                    "[ctx {}] staleguard: loaded a full snapshot: generation {:?}, {entries} IPs, {} bytes in {} ms",
                    self.id,
                    poller.generation(),
                    poller.paged_bytes().unwrap_or(body_size as u64),
                    spent_us / 1000
                );
            }
            Ok(Applied::Delta { changed }) => {
                self.vm
                    .metrics
                    .borrow_mut()
                    .inc(host, metrics::SYNC_DELTAS, 1);
                if changed > 0 {
                    log::debug!(
                        "[ctx {}] staleguard: applied a delta: generation {:?}, {changed} IPs changed",
                        self.id,
                        poller.generation()
                    );
                }
            }
            Ok(Applied::Held | Applied::StillHeld | Applied::Page { .. }) => {}
            Ok(Applied::PagesRefused) => {
                log::info!(
                    "[ctx {}] staleguard: the validator does not serve answers in pages (a release before them): asking for whole answers",
                    self.id
                );
            }
            Err(error) => {
                let mut reason = None;
                if let SyncError::Status(_) = error {
                    // Say why: the validator's JSON error, or Envoy's own text
                    // (503 "no healthy upstream").
                    let head = host.call_body(0, body_size.min(REASON_BYTES));
                    reason = Some(
                        head.ok()
                            .and_then(|body| answer_reason(&body))
                            .unwrap_or_else(|| "(no reason given)".to_owned()),
                    );
                }
                self.sync_error_because(host, &error, reason.as_deref());
                self.arm_timer(host, now);
                return;
            }
        }
        let event = poller.take_guard_event();
        self.guard_event(host, event);
        self.publish_gauges(host, now);
        self.poll(host, now);
        self.arm_timer(host, now);
    }

    fn sync_error<H: Host>(&self, host: &mut H, error: &SyncError) {
        self.sync_error_because(host, error, None);
    }

    /// Counts and logs a failed sync, with the reason the answer gave.
    fn sync_error_because<H: Host>(&self, host: &mut H, error: &SyncError, reason: Option<&str>) {
        self.vm
            .metrics
            .borrow_mut()
            .inc(host, &metrics::sync_errors(error.kind()), 1);
        match reason {
            Some(reason) => {
                log::warn!(
                    "[ctx {}] staleguard: sync failed: {error}: {reason}",
                    self.id
                );
            }
            None => log::warn!("[ctx {}] staleguard: sync failed: {error}", self.id),
        }
    }

    fn guard_event<H: Host>(&self, host: &mut H, event: Option<GuardEvent>) {
        let mut m = self.vm.metrics.borrow_mut();
        match event {
            None => {}
            Some(GuardEvent::Held(blast)) => {
                m.inc(host, metrics::GUARD_HELD_TOTAL, 1);
                m.gauge(host, metrics::GUARD_HOLDING, 1);
                m.gauge(host, metrics::GUARD_HELD_IPS, blast.lost_ips);
                log::warn!(
                    "[ctx {}] staleguard: guard held a validator answer ({}): it would reject {} of {} allowed IPs without tombstone or new holder; the previous data keeps serving",
                    self.id,
                    blast.tripped.as_ref().map_or_else(String::new, ToString::to_string),
                    blast.lost_ips,
                    blast.allowed_ips
                );
            }
            Some(GuardEvent::Confirmed(blast)) => {
                m.inc(host, metrics::GUARD_CONFIRMED_TOTAL, 1);
                m.gauge(host, metrics::GUARD_HOLDING, 0);
                log::warn!(
                    "[ctx {}] staleguard: guard confirmed a held change that persisted: applying it ({} of {} allowed IPs now rejected)",
                    self.id,
                    blast.lost_ips,
                    blast.allowed_ips
                );
            }
            Some(GuardEvent::Released) => {
                m.inc(host, metrics::GUARD_RELEASED_TOTAL, 1);
                m.gauge(host, metrics::GUARD_HOLDING, 0);
                log::info!(
                    "[ctx {}] staleguard: guard released: the validator's answer no longer trips it",
                    self.id
                );
            }
        }
    }

    fn publish_gauges<H: Host>(&self, host: &mut H, now: u64) {
        let Some(config) = &self.vm.config else {
            return;
        };
        let mut m = self.vm.metrics.borrow_mut();
        if self.lease.as_ref().is_some_and(Lease::is_held) {
            // Of this VM: the one that decodes the answers.
            let bytes = host.vm_memory_bytes();
            m.gauge(host, metrics::GAUGE_VM_MEMORY_BYTES, bytes);
            if let Some(poller) = &self.poller {
                let guard = poller.guard();
                let held_s = guard.held_for_ms(now).unwrap_or(0) / 1000;
                m.gauge(host, metrics::GUARD_HELD_SECONDS, held_s);
                m.gauge(
                    host,
                    metrics::GUARD_UNCONFIRMED_IPS,
                    guard.unconfirmed_ips(),
                );
            }
        }
        match IndexReader::new(&*host).meta() {
            Some(meta) => {
                m.gauge(host, metrics::GAUGE_GENERATION, meta.generation);
                m.gauge(host, metrics::GAUGE_ENTRIES, meta.entries);
                m.gauge(
                    host,
                    metrics::GAUGE_DATA_AGE_S,
                    now.saturating_sub(meta.synced_ms) / 1000,
                );
                let fresh = meta.is_fresh(now, config.max_staleness_ms);
                m.gauge(host, metrics::GAUGE_FRESH, u64::from(fresh));
            }
            None => m.gauge(host, metrics::GAUGE_FRESH, 0),
        }
    }
}

/// A call to the validator that Envoy refused to make, naming the cluster.
/// Envoy answers BadArgument when it knows no cluster of that name (the
/// headers are always complete): a typo, or a cluster CDS has not delivered
/// yet. `envoy --mode validate` does not check plugin configurations, and
/// the plugin cannot ask Envoy which clusters exist, so the first call (one
/// tick after the start) is where it shows.
fn dispatch_failed(cluster: &str, status: &str) -> SyncError {
    let hint = if status == "BadArgument" {
        ": Envoy has no cluster of that name; set validator_cluster to the cluster that reaches the validator (docs/filter.md)"
    } else {
        ""
    };
    SyncError::Transport(format!(
        "dispatch to validator_cluster {cluster:?} failed: {status}{hint}"
    ))
}

/// How much of a non-200 answer is read for its reason.
const REASON_BYTES: usize = 2048;

/// The reason a non-200 answer gives: the validator's `error.message` (its
/// JSON error, docs/api.md), else the body's first line (Envoy's own answers),
/// printable and cut to 300 characters.
fn answer_reason(body: &[u8]) -> Option<String> {
    let from_json = crate::config::json_value(body).ok().and_then(|v| {
        v.get("error")
            .and_then(|e| e.get("message"))
            .and_then(|m| m.as_str())
            .map(str::to_owned)
    });
    let text = from_json.unwrap_or_else(|| {
        String::from_utf8_lossy(body)
            .lines()
            .next()
            .unwrap_or_default()
            .to_owned()
    });
    let text: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .take(300)
        .collect();
    let text = text.trim();
    (!text.is_empty()).then(|| text.to_owned())
}

/// FNV-1a: a stable digest of a configuration, to log its problems once per
/// process.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
pub(crate) mod tests;
