//! `staleguard-validator audit`: which endpoints a gateway still holds that no
//! longer exist or now belong to another service, with no traffic at all.
//!
//! Where to start: [`audit_once`] reads the gateway ([`gateway`]: the admin
//! API or a saved config dump), resolves each cluster's service with the
//! filter's own rule (`staleguard_core::cluster`), asks for every endpoint's
//! verdict in one request (`POST /v1/verdicts`, or the same
//! [`crate::api::judge_all`] over a cluster file loaded by the file source) and
//! returns a [`report::Report`]. [`run`] prints it and picks the exit status;
//! [`watch`] repeats it and serves the findings as metrics. docs/audit.md is
//! the operator's page.

pub mod fetch;
pub mod gateway;
pub mod report;
pub mod watch;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use clap::{ArgGroup, Parser, ValueEnum};
use staleguard_core::batch::{Records, VerdictQuery, VerdictsAnswer, VerdictsRequest};
use staleguard_core::Policy;

use self::fetch::{Client, FetchError};
use self::gateway::{Gateway, GatewayError, PluginView};
use self::report::{ClusterReport, Exit, Finding, Judgement, Report};
use crate::config::parse_duration;
use crate::index::{Index, IndexConfig, Kind};
use crate::shared::SharedIndex;

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
        default_value = "0.0.0.0:9095"
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
    pub plugin: Option<PluginView>,
    /// The client.
    pub client: Client,
    /// `--every`, `--metrics-listen`.
    pub every: Option<(Duration, SocketAddr)>,
    /// `--output`.
    pub output: Output,
    /// `--stale-only`.
    pub stale_only: bool,
}

/// Why an audit could not finish.
#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    /// Bad flags or configuration.
    #[error("{0}")]
    Usage(String),
    /// The gateway's output is malformed or truncated.
    #[error("gateway admin output is malformed or truncated: {0}")]
    AdminMalformed(String),
    /// The gateway could not be read at all.
    #[error("gateway admin is unreachable: {0}")]
    AdminUnreachable(String),
    /// The `--config-dump` file could not be read (same exit status as an
    /// unreachable admin port: no endpoints to audit).
    #[error("cannot read the config dump {0}")]
    DumpUnreadable(String),
    /// No verdicts: the validator is unreachable, refused or answered nonsense.
    #[error("cannot get verdicts: {0}")]
    Validator(String),
}

impl AuditError {
    /// The exit status.
    pub fn exit(&self) -> Exit {
        match self {
            AuditError::Usage(_) => Exit::Usage,
            AuditError::AdminMalformed(_) => Exit::AdminMalformed,
            AuditError::AdminUnreachable(_) | AuditError::DumpUnreadable(_) => {
                Exit::AdminUnreachable
            }
            AuditError::Validator(_) => Exit::Validator,
        }
    }
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
                Ok(text) => match refusal(&text)
                    .map_or_else(|| PluginView::parse(&text).map_err(|e| e.to_string()), Err)
                {
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

/// Why the filter would refuse the plugin configuration `text`, if it would:
/// the filter's own parser, so the audit maps clusters only by what a gateway
/// runs. The Wasm VM's environment is not the audit's, so `token_env` counts
/// as set.
fn refusal(text: &str) -> Option<String> {
    let env = |_: &str| Some("set-in-the-gateway".to_owned());
    staleguard_engine::config::Config::parse_with_env(text.as_bytes(), env)
        .err()
        .map(|e| {
            format!(
                "the filter would refuse it, so the gateway runs unguarded:\n      - {}",
                e.problems().join("\n      - ")
            )
        })
}

/// Runs `staleguard-validator audit` with `argv` (after `audit`); returns the
/// exit code.
pub async fn run(argv: impl IntoIterator<Item = String>) -> i32 {
    let args = match AuditArgs::try_parse_from(
        std::iter::once("staleguard-validator audit".to_owned()).chain(argv),
    ) {
        Ok(args) => args,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() {
                Exit::Usage.code()
            } else {
                0
            };
        }
    };
    let audit = match Audit::from_args(args) {
        Ok(audit) => audit,
        Err(e) => {
            eprintln!("staleguard-validator audit: {e}");
            return e.exit().code();
        }
    };
    if let Some((every, listen)) = audit.every {
        return match watch::run(&audit, every, listen).await {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("staleguard-validator audit: {e}");
                Exit::Usage.code()
            }
        };
    }
    match audit_once(&audit).await {
        Ok(report) => {
            match audit.output {
                Output::Table => print!("{}", report.table(now_ms(), audit.stale_only)),
                Output::Json => println!("{:#}", report.to_json()),
            }
            if let Some(failure) = report.failure() {
                eprintln!("staleguard-validator audit: {failure}");
            }
            report.exit().code()
        }
        Err(e) => {
            if audit.output == Output::Json {
                println!(
                    "{:#}",
                    serde_json::json!({
                        "gateway": audit.gateway,
                        "error": {"kind": e.exit().as_str(), "message": e.to_string()},
                        "exit_status": e.exit().code(),
                    })
                );
            }
            eprintln!("staleguard-validator audit: {e}");
            e.exit().code()
        }
    }
}

