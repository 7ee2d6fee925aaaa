//! How fast each defence reacts to a deleted pod and to a recycled IP behind a
//! stuck control plane (issue 14, `bench/run` section 2).
//!
//! ```text
//! . scripts/setup.sh && sg_setup_all && sg_build_validator
//! cargo run --release -p staleguard-tests --example alternatives_reaction
//! # WINDOW=30 (seconds watched after each event) is the default
//! ```
//!
//! One simulated cluster ([`World`]): service `web` of 4 pods and service
//! `other` of 1, every pod a server on its own loopback IP. The gateways read
//! file-based EDS that is frozen after the start (a stuck control plane: the
//! endpoint list never changes) and differ only in their defence: staleguard
//! with the shipped configuration (the real validator on its file source,
//! which the harness rewrites at the event), active health checking, outlier
//! detection with Envoy's defaults, outlier detection allowed to eject every
//! host, retries only, a health check that matches the service name, and no
//! defence. Each gateway gets steady traffic from its own client (2 workers,
//! 5 ms apart). Then (a) a pod is deleted: its server stops (connections
//! refused), and (b) another pod's IP is recycled: its address now answers
//! 200 as a pod of `other`.
//!
//! For each gateway it watches, every 20 ms, the bad address: for (a) Envoy's
//! connection attempts to it that failed (`cx_connect_fail` in `/clusters`),
//! minus the requests the staleguard filter judged by then (Envoy starts the
//! connection before upstream filters run, so a request the filter rejects
//! or replays still makes one); for (b) the requests that reached the other
//! service there (counted by the server, by gateway). "Stops" is the last time
//! that count grew; "never" when it still grew in the window's last 2 s.
//! Prints a markdown section on stdout.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use serde_json::{json, Value};
use staleguard_tests::bench::env_usize;
use staleguard_tests::envoy::shipped_route_retry_policy;
use staleguard_tests::gateway::{cluster_name, Gateway, GatewaySpec};
use staleguard_tests::pods::via;
use staleguard_tests::scene::{deps, Scene};
use staleguard_tests::traffic::{Load, Outcomes};
use staleguard_tests::world::World;

const POLL: Duration = Duration::from_millis(20);

fn spec(name: &str, cluster_extra: Value, route_extra: Value) -> GatewaySpec {
    let mut s = GatewaySpec::unguarded(name);
    s.cluster_extra = cluster_extra;
    s.route_extra = route_extra;
    s
}

fn health_check(http: Value) -> Value {
    json!({"health_checks": [{
        "timeout": "1s",
        "interval": "5s",
        // Envoy checks every 60 s until the cluster has seen traffic, and the
        // gateways start before their traffic: a long-serving gateway would
        // check every 5 s, so this one does too.
        "no_traffic_interval": "5s",
        "unhealthy_threshold": 3,
        "healthy_threshold": 1,
        "http_health_check": http,
    }]})
}

/// One gateway's watch over one event.
#[derive(Debug, Default)]
struct Watch {
    /// (time since the event, count at the bad address).
    series: Vec<(Duration, u64)>,
    outcomes_before: Outcomes,
    outcomes_after: Outcomes,
    /// Envoy's view of the bad host at the end of the window.
    flags: String,
    /// Non-member verdicts of the filter in the window (guarded gateway).
    judged: u64,
}

impl Watch {
    fn bad(&self) -> u64 {
        self.series.last().map_or(0, |s| s.1) - self.series.first().map_or(0, |s| s.1)
    }

