use super::*;
use crate::fake::FakeHost;
use crate::root::tests::loaded;
use crate::root::Root;
use staleguard_core::{Reason, ServiceKey};

const CART: &str = "shop/cart";

/// A bodiless GET through the shipped `shop-cart` cluster, to `ip`.
fn get_to(host: &mut FakeHost, ip: &str) {
    host.properties
        .insert("xds.cluster_name".into(), "shop-cart".into());
    host.properties
        .insert("upstream.address".into(), format!("{ip}:8080"));
    host.request_headers = vec![
        (":method".into(), "GET".into()),
        (":path".into(), "/items".into()),
        (":authority".into(), "shop".into()),
        (":scheme".into(), "http".into()),
    ];
}

fn reject_status(extra: &str) -> u32 {
    Config::parse(&crate::fake::shipped_config(extra))
        .unwrap()
        .reject_status
}

// Counting rejections: on_reject is `reject` (the shipped config retries).
const ON_REJECT_REJECT: &str = r#"{"on_reject":"reject"}"#;

#[test]
fn an_unconfigured_vm_lets_everything_through() {
    let (_, mut host) = loaded("{}", &["10.0.0.1"]);
    get_to(&mut host, "10.0.0.9");
    let root = Root::new(3);
    assert_eq!(
        root.filter(2).request_headers(&mut host, true),
        Next::Continue
    );
    assert!(host.replies.is_empty());
}

#[test]
fn a_member_is_let_through_without_a_reply() {
    let (root, mut host) = loaded("{}", &["10.0.0.1"]);
    let calls = host.calls.len();
    get_to(&mut host, "10.0.0.1");
    let mut filter = root.filter(2);
    assert_eq!(filter.request_headers(&mut host, true), Next::Continue);
    assert!(host.replies.is_empty());
    assert_eq!(host.calls.len(), calls);
    assert!(!filter.replaying());
}

#[test]
fn on_reject_reject_a_rejection_replies_with_the_status_and_the_reason_header() {
    let (root, mut host) = loaded(ON_REJECT_REJECT, &["10.0.0.1"]);
    get_to(&mut host, "10.0.0.9");
    let mut filter = root.filter(2);
    assert_eq!(filter.request_headers(&mut host, true), Next::Pause);
    assert_eq!(host.replies.len(), 1);
    let reply = &host.replies[0];
    assert_eq!(reply.status, reject_status(ON_REJECT_REJECT));
    let header = Config::parse(&crate::fake::shipped_config(ON_REJECT_REJECT))
        .unwrap()
        .reject_header;
    assert_eq!(reply.header(&header), Some("destroyed"));
    assert_eq!(reply.body, b"staleguard: destroyed\n");
    assert!(!filter.replaying());
}

#[test]
fn on_reject_reject_request_counters_reach_the_host_on_the_tick_with_exact_sums() {
    let (mut root, mut host) = loaded(ON_REJECT_REJECT, &["10.0.0.1"]);
    let status = reject_status(ON_REJECT_REJECT);
    let allowed = metrics::requests(CART, Reason::Member, Effect::Allow);
    let rejected = metrics::requests(CART, Reason::Destroyed, Effect::Reject { status });
    for ip in ["10.0.0.1", "10.0.0.9", "10.0.0.1", "10.0.0.9", "10.0.0.1"] {
        get_to(&mut host, ip);
        root.filter(2).request_headers(&mut host, true);
    }
    // Counted in VM memory until the tick.
    assert_eq!(host.counter(&allowed), 0);
    assert_eq!(host.counter(&rejected), 0);
    root.tick(&mut host);
    assert_eq!(host.counter(&allowed), 3);
    assert_eq!(host.counter(&rejected), 2);
    // Flushed once: another tick adds nothing.
    root.tick(&mut host);
    assert_eq!(host.counter(&allowed), 3);
    assert_eq!(host.counter(&rejected), 2);
}

