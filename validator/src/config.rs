//! Configuration from flags and `STALEGUARD_*` environment variables.
//!
//! [`Args`] is what clap parses: values that need checking stay text there, so
//! that [`Config::from_args`] can check them all and report every problem at
//! once instead of the first one.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use staleguard_core::service::is_dns_label;

use crate::api::{ApiConfig, ConnectionLimits, TlsFiles};
use crate::index::IndexConfig;
use crate::scope::{PodScope, Selector};

/// Where the objects come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SourceKind {
    /// A YAML/JSON file or directory of objects (`--file`), re-read when it
    /// changes; without `--file`, the sample built into the binary.
    File,
    /// The Kubernetes API (in-cluster config or KUBECONFIG), list and watch.
    Kube,
}

/// How logs are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Command-line flags (each also readable from the environment variable shown).
#[derive(Debug, Clone, Parser)]
#[command(
    name = "staleguard-validator",
    version,
    about = "Watches Pods, Services and EndpointSlices and keeps a fresh pod IP -> identity index",
    after_help = "Subcommand: `staleguard-validator audit --help` audits a gateway's endpoints (docs/audit.md)."
)]
pub struct Args {
    /// Where objects come from.
    #[arg(long, env = "STALEGUARD_SOURCE", value_enum, default_value_t = SourceKind::File)]
    pub source: SourceKind,

    /// With `--source file`: a YAML or JSON file, or a directory of them, holding
    /// Pods, Services and EndpointSlices (`kubectl get -o yaml` output works).
    /// [default: the demo sample built into the binary]
    #[arg(long, env = "STALEGUARD_FILE")]
    pub file: Option<PathBuf>,

    /// How often `--file` is checked for changes.
    #[arg(long, env = "STALEGUARD_FILE_POLL", default_value = "500ms")]
    pub file_poll: String,

    /// With `--source kube`: watch only this namespace. [default: all namespaces]
    #[arg(long, env = "STALEGUARD_NAMESPACE")]
    pub namespace: Option<String>,

    /// With `--source kube`: a label selector for Pods (e.g. `app in (a,b)`).
    /// A Service whose own selector does not imply it, or that has no
    /// selector, is then out of scope: treated as unknown, since it may have
    /// members the validator does not see (docs/index.md). [default: all pods]
    #[arg(long, env = "STALEGUARD_POD_SELECTOR")]
    pub pod_selector: Option<String>,

    /// With `--source kube`: a label selector for Services and, through their
    /// `kubernetes.io/service-name` label, nothing else. [default: all services]
    #[arg(long, env = "STALEGUARD_SERVICE_SELECTOR")]
    pub service_selector: Option<String>,

    /// With `--source kube`: the API server ends each watch after this long and
    /// the validator renews it from where it was; an accepted renewal is a sign
    /// of life, so a quiet cluster stays fresh. Whole seconds, shorter than
    /// `--max-staleness`. [default: 60s]
    #[arg(long, env = "STALEGUARD_WATCH_TIMEOUT")]
    pub watch_timeout: Option<String>,

    /// How long an IP that lost its last pod keeps a tombstone (`90s`, `10m`,
    /// `1h`).
    #[arg(long, env = "STALEGUARD_TOMBSTONE_TTL", default_value = "10m")]
    pub tombstone_ttl: String,

    /// A watch silent for longer than this (no event, no accepted renewal)
    /// makes the data stale (filters then follow their failure policy).
    #[arg(long, env = "STALEGUARD_MAX_STALENESS", default_value = "5m")]
    pub max_staleness: String,

