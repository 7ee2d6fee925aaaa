//! Replay instead of reject: what happens to a request whose host is stale
//! when `on_reject` is `retry`.
//!
//! The router retries neither a local reply nor a reset from an upstream
//! filter, so the filter replays the request itself: it pauses, sends the
//! same request (the final, rewritten headers it sees) with
//! `dispatch_http_call` to the guarded cluster's *twin* (same endpoints, the
//! override-host load balancer, the filter in its [`TwinConfig`] role in a VM
//! of its own), naming live members of the service from the index
//! ([`crate::members`]) in the endpoint header; then it answers the client
//! with the live host's status, headers and body.
//!
//! Every pick is checked again: the twin takes the first named address that
//! is one of its endpoints, else falls back to round robin; its filter lets
//! the request through only when the host it got is one of the named ones,
//! and otherwise fails the call at once ([`TWIN_MISS_HEADER`]), so the origin
//! names the next batch. Nothing is ever sent to a host neither the index nor
//! the control plane vouches for.
//!
//! Only requests without a body are replayed (once the filter pauses on the
//! request headers the body never reaches it: Envoy turns a pause on the
//! headers into StopAllIterationAndWatermark, proxy-wasm/spec#63), and not
//! upgrades, CONNECT or gRPC (the answer is buffered: no streaming, no
//! trailers). The live host's answer is copied into the VM only up to
//! `retry.max_answer_bytes`; a larger one is left in Envoy and the client
//! gets the rejection ([`ReplayOutcome::AnswerTooLarge`]). The rest get the normal
//! rejection. Everything here is plain Rust; [`crate::request`] carries out
//! its steps.

use std::net::SocketAddr;

use staleguard_core::ip::canonical;

use serde_json::{Map, Value};

use crate::config::{header_problem, read, RetryConfig};
use crate::members::Member;

/// The twin's answer header that says "my pick was not one of the named
/// hosts; nothing was sent". Never forwarded to a client.
pub const TWIN_MISS_HEADER: &str = "x-staleguard-twin-miss";

/// The request header the router sets to the route's timeout.
pub const EXPECTED_TIMEOUT_HEADER: &str = "x-envoy-expected-rq-timeout-ms";

/// Why a rejected request is not replayed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ineligible {
    /// It has a body (or the headers did not end the stream).
    Body,
    /// Its method is not in `retry.methods`.
    Method,
    /// A protocol upgrade (WebSocket and the like).
    Upgrade,
    /// A CONNECT tunnel.
    Connect,
    /// gRPC: streamed, with trailers.
    Grpc,
    /// A header value that is not UTF-8 (the host's call API takes text).
    Encoding,
    /// The verdict is `stale`: an index that is not fresh cannot name live
    /// members either (fail-closed means nothing unchecked gets a request).
    Stale,
}

impl Ineligible {
    /// Every cause, for metrics.
    pub const ALL: [Ineligible; 7] = [
        Ineligible::Body,
        Ineligible::Method,
        Ineligible::Upgrade,
        Ineligible::Connect,
        Ineligible::Grpc,
        Ineligible::Encoding,
        Ineligible::Stale,
    ];

    /// `body`, `method`, `upgrade`, `connect`, `grpc`, `encoding`, `stale`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Ineligible::Body => "body",
            Ineligible::Method => "method",
            Ineligible::Upgrade => "upgrade",
            Ineligible::Connect => "connect",
            Ineligible::Grpc => "grpc",
            Ineligible::Encoding => "encoding",
            Ineligible::Stale => "stale",
        }
    }
}

/// How a replay ended (the metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplayOutcome {
    /// A live member answered; the client got its answer.
    Answered,
    /// No member answered within the attempts (or none is known): rejected.
    Exhausted,
    /// The timeout passed: the client got a 504.
    Timeout,
    /// The live host's answer was larger than `retry.max_answer_bytes`:
    /// rejected, the answer never copied into the VM.
    AnswerTooLarge,
    /// Not replayed: rejected.
    NotEligible(Ineligible),
}

