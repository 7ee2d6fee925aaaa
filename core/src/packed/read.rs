//! Reading the packed form a line at a time, a record at a time, without a tree of the whole answer.

use std::ops::ControlFlow;

use super::*;

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
    read_snapshot(reader, service, &mut Keeping(keep))
}

/// What a reader does with a document's records as they are read, one at a
/// time, instead of keeping them (see [`visit_snapshot`]).
pub trait Visit<S> {
    /// The records' list begins: `count` records follow. `services` are the
    /// document's `[services]` (every service a snapshot knows).
    fn begin(&mut self, services: &[ServiceKey], count: usize) -> ControlFlow<()> {
        let _ = (services, count);
        ControlFlow::Continue(())
    }

    /// Whether to read the record of `ip`: a record not wanted is skipped
    /// after its IP, unread and unchecked (a reader that skips records has
    /// read the same bytes whole before).
    fn wants(&mut self, ip: IpAddr) -> bool {
        let _ = ip;
        true
    }

    /// One record, read. `Break` stops reading: the document is refused
    /// with [`PackedError::Stopped`].
    fn record(&mut self, record: Record<S>) -> ControlFlow<()>;
}

/// Reads a packed snapshot (or reset) from `reader` as [`decode_snapshot`]
/// does, handing each record to `visit` as it is read: the answer is checked
/// whole (its `end`, its counts) and its records are never all held at once.
/// The snapshot returned keeps a `()` for each record read, which takes no
/// memory.
pub fn visit_snapshot<S: Clone>(
    reader: impl BufRead,
    service: impl FnMut(&ServiceKey) -> S,
    visit: &mut dyn Visit<S>,
) -> Result<Snapshot<()>, PackedError> {
    read_snapshot(reader, service, &mut Visiting(visit))
}

/// The kind on the first line of a packed document, `start` being at least
/// that line: `Some(true)` for a snapshot or reset, `Some(false)` for a
/// delta, `None` when it is neither (the reader then says why).
pub fn is_whole(start: &[u8]) -> Option<bool> {
    let line = start.split(|b| *b == b'\n').next()?;
    let kind = std::str::from_utf8(line).ok()?.rsplit(' ').next()?;
    match kind {
        "snapshot" | "reset" => Some(true),
        "delta" => Some(false),
        _ => None,
    }
}

fn read_snapshot<S: Clone, R>(
    reader: impl BufRead,
    service: impl FnMut(&ServiceKey) -> S,
    sink: &mut dyn Sink<S, R>,
) -> Result<Snapshot<R>, PackedError> {
    const WHAT: &str = "snapshot";
    let mut read = Reader::new(WHAT, reader);
    let document = read.document(service, sink)?;
    match document.kind {
        Kind::Snapshot | Kind::Reset => document.into_snapshot(&read),
        Kind::Delta => Err(read.malformed(1, "a delta where a snapshot was expected")),
    }
}

/// Where [`Reader::document`] puts the records it reads.
trait Sink<S, R> {
    fn begin(&mut self, services: &[ServiceKey], count: usize) -> ControlFlow<()>;
    fn wants(&mut self, ip: IpAddr) -> bool;
    /// `None`: stop reading.
    fn keep(&mut self, record: Record<S>) -> Option<R>;
}

/// Every record, as `keep` makes it.
struct Keeping<F>(F);

impl<S, R, F: FnMut(Record<S>) -> R> Sink<S, R> for Keeping<F> {
    fn begin(&mut self, _: &[ServiceKey], _: usize) -> ControlFlow<()> {
        ControlFlow::Continue(())
    }

    fn wants(&mut self, _: IpAddr) -> bool {
        true
    }

    fn keep(&mut self, record: Record<S>) -> Option<R> {
        Some((self.0)(record))
    }
}

/// Every record handed to a [`Visit`], none kept.
struct Visiting<'a, S>(&'a mut dyn Visit<S>);

