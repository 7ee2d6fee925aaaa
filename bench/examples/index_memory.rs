//! What the index costs the gateway's memory (issue 14): Envoy's resident set
//! after a full snapshot of `PODS` IPs, per IP, above a floor, and how much of
//! it is the poller VM's linear memory. Not a test: a benchmark, run by hand
//! (see docs/benchmarks.md, "The index in the gateway's memory"):
//!
//! ```text
//! . scripts/setup.sh && sg_setup_all
//! NOOP_WASM=/path/to/noop.wasm cargo run --release -p staleguard-bench --example index_memory
//! ```
//!
//! Each round starts three Envoys (`--concurrency 1`, the plugin
//! configuration deploy/ ships, one guarded cluster and its twin):
//!
//! - **noop**: the same gateway with a module whose filter does nothing
//!   (`NOOP_WASM`, e.g. the `bench/filters` no-op; skipped when unset): the
//!   floor any Wasm filter pays;
//! - **empty**: staleguard synced to an empty index;
//! - **full**: the same Envoy after the validator's index became `PODS` pods
//!   in `SERVICES` services (verdict view; the filter applies it as a reset).
//!
//! Resident set: `VmRSS` of the Envoy process, read `SETTLE_MS` (2000) after
//! the answer was applied. VM memory: the filter's
//! `staleguard_filter_vm_memory_bytes` gauge (the poller VM's linear memory,
//! which never shrinks: its peak). The rest of the growth is Envoy's: shared
//! data and what its allocator keeps of the answer's buffers. `ROUNDS` (3),
//! medians. `RESETS` (1): how many times the full index is applied as a
//! reset before the measurement (the validator restarts between them), since
//! a Wasm VM's memory never shrinks and a reset's peak could creep.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use staleguard_bench::{env_usize, index_gateway, median, rss_kib, swap_module, synthetic_index};
use staleguard_tests::envoy::Envoy;
use staleguard_tests::fake_validator::FakeValidator;

fn started(envoy: Option<Envoy>) -> Result<Envoy> {
    envoy.context("Envoy or the filter module is missing: run `. scripts/setup.sh && sg_setup_all`")
}

fn main() -> Result<()> {
    let services = env_usize("SERVICES", 1000);
    let pods = env_usize("PODS", 150_000);
    let rounds = env_usize("ROUNDS", 3).max(1);
    let resets = env_usize("RESETS", 1).max(1) as u64;
    let settle = Duration::from_millis(env_usize("SETTLE_MS", 2000) as u64);
    let noop: Option<PathBuf> = std::env::var_os("NOOP_WASM").map(PathBuf::from);

    let (keys, records) = synthetic_index(services, pods);
    let ips = records.len() as u64;
    println!("{ips} IPs in {} services", keys.len());

    let noop_rss = |module: &Path| -> Result<u64> {
        let validator = FakeValidator::start(7)?;
        let envoy = started(index_gateway(validator.addr()).start_with(|config| {
            swap_module(config, module);
            Ok(())
        })?)?;
        std::thread::sleep(settle);
        let rss = rss_kib(envoy.pid())? * 1024;
        drop(envoy);
        Ok(rss)
    };
    let ours_rss = || -> Result<[u64; 6]> {
        let validator = FakeValidator::start(7)?;
        let envoy = started(index_gateway(validator.addr()).start()?)?;
        envoy.eventually("the first answer", Duration::from_secs(120), |e| {
            Ok(e.stat("wasmcustom.staleguard_filter_sync_resets_total")? >= 1)
        })?;
        std::thread::sleep(settle);
        let empty_rss = rss_kib(envoy.pid())? * 1024;
        let empty_vm = envoy.stat("wasmcustom.staleguard_filter_vm_memory_bytes")?;
        validator.set_index(keys.clone(), records.clone());
        envoy.eventually("the reset", Duration::from_secs(180), |e| {
            Ok(e.stat("wasmcustom.staleguard_filter_sync_resets_total")? >= 2)
        })?;
        for again in 1..resets {
            // A restarted validator: a new epoch, the same index, a reset.
            validator.restart(7 + again);
            envoy.eventually("another reset", Duration::from_secs(180), |e| {
                Ok(e.stat("wasmcustom.staleguard_filter_sync_resets_total")? >= 2 + again)
            })?;
        }
        let entries = envoy.stat("wasmcustom.staleguard_filter_index_entries")?;
        if entries != ips {
            bail!("{entries} entries loaded, not {ips}");
        }
        std::thread::sleep(settle);
        let full_rss = rss_kib(envoy.pid())? * 1024;
        let full_vm = envoy.stat("wasmcustom.staleguard_filter_vm_memory_bytes")?;
        let apply_us = envoy.stat("wasmcustom.staleguard_filter_sync_apply_microseconds")?;
        let bytes = envoy.stat("wasmcustom.staleguard_filter_sync_received_bytes_total")?;
        drop(envoy);
        Ok([empty_rss, empty_vm, full_rss, full_vm, apply_us, bytes])
    };

    let mut rows: Vec<[u64; 6]> = vec![];
    let mut floors: Vec<u64> = vec![];
    for round in 0..rounds {
        // Alternate which gateway starts first, so a drift in the machine's
        // state does not always favour the same one.
        if round % 2 == 1 {
            rows.push(ours_rss()?);
        }
        if let Some(module) = &noop {
            floors.push(noop_rss(module)?);
        }
        if round % 2 == 0 {
            rows.push(ours_rss()?);
        }
    }
    let col = |i: usize| median(&mut rows.iter().map(|r| r[i]).collect::<Vec<_>>());
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    let per_ip = |b: u64| b as f64 / ips as f64;
    let (empty_rss, empty_vm, full_rss, full_vm, apply_us, bytes) =
        (col(0), col(1), col(2), col(3), col(4), col(5));
    println!(
        "{ips} IPs, {rounds} rounds (medians), {resets} reset(s) of the full index, Envoy --concurrency 1, shipped plugin:"
    );
    if !floors.is_empty() {
        let floor = median(&mut floors.clone());
        println!("  noop module RSS:        {:7.1} MiB", mib(floor));
        println!(
            "  staleguard, full index: {:7.1} MiB = {:.0} bytes per IP above the noop",
            mib(full_rss),
            per_ip(full_rss.saturating_sub(floor))
        );
    }
    println!(
        "  staleguard, empty:      {:7.1} MiB (poller VM {:.1} MiB)",
        mib(empty_rss),
        mib(empty_vm)
    );
    println!(
        "  staleguard, full:       {:7.1} MiB (poller VM {:.1} MiB), {:.0} bytes per IP above empty",
        mib(full_rss),
        mib(full_vm),
        per_ip(full_rss.saturating_sub(empty_rss))
    );
    let vm_growth = full_vm.saturating_sub(empty_vm);
    let rest = full_rss.saturating_sub(empty_rss).saturating_sub(vm_growth);
    println!(
        "  of which poller VM:     {:.0} bytes per IP; Envoy (shared data, buffers): {:.0} bytes per IP",
        per_ip(vm_growth),
        per_ip(rest)
    );
    println!(
        "  answer: {:.1} MB, the last applied in {:.0} ms",
        bytes as f64 / 1e6 / resets as f64,
        apply_us as f64 / 1000.0
    );
    println!("  raw [empty_rss, empty_vm, full_rss, full_vm, apply_us, bytes]: {rows:?}; noop rss {floors:?}");
    Ok(())
}
