use super::*;
use crate::config::CONFIG_REFUSED;
use crate::fake::{shipped_config, FakeHost};
use crate::host::Next;

use staleguard_core::{Freshness, IpRecord, PodHolder, ServiceKey, Snapshot};

/// The validator's snapshot at generation 3: `ips` are ready members of
/// shop/cart (the service of the shipped `shop-cart` cluster).
pub(crate) fn snapshot_body(ips: &[&str]) -> Vec<u8> {
    let cart = ServiceKey::new("shop", "cart");
    let records = ips
        .iter()
        .map(|ip| {
            IpRecord::held_by(
                ip.parse().unwrap(),
                vec![PodHolder::ready_member(
                    "shop",
                    format!("cart-{ip}"),
                    *ip,
                    cart.clone(),
                )],
            )
        })
        .collect();
    serde_json::to_vec(&Snapshot {
        v: 1,
        epoch: 9,
        generation: 3,
        freshness: Freshness {
            fresh: true,
            age_ms: Some(5),
        },
        services: vec![cart],
        records,
    })
    .unwrap()
}

/// Fires the timer when it is due.
fn fire(root: &mut Root, host: &mut FakeHost) {
    host.now_ms += root.timer_ms();
    root.tick(host);
}

/// A host at a time well past the epoch.
fn started_host() -> FakeHost {
    FakeHost {
        now_ms: 100_000,
        ..FakeHost::default()
    }
}

/// A root configured with the shipped configuration plus `extra`, after
/// its first tick (the one that takes the lease).
fn configured(host: &mut FakeHost, extra: &str) -> Root {
    let mut root = Root::new(1);
    assert!(root.configure(host, &shipped_config(extra)));
    root.tick(host);
    root
}

/// Delivers `body` as the answer (status 200) to call `token`; returns
/// its size.
fn answer(root: &mut Root, host: &mut FakeHost, token: u32, body: Vec<u8>) -> usize {
    let size = body.len();
    host.answer_with(200, body);
    root.call_response(host, token, 1, size);
    size
}

/// A root configured with the shipped configuration plus `extra`, that
/// holds the lease and has its first call (the snapshot) out.
pub(crate) fn polling(extra: &str) -> (Root, FakeHost) {
    let mut host = started_host();
    let mut root = configured(&mut host, extra);
    assert_eq!(host.counter(metrics::SYNC_LEASE_ACQUIRED), 1);
    assert!(
        host.calls.is_empty(),
        "the tick that takes the lease polls next"
    );
    fire(&mut root, &mut host);
    assert_eq!(host.calls.len(), 1);
    (root, host)
}

/// [`polling`], with the snapshot of `ips` loaded.
pub(crate) fn loaded(extra: &str, ips: &[&str]) -> (Root, FakeHost) {
    let (mut root, mut host) = polling(extra);
    answer(&mut root, &mut host, 1, snapshot_body(ips));
    assert_eq!(host.counter(metrics::SYNC_RESETS), 1);
    (root, host)
}

#[test]
fn the_poller_asks_for_the_packed_form_and_applies_a_packed_answer() {
    let (mut root, mut host) = polling("{}");
    assert_eq!(host.calls[0].header("accept"), Some(crate::sync::ACCEPT));
    let json: staleguard_core::Snapshot =
        serde_json::from_slice(&snapshot_body(&["10.0.0.1", "10.0.0.2"])).unwrap();
    let size = answer(
        &mut root,
        &mut host,
        1,
        staleguard_core::packed::encode_snapshot(&json),
    );
    assert_eq!(host.counter(metrics::SYNC_RESETS), 1);
    assert_eq!(host.counter(metrics::SYNC_BYTES), size as u64);
    assert_eq!(host.gauges.get(metrics::GAUGE_ENTRIES), Some(&2));
}