/// One audit: the gateway's endpoints, their services, their verdicts.
pub async fn audit_once(audit: &Audit) -> Result<Report, AuditError> {
    let gateway = read_gateway(audit).await?;
    let defaults = PluginView::default();
    let forced = audit.plugin.as_ref();
    // Resolve every cluster, and list what to ask about.
    let mut clusters = Vec::new();
    let mut queries = Vec::new();
    let twins = gateway.twins(forced, &defaults);
    for cluster in &gateway.clusters {
        let plugin = gateway.plugin_for(cluster, forced, &defaults);
        let twin_of = twins.get(&cluster.name).cloned();
        // A twin's endpoints are its cluster's, judged there.
        let service = match twin_of {
            Some(_) => None,
            None => gateway.service_of(cluster, forced, &defaults),
        };
        let mapped_by = gateway.plugin_source(cluster, forced);
        let policy = (plugin.policy != Policy::default()).then_some(plugin.policy);
        let mut pending = Vec::new();
        for endpoint in &cluster.endpoints {
            let slot = match (&service, endpoint.ip) {
                (None, _) if twin_of.is_some() => Err(Judgement::Twin),
                (None, _) => Err(Judgement::Unmapped),
                (Some(_), None) => Err(Judgement::NoAddress),
                (Some(_), Some(ip)) if !plugin.in_scope(ip) => Err(Judgement::OutOfScope),
                (Some(service), Some(ip)) => {
                    queries.push(VerdictQuery {
                        service: service.clone(),
                        ip,
                        policy,
                    });
                    Ok(queries.len() - 1)
                }
            };
            pending.push((endpoint, slot));
        }
        clusters.push((cluster, service, mapped_by, twin_of, pending));
    }
    let request = VerdictsRequest {
        policy: Policy::default(),
        // Who holds a member's IP is no finding; leaving those records out
        // keeps the answer for a large, mostly healthy gateway small.
        records: Records::NotMember,
        items: queries,
    };
    let (answer, verdicts_from) = verdicts(audit, &request).await?;
    if answer.items.len() != request.items.len() {
        return Err(AuditError::Validator(format!(
            "asked for {} verdicts, got {}",
            request.items.len(),
            answer.items.len()
        )));
    }
    let clusters = clusters
        .into_iter()
        .map(|(cluster, service, mapped_by, twin_of, pending)| {
            let mut findings: Vec<Finding> = pending
                .into_iter()
                .map(|(endpoint, slot)| match slot {
                    Ok(i) => {
                        let item = &answer.items[i];
                        Finding::judged(
                            endpoint.address.clone(),
                            item.ip,
                            item.verdict,
                            item.record.as_ref(),
                        )
                    }
                    Err(judgement) => Finding {
                        address: endpoint.address.clone(),
                        ip: endpoint.ip,
                        judgement,
                        since_ms: None,
                        holders: Vec::new(),
                    },
                })
                .collect();
            // By IP, numerically: 10.0.0.9 before 10.0.0.10.
            findings.sort_by(|a, b| (a.ip, &a.address).cmp(&(b.ip, &b.address)));
            ClusterReport {
                name: cluster.name.clone(),
                service,
                mapped_by,
                twin_of,
                findings,
            }
        })
        .collect();
    Ok(Report {
        gateway: audit.gateway.clone(),
        verdicts_from,
        generation: answer.generation,
        freshness: answer.freshness,
        clusters,
        notes: gateway
            .notes
            .iter()
            .cloned()
            .chain(drifted_twins(&gateway, &twins))
            .collect(),
    })
}

