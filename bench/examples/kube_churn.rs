//! The incident, replayed against a real API server: a 250-pod gateway scales
//! down to 20 while 100 other services churn, and the validator's kube source
//! follows. Not a test: a benchmark, run by hand (see docs/benchmarks.md):
//!
//! ```text
//! . scripts/setup.sh && sg_setup_apiserver
//! cargo run --release -p staleguard-bench --example kube_churn
//! ```
//!
//! Measures, per deleted gateway pod, the time from the API's response to the
//! delete until the validator's index shows the change (terminating after the
//! graceful delete, gone after the force delete), the total convergence time,
//! and every request the validator made to the server, by verb.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use staleguard_tests::apiserver::{ApiServer, Cluster, SliceEndpoint, HARNESS_USER_AGENT};
use staleguard_tests::kube_source::{parse_ip, KubeSource, VALIDATOR_USER_AGENT};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

const NS: &str = "bench";
const GATEWAY: usize = 250;
const KEEP: usize = 20;
const OTHER_SERVICES: usize = 100;
const PODS_PER_OTHER: usize = 10;
/// Writes in flight at once: "as fast as the server accepts".
const IN_FLIGHT: usize = 32;
/// Endpoints per slice, as the EndpointSlice controller's default.
const SLICE_SIZE: usize = 100;

fn gateway_ip(i: usize) -> String {
    format!("10.10.{}.{}", i / 200, i % 200 + 1)
}

fn other_ip(service: usize, pod: usize, generation: usize) -> String {
    format!("10.{}.{}.{}", 20 + generation, service, pod + 1)
}

#[derive(Default)]
struct Times {
    /// IP -> when the API answered the write.
    answered: HashMap<String, Instant>,
    /// IP -> when the index first showed the change.
    seen: HashMap<String, Instant>,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let Some(server) = ApiServer::start().await? else {
        bail!("STALEGUARD_APISERVER is not set: run `. scripts/setup.sh && sg_setup_apiserver`");
    };
    eprintln!("API server ready in {:?}", server.startup);
    let cluster = Cluster::new(server.client());
    cluster.namespace(NS).await?;

    // === the cluster before the incident ===
    let setup = Instant::now();
    cluster.service(NS, "gateway", 8080).await?;
    for s in 0..OTHER_SERVICES {
        cluster.service(NS, &format!("svc-{s}"), 8080).await?;
    }
    let mut pods: Vec<(String, String, String)> = (0..GATEWAY)
        .map(|i| (format!("gateway-{i}"), "gateway".to_owned(), gateway_ip(i)))
        .collect();
    for s in 0..OTHER_SERVICES {
        for p in 0..PODS_PER_OTHER {
            pods.push((
                format!("svc-{s}-{p}"),
                format!("svc-{s}"),
                other_ip(s, p, 0),
            ));
        }
    }
    let created = create_running(&cluster, pods).await?;
    write_slices(&cluster, "gateway", &created, 0..GATEWAY).await?;
    for s in 0..OTHER_SERVICES {
        let start = GATEWAY + s * PODS_PER_OTHER;
        write_slices(
            &cluster,
            &format!("svc-{s}"),
            &created,
            start..start + PODS_PER_OTHER,
        )
        .await?;
    }
    eprintln!(
        "created {} pods in {} services in {:?}",
        created.len(),
        OTHER_SERVICES + 1,
        setup.elapsed()
    );

    // === the validator ===
    let source = KubeSource::start(&server, Duration::from_secs(300)).await?;
    let synced = source.synced().await?;
    let want = created.len();
    source
        .wait_for("every pod indexed", Duration::from_secs(60), |ix| {
            ix.snapshot(Default::default()).records.len() == want
        })
        .await?;
    eprintln!("validator synced in {synced:?}");

    // === the scale-down, while the other services churn ===
    let graceful = Arc::new(Mutex::new(Times::default()));
    let forced = Arc::new(Mutex::new(Times::default()));
    let doomed: Vec<(String, String)> = created[KEEP..GATEWAY]
        .iter()
        .map(|(pod, ip)| (pod.metadata.name.clone().unwrap_or_default(), ip.clone()))
        .collect();
    let observer = tokio::spawn(observe(
        source.shared.clone(),
        doomed.iter().map(|(_, ip)| ip.clone()).collect(),
        graceful.clone(),
        forced.clone(),
    ));
    let churn_stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let churn = tokio::spawn(churn_others(cluster.clone(), churn_stop.clone()));

    let began = Instant::now();
    // Graceful deletes (the ReplicaSet scaling down), as fast as accepted.
    run_all(&doomed, |name, ip| {
        let cluster = cluster.clone();
        let times = graceful.clone();
        async move {
            let pod = cluster.delete_pod(NS, &name).await?;
            anyhow::ensure!(pod.is_some(), "{name} went at once; it should terminate");
            times.lock().unwrap().answered.insert(ip, Instant::now());
            Ok(())
        }
    })
    .await?;
    // The EndpointSlice controller drops them from the gateway's slices.
    write_slices(&cluster, "gateway", &created, 0..KEEP).await?;
    // Their kubelets finish them: the pods go away.
    run_all(&doomed, |name, ip| {
        let cluster = cluster.clone();
        let times = forced.clone();
        async move {
            cluster.force_delete_pod(NS, &name).await?;
            times.lock().unwrap().answered.insert(ip, Instant::now());
            Ok(())
        }
    })
    .await?;
    let writes_done = began.elapsed();
    churn_stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let churned = churn.await??;
    observer.await??;

