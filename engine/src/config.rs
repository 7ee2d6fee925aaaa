//! The plugin configuration: strict JSON, checked whole in `on_configure`.
//!
//! [`RawConfig`] is what operators write (unknown fields are refused, so a typo
//! never silently falls back to a default); [`Config::parse`] checks it and
//! reports every problem at once, each naming its field, so one reload fixes
//! them all. A refused configuration never stops the plugin: the root context
//! runs with the [`Fallback`] until a good one arrives (`crate::root`).

use std::fmt;
use std::io::{BufReader, Read};
use std::ops::RangeInclusive;

use serde_json::Value;
use staleguard_core::cluster::ClusterMap;
pub use staleguard_core::cluster::ClusterRule;
use staleguard_core::ip::Cidr;
use staleguard_core::verdict::{Action, FailurePolicy};
use staleguard_core::{Policy, ServiceKey};

use crate::guard::GuardConfig;
use crate::secret::Secret;

pub(crate) mod read;

/// Why a plugin configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// Not JSON at all.
    #[error("plugin configuration is not JSON: {0}")]
    Malformed(#[source] serde_json::Error),
    /// JSON, but with unknown fields, values of the wrong type, or values out
    /// of range: every problem, each naming its field.
    #[error("plugin configuration refused: {}", .0.join("; "))]
    Invalid(Vec<String>),
}

impl ConfigError {
    /// Every problem, one line each.
    pub fn problems(&self) -> Vec<String> {
        match self {
            ConfigError::Malformed(e) => vec![format!("not JSON: {e}")],
            ConfigError::Invalid(problems) => problems.clone(),
        }
    }
}

/// Enforce verdicts, or only count and log them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// Reject what the verdict rejects.
    #[default]
    Enforce,
    /// Count and log, never block.
    Audit,
}

/// What happens to a request the verdict rejects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnReject {
    /// Answer locally with `reject_status` and the reason header.
    Reject,
    /// Replay an eligible request to a live member through the twin cluster
    /// (see [`crate::replay`]); reject what cannot be replayed.
    Retry,
}

/// The replay path: how a rejected request reaches a live member instead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryConfig {
    /// The twin of a guarded cluster is named `<cluster><twin_suffix>`: same
    /// endpoints, the override-host load balancer, and the filter in its twin
    /// role (docs/filter.md).
    pub twin_suffix: String,
    /// Methods that may be replayed (requests without a body only).
    pub methods: Vec<String>,
    /// Calls to the twin at most, each naming a fresh batch of members.
    pub attempts: u32,
    /// Members named per call (the twin takes the first that is one of its
    /// endpoints).
    pub hosts_per_attempt: u32,
    /// Timeout of the whole replay when the route's is not readable
    /// (`x-envoy-expected-rq-timeout-ms`).
    pub timeout_ms: u64,
    /// The header the twin's load balancer reads the members from.
    pub endpoint_header: String,
    /// The largest answer a replay gives the client: the live host's answer
    /// is copied into the VM (whose memory never shrinks) to be sent on. A
    /// larger one is never copied; the client gets the rejection.
    pub max_answer_bytes: u64,
}

impl Default for RetryConfig {
    fn default() -> Self {
        Self {
            twin_suffix: default_twin_suffix(),
            methods: default_retry_methods(),
            attempts: default_retry_attempts(),
            hosts_per_attempt: default_hosts_per_attempt(),
            timeout_ms: default_retry_timeout_ms(),
            endpoint_header: default_endpoint_header(),
            max_answer_bytes: default_max_answer_bytes(),
        }
    }
}

impl RetryConfig {
    /// The name of `cluster`'s twin: `<cluster><twin_suffix>` (the rule
    /// `deploy/istio/twins.py` also follows; a test checks they agree).
    pub fn twin_name(&self, cluster: &str) -> String {
        format!("{cluster}{}", self.twin_suffix)
    }
}

fn default_twin_suffix() -> String {
    "|staleguard-twin".to_owned()
}
fn default_retry_methods() -> Vec<String> {
    ["GET", "HEAD", "OPTIONS"].map(str::to_owned).to_vec()
}
fn default_retry_attempts() -> u32 {
    3
}
pub(crate) fn default_hosts_per_attempt() -> u32 {
    8
}
fn default_retry_timeout_ms() -> u64 {
    15_000
}
pub(crate) fn default_endpoint_header() -> String {
    "x-gateway-destination-endpoint".to_owned()
}
/// 1 MiB, Envoy's default buffer limit per request.
fn default_max_answer_bytes() -> u64 {
    1 << 20
}

