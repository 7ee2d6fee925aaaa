//! Prometheus metrics (OpenMetrics text, every name prefixed
//! `staleguard_validator_`, so no validator series shares a name with a filter
//! series, which are all `staleguard_filter_`).
//!
//! Counters the API updates live in [`Metrics`]; the index's sizes and the
//! watches' health are read from the [`SharedIndex`] at scrape time, so the
//! index code stays free of metrics plumbing and a scrape always shows the
//! current state. `docs/metrics.md` lists every series.

use std::sync::atomic::AtomicU64;
use std::time::Duration;

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use crate::live::SharedIndex;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    route: &'static str,
    status: u16,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DocumentLabels {
    document: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClientReasonLabels {
    client: String,
    reason: &'static str,
}

/// How many clients get a label of their own in
/// `long_polls_refused_total`; the rest share `client="other"`, so a client
/// that cycles through addresses cannot grow the series without end.
pub const MAX_CLIENT_LABELS: usize = 32;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildReasonLabels {
    reason: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    resource: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EventLabels {
    resource: &'static str,
    event: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SkipLabels {
    resource: &'static str,
    reason: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ListenerLabels {
    listener: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ListenerReasonLabels {
    listener: &'static str,
    reason: &'static str,
}

/// The connections of every listener (`api`, `admin`, `audit`): how many are
/// open, and how many the bounds closed (`crate::api::ConnectionLimits`).
#[derive(Debug, Default)]
pub struct ConnectionMetrics {
    open: Family<ListenerLabels, Gauge>,
    refused: Family<ListenerReasonLabels, Counter>,
    timed_out: Family<ListenerReasonLabels, Counter>,
}

/// One open connection; the gauge goes down when it drops.
#[derive(Debug)]
pub struct OpenConnection(Gauge);

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.dec();
    }
}

impl ConnectionMetrics {
    /// Counts a connection open on `listener` until the guard drops.
    pub fn open(&self, listener: &'static str) -> OpenConnection {
        let gauge = self
            .open
            .get_or_create(&ListenerLabels { listener })
            .clone();
        gauge.inc();
        OpenConnection(gauge)
    }

    /// Counts a connection closed at accept (`max_connections`,
    /// `max_per_source`).
    pub fn refused(&self, listener: &'static str, reason: &'static str) {
        self.refused
            .get_or_create(&ListenerReasonLabels { listener, reason })
            .inc();
    }

    /// Counts a connection a timeout closed (`header_read`, `idle`).
    pub fn timed_out(&self, listener: &'static str, reason: &'static str) {
        self.timed_out
            .get_or_create(&ListenerReasonLabels { listener, reason })
            .inc();
    }

    /// Connections refused so far on `listener` for `reason`.
    pub fn refused_count(&self, listener: &'static str, reason: &'static str) -> u64 {
        self.refused
            .get_or_create(&ListenerReasonLabels { listener, reason })
            .get()
    }

    /// Connections closed so far by `reason`'s timeout on `listener`.
    pub fn timed_out_count(&self, listener: &'static str, reason: &'static str) -> u64 {
        self.timed_out
            .get_or_create(&ListenerReasonLabels { listener, reason })
            .get()
    }

    fn register(&self, registry: &mut Registry) {
        registry.register(
            "connections_open",
            "Connections open, by listener",
            self.open.clone(),
        );
        registry.register(
            "connections_refused",
            "Connections closed as soon as accepted, by listener and the cap they exceeded (max_connections, max_per_source)",
            self.refused.clone(),
        );
        registry.register(
            "connections_timed_out",
            "Connections closed by a timeout, by listener and timeout (header_read, idle)",
            self.timed_out.clone(),
        );
    }
}

/// The prefix of every validator series (the API's and the audit's).
pub const PREFIX: &str = "staleguard_validator";

/// The validator's own counters.
#[derive(Debug)]
pub struct Metrics {
    requests: Family<RequestLabels, Counter>,
    long_polls: Gauge<i64, std::sync::atomic::AtomicI64>,
    fan_out: Histogram,
    answer_builds: Family<DocumentLabels, Counter>,
    answer_build_time: Histogram,
    answer_build_reasons: Family<BuildReasonLabels, Counter>,
    answer_builds_running: Gauge<i64, std::sync::atomic::AtomicI64>,
    answer_pages_dropped: Family<BuildReasonLabels, Counter>,
    long_polls_refused: Family<ClientReasonLabels, Counter>,
    token_reload_failures: Counter,
    token_file_refused: Gauge,
    /// The clients that have a label of their own.
    labelled_clients: std::sync::Mutex<std::collections::HashSet<std::net::IpAddr>>,
    connections: std::sync::Arc<ConnectionMetrics>,
}

/// Decrements its gauge (long polls waiting, builds running) when dropped.
#[derive(Debug)]
pub struct Waiting<'a>(&'a Gauge<i64, std::sync::atomic::AtomicI64>);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Fresh metrics, all zero.
    pub fn new() -> Self {
        // 0.5 ms .. ~4 s: a fan-out above that is an incident of its own.
        let buckets = prometheus_client::metrics::histogram::exponential_buckets(0.0005, 2.0, 14);
        Self {
            requests: Family::default(),
            long_polls: Gauge::default(),
            fan_out: Histogram::new(buckets),
            answer_builds: Family::default(),
            // 0.1 ms .. ~1.6 s: a 150k-IP snapshot takes a few hundred ms.
            answer_build_time: Histogram::new(
                prometheus_client::metrics::histogram::exponential_buckets(0.0001, 2.0, 15),
            ),
            answer_build_reasons: Family::default(),
            answer_builds_running: Gauge::default(),
            answer_pages_dropped: Family::default(),
            long_polls_refused: Family::default(),
            token_reload_failures: Counter::default(),
            token_file_refused: Gauge::default(),
            labelled_clients: std::sync::Mutex::default(),
            connections: std::sync::Arc::default(),
        }
    }

    /// Counts one API request.
    pub fn observe_request(&self, route: &'static str, status: u16) {
        self.requests
            .get_or_create(&RequestLabels { route, status })
            .inc();
    }

    /// Marks a long poll as waiting until the guard drops.
    pub fn long_poll_waiting(&self) -> Waiting<'_> {
        self.long_polls.inc();
        Waiting(&self.long_polls)
    }

    /// Counts a long poll refused (`max_long_polls`, `max_per_client`) for
    /// `client`: its address for the first [`MAX_CLIENT_LABELS`] clients
    /// refused, `other` after them, `unknown` without one.
    pub fn long_poll_refused(&self, client: Option<std::net::IpAddr>, reason: &'static str) {
        let client = match client {
            None => "unknown".to_owned(),
            Some(ip) => {
                let mut labelled = self
                    .labelled_clients
                    .lock()
                    .unwrap_or_else(|e| e.into_inner());
                if labelled.contains(&ip) || labelled.len() < MAX_CLIENT_LABELS {
                    labelled.insert(ip);
                    ip.to_string()
                } else {
                    "other".to_owned()
                }
            }
        };
        self.long_polls_refused
            .get_or_create(&ClientReasonLabels { client, reason })
            .inc();
    }

    /// Long polls refused so far for `client` (as labelled) and `reason`.
    pub fn long_polls_refused(&self, client: &str, reason: &'static str) -> u64 {
        self.long_polls_refused
            .get_or_create(&ClientReasonLabels {
                client: client.to_owned(),
                reason,
            })
            .get()
    }

    /// Records a reload of the token file: a failure is counted and marks the
    /// file refused until a reload succeeds.
    pub fn token_reloaded(&self, ok: bool) {
        if !ok {
            self.token_reload_failures.inc();
        }
        self.token_file_refused.set(i64::from(!ok));
    }

    /// Failed token reloads so far.
    pub fn token_reload_failures(&self) -> u64 {
        self.token_reload_failures.get()
    }

    /// True while the token file on disk is refused and the old tokens serve.
    pub fn token_file_refused(&self) -> bool {
        self.token_file_refused.get() != 0
    }

    /// Records how long after the first client heard of a change another did.
    pub fn observe_fan_out(&self, latency: Duration) {
        self.fan_out.observe(latency.as_secs_f64());
    }

    /// Counts one answer built (`snapshot`, `delta` or `reset`) and how long
    /// it took; every other client asking for it meanwhile shared it.
    pub fn observe_answer_build(&self, document: &'static str, took: Duration) {
        self.answer_builds
            .get_or_create(&DocumentLabels { document })
            .inc();
        self.answer_build_time.observe(took.as_secs_f64());
    }

    /// Counts a build starting for `reason` (`snapshot`, `epoch`, `compacted`,
    /// `ahead`, `delta`) and marks it running until the guard drops.
    pub fn answer_build_running(&self, reason: &'static str) -> Waiting<'_> {
        self.answer_build_reasons
            .get_or_create(&BuildReasonLabels { reason })
            .inc();
        self.answer_builds_running.inc();
        Waiting(&self.answer_builds_running)
    }

    /// Builds started so far for `reason`.
    pub fn answer_build_reasons(&self, reason: &'static str) -> u64 {
        self.answer_build_reasons
            .get_or_create(&BuildReasonLabels { reason })
            .get()
    }

    /// Counts an answer held for its pages that was let go before its
    /// client asked for it again: `expired` (no page asked for a while),
    /// `evicted` (too many held).
    pub fn answer_pages_dropped(&self, reason: &'static str) {
        self.answer_pages_dropped
            .get_or_create(&BuildReasonLabels { reason })
            .inc();
    }

    /// Held answers let go so far for `reason`.
    pub fn answer_pages_dropped_count(&self, reason: &'static str) -> u64 {
        self.answer_pages_dropped
            .get_or_create(&BuildReasonLabels { reason })
            .get()
    }

    /// Builds running now.
    pub fn answer_builds_running(&self) -> i64 {
        self.answer_builds_running.get()
    }

    /// Answers built so far, by document (`snapshot`, `delta`, `reset`).
    pub fn answer_builds(&self, document: &'static str) -> u64 {
        self.answer_builds
            .get_or_create(&DocumentLabels { document })
            .get()
    }

    /// The connections of the API and admin listeners.
    pub fn connections(&self) -> std::sync::Arc<ConnectionMetrics> {
        self.connections.clone()
    }

    /// Encodes every metric, reading the index's state now.
    pub fn encode(&self, index: &SharedIndex) -> Result<String, std::fmt::Error> {
        let mut registry = Registry::with_prefix(PREFIX);
        registry.register(
            "api_requests",
            "API requests by route and status",
            self.requests.clone(),
        );
        registry.register(
            "long_polls_waiting",
            "Long polls waiting for a change",
            self.long_polls.clone(),
        );
        registry.register_with_unit(
            "change_fan_out",
            "Time from the first long poll answered with a generation to each later one",
            Unit::Seconds,
            self.fan_out.clone(),
        );
        registry.register(
            "answer_builds",
            "Snapshot, delta and reset answers built (each shared by every client asking meanwhile)",
            self.answer_builds.clone(),
        );
        registry.register_with_unit(
            "answer_build_duration",
            "Time to build and encode one answer, off the async workers",
            Unit::Seconds,
            self.answer_build_time.clone(),
        );
        registry.register(
            "long_polls_refused",
            "Long polls answered 429, by client address (the first 32 refused; then other) \
             and the cap (max_long_polls, max_per_client)",
            self.long_polls_refused.clone(),
        );
        registry.register(
            "token_reload_failures",
            "Reloads of --token-file that were refused (the previous tokens kept serving)",
            self.token_reload_failures.clone(),
        );
        registry.register(
            "token_file_refused",
            "1 while the token file on disk is refused and the previous tokens serve",
            self.token_file_refused.clone(),
        );
        registry.register(
            "answer_builds_started",
            "Answer builds started, by the reason of the request that started it \
             (snapshot, epoch, compacted, ahead: a snapshot; delta)",
            self.answer_build_reasons.clone(),
        );
        registry.register(
            "answer_builds_running",
            "Answer builds running now (at most --max-builds)",
            self.answer_builds_running.clone(),
        );
        registry.register(
            "answer_pages_dropped",
            "Answers held for their pages that were let go, by reason \
             (expired: no page asked for 30 s; evicted: too many held)",
            self.answer_pages_dropped.clone(),
        );
        self.connections.register(&mut registry);
        register_index(&mut registry, index);
        let mut text = String::new();
        encode(&mut text, &registry)?;
        Ok(text)
    }
}

/// The answer to a scrape: the `encode`d text as OpenMetrics, or a 500 when
/// it could not be encoded.
pub(crate) fn scrape_answer(encoded: Result<String, std::fmt::Error>) -> Response {
    match encoded {
        Ok(text) => (
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static(
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                ),
            )],
            text,
        )
            .into_response(),
        Err(error) => {
            tracing::error!(%error, "cannot encode metrics");
            StatusCode::INTERNAL_SERVER_ERROR.into_response()
        }
    }
}