    /// How many changed IPs and services the change log remembers; a client
    /// further behind gets a full snapshot.
    #[arg(
        long,
        env = "STALEGUARD_CHANGE_LOG_CAPACITY",
        default_value_t = 100_000
    )]
    pub change_log_capacity: usize,

    /// How long `--once` waits for the initial sync before giving up.
    #[arg(long, env = "STALEGUARD_SYNC_TIMEOUT", default_value = "60s")]
    pub sync_timeout: String,

    /// Load the source, wait for the initial sync, print an index summary and
    /// exit.
    #[arg(long)]
    pub once: bool,

    /// Log format.
    #[arg(long, env = "STALEGUARD_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    /// Address of the public API listener (`/v1`). Loopback unless told
    /// otherwise: a validator started by hand serves nobody else (in a cluster,
    /// `deploy/` sets `0.0.0.0:8080` and a token).
    #[arg(long, env = "STALEGUARD_LISTEN", default_value_t = ApiConfig::DEFAULT_LISTEN.to_string())]
    pub listen: String,

    /// Address of the admin listener (`/healthz`, `/readyz`, `/metrics`).
    /// Loopback unless told otherwise.
    #[arg(
        long,
        env = "STALEGUARD_ADMIN_LISTEN",
        default_value_t = ApiConfig::DEFAULT_ADMIN_LISTEN.to_string()
    )]
    pub admin_listen: String,

    /// A file holding the bearer token `/v1` requires (a mounted Secret), re-read
    /// when it changes. [default: `/v1` needs no token]
    #[arg(long, env = "STALEGUARD_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,

    /// PEM certificate chain for TLS on the public listener (a mounted
    /// `kubernetes.io/tls` Secret's `tls.crt`), re-read when it changes. With
    /// `--tls-key-file`. [default: plain HTTP]
    #[arg(long, env = "STALEGUARD_TLS_CERT_FILE", requires = "tls_key_file")]
    pub tls_cert_file: Option<PathBuf>,

    /// PEM private key of `--tls-cert-file` (`tls.key`).
    #[arg(long, env = "STALEGUARD_TLS_KEY_FILE", requires = "tls_cert_file")]
    pub tls_key_file: Option<PathBuf>,

    /// Serve `/v1` as plain HTTP on an address other than loopback. Without
    /// this flag, a `--listen` beyond loopback needs `--tls-cert-file`: in
    /// clear, the token can be read on the path and nothing tells gateways
    /// they talk to the validator.
    #[arg(long, env = "STALEGUARD_ALLOW_PLAINTEXT")]
    pub allow_plaintext: bool,

    /// Serve `/v1` without a token on an address other than loopback. Without
    /// this flag, a `--listen` beyond loopback needs `--token-file`: an open
    /// API lets anyone the network admits read the index and load the
    /// validator.
    #[arg(long, env = "STALEGUARD_ALLOW_NO_TOKEN")]
    pub allow_no_token: bool,

    /// The longest `wait` a long poll may ask for.
    #[arg(long, env = "STALEGUARD_MAX_WAIT", default_value_t = flag(ApiConfig::default().max_wait))]
    pub max_wait: String,

    /// How many long polls may wait at once; more are answered 429.
    #[arg(long, env = "STALEGUARD_MAX_LONG_POLLS", default_value_t = ApiConfig::default().max_long_polls)]
    pub max_long_polls: usize,

    /// How many of the waiting long polls one client (source address) may
    /// hold; more are answered 429. A gateway holds one.
    #[arg(
        long,
        env = "STALEGUARD_MAX_LONG_POLLS_PER_CLIENT",
        default_value_t = ApiConfig::default().max_long_polls_per_client
    )]
    pub max_long_polls_per_client: usize,

    /// How long any request may take on top of its `wait`.
    #[arg(long, env = "STALEGUARD_REQUEST_TIMEOUT", default_value_t = flag(ApiConfig::default().request_timeout))]
    pub request_timeout: String,

    /// How many answers (snapshots, deltas) may be built at once; more wait
    /// their turn. Every reset, whatever its `since`, shares one snapshot build.
    #[arg(long, env = "STALEGUARD_MAX_BUILDS", default_value_t = ApiConfig::default().max_builds)]
    pub max_builds: usize,

    /// How many `POST /v1/verdicts` may be read and judged at once; more wait
    /// their turn (each holds a body of up to 20 MiB while judged).
    #[arg(long, env = "STALEGUARD_MAX_VERDICT_BATCHES", default_value_t = ApiConfig::default().max_verdict_batches)]
    pub max_verdict_batches: usize,

    /// After SIGTERM, how long open connections may take before the process
    /// exits anyway.
    #[arg(long, env = "STALEGUARD_SHUTDOWN_GRACE", default_value_t = flag(ApiConfig::default().shutdown_grace))]
    pub shutdown_grace: String,

    /// Connections the public listener holds at once; more are closed as soon
    /// as accepted. Lowered at start, with a warning, when the open file limit
    /// has no room for it beside the admin listener's 128.
    #[arg(long, env = "STALEGUARD_MAX_CONNECTIONS", default_value_t = ConnectionLimits::API.max_connections)]
    pub max_connections: usize,

    /// Connections the public listener holds at once from one source address.
    #[arg(
        long,
        env = "STALEGUARD_MAX_CONNECTIONS_PER_SOURCE",
        default_value_t = ConnectionLimits::API.max_per_source
    )]
    pub max_connections_per_source: usize,

    /// Time a client has to send a complete request head, on a new connection
    /// or between two requests of a kept-alive one (both listeners).
    #[arg(long, env = "STALEGUARD_HEADER_READ_TIMEOUT", default_value_t = flag(ConnectionLimits::API.header_read_timeout))]
    pub header_read_timeout: String,

    /// A connection on which no byte moved for this long while no request of
    /// it is being handled is closed (both listeners).
    #[arg(long, env = "STALEGUARD_IDLE_TIMEOUT", default_value_t = flag(ConnectionLimits::API.idle_timeout))]
    pub idle_timeout: String,
}