/// The largest `retry.max_answer_bytes`: 64 MiB.
const MAX_ANSWER_BYTES: u64 = 64 << 20;

/// The plugin configuration as written (JSON in the Wasm filter's `configuration`).
#[derive(Debug, Clone)]
pub struct RawConfig {
    /// The Envoy cluster that reaches the validator.
    pub validator_cluster: String,
    /// `:authority` of validator requests (default: the cluster name).
    pub validator_authority: Option<String>,
    /// Bearer token sent to the validator (never shown by `Debug`).
    pub token: Option<Secret>,
    /// The Wasm VM environment variable that holds the token instead (set
    /// through `vm_config.environment_variables`, from a Kubernetes Secret),
    /// so the token never appears in the plugin configuration or a config dump.
    pub token_env: Option<String>,
    /// Long-poll wait in seconds (1..=60).
    pub poll_wait_s: u32,
    /// No successful sync for longer than this makes the data stale.
    pub max_staleness_ms: u64,
    /// Root-context tick period: lease renewal and poll scheduling.
    pub tick_ms: u64,
    /// How long a poller's lease lives without renewal.
    pub lease_ttl_ms: u64,
    /// First retry delay after a sync error.
    pub backoff_initial_ms: u64,
    /// Largest retry delay after sync errors.
    pub backoff_max_ms: u64,
    /// Ask for large answers in pages of this many bytes (0: whole
    /// answers; absent: the host's default, whole answers in the Wasm
    /// filter, see [`crate::root::Root::with_sync_page_bytes`]).
    pub sync_page_bytes: Option<u32>,
    /// `enforce` (default) or `audit`.
    pub mode: Mode,
    /// HTTP status of a rejection (default 503).
    pub reject_status: u32,
    /// Response header carrying the reason code (default `x-staleguard`).
    pub reject_header: String,
    /// The verdict policy (failure policy, terminating, unknown services).
    pub policy: Policy,
    /// Derive services from Istio cluster metadata and `outbound|...` names.
    pub istio: bool,
    /// Mapping rules for plain Envoy, tried first, in order.
    pub clusters: Vec<ClusterRule>,
    /// The blast-radius guard (see [`crate::guard`]); on by default.
    pub guard: GuardConfig,
    /// `reject` or `retry`; default `retry` when `retry` (the replay path)
    /// is configured, else `reject`.
    pub on_reject: Option<OnReject>,
    /// The replay path; its presence makes `retry` the default.
    pub retry: Option<RetryConfig>,
    /// This cluster's pod networks (CIDRs); when set, an upstream IP outside
    /// all of them (a remote cluster's pod, an east-west gateway) is not
    /// judged: passed and counted as out of scope. Empty (the default):
    /// every IP is judged.
    pub pod_cidrs: Vec<String>,
}

impl Default for RawConfig {
    /// Every field's default, and no validator cluster.
    fn default() -> Self {
        Self {
            validator_cluster: String::new(),
            validator_authority: None,
            token: None,
            token_env: None,
            poll_wait_s: default_wait_s(),
            max_staleness_ms: default_max_staleness_ms(),
            tick_ms: default_tick_ms(),
            lease_ttl_ms: default_lease_ttl_ms(),
            backoff_initial_ms: default_backoff_initial_ms(),
            backoff_max_ms: default_backoff_max_ms(),
            sync_page_bytes: None,
            mode: Mode::default(),
            reject_status: default_reject_status(),
            reject_header: default_reject_header(),
            policy: Policy::default(),
            istio: staleguard_core::cluster::default_istio(),
            clusters: Vec::new(),
            guard: GuardConfig::default(),
            on_reject: None,
            retry: None,
            pod_cidrs: Vec::new(),
        }
    }
}

fn default_wait_s() -> u32 {
    30
}
/// 60 s: the guard's `max_staleness_ms`, also the steering role's.
pub(crate) fn default_max_staleness_ms() -> u64 {
    60_000
}
fn default_tick_ms() -> u64 {
    1_000
}
fn default_lease_ttl_ms() -> u64 {
    5_000
}
fn default_backoff_initial_ms() -> u64 {
    500
}
fn default_backoff_max_ms() -> u64 {
    30_000
}
fn default_reject_status() -> u32 {
    503
}
/// `x-staleguard`: the guard's reject header, also what the steering role
/// strips by default.
pub(crate) fn default_reject_header() -> String {
    "x-staleguard".to_owned()
}

