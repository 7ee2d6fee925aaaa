//! What the benchmarks (`bench/examples`, driven by `bench/run`) share to read
//! their knobs, drive load, measure Envoy and report their runs.

use std::cmp::Ordering;
use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use staleguard_core::{Freshness, IpRecord, ServiceKey, Snapshot};
use staleguard_validator::index::{Index, IndexConfig};
use staleguard_validator::live::SharedIndex;
use staleguard_validator::synth;

use staleguard_tests::envoy::stats::STAT_RESETS;
use staleguard_tests::envoy::{shipped_plugin, Cluster, Envoy, Gateway};

/// What a benchmark fails with when Envoy or the filter module is not
/// installed (`Gateway::start` returned `None`).
pub const MISSING: &str =
    "Envoy or the filter module is missing: run `. scripts/setup.sh && sg_setup_all`";

/// Waits up to `timeout` until `envoy`'s filter has loaded its first full
/// snapshot (a large index takes a while).
pub fn wait_loaded(envoy: &Envoy, timeout: Duration) -> Result<()> {
    envoy.eventually("the first full load", timeout, |e| {
        Ok(e.stat(STAT_RESETS)? >= 1)
    })
}

/// A fresh snapshot of `services` and `records` (wire version 1, epoch 1,
/// generation 1): what the natively run benchmarks feed the engine.
pub fn fresh_snapshot(services: Vec<ServiceKey>, records: Vec<IpRecord>) -> Snapshot {
    Snapshot {
        v: 1,
        epoch: 1,
        generation: 1,
        freshness: Freshness {
            fresh: true,
            age_ms: None,
        },
        services,
        records,
    }
}

/// The whole number in the environment variable `name`, or `default` when it
/// is unset or not a number (the examples' knobs: `ROUNDS`, `PODS`, ...).
pub fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The median of `v` (the upper one of an even count), sorting `v` in place.
/// Panics on an empty slice: a run that measured nothing has no median.
pub fn median<T: Copy + PartialOrd>(v: &mut [T]) -> T {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(Ordering::Equal));
    v[v.len() / 2]
}

/// utime + stime of every thread of `pid`, in clock ticks.
pub fn cpu_ticks(pid: u32) -> Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The command name may hold spaces: fields count from after its `)`.
    let rest = stat.rsplit_once(')').context("stat")?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: u64 = fields.get(11).context("utime")?.parse()?;
    let stime: u64 = fields.get(12).context("stime")?.parse()?;
    Ok(utime + stime)
}

/// Nanoseconds every live thread of `pid` has spent on a CPU (the first
/// field of each `/proc/PID/task/TID/schedstat`, the scheduler's own
/// account): [`cpu_ticks`] at 10 ms resolution is 0.5% of a 2-second round
/// at full load, this is exact to the nanosecond. A thread that exits
/// between two readings takes its time with it (Envoy's threads live as long
/// as the process).
pub fn cpu_ns(pid: u32) -> Result<u64> {
    let mut total = 0u64;
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let path = task?.path().join("schedstat");
        // A thread may end between the listing and the read.
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        let ns: u64 = text
            .split_whitespace()
            .next()
            .context("schedstat")?
            .parse()?;
        total += ns;
    }
    Ok(total)
}

/// Puts every live thread of `pid` on CPU `cpu` alone (util-linux's
/// `taskset`, as the workspace has no unsafe code). A thread made later
/// inherits its maker's CPUs, so a process pinned once it has started stays
/// pinned. Pinning Envoy away from the load generator keeps them from taking
/// turns on one core and from moving between cores mid-window: on a shared
/// two-core machine that is most of the spread between two equal gateways'
/// CPU per request.
pub fn pin_threads(pid: u32, cpu: usize) -> Result<()> {
    let out = Command::new("taskset")
        .args(["--all-tasks", "--cpu-list", "--pid", &cpu.to_string()])
        .arg(pid.to_string())
        .output()
        .context("running taskset (util-linux) to pin a process to a CPU; PIN=0 runs unpinned")?;
    if !out.status.success() {
        bail!(
            "taskset could not pin process {pid} to CPU {cpu}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Clock ticks ([`cpu_ticks`]) in microseconds.
pub fn ticks_us(ticks: u64) -> f64 {
    // USER_HZ is 100 on Linux for every architecture this runs on.
    ticks as f64 * 10_000.0
}

/// The `p` quantile of `v` (nearest rank: the smallest value with at least
/// `p` of the values at or below it), sorting `v` in place. Panics on an empty
/// slice, as [`median`].
pub fn percentile<T: Copy + PartialOrd>(v: &mut [T], p: f64) -> T {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(Ordering::Equal));
    v[((v.len() as f64 * p).ceil() as usize).saturating_sub(1)]
}

/// The resident memory of `pid`, in KiB.
pub fn rss_kib(pid: u32) -> Result<u64> {
    status_kib(pid, "VmRSS")
}

/// The field `name` (`VmRSS`, `VmHWM`, ...) of `/proc/<pid>/status`, in KiB.
pub fn status_kib(pid: u32, name: &str) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next())
        .with_context(|| name.to_owned())?
        .parse()
        .with_context(|| name.to_owned())
}

