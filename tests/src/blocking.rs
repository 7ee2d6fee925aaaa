//! Blocking HTTP/1.1 on hyper, for the synchronous filter tests and Envoy's
//! admin: the fake validator, named upstream hosts on loopback addresses, and
//! requests through Envoy. Each server runs its own tokio runtime on a thread
//! of its own; handlers are blocking closures run off the async workers, so a
//! long poll or a slow host simply holds a blocking thread. One request per
//! connection (`connection: close`), as Envoy's upstream pool sees in the
//! tests; a [`Server::constant`] (a benchmark's pod) keeps connections open.
use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::{Bytes, Incoming};
use hyper_util::rt::TokioIo;
use tokio::sync::oneshot;

/// A parsed request.
#[derive(Debug, Clone, Default)]
pub struct Request {
    /// Method.
    pub method: String,
    /// Path with query.
    pub target: String,
    /// Headers, names lowercased (the last of repeated ones).
    pub headers: BTreeMap<String, String>,
    /// The body.
    pub body: Vec<u8>,
}

impl Request {
    /// The path without the query.
    pub fn path(&self) -> &str {
        self.target.split('?').next().unwrap_or_default()
    }

    /// A query parameter.
    pub fn query(&self, name: &str) -> Option<&str> {
        let (_, query) = self.target.split_once('?')?;
        query
            .split('&')
            .filter_map(|kv| kv.split_once('='))
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v)
    }
}

/// What a handler answers.
#[derive(Debug, Clone)]
pub enum Answer {
    /// A response.
    Respond {
        /// Status code.
        status: u16,
        /// Extra headers.
        headers: Vec<(String, String)>,
        /// Body.
        body: Vec<u8>,
    },
    /// Close the connection without answering.
    Hangup,
}

impl Answer {
    /// A 200 with a JSON body.
    pub fn json(body: Vec<u8>) -> Self {
        Answer::Respond {
            status: 200,
            headers: vec![("content-type".into(), "application/json".into())],
            body,
        }
    }

    /// A bare status with a text body.
    pub fn status(status: u16, body: &str) -> Self {
        Answer::Respond {
            status,
            headers: vec![],
            body: body.as_bytes().to_vec(),
        }
    }
}

/// How a server answers.
#[derive(Clone)]
enum Handler {
    /// A blocking closure, run off the async workers; one request per
    /// connection.
    Blocking(Arc<dyn Fn(&Request) -> Answer + Send + Sync>),
    /// The same answer to every request, on the async workers, connections
    /// kept open: a benchmark's pod, whose own cost must stay small next to
    /// the gateway's.
    Constant(Arc<Answer>),
}

/// A server that stops (and frees its port) when dropped.
pub struct Server {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    hits: Arc<AtomicU64>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server").field("addr", &self.addr).finish()
    }
}

impl Server {
    /// Serves `handler` on `bind` (port 0 picks a free one).
    pub fn start(
        bind: SocketAddr,
        handler: impl Fn(&Request) -> Answer + Send + Sync + 'static,
    ) -> Result<Self> {
        Self::serve(bind, Handler::Blocking(Arc::new(handler)))
    }

    /// Answers every request on `bind` with `answer` at once, keeping
    /// connections open (see `Handler::Constant`).
    pub fn constant(bind: SocketAddr, answer: Answer) -> Result<Self> {
        Self::serve(bind, Handler::Constant(Arc::new(answer)))
    }

    fn serve(bind: SocketAddr, handler: Handler) -> Result<Self> {
        Self::with_connections(bind, move |stream, hits| {
            serve_connection(stream, handler.clone(), hits)
        })
    }