impl<S> Sink<S, ()> for Visiting<'_, S> {
    fn begin(&mut self, services: &[ServiceKey], count: usize) -> ControlFlow<()> {
        self.0.begin(services, count)
    }

    fn wants(&mut self, ip: IpAddr) -> bool {
        self.0.wants(ip)
    }

    fn keep(&mut self, record: Record<S>) -> Option<()> {
        match self.0.record(record) {
            ControlFlow::Continue(()) => Some(()),
            ControlFlow::Break(()) => None,
        }
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
    let document = read.document(service, &mut Keeping(keep))?;
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

/// Why a binary record could not be framed.
enum Framing {
    /// The input ends inside it.
    Cut,
    /// It does not read.
    Bad(String),
    /// The reader failed.
    Io(std::io::Error),
}

/// Lines of one document, numbered, and the binary records between them.
struct Reader<B> {
    what: &'static str,
    /// How the records are written (the first line says).
    encoding: Encoding,
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

/// The input ends after line `after`, before `end`.
fn ended(what: &'static str, after: usize) -> PackedError {
    malformed(what, after + 1, "the document ends before `end`")
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
            encoding: Encoding::Text,
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
        self.next()?.ok_or_else(|| ended(what, after))
    }

    fn document<S: Clone, R>(
        &mut self,
        mut service: impl FnMut(&ServiceKey) -> S,
        sink: &mut dyn Sink<S, R>,
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
                        let known = document.services.as_deref().unwrap_or_default();
                        if sink.begin(known, count).is_break() {
                            return Err(PackedError::Stopped { what: self.what });
                        }
                        let mut records = Vec::with_capacity(count.min(MAX_RESERVE));
                        for k in 0..count {
                            let Some(record) = self.record(k, line, &table, sink)? else {
                                continue;
                            };
                            match sink.keep(record) {
                                Some(kept) => records.push(kept),
                                None => return Err(PackedError::Stopped { what: self.what }),
                            }
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

    /// The `k`th record of the list opened on line `list`, unless `sink`
    /// does not want it (then skipped unread).
    fn record<S: Clone, R>(
        &mut self,
        k: usize,
        list: usize,
        table: &[S],
        sink: &mut dyn Sink<S, R>,
    ) -> Result<Option<Record<S>>, PackedError> {
        let (what, after) = (self.what, self.line);
        match self.encoding {
            Encoding::Text => {
                let (line, text) = self.expect()?;
                let (ip, rest) = record_ip(text).map_err(|reason| malformed(what, line, reason))?;
                if !sink.wants(ip) {
                    return Ok(None);
                }
                parse_record(ip, rest, table)
                    .map(Some)
                    .map_err(|reason| malformed(what, line, reason))
            }
            Encoding::Binary => {
                let at = |reason: String| malformed(what, list, format!("record {k}: {reason}"));
                let (ip, body) = self.binary_record().map_err(|e| match e {
                    Framing::Cut => ended(what, after),
                    Framing::Bad(reason) => at(reason),
                    Framing::Io(source) => PackedError::Io { what, source },
                })?;
                if !sink.wants(ip) {
                    return Ok(None);
                }
                binary::parse_record(ip, body, table).map(Some).map_err(at)
            }
        }
    }

    /// The next binary record: its IP and its body.
    fn binary_record(&mut self) -> Result<(IpAddr, &[u8]), Framing> {
        let header = self.varint()?;
        let (address, body) = binary::frame(header);
        if body > MAX_LINE as u64 {
            return Err(Framing::Bad(format!("longer than {MAX_LINE} bytes")));
        }
        let len = address as u64 + body;
        self.buf.clear();
        // Bounded: a length the input does not hold reads what there is.
        (&mut self.reader)
            .take(len)
            .read_to_end(&mut self.buf)
            .map_err(Framing::Io)?;
        if (self.buf.len() as u64) < len {
            return Err(Framing::Cut);
        }
        let (address, body) = self.buf.split_at(address);
        let ip = binary::address(address).ok_or(Framing::Cut)?;
        Ok((ip, body))
    }

    /// A LEB128 number of the input (its one spelling).
    fn varint(&mut self) -> Result<u64, Framing> {
        let mut bytes = [0u8; 10];
        for i in 0..bytes.len() {
            let byte = &mut bytes[i..=i];
            self.reader.read_exact(byte).map_err(|e| match e.kind() {
                std::io::ErrorKind::UnexpectedEof => Framing::Cut,
                _ => Framing::Io(e),
            })?;
            if byte[0] & 0x80 == 0 {
                return crate::bytes::Reader::new(&bytes[..=i])
                    .varint()
                    .ok_or_else(|| Framing::Bad("a record's length does not read".into()));
            }
        }
        Err(Framing::Bad("a record's length does not read".into()))
    }

    fn first_line(&mut self) -> Result<Kind, PackedError> {
        let what = self.what;
        let (line, text) = {
            let (line, text) = self.expect()?;
            (line, text.to_owned())
        };
        let mut words = text.split(' ');
        self.encoding = match words.next() {
            Some(MAGIC) => Encoding::Text,
            Some(BINARY_MAGIC) => Encoding::Binary,
            _ => return Err(self.malformed(line, format!("does not start with `{MAGIC}`"))),
        };
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

/// A record line's IP, and its tokens after it (`None`: the IP alone).
fn record_ip(text: &str) -> Result<(IpAddr, Option<&str>), String> {
    let (ip, rest) = match text.split_once(' ') {
        Some((ip, rest)) => (ip, Some(rest)),
        None => (text, None),
    };
    let ip: IpAddr = ip.parse().map_err(|_| "a record starts with its IP")?;
    Ok((ip, rest))
}

fn parse_record<S: Clone>(
    ip: IpAddr,
    rest: Option<&str>,
    table: &[S],
) -> Result<Record<S>, String> {
    let tokens = rest.into_iter().flat_map(|rest| rest.split(' '));
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
                // A flag of a later release is skipped: an older gateway
                // reads a newer validator's answers.
                let flags = PodFlags::read(rest, UnknownFlag::Skip).map_err(|e| e.to_string())?;
                record.pods.push(Pod {
                    flags,
                    services: Vec::new(),
                });
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
