//! What a takeover of the poller lease costs the Wasm filter: the
//! successor reads the guard's baseline from the index (docs/filter.md, "The
//! blast-radius guard"), one `get_shared_data` per bucket.
//!
//! ```text
//! . scripts/setup.sh && sg_setup_all
//! cargo run --release -p staleguard-bench --example takeover_cost   # PODS=150000 SERVICES=1000 ROUNDS=3
//! ```
//!
//! One gateway (one worker) with the synthetic index of `PODS` IPs in
//! `SERVICES` services loaded, its guarded cluster over CDS. Each of
//! `ROUNDS` rounds replaces the cluster's plugin configuration (`tick_ms`
//! alternating 500 and 600), which replaces every root context: one of the
//! new ones takes the lease and seeds its baseline. Printed per round: the
//! time the successor's log line gives for reading the index (wall time of
//! its thread, in V8), the IPs it read, and the Envoy process's CPU from the
//! update to the seeding (utime + stime, 10 ms ticks), paired with the same
//! takeover on a gateway that indexes 2 IPs (the update's own cost: new VMs
//! compiled), alternated in each round.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde_json::json;
use staleguard_bench::{
    cpu_ticks, env_usize, loadavg, median, synthetic_index, ticks_us, wait_loaded, MISSING,
};
use staleguard_tests::envoy::{shipped_plugin, Cluster, Envoy, Gateway};
use staleguard_tests::fake_validator::FakeValidator;

const CLUSTER: &str = "outbound|80||svc-0.bench.svc.cluster.local";
const LEASE_ACQUIRED: &str = "wasmcustom.staleguard_filter_sync_lease_acquired_total";
const SEEDED: &str = "the guard's baseline is the index's: ";

fn cluster(tick_ms: u64) -> Cluster {
    Cluster::new(
        CLUSTER,
        SocketAddr::from(([127, 0, 1, 250], 9)),
        Some(shipped_plugin(json!({ "tick_ms": tick_ms }))),
    )
}

/// The IPs and milliseconds of every seeding line in `log`.
fn seedings(log: &str) -> Vec<(u64, u64)> {
    log.lines()
        .filter_map(|line| {
            let rest = &line[line.find(SEEDED)? + SEEDED.len()..];
            let ips = rest.split(' ').next()?.parse().ok()?;
            let ms = rest.rsplit_once("read in ")?.1.strip_suffix(" ms")?;
            Some((ips, ms.trim().parse().ok()?))
        })
        .collect()
}

/// A gateway with `records` indexed, loaded.
fn loaded(validator: &FakeValidator) -> Result<Envoy> {
    let gateway = Gateway {
        dynamic: vec![cluster(1_000)],
        ..Gateway::new(validator.addr(), vec![])
    };
    let envoy = gateway.start()?.context(MISSING)?;
    wait_loaded(&envoy, Duration::from_secs(180))?;
    Ok(envoy)
}

/// One takeover on `envoy` (`round` picks the configuration): the IPs the
/// successor read, the milliseconds its log line gives, and the Envoy
/// process's CPU from the update to that line.
fn takeover(envoy: &Envoy, round: usize) -> Result<(u64, u64, u64)> {
    let before = seedings(&envoy.log()).len();
    let acquired = envoy.stat(LEASE_ACQUIRED)?;
    let ticks = cpu_ticks(envoy.pid())?;
    envoy.update_clusters(&[cluster(if round % 2 == 0 { 500 } else { 600 })])?;
    envoy.eventually("the lease taken over", Duration::from_secs(60), |e| {
        Ok(e.stat(LEASE_ACQUIRED)? > acquired && seedings(&e.log()).len() > before)
    })?;
    let cpu = cpu_ticks(envoy.pid())?.saturating_sub(ticks);
    let Some(&(read, took)) = seedings(&envoy.log()).last() else {
        bail!("no seeding logged");
    };
    Ok((read, took, cpu))
}

fn main() -> Result<()> {
    let services = env_usize("SERVICES", 1000);
    let pods = env_usize("PODS", 150_000);
    let rounds = env_usize("ROUNDS", 3).max(1);
    let (keys, records) = synthetic_index(services, pods);
    let ips = records.len();
    let full = FakeValidator::start(7)?;
    full.set_index(keys.clone(), records.clone());
    let small = FakeValidator::start(8)?;
    small.set_index(keys, records.into_iter().take(2).collect());
    let full = (loaded(&full)?, full);
    let small = (loaded(&small)?, small);
    println!(
        "{ips} IPs in {services} services, load average {}",
        loadavg()
    );
    let (mut ms, mut full_cpu, mut small_cpu) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..rounds {
        let (read, took, cpu) = takeover(&full.0, round)?;
        let (_, _, idle) = takeover(&small.0, round)?;
        println!(
            "  round {round}: {read} IPs read in {took} ms (wall); Envoy CPU from the update to the seeding {:.0} ms, {:.0} ms with 2 IPs",
            ticks_us(cpu) / 1e3,
            ticks_us(idle) / 1e3
        );
        ms.push(took);
        full_cpu.push(cpu);
        small_cpu.push(idle);
    }
    println!(
        "  medians of {rounds}: {} ms wall; Envoy CPU {:.0} ms, {:.0} ms with 2 IPs (load average {})",
        median(&mut ms),
        ticks_us(median(&mut full_cpu)) / 1e3,
        ticks_us(median(&mut small_cpu)) / 1e3,
        loadavg()
    );
    Ok(())
}
