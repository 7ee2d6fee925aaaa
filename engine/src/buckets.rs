//! IP entries in hash buckets, so shared data stays bounded by the live index.
//!
//! Envoy's shared data cannot delete a key (proxy-wasm has no call for it; the
//! host's `SharedData::remove` is not exported to Wasm, checked against Envoy
//! 1.40's proxy-wasm-cpp-host): a key per IP would keep one entry for every IP
//! ever seen, and IPv6 pods rarely see an IP twice. So IPs share a fixed set of
//! keys: an IP's entry lives in bucket `fnv1a(canonical IP) mod B` under
//! `staleguard/ipb/<B>/<index>`, where `B` (a power of two, at least
//! [`MIN_BUCKETS`], about [`IPS_PER_BUCKET`] IPs per bucket) is chosen at each
//! full load and recorded in `meta`. Keys are reused as IPs come and go; their
//! number is at most `2 × B` over every `B` ever used, and `B` follows the
//! peak of the live index, not the number of IPs ever seen. Several IPs share
//! a key because every key costs Envoy a hash node and two strings (about 150
//! bytes), more than an IP's line itself.
//!
//! A bucket's value is `LOAD`, then one line per IP: `\n<ip> <holders>`, where
//! `<holders>` is the compact record of [`Holders`]: only what the verdict,
//! the member lists and the guard's successor need, no names, no JSON. Empty
//! means no entries. Like every entry, a bucket written under a load older
//! than `meta`'s is absent.

use std::net::IpAddr;

use serde::Deserialize;
use staleguard_core::ip::canonical;
use staleguard_core::packed::{self, PodFlags, UnknownFlag};
use staleguard_core::wire::{Membership, Tombstone, Via};
use staleguard_core::{IpRecord, PodHolder, ServiceKey};

use crate::entry::Entry;

/// The fewest buckets a layout has: a small index costs at most this many
/// keys, and small changes in its size never change the layout.
pub const MIN_BUCKETS: u32 = 1_024;

/// The most buckets a layout has.
pub const MAX_BUCKETS: u32 = 1 << 24;

/// IPs per bucket a new layout aims at: a reader copies and scans one bucket
/// (about 35 bytes per IP), so a few IPs share the cost of a key.
pub const IPS_PER_BUCKET: u64 = 8;

/// The bucket count for an index of `entries` IPs: about
/// [`IPS_PER_BUCKET`] IPs per bucket.
pub fn bucket_count(entries: u64) -> u32 {
    let wanted = u32::try_from(entries.div_ceil(IPS_PER_BUCKET)).unwrap_or(MAX_BUCKETS);
    wanted
        .checked_next_power_of_two()
        .unwrap_or(MAX_BUCKETS)
        .clamp(MIN_BUCKETS, MAX_BUCKETS)
}

/// True when an index of `entries` IPs has outgrown `buckets` (on average
/// more than twice [`IPS_PER_BUCKET`] IPs per bucket): the next full load
/// should re-lay it.
pub fn outgrown(entries: u64, buckets: u32) -> bool {
    buckets < MAX_BUCKETS && entries > u64::from(buckets) * IPS_PER_BUCKET * 2
}

/// The bucket of `ip` in a layout of `buckets` (a power of two).
pub fn bucket_of(ip: &IpAddr, buckets: u32) -> u32 {
    // FNV-1a over the canonical text: stable across VMs and releases, which a
    // std hasher is not.
    struct Fnv(u32);
    impl std::fmt::Write for Fnv {
        fn write_str(&mut self, s: &str) -> std::fmt::Result {
            for byte in s.bytes() {
                self.0 ^= u32::from(byte);
                self.0 = self.0.wrapping_mul(0x0100_0193);
            }
            Ok(())
        }
    }
    // Hashed as it is formatted: no string per call (a reset asks for
    // every IP's bucket once per slice).
    let mut hash = Fnv(0x811c_9dc5);
    let _ = std::fmt::Write::write_fmt(&mut hash, format_args!("{}", canonical(*ip)));
    hash.0 & buckets.saturating_sub(1)
}

/// The shared-data key of bucket `index` of a layout of `buckets`.
pub fn bucket_key(buckets: u32, index: u32) -> String {
    format!("staleguard/ipb/{buckets}/{index}")
}

