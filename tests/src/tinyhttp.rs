//! A tiny blocking HTTP/1.1 server and client (std only), enough for the
//! filter tests: the fake validator, named upstream hosts on loopback
//! addresses, and requests through Envoy. One thread per connection, one
//! request per connection (`connection: close`), so long polls simply hold
//! their thread.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{Context, Result};

/// A parsed request.
#[derive(Debug, Clone, Default)]
pub struct Request {
    /// Method.
    pub method: String,
    /// Path with query.
    pub target: String,
    /// Headers, names lowercased.
    pub headers: BTreeMap<String, String>,
    /// The body (`content-length` bytes).
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

type Handler = Arc<dyn Fn(&Request) -> Answer + Send + Sync>;

/// A server that stops (and frees its port) when dropped.
pub struct Server {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
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
        let listener = TcpListener::bind(bind).with_context(|| format!("bind {bind}"))?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let hits = Arc::new(AtomicU64::new(0));
        let handler: Handler = Arc::new(handler);
        let thread = {
            let stop = stop.clone();
            let hits = hits.clone();
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    match listener.accept() {
                        Ok((stream, _)) => {
                            let handler = handler.clone();
                            let hits = hits.clone();
                            std::thread::spawn(move || {
                                let _ = serve_one(stream, &handler, &hits);
                            });
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(5)),
                    }
                }
            })
        };
        Ok(Self {
            addr,
            stop,
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
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve_one(stream: TcpStream, handler: &Handler, hits: &AtomicU64) -> Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut line = String::new();
    if reader.read_line(&mut line)? == 0 {
        // A connection that never carried a request (Envoy connects to the
        // chosen host before upstream filters run) is not a hit.
        return Ok(());
    }
    let mut parts = line.split_whitespace();
    let mut request = Request {
        method: parts.next().unwrap_or_default().to_owned(),
        target: parts.next().unwrap_or_default().to_owned(),
        headers: BTreeMap::new(),
        body: Vec::new(),
    };
    let mut content_length = 0usize;
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h)? == 0 || h == "\r\n" || h == "\n" {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            let k = k.trim().to_ascii_lowercase();
            let v = v.trim().to_owned();
            if k == "content-length" {
                content_length = v.parse().unwrap_or(0);
            }
            request.headers.insert(k, v);
        }
    }
    request.body = vec![0u8; content_length];
    reader.read_exact(&mut request.body)?;
    let answer = handler(&request);
    hits.fetch_add(1, Ordering::SeqCst);
    let mut stream = stream;
    match answer {
        Answer::Hangup => Ok(()),
        Answer::Respond {
            status,
            headers,
            body,
        } => {
            let mut out = format!(
                "HTTP/1.1 {status} X\r\ncontent-length: {}\r\nconnection: close\r\n",
                body.len()
            );
            for (k, v) in headers {
                out.push_str(&format!("{k}: {v}\r\n"));
            }
            out.push_str("\r\n");
            stream.write_all(out.as_bytes())?;
            if request.method != "HEAD" {
                stream.write_all(&body)?;
            }
            stream.flush()?;
            Ok(())
        }
    }
}

/// A response as the client saw it.
#[derive(Debug, Clone)]
pub struct Response {
    /// Status code.
    pub status: u16,
    /// Headers, names lowercased.
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

/// Sends `method target` to `addr` with extra headers and `body` (with its
/// content-length); reads the whole answer (no body for `HEAD`).
pub fn request(
    addr: SocketAddr,
    method: &str,
    target: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> Result<Response> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2))
        .with_context(|| format!("connect {addr}"))?;
    stream.set_read_timeout(Some(Duration::from_secs(20)))?;
    let mut req = format!("{method} {target} HTTP/1.1\r\nhost: test\r\nconnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(body) = body {
        req.push_str(&format!("content-length: {}\r\n", body.len()));
    }
    req.push_str("\r\n");
    stream.write_all(req.as_bytes())?;
    if let Some(body) = body {
        stream.write_all(body)?;
    }
    // Read the head, then exactly content-length bytes: waiting for EOF would
    // wait out Envoy's delayed close (1 s) on every request.
    let mut reader = BufReader::new(stream);
    let mut status_line = String::new();
    reader.read_line(&mut status_line)?;
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("bad status line from {addr}: {status_line:?}"))?;
    let mut headers = BTreeMap::new();
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h)? == 0 || h == "\r\n" || h == "\n" {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_owned());
        }
    }
    let mut raw = Vec::new();
    match headers
        .get("content-length")
        .filter(|_| method != "HEAD")
        .and_then(|v| v.parse::<usize>().ok())
    {
        Some(len) => {
            raw.resize(len, 0);
            reader.read_exact(&mut raw)?;
        }
        None => {
            reader.read_to_end(&mut raw)?;
        }
    }
    let body = String::from_utf8_lossy(&raw).into_owned();
    Ok(Response {
        status,
        headers,
        body,
    })
}

/// An upstream host standing for a pod: answers 200 `host=<name>` on `ip`.
pub fn named_host(ip: &str, name: &str) -> Result<Server> {
    let name = name.to_owned();
    let bind: SocketAddr = format!("{ip}:0").parse()?;
    Server::start(bind, move |_| Answer::Respond {
        status: 200,
        headers: vec![("x-host".into(), name.clone())],
        body: format!("host={name}").into_bytes(),
    })
}