#[test]
fn the_timer_follows_the_pollers_next_step_no_sooner_than_the_least_interval() {
    let (mut root, mut host) = polling("{}");
    let snapshot = &host.calls[0];
    assert_eq!(snapshot.cluster, "staleguard-validator");
    assert_eq!(
        snapshot.header(":path"),
        Some("/v1/snapshot?v=1&view=verdict")
    );
    let size = answer(&mut root, &mut host, 1, snapshot_body(&["10.0.0.1"]));
    assert_eq!(host.counter(metrics::SYNC_RESETS), 1);
    assert_eq!(host.counter(metrics::SYNC_BYTES), size as u64);
    assert_eq!(host.gauges.get(metrics::GAUGE_GENERATION), Some(&3));
    // An answer at once does not make the next call at once: the timer
    // is re-armed for the least interval.
    assert_eq!(host.calls.len(), 1);
    assert_eq!(root.timer_ms(), MIN_POLL_INTERVAL_MS);
    assert_eq!(host.timer_ms(), Some(MIN_POLL_INTERVAL_MS));
    fire(&mut root, &mut host);
    assert_eq!(host.calls.len(), 2);
    assert_eq!(
        host.calls[1].header(":path"),
        Some("/v1/changes?v=1&view=verdict&epoch=9&since=3&wait=30")
    );
    // With the long poll out, the next thing due is the lease renewal.
    let tick_ms = Config::parse(&shipped_config("{}")).unwrap().tick_ms;
    assert!(root.timer_ms() > MIN_POLL_INTERVAL_MS && root.timer_ms() <= tick_ms);
    assert_eq!(host.counter(metrics::SYNC_POLLS), 2);
}

#[test]
fn the_watchdog_gives_up_on_a_call_never_answered_and_ignores_its_late_answer() {
    let (mut root, mut host) = loaded("{}", &["10.0.0.1"]);
    fire(&mut root, &mut host);
    assert_eq!(host.calls.len(), 2);
    let out_at = host.now_ms;
    let timeout_ms = u64::try_from(host.calls[1].timeout.as_millis()).unwrap();
    while host.now_ms < out_at + timeout_ms + crate::sync::WATCHDOG_SLACK_MS {
        assert_eq!(host.counter(&metrics::sync_errors("timeout")), 0);
        fire(&mut root, &mut host);
    }
    assert_eq!(host.counter(&metrics::sync_errors("timeout")), 1);
    // Its answer, should it come now, is not applied.
    answer(&mut root, &mut host, 2, snapshot_body(&["10.0.0.2"]));
    assert_eq!(host.counter(metrics::SYNC_RESETS), 1);
    assert_eq!(host.counter(metrics::SYNC_DELTAS), 0);
}

#[test]
fn a_call_without_an_answer_counts_as_a_transport_error() {
    let (mut root, mut host) = polling("{}");
    // A failed call: no headers, no body.
    root.call_response(&mut host, 1, 0, 0);
    assert_eq!(host.counter(&metrics::sync_errors("transport")), 1);
    assert_eq!(host.counter(metrics::SYNC_RESETS), 0);
    assert_eq!(host.counter(metrics::SYNC_BYTES), 0);
    // Backed off: no new call until the timer fires.
    assert_eq!(host.calls.len(), 1);
    assert!(root.timer_ms() > MIN_POLL_INTERVAL_MS);
}

#[test]
fn an_answer_with_an_error_status_counts_as_a_status_error() {
    let (mut root, mut host) = polling("{}");
    host.answer_with(500, Vec::new());
    root.call_response(&mut host, 1, 1, 0);
    assert_eq!(host.counter(&metrics::sync_errors("status")), 1);
    assert_eq!(host.counter(metrics::SYNC_RESETS), 0);
}