#[test]
fn a_rejected_bodiless_get_is_replayed_to_a_live_member_through_the_twin() {
    let (mut root, mut host) = loaded("{}", &["10.0.0.1"]);
    let calls = host.calls.len();
    get_to(&mut host, "10.0.0.9");
    let mut filter = root.filter(2);
    assert_eq!(filter.request_headers(&mut host, true), Next::Pause);
    assert!(host.replies.is_empty(), "no reply while the replay is out");
    assert!(filter.replaying());
    assert_eq!(host.calls.len(), calls + 1);
    let call = host.calls.last().unwrap().clone();
    assert_eq!(call.cluster, "shop-cart|staleguard-twin");
    assert_eq!(call.header(":path"), Some("/items"));
    let retry = Config::parse(&crate::fake::shipped_config("{}")).unwrap();
    let endpoint = &retry.replay().unwrap().endpoint_header;
    assert_eq!(call.header(endpoint), Some("10.0.0.1:8080"));
    // The member answers: the client gets its answer.
    host.answer = crate::fake::Answer {
        headers: vec![
            (":status".into(), "200".into()),
            (replay::UPSTREAM_TIME_HEADER.into(), "3".into()),
        ],
        body: b"hello".to_vec(),
    };
    filter.call_response(&mut host, call.token, 2, 5);
    assert!(!filter.replaying());
    assert_eq!(host.replies.len(), 1);
    assert_eq!(host.replies[0].status, 200);
    assert_eq!(host.replies[0].body, b"hello");
    root.tick(&mut host);
    let label = ServiceKey::new("shop", "cart").to_string();
    assert_eq!(
        host.counter(&metrics::requests_replayed(&label, Reason::Destroyed)),
        1
    );
    assert_eq!(host.counter(&metrics::retries(ReplayOutcome::Answered)), 1);
}

#[test]
fn a_request_with_a_body_is_rejected_not_replayed() {
    let (root, mut host) = loaded("{}", &["10.0.0.1"]);
    let calls = host.calls.len();
    get_to(&mut host, "10.0.0.9");
    assert_eq!(
        root.filter(2).request_headers(&mut host, false),
        Next::Pause
    );
    assert_eq!(host.calls.len(), calls, "no replay");
    assert_eq!(host.replies.len(), 1);
    assert_eq!(host.replies[0].status, reject_status("{}"));
    assert_eq!(
        host.counter(&metrics::retries(ReplayOutcome::NotEligible(
            Ineligible::Body
        ))),
        1
    );
}

#[test]
fn a_backends_reject_header_is_stripped_from_the_answer_to_a_request_with_a_body() {
    let (root, mut host) = loaded("{}", &["10.0.0.1"]);
    get_to(&mut host, "10.0.0.1");
    let mut filter = root.filter(2);
    assert_eq!(filter.request_headers(&mut host, false), Next::Continue);
    assert_eq!(filter.response_headers(&mut host), Next::Continue);
    let header = Config::parse(&crate::fake::shipped_config("{}"))
        .unwrap()
        .reject_header;
    assert_eq!(host.removed_response_headers, vec![header]);
    // Without a body (no route retries on the header): untouched.
    let mut filter = root.filter(3);
    filter.request_headers(&mut host, true);
    filter.response_headers(&mut host);
    assert_eq!(host.removed_response_headers.len(), 1);
}

#[test]
fn a_context_is_done_once_its_later_hooks_have_nothing_to_do() {
    let (root, mut host) = loaded("{}", &["10.0.0.1"]);
    // A bodiless GET let through: nothing after its headers.
    get_to(&mut host, "10.0.0.1");
    let mut filter = root.filter(2);
    assert_eq!(filter.request_headers(&mut host, true), Next::Continue);
    assert!(filter.done());
    // With a body: the answer's header waits for the response hook.
    let mut filter = root.filter(3);
    filter.request_headers(&mut host, false);
    assert!(!filter.done(), "the reject header is still to strip");
    filter.response_headers(&mut host);
    assert!(filter.done());
    // A replay: not done until its answer came.
    get_to(&mut host, "10.0.0.9");
    let mut filter = root.filter(4);
    assert_eq!(filter.request_headers(&mut host, true), Next::Pause);
    assert!(!filter.done(), "a replay is under way");
    let token = host.calls.last().unwrap().token;
    host.answer = crate::fake::Answer {
        headers: vec![(":status".into(), "200".into())],
        body: b"ok".to_vec(),
    };
    filter.call_response(&mut host, token, 1, 2);
    assert!(filter.done());
    // A rejection is answered at once.
    let (root, mut host) = loaded(ON_REJECT_REJECT, &["10.0.0.1"]);
    get_to(&mut host, "10.0.0.9");
    let mut filter = root.filter(5);
    assert_eq!(filter.request_headers(&mut host, true), Next::Pause);
    assert!(filter.done());
}