    /// When the count last grew, or `None` ("never") when it grew within the
    /// last 2 s of the window.
    fn stopped(&self, window: Duration) -> Option<Duration> {
        let mut last = Duration::ZERO;
        for pair in self.series.windows(2) {
            if pair[1].1 > pair[0].1 {
                last = pair[1].0;
            }
        }
        (last + Duration::from_secs(2) < window).then_some(last)
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let window = Duration::from_secs(env_usize("WINDOW", 30) as u64);
    let Some(deps) = deps() else {
        bail!("Envoy, the filter or the validator is missing: run `. scripts/setup.sh && sg_setup_all && sg_build_validator`");
    };
    let mut world = World::new()?;
    world.add_service("web", 4).await?;
    world.add_service("other", 1).await?;
    let specs = vec![
        // The shipped gateway: the plugin and the route's retry on a refused
        // connection, both from deploy/envoy/envoy.yaml.
        GatewaySpec {
            route_extra: json!({"retry_policy": shipped_route_retry_policy()}),
            ..GatewaySpec::guarded("staleguard", json!({}))
        },
        spec(
            "health-check",
            health_check(json!({"path": "/"})),
            json!({}),
        ),
        spec(
            "health-check-service-name",
            health_check(json!({"path": "/", "service_name_matcher": {"exact": "shop/web"}})),
            json!({}),
        ),
        spec(
            "outlier-defaults",
            json!({"outlier_detection": {}}),
            json!({}),
        ),
        spec(
            "outlier-eject-all",
            json!({"outlier_detection": {"consecutive_5xx": 3, "max_ejection_percent": 100}}),
            json!({}),
        ),
        spec(
            "retries",
            json!({}),
            json!({"retry_policy": {"retry_on": "connect-failure,5xx", "num_retries": 2}}),
        ),
        spec("none", json!({}), json!({})),
    ];
    eprintln!(
        "reaction: starting the validator and {} gateways",
        specs.len()
    );
    let mut scene = Scene::start(&deps, world, &[], &specs).await?;
    scene.world.freeze_eds();
    let loads: Vec<Load> = scene
        .gateways
        .iter()
        .map(|g| {
            Load::start(
                scene.http.clone(),
                g.target("web"),
                2,
                None,
                Some(Duration::from_millis(5)),
            )
        })
        .collect();
    // Let health checks pass once and traffic settle.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let load_before = loadavg();

    let web = scene.world.pods_of("web");
    let (dead_pod, recycled_pod) = (web[0].clone(), web[1].clone());

    // === (a) a pod is deleted: its server stops ===
    eprintln!("reaction: (a) deleting {} ({})", dead_pod.name, dead_pod.ip);
    let mut before = Vec::new();
    for (g, l) in scene.gateways.iter().zip(&loads) {
        before.push((l.outcomes(), dead_attempts(&scene, g, dead_pod.ip).await?));
    }
    let judged_before = judged_all(&scene).await?;
    scene.world.destroy(&dead_pod.name)?;
    scene.world.publish_truth()?;
    scene.world.stop_address(dead_pod.ip)?;
    let t0 = Instant::now();
    let mut deleted: Vec<Watch> = before
        .into_iter()
        .map(|(o, n)| Watch {
            series: vec![(Duration::ZERO, n)],
            outcomes_before: o,
            ..Watch::default()
        })
        .collect();
    while t0.elapsed() < window {
        tokio::time::sleep(POLL).await;
        for (g, w) in scene.gateways.iter().zip(&mut deleted) {
            let n = dead_attempts(&scene, g, dead_pod.ip).await?;
            w.series.push((t0.elapsed(), n));
        }
    }
    for ((l, w), g) in loads.iter().zip(&mut deleted).zip(&scene.gateways) {
        w.outcomes_after = l.outcomes();
        w.flags = health_flags(&scene, g, dead_pod.ip).await?;
    }

    // === (b) an IP is recycled: another app answers there ===
    eprintln!(
        "reaction: (b) recycling {} ({}) to `other`",
        recycled_pod.name, recycled_pod.ip
    );
    let mut before = Vec::new();
    for (g, l) in scene.gateways.iter().zip(&loads) {
        before.push((l.outcomes(), wrong_at(&scene, g, recycled_pod.ip)));
    }
    let judged_between = judged_all(&scene).await?;
    for (w, (a, b)) in deleted
        .iter_mut()
        .zip(judged_between.iter().zip(&judged_before))
    {
        w.judged = a - b;
    }
    scene.world.recycle(recycled_pod.ip, "other")?;
    scene.world.publish_truth()?;
    scene.world.settle();
    let t0 = Instant::now();
    let mut recycled: Vec<Watch> = before
        .into_iter()
        .map(|(o, n)| Watch {
            series: vec![(Duration::ZERO, n)],
            outcomes_before: o,
            ..Watch::default()
        })
        .collect();
    while t0.elapsed() < window {
        tokio::time::sleep(POLL).await;
        for (g, w) in scene.gateways.iter().zip(&mut recycled) {
            w.series
                .push((t0.elapsed(), wrong_at(&scene, g, recycled_pod.ip)));
        }
    }
    for ((l, w), g) in loads.iter().zip(&mut recycled).zip(&scene.gateways) {
        w.outcomes_after = l.outcomes();
        w.flags = health_flags(&scene, g, recycled_pod.ip).await?;
    }
    let judged_after = judged_all(&scene).await?;
    for (w, (a, b)) in recycled
        .iter_mut()
        .zip(judged_after.iter().zip(&judged_between))
    {
        w.judged = a - b;
    }
    let load_after = loadavg();
    let mut sent = 0;
    for l in loads {
        sent += l.stop().await.total();
    }

    // === report ===
    let secs = |d: Duration| {
        if d.is_zero() {
            "0 (never sent after the event)".to_owned()
        } else {
            format!("{:.2} s", d.as_secs_f64())
        }
    };
    println!(
        "Service `web` of 4 pods behind frozen file-based EDS; each gateway (Envoy 1.40, 1 worker) \
         gets 2 client workers sending back to back with 5 ms pauses ({sent} requests in all). \
         staleguard: the shipped configuration, the real validator on its file source (polled \
         every 10 ms, the default), rewritten at the event. Window {} s after each event, \
         sampled every 20 ms. Load average {load_before} before, {load_after} after.\n",
        window.as_secs()
    );
    println!(
        "| defence | (a) deleted pod: stops trying it after | connects refused there (not judged by the filter) | client requests failed | host state at the end | (b) recycled IP: stops sending there after | requests that reached the other app | answered by the other app / failed, at the client | host state at the end |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    let never = || format!("**never** (within {} s)", window.as_secs());
    for ((g, d), r) in scene.gateways.iter().zip(&deleted).zip(&recycled) {
        let d_out = d.outcomes_after.since(&d.outcomes_before);
        let r_out = r.outcomes_after.since(&r.outcomes_before);
        let judged = |w: &Watch| {
            if g.guarded {
                format!(" (filter: {} requests judged not a member)", w.judged)
            } else {
                String::new()
            }
        };
        println!(
            "| {} | {} | {} | {}{} | {} | {} | {} | {} / {}{} | {} |",
            label(&g.name),
            d.stopped(window).map_or_else(never, secs),
            d.bad(),
            d_out.failed(),
            judged(d),
            d.flags,
            r.stopped(window).map_or_else(never, secs),
            r.bad(),
            r_out.wrong_service,
            r_out.failed(),
            judged(r),
            r.flags
        );
    }
    println!(
        "\n(b)'s failures include requests still failing at (a)'s dead pod where a defence never \
         stopped using it. Host state: Envoy's `health_flags` for the address in `/clusters`."
    );
    let sg = scene.gateways.iter().position(|g| g.guarded).unwrap_or(0);
    println!(
        "\nMACHINE reaction staleguard_delete_s={} staleguard_recycle_s={}",
        deleted[sg]
            .stopped(window)
            .map_or("never".into(), |d| format!("{:.3}", d.as_secs_f64())),
        recycled[sg]
            .stopped(window)
            .map_or("never".into(), |d| format!("{:.3}", d.as_secs_f64()))
    );
    Ok(())
}

/// What the report calls a gateway.
fn label(name: &str) -> &str {
    match name {
        "staleguard" => "staleguard (shipped configuration: the plugin, and the route's retry on `connect-failure,refused-stream`)",
        "health-check" => "active health check (5 s interval, unhealthy threshold 3)",
        "health-check-service-name" => {
            "the same, matching the service name (`service_name_matcher`)"
        }
        "outlier-defaults" => "outlier detection, defaults",
        "outlier-eject-all" => "outlier detection, `max_ejection_percent` 100, `consecutive_5xx` 3",
        "retries" => "retries only (`connect-failure,5xx`, 2 retries)",
        "none" => "no defence",
        other => other,
    }
}

/// Failed connection attempts at `ip` in the gateway's web cluster, minus
/// (for the guarded gateway) the requests its filter judged not a member.
async fn dead_attempts(scene: &Scene, g: &Gateway, ip: IpAddr) -> Result<u64> {
    let url = format!("http://{}/clusters", g.admin);
    let text = scene.http.get(&url).await?.text();
    let prefix = format!(
        "{}::{}::cx_connect_fail::",
        cluster_name("web"),
        scene.world.addr(ip)
    );
    let refused: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    if !g.guarded {
        return Ok(refused);
    }
    Ok(refused.saturating_sub(judged(scene, g).await?))
}

/// Envoy's `health_flags` for `ip` in the gateway's web cluster.
async fn health_flags(scene: &Scene, g: &Gateway, ip: IpAddr) -> Result<String> {
    let url = format!("http://{}/clusters", g.admin);
    let text = scene.http.get(&url).await?.text();
    let prefix = format!(
        "{}::{}::health_flags::",
        cluster_name("web"),
        scene.world.addr(ip)
    );
    Ok(text
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .map_or("?".into(), |v| format!("`{}`", v.trim())))
}

/// Every gateway's filter verdicts other than `member` so far (0 unguarded).
async fn judged_all(scene: &Scene) -> Result<Vec<u64>> {
    let mut all = Vec::new();
    for g in &scene.gateways {
        all.push(if g.guarded {
            judged(scene, g).await?
        } else {
            0
        });
    }
    Ok(all)
}

async fn judged(scene: &Scene, g: &Gateway) -> Result<u64> {
    let stats = g.stats(&scene.http).await?;
    Ok(stats
        .iter()
        .filter(|(k, _)| {
            k.starts_with("wasmcustom.staleguard_filter_requests_total.")
                && !k.contains(".reason.member.")
        })
        .map(|(_, v)| *v)
        .sum())
}

/// Requests from gateway `g` that reached another service at `ip`.
fn wrong_at(scene: &Scene, g: &Gateway, ip: IpAddr) -> u64 {
    let tallies: BTreeMap<_, _> = scene.world.tallies_at(&[ip]);
    via(&tallies, &g.name).wrong_service
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "?".into())
}
