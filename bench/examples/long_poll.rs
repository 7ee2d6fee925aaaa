//! Fan-out benchmark: how long after an index change do 1,000 long-polling
//! gateways all have it, and what does the validator pay for that?
//!
//! `cargo run --release -p staleguard-bench --example long_poll` (options through the
//! environment: `CLIENTS` (1000), `ROUNDS` (30), `SERVICES` (100), `PODS` (150
//! per service)). The validator runs in a child process (this binary again,
//! with `SG_BENCH_ROLE=server`) so its CPU time and memory are its own; the
//! clients are plain HTTP/1.1 connections on loopback, each re-polling as soon
//! as it got an answer, as the filter does. For every round the child applies
//! one change and reports the wall-clock time it did; each client stamps the
//! time its answer was complete. Latency = stamp - change time (same machine,
//! same clock). Results go to docs/benchmarks.md by hand.
//!
//! With `BURST=50` (and `BURST_ROUNDS`, 5), a second phase follows the rounds:
//! in each burst round, 50 more gateways reset at once (half ask for
//! `/v1/snapshot`, as a starting filter does; half for `/v1/changes` with an
//! epoch that is not the validator's, as after a validator restart), and 10 ms
//! later the child applies a change, so the 1,000 long polls wake while the
//! snapshot is being built. It reports how many snapshot builds the burst cost
//! (from the validator's `staleguard_validator_answer_builds_total`), the validator's CPU
//! and peak RSS over the burst (the peak is reset before each burst through
//! `/proc/self/clear_refs`), the resetting gateways' time to a complete
//! snapshot, and the 1,000 other clients' latency from the change. For the
//! 150k-IP index: `SERVICES=1000 PODS=150 ROUNDS=0 BURST=50`.

use std::io::{BufRead, Write};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use staleguard_bench::{env_usize, median, percentile};
use staleguard_core::Changes;
use staleguard_validator::api::{self, ApiConfig, ConnectionLimits};
use staleguard_validator::index::{Index, IndexConfig};
use staleguard_validator::live::SharedIndex;
use staleguard_validator::synth;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

fn unix_nanos() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

fn main() -> Result<()> {
    if std::env::var("SG_BENCH_ROLE").as_deref() == Ok("server") {
        return server();
    }
    driver()
}

// === the validator side ===

fn server() -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let shared = SharedIndex::new(
            Index::new(rand_epoch(), IndexConfig::default()),
            Duration::from_secs(3600),
        );
        let cluster = synth::cluster(env_usize("SERVICES", 100), env_usize("PODS", 150));
        let victim = cluster.pods[0].clone();
        synth::feed(&shared, cluster);
        let config = ApiConfig {
            listen: "127.0.0.1:0".parse()?,
            admin_listen: "127.0.0.1:0".parse()?,
            max_long_polls: 100_000,
            max_long_polls_per_client: 100_000,
            // Every simulated gateway connects from 127.0.0.1.
            connections: ConnectionLimits {
                max_connections: 100_000,
                max_per_source: 100_000,
                ..ConnectionLimits::API
            },
            ..ApiConfig::default()
        };
        let (port, admin) = api::spawn(shared.clone(), &config).await?;
        let (epoch, generation) = {
            let index = shared.read();
            (index.epoch(), index.generation())
        };
        println!("ready {port} {admin} {epoch} {generation}");

        // Commands arrive on stdin; a blocking reader thread feeds them in.
        let (tx, mut rx) = mpsc::unbounded_channel();
        std::thread::spawn(move || {
            for line in std::io::stdin().lock().lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut present = true;
        while let Some(command) = rx.recv().await {
            match command.as_str() {
                "change" => {
                    let event = if present {
                        kube::runtime::watcher::Event::Delete(victim.clone())
                    } else {
                        kube::runtime::watcher::Event::Apply(victim.clone())
                    };
                    present = !present;
                    let at = unix_nanos();
                    shared.apply_pod(event, SystemTime::now());
                    println!("applied {} {at}", shared.read().generation());
                }
                "stats" => {
                    let (cpu, hwm, rss) = own_usage();
                    println!("stats {cpu} {hwm} {rss}");
                }
                "reset_peak" => {
                    // "5" resets the peak RSS (VmHWM) to the current RSS.
                    let done = std::fs::write("/proc/self/clear_refs", "5").is_ok();
                    println!("reset_peak {done}");
                }
                _ => break,
            }
            std::io::stdout().flush()?;
        }
        Ok(())
    })
}

fn rand_epoch() -> u64 {
    unix_nanos() as u64
}