/// The key of the bucket that holds `ip`.
pub fn key_of(ip: &IpAddr, buckets: u32) -> String {
    bucket_key(buckets, bucket_of(ip, buckets))
}

/// The entries of one bucket, as the poller edits them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Bucket {
    /// `(canonical IP, encoded [`Holders`])`, at most one line per IP.
    lines: Vec<(IpAddr, Vec<u8>)>,
}

impl Bucket {
    /// Reads a bucket value for editing: absent, stale (an older load than
    /// `meta_load`) or unreadable values are an empty bucket, which the next
    /// write replaces whole.
    pub fn read(bytes: &[u8], meta_load: u64) -> Self {
        let mut lines = Vec::new();
        let Some(rest) = valid_lines(bytes, meta_load) else {
            return Self { lines };
        };
        for line in rest.split(|b| *b == b'\n') {
            if let Some((ip, json)) = split_line(line) {
                lines.push((ip, json.to_vec()));
            }
        }
        Self { lines }
    }

    /// Number of IPs in the bucket.
    pub fn len(&self) -> usize {
        self.lines.len()
    }

    /// True when the bucket holds no IP.
    pub fn is_empty(&self) -> bool {
        self.lines.is_empty()
    }

    /// Each IP of the bucket and its line decoded (`None`: a line this
    /// build cannot read), for a poller that takes over the guard's
    /// baseline from the index (`crate::guard`'s seeding).
    pub fn holders(&self) -> impl Iterator<Item = (IpAddr, Option<Holders>)> + '_ {
        self.lines
            .iter()
            .map(|(ip, line)| (*ip, Holders::decode(line)))
    }

    /// Sets `record` (vacant: removes its IP). Returns the change in the
    /// number of IPs: +1 added, -1 removed, 0 replaced or nothing to remove.
    pub fn put(&mut self, record: &CompactRecord) -> i64 {
        let ip = record.ip;
        if record.is_vacant() {
            return self.remove(&ip);
        }
        let holders = record.line.to_vec();
        match self.lines.iter_mut().find(|(i, _)| *i == ip) {
            Some(line) => {
                line.1 = holders;
                0
            }
            None => {
                self.lines.push((ip, holders));
                1
            }
        }
    }

    /// Removes `ip`; -1 if it was there, else 0.
    pub fn remove(&mut self, ip: &IpAddr) -> i64 {
        let ip = canonical(*ip);
        let before = self.lines.len();
        self.lines.retain(|(i, _)| *i != ip);
        if self.lines.len() < before {
            -1
        } else {
            0
        }
    }

    /// The value to write under `load`: empty when the bucket is.
    pub fn encode(&self, load: u64) -> Vec<u8> {
        if self.lines.is_empty() {
            return Vec::new();
        }
        let mut out = load.to_string().into_bytes();
        for (ip, holders) in &self.lines {
            out.push(b'\n');
            out.extend_from_slice(ip.to_string().as_bytes());
            out.push(b' ');
            out.extend_from_slice(holders);
        }
        out
    }
}

/// The bytes [`push_line`] adds for `record` (not vacant).
pub fn line_len(record: &CompactRecord) -> usize {
    struct Count(usize);
    impl std::fmt::Write for Count {
        fn write_str(&mut self, s: &str) -> std::fmt::Result {
            self.0 += s.len();
            Ok(())
        }
    }
    let mut ip = Count(0);
    let _ = std::fmt::Write::write_fmt(&mut ip, format_args!("{}", record.ip));
    ip.0 + record.line.len() + 2
}

/// Appends the bucket line of `record` (not vacant) to `out` as a bucket
/// value carries it: `\n<ip> <holders>`.
pub fn push_line(out: &mut Vec<u8>, record: &CompactRecord) {
    use std::io::Write as _;
    let _ = write!(out, "\n{} ", record.ip);
    out.extend_from_slice(&record.line);
}

