//! Benchmarks of the identity index (not timed tests: they print numbers).
//!
//! `cargo run --release -p staleguard-bench --example index`
//!
//! - apply throughput: pod lifecycle events, slice updates, and a mix, applied
//!   to an index already holding 10,000 pods in 100 services;
//! - memory: resident set size of a fresh process after indexing 150,000 pods
//!   and 150,000 slice entries (the bench re-runs itself as that process);
//! - incident replay: a gateway scaled down from 250 to 20 pods, with the
//!   matching slice updates, amid 1,000 pods in 100 other services.
//!
//! Each timing is the median of several runs; the setup of a run is not timed.

use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant, SystemTime};

use k8s_openapi::api::core::v1::{Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::watcher::Event;
use staleguard_bench::{median, status_kib};
use staleguard_validator::index::{Index, IndexConfig};
use staleguard_validator::synth::{self, SynthPod};

const RUNS: usize = 7;

// === the benchmark's cluster ===
//
// Pod `n` of service `s` is `svc-<s>-7d9f8c6b5-<n>` in namespace `ns-<s % 50>`,
// on IP 10.x.y.z (room for 16M pods), uid a UUID per incarnation.

fn ip_of(n: u32) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(10, (n >> 16) as u8, (n >> 8) as u8, n as u8))
}

fn uid_of(n: u32, incarnation: u32) -> String {
    format!("{n:08x}-{incarnation:04x}-4c1e-9a11-0123456789ab")
}

fn namespace_of(service: u32) -> String {
    format!("ns-{}", service % 50)
}

#[derive(Clone, Copy)]
struct PodSpecBench {
    n: u32,
    service: u32,
    incarnation: u32,
    ready: bool,
    terminating: bool,
}

impl PodSpecBench {
    fn synth(self) -> SynthPod {
        let app = format!("svc-{}", self.service);
        let name = format!("{app}-7d9f8c6b5-{:05}", self.n);
        let mut pod = SynthPod::new(&namespace_of(self.service), &name, &app, ip_of(self.n));
        pod.uid = uid_of(self.n, self.incarnation);
        pod.ready = self.ready;
        pod.terminating = self.terminating;
        pod
    }
}

fn pod(p: PodSpecBench) -> Pod {
    p.synth().build()
}

fn service(s: u32) -> Service {
    synth::service(&namespace_of(s), &format!("svc-{s}"))
}

/// Slice `part` of service `s` listing `members` (pod numbers, with a flag for
/// terminating).
fn slice(s: u32, part: u32, members: &[(u32, bool)]) -> EndpointSlice {
    let endpoints = members
        .iter()
        .map(|&(n, terminating)| {
            PodSpecBench {
                n,
                service: s,
                incarnation: 0,
                ready: true,
                terminating,
            }
            .synth()
            .endpoint()
        })
        .collect();
    synth::slice(
        &namespace_of(s),
        &format!("svc-{s}-{part:05}"),
        &format!("svc-{s}"),
        endpoints,
    )
}

/// Services `first..first+count` with `per` pods each, one slice per 100 pods;
/// pod numbers start at `first_pod`.
fn world(ix: &mut Index, first: u32, count: u32, per: u32, first_pod: u32, now: SystemTime) {
    for s in first..first + count {
        ix.apply_service(Event::Apply(service(s)), now);
        let pods: Vec<u32> = (0..per)
            .map(|i| first_pod + (s - first) * per + i)
            .collect();
        for &n in &pods {
            let p = PodSpecBench {
                n,
                service: s,
                incarnation: 0,
                ready: true,
                terminating: false,
            };
            ix.apply_pod(Event::Apply(pod(p)), now);
        }
        for (part, chunk) in pods.chunks(100).enumerate() {
            let members: Vec<(u32, bool)> = chunk.iter().map(|&n| (n, false)).collect();
            ix.apply_slice(Event::Apply(slice(s, part as u32, &members)), now);
        }
    }
}

/// CPU time this thread has run, in nanoseconds (`CLOCK_THREAD_CPUTIME_ID`):
/// on a shared machine, wall time also counts time other processes took the
/// core. (`/proc/thread-self/schedstat` is only brought up to date at
/// scheduler ticks, too coarse for a batch of a hundred events.)
fn cpu_ns() -> u64 {
    u64::try_from(cpu_time::ThreadTime::now().as_duration().as_nanos()).unwrap_or(u64::MAX)
}

fn fresh_index() -> Index {
    Index::new(1, IndexConfig::default())
}

// === benchmarks ===

