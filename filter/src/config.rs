//! The plugin configuration: strict JSON, checked whole in `on_configure`.
//!
//! [`RawConfig`] is what operators write (unknown fields are refused, so a typo
//! never silently falls back to a default); [`Config::parse`] checks it and
//! reports every problem at once, so one reload fixes them all.

use serde::Deserialize;
use staleguard_core::{Policy, ServiceKey};

use crate::secret::Secret;

/// Why a plugin configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// Not JSON, not the expected shape, or an unknown field.
    #[error("plugin configuration is not valid JSON for staleguard: {0}")]
    Malformed(#[source] serde_json::Error),
    /// Parsed, but some values are out of range.
    #[error("plugin configuration refused: {}", .0.join("; "))]
    Invalid(Vec<String>),
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

/// A plain-Envoy mapping rule: a cluster name (exact or prefix) to a service.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterRule {
    /// Exact cluster name.
    #[serde(default)]
    pub name: Option<String>,
    /// Cluster name prefix (used when `name` is absent).
    #[serde(default)]
    pub prefix: Option<String>,
    /// The service the cluster routes to.
    pub service: ServiceKey,
}

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
    #[serde(default = "default_true")]
    pub istio: bool,
    /// Mapping rules for plain Envoy, tried first, in order.
    #[serde(default)]
    pub clusters: Vec<ClusterRule>,
}

fn default_wait_s() -> u32 {
    30
}
fn default_max_staleness_ms() -> u64 {
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
fn default_reject_header() -> String {
    "x-staleguard".to_owned()
}
fn default_true() -> bool {
    true
}

/// A checked configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// The checked fields (same names as written).
    pub raw: RawConfig,
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
        let mut raw: RawConfig = serde_json::from_slice(bytes).map_err(ConfigError::Malformed)?;
        let mut problems = Vec::new();
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
        if raw.validator_cluster.is_empty() {
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
            match (&rule.name, &rule.prefix) {
                (Some(n), None) if !n.is_empty() => {}
                (None, Some(p)) if !p.is_empty() => {}
                _ => problems.push(format!(
                    "clusters[{i}] needs exactly one non-empty `name` or `prefix`"
                )),
            }
        }
        if problems.is_empty() {
            Ok(Self { raw })
        } else {
            Err(ConfigError::Invalid(problems))
        }
    }

    /// The `:authority` of validator requests.
    pub fn authority(&self) -> &str {
        self.raw
            .validator_authority
            .as_deref()
            .unwrap_or(&self.raw.validator_cluster)
    }
}

fn is_header_name(s: &str) -> bool {
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
        assert!(matches!(err, ConfigError::Malformed(_)));
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