/// Writes into `value` the bucket value of load `load` whose lines start
/// at `starts` in `lines` (each as [`push_line`] wrote it, in the order of
/// the answer); an IP listed twice keeps its last line, as
/// [`Bucket::put`] does. Returns the number of IPs.
pub fn encode_lines(value: &mut Vec<u8>, load: u64, lines: &[u8], starts: &[usize]) -> usize {
    let line = |start: usize| {
        let rest = lines.get(start..).unwrap_or_default();
        let end = rest
            .iter()
            .skip(1)
            .position(|b| *b == b'\n')
            .map_or(rest.len(), |n| n + 1);
        &rest[..end]
    };
    let ip =
        |line: &'_ [u8]| -> usize { line.iter().position(|b| *b == b' ').unwrap_or(line.len()) };
    value.clear();
    value.extend_from_slice(load.to_string().as_bytes());
    let mut ips = 0;
    for (i, start) in starts.iter().enumerate() {
        let this = line(*start);
        let key = &this[..ip(this)];
        let again = starts[i + 1..].iter().any(|later| {
            let later = line(*later);
            &later[..ip(later)] == key
        });
        if !again {
            value.extend_from_slice(this);
            ips += 1;
        }
    }
    ips
}

/// After the load line, if the load is current; `None` for empty or stale
/// values. `Err` when the load cannot be read.
fn lines_after_load(bytes: &[u8], meta_load: u64) -> Result<Option<&[u8]>, ()> {
    if bytes.is_empty() {
        return Ok(None);
    }
    let (load, rest) = match bytes.iter().position(|b| *b == b'\n') {
        Some(i) => (&bytes[..i], &bytes[i + 1..]),
        None => (bytes, &[][..]),
    };
    let load = std::str::from_utf8(load)
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .ok_or(())?;
    Ok((load >= meta_load).then_some(rest))
}

fn valid_lines(bytes: &[u8], meta_load: u64) -> Option<&[u8]> {
    lines_after_load(bytes, meta_load).ok().flatten()
}

fn split_line(line: &[u8]) -> Option<(IpAddr, &[u8])> {
    let space = line.iter().position(|b| *b == b' ')?;
    let ip = std::str::from_utf8(&line[..space]).ok()?.parse().ok()?;
    Some((ip, &line[space + 1..]))
}

/// What a bucket value says about `ip`, for a reader: only that IP's line is
/// decoded.
pub fn find(bytes: &[u8], ip: &IpAddr, meta_load: u64) -> Entry<Holders> {
    let rest = match lines_after_load(bytes, meta_load) {
        Ok(Some(rest)) => rest,
        Ok(None) => return Entry::Absent,
        Err(()) => return Entry::Corrupt,
    };
    let wanted = canonical(*ip).to_string();
    for line in rest.split(|b| *b == b'\n') {
        let Some(space) = line.iter().position(|b| *b == b' ') else {
            return Entry::Corrupt;
        };
        if &line[..space] == wanted.as_bytes() {
            return match line.get(space + 1..).and_then(Holders::decode) {
                Some(holders) => Entry::Present(holders),
                None => Entry::Corrupt,
            };
        }
    }
    Entry::Absent
}

/// A service as a bucket line names it: 64-bit FNV-1a of `namespace/name`.
/// Stable across VMs and releases, so a reader hashes the service it asks
/// about and needs no table; two of a cluster's services sharing an id (odds
/// about 3e-14 among 1,000 services) would count as one.
pub fn service_id(service: &ServiceKey) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let parts = [service.namespace.as_bytes(), b"/", service.name.as_bytes()];
    for byte in parts.into_iter().flatten() {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash
}

/// One pod holding an IP, as a bucket line keeps it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Pod {
    /// Ready, terminating, in the node's network namespace.
    pub flags: PodFlags,
    /// Its services (by [`service_id`]), with the ports the index lists.
    pub services: Vec<(u64, Vec<u16>)>,
}

impl Pod {
    /// A pod of no service with `flags`.
    pub fn with_flags(flags: PodFlags) -> Self {
        Self {
            flags,
            services: Vec::new(),
        }
    }
}

/// An IP's entry as a bucket line keeps it: what [`staleguard_core::decide`]
/// and the member lists need, and no more (no pod names, uids or conditions).
///
/// Encoded as tokens separated by one space: `p` and the pod's flags
/// ([`PodFlags`], as the packed form writes them) open a pod; `s<id>` (16 hex
/// digits) is a service of the pod opened last, with `/PORT,PORT` when the
/// index lists ports; `b<id>` a bare service; `t` a tombstone. A pod line of
/// one service is 20 bytes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Holders {
    /// The pods holding the IP.
    pub pods: Vec<Pod>,
    /// Services listing the IP without a pod, by [`service_id`].
    pub bare: Vec<u64>,
    /// A tombstone remembers what held the IP (it never changes a verdict).
    pub tombstone: bool,
}

