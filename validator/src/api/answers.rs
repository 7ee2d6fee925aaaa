//! Encoded answers, shared by every client asking from the same position.
//!
//! When the index moves, every waiting gateway wakes and asks for the same
//! delta; after a validator restart, a whole fleet asks for the same snapshot.
//! Building and serializing that answer once per position and generation, not
//! once per client, is what keeps fan-out cheap. An entry lives at most
//! [`MAX_AGE`], so the `freshness.age_ms` it carries is never more than that
//! behind.
//!
//! Builds are **single flight**: while one is running, everyone asking for the
//! same document waits for it instead of starting another (a snapshot in flight
//! is joined even if the index moved meanwhile: a snapshot of any recent
//! generation is a valid start, and the client's next poll brings it up to
//! date). A reset answer is the snapshot document with the `kind` tag in
//! front, so `/v1/snapshot` and resets share one build too. A build runs on
//! the blocking pool, never on an async worker, and holds the index's read
//! lock only to copy what it needs, a chunk of records at a time (watch events
//! are applied between chunks): slimming and JSON encoding happen after the
//! lock is released.
//!
//! A reset is a reset whatever brought the client to it: no epoch or another
//! one, a `since` the change log no longer covers, or a `since` ahead of the
//! index. All of them share the snapshot's slot, so a client cannot make the
//! validator build one snapshot per `since` value it makes up. Builds of
//! distinct documents (deltas from distinct covered generations) still each
//! build, so at most [`super::Limits::max_builds`] run at once; the others
//! wait their turn. Every build is counted by the reason that started it.
//!
//! An answer is written in the [`Form`] its client asked for: JSON of a view,
//! or packed ([`staleguard_core::packed`]) with its records as text or in
//! binary; each form is built once and shared like the rest.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::http::{header, HeaderMap};
use staleguard_core::wire::Delta;
use staleguard_core::{packed, Changes, Snapshot};
use tokio::sync::OnceCell;

use crate::live::SharedIndex;
use crate::metrics::Metrics;

/// How long an encoded answer is reused.
pub(crate) const MAX_AGE: Duration = Duration::from_millis(250);

/// Where a client stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Position {
    /// `GET /v1/snapshot`.
    Snapshot,
    /// `GET /v1/changes` with no usable epoch: a reset.
    Reset,
    /// `GET /v1/changes` from this generation of our epoch.
    Since(u64),
}

/// How much of each record an answer carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum View {
    /// Everything (the default).
    #[default]
    Full,
    /// What a verdict needs ([`staleguard_core::IpRecord::verdict_view`]):
    /// what gateways ask for.
    Verdict,
}

/// How an answer is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Form {
    /// JSON of this view: the default, for people, the audit and any client.
    Json(View),
    /// The packed form, its records in this encoding: what gateways ask for.
    Packed(packed::Encoding),
}

impl Form {
    /// What a request asks for: the packed encoding its `Accept` prefers
    /// ([`packed::Encoding::accepted`]: binary records, then text; whatever
    /// the view: the packed form carries what a gateway keeps of the verdict
    /// view), else JSON of `view`.
    pub(crate) fn asked(view: View, headers: &HeaderMap) -> Self {
        let accept = headers
            .get_all(header::ACCEPT)
            .iter()
            .filter_map(|value| value.to_str().ok());
        match packed::Encoding::accepted(accept) {
            Some(encoding) => Form::Packed(encoding),
            None => Form::Json(view),
        }
    }

    /// The `Content-Type` of an answer in this form.
    pub(crate) fn content_type(self) -> &'static str {
        match self {
            Form::Json(_) => "application/json",
            Form::Packed(encoding) => encoding.media_type(),
        }
    }
}

/// One encoded answer and what the long poll needs to know about it.
#[derive(Debug, Clone)]
pub(crate) struct Encoded {
    pub(crate) body: Bytes,
    /// How `body` is written.
    pub(crate) form: Form,
    /// An empty delta: nothing to tell yet.
    pub(crate) empty: bool,
    /// The freshness the answer carries.
    pub(crate) fresh: bool,
    /// The generation the answer brings the client to.
    pub(crate) generation: u64,
}

/// What one build produces: a snapshot (served as such or as a reset), or what
/// changed since a generation (a delta, or a reset when the log no longer
/// covers it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Document {
    Snapshot,
    Since(u64),
}

impl Position {
    fn document(self) -> Document {
        match self {
            Position::Snapshot | Position::Reset => Document::Snapshot,
            Position::Since(since) => Document::Since(since),
        }
    }
}

#[derive(Debug)]
struct Built {
    at: Instant,
    encoded: Encoded,
    /// For a snapshot document: the same snapshot as a `Changes::Reset`,
    /// derived on first demand.
    reset: OnceLock<Bytes>,
}

