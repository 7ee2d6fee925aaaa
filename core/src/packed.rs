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
//! `p` and the pod's flags (`r` ready, `t` terminating, `h` host network) opens
//! a pod; `s<n>` is a service of the pod opened last; `b<n>` a bare service;
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
    /// The pod is ready.
    pub ready: bool,
    /// The pod is terminating.
    pub terminating: bool,
    /// The pod runs in the node's network namespace.
    pub host_network: bool,
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
                    ready: pod.ready,
                    terminating: pod.terminating,
                    host_network: pod.host_network,
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

// === writing ===

/// `snapshot` in packed form (kind `snapshot`).
pub fn encode_snapshot(snapshot: &Snapshot) -> Vec<u8> {
    let Snapshot {
        v: _,
        epoch,
        generation,
        freshness,
        services,
        records,
    } = snapshot;
    let mut w = Writer::new("snapshot", *epoch, *generation, None, freshness);
    w.write_whole(services, records);
    w.finish()
}

/// `changes` in packed form (kind `reset` or `delta`).
pub fn encode_changes(changes: &Changes) -> Vec<u8> {
    match changes {
        Changes::Reset(snapshot) => reset_of(&encode_snapshot(snapshot)),
        Changes::Delta(delta) => {
            let Delta {
                v: _,
                epoch,
                since,
                generation,
                freshness,
                services_added,
                services_removed,
                upserts,
                removed,
            } = delta;
            let mut w = Writer::new("delta", *epoch, *generation, Some(*since), freshness);
            w.list("services_added", services_added.len());
            for service in services_added {
                w.line(service);
            }
            w.list("services_removed", services_removed.len());
            for service in services_removed {
                w.line(service);
            }
            w.write_records("upserts", &[], upserts);
            w.list("removed", removed.len());
            for ip in removed {
                w.line(canonical(*ip));
            }
            w.finish()
        }
    }
}

/// A packed snapshot document as the reset that carries the same snapshot:
/// only the kind on the first line differs. Anything else is left alone.
pub fn reset_of(snapshot: &[u8]) -> Vec<u8> {
    let first = format!("{MAGIC} {WIRE_VERSION} snapshot\n");
    match snapshot.strip_prefix(first.as_bytes()) {
        Some(rest) => {
            let head = format!("{MAGIC} {WIRE_VERSION} reset\n");
            let mut out = Vec::with_capacity(head.len() + rest.len());
            out.extend_from_slice(head.as_bytes());
            out.extend_from_slice(rest);
            out
        }
        None => snapshot.to_vec(),
    }
}

struct Writer {
    out: String,
}

impl Writer {
    fn new(
        kind: &str,
        epoch: u64,
        generation: u64,
        since: Option<u64>,
        freshness: &Freshness,
    ) -> Self {
        let mut out = String::new();
        let _ = writeln!(out, "{MAGIC} {WIRE_VERSION} {kind}");
        let _ = writeln!(out, "epoch {epoch}");
        let _ = writeln!(out, "generation {generation}");
        if let Some(since) = since {
            let _ = writeln!(out, "since {since}");
        }
        let _ = writeln!(out, "fresh {}", u8::from(freshness.fresh));
        if let Some(age_ms) = freshness.age_ms {
            let _ = writeln!(out, "age_ms {age_ms}");
        }
        Self { out }
    }

    fn list(&mut self, name: &str, count: usize) {
        let _ = writeln!(self.out, "[{name}] {count}");
    }

    fn line(&mut self, item: impl std::fmt::Display) {
        let _ = writeln!(self.out, "{item}");
    }

    fn write_whole(&mut self, services: &[ServiceKey], records: &[IpRecord]) {
        self.list("services", services.len());
        for service in services {
            self.line(service);
        }
        self.write_records("records", services, records);
    }

    /// The `names` table (every service the records name beyond `known`,
    /// which the document listed first), then the records.
    fn write_records(&mut self, name: &str, known: &[ServiceKey], records: &[IpRecord]) {
        let mut position: HashMap<&ServiceKey, usize> =
            known.iter().enumerate().map(|(i, s)| (s, i)).collect();
        let mut names = Vec::new();
        for service in records.iter().flat_map(named_services) {
            let next = position.len();
            position.entry(service).or_insert_with(|| {
                names.push(service);
                next
            });
        }
        self.list("names", names.len());
        for service in names {
            self.line(service);
        }
        self.list(name, records.len());
        for record in records {
            self.record(record, &position);
        }
    }