impl Holders {
    /// What a bucket keeps of `record`.
    pub fn from_record(record: &IpRecord) -> Self {
        Self {
            pods: record
                .pods
                .iter()
                .map(|p| Pod {
                    flags: PodFlags {
                        ready: p.ready,
                        terminating: p.terminating,
                        host_network: p.host_network,
                    },
                    services: p
                        .services
                        .iter()
                        .map(|m| {
                            let mut ports: Vec<u16> = m.ports.iter().map(|p| p.port).collect();
                            ports.sort_unstable();
                            ports.dedup();
                            (service_id(&m.service), ports)
                        })
                        .collect(),
                })
                .collect(),
            bare: record.bare_services.iter().map(service_id).collect(),
            tombstone: record.tombstone.is_some(),
        }
    }

    /// The line's text (never empty for a record that is not vacant).
    pub fn encode(&self) -> Vec<u8> {
        use std::fmt::Write as _;
        let mut out = String::new();
        let token = |out: &mut String| {
            if !out.is_empty() {
                out.push(' ');
            }
        };
        for pod in &self.pods {
            token(&mut out);
            out.push('p');
            pod.flags.write(&mut out);
            for (id, ports) in &pod.services {
                token(&mut out);
                let _ = write!(out, "s{id:016x}");
                for (i, port) in ports.iter().enumerate() {
                    out.push(if i == 0 { '/' } else { ',' });
                    let _ = write!(out, "{port}");
                }
            }
        }
        for id in &self.bare {
            token(&mut out);
            let _ = write!(out, "b{id:016x}");
        }
        if self.tombstone {
            token(&mut out);
            out.push('t');
        }
        out.into_bytes()
    }

    /// Reads [`Holders::encode`]'s output; `None` for anything else (an
    /// empty line, an unknown token, a service before any pod).
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        let text = std::str::from_utf8(bytes).ok()?;
        if text.is_empty() {
            return None;
        }
        let mut holders = Self::default();
        for token in text.split(' ') {
            let (kind, rest) = token.split_at_checked(1)?;
            match kind {
                "p" => {
                    // Unlike a packed answer, a line this build did not
                    // write is refused, an unknown flag with it.
                    let flags = PodFlags::read(rest, UnknownFlag::Refuse).ok()?;
                    holders.pods.push(Pod::with_flags(flags));
                }
                "s" => {
                    let (id, ports) = match rest.split_once('/') {
                        // A `/` promises at least one port.
                        Some((id, ports)) => (
                            id,
                            ports
                                .split(',')
                                .map(|p| p.parse::<u16>().ok())
                                .collect::<Option<Vec<_>>>()?,
                        ),
                        None => (rest, Vec::new()),
                    };
                    holders.pods.last_mut()?.services.push((hex_id(id)?, ports));
                }
                "b" => holders.bare.push(hex_id(rest)?),
                "t" if rest.is_empty() && !holders.tombstone => holders.tombstone = true,
                _ => return None,
            }
        }
        Some(holders)
    }

    /// The record a verdict about `service` needs: the memberships in
    /// `service` carry its key; any other service is a placeholder key that
    /// equals no real one (its namespace is empty, which Kubernetes never
    /// allows), and names, uids and the tombstone's details are empty.
    pub fn record_for(&self, ip: IpAddr, service: &ServiceKey) -> IpRecord {
        let wanted = service_id(service);
        self.record_with(ip, |id| {
            if id == wanted {
                service.clone()
            } else {
                placeholder(id)
            }
        })
    }

    /// The record with every service a [`placeholder`]: a verdict about
    /// `placeholder(id)` is the verdict about the service with that id.
    pub fn record_by_ids(&self, ip: IpAddr) -> IpRecord {
        self.record_with(ip, placeholder)
    }

    fn record_with(&self, ip: IpAddr, key: impl Fn(u64) -> ServiceKey) -> IpRecord {
        IpRecord {
            ip,
            pods: self
                .pods
                .iter()
                .map(|p| PodHolder {
                    namespace: String::new(),
                    name: String::new(),
                    uid: String::new(),
                    services: p
                        .services
                        .iter()
                        .map(|(id, _)| Membership {
                            service: key(*id),
                            via: Via::Both,
                            ports: vec![],
                            conditions: None,
                        })
                        .collect(),
                    ready: p.flags.ready,
                    terminating: p.flags.terminating,
                    host_network: p.flags.host_network,
                })
                .collect(),
            bare_services: self.bare.iter().map(|id| key(*id)).collect(),
            tombstone: self.tombstone.then(|| Tombstone {
                pod: String::new(),
                uid: String::new(),
                services: vec![],
                since_ms: 0,
            }),
        }
    }

    /// Every service id the line names, each once.
    pub fn service_ids(&self) -> Vec<u64> {
        let mut ids: Vec<u64> = self
            .pods
            .iter()
            .flat_map(|p| p.services.iter().map(|(id, _)| *id))
            .chain(self.bare.iter().copied())
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }
}

