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
