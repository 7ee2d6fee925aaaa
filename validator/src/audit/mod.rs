//! `staleguard-validator audit`: which endpoints a gateway still holds that no
//! longer exist or now belong to another service, with no traffic at all.
//!
//! Where to start: [`audit_once`] reads the gateway ([`gateway`]: the admin
//! API or a saved config dump), resolves each cluster's service with the
//! filter's own rule (`staleguard_core::cluster`), asks for every endpoint's
//! verdict in one request (`POST /v1/verdicts`, or the same
//! [`crate::api::judge_all`] over a cluster file loaded by the file source) and
//! returns a [`report::Report`]. [`run`] checks the flags into an [`Audit`]
//! (`args`), prints the report and picks the exit status; [`sidecar`] repeats
//! it and serves the findings as metrics. docs/audit.md is the operator's page.

mod args;
pub mod fetch;
pub mod gateway;
pub mod report;
pub mod sidecar;

use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use clap::Parser;
use staleguard_core::batch::{Records, VerdictQuery, VerdictsAnswer, VerdictsRequest};
use staleguard_core::Policy;

use self::fetch::FetchError;
use self::gateway::{Gateway, GatewayError, PluginConfig};
use self::report::{ClusterReport, Exit, Finding, Judgement, Report};
use crate::index::{Index, IndexConfig, Kind};
use crate::live::SharedIndex;

pub use self::args::{Audit, AuditArgs, EndpointSource, Output, VerdictSource};

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
        return match sidecar::run(&audit, every, listen).await {
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
    let defaults = PluginConfig::default();
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
            let args = AuditArgs::try_parse_from([
                "audit",
                "--config-dump",
                dump.to_str().unwrap(),
                "--validator",
                &validator.to_string(),
                "--token-file",
                token_file.to_str().unwrap(),
            ])
            .unwrap();
            Audit::from_args(args).unwrap()
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
}
