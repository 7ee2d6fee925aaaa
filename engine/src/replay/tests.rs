use super::*;

fn h(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

fn member(ip: &str, ports: &[u16]) -> Member {
    Member {
        ip: ip.parse().unwrap(),
        ports: ports.to_vec(),
    }
}

fn sa(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

#[test]
fn only_bodiless_plain_requests_of_listed_methods_are_eligible() {
    let r = RetryConfig::default();
    let get = h(&[(":method", "GET"), (":path", "/")]);
    assert_eq!(eligibility(&r, &get, true), Ok(()));
    assert_eq!(eligibility(&r, &get, false), Err(Ineligible::Body));
    let head = h(&[(":method", "HEAD")]);
    assert_eq!(eligibility(&r, &head, true), Ok(()));
    let delete = h(&[(":method", "DELETE")]);
    assert_eq!(eligibility(&r, &delete, true), Err(Ineligible::Method));
    let post = h(&[(":method", "POST"), ("content-length", "3")]);
    assert_eq!(eligibility(&r, &post, false), Err(Ineligible::Body));
    let ws = h(&[
        (":method", "GET"),
        ("connection", "keep-alive, Upgrade"),
        ("upgrade", "websocket"),
    ]);
    assert_eq!(eligibility(&r, &ws, true), Err(Ineligible::Upgrade));
    let connect = h(&[(":method", "CONNECT")]);
    assert_eq!(eligibility(&r, &connect, false), Err(Ineligible::Connect));
    let grpc = h(&[
        (":method", "POST"),
        ("content-type", "application/grpc+proto"),
    ]);
    assert_eq!(eligibility(&r, &grpc, true), Err(Ineligible::Grpc));
    let custom = RetryConfig {
        methods: vec!["DELETE".into()],
        ..RetryConfig::default()
    };
    assert_eq!(eligibility(&custom, &delete, true), Ok(()));
    assert_eq!(eligibility(&custom, &get, true), Err(Ineligible::Method));
}

#[test]
fn the_plan_skips_the_stale_ip_spreads_and_batches() {
    let r = RetryConfig {
        attempts: 2,
        hosts_per_attempt: 2,
        ..RetryConfig::default()
    };
    let members: Vec<Member> = (1..=6)
        .map(|i| member(&format!("10.0.0.{i}"), &[]))
        .collect();
    let stale = sa("10.0.0.1:8080");
    let batches = plan(&r, &members, stale, 0);
    assert_eq!(
        batches,
        vec![
            vec![sa("10.0.0.2:8080"), sa("10.0.0.3:8080")],
            vec![sa("10.0.0.4:8080"), sa("10.0.0.5:8080")],
        ]
    );
    // Different seeds lead with different members, all of them.
    let firsts: std::collections::BTreeSet<SocketAddr> = (0..50)
        .map(|seed| plan(&r, &members, stale, seed)[0][0])
        .collect();
    assert_eq!(firsts.len(), 5);
    assert!(plan(&r, &[member("10.0.0.1", &[])], stale, 3).is_empty());
    assert!(plan(&r, &[], stale, 3).is_empty());
}

#[test]
fn the_port_is_the_stale_picks_unless_the_index_says_otherwise() {
    assert_eq!(member_port(&member("10.0.0.2", &[]), 80), Some(80));
    assert_eq!(member_port(&member("10.0.0.2", &[80, 81]), 80), Some(80));
    assert_eq!(member_port(&member("10.0.0.2", &[8080]), 80), Some(8080));
    assert_eq!(member_port(&member("10.0.0.2", &[81, 82]), 80), None);
    let batches = plan(
        &RetryConfig::default(),
        &[member("fd00::2", &[])],
        sa("[fd00::1]:80"),
        0,
    );
    assert_eq!(endpoint_value(&batches[0]), "[fd00::2]:80");
}

#[test]
fn the_replayed_request_keeps_the_request_and_names_the_hosts() {
    let req = h(&[
        (":method", "GET"),
        (":path", "/rewritten/x?q=1"),
        (":authority", "cart.shop"),
        ("x-request-id", "abc"),
        ("connection", "close"),
        ("x-envoy-expected-rq-timeout-ms", "5000"),
        ("x-gateway-destination-endpoint", "6.6.6.6:1"),
    ]);
    let out = request_headers(
        &req,
        "x-gateway-destination-endpoint",
        &[sa("10.0.0.2:80"), sa("10.0.0.3:80")],
    );
    assert_eq!(
        out,
        h(&[
            (":method", "GET"),
            (":path", "/rewritten/x?q=1"),
            (":authority", "cart.shop"),
            ("x-request-id", "abc"),
            ("x-gateway-destination-endpoint", "10.0.0.2:80,10.0.0.3:80"),
        ])
    );
}

#[test]
fn the_client_gets_the_live_hosts_headers_and_nothing_of_the_twin() {
    let answer = h(&[
        (":status", "201"),
        ("content-type", "text/plain"),
        ("x-host", "cart-2"),
        ("transfer-encoding", "chunked"),
        ("x-envoy-upstream-service-time", "3"),
        ("x-staleguard-twin-miss", "1"),
        ("set-cookie", "a=1"),
        ("set-cookie", "b=2"),
    ]);
    assert_eq!(
        response_headers(&answer),
        h(&[
            ("content-type", "text/plain"),
            ("x-host", "cart-2"),
            ("set-cookie", "a=1"),
            ("set-cookie", "b=2"),
        ])
    );
}

#[test]
fn a_head_gets_a_filler_of_the_answers_length() {
    let head = h(&[(":method", "HEAD")]);
    let get = h(&[(":method", "GET")]);
    let answer = h(&[("content-length", "42")]);
    assert_eq!(head_filler(&head, &answer), Some(42));
    assert_eq!(head_filler(&get, &answer), None);
    assert_eq!(head_filler(&head, &h(&[("content-length", "0")])), None);
    assert_eq!(
        head_filler(&head, &h(&[("content-length", "999999999")])),
        None
    );
    assert_eq!(head_filler(&head, &[]), None);
}

#[test]
fn the_timeout_is_the_routes_when_readable() {
    let r = RetryConfig::default();
    assert_eq!(
        timeout_ms(&r, &h(&[(EXPECTED_TIMEOUT_HEADER, "2500")])),
        2500
    );
    assert_eq!(
        timeout_ms(&r, &h(&[(EXPECTED_TIMEOUT_HEADER, "0")])),
        15_000
    );
    assert_eq!(
        timeout_ms(&r, &h(&[(EXPECTED_TIMEOUT_HEADER, "x")])),
        15_000
    );
    assert_eq!(timeout_ms(&r, &[]), 15_000);
}

#[test]
fn a_replay_walks_the_batches_until_an_answer_or_the_end() {
    let b = |s: &str| vec![sa(s)];
    let (mut replay, first) = Replay::start(vec![b("10.0.0.2:80"), b("10.0.0.3:80")], 1_000, 500);
    assert_eq!(
        first,
        Step::Send {
            hosts: b("10.0.0.2:80"),
            timeout_ms: 500
        }
    );
    assert_eq!(
        replay.on_result(1_100, CallResult::TwinMiss),
        Step::Send {
            hosts: b("10.0.0.3:80"),
            timeout_ms: 400
        }
    );
    assert_eq!(replay.attempts(), 2);
    assert_eq!(
        replay.on_result(1_200, CallResult::Failed),
        Step::Fail(ReplayOutcome::Exhausted)
    );
    let (mut replay, _) = Replay::start(vec![b("10.0.0.2:80")], 0, 500);
    assert_eq!(replay.on_result(10, CallResult::Answer), Step::Deliver);
    let (mut replay, _) = Replay::start(vec![b("10.0.0.2:80"), b("10.0.0.3:80")], 0, 500);
    assert_eq!(
        replay.on_result(500, CallResult::Failed),
        Step::Fail(ReplayOutcome::Timeout)
    );
    let (mut replay, _) = Replay::start(vec![b("10.0.0.2:80"), b("10.0.0.3:80")], 0, 500);
    assert_eq!(
        replay.on_result(499, CallResult::TimedOut),
        Step::Fail(ReplayOutcome::Timeout)
    );
    assert_eq!(
        Replay::start(vec![], 0, 500).1,
        Step::Fail(ReplayOutcome::Exhausted)
    );
}

#[test]
fn headers_that_are_not_text_are_not_replayed() {
    assert_eq!(
        text_headers(vec![("a".into(), b"ok".to_vec())]),
        Ok(h(&[("a", "ok")]))
    );
    assert_eq!(
        text_headers(vec![("a".into(), vec![0xff])]),
        Err(Ineligible::Encoding)
    );
}

#[test]
fn only_a_hosts_answer_is_an_answer() {
    let r = RetryConfig::default();
    assert_eq!(classify(&r, None, 0), CallResult::Failed);
    let host = h(&[(":status", "500"), (UPSTREAM_TIME_HEADER, "3")]);
    assert_eq!(classify(&r, Some(&host), 5), CallResult::Answer);
    let envoy_timeout = h(&[(":status", "504"), ("content-type", "text/plain")]);
    assert_eq!(classify(&r, Some(&envoy_timeout), 0), CallResult::TimedOut);
    let refused = h(&[(":status", "503"), ("content-type", "text/plain")]);
    assert_eq!(classify(&r, Some(&refused), 0), CallResult::Failed);
    let miss = h(&[(":status", "503"), (TWIN_MISS_HEADER, "1")]);
    assert_eq!(classify(&r, Some(&miss), 0), CallResult::TwinMiss);
}

#[test]
fn retry_max_answer_bytes_refuses_a_larger_answer() {
    let r = RetryConfig {
        max_answer_bytes: 100,
        ..RetryConfig::default()
    };
    let host = h(&[(":status", "200"), (UPSTREAM_TIME_HEADER, "3")]);
    assert_eq!(classify(&r, Some(&host), 100), CallResult::Answer);
    assert_eq!(classify(&r, Some(&host), 101), CallResult::TooLarge);
    assert_eq!(RetryConfig::default().max_answer_bytes, 1 << 20);
    let (mut replay, _) = Replay::start(vec![vec![sa("10.0.0.2:80")]], 0, 500);
    assert_eq!(
        replay.on_result(10, CallResult::TooLarge),
        Step::Fail(ReplayOutcome::AnswerTooLarge)
    );
}

#[test]
fn stale_verdicts_are_not_replayed_and_only_replayed_answers_count_as_retry() {
    use staleguard_core::Reason;
    assert_eq!(reason_allows_replay(Reason::Stale), Err(Ineligible::Stale));
    assert_eq!(reason_allows_replay(Reason::Destroyed), Ok(()));
    assert_eq!(reason_allows_replay(Reason::Recycled), Ok(()));
    assert!(counts_as_retry(ReplayOutcome::Answered));
    assert!(counts_as_retry(ReplayOutcome::Timeout));
    assert!(!counts_as_retry(ReplayOutcome::Exhausted));
    assert!(!counts_as_retry(ReplayOutcome::NotEligible(
        Ineligible::Body
    )));
}

#[test]
fn outcome_labels_are_distinct() {
    let labels: std::collections::BTreeSet<_> =
        ReplayOutcome::ALL.iter().map(|o| o.as_str()).collect();
    assert_eq!(labels.len(), ReplayOutcome::ALL.len());
}

#[test]
fn the_twin_lets_through_only_named_hosts() {
    let named = Some("10.0.0.2:80,[fd00::3]:80");
    assert!(twin_pick_is_named(named, Some("10.0.0.2:80")));
    assert!(twin_pick_is_named(named, Some("[fd00::3]:80")));
    assert!(twin_pick_is_named(named, Some("[::ffff:10.0.0.2]:80")));
    assert!(!twin_pick_is_named(named, Some("10.0.0.2:81")));
    assert!(!twin_pick_is_named(named, Some("10.0.0.9:80")));
    assert!(!twin_pick_is_named(None, Some("10.0.0.2:80")));
    assert!(!twin_pick_is_named(named, None));
    assert!(!twin_pick_is_named(Some("garbage"), Some("10.0.0.2:80")));
}

#[test]
fn twin_configurations_are_recognised_and_checked() {
    assert_eq!(
        TwinConfig::parse(br#"{"validator_cluster":"sg"}"#),
        Ok(None)
    );
    assert_eq!(TwinConfig::parse(b"not json"), Ok(None));
    assert_eq!(
        TwinConfig::parse(br#"{"replay_twin":{}}"#),
        Ok(Some(TwinConfig {
            endpoint_header: "x-gateway-destination-endpoint".into()
        }))
    );
    assert!(TwinConfig::parse(br#"{"replay_twin":{"endpint_header":"x"}}"#).is_err());
    assert!(TwinConfig::parse(br#"{"replay_twin":{},"validator_cluster":"sg"}"#).is_err());
    assert!(TwinConfig::parse(br#"{"replay_twin":{"endpoint_header":"X Y"}}"#).is_err());
}

/// What each kind of mistake in a twin's document is called.
#[test]
fn a_twin_configuration_that_does_not_read_says_what_is_wrong() {
    for (doc, says) in [
        (
            r#"{"replay_twin":{"endpint_header":"x"}}"#,
            "unknown field `endpint_header`, expected `endpoint_header`",
        ),
        (
            r#"{"replay_twin":{},"validator_cluster":"sg"}"#,
            "unknown field `validator_cluster`, expected `replay_twin`",
        ),
        (
            r#"{"replay_twin":{"endpoint_header":1}}"#,
            "invalid type: integer `1`, expected a string",
        ),
        (
            r#"{"replay_twin":null}"#,
            "invalid type: null, expected struct TwinConfig",
        ),
    ] {
        let refusal = TwinConfig::parse(doc.as_bytes()).unwrap_err();
        assert!(
            refusal.starts_with("plugin configuration of a replay twin refused: ")
                && refusal.contains(says),
            "{doc}: {refusal}"
        );
    }
}