    /// Serves every connection accepted on `bind` with `connection` (given
    /// the stream and the hit counter to add to), on a runtime of its own:
    /// for protocols other than HTTP/1.1 (h2c, see [`crate::h2`]).
    pub fn with_connections<F, Fut>(bind: SocketAddr, connection: F) -> Result<Self>
    where
        F: Fn(tokio::net::TcpStream, Arc<AtomicU64>) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let listener = std::net::TcpListener::bind(bind).with_context(|| format!("bind {bind}"))?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()?;
        let (stop, stopped) = oneshot::channel();
        let hits = Arc::new(AtomicU64::new(0));
        let thread = {
            let hits = hits.clone();
            std::thread::spawn(move || {
                runtime.block_on(accept(listener, connection, hits, stopped));
                // Requests still held (long polls) end with the test.
                runtime.shutdown_background();
            })
        };
        Ok(Self {
            addr,
            stop: Some(stop),
            hits,
            thread: Some(thread),
        })
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Requests answered or hung up on so far.
    pub fn hits(&self) -> u64 {
        self.hits.load(Ordering::SeqCst)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

async fn accept<F, Fut>(
    listener: std::net::TcpListener,
    connection: F,
    hits: Arc<AtomicU64>,
    mut stopped: oneshot::Receiver<()>,
) where
    F: Fn(tokio::net::TcpStream, Arc<AtomicU64>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
        return;
    };
    loop {
        let stream = tokio::select! {
            _ = &mut stopped => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(_) => continue,
            },
        };
        tokio::spawn(connection(stream, hits.clone()));
    }
}

/// Serves one connection. A connection that never carries a request (Envoy
/// connects to the chosen host before upstream filters run) is not a hit.
async fn serve_connection(stream: tokio::net::TcpStream, handler: Handler, hits: Arc<AtomicU64>) {
    // `Answer::Hangup` is broken HTTP on purpose: the service says so here and
    // the connection is dropped unanswered, rather than answered by hyper.
    let (hangup, hung_up) = tokio::sync::mpsc::unbounded_channel::<()>();
    let mut hung_up = hung_up;
    let keep_alive = matches!(handler, Handler::Constant(_));
    let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
        let (handler, hits, hangup) = (handler.clone(), hits.clone(), hangup.clone());
        async move {
            let request = read_request(req).await;
            let answer = match handler {
                Handler::Blocking(f) => tokio::task::spawn_blocking(move || f(&request))
                    .await
                    .unwrap_or(Answer::Hangup),
                Handler::Constant(answer) => (*answer).clone(),
            };
            hits.fetch_add(1, Ordering::SeqCst);
            match answer {
                Answer::Respond {
                    status,
                    headers,
                    body,
                } => Ok::<_, Infallible>(response(status, headers, body)),
                Answer::Hangup => {
                    let _ = hangup.send(());
                    // Never answered: the connection is dropped first.
                    std::future::pending().await
                }
            }
        }
    });
    let connection = hyper::server::conn::http1::Builder::new()
        .keep_alive(keep_alive)
        .serve_connection(TokioIo::new(stream), service);
    tokio::select! {
        _ = connection => {}
        _ = hung_up.recv() => {}
    }
}

