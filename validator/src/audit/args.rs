//! The audit's command line: its flags ([`AuditArgs`]), checked into an
//! [`Audit`] with every problem reported at once.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{ArgGroup, Parser, ValueEnum};
use staleguard_engine::config::ConfigError;

use super::fetch::{self, Client};
use super::gateway::{parse_plugin, PluginConfig};
use super::sidecar;
use super::AuditError;
use crate::config::parse_duration;

/// How the report is printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    /// A table and a summary per cluster.
    Table,
    /// One JSON document.
    Json,
}

/// `staleguard-validator audit` flags.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "staleguard-validator audit",
    about = "Audit a gateway: which endpoints it holds are destroyed or recycled, per the validator",
    after_help = "Exit status: 0 clean, 1 stale endpoints found, 2 bad flags (or a --plugin-config \
the filter would refuse), 3 malformed or truncated admin output, 4 admin port unreachable (or \
dump file unreadable), 5 validator unreachable or refusing (or cluster file unusable), 6 \
validator data not fresh, 7 nothing judged (no endpoint in a cluster that maps to a service). \
See docs/audit.md.",
    group(ArgGroup::new("endpoints").required(true).args(["admin", "config_dump"])),
    group(ArgGroup::new("verdicts").required(true).args(["validator", "cluster_file"]))
)]
pub struct AuditArgs {
    /// The gateway's Envoy admin address (`127.0.0.1:15000` in an Istio
    /// gateway pod): reads `/clusters?format=json` and `/config_dump`.
    #[arg(long, env = "STALEGUARD_AUDIT_ADMIN")]
    pub admin: Option<String>,

    /// A saved `/config_dump?include_eds` file instead of a live admin port.
    #[arg(long)]
    pub config_dump: Option<PathBuf>,

    /// The validator's public address (`https://staleguard-validator.staleguard.svc:8443`
    /// with `--validator-ca-file`; `http://` is plain HTTP).
    #[arg(long, env = "STALEGUARD_AUDIT_VALIDATOR")]
    pub validator: Option<String>,

    /// The CA certificates (PEM) that an `https://` `--validator` is verified
    /// against: the issuer of the validator's `--tls-cert-file`.
    #[arg(long, env = "STALEGUARD_AUDIT_VALIDATOR_CA_FILE")]
    pub validator_ca_file: Option<PathBuf>,

    /// A file holding the validator's bearer token (re-read on every run; its
    /// first non-empty line).
    #[arg(long, env = "STALEGUARD_AUDIT_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,

    /// Judge with a dump of the cluster's Pods, Services and EndpointSlices
    /// (`kubectl get pods,services,endpointslices -A -o yaml`), loaded by the
    /// validator's file source, instead of asking a validator.
    #[arg(long)]
    pub cluster_file: Option<PathBuf>,

    /// The staleguard plugin configuration (JSON) to map clusters with.
    /// [default: the one the gateway's config dump carries, per cluster;
    /// without one, Istio names and metadata]
    #[arg(long)]
    pub plugin_config: Option<PathBuf>,

    /// How the report is printed.
    #[arg(long, value_enum, default_value_t = Output::Table)]
    pub output: Output,

    /// In the table, list only stale endpoints (the summary still counts
    /// every endpoint).
    #[arg(long)]
    pub stale_only: bool,

    /// How long each request may take.
    #[arg(long, default_value = "10s")]
    pub timeout: String,

    /// The gateway's name in the report and the metrics. [default: the admin
    /// address or the dump file's name]
    #[arg(long, env = "STALEGUARD_AUDIT_GATEWAY")]
    pub gateway: Option<String>,

    /// Run continuously: audit every this long and serve the findings as
    /// metrics (`--metrics-listen`) instead of printing and exiting.
    #[arg(long, env = "STALEGUARD_AUDIT_EVERY")]
    pub every: Option<String>,

    /// With `--every`: where `/metrics` and `/healthz` are served.
    #[arg(
        long,
        env = "STALEGUARD_AUDIT_METRICS_LISTEN",
        default_value_t = sidecar::DEFAULT_METRICS_LISTEN.to_string()
    )]
    pub metrics_listen: String,
}

/// Where the gateway's endpoints come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EndpointSource {
    /// A live admin API, `http://host:port`.
    Admin(String),
    /// A saved config dump.
    Dump(PathBuf),
}

/// Where the verdicts come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VerdictSource {
    /// A validator, `http://host:port`, with an optional token file.
    Validator {
        /// The base URL.
        url: String,
        /// The bearer token's file.
        token_file: Option<PathBuf>,
    },
    /// A cluster file, through the file source.
    ClusterFile(PathBuf),
}

/// A checked audit configuration.
#[derive(Debug, Clone)]
pub struct Audit {
    /// The gateway's name.
    pub gateway: String,
    /// Its endpoints.
    pub endpoints: EndpointSource,
    /// The verdicts.
    pub verdicts: VerdictSource,
    /// `--plugin-config`, read.
    pub plugin: Option<PluginConfig>,
    /// The client.
    pub client: Client,
    /// `--every`, `--metrics-listen`.
    pub every: Option<(Duration, SocketAddr)>,
    /// `--output`.
    pub output: Output,
    /// `--stale-only`.
    pub stale_only: bool,
}

