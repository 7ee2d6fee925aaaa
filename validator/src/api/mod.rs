//! The validator's HTTP API: how gateways keep a copy of the index.
//!
//! A gateway fetches `GET /v1/snapshot` once, then long-polls
//! `GET /v1/changes?epoch=E&since=G&wait=S`: the answer comes as soon as the
//! index moves past `G` (a compacted delta), after `S` seconds with an empty
//! delta, or at once as a full reset when `E` is not this process's epoch or
//! `G` was compacted away. So hundreds of gateways stay in sync at the cost of
//! the changes, not of the index. `GET /v1/ips/{ip}` and `GET /v1/verdict` are
//! for operators and scripts; `POST /v1/verdicts` judges many endpoints at
//! once for `staleguard-validator audit`. `docs/api.md` documents every field and error.
//!
//! The admin listener ([`admin_router`]) serves `/healthz`, `/readyz` and
//! `/metrics` on a separate port, so probes and scrapes never share limits or
//! auth with gateways. Every listener bounds its connections ([`ConnectionLimits`]).

mod answers;
mod auth;
mod changes;
mod connections;
mod error;
mod pages;
mod serve;
mod tls;
mod verdicts;

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::rejection::QueryRejection;
use axum::extract::{MatchedPath, Path, Query, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use staleguard_core::verdict::{Action, FailurePolicy, Policy};
use staleguard_core::wire::WIRE_VERSION;
use staleguard_core::{decide, Freshness, IpRecord, ServiceKey, Verdict};
use tokio::sync::Semaphore;

pub use auth::{Token, TokenError, MIN_TOKEN_BYTES, PLACEHOLDER};
pub use changes::FanOut;
pub(crate) use connections::serve_bounded;
pub use connections::{fit_api_cap, raise_file_limit, ConnectionLimits, RESERVED_FILES};
pub use error::ApiError;
#[cfg(any(test, feature = "testing"))]
pub use serve::spawn;
pub use serve::{serve, ApiConfig, Listeners, ServeError};
pub use tls::{ServerTls, TlsError, TlsFiles};
pub use verdicts::judge_all;

use crate::live::SharedIndex;
use crate::metrics::Metrics;

/// Limits that keep clients from exhausting the validator.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// The longest `wait` a long poll may ask for.
    pub max_wait: Duration,
    /// How many long polls may wait at once; more get 429.
    pub max_long_polls: usize,
    /// How many of them one client (source address) may hold; more get 429.
    pub max_long_polls_per_client: usize,
    /// How long any request may take, on top of its `wait`.
    pub request_timeout: Duration,
    /// The longest query string accepted.
    pub max_query_bytes: usize,
    /// How many answers (snapshots, deltas) may be built at once; more wait.
    pub max_builds: usize,
    /// How many `POST /v1/verdicts` may be read and judged at once; more wait.
    pub max_verdict_batches: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_wait: Duration::from_secs(60),
            max_long_polls: 4096,
            max_long_polls_per_client: 64,
            request_timeout: Duration::from_secs(10),
            max_query_bytes: 1024,
            max_builds: 2,
            max_verdict_batches: 2,
        }
    }
}

/// Everything a handler needs; cheap to clone.
#[derive(Debug, Clone)]
pub struct ApiState {
    index: SharedIndex,
    metrics: Arc<Metrics>,
    limits: Limits,
    long_polls: Arc<Semaphore>,
    verdict_batches: Arc<Semaphore>,
    long_poll_clients: Arc<connections::Sources>,
    fan_out: FanOut,
    answers: Arc<answers::Answers>,
    pages: Arc<pages::SharedPages>,
    shutdown: tokio::sync::watch::Receiver<bool>,
}

impl ApiState {
    /// Builds the state. `shutdown` turning `true` makes open long polls answer
    /// with what they have, so a draining process does not hold clients.
    pub fn new(
        index: SharedIndex,
        metrics: Arc<Metrics>,
        limits: Limits,
        shutdown: tokio::sync::watch::Receiver<bool>,
    ) -> Self {
        let fan_out = FanOut::new(*index.subscribe().borrow());
        Self {
            long_polls: Arc::new(Semaphore::new(limits.max_long_polls)),
            long_poll_clients: Arc::default(),
            verdict_batches: Arc::new(Semaphore::new(
                limits.max_verdict_batches.clamp(1, Semaphore::MAX_PERMITS),
            )),
            metrics,
            limits,
            fan_out,
            answers: Arc::new(answers::Answers::new(limits.max_builds)),
            pages: Arc::new(std::sync::Mutex::new(pages::Pages::new(index.epoch()))),
            index,
            shutdown,
        }
    }
}