/// A checked configuration: the domain values the engine runs with, parsed
/// once (in `on_configure`) and read as fields on the request path. Built
/// from a [`RawConfig`] field by field (see [`Config::parse`]), so a new
/// written field that is not carried over breaks the build.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// The Envoy cluster that reaches the validator.
    pub validator_cluster: String,
    /// The `:authority` of validator requests (`validator_authority`, else
    /// the cluster name).
    pub authority: String,
    /// Bearer token sent to the validator: `token`, or the value of the VM
    /// environment variable `token_env` names.
    pub token: Option<Secret>,
    /// The environment variable the token was read from, if any.
    pub token_env: Option<String>,
    /// Long-poll wait in seconds (1..=60).
    pub poll_wait_s: u32,
    /// No successful sync for longer than this makes the data stale.
    pub max_staleness_ms: u64,
    /// Root-context tick period: lease renewal and poll scheduling.
    pub tick_ms: u64,
    /// How long a poller's lease lives without renewal.
    pub lease_ttl_ms: u64,
    /// First retry delay after a sync error.
    pub backoff_initial_ms: u64,
    /// Largest retry delay after sync errors.
    pub backoff_max_ms: u64,
    /// Large answers in pages of this many bytes (`Some(0)`: whole
    /// answers; `None`: the host's default).
    pub sync_page_bytes: Option<u32>,
    /// Enforce verdicts, or only count and log them.
    pub mode: Mode,
    /// HTTP status of a rejection.
    pub reject_status: u32,
    /// Response header carrying the reason code.
    pub reject_header: String,
    /// The verdict policy.
    pub policy: Policy,
    /// Derive services from Istio cluster metadata and `outbound|...` names.
    pub istio: bool,
    /// Mapping rules for plain Envoy, tried first, in order.
    pub clusters: Vec<ClusterRule>,
    /// The blast-radius guard.
    pub guard: GuardConfig,
    /// The replay path as configured, whether or not it is used: the twin
    /// clusters are named from it (see [`RetryConfig::twin_name`]).
    pub retry: Option<RetryConfig>,
    /// This cluster's pod networks; empty: every IP is judged.
    pub pod_cidrs: Vec<Cidr>,
    /// Rejected requests are replayed (decided once, see [`Config::replay`]).
    replays: bool,
    /// Why `on_reject: retry` was asked for but cannot work, if it was.
    retry_warning: Option<&'static str>,
}

impl Default for Config {
    /// What a gateway without the filter is judged by (the audit's
    /// default): every written default, no validator cluster, no token.
    fn default() -> Self {
        Self::from_raw(RawConfig::default(), Vec::new())
    }
}

impl Config {
    /// Parses and checks a configuration, reporting every problem together;
    /// `token_env` is read from the VM's environment.
    pub fn parse(bytes: &[u8]) -> Result<Self, ConfigError> {
        Self::parse_with_env(bytes, |name| std::env::var(name).ok())
    }

    /// [`Config::parse`] away from the gateway (the audit, the test
    /// harness): the Wasm VM's environment is not the caller's, so a
    /// `token_env` counts as set.
    pub fn parse_outside_gateway(bytes: &[u8]) -> Result<Self, ConfigError> {
        Self::parse_with_env(bytes, |_| Some("set-in-the-gateway".to_owned()))
    }

