//! Freshness end to end, with the validator's kube source and the plugin
//! configuration `deploy/` ships: from the API server's answer to a delete or
//! an IP reassignment to the first request the gateway rejects for it. Not a
//! test: a benchmark, run by hand (see docs/benchmarks.md):
//!
//! ```text
//! . scripts/setup.sh && sg_setup_all && sg_setup_apiserver
//! cargo run --release -p staleguard-bench --example freshness
//! ```
//!
//! `EVENTS` (120) pods of service `fresh/app`, each on its own loopback IP with
//! a server that notes when requests reach it, each behind its own gateway
//! cluster. Events, one after another: even ones a graceful delete then a force
//! delete (measured from the force delete's answer: terminating pods are
//! allowed by default, so the first rejection can only follow the IP going
//! away), odd ones a recycle (the pod is force deleted and its IP given to a
//! new pod of `fresh/other`; measured from the answer to the status write that
//! hands the IP over, to the first `recycled` rejection). During each event
//! `HAMMER` (4) threads send requests to the event's IP without pause, and one
//! more cycles through every pod's IP all along (steady traffic everywhere).
//!
//! Reported: p50, p99 and max of that latency, and of its first part (the
//! API's answer to the validator publishing the change in its index); the
//! requests that reached a deleted pod's address after the validator
//! published the deletion (its index showed the IP gone or recycled), and
//! the requests *sent* after the filter had applied it (a client had its
//! first rejection back) that still reached the pod. Every request carries
//! the moment it was sent, so one judged before the change, still on its way
//! to the pod, is not counted as the filter's miss.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::json;
use staleguard_bench::{env_usize, wait_loaded, MISSING};
use staleguard_tests::apiserver::{ApiServer, Cluster};
use staleguard_tests::blocking::{self, Answer, Server};
use staleguard_tests::envoy::{self, shipped_plugin, Gateway};
use staleguard_tests::kube_source::{parse_ip, KubeSource};
use staleguard_validator::api::{self, ApiConfig};

const NS: &str = "fresh";
const HAMMER: usize = 4;
/// The request header carrying when the request was sent (microseconds since
/// [`epoch`]).
const SENT: &str = "x-sent-us";

/// The common clock of clients and pods.
fn epoch() -> Instant {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn send(listener: std::net::SocketAddr, cluster: &str) -> Result<blocking::Response> {
    let sent = epoch().elapsed().as_micros().to_string();
    blocking::get(listener, "/", &[("x-cluster", cluster), (SENT, &sent)])
}

fn pod_ip(i: usize) -> String {
    format!("127.0.{}.{}", 40 + i / 200, i % 200 + 1)
}

fn cluster_name(i: usize) -> String {
    format!("outbound|8080|p{i}|app.{NS}.svc.cluster.local")
}

/// A "pod": a server on the pod's IP that notes, for each request that
/// reached it, when it arrived and when it was sent.
struct PodServer {
    server: Server,
    hits: Arc<Mutex<Vec<(Instant, Instant)>>>,
}

impl PodServer {
    fn start(ip: &str) -> Result<Self> {
        let hits = Arc::new(Mutex::new(Vec::new()));
        let seen = hits.clone();
        let server = Server::start(format!("{ip}:0").parse()?, move |req| {
            let sent = req
                .headers
                .get(SENT)
                .and_then(|v| v.parse::<u64>().ok())
                .map_or(epoch(), |us| epoch() + Duration::from_micros(us));
            seen.lock().unwrap().push((Instant::now(), sent));
            Answer::Respond {
                status: 200,
                headers: vec![],
                body: b"pod".to_vec(),
            }
        })?;
        Ok(Self { server, hits })
    }

    /// Requests that arrived after `t`.
    fn arrived_after(&self, t: Instant) -> usize {
        self.hits
            .lock()
            .unwrap()
            .iter()
            .filter(|(a, _)| *a > t)
            .count()
    }

    /// Requests sent after `t` that still arrived.
    fn sent_after(&self, t: Instant) -> usize {
        self.hits
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, s)| *s > t)
            .count()
    }
}

