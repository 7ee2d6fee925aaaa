//! Serving one listener with bounded connections: the defence of every port
//! the validator opens (the API, the admin listener, the audit's metrics).
//!
//! `axum::serve` builds hyper without a timer, so a client that connects and
//! sends nothing, or half a request head, holds a connection and a file
//! descriptor for as long as it likes; enough of them and `accept` fails for
//! everyone, the kubelet's probes included. Here each listener:
//! - gives a client [`ConnectionLimits::header_read_timeout`] to send a
//!   complete request head, on a new connection and between two requests of a
//!   kept-alive one (hyper's own timer: the wait for the next head counts);
//! - closes a connection on which no byte moved for
//!   [`ConnectionLimits::idle_timeout`] while no handler runs for it (a
//!   client that stops reading its answer); a handler (a long poll) is bounded
//!   by the router's own timeout instead;
//! - holds at most [`ConnectionLimits::max_connections`] connections, and at
//!   most [`ConnectionLimits::max_per_source`] from one address; a connection
//!   over either is closed as soon as it is accepted, and counted.
//!
//! The admin listener has caps of its own, and [`raise_file_limit`] keeps
//! room for it: the API's cap can never use the descriptors its probes need.
//! Connections speak HTTP/1.1 only (gateways and the audit do): HTTP/2 would
//! need bounds of its own before its first frame.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_rustls::TlsAcceptor;
use tower::ServiceExt;

use crate::metrics::ConnectionMetrics;

/// The bounds of one listener's connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Time to send a complete request head, from the connection's start or
    /// from the end of the previous answer.
    pub header_read_timeout: Duration,
    /// A connection on which no byte moved for this long, while no handler
    /// runs for it, is closed.
    pub idle_timeout: Duration,
    /// Connections open at once on the listener.
    pub max_connections: usize,
    /// Connections open at once from one source address.
    pub max_per_source: usize,
}

impl ConnectionLimits {
    /// The public API's defaults: room for every gateway's long poll
    /// (`--max-long-polls` is 4,096) and the snapshots and audits beside them.
    pub const API: Self = Self {
        header_read_timeout: Duration::from_secs(10),
        idle_timeout: Duration::from_secs(30),
        max_connections: 8192,
        max_per_source: 256,
    };

    /// The admin listener's defaults: probes and scrapes, a handful at a time.
    /// Its timeouts are the public listener's (`--header-read-timeout` and
    /// `--idle-timeout` set both).
    pub const ADMIN: Self = Self {
        header_read_timeout: Self::API.header_read_timeout,
        idle_timeout: Self::API.idle_timeout,
        max_connections: 128,
        max_per_source: 32,
    };
}

/// File descriptors kept beyond the listeners' caps: the watches, the token
/// and source files, the listeners themselves, the blocking pool.
pub const RESERVED_FILES: u64 = 256;

/// Raises the soft limit on open files to the hard limit (a container's
/// default soft limit is often 1,024, below the API's connection cap) and
/// returns the limit now in force, `None` where it cannot be read.
pub fn raise_file_limit() -> Option<u64> {
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(limit) => Some(limit),
        Err(error) => {
            tracing::warn!(%error, "cannot raise the open file limit");
            rlimit::getrlimit(rlimit::Resource::NOFILE)
                .ok()
                .map(|(soft, _)| soft)
        }
    }
}

/// The API's connection cap once the file limit is known: what is asked,
/// unless the admin listener's cap and [`RESERVED_FILES`] would then not fit,
/// in which case the API gets what is left (at least one connection), so
/// that the API's clients can never take the descriptors a probe needs.
pub fn fit_api_cap(asked: usize, admin: usize, file_limit: Option<u64>) -> usize {
    let Some(limit) = file_limit else {
        return asked;
    };
    let room = limit.saturating_sub(RESERVED_FILES + admin as u64);
    asked
        .min(usize::try_from(room).unwrap_or(usize::MAX))
        .max(1)
}

