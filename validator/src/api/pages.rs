//! Answers in pages (docs/api.md, "Answers in pages"): a client that gives
//! `page_bytes` gets a long answer a page at a time.
//!
//! The first page comes from `/v1/snapshot` or `/v1/changes` as any answer
//! does; the answer it is a page of is then held here, the very [`Bytes`] the
//! answer cache built (no copy), and `GET /v1/answer` serves slices of it by
//! id and offset. A fleet asking for the same shared answer shares one held
//! copy and one id. What is held is bounded whatever clients do: an answer
//! goes [`HOLD_FOR`] after its last page was asked for, and at most
//! [`MAX_HELD`] answers of at most [`MAX_HELD_BYTES`] together are held (the
//! least recently used goes first); a client asking for one that went gets
//! 410 and starts over. Each answer that goes is counted
//! (`staleguard_validator_answer_pages_dropped_total`, by reason).

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::{header, HeaderName, HeaderValue};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use staleguard_core::page;

use super::answers::{Encoded, Form};
use super::{check_version, ApiError, ApiState};
use crate::metrics::Metrics;

/// How long an answer is held after its last page was asked for: a gateway
/// asks for the next page as soon as it has one, so seconds are plenty.
pub(crate) const HOLD_FOR: Duration = Duration::from_secs(30);

/// The most answers held at once.
pub(crate) const MAX_HELD: usize = 32;

/// The most bytes held answers may take together (a 150k-IP snapshot is
/// about 2 MB packed, 20 MB as full JSON).
pub(crate) const MAX_HELD_BYTES: usize = 256 << 20;

#[derive(Debug)]
struct Held {
    id: String,
    body: Bytes,
    form: Form,
    last_used: Instant,
}

/// The answers being served in pages.
#[derive(Debug)]
pub(crate) struct Pages {
    /// Names this process's ids apart from a previous one's.
    prefix: u64,
    next: u64,
    /// Least recently used first.
    held: VecDeque<Held>,
    bytes: usize,
}

impl Pages {
    /// None held; ids start with `prefix` (the epoch: a restarted validator
    /// answers a previous process's id with 410).
    pub(crate) fn new(prefix: u64) -> Self {
        Self {
            prefix,
            next: 0,
            held: VecDeque::new(),
            bytes: 0,
        }
    }

    /// Holds `body` (written in `form`) for its further pages; the id to ask
    /// for them with. The same bytes held already keep their id.
    fn hold(&mut self, now: Instant, body: &Bytes, form: Form, metrics: &Metrics) -> String {
        self.expire(now, metrics);
        let same = self.held.iter().position(|h| {
            h.form == form && h.body.as_ptr() == body.as_ptr() && h.body.len() == body.len()
        });
        if let Some(at) = same {
            if let Some(mut held) = self.held.remove(at) {
                held.last_used = now;
                let id = held.id.clone();
                self.held.push_back(held);
                return id;
            }
        }
        self.next += 1;
        let id = format!("{:x}-{:x}", self.prefix, self.next);
        self.bytes += body.len();
        self.held.push_back(Held {
            id: id.clone(),
            body: body.clone(),
            form,
            last_used: now,
        });
        // The newest stays, whatever its size: its client is about to ask.
        while self.held.len() > 1 && (self.held.len() > MAX_HELD || self.bytes > MAX_HELD_BYTES) {
            self.drop_oldest(metrics, "evicted");
        }
        id
    }

    /// The held answer `id`, if it is still held (the next hold counts from
    /// now).
    fn get(&mut self, now: Instant, id: &str, metrics: &Metrics) -> Option<(Bytes, Form)> {
        self.expire(now, metrics);
        let at = self.held.iter().position(|h| h.id == id)?;
        let mut held = self.held.remove(at)?;
        held.last_used = now;
        let found = (held.body.clone(), held.form);
        self.held.push_back(held);
        Some(found)
    }

    fn expire(&mut self, now: Instant, metrics: &Metrics) {
        while self
            .held
            .front()
            .is_some_and(|h| now.saturating_duration_since(h.last_used) >= HOLD_FOR)
        {
            self.drop_oldest(metrics, "expired");
        }
    }

    fn drop_oldest(&mut self, metrics: &Metrics, reason: &'static str) {
        if let Some(held) = self.held.pop_front() {
            self.bytes -= held.body.len();
            metrics.answer_pages_dropped(reason);
        }
    }

    /// How many answers are held.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.held.len()
    }
}

/// The held answers of a process, shared by its handlers.
pub(crate) type SharedPages = Mutex<Pages>;

fn lock(pages: &SharedPages) -> std::sync::MutexGuard<'_, Pages> {
    pages.lock().unwrap_or_else(|e| e.into_inner())
}

/// `answer` as a client that asked with `page_bytes` gets it: whole when it
/// fits a page (or no page size was given), else its first page, the rest
/// held for `/v1/answer`.
pub(crate) fn respond(state: &ApiState, answer: Encoded, page_bytes: Option<u32>) -> Response {
    let Some(page_bytes) = page_bytes else {
        return super::changes::encoded(answer);
    };
    let len = page::page_len(page_bytes) as usize;
    if answer.body.len() <= len {
        return super::changes::encoded(answer);
    }
    let id = lock(&state.pages).hold(Instant::now(), &answer.body, answer.form, &state.metrics);
    page_of(answer.form, &answer.body, &id, 0, len)
}