/// Where objects come from, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceConfig {
    /// A file or directory, polled every `poll`.
    File {
        /// The path.
        path: PathBuf,
        /// How often it is checked for changes.
        poll: Duration,
    },
    /// The sample built into the binary.
    Embedded,
    /// The Kubernetes API.
    Kube {
        /// Only this namespace, if set.
        namespace: Option<String>,
        /// Label selector for Pods.
        pod_selector: Option<String>,
        /// Label selector for Services.
        service_selector: Option<String>,
        /// How long each watch stays open before it is renewed.
        watch_timeout: Duration,
    },
}

/// The validator's configuration, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Where objects come from.
    pub source: SourceConfig,
    /// The index's own settings.
    pub index: IndexConfig,
    /// A watch silent for longer than this makes the data stale.
    pub max_staleness: Duration,
    /// How long `--once` waits for the initial sync.
    pub sync_timeout: Duration,
    /// Print a summary and exit.
    pub once: bool,
    /// Log format.
    pub log_format: LogFormat,
    /// How the API is served.
    pub api: ApiConfig,
}

/// Every problem found in the configuration.
#[derive(Debug, thiserror::Error)]
#[error("invalid configuration:\n  - {}", .problems.join("\n  - "))]
pub struct ConfigError {
    /// One line per problem.
    pub problems: Vec<String>,
}

