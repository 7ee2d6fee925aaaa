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
//!
//! Envoy CPU per reset: utime + stime of the Envoy process (every thread,
//! `/proc/PID/stat`, 10 ms ticks) from the moment the validator's index
//! changed to the moment the filter counted the reset, the first reset (an
//! empty index replaced) and the median of the others; it includes
//! answering the admin `/stats` polls that wait for it (a few ms).
//!
//! `RELEASE=<bytes>`: every gateway's Envoy `memory_allocator_manager` gives
//! that many bytes of free memory back each second; `RELEASE=0`: none (as
//! the Wasm gateway shipped before it had one); unset: as
//! `deploy/envoy/envoy.yaml` ships it (64 MiB a second).
//!
//! `TWIN_WASM`: the twin's VMs (`vm_id: staleguard-twin`) of the staleguard
//! gateways run this module instead (e.g. the no-op: what the twin's three
//! VMs cost above the floor, the most a smaller module for the twin's role
//! could save; no request is sent, so the twin is never called).
//!
//! `BEFORE_WASM`: another staleguard module (an older commit's) measured in
//! the same run, each round alternating which goes first, so before and
//! after are paired under the same load. A module that cannot load the index
//! (an answer over Envoy's 32 MiB callout limit) is reported as failed and the
//! run goes on. The fake validator answers each module in the form it asks
//! for (packed or JSON). The last lines are `MACHINE` key=value lines for
//! bench/run.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use staleguard_bench::{
    cpu_ticks, env_usize, index_gateway, median, rss_kib, swap_module, synthetic_index, ticks_us,
};
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
    let before: Option<PathBuf> = std::env::var_os("BEFORE_WASM").map(PathBuf::from);

    let (keys, records) = synthetic_index(services, pods);
    let ips = records.len() as u64;
    println!("{ips} IPs in {} services", keys.len());

    let noop_rss = |module: &Path| -> Result<u64> {
        let validator = FakeValidator::start(7)?;
        let envoy = started(index_gateway(validator.addr()).start_with(|config| {
            swap_module(config, module);
            release_free_memory(config);
            Ok(())
        })?)?;
        std::thread::sleep(settle);
        let rss = rss_kib(envoy.pid())? * 1024;
        println!("  noop: {}", wasm_vms(&envoy)?);
        drop(envoy);
        Ok(rss)
    };
    // `module`: None for the one the harness runs (STALEGUARD_WASM).
    let ours_rss = |module: Option<&Path>| -> Result<[u64; 8]> {
        let validator = FakeValidator::start(7)?;
        let envoy = started(index_gateway(validator.addr()).start_with(|config| {
            if let Some(module) = module {
                swap_module(config, module);
            }
            if let Some(twin) = std::env::var_os("TWIN_WASM") {
                swap_twin_module(config, Path::new(&twin));
            }
            release_free_memory(config);
            Ok(())
        })?)?;
        envoy.eventually("the first answer", Duration::from_secs(120), |e| {
            Ok(e.stat("wasmcustom.staleguard_filter_sync_resets_total")? >= 1)
        })?;
        std::thread::sleep(settle);
        let empty_rss = rss_kib(envoy.pid())? * 1024;
        let empty_vm = envoy.stat("wasmcustom.staleguard_filter_vm_memory_bytes")?;
        println!("  staleguard, empty index: {}", wasm_vms(&envoy)?);
        let ticks = cpu_ticks(envoy.pid())?;
        validator.set_index(keys.clone(), records.clone());
        envoy.eventually("the reset", Duration::from_secs(180), |e| {
            Ok(e.stat("wasmcustom.staleguard_filter_sync_resets_total")? >= 2)
        })?;
        let first_cpu = cpu_ticks(envoy.pid())?.saturating_sub(ticks);
        let mut again_cpu = vec![];
        for again in 1..resets {
            // A restarted validator: a new epoch, the same index, a reset.
            let ticks = cpu_ticks(envoy.pid())?;
            validator.restart(7 + again);
            envoy.eventually("another reset", Duration::from_secs(180), |e| {
                Ok(e.stat("wasmcustom.staleguard_filter_sync_resets_total")? >= 2 + again)
            })?;
            again_cpu.push(cpu_ticks(envoy.pid())?.saturating_sub(ticks));
        }
        let again_cpu = if again_cpu.is_empty() {
            0
        } else {
            median(&mut again_cpu)
        };
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
        Ok([
            empty_rss, empty_vm, full_rss, full_vm, apply_us, bytes, first_cpu, again_cpu,
        ])
    };

    let mut modules: Vec<(&str, Option<&Path>)> = vec![("after", None)];
    if let Some(before) = &before {
        modules.insert(0, ("before", Some(before.as_path())));
    }
    let mut rows: Vec<Vec<[u64; 8]>> = vec![vec![]; modules.len()];
    let mut failed: Vec<Option<String>> = vec![None; modules.len()];
    let mut floors: Vec<u64> = vec![];
    for round in 0..rounds {
        // Alternate the order, so a drift in the machine's state does not
        // always favour the same gateway.
        let mut order: Vec<usize> = (0..modules.len()).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        if let Some(module) = &noop {
            if round % 2 == 1 {
                floors.push(noop_rss(module)?);
            }
        }
        for i in order {
            if failed[i].is_some() {
                continue;
            }
            match ours_rss(modules[i].1) {
                Ok(row) => rows[i].push(row),
                Err(e) => failed[i] = Some(format!("{e:#}")),
            }
        }
        if let Some(module) = &noop {
            if round % 2 == 0 {
                floors.push(noop_rss(module)?);
            }
        }
    }
    let floor = (!floors.is_empty()).then(|| median(&mut floors.clone()));
    println!(
        "{ips} IPs, {rounds} round(s) (medians), {resets} reset(s) of the full index, Envoy --concurrency 1, shipped plugin:"
    );
    if let Some(floor) = floor {
        println!("  noop module RSS: {:.1} MiB", mib(floor));
    }
    println!();
    println!("| module | RSS above the no-op, per IP | poller VM (peak) | VM growth, per IP | Envoy's growth, per IP | answer | last reset applied in | Envoy CPU per reset (first / others) |");
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    let mut machine = format!("MACHINE ips={ips} resets={resets}");
    for (i, (label, _)) in modules.iter().enumerate() {
        if let Some(error) = &failed[i] {
            // The first line: the harness appends Envoy's log.
            let first = error.lines().next().unwrap_or_default();
            println!(
                "| {label} | failed: {} | | | | | | |",
                first.replace('|', "/")
            );
            machine.push_str(&format!(" {label}_failed=1"));
            continue;
        }
        let col = |c: usize| median(&mut rows[i].iter().map(|r| r[c]).collect::<Vec<_>>());
        let (empty_rss, empty_vm, full_rss, full_vm, apply_us, bytes) =
            (col(0), col(1), col(2), col(3), col(4), col(5));
        let (first_cpu_s, again_cpu_s) = (ticks_us(col(6)) / 1e6, ticks_us(col(7)) / 1e6);
        let cpu = if resets > 1 {
            format!("{first_cpu_s:.2} / {again_cpu_s:.2} s")
        } else {
            format!("{first_cpu_s:.2} s")
        };
        let per_ip = |b: u64| b as f64 / ips as f64;
        let above_noop = floor.map(|f| per_ip(full_rss.saturating_sub(f)));
        let vm_growth = full_vm.saturating_sub(empty_vm);
        let rest = full_rss.saturating_sub(empty_rss).saturating_sub(vm_growth);
        let answer_mb = bytes as f64 / 1e6 / resets as f64;
        println!(
            "| {label} | {} | {:.1} MiB | {:.0} | {:.0} | {:.1} MB | {:.2} s | {cpu} |",
            above_noop.map_or("n/a".into(), |b| format!("{b:.0}")),
            mib(full_vm),
            per_ip(vm_growth),
            per_ip(rest),
            answer_mb,
            apply_us as f64 / 1e6
        );
        machine.push_str(&format!(
            " {label}_rss_per_ip={} {label}_vm_mib={:.1} {label}_vm_per_ip={:.0} {label}_answer_mb={answer_mb:.1} {label}_apply_s={:.2} {label}_reset_cpu_s={first_cpu_s:.2}",
            above_noop.map_or("n/a".into(), |b| format!("{b:.0}")),
            mib(full_vm),
            per_ip(vm_growth),
            apply_us as f64 / 1e6
        ));
        println!(
            "  {label} raw [empty_rss, empty_vm, full_rss, full_vm, apply_us, bytes, first_cpu_ticks, other_cpu_ticks]: {:?}",
            rows[i]
        );
    }
    println!("  noop rss {floors:?}");
    println!("{machine}");
    Ok(())
}