    /// [`Config::parse`] with the environment given by `env` (tests pass a map).
    pub fn parse_with_env(
        bytes: &[u8],
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, ConfigError> {
        let doc = json_value(bytes).map_err(ConfigError::Malformed)?;
        let mut problems = Vec::new();
        let Some(mut raw) = RawConfig::read(&doc, &mut problems) else {
            return Err(ConfigError::Invalid(problems));
        };
        // A missing or mistyped validator_cluster is reported once, above.
        let cluster_given = doc.get("validator_cluster").is_some_and(Value::is_string);
        if let Some(name) = raw.token_env.clone() {
            if raw.token.is_some() {
                problems.push("set `token` or `token_env`, not both".to_owned());
            } else {
                match env(&name) {
                    Some(token) => raw.token = Some(Secret::new(token.trim_end())),
                    // Never a silent token-less start: the validator would
                    // refuse every poll and the data would never be fresh.
                    None => problems.push(format!(
                        "token_env {name:?} is not set in the Wasm VM environment \
                         (vm_config.environment_variables)"
                    )),
                }
            }
        }
        if cluster_given && raw.validator_cluster.is_empty() {
            problems.push("validator_cluster must not be empty".to_owned());
        }
        if raw.poll_wait_s > 60 {
            problems.push(format!("poll_wait_s {} exceeds 60", raw.poll_wait_s));
        }
        if raw.poll_wait_s == 0 {
            // Without a wait every answer comes at once and the poller would
            // ask again at once: a busy loop against the validator.
            problems.push("poll_wait_s must be at least 1".to_owned());
        }
        if raw.max_staleness_ms <= u64::from(raw.poll_wait_s) * 1000 {
            // A healthy long poll answers only every poll_wait_s; a bound below
            // that would call healthy data stale between answers.
            problems.push(format!(
                "max_staleness_ms {} must exceed poll_wait_s ({} s)",
                raw.max_staleness_ms, raw.poll_wait_s
            ));
        }
        problems.extend(range_problem("tick_ms", raw.tick_ms, 10..=60_000));
        if raw.lease_ttl_ms < 2 * raw.tick_ms {
            // The holder renews once per tick; a TTL under two ticks would let
            // a healthy holder lose its lease to scheduling jitter.
            problems.push(format!(
                "lease_ttl_ms {} must be at least twice tick_ms {}",
                raw.lease_ttl_ms, raw.tick_ms
            ));
        }
        if raw.backoff_initial_ms == 0 || raw.backoff_max_ms < raw.backoff_initial_ms {
            problems.push(format!(
                "backoff needs 0 < backoff_initial_ms ({}) <= backoff_max_ms ({})",
                raw.backoff_initial_ms, raw.backoff_max_ms
            ));
        }
        problems.extend(range_problem("reject_status", raw.reject_status, 200..=599));
        problems.extend(header_problem("reject_header", &raw.reject_header));
        if let Some(token) = raw.token.as_ref().map(Secret::expose) {
            if token.is_empty() || token.bytes().any(|b| !(0x21..=0x7e).contains(&b)) {
                problems.push("token must be non-empty printable ASCII".to_owned());
            }
        }
        for (i, rule) in raw.clusters.iter().enumerate() {
            if let Some(problem) = rule.problem() {
                problems.push(format!("clusters[{i}] {problem}"));
            }
        }
        problems.extend(raw.guard.problems());
        if let Some(retry) = &raw.retry {
            retry_problems(retry, &mut problems);
        }
        let mut pod_cidrs = Vec::new();
        for (i, text) in raw.pod_cidrs.iter().enumerate() {
            match text.parse::<Cidr>() {
                Ok(cidr) => pod_cidrs.push(cidr),
                Err(e) => problems.push(format!("pod_cidrs[{i}]: {e}")),
            }
        }
        if problems.is_empty() {
            Ok(Self::from_raw(raw, pod_cidrs))
        } else {
            Err(ConfigError::Invalid(problems))
        }
    }

    /// The domain values of a checked `raw` (with its `pod_cidrs` parsed):
    /// every field carried over or decided here, once.
    fn from_raw(raw: RawConfig, pod_cidrs: Vec<Cidr>) -> Self {
        let RawConfig {
            validator_cluster,
            validator_authority,
            token,
            token_env,
            poll_wait_s,
            max_staleness_ms,
            tick_ms,
            lease_ttl_ms,
            backoff_initial_ms,
            backoff_max_ms,
            sync_page_bytes,
            mode,
            reject_status,
            reject_header,
            policy,
            istio,
            clusters,
            guard,
            on_reject,
            retry,
            pod_cidrs: _,
        } = raw;
        // `retry` asked for, or defaulted to when a replay path is given.
        let asked = on_reject.unwrap_or(if retry.is_some() {
            OnReject::Retry
        } else {
            OnReject::Reject
        }) == OnReject::Retry;
        let replays = asked && retry.is_some() && mode == Mode::Enforce;
        let retry_warning = match (asked, &retry, mode) {
            (false, _, _) => None,
            (true, None, _) => Some(
                "on_reject is retry but no replay path is configured (the `retry` block naming the twin clusters): rejecting instead",
            ),
            (true, Some(_), Mode::Audit) => Some(
                "on_reject is retry but mode is audit, which lets every request through: nothing is replayed",
            ),
            (true, Some(_), Mode::Enforce) => None,
        };
        Self {
            authority: validator_authority.unwrap_or_else(|| validator_cluster.clone()),
            validator_cluster,
            token,
            token_env,
            poll_wait_s,
            max_staleness_ms,
            tick_ms,
            lease_ttl_ms,
            backoff_initial_ms,
            backoff_max_ms,
            sync_page_bytes,
            mode,
            reject_status,
            reject_header,
            policy,
            istio,
            clusters,
            guard,
            retry,
            pod_cidrs,
            replays,
            retry_warning,
        }
    }

    /// The replay path, when rejected requests are to be replayed: `retry`
    /// asked for (or defaulted to), a replay path configured, and enforcing.
    pub fn replay(&self) -> Option<&RetryConfig> {
        self.retry.as_ref().filter(|_| self.replays)
    }

    /// Why `on_reject: retry` was asked for but cannot work, if it was: the
    /// line `on_configure` logs, since the filter then rejects instead.
    pub fn retry_warning(&self) -> Option<&str> {
        self.retry_warning
    }

    /// True when `ip` is one this gateway judges: no `pod_cidrs`, or inside
    /// one of them.
    pub fn in_scope(&self, ip: std::net::IpAddr) -> bool {
        staleguard_core::ip::in_scope(&self.pod_cidrs, ip)
    }

    /// How this configuration maps clusters to services (the rule shared with
    /// `staleguard-validator audit`).
    pub fn cluster_map(&self) -> ClusterMap<'_> {
        ClusterMap {
            validator_cluster: &self.validator_cluster,
            istio: self.istio,
            rules: &self.clusters,
        }
    }
}

