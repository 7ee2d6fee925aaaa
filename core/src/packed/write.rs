//! Writing the packed form: a document per snapshot or change set, a line per record.

use super::*;

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
