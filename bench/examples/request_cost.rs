//! What the filter costs Envoy per request, next to the floor of any Wasm
//! filter: CPU time per request of gateways that differ only in their
//! cluster's upstream filter, on the allow path and on the reject path.
//!
//! ```text
//! . scripts/setup.sh && sg_setup_all
//! NOOP_WASM=/path/noop.wasm BEFORE_WASM=/path/old/staleguard_filter.wasm \
//!   cargo run --release -p staleguard-bench --example request_cost
//! ```
//!
//! Gateways (Envoy 1.40, `--concurrency 1`, each its own process, all
//! running side by side): `none` (no upstream filter), `noop` (`NOOP_WASM`,
//! a proxy-wasm filter that does nothing: the floor), `before`
//! (`BEFORE_WASM`, another build of the filter, for an A/B; skipped when
//! unset), `floor` (`FLOOR_WASM`, optional: a module that makes only the
//! hostcalls the filter cannot avoid, two property reads, one shared-data
//! read and the clock, and decides nothing) and `after` (`STALEGUARD_WASM`,
//! this tree's build). Each has two
//! clusters: `allow`, whose host is a live member in the index, and `reject`,
//! whose host is in no record (destroyed). The filter runs the shipped
//! configuration with `"on_reject": "reject"` (a rejection is answered, not
//! replayed: the replay is measured by `retry_cost`). The index holds `PODS`
//! (150000) IPs from a fake validator. Without a filter, both clusters
//! forward.
//!
//! A measurement: `wrk -t1 -c16 -d SECONDS` (5) with keep-alive against one
//! gateway and cluster, the Envoy process's utime+stime from
//! `/proc/PID/stat` before and after, divided by the requests wrk completed.
//! `ROUNDS` (5) rounds, each measuring every gateway and path once, in an
//! order rotated per round; reported: the median of the rounds' CPU per
//! request and of the per-round ratios to `noop` on the same path.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use staleguard_bench::{
    cpu_ticks, env_usize, loadavg, median, swap_module, ticks_us, wrk, MISSING,
};
use staleguard_core::ServiceKey;
use staleguard_tests::blocking::{Answer, Server};
use staleguard_tests::envoy::{dependencies, shipped_plugin, Cluster, Envoy, Gateway};
use staleguard_tests::fake_validator::{records::pod, FakeValidator};

const ALLOW: &str = "outbound|80||cart.shop.svc.cluster.local";
const REJECT: &str = "outbound|81||cart.shop.svc.cluster.local";
const PATHS: [(&str, &str); 2] = [("allow", ALLOW), ("reject", REJECT)];