/// An IP's record as the poller keeps it from reading an answer to writing
/// it: its bucket line ([`Holders::encode`]), and the two facts the
/// blast-radius guard needs that the line drops. Read straight off the wire
/// (`#[serde(from = "IpRecord")]`, see [`staleguard_core::Snapshot`]), each
/// record whole only while it is turned into this: a reset of 150,000 IPs
/// never holds 150,000 records with their names and strings at once.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(from = "IpRecord")]
pub struct CompactRecord {
    /// The IP, canonical ([`canonical`]).
    pub ip: IpAddr,
    /// Its bucket line; empty for a vacant record.
    pub line: Box<[u8]>,
    /// A fingerprint of the pods holding it ([`packed::fingerprint`], as a
    /// packed answer carries it): a new holder changes it. 32 bits: a
    /// collision only hides a new holder from the guard's evidence, and the
    /// record is smaller by a word.
    pub fingerprint: u32,
    /// The services its tombstone names, by [`service_id`].
    pub tombstone: Box<[u64]>,
    /// Counts the records alive on this thread, for the tests that show a
    /// reset is applied without holding all of them.
    #[cfg(test)]
    pub(crate) alive: alive::Alive,
}

/// How many [`CompactRecord`]s a thread holds at once (tests only).
#[cfg(test)]
pub(crate) mod alive {
    use std::cell::Cell;

    thread_local! {
        static NOW: Cell<usize> = const { Cell::new(0) };
        static PEAK: Cell<usize> = const { Cell::new(0) };
    }

    /// One record's share of the count.
    #[derive(Debug)]
    pub(crate) struct Alive(());

    impl Alive {
        pub(crate) fn new() -> Self {
            NOW.with(|now| {
                now.set(now.get() + 1);
                PEAK.with(|peak| peak.set(peak.get().max(now.get())));
            });
            Self(())
        }
    }

    impl Clone for Alive {
        fn clone(&self) -> Self {
            Self::new()
        }
    }

    impl Drop for Alive {
        fn drop(&mut self) {
            NOW.with(|now| now.set(now.get().saturating_sub(1)));
        }
    }

    // A record's count never makes two records differ.
    impl PartialEq for Alive {
        fn eq(&self, _: &Self) -> bool {
            true
        }
    }

    impl Eq for Alive {}

    /// The most records alive at once on this thread since the last call;
    /// starts counting again from those alive now.
    pub(crate) fn take_peak() -> usize {
        let now = NOW.with(Cell::get);
        PEAK.with(|peak| peak.replace(now))
    }
}

impl CompactRecord {
    /// What the poller keeps of `record`.
    pub fn of(record: &IpRecord) -> Self {
        let line = if record.is_vacant() {
            Vec::new()
        } else {
            Holders::from_record(record).encode()
        };
        Self {
            ip: canonical(record.ip),
            line: line.into_boxed_slice(),
            fingerprint: packed::fingerprint(&record.pods),
            tombstone: record
                .tombstone
                .iter()
                .flat_map(|t| t.services.iter().map(service_id))
                .collect(),
            #[cfg(test)]
            alive: alive::Alive::new(),
        }
    }

