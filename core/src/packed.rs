//! The packed form of snapshots and changes: what a gateway keeps of each
//! record, read one record at a time, its records a line each or in binary.
//!
//! JSON ([`crate::wire`]) stays the validator's default answer, for people,
//! the audit and clients of their own. A gateway asks for this form in
//! `Accept` on `/v1/snapshot` and `/v1/changes`: the binary records first
//! ([`BINARY_MEDIA_TYPE`], [`Encoding::Binary`]), then the text form
//! ([`MEDIA_TYPE`]), then JSON ([`Encoding::accepted`] is how a validator
//! chooses). A validator answers the best it knows: one of the last release
//! knows only the text form, one before it only JSON; the answer's
//! `Content-Type` and its first bytes ([`encoding_of`]) say which, and the
//! readers here read both encodings, so a gateway works with validators of
//! every release. A record carries what the verdict view carries that a
//! gateway keeps (its pods' flags and services, bare members, the
//! tombstone's services) and, instead of pod names, a [`fingerprint`] of
//! them: at 150,000 IPs, about a fifth of the verdict view's JSON as text,
//! under a tenth in binary (about 12 bytes a record against 28-30).
//!
//! # Format (wire version 1)
//! ASCII lines, each ending in `\n`:
//!
//! ```text
//! staleguard-packed 1 reset
//! epoch 5902170348271046
//! generation 3
//! fresh 1
//! age_ms 6
//! [services] 3
//! pay/pay
//! shop/cart
//! shop/legacy-db
//! [names] 1
//! shop/gone
//! [records] 3
//! 10.244.1.11 f9c1d2e3a pr s1
//! 192.168.50.10 b2
//! 10.244.1.14 t1,3
//! end
//! ```
//!
//! The first line names the format, the wire major and the kind (`snapshot`,
//! `reset` or `delta`). Then fields, `name value`, and lists, `[name] count`
//! followed by that many lines: `services` (the known services; snapshot and
//! reset), `services_added` and `services_removed` (delta), `names` (services
//! records name that are not in `services`), `records` (snapshot and reset) or
//! `upserts` (delta), `removed` (IPs, delta). `end` closes the document, so a
//! cut answer is refused, not read as a short one. A record names a service by
//! its position in `services` followed by `names`, which come before any
//! record. Fields a delta has: `epoch`, `generation`, `since`, `fresh`,
//! `age_ms` (optional); a snapshot has no `since`.
//!
//! A record line is the IP, then tokens separated by one space: `f` and 8 hex
//! digits, the [`fingerprint`] of its pods (absent when no pod holds the IP);
//! `p` and the pod's flags ([`PodFlags`]: `r` ready, `t` terminating, `h` host
//! network, as a gateway's bucket line writes them too) opens a pod; `s<n>` is a service of the pod opened last; `b<n>` a bare service;
//! `t` a tombstone, with the services it names as `t<n>,<n>`.
//!
//! As in JSON, readers ignore what they do not know: a field or list of
//! another name (a list's lines skipped by its count), a record token that
//! starts with another letter, a pod flag of another letter. Anything else
//! that does not read is refused with its line number.
//!
//! # The binary encoding
//! A document whose first word is `staleguard-packed-binary` (media type
//! [`BINARY_MEDIA_TYPE`]) is the same document, lines and rules, except
//! that the items of `[records]` and `[upserts]` are binary records (the
//! layout is in `packed/binary.rs`'s docs): a LEB128 header (the body's
//! length and the address family), the address in 4 or 16 bytes, then the
//! fingerprint, pods (flags as bits, services as LEB128 positions), bare
//! services and the tombstone's. The lines resume after the last record:
//! `end` still closes the document, so a cut answer is refused. A binary
//! record's length frames it: a reader skips fields a later release adds
//! after the ones it knows (as it skips an unknown token) and ignores pod
//! flag bits it does not know; a length past [`MAX_LINE`], a record that
//! ends inside its fields or names no service of the document is refused
//! with the record's number. Nothing is allocated by a stated length or
//! count beyond the bytes that are there.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::io::{BufRead, Read};
use std::net::IpAddr;

use crate::ip::canonical;
use crate::wire::{Changes, Delta, Freshness, Membership, Tombstone, Via, WIRE_VERSION};
use crate::{IpRecord, PodHolder, ServiceKey, Snapshot};