impl ReplayOutcome {
    /// Every outcome, for metrics.
    pub const ALL: [ReplayOutcome; 11] = [
        ReplayOutcome::Answered,
        ReplayOutcome::Exhausted,
        ReplayOutcome::Timeout,
        ReplayOutcome::AnswerTooLarge,
        ReplayOutcome::NotEligible(Ineligible::Body),
        ReplayOutcome::NotEligible(Ineligible::Method),
        ReplayOutcome::NotEligible(Ineligible::Upgrade),
        ReplayOutcome::NotEligible(Ineligible::Connect),
        ReplayOutcome::NotEligible(Ineligible::Grpc),
        ReplayOutcome::NotEligible(Ineligible::Encoding),
        ReplayOutcome::NotEligible(Ineligible::Stale),
    ];

    /// `answered`, `exhausted`, `timeout`, `answer_too_large`,
    /// `not_eligible_<cause>`.
    pub fn as_str(self) -> &'static str {
        match self {
            ReplayOutcome::Answered => "answered",
            ReplayOutcome::Exhausted => "exhausted",
            ReplayOutcome::Timeout => "timeout",
            ReplayOutcome::AnswerTooLarge => "answer_too_large",
            ReplayOutcome::NotEligible(Ineligible::Body) => "not_eligible_body",
            ReplayOutcome::NotEligible(Ineligible::Method) => "not_eligible_method",
            ReplayOutcome::NotEligible(Ineligible::Upgrade) => "not_eligible_upgrade",
            ReplayOutcome::NotEligible(Ineligible::Connect) => "not_eligible_connect",
            ReplayOutcome::NotEligible(Ineligible::Grpc) => "not_eligible_grpc",
            ReplayOutcome::NotEligible(Ineligible::Encoding) => "not_eligible_encoding",
            ReplayOutcome::NotEligible(Ineligible::Stale) => "not_eligible_stale",
        }
    }
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

/// The request headers as text, or [`Ineligible::Encoding`] when a value is
/// not UTF-8 (it could not be replayed unchanged).
pub fn text_headers(raw: Vec<(String, Vec<u8>)>) -> Result<Vec<(String, String)>, Ineligible> {
    raw.into_iter()
        .map(|(k, v)| String::from_utf8(v).map(|v| (k, v)))
        .collect::<Result<_, _>>()
        .map_err(|_| Ineligible::Encoding)
}

/// May a request rejected for `reason` be replayed at all? Not when the
/// verdict is `stale`: the member lists come from the same untrusted index.
pub fn reason_allows_replay(reason: staleguard_core::Reason) -> Result<(), Ineligible> {
    match reason {
        staleguard_core::Reason::Stale => Err(Ineligible::Stale),
        _ => Ok(()),
    }
}

/// Whether a replay that ended with `outcome` counts as the filter's
/// `retry` action (the client got a replayed answer, or its timeout) rather
/// than a `reject` (the client got the rejection).
pub fn counts_as_retry(outcome: ReplayOutcome) -> bool {
    matches!(outcome, ReplayOutcome::Answered | ReplayOutcome::Timeout)
}

/// May this request be replayed? `end_of_stream` is what Envoy said with the
/// request headers (true: no body follows).
pub fn eligibility(
    retry: &RetryConfig,
    headers: &[(String, String)],
    end_of_stream: bool,
) -> Result<(), Ineligible> {
    let method = header(headers, ":method").unwrap_or_default();
    if method == "CONNECT" {
        return Err(Ineligible::Connect);
    }
    let connection_upgrade = header(headers, "connection").is_some_and(|v| {
        v.split(',')
            .any(|t| t.trim().eq_ignore_ascii_case("upgrade"))
    });
    if connection_upgrade || header(headers, "upgrade").is_some() {
        return Err(Ineligible::Upgrade);
    }
    if header(headers, "content-type").is_some_and(|v| v.starts_with("application/grpc")) {
        return Err(Ineligible::Grpc);
    }
    if !end_of_stream {
        return Err(Ineligible::Body);
    }
    if !retry.methods.iter().any(|m| m == method) {
        return Err(Ineligible::Method);
    }
    Ok(())
}

