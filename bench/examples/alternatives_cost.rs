//! What staleguard costs per request against what a user would otherwise run
//! (issue 14, `bench/run` section 1): gateways side by side, Envoy 1.40 with
//! one worker each, that differ only in the guarded cluster's upstream HTTP
//! filters. wrk drives each in turn (interleaved rounds); Envoy's CPU comes
//! from `/proc/PID/stat` (utime + stime, every thread), latency from wrk.
//!
//! ```text
//! . scripts/setup.sh && sg_setup_all
//! cargo build -p staleguard-bench-filters --target wasm32-wasip1 --profile wasm-release
//! STALEGUARD_BENCH_WASM=target/wasm32-wasip1/wasm-release/staleguard_bench_filters.wasm \
//!   cargo run --release -p staleguard-bench --example alternatives_cost
//! # PODS=150000 ROUNDS=6 SECONDS=15 CONNECTIONS=16 are the defaults
//! ```
//!
//! The validator's real API serves a synthetic index of `PODS` IPs in 1,000
//! services plus the benchmark's own: `bench/live` (4 pods, servers on
//! 127.0.1.1-4) and `bench/other` (one pod on 127.0.1.9: the recycled IP the
//! reject and retry paths aim at). It runs in a child process (this binary
//! again), so the naive design's validator CPU is its own. Prints a markdown
//! section on stdout; progress on stderr.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use staleguard_bench::{
    cpu_ticks, env_usize, loadavg, median, rss_kib, swap_module, ticks_us, wait_loaded, wrk,
    MISSING,
};
use staleguard_tests::blocking::{Answer, Server};
use staleguard_tests::envoy::{add_twin_endpoints, shipped_plugin, Cluster, Envoy, Gateway};
use staleguard_tests::process::OwnedProcess;

const LIVE: &str = "outbound|80||live.bench.svc.cluster.local";
const LIVE_IPS: [&str; 4] = ["127.0.1.1", "127.0.1.2", "127.0.1.3", "127.0.1.4"];
/// A pod of `bench/other`: for `bench/live`'s cluster, a recycled IP.
const RECYCLED_IP: &str = "127.0.1.9";
const CHILD_ENV: &str = "REQUEST_COST_VALIDATOR";

/// One gateway of the comparison.
struct Variant {
    name: &'static str,
    /// What the filter counts for each request, checked against Envoy's
    /// `http.gateway.downstream_rq_total` (`None`: the variant counts nothing).
    counted: Option<Counter>,
    /// Every answer must be 2xx (else: every answer must not be).
    ok: bool,
    envoy: Envoy,
}

