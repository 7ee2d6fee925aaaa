//! Client side: a small HTTP client and a load generator that counts outcomes.
//!
//! Every response through the gateway is classified from what the client sees:
//! answered by the service it meant, by another service, by a ghost (a dead
//! pod's address), rejected by staleguard (a status with the reason header), or
//! something else. The servers count the same requests where they land
//! ([`crate::pods`]); tests compare both with the filter's metrics.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::{Context, Result};
use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper::header::HeaderMap;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::task::JoinHandle;

use crate::pods::SERVICE_HEADER;

/// The header carrying staleguard's reject reason (the filter's default).
pub const REJECT_HEADER: &str = "x-staleguard";

/// A plain HTTP/1.1 client with keep-alive.
#[derive(Debug, Clone)]
pub struct Http {
    client: Client<HttpConnector, Empty<Bytes>>,
}

/// A response, read whole.
#[derive(Debug, Clone)]
pub struct Reply {
    /// The status code.
    pub status: u16,
    /// The headers.
    pub headers: HeaderMap,
    /// The body.
    pub body: Bytes,
}

impl Reply {
    /// A header's value as text (empty when absent or not text).
    pub fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
    }

    /// The body as text (lossy).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

impl Default for Http {
    fn default() -> Self {
        Self::new()
    }
}

impl Http {
    /// A client with short timeouts, for loopback only.
    pub fn new() -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(Duration::from_secs(2)));
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(10))
            .build(connector);
        Self { client }
    }

    /// `GET url` with extra headers, read whole, within 10 seconds.
    pub async fn get_with(&self, url: &str, headers: &[(&str, &str)]) -> Result<Reply> {
        let mut req = hyper::Request::get(url);
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        let req = req
            .body(Empty::new())
            .with_context(|| format!("request {url}"))?;
        let fut = async {
            let resp = self.client.request(req).await?;
            let (parts, body) = resp.into_parts();
            let body = body.collect().await?.to_bytes();
            anyhow::Ok(Reply {
                status: parts.status.as_u16(),
                headers: parts.headers,
                body,
            })
        };
        tokio::time::timeout(Duration::from_secs(10), fut)
            .await
            .with_context(|| format!("GET {url} timed out"))?
            .with_context(|| format!("GET {url}"))
    }

    /// `GET url`, read whole.
    pub async fn get(&self, url: &str) -> Result<Reply> {
        self.get_with(url, &[]).await
    }
}

/// Where a load generator sends requests: a gateway URL, and the service the
/// route behind it means.
#[derive(Debug, Clone)]
pub struct Target {
    /// The URL (the gateway listener and a path the route matches).
    pub url: String,
    /// Extra request headers (e.g. a `host` that picks the route).
    pub headers: Vec<(String, String)>,
    /// `namespace/name` of the service the route means.
    pub service: String,
}

/// What the client saw, by kind.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Outcomes {
    /// 2xx from the service the route means.
    pub right: u64,
    /// 2xx from another service.
    pub wrong_service: u64,
    /// 2xx from a dead pod's address.
    pub dead: u64,
    /// Rejected by staleguard, by reason code.
    pub rejected: BTreeMap<String, u64>,
    /// Any other status, by code (e.g. Envoy's own 503s).
    pub other_status: BTreeMap<u16, u64>,
    /// No response at all (connection error, timeout).
    pub errors: u64,
}

impl Outcomes {
    /// Every request.
    pub fn total(&self) -> u64 {
        self.right
            + self.wrong_service
            + self.dead
            + self.rejected.values().sum::<u64>()
            + self.other_status.values().sum::<u64>()
            + self.errors
    }

    /// Requests that failed their client: anything but a 2xx from the
    /// service the route means (a rejection, an error status, no answer, or an
    /// answer from a wrong or dead pod).
    pub fn failed(&self) -> u64 {
        self.total() - self.right
    }

    /// Requests staleguard rejected, whatever the reason.
    pub fn rejected_total(&self) -> u64 {
        self.rejected.values().sum()
    }

    /// Requests staleguard rejected for `reason`.
    pub fn rejected_for(&self, reason: &str) -> u64 {
        self.rejected.get(reason).copied().unwrap_or(0)
    }

    /// Requests answered by a wrong or dead pod.
    pub fn misrouted(&self) -> u64 {
        self.wrong_service + self.dead
    }

    /// Records one result.
    pub fn record(&mut self, service: &str, result: &Result<Reply>) {
        match result {
            Err(_) => self.errors += 1,
            Ok(reply) => {
                let reason = reply.header(REJECT_HEADER);
                if !reason.is_empty() && !(200..300).contains(&reply.status) {
                    *self.rejected.entry(reason.to_owned()).or_default() += 1;
                } else if !(200..300).contains(&reply.status) {
                    *self.other_status.entry(reply.status).or_default() += 1;
                } else {
                    match reply.header(SERVICE_HEADER) {
                        s if s == service => self.right += 1,
                        "ghost" => self.dead += 1,
                        _ => self.wrong_service += 1,
                    }
                }
            }
        }
    }

