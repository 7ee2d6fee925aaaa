//! The incident staleguard exists for (istio/istio#25112, issue 21), on
//! loopback: one guarded service whose endpoints are mostly stale, in the four
//! ways a pod's IP goes stale, and a load of concurrent clients that counts
//! what came back.
//!
//! [`Endpoints::start`] puts every endpoint on one port (a service's pods
//! share their target port; a replay names members on the stale pick's port)
//! of its own loopback address:
//! - [`Kind::Live`]: a pod of `shop/cart` that echoes the method, path, body
//!   length and a digest of the body, so the client checks the body arrived
//!   intact;
//! - [`Kind::Recycled`]: a pod of `shop/other` holding a dead cart pod's IP; it
//!   answers 200, as itself;
//! - [`Kind::Blackholed`]: no host answers; SYNs vanish, as on a pod network.
//!   On loopback: a listener with a backlog of 0 whose accept queue is full,
//!   so the kernel drops every further SYN;
//! - [`Kind::Refusing`]: nothing listens; the connection is refused at once;
//! - [`Kind::Hung`]: a listener that accepts and never reads or answers.
//!
//! [`index`] is what the validator says of them (live and recycled pods;
//! the other three are gone). [`run`] sends a [`Load`] through a gateway and
//! returns a [`Report`] per method; every endpoint counts what reached it.

use std::collections::BTreeMap;
use std::io::Read;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use staleguard_core::{IpRecord, ServiceKey};

use crate::blocking::{self, Answer, Server};
use crate::fake_validator::records::pod;

/// What an endpoint's address is, at the time of the incident.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    /// A live pod of the service.
    Live,
    /// Recycled: a pod of another service holds the IP and answers 200.
    Recycled,
    /// Deleted; the IP drops SYNs.
    Blackholed,
    /// Deleted; the IP refuses connections.
    Refusing,
    /// Deleted; the IP accepts connections and never answers.
    Hung,
}

impl Kind {
    /// `live`, `recycled`, `blackholed`, `refusing`, `hung`.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Live => "live",
            Kind::Recycled => "recycled",
            Kind::Blackholed => "blackholed",
            Kind::Refusing => "refusing",
            Kind::Hung => "hung",
        }
    }
}

/// How many endpoints of each kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mix {
    /// Live pods of the service.
    pub live: usize,
    /// IPs recycled to another service.
    pub recycled: usize,
    /// Deleted pods' IPs that drop SYNs.
    pub blackholed: usize,
    /// Deleted pods' IPs that refuse connections.
    pub refusing: usize,
    /// Deleted pods' IPs that accept and never answer.
    pub hung: usize,
}

impl Mix {
    /// The incident's proportions: 25 endpoints, 2 live, 23 stale (92%).
    pub const INCIDENT: Mix = Mix {
        live: 2,
        recycled: 6,
        blackholed: 6,
        refusing: 6,
        hung: 5,
    };

    /// The same service with no stale endpoint: the latency baseline.
    pub const HEALTHY: Mix = Mix {
        live: 2,
        recycled: 0,
        blackholed: 0,
        refusing: 0,
        hung: 0,
    };

    fn kinds(&self) -> Vec<Kind> {
        [
            (Kind::Live, self.live),
            (Kind::Recycled, self.recycled),
            (Kind::Blackholed, self.blackholed),
            (Kind::Refusing, self.refusing),
            (Kind::Hung, self.hung),
        ]
        .into_iter()
        .flat_map(|(k, n)| std::iter::repeat_n(k, n))
        .collect()
    }

    /// Endpoints in all.
    pub fn total(&self) -> usize {
        self.kinds().len()
    }
}

/// The service the gateway's route means.
pub fn cart() -> ServiceKey {
    ServiceKey::new("shop", "cart")
}

/// The service recycled IPs belong to now.
pub fn other() -> ServiceKey {
    ServiceKey::new("shop", "other")
}

/// The header every pod answers with: its service.
pub const SERVICE_HEADER: &str = "x-incident-service";
/// The header every pod answers with: its name.
pub const POD_HEADER: &str = "x-incident-pod";