/// The port to use on a member: the stale pick's, unless the index lists the
/// member's ports in the service without it; then the only one it lists, or
/// none (a multi-port member whose port cannot be matched is skipped).
pub fn member_port(member: &Member, stale_port: u16) -> Option<u16> {
    match member.ports.as_slice() {
        [] => Some(stale_port),
        ports if ports.contains(&stale_port) => Some(stale_port),
        [only] => Some(*only),
        _ => None,
    }
}

/// The batches of hosts to name, one per attempt: the live members except the
/// stale host's IP, rotated by `seed` so replays spread over all of them,
/// `hosts_per_attempt` at a time, at most `attempts` batches.
pub fn plan(
    retry: &RetryConfig,
    members: &[Member],
    stale: SocketAddr,
    seed: u64,
) -> Vec<Vec<SocketAddr>> {
    let hosts: Vec<SocketAddr> = members
        .iter()
        .filter(|m| m.ip != stale.ip())
        .filter_map(|m| Some(SocketAddr::new(m.ip, member_port(m, stale.port())?)))
        .collect();
    if hosts.is_empty() {
        return Vec::new();
    }
    let start = usize::try_from(seed % hosts.len() as u64).unwrap_or(0);
    let rotated = hosts[start..].iter().chain(&hosts[..start]).copied();
    let per = usize::try_from(retry.hosts_per_attempt.max(1)).unwrap_or(1);
    let attempts = usize::try_from(retry.attempts).unwrap_or(1);
    rotated
        .collect::<Vec<_>>()
        .chunks(per)
        .take(attempts)
        .map(<[SocketAddr]>::to_vec)
        .collect()
}

/// The endpoint header's value for a batch: `IP:PORT,[V6]:PORT,...`.
pub fn endpoint_value(hosts: &[SocketAddr]) -> String {
    hosts
        .iter()
        .map(SocketAddr::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// Hop-by-hop headers (RFC 9110 section 7.6.1 and their usual companions):
/// never copied between the two legs.
const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
];

/// The headers of the replayed request: the request's own (as the upstream
/// filter sees them, rewrites included) without hop-by-hop ones, the route's
/// timeout hint (the twin's router sets its own) or any endpoint header a
/// client sent, plus the endpoint header naming `hosts`.
pub fn request_headers(
    headers: &[(String, String)],
    endpoint_header: &str,
    hosts: &[SocketAddr],
) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = headers
        .iter()
        .filter(|(k, _)| {
            let k = k.to_ascii_lowercase();
            !HOP_BY_HOP.contains(&k.as_str())
                && k != EXPECTED_TIMEOUT_HEADER
                && k != endpoint_header
                && k != TWIN_MISS_HEADER
        })
        .cloned()
        .collect();
    out.push((endpoint_header.to_owned(), endpoint_value(hosts)));
    out
}

/// The headers the client gets from the live host's answer: all but pseudo
/// and hop-by-hop headers and what the twin leg added (its miss marker, its
/// router's timing): the twin's identity never reaches the client.
pub fn response_headers(headers: &[(String, String)]) -> Vec<(String, String)> {
    headers
        .iter()
        .filter(|(k, _)| {
            let k = k.to_ascii_lowercase();
            !k.starts_with(':')
                && !HOP_BY_HOP.contains(&k.as_str())
                && k != TWIN_MISS_HEADER
                && k != UPSTREAM_TIME_HEADER
        })
        .cloned()
        .collect()
}

/// The largest HEAD body [`head_filler`] stands in for.
pub const HEAD_FILLER_MAX: usize = 1 << 20;

/// For a HEAD, a stand-in body of the answer's `content-length`: Envoy's local
/// reply drops `content-type` and `content-length` when the body is empty, and
/// never sends a body to a HEAD, so a filler keeps the live host's headers
/// intact. `None` for other methods, or past [`HEAD_FILLER_MAX`].
pub fn head_filler(request: &[(String, String)], answer: &[(String, String)]) -> Option<usize> {
    if header(request, ":method") != Some("HEAD") {
        return None;
    }
    header(answer, "content-length")
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|n| (1..=HEAD_FILLER_MAX).contains(n))
}

