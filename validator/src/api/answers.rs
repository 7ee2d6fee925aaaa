//! Encoded answers, shared by every client asking from the same position.
//!
//! When the index moves, every waiting gateway wakes and asks for the same
//! delta; after a validator restart, a whole fleet asks for the same snapshot.
//! Building and serializing that answer once per position and generation, not
//! once per client, is what keeps fan-out cheap. An entry lives at most
//! [`MAX_AGE`], so the `freshness.age_ms` it carries is never more than that
//! behind.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use staleguard_core::{Changes, Snapshot};

use crate::shared::SharedIndex;

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

/// One encoded answer and what the long poll needs to know about it.
#[derive(Debug, Clone)]
pub(crate) struct Encoded {
    pub(crate) body: Bytes,
    /// An empty delta: nothing to tell yet.
    pub(crate) empty: bool,
    /// The freshness the answer carries.
    pub(crate) fresh: bool,
    /// The generation the answer brings the client to.
    pub(crate) generation: u64,
}

#[derive(Debug, Default)]
pub(crate) struct Answers {
    entries: Mutex<HashMap<(Position, View), (Instant, Encoded)>>,
}

impl Answers {
    /// The answer for a client at `(epoch, since)` (or for a snapshot).
    pub(crate) fn get(&self, index: &SharedIndex, position: Position, view: View) -> Encoded {
        let freshness = index.freshness();
        let generation = index.read().generation();
        {
            let entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
            if let Some((built, hit)) = entries.get(&(position, view)) {
                if hit.generation == generation
                    && hit.fresh == freshness.fresh
                    && built.elapsed() < MAX_AGE
                {
                    return hit.clone();
                }
            }
        }
        let encoded = build(index, position, view, freshness);
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        entries.retain(|_, (built, e)| {
            e.generation == encoded.generation && built.elapsed() < MAX_AGE
        });
        entries.insert((position, view), (Instant::now(), encoded.clone()));
        encoded
    }
}

/// Where `(epoch, since)` puts a client of an index of epoch `ours`.
pub(crate) fn position(ours: u64, epoch: Option<u64>, since: Option<u64>) -> Position {
    match (epoch, since) {
        (Some(epoch), Some(since)) if epoch == ours => Position::Since(since),
        _ => Position::Reset,
    }
}

fn build(
    index: &SharedIndex,
    position: Position,
    view: View,
    freshness: staleguard_core::Freshness,
) -> Encoded {
    let slim = |records: &mut Vec<staleguard_core::IpRecord>| {
        if view == View::Verdict {
            *records = std::mem::take(records)
                .into_iter()
                .map(staleguard_core::IpRecord::verdict_view)
                .collect();
        }
    };
    let fresh = freshness.fresh;
    let (document, empty, generation) = {
        let index = index.read();
        let snapshot = |index: &crate::index::Index| {
            let mut s = index.snapshot(freshness.clone());
            slim(&mut s.records);
            s
        };
        match position {
            Position::Snapshot => {
                let s: Snapshot = snapshot(&index);
                let g = s.generation;
                (serde_json::to_vec(&s), false, g)
            }
            Position::Reset => {
                let s = snapshot(&index);
                let g = s.generation;
                (serde_json::to_vec(&Changes::Reset(s)), false, g)
            }
            Position::Since(since) => match index.changes_since(since, freshness.clone()) {
                Some(mut delta) => {
                    slim(&mut delta.upserts);
                    let (empty, g) = (delta.is_empty(), delta.generation);
                    (serde_json::to_vec(&Changes::Delta(delta)), empty, g)
                }
                None => {
                    let s = snapshot(&index);
                    let g = s.generation;
                    (serde_json::to_vec(&Changes::Reset(s)), false, g)
                }
            },
        }
    };
    let body = document.unwrap_or_else(|error| {
        // Our own types always serialize; if that ever breaks, say so loudly
        // and send something a client refuses rather than a partial document.
        tracing::error!(%error, "cannot serialize an answer");
        b"{}".to_vec()
    });
    Encoded {
        body: Bytes::from(body),
        empty,
        fresh,
        generation,
    }
}