fn gauge(value: u64) -> Gauge<u64, AtomicU64> {
    let g = Gauge::<u64, AtomicU64>::default();
    g.set(value);
    g
}

fn register_index(registry: &mut Registry, shared: &SharedIndex) {
    let freshness = shared.freshness();
    let (generation, stats, out_of_scope) = {
        let index = shared.read();
        (
            index.generation(),
            index.stats(),
            index.out_of_scope_count(),
        )
    };
    registry.register("index_generation", "Index generation", gauge(generation));
    registry.register("index_pods", "Pods in the index", gauge(stats.pods as u64));
    registry.register("index_ips", "IPs in the index", gauge(stats.ips as u64));
    registry.register(
        "index_services",
        "Services in the index",
        gauge(stats.services as u64),
    );
    registry.register(
        "index_services_out_of_scope",
        "Services treated as unknown because they may have members outside --namespace/--pod-selector",
        gauge(out_of_scope as u64),
    );
    registry.register(
        "index_tombstones",
        "IPs remembered only by a tombstone",
        gauge(stats.tombstones as u64),
    );
    registry.register(
        "ready",
        "1 when every watch finished its initial list and is fresh",
        gauge(u64::from(shared.ready())),
    );
    registry.register(
        "index_fresh",
        "1 when the index may be trusted (served to filters as freshness.fresh)",
        gauge(u64::from(freshness.fresh)),
    );

    let skipped = Family::<SkipLabels, Counter>::default();
    for ((resource, reason), count) in &stats.skipped {
        skipped
            .get_or_create(&SkipLabels {
                resource: resource.as_str(),
                reason: reason.as_str(),
            })
            .inc_by(*count);
    }
    registry.register(
        "objects_skipped",
        "Malformed objects skipped by resource and reason",
        skipped,
    );

    let events = Family::<EventLabels, Counter>::default();
    let errors = Family::<KindLabels, Counter>::default();
    let relists = Family::<KindLabels, Counter>::default();
    let staleness = Family::<KindLabels, Gauge<f64, AtomicU64>>::default();
    for w in shared.watch_health() {
        let kind = KindLabels { resource: w.kind };
        for (event, count) in w.events() {
            events
                .get_or_create(&EventLabels {
                    resource: w.kind,
                    event,
                })
                .inc_by(count);
        }
        errors.get_or_create(&kind).inc_by(w.errors);
        relists.get_or_create(&kind).inc_by(w.relists);
        if let Some(age) = w.last_event_age {
            staleness.get_or_create(&kind).set(age.as_secs_f64());
        }
    }
    registry.register("watch_events", "Watch events by resource and type", events);
    registry.register("watch_errors", "Watch errors by resource", errors);
    registry.register(
        "watch_relists",
        "Relists (initial lists included) by resource",
        relists,
    );
    registry.register_with_unit(
        "watch_last_event_age",
        "Time since each watch last delivered an event or bookmark",
        Unit::Seconds,
        staleness,
    );
}