/// The media type a client puts in `Accept` to be answered in the text
/// form, and the `Content-Type` of such an answer.
pub const MEDIA_TYPE: &str = "application/vnd.staleguard.packed";

/// The media type of the binary form ([`Encoding::Binary`]).
pub const BINARY_MEDIA_TYPE: &str = "application/vnd.staleguard.packed-binary";

/// How a packed document writes its records: the rest (first line, fields,
/// lists of services and IPs, `end`) is the same text in both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Encoding {
    /// A line per record ([`MEDIA_TYPE`]; the first line starts
    /// `staleguard-packed`).
    Text,
    /// Records in binary ([`BINARY_MEDIA_TYPE`]; the first line starts
    /// `staleguard-packed-binary`).
    Binary,
}

impl Encoding {
    /// The media type that asks for this encoding and labels an answer in it.
    pub fn media_type(self) -> &'static str {
        match self {
            Encoding::Text => MEDIA_TYPE,
            Encoding::Binary => BINARY_MEDIA_TYPE,
        }
    }

    /// The first word of a document in this encoding.
    fn magic(self) -> &'static str {
        match self {
            Encoding::Text => MAGIC,
            Encoding::Binary => BINARY_MAGIC,
        }
    }

    /// The packed encoding a request's `Accept` values ask for, `None` for
    /// JSON. Each media range may carry a `q` weight (1 when absent; 0, or
    /// one that does not read, refuses it); the packed encoding of the
    /// highest weight wins, binary on a tie, unless `application/json` weighs
    /// more. Names are matched whole and in any case; ranges naming neither
    /// (`*/*`, other types) leave the default, JSON.
    pub fn accepted<'a>(accept: impl IntoIterator<Item = &'a str>) -> Option<Encoding> {
        let (mut binary, mut text, mut json) = (0.0f32, 0.0f32, 0.0f32);
        for range in accept.into_iter().flat_map(|value| value.split(',')) {
            let mut parts = range.split(';');
            let media = parts.next().unwrap_or_default().trim();
            let mut q = 1.0;
            for parameter in parts {
                if let Some((name, value)) = parameter.split_once('=') {
                    if name.trim().eq_ignore_ascii_case("q") {
                        q = value
                            .trim()
                            .parse::<f32>()
                            .ok()
                            .filter(|q| (0.0..=1.0).contains(q))
                            .unwrap_or(0.0);
                    }
                }
            }
            let slot = if media.eq_ignore_ascii_case(BINARY_MEDIA_TYPE) {
                &mut binary
            } else if media.eq_ignore_ascii_case(MEDIA_TYPE) {
                &mut text
            } else if media.eq_ignore_ascii_case("application/json") {
                &mut json
            } else {
                continue;
            };
            *slot = slot.max(q);
        }
        let (encoding, q) = if binary >= text {
            (Encoding::Binary, binary)
        } else {
            (Encoding::Text, text)
        };
        (q > 0.0 && q >= json).then_some(encoding)
    }
}

/// The first word of every text packed document.
const MAGIC: &str = "staleguard-packed";

/// The first word of every binary packed document.
const BINARY_MAGIC: &str = "staleguard-packed-binary";

/// The longest line read (a node IP's record names every `hostNetwork` pod
/// on the node with its services; a few KiB in practice).
pub const MAX_LINE: usize = 1 << 20;

/// A list's stated count reserves at most this many entries up front; a
/// longer list still reads, growing as it goes.
const MAX_RESERVE: usize = 1 << 20;

/// The [`fingerprint`] of no pods.
pub const NO_PODS: u32 = fold(FNV_OFFSET);

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0100_0000_01b3;

const fn fold(hash: u64) -> u32 {
    (hash ^ (hash >> 32)) as u32
}

/// Who holds an IP, in 32 bits: FNV-1a over each pod's `namespace/name` and a
/// newline, in order, folded. A new holder changes it (a collision only hides
/// that from a comparison of fingerprints); stable across processes and
/// releases, so fingerprints of answers from different validators compare.
pub fn fingerprint<'a>(pods: impl IntoIterator<Item = &'a PodHolder>) -> u32 {
    let mut hash = FNV_OFFSET;
    for pod in pods {
        let parts = [pod.namespace.as_bytes(), b"/", pod.name.as_bytes(), b"\n"];
        for byte in parts.into_iter().flatten() {
            hash ^= u64::from(*byte);
            hash = hash.wrapping_mul(FNV_PRIME);
        }
    }
    fold(hash)
}