/// The public router: `/v1/...`, behind the bearer token when one is given.
pub fn router(state: ApiState, token: Option<Token>) -> Router {
    let timeout = state.limits.max_wait + state.limits.request_timeout;
    let mut v1 = Router::new()
        .route("/v1/snapshot", get(snapshot))
        .route("/v1/changes", get(changes::changes))
        .route(staleguard_core::page::ANSWER_PATH, get(pages::answer))
        .route("/v1/ips/{ip}", get(ip_record))
        .route("/v1/verdict", get(verdict))
        .route("/v1/verdicts", post(verdicts::verdicts));
    if let Some(token) = token {
        v1 = v1.layer(middleware::from_fn_with_state(token, auth::require_token));
    }
    v1.fallback(not_found)
        .layer(middleware::from_fn_with_state(state.clone(), guard_query))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            count_requests,
        ))
        .layer(tower_http::timeout::TimeoutLayer::with_status_code(
            StatusCode::REQUEST_TIMEOUT,
            timeout,
        ))
        .with_state(state)
}

/// The admin router: `/healthz`, `/readyz`, `/metrics`. No auth: bind it where
/// only the kubelet and Prometheus reach it.
pub fn admin_router(state: ApiState) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(state)
}

// === handlers ===

async fn snapshot(
    State(state): State<ApiState>,
    headers: axum::http::HeaderMap,
    query: Result<Query<VersionQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(q) = query.map_err(|e| ApiError::BadRequest(e.body_text()))?;
    check_version(q.v)?;
    let answer = state
        .answers
        .get(
            &state.index,
            &state.metrics,
            answers::Position::Snapshot,
            answers::Form::asked(q.view, &headers),
        )
        .await?;
    Ok(pages::respond(&state, answer, q.page_bytes))
}

async fn ip_record(
    State(state): State<ApiState>,
    Path(ip): Path<String>,
) -> Result<Response, ApiError> {
    let ip = parse_ip(&ip)?;
    let record = state.index.read().record(ip);
    match record {
        Some(record) => Ok(json(&IpAnswer {
            v: WIRE_VERSION,
            freshness: state.index.freshness(),
            record,
        })),
        None => Err(ApiError::NotFound(format!(
            "the validator knows nothing of {ip}"
        ))),
    }
}

async fn verdict(
    State(state): State<ApiState>,
    query: Result<Query<VerdictQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(q) = query.map_err(|e| ApiError::BadRequest(e.body_text()))?;
    check_version(q.v)?;
    let service: ServiceKey = q
        .service
        .as_deref()
        .ok_or_else(|| ApiError::BadRequest("missing service=NAMESPACE/NAME".into()))?
        .parse()
        .map_err(|e: staleguard_core::service::ServiceKeyError| {
            ApiError::BadRequest(e.to_string())
        })?;
    let ip = parse_ip(
        q.ip.as_deref()
            .ok_or_else(|| ApiError::BadRequest("missing ip=IP".into()))?,
    )?;
    let port = match q.port.as_deref() {
        None => None,
        Some(p) => Some(p.parse::<u16>().ok().filter(|p| *p != 0).ok_or_else(|| {
            ApiError::BadRequest(format!("port {p:?} is not a number from 1 to 65535"))
        })?),
    };
    let policy = Policy {
        failure_policy: q.failure_policy.unwrap_or_default(),
        terminating: q.terminating.unwrap_or(Action::Allow),
        unknown_service: q.unknown_service.unwrap_or(Action::Allow),
    };
    let freshness = state.index.freshness();
    let (known, record, out_of_scope) = {
        let index = state.index.read();
        (
            index.knows_service(&service),
            index.record(ip),
            index.out_of_scope(&service).map(str::to_owned),
        )
    };
    let verdict = decide(&policy, freshness.fresh, &service, known, record.as_ref());
    Ok(json(&VerdictAnswer {
        v: WIRE_VERSION,
        service,
        ip,
        port,
        verdict,
        service_known: known,
        out_of_scope,
        freshness,
        record,
    }))
}

/// `200 ok` while the index can move; `503` once a source task stopped or a
/// writer panicked, so the kubelet restarts a validator whose index froze.
async fn healthz(State(state): State<ApiState>) -> Response {
    match state.index.failure() {
        None => "ok\n".into_response(),
        Some(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not serving a live index: {reason}\n"),
        )
            .into_response(),
    }
}