// === the audit's metrics ===

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AuditStaleLabels {
    gateway: String,
    cluster: String,
    reason: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AuditReasonLabels {
    gateway: String,
    reason: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AuditRunLabels {
    gateway: String,
    outcome: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GatewayLabels {
    gateway: String,
}

/// What one audit run found, for [`AuditMetrics::record`].
#[derive(Debug, Clone, Default)]
pub struct AuditFindings {
    /// Stale endpoints by `(cluster, reason)`.
    pub stale: Vec<(String, &'static str, u64)>,
    /// Every endpoint by reason code (`unmapped` and `no_address` included).
    pub by_reason: Vec<(&'static str, u64)>,
}

/// The metrics of `staleguard-validator audit --every` (`docs/metrics.md`).
///
/// The findings of the last run that judged the gateway stay until the next
/// such run: a failing run changes `audit_runs_total` and leaves
/// `audit_last_success_timestamp_seconds` to age, which is what an alert on a
/// broken audit watches.
#[derive(Debug, Default)]
pub struct AuditMetrics {
    stale: Family<AuditStaleLabels, Gauge>,
    endpoints: Family<AuditReasonLabels, Gauge>,
    runs: Family<AuditRunLabels, Counter>,
    duration: Family<GatewayLabels, Gauge<f64, AtomicU64>>,
    last_success: Family<GatewayLabels, Gauge<f64, AtomicU64>>,
    connections: std::sync::Arc<ConnectionMetrics>,
}

impl AuditMetrics {
    /// Records one run: its outcome label, how long it took and, when it
    /// judged the gateway, its findings; `now` is its end.
    pub fn record(
        &self,
        gateway: &str,
        outcome: &'static str,
        took: Duration,
        findings: Option<&AuditFindings>,
        now: std::time::SystemTime,
    ) {
        let gw = || GatewayLabels {
            gateway: gateway.to_owned(),
        };
        self.runs
            .get_or_create(&AuditRunLabels {
                gateway: gateway.to_owned(),
                outcome,
            })
            .inc();
        self.duration.get_or_create(&gw()).set(took.as_secs_f64());
        let Some(findings) = findings else {
            return;
        };
        // A cluster that is clean now must not keep its old series.
        self.stale.clear();
        for (cluster, reason, n) in &findings.stale {
            self.stale
                .get_or_create(&AuditStaleLabels {
                    gateway: gateway.to_owned(),
                    cluster: cluster.clone(),
                    reason,
                })
                .set(*n as i64);
        }
        self.endpoints.clear();
        for (reason, n) in &findings.by_reason {
            self.endpoints
                .get_or_create(&AuditReasonLabels {
                    gateway: gateway.to_owned(),
                    reason,
                })
                .set(*n as i64);
        }
        let since_epoch = now
            .duration_since(std::time::SystemTime::UNIX_EPOCH)
            .unwrap_or_default();
        self.last_success
            .get_or_create(&gw())
            .set(since_epoch.as_secs_f64());
    }

    /// The connections of the audit's metrics listener.
    pub fn connections(&self) -> std::sync::Arc<ConnectionMetrics> {
        self.connections.clone()
    }

    /// Encodes the audit's metrics.
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut registry = Registry::with_prefix(PREFIX);
        registry.register(
            "audit_stale_endpoints",
            "Endpoints the gateway holds that are destroyed or recycled, by cluster and reason, at the last audit that judged it",
            self.stale.clone(),
        );
        registry.register(
            "audit_endpoints",
            "Endpoints the gateway holds by reason (verdict reasons, unmapped, no_address), at the last audit that judged it",
            self.endpoints.clone(),
        );
        registry.register(
            "audit_runs",
            "Audit runs by outcome (clean, stale, admin_malformed, admin_unreachable, validator_unreachable, not_fresh, usage)",
            self.runs.clone(),
        );
        registry.register_with_unit(
            "audit_run_duration",
            "How long the last audit run took",
            Unit::Seconds,
            self.duration.clone(),
        );
        registry.register_with_unit(
            "audit_last_success_timestamp",
            "When the last audit that judged the gateway ended, in seconds since the Unix epoch",
            Unit::Seconds,
            self.last_success.clone(),
        );
        self.connections.register(&mut registry);
        let mut text = String::new();
        encode(&mut text, &registry)?;
        Ok(text)
    }
}

#[cfg(test)]
mod naming_tests {
    use std::time::SystemTime;

    use super::*;
    use crate::index::{Index, IndexConfig, Kind};

    /// Every family in a scrape: `(name, type)`, from the `# TYPE` lines.
    fn families(text: &str) -> Vec<(String, String)> {
        text.lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .filter_map(|l| l.split_once(' '))
            .map(|(n, t)| (n.to_owned(), t.to_owned()))
            .collect()
    }

    fn check(text: &str, min_families: usize) {
        let docs = include_str!("../../docs/metrics.md");
        let found = families(text);
        assert!(found.len() >= min_families, "{text}");
        for (name, kind) in found {
            assert!(name.starts_with("staleguard_validator_"), "{name}");
            // OpenMetrics names a counter family without its `_total`; the
            // samples carry it.
            let sample = if kind == "counter" {
                assert!(
                    text.contains(&format!("\n{name}_total")),
                    "{name}: no _total samples"
                );
                format!("{name}_total")
            } else {
                name.clone()
            };
            if name.contains("age") || name.contains("duration") || name.contains("fan_out") {
                assert!(name.ends_with("_seconds"), "a duration in seconds: {name}");
            }
            assert!(
                docs.contains(&format!("`{sample}`")),
                "docs/metrics.md does not document `{sample}`"
            );
        }
    }

    #[test]
    fn every_series_is_prefixed_conventional_and_documented() {
        let shared = SharedIndex::new(
            Index::new(1, IndexConfig::default()),
            Duration::from_secs(60),
        );
        shared.apply_pod(kube::runtime::watcher::Event::Init, SystemTime::now());
        for kind in [Kind::Pod, Kind::Service, Kind::EndpointSlice] {
            shared.heard(kind);
            shared.watch_error(kind);
        }
        let metrics = Metrics::new();
        metrics.observe_request("snapshot", 200);
        metrics.observe_fan_out(Duration::from_millis(3));
        check(&metrics.encode(&shared).unwrap(), 14);
        let audit = AuditMetrics::default();
        let findings = AuditFindings {
            stale: vec![("outbound|80||a.b.svc.cluster.local".into(), "destroyed", 1)],
            by_reason: vec![("member", 3)],
        };
        audit.record(
            "gw-1",
            "stale",
            Duration::from_millis(5),
            Some(&findings),
            SystemTime::now(),
        );
        check(&audit.encode().unwrap(), 5);
    }
}