enum Bench {
    Pod(Vec<Event<Pod>>),
    Slice(Vec<Event<EndpointSlice>>),
    Mixed(Vec<Mixed>),
}

// Unboxed on purpose: a box per event would add an allocation the watcher
// does not make.
#[allow(clippy::large_enum_variant)]
enum Mixed {
    Pod(Event<Pod>),
    Slice(Event<EndpointSlice>),
}

/// Event `i` of the pod lifecycles in the 100 services of the base world:
/// pod `1,000,000 + i / 4` is created (not ready), turns ready, turns
/// terminating, and is deleted.
fn pod_event(i: u32) -> Event<Pod> {
    let n = 1_000_000 + i / 4;
    let p = PodSpecBench {
        n,
        service: n % 100,
        incarnation: 0,
        ready: false,
        terminating: false,
    };
    match i % 4 {
        0 => Event::Apply(pod(p)),
        1 => Event::Apply(pod(PodSpecBench { ready: true, ..p })),
        2 => Event::Apply(pod(PodSpecBench {
            terminating: true,
            ..p
        })),
        _ => Event::Delete(pod(p)),
    }
}

/// Update `i` of full 100-endpoint slices of the base world, each flipping
/// one entry to terminating and back.
fn slice_event(i: u32) -> Event<EndpointSlice> {
    let s = i % 100;
    let flip = (i / 100) % 100;
    let members: Vec<(u32, bool)> = (0..100)
        .map(|k| (s * 100 + k, k == flip && (i / 10_000) % 2 == 0))
        .collect();
    Event::Apply(slice(s, 0, &members))
}

/// Event `i` of the endpoints controller's view of pod lifecycles: per pod,
/// two pod events, its slice update (listed in a second slice), two more pod
/// events, and the slice update that drops it.
fn mixed_event(i: u32) -> Mixed {
    let (pod_n, step) = (i / 6, i % 6);
    let n = 1_000_000 + pod_n;
    let s = n % 100;
    match step {
        2 => Mixed::Slice(Event::Apply(slice(s, 1, &[(n, false)]))),
        5 => Mixed::Slice(Event::Apply(slice(s, 1, &[]))),
        _ => Mixed::Pod(pod_event(pod_n * 4 + step - step / 3)),
    }
}

/// Events are built and applied in batches of this many, and only applying
/// is timed. Building them all first would free every object in the timed
/// loop and allocate none: glibc then piles up millions of free chunks and
/// consolidates them on the next large allocation, a pattern the validator
/// (decode one object, apply it, drop it) never has.
const BATCH: u32 = 100;

fn throughput(name: &str, total: u32, make: impl Fn(u32, u32) -> Bench) -> f64 {
    let now = SystemTime::now();
    let mut rates = Vec::new();
    let mut cpu_rates = Vec::new();
    for _ in 0..RUNS {
        let mut ix = fresh_index();
        world(&mut ix, 0, 100, 100, 0, now);
        let mut wall = Duration::ZERO;
        let mut cpu = 0u64;
        let mut first = 0;
        while first < total {
            let count = BATCH.min(total - first);
            let bench = make(first, count);
            first += count;
            let cpu_start = cpu_ns();
            let start = Instant::now();
            match bench {
                Bench::Pod(events) => {
                    for e in events {
                        ix.apply_pod(e, now);
                    }
                }
                Bench::Slice(events) => {
                    for e in events {
                        ix.apply_slice(e, now);
                    }
                }
                Bench::Mixed(events) => {
                    for e in events {
                        match e {
                            Mixed::Pod(e) => ix.apply_pod(e, now),
                            Mixed::Slice(e) => ix.apply_slice(e, now),
                        }
                    }
                }
            }
            wall += start.elapsed();
            cpu += cpu_ns() - cpu_start;
        }
        rates.push(f64::from(total) / wall.as_secs_f64());
        cpu_rates.push(f64::from(total) / (cpu as f64 / 1e9));
        std::hint::black_box(&ix);
    }
    if std::env::var_os("STALEGUARD_BENCH_RUNS").is_some() {
        let runs: Vec<String> = cpu_rates.iter().map(|r| format!("{r:.0}")).collect();
        println!("  {name}, per run: {}", runs.join(" "));
    }
    let rate = median(&mut rates);
    let cpu_rate = median(&mut cpu_rates);
    println!(
        "apply throughput, {name}: {cpu_rate:.0} events per CPU-second, {rate:.0} events/s wall (median of {RUNS})"
    );
    cpu_rate
}