impl Audit {
    /// Checks the flags, reporting every problem together.
    pub fn from_args(args: AuditArgs) -> Result<Self, AuditError> {
        let mut problems = Vec::new();
        let timeout = match parse_duration(&args.timeout) {
            Ok(d) if d >= Duration::from_millis(100) => d,
            Ok(_) => {
                problems.push(format!(
                    "--timeout {:?}: must be at least 100ms",
                    args.timeout
                ));
                Duration::from_secs(10)
            }
            Err(e) => {
                problems.push(format!("--timeout {:?}: {e}", args.timeout));
                Duration::from_secs(10)
            }
        };
        let endpoints = match (&args.admin, &args.config_dump) {
            (Some(admin), _) => match fetch::base_url(admin) {
                Ok(url) => EndpointSource::Admin(url),
                Err(e) => {
                    problems.push(format!("--admin: {e}"));
                    EndpointSource::Admin(String::new())
                }
            },
            (None, Some(path)) => EndpointSource::Dump(path.clone()),
            (None, None) => {
                problems.push("one of --admin or --config-dump is required".into());
                EndpointSource::Admin(String::new())
            }
        };
        let verdicts = match (&args.validator, &args.cluster_file) {
            (Some(url), _) => match fetch::validator_url(url) {
                Ok(url) if url.starts_with("https://") && args.validator_ca_file.is_none() => {
                    problems.push(format!(
                        "--validator {url}: https:// needs --validator-ca-file to verify it"
                    ));
                    VerdictSource::ClusterFile(PathBuf::new())
                }
                Ok(url) => VerdictSource::Validator {
                    url,
                    token_file: args.token_file.clone(),
                },
                Err(e) => {
                    problems.push(format!("--validator: {e}"));
                    VerdictSource::ClusterFile(PathBuf::new())
                }
            },
            (None, Some(path)) => {
                if args.token_file.is_some() {
                    problems.push("--token-file only applies to --validator".into());
                }
                VerdictSource::ClusterFile(path.clone())
            }
            (None, None) => {
                problems.push("one of --validator or --cluster-file is required".into());
                VerdictSource::ClusterFile(PathBuf::new())
            }
        };
        let plugin = match &args.plugin_config {
            None => None,
            Some(path) => match std::fs::read_to_string(path) {
                Ok(text) => match parse_plugin(&text).map_err(|e| refusal(&e)) {
                    Ok(p) => Some(p),
                    Err(e) => {
                        problems.push(format!("--plugin-config {}: {e}", path.display()));
                        None
                    }
                },
                Err(e) => {
                    problems.push(format!("--plugin-config {}: {e}", path.display()));
                    None
                }
            },
        };
        let every = match &args.every {
            None => None,
            Some(text) => {
                let every = match parse_duration(text) {
                    Ok(d) if d >= Duration::from_secs(1) => d,
                    Ok(_) => {
                        problems.push(format!("--every {text:?}: must be at least 1s"));
                        Duration::from_secs(30)
                    }
                    Err(e) => {
                        problems.push(format!("--every {text:?}: {e}"));
                        Duration::from_secs(30)
                    }
                };
                match args.metrics_listen.parse::<SocketAddr>() {
                    Ok(listen) => Some((every, listen)),
                    Err(_) => {
                        problems.push(format!(
                            "--metrics-listen {:?}: not an IP:PORT address",
                            args.metrics_listen
                        ));
                        None
                    }
                }
            }
        };
        let gateway = args.gateway.clone().unwrap_or_else(|| match &endpoints {
            EndpointSource::Admin(url) => url.trim_start_matches("http://").to_owned(),
            EndpointSource::Dump(path) => path.file_name().map_or_else(
                || path.display().to_string(),
                |n| n.to_string_lossy().into_owned(),
            ),
        });
        let client = Client::new(timeout, args.validator_ca_file.as_deref())
            .map_err(|e| problems.push(format!("--validator-ca-file {e}")))
            .ok();
        let (true, Some(client)) = (problems.is_empty(), client) else {
            return Err(AuditError::Usage(format!(
                "invalid audit flags:\n  - {}",
                problems.join("\n  - ")
            )));
        };
        Ok(Self {
            gateway,
            endpoints,
            verdicts,
            plugin,
            client,
            every,
            output: args.output,
            stale_only: args.stale_only,
        })
    }
}

