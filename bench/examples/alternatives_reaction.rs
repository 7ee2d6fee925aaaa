//! How fast each defence reacts to a deleted pod and to a recycled IP behind a
//! stuck control plane (issue 14, `bench/run` section 2).
//!
//! ```text
//! . scripts/setup.sh && sg_setup_all && sg_build_validator
//! cargo run --release -p staleguard-bench --example alternatives_reaction
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
use staleguard_bench::{env_usize, loadavg};
use staleguard_tests::envoy::shipped_route_retry_policy;
use staleguard_tests::envoy::{Envoy, Gateway};
use staleguard_tests::pods::via;
use staleguard_tests::scene::{deps, Scene};
use staleguard_tests::traffic::{Load, Outcomes};
use staleguard_tests::world::{cluster_name, World};

const POLL: Duration = Duration::from_millis(20);

/// An unguarded gateway with Envoy's own defences: `cluster_extra` on every
/// cluster, `route_extra` on every route.
fn spec(world: &World, name: &str, cluster_extra: Value, route_extra: Value) -> Gateway {
    let mut g = world.unguarded(name);
    for c in &mut g.clusters {
        c.extra = cluster_extra.clone();
    }
    g.route_extra = route_extra;
    g
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
        Gateway {
            route_extra: json!({"retry_policy": shipped_route_retry_policy()}),
            ..world.guarded("staleguard", json!({}))
        },
        spec(
            &world,
            "health-check",
            health_check(json!({"path": "/"})),
            json!({}),
        ),
        spec(
            &world,
            "health-check-service-name",
            health_check(json!({"path": "/", "service_name_matcher": {"exact": "shop/web"}})),
            json!({}),
        ),
        spec(
            &world,
            "outlier-defaults",
            json!({"outlier_detection": {}}),
            json!({}),
        ),
        spec(
            &world,
            "outlier-eject-all",
            json!({"outlier_detection": {"consecutive_5xx": 3, "max_ejection_percent": 100}}),
            json!({}),
        ),
        spec(
            &world,
            "retries",
            json!({}),
            json!({"retry_policy": {"retry_on": "connect-failure,5xx", "num_retries": 2}}),
        ),
        spec(&world, "none", json!({}), json!({})),
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
    let dead_ip = dead_pod.ip;
    let dead = |scene: &Scene, g: &Envoy| dead_attempts(scene, g, dead_ip);
    let before = counts(&scene, &loads, dead)?;
    let judged_before = judged_all(&scene)?;
    scene.world.destroy(&dead_pod.name)?;
    scene.world.publish_truth()?;
    scene.world.stop_address(dead_pod.ip)?;
    let mut deleted = watch(&scene, &loads, before, dead_pod.ip, window, dead).await?;

    // === (b) an IP is recycled: another app answers there ===
    eprintln!(
        "reaction: (b) recycling {} ({}) to `other`",
        recycled_pod.name, recycled_pod.ip
    );
    let recycled_ip = recycled_pod.ip;
    let wrong = |scene: &Scene, g: &Envoy| Ok(wrong_at(scene, g, recycled_ip));
    let before = counts(&scene, &loads, wrong)?;
    let judged_between = judged_all(&scene)?;
    for (w, (a, b)) in deleted
        .iter_mut()
        .zip(judged_between.iter().zip(&judged_before))
    {
        w.judged = a - b;
    }
    scene.world.recycle(recycled_pod.ip, "other")?;
    scene.world.publish_truth()?;
    scene.world.settle();
    let mut recycled = watch(&scene, &loads, before, recycled_pod.ip, window, wrong).await?;
    let judged_after = judged_all(&scene)?;
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

/// Every gateway's `count` and its clients' outcomes so far: where a
/// [`watch`] starts.
fn counts(
    scene: &Scene,
    loads: &[Load],
    count: impl Fn(&Scene, &Envoy) -> Result<u64>,
) -> Result<Vec<(Outcomes, u64)>> {
    scene
        .gateways
        .iter()
        .zip(loads)
        .map(|(g, l)| Ok((l.outcomes(), count(scene, g)?)))
        .collect()
}

/// Watches every gateway for `window` after an event at `ip`, from `before`
/// ([`counts`] just before it): `count` (what reached the bad address so
/// far) every [`POLL`], then the clients' outcomes and Envoy's view of the
/// host.
async fn watch(
    scene: &Scene,
    loads: &[Load],
    before: Vec<(Outcomes, u64)>,
    ip: IpAddr,
    window: Duration,
    count: impl Fn(&Scene, &Envoy) -> Result<u64>,
) -> Result<Vec<Watch>> {
    let t0 = Instant::now();
    let mut watches: Vec<Watch> = before
        .into_iter()
        .map(|(o, n)| Watch {
            series: vec![(Duration::ZERO, n)],
            outcomes_before: o,
            ..Watch::default()
        })
        .collect();
    while t0.elapsed() < window {
        tokio::time::sleep(POLL).await;
        for (g, w) in scene.gateways.iter().zip(&mut watches) {
            w.series.push((t0.elapsed(), count(scene, g)?));
        }
    }
    for ((l, w), g) in loads.iter().zip(&mut watches).zip(&scene.gateways) {
        w.outcomes_after = l.outcomes();
        w.flags = health_flags(scene, g, ip)?;
    }
    Ok(watches)
}

/// Failed connection attempts at `ip` in the gateway's web cluster, minus
/// (for the guarded gateway) the requests its filter judged not a member.
fn dead_attempts(scene: &Scene, g: &Envoy, ip: IpAddr) -> Result<u64> {
    let refused: u64 = web_host_stat(scene, g, ip, "cx_connect_fail")?
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    if !g.guarded {
        return Ok(refused);
    }
    Ok(refused.saturating_sub(judged(g)?))
}

/// Envoy's `health_flags` for `ip` in the gateway's web cluster.
fn health_flags(scene: &Scene, g: &Envoy, ip: IpAddr) -> Result<String> {
    Ok(web_host_stat(scene, g, ip, "health_flags")?.map_or("?".into(), |v| format!("`{v}`")))
}

/// One of the host lines `/clusters` prints for `ip` in the gateway's web
/// cluster (`<cluster>::<address>::<field>::<value>`), if present.
fn web_host_stat(scene: &Scene, g: &Envoy, ip: IpAddr, field: &str) -> Result<Option<String>> {
    let text = g.admin("/clusters")?;
    let prefix = format!(
        "{}::{}::{field}::",
        cluster_name("web"),
        scene.world.addr(ip)
    );
    Ok(text
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .map(|v| v.trim().to_owned()))
}

/// Every gateway's filter verdicts other than `member` so far (0 unguarded).
fn judged_all(scene: &Scene) -> Result<Vec<u64>> {
    scene
        .gateways
        .iter()
        .map(|g| if g.guarded { judged(g) } else { Ok(0) })
        .collect()
}

fn judged(g: &Envoy) -> Result<u64> {
    let stats = g.stats()?;
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
fn wrong_at(scene: &Scene, g: &Envoy, ip: IpAddr) -> u64 {
    let tallies: BTreeMap<_, _> = scene.world.tallies_at(&[ip]);
    via(&tallies, &g.name).wrong_service
}
