//! The incident at its proportions (issue 21; docs/benchmarks.md, "Retry")
//! against the alternatives: the shipped `deploy/envoy/envoy.yaml` with and
//! without the filter, and without it but with Envoy's own defences (active
//! health checks, outlier detection) on the guarded cluster. Each gateway
//! gets the same endpoints (2 live, the rest recycled, blackholed, refusing
//! and hung: `staleguard_tests::incident`) and the same load (16 clients;
//! GET, HEAD, POST, PUT, PATCH; bodies up to 1 MiB), after its defence has
//! had the time to act (the first sync; three failed health checks). A last
//! row runs the shipped gateway over endpoints that are all live (no stale
//! endpoint): issue 21's latency bar is the incident's p99 no more than
//! 50 ms above that row's, and the run ends with that comparison.
//!
//! ```text
//! . scripts/setup.sh && sg_setup_envoy && sg_build_filter
//! cargo run --release -p staleguard-bench --example incident
//! # REQUESTS=320 per client through staleguard, UNGUARDED_REQUESTS=20
//! # through the others (where a hung pod holds a request for the route's
//! # 15 s timeout)
//! ```

use std::time::Duration;

use anyhow::{bail, Result};
use serde_json::{json, Value};
use staleguard_bench::env_usize;
use staleguard_tests::envoy::{cluster_mut, dependencies, shipped_gateway, Envoy, Launch};
use staleguard_tests::fake_validator::FakeValidator;
use staleguard_tests::incident::{self, Endpoints, Load, Mix, ALL};
use staleguard_tests::process::free_addr;

/// One gateway: a name, an edit of the shipped bootstrap, and how long its
/// defence needs before the load.
struct Variant {
    name: &'static str,
    edit: fn(&mut Value) -> Result<()>,
    /// Runs the filter: wait for its first sync.
    guarded: bool,
    /// Over the all-live endpoints (the latency baseline), not the incident's.
    healthy: bool,
    settle: Duration,
}

/// Takes every staleguard filter out of the bootstrap (the routes and the
/// rest stay as shipped).
fn without_filter(bootstrap: &mut Value) -> Result<()> {
    for name in ["shop-cart", "shop-cart|staleguard-twin", "staleguard-body"] {
        let c = cluster_mut(bootstrap, name)?;
        for hpo in c["typed_extension_protocol_options"]
            .as_object_mut()
            .into_iter()
            .flat_map(|o| o.values_mut())
        {
            if let Some(filters) = hpo["http_filters"].as_array_mut() {
                filters.retain(|f| f["name"] != "envoy.filters.http.wasm");
            }
        }
    }
    Ok(())
}

fn shipped(_: &mut Value) -> Result<()> {
    Ok(())
}

/// Active health checks as `alternatives_reaction` runs them: every 5 s,
/// unhealthy after 3 failures.
fn health_checks(bootstrap: &mut Value) -> Result<()> {
    without_filter(bootstrap)?;
    cluster_mut(bootstrap, "shop-cart")?["health_checks"] = json!([{
        "timeout": "1s",
        "interval": "5s",
        "no_traffic_interval": "5s",
        "unhealthy_threshold": 3,
        "healthy_threshold": 1,
        "http_health_check": {"path": "/healthz"},
    }]);
    Ok(())
}

/// Outlier detection with Envoy's defaults.
fn outlier_detection(bootstrap: &mut Value) -> Result<()> {
    without_filter(bootstrap)?;
    cluster_mut(bootstrap, "shop-cart")?["outlier_detection"] = json!({});
    Ok(())
}

