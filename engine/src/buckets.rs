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
//! A bucket's value is binary (the `m4` layout): [`binary::MAGIC`], the
//! `LOAD` as a LEB128 number, then one line per IP: a LEB128 header
//! `(holders length << 1) | is IPv6`, the address (4 or 16 bytes, network
//! order, canonical: an IPv4-mapped IPv6 address is its IPv4 address) and
//! `<holders>`, the compact record of [`Holders`]: only what the verdict,
//! the member lists and the guard's successor need, no names, no JSON. A
//! live pod of one service is a 15-byte IPv4 line. Every line carries its
//! own length, so a reader skips the lines of other IPs by comparing 4 or 16
//! bytes and decodes only its own. Empty means no entries; a value in the
//! text of an earlier layout (it starts with a decimal load, older than any
//! `m4` load) is absent; anything a reader cannot frame is corrupt. Like
//! every entry, a bucket written under a load older than `meta`'s is absent.

use std::net::IpAddr;

use serde::Deserialize;
use staleguard_core::ip::canonical;
use staleguard_core::packed::{self, PodFlags};
use staleguard_core::wire::{Membership, Tombstone, Via};
use staleguard_core::{IpRecord, PodHolder, ServiceKey};

use crate::binary::{self, Opening, Reader};
use crate::entry::Entry;

/// The fewest buckets a layout has: a small index costs at most this many
/// keys, and small changes in its size never change the layout.
pub const MIN_BUCKETS: u32 = 1_024;

/// The most buckets a layout has.
pub const MAX_BUCKETS: u32 = 1 << 24;

/// IPs per bucket a new layout aims at: a reader copies and scans one bucket
/// (about 15 bytes per IPv4 pod, 17-32 lines after rounding `B` up), so
/// many IPs share the cost of a key (about 150 bytes in Envoy's shared
/// data, 10 IPs' binary lines): 32 instead of 16 took 7 bytes per IP off
/// the Wasm gateway at 150,000 IPs, and a cold verdict's longer scan did
/// not show above the noise (docs/benchmarks.md).
pub const IPS_PER_BUCKET: u64 = 32;

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
    /// `meta_load`, a text value of an earlier layout) or unreadable values
    /// are an empty bucket, which the next write replaces whole; of a value
    /// whose lines stop framing part way, the lines before (those a reader
    /// finds) are kept.
    pub fn read(bytes: &[u8], meta_load: u64) -> Self {
        let mut lines = Vec::new();
        let Some(rest) = valid_lines(bytes, meta_load) else {
            return Self { lines };
        };
        // The lines before one that does not frame are kept: a reader finds
        // them too.
        for line in Lines::new(rest).map_while(Result::ok) {
            if let Some(ip) = line.ip() {
                lines.push((ip, line.holders.to_vec()));
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
        let mut out = Vec::new();
        binary::push_opening(&mut out, load);
        for (ip, holders) in &self.lines {
            push_parts(&mut out, ip, holders);
        }
        out
    }
}

/// The bytes [`push_line`] adds for `record` (not vacant).
pub fn line_len(record: &CompactRecord) -> usize {
    let addr = if record.ip.is_ipv6() { 16 } else { 4 };
    binary::varint_len(line_header(&record.ip, record.line.len())) + addr + record.line.len()
}

/// Appends the bucket line of `record` (not vacant) to `out` as a bucket
/// value carries it: header, address, holders.
pub fn push_line(out: &mut Vec<u8>, record: &CompactRecord) {
    push_parts(out, &record.ip, &record.line);
}

/// A line's header: the holders' length, and whether the address is IPv6.
fn line_header(ip: &IpAddr, holders: usize) -> u64 {
    ((holders as u64) << 1) | u64::from(ip.is_ipv6())
}

fn push_parts(out: &mut Vec<u8>, ip: &IpAddr, holders: &[u8]) {
    binary::push_varint(out, line_header(ip, holders.len()));
    binary::push_ip(out, ip);
    out.extend_from_slice(holders);
}

/// Writes into `value` the bucket value of load `load` whose lines start
/// at `starts` in `lines` (each as [`push_line`] wrote it, in the order of
/// the answer); an IP listed twice keeps its last line, as
/// [`Bucket::put`] does. Returns the number of IPs.
pub fn encode_lines(value: &mut Vec<u8>, load: u64, lines: &[u8], starts: &[usize]) -> usize {
    // The whole line and its address.
    let line = |start: usize| -> Option<(&[u8], &[u8])> {
        let rest = lines.get(start..)?;
        let mut reader = Reader::new(rest);
        let line = Line::next(&mut reader)?;
        let len = rest.len() - reader.rest().len();
        Some((rest.get(..len)?, line.addr))
    };
    value.clear();
    binary::push_opening(value, load);
    let mut ips = 0;
    for (i, start) in starts.iter().enumerate() {
        let Some((this, addr)) = line(*start) else {
            continue;
        };
        let again = starts[i + 1..]
            .iter()
            .any(|later| line(*later).is_some_and(|(_, a)| a == addr));
        if !again {
            value.extend_from_slice(this);
            ips += 1;
        }
    }
    ips
}

/// After the opening, if the load is current; `None` for empty or stale
/// values (a text value of an earlier layout is stale). `Err` when the
/// opening cannot be read.
fn lines_after_load(bytes: &[u8], meta_load: u64) -> Result<Option<&[u8]>, ()> {
    match binary::opening(bytes) {
        Opening::Absent => Ok(None),
        Opening::Garbage => Err(()),
        Opening::Load(load, rest) => Ok((load >= meta_load).then_some(rest)),
    }
}

fn valid_lines(bytes: &[u8], meta_load: u64) -> Option<&[u8]> {
    lines_after_load(bytes, meta_load).ok().flatten()
}

/// One line of a bucket value, framed but not decoded.
#[derive(Debug, Clone, Copy)]
struct Line<'a> {
    /// 4 or 16 bytes.
    addr: &'a [u8],
    /// The encoded [`Holders`], never empty.
    holders: &'a [u8],
}

