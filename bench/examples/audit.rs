//! Audit benchmark: a gateway with many clusters, judged in one
//! `POST /v1/verdicts`, against the naive way (one `GET /v1/verdict` per
//! endpoint), over loopback HTTP against a real validator API.
//!
//! `cargo run --release -p staleguard-bench --example audit` (options through the
//! environment: `CLUSTERS` (1000), `ENDPOINTS` (20 per cluster), `STALE`
//! (every `STALE`th endpoint's pod is gone, 10), `ROUNDS` (5)). The validator
//! API and a fake Envoy admin port serving a synthetic `/clusters?format=json`
//! run in this process; both ways use the same HTTP client and loopback, so
//! the ratio says what one request per endpoint costs. Results go to
//! docs/benchmarks.md by hand.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use axum::routing::get;
use axum::Router;
use clap::Parser;
use serde_json::json;
use staleguard_bench::{env_usize, median};
use staleguard_validator::api::{self, ApiConfig};
use staleguard_validator::audit::fetch::Client;
use staleguard_validator::audit::{audit_once, Audit, AuditArgs};
use staleguard_validator::synth;

fn main() -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(run())
}

async fn run() -> Result<()> {
    let clusters = env_usize("CLUSTERS", 1000);
    let per = env_usize("ENDPOINTS", 20);
    let stale_every = env_usize("STALE", 10).max(1);
    let rounds = env_usize("ROUNDS", 5).max(1);

    // The truth: every endpoint's pod, except every `stale_every`th.
    let mut truth = synth::cluster(clusters, per);
    let gone: std::collections::HashSet<String> = (0..clusters * per)
        .filter(|i| i % stale_every == 0)
        .map(|i| synth::ip(i as u32).to_string())
        .collect();
    truth.pods.retain(|p| {
        let ip = p.status.as_ref().and_then(|s| s.pod_ip.clone());
        !ip.is_some_and(|ip| gone.contains(&ip))
    });
    for slice in &mut truth.slices {
        slice
            .endpoints
            .retain(|e| !e.addresses.iter().any(|a| gone.contains(a)));
    }
    let shared = synth::indexed(truth);
    let config = ApiConfig {
        listen: "127.0.0.1:0".parse()?,
        admin_listen: "127.0.0.1:0".parse()?,
        ..ApiConfig::default()
    };
    let (validator, _) = api::spawn(shared, &config).await?;

    // The gateway: one Istio-named cluster per service, every pod an endpoint.
    let statuses: Vec<serde_json::Value> = (0..clusters)
        .map(|s| {
            let hosts: Vec<serde_json::Value> = (0..per)
                .map(|p| {
                    let ip = synth::ip((s * per + p) as u32).to_string();
                    // As Envoy 1.40 prints a host: the stats and health the
                    // audit skips are most of the document.
                    json!({"address": {"socket_address": {"address": ip, "port_value": 8080}},
                        "stats": [{"name": "cx_connect_fail"}, {"name": "cx_total"}, {"name": "rq_error"},
                            {"name": "rq_success"}, {"name": "rq_timeout"}, {"name": "rq_total"},
                            {"type": "GAUGE", "name": "cx_active"}, {"type": "GAUGE", "name": "rq_active"},
                            {"type": "GAUGE", "name": "rq_pending_active"}],
                        "health_status": {"eds_health_status": "HEALTHY"}, "weight": 1, "locality": {}})
                })
                .collect();
            json!({"name": format!("outbound|80||svc-{s}.bench.svc.cluster.local"), "host_statuses": hosts})
        })
        .collect();
    let clusters_json = json!({"cluster_statuses": statuses}).to_string();
    let admin_app = Router::new()
        .route("/clusters", get(move || async move { clusters_json }))
        .route("/config_dump", get(|| async { r#"{"configs":[]}"# }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let admin: SocketAddr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, admin_app).await });

    let audit = Audit::from_args(AuditArgs::try_parse_from([
        "audit",
        "--admin",
        &admin.to_string(),
        "--validator",
        &format!("http://{validator}"),
        "--timeout",
        "60s",
    ])?)?;
    let endpoints = clusters * per;
    let want_stale = gone.len();
    println!(
        "{clusters} clusters x {per} endpoints = {endpoints} endpoints, {want_stale} stale; {rounds} rounds"
    );

    let mut batch = Vec::new();
    let mut naive = Vec::new();
    let client = Client::new(Duration::from_secs(60), None).map_err(anyhow::Error::msg)?;
    for round in 0..rounds {
        let t0 = Instant::now();
        let report = audit_once(&audit).await?;
        batch.push(t0.elapsed());
        if report.stale() != want_stale || report.endpoints() != endpoints {
            bail!(
                "audit found {} stale of {}, want {want_stale} of {endpoints}",
                report.stale(),
                report.endpoints()
            );
        }
        // The naive way: the same admin reads, then one verdict per endpoint.
        let t0 = Instant::now();
        client
            .get(&format!("http://{admin}/clusters?format=json"))
            .await?;
        client.get(&format!("http://{admin}/config_dump")).await?;
        let mut stale = 0;
        for s in 0..clusters {
            for p in 0..per {
                let ip = synth::ip((s * per + p) as u32);
                let body = client
                    .get(&format!(
                        "http://{validator}/v1/verdict?service=bench/svc-{s}&ip={ip}"
                    ))
                    .await?;
                let doc: serde_json::Value = serde_json::from_slice(&body)?;
                if doc["verdict"]["reason"] == "destroyed" {
                    stale += 1;
                }
            }
        }
        naive.push(t0.elapsed());
        // Where the one-request audit spends its time.
        let t0 = Instant::now();
        let live = client
            .get(&format!("http://{admin}/clusters?format=json"))
            .await?;
        let fetched = t0.elapsed();
        let t0 = Instant::now();
        staleguard_validator::audit::gateway::parse_clusters(&live)?;
        let parsed = t0.elapsed();
        let items: Vec<serde_json::Value> = (0..endpoints)
            .map(
                |i| json!({"service": format!("bench/svc-{}", i / per), "ip": synth::ip(i as u32)}),
            )
            .collect();
        let body = serde_json::to_vec(&json!({"records": "not_member", "items": items}))?;
        let t0 = Instant::now();
        let answer = client
            .post_json(&format!("http://{validator}/v1/verdicts"), body, None)
            .await?;
        let posted = t0.elapsed();
        let t0 = Instant::now();
        let _: staleguard_core::batch::VerdictsAnswer = serde_json::from_slice(&answer)?;
        println!(
            "  phases: GET /clusters {:.1} ms ({} KiB), parse {:.1} ms; POST /v1/verdicts {:.1} ms ({} KiB answer), parse {:.1} ms",
            fetched.as_secs_f64() * 1e3,
            live.len() / 1024,
            parsed.as_secs_f64() * 1e3,
            posted.as_secs_f64() * 1e3,
            answer.len() / 1024,
            t0.elapsed().as_secs_f64() * 1e3
        );
        if stale != want_stale {
            bail!("naive: {stale} stale, want {want_stale}");
        }
        println!(
            "round {round}: one request {:.1} ms, one per endpoint {:.1} ms",
            batch[round].as_secs_f64() * 1e3,
            naive[round].as_secs_f64() * 1e3
        );
    }
    let (b, n) = (median(&mut batch), median(&mut naive));
    println!(
        "median: audit (one POST /v1/verdicts) {:.1} ms; one GET /v1/verdict per endpoint {:.1} ms; ratio {:.1}x",
        b.as_secs_f64() * 1e3,
        n.as_secs_f64() * 1e3,
        n.as_secs_f64() / b.as_secs_f64()
    );
    Ok(())
}
