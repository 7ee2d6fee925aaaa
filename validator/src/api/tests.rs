//! Router tests: every route, through `tower::ServiceExt::oneshot`, against an
//! index fed with the same watch events the sources produce.

use std::time::{Duration, Instant, SystemTime};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::Router;
use http_body_util::BodyExt;
use k8s_openapi::api::core::v1::Service;
use kube::runtime::watcher::Event;
use serde_json::Value;
use staleguard_core::Changes;
use tower::ServiceExt;

use super::*;
use crate::index::fixtures::{pod, service, slice};
use crate::index::{Index, IndexConfig};

const EPOCH: u64 = 7;

/// An index that finished its initial sync with `shop/cart` (pods cart-1 on
/// 10.0.0.1, cart-2 on 10.0.0.2) and `shop/pay` (pay-1 on 10.0.0.9).
fn synced_index(change_log_capacity: usize) -> SharedIndex {
    let config = IndexConfig {
        change_log_capacity,
        ..IndexConfig::default()
    };
    let shared = SharedIndex::new(Index::new(EPOCH, config), Duration::from_secs(60));
    let pods = [
        ("cart-1", "10.0.0.1", "cart"),
        ("cart-2", "10.0.0.2", "cart"),
        ("pay-1", "10.0.0.9", "pay"),
    ]
    .map(|(name, ip, app)| pod("shop", name).ip(ip).labels(&[("app", app)]).build());
    let cart_abc = slice("shop", "cart-abc", "cart")
        .port("http", 8080)
        .endpoint("10.0.0.1", Some("uid-cart-1"))
        .endpoint("10.0.0.2", Some("uid-cart-2"))
        .build();
    shared.relist_all(shop_services(), pods, [cart_abc], SystemTime::now());
    shared
}

/// `shop/cart` (app=cart) and `shop/pay` (app=pay).
fn shop_services() -> [Service; 2] {
    ["cart", "pay"].map(|name| service("shop", name).selector(&[("app", name)]).build())
}

struct Fixture {
    index: SharedIndex,
    metrics: Arc<Metrics>,
    app: Router,
    admin: Router,
    shutdown: tokio::sync::watch::Sender<bool>,
}

fn fixture_with(index: SharedIndex, limits: Limits, token: Option<Token>) -> Fixture {
    let (shutdown, shutdown_rx) = tokio::sync::watch::channel(false);
    let metrics = Arc::new(Metrics::new());
    let state = ApiState::new(index.clone(), metrics.clone(), limits, shutdown_rx);
    Fixture {
        metrics,
        app: router(state.clone(), token),
        admin: admin_router(state),
        index,
        shutdown,
    }
}

fn fixture() -> Fixture {
    fixture_with(synced_index(1000), Limits::default(), None)
}