impl Built {
    fn answer(&self, position: Position) -> Encoded {
        match position {
            Position::Reset => Encoded {
                body: self
                    .reset
                    .get_or_init(|| match self.encoded.form {
                        Form::Json(_) => reset_of(&self.encoded.body),
                        Form::Packed(_) => Bytes::from(packed::reset_of(&self.encoded.body)),
                    })
                    .clone(),
                ..self.encoded.clone()
            },
            Position::Snapshot | Position::Since(_) => self.encoded.clone(),
        }
    }
}

/// One document being built or built, for the generation and freshness it was
/// asked at.
#[derive(Debug)]
struct Slot {
    generation: u64,
    fresh: bool,
    cell: Arc<OnceCell<Arc<Built>>>,
}

impl Slot {
    fn serves(&self, document: Document, generation: u64, fresh: bool) -> bool {
        if self.fresh != fresh {
            return false;
        }
        match self.cell.get() {
            // In flight: a snapshot of a slightly older generation is still a
            // valid start; a delta must be of this generation, or a long poll
            // woken by the change would be told nothing happened.
            None => self.generation == generation || document == Document::Snapshot,
            Some(built) => self.generation == generation && built.at.elapsed() < MAX_AGE,
        }
    }
}

/// The answers being built and recently built.
#[derive(Debug)]
pub(crate) struct Answers {
    slots: Mutex<HashMap<(Document, Form), Slot>>,
    /// One permit per build allowed to run at once.
    builds: tokio::sync::Semaphore,
}

/// A build that could not finish (it panicked); the caller answers 500.
#[derive(Debug, thiserror::Error)]
#[error("building the answer failed: {0}")]
pub(crate) struct BuildFailed(String);

impl Answers {
    /// No answer yet; at most `max_builds` builds at once (at least one).
    pub(crate) fn new(max_builds: usize) -> Self {
        Self {
            slots: Mutex::default(),
            builds: tokio::sync::Semaphore::new(
                max_builds.clamp(1, tokio::sync::Semaphore::MAX_PERMITS),
            ),
        }
    }

    /// The answer for a client at `position`: the one being built or recently
    /// built for it, or a new build that others asking meanwhile will share.
    pub(crate) async fn get(
        &self,
        index: &SharedIndex,
        metrics: &Metrics,
        position: Position,
        form: Form,
    ) -> Result<Encoded, BuildFailed> {
        let fresh = index.freshness().fresh;
        let generation = index.generation();
        let (position, reason) = served_as(index, position);
        let document = position.document();
        let cell = {
            let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
            let reusable = slots
                .get(&(document, form))
                .is_some_and(|slot| slot.serves(document, generation, fresh));
            if !reusable {
                slots.retain(|_, slot| {
                    slot.cell.get().is_none_or(|built| {
                        slot.generation == generation && built.at.elapsed() < MAX_AGE
                    })
                });
                slots.insert(
                    (document, form),
                    Slot {
                        generation,
                        fresh,
                        cell: Arc::default(),
                    },
                );
            }
            match slots.get(&(document, form)) {
                Some(slot) => slot.cell.clone(),
                None => Arc::default(),
            }
        };
        let built = cell
            .get_or_try_init(|| async {
                let _permit = self
                    .builds
                    .acquire()
                    .await
                    .map_err(|e| BuildFailed(e.to_string()))?;
                let _running = metrics.answer_build_running(reason);
                let index = index.clone();
                let started = Instant::now();
                let built = tokio::task::spawn_blocking(move || build(&index, document, form))
                    .await
                    .map_err(|e| BuildFailed(e.to_string()))?;
                metrics.observe_answer_build(built.1, started.elapsed());
                Ok::<_, BuildFailed>(Arc::new(built.0))
            })
            .await?;
        Ok(built.answer(position))
    }
}

/// Where a client at `position` is served from, and the reason a build for it
/// is counted under: a `since` the change log cannot answer (older than it
/// remembers, or ahead of the index) is a reset, served from the snapshot's
/// slot like every other reset.
fn served_as(index: &SharedIndex, position: Position) -> (Position, &'static str) {
    match position {
        Position::Snapshot => (position, "snapshot"),
        Position::Reset => (position, "epoch"),
        Position::Since(since) if index.has_changes_since(since) => (position, "delta"),
        Position::Since(since) if since > index.generation() => (Position::Reset, "ahead"),
        Position::Since(_) => (Position::Reset, "compacted"),
    }
}

/// Where `(epoch, since)` puts a client of an index of epoch `ours`.
pub(crate) fn position(ours: u64, epoch: Option<u64>, since: Option<u64>) -> Position {
    match (epoch, since) {
        (Some(epoch), Some(since)) if epoch == ours => Position::Since(since),
        _ => Position::Reset,
    }
}

/// What a build copied out of the index.
enum Copied {
    Snapshot(Snapshot),
    Delta(Delta),
    Reset(Snapshot),
}