fn incident() -> f64 {
    let now = SystemTime::now();
    let gateway = 1000; // the scaled-down service's number
    let mut times = Vec::new();
    let mut cpu_times = Vec::new();
    for _ in 0..RUNS {
        let mut ix = fresh_index();
        world(&mut ix, 0, 100, 10, 0, now); // 1,000 pods in 100 services
        world(&mut ix, gateway, 1, 250, 100_000, now); // the gateway's 250 pods
        let first = 100_000u32;
        let gw = |n: u32, terminating: bool| PodSpecBench {
            n,
            service: gateway,
            incarnation: 0,
            ready: !terminating,
            terminating,
        };
        let mut members: Vec<(u32, bool)> = (first..first + 250).map(|n| (n, false)).collect();
        let slices = |members: &[(u32, bool)]| -> Vec<EndpointSlice> {
            members
                .chunks(100)
                .enumerate()
                .map(|(part, chunk)| slice(gateway, part as u32, chunk))
                .collect()
        };
        // The replay: every removed pod turns terminating and its slice says
        // so; then the pods go and the slices drop them. The endpoints
        // controller batches, so one slice update per 10 pods.
        let mut pods: Vec<Event<Pod>> = Vec::new();
        let mut slice_updates: Vec<Event<EndpointSlice>> = Vec::new();
        let mut deletes: Vec<Event<Pod>> = Vec::new();
        for (i, n) in (first + 20..first + 250).enumerate() {
            pods.push(Event::Apply(pod(gw(n, true))));
            members[(n - first) as usize].1 = true;
            if i % 10 == 9 {
                slice_updates.extend(slices(&members).into_iter().map(Event::Apply));
            }
            deletes.push(Event::Delete(pod(gw(n, true))));
        }
        let last_slices: Vec<Event<EndpointSlice>> = {
            let kept = &members[..20];
            let mut out: Vec<Event<EndpointSlice>> =
                slices(kept).into_iter().map(Event::Apply).collect();
            out.push(Event::Delete(slice(gateway, 1, &[])));
            out.push(Event::Delete(slice(gateway, 2, &[])));
            out
        };
        let events = pods.len() + slice_updates.len() + deletes.len() + last_slices.len();
        let start = Instant::now();
        let cpu_start = cpu_ns();
        for e in pods {
            ix.apply_pod(e, now);
        }
        for e in slice_updates {
            ix.apply_slice(e, now);
        }
        for e in deletes {
            ix.apply_pod(e, now);
        }
        for e in last_slices {
            ix.apply_slice(e, now);
        }
        let elapsed = start.elapsed();
        cpu_times.push((cpu_ns() - cpu_start) as f64 / 1e6);
        assert_eq!(
            ix.stats().tombstones,
            230,
            "every removed pod left a tombstone"
        );
        times.push(elapsed.as_secs_f64() * 1000.0);
        if times.len() == 1 {
            println!("incident replay: {events} events");
        }
    }
    let ms = median(&mut times);
    let cpu_ms = median(&mut cpu_times);
    println!(
        "incident replay (250 -> 20 amid 1,000 pods in 100 services): {ms:.2} ms wall, {cpu_ms:.2} ms CPU (median of {RUNS})"
    );
    ms
}

/// The field `name` of this process's status, in KiB (0 when unreadable).
fn rss_kib(name: &str) -> u64 {
    status_kib(std::process::id(), name).unwrap_or(0)
}

