//! What keeping a gateway's copy of the index costs the filter: the size of a
//! full snapshot and of a delta, and the time to decode and apply each, natively
//! and inside Envoy's V8, on one machine in one run.
//!
//! ```text
//! . scripts/setup.sh && sg_setup_all
//! cargo run --release -p staleguard-bench --example snapshot_cost
//! ```
//!
//! `PODS` (150000) pods in `SERVICES` (1000) services; `CHANGES` (100) pods
//! deleted or re-created per delta; `ROUNDS` (7) measurements of each, medians
//! reported. The validator's API runs in this process on loopback; Envoy 1.40
//! runs the release filter as an upstream filter with the validator as its
//! cluster. In V8 the time is the filter's own `sync_apply_us` gauge: from the
//! answer's arrival to shared data written (decode + one write per IP).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result};
use kube::runtime::watcher::Event;
use staleguard_bench::{env_usize, index_gateway, median, wait_loaded, MISSING};
use staleguard_core::{Changes, Freshness, IpRecord};
use staleguard_engine::store::MemoryStore;
use staleguard_engine::sync::{Poller, Request, SyncConfig};
use staleguard_validator::api::{self, ApiConfig};
use staleguard_validator::index::{Index, IndexConfig};
use staleguard_validator::live::SharedIndex;
use staleguard_validator::synth;

const SYNC: SyncConfig = SyncConfig {
    wait_s: 30,
    backoff_initial_ms: 100,
    backoff_max_ms: 1000,
    min_interval_ms: 0,
    page_bytes: None,
};

fn main() -> Result<()> {
    let services = env_usize("SERVICES", 1000);
    let pods = env_usize("PODS", 150_000);
    let changes = env_usize("CHANGES", 100);
    let rounds = env_usize("ROUNDS", 7).max(1);

    let shared = SharedIndex::new(
        Index::new(1, IndexConfig::default()),
        Duration::from_secs(3600),
    );
    let cluster = synth::cluster(services, pods / services);
    let victims: Vec<_> = cluster
        .pods
        .iter()
        .step_by(pods / changes)
        .take(changes)
        .cloned()
        .collect();
    synth::feed(&shared, cluster);
    let fresh = || Freshness {
        fresh: true,
        age_ms: Some(0),
    };

    // === sizes and native cost ===
    let toggle = |present: bool| {
        for pod in &victims {
            let event = if present {
                Event::Delete(pod.clone())
            } else {
                Event::Apply(pod.clone())
            };
            shared.apply_pod(event, SystemTime::now());
        }
    };
    // Gateways ask for the verdict view (`?view=verdict`); the full one is
    // measured for its size only.
    let g0 = shared.read().generation();
    let full = serde_json::to_vec(&shared.read().snapshot(fresh()))?;
    let mut slim = shared.read().snapshot(fresh());
    slim.records = slim
        .records
        .into_iter()
        .map(IpRecord::verdict_view)
        .collect();
    let records = slim.records.len();
    let snapshot = serde_json::to_vec(&slim)?;
    toggle(true);
    let mut slim_delta = shared.read().changes_since(g0, fresh()).context("delta")?;
    slim_delta.upserts = slim_delta
        .upserts
        .into_iter()
        .map(IpRecord::verdict_view)
        .collect();
    let delta = serde_json::to_vec(&Changes::Delta(slim_delta))?;
    toggle(false);
    println!("index: {records} IPs in {services} services; a delta of {changes} deleted pods");
    println!(
        "  snapshot JSON, full view     {:>12} bytes ({:.0} bytes per IP)",
        full.len(),
        full.len() as f64 / records as f64
    );
    println!(
        "  snapshot JSON, verdict view  {:>12} bytes ({:.0} bytes per IP)",
        snapshot.len(),
        snapshot.len() as f64 / records as f64
    );
    println!("  delta JSON, verdict view     {:>12} bytes", delta.len());

    let mut decode = Vec::new();
    let mut apply_snapshot = Vec::new();
    let mut apply_delta = Vec::new();
    for _ in 0..rounds {
        let t = Instant::now();
        let parsed = staleguard_core::Snapshot::from_json(&snapshot)?;
        decode.push(t.elapsed());
        assert_eq!(parsed.records.len(), records);
        let mut store = MemoryStore::default();
        let mut poller = Poller::new(SYNC, 1);
        assert_eq!(poller.next_request(0, &store), Some(Request::Snapshot));
        let t = Instant::now();
        poller
            .on_response(0, 200, &snapshot, &mut store)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        apply_snapshot.push(t.elapsed());
        assert!(matches!(
            poller.next_request(1, &store),
            Some(Request::Changes { .. })
        ));
        let t = Instant::now();
        poller
            .on_response(1, 200, &delta, &mut store)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        apply_delta.push(t.elapsed());
    }
    let native_snapshot = median(&mut apply_snapshot);
    let native_delta = median(&mut apply_delta);
    println!("native, verdict view (medians of {rounds}):");
    println!("  snapshot JSON parse alone      {:?}", median(&mut decode));
    println!("  snapshot decode + apply        {native_snapshot:?}");
    println!("  delta decode + apply           {native_delta:?}");

    // === inside Envoy's V8 ===
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let validator = runtime.block_on(async {
        let config = ApiConfig {
            listen: "127.0.0.1:0".parse()?,
            admin_listen: "127.0.0.1:0".parse()?,
            ..ApiConfig::default()
        };
        let (addr, _admin) = api::spawn(shared.clone(), &config).await?;
        Ok::<_, anyhow::Error>(addr)
    })?;
    let gateway = index_gateway(validator);
    let mut v8_snapshot = Vec::new();
    let mut v8_delta = Vec::new();
    for round in 0..rounds {
        let envoy = gateway.start()?.context(MISSING)?;
        wait_loaded(&envoy, Duration::from_secs(120))?;
        v8_snapshot.push(Duration::from_micros(
            envoy.stat("wasmcustom.staleguard_filter_sync_apply_microseconds")?,
        ));
        if round == 0 {
            println!(
                "  (Envoy: {} entries loaded)",
                envoy.stat("wasmcustom.staleguard_filter_index_entries")?
            );
        }
        // Deltas: delete the victims, then bring them back, each one answer.
        for present in [true, false] {
            let before = envoy.stat("wasmcustom.staleguard_filter_index_generation")?;
            toggle(present);
            let target = shared.read().generation();
            envoy.eventually("the delta is applied", Duration::from_secs(30), |e| {
                Ok(e.stat("wasmcustom.staleguard_filter_index_generation")? >= target)
            })?;
            if before < target {
                v8_delta.push(Duration::from_micros(
                    envoy.stat("wasmcustom.staleguard_filter_sync_apply_microseconds")?,
                ));
            }
        }
        drop(envoy);
    }
    let v8_snapshot = median(&mut v8_snapshot);
    let v8_delta = median(&mut v8_delta);
    println!(
        "inside Envoy 1.40's V8, verdict view (medians of {rounds} snapshots and {} deltas):",
        rounds * 2
    );
    println!(
        "  snapshot decode + apply        {v8_snapshot:?}  ({:.1}x native)",
        v8_snapshot.as_secs_f64() / native_snapshot.as_secs_f64()
    );
    println!(
        "  delta decode + apply           {v8_delta:?}  ({:.1}x native)",
        v8_delta.as_secs_f64() / native_delta.as_secs_f64()
    );
    Ok(())
}