/// (CPU time in clock ticks, peak RSS in KiB, RSS in KiB) of this process.
fn own_usage() -> (u64, u64, u64) {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the parenthesised command name; utime and stime are 14 and 15.
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let cpu = ticks(11) + ticks(12);
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kib = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    (cpu, kib("VmHWM:"), kib("VmRSS:"))
}

// === the gateways' side ===

/// Set once the measurement is over, when the clients' connections may drop.
static FINISHED: AtomicBool = AtomicBool::new(false);

struct Receipt {
    generation: u64,
    at: u128,
}

/// Has the validator side apply one change, then collects each client's delay
/// from the change to its answer with the new generation, waiting at most
/// `timeout` for each answer; returns the new generation and the delays.
fn change_and_wait(
    runtime: &tokio::runtime::Runtime,
    to_server: &mut impl Write,
    next_line: &mut impl FnMut() -> Result<Vec<String>>,
    rx: &mut mpsc::UnboundedReceiver<Receipt>,
    clients: usize,
    timeout: Duration,
) -> Result<(u64, Vec<Duration>)> {
    writeln!(to_server, "change")?;
    let applied = next_line()?;
    let (generation, at): (u64, u128) = (applied[1].parse()?, applied[2].parse()?);
    let mut latencies = Vec::with_capacity(clients);
    runtime.block_on(async {
        while latencies.len() < clients {
            let Some(r) = tokio::time::timeout(timeout, rx.recv()).await? else {
                bail!("clients went away");
            };
            if r.generation == generation {
                latencies.push(Duration::from_nanos(r.at.saturating_sub(at) as u64));
            }
        }
        Ok::<_, anyhow::Error>(())
    })?;
    Ok((generation, latencies))
}

