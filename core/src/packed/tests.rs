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
/// A delta at generation 5 since 3 (epoch 7) that adds `a/b`, removes
/// `shop/pay`, and carries `upserts` and the `removed` IPs.
fn delta(upserts: Vec<IpRecord>, removed: &[&str]) -> Delta {
    Delta {
        v: WIRE_VERSION,
        epoch: 7,
        since: 3,
        generation: 5,
        freshness: Freshness::default(),
        services_added: vec![key("a/b")],
        services_removed: vec![key("shop/pay")],
        upserts,
        removed: removed.iter().map(|ip| ip.parse().unwrap()).collect(),
    }
}

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
    let Changes::Reset(read) = decode_changes(&reset[..], ServiceKey::clone, |r| r).unwrap() else {
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

    let delta = delta(
        snapshot.records[1..3].to_vec(),
        &["::ffff:10.0.0.1", "fd00::1"],
    );
    let bytes = encode_changes(&Changes::Delta(delta.clone()));
    let Changes::Delta(read) = decode_changes(&bytes[..], ServiceKey::clone, |r| r).unwrap() else {
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
    let Changes::Delta(read) = decode_changes(&bytes[..], ServiceKey::clone, |r| r).unwrap() else {
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
    assert!(record.pods[0].flags.ready);
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

/// Collects what [`visit_snapshot`] hands over, keeping only the IPs it is
/// told to want.
struct Collect {
    services: Vec<ServiceKey>,
    count: usize,
    keep: fn(&IpAddr) -> bool,
    records: Vec<Record<ServiceKey>>,
    stop_after: Option<usize>,
}

impl Visit<ServiceKey> for Collect {
    fn begin(&mut self, services: &[ServiceKey], count: usize) -> std::ops::ControlFlow<()> {
        self.services = services.to_vec();
        self.count = count;
        std::ops::ControlFlow::Continue(())
    }

    fn wants(&mut self, ip: IpAddr) -> bool {
        (self.keep)(&ip)
    }

    fn record(&mut self, record: Record<ServiceKey>) -> std::ops::ControlFlow<()> {
        self.records.push(record);
        match self.stop_after {
            Some(n) if self.records.len() >= n => std::ops::ControlFlow::Break(()),
            _ => std::ops::ControlFlow::Continue(()),
        }
    }
}

fn collect(keep: fn(&IpAddr) -> bool) -> Collect {
    Collect {
        services: vec![],
        count: 0,
        keep,
        records: vec![],
        stop_after: None,
    }
}

#[test]
fn a_visited_snapshot_hands_over_each_record_as_decode_keeps_it() {
    let snapshot = snapshot();
    let bytes = encode_changes(&Changes::Reset(snapshot.clone()));
    let whole = read_snapshot(&bytes).unwrap();
    let mut all = collect(|_| true);
    let head = visit_snapshot(&bytes[..], ServiceKey::clone, &mut all).unwrap();
    assert_eq!(all.records, whole.records);
    assert_eq!(
        (all.count, &all.services),
        (whole.records.len(), &whole.services)
    );
    assert_eq!(
        (head.epoch, head.generation),
        (whole.epoch, whole.generation)
    );
    assert_eq!(head.services, whole.services);
    // Nothing is kept: a `()` per record, which takes no memory.
    assert_eq!(head.records.len(), whole.records.len());
    // A record not wanted is skipped, the others read as before.
    let mut v4 = collect(IpAddr::is_ipv4);
    visit_snapshot(&bytes[..], ServiceKey::clone, &mut v4).unwrap();
    let want: Vec<_> = whole
        .records
        .iter()
        .filter(|r| r.ip.is_ipv4())
        .cloned()
        .collect();
    assert!(!want.is_empty() && want.len() < whole.records.len());
    assert_eq!(v4.records, want);
    // A visitor that stops refuses the document.
    let mut stop = collect(|_| true);
    stop.stop_after = Some(1);
    let err = visit_snapshot(&bytes[..], ServiceKey::clone, &mut stop).unwrap_err();
    assert!(matches!(err, PackedError::Stopped { .. }), "{err}");
    // A cut answer is refused as decode refuses it.
    let cut = &bytes[..bytes.len() - 4];
    assert!(visit_snapshot(cut, ServiceKey::clone, &mut collect(|_| true)).is_err());
}

#[test]
fn the_first_line_tells_a_whole_index_from_a_delta() {
    let snapshot = snapshot();
    assert_eq!(is_whole(&encode_snapshot(&snapshot)), Some(true));
    assert_eq!(
        is_whole(&encode_changes(&Changes::Reset(snapshot))),
        Some(true)
    );
    let delta = Changes::Delta(Delta {
        v: WIRE_VERSION,
        epoch: 1,
        since: 1,
        generation: 2,
        freshness: Freshness::default(),
        services_added: vec![],
        services_removed: vec![],
        upserts: vec![],
        removed: vec![],
    });
    assert_eq!(is_whole(&encode_changes(&delta)), Some(false));
    assert_eq!(is_whole(b"{\"kind\":\"reset\"}"), None);
}

// === the binary encoding ===

fn both(snapshot: &Snapshot) -> [Vec<u8>; 2] {
    [
        encode_snapshot_as(Encoding::Text, snapshot),
        encode_snapshot_as(Encoding::Binary, snapshot),
    ]
}

#[test]
fn a_binary_snapshot_reads_back_as_the_text_one_reads() {
    let snapshot = snapshot();
    let [text, binary] = both(&snapshot);
    assert!(binary.starts_with(b"staleguard-packed-binary 1 snapshot\n"));
    assert!(binary.ends_with(b"end\n"));
    assert_eq!(encoding_of(&binary), Some(Encoding::Binary));
    assert_eq!(encoding_of(&text), Some(Encoding::Text));
    assert!(starts_packed(&binary) && starts_packed(&text));
    let from_text = read_snapshot(&text).unwrap();
    let from_binary = read_snapshot(&binary).unwrap();
    assert_eq!(from_binary.records, from_text.records);
    assert_eq!(
        (
            from_binary.epoch,
            from_binary.generation,
            &from_binary.freshness,
            &from_binary.services
        ),
        (
            from_text.epoch,
            from_text.generation,
            &from_text.freshness,
            &from_text.services
        )
    );
    // Visited, skipping some records unread: the same records as decoded.
    for keep in [(|_: &IpAddr| true) as fn(&IpAddr) -> bool, |ip| {
        ip.is_ipv4()
    }] {
        let (mut a, mut b) = (collect(keep), collect(keep));
        visit_snapshot(&text[..], ServiceKey::clone, &mut a).unwrap();
        visit_snapshot(&binary[..], ServiceKey::clone, &mut b).unwrap();
        assert_eq!(a.records, b.records);
        assert_eq!((a.count, &a.services), (b.count, &b.services));
    }
    // A reset of either encoding is the snapshot with its kind changed.
    let reset = encode_changes_as(Encoding::Binary, &Changes::Reset(snapshot.clone()));
    assert_eq!(reset, reset_of(&binary));
    assert!(reset.starts_with(b"staleguard-packed-binary 1 reset\n"));
    assert_eq!(is_whole(&reset), Some(true));
    let Changes::Reset(read) = decode_changes(&reset[..], ServiceKey::clone, |r| r).unwrap() else {
        panic!("a reset reads as a reset");
    };
    assert_eq!(read.records, from_text.records);
}

#[test]
fn a_binary_delta_reads_back_as_the_text_one_reads() {
    let snapshot = snapshot();
    let delta = Changes::Delta(delta(snapshot.records.clone(), &["::ffff:10.0.0.1"]));
    let text = encode_changes_as(Encoding::Text, &delta);
    let binary = encode_changes_as(Encoding::Binary, &delta);
    assert_eq!(is_whole(&binary), Some(false));
    let read = |bytes: &[u8]| match decode_changes(bytes, ServiceKey::clone, |r| r).unwrap() {
        Changes::Delta(d) => d,
        Changes::Reset(_) => panic!("a delta reads as a delta"),
    };
    let (t, b) = (read(&text), read(&binary));
    assert_eq!(b.upserts, t.upserts);
    assert_eq!(
        (
            b.epoch,
            b.since,
            b.generation,
            &b.removed,
            &b.services_added
        ),
        (
            t.epoch,
            t.since,
            t.generation,
            &t.removed,
            &t.services_added
        )
    );
    assert_eq!(b.services_removed, t.services_removed);
}

/// A snapshot of `n` IPv4 pods of one service each, among 1,000 services:
/// the benchmark's shape.
fn large(n: u32) -> Snapshot {
    let mut snapshot = snapshot();
    snapshot.services = (0..1_000).map(|i| key(&format!("ns-{i}/svc"))).collect();
    snapshot.records = (0..n)
        .map(|i| {
            let ip = IpAddr::from([10, (i >> 16) as u8, (i >> 8) as u8, i as u8]);
            let mut pod = pod(&format!("svc-{i:06}"), &[], true, false);
            pod.services = vec![Membership {
                service: key(&format!("ns-{}/svc", i % 1_000)),
                via: Via::Both,
                ports: vec![],
                conditions: None,
            }];
            IpRecord::held_by(ip, vec![pod])
        })
        .collect();
    snapshot
}

#[test]
fn a_binary_record_of_a_live_pod_is_12_or_13_bytes() {
    let snapshot = large(10_000);
    let [text, binary] = both(&snapshot);
    let head = encode_snapshot_as(
        Encoding::Binary,
        &Snapshot {
            records: vec![],
            ..snapshot.clone()
        },
    );
    let per_record = (binary.len() - head.len()) as f64 / 10_000.0;
    // Header, address 4, head, fingerprint 4, pod, service (1 or 2 bytes).
    assert!((12.0..=13.0).contains(&per_record), "{per_record}");
    assert!(
        binary.len() * 2 < text.len(),
        "{} against {}",
        binary.len(),
        text.len()
    );
    assert_eq!(
        read_snapshot(&binary).unwrap().records,
        read_snapshot(&text).unwrap().records
    );
}

#[test]
fn counts_past_four_bits_take_a_number_of_their_own() {
    let mut snapshot = snapshot();
    let services: Vec<String> = (0..20).map(|i| format!("shop/s{i}")).collect();
    let names: Vec<&str> = services.iter().map(String::as_str).collect();
    let pods: Vec<PodHolder> = (0..17)
        .map(|i| pod(&format!("p{i}"), &names[..i], i % 2 == 0, i % 3 == 0))
        .collect();
    snapshot.records = vec![IpRecord::held_by("192.168.0.9".parse().unwrap(), pods)];
    let [text, binary] = both(&snapshot);
    let read = read_snapshot(&binary).unwrap();
    assert_eq!(read.records, read_snapshot(&text).unwrap().records);
    assert_eq!(read.records[0].pods.len(), 17);
    assert_eq!(read.records[0].pods[16].services.len(), 16);
}

/// `bytes` with its records' list replaced by `records`, written raw.
fn with_records(bytes: &[u8], count: usize, records: &[u8]) -> Vec<u8> {
    let marker = b"[records] ";
    let at = bytes
        .windows(marker.len())
        .position(|w| w == marker)
        .unwrap();
    let mut out = bytes[..at].to_vec();
    out.extend_from_slice(format!("[records] {count}\n").as_bytes());
    out.extend_from_slice(records);
    out.extend_from_slice(b"end\n");
    out
}

fn empty_binary() -> Vec<u8> {
    let mut snapshot = snapshot();
    snapshot.records.clear();
    encode_snapshot_as(Encoding::Binary, &snapshot)
}

#[test]
fn a_binary_records_later_fields_and_flags_are_skipped() {
    let base = empty_binary();
    // 10.0.0.1: a fingerprint, a pod (ready, and flag bit 8 of a later
    // release) of service 2, then two bytes of a later field.
    let body = [0x11, 1, 2, 3, 4, 0x19, 2, 0xee, 0xff];
    let mut record = vec![(body.len() as u8) << 1, 10, 0, 0, 1];
    record.extend_from_slice(&body);
    // A field of a later release before the list, too.
    let bytes = with_records(&base, 1, &record);
    let bytes = [
        &b"staleguard-packed-binary 1 snapshot\nfuture x\n"[..],
        &bytes[36..],
    ]
    .concat();
    let read = read_snapshot(&bytes).unwrap();
    let record = &read.records[0];
    assert_eq!(record.ip, "10.0.0.1".parse::<IpAddr>().unwrap());
    assert_eq!(record.fingerprint, 0x0403_0201);
    assert_eq!(record.pods.len(), 1);
    assert_eq!(
        record.pods[0].flags,
        PodFlags {
            ready: true,
            ..PodFlags::default()
        }
    );
    assert_eq!(record.pods[0].services, vec![key("pay/pay")]);
    assert_eq!(
        (record.bare_services.len(), record.tombstone.is_none()),
        (0, true)
    );
}

#[test]
fn a_cut_or_damaged_binary_document_is_refused() {
    let bytes = encode_snapshot_as(Encoding::Binary, &snapshot());
    for cut in 0..bytes.len() {
        assert!(read_snapshot(&bytes[..cut]).is_err(), "cut at {cut}");
        let reset = reset_of(&bytes);
        let cut = cut.min(reset.len() - 1);
        assert!(decode_changes(&reset[..cut], ServiceKey::clone, |r| r).is_err());
    }
    let base = empty_binary();
    let cases: [(&[u8], &str); 6] = [
        // A service past the table.
        (&[6, 10, 0, 0, 1, 0x10, 0x11, 99], "names no service"),
        // A body shorter than its fields.
        (&[4, 10, 0, 0, 1, 0x11, 1], "ends inside its fields"),
        // A length with a needless zero byte: one spelling only.
        (&[0x86, 0x00, 10, 0, 0, 1, 0, 0, 0], "length does not read"),
        // A length past the largest record, which nothing is allocated for.
        (&[0xff, 0xff, 0xff, 0xff, 0x0f], "longer than"),
        // An empty body.
        (&[0, 10, 0, 0, 1], "ends inside its fields"),
        // A count of pods with more pods than bytes.
        (
            &[6, 10, 0, 0, 1, 0xf0, 0xff, 0x01],
            "ends inside its fields",
        ),
    ];
    for (record, says) in cases {
        let err = read_snapshot(&with_records(&base, 1, record))
            .unwrap_err()
            .to_string();
        assert!(err.contains(says), "{record:?}: {err}");
        assert!(err.contains("record 0"), "{err}");
    }
    // More records stated than the document holds: `end` is not a record.
    let err = read_snapshot(&with_records(&base, 2, &[2, 10, 0, 0, 1, 0]))
        .unwrap_err()
        .to_string();
    assert!(err.contains("ends before `end`"), "{err}");
    let records = [0x30u8; 64];
    assert!(read_snapshot(&with_records(&base, usize::MAX, &records)).is_err());
}

#[test]
fn the_packed_encoding_asked_for_is_the_heaviest_binary_first() {
    let asked = |accept: &str| Encoding::accepted([accept]);
    let ours = "application/vnd.staleguard.packed-binary, \
        application/vnd.staleguard.packed;q=0.9, application/json;q=0.5";
    assert_eq!(asked(ours), Some(Encoding::Binary));
    // The last release's gateway: text.
    let old = "application/vnd.staleguard.packed, application/json;q=0.5";
    assert_eq!(asked(old), Some(Encoding::Text));
    for (accept, want) in [
        (BINARY_MEDIA_TYPE, Some(Encoding::Binary)),
        (MEDIA_TYPE, Some(Encoding::Text)),
        // Equal weights: binary, in either order.
        (
            "application/vnd.staleguard.packed, APPLICATION/VND.STALEGUARD.PACKED-BINARY",
            Some(Encoding::Binary),
        ),
        // Weights decide, not the order.
        (
            "application/vnd.staleguard.packed-binary;q=0.2, application/vnd.staleguard.packed",
            Some(Encoding::Text),
        ),
        ("application/vnd.staleguard.packed-binary; Q=0", None),
        ("application/vnd.staleguard.packed-binary;q=high", None),
        (
            "application/json, application/vnd.staleguard.packed;q=0.4",
            None,
        ),
        (
            "application/json;q=0.5, application/vnd.staleguard.packed; q=1",
            Some(Encoding::Text),
        ),
        ("application/vnd.staleguard.packedx", None),
        ("application/vnd.staleguard.packed-binaryx", None),
        ("*/*", None),
        ("", None),
    ] {
        assert_eq!(asked(accept), want, "{accept}");
    }
    // Several header values count together.
    assert_eq!(
        Encoding::accepted(["application/json;q=0.1", BINARY_MEDIA_TYPE]),
        Some(Encoding::Binary)
    );
}
