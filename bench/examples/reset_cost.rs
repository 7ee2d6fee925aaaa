//! What a full reset (a `/v1/changes` answer of kind `reset`) costs the filter
//! inside Envoy's V8, next to the first snapshot: time to decode and apply, and
//! the poller VM's memory. Not a test: a benchmark, run by hand (see
//! docs/benchmarks.md):
//!
//! ```text
//! . scripts/setup.sh && sg_setup_all
//! cargo run --release -p staleguard-bench --example reset_cost
//! ```
//!
//! The index: `PODS` (150000) pods in `SERVICES` (1000) services, built by
//! the validator's own index from synthetic objects and served, verdict view,
//! by the test harness's fake validator. Each measurement gets its own Envoy
//! start, so the VM's memory is that of one answer (Wasm memory never shrinks:
//! a second big answer in the same VM would reuse the first one's pages):
//! "snapshot" is the first answer of a filter that starts against the full
//! index; "reset" is the answer to the long poll of a filter that synced an
//! empty index when the whole index is replaced (a new epoch's worth of data:
//! the validator restarted, or the filter's generation was compacted away).
//! `ROUNDS` (5) of each, medians. Time is the filter's `staleguard_filter_sync_apply_microseconds`
//! gauge, memory its `staleguard_filter_vm_memory_bytes` gauge. The gateway runs the plugin
//! configuration deploy/ ships.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use anyhow::{bail, Context, Result};
use staleguard_bench::{env_usize, index_gateway, median, synthetic_index, wait_loaded, MISSING};
use staleguard_tests::fake_validator::FakeValidator;

fn main() -> Result<()> {
    let services = env_usize("SERVICES", 1000);
    let pods = env_usize("PODS", 150_000);
    let rounds = env_usize("ROUNDS", 5).max(1);
    let (keys, records) = synthetic_index(services, pods);
    println!("{} IPs in {} services", records.len(), keys.len());

    let measure = |full_at_start: bool| -> Result<(u64, u64)> {
        let validator = FakeValidator::start(7)?;
        if full_at_start {
            validator.set_index(keys.clone(), records.clone());
        }
        let gateway = index_gateway(validator.addr());
        let envoy = gateway.start()?.context(MISSING)?;
        wait_loaded(&envoy, Duration::from_secs(120))?;
        if !full_at_start {
            // The long poll is out; the whole index replaces the empty one.
            std::thread::sleep(Duration::from_millis(300));
            validator.set_index(keys.clone(), records.clone());
            envoy.eventually("the reset", Duration::from_secs(120), |e| {
                Ok(e.stat("wasmcustom.staleguard_filter_sync_resets_total")? >= 2)
            })?;
        }
        let entries = envoy.stat("wasmcustom.staleguard_filter_index_entries")?;
        if entries != records.len() as u64 {
            bail!("{entries} entries loaded, not {}", records.len());
        }
        // The gauges follow the answer that was applied.
        std::thread::sleep(Duration::from_millis(200));
        let us = envoy.stat("wasmcustom.staleguard_filter_sync_apply_microseconds")?;
        let mem = envoy.stat("wasmcustom.staleguard_filter_vm_memory_bytes")?;
        drop(envoy);
        Ok((us, mem))
    };
    let (mut snap_us, mut snap_mem, mut reset_us, mut reset_mem) = (vec![], vec![], vec![], vec![]);
    for _ in 0..rounds {
        let (us, mem) = measure(true)?;
        snap_us.push(us);
        snap_mem.push(mem);
        let (us, mem) = measure(false)?;
        reset_us.push(us);
        reset_mem.push(mem);
    }
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    println!(
        "{pods} pods in {services} services, verdict view, {rounds} Envoy starts each (medians):"
    );
    println!(
        "  snapshot: decode + apply {:.0} ms, poller VM memory {:.1} MiB",
        median(&mut snap_us.clone()) as f64 / 1000.0,
        mib(median(&mut snap_mem.clone()))
    );
    println!(
        "  reset:    decode + apply {:.0} ms, poller VM memory {:.1} MiB",
        median(&mut reset_us.clone()) as f64 / 1000.0,
        mib(median(&mut reset_mem.clone()))
    );
    println!(
        "  raw: snapshot us {snap_us:?} mem {snap_mem:?}; reset us {reset_us:?} mem {reset_mem:?}"
    );
    Ok(())
}