/// The replay's timeout: the route's (the router's hint header) when it is
/// readable and positive, else the configured one.
pub fn timeout_ms(retry: &RetryConfig, headers: &[(String, String)]) -> u64 {
    header(headers, EXPECTED_TIMEOUT_HEADER)
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|t| *t > 0)
        .unwrap_or(retry.timeout_ms)
}

/// What the twin call brought back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallResult {
    /// An answer from a named live host.
    Answer,
    /// An answer from a named live host, larger than
    /// `retry.max_answer_bytes`.
    TooLarge,
    /// The twin's pick was not a named host: nothing was sent.
    TwinMiss,
    /// No host's answer: a reset, a refused connection.
    Failed,
    /// The call's timeout passed (the twin leg's router answered 504).
    TimedOut,
}

/// The header Envoy's router adds to an answer that came from a host (and
/// not to its own replies: a timeout, a refused connection, no host).
pub const UPSTREAM_TIME_HEADER: &str = "x-envoy-upstream-service-time";

/// What a twin call's answer says: its headers (`None`: the call failed
/// with no answer at all) and its body's size against
/// `retry.max_answer_bytes`.
pub fn classify(
    retry: &RetryConfig,
    answer: Option<&[(String, String)]>,
    body_size: usize,
) -> CallResult {
    let Some(headers) = answer else {
        return CallResult::Failed;
    };
    if header(headers, TWIN_MISS_HEADER).is_some() {
        CallResult::TwinMiss
    } else if header(headers, UPSTREAM_TIME_HEADER).is_none() {
        // The twin leg's router answered itself (its timeout, a connection
        // the member refused): no host's answer to give the client.
        if header(headers, ":status") == Some("504") {
            CallResult::TimedOut
        } else {
            CallResult::Failed
        }
    } else if u64::try_from(body_size).map_or(true, |n| n > retry.max_answer_bytes) {
        CallResult::TooLarge
    } else {
        CallResult::Answer
    }
}

/// What the request does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Call the twin naming `hosts`, with `timeout_ms` left.
    Send {
        /// The hosts to name, in order.
        hosts: Vec<SocketAddr>,
        /// Time left for this call.
        timeout_ms: u64,
    },
    /// Give the client the answer just received.
    Deliver,
    /// Give up with this outcome (`Exhausted`: the normal rejection;
    /// `Timeout`: a 504).
    Fail(ReplayOutcome),
}

/// One request's replay: the batches still to try and the deadline.
#[derive(Debug, Clone)]
pub struct Replay {
    batches: std::vec::IntoIter<Vec<SocketAddr>>,
    deadline_ms: u64,
    attempts: u32,
}

impl Replay {
    /// Starts a replay at `now_ms` over `batches` (from [`plan`]) with
    /// `timeout_ms` for the whole of it; returns the first step.
    pub fn start(batches: Vec<Vec<SocketAddr>>, now_ms: u64, timeout_ms: u64) -> (Self, Step) {
        let mut replay = Self {
            batches: batches.into_iter(),
            deadline_ms: now_ms.saturating_add(timeout_ms),
            attempts: 0,
        };
        let step = replay.next(now_ms);
        (replay, step)
    }

    /// Calls made so far.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// The next step after a call's result at `now_ms`.
    pub fn on_result(&mut self, now_ms: u64, result: CallResult) -> Step {
        match result {
            CallResult::Answer => Step::Deliver,
            CallResult::TooLarge => Step::Fail(ReplayOutcome::AnswerTooLarge),
            CallResult::TimedOut => Step::Fail(ReplayOutcome::Timeout),
            // A call that failed at its deadline is the timeout; one that
            // failed sooner (a member that died since the index said live,
            // a refused connection) is worth the next batch.
            CallResult::Failed if now_ms >= self.deadline_ms => Step::Fail(ReplayOutcome::Timeout),
            CallResult::TwinMiss | CallResult::Failed => self.next(now_ms),
        }
    }

    fn next(&mut self, now_ms: u64) -> Step {
        if now_ms >= self.deadline_ms {
            return Step::Fail(ReplayOutcome::Timeout);
        }
        match self.batches.next() {
            Some(hosts) => {
                self.attempts += 1;
                Step::Send {
                    hosts,
                    timeout_ms: self.deadline_ms - now_ms,
                }
            }
            None => Step::Fail(ReplayOutcome::Exhausted),
        }
    }
}

