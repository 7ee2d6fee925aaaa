//! HTTP/2 without TLS (h2c, prior knowledge) on loopback: backends that speak
//! only HTTP/2, as Istio's h2 and gRPC ports expect, and a client for them.
//!
//! A [`backend`] refuses HTTP/1.1 (a request over HTTP/1.1 gets no answer,
//! as from a real h2-only server), counts what reached it and answers with its
//! name in `x-host`; in gRPC mode it answers like a unary gRPC method: a
//! length-prefixed message and `grpc-status: 0` in the trailers. [`request`]
//! sends one request over h2c and collects headers, body and trailers.

use std::collections::{BTreeMap, VecDeque};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use std::time::Duration;

use anyhow::{Context, Result};
use http_body_util::BodyExt;
use hyper::body::{Bytes, Frame, Incoming};
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};

use crate::blocking::{header_map, Server};

/// What a backend answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Plain HTTP/2: 200, `x-host`, a text body.
    Http,
    /// A unary gRPC method: `application/grpc`, one message, `grpc-status: 0`.
    Grpc,
}

/// Starts an h2c-only backend named `name` on `ip` (any free port): a
/// [`Server`] that speaks only HTTP/2.
pub fn backend(ip: &str, name: &str, kind: Kind) -> Result<Server> {
    let name: Arc<str> = name.into();
    Server::with_connections(SocketAddr::new(ip.parse()?, 0), move |stream, hits| {
        let name = name.clone();
        let service = hyper::service::service_fn(move |req: Request<Incoming>| {
            let (name, hits) = (name.clone(), hits.clone());
            async move { Ok::<_, Infallible>(answer(req, &name, kind, &hits).await) }
        });
        async move {
            let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), service)
                .await;
        }
    })
}

/// A body of fixed frames: data, then trailers.
#[derive(Debug, Default)]
pub struct Frames(VecDeque<Frame<Bytes>>);

impl Frames {
    /// Data, then (if any) trailers.
    pub fn new(data: Bytes, trailers: &[(&str, &str)]) -> Self {
        let mut frames = VecDeque::new();
        if !data.is_empty() {
            frames.push_back(Frame::data(data));
        }
        if !trailers.is_empty() {
            let mut map = hyper::HeaderMap::new();
            for (k, v) in trailers {
                if let (Ok(k), Ok(v)) = (
                    hyper::header::HeaderName::from_bytes(k.as_bytes()),
                    hyper::header::HeaderValue::from_str(v),
                ) {
                    map.insert(k, v);
                }
            }
            frames.push_back(Frame::trailers(map));
        }
        Self(frames)
    }
}

impl hyper::body::Body for Frames {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut TaskContext<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Poll::Ready(self.0.pop_front().map(Ok))
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_empty()
    }
}

async fn answer(
    req: Request<Incoming>,
    name: &str,
    kind: Kind,
    hits: &AtomicU64,
) -> Response<Frames> {
    hits.fetch_add(1, Ordering::Relaxed);
    let _ = req.into_body().collect().await;
    match kind {
        Kind::Http => Response::builder()
            .header("x-host", name)
            .body(Frames::new(Bytes::from(format!("{name}\n")), &[]))
            .unwrap_or_default(),
        Kind::Grpc => Response::builder()
            .header("content-type", "application/grpc")
            .header("x-host", name)
            .body(Frames::new(
                grpc_frame(name.as_bytes()),
                &[("grpc-status", "0"), ("grpc-message", "")],
            ))
            .unwrap_or_default(),
    }
}

/// One length-prefixed gRPC message (uncompressed).
pub fn grpc_frame(payload: &[u8]) -> Bytes {
    let mut out = Vec::with_capacity(payload.len() + 5);
    out.push(0);
    out.extend_from_slice(
        &u32::try_from(payload.len())
            .unwrap_or(u32::MAX)
            .to_be_bytes(),
    );
    out.extend_from_slice(payload);
    Bytes::from(out)
}

/// An answer as the client saw it.
#[derive(Debug, Clone, Default)]
pub struct H2Response {
    /// HTTP status.
    pub status: u16,
    /// Response headers (lowercase names; the last value of a repeated one).
    pub headers: BTreeMap<String, String>,
    /// The body.
    pub body: Vec<u8>,
    /// Trailers, if any.
    pub trailers: BTreeMap<String, String>,
}

impl H2Response {
    /// A header, or `""`.
    pub fn header(&self, name: &str) -> &str {
        self.headers.get(name).map_or("", String::as_str)
    }

    /// `grpc-status` from the trailers, or from the headers of a
    /// trailers-only answer (how Envoy answers a gRPC request itself).
    pub fn grpc_status(&self) -> Option<u32> {
        self.trailers
            .get("grpc-status")
            .or_else(|| self.headers.get("grpc-status"))
            .and_then(|v| v.parse().ok())
    }
}

/// Sends one request over h2c (prior knowledge) to `addr`: a GET, or with
/// `kind` [`Kind::Grpc`] a unary gRPC call (POST, `application/grpc`, one
/// message). `authority` becomes `:authority`, which the gateway routes by.
pub fn request(addr: SocketAddr, authority: &str, path: &str, kind: Kind) -> Result<H2Response> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        tokio::time::timeout(Duration::from_secs(10), send(addr, authority, path, kind))
            .await
            .with_context(|| format!("h2 request to {addr} ({authority}{path}) timed out"))?
    })
}

async fn send(addr: SocketAddr, authority: &str, path: &str, kind: Kind) -> Result<H2Response> {
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .with_context(|| format!("connect {addr}"))?;
    let (mut sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .context("h2 handshake")?;
    tokio::spawn(conn);
    let uri = format!("http://{authority}{path}");
    let req = match kind {
        Kind::Http => Request::get(uri).body(Frames::default())?,
        Kind::Grpc => Request::post(uri)
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(Frames::new(grpc_frame(b"ping"), &[]))?,
    };
    let response = sender.send_request(req).await.context("h2 request")?;
    let status = response.status().as_u16();
    let headers = header_map(response.headers());
    let collected = response.into_body().collect().await.context("h2 body")?;
    let trailers = collected.trailers().map(header_map).unwrap_or_default();
    Ok(H2Response {
        status,
        headers,
        body: collected.to_bytes().to_vec(),
        trailers,
    })
}