#[test]
fn retry_max_answer_bytes_a_larger_answer_gets_the_rejection() {
    let extra = r#"{"retry":{"max_answer_bytes":4}}"#;
    let (mut root, mut host) = loaded(extra, &["10.0.0.1"]);
    get_to(&mut host, "10.0.0.9");
    let mut filter = root.filter(2);
    filter.request_headers(&mut host, true);
    let call = host.calls.last().unwrap().clone();
    host.answer = crate::fake::Answer {
        headers: vec![
            (":status".into(), "200".into()),
            (replay::UPSTREAM_TIME_HEADER.into(), "3".into()),
        ],
        body: b"12345".to_vec(),
    };
    filter.call_response(&mut host, call.token, 2, 5);
    assert_eq!(host.replies.len(), 1);
    assert_eq!(host.replies[0].status, reject_status(extra));
    assert_eq!(host.replies[0].body, b"staleguard: destroyed\n");
    root.tick(&mut host);
    assert_eq!(
        host.counter(&metrics::retries(ReplayOutcome::AnswerTooLarge)),
        1
    );
}

#[test]
fn the_steering_role_names_live_members_and_never_pauses() {
    let (root, mut host) = loaded("{}", &["10.0.0.1", "10.0.0.2"]);
    let mut steering = Root::new(7);
    assert!(steering.configure(
        &mut host,
        br#"{"steer":{"service":"shop/cart","port":8080}}"#
    ));
    // The guard judged a pick stale: the body path steers.
    get_to(&mut host, "10.0.0.9");
    root.filter(1).request_headers(&mut host, true);
    drop(root);
    get_to(&mut host, "10.0.0.9");
    host.request_headers
        .push(("x-gateway-destination-endpoint".into(), "6.6.6.6:1".into()));
    let calls = host.calls.len();
    let mut filter = steering.filter(2);
    assert_eq!(filter.request_headers(&mut host, false), Next::Continue);
    let named = host
        .request_headers
        .iter()
        .find(|(k, _)| k == "x-gateway-destination-endpoint")
        .map(|(_, v)| v.clone())
        .unwrap();
    let mut named: Vec<&str> = named.split(',').collect();
    named.sort_unstable();
    assert_eq!(named, ["10.0.0.1:8080", "10.0.0.2:8080"]);
    assert!(host.replies.is_empty());
    assert_eq!(host.calls.len(), calls);
    // An index not synced for longer than max_staleness_ms names no one.
    host.now_ms += 60_001;
    let before = host.removed_headers.len();
    steering.filter(4).request_headers(&mut host, false);
    assert_eq!(host.removed_headers.len(), before + 1);
    host.now_ms -= 60_001;
    // A service the index has no member of: the client's header goes.
    let mut other = Root::new(8);
    assert!(other.configure(&mut host, br#"{"steer":{"service":"shop/none","port":80}}"#));
    other.filter(3).request_headers(&mut host, false);
    assert!(host
        .removed_headers
        .contains(&"x-gateway-destination-endpoint".to_owned()));
}

/// `steer.while_stale_ms`: the body path keeps the cluster's own load
/// balancing until the guard judges a pick of the service stale, steers
/// from then on, and stops once no stale pick was seen for that long.
#[test]
fn steer_while_stale_ms_steers_only_after_a_stale_pick_and_for_that_long() {
    let (root, mut host) = loaded("{}", &["10.0.0.1", "10.0.0.2"]);
    let mut steering = Root::new(7);
    assert!(steering.configure(
        &mut host,
        br#"{"steer":{"service":"shop/cart","port":8080,"while_stale_ms":1000}}"#
    ));
    let named = |host: &FakeHost| {
        host.request_headers
            .iter()
            .any(|(k, _)| k == "x-gateway-destination-endpoint")
    };
    get_to(&mut host, "10.0.0.1");
    root.filter(1).request_headers(&mut host, true);
    get_to(&mut host, "10.0.0.1");
    steering.filter(2).request_headers(&mut host, false);
    assert!(!named(&host), "only live picks seen: no steering");

    get_to(&mut host, "10.0.0.9");
    root.filter(3).request_headers(&mut host, true);
    host.now_ms += 1_000;
    get_to(&mut host, "10.0.0.1");
    steering.filter(4).request_headers(&mut host, false);
    assert!(named(&host), "a stale pick 1 s ago: steered");

    host.now_ms += 1;
    get_to(&mut host, "10.0.0.1");
    steering.filter(5).request_headers(&mut host, false);
    assert!(!named(&host), "no stale pick for longer: no steering");

    // 0: always.
    let mut always = Root::new(8);
    assert!(always.configure(
        &mut host,
        br#"{"steer":{"service":"shop/cart","port":8080,"while_stale_ms":0}}"#
    ));
    get_to(&mut host, "10.0.0.1");
    always.filter(6).request_headers(&mut host, false);
    assert!(named(&host), "while_stale_ms 0 steers always");
}

/// `loaded`'s root and host with passes kept and a store that counts its
/// writes (what the native module runs), and one GET to the member
/// 10.0.0.1 judged in full: the pass it leaves.
#[cfg(feature = "passes")]
fn passing() -> (Root, FakeHost) {
    let (root, mut host) = loaded("{}", &["10.0.0.1"]);
    let root = root.with_known_passes();
    host.writes = Some(1);
    get_to(&mut host, "10.0.0.1");
    assert!(!root.pass_known(&mut host), "not judged yet");
    assert_eq!(
        root.filter(2).request_headers(&mut host, true),
        Next::Continue
    );
    (root, host)
}

#[test]
#[cfg(feature = "passes")]
fn a_known_pass_is_counted_as_the_request_judged_in_full_was() {
    let (mut root, mut host) = passing();
    let allowed = metrics::requests(CART, Reason::Member, Effect::Allow);
    for _ in 0..3 {
        assert!(root.pass_known(&mut host));
    }
    assert!(host.replies.is_empty());
    root.tick(&mut host);
    assert_eq!(
        host.counter(&allowed),
        4,
        "one judged in full, three passes"
    );
}

#[test]
#[cfg(feature = "passes")]
fn a_pass_goes_with_any_write_to_the_store() {
    let (root, mut host) = passing();
    assert!(root.pass_known(&mut host));
    crate::host::SharedData::set(&mut host, "unrelated", b"x", None).unwrap();
    assert!(!root.pass_known(&mut host));
    // Judged in full again, it is a pass again.
    root.filter(3).request_headers(&mut host, true);
    assert!(root.pass_known(&mut host));
}

#[test]
#[cfg(feature = "passes")]
fn a_pass_goes_when_its_data_is_no_longer_fresh_and_the_failure_policy_decides() {
    let (mut root, mut host) = passing();
    let max = Config::parse(&crate::fake::shipped_config("{}"))
        .unwrap()
        .max_staleness_ms;
    host.now_ms += max + 1;
    assert!(!root.pass_known(&mut host));
    assert_eq!(
        root.filter(3).request_headers(&mut host, true),
        Next::Continue
    );
    root.tick(&mut host);
    let stale = metrics::requests(CART, Reason::Stale, Effect::Allow);
    assert_eq!(host.counter(&stale), 1, "fail-open, counted as stale");
}

#[test]
#[cfg(feature = "passes")]
fn a_pass_is_for_its_cluster_only() {
    let (root, mut host) = passing();
    host.properties
        .insert("xds.cluster_name".into(), "shop-cart-canary".into());
    assert!(!root.pass_known(&mut host));
}

#[test]
#[cfg(feature = "passes")]
fn a_rejected_or_unknown_host_is_never_a_pass() {
    let (root, mut host) = passing();
    get_to(&mut host, "10.0.0.9");
    assert!(!root.pass_known(&mut host));
    root.filter(3).request_headers(&mut host, true);
    assert!(!root.pass_known(&mut host), "a rejection is not kept");
    host.properties.remove("upstream.address");
    assert!(!root.pass_known(&mut host));
}

#[test]
#[cfg(feature = "passes")]
fn no_pass_without_asking_or_without_a_write_count() {
    let (root, mut host) = loaded("{}", &["10.0.0.1"]);
    host.writes = Some(1);
    get_to(&mut host, "10.0.0.1");
    root.filter(2).request_headers(&mut host, true);
    assert!(!root.pass_known(&mut host), "passes not asked for");
    let (root, mut host) = passing();
    host.writes = None;
    assert!(!root.pass_known(&mut host), "no write count");
}

#[test]
#[cfg(feature = "passes")]
fn a_new_configuration_forgets_the_passes() {
    let (mut root, mut host) = passing();
    assert!(root.pass_known(&mut host));
    assert!(root.configure(&mut host, &crate::fake::shipped_config("{}")));
    assert!(!root.pass_known(&mut host));
}