/// What one event measured.
struct Measured {
    recycle: bool,
    latency: Duration,
    /// The API's answer to the validator's index showing the change.
    to_validator: Duration,
    after_published: usize,
    after_applied: usize,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let events = env_usize("EVENTS", 200);
    epoch();
    let Some(server) = ApiServer::start().await? else {
        bail!("STALEGUARD_APISERVER is not set: run `. scripts/setup.sh && sg_setup_apiserver`");
    };
    let cluster = Cluster::new(server.client());
    cluster.namespace(NS).await?;
    cluster.service(NS, "app", 8080).await?;
    cluster.service(NS, "other", 8080).await?;
    let mut pods = Vec::new();
    for i in 0..events {
        let ip = pod_ip(i);
        let pod = PodServer::start(&ip)?;
        cluster.pod(NS, &format!("app-{i}"), "app").await?;
        cluster.run_pod(NS, &format!("app-{i}"), &ip, true).await?;
        pods.push(pod);
    }

    // The validator: the kube source feeding the API the filter polls.
    let source = KubeSource::start(&server, Duration::from_secs(300)).await?;
    source.synced().await?;
    source
        .wait_for("every pod indexed", Duration::from_secs(60), |ix| {
            (0..events).all(|i| ix.record(parse_ip(&pod_ip(i))).is_some())
        })
        .await?;
    let config = ApiConfig {
        listen: "127.0.0.1:0".parse()?,
        admin_listen: "127.0.0.1:0".parse()?,
        ..ApiConfig::default()
    };
    let (validator, _admin) = api::spawn(source.shared.clone(), &config).await?;

    // The gateway: one cluster per pod, the shipped plugin configuration.
    let plugin = shipped_plugin(json!({}));
    println!("plugin configuration (deploy/envoy/envoy.yaml): {plugin}");
    let clusters = (0..events)
        .map(|i| {
            envoy::Cluster::new(
                &cluster_name(i),
                pods[i].server.addr(),
                Some(plugin.clone()),
            )
        })
        .collect();
    let gateway = Gateway {
        concurrency: 2,
        ..Gateway::new(validator, clusters)
    };
    let envoy = gateway.start()?.context(MISSING)?;
    wait_loaded(&envoy, Duration::from_secs(60))?;
    let listener = envoy.listener;
    for i in 0..events {
        let r = send(listener, &cluster_name(i))?;
        if r.status != 200 {
            bail!("pod {i} is not served before the events: {r:?}");
        }
    }