/// Builds `document` (on the blocking pool). Returns it with the kind of
/// document it turned out to be, for the build counter.
fn build(index: &SharedIndex, document: Document, form: Form) -> (Built, &'static str) {
    // Snapshots are copied a chunk at a time (SharedIndex::snapshot), so a
    // watch event never waits for more than a chunk.
    let copied = match document {
        Document::Snapshot => Copied::Snapshot(index.snapshot()),
        Document::Since(since) => {
            let delta = {
                let guard = index.read();
                // Taken with the lock held: a poisoned lock shows as not fresh.
                let freshness = index.freshness();
                guard.changes_since(since, freshness)
            };
            match delta {
                Some(delta) => Copied::Delta(delta),
                None => Copied::Reset(index.snapshot()),
            }
        }
    };
    // The lock is released: the rest costs the index's writers nothing.
    let view = match form {
        Form::Json(view) => view,
        Form::Packed(encoding) => return packed_build(copied, encoding),
    };
    let slim = |records: Vec<staleguard_core::IpRecord>| match view {
        View::Full => records,
        View::Verdict => records
            .into_iter()
            .map(staleguard_core::IpRecord::verdict_view)
            .collect(),
    };
    let (document, kind, empty, fresh, generation) = match copied {
        Copied::Snapshot(mut s) => {
            s.records = slim(s.records);
            let meta = (false, s.freshness.fresh, s.generation);
            (serde_json::to_vec(&s), "snapshot", meta.0, meta.1, meta.2)
        }
        Copied::Reset(mut s) => {
            s.records = slim(s.records);
            let meta = (false, s.freshness.fresh, s.generation);
            (
                serde_json::to_vec(&Changes::Reset(s)),
                "reset",
                meta.0,
                meta.1,
                meta.2,
            )
        }
        Copied::Delta(mut d) => {
            d.upserts = slim(d.upserts);
            let meta = (d.is_empty(), d.freshness.fresh, d.generation);
            (
                serde_json::to_vec(&Changes::Delta(d)),
                "delta",
                meta.0,
                meta.1,
                meta.2,
            )
        }
    };
    let body = document.unwrap_or_else(|error| {
        // Our own types always serialize; if that ever breaks, say so loudly
        // and send something a client refuses rather than a partial document.
        tracing::error!(%error, "cannot serialize an answer");
        b"{}".to_vec()
    });
    (built(body, form, empty, fresh, generation), kind)
}

/// [`build`]'s packed form: the encoder writes only what the form carries.
fn packed_build(copied: Copied, encoding: packed::Encoding) -> (Built, &'static str) {
    let (body, kind, empty, fresh, generation) = match copied {
        Copied::Snapshot(s) => {
            let meta = (s.freshness.fresh, s.generation);
            let body = packed::encode_snapshot_as(encoding, &s);
            (body, "snapshot", false, meta.0, meta.1)
        }
        Copied::Reset(s) => {
            let meta = (s.freshness.fresh, s.generation);
            let body = packed::encode_changes_as(encoding, &Changes::Reset(s));
            (body, "reset", false, meta.0, meta.1)
        }
        Copied::Delta(d) => {
            let meta = (d.is_empty(), d.freshness.fresh, d.generation);
            let body = packed::encode_changes_as(encoding, &Changes::Delta(d));
            (body, "delta", meta.0, meta.1, meta.2)
        }
    };
    let form = Form::Packed(encoding);
    (built(body, form, empty, fresh, generation), kind)
}

fn built(body: Vec<u8>, form: Form, empty: bool, fresh: bool, generation: u64) -> Built {
    Built {
        at: Instant::now(),
        encoded: Encoded {
            body: Bytes::from(body),
            form,
            empty,
            fresh,
            generation,
        },
        reset: OnceLock::new(),
    }
}

/// A snapshot document as a `Changes::Reset`: serde writes an internally
/// tagged variant as its content's object with the tag first, so the reset is
/// the snapshot with `"kind":"reset",` after the opening brace (a unit test
/// holds this to serde's own output). Copying bytes is far cheaper than a
/// second build.
fn reset_of(snapshot: &[u8]) -> Bytes {
    match snapshot.split_first() {
        Some((b'{', rest)) if rest.first().is_some_and(|b| *b != b'}') => {
            const TAG: &[u8] = br#"{"kind":"reset","#;
            let mut out = Vec::with_capacity(TAG.len() + rest.len());
            out.extend_from_slice(TAG);
            out.extend_from_slice(rest);
            Bytes::from(out)
        }
        _ => Bytes::copy_from_slice(snapshot),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reset_is_the_snapshot_with_the_tag_in_front_byte_for_byte() {
        let shared = crate::synth::indexed(crate::synth::cluster(3, 4));
        let snapshot = shared.read().snapshot(shared.freshness());
        let ours = reset_of(&serde_json::to_vec(&snapshot).unwrap());
        let serde = serde_json::to_vec(&Changes::Reset(snapshot)).unwrap();
        assert_eq!(
            String::from_utf8_lossy(&ours),
            String::from_utf8_lossy(&serde)
        );
        assert_eq!(&reset_of(b"{}")[..], b"{}", "not a snapshot: left alone");
    }
}
