//! What retry costs Envoy (docs/benchmarks.md, "Retry"): CPU per request on the
//! normal path with retry off and on, through the body path's internal
//! listener, and without the filter; and the latency of a replayed request
//! against a direct one. One Envoy (one worker), interleaved rounds, the
//! CPU of every Envoy thread read from /proc (schedstat, nanoseconds).
//!
//! ```text
//! . scripts/setup.sh && sg_setup_all
//! cargo run --release -p staleguard-bench --example retry_cost
//! # ROUNDS=7 REQUESTS=2000 are the defaults
//! ```

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::json;
use staleguard_bench::{env_usize, median, percentile, wait_loaded, MISSING};
use staleguard_core::ServiceKey;
use staleguard_tests::blocking::{Answer, Server};
use staleguard_tests::envoy::{
    add_twin_endpoints, body_path, shipped_plugin, Cluster, Envoy, Gateway,
};
use staleguard_tests::fake_validator::{records::pod, FakeValidator};

const SVC: &str = "cart.shop.svc.cluster.local";

fn cluster(subset: &str) -> String {
    format!("outbound|80|{subset}|{SVC}")
}

/// Nanoseconds on CPU of every thread of `pid`.
fn cpu_ns(pid: u32) -> Result<u64> {
    let mut total = 0;
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let stat = std::fs::read_to_string(task?.path().join("schedstat"))?;
        total += stat
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<u64>().ok())
            .context("schedstat")?;
    }
    Ok(total)
}

struct Mode {
    name: &'static str,
    cluster: String,
    path: &'static str,
}

fn main() -> Result<()> {
    let rounds = env_usize("ROUNDS", 7);
    let requests = env_usize("REQUESTS", 2000);
    let cart = ServiceKey::new("shop", "cart");
    // A pod that answers at once, on the async workers.
    let live = Server::constant(
        "127.0.7.2:0".parse()?,
        Answer::Respond {
            status: 200,
            headers: vec![("x-host".into(), "live".into())],
            body: b"host=live".to_vec(),
        },
    )?;
    let port = live.addr().port();
    let gone: SocketAddr = format!("127.0.7.1:{port}").parse()?;
    let _gone_server = Server::start(gone, |_| Answer::status(500, "stale"))?;
    let validator = FakeValidator::start(71)?;
    validator.set_index(
        vec![cart.clone()],
        vec![pod("127.0.7.2", "live", &[&cart], false)],
    );
    let off = shipped_plugin(json!({"on_reject": "reject"}));
    let on = shipped_plugin(json!({}));
    let gateway = Gateway::new(
        validator.addr(),
        vec![
            Cluster::new(&cluster("plain"), live.addr(), None),
            Cluster::new(&cluster("off"), live.addr(), Some(off)),
            Cluster::new(&cluster("on"), live.addr(), Some(on.clone())),
            Cluster::new(&cluster("replayed"), gone, Some(on)),
        ],
    );
    let Some(envoy) = gateway.start_with(|bootstrap| {
        // Every pick of `replayed` is the stale host; its twin also has the
        // live one, which the replay names.
        add_twin_endpoints(
            bootstrap,
            &cluster("replayed"),
            &[SocketAddr::from(([127, 0, 7, 2], port))],
        )?;
        let outer = body_path(
            bootstrap,
            "/body/",
            json!({"cluster_header": "x-cluster", "timeout": "5s"}),
            "x-staleguard",
            3,
        );
        bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
            ["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
            .as_array_mut()
            .context("routes")?
            .insert(0, outer);
        Ok(())
    })?
    else {
        bail!(MISSING);
    };
    wait_loaded(&envoy, Duration::from_secs(30))?;
    let modes = [
        Mode {
            name: "no filter",
            cluster: cluster("plain"),
            path: "/",
        },
        Mode {
            name: "filter, retry off",
            cluster: cluster("off"),
            path: "/",
        },
        Mode {
            name: "filter, retry on",
            cluster: cluster("on"),
            path: "/",
        },
        Mode {
            name: "filter, retry on, body path",
            cluster: cluster("on"),
            path: "/body/",
        },
        Mode {
            name: "filter, every pick replayed",
            cluster: cluster("replayed"),
            path: "/",
        },
    ];
    // Warm up every path.
    for m in &modes {
        for _ in 0..200 {
            check(&envoy, m)?;
        }
    }
    let mut cpu: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
    let mut latency: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
    for round in 0..rounds {
        // Each round starts with another mode, so no mode always runs first
        // (or last) while the machine's load drifts.
        for k in 0..modes.len() {
            let i = (k + round) % modes.len();
            let m = &modes[i];
            let before = cpu_ns(envoy.pid())?;
            for _ in 0..requests {
                let t = Instant::now();
                check(&envoy, m)?;
                latency[i].push(t.elapsed().as_secs_f64() * 1e6);
            }
            let spent = cpu_ns(envoy.pid())? - before;
            cpu[i].push(spent as f64 / requests as f64 / 1000.0);
        }
        eprintln!("round {} of {rounds} done", round + 1);
    }
    let replayed = envoy.stat("wasmcustom.staleguard_filter_retries_total.outcome.answered")?;
    println!(
        "{rounds} rounds x {requests} requests per mode, interleaved; {replayed} replays answered"
    );
    println!(
        "| path | Envoy CPU per request, median of rounds (quartiles) | client latency p50 | p99 |"
    );
    println!("| --- | --- | --- | --- |");
    for (i, m) in modes.iter().enumerate() {
        println!(
            "| {} | {:.1} us ({:.1}-{:.1}) | {:.0} us | {:.0} us |",
            m.name,
            median(&mut cpu[i]),
            percentile(&mut cpu[i], 0.25),
            percentile(&mut cpu[i], 0.75),
            percentile(&mut latency[i], 0.5),
            percentile(&mut latency[i], 0.99)
        );
    }
    Ok(())
}

fn check(envoy: &Envoy, m: &Mode) -> Result<()> {
    let r = envoy.send(&m.cluster, "GET", m.path, None)?;
    if r.status != 200 || r.header("x-host") != "live" {
        bail!("{}: {r:?}", m.name);
    }
    Ok(())
}