/// The 1-minute load average, to state with every number.
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "?".into())
}

/// Replaces the module of every Wasm filter in a bootstrap (each `code`
/// with a `local` file) with `wasm`: a gateway that differs from another in
/// its module only.
pub fn swap_module(bootstrap: &mut Value, wasm: &Path) {
    match bootstrap {
        Value::Object(map) => {
            if let Some(code) = map.get_mut("code") {
                if code.get("local").is_some() {
                    *code = json!({"local": {"filename": wasm.display().to_string()}});
                    return;
                }
            }
            for child in map.values_mut() {
                swap_module(child, wasm);
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|c| swap_module(c, wasm)),
        _ => {}
    }
}

/// What one `wrk` run reported.
#[derive(Debug, Clone, PartialEq)]
pub struct WrkRun {
    /// Requests completed.
    pub requests: u64,
    /// Answers other than 2xx/3xx.
    pub bad_status: u64,
    /// Connect, read, write and timeout errors.
    pub socket_errors: u64,
    /// Latency percentiles, microseconds.
    pub p50_us: f64,
    /// The 99th percentile.
    pub p99_us: f64,
}

/// Runs `wrk` (one thread, `connections` kept-alive connections, `seconds`)
/// against the gateway on `listener`, to `cluster` by the `x-cluster`
/// header.
pub fn wrk(
    listener: SocketAddr,
    cluster: &str,
    connections: usize,
    seconds: usize,
) -> Result<WrkRun> {
    let out = Command::new("wrk")
        .args(["-t1", "--latency"])
        .arg(format!("-c{connections}"))
        .arg(format!("-d{seconds}s"))
        .args(["-H", &format!("x-cluster: {cluster}")])
        .arg(format!("http://{listener}/"))
        .output()
        .context("run wrk (bench/run installs it: apt-get install wrk)")?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!("wrk failed: {text}{}", String::from_utf8_lossy(&out.stderr));
    }
    parse_wrk(&text).with_context(|| format!("wrk's output:\n{text}"))
}

/// Reads `wrk --latency`'s report.
pub fn parse_wrk(text: &str) -> Result<WrkRun> {
    let mut run = WrkRun {
        requests: 0,
        bad_status: 0,
        socket_errors: 0,
        p50_us: f64::NAN,
        p99_us: f64::NAN,
    };
    for line in text.lines().map(str::trim) {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            [n, "requests", "in", ..] => run.requests = n.parse()?,
            ["Non-2xx", "or", "3xx", "responses:", n] => run.bad_status = n.parse()?,
            ["Socket", "errors:", rest @ ..] => {
                run.socket_errors = rest
                    .iter()
                    .filter_map(|w| w.trim_end_matches(',').parse::<u64>().ok())
                    .sum();
            }
            ["50%", v] => run.p50_us = duration_us(v)?,
            ["99%", v] => run.p99_us = duration_us(v)?,
            _ => {}
        }
    }
    if run.p50_us.is_nan() {
        bail!("no latency distribution");
    }
    Ok(run)
}

/// `wrk`'s durations (`812.00us`, `1.68ms`, `2.10s`) in microseconds.
fn duration_us(v: &str) -> Result<f64> {
    let split = v
        .find(|c: char| c.is_ascii_alphabetic())
        .context("a unit")?;
    let (n, unit) = v.split_at(split);
    let n: f64 = n.parse()?;
    Ok(match unit {
        "us" => n,
        "ms" => n * 1e3,
        "s" => n * 1e6,
        "m" => n * 60e6,
        other => bail!("unit {other}"),
    })
}

