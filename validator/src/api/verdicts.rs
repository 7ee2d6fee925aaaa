//! `POST /v1/verdicts`: the verdicts of many endpoints in one request, for
//! `staleguard-validator audit` (one round trip however large the gateway).

use axum::extract::rejection::{JsonRejection, QueryRejection};
use axum::extract::{Query, State};
use axum::response::Response;
use axum::Json;
use staleguard_core::batch::{Records, VerdictItem, VerdictsAnswer, VerdictsRequest, MAX_ITEMS};
use staleguard_core::wire::WIRE_VERSION;
use staleguard_core::{decide, Reason};

use super::error::ApiError;
use super::{check_version, json, ApiState};
use crate::shared::SharedIndex;

/// The largest request body accepted: [`MAX_ITEMS`] items of ~80 bytes.
pub(crate) const MAX_BODY_BYTES: usize = 20 * 1024 * 1024;

#[derive(Debug, serde::Deserialize)]
pub(crate) struct VerdictsQuery {
    v: Option<u32>,
}

pub(crate) async fn verdicts(
    State(state): State<ApiState>,
    query: Result<Query<VerdictsQuery>, QueryRejection>,
    body: Result<Json<VerdictsRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Query(q) = query.map_err(|e| ApiError::BadRequest(e.body_text()))?;
    check_version(q.v)?;
    let Json(request) = body.map_err(|e| ApiError::BadRequest(e.body_text()))?;
    if request.items.len() > MAX_ITEMS {
        return Err(ApiError::BadRequest(format!(
            "{} items exceed the limit of {MAX_ITEMS} per request",
            request.items.len()
        )));
    }
    Ok(json(&judge_all(&state.index, &request)))
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