async fn read_request(req: hyper::Request<Incoming>) -> Request {
    let (parts, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .map(|b| b.to_bytes().to_vec())
        .unwrap_or_default();
    Request {
        method: parts.method.to_string(),
        target: parts
            .uri
            .path_and_query()
            .map_or_else(|| parts.uri.to_string(), |pq| pq.as_str().to_owned()),
        headers: header_map(&parts.headers),
        body,
    }
}

fn response(
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
) -> hyper::Response<Full<Bytes>> {
    let mut builder = hyper::Response::builder().status(status);
    for (k, v) in headers {
        builder = builder.header(k, v);
    }
    builder
        .body(Full::new(Bytes::from(body)))
        .unwrap_or_else(|e| {
            let mut r = hyper::Response::new(Full::new(Bytes::from(e.to_string())));
            *r.status_mut() = hyper::StatusCode::INTERNAL_SERVER_ERROR;
            r
        })
}

/// Headers as text, by name (the last of repeated ones).
pub fn header_map(headers: &hyper::HeaderMap) -> BTreeMap<String, String> {
    headers
        .iter()
        .map(|(k, v)| {
            (
                k.as_str().to_owned(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect()
}

/// A response as the client saw it.
#[derive(Debug, Clone)]
pub struct Response {
    /// Status code.
    pub status: u16,
    /// Headers, names lowercased (the last of repeated ones).
    pub headers: BTreeMap<String, String>,
    /// Body as text.
    pub body: String,
}

impl Response {
    /// A header's value, or "".
    pub fn header(&self, name: &str) -> &str {
        self.headers.get(name).map_or("", String::as_str)
    }
}

/// Sends `GET target` to `addr` with extra headers; reads the whole answer.
pub fn get(addr: SocketAddr, target: &str, headers: &[(&str, &str)]) -> Result<Response> {
    request(addr, "GET", target, headers, None)
}

thread_local! {
    /// One client runtime per calling thread, not one per request: the
    /// benchmark examples time requests through this client.
    static CLIENT: std::io::Result<tokio::runtime::Runtime> =
        tokio::runtime::Builder::new_current_thread().enable_all().build();
}

/// Sends `method target` to `addr` with extra headers and `body` (with its
/// content-length); reads the whole answer (no body for `HEAD`).
pub fn request(
    addr: SocketAddr,
    method: &str,
    target: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> Result<Response> {
    let mut builder = hyper::Request::builder()
        .method(method)
        .uri(target)
        .header("connection", "close");
    // `test` unless the caller names a host (a gateway that routes by
    // virtual host).
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        builder = builder.header("host", "test");
    }
    for (k, v) in headers {
        builder = builder.header(*k, *v);
    }
    let request = match body {
        Some(body) => builder.body(Full::new(Bytes::copy_from_slice(body)).boxed()),
        None => builder.body(Empty::new().boxed()),
    }
    .with_context(|| format!("{method} {target}"))?;
    off_runtime(|| {
        CLIENT.with(|runtime| {
            let runtime = runtime
                .as_ref()
                .map_err(|e| anyhow!("client runtime: {e}"))?;
            runtime.block_on(exchange(addr, request))
        })
    })
}

/// Runs the blocking `f` wherever the caller is: on a worker of a
/// multi-thread tokio runtime it first hands the worker's tasks to another
/// thread (`block_in_place`), so async tests use the blocking harness while
/// their servers and load keep running. A current-thread runtime has no
/// thread to lend: that is an error, not a deadlock.
pub fn off_runtime<R>(f: impl FnOnce() -> Result<R>) -> Result<R> {
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::CurrentThread => {
            Err(anyhow!(
                "a blocking harness call on a current-thread tokio runtime; \
             use #[tokio::test(flavor = \"multi_thread\")]"
            ))
        }
        Ok(_) => tokio::task::block_in_place(f),
        Err(_) => f(),
    }
}

async fn exchange(
    addr: SocketAddr,
    request: hyper::Request<http_body_util::combinators::BoxBody<Bytes, Infallible>>,
) -> Result<Response> {
    let stream = tokio::time::timeout(Duration::from_secs(2), tokio::net::TcpStream::connect(addr))
        .await
        .with_context(|| format!("connect {addr}: timed out"))?
        .with_context(|| format!("connect {addr}"))?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .with_context(|| format!("handshake {addr}"))?;
    let answer = async move {
        let response = sender.send_request(request).await?;
        let (parts, body) = response.into_parts();
        let body = body.collect().await?.to_bytes();
        Ok::<_, hyper::Error>((parts, body))
    };
    // The connection ends on the server's close, which Envoy delays (1 s):
    // drive it only until the answer is read.
    let connection = async move {
        let _ = connection.await;
        std::future::pending::<()>().await
    };
    let (parts, body) = tokio::time::timeout(Duration::from_secs(20), async {
        tokio::select! {
            answer = answer => answer,
            _ = connection => unreachable!("pending"),
        }
    })
    .await
    .with_context(|| format!("no answer from {addr} within 20 s"))?
    .with_context(|| format!("exchange with {addr}"))?;
    Ok(Response {
        status: parts.status.as_u16(),
        headers: header_map(&parts.headers),
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}

/// An upstream host standing for a pod: answers 200 `host=<name>` on `ip`.
pub fn named_host(ip: &str, name: &str) -> Result<Server> {
    named_host_on(ip, 0, name)
}

/// [`named_host`] on `port` (0: any free one).
pub fn named_host_on(ip: &str, port: u16, name: &str) -> Result<Server> {
    let name = name.to_owned();
    let bind = SocketAddr::new(ip.parse()?, port);
    Server::start(bind, move |_| Answer::Respond {
        status: 200,
        headers: vec![("x-host".into(), name.clone())],
        body: format!("host={name}").into_bytes(),
    })
}