/// The encoding of the packed document `start` begins (at least its first
/// 25 bytes), `None` when it is not one: a reader that asked for several
/// forms tells which it got without the `Content-Type`. JSON never starts so.
pub fn encoding_of(start: &[u8]) -> Option<Encoding> {
    [Encoding::Binary, Encoding::Text].into_iter().find(|e| {
        start
            .strip_prefix(e.magic().as_bytes())
            .is_some_and(|rest| rest.first() == Some(&b' '))
    })
}

/// True when `start` (at least its first 25 bytes) begins a packed
/// document of either encoding ([`encoding_of`]).
pub fn starts_packed(start: &[u8]) -> bool {
    encoding_of(start).is_some()
}

/// Why a packed document could not be read.
#[derive(Debug, thiserror::Error)]
pub enum PackedError {
    /// Not a packed document, or not the shape of the expected one.
    #[error("malformed packed {what}, line {line}: {reason}")]
    Malformed {
        /// Which document was expected.
        what: &'static str,
        /// The line that did not read (1 is the first).
        line: usize,
        /// What was wrong with it.
        reason: String,
    },
    /// A wire major version this reader does not speak.
    #[error("packed {what} has wire version {found}, this reader speaks {WIRE_VERSION}")]
    Version {
        /// Which document was read.
        what: &'static str,
        /// The version it carried.
        found: u32,
    },
    /// The caller's [`Visit`] stopped reading (its own error says why).
    #[error("reading a packed {what}: stopped by its reader")]
    Stopped {
        /// Which document was read.
        what: &'static str,
    },
    /// The reader failed.
    #[error("reading a packed {what}: {source}")]
    Io {
        /// Which document was expected.
        what: &'static str,
        /// The reader's error.
        #[source]
        source: std::io::Error,
    },
}

/// One IP as a packed document carries it, services as the caller's `S`
/// (their key, or an id the caller derives from it once per document).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record<S> {
    /// The IP, canonical.
    pub ip: IpAddr,
    /// The [`fingerprint`] of the pods holding it ([`NO_PODS`] for none).
    pub fingerprint: u32,
    /// The pods holding it.
    pub pods: Vec<Pod<S>>,
    /// Services listing it without a pod.
    pub bare_services: Vec<S>,
    /// The services its tombstone names, when it has one.
    pub tombstone: Option<Vec<S>>,
}

/// A pod holding an IP, as a packed record carries it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Pod<S> {
    /// Its flags.
    pub flags: PodFlags,
    /// The services it is a member of.
    pub services: Vec<S>,
}

impl Record<ServiceKey> {
    /// The record as the wire types hold it: what [`crate::decide`] reads is
    /// there (memberships `via` both, no ports or conditions), pod names, uids
    /// and the tombstone's pod and time are empty.
    pub fn into_ip_record(self) -> IpRecord {
        let Record {
            ip,
            fingerprint: _,
            pods,
            bare_services,
            tombstone,
        } = self;
        IpRecord {
            ip,
            pods: pods
                .into_iter()
                .map(|pod| PodHolder {
                    namespace: String::new(),
                    name: String::new(),
                    uid: String::new(),
                    services: pod
                        .services
                        .into_iter()
                        .map(|service| Membership {
                            service,
                            via: Via::Both,
                            ports: Vec::new(),
                            conditions: None,
                        })
                        .collect(),
                    ready: pod.flags.ready,
                    terminating: pod.flags.terminating,
                    host_network: pod.flags.host_network,
                })
                .collect(),
            bare_services,
            tombstone: tombstone.map(|services| Tombstone {
                pod: String::new(),
                uid: String::new(),
                services,
                since_ms: 0,
            }),
        }
    }
}

mod binary;
mod flags;
mod read;
#[cfg(test)]
mod tests;
mod write;

pub use flags::{FlagError, PodFlags, UnknownFlag};
pub use read::{decode_changes, decode_snapshot, is_whole, visit_snapshot, Visit};
pub use write::{encode_changes, encode_changes_as, encode_snapshot, encode_snapshot_as, reset_of};
