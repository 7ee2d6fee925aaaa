use super::*;
use staleguard_core::verdict::FailurePolicy;

#[test]
fn minimal_config_takes_defaults() {
    let c = Config::parse(br#"{"validator_cluster":"sg"}"#).unwrap();
    assert_eq!(c.poll_wait_s, 30);
    assert_eq!(c.reject_status, 503);
    assert_eq!(c.reject_header, "x-staleguard");
    assert_eq!(c.mode, Mode::Enforce);
    assert_eq!(c.policy.failure_policy, FailurePolicy::Open);
    assert!(c.istio);
    assert_eq!(c.authority, "sg");
    assert_eq!(c.guard, GuardConfig::default());
    assert!(c.guard.enabled);
}

#[test]
fn guard_knobs_parse_and_are_checked() {
    let c = Config::parse(
        br#"{"validator_cluster":"sg","guard":{"max_loss_percent":80,"confirm_ms":5000}}"#,
    )
    .unwrap();
    assert_eq!(c.guard.max_loss_percent, 80);
    assert_eq!(c.guard.confirm_ms, 5_000);
    assert_eq!(c.guard.min_ips, GuardConfig::default().min_ips);
    let err = Config::parse(
        br#"{"validator_cluster":"sg","guard":{"max_loss_percent":0,"min_service_ips":0}}"#,
    )
    .unwrap_err();
    assert!(err.to_string().contains("guard.max_loss_percent"), "{err}");
    assert!(err.to_string().contains("guard.min_service_ips"), "{err}");
    let err = Config::parse(br#"{"validator_cluster":"sg","guard":{"enable":false}}"#).unwrap_err();
    assert!(err.to_string().contains("unknown field `enable`"), "{err}");
}

#[test]
fn full_config_parses() {
    let c = Config::parse(
        br#"{"validator_cluster":"sg","validator_authority":"v.sg.svc","token":"abc",
        "poll_wait_s":1,"max_staleness_ms":3000,"tick_ms":100,"lease_ttl_ms":500,
        "backoff_initial_ms":50,"backoff_max_ms":1000,"mode":"audit",
        "reject_status":502,"reject_header":"x-sg","istio":false,
        "policy":{"failure_policy":"closed","terminating":"reject"},
        "clusters":[{"name":"cart","service":"shop/cart"},{"prefix":"pay-","service":"shop/pay"}]}"#,
    )
    .unwrap();
    assert_eq!(c.mode, Mode::Audit);
    assert_eq!(c.clusters.len(), 2);
    assert_eq!(c.authority, "v.sg.svc");
}

#[test]
fn no_debug_output_of_the_configuration_shows_the_token() {
    let token = "s3cret-token-0123456789abcdef0123";
    let json = format!(r#"{{"validator_cluster":"sg","token":"{token}"}}"#);
    let c = Config::parse(json.as_bytes()).unwrap();
    for shown in [
        format!("{c:?}"),
        format!("{c:#?}"),
        format!("{:?}", c.token),
    ] {
        assert!(!shown.contains(token), "{shown}");
        assert!(shown.contains("<redacted>"), "{shown}");
    }
    assert_eq!(c.token.as_ref().map(Secret::expose), Some(token));
    // Nor does a refusal: the message names the field, not the value.
    let bad = format!(r#"{{"validator_cluster":"","token":"{token} x"}}"#);
    let err = Config::parse(bad.as_bytes()).unwrap_err();
    for shown in [err.to_string(), format!("{err:?}")] {
        assert!(!shown.contains("s3cret"), "{shown}");
    }
}

#[test]
fn unknown_fields_are_refused() {
    let err = Config::parse(br#"{"validator_cluster":"sg","mdoe":"audit"}"#).unwrap_err();
    assert!(err.to_string().contains("unknown field `mdoe`"), "{err}");
    let err = Config::parse(br#"{"validator_cluster":"sg","policy":{"fail":"open"}}"#).unwrap_err();
    assert!(
        err.to_string()
            .contains("policy.fail: unknown field `fail`, expected one of `failure_policy`"),
        "{err}"
    );
}

#[test]
fn every_type_error_and_unknown_field_is_reported_with_its_field() {
    // serde alone stops at the first of these (issue 25).
    let err = Config::parse(
        br#"{"validator_cluster":"sg","poll_wait_s":"30","mode":1,"mdoe":"audit",
        "policy":{"failure_policy":"opn","fail":1},"guard":{"enable":false},
        "clusters":[{"name":"a","service":"shop/a"},{"name":2,"service":"shop/b"},{"name":"c"}],
        "retry":{"methods":["GET",7]},"tick_ms":-1}"#,
    )
    .unwrap_err();
    let ConfigError::Invalid(problems) = err else {
        panic!("expected Invalid, got {err}");
    };
    let all = problems.join("\n");
    for expected in [
        r#"poll_wait_s: invalid type: string "30", expected u32"#,
        "mode: invalid type: integer `1`, expected",
        "mdoe: unknown field `mdoe`, expected one of `validator_cluster`",
        "policy.failure_policy: unknown variant `opn`, expected `open` or `closed`",
        "policy.fail: unknown field `fail`",
        "guard.enable: unknown field `enable`",
        "clusters[1].name: invalid type: integer `2`, expected a string",
        "clusters[2]: missing field `service`",
        "retry.methods[1]: invalid type: integer `7`, expected a string",
        "tick_ms: invalid value: integer `-1`, expected u64",
    ] {
        assert!(all.contains(expected), "no {expected:?} in:\n{all}");
    }
    // And the rule check of the cluster whose `name` was left out.
    assert!(all.contains("clusters[1] needs exactly one"), "{all}");
    assert_eq!(problems.len(), 11, "{all}");
}

#[test]
fn a_missing_or_mistyped_validator_cluster_is_named_once() {
    let err = Config::parse(br#"{"mode":"audit"}"#).unwrap_err();
    assert_eq!(
        err.problems(),
        ["validator_cluster is missing: name the Envoy cluster that reaches the validator"]
    );
    let err = Config::parse(br#"{"validator_cluster":["sg"],"poll_wait_s":0}"#).unwrap_err();
    let problems = err.problems();
    assert_eq!(problems.len(), 2, "{problems:?}");
    assert!(
        problems[0].starts_with("poll_wait_s must be at least 1")
            || problems[1].starts_with("poll_wait_s must be at least 1"),
        "{problems:?}"
    );
    assert!(
        problems
            .iter()
            .any(|p| p.starts_with("validator_cluster: invalid type: sequence")),
        "{problems:?}"
    );
}

#[test]
fn json_that_is_not_an_object_is_named_for_what_it_is() {
    let err = Config::parse(b"[]").unwrap_err();
    assert_eq!(
        err.problems(),
        ["the plugin configuration must be a JSON object, not an array"]
    );
    assert!(matches!(
        Config::parse(b"{"),
        Err(ConfigError::Malformed(_))
    ));
}

#[test]
fn a_mistyped_token_is_named_without_its_value() {
    let err = Config::parse(br#"{"validator_cluster":"sg","token":123456789}"#).unwrap_err();
    assert_eq!(
        err.problems(),
        ["token: must be a string (value not shown)"]
    );
}

#[test]
fn the_fallback_reads_the_failure_policy_of_a_refused_document() {
    let open = Fallback::read(br#"{"mdoe":1}"#);
    assert_eq!(open.failure_policy, FailurePolicy::Open);
    assert_eq!(
        (open.reject_status, open.reject_header.as_str()),
        (503, "x-staleguard")
    );
    let closed = Fallback::read(
        br#"{"policy":{"failure_policy":"closed","fail":1},"reject_status":429,"reject_header":"x-sg"}"#,
    );
    assert_eq!(closed.failure_policy, FailurePolicy::Closed);
    assert_eq!(
        (closed.reject_status, closed.reject_header.as_str()),
        (429, "x-sg")
    );
    assert!(closed.describe().contains("rejects every request with 429"));
    let junk = Fallback::read(b"\xff not json");
    assert_eq!(junk, open);
}

#[test]
fn a_zero_wait_is_refused() {
    let err = Config::parse(br#"{"validator_cluster":"sg","poll_wait_s":0}"#).unwrap_err();
    assert!(
        err.to_string().contains("poll_wait_s must be at least 1"),
        "{err}"
    );
}

#[test]
fn every_problem_is_reported_together() {
    let err = Config::parse(
        br#"{"validator_cluster":"","poll_wait_s":61,"max_staleness_ms":1000,"tick_ms":5,
        "reject_status":99,"reject_header":"X Bad","token":"",
        "clusters":[{"service":"a/b"}]}"#,
    )
    .unwrap_err();
    let ConfigError::Invalid(problems) = err else {
        panic!("expected Invalid, got {err}");
    };
    assert_eq!(problems.len(), 8, "{problems:?}");
}

#[test]
fn retry_is_the_default_where_a_replay_path_is_configured() {
    let plain = Config::parse(br#"{"validator_cluster":"sg"}"#).unwrap();
    assert!(plain.replay().is_none());
    assert_eq!(plain.retry_warning(), None);
    let with_path = Config::parse(br#"{"validator_cluster":"sg","retry":{}}"#).unwrap();
    let retry = with_path.replay().unwrap();
    assert_eq!(retry.twin_suffix, "|staleguard-twin");
    assert_eq!(retry.methods, ["GET", "HEAD", "OPTIONS"]);
    assert_eq!((retry.attempts, retry.hosts_per_attempt), (3, 8));
    let opted_out =
        Config::parse(br#"{"validator_cluster":"sg","retry":{},"on_reject":"reject"}"#).unwrap();
    assert!(opted_out.replay().is_none());
}

/// `deploy/istio/twins.py` makes the twins for Istio, in Python: its
/// naming rule and default suffix must be the engine's.
#[test]
fn twins_py_names_twins_as_the_engine_does_with_the_default_twin_suffix_and_endpoint_header() {
    let script = include_str!("../../../deploy/istio/twins.py");
    let retry = RetryConfig::default();
    let default = format!(
        r#"p.add_argument("--suffix", default="{}""#,
        retry.twin_suffix
    );
    assert!(
        script.contains(&default),
        "twins.py's --suffix default is not {:?}",
        retry.twin_suffix
    );
    let header = format!(
        r#"p.add_argument("--header", default="{}""#,
        retry.endpoint_header
    );
    assert!(
        script.contains(&header),
        "twins.py's --header default is not {:?}",
        retry.endpoint_header
    );
    // `<cluster><suffix>`: the name and the EDS cluster name.
    assert!(script.contains(r#"t["name"] = name + suffix"#));
    assert_eq!(
        retry.twin_name("outbound|80||cart.shop.svc.cluster.local"),
        "outbound|80||cart.shop.svc.cluster.local|staleguard-twin"
    );
}

#[test]
fn retry_that_cannot_work_says_why() {
    let no_path = Config::parse(br#"{"validator_cluster":"sg","on_reject":"retry"}"#).unwrap();
    assert!(no_path.replay().is_none());
    assert!(no_path.retry_warning().unwrap().contains("no replay path"));
    let audit = Config::parse(
        br#"{"validator_cluster":"sg","on_reject":"retry","retry":{},"mode":"audit"}"#,
    )
    .unwrap();
    assert!(audit.replay().is_none());
    assert!(audit.retry_warning().unwrap().contains("audit"));
    let audit_by_default =
        Config::parse(br#"{"validator_cluster":"sg","retry":{},"mode":"audit"}"#).unwrap();
    assert!(audit_by_default.retry_warning().unwrap().contains("audit"));
    let working = Config::parse(br#"{"validator_cluster":"sg","retry":{}}"#).unwrap();
    assert_eq!(working.retry_warning(), None);
}

#[test]
fn bad_retry_settings_are_reported_together() {
    let err = Config::parse(
        br#"{"validator_cluster":"sg","retry":{"twin_suffix":"","methods":["get","CONNECT"],
        "attempts":0,"hosts_per_attempt":65,"timeout_ms":0,"endpoint_header":"X"}}"#,
    )
    .unwrap_err();
    let ConfigError::Invalid(problems) = err else {
        panic!("expected Invalid, got {err}");
    };
    assert_eq!(problems.len(), 7, "{problems:?}");
    let err = Config::parse(br#"{"validator_cluster":"sg","retry":{"atempts":2}}"#).unwrap_err();
    assert!(err.to_string().contains("unknown field `atempts`"), "{err}");
}

#[test]
fn tick_ms_reject_status_and_the_retry_counts_outside_their_ranges_name_field_value_and_range() {
    let err = Config::parse(
        br#"{"validator_cluster":"sg","tick_ms":9,"lease_ttl_ms":60000,"reject_status":600,
        "retry":{"attempts":11,"hosts_per_attempt":0,"timeout_ms":3600001,
        "max_answer_bytes":67108865}}"#,
    )
    .unwrap_err();
    assert_eq!(
        err.problems(),
        [
            "tick_ms 9 not in 10..=60000",
            "reject_status 600 not in 200..=599",
            "retry.attempts 11 not in 1..=10",
            "retry.hosts_per_attempt 0 not in 1..=64",
            "retry.timeout_ms 3600001 not in 1..=3600000",
            "retry.max_answer_bytes 67108865 not in 1..=67108864",
        ]
    );
}

#[test]
fn the_token_can_come_from_the_vm_environment() {
    let env = |name: &str| (name == "SG_TOKEN").then(|| "s3cret\n".to_owned());
    let c = Config::parse_with_env(br#"{"validator_cluster":"sg","token_env":"SG_TOKEN"}"#, env)
        .unwrap();
    assert_eq!(
        c.token.as_ref().map(Secret::expose),
        Some("s3cret"),
        "a Secret file's newline is cut"
    );

    let err = Config::parse_with_env(br#"{"validator_cluster":"sg","token_env":"MISSING"}"#, env)
        .unwrap_err();
    assert!(err.to_string().contains("\"MISSING\" is not set"), "{err}");

    let err = Config::parse_with_env(
        br#"{"validator_cluster":"sg","token":"a","token_env":"SG_TOKEN"}"#,
        env,
    )
    .unwrap_err();
    assert!(err.to_string().contains("not both"), "{err}");

    let empty = |_: &str| Some(String::new());
    let err = Config::parse_with_env(
        br#"{"validator_cluster":"sg","token_env":"SG_TOKEN"}"#,
        empty,
    )
    .unwrap_err();
    assert!(err.to_string().contains("non-empty"), "{err}");
}

#[test]
fn garbage_is_refused() {
    for bad in [
        &b""[..],
        b"null",
        b"[]",
        b"{",
        b"\xff",
        br#"{"validator_cluster":1}"#,
    ] {
        assert!(Config::parse(bad).is_err());
    }
}

/// The problems of a document that has some.
fn problems_of(doc: &str) -> Vec<String> {
    match Config::parse(doc.as_bytes()) {
        Ok(c) => panic!("{doc} was accepted: {c:?}"),
        Err(e) => e.problems(),
    }
}

/// The message of every kind of field (string, integers in and out of their
/// type's range, boolean, enum, nested object, array and its items), pinned
/// so that how the document is read can change without the operator seeing
/// a different refusal.
#[test]
fn each_kind_of_field_names_its_path_what_was_found_and_what_is_accepted() {
    for (field_and_value, expected) in [
        // Strings.
        (
            r#""validator_authority":1"#,
            "validator_authority: invalid type: integer `1`, expected a string",
        ),
        (
            r#""token_env":true"#,
            "token_env: invalid type: boolean `true`, expected a string",
        ),
        (
            r#""reject_header":5"#,
            "reject_header: invalid type: integer `5`, expected a string",
        ),
        // Integers: negative, too large for u32, not whole, null, other types.
        (
            r#""poll_wait_s":-1"#,
            "poll_wait_s: invalid value: integer `-1`, expected u32",
        ),
        (
            r#""poll_wait_s":4294967296"#,
            "poll_wait_s: invalid value: integer `4294967296`, expected u32",
        ),
        (
            r#""poll_wait_s":1.5"#,
            "poll_wait_s: invalid type: floating point `1.5`, expected u32",
        ),
        (
            r#""poll_wait_s":null"#,
            "poll_wait_s: invalid type: null, expected u32",
        ),
        (
            r#""poll_wait_s":true"#,
            "poll_wait_s: invalid type: boolean `true`, expected u32",
        ),
        (
            r#""reject_status":"503""#,
            r#"reject_status: invalid type: string "503", expected u32"#,
        ),
        (
            r#""max_staleness_ms":"1""#,
            r#"max_staleness_ms: invalid type: string "1", expected u64"#,
        ),
        (
            r#""sync_page_bytes":-5"#,
            "sync_page_bytes: invalid value: integer `-5`, expected u32",
        ),
        (
            r#""sync_page_bytes":{}"#,
            "sync_page_bytes: invalid type: map, expected u32",
        ),
        // Booleans.
        (
            r#""istio":"yes""#,
            r#"istio: invalid type: string "yes", expected a boolean"#,
        ),
        (
            r#""istio":null"#,
            "istio: invalid type: null, expected a boolean",
        ),
        // Enums: an unknown variant.
        (
            r#""mode":"Audit""#,
            "mode: unknown variant `Audit`, expected `enforce` or `audit`",
        ),
        (
            r#""on_reject":"replay""#,
            "on_reject: unknown variant `replay`, expected `reject` or `retry`",
        ),
        // Nested objects.
        (
            r#""policy":1"#,
            "policy: invalid type: integer `1`, expected struct Policy",
        ),
        (
            r#""policy":null"#,
            "policy: invalid type: null, expected struct Policy",
        ),
        (
            r#""guard":1"#,
            "guard: invalid type: integer `1`, expected struct GuardConfig",
        ),
        (
            r#""retry":1"#,
            "retry: invalid type: integer `1`, expected struct RetryConfig",
        ),
        (
            r#""guard":{"max_loss_percent":4294967296}"#,
            "guard.max_loss_percent: invalid value: integer `4294967296`, expected u32",
        ),
        // Arrays and their items.
        (
            r#""clusters":{}"#,
            "clusters: invalid type: map, expected a sequence",
        ),
        (
            r#""clusters":["a"]"#,
            r#"clusters[0]: invalid type: string "a", expected struct ClusterRule"#,
        ),
        (
            r#""clusters":[{"name":"a","service":"shop/a","x":1}]"#,
            "clusters[0].x: unknown field `x`, expected one of `name`, `prefix`, `service`",
        ),
        (
            r#""pod_cidrs":"10.0.0.0/8""#,
            r#"pod_cidrs: invalid type: string "10.0.0.0/8", expected a sequence"#,
        ),
    ] {
        let doc = format!(r#"{{"validator_cluster":"sg",{field_and_value}}}"#);
        assert_eq!(problems_of(&doc), [expected], "{doc}");
    }
}

#[test]
fn an_enum_of_the_wrong_type_is_named_with_its_field() {
    for (field_and_value, start) in [
        (r#""mode":null"#, "mode: invalid type: null, expected "),
        (
            r#""mode":["audit"]"#,
            "mode: invalid type: sequence, expected ",
        ),
        (
            r#""on_reject":2"#,
            "on_reject: invalid type: integer `2`, expected ",
        ),
        (
            r#""policy":{"failure_policy":null}"#,
            "policy.failure_policy: invalid type: null, expected ",
        ),
    ] {
        let doc = format!(r#"{{"validator_cluster":"sg",{field_and_value}}}"#);
        let problems = problems_of(&doc);
        assert_eq!(problems.len(), 1, "{doc}: {problems:?}");
        assert!(problems[0].starts_with(start), "{doc}: {problems:?}");
    }
}

#[test]
fn every_wrong_field_of_a_nested_object_is_named() {
    assert_eq!(
        problems_of(
            r#"{"validator_cluster":"sg","guard":{"enabled":"no","max_loss_percent":-1,
            "min_ips":1.5,"min_service_ips":"2","confirm_ms":null}}"#
        ),
        [
            "guard.confirm_ms: invalid type: null, expected u64",
            r#"guard.enabled: invalid type: string "no", expected a boolean"#,
            "guard.max_loss_percent: invalid value: integer `-1`, expected u32",
            "guard.min_ips: invalid type: floating point `1.5`, expected u64",
            r#"guard.min_service_ips: invalid type: string "2", expected u64"#,
        ]
    );
    assert_eq!(
        problems_of(
            r#"{"validator_cluster":"sg","retry":{"twin_suffix":1,"methods":"GET","attempts":-2,
            "hosts_per_attempt":"8","timeout_ms":true,"endpoint_header":[],"max_answer_bytes":-1}}"#
        ),
        [
            "retry.attempts: invalid value: integer `-2`, expected u32",
            "retry.endpoint_header: invalid type: sequence, expected a string",
            r#"retry.hosts_per_attempt: invalid type: string "8", expected u32"#,
            "retry.max_answer_bytes: invalid value: integer `-1`, expected u64",
            r#"retry.methods: invalid type: string "GET", expected a sequence"#,
            "retry.timeout_ms: invalid type: boolean `true`, expected u64",
            "retry.twin_suffix: invalid type: integer `1`, expected a string",
        ]
    );
    assert_eq!(
        problems_of(
            r#"{"validator_cluster":"sg","policy":{"terminating":"drop","unknown_service":"allow"}}"#
        ),
        ["policy.terminating: unknown variant `drop`, expected `allow` or `reject`"]
    );
}

#[test]
fn a_cluster_rule_without_a_valid_service_is_named_and_left_out() {
    assert_eq!(
        problems_of(r#"{"validator_cluster":"sg","clusters":[{"name":"a","service":"nope"}]}"#),
        [
            r#"clusters[0].service: service "nope" is not of the form NAMESPACE/NAME"#,
            "clusters[0]: missing field `service`",
        ]
    );
    assert_eq!(
        problems_of(r#"{"validator_cluster":"sg","clusters":[{"prefix":3,"service":5}]}"#),
        [
            "clusters[0].prefix: invalid type: integer `3`, expected a string",
            "clusters[0].service: invalid type: integer `5`, expected a string",
            "clusters[0]: missing field `service`",
        ]
    );
}

#[test]
fn each_unknown_field_is_named_with_the_fields_accepted() {
    let accepted = "expected one of `validator_cluster`, `validator_authority`, `token`, \
        `token_env`, `poll_wait_s`, `max_staleness_ms`, `tick_ms`, `lease_ttl_ms`, \
        `backoff_initial_ms`, `backoff_max_ms`, `sync_page_bytes`, `mode`, `reject_status`, \
        `reject_header`, `policy`, `istio`, `clusters`, `guard`, `on_reject`, `retry`, `pod_cidrs`";
    assert_eq!(
        problems_of(r#"{"validator_cluster":"sg","a":1,"b":2}"#),
        [
            format!("a: unknown field `a`, {accepted}"),
            format!("b: unknown field `b`, {accepted}"),
        ]
    );
    assert_eq!(
        problems_of(r#"{"validator_cluster":"sg","guard":{"enable":true}}"#),
        [
            "guard.enable: unknown field `enable`, expected one of `enabled`, `max_loss_percent`, \
          `min_ips`, `min_service_ips`, `confirm_ms`"
        ]
    );
    assert_eq!(
        problems_of(r#"{"validator_cluster":"sg","retry":{"atempts":2}}"#),
        [
            "retry.atempts: unknown field `atempts`, expected one of `twin_suffix`, `methods`, \
          `attempts`, `hosts_per_attempt`, `timeout_ms`, `endpoint_header`, `max_answer_bytes`"
        ]
    );
    assert_eq!(
        problems_of(r#"{"validator_cluster":"sg","policy":{"fail":1}}"#),
        [
            "policy.fail: unknown field `fail`, expected one of `failure_policy`, `terminating`, \
          `unknown_service`"
        ]
    );
}

#[test]
fn null_is_the_default_of_an_optional_field() {
    let c = Config::parse(
        br#"{"validator_cluster":"sg","validator_authority":null,"token":null,"token_env":null,
        "sync_page_bytes":null,"on_reject":null,"retry":null}"#,
    )
    .unwrap();
    assert_eq!(c.authority, "sg");
    assert_eq!(
        (c.token, c.token_env, c.sync_page_bytes),
        (None, None, None)
    );
    assert!(c.retry.is_none());
}

#[test]
fn every_field_written_is_read() {
    let c = Config::parse_outside_gateway(
        br#"{"validator_cluster":"sg","validator_authority":"v","token_env":"T","poll_wait_s":2,"max_staleness_ms":9000,
        "tick_ms":20,"lease_ttl_ms":40,"backoff_initial_ms":7,"backoff_max_ms":70,
        "sync_page_bytes":4096,"mode":"audit","reject_status":429,"reject_header":"x-h",
        "policy":{"failure_policy":"closed","terminating":"reject","unknown_service":"reject"},
        "istio":false,"clusters":[{"prefix":"p-","service":"a/b"}],
        "guard":{"enabled":false,"max_loss_percent":9,"min_ips":3,"min_service_ips":4,"confirm_ms":5},
        "on_reject":"reject",
        "retry":{"twin_suffix":"-t","methods":["PUT"],"attempts":2,"hosts_per_attempt":3,
        "timeout_ms":4,"endpoint_header":"x-e","max_answer_bytes":5},
        "pod_cidrs":["10.0.0.0/8"]}"#,
    )
    .unwrap();
    assert_eq!(
        (c.authority.as_str(), c.token_env.as_deref()),
        ("v", Some("T"))
    );
    assert_eq!(
        (c.poll_wait_s, c.max_staleness_ms, c.tick_ms, c.lease_ttl_ms),
        (2, 9000, 20, 40)
    );
    assert_eq!((c.backoff_initial_ms, c.backoff_max_ms), (7, 70));
    assert_eq!(c.sync_page_bytes, Some(4096));
    assert_eq!(c.mode, Mode::Audit);
    assert_eq!((c.reject_status, c.reject_header.as_str()), (429, "x-h"));
    assert_eq!(
        c.policy,
        Policy {
            failure_policy: FailurePolicy::Closed,
            terminating: staleguard_core::verdict::Action::Reject,
            unknown_service: staleguard_core::verdict::Action::Reject,
        }
    );
    assert!(!c.istio);
    assert_eq!(
        c.clusters,
        [ClusterRule {
            name: None,
            prefix: Some("p-".to_owned()),
            service: staleguard_core::ServiceKey::new("a", "b"),
        }]
    );
    assert_eq!(
        c.guard,
        GuardConfig {
            enabled: false,
            max_loss_percent: 9,
            min_ips: 3,
            min_service_ips: 4,
            confirm_ms: 5,
        }
    );
    assert!(c.replay().is_none(), "on_reject: reject");
    assert_eq!(
        c.retry,
        Some(RetryConfig {
            twin_suffix: "-t".to_owned(),
            methods: vec!["PUT".to_owned()],
            attempts: 2,
            hosts_per_attempt: 3,
            timeout_ms: 4,
            endpoint_header: "x-e".to_owned(),
            max_answer_bytes: 5,
        })
    );
    assert_eq!(c.pod_cidrs.len(), 1);
}

/// serde read a struct from an array of its fields in order, and an enum
/// from a one-entry object; no operator writes either, and a typo that
/// became one was taken silently.
#[test]
fn an_array_is_not_a_nested_object_nor_an_object_an_enum() {
    assert_eq!(
        problems_of(r#"{"validator_cluster":"sg","guard":[false]}"#),
        ["guard: invalid type: sequence, expected struct GuardConfig"]
    );
    assert_eq!(
        problems_of(r#"{"validator_cluster":"sg","policy":[]}"#),
        ["policy: invalid type: sequence, expected struct Policy"]
    );
    assert_eq!(
        problems_of(r#"{"validator_cluster":"sg","mode":{"audit":null}}"#),
        ["mode: invalid type: map, expected `enforce` or `audit`"]
    );
}