impl Config {
    /// Checks `args`, collecting every problem.
    pub fn from_args(args: Args) -> Result<Self, ConfigError> {
        let mut problems = Vec::new();
        let mut duration = |flag: &str, text: &str, min: Duration| match parse_duration(text) {
            Ok(d) if d >= min => d,
            Ok(_) => {
                problems.push(format!("--{flag} {text:?}: must be at least {min:?}"));
                min
            }
            Err(e) => {
                problems.push(format!("--{flag} {text:?}: {e}"));
                min
            }
        };
        let file_poll = duration("file-poll", &args.file_poll, Duration::from_millis(10));
        let tombstone_ttl = duration("tombstone-ttl", &args.tombstone_ttl, Duration::ZERO);
        let max_staleness = duration("max-staleness", &args.max_staleness, Duration::from_secs(1));
        let sync_timeout = duration("sync-timeout", &args.sync_timeout, Duration::ZERO);
        let max_wait = duration("max-wait", &args.max_wait, Duration::ZERO);
        let request_timeout = duration(
            "request-timeout",
            &args.request_timeout,
            Duration::from_millis(100),
        );
        let shutdown_grace = duration("shutdown-grace", &args.shutdown_grace, Duration::ZERO);
        let header_read_timeout = duration(
            "header-read-timeout",
            &args.header_read_timeout,
            Duration::from_millis(100),
        );
        let idle_timeout = duration(
            "idle-timeout",
            &args.idle_timeout,
            Duration::from_millis(100),
        );
        let mut address = |flag: &str, text: &str| match text.parse::<SocketAddr>() {
            Ok(addr) => Some(addr),
            Err(_) => {
                problems.push(format!("--{flag} {text:?}: not an IP:PORT address"));
                None
            }
        };
        let listen = address("listen", &args.listen);
        let admin_listen = address("admin-listen", &args.admin_listen);
        if let Some(listen) = listen.filter(|l| !l.ip().is_loopback()) {
            if args.token_file.is_none() && !args.allow_no_token {
                problems.push(format!(
                    "--listen {listen}: serves /v1 beyond this machine without a token; give \
                     --token-file, or --allow-no-token to choose an open API"
                ));
            }
            if args.tls_cert_file.is_none() && !args.allow_plaintext {
                problems.push(format!(
                    "--listen {listen}: serves /v1 beyond this machine in clear; give \
                     --tls-cert-file and --tls-key-file, or --allow-plaintext to choose plain HTTP"
                ));
            }
        }
        if args.max_long_polls == 0 {
            problems.push("--max-long-polls: must be at least 1".into());
        }
        if args.change_log_capacity == 0 {
            problems.push("--change-log-capacity: must be at least 1".into());
        }
        if args.max_long_polls_per_client == 0 {
            problems.push("--max-long-polls-per-client: must be at least 1".into());
        }
        if args.max_builds == 0 {
            problems.push("--max-builds: must be at least 1".into());
        }
        if args.max_verdict_batches == 0 {
            problems.push("--max-verdict-batches: must be at least 1".into());
        }
        if args.max_connections == 0 {
            problems.push("--max-connections: must be at least 1".into());
        }
        if args.max_connections_per_source == 0 {
            problems.push("--max-connections-per-source: must be at least 1".into());
        }
        let mut scope = PodScope::default();
        let source = match args.source {
            SourceKind::File => {
                for (flag, set) in [
                    ("namespace", args.namespace.is_some()),
                    ("pod-selector", args.pod_selector.is_some()),
                    ("service-selector", args.service_selector.is_some()),
                    ("watch-timeout", args.watch_timeout.is_some()),
                ] {
                    if set {
                        problems.push(format!("--{flag} only applies to --source kube"));
                    }
                }
                match args.file {
                    Some(path) => SourceConfig::File {
                        path,
                        poll: file_poll,
                    },
                    None => SourceConfig::Embedded,
                }
            }
            SourceKind::Kube => {
                if args.file.is_some() {
                    problems.push("--file only applies to --source file".into());
                }
                if let Some(ns) = &args.namespace {
                    if !is_dns_label(ns) {
                        problems.push(format!(
                            "--namespace {ns:?}: not a namespace name (lowercase letters, digits, '-')"
                        ));
                    }
                }
                // Checked by the parser --pod-selector uses: the API server
                // has the last word, but a typo fails at start-up, not as a
                // watch error loop.
                if let Some(sel) = &args.service_selector {
                    if let Err(e) = Selector::parse(sel) {
                        problems.push(format!("--service-selector {sel:?}: {e}"));
                    }
                }
                // Parsed, not only checked: which services the index may
                // judge depends on it.
                scope.namespace = args.namespace.clone();
                if let Some(sel) = &args.pod_selector {
                    match Selector::parse(sel) {
                        Ok(s) => scope.pod_selector = Some(s),
                        Err(e) => problems.push(format!("--pod-selector {sel:?}: {e}")),
                    }
                }
                let text = args.watch_timeout.as_deref().unwrap_or("60s");
                let watch_timeout = match parse_duration(text) {
                    Ok(d) if d < Duration::from_secs(1) || d.subsec_nanos() != 0 => {
                        problems.push(format!(
                            "--watch-timeout {text:?}: must be a whole number of seconds, at least 1s"
                        ));
                        d
                    }
                    Ok(d) if d >= max_staleness => {
                        problems.push(format!(
                            "--watch-timeout {text:?}: must be shorter than --max-staleness \
                             ({:?}), or a quiet cluster reads stale between renewals",
                            max_staleness
                        ));
                        d
                    }
                    Ok(d) => d,
                    Err(e) => {
                        problems.push(format!("--watch-timeout {text:?}: {e}"));
                        Duration::from_secs(60)
                    }
                };
                SourceConfig::Kube {
                    namespace: args.namespace,
                    pod_selector: args.pod_selector,
                    service_selector: args.service_selector,
                    watch_timeout,
                }
            }
        };
        let (Some(listen), Some(admin_listen), true) = (listen, admin_listen, problems.is_empty())
        else {
            return Err(ConfigError { problems });
        };
        Ok(Self {
            source,
            index: IndexConfig {
                tombstone_ttl,
                change_log_capacity: args.change_log_capacity,
                scope,
            },
            max_staleness,
            sync_timeout,
            once: args.once,
            log_format: args.log_format,
            api: ApiConfig {
                listen,
                admin_listen,
                token_file: args.token_file,
                max_wait,
                max_long_polls: args.max_long_polls,
                max_long_polls_per_client: args.max_long_polls_per_client,
                request_timeout,
                max_builds: args.max_builds,
                max_verdict_batches: args.max_verdict_batches,
                shutdown_grace,
                connections: ConnectionLimits {
                    header_read_timeout,
                    idle_timeout,
                    max_connections: args.max_connections,
                    max_per_source: args.max_connections_per_source,
                },
                admin_connections: ConnectionLimits {
                    header_read_timeout,
                    idle_timeout,
                    ..ConnectionLimits::ADMIN
                },
                tls: args
                    .tls_cert_file
                    .zip(args.tls_key_file)
                    .map(|(cert, key)| TlsFiles { cert, key }),
            },
        })
    }
}