#[derive(Clone, Copy)]
enum Counter {
    Requests(&'static str, &'static str),
    Stat(&'static str),
}

#[derive(Default)]
struct Samples {
    cpu_us: Vec<f64>,
    validator_us: Vec<f64>,
    p50_us: Vec<f64>,
    p99_us: Vec<f64>,
    rps: Vec<f64>,
    requests: u64,
    bad_status: u64,
    socket_errors: u64,
}

fn main() -> Result<()> {
    if std::env::var_os(CHILD_ENV).is_some() {
        return serve_validator();
    }
    let pods = env_usize("PODS", 150_000);
    let rounds = env_usize("ROUNDS", 6).max(1);
    let seconds = env_usize("SECONDS", 15).max(1);
    let connections = env_usize("CONNECTIONS", 16).max(1);
    let bench_wasm = PathBuf::from(
        std::env::var("STALEGUARD_BENCH_WASM")
            .context("STALEGUARD_BENCH_WASM: the bench filter module (bench/run builds it)")?,
    );
    if !bench_wasm.exists() {
        bail!("{}: no such module", bench_wasm.display());
    }

    // === the validator, in a child process ===
    eprintln!("request_cost: validator with {pods} synthetic IPs (child process)");
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.env(CHILD_ENV, "1").env("PODS", pods.to_string());
    let validator = OwnedProcess::spawn("request-cost-validator", cmd)?;
    let started = Instant::now();
    let validator_addr: SocketAddr = loop {
        validator.check_alive()?;
        if let Some(line) = validator
            .output()
            .lines()
            .find_map(|l| l.strip_prefix("LISTEN ").map(str::to_owned))
        {
            break line.trim().parse()?;
        }
        if started.elapsed() > Duration::from_secs(300) {
            bail!("the validator child did not start:\n{}", validator.output());
        }
        std::thread::sleep(Duration::from_millis(100));
    };

    // === the pods ===
    let (port, _pods) = bind_pods()?;
    let live: Vec<SocketAddr> = LIVE_IPS
        .iter()
        .map(|ip| SocketAddr::new(ip.parse().unwrap(), port))
        .collect();
    let recycled = SocketAddr::new(RECYCLED_IP.parse()?, port);

    // === the gateways ===
    let gateway = |hosts: Vec<SocketAddr>, plugin: Option<Value>| {
        Gateway::new(
            validator_addr,
            vec![Cluster::with_hosts(LIVE, hosts, plugin)],
        )
    };
    let start = |name: &str, g: Gateway, edit: &dyn Fn(&mut Value) -> Result<()>| {
        eprintln!("request_cost: starting gateway `{name}`");
        g.start_with(edit)?.context(MISSING)
    };
    let keep = |_: &mut Value| Ok(());
    let bench_module = |b: &mut Value| {
        swap_module(b, &bench_wasm);
        Ok(())
    };
    // The retry path: every pick is the recycled IP; the twin also has the
    // live pods, which the replay names.
    let twin_has_live = |b: &mut Value| add_twin_endpoints(b, LIVE, &live);
    let mut variants = vec![
        Variant {
            name: "no filter",
            counted: None,
            ok: true,
            envoy: start("no filter", gateway(live.clone(), None), &keep)?,
        },
        Variant {
            name: "no-op Wasm filter",
            counted: None,
            ok: true,
            envoy: start(
                "no-op",
                gateway(live.clone(), Some(json!({}))),
                &bench_module,
            )?,
        },
        Variant {
            name: "staleguard, allow path (shipped)",
            counted: Some(Counter::Requests("member", "allow")),
            ok: true,
            envoy: start(
                "staleguard allow",
                gateway(live.clone(), Some(shipped_plugin(json!({})))),
                &keep,
            )?,
        },
        Variant {
            name: "staleguard, reject path (knob: on_reject=reject)",
            counted: Some(Counter::Requests("recycled", "reject")),
            ok: false,
            envoy: start(
                "staleguard reject",
                gateway(
                    vec![recycled],
                    Some(shipped_plugin(json!({"on_reject": "reject"}))),
                ),
                &keep,
            )?,
        },
        Variant {
            name: "staleguard, retry path (shipped: replayed via the twin)",
            counted: Some(Counter::Requests("recycled", "retry")),
            ok: true,
            envoy: start(
                "staleguard retry",
                gateway(vec![recycled], Some(shipped_plugin(json!({})))),
                &twin_has_live,
            )?,
        },
        Variant {
            name: "naive: ask the validator per request",
            counted: Some(Counter::Stat("wasmcustom.bench_naive_asked_total")),
            ok: true,
            envoy: start(
                "naive",
                gateway(
                    live.clone(),
                    Some(json!({"mode": "naive", "service": "bench/live"})),
                ),
                &bench_module,
            )?,
        },
    ];
    const NAIVE: usize = 5;
    const ALLOW: usize = 2;
    const NOOP: usize = 1;
    const NONE: usize = 0;

    for v in &mut variants {
        if v.counted.is_some() && !v.name.starts_with("naive") {
            wait_loaded(&v.envoy, Duration::from_secs(300))?;
        }
    }
    let entries = variants[ALLOW]
        .envoy
        .stat("wasmcustom.staleguard_filter_index_entries")?;
    let resync_us = variants[ALLOW]
        .envoy
        .stat("wasmcustom.staleguard_filter_sync_apply_microseconds")?;

    // === warm-up, then interleaved rounds ===
    for v in &variants {
        let r = wrk(v.envoy.listener, LIVE, connections, 1)?;
        if v.ok != (r.bad_status == 0) || r.requests == 0 {
            bail!(
                "{}: warm-up answered {} of {} requests with a non-2xx status",
                v.name,
                r.bad_status,
                r.requests
            );
        }
    }
    let load_before = loadavg();
    let mut samples: Vec<Samples> = variants.iter().map(|_| Samples::default()).collect();
    for round in 0..rounds {
        for k in 0..variants.len() {
            let i = (k + round) % variants.len();
            let v = &variants[i];
            let cpu0 = cpu_ticks(v.envoy.pid())?;
            let val0 = cpu_ticks(validator.pid())?;
            let r = wrk(v.envoy.listener, LIVE, connections, seconds)?;
            let cpu = cpu_ticks(v.envoy.pid())? - cpu0;
            let val = cpu_ticks(validator.pid())? - val0;
            let s = &mut samples[i];
            let done = r.requests.max(1) as f64;
            s.cpu_us.push(ticks_us(cpu) / done);
            if i == NAIVE {
                s.validator_us.push(ticks_us(val) / done);
            }
            s.p50_us.push(r.p50_us);
            s.p99_us.push(r.p99_us);
            s.rps.push(r.requests as f64 / seconds as f64);
            s.requests += r.requests;
            s.bad_status += r.bad_status;
            s.socket_errors += r.socket_errors;
        }
        eprintln!("request_cost: round {} of {rounds} done", round + 1);
    }
    let load_after = loadavg();

    // === checks: every request judged once, statuses as the path says ===
    let mut problems = Vec::new();
    let mut checked = Vec::new();
    for (v, s) in variants.iter_mut().zip(&samples) {
        let downstream = v.envoy.stat("http.gateway.downstream_rq_total")?;
        if let Some(counter) = v.counted {
            // The filter adds its request counts to Envoy's on the root's
            // tick (docs/metrics.md): give the last tick time to come before
            // comparing. A counter that never gets there fails the check.
            let runs = (rounds + 1) * connections;
            let want = downstream.saturating_sub(runs as u64);
            let _ = v
                .envoy
                .eventually("the last counts", Duration::from_secs(10), |e| {
                    Ok(match counter {
                        Counter::Requests(reason, action) => e.requests(reason, action)?,
                        Counter::Stat(name) => e.stat(name)?,
                    } >= want)
                });
            let counted = match counter {
                Counter::Requests(reason, action) => v.envoy.requests(reason, action)?,
                Counter::Stat(name) => v.envoy.stat(name)?,
            };
            // wrk stops with up to one request in flight per connection; a
            // request its client abandoned mid-replay is not counted by the
            // filter (it counts a replay when it ends).
            let abandoned = downstream.saturating_sub(counted);
            if counted > downstream || abandoned > runs as u64 {
                problems.push(format!(
                    "{}: the filter counted {counted} requests, Envoy {downstream}",
                    v.name
                ));
            }
            checked.push(format!(
                "{}: {counted} of {downstream}{}",
                v.name,
                if abandoned > 0 {
                    format!(" ({abandoned} abandoned in flight when wrk stopped)")
                } else {
                    String::new()
                }
            ));
        }
        let bad = if v.ok {
            s.bad_status
        } else {
            s.requests - s.bad_status
        };
        if bad > 0 {
            problems.push(format!(
                "{}: {bad} of {} answers had the wrong status class",
                v.name, s.requests
            ));
        }
    }

    // === report ===
    let mut cpu: Vec<f64> = samples.iter_mut().map(|s| median(&mut s.cpu_us)).collect();
    let validator_cpu = median(&mut samples[NAIVE].validator_us);
    cpu.push(0.0);
    let none = cpu[NONE];
    let noop = cpu[NOOP];
    println!(
        "{rounds} interleaved rounds of {seconds} s per gateway, wrk with {connections} keep-alive \
         connections (1 thread), Envoy 1.40 `--concurrency 1` per gateway; index of {entries} IPs \
         in the filter. Load average {load_before} before, {load_after} after.\n"
    );
    println!(
        "| gateway (upstream filters) | Envoy CPU per request (median) | x no filter | x no-op Wasm | \
         requests/s | latency p50 / p99 (medians) | requests | non-2xx |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    for (i, (v, s)) in variants.iter().zip(samples.iter_mut()).enumerate() {
        let c = cpu[i];
        let extra = if i == NAIVE {
            format!(
                " + validator {validator_cpu:.1} us = **{:.1} us**",
                c + validator_cpu
            )
        } else {
            String::new()
        };
        let total = if i == NAIVE { c + validator_cpu } else { c };
        println!(
            "| {} | {c:.1} us{extra} | {:.2}x | {:.2}x | {:.0} | {:.0} / {:.0} us | {} | {} |",
            v.name,
            total / none,
            total / noop,
            median(&mut s.rps),
            median(&mut s.p50_us),
            median(&mut s.p99_us),
            s.requests,
            s.bad_status
        );
    }
    let sg = cpu[ALLOW];
    let naive_total = cpu[NAIVE] + validator_cpu;
    println!();
    println!(
        "- naive / staleguard (allow path), Envoy + validator CPU per request: **{:.1}x** \
         (target >= 5x: {}); Envoy alone: {:.1}x",
        naive_total / sg,
        verdict(naive_total / sg >= 5.0),
        cpu[NAIVE] / sg
    );
    println!(
        "- staleguard (allow path) / no-op Wasm: **{:.2}x** (target <= 1.05x: {}); \
         staleguard's own share above the no-op: {:.1} us per request",
        sg / noop,
        verdict(sg / noop <= 1.05),
        sg - noop
    );
    println!(
        "- the filter's full resync of {entries} IPs inside Envoy (decode + write to shared data, \
         `staleguard_filter_sync_apply_microseconds`): {:.2} s",
        resync_us as f64 / 1e6
    );
    let rss_noop = rss_kib(variants[NOOP].envoy.pid())?;
    let rss_sg = rss_kib(variants[ALLOW].envoy.pid())?;
    let rss_none = rss_kib(variants[NONE].envoy.pid())?;
    println!(
        "- Envoy RSS: no filter {:.1} MiB, no-op Wasm {:.1} MiB, staleguard {:.1} MiB: \
         **{:.1} MiB above the no-op, {:.0} bytes per IP**",
        rss_none as f64 / 1024.0,
        rss_noop as f64 / 1024.0,
        rss_sg as f64 / 1024.0,
        (rss_sg as f64 - rss_noop as f64) / 1024.0,
        (rss_sg as f64 - rss_noop as f64) * 1024.0 / entries.max(1) as f64
    );
    if problems.is_empty() {
        println!(
            "- checks: statuses as expected; requests the filter counted, of Envoy's downstream \
             requests: {}",
            checked.join("; ")
        );
    } else {
        for p in &problems {
            println!("- **check failed**: {p}");
        }
    }
    println!(
        "\nMACHINE request_cost sg_over_noop={:.3} naive_over_sg={:.2} sg_us={sg:.1} noop_us={noop:.1} \
         none_us={none:.1} naive_us={:.1} naive_validator_us={validator_cpu:.1} resync_s={:.2} \
         rss_above_noop_mib={:.1} entries={entries}",
        sg / noop,
        naive_total / sg,
        cpu[NAIVE],
        resync_us as f64 / 1e6,
        (rss_sg as f64 - rss_noop as f64) / 1024.0
    );
    if !problems.is_empty() {
        bail!("{} check(s) failed (see the report)", problems.len());
    }
    Ok(())
}

fn verdict(met: bool) -> &'static str {
    if met {
        "met"
    } else {
        "**missed**"
    }
}