    // Converged: the index equals the API.
    let truth = truth(&server.client()).await?;
    source
        .wait_for("the index equals the API", Duration::from_secs(60), |ix| {
            let snap = ix.snapshot(Default::default());
            let have: BTreeMap<String, String> = snap
                .records
                .iter()
                .flat_map(|r| {
                    r.pods
                        .iter()
                        .map(move |p| (p.name.clone(), r.ip.to_string()))
                })
                .collect();
            have == truth
        })
        .await?;
    let converged = began.elapsed();

    // === report ===
    let counts = server.request_counts().await?;
    let mut by_verb: BTreeMap<(String, String), u64> = BTreeMap::new();
    let mut harness_writes = 0;
    for c in &counts {
        if c.user_agent == VALIDATOR_USER_AGENT {
            *by_verb
                .entry((c.verb.clone(), c.resource.clone()))
                .or_default() += c.count;
        } else if c.user_agent == HARNESS_USER_AGENT {
            harness_writes += c.count;
        }
    }
    println!("## Churn against a real API server\n");
    println!(
        "{GATEWAY} gateway pods + {} pods in {OTHER_SERVICES} other services; {} gateway pods deleted",
        OTHER_SERVICES * PODS_PER_OTHER,
        doomed.len()
    );
    println!("(graceful delete, slice update, then force delete; {IN_FLIGHT} writes in flight) while {churned} other pods were replaced.\n");
    println!("| measure | p50 | p99 | max | seen before the API answered |");
    println!("| --- | --- | --- | --- | --- |");
    for (what, times) in [
        ("delete -> index shows terminating", &graceful),
        ("force delete -> index shows IP gone", &forced),
    ] {
        let t = times.lock().unwrap();
        let (lat, early) = latencies(&t);
        println!(
            "| {what} | {} | {} | {} | {early} of {} |",
            ms(pct(&lat, 50)),
            ms(pct(&lat, 99)),
            ms(lat.last().copied().unwrap_or_default()),
            lat.len()
        );
    }
    println!();
    println!("- all writes answered after {}", ms(writes_done));
    println!(
        "- index equal to the API after {} (convergence)",
        ms(converged)
    );
    println!("- harness requests (writes and reads of the test itself): {harness_writes}");
    println!("- validator requests to the API server, by verb:\n");
    println!("| verb | resource | requests |\n| --- | --- | --- |");
    for ((verb, resource), n) in &by_verb {
        println!("| {verb} | {resource} | {n} |");
    }
    let other: Vec<_> = by_verb
        .keys()
        .filter(|(verb, _)| verb != "list" && verb != "watch")
        .collect();
    if !other.is_empty() {
        bail!("the validator made requests other than list and watch: {other:?}");
    }
    Ok(())
}

/// Creates running pods (create, then the kubelet's status write) and returns
/// them with their IPs, in order.
async fn create_running(
    cluster: &Cluster,
    pods: Vec<(String, String, String)>,
) -> Result<Vec<(Pod, String)>> {
    let gate = Arc::new(Semaphore::new(IN_FLIGHT));
    let mut set = JoinSet::new();
    for (i, (name, app, ip)) in pods.into_iter().enumerate() {
        let cluster = cluster.clone();
        let permit = gate.clone().acquire_owned().await?;
        set.spawn(async move {
            let _permit = permit;
            cluster.pod(NS, &name, &app).await?;
            let pod = cluster.run_pod(NS, &name, &ip, true).await?;
            anyhow::Ok((i, pod, ip))
        });
    }
    let mut out = Vec::new();
    while let Some(r) = set.join_next().await {
        out.push(r??);
    }
    out.sort_by_key(|(i, _, _)| *i);
    Ok(out.into_iter().map(|(_, pod, ip)| (pod, ip)).collect())
}

/// Writes a service's slices (100 endpoints each) for `created[range]`.
async fn write_slices(
    cluster: &Cluster,
    service: &str,
    created: &[(Pod, String)],
    range: std::ops::Range<usize>,
) -> Result<()> {
    let endpoints: Vec<SliceEndpoint> = created[range]
        .iter()
        .map(|(pod, ip)| SliceEndpoint::pod(ip, pod))
        .collect();
    let chunks: Vec<&[SliceEndpoint]> = endpoints.chunks(SLICE_SIZE).collect();
    for n in 0..3 {
        let name = format!("{service}-{n}");
        match chunks.get(n) {
            Some(chunk) => {
                cluster.named_slice(NS, service, &name, 8080, chunk).await?;
            }
            None if n > 0 => {
                let _ = cluster.delete_slice(NS, &name).await;
            }
            None => {
                cluster.named_slice(NS, service, &name, 8080, &[]).await?;
            }
        }
    }
    Ok(())
}

