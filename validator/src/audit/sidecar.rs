//! `audit --every`: the audit as a sidecar beside a gateway, repeating and
//! serving its findings as metrics, so an alert fires before traffic is hurt.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use axum::extract::State;

use axum::response::Response;
use axum::routing::get;
use axum::Router;

use super::report::{Exit, Report};
use super::{audit_once, Audit};
use crate::metrics::{AuditFindings, AuditMetrics};

/// Where `--every` serves its metrics unless told otherwise
/// (`--metrics-listen`): loopback, as the validator's own listeners; the
/// sidecar in `deploy/audit` sets `0.0.0.0:9095` for Prometheus.
pub const DEFAULT_METRICS_LISTEN: SocketAddr =
    SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 9095);

/// What the metrics show of a report: stale endpoints by cluster and reason,
/// every endpoint by reason.
pub fn findings(report: &Report) -> AuditFindings {
    let mut stale: BTreeMap<(String, &'static str), u64> = BTreeMap::new();
    let mut by_reason: BTreeMap<&'static str, u64> = BTreeMap::new();
    for cluster in &report.clusters {
        for f in &cluster.findings {
            let reason = f.judgement.reason();
            *by_reason.entry(reason).or_default() += 1;
            if f.judgement.is_stale() {
                *stale.entry((cluster.name.clone(), reason)).or_default() += 1;
            }
        }
    }
    AuditFindings {
        stale: stale.into_iter().map(|((c, r), n)| (c, r, n)).collect(),
        by_reason: by_reason.into_iter().collect(),
    }
}

/// The metrics router: `/metrics` and `/healthz`.
pub fn router(metrics: Arc<AuditMetrics>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/metrics", get(serve_metrics))
        .with_state(metrics)
}

async fn serve_metrics(State(metrics): State<Arc<AuditMetrics>>) -> Response {
    crate::metrics::scrape_answer(metrics.encode())
}

/// Audits every `every` until SIGINT/SIGTERM, serving metrics on `listen`.
pub async fn run(audit: &Audit, every: Duration, listen: SocketAddr) -> std::io::Result<()> {
    let metrics = Arc::new(AuditMetrics::default());
    let listener = tokio::net::TcpListener::bind(listen).await.map_err(|e| {
        std::io::Error::new(
            e.kind(),
            format!("--metrics-listen {listen}: cannot listen there: {e}"),
        )
    })?;
    tracing::info!(
        gateway = %audit.gateway,
        metrics = %listener.local_addr()?,
        every = ?every,
        "auditing continuously"
    );
    let app = router(metrics.clone());
    // Bounded like the validator's admin listener: a scraper that misbehaves
    // cannot hold the audit's descriptors. The sender lives as long as the
    // loop below; dropping it stops the listener.
    let (_serving, stop) = tokio::sync::watch::channel(false);
    let server = tokio::spawn(crate::api::serve_bounded(
        listener,
        app,
        crate::api::ConnectionLimits::ADMIN,
        metrics.connections(),
        "audit",
        stop,
        None,
    ));
    let shutdown = crate::shutdown_signal();
    tokio::pin!(shutdown);
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            _ = tick.tick() => {}
        }
        let started = Instant::now();
        let result = audit_once(audit).await;
        let took = started.elapsed();
        match &result {
            Ok(report) => {
                let exit = report.exit();
                // Data that is not fresh, or clusters that map to no
                // service, judged nothing: keep the last findings rather
                // than report a clean gateway.
                let judged = (!matches!(exit, Exit::NotFresh | Exit::NothingJudged))
                    .then(|| findings(report));
                metrics.record(
                    &audit.gateway,
                    exit.as_str(),
                    took,
                    judged.as_ref(),
                    SystemTime::now(),
                );
                let stale = report.stale();
                if stale > 0 {
                    tracing::warn!(
                        gateway = %audit.gateway,
                        stale,
                        endpoints = report.endpoints(),
                        "the gateway holds stale endpoints"
                    );
                } else if let Some(failure) = report.failure() {
                    tracing::warn!(gateway = %audit.gateway, outcome = exit.as_str(), "{failure}");
                } else {
                    tracing::info!(
                        gateway = %audit.gateway,
                        endpoints = report.endpoints(),
                        outcome = exit.as_str(),
                        "audited"
                    );
                }
            }
            Err(error) => {
                metrics.record(
                    &audit.gateway,
                    error.exit().as_str(),
                    took,
                    None,
                    SystemTime::now(),
                );
                tracing::error!(gateway = %audit.gateway, %error, "audit failed");
            }
        }
    }
    server.abort();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::audit::report::{ClusterReport, Finding, Judgement};
    use staleguard_core::{Action, Freshness, Reason, ServiceKey, Verdict};

    fn finding(reason: Reason, action: Action) -> Finding {
        Finding {
            address: "10.0.0.1:80".into(),
            ip: None,
            judgement: Judgement::Judged(Verdict { reason, action }),
            since_ms: None,
            holders: vec![],
        }
    }

    #[test]
    fn metrics_show_stale_endpoints_by_gateway_cluster_and_reason() {
        let report = Report {
            gateway: "gw-1".into(),
            verdicts_from: "test".into(),
            generation: 1,
            freshness: Freshness {
                fresh: true,
                age_ms: None,
            },
            clusters: vec![ClusterReport {
                name: "outbound|80||cart.shop.svc.cluster.local".into(),
                service: Some(ServiceKey::new("shop", "cart")),
                mapped_by: "default",
                twin_of: None,
                findings: vec![
                    finding(Reason::Destroyed, Action::Reject),
                    finding(Reason::Destroyed, Action::Reject),
                    finding(Reason::Recycled, Action::Reject),
                    finding(Reason::Member, Action::Allow),
                ],
            }],
            notes: vec![],
        };
        let metrics = AuditMetrics::default();
        let at = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
        metrics.record(
            "gw-1",
            "stale",
            Duration::from_millis(250),
            Some(&findings(&report)),
            at,
        );
        let text = metrics.encode().unwrap();
        for line in [
            "staleguard_validator_audit_stale_endpoints{gateway=\"gw-1\",cluster=\"outbound|80||cart.shop.svc.cluster.local\",reason=\"destroyed\"} 2",
            "staleguard_validator_audit_stale_endpoints{gateway=\"gw-1\",cluster=\"outbound|80||cart.shop.svc.cluster.local\",reason=\"recycled\"} 1",
            "staleguard_validator_audit_endpoints{gateway=\"gw-1\",reason=\"member\"} 1",
            "staleguard_validator_audit_runs_total{gateway=\"gw-1\",outcome=\"stale\"} 1",
            "staleguard_validator_audit_run_duration_seconds{gateway=\"gw-1\"} 0.25",
            "staleguard_validator_audit_last_success_timestamp_seconds{gateway=\"gw-1\"} 1000.0",
        ] {
            assert!(text.contains(line), "missing {line}\n{text}");
        }
        // A failed run counts, and leaves the findings; a clean one clears them.
        metrics.record("gw-1", "admin_unreachable", Duration::ZERO, None, at);
        assert!(metrics.encode().unwrap().contains("reason=\"recycled\"} 1"));
        metrics.record(
            "gw-1",
            "clean",
            Duration::ZERO,
            Some(&AuditFindings::default()),
            at,
        );
        let text = metrics.encode().unwrap();
        assert!(
            !text.contains("staleguard_validator_audit_stale_endpoints{"),
            "{text}"
        );
        assert!(text.contains("outcome=\"admin_unreachable\"} 1"), "{text}");
    }
}