    fn record(&mut self, record: &IpRecord, position: &HashMap<&ServiceKey, usize>) {
        let out = &mut self.out;
        let at = |service: &ServiceKey| position.get(service).copied().unwrap_or_default();
        let _ = write!(out, "{}", canonical(record.ip));
        if !record.pods.is_empty() {
            let _ = write!(out, " f{:08x}", fingerprint(&record.pods));
        }
        for pod in &record.pods {
            out.push_str(" p");
            for (set, flag) in [
                (pod.ready, 'r'),
                (pod.terminating, 't'),
                (pod.host_network, 'h'),
            ] {
                if set {
                    out.push(flag);
                }
            }
            for membership in &pod.services {
                let _ = write!(out, " s{}", at(&membership.service));
            }
        }
        for service in &record.bare_services {
            let _ = write!(out, " b{}", at(service));
        }
        if let Some(tombstone) = &record.tombstone {
            out.push_str(" t");
            for (i, service) in tombstone.services.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                let _ = write!(out, "{}", at(service));
            }
        }
        out.push('\n');
    }

    fn finish(mut self) -> Vec<u8> {
        self.out.push_str("end\n");
        self.out.into_bytes()
    }
}

/// Every service `record` names, repeats included.
fn named_services(record: &IpRecord) -> impl Iterator<Item = &ServiceKey> {
    record
        .pods
        .iter()
        .flat_map(|pod| pod.services.iter().map(|m| &m.service))
        .chain(&record.bare_services)
        .chain(record.tombstone.iter().flat_map(|t| &t.services))
}

// === reading ===

/// Reads a packed snapshot (or reset) from `reader` a line at a time: each
/// record is built as `keep` makes it from its [`Record`], whose services are
/// what `service` made of each service of the document (once per document,
/// not per record). The records' `Vec` is sized by the count the document
/// states.
pub fn decode_snapshot<S: Clone, R>(
    reader: impl BufRead,
    service: impl FnMut(&ServiceKey) -> S,
    keep: impl FnMut(Record<S>) -> R,
) -> Result<Snapshot<R>, PackedError> {
    const WHAT: &str = "snapshot";
    let mut read = Reader::new(WHAT, reader);
    let document = read.document(service, keep)?;
    match document.kind {
        Kind::Snapshot | Kind::Reset => document.into_snapshot(&read),
        Kind::Delta => Err(read.malformed(1, "a delta where a snapshot was expected")),
    }
}