/// A synthetic cluster of `pods` pods spread over `services` services, as
/// the validator indexes it (`validator::synth`), in the verdict view the
/// filter is sent: the services and one record per IP.
pub fn synthetic_index(services: usize, pods: usize) -> (Vec<ServiceKey>, Vec<IpRecord>) {
    let services = services.max(1);
    let shared = SharedIndex::new(
        Index::new(1, IndexConfig::default()),
        Duration::from_secs(3600),
    );
    synth::feed(&shared, synth::cluster(services, pods / services));
    let snapshot = shared.read().snapshot(Freshness {
        fresh: true,
        age_ms: Some(0),
    });
    let records = snapshot
        .records
        .into_iter()
        .map(IpRecord::verdict_view)
        .collect();
    (snapshot.services, records)
}

/// One gateway (one worker) with one guarded cluster of a synthetic service
/// (`svc-0` of [`synthetic_index`]) and the shipped plugin, polling the
/// validator at `validator`: what the memory and reset examples load an
/// index into. Its one endpoint, 127.0.1.250:9, is never sent traffic.
pub fn index_gateway(validator: SocketAddr) -> Gateway {
    Gateway::new(
        validator,
        vec![Cluster::new(
            "outbound|80||svc-0.bench.svc.cluster.local",
            SocketAddr::from(([127, 0, 1, 250], 9)),
            Some(shipped_plugin(json!({}))),
        )],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_wrks_report() {
        let text = "Running 5s test @ http://127.0.0.1:1/\n\
              1 threads and 16 connections\n\
              Latency Distribution\n\
                 50%  812.00us\n\
                 75%    1.01ms\n\
                 99%    1.68ms\n\
              61234 requests in 5.00s, 7.36MB read\n\
              Socket errors: connect 0, read 2, write 0, timeout 1\n\
              Non-2xx or 3xx responses: 12\n";
        let run = parse_wrk(text).unwrap();
        assert_eq!(
            run,
            WrkRun {
                requests: 61234,
                bad_status: 12,
                socket_errors: 3,
                p50_us: 812.0,
                p99_us: 1680.0,
            }
        );
        assert!(
            parse_wrk("61234 requests in 5.00s").is_err(),
            "no latencies"
        );
        assert!(duration_us("3fortnights").is_err());
    }

    #[test]
    fn pin_threads_leaves_a_process_one_cpu() {
        let cpus = std::thread::available_parallelism().map_or(1, usize::from);
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = child.id();
        let last = cpus - 1;
        let pinned = pin_threads(pid, last);
        let allowed = std::fs::read_to_string(format!("/proc/{pid}/status"))
            .unwrap()
            .lines()
            .find_map(|l| {
                l.strip_prefix("Cpus_allowed_list:")
                    .map(|v| v.trim().to_owned())
            });
        let past_the_last = pin_threads(pid, cpus + 64);
        let _ = child.kill();
        let _ = child.wait();
        pinned.unwrap();
        assert_eq!(allowed.as_deref(), Some(last.to_string().as_str()));
        let error = format!("{:#}", past_the_last.unwrap_err());
        assert!(error.contains("could not pin"), "{error}");
    }

    #[test]
    fn cpu_ns_counts_the_nanoseconds_a_process_spent_on_a_cpu() {
        // A process of one thread that spins, as an Envoy worker under load
        // does: not this test binary, whose other tests' threads end while
        // it runs and take their time out of the sum (`cpu_ns` says so).
        let mut child = std::process::Command::new("sh")
            .args(["-c", "while :; do :; done"])
            .spawn()
            .unwrap();
        let pid = child.id();
        let before = cpu_ns(pid).unwrap();
        let start = std::time::Instant::now();
        // Until 10 ms of CPU are counted (a loaded machine may take longer
        // than 10 ms of wall time to give them).
        let mut spent = 0;
        while spent < 10_000_000 && start.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(5));
            spent = cpu_ns(pid)
                .unwrap()
                .checked_sub(before)
                .expect("a live thread's time on a CPU never falls");
        }
        let wall = start.elapsed().as_nanos() as u64;
        let _ = child.kill();
        let _ = child.wait();
        assert!(
            spent >= 10_000_000,
            "10 s of spinning counted as {spent} ns"
        );
        assert!(
            spent <= wall + 20_000_000,
            "{spent} ns of CPU in {wall} ns of wall time for one thread: not nanoseconds"
        );
    }

    #[test]
    fn median_is_the_middle_or_the_upper_middle() {
        assert_eq!(median(&mut [3u64, 1, 2]), 2);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 3.0);
    }
}