/// A body's digest (FNV-1a, 64 bits): what a live pod echoes and the client
/// checks.
pub fn digest(body: &[u8]) -> u64 {
    body.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// What a live pod answers to `method target` with `body`.
pub fn echo(method: &str, target: &str, body: &[u8]) -> String {
    format!("{method} {target} {} {:016x}", body.len(), digest(body))
}

/// One endpoint, running.
enum Holder {
    Server(Server),
    /// Sockets held open (a full accept queue, hung connections) and the
    /// thread that accepts, if any.
    Sockets {
        stop: Arc<AtomicBool>,
        thread: Option<JoinHandle<()>>,
        _held: Vec<TcpStream>,
        listener: Arc<TcpListener>,
        hits: Arc<Mutex<u64>>,
    },
    Nothing,
}

/// The endpoints of the incident, on `127.0.<net>.1..` and one port; stopped
/// when dropped.
pub struct Endpoints {
    /// Every endpoint's address and kind, in order.
    pub all: Vec<(SocketAddr, Kind)>,
    holders: Vec<Holder>,
}

impl std::fmt::Debug for Endpoints {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoints").field("all", &self.all).finish()
    }
}

impl Endpoints {
    /// Starts `mix` on `127.0.<net>.1`, `.2`, ... (live pods first).
    pub fn start(net: u8, mix: Mix) -> Result<Self> {
        let kinds = mix.kinds();
        let mut port = 0u16;
        let mut all = Vec::new();
        let mut holders = Vec::new();
        for (i, kind) in kinds.iter().enumerate() {
            let host = u8::try_from(i + 1).context("at most 254 endpoints")?;
            let ip = std::net::IpAddr::from([127, 0, net, host]);
            let name = format!("{}-{i}", kind.as_str());
            let holder = match kind {
                Kind::Live => Holder::Server(pod_server(SocketAddr::new(ip, port), cart(), &name)?),
                Kind::Recycled => {
                    Holder::Server(pod_server(SocketAddr::new(ip, port), other(), &name)?)
                }
                Kind::Blackholed => blackhole(SocketAddr::new(ip, port))?,
                Kind::Hung => hung(SocketAddr::new(ip, port))?,
                Kind::Refusing => Holder::Nothing,
            };
            if port == 0 {
                port = match &holder {
                    Holder::Server(s) => s.addr().port(),
                    Holder::Sockets { listener, .. } => listener.local_addr()?.port(),
                    Holder::Nothing => crate::process::free_port()?,
                };
            }
            all.push((SocketAddr::new(ip, port), *kind));
            holders.push(holder);
        }
        Ok(Self { all, holders })
    }

    /// The addresses, for the gateway's cluster.
    pub fn addrs(&self) -> Vec<SocketAddr> {
        self.all.iter().map(|(a, _)| *a).collect()
    }

    /// Requests that reached an endpoint of `kind` (for blackholed and
    /// refusing ones, always 0; for hung ones, connections that carried
    /// bytes: a connection the gateway opened and never used is no request).
    pub fn hits(&self, kind: Kind) -> u64 {
        self.all
            .iter()
            .zip(&self.holders)
            .filter(|((_, k), _)| *k == kind)
            .map(|(_, h)| match h {
                Holder::Server(s) => s.hits(),
                Holder::Sockets { hits, .. } => {
                    *hits.lock().unwrap_or_else(PoisonError::into_inner)
                }
                Holder::Nothing => 0,
            })
            .sum()
    }

    /// What the validator's index says: live pods of `shop/cart`, recycled
    /// IPs held by pods of `shop/other`; deleted pods are not in it.
    pub fn index(&self) -> (Vec<ServiceKey>, Vec<IpRecord>) {
        let (cart, other) = (cart(), other());
        let records = self
            .all
            .iter()
            .enumerate()
            .filter_map(|(i, (a, k))| match k {
                Kind::Live => Some(pod(
                    &a.ip().to_string(),
                    &format!("cart-{i}"),
                    &[&cart],
                    false,
                )),
                Kind::Recycled => Some(pod(
                    &a.ip().to_string(),
                    &format!("other-{i}"),
                    &[&other],
                    false,
                )),
                _ => None,
            })
            .collect();
        (vec![cart, other], records)
    }
}

impl Drop for Endpoints {
    fn drop(&mut self) {
        for holder in &mut self.holders {
            if let Holder::Sockets { stop, thread, .. } = holder {
                stop.store(true, Ordering::SeqCst);
                if let Some(t) = thread.take() {
                    let _ = t.join();
                }
            }
        }
    }
}

/// A pod of `service` named `name`: 200, its service and name in headers,
/// the echo of the request ([`echo`]) in the body.
fn pod_server(bind: SocketAddr, service: ServiceKey, name: &str) -> Result<Server> {
    let (service, name) = (service.to_string(), name.to_owned());
    Server::start(bind, move |req| Answer::Respond {
        status: 200,
        headers: vec![
            (SERVICE_HEADER.into(), service.clone()),
            (POD_HEADER.into(), name.clone()),
            ("content-type".into(), "text/plain".into()),
        ],
        body: echo(&req.method, &req.target, &req.body).into_bytes(),
    })
}