/// Runs `f(name, ip)` for every pod, `IN_FLIGHT` at a time.
async fn run_all<F, Fut>(pods: &[(String, String)], f: F) -> Result<()>
where
    F: Fn(String, String) -> Fut,
    Fut: std::future::Future<Output = Result<()>> + Send + 'static,
{
    let gate = Arc::new(Semaphore::new(IN_FLIGHT));
    let mut set = JoinSet::new();
    for (name, ip) in pods {
        let permit = gate.clone().acquire_owned().await?;
        let fut = f(name.clone(), ip.clone());
        set.spawn(async move {
            let _permit = permit;
            fut.await
        });
    }
    while let Some(r) = set.join_next().await {
        r??;
    }
    Ok(())
}

/// Workers replacing pods of the other services at once.
const CHURN_WORKERS: usize = 4;

/// Replaces pods of the other services (delete one, create its successor on a
/// new IP, rewrite a slice) with [`CHURN_WORKERS`] workers until told to stop;
/// returns how many pods were replaced.
async fn churn_others(cluster: Cluster, stop: Arc<std::sync::atomic::AtomicBool>) -> Result<usize> {
    let mut set = JoinSet::new();
    for worker in 0..CHURN_WORKERS {
        let (cluster, stop) = (cluster.clone(), stop.clone());
        set.spawn(async move {
            let mut replaced = 0;
            // Worker w takes n = w, w + W, ...; the replacement of a pod's
            // next generation (n + 1000) falls to the same worker, in order.
            let mut n = worker;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                replace_other(&cluster, n).await?;
                replaced += 1;
                n += CHURN_WORKERS;
            }
            anyhow::Ok(replaced)
        });
    }
    let mut total = 0;
    while let Some(r) = set.join_next().await {
        total += r??;
    }
    Ok(total)
}

async fn replace_other(cluster: &Cluster, n: usize) -> Result<()> {
    let s = n % OTHER_SERVICES;
    let p = (n / OTHER_SERVICES) % PODS_PER_OTHER;
    let generation = n / (OTHER_SERVICES * PODS_PER_OTHER);
    let old = if generation == 0 {
        format!("svc-{s}-{p}")
    } else {
        format!("svc-{s}-{p}-g{generation}")
    };
    let new = format!("svc-{s}-{p}-g{}", generation + 1);
    cluster.force_delete_pod(NS, &old).await?;
    cluster.pod(NS, &new, &format!("svc-{s}")).await?;
    let ip = other_ip(s, p, generation + 1);
    let pod = cluster.run_pod(NS, &new, &ip, true).await?;
    cluster
        .named_slice(
            NS,
            &format!("svc-{s}"),
            &format!("svc-{s}-churn-{p}"),
            8080,
            &[SliceEndpoint::pod(&ip, &pod)],
        )
        .await?;
    Ok(())
}

/// Notes when each IP first shows terminating and then gone in the index.
async fn observe(
    shared: staleguard_validator::live::SharedIndex,
    ips: Vec<String>,
    graceful: Arc<Mutex<Times>>,
    forced: Arc<Mutex<Times>>,
) -> Result<()> {
    let mut generations = shared.subscribe();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let now = Instant::now();
        let mut done = true;
        {
            let index = shared.read();
            let mut g = graceful.lock().unwrap();
            let mut f = forced.lock().unwrap();
            for ip in &ips {
                let record = index.record(parse_ip(ip));
                let pods = record.as_ref().map(|r| r.pods.as_slice()).unwrap_or(&[]);
                if pods.iter().any(|p| p.terminating) || pods.is_empty() {
                    g.seen.entry(ip.clone()).or_insert(now);
                }
                if pods.is_empty() {
                    f.seen.entry(ip.clone()).or_insert(now);
                } else {
                    done = false;
                }
            }
        }
        if done {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("the index did not show every deletion within 120 s");
        }
        let _ = tokio::time::timeout(Duration::from_millis(100), generations.changed()).await;
    }
}

async fn truth(client: &kube::Client) -> Result<BTreeMap<String, String>> {
    let pods = Api::<Pod>::namespaced(client.clone(), NS)
        .list(&ListParams::default())
        .await
        .context("list pods")?;
    Ok(pods
        .items
        .into_iter()
        .filter_map(|p| Some((p.metadata.name?, p.status?.pod_ip?)))
        .collect())
}

/// Latencies (sorted) and how many changes the index showed before the API
/// answered the write (counted as zero).
fn latencies(t: &Times) -> (Vec<Duration>, usize) {
    let mut early = 0;
    let mut lat: Vec<Duration> = t
        .answered
        .iter()
        .filter_map(|(ip, answered)| {
            let seen = t.seen.get(ip)?;
            if seen < answered {
                early += 1;
            }
            Some(seen.saturating_duration_since(*answered))
        })
        .collect();
    lat.sort();
    (lat, early)
}

fn pct(sorted: &[Duration], p: usize) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = (sorted.len() * p).div_ceil(100).saturating_sub(1);
    sorted[i.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}