/// A note for each retry twin whose settings are no longer its cluster's (a
/// DestinationRule changed after `deploy/istio/twins.py` ran): replays then
/// go out with the old pool, TLS or timeout settings.
fn drifted_twins(
    gateway: &Gateway,
    twins: &std::collections::HashMap<String, String>,
) -> Vec<String> {
    let settings = |name: &str| {
        gateway
            .clusters
            .iter()
            .find(|c| c.name == name)
            .and_then(|c| c.settings.as_ref())
    };
    let mut notes: Vec<String> = twins
        .iter()
        .filter_map(|(twin, guarded)| {
            let drift = gateway::twin_drift(settings(twin)?, settings(guarded)?);
            (!drift.is_empty()).then(|| {
                format!(
                    "retry twin {twin} has drifted from {guarded} ({}): re-run deploy/istio/twins.py",
                    drift.join(", ")
                )
            })
        })
        .collect();
    notes.sort();
    notes
}

async fn read_gateway(audit: &Audit) -> Result<Gateway, AuditError> {
    let admin_error = |e: FetchError| match e {
        FetchError::Unreachable { .. } => AuditError::AdminUnreachable(e.to_string()),
        FetchError::Truncated { .. } | FetchError::Status { .. } => {
            AuditError::AdminMalformed(e.to_string())
        }
    };
    let malformed = |e: GatewayError| AuditError::AdminMalformed(e.to_string());
    match &audit.endpoints {
        EndpointSource::Admin(base) => {
            let live = audit
                .client
                .get(&format!("{base}/clusters?format=json"))
                .await
                .map_err(admin_error)?;
            let live = gateway::parse_clusters(&live).map_err(malformed)?;
            let dump = audit
                .client
                .get(&format!("{base}/config_dump"))
                .await
                .map_err(admin_error)?;
            let config = gateway::parse_config_dump(&dump, "/config_dump").map_err(malformed)?;
            Ok(gateway::merge(config, live))
        }
        EndpointSource::Dump(path) => {
            let bytes = read_file(path.clone())
                .await
                .map_err(|e| AuditError::DumpUnreadable(format!("{}: {e}", path.display())))?;
            gateway::parse_config_dump(&bytes, &path.display().to_string()).map_err(malformed)
        }
    }
}

async fn verdicts(
    audit: &Audit,
    request: &VerdictsRequest,
) -> Result<(VerdictsAnswer, String), AuditError> {
    match &audit.verdicts {
        VerdictSource::Validator { url, token_file } => {
            let token = match token_file {
                None => None,
                Some(path) => {
                    let bytes = read_file(path.clone()).await.map_err(|e| {
                        AuditError::Usage(format!(
                            "cannot read --token-file {}: {e}",
                            path.display()
                        ))
                    })?;
                    // The first token, should the file be the validator's own
                    // (one token per line while rotating).
                    let text = String::from_utf8_lossy(&bytes);
                    let token = text
                        .lines()
                        .map(str::trim)
                        .find(|l| !l.is_empty())
                        .unwrap_or("")
                        .to_owned();
                    if token.is_empty() {
                        return Err(AuditError::Usage(format!(
                            "--token-file {} is empty",
                            path.display()
                        )));
                    }
                    Some(token)
                }
            };
            let body = serde_json::to_vec(request)
                .map_err(|e| AuditError::Validator(format!("cannot encode the request: {e}")))?;
            let bytes = audit
                .client
                .post_json(&format!("{url}/v1/verdicts?v=1"), body, token.as_deref())
                .await
                .map_err(|e| AuditError::Validator(e.to_string()))?;
            let answer: VerdictsAnswer = serde_json::from_slice(&bytes).map_err(|e| {
                AuditError::Validator(format!("{url}/v1/verdicts: not a verdicts answer: {e}"))
            })?;
            Ok((answer, url.clone()))
        }
        VerdictSource::ClusterFile(path) => {
            let path2 = path.clone();
            let objects = tokio::task::spawn_blocking(move || crate::source::file::load(&path2))
                .await
                .map_err(|e| AuditError::Validator(e.to_string()))?
                .map_err(|e| AuditError::Validator(e.to_string()))?;
            let shared = cluster_file_index(objects);
            let answer = crate::api::judge_all(&shared, request);
            Ok((answer, format!("cluster file {}", path.display())))
        }
    }
}