fn main() -> Result<()> {
    let Some((envoy, wasm)) = dependencies() else {
        bail!("Envoy or the filter module is missing: run `. scripts/setup.sh && sg_setup_all`");
    };
    let guarded_load = Load::incident(env_usize("REQUESTS", 320));
    let unguarded_load = Load::incident(env_usize("UNGUARDED_REQUESTS", 20));
    let endpoints = Endpoints::start(25, Mix::INCIDENT)?;
    let validator = FakeValidator::start(2500)?;
    let (services, records) = endpoints.index();
    validator.set_index(services, records);
    let healthy = Endpoints::start(26, Mix::HEALTHY)?;
    let validator_ok = FakeValidator::start(2600)?;
    let (services, records) = healthy.index();
    validator_ok.set_index(services, records);
    let variants = [
        Variant {
            name: "no filter",
            edit: without_filter,
            guarded: false,
            healthy: false,
            settle: Duration::ZERO,
        },
        Variant {
            name: "staleguard (shipped)",
            edit: shipped,
            guarded: true,
            healthy: false,
            settle: Duration::ZERO,
        },
        Variant {
            name: "health checks",
            edit: health_checks,
            guarded: false,
            healthy: false,
            settle: Duration::from_secs(16),
        },
        Variant {
            name: "outlier detection",
            edit: outlier_detection,
            guarded: false,
            healthy: false,
            settle: Duration::ZERO,
        },
        Variant {
            name: "staleguard (shipped), 0 stale",
            edit: shipped,
            guarded: true,
            healthy: true,
            settle: Duration::ZERO,
        },
    ];
    // p99 of the guarded incident and of its all-live baseline.
    let (mut incident_p99, mut baseline_p99) = (None, None);
    println!(
        "| gateway | answered by a live pod | wrong service | requests at stale pods (probes included) | failed | p50 | p99 | slowest |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    for v in variants {
        let (before_recycled, before_hung) = (
            endpoints.hits(incident::Kind::Recycled),
            endpoints.hits(incident::Kind::Hung),
        );
        let (listener, admin) = (free_addr()?, free_addr()?);
        let (over, index) = if v.healthy {
            (&healthy, &validator_ok)
        } else {
            (&endpoints, &validator)
        };
        let mut bootstrap = shipped_gateway(&wasm, listener, admin, index.addr(), &over.addrs());
        (v.edit)(&mut bootstrap)?;
        let launch = Launch {
            name: v.name.replace(|c: char| !c.is_ascii_alphanumeric(), "-"),
            concurrency: 2,
            env: vec![],
            detach: false,
        };
        let gateway = Envoy::spawn(&envoy, &bootstrap, &launch)?;
        if v.guarded {
            gateway.wait_first_sync()?;
        }
        std::thread::sleep(v.settle);
        eprintln!("incident: {} ...", v.name);
        let load = if v.guarded {
            &guarded_load
        } else {
            &unguarded_load
        };
        let reports = incident::run(gateway.listener, load)?;
        drop(gateway);
        let all = &reports[ALL];
        if v.guarded {
            let p99 = Some(all.percentile(99.0));
            if v.healthy {
                baseline_p99 = p99;
            } else {
                incident_p99 = p99;
            }
        }
        let stale = endpoints.hits(incident::Kind::Recycled) - before_recycled
            + endpoints.hits(incident::Kind::Hung)
            - before_hung;
        let share = |n: u64| n as f64 * 100.0 / all.sent.max(1) as f64;
        println!(
            "| {} | {:.2}% | {:.2}% | {stale} | {:.2}% | {:.1} ms | {:.1} ms | {:.0} ms |",
            v.name,
            share(all.answered),
            share(all.wrong_service),
            share(all.failures()),
            all.percentile(50.0).as_secs_f64() * 1e3,
            all.percentile(99.0).as_secs_f64() * 1e3,
            all.percentile(100.0).as_secs_f64() * 1e3,
        );
        for (method, r) in reports.iter().filter(|(m, _)| m.as_str() != ALL) {
            eprintln!("  {} {method:5} {}", v.name, r.line());
        }
    }
    if let (Some(incident), Some(baseline)) = (incident_p99, baseline_p99) {
        let above = incident.as_secs_f64() * 1e3 - baseline.as_secs_f64() * 1e3;
        println!(
            "\nstaleguard's p99 during the incident is {above:.1} ms above its p99 with no stale endpoint (target <= 50 ms: {})",
            if above <= 50.0 { "met" } else { "missed" }
        );
    }
    Ok(())
}
