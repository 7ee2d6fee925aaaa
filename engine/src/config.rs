//! The plugin configuration: strict JSON, checked whole in `on_configure`.
//!
//! [`RawConfig`] is what operators write (unknown fields are refused, so a typo
//! never silently falls back to a default); [`Config::parse`] checks it and
//! reports every problem at once, each naming its field, so one reload fixes
//! them all. A refused configuration never stops the plugin: the root context
//! runs with the [`Fallback`] until a good one arrives (`crate::root`).

use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{Map, Value};
use staleguard_core::cluster::ClusterMap;
pub use staleguard_core::cluster::ClusterRule;
use staleguard_core::ip::Cidr;
use staleguard_core::verdict::FailurePolicy;
use staleguard_core::Policy;

use crate::guard::GuardConfig;
use crate::secret::Secret;

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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Reject what the verdict rejects.
    #[default]
    Enforce,
    /// Count and log, never block.
    Audit,
}

/// What happens to a request the verdict rejects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnReject {
    /// Answer locally with `reject_status` and the reason header.
    Reject,
    /// Replay an eligible request to a live member through the twin cluster
    /// (see [`crate::replay`]); reject what cannot be replayed.
    Retry,
}

/// The replay path: how a rejected request reaches a live member instead.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetryConfig {
    /// The twin of a guarded cluster is named `<cluster><twin_suffix>`: same
    /// endpoints, the override-host load balancer, and the filter in its twin
    /// role (docs/filter.md).
    #[serde(default = "default_twin_suffix")]
    pub twin_suffix: String,
    /// Methods that may be replayed (requests without a body only).
    #[serde(default = "default_retry_methods")]
    pub methods: Vec<String>,
    /// Calls to the twin at most, each naming a fresh batch of members.
    #[serde(default = "default_retry_attempts")]
    pub attempts: u32,
    /// Members named per call (the twin takes the first that is one of its
    /// endpoints).
    #[serde(default = "default_hosts_per_attempt")]
    pub hosts_per_attempt: u32,
    /// Timeout of the whole replay when the route's is not readable
    /// (`x-envoy-expected-rq-timeout-ms`).
    #[serde(default = "default_retry_timeout_ms")]
    pub timeout_ms: u64,
    /// The header the twin's load balancer reads the members from.
    #[serde(default = "default_endpoint_header")]
    pub endpoint_header: String,
    /// The largest answer a replay gives the client: the live host's answer
    /// is copied into the VM (whose memory never shrinks) to be sent on. A
    /// larger one is never copied; the client gets the rejection.
    #[serde(default = "default_max_answer_bytes")]
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
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    /// The Envoy cluster that reaches the validator.
    pub validator_cluster: String,
    /// `:authority` of validator requests (default: the cluster name).
    #[serde(default)]
    pub validator_authority: Option<String>,
    /// Bearer token sent to the validator (never shown by `Debug`).
    #[serde(default)]
    pub token: Option<Secret>,
    /// The Wasm VM environment variable that holds the token instead (set
    /// through `vm_config.environment_variables`, from a Kubernetes Secret),
    /// so the token never appears in the plugin configuration or a config dump.
    #[serde(default)]
    pub token_env: Option<String>,
    /// Long-poll wait in seconds (1..=60).
    #[serde(default = "default_wait_s")]
    pub poll_wait_s: u32,
    /// No successful sync for longer than this makes the data stale.
    #[serde(default = "default_max_staleness_ms")]
    pub max_staleness_ms: u64,
    /// Root-context tick period: lease renewal and poll scheduling.
    #[serde(default = "default_tick_ms")]
    pub tick_ms: u64,
    /// How long a poller's lease lives without renewal.
    #[serde(default = "default_lease_ttl_ms")]
    pub lease_ttl_ms: u64,
    /// First retry delay after a sync error.
    #[serde(default = "default_backoff_initial_ms")]
    pub backoff_initial_ms: u64,
    /// Largest retry delay after sync errors.
    #[serde(default = "default_backoff_max_ms")]
    pub backoff_max_ms: u64,
    /// `enforce` (default) or `audit`.
    #[serde(default)]
    pub mode: Mode,
    /// HTTP status of a rejection (default 503).
    #[serde(default = "default_reject_status")]
    pub reject_status: u32,
    /// Response header carrying the reason code (default `x-staleguard`).
    #[serde(default = "default_reject_header")]
    pub reject_header: String,
    /// The verdict policy (failure policy, terminating, unknown services).
    #[serde(default)]
    pub policy: Policy,
    /// Derive services from Istio cluster metadata and `outbound|...` names.
    #[serde(default = "staleguard_core::cluster::default_istio")]
    pub istio: bool,
    /// Mapping rules for plain Envoy, tried first, in order.
    #[serde(default)]
    pub clusters: Vec<ClusterRule>,
    /// The blast-radius guard (see [`crate::guard`]); on by default.
    #[serde(default)]
    pub guard: GuardConfig,
    /// `reject` or `retry`; default `retry` when `retry` (the replay path)
    /// is configured, else `reject`.
    #[serde(default)]
    pub on_reject: Option<OnReject>,
    /// The replay path; its presence makes `retry` the default.
    #[serde(default)]
    pub retry: Option<RetryConfig>,
    /// This cluster's pod networks (CIDRs); when set, an upstream IP outside
    /// all of them (a remote cluster's pod, an east-west gateway) is not
    /// judged: passed and counted as out of scope. Empty (the default):
    /// every IP is judged.
    #[serde(default)]
    pub pod_cidrs: Vec<String>,
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