/// Serves `app` on `listener` within `limits` until `stop` turns true; then
/// stops accepting, asks every open connection to close after its current
/// request, and returns once all have.
pub(crate) async fn serve_bounded(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    metrics: Arc<ConnectionMetrics>,
    listener_name: &'static str,
    mut stop: tokio::sync::watch::Receiver<bool>,
    tls: Option<TlsAcceptor>,
) {
    let max = limits.max_connections.clamp(1, Semaphore::MAX_PERMITS);
    let open = Arc::new(Semaphore::new(max));
    let sources = Arc::new(Sources::default());
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stop.wait_for(|s| *s) => break,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(error) => {
                // Out of descriptors or memory: the listener is fine, the
                // process is full. Let open connections end, then go on.
                tracing::warn!(listener = listener_name, %error, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(permit) = open.clone().try_acquire_owned() else {
            metrics.refused(listener_name, "max_connections");
            continue;
        };
        let Some(source) = sources.clone().enter(peer.ip(), limits.max_per_source) else {
            metrics.refused(listener_name, "max_per_source");
            continue;
        };
        let app = app.clone();
        let metrics = metrics.clone();
        let stop = stop.clone();
        let tls = tls.clone();
        tokio::spawn(async move {
            let _open = metrics.open(listener_name);
            let _ = stream.set_nodelay(true);
            let ended = match tls {
                None => serve_connection(stream, peer, app, limits, stop).await,
                // The handshake gets the time a request head gets.
                Some(tls) => {
                    match tokio::time::timeout(limits.header_read_timeout, tls.accept(stream)).await
                    {
                        Ok(Ok(stream)) => serve_connection(stream, peer, app, limits, stop).await,
                        Ok(Err(error)) => {
                            tracing::debug!(%peer, %error, "TLS handshake failed");
                            metrics.refused(listener_name, "tls_handshake");
                            None
                        }
                        Err(_) => Some("tls_handshake"),
                    }
                }
            };
            if let Some(reason) = ended {
                metrics.timed_out(listener_name, reason);
            }
            drop((source, permit));
        });
    }
    // Every connection holds a permit: all of them back means all closed.
    let _ = open.acquire_many(max as u32).await;
}

/// Serves one connection; returns which timeout closed it, if one did.
async fn serve_connection<S>(
    stream: S,
    peer: SocketAddr,
    app: Router,
    limits: ConnectionLimits,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Option<&'static str>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let activity = Arc::new(Activity::new());
    let io = TokioIo::new(Tracked {
        inner: stream,
        activity: activity.clone(),
    });
    let handlers = activity.clone();
    let service = hyper::service::service_fn(move |request: http::Request<Incoming>| {
        let busy = handlers.busy();
        let app = app.clone();
        let mut request = request.map(axum::body::Body::new);
        // Handlers that treat clients apart (long polls) read who this is.
        request
            .extensions_mut()
            .insert(axum::extract::ConnectInfo(peer));
        async move {
            let response = app.oneshot(request).await;
            drop(busy);
            response
        }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .keep_alive(true);
    let connection = builder.serve_connection(io, service);
    tokio::pin!(connection);
    let mut stopping = false;
    loop {
        let idle_check = tokio::time::sleep(activity.idle_check_in(limits.idle_timeout));
        tokio::select! {
            ended = connection.as_mut() => {
                return match ended {
                    Err(error) if error.is_timeout() => Some("header_read"),
                    Err(error) => {
                        tracing::debug!(%error, "connection ended with an error");
                        None
                    }
                    Ok(()) => None,
                };
            }
            _ = stop.wait_for(|s| *s), if !stopping => {
                stopping = true;
                connection.as_mut().graceful_shutdown();
            }
            () = idle_check => {
                if activity.idle_for() >= limits.idle_timeout {
                    return Some("idle");
                }
            }
        }
    }
}

/// How many of something (connections, long polls) each source address
/// holds, each capped.
#[derive(Debug, Default)]
pub(crate) struct Sources {
    open: Mutex<HashMap<IpAddr, usize>>,
}

/// One of what a source holds; leaves on drop.
#[derive(Debug)]
pub(crate) struct Source {
    sources: Arc<Sources>,
    ip: IpAddr,
}

impl Sources {
    /// Counts one more for `ip`, unless it already holds `max`.
    pub(crate) fn enter(self: Arc<Self>, ip: IpAddr, max: usize) -> Option<Source> {
        // An IPv4 client of a dual-stack socket shows as ::ffff:a.b.c.d.
        let ip = ip.to_canonical();
        {
            let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
            let count = open.entry(ip).or_insert(0);
            if *count >= max {
                return None;
            }
            *count += 1;
        }
        Some(Source { sources: self, ip })
    }
}

impl Drop for Source {
    fn drop(&mut self) {
        let mut open = self.sources.open.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(count) = open.get_mut(&self.ip) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                open.remove(&self.ip);
            }
        }
    }
}

/// When a connection last moved a byte, and whether a handler runs for it.
#[derive(Debug)]
struct Activity {
    start: Instant,
    /// Milliseconds from `start` to the last byte read or written.
    last_ms: AtomicU64,
    handlers: AtomicUsize,
}

/// A handler running; the connection is not idle meanwhile.
#[derive(Debug)]
struct Busy(Arc<Activity>);

impl Activity {
    fn new() -> Self {
        Self {
            start: Instant::now(),
            last_ms: AtomicU64::new(0),
            handlers: AtomicUsize::new(0),
        }
    }

    fn moved(&self) {
        let ms = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_ms.store(ms, Ordering::Relaxed);
    }

    fn busy(self: &Arc<Self>) -> Busy {
        self.handlers.fetch_add(1, Ordering::AcqRel);
        Busy(self.clone())
    }

    /// How long the connection has been idle: zero while a handler runs.
    fn idle_for(&self) -> Duration {
        if self.handlers.load(Ordering::Acquire) > 0 {
            return Duration::ZERO;
        }
        let last = Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
        self.start.elapsed().saturating_sub(last)
    }

    /// When to look again: when the connection would reach `timeout` if
    /// nothing moves meanwhile (at least a little later, never in a loop).
    fn idle_check_in(&self, timeout: Duration) -> Duration {
        timeout
            .saturating_sub(self.idle_for())
            .max(Duration::from_millis(10))
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        // The answer starts now: its idle time counts from here.
        self.0.moved();
        self.0.handlers.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A stream that notes every byte it moves in its [`Activity`].
#[derive(Debug)]
struct Tracked<S> {
    inner: S,
    activity: Arc<Activity>,
}

impl<S: AsyncRead + Unpin> AsyncRead for Tracked<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.activity.moved();
        }
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Tracked<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.moved();
        }
        polled
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.moved();
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