/// What a root context whose configuration was refused does until a good one
/// arrives: the failure policy's behaviour for data it cannot trust, read
/// from whatever of the refused document can be read (the defaults
/// otherwise). Open lets every request through, counted; closed rejects with
/// the configured status and the reason `config_refused`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fallback {
    /// `policy.failure_policy` of the refused document, if readable.
    pub failure_policy: FailurePolicy,
    /// `reject_status`, if readable and in range.
    pub reject_status: u32,
    /// `reject_header`, if readable and a header name.
    pub reject_header: String,
}

/// The reason code a closed [`Fallback`] rejects with.
pub const CONFIG_REFUSED: &str = "config_refused";

impl Fallback {
    /// The fallback of a refused document `bytes`.
    pub fn read(bytes: &[u8]) -> Self {
        let doc = json_value(bytes).unwrap_or(Value::Null);
        let failure_policy = doc
            .get("policy")
            .and_then(|p| p.get("failure_policy"))
            .and_then(|v| read::variant("", v, FAILURE_POLICIES, &mut Vec::new()))
            .unwrap_or_default();
        let reject_status = doc
            .get("reject_status")
            .and_then(Value::as_u64)
            .and_then(|s| u32::try_from(s).ok())
            .filter(|s| (200..=599).contains(s))
            .unwrap_or_else(default_reject_status);
        let reject_header = doc
            .get("reject_header")
            .and_then(Value::as_str)
            .filter(|h| is_header_name(h))
            .map_or_else(default_reject_header, str::to_owned);
        Self {
            failure_policy,
            reject_status,
            reject_header,
        }
    }

    /// What happens to requests, for the log line of a refusal.
    pub fn describe(&self) -> String {
        match self.failure_policy {
            FailurePolicy::Open => "the filter lets every request through unguarded (failure policy open), \
                 counted in staleguard_filter_requests_unconfigured_total, until a good configuration arrives"
                .to_owned(),
            FailurePolicy::Closed => format!(
                "the filter rejects every request with {} and `{}: {CONFIG_REFUSED}` (failure policy closed), \
                 counted in staleguard_filter_requests_unconfigured_total, until a good configuration arrives",
                self.reject_status, self.reject_header
            ),
        }
    }
}