fn driver() -> Result<()> {
    let clients = env_usize("CLIENTS", 1000);
    let rounds = env_usize("ROUNDS", 30);
    let exe = std::env::current_exe()?;
    let mut child = Command::new(exe)
        .env("SG_BENCH_ROLE", "server")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .context("start the validator side")?;
    let mut to_server = child.stdin.take().context("stdin")?;
    let mut from_server = std::io::BufReader::new(child.stdout.take().context("stdout")?).lines();
    let mut next_line = move || -> Result<Vec<String>> {
        let line = from_server.next().context("validator side exited")??;
        Ok(line.split_whitespace().map(str::to_owned).collect())
    };
    let ready = next_line()?;
    let [_, addr, admin, epoch, generation] = ready.as_slice() else {
        bail!("unexpected greeting {ready:?}");
    };
    let addr: SocketAddr = addr.parse()?;
    let admin: SocketAddr = admin.parse()?;
    let epoch: u64 = epoch.parse()?;
    let mut generation: u64 = generation.parse()?;

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let (tx, mut rx) = mpsc::unbounded_channel::<Receipt>();
    runtime.block_on(async {
        for _ in 0..clients {
            let tx = tx.clone();
            tokio::spawn(async move {
                if let Err(e) = client(addr, epoch, generation, tx).await {
                    if !FINISHED.load(Ordering::Relaxed) {
                        eprintln!("client failed: {e:#}");
                    }
                }
            });
        }
    });

    let mut p50s = Vec::new();
    let mut p99s = Vec::new();
    let mut maxes = Vec::new();
    let mut wall = Duration::ZERO;
    let mut cpu_ticks = 0;
    for round in 0..rounds {
        runtime.block_on(wait_for_waiting(admin, clients))?;
        writeln!(to_server, "stats")?;
        let before = next_line()?;
        let started = Instant::now();
        let (new_generation, mut latencies) = change_and_wait(
            &runtime,
            &mut to_server,
            &mut next_line,
            &mut rx,
            clients,
            Duration::from_secs(30),
        )?;
        wall += started.elapsed();
        writeln!(to_server, "stats")?;
        let after = next_line()?;
        cpu_ticks += after[1].parse::<u64>()? - before[1].parse::<u64>()?;
        generation = new_generation;
        latencies.sort();
        let (p50, p99, max) = (
            percentile(&mut latencies, 0.50),
            percentile(&mut latencies, 0.99),
            latencies[latencies.len() - 1],
        );
        eprintln!("round {round:>2}: generation {generation}: p50 {p50:?} p99 {p99:?} max {max:?}");
        p50s.push(p50);
        p99s.push(p99);
        maxes.push(max);
    }
    let burst = env_usize("BURST", 0);
    let mut burst_report = Vec::new();
    for round in 0..if burst > 0 {
        env_usize("BURST_ROUNDS", 5)
    } else {
        0
    } {
        runtime.block_on(wait_for_waiting(admin, clients))?;
        let builds_before = runtime.block_on(snapshot_builds(admin))?;
        writeln!(to_server, "reset_peak")?;
        let peak_reset = next_line()?;
        writeln!(to_server, "stats")?;
        let before = next_line()?;
        let started = Instant::now();
        let resets: Vec<_> = (0..burst)
            .map(|i| {
                let path = if i % 2 == 0 {
                    "/v1/snapshot?v=1&view=verdict".to_owned()
                } else {
                    format!(
                        "/v1/changes?v=1&view=verdict&epoch={}&since=1&wait=30",
                        epoch.wrapping_add(1)
                    )
                };
                runtime.spawn(async move {
                    let at = Instant::now();
                    let body = fetch(addr, &path).await?;
                    let took = at.elapsed();
                    // Real gateways decode on their own machines; here the
                    // driver shares two cores with the validator, so it only
                    // checks the head of the document.
                    let head = String::from_utf8_lossy(&body[..body.len().min(256)]).into_owned();
                    if !head.contains("\"records\"") && !head.contains("\"services\"") {
                        bail!("not a snapshot: {head}");
                    }
                    if i % 2 == 1 && !head.starts_with(r#"{"kind":"reset","#) {
                        bail!("not a reset: {head}");
                    }
                    Ok::<_, anyhow::Error>((took, body.len(), 0u64))
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(10));
        let (_, mut latencies) = change_and_wait(
            &runtime,
            &mut to_server,
            &mut next_line,
            &mut rx,
            clients,
            Duration::from_secs(60),
        )?;
        let mut reset_times = Vec::with_capacity(burst);
        let mut bytes = 0;
        for r in resets {
            let (took, len, _) = runtime.block_on(r)??;
            reset_times.push(took);
            bytes = len;
        }
        let wall = started.elapsed();
        writeln!(to_server, "stats")?;
        let after = next_line()?;
        let builds = runtime.block_on(snapshot_builds(admin))? - builds_before;
        latencies.sort();
        reset_times.sort();
        let ticks = after[1].parse::<u64>()? - before[1].parse::<u64>()?;
        let line = BurstRound {
            rss_before_kib: before[3].parse()?,
            builds,
            cpu: Duration::from_millis(ticks * 10),
            wall,
            peak_kib: after[2].parse()?,
            reset_p50: percentile(&mut reset_times, 0.5),
            reset_max: reset_times[reset_times.len() - 1],
            p50: percentile(&mut latencies, 0.5),
            p99: percentile(&mut latencies, 0.99),
            max: latencies[latencies.len() - 1],
            bytes,
        };
        eprintln!(
            "burst {round}: {} snapshot build(s), validator CPU {:?} over {:?}, RSS before {} KiB, \
             peak RSS {} KiB (peak reset: {}), resets p50 {:?} max {:?} ({} bytes), others p50 {:?} p99 {:?} max {:?}",
            line.builds, line.cpu, line.wall, line.rss_before_kib, line.peak_kib, peak_reset[1], line.reset_p50,
            line.reset_max, line.bytes, line.p50, line.p99, line.max
        );
        burst_report.push(line);
    }
    writeln!(to_server, "stats")?;
    let last = next_line()?;
    FINISHED.store(true, Ordering::Relaxed);
    drop(to_server);
    let _ = child.wait();

    println!(
        "long-poll fan-out: {clients} clients, {rounds} rounds, index of {} pods",
        env_usize("SERVICES", 100) * env_usize("PODS", 150)
    );
    if rounds > 0 {
        println!(
            "  median over rounds of p50 latency  {:?}",
            median(&mut p50s)
        );
        println!(
            "  median over rounds of p99 latency  {:?}",
            median(&mut p99s)
        );
        println!(
            "  median over rounds of max latency  {:?}",
            median(&mut maxes)
        );
        println!(
            "  validator CPU during rounds        {:.0}% of one core ({} ticks in {:?})",
            cpu_ticks as f64 / 100.0 / wall.as_secs_f64() * 100.0,
            cpu_ticks,
            wall
        );
    }
    println!(
        "  validator RSS now / peak           {} / {} KiB",
        last[3], last[2]
    );
    if !burst_report.is_empty() {
        let med = |f: &dyn Fn(&BurstRound) -> Duration| {
            let mut v: Vec<Duration> = burst_report.iter().map(f).collect();
            v.sort();
            v[v.len() / 2]
        };
        let mut peaks: Vec<u64> = burst_report.iter().map(|r| r.peak_kib).collect();
        peaks.sort_unstable();
        println!(
            "burst: {burst} gateways resetting at once, {} rounds, medians over rounds",
            burst_report.len()
        );
        println!(
            "  snapshot builds per burst          {:?}",
            burst_report.iter().map(|r| r.builds).collect::<Vec<_>>()
        );
        println!(
            "  validator CPU per burst            {:?} over {:?}",
            med(&|r| r.cpu),
            med(&|r| r.wall)
        );
        let mut growth: Vec<u64> = burst_report
            .iter()
            .map(|r| r.peak_kib.saturating_sub(r.rss_before_kib))
            .collect();
        growth.sort_unstable();
        println!(
            "  validator peak RSS during burst    {} KiB ({} KiB above the RSS before it)",
            peaks[peaks.len() / 2],
            growth[growth.len() / 2]
        );
        println!(
            "  resetting gateways p50 / max       {:?} / {:?} ({} bytes each)",
            med(&|r| r.reset_p50),
            med(&|r| r.reset_max),
            burst_report[0].bytes
        );
        println!(
            "  other {clients} clients p50 / p99 / max {:?} / {:?} / {:?}",
            med(&|r| r.p50),
            med(&|r| r.p99),
            med(&|r| r.max)
        );
    }
    Ok(())
}

/// One burst round's numbers.
struct BurstRound {
    rss_before_kib: u64,
    builds: u64,
    cpu: Duration,
    wall: Duration,
    peak_kib: u64,
    reset_p50: Duration,
    reset_max: Duration,
    p50: Duration,
    p99: Duration,
    max: Duration,
    bytes: usize,
}

/// `staleguard_validator_answer_builds_total{document="snapshot"}` from the admin listener.
async fn snapshot_builds(admin: SocketAddr) -> Result<u64> {
    let text = http_get(admin, "/metrics").await?;
    Ok(text
        .lines()
        .find_map(|l| {
            l.strip_prefix(r#"staleguard_validator_answer_builds_total{document="snapshot"} "#)
        })
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0))
}

/// One GET on a fresh connection; the body.
async fn fetch(addr: SocketAddr, path: &str) -> Result<Vec<u8>> {
    let mut stream = TcpStream::connect(addr).await?;
    stream
        .write_all(format!("GET {path} HTTP/1.1\r\nHost: bench\r\n\r\n").as_bytes())
        .await?;
    read_response(&mut stream).await
}

/// Waits until the validator reports `clients` long polls waiting.
async fn wait_for_waiting(admin: SocketAddr, clients: usize) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let text = http_get(admin, "/metrics").await?;
        let waiting = text
            .lines()
            .find_map(|l| l.strip_prefix("staleguard_validator_long_polls_waiting "))
            .and_then(|v| v.trim().parse::<usize>().ok())
            .unwrap_or(0);
        if waiting >= clients {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("only {waiting} of {clients} long polls waiting after 30 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn client(
    addr: SocketAddr,
    epoch: u64,
    mut since: u64,
    tx: mpsc::UnboundedSender<Receipt>,
) -> Result<()> {
    let mut stream = TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    loop {
        let request = format!(
            "GET /v1/changes?epoch={epoch}&since={since}&wait=30 HTTP/1.1\r\nHost: bench\r\n\r\n"
        );
        stream.write_all(request.as_bytes()).await?;
        let body = read_response(&mut stream).await?;
        let at = unix_nanos();
        let generation = match Changes::from_json(&body)? {
            Changes::Delta(d) => d.generation,
            Changes::Reset(s) => s.generation,
        };
        since = generation;
        if tx.send(Receipt { generation, at }).is_err() {
            return Ok(());
        }
    }
}

/// Reads one HTTP/1.1 response with a content-length; returns its body.
async fn read_response(stream: &mut TcpStream) -> Result<Vec<u8>> {
    let mut buf = Vec::with_capacity(4096);
    let mut chunk = [0u8; 4096];
    let header_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            bail!("connection closed");
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..header_end]).to_ascii_lowercase();
    if !head.starts_with("http/1.1 200") {
        bail!("unexpected answer: {}", head.lines().next().unwrap_or(""));
    }
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .context("no content-length")?
        .trim()
        .parse()?;
    while buf.len() < header_end + length {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            bail!("connection closed mid-body");
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    Ok(buf[header_end..header_end + length].to_vec())
}

async fn http_get(addr: SocketAddr, path: &str) -> Result<String> {
    let mut stream = TcpStream::connect(addr).await?;
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await?;
    let mut text = String::new();
    stream.read_to_string(&mut text).await?;
    Ok(text)
}