/// `d` as a flag's default is shown and parsed (`1m`, `10s`, `500ms`).
fn flag(d: Duration) -> String {
    humantime::format_duration(d).to_string()
}

/// Parses a duration such as `500ms`, `1.5s`, `10m`, `1h` or `1m30s` (humantime's
/// syntax: numbers with a unit each, summed). A bare number has no unit and is
/// refused rather than guessed.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    if text.is_empty() {
        return Err("empty duration (use e.g. 500ms, 30s, 10m, 1h)".into());
    }
    humantime::parse_duration(text).map_err(|e| format!("{e} (use e.g. 500ms, 30s, 10m, 1h)"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Config, ConfigError> {
        let mut argv = vec!["staleguard-validator"];
        argv.extend_from_slice(args);
        Config::from_args(Args::try_parse_from(argv).unwrap())
    }

    #[test]
    fn defaults_use_the_embedded_sample() {
        let c = parse(&[]).unwrap();
        assert_eq!(c.source, SourceConfig::Embedded);
        assert_eq!(c.api.token_file, None);
        assert_eq!(c.index.tombstone_ttl, Duration::from_secs(600));
        assert_eq!(c.max_staleness, Duration::from_secs(300));
        assert!(!c.once);
    }

    #[test]
    fn no_flags_serve_on_loopback_only() {
        let c = parse(&[]).unwrap();
        assert!(c.api.listen.ip().is_loopback(), "{}", c.api.listen);
        assert!(
            c.api.admin_listen.ip().is_loopback(),
            "{}",
            c.api.admin_listen
        );
        assert_eq!(c.api.listen, "127.0.0.1:8080".parse().unwrap());
        assert_eq!(c.api.admin_listen, "127.0.0.1:9090".parse().unwrap());
    }

    #[test]
    fn api_config_default_is_what_no_flags_give() {
        assert_eq!(parse(&[]).unwrap().api, ApiConfig::default());
    }

    #[test]
    fn a_listen_beyond_loopback_needs_a_token_file_or_allow_no_token() {
        let tls = ["--tls-cert-file", "/c", "--tls-key-file", "/k"];
        let with = |args: &[&str]| {
            let mut all = vec!["--listen", "0.0.0.0:8080"];
            all.extend_from_slice(args);
            parse(&all)
        };
        let err = with(&tls).unwrap_err();
        assert_eq!(err.problems.len(), 1, "{err}");
        assert!(err.to_string().contains("--allow-no-token"), "{err}");
        assert!(with(&[&tls[..], &["--allow-no-token"]].concat()).is_ok());
        assert!(with(&[&tls[..], &["--token-file", "/t"]].concat()).is_ok());
        assert!(parse(&["--listen", "127.0.0.2:8080"]).is_ok());
        assert!(parse(&["--listen", "[::1]:8080"]).is_ok());
    }

    #[test]
    fn a_listen_beyond_loopback_needs_tls_or_allow_plaintext() {
        let err = parse(&["--listen", "0.0.0.0:8080", "--token-file", "/t"]).unwrap_err();
        assert_eq!(err.problems.len(), 1, "{err}");
        assert!(err.to_string().contains("--allow-plaintext"), "{err}");
        let c = parse(&[
            "--listen",
            "0.0.0.0:8080",
            "--token-file",
            "/t",
            "--tls-cert-file",
            "/tls/tls.crt",
            "--tls-key-file",
            "/tls/tls.key",
        ])
        .unwrap();
        assert_eq!(
            c.api.tls.map(|t| (t.cert, t.key)),
            Some(("/tls/tls.crt".into(), "/tls/tls.key".into()))
        );
        let plain = ["--listen", "0.0.0.0:8080", "--token-file", "/t"];
        assert!(parse(&[&plain[..], &["--allow-plaintext"]].concat()).is_ok());
        // A key without its certificate is a usage error.
        let mut argv = vec!["staleguard-validator", "--tls-key-file", "/k"];
        assert!(Args::try_parse_from(&argv).is_err());
        argv.extend(["--tls-cert-file", "/c"]);
        assert!(Args::try_parse_from(&argv).is_ok());
    }

    #[test]
    fn durations_parse_in_common_units() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("2h"), Ok(Duration::from_secs(7200)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        for bad in ["", "10", "ms", "10x", "-1s", "1s garbage"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn every_problem_is_reported_at_once() {
        let err = parse(&[
            "--tombstone-ttl",
            "ten minutes",
            "--max-staleness",
            "0s",
            "--namespace",
            "Shop",
            "--change-log-capacity",
            "0",
        ])
        .unwrap_err();
        assert_eq!(err.problems.len(), 4, "{err}");
        let text = err.to_string();
        assert!(text.contains("--tombstone-ttl"), "{text}");
        assert!(text.contains("--max-staleness"), "{text}");
        assert!(text.contains("--namespace only applies"), "{text}");
        let err = parse(&[
            "--source",
            "kube",
            "--namespace",
            "Shop",
            "--pod-selector",
            "a in (",
        ])
        .unwrap_err();
        assert_eq!(err.problems.len(), 2, "{err}");
    }

    #[test]
    fn api_flags_are_checked_with_the_rest() {
        let c = parse(&["--listen", "127.0.0.1:18080", "--max-wait", "30s"]).unwrap();
        assert_eq!(c.api.listen, "127.0.0.1:18080".parse().unwrap());
        assert_eq!(c.api.admin_listen, "127.0.0.1:9090".parse().unwrap());
        assert_eq!(c.api.max_wait, Duration::from_secs(30));
        assert_eq!(c.api.shutdown_grace, Duration::from_secs(10));
        let err = parse(&[
            "--listen",
            "localhost",
            "--admin-listen",
            "1.2.3.4:99999",
            "--max-wait",
            "soon",
            "--max-long-polls",
            "0",
        ])
        .unwrap_err();
        assert_eq!(err.problems.len(), 4, "{err}");
    }

    #[test]
    fn watch_timeout_is_whole_seconds_under_the_staleness_bound() {
        let c = parse(&["--source", "kube"]).unwrap();
        let SourceConfig::Kube { watch_timeout, .. } = c.source else {
            panic!("{:?}", c.source)
        };
        assert_eq!(watch_timeout, Duration::from_secs(60));
        let c = parse(&["--source", "kube", "--watch-timeout", "2m"]).unwrap();
        assert!(matches!(
            c.source,
            SourceConfig::Kube { watch_timeout, .. } if watch_timeout == Duration::from_secs(120)
        ));
        for (bad, says) in [
            ("500ms", "whole number of seconds"),
            ("1500ms", "whole number of seconds"),
            ("5m", "shorter than --max-staleness"),
            ("soon", "--watch-timeout \"soon\""),
        ] {
            let err = parse(&["--source", "kube", "--watch-timeout", bad]).unwrap_err();
            assert_eq!(err.problems.len(), 1, "{err}");
            assert!(err.to_string().contains(says), "{bad}: {err}");
        }
        let err = parse(&["--watch-timeout", "30s"]).unwrap_err();
        assert!(
            err.to_string().contains("--watch-timeout only applies"),
            "{err}"
        );
    }

    #[test]
    fn the_pod_scope_reaches_the_index() {
        let c = parse(&[
            "--source",
            "kube",
            "--namespace",
            "shop",
            "--pod-selector",
            "app in (cart,pay)",
        ])
        .unwrap();
        assert_eq!(c.index.scope.namespace.as_deref(), Some("shop"));
        assert_eq!(
            c.index.scope.pod_selector.map(|s| s.to_string()),
            Some("app in (cart,pay)".to_owned())
        );
        assert!(parse(&[]).unwrap().index.scope.is_whole_cluster());
        let err = parse(&["--source", "kube", "--pod-selector", "app is cart"]).unwrap_err();
        assert!(err.to_string().contains("--pod-selector"), "{err}");
    }

    #[test]
    fn help_shows_every_default() {
        use clap::CommandFactory;
        let help = Args::command().render_long_help().to_string();
        for default in [
            "[default: file]",
            "[default: 500ms]",
            "[default: 10m]",
            "[default: 5m]",
            "[default: 60s]",
        ] {
            assert!(help.contains(default), "{default} missing from:\n{help}");
        }
        assert!(help.contains("STALEGUARD_TOMBSTONE_TTL"));
    }
}