#[test]
fn a_refused_dispatch_counts_as_a_transport_error() {
    let mut host = FakeHost {
        refuse_calls: true,
        ..started_host()
    };
    let mut root = configured(&mut host, "{}");
    fire(&mut root, &mut host);
    assert_eq!(host.counter(&metrics::sync_errors("transport")), 1);
    assert_eq!(host.counter(metrics::SYNC_POLLS), 0);
    // The message names the cluster and the fix.
    let error = dispatch_failed("staleguard-validator", "BadArgument").to_string();
    assert!(
        error.contains(r#"validator_cluster "staleguard-validator" failed"#)
            && error.contains("Envoy has no cluster of that name"),
        "{error}"
    );
}

/// A GET through the shipped `shop-cart` cluster to an IP no index holds.
fn request_to_nowhere(host: &mut FakeHost) {
    host.properties
        .insert("xds.cluster_name".into(), "shop-cart".into());
    host.properties
        .insert("upstream.address".into(), "10.9.9.9:8080".into());
    host.request_headers = vec![(":method".into(), "GET".into())];
}

#[test]
fn a_refused_configuration_starts_the_plugin_and_fails_open_counted() {
    let mut host = started_host();
    let mut root = Root::new(1);
    // Each class of problem: unknown field, wrong type, bad value, a
    // token variable that is not set.
    let bad = shipped_config(
        r#"{"mdoe":"audit","poll_wait_s":"30","reject_status":42,"token_env":"SG_UNSET_FOR_TEST"}"#,
    );
    assert!(root.configure(&mut host, &bad), "the plugin must start");
    assert_eq!(host.counter(metrics::CONFIG_REFUSED), 1);
    // No lease, no poller: nothing is asked of the validator.
    fire(&mut root, &mut host);
    root.tick(&mut host);
    assert!(host.calls.is_empty());
    request_to_nowhere(&mut host);
    for _ in 0..3 {
        assert_eq!(
            root.filter(2).request_headers(&mut host, true),
            Next::Continue
        );
    }
    assert!(host.replies.is_empty());
    assert_eq!(host.counter(metrics::REQUESTS_UNCONFIGURED), 3);

    // A good configuration takes over.
    assert!(root.configure(&mut host, &shipped_config("{}")));
    root.filter(3).request_headers(&mut host, true);
    assert_eq!(host.counter(metrics::REQUESTS_UNCONFIGURED), 3);
    fire(&mut root, &mut host);
    fire(&mut root, &mut host);
    assert_eq!(host.calls.len(), 1, "polling once configured");
}

#[test]
fn a_refused_configuration_with_failure_policy_closed_rejects_with_config_refused() {
    let mut host = started_host();
    let mut root = Root::new(1);
    let bad = shipped_config(r#"{"policy":{"failure_policy":"closed"},"mdoe":1}"#);
    assert!(root.configure(&mut host, &bad));
    request_to_nowhere(&mut host);
    assert_eq!(root.filter(2).request_headers(&mut host, true), Next::Pause);
    let reply = &host.replies[0];
    assert_eq!(reply.status, 503);
    assert_eq!(
        reply.headers,
        [("x-staleguard".to_owned(), CONFIG_REFUSED.to_owned())]
    );
    assert_eq!(host.counter(metrics::REQUESTS_UNCONFIGURED), 1);
}

#[test]
fn a_refused_configuration_is_logged_and_counted_by_the_first_vm_only() {
    let mut host = started_host();
    let bad = shipped_config(r#"{"mdoe":1}"#);
    let first = Root::new(1);
    assert!(first.first_to_refuse(&mut host, &bad));
    let second = Root::new(2);
    assert!(!second.first_to_refuse(&mut host, &bad));
    assert_eq!(host.counter(metrics::CONFIG_REFUSED), 1);
    let other = shipped_config(r#"{"mdoe":2}"#);
    assert!(second.first_to_refuse(&mut host, &other));
    assert_eq!(host.counter(metrics::CONFIG_REFUSED), 2);
}

#[test]
fn a_refused_twin_configuration_starts_the_plugin() {
    let mut host = started_host();
    let mut root = Root::new(1);
    assert!(root.configure(&mut host, br#"{"replay_twin":{"endpint_header":"x"}}"#));
    assert_eq!(host.counter(metrics::CONFIG_REFUSED), 1);
}

#[test]
fn a_refusal_s_reason_is_read_from_the_answer() {
    assert_eq!(
        answer_reason(br#"{"error":{"code":"bad_request","message":"wait=-1 is out of range"}}"#)
            .as_deref(),
        Some("wait=-1 is out of range")
    );
    assert_eq!(
        answer_reason(b"no healthy upstream").as_deref(),
        Some("no healthy upstream")
    );
    assert_eq!(
        answer_reason(
            b"upstream connect error
more"
        )
        .as_deref(),
        Some("upstream connect error")
    );
    assert_eq!(answer_reason(b""), None);
    assert_eq!(answer_reason(&[b'x'; 1000]).map(|r| r.len()), Some(300));
}

#[test]
fn a_call_of_another_context_is_not_this_roots() {
    let (mut root, mut host) = polling("{}");
    root.call_response(&mut host, 77, 0, 0);
    assert_eq!(host.counter(&metrics::sync_errors("transport")), 0);
}

// === a takeover ===

use crate::sync::tests::twenty_ips;

/// The validator's next answer, served as a reset at generation 4: only
/// `ips` are left.
fn reset_body(ips: &[&str]) -> Vec<u8> {
    let snapshot: Snapshot = serde_json::from_slice(&snapshot_body(ips)).unwrap();
    let reset = staleguard_core::Changes::Reset(Snapshot {
        generation: 4,
        ..snapshot
    });
    serde_json::to_vec(&reset).unwrap()
}

/// The token of the last call dispatched.
fn last_token(host: &FakeHost) -> u32 {
    host.calls.last().unwrap().token
}

/// Root A (lease owner 42) loaded a snapshot of twenty IPs and holds the
/// validator's next answer, which keeps two; root B (owner 43), on the same
/// shared data, watches the lease. Returns A, B, the host and that answer.
fn a_holds_and_b_waits() -> (Root, Root, FakeHost, Vec<u8>) {
    let ips = twenty_ips();
    let ips: Vec<&str> = ips.iter().map(String::as_str).collect();
    let (mut a, mut host) = loaded("{}", &ips);
    fire(&mut a, &mut host);
    let dropping = reset_body(&ips[..2]);
    let token = last_token(&host);
    answer(&mut a, &mut host, token, dropping.clone());
    assert_eq!(host.counter(metrics::GUARD_HELD_TOTAL), 1, "A holds it");
    host.random = 1;
    let mut b = Root::new(2);
    assert!(b.configure(&mut host, &shipped_config("{}")));
    b.tick(&mut host);
    assert_eq!(host.counter(metrics::SYNC_LEASE_ACQUIRED), 1, "A's lease");
    (a, b, host, dropping)
}

/// B takes the lease of A, which stopped renewing it (its thread stalled),
/// and has its first call out.
fn b_takes_over(b: &mut Root, host: &mut FakeHost) {
    let ttl = Config::parse(&shipped_config("{}")).unwrap().lease_ttl_ms;
    host.now_ms += ttl + 1;
    b.tick(host);
    assert_eq!(host.counter(metrics::SYNC_LEASE_ACQUIRED), 2, "B took it");
    let calls = host.calls.len();
    fire(b, host);
    assert_eq!(host.calls.len(), calls + 1, "B polls");
}

#[test]
fn a_root_that_takes_the_lease_over_holds_what_its_predecessor_held() {
    let (_a, mut b, mut host, dropping) = a_holds_and_b_waits();
    b_takes_over(&mut b, &mut host);
    assert_eq!(
        host.calls.last().unwrap().header(":path"),
        Some("/v1/changes?v=1&view=verdict&epoch=9&since=3&wait=30"),
        "B continues from the applied generation"
    );
    let token = last_token(&host);
    answer(&mut b, &mut host, token, dropping);
    assert_eq!(host.counter(metrics::SYNC_RESETS), 1, "not applied");
    assert_eq!(host.counter(metrics::GUARD_HELD_TOTAL), 2, "B holds it too");
    assert_eq!(host.gauges.get(metrics::GAUGE_ENTRIES), Some(&20));
}

#[test]
#[cfg(feature = "pages")]
fn with_sync_page_bytes_a_snapshot_is_asked_for_and_put_together_in_pages() {
    let mut host = started_host();
    let mut root = Root::new(1).with_sync_page_bytes(Some(16_384));
    assert!(root.configure(&mut host, &shipped_config("{}")));
    root.tick(&mut host);
    fire(&mut root, &mut host);
    assert_eq!(
        host.calls[0].header(":path"),
        Some("/v1/snapshot?v=1&view=verdict&page_bytes=16384")
    );
    let ips: Vec<String> = (1..=200)
        .map(|i| format!("10.0.{}.{}", i / 100, i % 100 + 1))
        .collect();
    let ips: Vec<&str> = ips.iter().map(String::as_str).collect();
    let whole = snapshot_body(&ips);
    let page = whole.len() / 3 + 1;
    let mut offset = 0;
    while offset < whole.len() {
        let end = (offset + page).min(whole.len());
        host.answer_with(200, whole[offset..end].to_vec());
        for (name, value) in [
            (
                staleguard_core::page::LENGTH_HEADER,
                whole.len().to_string(),
            ),
            (staleguard_core::page::ID_HEADER, "9-1".to_owned()),
            (staleguard_core::page::OFFSET_HEADER, offset.to_string()),
        ] {
            host.answer.headers.push((name.to_owned(), value));
        }
        let token = u32::try_from(host.calls.len()).unwrap();
        root.call_response(&mut host, token, 4, end - offset);
        offset = end;
        if offset < whole.len() {
            assert_eq!(
                host.calls.last().unwrap().header(":path").unwrap(),
                format!("/v1/answer?v=1&id=9-1&offset={offset}&page_bytes=16384"),
                "the next page at once, from the answer's callback"
            );
        }
    }
    assert_eq!(host.calls.len(), 3);
    assert_eq!(host.counter(metrics::SYNC_RESETS), 1);
    assert_eq!(host.gauges.get(metrics::GAUGE_ENTRIES), Some(&200));
    // The configuration's `sync_page_bytes: 0` turns pages off.
    let mut host = started_host();
    let mut root = Root::new(1).with_sync_page_bytes(Some(16_384));
    assert!(root.configure(&mut host, &shipped_config(r#"{"sync_page_bytes": 0}"#)));
    root.tick(&mut host);
    fire(&mut root, &mut host);
    assert_eq!(
        host.calls[0].header(":path"),
        Some("/v1/snapshot?v=1&view=verdict")
    );
}