/// Runs in a child process: index 150k pods and 150k slice entries, one object
/// at a time (so no event buffer inflates the number), and print RSS.
fn memory_child() {
    let now = SystemTime::now();
    let before = rss_kib("VmRSS");
    let mut ix = fresh_index();
    world(&mut ix, 0, 1500, 100, 0, now);
    let stats = ix.stats();
    assert_eq!(stats.pods, 150_000);
    assert_eq!(stats.slice_entries, 150_000);
    let after = rss_kib("VmRSS");
    let peak = rss_kib("VmHWM");
    let snapshot_start = Instant::now();
    let snapshot = ix.snapshot(Default::default());
    let snapshot_ms = snapshot_start.elapsed().as_secs_f64() * 1000.0;
    let json_start = Instant::now();
    let json = serde_json::to_vec(&snapshot).unwrap_or_default();
    let json_ms = json_start.elapsed().as_secs_f64() * 1000.0;
    // What gateways ask for: the verdict view's JSON (before issue 28), the
    // packed form as text and with binary records (now), each from the
    // copied snapshot.
    let verdict_start = Instant::now();
    let mut slim = snapshot.clone();
    slim.records = slim
        .records
        .into_iter()
        .map(staleguard_core::IpRecord::verdict_view)
        .collect();
    let verdict = serde_json::to_vec(&slim).unwrap_or_default();
    let verdict_ms = verdict_start.elapsed().as_secs_f64() * 1000.0;
    let packed_start = Instant::now();
    let packed = staleguard_core::packed::encode_snapshot(&snapshot);
    let packed_ms = packed_start.elapsed().as_secs_f64() * 1000.0;
    let binary_start = Instant::now();
    let binary = staleguard_core::packed::encode_snapshot_as(
        staleguard_core::packed::Encoding::Binary,
        &snapshot,
    );
    let binary_ms = binary_start.elapsed().as_secs_f64() * 1000.0;
    println!(
        "{} {} {} {} {:.1} {:.1} {} {:.1} {} {:.1} {} {:.1} {}",
        before,
        after,
        peak,
        snapshot.records.len(),
        snapshot_ms,
        json_ms,
        json.len(),
        verdict_ms,
        verdict.len(),
        packed_ms,
        packed.len(),
        binary_ms,
        binary.len()
    );
    std::hint::black_box(&ix);
}

fn memory() -> Option<f64> {
    let exe = std::env::current_exe().ok()?;
    let mut samples = Vec::new();
    for _ in 0..3 {
        let out = std::process::Command::new(&exe)
            .arg("memory-child")
            .output()
            .ok()?;
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let nums: Vec<f64> = text
            .split_whitespace()
            .filter_map(|v| v.parse().ok())
            .collect();
        if nums.len() != 13 {
            eprintln!(
                "memory child failed: {text} {}",
                String::from_utf8_lossy(&out.stderr)
            );
            return None;
        }
        samples.push(nums);
    }
    let col = |i: usize| median(&mut samples.iter().map(|s| s[i]).collect::<Vec<f64>>());
    let rss_mb = col(1) / 1024.0;
    println!(
        "memory at 150k pods + 150k slice entries: RSS {:.1} MiB (baseline {:.1} MiB, peak {:.1} MiB; median of 3 processes)",
        rss_mb,
        col(0) / 1024.0,
        col(2) / 1024.0
    );
    println!(
        "snapshot at that size: {} records built in {:.0} ms, JSON {:.0} ms, {:.1} MiB",
        col(3),
        col(4),
        col(5),
        col(6) / 1024.0 / 1024.0
    );
    println!(
        "  as gateways ask for it: verdict view JSON {:.0} ms, {:.1} MB; packed {:.0} ms, {:.1} MB; packed with binary records {:.0} ms, {:.1} MB",
        col(7),
        col(8) / 1e6,
        col(9),
        col(10) / 1e6,
        col(11),
        col(12) / 1e6
    );
    Some(rss_mb)
}

fn main() {
    if std::env::args().any(|a| a == "memory-child") {
        memory_child();
        return;
    }
    // `cargo run --release -p staleguard-bench --example index -- pod incident`
    // runs only those parts.
    let only: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let wanted = |name: &str| only.is_empty() || only.iter().any(|o| o == name);
    let started = Instant::now();
    let mut pods = f64::NAN;
    let mut slices = f64::NAN;
    let mut mixed = f64::NAN;
    let mut replay = f64::NAN;
    let mut rss = None;
    if wanted("pod") {
        pods = throughput("pod lifecycle events", 200_000, |first, count| {
            Bench::Pod((first..first + count).map(pod_event).collect())
        });
    }
    if wanted("slice") {
        slices = throughput("100-endpoint slice updates", 20_000, |first, count| {
            Bench::Slice((first..first + count).map(slice_event).collect())
        });
    }
    if wanted("mixed") {
        mixed = throughput("mixed (4 pod : 2 slice events)", 120_000, |first, count| {
            Bench::Mixed((first..first + count).map(mixed_event).collect())
        });
    }
    if wanted("incident") {
        replay = incident();
    }
    if wanted("memory") {
        rss = memory();
    }
    println!();
    println!("targets: >= 200k events/s on one core, <= 150 MB RSS, incident < 100 ms");
    println!(
        "per CPU-second: pod {pods:.0}/s, slice {slices:.0}/s, mixed {mixed:.0}/s; incident {replay:.2} ms wall; RSS {}",
        rss.map_or("n/a".into(), |r| format!("{r:.1} MiB"))
    );
    println!(
        "(took {:.0?})",
        Duration::from_secs(started.elapsed().as_secs())
    );
}