/// `TWIN_WASM`: every VM of `vm_id: staleguard-twin` loads `wasm`.
fn swap_twin_module(bootstrap: &mut serde_json::Value, wasm: &Path) {
    match bootstrap {
        serde_json::Value::Object(map) => {
            if map.get("vm_id").and_then(|v| v.as_str()) == Some("staleguard-twin") {
                swap_module(bootstrap, wasm);
                return;
            }
            map.values_mut().for_each(|c| swap_twin_module(c, wasm));
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(|c| swap_twin_module(c, wasm)),
        _ => {}
    }
}

/// `RELEASE`: Envoy gives that many bytes of free memory back every second
/// (0: none; unset: as shipped).
fn release_free_memory(bootstrap: &mut serde_json::Value) {
    match std::env::var("RELEASE")
        .ok()
        .and_then(|r| r.parse::<u64>().ok())
    {
        None => {}
        Some(0) => {
            if let Some(b) = bootstrap.as_object_mut() {
                b.remove("memory_allocator_manager");
            }
        }
        Some(bytes) => {
            bootstrap["memory_allocator_manager"] =
                serde_json::json!({"bytes_to_release": bytes, "memory_release_interval": "1s"});
        }
    }
}

/// Where a gateway's fixed cost goes: how many Wasm VMs Envoy runs (every
/// `vm_id` has a base VM and one per thread, main thread included) and what
/// Envoy's allocator holds (`/memory`; V8's own pages are not in it).
fn wasm_vms(envoy: &Envoy) -> Result<String> {
    let active = envoy.stat("wasm.envoy.wasm.runtime.v8.active")?;
    let created = envoy.stat("wasm.envoy.wasm.runtime.v8.created")?;
    let memory: serde_json::Value = serde_json::from_str(&envoy.admin("/memory")?)?;
    let field = |name: &str| {
        memory[name]
            .as_str()
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    Ok(format!(
        "{active} V8 VMs active ({created} created), Envoy allocated {:.1} MiB (heap {:.1} MiB), RSS {:.1} MiB",
        mib(field("allocated")),
        mib(field("heap_size")),
        mib(rss_kib(envoy.pid())? * 1024)
    ))
}

fn mib(b: u64) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}
