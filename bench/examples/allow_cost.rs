//! What issue 21 costs the allow path (docs/benchmarks.md, "The allow path
//! before and after issue 21"): the shipped `deploy/envoy/envoy.yaml` and
//! module of an earlier commit against today's, both over the same two live
//! pods and the same validator, no stale endpoint. Two Envoys (one worker
//! each) run side by side; each round sends sequential GETs, then POSTs with
//! a 2 KiB body (the body path), through one gateway and then the other, the
//! order swapped every round. Envoy CPU per request (utime + stime of every
//! thread, clock ticks) is the median over rounds; client latency p50/p99 is
//! over every request of a gateway.
//!
//! ```text
//! . scripts/setup.sh && sg_setup_envoy && sg_build_filter
//! git worktree add /tmp/before 30e4ea6
//! (cd /tmp/before && CARGO_TARGET_DIR=/tmp/before-target cargo build -p staleguard-filter \
//!     --target wasm32-wasip1 --profile wasm-release)
//! BEFORE_WASM=/tmp/before-target/wasm32-wasip1/wasm-release/staleguard_filter.wasm \
//! BEFORE_YAML=/tmp/before/deploy/envoy/envoy.yaml \
//!   cargo run --release -p staleguard-bench --example allow_cost
//! # ROUNDS=9 REQUESTS=400 are the defaults
//! ```

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde_json::Value;
use staleguard_bench::{cpu_ticks, env_usize, loadavg, median, ticks_us};
use staleguard_tests::blocking;
use staleguard_tests::envoy::{dependencies, gateway_on_loopback, shipped_gateway, Envoy, Launch};
use staleguard_tests::fake_validator::FakeValidator;
use staleguard_tests::incident::{Endpoints, Mix};
use staleguard_tests::process::free_addr;

/// One gateway under test, and what was measured through it.
struct Side {
    name: &'static str,
    envoy: Envoy,
    /// Envoy CPU per request, one value per round: GETs, POSTs.
    cpu_us: [Vec<f64>; 2],
    /// Client latency of every request, in microseconds: GETs, POSTs.
    latency_us: [Vec<f64>; 2],
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

fn main() -> Result<()> {
    let rounds = env_usize("ROUNDS", 9);
    let requests = env_usize("REQUESTS", 400);
    let (Some(before_wasm), Some(before_yaml)) = (
        std::env::var_os("BEFORE_WASM").map(PathBuf::from),
        std::env::var_os("BEFORE_YAML").map(PathBuf::from),
    ) else {
        bail!("set BEFORE_WASM and BEFORE_YAML (the module and deploy/envoy/envoy.yaml of the commit to compare with; see the module docs)");
    };
    let Some((envoy, wasm)) = dependencies() else {
        bail!("Envoy or the filter module is missing: . scripts/setup.sh && sg_setup_envoy && sg_build_filter");
    };
    let before_doc: Value = yaml_serde::from_str(
        &std::fs::read_to_string(&before_yaml)
            .with_context(|| format!("read {}", before_yaml.display()))?,
    )
    .with_context(|| format!("parse {}", before_yaml.display()))?;

    let pods = Endpoints::start(27, Mix::HEALTHY)?;
    let validator = FakeValidator::start(2700)?;
    let (services, records) = pods.index();
    validator.set_index(services, records);
    let cart = pods.addrs();
    let start = |name: &'static str, bootstrap: &Value| -> Result<Side> {
        let launch = Launch {
            name: name.into(),
            concurrency: 1,
            env: vec![],
            detach: false,
        };
        let envoy = Envoy::spawn(&envoy, bootstrap, &launch)?;
        envoy.wait_first_sync()?;
        Ok(Side {
            name,
            envoy,
            cpu_us: [vec![], vec![]],
            latency_us: [vec![], vec![]],
        })
    };
    let (l, a) = (free_addr()?, free_addr()?);
    let before = gateway_on_loopback(&before_doc, &before_wasm, l, a, validator.addr(), &cart);
    let (l, a) = (free_addr()?, free_addr()?);
    let after = shipped_gateway(&wasm, l, a, validator.addr(), &cart);
    let mut sides = [start("before", &before)?, start("after", &after)?];

    let body = vec![b'x'; 2 << 10];
    println!(
        "allow path: {rounds} rounds x {requests} GETs and {requests} POSTs (2 KiB) per gateway, load {}",
        loadavg()
    );
    for round in 0..rounds {
        let order: [usize; 2] = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        for i in order {
            let side = &mut sides[i];
            for (m, (method, body)) in [("GET", None), ("POST", Some(body.as_slice()))]
                .into_iter()
                .enumerate()
            {
                let cpu0 = cpu_ticks(side.envoy.pid())?;
                for n in 0..requests {
                    let started = Instant::now();
                    let r = blocking::request(
                        side.envoy.listener,
                        method,
                        &format!("/cart/{round}/{n}"),
                        &[],
                        body,
                    )?;
                    side.latency_us[m].push(started.elapsed().as_secs_f64() * 1e6);
                    if r.status != 200 {
                        bail!("{} {method}: {} {:?}", side.name, r.status, r.headers);
                    }
                }
                let cpu = cpu_ticks(side.envoy.pid())? - cpu0;
                side.cpu_us[m].push(ticks_us(cpu) / requests as f64);
            }
        }
    }
    // Paired: after / before of each round (before the table sorts them).
    let mut ratio_lines = vec![];
    for (m, method) in ["GET", "POST"].iter().enumerate() {
        let mut ratios: Vec<f64> = sides[1].cpu_us[m]
            .iter()
            .zip(&sides[0].cpu_us[m])
            .map(|(a, b)| a / b)
            .collect();
        ratio_lines.push(format!(
            "{method}: after/before CPU per request, median of the rounds' ratios: {:.3}",
            median(&mut ratios)
        ));
    }
    println!(
        "{:8} {:>24} {:>20} {:>24} {:>20}",
        "gateway",
        "GET CPU/req (quartiles)",
        "GET p50 / p99",
        "POST CPU/req (quartiles)",
        "POST p50 / p99"
    );
    for side in &mut sides {
        let mut cols = vec![];
        for m in 0..2 {
            let cpu = &mut side.cpu_us[m];
            let (q1, med, q3) = (percentile(cpu, 0.25), median(cpu), percentile(cpu, 0.75));
            let lat = &mut side.latency_us[m];
            let (p50, p99) = (percentile(lat, 0.5), percentile(lat, 0.99));
            cols.push(format!("{med:.0} us ({q1:.0}-{q3:.0})"));
            cols.push(format!("{p50:.0} / {p99:.0} us"));
        }
        println!(
            "{:8} {:>24} {:>20} {:>24} {:>20}",
            side.name, cols[0], cols[1], cols[2], cols[3]
        );
    }
    for line in ratio_lines {
        println!("{line}");
    }
    println!("load at the end {}", loadavg());
    Ok(())
}