/// A JSON document (a plugin configuration, an error answer) as a [`Value`],
/// read through the same reader type as the validator's JSON answers
/// (`crate::sync`: a `BufReader` over a boxed body), so that the module
/// carries one copy of `serde_json`'s parser instead of one per reader type
/// (10 KB of the Wasm module's code; docs/benchmarks.md, "A smaller module").
/// The bytes are copied once: a configuration or an error answer is small.
pub(crate) fn json_value(bytes: &[u8]) -> serde_json::Result<Value> {
    let body: Box<dyn Read> = Box::new(std::io::Cursor::new(bytes.to_vec()));
    serde_json::from_reader(BufReader::new(body))
}

// === the shape of a document, field by field ===

/// The names `mode` accepts.
const MODES: &[(&str, Mode)] = &[("enforce", Mode::Enforce), ("audit", Mode::Audit)];
/// The names `on_reject` accepts.
const ON_REJECTS: &[(&str, OnReject)] = &[("reject", OnReject::Reject), ("retry", OnReject::Retry)];
/// The names `policy.failure_policy` accepts.
const FAILURE_POLICIES: &[(&str, FailurePolicy)] = &[
    ("open", FailurePolicy::Open),
    ("closed", FailurePolicy::Closed),
];
/// The names `policy.terminating` and `policy.unknown_service` accept.
const ACTIONS: &[(&str, Action)] = &[("allow", Action::Allow), ("reject", Action::Reject)];

/// The fields of the plugin configuration, as a refusal lists them.
const RAW_FIELDS: &[&str] = &[
    "validator_cluster",
    "validator_authority",
    "token",
    "token_env",
    "poll_wait_s",
    "max_staleness_ms",
    "tick_ms",
    "lease_ttl_ms",
    "backoff_initial_ms",
    "backoff_max_ms",
    "sync_page_bytes",
    "mode",
    "reject_status",
    "reject_header",
    "policy",
    "istio",
    "clusters",
    "guard",
    "on_reject",
    "retry",
    "pod_cidrs",
];

impl RawConfig {
    /// The configuration in `doc`, read field by field so that every unknown
    /// field and every value of the wrong type is reported, each with its
    /// path: a field that is refused keeps its default and the rest is read.
    /// `None` when `doc` is not an object.
    fn read(doc: &Value, problems: &mut Vec<String>) -> Option<Self> {
        let Value::Object(fields) = doc else {
            problems.push(format!(
                "the plugin configuration must be a JSON object, not {}",
                kind(doc)
            ));
            return None;
        };
        if !fields.contains_key("validator_cluster") {
            problems.push(
                "validator_cluster is missing: name the Envoy cluster that reaches the validator"
                    .to_owned(),
            );
        }
        let mut raw = Self::default();
        read::fields(
            "",
            doc,
            "",
            RAW_FIELDS,
            problems,
            &mut |key, path, value, p| match key {
                "validator_cluster" => {
                    read::set(&mut raw.validator_cluster, read::string(path, value, p))
                }
                "validator_authority" => {
                    raw.validator_authority =
                        read::unless_null(value).and_then(|v| read::string(path, v, p));
                }
                "token" => {
                    raw.token = read::unless_null(value).and_then(|v| match v {
                        Value::String(token) => Some(Secret::new(token.as_str())),
                        // Never the value: it may be the token, misquoted.
                        _ => {
                            p.push("token: must be a string (value not shown)".to_owned());
                            None
                        }
                    })
                }
                "token_env" => {
                    raw.token_env = read::unless_null(value).and_then(|v| read::string(path, v, p))
                }
                "poll_wait_s" => read::set(&mut raw.poll_wait_s, read::u32(path, value, p)),
                "max_staleness_ms" => {
                    read::set(&mut raw.max_staleness_ms, read::u64(path, value, p))
                }
                "tick_ms" => read::set(&mut raw.tick_ms, read::u64(path, value, p)),
                "lease_ttl_ms" => read::set(&mut raw.lease_ttl_ms, read::u64(path, value, p)),
                "backoff_initial_ms" => {
                    read::set(&mut raw.backoff_initial_ms, read::u64(path, value, p))
                }
                "backoff_max_ms" => read::set(&mut raw.backoff_max_ms, read::u64(path, value, p)),
                "sync_page_bytes" => {
                    raw.sync_page_bytes =
                        read::unless_null(value).and_then(|v| read::u32(path, v, p))
                }
                "mode" => read::set(&mut raw.mode, read::variant(path, value, MODES, p)),
                "reject_status" => read::set(&mut raw.reject_status, read::u32(path, value, p)),
                "reject_header" => read::set(&mut raw.reject_header, read::string(path, value, p)),
                "policy" => read::set(&mut raw.policy, read_policy(path, value, p)),
                "istio" => read::set(&mut raw.istio, read::boolean(path, value, p)),
                "clusters" => {
                    if let Some(items) = read::array(path, value, p) {
                        raw.clusters = items
                            .iter()
                            .enumerate()
                            .filter_map(|(i, item)| {
                                read_cluster_rule(&format!("{path}[{i}]"), item, p)
                            })
                            .collect();
                    }
                }
                "guard" => read::set(&mut raw.guard, GuardConfig::read(path, value, p)),
                "on_reject" => {
                    raw.on_reject =
                        read::unless_null(value).and_then(|v| read::variant(path, v, ON_REJECTS, p))
                }
                "retry" => {
                    raw.retry = read::unless_null(value).and_then(|v| RetryConfig::read(path, v, p))
                }
                "pod_cidrs" => read::set(&mut raw.pod_cidrs, read::strings(path, value, p)),
                // Not in RAW_FIELDS: named by `read::fields`.
                _ => {}
            },
        )?;
        Some(raw)
    }
}