impl<'a> Line<'a> {
    /// Reads the next line; `None` when it does not frame (cut, or empty
    /// holders, which no writer writes).
    fn next(reader: &mut Reader<'a>) -> Option<Self> {
        let header = reader.varint()?;
        let addr = reader.take(if header & 1 == 1 { 16 } else { 4 })?;
        let len = usize::try_from(header >> 1).ok().filter(|len| *len > 0)?;
        let holders = reader.take(len)?;
        Some(Self { addr, holders })
    }

    fn ip(&self) -> Option<IpAddr> {
        if let Ok(v4) = <[u8; 4]>::try_from(self.addr) {
            return Some(IpAddr::from(v4));
        }
        <[u8; 16]>::try_from(self.addr).ok().map(IpAddr::from)
    }
}

/// The lines after a value's opening, up to the first that does not frame
/// (an `Err`, the last item).
struct Lines<'a> {
    reader: Reader<'a>,
    failed: bool,
}

impl<'a> Lines<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        Self {
            reader: Reader::new(bytes),
            failed: false,
        }
    }
}

impl<'a> Iterator for Lines<'a> {
    type Item = Result<Line<'a>, ()>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed || self.reader.is_empty() {
            return None;
        }
        let line = Line::next(&mut self.reader).ok_or(());
        self.failed = line.is_err();
        Some(line)
    }
}

/// The encoded [`Holders`] of `ip` in a bucket value, borrowed from it:
/// what a reader needs before it decodes anything. Allocates nothing: the
/// other lines are skipped by comparing their address bytes with `ip`'s.
pub fn find_line<'a>(bytes: &'a [u8], ip: &IpAddr, meta_load: u64) -> Entry<&'a [u8]> {
    let rest = match lines_after_load(bytes, meta_load) {
        Ok(Some(rest)) => rest,
        Ok(None) => return Entry::Absent,
        Err(()) => return Entry::Corrupt,
    };
    let (v4, v6);
    let wanted: &[u8] = match canonical(*ip) {
        IpAddr::V4(a) => {
            v4 = a.octets();
            &v4
        }
        IpAddr::V6(a) => {
            v6 = a.octets();
            &v6
        }
    };
    for line in Lines::new(rest) {
        match line {
            Ok(line) if line.addr == wanted => return Entry::Present(line.holders),
            Ok(_) => {}
            Err(()) => return Entry::Corrupt,
        }
    }
    Entry::Absent
}