/// A listener with a backlog of 0 whose accept queue is filled: the kernel
/// then drops every further SYN (no RST), as for an IP no host holds.
fn blackhole(bind: SocketAddr) -> Result<Holder> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()?;
    let listener = {
        let _in = runtime.enter();
        let socket = tokio::net::TcpSocket::new_v4()?;
        socket.bind(bind).with_context(|| format!("bind {bind}"))?;
        socket.listen(0)?.into_std()?
    };
    let addr = listener.local_addr()?;
    let mut held = Vec::new();
    // Connect until a connect does not complete: the queue is full.
    while held.len() < 8 {
        match TcpStream::connect_timeout(&addr, Duration::from_millis(200)) {
            Ok(s) => held.push(s),
            Err(_) => break,
        }
    }
    anyhow::ensure!(
        held.len() < 8,
        "{addr}: the accept queue never filled; SYNs are not dropped here"
    );
    Ok(Holder::Sockets {
        stop: Arc::new(AtomicBool::new(false)),
        thread: None,
        _held: held,
        listener: Arc::new(listener),
        hits: Arc::new(Mutex::new(0)),
    })
}

/// A listener that accepts every connection and never reads or answers.
fn hung(bind: SocketAddr) -> Result<Holder> {
    let listener = Arc::new(TcpListener::bind(bind).with_context(|| format!("bind {bind}"))?);
    listener.set_nonblocking(true)?;
    let stop = Arc::new(AtomicBool::new(false));
    let hits = Arc::new(Mutex::new(0u64));
    let thread = {
        let (listener, stop, hits) = (listener.clone(), stop.clone(), hits.clone());
        std::thread::spawn(move || {
            let mut open = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((s, _)) => {
                        let _ = s.set_nonblocking(true);
                        open.push((s, false));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
                // A connection that carried bytes carried a request (counted
                // once); one the gateway closed is forgotten.
                open.retain_mut(|(s, counted)| {
                    let mut b = [0u8; 4096];
                    match (&*s).read(&mut b) {
                        Ok(0) => false,
                        Ok(_) => {
                            if !*counted {
                                *counted = true;
                                *hits.lock().unwrap_or_else(PoisonError::into_inner) += 1;
                            }
                            true
                        }
                        Err(_) => true,
                    }
                });
            }
        })
    };
    Ok(Holder::Sockets {
        stop,
        thread: Some(thread),
        _held: Vec::new(),
        listener,
        hits,
    })
}

/// The load: concurrent clients, each sending its share of requests, methods
/// and body sizes in turn.
#[derive(Debug, Clone)]
pub struct Load {
    /// Concurrent clients (one connection per request).
    pub clients: usize,
    /// Requests per client.
    pub per_client: usize,
    /// Methods, in turn.
    pub methods: Vec<&'static str>,
    /// Body sizes for methods with a body, in turn.
    pub body_sizes: Vec<usize>,
    /// The path prefix the gateway routes to the service.
    pub prefix: String,
    /// The `host` header, for a gateway that routes by virtual host (an
    /// Istio gateway's); none for the shipped plain-Envoy gateway.
    pub host: Option<String>,
}

impl Load {
    /// Issue 21's load: 16 clients; GET, HEAD, POST, PUT, PATCH; bodies of
    /// 16 B to 1 MiB.
    pub fn incident(per_client: usize) -> Self {
        Self {
            clients: 16,
            per_client,
            methods: vec!["GET", "HEAD", "POST", "PUT", "PATCH"],
            body_sizes: vec![16, 2 << 10, 64 << 10, 16, 2 << 10, 1 << 20],
            prefix: "/cart".into(),
            host: None,
        }
    }
}

/// What the clients saw, for one method.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// Requests sent.
    pub sent: u64,
    /// Answered by a live pod of the service, body intact.
    pub answered: u64,
    /// Answered by another service.
    pub wrong_service: u64,
    /// Anything else, by status and a few response headers.
    pub failed: BTreeMap<String, u64>,
    /// Client latency of every request, in microseconds, sorted.
    pub latencies_us: Vec<u64>,
}

impl Report {
    /// Requests that failed.
    pub fn failures(&self) -> u64 {
        self.failed.values().sum()
    }