/// A checked configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// The checked fields (same names as written).
    pub raw: RawConfig,
    /// `raw.pod_cidrs`, parsed.
    pub pod_cidrs: Vec<Cidr>,
}

impl Config {
    /// Parses and checks a configuration, reporting every problem together;
    /// `token_env` is read from the VM's environment.
    pub fn parse(bytes: &[u8]) -> Result<Self, ConfigError> {
        Self::parse_with_env(bytes, |name| std::env::var(name).ok())
    }

    /// [`Config::parse`] with the environment given by `env` (tests pass a map).
    pub fn parse_with_env(
        bytes: &[u8],
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, ConfigError> {
        let doc: Value = serde_json::from_slice(bytes).map_err(ConfigError::Malformed)?;
        let mut problems = Vec::new();
        let Some(mut raw) = shape(&doc, &mut problems) else {
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
        if !(10..=60_000).contains(&raw.tick_ms) {
            problems.push(format!("tick_ms {} not in 10..=60000", raw.tick_ms));
        }
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
        if !(200..=599).contains(&raw.reject_status) {
            problems.push(format!(
                "reject_status {} not in 200..=599",
                raw.reject_status
            ));
        }
        if !is_header_name(&raw.reject_header) {
            problems.push(format!(
                "reject_header {:?} is not a lowercase header name",
                raw.reject_header
            ));
        }
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
            Ok(Self { raw, pod_cidrs })
        } else {
            Err(ConfigError::Invalid(problems))
        }
    }

    /// The replay path, when rejected requests are to be replayed: `retry`
    /// asked for (or defaulted to), a replay path configured, and enforcing.
    pub fn replay(&self) -> Option<&RetryConfig> {
        let wanted = self.raw.on_reject.unwrap_or(if self.raw.retry.is_some() {
            OnReject::Retry
        } else {
            OnReject::Reject
        });
        match (wanted, self.raw.mode) {
            (OnReject::Retry, Mode::Enforce) => self.raw.retry.as_ref(),
            _ => None,
        }
    }

    /// Why `on_reject: retry` was asked for but cannot work, if it was: the
    /// line `on_configure` logs, since the filter then rejects instead.
    pub fn retry_warning(&self) -> Option<String> {
        let asked = match self.raw.on_reject {
            Some(OnReject::Retry) => true,
            Some(OnReject::Reject) => false,
            None => self.raw.retry.is_some(),
        };
        if !asked {
            return None;
        }
        if self.raw.retry.is_none() {
            return Some(
                "on_reject is retry but no replay path is configured (the `retry` block naming the twin clusters): rejecting instead"
                    .to_owned(),
            );
        }
        (self.raw.mode == Mode::Audit)
            .then(|| "on_reject is retry but mode is audit, which lets every request through: nothing is replayed".to_owned())
    }

    /// True when `ip` is one this gateway judges: no `pod_cidrs`, or inside
    /// one of them.
    pub fn in_scope(&self, ip: std::net::IpAddr) -> bool {
        staleguard_core::ip::in_scope(&self.pod_cidrs, ip)
    }

    /// The `:authority` of validator requests.
    pub fn authority(&self) -> &str {
        self.raw
            .validator_authority
            .as_deref()
            .unwrap_or(&self.raw.validator_cluster)
    }

    /// How this configuration maps clusters to services (the rule shared with
    /// `staleguard-validator audit`).
    pub fn cluster_map(&self) -> ClusterMap<'_> {
        ClusterMap {
            validator_cluster: &self.raw.validator_cluster,
            istio: self.raw.istio,
            rules: &self.raw.clusters,
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
        let doc = serde_json::from_slice::<Value>(bytes).unwrap_or(Value::Null);
        let failure_policy = doc
            .get("policy")
            .and_then(|p| p.get("failure_policy"))
            .and_then(|v| FailurePolicy::deserialize(v).ok())
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

// === the shape of a document, field by field ===

/// The [`RawConfig`] in `doc`, checked field by field so that every unknown
/// field and every value of the wrong type is reported (serde alone stops at
/// the first), each with its path: the fields that fail are left out (their
/// defaults apply) and the rest is parsed. `None` when nothing usable is left.
fn shape(doc: &Value, problems: &mut Vec<String>) -> Option<RawConfig> {
    let Value::Object(fields) = doc else {
        problems.push(format!(
            "the plugin configuration must be a JSON object, not {}",
            kind(doc)
        ));
        return None;
    };
    // The one required field is put in first, a stand-in if it is missing or
    // not a string, so that every other field is tried against a complete
    // document: a `missing field` error met later is then the nested
    // object's own.
    let mut seed = Map::new();
    match fields.get("validator_cluster") {
        Some(Value::String(s)) => seed.insert("validator_cluster".into(), Value::String(s.clone())),
        Some(_) => seed.insert("validator_cluster".into(), Value::String(String::new())),
        None => {
            problems.push(
                "validator_cluster is missing: name the Envoy cluster that reaches the validator"
                    .to_owned(),
            );
            seed.insert("validator_cluster".into(), Value::String(String::new()))
        }
    };
    let probe = |candidate: &Value| refusal::<RawConfig>(candidate);
    let accepted = narrow_object("", fields, seed, &probe, problems)?;
    match RawConfig::deserialize(&accepted) {
        Ok(raw) => Some(raw),
        Err(e) => {
            problems.push(e.to_string());
            None
        }
    }
}

/// Tries a candidate value in its place in the document: `Some(error)` when
/// the document would be refused for it.
type Probe<'a> = &'a dyn Fn(&Value) -> Option<String>;

/// Why `T` refuses `candidate`.
fn refusal<T: DeserializeOwned>(candidate: &Value) -> Option<String> {
    T::deserialize(candidate).err().map(|e| e.to_string())
}

/// `error`, unless it is a `missing field` one: an object built up field by
/// field lacks the fields still to come.
fn but_missing(error: Option<String>) -> Option<String> {
    error.filter(|e| !e.starts_with("missing field"))
}

/// The part of `value` (at `path`) that `probe` accepts; what it leaves out is
/// pushed to `problems`.
fn narrow(
    path: &str,
    value: &Value,
    probe: Probe<'_>,
    problems: &mut Vec<String>,
) -> Option<Value> {
    let Some(error) = probe(value) else {
        return Some(value.clone());
    };
    match value {
        Value::Object(fields) => narrow_object(path, fields, Map::new(), probe, problems),
        Value::Array(items) => {
            if let Some(error) = but_missing(probe(&Value::Array(vec![]))) {
                problems.push(problem(path, &error));
                return None;
            }
            let mut kept: Vec<Value> = vec![];
            for (i, item) in items.iter().enumerate() {
                let at = |candidate: &Value| {
                    let mut trial = kept.clone();
                    trial.push(candidate.clone());
                    probe(&Value::Array(trial))
                };
                if let Some(item) = narrow(&format!("{path}[{i}]"), item, &at, problems) {
                    kept.push(item);
                }
            }
            Some(Value::Array(kept))
        }
        _ => {
            problems.push(problem(path, &error));
            None
        }
    }
}

/// [`narrow`] for an object, starting from the fields in `seed`.
fn narrow_object(
    path: &str,
    fields: &Map<String, Value>,
    seed: Map<String, Value>,
    probe: Probe<'_>,
    problems: &mut Vec<String>,
) -> Option<Value> {
    if let Some(error) = but_missing(probe(&Value::Object(seed.clone()))) {
        // Not an object where one is expected, or an unknown object field.
        problems.push(problem(path, &error));
        return None;
    }
    // The top level starts complete (see `shape`); below it, an object is
    // complete only once all its fields are in.
    let top = path.is_empty();
    let mut kept = seed;
    for (key, value) in fields {
        let at = |candidate: &Value| {
            let mut trial = kept.clone();
            trial.insert(key.clone(), candidate.clone());
            let error = probe(&Value::Object(trial));
            if top {
                error
            } else {
                but_missing(error)
            }
        };
        let sub = if path.is_empty() {
            key.clone()
        } else {
            format!("{path}.{key}")
        };
        if let Some(value) = narrow(&sub, value, &at, problems) {
            kept.insert(key.clone(), value);
        }
    }
    let kept = Value::Object(kept);
    if let Some(error) = probe(&kept) {
        // A required field is missing.
        problems.push(problem(path, &error));
        return None;
    }
    Some(kept)
}

/// One problem line: the field's path and what serde said (which names the
/// value and what is accepted), but never the token's value.
fn problem(path: &str, error: &str) -> String {
    if path.is_empty() {
        return error.to_owned();
    }
    if path == "token" {
        return "token: must be a string (value not shown)".to_owned();
    }
    format!("{path}: {error}")
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
    if !(1..=10).contains(&retry.attempts) {
        problems.push(format!("retry.attempts {} not in 1..=10", retry.attempts));
    }
    if !(1..=64).contains(&retry.hosts_per_attempt) {
        problems.push(format!(
            "retry.hosts_per_attempt {} not in 1..=64",
            retry.hosts_per_attempt
        ));
    }
    if !(1..=3_600_000).contains(&retry.timeout_ms) {
        problems.push(format!(
            "retry.timeout_ms {} not in 1..=3600000",
            retry.timeout_ms
        ));
    }
    if !(1..=MAX_ANSWER_BYTES).contains(&retry.max_answer_bytes) {
        problems.push(format!(
            "retry.max_answer_bytes {} not in 1..={MAX_ANSWER_BYTES}",
            retry.max_answer_bytes
        ));
    }
    if !is_header_name(&retry.endpoint_header) {
        problems.push(format!(
            "retry.endpoint_header {:?} is not a lowercase header name",
            retry.endpoint_header
        ));
    }
}

/// A lowercase header name (what every header knob must be).
pub(crate) fn is_header_name(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

#[cfg(test)]
mod tests {
    use super::*;
    use staleguard_core::verdict::FailurePolicy;

    #[test]
    fn minimal_config_takes_defaults() {
        let c = Config::parse(br#"{"validator_cluster":"sg"}"#).unwrap();
        assert_eq!(c.raw.poll_wait_s, 30);
        assert_eq!(c.raw.reject_status, 503);
        assert_eq!(c.raw.reject_header, "x-staleguard");
        assert_eq!(c.raw.mode, Mode::Enforce);
        assert_eq!(c.raw.policy.failure_policy, FailurePolicy::Open);
        assert!(c.raw.istio);
        assert_eq!(c.authority(), "sg");
        assert_eq!(c.raw.guard, GuardConfig::default());
        assert!(c.raw.guard.enabled);
    }

    #[test]
    fn guard_knobs_parse_and_are_checked() {
        let c = Config::parse(
            br#"{"validator_cluster":"sg","guard":{"max_loss_percent":80,"confirm_ms":5000}}"#,
        )
        .unwrap();
        assert_eq!(c.raw.guard.max_loss_percent, 80);
        assert_eq!(c.raw.guard.confirm_ms, 5_000);
        assert_eq!(c.raw.guard.min_ips, GuardConfig::default().min_ips);
        let err = Config::parse(
            br#"{"validator_cluster":"sg","guard":{"max_loss_percent":0,"min_service_ips":0}}"#,
        )
        .unwrap_err();
        assert!(err.to_string().contains("guard.max_loss_percent"), "{err}");
        assert!(err.to_string().contains("guard.min_service_ips"), "{err}");
        let err =
            Config::parse(br#"{"validator_cluster":"sg","guard":{"enable":false}}"#).unwrap_err();
        assert!(err.to_string().contains("unknown field `enable`"), "{err}");
    }

    #[test]
    fn full_config_parses() {
        let c = Config::parse(
            br#"{"validator_cluster":"sg","validator_authority":"v.sg.svc","token":"abc",
            "poll_wait_s":1,"max_staleness_ms":3000,"tick_ms":100,"lease_ttl_ms":500,
            "backoff_initial_ms":50,"backoff_max_ms":1000,"mode":"audit",
            "reject_status":502,"reject_header":"x-sg","istio":false,
            "policy":{"failure_policy":"closed","terminating":"reject"},
            "clusters":[{"name":"cart","service":"shop/cart"},{"prefix":"pay-","service":"shop/pay"}]}"#,
        )
        .unwrap();
        assert_eq!(c.raw.mode, Mode::Audit);
        assert_eq!(c.raw.clusters.len(), 2);
        assert_eq!(c.authority(), "v.sg.svc");
    }

    #[test]
    fn no_debug_output_of_the_configuration_shows_the_token() {
        let token = "s3cret-token-0123456789abcdef0123";
        let json = format!(r#"{{"validator_cluster":"sg","token":"{token}"}}"#);
        let c = Config::parse(json.as_bytes()).unwrap();
        for shown in [format!("{c:?}"), format!("{c:#?}"), format!("{:?}", c.raw)] {
            assert!(!shown.contains(token), "{shown}");
            assert!(shown.contains("<redacted>"), "{shown}");
        }
        assert_eq!(c.raw.token.as_ref().map(Secret::expose), Some(token));
        // Nor does a refusal: the message names the field, not the value.
        let bad = format!(r#"{{"validator_cluster":"","token":"{token} x"}}"#);
        let err = Config::parse(bad.as_bytes()).unwrap_err();
        for shown in [err.to_string(), format!("{err:?}")] {
            assert!(!shown.contains("s3cret"), "{shown}");
        }
    }

    #[test]
    fn unknown_fields_are_refused() {
        let err = Config::parse(br#"{"validator_cluster":"sg","mdoe":"audit"}"#).unwrap_err();
        assert!(err.to_string().contains("unknown field `mdoe`"), "{err}");
        let err =
            Config::parse(br#"{"validator_cluster":"sg","policy":{"fail":"open"}}"#).unwrap_err();
        assert!(
            err.to_string()
                .contains("policy.fail: unknown field `fail`, expected one of `failure_policy`"),
            "{err}"
        );
    }

    #[test]
    fn every_type_error_and_unknown_field_is_reported_with_its_field() {
        // serde alone stops at the first of these (issue 25).
        let err = Config::parse(
            br#"{"validator_cluster":"sg","poll_wait_s":"30","mode":1,"mdoe":"audit",
            "policy":{"failure_policy":"opn","fail":1},"guard":{"enable":false},
            "clusters":[{"name":"a","service":"shop/a"},{"name":2,"service":"shop/b"},{"name":"c"}],
            "retry":{"methods":["GET",7]},"tick_ms":-1}"#,
        )
        .unwrap_err();
        let ConfigError::Invalid(problems) = err else {
            panic!("expected Invalid, got {err}");
        };
        let all = problems.join("\n");
        for expected in [
            r#"poll_wait_s: invalid type: string "30", expected u32"#,
            "mode: invalid type: integer `1`, expected",
            "mdoe: unknown field `mdoe`, expected one of `validator_cluster`",
            "policy.failure_policy: unknown variant `opn`, expected `open` or `closed`",
            "policy.fail: unknown field `fail`",
            "guard.enable: unknown field `enable`",
            "clusters[1].name: invalid type: integer `2`, expected a string",
            "clusters[2]: missing field `service`",
            "retry.methods[1]: invalid type: integer `7`, expected a string",
            "tick_ms: invalid value: integer `-1`, expected u64",
        ] {
            assert!(all.contains(expected), "no {expected:?} in:\n{all}");
        }
        // And the rule check of the cluster whose `name` was left out.
        assert!(all.contains("clusters[1] needs exactly one"), "{all}");
        assert_eq!(problems.len(), 11, "{all}");
    }

    #[test]
    fn a_missing_or_mistyped_validator_cluster_is_named_once() {
        let err = Config::parse(br#"{"mode":"audit"}"#).unwrap_err();
        assert_eq!(
            err.problems(),
            ["validator_cluster is missing: name the Envoy cluster that reaches the validator"]
        );
        let err = Config::parse(br#"{"validator_cluster":["sg"],"poll_wait_s":0}"#).unwrap_err();
        let problems = err.problems();
        assert_eq!(problems.len(), 2, "{problems:?}");
        assert!(
            problems[0].starts_with("poll_wait_s must be at least 1")
                || problems[1].starts_with("poll_wait_s must be at least 1"),
            "{problems:?}"
        );
        assert!(
            problems
                .iter()
                .any(|p| p.starts_with("validator_cluster: invalid type: sequence")),
            "{problems:?}"
        );
    }

    #[test]
    fn json_that_is_not_an_object_is_named_for_what_it_is() {
        let err = Config::parse(b"[]").unwrap_err();
        assert_eq!(
            err.problems(),
            ["the plugin configuration must be a JSON object, not an array"]
        );
        assert!(matches!(
            Config::parse(b"{"),
            Err(ConfigError::Malformed(_))
        ));
    }

    #[test]
    fn a_mistyped_token_is_named_without_its_value() {
        let err = Config::parse(br#"{"validator_cluster":"sg","token":123456789}"#).unwrap_err();
        assert_eq!(
            err.problems(),
            ["token: must be a string (value not shown)"]
        );
    }

    #[test]
    fn the_fallback_reads_the_failure_policy_of_a_refused_document() {
        let open = Fallback::read(br#"{"mdoe":1}"#);
        assert_eq!(open.failure_policy, FailurePolicy::Open);
        assert_eq!(
            (open.reject_status, open.reject_header.as_str()),
            (503, "x-staleguard")
        );
        let closed = Fallback::read(
            br#"{"policy":{"failure_policy":"closed","fail":1},"reject_status":429,"reject_header":"x-sg"}"#,
        );
        assert_eq!(closed.failure_policy, FailurePolicy::Closed);
        assert_eq!(
            (closed.reject_status, closed.reject_header.as_str()),
            (429, "x-sg")
        );
        assert!(closed.describe().contains("rejects every request with 429"));
        let junk = Fallback::read(b"\xff not json");
        assert_eq!(junk, open);
    }

    #[test]
    fn a_zero_wait_is_refused() {
        let err = Config::parse(br#"{"validator_cluster":"sg","poll_wait_s":0}"#).unwrap_err();
        assert!(
            err.to_string().contains("poll_wait_s must be at least 1"),
            "{err}"
        );
    }

    #[test]
    fn every_problem_is_reported_together() {
        let err = Config::parse(
            br#"{"validator_cluster":"","poll_wait_s":61,"max_staleness_ms":1000,"tick_ms":5,
            "reject_status":99,"reject_header":"X Bad","token":"",
            "clusters":[{"service":"a/b"}]}"#,
        )
        .unwrap_err();
        let ConfigError::Invalid(problems) = err else {
            panic!("expected Invalid, got {err}");
        };
        assert_eq!(problems.len(), 8, "{problems:?}");
    }

    #[test]
    fn retry_is_the_default_where_a_replay_path_is_configured() {
        let plain = Config::parse(br#"{"validator_cluster":"sg"}"#).unwrap();
        assert!(plain.replay().is_none());
        assert_eq!(plain.retry_warning(), None);
        let with_path = Config::parse(br#"{"validator_cluster":"sg","retry":{}}"#).unwrap();
        let retry = with_path.replay().unwrap();
        assert_eq!(retry.twin_suffix, "|staleguard-twin");
        assert_eq!(retry.methods, ["GET", "HEAD", "OPTIONS"]);
        assert_eq!((retry.attempts, retry.hosts_per_attempt), (3, 8));
        let opted_out =
            Config::parse(br#"{"validator_cluster":"sg","retry":{},"on_reject":"reject"}"#)
                .unwrap();
        assert!(opted_out.replay().is_none());
    }

    #[test]
    fn retry_that_cannot_work_says_why() {
        let no_path = Config::parse(br#"{"validator_cluster":"sg","on_reject":"retry"}"#).unwrap();
        assert!(no_path.replay().is_none());
        assert!(no_path.retry_warning().unwrap().contains("no replay path"));
        let audit = Config::parse(
            br#"{"validator_cluster":"sg","on_reject":"retry","retry":{},"mode":"audit"}"#,
        )
        .unwrap();
        assert!(audit.replay().is_none());
        assert!(audit.retry_warning().unwrap().contains("audit"));
        let audit_by_default =
            Config::parse(br#"{"validator_cluster":"sg","retry":{},"mode":"audit"}"#).unwrap();
        assert!(audit_by_default.retry_warning().unwrap().contains("audit"));
        let working = Config::parse(br#"{"validator_cluster":"sg","retry":{}}"#).unwrap();
        assert_eq!(working.retry_warning(), None);
    }

    #[test]
    fn bad_retry_settings_are_reported_together() {
        let err = Config::parse(
            br#"{"validator_cluster":"sg","retry":{"twin_suffix":"","methods":["get","CONNECT"],
            "attempts":0,"hosts_per_attempt":65,"timeout_ms":0,"endpoint_header":"X"}}"#,
        )
        .unwrap_err();
        let ConfigError::Invalid(problems) = err else {
            panic!("expected Invalid, got {err}");
        };
        assert_eq!(problems.len(), 7, "{problems:?}");
        let err =
            Config::parse(br#"{"validator_cluster":"sg","retry":{"atempts":2}}"#).unwrap_err();
        assert!(err.to_string().contains("unknown field `atempts`"), "{err}");
    }

    #[test]
    fn the_token_can_come_from_the_vm_environment() {
        let env = |name: &str| (name == "SG_TOKEN").then(|| "s3cret\n".to_owned());
        let c =
            Config::parse_with_env(br#"{"validator_cluster":"sg","token_env":"SG_TOKEN"}"#, env)
                .unwrap();
        assert_eq!(
            c.raw.token.as_ref().map(Secret::expose),
            Some("s3cret"),
            "a Secret file's newline is cut"
        );

        let err =
            Config::parse_with_env(br#"{"validator_cluster":"sg","token_env":"MISSING"}"#, env)
                .unwrap_err();
        assert!(err.to_string().contains("\"MISSING\" is not set"), "{err}");

        let err = Config::parse_with_env(
            br#"{"validator_cluster":"sg","token":"a","token_env":"SG_TOKEN"}"#,
            env,
        )
        .unwrap_err();
        assert!(err.to_string().contains("not both"), "{err}");

        let empty = |_: &str| Some(String::new());
        let err = Config::parse_with_env(
            br#"{"validator_cluster":"sg","token_env":"SG_TOKEN"}"#,
            empty,
        )
        .unwrap_err();
        assert!(err.to_string().contains("non-empty"), "{err}");
    }

    #[test]
    fn garbage_is_refused() {
        for bad in [
            &b""[..],
            b"null",
            b"[]",
            b"{",
            b"\xff",
            br#"{"validator_cluster":1}"#,
        ] {
            assert!(Config::parse(bad).is_err());
        }
    }
}