/// What a bucket value says about `ip`, for a reader: only that IP's line is
/// decoded.
pub fn find(bytes: &[u8], ip: &IpAddr, meta_load: u64) -> Entry<Holders> {
    match find_line(bytes, ip, meta_load) {
        Entry::Present(line) => match Holders::decode(line) {
            Some(holders) => Entry::Present(holders),
            None => Entry::Corrupt,
        },
        Entry::Absent => Entry::Absent,
        Entry::Corrupt => Entry::Corrupt,
    }
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
/// Encoded as a run of items, each opened by a tag byte: `0b00000hta` a
/// pod with its flags (`a` ready, `t` terminating, `h` host network; the
/// other bits zero); `0b01nnnnnn` a service of the pod opened last with
/// `n` ports (`n` = 63: a LEB128 count of at least 63 follows), then its
/// [`service_id`] (8 bytes, little-endian) and the ports (2 bytes each,
/// little-endian); `0x80` and an id, a bare service; `0xc0` the tombstone.
/// A pod of one service without ports is 10 bytes.
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

    /// The encoded line (never empty for a record that is not vacant).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        for pod in &self.pods {
            out.push(TAG_POD | flag_bits(pod.flags));
            for (id, ports) in &pod.services {
                match u8::try_from(ports.len())
                    .ok()
                    .filter(|n| *n < PORTS_COUNTED)
                {
                    Some(n) => out.push(TAG_SERVICE | n),
                    None => {
                        out.push(TAG_SERVICE | PORTS_COUNTED);
                        binary::push_varint(&mut out, ports.len() as u64);
                    }
                }
                out.extend_from_slice(&id.to_le_bytes());
                for port in ports {
                    out.extend_from_slice(&port.to_le_bytes());
                }
            }
        }
        for id in &self.bare {
            out.push(TAG_BARE);
            out.extend_from_slice(&id.to_le_bytes());
        }
        if self.tombstone {
            out.push(TAG_TOMBSTONE);
        }
        out
    }

    /// Reads [`Holders::encode`]'s output; `None` for anything else (an
    /// empty line, an unknown tag or flag, a service before any pod, a cut
    /// item, a second tombstone). Reads nothing past `bytes`, and allocates
    /// no more than `bytes` can fill.
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        if bytes.is_empty() {
            return None;
        }
        let mut reader = Reader::new(bytes);
        let mut holders = Self::default();
        while let Some(tag) = reader.byte() {
            match tag {
                // Unlike a packed answer, a line this build did not write
                // is refused, an unknown flag with it.
                0x00..=0x07 => holders.pods.push(Pod::with_flags(flags_of(tag))),
                0x40..=0x7f => {
                    let ports = match tag & PORTS_COUNTED {
                        PORTS_COUNTED => usize::try_from(reader.varint()?)
                            .ok()
                            .filter(|n| *n >= usize::from(PORTS_COUNTED))?,
                        n => usize::from(n),
                    };
                    let id = reader.u64()?;
                    if ports > reader.rest().len() / 2 {
                        return None;
                    }
                    let ports = (0..ports)
                        .map(|_| reader.u16())
                        .collect::<Option<Vec<_>>>()?;
                    holders.pods.last_mut()?.services.push((id, ports));
                }
                TAG_BARE => holders.bare.push(reader.u64()?),
                TAG_TOMBSTONE if !holders.tombstone => holders.tombstone = true,
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

/// A pod's tag: its flags in the low three bits.
const TAG_POD: u8 = 0x00;
/// A service's tag: its port count in the low six bits.
const TAG_SERVICE: u8 = 0x40;
/// A service tag's port count that says a LEB128 count follows.
const PORTS_COUNTED: u8 = 0x3f;
/// A bare service's tag.
const TAG_BARE: u8 = 0x80;
/// The tombstone's tag.
const TAG_TOMBSTONE: u8 = 0xc0;

fn flag_bits(flags: PodFlags) -> u8 {
    flags.bits()
}

/// The flags of a pod tag (its low three bits).
fn flags_of(tag: u8) -> PodFlags {
    PodFlags::from_bits(tag)
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
        assert_eq!(bucket_count(32 * 1_024), 1_024);
        assert_eq!(bucket_count(32 * 1_024 + 1), 2_048);
        assert_eq!(bucket_count(150_000), 8_192, "18.3 IPs per bucket");
        assert_eq!(bucket_count(u64::MAX), MAX_BUCKETS);
        assert!(!outgrown(65_536, 1_024));
        assert!(outgrown(65_537, 1_024));
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
        assert_eq!(find(&[MAGIC], &one, 0), Entry::Corrupt, "no load");
        assert_eq!(find(&[MAGIC, 1, 2, 10, 0], &one, 0), Entry::Corrupt, "cut");
        assert_eq!(
            find(&[MAGIC, 1, 0, 10, 0, 0, 1], &one, 0),
            Entry::Corrupt,
            "no holders"
        );
        assert_eq!(
            find(&[MAGIC, 1, 2, 10, 0, 0, 1, 0x08], &one, 0),
            Entry::Corrupt,
            "an unknown pod flag"
        );
        assert_eq!(
            find(&[MAGIC, 1, 2, 10, 0, 0, 2, 0x01, 2], &one, 0),
            Entry::Corrupt,
            "a line before it that does not frame"
        );
    }

    /// The first byte of a binary value (`binary::MAGIC`), spelt out.
    const MAGIC: u8 = 0xb4;

    /// `shop/cart`'s id (64-bit FNV-1a), little-endian, computed apart.
    const CART: [u8; 8] = [0xb8, 0x4e, 0xf0, 0xfe, 0x47, 0x3f, 0x10, 0xfc];
    /// `shop/pay`'s id, likewise.
    const PAY: [u8; 8] = [0xb4, 0xd3, 0x84, 0x7e, 0x3c, 0x70, 0x45, 0x01];

    #[test]
    fn a_bucket_value_is_its_load_then_a_line_per_ip_in_binary() {
        let mut b = Bucket::default();
        b.put(&CompactRecord::of(&record("10.0.0.1")));
        b.put(&CompactRecord::of(&record("::ffff:10.0.0.2")));
        b.put(&CompactRecord::of(&record("fd00::1")));
        let mut fd00 = vec![0xfd, 0x00];
        fd00.extend([0; 13]);
        fd00.push(1);
        let mut expected = vec![MAGIC, 0xac, 0x02]; // load 300
        expected.extend([0x02, 10, 0, 0, 1, 0x01]); // one byte of holders, IPv4
        expected.extend([0x02, 10, 0, 0, 2, 0x01]); // canonical: IPv4
        expected.push(0x03); // one byte of holders, IPv6
        expected.extend(&fd00);
        expected.push(0x01);
        assert_eq!(b.encode(300), expected);
        assert_eq!(Bucket::read(&expected, 300), b);
        let mut cut = expected.clone();
        cut.extend([0x02, 10, 0]);
        assert_eq!(Bucket::read(&cut, 300), b, "the lines before a cut one");
        assert_eq!(
            find(&cut, &"10.0.0.9".parse().unwrap(), 300),
            Entry::Corrupt,
            "an IP not before the cut line may be in it"
        );
        let two: IpAddr = "::ffff:10.0.0.2".parse().unwrap();
        assert_eq!(
            find_line(&expected, &two, 300),
            Entry::Present(&[0x01][..]),
            "found whatever its spelling"
        );
        // A line of a live pod of one service: 15 bytes.
        let mut r = record("10.0.0.3");
        r.pods[0].services = vec![Membership {
            service: ServiceKey::new("shop", "cart"),
            via: Via::Both,
            ports: vec![],
            conditions: None,
        }];
        let compact = CompactRecord::of(&r);
        let mut line = Vec::new();
        push_line(&mut line, &compact);
        let mut expected = vec![0x14, 10, 0, 0, 3, 0x01, 0x40];
        expected.extend(CART);
        assert_eq!(line, expected);
        assert_eq!(line_len(&compact), 15);
        // A line's length past 63 bytes of holders takes a second header
        // byte.
        let mut wide = record("fd00::2");
        wide.bare_services = (0..8)
            .map(|i| ServiceKey::new("shop", format!("s{i}")))
            .collect();
        let compact = CompactRecord::of(&wide);
        assert_eq!(compact.line.len(), 1 + 8 * 9);
        let mut line = Vec::new();
        push_line(&mut line, &compact);
        assert_eq!(&line[..2], &[0x93, 0x01], "(73 << 1) | 1");
        assert_eq!(line.len(), line_len(&compact));
        assert_eq!(line.len(), 2 + 16 + 73);
    }

    #[test]
    fn a_text_bucket_of_an_earlier_layout_is_absent_not_corrupt() {
        // Older than any load of this layout: the meta flip hides it, as a
        // bucket of an older load.
        let ip: IpAddr = "10.0.0.1".parse().unwrap();
        let m3 = b"7\n10.0.0.1 pr s0123456789abcdef";
        assert_eq!(find(m3, &ip, 1), Entry::Absent);
        assert_eq!(Bucket::read(m3, 1), Bucket::default());
    }

    #[test]
    fn a_streamed_bucket_keeps_the_last_line_of_an_ip() {
        let first = CompactRecord::of(&record("10.0.0.1"));
        let other = CompactRecord::of(&record("fd00::1"));
        let mut last = first.clone();
        last.line = vec![0x02].into_boxed_slice();
        let mut arena = Vec::new();
        let mut starts = Vec::new();
        for r in [&first, &other, &last] {
            starts.push(arena.len());
            push_line(&mut arena, r);
        }
        let mut value = Vec::new();
        assert_eq!(encode_lines(&mut value, 2, &arena, &starts), 2);
        let mut expected = vec![MAGIC, 2, 0x03];
        expected.extend([0xfd, 0x00]);
        expected.extend([0; 13]);
        expected.extend([1, 0x01]);
        expected.extend([0x02, 10, 0, 0, 1, 0x02]);
        assert_eq!(value, expected);
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
        let mut expected = vec![0x01, 0x42]; // a ready pod; a service, 2 ports
        expected.extend(CART);
        expected.extend([0x90, 0x1f, 0x82, 0x23]); // 8080, 9090
        expected.push(0x06); // a terminating host-network pod
        expected.push(0x80); // a bare service
        expected.extend(PAY);
        expected.push(0xc0); // the tombstone
        assert_eq!(line, expected);
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
        // A small line: one ready pod.
        assert_eq!(Holders::from_record(&record("10.0.0.2")).encode(), [0x01]);
        // 63 ports and more: the count follows the tag.
        let many = Holders {
            pods: vec![Pod {
                flags: PodFlags::default(),
                services: vec![(7, (1..=70).collect())],
            }],
            ..Holders::default()
        };
        let line = many.encode();
        assert_eq!(&line[..3], &[0x00, 0x7f, 70]);
        assert_eq!(line.len(), 3 + 8 + 140);
        assert_eq!(Holders::decode(&line), Some(many));
        let id = [0u8; 8];
        let with = |head: &[u8], tail: &[u8]| [head, &id[..], tail].concat();
        for bad in [
            vec![],
            vec![0x08],                                 // an unknown pod flag
            vec![0x81],                                 // an unknown tag
            with(&[0x40], &[]),                         // a service before any pod
            with(&[0x01, 0x41], &[]),                   // its port missing
            with(&[0x01, 0x41], &[0x50]),               // half a port
            vec![0x01, 0x40, 0, 0, 0, 0, 0, 0, 0],      // a cut id
            with(&[0x01, 0x7f, 0x05], &[0, 0]),         // a count below 63 after the tag
            with(&[0x01, 0x7f, 0xff, 0xff, 0x03], &[]), // more ports than bytes
            vec![0x80, 1, 2, 3],                        // a cut bare service
            vec![0xc0, 0xc0],                           // two tombstones
        ] {
            assert_eq!(Holders::decode(&bad), None, "{bad:x?}");
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
            assert_eq!(line, [mask], "the tag of a pod holds its flags");
            let decoded = Holders::decode(&line).unwrap();
            assert_eq!(decoded.pods[0].flags, flags, "bucket line, {mask:03b}");
        }
        // The rules differ on a flag neither knows: a packed answer of a
        // later release skips it, a bucket line refuses it.
        assert!(Holders::decode(&[0x09]).is_none());
        assert_eq!(
            PodFlags::read("rx", packed::UnknownFlag::Skip),
            Ok(PodFlags {
                ready: true,
                ..PodFlags::default()
            })
        );
    }
}