/// The page of `body` from `offset`, at most `len` bytes, with the headers
/// naming the whole.
fn page_of(form: Form, body: &Bytes, id: &str, offset: usize, len: usize) -> Response {
    let end = offset.saturating_add(len).min(body.len());
    let number = |n: usize| HeaderValue::from_str(&n.to_string());
    let (Ok(length), Ok(at), Ok(id)) = (
        number(body.len()),
        number(offset),
        HeaderValue::from_str(id),
    ) else {
        return ApiError::Internal.into_response();
    };
    (
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static(form.content_type()),
            ),
            (header::VARY, HeaderValue::from_static("accept")),
            (HeaderName::from_static(page::LENGTH_HEADER), length),
            (HeaderName::from_static(page::ID_HEADER), id),
            (HeaderName::from_static(page::OFFSET_HEADER), at),
        ],
        body.slice(offset.min(end)..end),
    )
        .into_response()
}

// Query parameters are strict, as on every route.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct AnswerQuery {
    v: Option<u32>,
    id: Option<String>,
    offset: Option<u64>,
    page_bytes: Option<u32>,
}

/// `GET /v1/answer?v=1&id=ID&offset=O&page_bytes=L`: bytes `[O, O+L)` of a
/// held answer (the rest of it without `page_bytes`).
pub(crate) async fn answer(
    State(state): State<ApiState>,
    query: Result<Query<AnswerQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(q) = query.map_err(|e| ApiError::BadRequest(e.body_text()))?;
    check_version(q.v)?;
    let id = q.id.ok_or_else(|| {
        ApiError::BadRequest(
            "missing id=ID (the staleguard-answer-id header of the first page)".into(),
        )
    })?;
    let offset = q
        .offset
        .ok_or_else(|| ApiError::BadRequest("missing offset=BYTES".into()))?;
    let found = lock(&state.pages).get(Instant::now(), &id, &state.metrics);
    let Some((body, form)) = found else {
        return Err(ApiError::Gone(format!(
            "answer {id:?} is no longer held (answers are held {} s after their last page); ask for it again",
            HOLD_FOR.as_secs()
        )));
    };
    let offset = usize::try_from(offset)
        .ok()
        .filter(|o| *o <= body.len())
        .ok_or_else(|| {
            ApiError::BadRequest(format!(
                "offset={offset} is past the end of answer {id:?} ({} bytes)",
                body.len()
            ))
        })?;
    let len = q
        .page_bytes
        .map_or(usize::MAX, |l| page::page_len(l) as usize);
    Ok(page_of(form, &body, &id, offset, len))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn form() -> Form {
        Form::Packed(staleguard_core::packed::Encoding::Binary)
    }

    #[test]
    fn the_same_answer_is_held_once_and_a_hostile_client_cannot_grow_the_hold() {
        let metrics = Metrics::new();
        let mut pages = Pages::new(7);
        let now = Instant::now();
        let shared = Bytes::from(vec![1u8; 100]);
        let a = pages.hold(now, &shared, form(), &metrics);
        let b = pages.hold(now, &shared.clone(), form(), &metrics);
        assert_eq!(a, b, "a fleet asking the same answer shares one id");
        assert_eq!(pages.len(), 1);
        // Distinct answers, many more than the bound: the oldest go.
        for i in 0..(MAX_HELD * 3) {
            pages.hold(now, &Bytes::from(vec![i as u8; 10]), form(), &metrics);
        }
        assert_eq!(pages.len(), MAX_HELD);
        assert!(
            pages.get(now, &a, &metrics).is_none(),
            "the oldest was evicted"
        );
        assert_eq!(
            metrics.answer_pages_dropped_count("evicted"),
            (MAX_HELD * 2 + 1) as u64
        );
    }

    #[test]
    fn a_held_answer_goes_after_its_last_page_and_each_page_keeps_it() {
        let metrics = Metrics::new();
        let mut pages = Pages::new(7);
        let start = Instant::now();
        let body = Bytes::from(vec![1u8; 100]);
        let id = pages.hold(start, &body, form(), &metrics);
        let later = start + HOLD_FOR - Duration::from_secs(1);
        assert!(pages.get(later, &id, &metrics).is_some());
        assert!(
            pages
                .get(later + HOLD_FOR - Duration::from_secs(1), &id, &metrics)
                .is_some(),
            "asking for a page holds it on"
        );
        assert!(pages.get(later + HOLD_FOR * 3, &id, &metrics).is_none());
        assert_eq!(metrics.answer_pages_dropped_count("expired"), 1);
    }

    #[test]
    fn bytes_held_are_bounded_but_the_newest_answer_stays() {
        let metrics = Metrics::new();
        let mut pages = Pages::new(7);
        let now = Instant::now();
        let big = Bytes::from(vec![0u8; MAX_HELD_BYTES / 2 + 1]);
        pages.hold(now, &big, form(), &metrics);
        let other = Bytes::from(vec![1u8; MAX_HELD_BYTES / 2 + 1]);
        let id = pages.hold(now, &other, form(), &metrics);
        assert_eq!(pages.len(), 1);
        assert!(pages.get(now, &id, &metrics).is_some());
    }
}
