//! Simulated pods: small HTTP servers on distinct loopback addresses.
//!
//! A [`PodServer`] owns one address (`127.0.1.x:port`, standing for a pod IP)
//! for the whole test. Who answers there is its [`Occupant`], which the harness
//! switches as the simulated cluster changes: the pod the gateway was told
//! about, a pod of another service after the IP was recycled, or a [`Ghost`]
//! (whatever answers on a dead pod's address: in the incident, 200s from
//! someone else), or a dead pod's address that hangs, refuses or drops
//! connections. Keeping the listener bound across those switches is what lets
//! the server count the requests that reached an address the gateway should no
//! longer have used.
//!
//! Envoy tags each request with the service it meant (`x-sg-intended`) and the
//! gateway path it took (`x-sg-via`: guarded, plain, audit...), so every
//! request is classified *at the server*, where it landed, into a [`Tally`]:
//! right service, wrong service, or a dead pod.
//!
//! [`Ghost`]: Occupant::Ghost

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};

use anyhow::{Context, Result};
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, Response};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::sync::Notify;
use tokio::task::{AbortHandle, JoinHandle};

/// The response header a health check's `service_name_matcher` reads.
pub const HEALTHCHECKED_HEADER: &str = "x-envoy-upstream-healthchecked-cluster";

/// The request header naming the service the gateway's cluster routes to.
pub const INTENDED_HEADER: &str = "x-sg-intended";
/// The request header naming the gateway path (guarded, plain, audit...).
pub const VIA_HEADER: &str = "x-sg-via";
/// The response header naming the service that answered (`ghost` for a dead pod).
pub const SERVICE_HEADER: &str = "x-sg-service";
/// The response header naming the pod that answered.
pub const POD_HEADER: &str = "x-sg-pod";

/// Who answers on an address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Occupant {
    /// A pod of a service (`namespace/name`).
    Pod {
        /// `namespace/name` of the pod's service.
        service: String,
        /// The pod's name.
        pod: String,
    },
    /// Nothing the cluster knows: the address of a destroyed pod, still
    /// answering 200 as whatever took it over.
    Ghost,
    /// A destroyed pod's address that accepts connections and never answers.
    Hung,
    /// A destroyed pod's address that refuses connections: nothing listens.
    Refusing,
    /// A destroyed pod's address whose SYNs vanish, as on a pod network (on
    /// loopback: a listener with a backlog of 0 whose accept queue is full).
    Blackholed,
}

impl Occupant {
    /// A pod of `service`.
    pub fn pod(service: impl Into<String>, pod: impl Into<String>) -> Self {
        Occupant::Pod {
            service: service.into(),
            pod: pod.into(),
        }
    }
}

/// Requests that reached one address (or many, summed), by where they landed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tally {
    /// Answered by a pod of the service the gateway meant.
    pub right: u64,
    /// Answered by a pod of another service (a recycled IP).
    pub wrong_service: u64,
    /// Answered on a destroyed pod's address.
    pub dead: u64,
    /// Arrived without the `x-sg-intended` header (not through the gateway).
    pub untagged: u64,
}

impl Tally {
    /// Requests that reached a wrong or dead pod.
    pub fn misrouted(&self) -> u64 {
        self.wrong_service + self.dead
    }

    /// Every request counted.
    pub fn total(&self) -> u64 {
        self.right + self.wrong_service + self.dead + self.untagged
    }

    fn add(&mut self, other: &Tally) {
        self.right += other.right;
        self.wrong_service += other.wrong_service;
        self.dead += other.dead;
        self.untagged += other.untagged;
    }
}

/// Tallies by gateway path (`x-sg-via`; `-` when absent).
pub type Tallies = BTreeMap<String, Tally>;

/// The tally of one gateway path (zero when nothing came that way).
pub fn via(tallies: &Tallies, path: &str) -> Tally {
    tallies.get(path).copied().unwrap_or_default()
}

/// Adds `from` into `into`, path by path.
pub fn merge(into: &mut Tallies, from: &Tallies) {
    for (via, tally) in from {
        into.entry(via.clone()).or_default().add(tally);
    }
}

#[derive(Debug)]
struct PodState {
    occupant: Mutex<Occupant>,
    tallies: Mutex<Tallies>,
}

/// One simulated pod address with a switchable occupant.
#[derive(Debug)]
pub struct PodServer {
    addr: SocketAddr,
    state: Arc<PodState>,
    /// Wakes the accept loop when the occupant changes: a refusing or
    /// blackholed address closes its listener, a pod's opens it again.
    changed: Arc<Notify>,
    task: JoinHandle<()>,
    /// The open connections' tasks, so [`PodServer::stop`] can close them.
    connections: Arc<Mutex<Vec<AbortHandle>>>,
}

impl PodServer {
    /// Binds `addr` and starts answering as `occupant`. Needs a tokio runtime.
    pub async fn start(addr: SocketAddr, occupant: Occupant) -> Result<Self> {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("bind pod address {addr}"))?;
        let state = Arc::new(PodState {
            occupant: Mutex::new(occupant),
            tallies: Mutex::new(Tallies::new()),
        });
        let connections = Arc::new(Mutex::new(Vec::new()));
        let changed = Arc::new(Notify::new());
        let task = tokio::spawn(accept(
            addr,
            listener,
            state.clone(),
            connections.clone(),
            changed.clone(),
        ));
        Ok(Self {
            addr,
            state,
            changed,
            task,
            connections,
        })
    }

    /// Stops the pod as a killed process stops: the address refuses new
    /// connections and the open ones are closed (Envoy sees them end).
    pub fn stop(&self) {
        self.task.abort();
        for connection in lock(&self.connections).drain(..) {
            connection.abort();
        }
    }

    /// The address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Who answers now.
    pub fn occupant(&self) -> Occupant {
        lock(&self.state.occupant).clone()
    }

    /// Switches who answers; requests already in flight finish as the old one.
    pub fn set_occupant(&self, occupant: Occupant) {
        *lock(&self.state.occupant) = occupant;
        self.changed.notify_one();
    }

    /// What reached this address so far, by gateway path.
    pub fn tallies(&self) -> Tallies {
        lock(&self.state.tallies).clone()
    }
}