async fn readyz(State(state): State<ApiState>) -> Response {
    let ready = state.index.ready();
    let body = Readiness {
        ready,
        freshness: state.index.freshness(),
        watches: state
            .index
            .watch_health()
            .into_iter()
            .map(|w| WatchReadiness {
                kind: w.kind,
                synced: w.synced,
                last_event_age_ms: w.last_event_age.map(|d| d.as_millis() as u64),
            })
            .collect(),
    };
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(body)).into_response()
}

async fn metrics(State(state): State<ApiState>) -> Response {
    crate::metrics::scrape_answer(state.metrics.encode(&state.index))
}

async fn not_found() -> ApiError {
    ApiError::NotFound("no such endpoint; see docs/api.md".into())
}

// === middleware ===

/// Refuses oversized query strings before any extractor parses them.
async fn guard_query(
    State(state): State<ApiState>,
    request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    let len = request.uri().query().map_or(0, str::len);
    if len > state.limits.max_query_bytes {
        return Err(ApiError::BadRequest(format!(
            "query string of {len} bytes exceeds the limit of {}",
            state.limits.max_query_bytes
        )));
    }
    Ok(next.run(request).await)
}

/// Counts every request by route and status.
async fn count_requests(State(state): State<ApiState>, request: Request, next: Next) -> Response {
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or("unmatched", |p| route_label(p.as_str()));
    let response = next.run(request).await;
    state
        .metrics
        .observe_request(route, response.status().as_u16());
    response
}

/// Route labels are a fixed set, so a scanner cannot grow the metric.
fn route_label(path: &str) -> &'static str {
    match path {
        "/v1/snapshot" => "snapshot",
        "/v1/changes" => "changes",
        "/v1/answer" => "answer",
        "/v1/ips/{ip}" => "ips",
        "/v1/verdict" => "verdict",
        "/v1/verdicts" => "verdicts",
        _ => "other",
    }
}

// === helpers and answer types ===

pub(crate) fn json<T: Serialize>(value: &T) -> Response {
    match serde_json::to_vec(value) {
        Ok(body) => (
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            body,
        )
            .into_response(),
        Err(error) => {
            tracing::error!(%error, "cannot serialize an answer");
            StatusCode::INTERNAL_SERVER_ERROR.into_response()
        }
    }
}

pub(crate) fn check_version(v: Option<u32>) -> Result<(), ApiError> {
    match v {
        None | Some(WIRE_VERSION) => Ok(()),
        Some(other) => Err(ApiError::BadRequest(format!(
            "wire version {other} is not served; this validator speaks v={WIRE_VERSION}"
        ))),
    }
}

fn parse_ip(text: &str) -> Result<IpAddr, ApiError> {
    text.parse()
        .map_err(|_| ApiError::BadRequest(format!("{text:?} is not an IPv4 or IPv6 address")))
}

// Query parameters are strict: a misspelt one (`wiat=30`) is refused with
// the list of the accepted ones, never silently ignored.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct VersionQuery {
    v: Option<u32>,
    #[serde(default)]
    view: answers::View,
    /// Answer in pages of this many bytes (docs/api.md, "Answers in pages").
    page_bytes: Option<u32>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct VerdictQuery {
    v: Option<u32>,
    service: Option<String>,
    ip: Option<String>,
    port: Option<String>,
    failure_policy: Option<FailurePolicy>,
    terminating: Option<Action>,
    unknown_service: Option<Action>,
}

#[derive(Debug, Serialize)]
struct IpAnswer {
    v: u32,
    freshness: Freshness,
    record: IpRecord,
}

#[derive(Debug, Serialize)]
struct VerdictAnswer {
    v: u32,
    service: ServiceKey,
    ip: IpAddr,
    #[serde(skip_serializing_if = "Option::is_none")]
    port: Option<u16>,
    verdict: Verdict,
    service_known: bool,
    /// Why an existing service is treated as unknown: the watches may not
    /// see all of its members (`--namespace`, `--pod-selector`).
    #[serde(skip_serializing_if = "Option::is_none")]
    out_of_scope: Option<String>,
    freshness: Freshness,
    #[serde(skip_serializing_if = "Option::is_none")]
    record: Option<IpRecord>,
}

#[derive(Debug, Serialize)]
struct Readiness {
    ready: bool,
    freshness: Freshness,
    watches: Vec<WatchReadiness>,
}

#[derive(Debug, Serialize)]
struct WatchReadiness {
    kind: &'static str,
    synced: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    last_event_age_ms: Option<u64>,
}

#[cfg(test)]
mod tests;