    /// What the poller keeps of a record of a packed answer, its services
    /// read as [`service_id`]s: the same as [`CompactRecord::of`] keeps of
    /// the record in JSON.
    pub fn of_packed(record: packed::Record<u64>) -> Self {
        let packed::Record {
            ip,
            fingerprint,
            pods,
            bare_services,
            tombstone,
        } = record;
        let holders = Holders {
            pods: pods
                .into_iter()
                .map(|pod| Pod {
                    services: pod
                        .services
                        .into_iter()
                        .map(|id| (id, Vec::new()))
                        .collect(),
                    ..Pod::with_flags(pod.flags)
                })
                .collect(),
            bare: bare_services,
            tombstone: tombstone.is_some(),
        };
        let vacant = holders.pods.is_empty() && holders.bare.is_empty() && !holders.tombstone;
        let line = if vacant { Vec::new() } else { holders.encode() };
        Self {
            ip: canonical(ip),
            line: line.into_boxed_slice(),
            fingerprint,
            tombstone: tombstone.unwrap_or_default().into_boxed_slice(),
            #[cfg(test)]
            alive: alive::Alive::new(),
        }
    }

    /// True when no pod, service or tombstone names the IP.
    pub fn is_vacant(&self) -> bool {
        self.line.is_empty()
    }

    /// The line, decoded (`None` for a vacant record).
    pub fn holders(&self) -> Option<Holders> {
        Holders::decode(&self.line)
    }
}

impl From<IpRecord> for CompactRecord {
    fn from(record: IpRecord) -> Self {
        Self::of(&record)
    }
}

/// The key standing for the service with id `id` in a decoded record: its
/// namespace is empty, which no Kubernetes Service has.
pub fn placeholder(id: u64) -> ServiceKey {
    ServiceKey::new("", format!("{id:016x}"))
}

fn hex_id(text: &str) -> Option<u64> {
    if text.len() != 16 || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u64::from_str_radix(text, 16).ok()
}

