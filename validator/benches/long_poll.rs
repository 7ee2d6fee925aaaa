//! Fan-out benchmark: how long after an index change do 1,000 long-polling
//! gateways all have it, and what does the validator pay for that?
//!
//! `cargo bench -p staleguard-validator --bench long_poll` (options through the
//! environment: `CLIENTS` (1000), `ROUNDS` (30), `SERVICES` (100), `PODS` (150
//! per service)). The validator runs in a child process (this binary again,
//! with `SG_BENCH_ROLE=server`) so its CPU time and memory are its own; the
//! clients are plain HTTP/1.1 connections on loopback, each re-polling as soon
//! as it got an answer, as the filter does. For every round the child applies
//! one change and reports the wall-clock time it did; each client stamps the
//! time its answer was complete. Latency = stamp - change time (same machine,
//! same clock). Results go to docs/benchmarks.md by hand.

use std::io::{BufRead, Write};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use staleguard_core::Changes;
use staleguard_validator::api::{self, ApiConfig};
use staleguard_validator::index::{Index, IndexConfig};
use staleguard_validator::shared::SharedIndex;
use staleguard_validator::synth;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

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
        let cluster = synth::cluster(env("SERVICES", 100), env("PODS", 150));
        let victim = cluster.pods[0].clone();
        synth::feed(&shared, cluster);
        let config = ApiConfig {
            listen: "127.0.0.1:0".parse()?,
            admin_listen: "127.0.0.1:0".parse()?,
            max_long_polls: 100_000,
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

fn driver() -> Result<()> {
    let clients = env("CLIENTS", 1000);
    let rounds = env("ROUNDS", 30);
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
        writeln!(to_server, "change")?;
        let applied = next_line()?;
        let (new_generation, at): (u64, u128) = (applied[1].parse()?, applied[2].parse()?);
        let mut latencies = Vec::with_capacity(clients);
        runtime.block_on(async {
            while latencies.len() < clients {
                let Some(r) = tokio::time::timeout(Duration::from_secs(30), rx.recv()).await?
                else {
                    bail!("clients went away");
                };
                if r.generation == new_generation {
                    latencies.push(Duration::from_nanos(r.at.saturating_sub(at) as u64));
                }
            }
            Ok::<_, anyhow::Error>(())
        })?;
        wall += started.elapsed();
        writeln!(to_server, "stats")?;
        let after = next_line()?;
        cpu_ticks += after[1].parse::<u64>()? - before[1].parse::<u64>()?;
        generation = new_generation;
        latencies.sort();
        let pct =
            |p: f64| latencies[((latencies.len() as f64 * p).ceil() as usize).saturating_sub(1)];
        let (p50, p99, max) = (pct(0.50), pct(0.99), latencies[latencies.len() - 1]);
        eprintln!("round {round:>2}: generation {generation}: p50 {p50:?} p99 {p99:?} max {max:?}");
        p50s.push(p50);
        p99s.push(p99);
        maxes.push(max);
    }
    writeln!(to_server, "stats")?;
    let last = next_line()?;
    FINISHED.store(true, Ordering::Relaxed);
    drop(to_server);
    let _ = child.wait();

    let median = |v: &mut Vec<Duration>| {
        v.sort();
        v[v.len() / 2]
    };
    println!(
        "long-poll fan-out: {clients} clients, {rounds} rounds, index of {} pods",
        env("SERVICES", 100) * env("PODS", 150)
    );
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
    println!(
        "  validator RSS now / peak           {} / {} KiB",
        last[3], last[2]
    );
    Ok(())
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