fn main() -> Result<()> {
    let pods = env_usize("PODS", 150_000);
    let rounds = env_usize("ROUNDS", 5).max(1);
    let seconds = env_usize("SECONDS", 5).max(1);
    let Some((_, after)) = dependencies() else {
        bail!(MISSING);
    };
    let noop = PathBuf::from(std::env::var("NOOP_WASM").context("NOOP_WASM: the no-op module")?);
    let before = std::env::var("BEFORE_WASM").ok().map(PathBuf::from);
    let floor = std::env::var("FLOOR_WASM").ok().map(PathBuf::from);

    // The index: `pods` IPs in 1000 services, and the live host.
    let cart = ServiceKey::new("shop", "cart");
    let live_ip = "127.0.1.90";
    let gone_ip = "127.0.1.91";
    let services: Vec<ServiceKey> = (0..1000)
        .map(|i| ServiceKey::new("bench", format!("svc-{i}")))
        .chain(std::iter::once(cart.clone()))
        .collect();
    let mut records: Vec<_> = (0..pods)
        .map(|i| {
            let ip = format!("10.{}.{}.{}", (i >> 16) & 255, (i >> 8) & 255, i & 255);
            pod(&ip, &format!("p-{i}"), &[&services[i % 1000]], false)
        })
        .collect();
    records.push(pod(live_ip, "cart-live", &[&cart], false));
    let validator = FakeValidator::start(1)?;
    validator.set_index(services, records);

    // Keep-alive upstreams answering `200 ok` at once: a connection per
    // request would add a connect to Envoy's cost.
    let upstream = |ip: &str| {
        let ok = Answer::Respond {
            status: 200,
            headers: vec![],
            body: b"ok".to_vec(),
        };
        Server::constant(SocketAddr::new(ip.parse()?, 0), ok)
    };
    let (live_server, gone_server) = (upstream(live_ip)?, upstream(gone_ip)?);
    let (live, gone) = (live_server.addr(), gone_server.addr());
    let plugin = shipped_plugin(json!({"on_reject": "reject"}));
    let gateway = |plugin: Option<Value>| {
        Gateway::new(
            validator.addr(),
            vec![
                Cluster::new(ALLOW, live, plugin.clone()),
                Cluster::new(REJECT, gone, plugin),
            ],
        )
    };
    // Every variant's module in place of the one the harness names.
    let with_module = |module: PathBuf| {
        move |config: &mut Value| {
            swap_module(config, &module);
            Ok(())
        }
    };
    let mut variants: Vec<(&str, Envoy)> = Vec::new();
    let start = |g: Gateway, module: Option<PathBuf>| -> Result<Envoy> {
        let envoy = match module {
            Some(m) => g.start_with(with_module(m))?,
            None => g.start()?,
        };
        envoy.context("Envoy is missing")
    };
    variants.push(("none", start(gateway(None), None)?));
    variants.push(("noop", start(gateway(Some(json!({}))), Some(noop))?));
    if let Some(floor) = floor {
        variants.push(("floor", start(gateway(Some(json!({}))), Some(floor))?));
    }
    if let Some(before) = before {
        variants.push((
            "before",
            start(gateway(Some(plugin.clone())), Some(before))?,
        ));
    }
    variants.push(("after", start(gateway(Some(plugin.clone())), Some(after))?));
    for (name, envoy) in variants
        .iter_mut()
        .filter(|(n, _)| *n == "before" || *n == "after")
    {
        envoy.eventually(
            &format!("{name}: the index is loaded"),
            Duration::from_secs(180),
            |e| Ok(e.stat("wasmcustom.staleguard_filter_index_entries")? >= pods as u64),
        )?;
        for (path, cluster) in PATHS {
            let r = envoy.get(cluster)?;
            let want = if path == "allow" { 200 } else { 503 };
            if r.status != want {
                bail!("{name} {path}: {} {:?}", r.status, r.header("x-staleguard"));
            }
        }
    }

    // (variant, path) -> CPU us per request, one per round.
    let mut cost: BTreeMap<(String, &str), Vec<f64>> = BTreeMap::new();
    let mut ratio: BTreeMap<(String, &str), Vec<f64>> = BTreeMap::new();
    let mut runs: Vec<(usize, &str, &str)> = Vec::new();
    for v in 0..variants.len() {
        for (path, cluster) in PATHS {
            runs.push((v, path, cluster));
        }
    }
    for round in 0..rounds {
        // Each round starts one measurement later than the last.
        if round > 0 {
            runs.rotate_left(1);
        }
        let mut this: BTreeMap<(String, &str), f64> = BTreeMap::new();
        for &(v, path, cluster) in &runs {
            let (name, envoy) = &variants[v];
            let t0 = cpu_ticks(envoy.pid())?;
            let run = wrk(envoy.listener, cluster, 16, seconds)?;
            let t1 = cpu_ticks(envoy.pid())?;
            if path == "allow" && run.bad_status > 0 {
                bail!("{name}: the allow path answered non-2xx: {run:?}");
            }
            let us = ticks_us(t1 - t0) / run.requests.max(1) as f64;
            this.insert((name.to_string(), path), us);
            cost.entry((name.to_string(), path)).or_default().push(us);
        }
        for ((name, path), us) in &this {
            if let Some(floor) = this.get(&("noop".to_string(), *path)) {
                ratio
                    .entry((name.clone(), *path))
                    .or_default()
                    .push(us / floor);
            }
        }
        eprintln!("round {}/{rounds} done", round + 1);
    }
    println!(
        "CPU per request, medians of {rounds} rounds of {seconds} s (wrk -c16, Envoy --concurrency 1, {pods} IPs; load average {})",
        loadavg()
    );
    println!(
        "{:<8} {:<7} {:>9} {:>9}",
        "filter", "path", "us/req", "x noop"
    );
    for (key, values) in &mut cost {
        let r = ratio.get_mut(key).map(|r| median(r)).unwrap_or(f64::NAN);
        println!(
            "{:<8} {:<7} {:>9.1} {:>9.3}",
            key.0,
            key.1,
            median(values),
            r
        );
    }
    drop(variants);
    Ok(())
}
