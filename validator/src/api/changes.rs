//! `GET /v1/changes`: the long poll that keeps gateways in sync.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::rejection::QueryRejection;
use axum::extract::{ConnectInfo, Query, State};
use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use serde::Deserialize;

use super::answers::{self, Encoded, Form, View};
use super::{check_version, ApiError, ApiState};
use crate::metrics::Metrics;

/// How often a waiting long poll re-checks freshness, so a validator that turns
/// stale (or fresh again) tells its clients without waiting for a change.
const FRESHNESS_RECHECK: Duration = Duration::from_secs(1);

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ChangesQuery {
    v: Option<u32>,
    epoch: Option<u64>,
    since: Option<u64>,
    wait: Option<f64>,
    #[serde(default)]
    view: View,
    /// Answer in pages of this many bytes (docs/api.md, "Answers in pages").
    page_bytes: Option<u32>,
}

/// Measures fan-out: the time from the first long poll woken by a generation
/// to each later answer carrying it, i.e. how long the last gateway waits
/// after the first one heard.
#[derive(Debug, Clone)]
pub struct FanOut {
    latest: Arc<Mutex<(u64, Instant)>>,
}

impl FanOut {
    /// Starts measuring from generation `current`.
    pub fn new(current: u64) -> Self {
        Self {
            latest: Arc::new(Mutex::new((current, Instant::now()))),
        }
    }

    fn observe(&self, metrics: &Metrics, generation: u64) {
        let mut latest = self.latest.lock().unwrap_or_else(|e| e.into_inner());
        if generation > latest.0 {
            *latest = (generation, Instant::now());
        }
        if generation == latest.0 {
            metrics.observe_fan_out(latest.1.elapsed());
        }
    }
}

pub(crate) async fn changes(
    State(state): State<ApiState>,
    client: Option<Extension<ConnectInfo<SocketAddr>>>,
    headers: HeaderMap,
    query: Result<Query<ChangesQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(q) = query.map_err(|e| ApiError::BadRequest(e.body_text()))?;
    check_version(q.v)?;
    let form = Form::asked(q.view, &headers);
    let wait = parse_wait(q.wait, state.limits.max_wait)?;

    // Subscribe before the first read, so a change between the two is not lost.
    let mut generations = state.index.subscribe();
    generations.borrow_and_update();
    let position = answers::position(state.index.epoch(), q.epoch, q.since);
    let first = state
        .answers
        .get(&state.index, &state.metrics, position, form)
        .await?;
    if wait.is_zero() || !first.empty || *state.shutdown.borrow() {
        return Ok(super::pages::respond(&state, first, q.page_bytes));
    }

    // One client (a source address) may hold only so many of the waiting
    // long polls, so one client cannot take the whole budget. Requests that
    // did not come through a listener (tests) have no address.
    let client = client.map(|Extension(ConnectInfo(peer))| peer.ip().to_canonical());
    let _per_client = match client {
        Some(ip) => Some(
            state
                .long_poll_clients
                .clone()
                .enter(ip, state.limits.max_long_polls_per_client)
                .ok_or_else(|| {
                    state.metrics.long_poll_refused(client, "max_per_client");
                    ApiError::TooManyLongPolls(state.limits.max_long_polls_per_client)
                })?,
        ),
        None => None,
    };
    let _permit = state.long_polls.clone().try_acquire_owned().map_err(|_| {
        state.metrics.long_poll_refused(client, "max_long_polls");
        ApiError::TooManyLongPolls(state.limits.max_long_polls)
    })?;
    let _waiting = state.metrics.long_poll_waiting();
    let deadline = tokio::time::sleep(wait);
    tokio::pin!(deadline);
    let mut recheck = tokio::time::interval(FRESHNESS_RECHECK);
    recheck.reset();
    let mut shutdown = state.shutdown.clone();
    loop {
        tokio::select! {
            changed = generations.changed() => {
                if changed.is_err() {
                    break;
                }
                let next = state
                    .answers
                    .get(&state.index, &state.metrics, position, form)
                    .await?;
                if !next.empty {
                    state.fan_out.observe(&state.metrics, next.generation);
                    return Ok(super::pages::respond(&state, next, q.page_bytes));
                }
                // Woken without a change: the index turned not fresh (a source
                // stopped); say so now rather than at the next recheck.
                if next.fresh != first.fresh {
                    return Ok(super::pages::respond(&state, next, q.page_bytes));
                }
            }
            _ = recheck.tick() => {
                if state.index.freshness().fresh != first.fresh {
                    break;
                }
            }
            _ = shutdown.changed() => break,
            _ = &mut deadline => break,
        }
    }
    let last = state
        .answers
        .get(&state.index, &state.metrics, position, form)
        .await?;
    Ok(super::pages::respond(&state, last, q.page_bytes))
}

/// An answer in the form it was built in; `Vary: Accept`, as the form
/// follows the request's `Accept`.
pub(crate) fn encoded(answer: Encoded) -> Response {
    (
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static(answer.form.content_type()),
            ),
            (header::VARY, HeaderValue::from_static("accept")),
        ],
        answer.body,
    )
        .into_response()
}

/// The long poll's wait: `wait` seconds, at most `max` (`--max-wait`). A
/// longer wait is clamped, not refused: the answer only comes sooner, which
/// every client must handle anyway, whereas a refusal would leave a gateway
/// whose `poll_wait_s` exceeds the validator's `--max-wait` without data.
fn parse_wait(wait: Option<f64>, max: Duration) -> Result<Duration, ApiError> {
    let Some(seconds) = wait else {
        return Ok(Duration::ZERO);
    };
    if !seconds.is_finite() || seconds < 0.0 {
        return Err(ApiError::BadRequest(format!(
            "wait={seconds} is out of range: give seconds from 0 (longer waits are cut to --max-wait, {} s)",
            max.as_secs_f64()
        )));
    }
    Ok(Duration::from_secs_f64(seconds.min(max.as_secs_f64())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wait_must_be_a_bounded_number_of_seconds() {
        let max = Duration::from_secs(60);
        assert_eq!(parse_wait(None, max).unwrap(), Duration::ZERO);
        assert_eq!(
            parse_wait(Some(0.25), max).unwrap(),
            Duration::from_millis(250)
        );
        assert_eq!(parse_wait(Some(60.0), max).unwrap(), max);
        // Above --max-wait: clamped, the answer comes sooner.
        assert_eq!(parse_wait(Some(60.5), max).unwrap(), max);
        assert_eq!(parse_wait(Some(1e300), max).unwrap(), max);
        for bad in [-1.0, f64::NAN, f64::INFINITY] {
            assert!(parse_wait(Some(bad), max).is_err(), "{bad}");
        }
    }
}
