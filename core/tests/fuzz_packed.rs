//! Fuzzing of the packed form's reader (`staleguard_core::packed`): packed
//! documents (text and binary records) of random snapshots and deltas read
//! back to what they carry, the binary ones to what the text ones read, and
//! the same documents mutated at random (bit flips, cuts, splices of the
//! format's own tokens) or pure random bytes are refused or read, never a
//! panic. `PROPTEST_CASES` sets the number of inputs of each property (256 by
//! default); a long run:
//!
//! ```text
//! PROPTEST_CASES=200000 cargo test --release -p staleguard-core --test fuzz_packed
//! ```
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::IpAddr;

use proptest::prelude::*;
use staleguard_core::packed::{self, Encoding, Record};
use staleguard_core::wire::{Delta, Membership, Tombstone, Via, WIRE_VERSION};
use staleguard_core::{Changes, Freshness, IpRecord, PodHolder, ServiceKey, Snapshot};

const SERVICES: [&str; 6] = [
    "shop/cart",
    "shop/pay",
    "kube/agent",
    "a/b",
    "x-1/y-2",
    "gone/old",
];

fn service() -> impl Strategy<Value = ServiceKey> {
    (0..SERVICES.len()).prop_map(|i| SERVICES[i].parse().unwrap())
}

fn ip() -> impl Strategy<Value = IpAddr> {
    prop_oneof![
        any::<[u8; 4]>().prop_map(IpAddr::from),
        any::<[u16; 8]>().prop_map(IpAddr::from),
    ]
}

fn pod() -> impl Strategy<Value = PodHolder> {
    (
        "[a-z]{1,8}",
        "[a-z0-9-]{1,20}",
        prop::collection::vec(service(), 0..3),
        any::<[bool; 3]>(),
    )
        .prop_map(
            |(namespace, name, services, [ready, terminating, host])| PodHolder {
                namespace,
                name,
                uid: String::new(),
                services: services
                    .into_iter()
                    .map(|service| Membership {
                        service,
                        via: Via::Both,
                        ports: vec![],
                        conditions: None,
                    })
                    .collect(),
                ready,
                terminating,
                host_network: host,
            },
        )
}

fn record() -> impl Strategy<Value = IpRecord> {
    (
        ip(),
        prop::collection::vec(pod(), 0..3),
        prop::collection::vec(service(), 0..2),
        prop::option::of(prop::collection::vec(service(), 0..3)),
    )
        .prop_map(|(ip, pods, bare_services, tombstone)| IpRecord {
            ip: staleguard_core::ip::canonical(ip),
            pods,
            bare_services,
            tombstone: tombstone.map(|services| Tombstone {
                pod: String::new(),
                uid: String::new(),
                services,
                since_ms: 0,
            }),
        })
}

fn snapshot() -> impl Strategy<Value = Snapshot> {
    (
        0..staleguard_core::wire::MAX_EPOCH,
        any::<u64>(),
        any::<bool>(),
        prop::option::of(any::<u64>()),
        prop::collection::vec(service(), 0..4),
        prop::collection::vec(record(), 0..12),
    )
        .prop_map(
            |(epoch, generation, fresh, age_ms, mut services, records)| {
                services.sort();
                services.dedup();
                Snapshot {
                    v: WIRE_VERSION,
                    epoch,
                    generation,
                    freshness: Freshness { fresh, age_ms },
                    services,
                    records,
                }
            },
        )
}

/// What a packed record carries of `record`, with its fingerprint.
fn carried(record: &IpRecord) -> (u32, IpRecord) {
    let mut kept = record.clone();
    for pod in &mut kept.pods {
        pod.namespace.clear();
        pod.name.clear();
    }
    (packed::fingerprint(&record.pods), kept)
}

fn read(record: Record<ServiceKey>) -> (u32, IpRecord) {
    (record.fingerprint, record.into_ip_record())
}

