//! Writing the packed form: a document per snapshot or change set, a record
//! per line or in binary.

use std::io::Write as _;

use super::*;

/// `snapshot` in the text packed form (kind `snapshot`).
pub fn encode_snapshot(snapshot: &Snapshot) -> Vec<u8> {
    encode_snapshot_as(Encoding::Text, snapshot)
}

/// `changes` in the text packed form (kind `reset` or `delta`).
pub fn encode_changes(changes: &Changes) -> Vec<u8> {
    encode_changes_as(Encoding::Text, changes)
}

/// `snapshot` in packed form, its records in `encoding` (kind `snapshot`).
pub fn encode_snapshot_as(encoding: Encoding, snapshot: &Snapshot) -> Vec<u8> {
    let Snapshot {
        v: _,
        epoch,
        generation,
        freshness,
        services,
        records,
    } = snapshot;
    let mut w = Writer::new(encoding, "snapshot", *epoch, *generation, None, freshness);
    w.write_whole(services, records);
    w.finish()
}

/// `changes` in packed form, its records in `encoding` (kind `reset` or
/// `delta`).
pub fn encode_changes_as(encoding: Encoding, changes: &Changes) -> Vec<u8> {
    match changes {
        Changes::Reset(snapshot) => reset_of(&encode_snapshot_as(encoding, snapshot)),
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
            let mut w = Writer::new(
                encoding,
                "delta",
                *epoch,
                *generation,
                Some(*since),
                freshness,
            );
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

/// A packed snapshot document (of either encoding) as the reset that
/// carries the same snapshot: only the kind on the first line differs.
/// Anything else is left alone.
pub fn reset_of(snapshot: &[u8]) -> Vec<u8> {
    let Some(encoding) = encoding_of(snapshot) else {
        return snapshot.to_vec();
    };
    let magic = encoding.magic();
    let first = format!("{magic} {WIRE_VERSION} snapshot\n");
    match snapshot.strip_prefix(first.as_bytes()) {
        Some(rest) => {
            let head = format!("{magic} {WIRE_VERSION} reset\n");
            let mut out = Vec::with_capacity(head.len() + rest.len());
            out.extend_from_slice(head.as_bytes());
            out.extend_from_slice(rest);
            out
        }
        None => snapshot.to_vec(),
    }
}

struct Writer {
    out: Vec<u8>,
    encoding: Encoding,
    /// A record's text line, reused from record to record.
    line: String,
    /// A binary record's body, reused from record to record.
    body: Vec<u8>,
}

impl Writer {
    fn new(
        encoding: Encoding,
        kind: &str,
        epoch: u64,
        generation: u64,
        since: Option<u64>,
        freshness: &Freshness,
    ) -> Self {
        let mut out = Vec::new();
        let magic = encoding.magic();
        let _ = writeln!(out, "{magic} {WIRE_VERSION} {kind}");
        let _ = writeln!(out, "epoch {epoch}");
        let _ = writeln!(out, "generation {generation}");
        if let Some(since) = since {
            let _ = writeln!(out, "since {since}");
        }
        let _ = writeln!(out, "fresh {}", u8::from(freshness.fresh));
        if let Some(age_ms) = freshness.age_ms {
            let _ = writeln!(out, "age_ms {age_ms}");
        }
        Self {
            out,
            encoding,
            line: String::new(),
            body: Vec::new(),
        }
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
        let at = |service: &ServiceKey| position.get(service).copied().unwrap_or_default();
        match self.encoding {
            Encoding::Text => {
                self.line.clear();
                text_record(&mut self.line, record, at);
                self.out.extend_from_slice(self.line.as_bytes());
            }
            Encoding::Binary => binary::push_record(&mut self.out, &mut self.body, record, at),
        }
    }

    fn finish(mut self) -> Vec<u8> {
        self.out.extend_from_slice(b"end\n");
        self.out
    }
}

/// Appends the text line of `record`; `at` is a service's position.
fn text_record(out: &mut String, record: &IpRecord, at: impl Fn(&ServiceKey) -> usize) {
    let _ = write!(out, "{}", canonical(record.ip));
    if !record.pods.is_empty() {
        let _ = write!(out, " f{:08x}", fingerprint(&record.pods));
    }
    for pod in &record.pods {
        out.push_str(" p");
        PodFlags {
            ready: pod.ready,
            terminating: pod.terminating,
            host_network: pod.host_network,
        }
        .write(out);
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

/// Every service `record` names, repeats included.
fn named_services(record: &IpRecord) -> impl Iterator<Item = &ServiceKey> {
    record
        .pods
        .iter()
        .flat_map(|pod| pod.services.iter().map(|m| &m.service))
        .chain(&record.bare_services)
        .chain(record.tombstone.iter().flat_map(|t| &t.services))
}
