//! `POST /v1/verdicts`: the verdicts of many endpoints in one request, for
//! `staleguard-validator audit` (one round trip however large the gateway).

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, Request, State};
use axum::http::header::{HeaderValue, CONTENT_LENGTH, CONTENT_TYPE};
use axum::response::{IntoResponse, Response};
use staleguard_core::batch::{Records, VerdictItem, VerdictsAnswer, VerdictsRequest};
use staleguard_core::wire::WIRE_VERSION;
use staleguard_core::{decide, Reason};

use super::error::ApiError;
use super::{check_version, ApiState};
use crate::live::SharedIndex;

/// The largest request body accepted: [`staleguard_core::batch::MAX_ITEMS`]
/// items of ~80 bytes.
pub(crate) const MAX_BODY_BYTES: usize = 20 * 1024 * 1024;

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct VerdictsQuery {
    v: Option<u32>,
}

/// A declared length over [`MAX_BODY_BYTES`] is refused before a byte of the
/// body is read; an undeclared one stops being read at the limit. Reading,
/// decoding and judging wait for one of `--max-verdict-batches` permits, so
/// that only so many bodies are held at once, and run on the blocking pool:
/// a large batch never stalls the async workers (probes, long polls).
pub(crate) async fn verdicts(
    State(state): State<ApiState>,
    query: Result<Query<VerdictsQuery>, QueryRejection>,
    request: Request,
) -> Result<Response, ApiError> {
    let Query(q) = query.map_err(|e| ApiError::BadRequest(e.body_text()))?;
    check_version(q.v)?;
    let declared = request
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if let Some(len) = declared.filter(|len| *len > MAX_BODY_BYTES as u64) {
        return Err(too_large(&format!("a body of {len} bytes")));
    }
    let _permit = state
        .verdict_batches
        .clone()
        .acquire_owned()
        .await
        .map_err(|_| ApiError::Internal)?;
    let body = axum::body::to_bytes(request.into_body(), MAX_BODY_BYTES)
        .await
        .map_err(|error| {
            let over = std::error::Error::source(&error)
                .is_some_and(|e| e.is::<http_body_util::LengthLimitError>());
            if over {
                too_large("the body")
            } else {
                ApiError::BadRequest(format!("cannot read the body: {error}"))
            }
        })?;
    let index = state.index.clone();
    let answer = tokio::task::spawn_blocking(move || {
        let request: VerdictsRequest = serde_json::from_slice(&body)
            .map_err(|e| ApiError::BadRequest(format!("not a verdicts request: {e}")))?;
        serde_json::to_vec(&judge_all(&index, &request)).map_err(|error| {
            tracing::error!(%error, "cannot serialize an answer");
            ApiError::Internal
        })
    })
    .await
    .map_err(|error| {
        tracing::error!(%error, "judging a batch failed");
        ApiError::Internal
    })??;
    Ok((
        [(CONTENT_TYPE, HeaderValue::from_static("application/json"))],
        answer,
    )
        .into_response())
}

fn too_large(what: &str) -> ApiError {
    ApiError::TooLarge(format!(
        "{what} exceeds the limit of {MAX_BODY_BYTES} bytes (20 MiB) per request; \
         split the items into several requests"
    ))
}

/// Judges every item of `request` against one view of the index (one
/// generation, one freshness), with the same [`decide`] as `GET /v1/verdict`
/// and the filter. The audit's file source calls it too.
pub fn judge_all(shared: &SharedIndex, request: &VerdictsRequest) -> VerdictsAnswer {
    let freshness = shared.freshness();
    let index = shared.read();
    let items = request
        .items
        .iter()
        .map(|q| {
            let known = index.knows_service(&q.service);
            let record = index
                .record(q.ip)
                .map(staleguard_core::IpRecord::verdict_view);
            let verdict = decide(
                q.policy.as_ref().unwrap_or(&request.policy),
                freshness.fresh,
                &q.service,
                known,
                record.as_ref(),
            );
            let keep = match request.records {
                Records::All => true,
                Records::NotMember => verdict.reason != Reason::Member,
                Records::None => false,
            };
            VerdictItem {
                service: q.service.clone(),
                ip: q.ip,
                verdict,
                service_known: known,
                record: record.filter(|_| keep),
            }
        })
        .collect();
    VerdictsAnswer {
        v: WIRE_VERSION,
        generation: index.generation(),
        freshness,
        items,
    }
}
