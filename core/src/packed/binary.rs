//! The binary encoding's records ([`Encoding::Binary`]): what a text record
//! line carries, in about 12 bytes instead of 30.
//!
//! ```text
//! record  = header address body
//! header  = LEB128 of (body length << 1 | 1 for IPv6)
//! address = 4 or 16 bytes, network order (the canonical form)
//! body    = head [fingerprint] [pod count] pod* [bare] [tombstone] (later fields)
//! head    = a byte: 1 a fingerprint follows, 2 bare services follow,
//!           4 a tombstone follows, 8 none yet (0), the high four bits the
//!           pod count (15: a LEB128 count follows the fingerprint)
//! fingerprint = 4 bytes, little-endian
//! pod     = a byte: its flags in the low three bits ([`PodFlags::bits`]),
//!           8 none yet, the high four bits its service count (15: a LEB128
//!           count follows), then each service as LEB128
//! bare, tombstone = a LEB128 count, then each service as LEB128
//! ```
//!
//! A service is its position in the document's `services` then `names`, as
//! in the text form. The body's length frames the record: a reader skips a
//! record it does not want unread, and skips what follows the fields it
//! knows (a later release's), as it skips a text record's unknown tokens; a
//! flag bit it does not know is ignored, as an unknown flag letter is.

use super::*;
use crate::bytes::{push_ip, push_varint, Reader};

/// A head or pod byte's count that says a LEB128 count follows.
const COUNTED: u8 = 15;
/// Head bit: the fingerprint follows.
const FINGERPRINT: u8 = 1;
/// Head bit: bare services follow.
const BARE: u8 = 2;
/// Head bit: a tombstone follows.
const TOMBSTONE: u8 = 4;
/// The flags of a pod byte.
const FLAGS: u8 = 7;

/// Appends `record` (its IP canonical); `at` is a service's position.
/// `body` is scratch space, reused between records.
pub(super) fn push_record(
    out: &mut Vec<u8>,
    body: &mut Vec<u8>,
    record: &IpRecord,
    at: impl Fn(&ServiceKey) -> usize,
) {
    body.clear();
    let mut head = small(record.pods.len()) << 4;
    if !record.pods.is_empty() {
        head |= FINGERPRINT;
    }
    if !record.bare_services.is_empty() {
        head |= BARE;
    }
    if record.tombstone.is_some() {
        head |= TOMBSTONE;
    }
    body.push(head);
    if !record.pods.is_empty() {
        body.extend_from_slice(&fingerprint(&record.pods).to_le_bytes());
    }
    push_count(body, record.pods.len());
    for pod in &record.pods {
        let flags = PodFlags {
            ready: pod.ready,
            terminating: pod.terminating,
            host_network: pod.host_network,
        };
        body.push(flags.bits() | small(pod.services.len()) << 4);
        push_count(body, pod.services.len());
        push_services(body, pod.services.iter().map(|m| &m.service), &at);
    }
    if !record.bare_services.is_empty() {
        push_varint(body, record.bare_services.len() as u64);
        push_services(body, &record.bare_services, &at);
    }
    if let Some(tombstone) = &record.tombstone {
        push_varint(body, tombstone.services.len() as u64);
        push_services(body, &tombstone.services, &at);
    }
    let ip = canonical(record.ip);
    push_varint(out, header(&ip, body.len()));
    push_ip(out, &ip);
    out.extend_from_slice(body);
}

fn push_services<'a>(
    out: &mut Vec<u8>,
    services: impl IntoIterator<Item = &'a ServiceKey>,
    at: &impl Fn(&ServiceKey) -> usize,
) {
    for service in services {
        push_varint(out, at(service) as u64);
    }
}

/// A record's header: its body's length, and whether the address is IPv6.
fn header(ip: &IpAddr, body: usize) -> u64 {
    ((body as u64) << 1) | u64::from(ip.is_ipv6())
}

/// What a record's header says: the address's length and the body's.
pub(super) fn frame(header: u64) -> (usize, u64) {
    let address = if header & 1 == 1 { 16 } else { 4 };
    (address, header >> 1)
}

/// The canonical IP of a record's address bytes (4 or 16).
pub(super) fn address(bytes: &[u8]) -> Option<IpAddr> {
    let ip = match bytes.len() {
        4 => IpAddr::from(<[u8; 4]>::try_from(bytes).ok()?),
        16 => IpAddr::from(<[u8; 16]>::try_from(bytes).ok()?),
        _ => return None,
    };
    Some(canonical(ip))
}

/// `n` as the four bits of a head or pod byte.
fn small(n: usize) -> u8 {
    n.min(usize::from(COUNTED)) as u8
}

/// The LEB128 count that follows when `n` does not fit in four bits.
fn push_count(out: &mut Vec<u8>, n: usize) {
    if n >= usize::from(COUNTED) {
        push_varint(out, n as u64);
    }
}

/// Reads the body of the record of `ip`: what a text record's tokens would
/// have made of it.
pub(super) fn parse_record<S: Clone>(
    ip: IpAddr,
    body: &[u8],
    table: &[S],
) -> Result<Record<S>, String> {
    let mut r = Reader::new(body);
    let head = r.byte().ok_or_else(cut)?;
    let fingerprint = match head & FINGERPRINT {
        0 => NO_PODS,
        _ => u32::from_le_bytes(r.array().ok_or_else(cut)?),
    };
    let mut pods = Vec::new();
    for _ in 0..count(&mut r, head >> 4)? {
        let byte = r.byte().ok_or_else(cut)?;
        let n = count(&mut r, byte >> 4)?;
        pods.push(Pod {
            flags: PodFlags::from_bits(byte & FLAGS),
            services: services(&mut r, n, table)?,
        });
    }
    let mut list = |bit: u8| match head & bit {
        0 => Ok(None),
        _ => {
            let n = r.varint().ok_or_else(cut)?;
            services(&mut r, n, table).map(Some)
        }
    };
    let bare_services = list(BARE)?.unwrap_or_default();
    let tombstone = list(TOMBSTONE)?;
    // What follows is a later release's: skipped.
    Ok(Record {
        ip,
        fingerprint,
        pods,
        bare_services,
        tombstone,
    })
}

fn cut() -> String {
    "the record ends inside its fields".to_owned()
}

/// A count of four bits, or the LEB128 count that follows.
fn count(r: &mut Reader<'_>, bits: u8) -> Result<u64, String> {
    match bits {
        COUNTED => r.varint().ok_or_else(cut),
        n => Ok(u64::from(n)),
    }
}

/// `count` services. Each is at least a byte: a count larger than the body
/// runs out of bytes, it never reserves memory.
fn services<S: Clone>(r: &mut Reader<'_>, count: u64, table: &[S]) -> Result<Vec<S>, String> {
    let mut out = Vec::new();
    for _ in 0..count {
        let n = r.varint().ok_or_else(cut)?;
        let service = usize::try_from(n)
            .ok()
            .and_then(|n| table.get(n))
            .cloned()
            .ok_or_else(|| format!("`{n}` names no service of the document"))?;
        out.push(service);
    }
    Ok(out)
}
