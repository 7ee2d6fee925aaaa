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