impl Drop for PodServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A listener on `addr` that may take over an address just closed.
fn bind(addr: SocketAddr, backlog: u32) -> std::io::Result<tokio::net::TcpListener> {
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(backlog)
}

/// A listener on `addr` with a backlog of 0 and its accept queue filled, so
/// the kernel drops every further SYN (no RST), and the connections that
/// fill it.
async fn blackhole(
    addr: SocketAddr,
) -> std::io::Result<(tokio::net::TcpListener, Vec<tokio::net::TcpStream>)> {
    let listener = bind(addr, 0)?;
    let mut held = Vec::new();
    while held.len() < 8 {
        let connect = tokio::net::TcpStream::connect(addr);
        match tokio::time::timeout(std::time::Duration::from_millis(200), connect).await {
            Ok(Ok(s)) => held.push(s),
            _ => break,
        }
    }
    Ok((listener, held))
}

/// Serves HTTP/1.1 on every accepted connection, each in a task of its own
/// (kept in `connections`, so [`PodServer::stop`] can end them), while the
/// occupant answers; closes the listener while the address refuses or drops
/// connections, and binds it again when a pod takes the address.
async fn accept(
    addr: SocketAddr,
    listener: tokio::net::TcpListener,
    state: Arc<PodState>,
    connections: Arc<Mutex<Vec<AbortHandle>>>,
    changed: Arc<Notify>,
) {
    let mut listening = Some(listener);
    let mut hole: Option<(tokio::net::TcpListener, Vec<tokio::net::TcpStream>)> = None;
    let pause = || tokio::time::sleep(std::time::Duration::from_millis(10));
    loop {
        let occupant = lock(&state.occupant).clone();
        if matches!(occupant, Occupant::Refusing | Occupant::Blackholed) {
            if listening.take().is_some() {
                // The pod drained before it died: requests in flight finish,
                // then its connections end.
                let open: Vec<AbortHandle> = lock(&connections).drain(..).collect();
                tokio::spawn(async move {
                    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                    for connection in open {
                        connection.abort();
                    }
                });
            }
            match occupant {
                Occupant::Blackholed if hole.is_none() => hole = blackhole(addr).await.ok(),
                Occupant::Blackholed => {}
                _ => hole = None,
            }
            changed.notified().await;
            continue;
        }
        hole = None;
        if listening.is_none() {
            match bind(addr, 1024) {
                Ok(l) => listening = Some(l),
                Err(_) => {
                    pause().await;
                    continue;
                }
            }
        }
        let Some(listener) = &listening else {
            continue;
        };
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = changed.notified() => continue,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(_) => {
                // Out of descriptors, most likely: wait instead of spinning.
                pause().await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let state = state.clone();
        let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
            let state = state.clone();
            async move { Ok::<_, Infallible>(answer(State(state), req.headers().clone()).await) }
        });
        let task = tokio::spawn(async move {
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
        let mut open = lock(&connections);
        open.retain(|c| !c.is_finished());
        open.push(task.abort_handle());
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panicking test thread must not hide the counts from the report.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

async fn answer(State(state): State<Arc<PodState>>, headers: HeaderMap) -> Response<Body> {
    let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let via = text(VIA_HEADER).unwrap_or("-").to_owned();
    let intended = text(INTENDED_HEADER);
    // One read of the occupant classifies and answers, so a switch mid-request
    // can never count one occupant and answer as the other.
    let occupant = lock(&state.occupant).clone();
    {
        let mut tallies = lock(&state.tallies);
        let tally = tallies.entry(via).or_default();
        match (&occupant, intended) {
            (_, None) => tally.untagged += 1,
            (
                Occupant::Ghost | Occupant::Hung | Occupant::Refusing | Occupant::Blackholed,
                Some(_),
            ) => tally.dead += 1,
            (Occupant::Pod { service, .. }, Some(want)) if service == want => tally.right += 1,
            (Occupant::Pod { .. }, Some(_)) => tally.wrong_service += 1,
        }
    }
    let (service, pod, body) = match &occupant {
        Occupant::Pod { service, pod } => {
            (service.clone(), pod.clone(), format!("{service} {pod}\n"))
        }
        Occupant::Hung => {
            // Accepted, read, never answered: the gateway's timeout ends it.
            std::future::pending::<()>().await;
            return Response::new(Body::empty());
        }
        Occupant::Ghost | Occupant::Refusing | Occupant::Blackholed => {
            ("ghost".into(), "-".into(), "ghost\n".into())
        }
    };
    let mut response = Response::new(Body::from(body));
    // What a sidecar's health check answer names (Envoy's
    // `service_name_matcher` compares it): the service this address serves now.
    let checked = service.clone();
    for (name, value) in [
        (SERVICE_HEADER, service),
        (POD_HEADER, pod),
        (HEALTHCHECKED_HEADER, checked),
    ] {
        if let Ok(value) = HeaderValue::from_str(&value) {
            response.headers_mut().insert(name, value);
        }
    }
    response
}
