use super::*;

fn record() -> IpRecord {
    IpRecord {
        ip: "10.0.0.7".parse().unwrap(),
        pods: vec![PodHolder {
            namespace: "shop".into(),
            name: "cart-7d9f".into(),
            uid: "u-1".into(),
            services: vec![Membership {
                service: ServiceKey::new("shop", "cart"),
                via: Via::Both,
                ports: vec![EndpointPort {
                    name: Some("http".into()),
                    port: 8080,
                    protocol: Some("TCP".into()),
                }],
                conditions: Some(EndpointConditions {
                    ready: true,
                    serving: true,
                    terminating: false,
                }),
            }],
            ready: true,
            terminating: false,
            host_network: false,
        }],
        bare_services: vec![],
        tombstone: None,
    }
}

#[test]
fn the_verdict_view_keeps_what_decide_needs() {
    let full = record();
    let slim = full.clone().verdict_view();
    let service = ServiceKey::new("shop", "cart");
    let strict = crate::Policy {
        terminating: crate::Action::Reject,
        unknown_service: crate::Action::Reject,
        failure_policy: crate::verdict::FailurePolicy::Closed,
    };
    for policy in [crate::Policy::default(), strict] {
        assert_eq!(
            crate::decide(&policy, true, &service, true, Some(&full)),
            crate::decide(&policy, true, &service, true, Some(&slim))
        );
    }
    assert_eq!(slim.pods[0].name, "cart-7d9f");
    assert!(slim.pods[0].uid.is_empty());
    assert!(slim.pods[0].services[0].ports.is_empty());
    let (full_len, slim_len) = (
        serde_json::to_vec(&full).unwrap().len(),
        serde_json::to_vec(&slim).unwrap().len(),
    );
    assert!(slim_len * 2 < full_len, "{slim_len} vs {full_len}");
}

#[test]
fn snapshot_round_trips() {
    let snapshot = Snapshot {
        v: WIRE_VERSION,
        epoch: u64::MAX,
        generation: 42,
        freshness: Freshness {
            fresh: true,
            age_ms: Some(120),
        },
        services: vec![ServiceKey::new("shop", "cart")],
        records: vec![record()],
    };
    let json = serde_json::to_vec(&snapshot).unwrap();
    assert_eq!(Snapshot::from_json(&json).unwrap(), snapshot);
}