    /// The `p`th percentile latency (0..=100).
    pub fn percentile(&self, p: f64) -> Duration {
        if self.latencies_us.is_empty() {
            return Duration::ZERO;
        }
        let rank = ((p / 100.0) * (self.latencies_us.len() - 1) as f64).round() as usize;
        Duration::from_micros(self.latencies_us[rank.min(self.latencies_us.len() - 1)])
    }

    /// The answered share, 0..=1.
    pub fn answered_share(&self) -> f64 {
        if self.sent == 0 {
            return 0.0;
        }
        self.answered as f64 / self.sent as f64
    }

    fn merge(&mut self, other: &Report) {
        self.sent += other.sent;
        self.answered += other.answered;
        self.wrong_service += other.wrong_service;
        for (k, v) in &other.failed {
            *self.failed.entry(k.clone()).or_default() += v;
        }
        self.latencies_us.extend(&other.latencies_us);
        self.latencies_us.sort_unstable();
    }

    /// One line: `answered a/n, wrong w, failed f, p50 .. p99 .. max ..`.
    pub fn line(&self) -> String {
        format!(
            "answered {}/{} ({:.2}%), wrong service {}, failed {} {:?}, p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
            self.answered,
            self.sent,
            self.answered_share() * 100.0,
            self.wrong_service,
            self.failures(),
            self.failed,
            self.percentile(50.0).as_secs_f64() * 1e3,
            self.percentile(99.0).as_secs_f64() * 1e3,
            self.percentile(100.0).as_secs_f64() * 1e3,
        )
    }
}

/// Reports by method, and `ALL` for every request.
pub type Reports = BTreeMap<String, Report>;

/// The key of [`Reports`] for every request.
pub const ALL: &str = "ALL";

/// Sends `load` to the gateway listening on `gateway` and says what came back.
pub fn run(gateway: SocketAddr, load: &Load) -> Result<Reports> {
    let bodies: Vec<Vec<u8>> = load
        .body_sizes
        .iter()
        .map(|n| (0..*n).map(|i| (i % 251) as u8).collect())
        .collect();
    let bodies = Arc::new(bodies);
    let workers: Vec<_> = (0..load.clients)
        .map(|c| {
            let (load, bodies) = (load.clone(), bodies.clone());
            std::thread::spawn(move || client(gateway, &load, &bodies, c))
        })
        .collect();
    let mut reports = Reports::new();
    for w in workers {
        let mine = w
            .join()
            .map_err(|_| anyhow::anyhow!("a client thread panicked"))??;
        for (method, r) in mine {
            reports.entry(method.clone()).or_default().merge(&r);
            reports.entry(ALL.into()).or_default().merge(&r);
        }
    }
    Ok(reports)
}

fn client(gateway: SocketAddr, load: &Load, bodies: &[Vec<u8>], c: usize) -> Result<Reports> {
    let mut reports = Reports::new();
    let cart = cart().to_string();
    for i in 0..load.per_client {
        let n = c * load.per_client + i;
        let method = load.methods[n % load.methods.len()];
        let body = (!matches!(method, "GET" | "HEAD")).then(|| {
            let k = (n / load.methods.len()) % bodies.len();
            bodies[k].as_slice()
        });
        let target = format!("{}/{c}/{i}?n={n}", load.prefix);
        let started = Instant::now();
        let host: Vec<(&str, &str)> = load.host.iter().map(|h| ("host", h.as_str())).collect();
        let result = blocking::request(gateway, method, &target, &host, body);
        let took = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
        let report = reports.entry(method.to_owned()).or_default();
        report.sent += 1;
        report.latencies_us.push(took);
        match result {
            Ok(r) if r.header(SERVICE_HEADER) == cart && r.status == 200 => {
                let intact =
                    method == "HEAD" || r.body == echo(method, &target, body.unwrap_or_default());
                if intact {
                    report.answered += 1;
                } else {
                    *report.failed.entry("200 body altered".into()).or_default() += 1;
                }
            }
            Ok(r) if !r.header(SERVICE_HEADER).is_empty() => report.wrong_service += 1,
            Ok(r) => {
                let key = format!(
                    "{} {}{}",
                    r.status,
                    r.header("x-staleguard"),
                    r.body.chars().take(40).collect::<String>().trim()
                );
                *report.failed.entry(key).or_default() += 1;
            }
            Err(e) => {
                let key = format!("error {}", e.root_cause());
                *report.failed.entry(key).or_default() += 1;
            }
        }
    }
    Ok(reports)
}

/// Requests per client of an incident test: `STALEGUARD_INCIDENT_REQUESTS`
/// when set to a number, `default` otherwise.
pub fn requests_per_client(default: usize) -> usize {
    std::env::var("STALEGUARD_INCIDENT_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}