// === the validator child ===

fn serve_validator() -> Result<()> {
    use staleguard_validator::api::{self, ApiConfig};
    use staleguard_validator::index::{Index, IndexConfig};
    use staleguard_validator::live::SharedIndex;
    use staleguard_validator::synth;

    let pods = env_usize("PODS", 150_000);
    let services = 1000.min(pods.max(1));
    let shared = SharedIndex::new(
        Index::new(1, IndexConfig::default()),
        Duration::from_secs(3600),
    );
    let mut cluster = synth::cluster(services, pods / services);
    for (app, ips) in [("live", &LIVE_IPS[..]), ("other", &[RECYCLED_IP][..])] {
        let members: Vec<synth::SynthPod> = ips
            .iter()
            .enumerate()
            .map(|(n, ip)| {
                synth::SynthPod::new("bench", &format!("{app}-{n}"), app, ip.parse().unwrap())
            })
            .collect();
        cluster.services.push(synth::service("bench", app));
        cluster.slices.push(synth::slice(
            "bench",
            &format!("{app}-slice"),
            app,
            members.iter().map(synth::SynthPod::endpoint).collect(),
        ));
        cluster
            .pods
            .extend(members.iter().map(synth::SynthPod::build));
    }
    synth::feed(&shared, cluster);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let config = ApiConfig {
            listen: "127.0.0.1:0".parse()?,
            admin_listen: "127.0.0.1:0".parse()?,
            ..ApiConfig::default()
        };
        let (addr, _admin) = api::spawn(shared.clone(), &config).await?;
        println!("LISTEN {addr}");
        std::io::stdout().flush()?;
        std::future::pending::<()>().await;
        Ok(())
    })
}

// === the pods: answer at once, keep connections ===

/// The live pods and the recycled IP, on one port (free on all five
/// addresses), answering at once with their app's name.
fn bind_pods() -> Result<(u16, Vec<Server>)> {
    let pod = |ip: &str, port: u16, app: &str| {
        let answer = Answer::Respond {
            status: 200,
            headers: vec![("x-app".into(), app.into())],
            body: format!("{app}\n").into_bytes(),
        };
        Server::constant(SocketAddr::new(ip.parse()?, port), answer)
    };
    for _ in 0..20 {
        let first = pod(LIVE_IPS[0], 0, "live")?;
        let port = first.addr().port();
        let rest: Result<Vec<Server>> = LIVE_IPS[1..]
            .iter()
            .map(|ip| pod(ip, port, "live"))
            .chain(std::iter::once(pod(RECYCLED_IP, port, "other")))
            .collect();
        let Ok(rest) = rest else { continue };
        return Ok((port, std::iter::once(first).chain(rest).collect()));
    }
    bail!("no port free on all of 127.0.1.1-4 and .9")
}