/// Waits until `n` long polls hold a permit and wait for a change, as the
/// `long_polls_waiting` gauge says: the condition the tests used to sleep for.
async fn until_long_polls_waiting(f: &Fixture, n: i64) {
    let want = format!("{}_long_polls_waiting {n}", crate::metrics::PREFIX);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = f.metrics.encode(&f.index).unwrap();
        if text.lines().any(|line| line == want) {
            return;
        }
        assert!(Instant::now() < deadline, "no {want:?} in:\n{text}");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// `/v1/changes` from the current generation, waiting up to 30 s.
fn long_poll_uri(f: &Fixture) -> String {
    let g = f.index.read().generation();
    format!("/v1/changes?epoch={EPOCH}&since={g}&wait=30")
}

/// A long poll ([`long_poll_uri`]) on another task, once it waits for a change.
async fn waiting_long_poll(f: &Fixture) -> tokio::task::JoinHandle<(StatusCode, Value)> {
    let (app, uri) = (f.app.clone(), long_poll_uri(f));
    let poll = tokio::spawn(async move { get(&app, &uri).await });
    until_long_polls_waiting(f, 1).await;
    poll
}

async fn get(app: &Router, uri: &str) -> (StatusCode, Value) {
    get_with(app, Request::get(uri).body(Body::empty()).unwrap()).await
}

async fn get_with(app: &Router, request: Request<Body>) -> (StatusCode, Value) {
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let value = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
    (status, value)
}

fn changes(value: Value) -> Changes {
    Changes::from_json(value.to_string().as_bytes()).unwrap()
}

fn delete_cart_2(index: &SharedIndex) {
    let p = pod("shop", "cart-2")
        .ip("10.0.0.2")
        .labels(&[("app", "cart")])
        .build();
    index.apply_pod(Event::Delete(p), SystemTime::now());
}

#[tokio::test]
async fn snapshot_has_every_record_with_epoch_generation_and_freshness() {
    let f = fixture();
    let (status, body) = get(&f.app, "/v1/snapshot").await;
    assert_eq!(status, StatusCode::OK);
    let snapshot = staleguard_core::Snapshot::from_json(body.to_string().as_bytes()).unwrap();
    assert_eq!(snapshot.epoch, EPOCH);
    assert_eq!(snapshot.generation, f.index.read().generation());
    assert!(snapshot.freshness.fresh);
    assert_eq!(snapshot.records.len(), 3);
    assert_eq!(snapshot.services.len(), 2);
}

#[tokio::test]
async fn the_verdict_view_drops_what_a_verdict_does_not_need() {
    let f = fixture();
    let (_, full) = get(&f.app, "/v1/snapshot").await;
    let (status, slim) = get(&f.app, "/v1/snapshot?view=verdict").await;
    assert_eq!(status, StatusCode::OK);
    let cart_1 = |doc: &Value| {
        doc["records"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["ip"] == "10.0.0.1")
            .cloned()
            .unwrap()
    };
    assert_eq!(cart_1(&full)["pods"][0]["uid"], "uid-cart-1");
    assert_eq!(
        cart_1(&full)["pods"][0]["services"][0]["ports"][0]["port"],
        8080
    );
    let slim_pod = &cart_1(&slim)["pods"][0];
    assert_eq!(slim_pod["name"], "cart-1");
    assert_eq!(slim_pod["services"][0]["service"], "shop/cart");
    assert!(slim_pod.get("uid").is_none() && slim_pod["services"][0].get("ports").is_none());
    assert!(slim.to_string().len() < full.to_string().len());

    let g = f.index.read().generation();
    delete_cart_2(&f.index);
    let (_, body) = get(
        &f.app,
        &format!("/v1/changes?epoch={EPOCH}&since={g}&view=verdict"),
    )
    .await;
    let Changes::Delta(delta) = changes(body) else {
        panic!("expected a delta")
    };
    assert_eq!(delta.upserts.len(), 1);
    assert!(delta.upserts[0].tombstone.as_ref().unwrap().uid.is_empty());
    let (status, _) = get(&f.app, "/v1/snapshot?view=everything").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
}

/// `uri` asked with `Accept: accept`: the status, `Content-Type`, `Vary` and body.
async fn get_accepting(
    app: &Router,
    uri: &str,
    accept: &str,
) -> (StatusCode, String, String, Vec<u8>) {
    let request = Request::get(uri)
        .header("accept", accept)
        .body(Body::empty())
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let header = |name| {
        response
            .headers()
            .get(name)
            .map(|v| v.to_str().unwrap().to_owned())
            .unwrap_or_default()
    };
    let (status, content_type, vary) = (response.status(), header("content-type"), header("vary"));
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (status, content_type, vary, bytes.to_vec())
}

const PACKED: &str = staleguard_core::packed::MEDIA_TYPE;

#[tokio::test]
async fn a_client_accepting_the_packed_form_gets_it_and_json_stays_the_default() {
    use staleguard_core::packed::{self, Record};
    let f = fixture();
    let (_, json) = get(&f.app, "/v1/snapshot?view=verdict").await;
    let json = staleguard_core::Snapshot::from_json(json.to_string().as_bytes()).unwrap();
    // Among other media types, with parameters, in any case: packed.
    for accept in [
        PACKED.to_owned(),
        format!("application/json;q=0.5, {}; q=1", PACKED.to_uppercase()),
    ] {
        let (status, content_type, vary, body) =
            get_accepting(&f.app, "/v1/snapshot", &accept).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!((content_type.as_str(), vary.as_str()), (PACKED, "accept"));
        let read =
            packed::decode_snapshot(&body[..], ServiceKey::clone, Record::into_ip_record).unwrap();
        assert_eq!((read.epoch, read.generation), (json.epoch, json.generation));
        assert_eq!(read.services, json.services);
        // The same records, as far as any verdict can tell.
        assert_eq!(read.records.len(), json.records.len());
        for (packed, json) in read.records.iter().zip(&json.records) {
            assert_eq!(packed.ip, json.ip);
            for service in ["shop/cart", "shop/pay", "shop/other"] {
                let service: ServiceKey = service.parse().unwrap();
                let known = read.services.contains(&service);
                assert_eq!(
                    decide(&Policy::default(), true, &service, known, Some(packed)),
                    decide(&Policy::default(), true, &service, known, Some(json)),
                );
            }
        }
        assert!(body.len() * 2 < serde_json::to_vec(&json).unwrap().len());
    }
    // Without it, or asking for JSON: JSON, as before.
    for accept in [
        "application/json",
        "*/*",
        "application/vnd.staleguard.packedx",
    ] {
        let (_, content_type, vary, body) = get_accepting(&f.app, "/v1/snapshot", accept).await;
        assert_eq!(
            (content_type.as_str(), vary.as_str()),
            ("application/json", "accept")
        );
        assert!(
            staleguard_core::Snapshot::from_json(&body).is_ok(),
            "{accept}"
        );
    }
}

#[tokio::test]
async fn resets_and_deltas_come_packed_to_a_client_that_accepts_it() {
    use staleguard_core::packed::{self, Record};
    let f = fixture();
    let read = |body: Vec<u8>| {
        packed::decode_changes(&body[..], ServiceKey::clone, Record::into_ip_record).unwrap()
    };
    let (_, content_type, _, body) = get_accepting(&f.app, "/v1/changes", PACKED).await;
    assert_eq!(content_type, PACKED);
    let Changes::Reset(reset) = read(body) else {
        panic!("no position: a reset")
    };
    assert_eq!((reset.epoch, reset.records.len()), (EPOCH, 3));
    // A JSON reset built meanwhile is its own answer, not the packed one.
    let (_, json) = get(&f.app, "/v1/changes").await;
    assert!(matches!(changes(json), Changes::Reset(_)));

    let g = f.index.read().generation();
    delete_cart_2(&f.index);
    let uri = format!("/v1/changes?epoch={EPOCH}&since={g}&wait=5");
    let (_, content_type, _, body) = get_accepting(&f.app, &uri, PACKED).await;
    assert_eq!(content_type, PACKED);
    let Changes::Delta(delta) = read(body) else {
        panic!("from a covered generation: a delta")
    };
    assert!(delta.generation > g);
    assert_eq!(delta.since, g);
    let upsert = &delta.upserts[0];
    assert_eq!(upsert.ip.to_string(), "10.0.0.2");
    assert!(upsert.pods.is_empty());
    assert_eq!(
        upsert.tombstone.as_ref().unwrap().services,
        vec!["shop/cart".parse::<ServiceKey>().unwrap()]
    );
    // A long poll from the current generation: an empty packed delta.
    let now = f.index.read().generation();
    let uri = format!("/v1/changes?epoch={EPOCH}&since={now}&wait=0");
    let (_, _, _, body) = get_accepting(&f.app, &uri, PACKED).await;
    let Changes::Delta(delta) = read(body) else {
        panic!("an empty delta")
    };
    assert!(delta.is_empty() && delta.generation == now);
}

const BINARY: &str = staleguard_core::packed::BINARY_MEDIA_TYPE;

/// What this release's gateway sends (`staleguard_engine::sync::ACCEPT`).
const GATEWAY_ACCEPT: &str = "application/vnd.staleguard.packed-binary, \
    application/vnd.staleguard.packed;q=0.9, application/json;q=0.5";

#[tokio::test]
async fn the_binary_packed_form_is_answered_first_and_the_last_releases_accept_as_before() {
    use staleguard_core::packed::{self, Encoding, Record};
    let f = fixture();
    let snapshot = |body: &[u8]| {
        packed::decode_snapshot(body, ServiceKey::clone, Record::into_ip_record).unwrap()
    };
    let (_, content_type, vary, binary) =
        get_accepting(&f.app, "/v1/snapshot", GATEWAY_ACCEPT).await;
    assert_eq!((content_type.as_str(), vary.as_str()), (BINARY, "accept"));
    assert_eq!(packed::encoding_of(&binary), Some(Encoding::Binary));
    // The last release's gateway asks for text, and gets what it got.
    let old = "application/vnd.staleguard.packed, application/json;q=0.5";
    let (_, content_type, _, text) = get_accepting(&f.app, "/v1/snapshot", old).await;
    assert_eq!(content_type, PACKED);
    assert_eq!(packed::encoding_of(&text), Some(Encoding::Text));
    let (binary, text) = (snapshot(&binary), snapshot(&text));
    assert_eq!(binary.records, text.records);
    assert_eq!(
        (binary.epoch, binary.generation, &binary.services),
        (text.epoch, text.generation, &text.services)
    );
    // Weights decide: text weighed above binary is text; JSON above both, JSON.
    let (_, content_type, _, _) = get_accepting(
        &f.app,
        "/v1/snapshot",
        &format!("{BINARY};q=0.1, {PACKED};q=0.2"),
    )
    .await;
    assert_eq!(content_type, PACKED);
    let (_, content_type, _, body) = get_accepting(
        &f.app,
        "/v1/snapshot",
        &format!("application/json, {BINARY};q=0.5"),
    )
    .await;
    assert_eq!(content_type, "application/json");
    assert!(staleguard_core::Snapshot::from_json(&body).is_ok());

    // Resets and deltas too, each encoding built and shared on its own.
    let (_, content_type, _, body) = get_accepting(&f.app, "/v1/changes", GATEWAY_ACCEPT).await;
    assert_eq!(content_type, BINARY);
    let read = |body: Vec<u8>| {
        packed::decode_changes(&body[..], ServiceKey::clone, Record::into_ip_record).unwrap()
    };
    let Changes::Reset(reset) = read(body) else {
        panic!("no position: a reset")
    };
    assert_eq!(reset.records, text.records);
    let (_, content_type, _, body) = get_accepting(&f.app, "/v1/changes", old).await;
    assert_eq!(content_type, PACKED);
    assert!(body.starts_with(b"staleguard-packed 1 reset\n"));
    let g = f.index.read().generation();
    delete_cart_2(&f.index);
    let uri = format!("/v1/changes?epoch={EPOCH}&since={g}&wait=5");
    let (_, content_type, _, body) = get_accepting(&f.app, &uri, GATEWAY_ACCEPT).await;
    assert_eq!(content_type, BINARY);
    let Changes::Delta(delta) = read(body) else {
        panic!("from a covered generation: a delta")
    };
    assert_eq!(delta.upserts[0].ip.to_string(), "10.0.0.2");
}

#[tokio::test]
async fn changes_from_the_current_generation_are_an_empty_delta() {
    let f = fixture();
    let g = f.index.read().generation();
    let (status, body) = get(&f.app, &format!("/v1/changes?epoch={EPOCH}&since={g}")).await;
    assert_eq!(status, StatusCode::OK);
    let Changes::Delta(delta) = changes(body) else {
        panic!("expected a delta")
    };
    assert!(delta.is_empty());
    assert_eq!((delta.since, delta.generation), (g, g));
}

#[tokio::test]
async fn changes_since_an_older_generation_carry_the_new_state() {
    let f = fixture();
    let g = f.index.read().generation();
    delete_cart_2(&f.index);
    let (_, body) = get(&f.app, &format!("/v1/changes?epoch={EPOCH}&since={g}")).await;
    let Changes::Delta(delta) = changes(body) else {
        panic!("expected a delta")
    };
    assert!(delta.generation > g);
    let upsert = delta
        .upserts
        .iter()
        .find(|r| r.ip.to_string() == "10.0.0.2")
        .expect("10.0.0.2 changed");
    assert!(upsert.pods.is_empty());
    assert!(upsert.tombstone.is_some());
}

#[tokio::test]
async fn a_wrong_or_missing_position_answers_with_a_reset() {
    let f = fixture();
    for uri in [
        "/v1/changes?epoch=8&since=1".to_owned(),
        "/v1/changes".to_owned(),
        format!("/v1/changes?epoch={EPOCH}"),
        format!("/v1/changes?epoch={EPOCH}&since=999999"),
    ] {
        let (status, body) = get(&f.app, &uri).await;
        assert_eq!(status, StatusCode::OK, "{uri}");
        let Changes::Reset(snapshot) = changes(body) else {
            panic!("{uri}: expected a reset")
        };
        assert_eq!(snapshot.epoch, EPOCH);
        assert_eq!(snapshot.records.len(), 3);
    }
}

#[tokio::test]
async fn a_generation_compacted_away_answers_with_a_reset() {
    let f = fixture_with(synced_index(1), Limits::default(), None);
    let g = f.index.read().generation();
    delete_cart_2(&f.index);
    let p = pod("shop", "pay-1").ip("10.0.0.9").build();
    f.index.apply_pod(Event::Delete(p), SystemTime::now());
    let (_, body) = get(&f.app, &format!("/v1/changes?epoch={EPOCH}&since={g}")).await;
    assert!(matches!(changes(body), Changes::Reset(_)));
}

#[tokio::test]
async fn a_long_poll_wakes_on_a_change_before_its_wait_ends() {
    let f = fixture();
    let started = Instant::now();
    let poll = waiting_long_poll(&f).await;
    assert!(!poll.is_finished(), "answered before any change");
    delete_cart_2(&f.index);
    let (status, body) = poll.await.unwrap();
    assert_eq!(status, StatusCode::OK);
    let Changes::Delta(delta) = changes(body) else {
        panic!("expected a delta")
    };
    assert!(!delta.is_empty());
    assert!(started.elapsed() < Duration::from_secs(30), "waited out");
}

#[tokio::test]
async fn a_long_poll_without_changes_times_out_with_an_empty_delta() {
    let f = fixture();
    let g = f.index.read().generation();
    let started = Instant::now();
    let (status, body) = get(
        &f.app,
        &format!("/v1/changes?epoch={EPOCH}&since={g}&wait=0.2"),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert!(started.elapsed() >= Duration::from_millis(200));
    let Changes::Delta(delta) = changes(body) else {
        panic!("expected a delta")
    };
    assert!(delta.is_empty());
    assert_eq!(delta.generation, g);
}

#[tokio::test]
async fn a_wait_beyond_max_wait_is_cut_to_it_not_refused() {
    // A gateway whose poll_wait_s exceeds the validator's --max-wait still
    // gets its answers, only sooner.
    let limits = Limits {
        max_wait: Duration::from_millis(200),
        ..Limits::default()
    };
    let f = fixture_with(synced_index(1024), limits, None);
    let g = f.index.read().generation();
    let started = Instant::now();
    let (status, body) = get(
        &f.app,
        &format!("/v1/changes?epoch={EPOCH}&since={g}&wait=30"),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(200) && waited < Duration::from_secs(10),
        "{waited:?}"
    );
    assert!(matches!(changes(body), Changes::Delta(d) if d.is_empty()));
}

#[tokio::test]
async fn shutdown_answers_waiting_long_polls_at_once() {
    let f = fixture();
    let poll = waiting_long_poll(&f).await;
    f.shutdown.send(true).unwrap();
    let (status, body) = tokio::time::timeout(Duration::from_secs(5), poll)
        .await
        .expect("the long poll answered after shutdown")
        .unwrap();
    assert_eq!(status, StatusCode::OK);
    assert!(matches!(changes(body), Changes::Delta(d) if d.is_empty()));
}

#[tokio::test]
async fn a_stopped_source_fails_healthz_and_answers_waiting_long_polls_as_not_fresh() {
    let f = fixture();
    let poll = waiting_long_poll(&f).await;
    assert!(!poll.is_finished(), "answered before anything happened");
    let (status, _) = get(&f.admin, "/healthz").await;
    assert_eq!(status, StatusCode::OK);
    f.index.fail("the pod watch ended");
    // Well before the one-second freshness recheck.
    let (status, body) = tokio::time::timeout(Duration::from_millis(500), poll)
        .await
        .expect("the long poll answered at once")
        .unwrap();
    assert_eq!(status, StatusCode::OK);
    let Changes::Delta(delta) = changes(body) else {
        panic!("expected a delta")
    };
    assert!(!delta.freshness.fresh);
    let (status, body) = get(&f.admin, "/healthz").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(
        body.as_str().unwrap().contains("the pod watch ended"),
        "{body}"
    );
    let (_, body) = get(&f.app, "/v1/snapshot").await;
    assert_eq!(body["freshness"]["fresh"], false);
    let (status, _) = get(&f.admin, "/readyz").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
}

/// Holds the index's write lock for `hold` on another thread, as a long event
/// application would; returns the flag it sets just before letting go.
fn hold_the_write_lock(index: &SharedIndex, hold: Duration) -> Arc<std::sync::atomic::AtomicBool> {
    let released = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (index, flag) = (index.clone(), released.clone());
    let (locked_tx, locked_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        index.update(|_| {
            locked_tx.send(()).unwrap();
            std::thread::sleep(hold);
            flag.store(true, std::sync::atomic::Ordering::SeqCst);
        });
    });
    locked_rx.recv().unwrap();
    released
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_gateways_resetting_at_once_cost_one_build() {
    let f = fixture();
    // The first build is stuck behind a writer while the fleet arrives.
    let released = hold_the_write_lock(&f.index, Duration::from_millis(300));
    let mut polls = Vec::new();
    for i in 0..50 {
        let app = f.app.clone();
        // Restarted gateways ask for a snapshot; gateways that saw the
        // validator restart ask for changes with an epoch that is not ours.
        let uri = if i % 2 == 0 {
            "/v1/snapshot?view=verdict".to_owned()
        } else {
            format!("/v1/changes?view=verdict&epoch={}&since=1", EPOCH + 1)
        };
        polls.push(tokio::spawn(async move { get(&app, &uri).await }));
    }
    let mut generations = std::collections::BTreeSet::new();
    for (i, poll) in polls.into_iter().enumerate() {
        let (status, body) = poll.await.unwrap();
        assert_eq!(status, StatusCode::OK);
        let generation = if i % 2 == 0 {
            staleguard_core::Snapshot::from_json(body.to_string().as_bytes())
                .unwrap()
                .generation
        } else {
            let Changes::Reset(s) = changes(body) else {
                panic!("expected a reset")
            };
            s.generation
        };
        generations.insert(generation);
    }
    assert!(released.load(std::sync::atomic::Ordering::SeqCst));
    assert_eq!(generations.len(), 1);
    assert_eq!(f.metrics.answer_builds("snapshot"), 1);
    assert_eq!(f.metrics.answer_builds("reset"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_resets_from_distinct_since_values_share_one_snapshot_build() {
    // A change log of one entry: every generation but the latest is compacted.
    let f = fixture_with(synced_index(1), Limits::default(), None);
    for i in 0..12 {
        let ip = format!("10.0.1.{i}");
        let p = pod("shop", &ip).ip(&ip).labels(&[("app", "cart")]).build();
        f.index.apply_pod(Event::Apply(p), SystemTime::now());
    }
    let generation = f.index.read().generation();
    let floor = f.index.read().change_log_floor();
    assert!(floor >= 10, "{floor}");
    // The builds are stuck behind a writer while all twenty arrive.
    let released = hold_the_write_lock(&f.index, Duration::from_millis(300));
    let mut polls = Vec::new();
    for i in 0..20u64 {
        let app = f.app.clone();
        // Half of them compacted away, half ahead of the index: made up.
        let since = if i % 2 == 0 {
            i / 2
        } else {
            generation + 1_000 + i
        };
        let uri = format!("/v1/changes?epoch={EPOCH}&since={since}");
        polls.push(tokio::spawn(async move { get(&app, &uri).await }));
    }
    for poll in polls {
        let (status, body) = poll.await.unwrap();
        assert_eq!(status, StatusCode::OK);
        assert!(matches!(changes(body), Changes::Reset(_)));
    }
    assert!(released.load(std::sync::atomic::Ordering::SeqCst));
    let builds = f.metrics.answer_builds("snapshot") + f.metrics.answer_builds("reset");
    assert_eq!(
        builds, 1,
        "one snapshot for every reset, whatever the since"
    );
    let started =
        f.metrics.answer_build_reasons("compacted") + f.metrics.answer_build_reasons("ahead");
    assert_eq!(started, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_builds_bounds_the_builds_running_at_once() {
    let limits = Limits {
        max_builds: 2,
        ..Limits::default()
    };
    let f = fixture_with(synced_index(1000), limits, None);
    for ip in [
        "10.0.0.21",
        "10.0.0.22",
        "10.0.0.23",
        "10.0.0.24",
        "10.0.0.25",
    ] {
        let p = pod("shop", ip).ip(ip).labels(&[("app", "cart")]).build();
        f.index.apply_pod(Event::Apply(p), SystemTime::now());
    }
    let generation = f.index.read().generation();
    // Each poll asks a distinct delta the log covers: a build each, but held
    // behind a writer, so they would all run at once without the cap.
    let released = hold_the_write_lock(&f.index, Duration::from_millis(600));
    let mut polls = Vec::new();
    for since in generation - 5..generation {
        let app = f.app.clone();
        let uri = format!("/v1/changes?epoch={EPOCH}&since={since}");
        polls.push(tokio::spawn(async move { get(&app, &uri).await }));
    }
    let mut most = 0;
    while !released.load(std::sync::atomic::Ordering::SeqCst) {
        most = most.max(f.metrics.answer_builds_running());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(most, 2, "builds running at once while five waited");
    for poll in polls {
        let (status, body) = poll.await.unwrap();
        assert_eq!(status, StatusCode::OK);
        assert!(matches!(changes(body), Changes::Delta(_)));
    }
    assert_eq!(f.metrics.answer_build_reasons("delta"), 5);
}

#[tokio::test(flavor = "current_thread")]
async fn a_snapshot_build_never_blocks_the_async_workers() {
    let f = fixture();
    let released = hold_the_write_lock(&f.index, Duration::from_millis(500));
    let app = f.app.clone();
    let snapshot = tokio::spawn(async move { get(&app, "/v1/snapshot").await });
    tokio::task::yield_now().await;
    // The only worker thread is free while the build waits for the lock.
    let (status, _) = get(&f.admin, "/healthz").await;
    assert_eq!(status, StatusCode::OK);
    let (status, _) = get(&f.admin, "/readyz").await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        !released.load(std::sync::atomic::Ordering::SeqCst),
        "the probes waited for the snapshot build"
    );
    let (status, _) = snapshot.await.unwrap();
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn long_polls_beyond_the_limit_get_429() {
    let limits = Limits {
        max_long_polls: 1,
        ..Limits::default()
    };
    let f = fixture_with(synced_index(1000), limits, None);
    let first = waiting_long_poll(&f).await;
    let (status, body) = get(&f.app, &long_poll_uri(&f)).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(body["error"]["code"], "too_many_long_polls");
    f.shutdown.send(true).unwrap();
    assert_eq!(first.await.unwrap().0, StatusCode::OK);
}

/// A long poll from `client`, as the listener marks a request it accepted.
fn long_poll_from(f: &Fixture, client: [u8; 4]) -> Request<Body> {
    let mut request = Request::get(long_poll_uri(f)).body(Body::empty()).unwrap();
    request
        .extensions_mut()
        .insert(axum::extract::ConnectInfo(std::net::SocketAddr::from((
            client, 40000,
        ))));
    request
}

#[tokio::test]
async fn max_long_polls_per_client_leaves_room_for_the_other_clients() {
    let limits = Limits {
        max_long_polls_per_client: 2,
        ..Limits::default()
    };
    let f = fixture_with(synced_index(1000), limits, None);
    let mut waiting = Vec::new();
    for n in 1..=2 {
        let (app, request) = (f.app.clone(), long_poll_from(&f, [10, 1, 1, 1]));
        waiting.push(tokio::spawn(async move { get_with(&app, request).await }));
        until_long_polls_waiting(&f, n).await;
    }
    let (status, body) = get_with(&f.app, long_poll_from(&f, [10, 1, 1, 1])).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("limit 2"),
        "{body}"
    );
    // Another client still gets in.
    let (app, request) = (f.app.clone(), long_poll_from(&f, [10, 1, 1, 2]));
    waiting.push(tokio::spawn(async move { get_with(&app, request).await }));
    until_long_polls_waiting(&f, 3).await;
    assert_eq!(
        f.metrics.long_polls_refused("10.1.1.1", "max_per_client"),
        1
    );
    assert_eq!(
        f.metrics.long_polls_refused("10.1.1.2", "max_per_client"),
        0
    );
    f.shutdown.send(true).unwrap();
    for poll in waiting {
        assert_eq!(poll.await.unwrap().0, StatusCode::OK);
    }
}

#[tokio::test]
async fn long_poll_refusals_are_counted_per_client_with_bounded_labels() {
    let limits = Limits {
        max_long_polls: 1,
        ..Limits::default()
    };
    let f = fixture_with(synced_index(1000), limits, None);
    let first = waiting_long_poll(&f).await;
    let clients = crate::metrics::MAX_CLIENT_LABELS as u8 + 8;
    for last in 1..=clients {
        let (status, _) = get_with(&f.app, long_poll_from(&f, [10, 2, 0, last])).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    }
    assert_eq!(
        f.metrics.long_polls_refused("10.2.0.1", "max_long_polls"),
        1
    );
    assert_eq!(f.metrics.long_polls_refused("other", "max_long_polls"), 8);
    let (_, metrics) = get(&f.admin, "/metrics").await;
    let text = metrics.as_str().unwrap_or_default().to_owned();
    let series = text
        .lines()
        .filter(|l| l.starts_with("staleguard_validator_long_polls_refused_total{"))
        .count();
    assert_eq!(series, crate::metrics::MAX_CLIENT_LABELS + 1, "{text}");
    f.shutdown.send(true).unwrap();
    assert_eq!(first.await.unwrap().0, StatusCode::OK);
}

#[tokio::test]
async fn ip_lookup_finds_a_record_or_says_not_found() {
    let f = fixture();
    let (status, body) = get(&f.app, "/v1/ips/10.0.0.1").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["record"]["pods"][0]["name"], "cart-1");
    assert_eq!(body["freshness"]["fresh"], true);
    let (status, body) = get(&f.app, "/v1/ips/10.9.9.9").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(body["error"]["code"], "not_found");
}

#[tokio::test]
async fn verdicts_match_the_rules() {
    let f = fixture();
    delete_cart_2(&f.index);
    for (query, reason, action) in [
        ("service=shop/cart&ip=10.0.0.1&port=8080", "member", "allow"),
        ("service=shop/cart&ip=10.0.0.2", "destroyed", "reject"),
        ("service=shop/cart&ip=10.0.0.9", "recycled", "reject"),
        ("service=shop/cart&ip=10.7.7.7", "destroyed", "reject"),
        ("service=shop/other&ip=10.0.0.1", "unknown_service", "allow"),
        (
            "service=shop/other&ip=10.0.0.1&unknown_service=reject",
            "unknown_service",
            "reject",
        ),
    ] {
        let (status, body) = get(&f.app, &format!("/v1/verdict?{query}")).await;
        assert_eq!(status, StatusCode::OK, "{query}: {body}");
        assert_eq!(body["verdict"]["reason"], reason, "{query}");
        assert_eq!(body["verdict"]["action"], action, "{query}");
    }
}

#[tokio::test]
async fn bad_input_is_a_400_with_a_json_error() {
    let f = fixture();
    let long = format!(
        "/v1/verdict?service=shop/cart&ip=10.0.0.1&x={}",
        "a".repeat(2000)
    );
    for uri in [
        "/v1/ips/10.0.0.256",
        "/v1/ips/not-an-ip",
        "/v1/verdict?service=cart&ip=10.0.0.1",
        "/v1/verdict?service=Shop/cart&ip=10.0.0.1",
        "/v1/verdict?ip=10.0.0.1",
        "/v1/verdict?service=shop/cart",
        "/v1/verdict?service=shop/cart&ip=10.0.0.1&port=0",
        "/v1/verdict?service=shop/cart&ip=10.0.0.1&port=70000",
        "/v1/verdict?service=shop/cart&ip=10.0.0.1&terminating=maybe",
        "/v1/changes?epoch=7&since=1&wait=-1",
        "/v1/changes?epoch=7&since=1&wait=NaN",
        "/v1/changes?epoch=seven&since=1",
        "/v1/changes?since=-3",
        "/v1/snapshot?v=2",
        "/v1/changes?v=0",
        "/v1/changes?epoch=7&since=1&wiat=30",
        "/v1/snapshot?veiw=verdict",
        "/v1/verdict?service=shop/cart&ip=10.0.0.1&terminatin=reject",
        long.as_str(),
    ] {
        let (status, body) = get(&f.app, uri).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{uri}: {body}");
        assert_eq!(body["error"]["code"], "bad_request", "{uri}");
        assert!(
            body["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{uri}"
        );
    }
    // A misspelt parameter is named, with what is accepted.
    let (_, body) = get(&f.app, "/v1/changes?epoch=7&since=1&wiat=30").await;
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("unknown field `wiat`") && message.contains("`wait`"),
        "{message}"
    );
    let (status, body) = get(&f.app, "/v2/anything").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(body["error"]["code"], "not_found");
}

#[tokio::test]
async fn the_token_guards_v1() {
    const SECRET: &str = "open-sesame-open-sesame-open-sesame";
    let dir = std::env::temp_dir().join(format!("sg-api-token-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("token");
    std::fs::write(&path, format!("{SECRET}\n")).unwrap();
    let token = Token::from_file(&path).unwrap();
    let f = fixture_with(synced_index(1000), Limits::default(), Some(token));
    let request = |auth: Option<&str>| {
        let mut r = Request::get("/v1/snapshot");
        if let Some(auth) = auth {
            r = r.header("authorization", auth);
        }
        r.body(Body::empty()).unwrap()
    };
    let basic = format!("Basic {SECRET}");
    for auth in [
        None,
        Some("Bearer wrong"),
        Some(SECRET),
        Some(basic.as_str()),
    ] {
        let (status, body) = get_with(&f.app, request(auth)).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{auth:?}");
        assert_eq!(body["error"]["code"], "unauthorized");
        assert!(!body.to_string().contains(SECRET));
    }
    // The scheme is case-insensitive, as every HTTP auth scheme.
    for scheme in ["Bearer", "bearer", "BEARER"] {
        let auth = format!("{scheme} {SECRET}");
        let (status, _) = get_with(&f.app, request(Some(&auth))).await;
        assert_eq!(status, StatusCode::OK, "{auth}");
    }
    // The admin listener needs no token.
    let (status, _) = get(&f.admin, "/healthz").await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn readyz_waits_for_the_initial_sync() {
    let empty = SharedIndex::new(
        Index::new(EPOCH, IndexConfig::default()),
        Duration::from_secs(60),
    );
    let f = fixture_with(empty, Limits::default(), None);
    let (status, body) = get(&f.admin, "/readyz").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(body["ready"], false);
    assert_eq!(body["watches"].as_array().unwrap().len(), 3);

    let f = fixture();
    let (status, body) = get(&f.admin, "/readyz").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["ready"], true);
}

#[tokio::test]
async fn metrics_show_the_index_and_the_requests() {
    let f = fixture();
    get(&f.app, "/v1/snapshot").await;
    get(&f.app, "/v1/ips/nope").await;
    let response = f
        .admin
        .clone()
        .oneshot(Request::get("/metrics").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let text = String::from_utf8(
        response
            .into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes()
            .to_vec(),
    )
    .unwrap();
    for expected in [
        "staleguard_validator_index_pods 3",
        "staleguard_validator_index_ips 3",
        "staleguard_validator_index_services 2",
        "staleguard_validator_ready 1",
        r#"staleguard_validator_api_requests_total{route="snapshot",status="200"} 1"#,
        r#"staleguard_validator_api_requests_total{route="ips",status="400"} 1"#,
        r#"staleguard_validator_watch_events_total{resource="pod",event="init_apply"} 3"#,
        "staleguard_validator_long_polls_waiting 0",
        "# EOF",
    ] {
        assert!(text.contains(expected), "missing {expected:?} in:\n{text}");
    }
}

#[tokio::test]
async fn a_verdict_for_a_service_outside_the_pod_scope_says_why_it_is_unknown() {
    // `--pod-selector app=pay`: cart's pods are not watched, so its slice
    // entry names a pod the index never sees.
    let config = IndexConfig {
        scope: crate::scope::PodScope {
            namespace: None,
            pod_selector: Some(crate::scope::Selector::parse("app=pay").unwrap()),
        },
        ..IndexConfig::default()
    };
    let shared = SharedIndex::new(Index::new(EPOCH, config), Duration::from_secs(60));
    let pay_1 = pod("shop", "pay-1")
        .ip("10.0.0.9")
        .labels(&[("app", "pay")])
        .build();
    let cart_abc = slice("shop", "cart-abc", "cart")
        .port("http", 8080)
        .endpoint("10.0.0.1", Some("uid-cart-1"))
        .build();
    shared.relist_all(shop_services(), [pay_1], [cart_abc], SystemTime::now());
    let f = fixture_with(shared, Limits::default(), None);

    let (_, body) = get(&f.app, "/v1/verdict?service=shop/cart&ip=10.0.0.1").await;
    assert_eq!(body["verdict"]["reason"], "unknown_service", "{body}");
    assert_eq!(body["verdict"]["action"], "allow", "{body}");
    assert_eq!(body["service_known"], false);
    let why = body["out_of_scope"].as_str().unwrap();
    assert!(
        why.contains("app=cart does not imply --pod-selector"),
        "{why}"
    );
    // The service the scope covers is judged as before.
    let (_, body) = get(&f.app, "/v1/verdict?service=shop/pay&ip=10.0.0.9").await;
    assert_eq!(body["verdict"]["reason"], "member", "{body}");
    assert!(body.get("out_of_scope").is_none(), "{body}");
    let (_, body) = get(&f.app, "/v1/verdict?service=shop/pay&ip=10.0.0.1").await;
    assert_eq!(body["verdict"]["reason"], "destroyed", "{body}");
    // Gateways do not get it as a known service either.
    let (_, body) = get(&f.app, "/v1/snapshot").await;
    assert_eq!(body["services"], serde_json::json!(["shop/pay"]), "{body}");
    let (_, metrics) = get(&f.admin, "/metrics").await;
    let metrics = metrics.as_str().unwrap_or_default().to_owned();
    assert!(
        metrics.contains("staleguard_validator_index_services_out_of_scope 1"),
        "{metrics}"
    );
}

// === POST /v1/verdicts ===

fn post_json(uri: &str, body: &str, auth: Option<&str>) -> Request<Body> {
    let mut r = Request::post(uri).header("content-type", "application/json");
    if let Some(auth) = auth {
        r = r.header("authorization", auth);
    }
    r.body(Body::from(body.to_owned())).unwrap()
}

#[tokio::test]
async fn batch_verdicts_match_the_single_ones_in_order() {
    let f = fixture();
    delete_cart_2(&f.index);
    let queries = [
        ("shop/cart", "10.0.0.1"),
        ("shop/cart", "10.0.0.2"),
        ("shop/cart", "10.0.0.9"),
        ("shop/cart", "10.7.7.7"),
        ("shop/other", "10.0.0.1"),
    ];
    let items: Vec<Value> = queries
        .iter()
        .map(|(s, ip)| serde_json::json!({"service": s, "ip": ip}))
        .collect();
    let body = serde_json::json!({"items": items}).to_string();
    let (status, answer) = get_with(&f.app, post_json("/v1/verdicts", &body, None)).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    let answer: staleguard_core::batch::VerdictsAnswer = serde_json::from_value(answer).unwrap();
    assert_eq!(answer.generation, f.index.read().generation());
    assert!(answer.freshness.fresh);
    assert_eq!(answer.items.len(), queries.len());
    for ((service, ip), item) in queries.iter().zip(&answer.items) {
        let (_, single) = get(&f.app, &format!("/v1/verdict?service={service}&ip={ip}")).await;
        assert_eq!(item.service.to_string(), *service);
        assert_eq!(item.ip.to_string(), *ip);
        assert_eq!(
            serde_json::to_value(item.verdict).unwrap(),
            single["verdict"]
        );
        assert_eq!(item.service_known, single["service_known"]);
    }
    let tombstone = answer.items[1].record.as_ref().unwrap().tombstone.as_ref();
    assert!(tombstone.is_some_and(|t| t.uid.is_empty()), "verdict view");

    let slim = body.replace("{\"items\"", "{\"records\":\"not_member\",\"items\"");
    let (_, answer) = get_with(&f.app, post_json("/v1/verdicts", &slim, None)).await;
    let with_record: Vec<bool> = answer["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i.get("record").is_some())
        .collect();
    assert_eq!(with_record, [false, true, true, false, true], "{answer}");

    let strict = r#"{"policy":{"unknown_service":"reject"},"items":[{"service":"shop/other","ip":"10.0.0.1"}]}"#;
    let (_, answer) = get_with(&f.app, post_json("/v1/verdicts", strict, None)).await;
    assert_eq!(answer["items"][0]["verdict"]["action"], "reject");
}

#[tokio::test]
async fn batch_verdicts_refuse_bad_bodies_and_need_the_token() {
    let f = fixture();
    for body in [
        "",
        "{",
        "[]",
        r#"{"items":[{"service":"cart","ip":"10.0.0.1"}]}"#,
        r#"{"items":[{"service":"shop/cart","ip":"10.0.0.256"}]}"#,
        r#"{"policy":{"fail":"open"},"items":[]}"#,
    ] {
        let (status, answer) = get_with(&f.app, post_json("/v1/verdicts", body, None)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {answer}");
        assert_eq!(answer["error"]["code"], "bad_request", "{body}");
    }
    let (status, _) = get_with(
        &f.app,
        post_json("/v1/verdicts?v=2", r#"{"items":[]}"#, None),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);

    let dir = std::env::temp_dir().join(format!("sg-api-batch-token-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("token");
    // At least 32 bytes: shorter tokens are refused at start.
    std::fs::write(&path, "open-sesame-open-sesame-open-sesame\n").unwrap();
    let token = Token::from_file(&path).unwrap();
    let f = fixture_with(synced_index(1000), Limits::default(), Some(token));
    let body = r#"{"items":[{"service":"shop/cart","ip":"10.0.0.1"}]}"#;
    let (status, _) = get_with(&f.app, post_json("/v1/verdicts", body, None)).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, answer) = get_with(
        &f.app,
        post_json(
            "/v1/verdicts",
            body,
            Some("Bearer open-sesame-open-sesame-open-sesame"),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert_eq!(answer["items"][0]["verdict"]["reason"], "member");
}

/// A body that yields `chunk`-byte pieces of JSON-ish filler for ever,
/// counting the bytes the server pulled from it.
fn endless_body(chunk: usize, pulled: Arc<std::sync::atomic::AtomicUsize>) -> Body {
    let stream = futures::stream::unfold(pulled, move |pulled| async move {
        pulled.fetch_add(chunk, std::sync::atomic::Ordering::SeqCst);
        let piece = axum::body::Bytes::from(vec![b' '; chunk]);
        Some((Ok::<_, std::io::Error>(piece), pulled))
    });
    Body::from_stream(stream)
}

#[tokio::test]
async fn an_oversized_verdicts_body_is_refused_before_it_is_read_whole() {
    let f = fixture();
    let limit = verdicts::MAX_BODY_BYTES;
    // Declared too large: refused before a byte is read.
    let pulled = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let request = Request::post("/v1/verdicts")
        .header("content-type", "application/json")
        .header("content-length", (limit + 1).to_string())
        .body(endless_body(64 * 1024, pulled.clone()))
        .unwrap();
    let (status, answer) = get_with(&f.app, request).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{answer}");
    assert_eq!(answer["error"]["code"], "too_large");
    let message = answer["error"]["message"].as_str().unwrap();
    assert!(message.contains(&limit.to_string()), "{message}");
    assert_eq!(pulled.load(std::sync::atomic::Ordering::SeqCst), 0);
    // Undeclared (chunked) and endless: reading stops at the limit.
    let pulled = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let request = Request::post("/v1/verdicts")
        .header("content-type", "application/json")
        .body(endless_body(64 * 1024, pulled.clone()))
        .unwrap();
    let (status, answer) = get_with(&f.app, request).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{answer}");
    let read = pulled.load(std::sync::atomic::Ordering::SeqCst);
    assert!(read <= limit + 2 * 64 * 1024, "read {read} bytes");
}

#[tokio::test]
async fn verdicts_past_max_items_are_refused_with_the_limit_named() {
    let f = fixture();
    let item = r#"{"service":"shop/cart","ip":"10.0.0.1"}"#;
    let n = staleguard_core::batch::MAX_ITEMS + 1;
    let body = format!(r#"{{"items":[{}]}}"#, vec![item; n].join(","));
    let (status, answer) = get_with(&f.app, post_json("/v1/verdicts", &body, None)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let message = answer["error"]["message"].as_str().unwrap();
    assert!(message.contains("more than 200000 items"), "{message}");
}

#[tokio::test(flavor = "current_thread")]
async fn max_verdict_batches_holds_further_bodies_unread_and_judging_leaves_the_workers_free() {
    let limits = Limits {
        max_verdict_batches: 1,
        ..Limits::default()
    };
    let f = fixture_with(synced_index(1000), limits, None);
    // The first batch's judging waits for a writer, on the blocking pool.
    let released = hold_the_write_lock(&f.index, Duration::from_millis(400));
    let body = r#"{"items":[{"service":"shop/cart","ip":"10.0.0.1"}]}"#;
    let app = f.app.clone();
    let first =
        tokio::spawn(async move { get_with(&app, post_json("/v1/verdicts", body, None)).await });
    // A second batch waits for the permit before reading its body.
    let pulled = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let request = Request::post("/v1/verdicts")
        .header("content-type", "application/json")
        .body(endless_body(1024, pulled.clone()))
        .unwrap();
    let app = f.app.clone();
    let second = tokio::spawn(async move { get_with(&app, request).await });
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    // The only async worker is free while the first batch is judged.
    let (status, _) = get(&f.admin, "/healthz").await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        !released.load(std::sync::atomic::Ordering::SeqCst),
        "the probe waited for the batch"
    );
    assert_eq!(
        pulled.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "the second body was read while the first batch held the only permit"
    );
    let (status, answer) = first.await.unwrap();
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert_eq!(answer["items"][0]["verdict"]["reason"], "member");
    // Once its turn came, the endless second body was read up to the limit.
    let (status, _) = second.await.unwrap();
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert!(pulled.load(std::sync::atomic::Ordering::SeqCst) > 0);
}

/// A `GET` of `uri` with `accept`: status, the headers, the body.
async fn get_headers(
    app: &Router,
    uri: &str,
    accept: &str,
) -> (StatusCode, axum::http::HeaderMap, Vec<u8>) {
    let request = Request::get(uri)
        .header("accept", accept)
        .body(Body::empty())
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let (status, headers) = (response.status(), response.headers().clone());
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (status, headers, bytes.to_vec())
}

fn header_of<'a>(headers: &'a axum::http::HeaderMap, name: &str) -> &'a str {
    headers
        .get(name)
        .map_or("", |v| v.to_str().unwrap_or_default())
}

#[tokio::test]
async fn an_answer_asked_in_pages_comes_back_whole_from_its_pages_in_any_form() {
    use staleguard_core::page::{ID_HEADER, LENGTH_HEADER, MIN_PAGE_BYTES, OFFSET_HEADER};
    let f = fixture_with(
        crate::synth::indexed(crate::synth::cluster(50, 100)),
        Limits::default(),
        None,
    );
    let epoch = f.index.epoch();
    for (accept, uri) in [
        ("application/json", "/v1/snapshot?v=1".to_owned()),
        (
            staleguard_core::packed::BINARY_MEDIA_TYPE,
            "/v1/snapshot?v=1&view=verdict".to_owned(),
        ),
        (
            PACKED,
            format!("/v1/changes?v=1&epoch={}&since=0", epoch + 1),
        ),
    ] {
        let (status, _, whole) = get_headers(&f.app, &uri, accept).await;
        assert_eq!(status, StatusCode::OK);
        assert!(whole.len() > 2 * MIN_PAGE_BYTES as usize, "{}", whole.len());
        // A page size under the floor is raised to it.
        let (status, first_headers, first) =
            get_headers(&f.app, &format!("{uri}&page_bytes=100"), accept).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(first.len(), MIN_PAGE_BYTES as usize);
        assert_eq!(
            header_of(&first_headers, LENGTH_HEADER),
            whole.len().to_string()
        );
        let content_type = header_of(&first_headers, "content-type").to_owned();
        let id = header_of(&first_headers, ID_HEADER).to_owned();
        assert!(!id.is_empty());
        // Another client of the same answer gets the same id.
        let (_, again, _) = get_headers(&f.app, &format!("{uri}&page_bytes=100"), accept).await;
        assert_eq!(header_of(&again, ID_HEADER), id);
        let mut body = first;
        while body.len() < whole.len() {
            let page_uri = format!(
                "/v1/answer?v=1&id={id}&offset={}&page_bytes=20000",
                body.len()
            );
            let (status, headers, page) = get_headers(&f.app, &page_uri, accept).await;
            assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&page));
            assert_eq!(header_of(&headers, OFFSET_HEADER), body.len().to_string());
            assert_eq!(header_of(&headers, ID_HEADER), id);
            assert_eq!(header_of(&headers, "content-type"), content_type);
            assert!(!page.is_empty() && page.len() <= 20_000);
            body.extend_from_slice(&page);
        }
        assert_eq!(body, whole, "{accept}: the pages are the unpaged answer");
        // An offset past the end is refused; the end itself is an empty page.
        let past = format!("/v1/answer?v=1&id={id}&offset={}", whole.len() + 1);
        let (status, _) = get(&f.app, &past).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        let end = format!("/v1/answer?v=1&id={id}&offset={}", whole.len());
        let (status, _, page) = get_headers(&f.app, &end, accept).await;
        assert_eq!((status, page.len()), (StatusCode::OK, 0));
    }
    // An answer that fits a page comes whole, without the headers.
    let (status, headers, _) = get_headers(
        &f.app,
        &format!(
            "/v1/changes?v=1&epoch={epoch}&since={}&page_bytes=65536",
            f.index.generation()
        ),
        PACKED,
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert!(headers.get(LENGTH_HEADER).is_none());
}

#[tokio::test]
async fn a_page_of_an_answer_no_longer_held_is_gone_and_the_route_takes_no_other_parameter() {
    let f = fixture();
    let (status, body) = get(&f.app, "/v1/answer?v=1&id=7-99&offset=0").await;
    assert_eq!(status, StatusCode::GONE);
    assert_eq!(body["error"]["code"], "gone");
    let (status, _) = get(&f.app, "/v1/answer?v=1&id=7-99&offset=0&wait=1").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let (status, _) = get(&f.app, "/v1/answer?v=1&offset=0").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn the_answer_route_is_behind_the_token_too() {
    let dir = std::env::temp_dir().join(format!("sg-api-pages-token-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("token");
    std::fs::write(&path, "open-sesame-open-sesame-open-sesame\n").unwrap();
    let token = Token::from_file(&path).unwrap();
    let f = fixture_with(synced_index(1000), Limits::default(), Some(token));
    let (status, _) = get(&f.app, "/v1/answer?v=1&id=7-1&offset=0").await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
}