#[test]
fn epochs_and_generations_are_read_as_strings_or_numbers() {
    let snapshot = Snapshot {
        v: WIRE_VERSION,
        epoch: 9_271_046_301_922_839_485,
        generation: 42,
        freshness: Freshness::default(),
        services: vec![],
        records: vec![],
    };
    // Written as numbers (what a 0.1 gateway reads), read back exactly.
    let json = serde_json::to_string(&snapshot).unwrap();
    assert!(
        json.contains(r#""epoch":9271046301922839485,"generation":42"#),
        "{json}"
    );
    assert_eq!(Snapshot::from_json(json.as_bytes()).unwrap(), snapshot);
    // The string form, which a reader that holds numbers as doubles
    // keeps exact.
    let strings = br#"{"v":1,"epoch":"9271046301922839485","generation":"42","freshness":{"fresh":false},"services":[],"records":[]}"#;
    assert_eq!(Snapshot::from_json(strings).unwrap(), snapshot);
    let delta = Changes::Delta(Delta {
        v: 1,
        epoch: u64::MAX,
        since: 3,
        generation: 5,
        freshness: Freshness::default(),
        services_added: vec![],
        services_removed: vec![],
        upserts: vec![],
        removed: vec![],
    });
    let strings = br#"{"kind":"delta","v":1,"epoch":"18446744073709551615","since":"3","generation":"5","freshness":{"fresh":false}}"#;
    assert_eq!(Changes::from_json(strings).unwrap(), delta);
    let json = serde_json::to_string(&delta).unwrap();
    assert_eq!(Changes::from_json(json.as_bytes()).unwrap(), delta);
    // Anything else is refused, naming what is accepted.
    for bad in [
        r#""-1""#,
        "-1",
        r#""""#,
        r#""12a""#,
        r#"" 12""#,
        r#""18446744073709551616""#,
        "1.5",
        "null",
    ] {
        let json = format!(
            r#"{{"v":1,"epoch":{bad},"generation":1,"freshness":{{"fresh":true}},"services":[],"records":[]}}"#
        );
        let err = Snapshot::from_json(json.as_bytes()).unwrap_err();
        assert!(err.to_string().contains("decimal string"), "{bad}: {err}");
    }
}

#[test]
fn an_epoch_below_max_epoch_is_exact_as_a_double() {
    let largest = MAX_EPOCH - 1;
    assert_eq!(largest as f64 as u64, largest);
}

#[test]
fn changes_are_tagged_by_kind() {
    let delta = Changes::Delta(Delta {
        v: 1,
        epoch: 7,
        since: 3,
        generation: 5,
        freshness: Freshness::default(),
        services_added: vec![],
        services_removed: vec![],
        upserts: vec![record()],
        removed: vec!["fd00::1".parse().unwrap()],
    });
    let json = serde_json::to_string(&delta).unwrap();
    assert!(json.starts_with(r#"{"kind":"delta""#), "{json}");
    assert_eq!(Changes::from_json(json.as_bytes()).unwrap(), delta);
}

#[test]
fn a_reset_reads_in_any_field_order_and_needs_its_fields() {
    let reset = Changes::Reset(Snapshot {
        v: WIRE_VERSION,
        epoch: 3,
        generation: 9,
        freshness: Freshness::default(),
        services: vec![ServiceKey::new("shop", "cart")],
        records: vec![record()],
    });
    let json = serde_json::to_string(&reset).unwrap();
    assert!(json.starts_with(r#"{"kind":"reset""#), "{json}");
    assert_eq!(Changes::from_json(json.as_bytes()).unwrap(), reset);
    // The tag last, as another encoder may write it.
    let rest = json.replacen(r#""kind":"reset","#, "", 1);
    let reordered = format!(r#"{},"kind":"reset"}}"#, &rest[..rest.len() - 1]);
    assert!(reordered.ends_with(r#""kind":"reset"}"#), "{reordered}");
    assert_eq!(Changes::from_json(reordered.as_bytes()).unwrap(), reset);
    // A reset without records, a delta without `since`: refused, named.
    let no_records = br#"{"kind":"reset","v":1,"epoch":1,"generation":1,"freshness":{"fresh":true},"services":[]}"#;
    let err = Changes::from_json(no_records).unwrap_err().to_string();
    assert!(err.contains("missing field `records`"), "{err}");
    let no_since = br#"{"kind":"delta","v":1,"epoch":1,"generation":1,"freshness":{"fresh":true}}"#;
    let err = Changes::from_json(no_since).unwrap_err().to_string();
    assert!(err.contains("missing field `since`"), "{err}");
}

#[test]
fn a_reset_is_read_without_an_intermediate_tree() {
    // serde's internally tagged derive buffers the whole document into a
    // tree before it looks at the tag, so a bad field is only found once
    // every record has been read, and its error has no position. Read
    // straight into typed fields, the reader stops at the bad field.
    let records = vec![r#"{"ip":"10.0.0.1"}"#; 1_000].join(",");
    let json = format!(
        r#"{{"kind":"reset","v":1,"epoch":"x","generation":1,"freshness":{{"fresh":true}},"services":[],"records":[{records}]}}"#
    );
    let Err(WireError::Malformed { source, .. }) = Changes::from_json(json.as_bytes()) else {
        panic!("an epoch that is no number must be refused");
    };
    // Buffered, the error has no position at all (line 0, column 0).
    assert_eq!(source.line(), 1, "{source}");
    assert!(
        (1..40).contains(&source.column()),
        "read past the bad field: {source}"
    );
}

#[test]
fn unknown_fields_are_ignored_and_defaults_fill_gaps() {
    let json = br#"{"kind":"delta","v":1,"epoch":1,"since":0,"generation":1,
        "freshness":{"fresh":true,"future":"field"},"also_new":[1,2],
        "upserts":[{"ip":"10.1.2.3","pods":[{"namespace":"a","name":"b","extra":true}]}]}"#;
    let Changes::Delta(delta) = Changes::from_json(json).unwrap() else {
        panic!("expected a delta");
    };
    assert_eq!(delta.upserts[0].pods[0].uid, "");
    assert!(delta.removed.is_empty());
}

#[test]
fn other_versions_and_garbage_are_refused_with_a_reason() {
    let v2 =
        br#"{"kind":"delta","v":2,"epoch":1,"since":0,"generation":1,"freshness":{"fresh":true}}"#;
    assert!(matches!(
        Changes::from_json(v2),
        Err(WireError::Version { found: 2, .. })
    ));
    for garbage in [&b""[..], b"{", b"[]", b"{\"kind\":\"nope\"}", b"\xff\xfe"] {
        let err = Changes::from_json(garbage).unwrap_err();
        assert!(err.to_string().starts_with("malformed changes"), "{err}");
    }
    let bad_ip = br#"{"v":1,"epoch":1,"generation":1,"freshness":{"fresh":true},"services":[],"records":[{"ip":"10.0.0.256"}]}"#;
    assert!(Snapshot::from_json(bad_ip).is_err());
}