/// Reads a packed changes answer (a reset or a delta) from `reader`, as
/// [`decode_snapshot`] reads a snapshot.
pub fn decode_changes<S: Clone, R>(
    reader: impl BufRead,
    service: impl FnMut(&ServiceKey) -> S,
    keep: impl FnMut(Record<S>) -> R,
) -> Result<Changes<R>, PackedError> {
    const WHAT: &str = "changes";
    let mut read = Reader::new(WHAT, reader);
    let document = read.document(service, keep)?;
    match document.kind {
        Kind::Reset => Ok(Changes::Reset(document.into_snapshot(&read)?)),
        Kind::Delta => Ok(Changes::Delta(document.into_delta(&read)?)),
        Kind::Snapshot => Err(read.malformed(1, "a snapshot where changes were expected")),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Snapshot,
    Reset,
    Delta,
}

/// Everything a document carried, before it is checked against its kind.
struct Document<R> {
    kind: Kind,
    epoch: Option<u64>,
    generation: Option<u64>,
    since: Option<u64>,
    fresh: Option<bool>,
    age_ms: Option<u64>,
    services: Option<Vec<ServiceKey>>,
    services_added: Option<Vec<ServiceKey>>,
    services_removed: Option<Vec<ServiceKey>>,
    records: Option<Vec<R>>,
    upserts: Option<Vec<R>>,
    removed: Option<Vec<IpAddr>>,
}

impl<R> Document<R> {
    fn new(kind: Kind) -> Self {
        Self {
            kind,
            epoch: None,
            generation: None,
            since: None,
            fresh: None,
            age_ms: None,
            services: None,
            services_added: None,
            services_removed: None,
            records: None,
            upserts: None,
            removed: None,
        }
    }

    fn head<B>(&self, read: &Reader<B>) -> Result<(u64, u64, Freshness), PackedError> {
        let missing = |field: &str| read.malformed(read.line, format!("no `{field}`"));
        Ok((
            self.epoch.ok_or_else(|| missing("epoch"))?,
            self.generation.ok_or_else(|| missing("generation"))?,
            Freshness {
                fresh: self.fresh.ok_or_else(|| missing("fresh"))?,
                age_ms: self.age_ms,
            },
        ))
    }

    fn into_snapshot<B>(self, read: &Reader<B>) -> Result<Snapshot<R>, PackedError> {
        let (epoch, generation, freshness) = self.head(read)?;
        let missing = |field: &str| read.malformed(read.line, format!("no `[{field}]`"));
        Ok(Snapshot {
            v: WIRE_VERSION,
            epoch,
            generation,
            freshness,
            services: self.services.ok_or_else(|| missing("services"))?,
            records: self.records.ok_or_else(|| missing("records"))?,
        })
    }

    fn into_delta<B>(self, read: &Reader<B>) -> Result<Delta<R>, PackedError> {
        let (epoch, generation, freshness) = self.head(read)?;
        Ok(Delta {
            v: WIRE_VERSION,
            epoch,
            since: self
                .since
                .ok_or_else(|| read.malformed(read.line, "no `since`"))?,
            generation,
            freshness,
            services_added: self.services_added.unwrap_or_default(),
            services_removed: self.services_removed.unwrap_or_default(),
            upserts: self.upserts.unwrap_or_default(),
            removed: self.removed.unwrap_or_default(),
        })
    }
}

/// Lines of one document, numbered.
struct Reader<B> {
    what: &'static str,
    reader: B,
    buf: Vec<u8>,
    /// The number of the line read last.
    line: usize,
}

impl<B> Reader<B> {
    fn malformed(&self, line: usize, reason: impl Into<String>) -> PackedError {
        malformed(self.what, line, reason)
    }
}

fn malformed(what: &'static str, line: usize, reason: impl Into<String>) -> PackedError {
    PackedError::Malformed {
        what,
        line,
        reason: reason.into(),
    }
}

impl<B: BufRead> Reader<B> {
    fn new(what: &'static str, reader: B) -> Self {
        Self {
            what,
            reader,
            buf: Vec::new(),
            line: 0,
        }
    }

    /// The next line without its `\n`; `None` at the end of the input.
    fn next(&mut self) -> Result<Option<(usize, &str)>, PackedError> {
        self.buf.clear();
        let read = (&mut self.reader)
            .take(MAX_LINE as u64 + 1)
            .read_until(b'\n', &mut self.buf)
            .map_err(|source| PackedError::Io {
                what: self.what,
                source,
            })?;
        if read == 0 {
            return Ok(None);
        }
        self.line += 1;
        let line = self.line;
        let Some(text) = self.buf.strip_suffix(b"\n") else {
            let reason = if self.buf.len() > MAX_LINE {
                format!("longer than {MAX_LINE} bytes")
            } else {
                "no newline at the end".to_owned()
            };
            return Err(self.malformed(line, reason));
        };
        match std::str::from_utf8(text) {
            Ok(text) => Ok(Some((line, text))),
            Err(_) => Err(self.malformed(line, "not UTF-8")),
        }
    }

    /// The next line; the input must have one.
    fn expect(&mut self) -> Result<(usize, &str), PackedError> {
        let (what, after) = (self.what, self.line);
        self.next()?
            .ok_or_else(|| malformed(what, after + 1, "the document ends before `end`"))
    }

    fn document<S: Clone, R>(
        &mut self,
        mut service: impl FnMut(&ServiceKey) -> S,
        mut keep: impl FnMut(Record<S>) -> R,
    ) -> Result<Document<R>, PackedError> {
        let kind = self.first_line()?;
        let mut document = Document::new(kind);
        // Every service a record may name, by position: `services`, then `names`.
        let mut table: Vec<S> = Vec::new();
        let mut records_begun = false;
        let mut names_seen = false;
        loop {
            // Owned: the lists below read on (record lines are not copied).
            let (line, text) = {
                let (line, text) = self.expect()?;
                (line, text.to_owned())
            };
            let text = text.as_str();
            if text == "end" {
                break;
            }
            if let Some(rest) = text.strip_prefix('[') {
                let (name, count) = rest
                    .split_once("] ")
                    .and_then(|(name, count)| Some((name, number(count)?)))
                    .ok_or_else(|| self.malformed(line, "a list is `[name] count`"))?;
                let count = usize::try_from(count)
                    .map_err(|_| self.malformed(line, "a count this reader cannot hold"))?;
                let table_list = matches!(name, "services" | "names");
                if table_list && records_begun {
                    return Err(self.malformed(line, format!("`[{name}]` after the records")));
                }
                // Positions count `services` first: a table in another order
                // would shift every reference.
                let misplaced = match name {
                    "names" => document.services.is_none() && kind != Kind::Delta,
                    "services" => names_seen,
                    _ => false,
                };
                if misplaced {
                    return Err(self.malformed(line, "`[names]` before `[services]`"));
                }
                let duplicate = match name {
                    "services" => {
                        let services = self.services(count)?;
                        table.extend(services.iter().map(&mut service));
                        document.services.replace(services).is_some()
                    }
                    "names" => {
                        let names = self.services(count)?;
                        table.extend(names.iter().map(&mut service));
                        std::mem::replace(&mut names_seen, true)
                    }
                    "services_added" => {
                        let services = self.services(count)?;
                        document.services_added.replace(services).is_some()
                    }
                    "services_removed" => {
                        let services = self.services(count)?;
                        document.services_removed.replace(services).is_some()
                    }
                    "records" | "upserts" => {
                        records_begun = true;
                        let mut records = Vec::with_capacity(count.min(MAX_RESERVE));
                        for _ in 0..count {
                            let (line, text) = self.expect()?;
                            let record = parse_record(text, &table)
                                .map_err(|reason| self.malformed(line, reason))?;
                            records.push(keep(record));
                        }
                        let slot = if name == "records" {
                            &mut document.records
                        } else {
                            &mut document.upserts
                        };
                        slot.replace(records).is_some()
                    }
                    "removed" => {
                        let mut ips = Vec::with_capacity(count.min(MAX_RESERVE));
                        for _ in 0..count {
                            let (line, text) = self.expect()?;
                            let ip: IpAddr = text
                                .parse()
                                .map_err(|_| self.malformed(line, "not an IP address"))?;
                            ips.push(canonical(ip));
                        }
                        document.removed.replace(ips).is_some()
                    }
                    _ => {
                        // A list of a later release: skipped by its count.
                        for _ in 0..count {
                            self.expect()?;
                        }
                        false
                    }
                };
                if duplicate {
                    return Err(self.malformed(line, format!("`[{name}]` twice")));
                }
                continue;
            }
            let (name, value) = text
                .split_once(' ')
                .ok_or_else(|| self.malformed(line, "a field is `name value`"))?;
            let duplicate = match name {
                "epoch" | "generation" | "since" | "age_ms" => {
                    let value = number(value).ok_or_else(|| {
                        self.malformed(line, format!("`{name}` is an unsigned decimal"))
                    })?;
                    let slot = match name {
                        "epoch" => &mut document.epoch,
                        "generation" => &mut document.generation,
                        "since" => &mut document.since,
                        _ => &mut document.age_ms,
                    };
                    slot.replace(value).is_some()
                }
                "fresh" => {
                    let fresh = match value {
                        "0" => false,
                        "1" => true,
                        _ => return Err(self.malformed(line, "`fresh` is 0 or 1")),
                    };
                    document.fresh.replace(fresh).is_some()
                }
                // A field of a later release.
                _ => false,
            };
            if duplicate {
                return Err(self.malformed(line, format!("`{name}` twice")));
            }
        }
        if let Some((line, _)) = self.next()? {
            return Err(self.malformed(line, "more after `end`"));
        }
        Ok(document)
    }

    fn first_line(&mut self) -> Result<Kind, PackedError> {
        let what = self.what;
        let (line, text) = {
            let (line, text) = self.expect()?;
            (line, text.to_owned())
        };
        let mut words = text.split(' ');
        if words.next() != Some(MAGIC) {
            return Err(self.malformed(line, format!("does not start with `{MAGIC}`")));
        }
        let found = words
            .next()
            .and_then(number)
            .and_then(|v| u32::try_from(v).ok())
            .ok_or_else(|| self.malformed(line, "no wire version"))?;
        if found != WIRE_VERSION {
            return Err(PackedError::Version { what, found });
        }
        let kind = match (words.next(), words.next()) {
            (Some("snapshot"), None) => Kind::Snapshot,
            (Some("reset"), None) => Kind::Reset,
            (Some("delta"), None) => Kind::Delta,
            _ => return Err(self.malformed(line, "the kind is snapshot, reset or delta")),
        };
        Ok(kind)
    }

    fn services(&mut self, count: usize) -> Result<Vec<ServiceKey>, PackedError> {
        let mut services = Vec::with_capacity(count.min(MAX_RESERVE));
        for _ in 0..count {
            let (line, text) = self.expect()?;
            let service = text
                .parse()
                .map_err(|e| self.malformed(line, format!("{e}")))?;
            services.push(service);
        }
        Ok(services)
    }
}

/// An unsigned decimal: digits only, no sign, no spaces.
fn number(text: &str) -> Option<u64> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

fn parse_record<S: Clone>(text: &str, table: &[S]) -> Result<Record<S>, String> {
    let mut tokens = text.split(' ');
    let ip: IpAddr = tokens
        .next()
        .and_then(|ip| ip.parse().ok())
        .ok_or("a record starts with its IP")?;
    let named = |n: &str| {
        number(n)
            .and_then(|n| usize::try_from(n).ok())
            .and_then(|n| table.get(n))
            .cloned()
            .ok_or_else(|| format!("`{n}` names no service of the document"))
    };
    let mut record = Record {
        ip: canonical(ip),
        fingerprint: NO_PODS,
        pods: Vec::new(),
        bare_services: Vec::new(),
        tombstone: None,
    };
    let mut fingerprint = None;
    for token in tokens {
        let Some((kind, rest)) = token.split_at_checked(1) else {
            return Err("an empty token".into());
        };
        match kind {
            "f" => {
                let value = (rest.len() == 8)
                    .then(|| u32::from_str_radix(rest, 16).ok())
                    .flatten()
                    .filter(|_| rest.bytes().all(|b| b.is_ascii_hexdigit()))
                    .ok_or("a fingerprint is `f` and 8 hex digits")?;
                if fingerprint.replace(value).is_some() {
                    return Err("two fingerprints".into());
                }
            }
            "p" => {
                let mut pod = Pod {
                    ready: false,
                    terminating: false,
                    host_network: false,
                    services: Vec::new(),
                };
                for flag in rest.chars() {
                    let slot = match flag {
                        'r' => &mut pod.ready,
                        't' => &mut pod.terminating,
                        'h' => &mut pod.host_network,
                        // A flag of a later release.
                        _ => continue,
                    };
                    if std::mem::replace(slot, true) {
                        return Err(format!("pod flag `{flag}` twice"));
                    }
                }
                record.pods.push(pod);
            }
            "s" => {
                let service = named(rest)?;
                record
                    .pods
                    .last_mut()
                    .ok_or("a service before any pod")?
                    .services
                    .push(service);
            }
            "b" => record.bare_services.push(named(rest)?),
            "t" => {
                let services = if rest.is_empty() {
                    Vec::new()
                } else {
                    rest.split(',').map(named).collect::<Result<_, _>>()?
                };
                if record.tombstone.replace(services).is_some() {
                    return Err("two tombstones".into());
                }
            }
            // A token of a later release.
            _ if kind.bytes().all(|b| b.is_ascii_lowercase()) => {}
            _ => return Err(format!("token `{token}` does not read")),
        }
    }
    if let Some(value) = fingerprint {
        record.fingerprint = value;
    }
    Ok(record)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{EndpointConditions, EndpointPort};
    use crate::{Action, Policy};

    fn key(s: &str) -> ServiceKey {
        s.parse().unwrap()
    }

    fn pod(name: &str, services: &[&str], ready: bool, terminating: bool) -> PodHolder {
        PodHolder {
            namespace: "shop".into(),
            name: name.into(),
            uid: format!("uid-{name}"),
            services: services
                .iter()
                .map(|s| Membership {
                    service: key(s),
                    via: Via::Slice,
                    ports: vec![EndpointPort {
                        name: Some("http".into()),
                        port: 8080,
                        protocol: Some("TCP".into()),
                    }],
                    conditions: Some(EndpointConditions {
                        ready,
                        serving: ready,
                        terminating,
                    }),
                })
                .collect(),
            ready,
            terminating,
            host_network: false,
        }
    }

    /// Every shape a record takes: one pod, a terminating one beside its
    /// successor, host-network pods, bare members, tombstones naming a
    /// service that is gone, a tombstone with no services.
    fn snapshot() -> Snapshot {
        let mut host = pod("node-agent", &["kube/agent"], true, false);
        host.host_network = true;
        let mut other = pod(
            "node-exporter",
            &["kube/metrics", "kube/agent"],
            false,
            false,
        );
        other.host_network = true;
        Snapshot {
            v: WIRE_VERSION,
            epoch: 5_902_170_348_271_046,
            generation: 42,
            freshness: Freshness {
                fresh: true,
                age_ms: Some(6),
            },
            services: ["kube/agent", "kube/metrics", "pay/pay", "shop/cart"]
                .map(key)
                .to_vec(),
            records: vec![
                IpRecord::held_by(
                    "10.244.1.11".parse().unwrap(),
                    vec![pod("cart-1", &["shop/cart"], true, false)],
                ),
                IpRecord::held_by(
                    "10.244.1.12".parse().unwrap(),
                    vec![
                        pod("cart-2", &["shop/cart"], false, true),
                        pod("pay-9", &["pay/pay"], true, false),
                    ],
                ),
                IpRecord::held_by("192.168.0.4".parse().unwrap(), vec![host, other]),
                IpRecord {
                    ip: "fd00::7".parse().unwrap(),
                    pods: vec![],
                    bare_services: vec![key("pay/pay"), key("shop/legacy-db")],
                    tombstone: Some(Tombstone {
                        pod: "shop/cart-0".into(),
                        uid: "u-0".into(),
                        services: vec![key("shop/gone"), key("shop/cart")],
                        since_ms: 1_764_460_000_000,
                    }),
                },
                IpRecord {
                    ip: "10.244.1.14".parse().unwrap(),
                    pods: vec![],
                    bare_services: vec![],
                    tombstone: Some(Tombstone {
                        pod: "shop/cart-4".into(),
                        uid: String::new(),
                        services: vec![],
                        since_ms: 1,
                    }),
                },
            ],
        }
    }

    /// What a packed record keeps of `record`: the verdict view, memberships
    /// `via` both, no names, uids or tombstone details.
    fn kept(record: &IpRecord) -> IpRecord {
        let mut kept = record.clone().verdict_view();
        for pod in &mut kept.pods {
            pod.namespace.clear();
            pod.name.clear();
            for membership in &mut pod.services {
                membership.via = Via::Both;
            }
        }
        if let Some(tombstone) = &mut kept.tombstone {
            tombstone.pod.clear();
            tombstone.since_ms = 0;
        }
        kept
    }

    fn read_snapshot(bytes: &[u8]) -> Result<Snapshot<Record<ServiceKey>>, PackedError> {
        decode_snapshot(bytes, ServiceKey::clone, |r| r)
    }

    #[test]
    fn a_snapshot_reads_back_as_its_verdict_view_with_fingerprints() {
        let snapshot = snapshot();
        let bytes = encode_snapshot(&snapshot);
        let text = String::from_utf8(bytes.clone()).unwrap();
        assert!(text.starts_with("staleguard-packed 1 snapshot\n"), "{text}");
        assert!(text.ends_with("\nend\n"), "{text}");
        let read = read_snapshot(&bytes).unwrap();
        assert_eq!(
            (
                read.v,
                read.epoch,
                read.generation,
                &read.freshness,
                &read.services
            ),
            (
                snapshot.v,
                snapshot.epoch,
                snapshot.generation,
                &snapshot.freshness,
                &snapshot.services
            )
        );
        assert_eq!(read.records.len(), snapshot.records.len());
        for (read, sent) in read.records.into_iter().zip(&snapshot.records) {
            assert_eq!(read.fingerprint, fingerprint(&sent.pods), "{}", sent.ip);
            assert_eq!(read.into_ip_record(), kept(sent));
        }
    }

    #[test]
    fn every_verdict_of_a_packed_record_is_the_verdict_of_the_json_one() {
        let snapshot = snapshot();
        let read = read_snapshot(&encode_snapshot(&snapshot)).unwrap();
        let strict = Policy {
            terminating: Action::Reject,
            unknown_service: Action::Reject,
            failure_policy: crate::verdict::FailurePolicy::Closed,
        };
        let mut asked = snapshot.services.clone();
        asked.extend([key("shop/legacy-db"), key("shop/gone"), key("x/unknown")]);
        for (packed, json) in read.records.into_iter().zip(&snapshot.records) {
            let packed = packed.into_ip_record();
            for policy in [Policy::default(), strict] {
                for service in &asked {
                    let known = snapshot.services.contains(service);
                    assert_eq!(
                        crate::decide(&policy, true, service, known, Some(&packed)),
                        crate::decide(&policy, true, service, known, Some(json)),
                        "{} for {service}",
                        json.ip
                    );
                }
            }
        }
    }

    #[test]
    fn a_packed_snapshot_is_a_fraction_of_the_verdict_views_json() {
        let mut snapshot = snapshot();
        snapshot.records = (0..1_000u32)
            .map(|i| {
                let ip = IpAddr::from([10, 244, (i / 250) as u8, (i % 250) as u8]);
                let service = format!("shop-{}/svc-{}", i % 10, i % 100);
                let name = format!("svc-{}-7d9f8c6b5-{i:05}", i % 100);
                let mut pod = pod(&name, &[], true, false);
                pod.services = vec![Membership {
                    service: key(&service),
                    via: Via::Both,
                    ports: vec![],
                    conditions: None,
                }];
                IpRecord::held_by(ip, vec![pod]).verdict_view()
            })
            .collect();
        let json = serde_json::to_vec(&snapshot).unwrap().len();
        let packed = encode_snapshot(&snapshot).len();
        assert!(packed * 4 < json, "packed {packed} B, JSON {json} B");
    }

    #[test]
    fn resets_and_deltas_read_back() {
        let snapshot = snapshot();
        let reset = encode_changes(&Changes::Reset(snapshot.clone()));
        assert_eq!(reset, reset_of(&encode_snapshot(&snapshot)));
        assert!(reset.starts_with(b"staleguard-packed 1 reset\n"));
        let Changes::Reset(read) = decode_changes(&reset[..], ServiceKey::clone, |r| r).unwrap()
        else {
            panic!("a reset reads as a reset");
        };
        assert_eq!(read.records.len(), snapshot.records.len());
        // A reset is also a snapshot; a snapshot is no changes answer.
        assert!(read_snapshot(&reset).is_ok());
        let err = decode_changes(&encode_snapshot(&snapshot)[..], ServiceKey::clone, |r| r);
        assert!(err
            .unwrap_err()
            .to_string()
            .contains("snapshot where changes"));

        let delta = Delta {
            v: WIRE_VERSION,
            epoch: 7,
            since: 3,
            generation: 5,
            freshness: Freshness::default(),
            services_added: vec![key("a/b")],
            services_removed: vec![key("shop/pay")],
            upserts: snapshot.records[1..3].to_vec(),
            removed: vec![
                "::ffff:10.0.0.1".parse().unwrap(),
                "fd00::1".parse().unwrap(),
            ],
        };
        let bytes = encode_changes(&Changes::Delta(delta.clone()));
        let Changes::Delta(read) = decode_changes(&bytes[..], ServiceKey::clone, |r| r).unwrap()
        else {
            panic!("a delta reads as a delta");
        };
        assert_eq!(
            (read.epoch, read.since, read.generation, &read.freshness),
            (7, 3, 5, &delta.freshness)
        );
        assert_eq!(read.services_added, delta.services_added);
        assert_eq!(read.services_removed, delta.services_removed);
        let removed: Vec<IpAddr> = vec!["10.0.0.1".parse().unwrap(), "fd00::1".parse().unwrap()];
        assert_eq!(read.removed, removed, "canonical");
        let upserts: Vec<IpRecord> = read
            .upserts
            .into_iter()
            .map(Record::into_ip_record)
            .collect();
        let sent: Vec<IpRecord> = delta.upserts.iter().map(kept).collect();
        assert_eq!(upserts, sent);
        // An empty delta: the long poll's usual answer, a few lines.
        let empty = Delta {
            upserts: vec![],
            removed: vec![],
            services_added: vec![],
            services_removed: vec![],
            ..delta
        };
        let bytes = encode_changes(&Changes::Delta(empty));
        assert!(bytes.len() < 150, "{}", String::from_utf8_lossy(&bytes));
        let Changes::Delta(read) = decode_changes(&bytes[..], ServiceKey::clone, |r| r).unwrap()
        else {
            panic!("a delta reads as a delta");
        };
        assert!(read.is_empty());
    }

    #[test]
    fn records_are_kept_as_the_caller_makes_them_with_services_mapped_once_per_document() {
        let snapshot = snapshot();
        let bytes = encode_snapshot(&snapshot);
        let mut mapped = 0;
        let read = decode_snapshot(
            &bytes[..],
            |s| {
                mapped += 1;
                s.to_string().len()
            },
            |r| (r.ip, r.pods.iter().map(|p| p.services.len()).sum::<usize>()),
        )
        .unwrap();
        // Four known services, two more named only by records.
        assert_eq!(mapped, 6);
        assert_eq!(read.records[1], ("10.244.1.12".parse().unwrap(), 2));
        assert!(read.records.capacity() == read.records.len());
    }

    #[test]
    fn fields_lists_and_tokens_of_a_later_release_are_skipped() {
        let text = "staleguard-packed 1 snapshot\nepoch 1\nfuture value\n[future] 2\nx\ny\n\
            generation 2\nfresh 0\n[services] 1\nshop/cart\n[names] 0\n[records] 1\n\
            10.0.0.1 pxr s0 z9 q\nend\n";
        let read = read_snapshot(text.as_bytes()).unwrap();
        let record = &read.records[0];
        assert!(record.pods[0].ready);
        assert_eq!(record.pods[0].services, vec![key("shop/cart")]);
        assert_eq!(record.fingerprint, NO_PODS);
    }

    #[test]
    fn a_cut_or_damaged_document_is_refused_with_its_line() {
        let bytes = encode_snapshot(&snapshot());
        let text = String::from_utf8(bytes.clone()).unwrap();
        // Cut anywhere: never read as a shorter document.
        for cut in 0..bytes.len() {
            assert!(read_snapshot(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let cases = [
            (
                "staleguard-packed 1 snapshot",
                "staleguard-packed 1 delta",
                "a delta where",
            ),
            (
                "staleguard-packed 1 snapshot",
                "staleguard-packet 1 snapshot",
                "line 1",
            ),
            ("generation 42", "generation -1", "line 3"),
            ("fresh 1", "fresh yes", "`fresh` is 0 or 1"),
            ("[services] 4", "[services] 5", "line"),
            (" s3", " s99", "names no service"),
            (" s3", " s3 s", "names no service"),
            ("10.244.1.11", "10.244.1.256", "starts with its IP"),
            ("\nend\n", "\nend\nend\n", "more after `end`"),
            (" pr ", " prr ", "pod flag `r` twice"),
            (" pr ", "  pr ", "empty token"),
            (" pr ", " pr P ", "does not read"),
            ("epoch 5902170348271046\n", "", "no `epoch`"),
            ("[names] 2\n", "[services] 0\n[names] 2\n", "twice"),
        ];
        for (from, to, says) in cases {
            assert!(text.contains(from), "{from}");
            let bad = text.replacen(from, to, 1);
            let err = read_snapshot(bad.as_bytes()).unwrap_err().to_string();
            assert!(err.contains(says), "{from} -> {to}: {err}");
        }
        let v2 = text.replacen("packed 1", "packed 2", 1);
        assert!(matches!(
            read_snapshot(v2.as_bytes()),
            Err(PackedError::Version { found: 2, .. })
        ));
        let long = format!("{}\n", "x".repeat(MAX_LINE + 1));
        let err = read_snapshot(long.as_bytes()).unwrap_err().to_string();
        assert!(err.contains("longer than"), "{err}");
    }

    #[test]
    fn a_stated_count_larger_than_the_document_is_refused() {
        let text = "staleguard-packed 1 snapshot\nepoch 1\ngeneration 1\nfresh 1\n\
            [services] 0\n[names] 0\n[records] 18446744073709551615\nend\n";
        let err = read_snapshot(text.as_bytes()).unwrap_err().to_string();
        assert!(err.contains("starts with its IP"), "{err}");
    }

    #[test]
    fn a_packed_document_is_told_from_json_by_its_first_bytes() {
        let bytes = encode_snapshot(&snapshot());
        assert!(starts_packed(&bytes));
        assert!(starts_packed(&encode_changes(&Changes::Reset(snapshot()))));
        let json = serde_json::to_vec(&snapshot()).unwrap();
        assert!(!starts_packed(&json));
        for short in [
            &b""[..],
            b"staleguard-packed",
            b"staleguard-packedx 1",
            b" staleguard-packed 1",
        ] {
            assert!(!starts_packed(short), "{}", String::from_utf8_lossy(short));
        }
    }

    #[test]
    fn the_fingerprint_follows_the_holders() {
        let a = pod("cart-1", &["shop/cart"], true, false);
        let b = pod("cart-2", &["shop/cart"], true, false);
        assert_eq!(fingerprint([]), NO_PODS);
        assert_ne!(fingerprint([&a]), fingerprint([&b]));
        assert_ne!(fingerprint([&a]), NO_PODS);
        // Names only: readiness and services are in the record itself.
        let mut a_draining = a.clone();
        a_draining.terminating = true;
        a_draining.uid = "another".into();
        assert_eq!(fingerprint([&a]), fingerprint([&a_draining]));
        // "ns/a" + "b" is not "ns/ab".
        let mut ab = a.clone();
        ab.name = "cart-1cart-2".into();
        assert_ne!(fingerprint([&a, &b]), fingerprint([&ab]));
        // Fixed across releases: one value pinned (FNV-1a of "shop/cart-1\n", folded).
        assert_eq!(
            fingerprint([&a]),
            0x41c5_6bca_u32,
            "{:08x}",
            fingerprint([&a])
        );
    }
}
