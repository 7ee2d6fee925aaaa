//! The packed form of snapshots and changes: what a gateway keeps of each
//! record, a line per record, read one record at a time.
//!
//! JSON ([`crate::wire`]) stays the validator's default answer, for people,
//! the audit and clients of their own. A gateway asks for this form with
//! `Accept: application/vnd.staleguard.packed` ([`MEDIA_TYPE`]) on
//! `/v1/snapshot` and `/v1/changes`; a validator that does not know it answers
//! JSON, which the answer's `Content-Type` says, so a reader of both works with
//! validators of either release. A record carries what the verdict view
//! carries that a gateway keeps (its pods' flags and services, bare members,
//! the tombstone's services) and, instead of pod names, a [`fingerprint`] of
//! them: at 150,000 IPs, about a fifth of the verdict view's JSON.
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

use std::collections::HashMap;
use std::fmt::Write as _;
use std::io::{BufRead, Read};
use std::net::IpAddr;

use crate::ip::canonical;
use crate::wire::{Changes, Delta, Freshness, Membership, Tombstone, Via, WIRE_VERSION};
use crate::{IpRecord, PodHolder, ServiceKey, Snapshot};

/// The media type a client puts in `Accept` to be answered in this form, and
/// the `Content-Type` of such an answer.
pub const MEDIA_TYPE: &str = "application/vnd.staleguard.packed";

/// The first word of every packed document.
const MAGIC: &str = "staleguard-packed";

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

/// True when `start`, the first bytes of an answer (at least the first 18),
/// begin a packed document: a reader that asked for either form tells
/// which it got without the `Content-Type`. JSON never starts so.
pub fn starts_packed(start: &[u8]) -> bool {
    start
        .strip_prefix(MAGIC.as_bytes())
        .is_some_and(|rest| rest.first() == Some(&b' '))
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

mod flags;
mod read;
#[cfg(test)]
mod tests;
mod write;

pub use flags::{FlagError, PodFlags, UnknownFlag};
pub use read::{decode_changes, decode_snapshot, is_whole, visit_snapshot, Visit};
pub use write::{encode_changes, encode_snapshot, reset_of};