    /// The difference `self - earlier` (for counts over a window).
    pub fn since(&self, earlier: &Outcomes) -> Outcomes {
        fn sub_map<K: Ord + Clone>(
            now: &BTreeMap<K, u64>,
            then: &BTreeMap<K, u64>,
        ) -> BTreeMap<K, u64> {
            now.iter()
                .map(|(k, v)| (k.clone(), v - then.get(k).copied().unwrap_or(0)))
                .filter(|(_, v)| *v > 0)
                .collect()
        }
        Outcomes {
            right: self.right - earlier.right,
            wrong_service: self.wrong_service - earlier.wrong_service,
            dead: self.dead - earlier.dead,
            rejected: sub_map(&self.rejected, &earlier.rejected),
            other_status: sub_map(&self.other_status, &earlier.other_status),
            errors: self.errors - earlier.errors,
        }
    }
}

/// Sends `requests` requests to `target` from `concurrency` workers and
/// returns what came back.
pub async fn burst(http: &Http, target: &Target, requests: u64, concurrency: usize) -> Outcomes {
    let load = Load::start(
        http.clone(),
        target.clone(),
        concurrency,
        Some(requests),
        None,
    );
    load.finish().await
}

/// A running load generator.
#[derive(Debug)]
pub struct Load {
    outcomes: Arc<Mutex<Outcomes>>,
    stop: Arc<AtomicBool>,
    workers: Vec<JoinHandle<()>>,
}

impl Load {
    /// Starts `concurrency` workers sending to `target` until stopped or, with
    /// `budget`, until that many requests were sent; each worker waits `pause`
    /// between its requests when given.
    pub fn start(
        http: Http,
        target: Target,
        concurrency: usize,
        budget: Option<u64>,
        pause: Option<Duration>,
    ) -> Self {
        let outcomes = Arc::new(Mutex::new(Outcomes::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicU64::new(0));
        let target = Arc::new(target);
        let workers = (0..concurrency.max(1))
            .map(|_| {
                let (http, target, outcomes, stop, sent) = (
                    http.clone(),
                    target.clone(),
                    outcomes.clone(),
                    stop.clone(),
                    sent.clone(),
                );
                tokio::spawn(async move {
                    let headers: Vec<(&str, &str)> = target
                        .headers
                        .iter()
                        .map(|(k, v)| (k.as_str(), v.as_str()))
                        .collect();
                    while !stop.load(Ordering::Relaxed) {
                        if let Some(budget) = budget {
                            if sent.fetch_add(1, Ordering::Relaxed) >= budget {
                                break;
                            }
                        }
                        let result = http.get_with(&target.url, &headers).await;
                        lock(&outcomes).record(&target.service, &result);
                        if let Some(pause) = pause {
                            tokio::time::sleep(pause).await;
                        }
                    }
                })
            })
            .collect();
        Self {
            outcomes,
            stop,
            workers,
        }
    }

    /// What came back so far.
    pub fn outcomes(&self) -> Outcomes {
        lock(&self.outcomes).clone()
    }

    /// Stops the workers (after their request in flight) and returns the total.
    pub async fn stop(self) -> Outcomes {
        self.stop.store(true, Ordering::Relaxed);
        self.finish().await
    }

    /// Waits until the workers are done (the budget is spent) and returns the
    /// total.
    pub async fn finish(mut self) -> Outcomes {
        for worker in std::mem::take(&mut self.workers) {
            let _ = worker.await;
        }
        lock(&self.outcomes).clone()
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(status: u16, headers: &[(&'static str, &'static str)]) -> Result<Reply> {
        let mut map = HeaderMap::new();
        for (k, v) in headers {
            map.insert(*k, v.parse().unwrap());
        }
        Ok(Reply {
            status,
            headers: map,
            body: Bytes::new(),
        })
    }

    #[test]
    fn classifies_what_the_client_sees() {
        let mut o = Outcomes::default();
        o.record("shop/api", &reply(200, &[(SERVICE_HEADER, "shop/api")]));
        o.record("shop/api", &reply(200, &[(SERVICE_HEADER, "shop/billing")]));
        o.record("shop/api", &reply(200, &[(SERVICE_HEADER, "ghost")]));
        o.record("shop/api", &reply(503, &[(REJECT_HEADER, "destroyed")]));
        o.record("shop/api", &reply(503, &[]));
        // A 2xx never counts as a rejection, whatever its headers say.
        o.record(
            "shop/api",
            &reply(200, &[(SERVICE_HEADER, "shop/api"), (REJECT_HEADER, "x")]),
        );
        o.record("shop/api", &Err(anyhow::anyhow!("refused")));
        assert_eq!((o.right, o.wrong_service, o.dead), (2, 1, 1));
        assert_eq!(o.rejected_for("destroyed"), 1);
        assert_eq!(o.other_status[&503], 1);
        assert_eq!(o.errors, 1);
        assert_eq!(o.total(), 7);
        assert_eq!(o.misrouted(), 2);

        let earlier = o.clone();
        o.record("shop/api", &reply(503, &[(REJECT_HEADER, "recycled")]));
        let window = o.since(&earlier);
        assert_eq!(window.total(), 1);
        assert_eq!(window.rejected_for("recycled"), 1);
        assert!(window.other_status.is_empty());
    }
}