/// The fields of `retry`, as a refusal lists them.
const RETRY_FIELDS: &[&str] = &[
    "twin_suffix",
    "methods",
    "attempts",
    "hosts_per_attempt",
    "timeout_ms",
    "endpoint_header",
    "max_answer_bytes",
];

impl RetryConfig {
    /// The replay path at `path`: [`RawConfig::read`]'s rules.
    fn read(path: &str, value: &Value, problems: &mut Vec<String>) -> Option<Self> {
        let mut retry = Self::default();
        read::fields(
            path,
            value,
            "struct RetryConfig",
            RETRY_FIELDS,
            problems,
            &mut |key, at, value, p| match key {
                "twin_suffix" => read::set(&mut retry.twin_suffix, read::string(at, value, p)),
                "methods" => read::set(&mut retry.methods, read::strings(at, value, p)),
                "attempts" => read::set(&mut retry.attempts, read::u32(at, value, p)),
                "hosts_per_attempt" => {
                    read::set(&mut retry.hosts_per_attempt, read::u32(at, value, p))
                }
                "timeout_ms" => read::set(&mut retry.timeout_ms, read::u64(at, value, p)),
                "endpoint_header" => {
                    read::set(&mut retry.endpoint_header, read::string(at, value, p))
                }
                "max_answer_bytes" => {
                    read::set(&mut retry.max_answer_bytes, read::u64(at, value, p))
                }
                // Not in RETRY_FIELDS: named by `read::fields`.
                _ => {}
            },
        )?;
        Some(retry)
    }
}

/// The fields of `guard`, as a refusal lists them.
const GUARD_FIELDS: &[&str] = &[
    "enabled",
    "max_loss_percent",
    "min_ips",
    "min_service_ips",
    "confirm_ms",
];

impl GuardConfig {
    /// The guard's knobs at `path`: [`RawConfig::read`]'s rules.
    fn read(path: &str, value: &Value, problems: &mut Vec<String>) -> Option<Self> {
        let mut guard = Self::default();
        read::fields(
            path,
            value,
            "struct GuardConfig",
            GUARD_FIELDS,
            problems,
            &mut |key, at, value, p| match key {
                "enabled" => read::set(&mut guard.enabled, read::boolean(at, value, p)),
                "max_loss_percent" => {
                    read::set(&mut guard.max_loss_percent, read::u32(at, value, p))
                }
                "min_ips" => read::set(&mut guard.min_ips, read::u64(at, value, p)),
                "min_service_ips" => read::set(&mut guard.min_service_ips, read::u64(at, value, p)),
                "confirm_ms" => read::set(&mut guard.confirm_ms, read::u64(at, value, p)),
                // Not in GUARD_FIELDS: named by `read::fields`.
                _ => {}
            },
        )?;
        Some(guard)
    }
}

/// The fields of `policy`, as a refusal lists them.
const POLICY_FIELDS: &[&str] = &["failure_policy", "terminating", "unknown_service"];