    // Steady traffic to every pod, all along.
    let stop = Arc::new(AtomicBool::new(false));
    let steady = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                let _ = send(listener, &cluster_name(i % events));
                i += 1;
            }
        })
    };
    // The event's IP, hammered; the first rejection with the awaited reason.
    let target = Arc::new(AtomicUsize::new(usize::MAX));
    let want = Arc::new(Mutex::new(String::new()));
    let first: Arc<Mutex<Option<Instant>>> = Arc::new(Mutex::new(None));
    let hammers: Vec<_> = (0..HAMMER)
        .map(|_| {
            let (stop, target, want, first) =
                (stop.clone(), target.clone(), want.clone(), first.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let i = target.load(Ordering::Relaxed);
                    if i == usize::MAX {
                        std::thread::sleep(Duration::from_millis(1));
                        continue;
                    }
                    let Ok(r) = send(listener, &cluster_name(i)) else {
                        continue;
                    };
                    let reason = r.header("x-staleguard").to_owned();
                    if !reason.is_empty() && reason == *want.lock().unwrap() {
                        let now = Instant::now();
                        first.lock().unwrap().get_or_insert(now);
                    }
                }
            })
        })
        .collect();

    let mut measured = Vec::new();
    for (i, pod) in pods.iter().enumerate() {
        let ip = pod_ip(i);
        let name = format!("app-{i}");
        let recycle = i % 2 == 1;
        *first.lock().unwrap() = None;
        *want.lock().unwrap() = if recycle { "recycled" } else { "destroyed" }.to_owned();
        target.store(i, Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(20));
        if !recycle {
            cluster.delete_pod(NS, &name).await?;
        }
        cluster.force_delete_pod(NS, &name).await?;
        let deleted = Instant::now();
        // When the validator published the deletion: the IP no longer holds
        // app-i.
        let published = deleted
            + source
                .wait_for(
                    "the validator publishes the deletion",
                    Duration::from_secs(30),
                    |ix| {
                        ix.record(parse_ip(&ip))
                            .is_none_or(|r| r.pods.iter().all(|p| p.name != name))
                    },
                )
                .await?;
        let (answered, to_validator) = if recycle {
            cluster.pod(NS, &format!("other-{i}"), "other").await?;
            cluster
                .run_pod(NS, &format!("other-{i}"), &ip, true)
                .await?;
            let answered = Instant::now();
            let other = format!("other-{i}");
            let seen = source
                .wait_for(
                    "the validator publishes the recycle",
                    Duration::from_secs(30),
                    |ix| {
                        ix.record(parse_ip(&ip))
                            .is_some_and(|r| r.pods.iter().any(|p| p.name == other))
                    },
                )
                .await?;
            (answered, seen)
        } else {
            (deleted, published.saturating_duration_since(deleted))
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        let rejected = loop {
            if let Some(t) = *first.lock().unwrap() {
                break t;
            }
            if Instant::now() > deadline {
                bail!(
                    "event {i} ({ip}) was never rejected:\n{}",
                    envoy::tail(&envoy.log(), 40)
                );
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        };
        target.store(usize::MAX, Ordering::Relaxed);
        // Let requests in flight land before counting.
        tokio::time::sleep(Duration::from_millis(50)).await;
        measured.push(Measured {
            recycle,
            latency: rejected.saturating_duration_since(answered),
            to_validator,
            after_published: pod.arrived_after(published),
            after_applied: pod.sent_after(rejected),
        });
    }
    stop.store(true, Ordering::Relaxed);
    for h in hammers {
        let _ = h.join();
    }
    let _ = steady.join();

    let pct = |v: &[Duration], p: usize| {
        v[((v.len() * p).div_ceil(100))
            .saturating_sub(1)
            .min(v.len() - 1)]
    };
    let ms = |d: Duration| format!("{:.1} ms", d.as_secs_f64() * 1000.0);
    println!("\n| events | p50 | p99 | max | of which API -> validator index, p50 / p99 | requests a deleted pod answered after the validator published its deletion | requests sent after the filter applied it that reached the pod |");
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    for (what, filter) in [
        ("all", None),
        ("graceful then force delete", Some(false)),
        ("recycle", Some(true)),
    ] {
        let chosen: Vec<&Measured> = measured
            .iter()
            .filter(|m| filter.is_none_or(|r| m.recycle == r))
            .collect();
        let mut lat: Vec<Duration> = chosen.iter().map(|m| m.latency).collect();
        lat.sort();
        let mut val: Vec<Duration> = chosen.iter().map(|m| m.to_validator).collect();
        val.sort();
        println!(
            "| {what} ({}) | {} | {} | {} | {} / {} | {} | {} |",
            chosen.len(),
            ms(pct(&lat, 50)),
            ms(pct(&lat, 99)),
            ms(*lat.last().unwrap()),
            ms(pct(&val, 50)),
            ms(pct(&val, 99)),
            chosen.iter().map(|m| m.after_published).sum::<usize>(),
            chosen.iter().map(|m| m.after_applied).sum::<usize>(),
        );
    }
    println!(
        "\nsync: {} long polls, {} deltas, {} resets, errors: {}",
        envoy.stat("wasmcustom.staleguard_filter_sync_polls_total")?,
        envoy.stat("wasmcustom.staleguard_filter_sync_deltas_total")?,
        envoy.stat("wasmcustom.staleguard_filter_sync_resets_total")?,
        envoy.admin("/stats?filter=sync_errors")?.trim()
    );
    drop(envoy);
    Ok(())
}