/// Tokens of the format, spliced in by the mutations.
const TOKENS: &[&str] = &[
    "\n",
    " ",
    "[",
    "] ",
    "end\n",
    "[records] 3\n",
    "[names] 1\n",
    "[removed] 99999999999\n",
    " s0",
    " s18446744073709551615",
    " p",
    " prth",
    " t",
    " t0,0",
    " f",
    " fffffffff",
    " b1",
    "epoch 1\n",
    "fresh 2\n",
    "::ffff:10.0.0.1",
    "staleguard-packed 1 delta\n",
    "staleguard-packed-binary 1 reset\n",
    "\u{7f}",
    "\u{0}",
    "\u{ff}",
];

#[derive(Debug, Clone)]
enum Mutation {
    Flip(usize, u8),
    Insert(usize, u8),
    Cut(usize, usize),
    Token(usize, usize),
    Truncate(usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), 0..8u8).prop_map(|(i, b)| Mutation::Flip(i, b)),
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Insert(i, b)),
        (any::<usize>(), 0..16usize).prop_map(|(i, n)| Mutation::Cut(i, n)),
        (any::<usize>(), 0..TOKENS.len()).prop_map(|(i, t)| Mutation::Token(i, t)),
        any::<usize>().prop_map(Mutation::Truncate),
    ]
}

fn mutate(bytes: &mut Vec<u8>, mutation: &Mutation) {
    let len = bytes.len();
    match *mutation {
        Mutation::Flip(i, bit) if len > 0 => bytes[i % len] ^= 1 << bit,
        Mutation::Insert(i, byte) => bytes.insert(i % (len + 1), byte),
        Mutation::Cut(i, n) if len > 0 => {
            let a = i % len;
            bytes.drain(a..(a + n).min(len));
        }
        Mutation::Token(i, t) => {
            let i = i % (len + 1);
            bytes.splice(i..i, TOKENS[t].bytes());
        }
        Mutation::Truncate(i) => bytes.truncate(i % (len + 1)),
        _ => {}
    }
}

/// Reads `bytes` every way a client does; a document that reads is whole.
fn feed(bytes: &[u8]) {
    if let Ok(snapshot) = packed::decode_snapshot(bytes, ServiceKey::clone, read) {
        assert_eq!(snapshot.v, WIRE_VERSION);
    }
    let _ = packed::decode_changes(bytes, ServiceKey::clone, read);
    // The filter's way: services as ids, records as a small type.
    let _ = packed::decode_changes(
        bytes,
        |s| s.name.len() as u64,
        |r| (r.ip, r.fingerprint, r.pods.len()),
    );
    // The poller's way with a reset: a record at a time, some skipped
    // unread; it refuses what decoding refuses.
    let visited = packed::visit_snapshot(bytes, |s| s.name.len() as u64, &mut Every);
    let decoded = packed::decode_snapshot(bytes, |s| s.name.len() as u64, |_| ());
    assert_eq!(visited.is_ok(), decoded.is_ok());
    let _ = packed::visit_snapshot(bytes, |s| s.name.len() as u64, &mut Ipv4Only);
}

/// Reads every record.
struct Every;

impl packed::Visit<u64> for Every {
    fn record(&mut self, _: packed::Record<u64>) -> std::ops::ControlFlow<()> {
        std::ops::ControlFlow::Continue(())
    }
}

/// Reads the IPv4 records, skips the others.
struct Ipv4Only;

impl packed::Visit<u64> for Ipv4Only {
    fn wants(&mut self, ip: std::net::IpAddr) -> bool {
        ip.is_ipv4()
    }

    fn record(&mut self, _: packed::Record<u64>) -> std::ops::ControlFlow<()> {
        std::ops::ControlFlow::Continue(())
    }
}

fn encoding() -> impl Strategy<Value = Encoding> {
    prop_oneof![Just(Encoding::Text), Just(Encoding::Binary)]
}