/// What the audit says of a plugin configuration the filter refuses.
fn refusal(error: &ConfigError) -> String {
    format!(
        "the filter would refuse it, so the gateway runs unguarded:\n      - {}",
        error.problems().join("\n      - ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::audit::report::Exit;

    fn parse(args: &[&str]) -> Result<Audit, AuditError> {
        let args = AuditArgs::try_parse_from(std::iter::once("audit").chain(args.iter().copied()))
            .map_err(|e| AuditError::Usage(e.to_string()))?;
        Audit::from_args(args)
    }

    #[test]
    fn metrics_listen_defaults_to_loopback() {
        let args = AuditArgs::try_parse_from([
            "audit",
            "--admin",
            "127.0.0.1:15000",
            "--validator",
            "http://127.0.0.1:8080",
        ])
        .unwrap();
        let listen: SocketAddr = args.metrics_listen.parse().unwrap();
        assert!(listen.ip().is_loopback(), "{listen}");
        assert_eq!(listen, "127.0.0.1:9095".parse().unwrap());
    }

    #[test]
    fn an_https_validator_needs_validator_ca_file_to_verify_it() {
        let https = [
            "--admin",
            "127.0.0.1:15000",
            "--validator",
            "https://v.sg.svc:8080",
        ];
        let err = parse(&https).unwrap_err();
        assert_eq!(err.exit(), Exit::Usage);
        assert!(err.to_string().contains("--validator-ca-file"), "{err}");
        let dir = std::env::temp_dir().join(format!("sg-audit-ca-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let empty = dir.join("empty.crt");
        std::fs::write(&empty, "").unwrap();
        let with = |ca: &std::path::Path| {
            let mut argv = https.to_vec();
            argv.extend(["--validator-ca-file", ca.to_str().unwrap()]);
            parse(&argv)
        };
        let err = with(&empty).unwrap_err();
        assert!(
            err.to_string().contains("holds no PEM certificate"),
            "{err}"
        );
        assert!(with(&dir.join("absent.crt")).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_shipped_sidecar_runs_a_valid_continuous_audit() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../deploy/audit/gateway-sidecar.yaml"
        );
        let doc: yaml_serde::Value =
            yaml_serde::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let container = &doc["spec"]["template"]["spec"]["containers"][0];
        let args: Vec<&str> = container["args"]
            .as_sequence()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap())
            .collect();
        assert_eq!(args[0], "audit");
        let audit = parse(&args[1..]).unwrap();
        assert_eq!(
            audit.endpoints,
            EndpointSource::Admin("http://127.0.0.1:15000".into())
        );
        assert!(matches!(
            audit.verdicts,
            VerdictSource::Validator {
                token_file: Some(_),
                ..
            }
        ));
        let (every, listen) = audit.every.unwrap();
        assert_eq!(every, Duration::from_secs(30));
        let port = container["ports"][0]["containerPort"].as_u64().unwrap();
        assert_eq!(u64::from(listen.port()), port);
        let mount = container["volumeMounts"][0]["mountPath"].as_str().unwrap();
        let token = args
            .iter()
            .find_map(|a| a.strip_prefix("--token-file="))
            .unwrap();
        assert!(token.starts_with(mount), "{token} not under {mount}");
    }

    #[test]
    fn a_plugin_config_the_filter_would_refuse_is_a_usage_error_naming_each_problem() {
        let dir = std::env::temp_dir().join(format!("sg-audit-plugin-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join("plugin.json");
        std::fs::write(
            &config,
            r#"{"validator_cluster":"sg","clusters":[{"nmae":"a","service":"shop/a"}],"reject_status":42}"#,
        )
        .unwrap();
        let path = config.to_str().unwrap();
        let args = [
            "--config-dump",
            "d.json",
            "--cluster-file",
            "c.yaml",
            "--plugin-config",
            path,
        ];
        let err = parse(&args).unwrap_err();
        assert_eq!(err.exit(), Exit::Usage);
        let text = err.to_string();
        assert!(text.contains("the filter would refuse it"), "{text}");
        assert!(
            text.contains("clusters[0].nmae: unknown field `nmae`"),
            "{text}"
        );
        assert!(text.contains("reject_status 42 not in 200..=599"), "{text}");
        // token_env names a variable of the gateway's VM, not the audit's.
        std::fs::write(
            &config,
            r#"{"validator_cluster":"sg","token_env":"STALEGUARD_TOKEN"}"#,
        )
        .unwrap();
        let audit = parse(&args).unwrap();
        assert_eq!(audit.plugin.unwrap().validator_cluster, "sg");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn bad_flags_are_reported_together() {
        let err = parse(&[
            "--admin",
            "localhost",
            "--validator",
            "https://v:8080",
            "--timeout",
            "1ms",
            "--every",
            "soon",
        ])
        .unwrap_err();
        let text = err.to_string();
        assert_eq!(err.exit(), Exit::Usage);
        for flag in ["--admin", "--validator", "--timeout", "--every"] {
            assert!(text.contains(flag), "{flag}: {text}");
        }
        let err = parse(&[
            "--config-dump",
            "d.json",
            "--cluster-file",
            "c.yaml",
            "--token-file",
            "t",
        ])
        .unwrap_err();
        assert!(
            err.to_string().contains("--token-file only applies"),
            "{err}"
        );
        assert!(
            parse(&["--admin", "127.0.0.1:1"]).is_err(),
            "a verdict source is required"
        );
    }
}