/// The verdict policy at `path`: [`RawConfig::read`]'s rules.
fn read_policy(path: &str, value: &Value, problems: &mut Vec<String>) -> Option<Policy> {
    let mut policy = Policy::default();
    read::fields(
        path,
        value,
        "struct Policy",
        POLICY_FIELDS,
        problems,
        &mut |key, at, value, p| match key {
            "failure_policy" => read::set(
                &mut policy.failure_policy,
                read::variant(at, value, FAILURE_POLICIES, p),
            ),
            "terminating" => read::set(
                &mut policy.terminating,
                read::variant(at, value, ACTIONS, p),
            ),
            "unknown_service" => read::set(
                &mut policy.unknown_service,
                read::variant(at, value, ACTIONS, p),
            ),
            // Not in POLICY_FIELDS: named by `read::fields`.
            _ => {}
        },
    )?;
    Some(policy)
}

/// The fields of a `clusters` rule, as a refusal lists them.
const CLUSTER_RULE_FIELDS: &[&str] = &["name", "prefix", "service"];

/// The cluster rule at `path`: [`RawConfig::read`]'s rules; a rule without
/// a valid `service` is left out.
fn read_cluster_rule(path: &str, value: &Value, problems: &mut Vec<String>) -> Option<ClusterRule> {
    let (mut name, mut prefix, mut service) = (None, None, None);
    read::fields(
        path,
        value,
        "struct ClusterRule",
        CLUSTER_RULE_FIELDS,
        problems,
        &mut |key, at, value, p| match key {
            "name" => name = read::unless_null(value).and_then(|v| read::string(at, v, p)),
            "prefix" => prefix = read::unless_null(value).and_then(|v| read::string(at, v, p)),
            "service" => {
                service = read::string(at, value, p).and_then(|s| match s.parse::<ServiceKey>() {
                    Ok(key) => Some(key),
                    Err(e) => {
                        p.push(format!("{at}: {e}"));
                        None
                    }
                });
            }
            // Not in CLUSTER_RULE_FIELDS: named by `read::fields`.
            _ => {}
        },
    )?;
    let Some(service) = service else {
        read::missing(path, "service", problems);
        return None;
    };
    Some(ClusterRule {
        name,
        prefix,
        service,
    })
}

/// A JSON value's kind, for messages.
fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn retry_problems(retry: &RetryConfig, problems: &mut Vec<String>) {
    if retry.twin_suffix.is_empty() {
        // An empty suffix would make the twin the guarded cluster itself.
        problems.push("retry.twin_suffix must not be empty".to_owned());
    }
    for m in &retry.methods {
        if m.is_empty() || !m.bytes().all(|b| b.is_ascii_uppercase()) {
            problems.push(format!("retry.methods: {m:?} is not an uppercase method"));
        } else if m == "CONNECT" {
            problems.push("retry.methods: CONNECT cannot be replayed".to_owned());
        }
    }
    problems.extend(range_problem("retry.attempts", retry.attempts, 1..=10));
    problems.extend(range_problem(
        "retry.hosts_per_attempt",
        retry.hosts_per_attempt,
        HOSTS_PER_CALL,
    ));
    problems.extend(range_problem(
        "retry.timeout_ms",
        retry.timeout_ms,
        1..=3_600_000,
    ));
    problems.extend(range_problem(
        "retry.max_answer_bytes",
        retry.max_answer_bytes,
        1..=MAX_ANSWER_BYTES,
    ));
    problems.extend(header_problem(
        "retry.endpoint_header",
        &retry.endpoint_header,
    ));
}

/// How many members one call may name (`retry.hosts_per_attempt`,
/// `steer.hosts`).
pub(crate) const HOSTS_PER_CALL: RangeInclusive<u32> = 1..=64;

/// The problem with `value` as the knob `field`, if it is outside `range`.
pub(crate) fn range_problem<T>(field: &str, value: T, range: RangeInclusive<T>) -> Option<String>
where
    T: PartialOrd + fmt::Display + fmt::Debug,
{
    (!range.contains(&value)).then(|| format!("{field} {value} not in {range:?}"))
}

/// The problem with `value` as the header knob `field`, if it is not a
/// lowercase header name (what every header knob must be).
pub(crate) fn header_problem(field: &str, value: &str) -> Option<String> {
    (!is_header_name(value)).then(|| format!("{field} {value:?} is not a lowercase header name"))
}

/// A lowercase header name.
fn is_header_name(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

#[cfg(test)]
mod tests;