proptest! {
    #[test]
    fn a_packed_snapshot_reads_back_what_it_carries(
        snapshot in snapshot(),
        encoding in encoding(),
    ) {
        let bytes = packed::encode_snapshot_as(encoding, &snapshot);
        prop_assert_eq!(packed::encoding_of(&bytes), Some(encoding));
        let back = packed::decode_snapshot(&bytes[..], ServiceKey::clone, read).unwrap();
        prop_assert_eq!(back.epoch, snapshot.epoch);
        prop_assert_eq!(back.generation, snapshot.generation);
        prop_assert_eq!(&back.freshness, &snapshot.freshness);
        prop_assert_eq!(&back.services, &snapshot.services);
        let sent: Vec<_> = snapshot.records.iter().map(carried).collect();
        prop_assert_eq!(back.records, sent);
    }

    #[test]
    fn a_packed_delta_reads_back_what_it_carries(
        snapshot in snapshot(),
        since in any::<u64>(),
        removed in prop::collection::vec(ip(), 0..4),
        added in prop::collection::vec(service(), 0..3),
        encoding in encoding(),
    ) {
        let delta = Delta {
            v: WIRE_VERSION,
            epoch: snapshot.epoch,
            since,
            generation: snapshot.generation,
            freshness: snapshot.freshness.clone(),
            services_added: added,
            services_removed: snapshot.services.clone(),
            upserts: snapshot.records.clone(),
            removed,
        };
        let bytes = packed::encode_changes_as(encoding, &Changes::Delta(delta.clone()));
        let Changes::Delta(back) =
            packed::decode_changes(&bytes[..], ServiceKey::clone, read).unwrap()
        else {
            panic!("a delta reads as a delta");
        };
        prop_assert_eq!(back.since, since);
        prop_assert_eq!(&back.services_added, &delta.services_added);
        prop_assert_eq!(&back.services_removed, &delta.services_removed);
        let removed: Vec<IpAddr> = delta
            .removed
            .iter()
            .map(|ip| staleguard_core::ip::canonical(*ip))
            .collect();
        prop_assert_eq!(back.removed, removed);
        let sent: Vec<_> = delta.upserts.iter().map(carried).collect();
        prop_assert_eq!(back.upserts, sent);
    }

    #[test]
    fn a_binary_document_reads_as_its_text_twin(snapshot in snapshot()) {
        let text = packed::encode_snapshot_as(Encoding::Text, &snapshot);
        let binary = packed::encode_snapshot_as(Encoding::Binary, &snapshot);
        let text = packed::decode_snapshot(&text[..], ServiceKey::clone, |r| r).unwrap();
        let binary = packed::decode_snapshot(&binary[..], ServiceKey::clone, |r| r).unwrap();
        prop_assert_eq!(binary.records, text.records);
    }

    #[test]
    fn mutated_documents_never_panic(
        snapshot in snapshot(),
        reset in any::<bool>(),
        encoding in encoding(),
        mutations in prop::collection::vec(mutation(), 1..6),
    ) {
        let mut bytes = if reset {
            packed::encode_changes_as(encoding, &Changes::Reset(snapshot))
        } else {
            packed::encode_snapshot_as(encoding, &snapshot)
        };
        for m in &mutations {
            mutate(&mut bytes, m);
        }
        feed(&bytes);
    }

    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        feed(&bytes);
        let mut prefixed = b"staleguard-packed 1 snapshot\n".to_vec();
        prefixed.extend_from_slice(&bytes);
        feed(&prefixed);
        // Binary records after a header that reads.
        let mut binary = b"staleguard-packed-binary 1 snapshot\nepoch 1\ngeneration 1\n\
            fresh 1\n[services] 2\na/b\nc/d\n[names] 0\n[records] 3\n"
            .to_vec();
        binary.extend_from_slice(&bytes);
        feed(&binary);
    }
}