/// An index holding one load of a cluster file: synced and fresh, as the file
/// is the truth at one moment.
fn cluster_file_index(objects: crate::source::file::Objects) -> SharedIndex {
    let shared = SharedIndex::new(
        Index::new(0, IndexConfig::default()),
        Duration::from_secs(3600),
    );
    crate::source::file::feed(&shared, objects, SystemTime::now());
    for kind in Kind::ALL {
        shared.heard(kind);
    }
    shared
}

async fn read_file(path: PathBuf) -> std::io::Result<Vec<u8>> {
    tokio::fs::read(&path).await
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Whether `argv` (without the program name) asks for the audit.
pub fn wants_audit(first: Option<&str>) -> bool {
    first == Some("audit")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_twin_whose_settings_drifted_from_its_cluster_is_a_note() {
        let cluster = |name: &str, timeout: &str| gateway::Cluster {
            name: name.into(),
            settings: Some(serde_json::json!({"connect_timeout": timeout})),
            ..gateway::Cluster::default()
        };
        let twins =
            std::collections::HashMap::from([("c|staleguard-twin".to_owned(), "c".to_owned())]);
        let current = Gateway {
            clusters: vec![cluster("c", "1s"), cluster("c|staleguard-twin", "1s")],
            ..Gateway::default()
        };
        assert!(drifted_twins(&current, &twins).is_empty());
        let drifted = Gateway {
            clusters: vec![cluster("c", "1s"), cluster("c|staleguard-twin", "2s")],
            ..Gateway::default()
        };
        assert_eq!(
            drifted_twins(&drifted, &twins),
            ["retry twin c|staleguard-twin has drifted from c (connect_timeout): re-run deploy/istio/twins.py"]
        );
    }

    fn parse(args: &[&str]) -> Result<Audit, AuditError> {
        let args = AuditArgs::try_parse_from(std::iter::once("audit").chain(args.iter().copied()))
            .map_err(|e| AuditError::Usage(e.to_string()))?;
        Audit::from_args(args)
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

    #[tokio::test]
    async fn the_token_is_the_first_line_of_its_file_and_a_refusal_is_a_validator_error() {
        let dir = std::env::temp_dir().join(format!("sg-audit-token-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (new, old) = ("n".repeat(40), "o".repeat(40));
        let accepted = dir.join("validator-token");
        std::fs::write(&accepted, format!("{new}\n{old}\n")).unwrap();
        let shared = SharedIndex::new(
            Index::new(1, IndexConfig::default()),
            Duration::from_secs(60),
        );
        crate::source::file::feed(&shared, Default::default(), SystemTime::now());
        let config = crate::api::ApiConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            admin_listen: "127.0.0.1:0".parse().unwrap(),
            token_file: Some(accepted.clone()),
            ..crate::api::ApiConfig::default()
        };
        // As `api::spawn`, with the token.
        let listeners = crate::api::Listeners::bind(&config).await.unwrap();
        let validator = listeners.public_addr().unwrap();
        let (_stop, stopped) = tokio::sync::watch::channel(false);
        let state = crate::api::ApiState::new(
            shared,
            std::sync::Arc::new(crate::metrics::Metrics::new()),
            config.limits(),
            stopped,
        );
        let token = config.token().unwrap();
        assert!(token.is_some());
        tokio::spawn(crate::api::serve(
            listeners,
            state,
            token,
            Duration::ZERO,
            std::future::pending(),
        ));
        let dump = dir.join("dump.json");
        std::fs::write(&dump, r#"{"configs":[]}"#).unwrap();
        let audit_with = |token_file: &std::path::Path| {
            parse(&[
                "--config-dump",
                dump.to_str().unwrap(),
                "--validator",
                &validator.to_string(),
                "--token-file",
                token_file.to_str().unwrap(),
            ])
            .unwrap()
        };
        // The validator's own file, two tokens while rotating: the first is sent.
        let report = audit_once(&audit_with(&accepted)).await.unwrap();
        assert_eq!(report.endpoints(), 0);
        let wrong = dir.join("wrong-token");
        std::fs::write(&wrong, "w".repeat(40)).unwrap();
        let err = audit_once(&audit_with(&wrong)).await.unwrap_err();
        assert_eq!(err.exit(), Exit::Validator, "{err}");
        assert!(err.to_string().contains("401"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
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