/// Writes one record into its bucket (read, edit, write): for tests that
/// seed a store; the poller batches its edits per bucket.
#[cfg(test)]
pub(crate) fn put(
    store: &mut dyn crate::host::SharedData,
    load: u64,
    buckets: u32,
    record: &IpRecord,
) -> Result<(), crate::host::StoreError> {
    let key = key_of(&record.ip, buckets);
    let (value, _) = store.get(&key)?;
    let mut bucket = Bucket::read(&value.unwrap_or_default(), load);
    bucket.put(&CompactRecord::of(record));
    store.set(&key, &bucket.encode(load), None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use staleguard_core::PodHolder;

    fn record(ip: &str) -> IpRecord {
        IpRecord {
            ip: ip.parse().unwrap(),
            pods: vec![PodHolder {
                namespace: "shop".into(),
                name: format!("cart-{ip}"),
                uid: String::new(),
                services: vec![],
                ready: true,
                terminating: false,
                host_network: false,
            }],
            bare_services: vec![],
            tombstone: None,
        }
    }

    /// A snapshot of `records` and no services.
    fn snapshot(records: Vec<IpRecord>) -> staleguard_core::Snapshot {
        staleguard_core::Snapshot {
            v: 1,
            epoch: 1,
            generation: 1,
            freshness: Default::default(),
            services: vec![],
            records,
        }
    }

    #[test]
    fn bucket_counts_follow_the_index_within_bounds() {
        assert_eq!(bucket_count(0), MIN_BUCKETS);
        assert_eq!(bucket_count(8 * 1_024), 1_024);
        assert_eq!(bucket_count(8 * 1_024 + 1), 2_048);
        assert_eq!(bucket_count(150_000), 32_768, "4.6 IPs per bucket");
        assert_eq!(bucket_count(u64::MAX), MAX_BUCKETS);
        assert!(!outgrown(16_384, 1_024));
        assert!(outgrown(16_385, 1_024));
        assert!(!outgrown(u64::MAX, MAX_BUCKETS), "nothing bigger to go to");
    }

    #[test]
    fn an_ip_has_one_bucket_whatever_its_spelling() {
        let v4: IpAddr = "10.0.0.7".parse().unwrap();
        let mapped: IpAddr = "::ffff:10.0.0.7".parse().unwrap();
        assert_eq!(key_of(&v4, 1_024), key_of(&mapped, 1_024));
        assert!(bucket_of(&"fd00::1".parse().unwrap(), 1_024) < 1_024);
        // Stable across releases: readers of one version find what writers
        // of another wrote.
        assert_eq!(bucket_of(&v4, 1 << 24), 0xbe_b51b, "FNV-1a of \"10.0.0.7\"");
    }

    #[test]
    fn buckets_hold_several_ips_and_readers_decode_only_theirs() {
        let mut b = Bucket::default();
        assert_eq!(b.put(&CompactRecord::of(&record("10.0.0.1"))), 1);
        assert_eq!(b.put(&CompactRecord::of(&record("fd00::1"))), 1);
        assert_eq!(
            b.put(&CompactRecord::of(&record("10.0.0.1"))),
            0,
            "replaced"
        );
        let bytes = b.encode(7);
        let one: IpAddr = "10.0.0.1".parse().unwrap();
        let kept = Holders::from_record(&record("10.0.0.1"));
        assert_eq!(find(&bytes, &one, 7), Entry::Present(kept.clone()));
        assert_eq!(find(&bytes, &one, 6), Entry::Present(kept));
        assert_eq!(find(&bytes, &one, 8), Entry::Absent, "an older load");
        assert_eq!(find(&bytes, &"10.0.0.2".parse().unwrap(), 7), Entry::Absent);
        assert_eq!(Bucket::read(&bytes, 7), b);
        assert_eq!(Bucket::read(&bytes, 8), Bucket::default(), "stale: empty");
        assert_eq!(b.remove(&one), -1);
        assert_eq!(b.remove(&one), 0);
        let mut vacant = record("fd00::1");
        vacant.pods.clear();
        assert_eq!(
            b.put(&CompactRecord::of(&vacant)),
            -1,
            "a vacant record removes its IP"
        );
        assert!(b.encode(7).is_empty());
        assert_eq!(find(b"", &one, 0), Entry::Absent);
        assert_eq!(find(b"x\n10.0.0.1 {}", &one, 0), Entry::Corrupt);
        assert_eq!(find(b"1\n10.0.0.1 {", &one, 0), Entry::Corrupt);
        assert_eq!(find(b"1\nnospace", &one, 0), Entry::Corrupt);
    }

    #[test]
    fn holders_keep_what_verdicts_and_member_lists_need_and_round_trip() {
        use staleguard_core::wire::EndpointPort;
        use staleguard_core::{decide, Policy, Reason};
        let cart = ServiceKey::new("shop", "cart");
        let pay = ServiceKey::new("shop", "pay");
        let mut r = record("10.0.0.1");
        r.pods[0].services = vec![Membership {
            service: cart.clone(),
            via: Via::Slice,
            ports: vec![
                EndpointPort {
                    name: None,
                    port: 9090,
                    protocol: None,
                },
                EndpointPort {
                    name: None,
                    port: 8080,
                    protocol: None,
                },
            ],
            conditions: None,
        }];
        let mut stranger = r.pods[0].clone();
        stranger.services = vec![];
        stranger.ready = false;
        stranger.terminating = true;
        stranger.host_network = true;
        r.pods.push(stranger);
        r.bare_services = vec![pay.clone()];
        r.tombstone = Some(Tombstone {
            pod: "shop/old".into(),
            uid: "u".into(),
            services: vec![cart.clone()],
            since_ms: 5,
        });
        let holders = Holders::from_record(&r);
        let line = holders.encode();
        assert_eq!(
            String::from_utf8(line.clone()).unwrap(),
            format!(
                "pr s{:016x}/8080,9090 pth b{:016x} t",
                service_id(&cart),
                service_id(&pay)
            )
        );
        assert_eq!(Holders::decode(&line), Some(holders.clone()));
        // The verdict on the kept record is the verdict on the full one, for
        // the service asked about and for one the line does not name.
        let other = ServiceKey::new("shop", "other");
        for service in [&cart, &pay, &other] {
            let kept = holders.record_for(r.ip, service);
            let strict = Policy {
                terminating: staleguard_core::Action::Reject,
                ..Policy::default()
            };
            for policy in [Policy::default(), strict] {
                assert_eq!(
                    decide(&policy, true, service, true, Some(&kept)),
                    decide(&policy, true, service, true, Some(&r)),
                    "{service}"
                );
            }
        }
        let kept = holders.record_for(r.ip, &other);
        assert_eq!(
            decide(&Policy::default(), true, &other, true, Some(&kept)).reason,
            Reason::HostNetwork,
            "the host-network stranger is kept"
        );
        assert_eq!(
            service_id(&cart),
            service_id(&ServiceKey::new("shop", "cart"))
        );
        assert_ne!(service_id(&cart), service_id(&pay));
        // A small line: one pod, one service.
        assert_eq!(Holders::from_record(&record("10.0.0.2")).encode(), b"pr");
        for bad in [
            &b""[..],
            b"x",
            b"s0123456789abcdef",
            b"pr s0123",
            b"pr s0123456789abcdeg",
            b"pr s+123456789abcdef",
            b"prr",
            b"pq",
            b"pr s0123456789abcdef/",
            b"pr s0123456789abcdef/70000",
            b"t t",
            b"tx",
            b"pr  t",
            b"pr\xff",
        ] {
            assert_eq!(
                Holders::decode(bad),
                None,
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn a_packed_record_is_kept_as_its_json_record_is() {
        let cart: ServiceKey = "shop/cart".parse().unwrap();
        let gone: ServiceKey = "shop/gone".parse().unwrap();
        let mut held = record("10.0.0.1");
        held.pods[0].services = vec![Membership {
            service: cart.clone(),
            via: Via::Both,
            ports: vec![],
            conditions: None,
        }];
        held.pods.push(PodHolder {
            terminating: true,
            host_network: true,
            ..record("10.0.0.1").pods[0].clone()
        });
        held.bare_services = vec![gone.clone()];
        let tombstoned = IpRecord {
            ip: "fd00::1".parse().unwrap(),
            pods: vec![],
            bare_services: vec![],
            tombstone: Some(Tombstone {
                pod: "shop/cart-0".into(),
                uid: String::new(),
                services: vec![gone, cart],
                since_ms: 7,
            }),
        };
        let snapshot = snapshot(vec![held, tombstoned]);
        let bytes = packed::encode_snapshot(&snapshot);
        let read =
            packed::decode_snapshot(&bytes[..], service_id, CompactRecord::of_packed).unwrap();
        let json: Vec<CompactRecord> = snapshot.records.iter().map(CompactRecord::of).collect();
        assert_eq!(read.records, json);
    }

    #[test]
    fn every_pod_flag_set_round_trips_through_the_packed_form_and_a_bucket_line() {
        for mask in 0..8u8 {
            let flags = PodFlags {
                ready: mask & 1 != 0,
                terminating: mask & 2 != 0,
                host_network: mask & 4 != 0,
            };
            let mut r = record("10.0.0.1");
            r.pods[0].ready = flags.ready;
            r.pods[0].terminating = flags.terminating;
            r.pods[0].host_network = flags.host_network;
            let snapshot = snapshot(vec![r.clone()]);
            let bytes = packed::encode_snapshot(&snapshot);
            let read = packed::decode_snapshot(&bytes[..], service_id, |p| p).unwrap();
            assert_eq!(read.records[0].pods[0].flags, flags, "packed, {mask:03b}");
            let line = Holders::from_record(&r).encode();
            let decoded = Holders::decode(&line).unwrap();
            assert_eq!(decoded.pods[0].flags, flags, "bucket line, {mask:03b}");
            // The same letters in both forms.
            let text = String::from_utf8(bytes).unwrap();
            let packed_token = text
                .lines()
                .find(|l| l.starts_with("10.0.0.1 "))
                .and_then(|l| l.split(' ').find(|t| t.starts_with('p')))
                .unwrap();
            let line = String::from_utf8(line).unwrap();
            assert_eq!(line.split(' ').next(), Some(packed_token));
        }
        // The rules differ on a letter neither knows: a packed answer of a
        // later release skips it, a bucket line refuses it.
        assert!(Holders::decode(b"prx").is_none());
        assert_eq!(
            PodFlags::read("rx", UnknownFlag::Skip),
            Ok(PodFlags {
                ready: true,
                ..PodFlags::default()
            })
        );
    }
}
