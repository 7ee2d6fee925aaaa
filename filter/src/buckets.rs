//! IP entries in hash buckets, so shared data stays bounded by the live index.
//!
//! Envoy's shared data cannot delete a key (proxy-wasm has no call for it; the
//! host's `SharedData::remove` is not exported to Wasm, checked against Envoy
//! 1.40's proxy-wasm-cpp-host): a key per IP would keep one entry for every IP
//! ever seen, and IPv6 pods rarely see an IP twice. So IPs share a fixed set of
//! keys: an IP's entry lives in bucket `fnv1a(canonical IP) mod B` under
//! `staleguard/ipb/<B>/<index>`, where `B` (a power of two, at least
//! [`MIN_BUCKETS`], about one IP per bucket) is chosen at each full load and
//! recorded in `meta`. Keys are reused as IPs come and go; their number is at
//! most `2 × B` over every `B` ever used, and `B` follows the peak of the live
//! index, not the number of IPs ever seen.
//!
//! A bucket's value is `LOAD`, then one line per IP: `\n<ip> <IpRecord JSON>`
//! (JSON never holds a raw newline). Empty means no entries. Like every entry,
//! a bucket written under a load older than `meta`'s is absent.

use std::net::IpAddr;

use staleguard_core::ip::canonical;
use staleguard_core::IpRecord;

use crate::store::{Entry, SharedData, StoreError};

/// The fewest buckets a layout has: a small index costs at most this many
/// keys, and small changes in its size never change the layout.
pub const MIN_BUCKETS: u32 = 1_024;

/// The most buckets a layout has (16 M IPs at one per bucket).
pub const MAX_BUCKETS: u32 = 1 << 24;

/// The bucket count for an index of `entries` IPs: about one IP per bucket.
pub fn bucket_count(entries: u64) -> u32 {
    let wanted = u32::try_from(entries).unwrap_or(MAX_BUCKETS);
    wanted
        .checked_next_power_of_two()
        .unwrap_or(MAX_BUCKETS)
        .clamp(MIN_BUCKETS, MAX_BUCKETS)
}

/// True when an index of `entries` IPs has outgrown `buckets` (on average
/// more than two IPs per bucket): the next full load should re-lay it.
pub fn outgrown(entries: u64, buckets: u32) -> bool {
    buckets < MAX_BUCKETS && entries > u64::from(buckets) * 2
}

/// The bucket of `ip` in a layout of `buckets` (a power of two).
pub fn bucket_of(ip: &IpAddr, buckets: u32) -> u32 {
    // FNV-1a over the canonical text: stable across VMs and releases, which a
    // std hasher is not.
    let mut hash: u32 = 0x811c_9dc5;
    for byte in canonical(*ip).to_string().bytes() {
        hash ^= u32::from(byte);
        hash = hash.wrapping_mul(0x0100_0193);
    }
    hash & buckets.saturating_sub(1)
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
    /// `(canonical IP, record JSON)`, at most one line per IP.
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

    /// Sets `record` (vacant: removes its IP). Returns the change in the
    /// number of IPs: +1 added, -1 removed, 0 replaced or nothing to remove.
    pub fn put(&mut self, record: &IpRecord) -> i64 {
        let ip = canonical(record.ip);
        if record.is_vacant() {
            return self.remove(&ip);
        }
        // Serializing a plain data struct cannot fail; if it ever did, the IP
        // is dropped (absent) rather than written half.
        let Ok(json) = serde_json::to_vec(record) else {
            return self.remove(&ip);
        };
        match self.lines.iter_mut().find(|(i, _)| *i == ip) {
            Some(line) => {
                line.1 = json;
                0
            }
            None => {
                self.lines.push((ip, json));
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
        for (ip, json) in &self.lines {
            out.push(b'\n');
            out.extend_from_slice(ip.to_string().as_bytes());
            out.push(b' ');
            out.extend_from_slice(json);
        }
        out
    }
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
pub fn find(bytes: &[u8], ip: &IpAddr, meta_load: u64) -> Entry<IpRecord> {
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
            return match serde_json::from_slice::<IpRecord>(&line[space + 1..]) {
                Ok(record) => Entry::Present(record),
                Err(_) => Entry::Corrupt,
            };
        }
    }
    Entry::Absent
}

/// Writes one record into its bucket (read, edit, write): for tests and
/// tools that seed a store; the poller batches its edits per bucket.
pub fn put(
    store: &mut dyn SharedData,
    load: u64,
    buckets: u32,
    record: &IpRecord,
) -> Result<(), StoreError> {
    let key = key_of(&record.ip, buckets);
    let (value, _) = store.get(&key)?;
    let mut bucket = Bucket::read(&value.unwrap_or_default(), load);
    bucket.put(record);
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

    #[test]
    fn bucket_counts_follow_the_index_within_bounds() {
        assert_eq!(bucket_count(0), MIN_BUCKETS);
        assert_eq!(bucket_count(1_025), 2_048);
        assert_eq!(bucket_count(150_000), 262_144);
        assert_eq!(bucket_count(u64::MAX), MAX_BUCKETS);
        assert!(!outgrown(2_048, 1_024));
        assert!(outgrown(2_049, 1_024));
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
        assert_eq!(b.put(&record("10.0.0.1")), 1);
        assert_eq!(b.put(&record("fd00::1")), 1);
        assert_eq!(b.put(&record("10.0.0.1")), 0, "replaced");
        let bytes = b.encode(7);
        let one: IpAddr = "10.0.0.1".parse().unwrap();
        assert_eq!(find(&bytes, &one, 7), Entry::Present(record("10.0.0.1")));
        assert_eq!(find(&bytes, &one, 6), Entry::Present(record("10.0.0.1")));
        assert_eq!(find(&bytes, &one, 8), Entry::Absent, "an older load");
        assert_eq!(find(&bytes, &"10.0.0.2".parse().unwrap(), 7), Entry::Absent);
        assert_eq!(Bucket::read(&bytes, 7), b);
        assert_eq!(Bucket::read(&bytes, 8), Bucket::default(), "stale: empty");
        assert_eq!(b.remove(&one), -1);
        assert_eq!(b.remove(&one), 0);
        let mut vacant = record("fd00::1");
        vacant.pods.clear();
        assert_eq!(b.put(&vacant), -1, "a vacant record removes its IP");
        assert!(b.encode(7).is_empty());
        assert_eq!(find(b"", &one, 0), Entry::Absent);
        assert_eq!(find(b"x\n10.0.0.1 {}", &one, 0), Entry::Corrupt);
        assert_eq!(find(b"1\n10.0.0.1 {", &one, 0), Entry::Corrupt);
        assert_eq!(find(b"1\nnospace", &one, 0), Entry::Corrupt);
    }
}