// === impl TwinConfig ===

/// The plugin configuration of the filter in a twin cluster:
/// `{"replay_twin": {"endpoint_header": "..."}}`. The twin needs no index: it
/// only checks that its load balancer picked a host the origin named.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TwinConfig {
    /// The header carrying the named hosts (as `retry.endpoint_header`).
    pub endpoint_header: String,
}

impl TwinConfig {
    /// The twin configuration, if `bytes` is one (`Ok(None)`: it is not a
    /// twin configuration, parse it as the guard's).
    pub fn parse(bytes: &[u8]) -> Result<Option<Self>, String> {
        let Some(twin) = role(bytes, "replay_twin", "a replay twin", Self::read)? else {
            return Ok(None);
        };
        if let Some(problem) = header_problem("replay_twin.endpoint_header", &twin.endpoint_header)
        {
            return Err(problem);
        }
        Ok(Some(twin))
    }

    /// The twin's fields at `path`, as the guard's configuration is read.
    fn read(path: &str, value: &Value, problems: &mut Vec<String>) -> Option<Self> {
        let mut twin = Self {
            endpoint_header: crate::config::default_endpoint_header(),
        };
        read::fields(
            path,
            value,
            "struct TwinConfig",
            &["endpoint_header"],
            problems,
            &mut |key, at, value, p| {
                if key == "endpoint_header" {
                    read::set(&mut twin.endpoint_header, read::string(at, value, p));
                }
            },
        )?;
        Some(twin)
    }
}

/// A role's plugin configuration (`{"<key>": {...}}`, its value read by
/// `read_role`), if `bytes` is one: `Ok(None)` when it is not (parse it as
/// another role's), every problem naming `what` when it is but does not
/// read.
pub(crate) fn role<T>(
    bytes: &[u8],
    key: &str,
    what: &str,
    read_role: impl FnOnce(&str, &Value, &mut Vec<String>) -> Option<T>,
) -> Result<Option<T>, String> {
    let Some((doc, mut problems)) = role_document(bytes, key) else {
        return Ok(None);
    };
    let read = doc
        .get(key)
        .and_then(|value| read_role(key, value, &mut problems));
    match refusal(what, &problems) {
        Some(refused) => Err(refused),
        None => Ok(read),
    }
}

/// The document `bytes`, if it has the field `key`, with a problem for
/// each other field: a role's document has no other.
fn role_document(bytes: &[u8], key: &str) -> Option<(Map<String, Value>, Vec<String>)> {
    let Ok(Value::Object(doc)) = crate::config::json_value(bytes) else {
        return None;
    };
    if !doc.contains_key(key) {
        return None;
    }
    let mut problems = Vec::new();
    for other in doc.keys().filter(|k| *k != key) {
        read::unknown(other, other, &[key], &mut problems);
    }
    Some((doc, problems))
}

/// The refusal of a role's document with `problems`, if it has any.
fn refusal(what: &str, problems: &[String]) -> Option<String> {
    (!problems.is_empty()).then(|| {
        format!(
            "plugin configuration of {what} refused: {}",
            problems.join("; ")
        )
    })
}

/// The twin's check: is the host its load balancer picked (`address`, as
/// `upstream.address`) one of the hosts the origin named (`named`, the
/// endpoint header)? Without either, no.
pub fn twin_pick_is_named(named: Option<&str>, address: Option<&str>) -> bool {
    let Some(picked) = address.and_then(parse_socket) else {
        return false;
    };
    named.is_some_and(|list| {
        list.split(',')
            .filter_map(|h| parse_socket(h.trim()))
            .any(|h| h == picked)
    })
}

fn parse_socket(s: &str) -> Option<SocketAddr> {
    let addr: SocketAddr = s.parse().ok()?;
    // One canonical form for IPv4-mapped IPv6, as the index keys it.
    Some(SocketAddr::new(canonical(addr.ip()), addr.port()))
}

#[cfg(test)]
mod tests;
