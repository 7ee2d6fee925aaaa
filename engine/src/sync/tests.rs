use super::*;
use crate::buckets;
use crate::entry::Entry;
use crate::store::{IndexReader, MemoryStore};

use staleguard_core::{Freshness, IpRecord, PodHolder, ServiceKey};
use std::net::IpAddr;

pub(crate) const CFG: SyncConfig = SyncConfig {
    wait_s: 5,
    backoff_initial_ms: 100,
    backoff_max_ms: 1_000,
    min_interval_ms: 0,
    page_bytes: None,
};

/// What the root builds from the shipped plugin configuration.
const SHIPPED: SyncConfig = SyncConfig {
    wait_s: 30,
    backoff_initial_ms: 500,
    backoff_max_ms: 30_000,
    min_interval_ms: 50,
    page_bytes: None,
};

pub(crate) fn cart() -> ServiceKey {
    ServiceKey::new("shop", "cart")
}

pub(crate) fn rec(ip: &str) -> IpRecord {
    IpRecord::held_by(
        ip.parse().unwrap(),
        vec![PodHolder::ready_member(
            "shop",
            format!("cart-{ip}"),
            ip,
            cart(),
        )],
    )
}

pub(crate) fn snapshot(epoch: u64, generation: u64, ips: &[&str]) -> Snapshot {
    Snapshot {
        v: 1,
        epoch,
        generation,
        freshness: Freshness {
            fresh: true,
            age_ms: Some(5),
        },
        services: vec![cart()],
        records: ips.iter().map(|ip| rec(ip)).collect(),
    }
}

pub(crate) fn delta(epoch: u64, since: u64, generation: u64) -> Delta {
    Delta {
        v: 1,
        epoch,
        since,
        generation,
        freshness: Freshness {
            fresh: true,
            age_ms: None,
        },
        services_added: vec![],
        services_removed: vec![],
        upserts: vec![],
        removed: vec![],
    }
}

pub(crate) fn present(store: &MemoryStore, ip: &str) -> bool {
    matches!(
        IndexReader::new(store)
            .lookup(&cart(), &ip.parse().unwrap())
            .record,
        Entry::Present(_)
    )
}

pub(crate) fn json<T: serde::Serialize>(t: &T) -> Vec<u8> {
    serde_json::to_vec(t).unwrap()
}

/// A poller (id 7) that loaded a snapshot of `ips` (epoch 9, generation 3)
/// at time 0, and the store it wrote.
fn loaded(ips: &[&str]) -> (Poller, MemoryStore) {
    let mut store = MemoryStore::default();
    let mut p = Poller::new(CFG, 7);
    p.next_request(0, &store);
    p.on_response(0, 200, &json(&snapshot(9, 3, ips)), &mut store)
        .unwrap();
    (p, store)
}

/// `ip`, its cart pod deleted: only the tombstone is left.
pub(crate) fn tombstoned(ip: &str) -> IpRecord {
    IpRecord {
        pods: vec![],
        tombstone: Some(staleguard_core::wire::Tombstone {
            pod: format!("shop/cart-{ip}"),
            uid: String::new(),
            services: vec![cart()],
            since_ms: 1,
        }),
        ..rec(ip)
    }
}

/// 10.0.0.1 to 10.0.0.20.
pub(crate) fn twenty_ips() -> Vec<String> {
    (1..=20).map(|i| format!("10.0.0.{i}")).collect()
}

#[test]
fn starts_with_a_snapshot_then_long_polls() {
    let mut store = MemoryStore::default();
    let mut p = Poller::new(CFG, 7);
    assert_eq!(p.next_request(0, &store), Some(Request::Snapshot));
    assert_eq!(p.next_request(0, &store), None, "one request at a time");
    let applied = p
        .on_response(10, 200, &json(&snapshot(9, 3, &["10.0.0.1"])), &mut store)
        .unwrap();
    assert_eq!(applied, Applied::Reset { entries: 1 });
    assert!(present(&store, "10.0.0.1"));
    let req = p.next_request(10, &store).unwrap();
    assert_eq!(
        req.path(),
        "/v1/changes?v=1&view=verdict&epoch=9&since=3&wait=5"
    );
    let meta = IndexReader::new(&store).meta().unwrap();
    assert_eq!((meta.epoch, meta.generation, meta.synced_ms), (9, 3, 10));
    assert!(meta.fresh);
}

#[test]
fn packed_answers_apply_as_their_json_does_and_are_asked_for_first() {
    // Binary records first; a validator of the last release, which answers
    // the text form to any range naming it exactly, still finds it.
    assert_eq!(
        packed::Encoding::accepted([ACCEPT]),
        Some(packed::Encoding::Binary)
    );
    assert!(ACCEPT
        .split(',')
        .any(|range| range.split(';').next().map(str::trim) == Some(packed::MEDIA_TYPE)));
    let mut terminating = rec("10.0.0.3");
    terminating.pods[0].terminating = true;
    let mut d = delta(9, 3, 5);
    d.upserts = vec![rec("10.0.0.2"), terminating];
    d.removed = vec!["10.0.0.1".parse().unwrap()];
    d.services_added = vec![ServiceKey::new("shop", "pay")];
    let answers: [(Changes, bool); 3] = [
        (
            Changes::Reset(snapshot(9, 3, &["10.0.0.1", "fd00::1"])),
            true,
        ),
        (Changes::Delta(d), false),
        (
            Changes::Reset(snapshot(11, 1, &["10.0.0.2", "10.0.0.4"])),
            false,
        ),
    ];
    let ips = ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4", "fd00::1"];
    // What each answer leaves in shared data: meta and every IP's bucket.
    let run = |encode: &dyn Fn(&Changes, bool) -> Vec<u8>| {
        let mut store = MemoryStore::default();
        let mut p = Poller::new(CFG, 7);
        let mut seen = Vec::new();
        for (at, (answer, first)) in answers.iter().enumerate() {
            p.next_request(at as u64, &store).unwrap();
            let applied = p.on_response(at as u64, 200, &encode(answer, *first), &mut store);
            let meta = IndexReader::new(&store).meta().unwrap();
            let buckets: Vec<_> = ips
                .iter()
                .map(|ip| {
                    store
                        .get(&buckets::key_of(&ip.parse().unwrap(), meta.buckets))
                        .unwrap()
                        .0
                })
                .collect();
            seen.push((applied.unwrap(), store.get(META_KEY).unwrap().0, buckets));
        }
        seen
    };
    let json = run(&|answer, first| match (answer, first) {
        (Changes::Reset(s), true) => json(s),
        _ => json(answer),
    });
    for encoding in [packed::Encoding::Text, packed::Encoding::Binary] {
        let packed = run(&|answer, first| match (answer, first) {
            (Changes::Reset(s), true) => packed::encode_snapshot_as(encoding, s),
            _ => packed::encode_changes_as(encoding, answer),
        });
        assert_eq!(packed, json, "{encoding:?}");
    }
    assert!(
        matches!(json[1].0, Applied::Delta { changed: 3 }),
        "{:?}",
        json[1].0
    );
}

#[test]
fn a_damaged_packed_answer_is_a_decode_error_and_the_data_stays() {
    let (mut p, mut store) = loaded(&["10.0.0.1"]);
    p.next_request(0, &store);
    let mut d = delta(9, 3, 5);
    d.removed = vec!["10.0.0.1".parse().unwrap()];
    for encoding in [packed::Encoding::Text, packed::Encoding::Binary] {
        let mut p = p.clone();
        let bytes = packed::encode_changes_as(encoding, &Changes::Delta(d.clone()));
        let cut = &bytes[..bytes.len() - 4];
        let err = p.on_response(10, 200, cut, &mut store).unwrap_err();
        assert!(matches!(err, SyncError::DecodePacked(_)), "{err}");
        assert_eq!(err.kind(), "decode");
        assert!(present(&store, "10.0.0.1"));
        assert_eq!(p.next_request(10_000, &store), Some(Request::Snapshot));
    }
}

#[test]
fn deltas_upsert_and_remove() {
    let (mut p, mut store) = loaded(&["10.0.0.1"]);
    p.next_request(0, &store);
    let mut d = delta(9, 3, 5);
    d.upserts = vec![rec("10.0.0.2")];
    d.removed = vec!["10.0.0.1".parse().unwrap()];
    let applied = p
        .on_response(20, 200, &json(&Changes::Delta(d)), &mut store)
        .unwrap();
    assert_eq!(applied, Applied::Delta { changed: 2 });
    assert!(!present(&store, "10.0.0.1"));
    assert!(present(&store, "10.0.0.2"));
    assert_eq!(p.generation(), Some(5));
    assert_eq!(p.entries(), 1);
    // An empty answer to a long poll still proves the validator is alive.
    p.next_request(20, &store);
    p.on_response(90, 200, &json(&Changes::Delta(delta(9, 5, 5))), &mut store)
        .unwrap();
    assert_eq!(IndexReader::new(&store).meta().unwrap().synced_ms, 90);
}

#[test]
fn a_reset_invalidates_what_the_new_snapshot_lacks() {
    let (mut p, mut store) = loaded(&["10.0.0.1", "10.0.0.2"]);
    p.next_request(0, &store);
    let reset = Changes::Reset(snapshot(11, 1, &["10.0.0.2", "10.0.0.3"]));
    assert_eq!(
        p.on_response(5, 200, &json(&reset), &mut store).unwrap(),
        Applied::Reset { entries: 2 }
    );
    assert!(!present(&store, "10.0.0.1"));
    assert!(present(&store, "10.0.0.2"));
    assert!(present(&store, "10.0.0.3"));
    assert_eq!(
        p.next_request(5, &store).unwrap().path(),
        "/v1/changes?v=1&view=verdict&epoch=11&since=1&wait=5"
    );
}

#[test]
fn a_successor_continues_from_meta_and_a_reset_hides_unknown_leftovers() {
    let mut store = MemoryStore::default();
    let mut first = Poller::new(CFG, 1);
    first.next_request(0, &store);
    first
        .on_response(0, 200, &json(&snapshot(9, 3, &["10.0.0.1"])), &mut store)
        .unwrap();
    // `first` dies; `second` adopts its cursor and asks for changes.
    let mut second = Poller::new(CFG, 2);
    assert_eq!(
        second.next_request(1, &store).unwrap().path(),
        "/v1/changes?v=1&view=verdict&epoch=9&since=3&wait=5"
    );
    let reset = Changes::Reset(snapshot(12, 1, &["10.0.0.5"]));
    second
        .on_response(2, 200, &json(&reset), &mut store)
        .unwrap();
    // second never knew 10.0.0.1's key, but the new load hides it.
    assert!(!present(&store, "10.0.0.1"));
    assert!(present(&store, "10.0.0.5"));
}

#[test]
fn out_of_step_deltas_force_a_snapshot() {
    let (mut p, mut store) = loaded(&[]);
    for bad in [delta(9, 2, 4), delta(8, 3, 4), delta(9, 3, 2)] {
        p.next_request(u64::MAX / 2, &store);
        let err = p
            .on_response(0, 200, &json(&Changes::Delta(bad)), &mut store)
            .unwrap_err();
        assert_eq!(err.kind(), "sequence");
        assert_eq!(
            p.next_request(u64::MAX / 2, &store),
            Some(Request::Snapshot)
        );
        p.on_response(0, 200, &json(&snapshot(9, 3, &[])), &mut store)
            .unwrap();
    }
}

#[test]
fn errors_back_off_exponentially_with_jitter_and_keep_the_data() {
    let (mut p, mut store) = loaded(&["10.0.0.1"]);
    let mut now = 0;
    let mut delays = vec![];
    for status in [503, 500, 401, 503, 503, 503] {
        assert!(p.next_request(now, &store).is_some());
        let err = p.on_response(now, status, b"", &mut store).unwrap_err();
        assert_eq!(err.kind(), "status");
        let before = now;
        while p.next_request(now, &store).is_none() {
            now += 1;
        }
        p.in_flight = None;
        delays.push(now - before);
    }
    assert!((50..=100).contains(&delays[0]), "{delays:?}");
    assert!((100..=200).contains(&delays[1]), "{delays:?}");
    assert!(delays[5] <= 1_000 && delays[5] >= 500, "{delays:?}");
    assert!(present(&store, "10.0.0.1"), "errors never clear data");
    // Garbage is an error too, and the next attempt starts over.
    p.next_request(now, &store);
    let err = p
        .on_response(now, 200, b"{not json", &mut store)
        .unwrap_err();
    assert_eq!(err.kind(), "decode");
    p.on_failure(now, &SyncError::Transport("x".into()));
    now += 10_000;
    assert_eq!(p.next_request(now, &store), Some(Request::Snapshot));
}

#[test]
fn answers_that_come_at_once_do_not_make_a_busy_loop() {
    let mut store = MemoryStore::default();
    let mut p = Poller::new(
        SyncConfig {
            min_interval_ms: 100,
            page_bytes: None,
            ..CFG
        },
        7,
    );
    p.next_request(1_000, &store);
    p.on_response(1_000, 200, &json(&snapshot(9, 3, &[])), &mut store)
        .unwrap();
    assert_eq!(p.next_request(1_050, &store), None, "too soon");
    assert!(p.next_request(1_100, &store).is_some());
}

/// Drives the poller as the root does with a timer that fires only at
/// `wake_at_ms` (and at `tick_ms` lease ticks): returns when each request
/// went out.
fn sends(p: &mut Poller, store: &MemoryStore, from: u64, until: u64, tick_ms: u64) -> Vec<u64> {
    let mut sent = vec![];
    let mut now = from;
    while now < until {
        if p.next_request(now, store).is_some() {
            sent.push(now);
            // Answered at once (a burst of changes).
            p.in_flight = None;
            p.backoff.reset();
            p.next_at_ms = now;
        }
        let next_tick = (now / tick_ms + 1) * tick_ms;
        now = p.wake_at_ms().max(now + 1).min(next_tick);
    }
    sent
}

#[test]
fn a_quick_answer_is_followed_by_the_next_poll_at_the_least_interval_not_the_tick() {
    let store = MemoryStore::default();
    let mut p = Poller::new(SHIPPED, 7);
    // The shipped tick is 1 s; answers come at once; the next poll is due
    // the least interval (50 ms) after the previous one, every time.
    let sent = sends(&mut p, &store, 1_000, 2_000, 1_000);
    assert_eq!(sent, (20..40).map(|i| i * 50).collect::<Vec<_>>());
}

#[test]
fn backoff_delays_are_honoured_to_the_millisecond() {
    let mut store = MemoryStore::default();
    let mut p = Poller::new(SHIPPED, 7);
    p.next_request(0, &store);
    p.on_response(0, 200, &json(&snapshot(9, 3, &[])), &mut store)
        .unwrap();
    let mut now = p.wake_at_ms();
    assert_eq!(now, 50, "the least interval after the snapshot request");
    for attempt in 0..6 {
        assert!(p.next_request(now, &store).is_some(), "attempt {attempt}");
        p.on_failure(now, &SyncError::Status(503));
        let due = p.wake_at_ms();
        assert!(due > now, "a backoff lies ahead");
        assert_eq!(
            p.next_request(due - 1, &store),
            None,
            "not before it is due"
        );
        now = due;
    }
    // The wake-up time is exactly when the poller sends again.
    assert!(p.next_request(now, &store).is_some());
}

#[test]
fn while_a_request_is_out_the_poller_wakes_for_its_watchdog() {
    let store = MemoryStore::default();
    let mut p = Poller::new(SHIPPED, 7);
    assert_eq!(p.wake_at_ms(), 0, "a new poller is due at once");
    let snapshot = p.next_request(1_000, &store).unwrap();
    assert_eq!(
        p.wake_at_ms(),
        1_000 + SNAPSHOT_TIMEOUT_MS + WATCHDOG_SLACK_MS
    );
    assert_eq!(SHIPPED.watchdog_ms(&snapshot), 32_000);
    let poll = Request::Changes {
        epoch: 1,
        since: 1,
        wait_s: 30,
    };
    assert_eq!(SHIPPED.request_timeout_ms(&poll), 35_000);
    assert_eq!(SHIPPED.watchdog_ms(&poll), 37_000);
}

#[test]
fn the_watchdog_gives_up_on_a_call_that_never_answers_and_backs_off() {
    let (mut p, store) = loaded(&["10.0.0.1"]);
    let poll = p.next_request(10, &store).unwrap();
    let limit = 10 + CFG.watchdog_ms(&poll);
    assert_eq!(limit, 10 + 5_000 + LONG_POLL_SLACK_MS + WATCHDOG_SLACK_MS);
    assert!(p.watchdog(limit - 1).is_none(), "not yet");
    assert!(p.in_flight());
    let error = p.watchdog(limit).unwrap();
    assert_eq!(error.kind(), "timeout");
    assert!(!p.in_flight(), "the call is forgotten");
    assert!(p.watchdog(u64::MAX).is_none(), "nothing left to give up on");
    // Retried after a backoff, from the same cursor: no reload.
    let due = p.wake_at_ms();
    assert!(due > limit);
    assert_eq!(
        p.next_request(due, &store).unwrap().path(),
        "/v1/changes?v=1&view=verdict&epoch=9&since=3&wait=5"
    );
    assert!(present(&store, "10.0.0.1"), "giving up keeps the data");
}

fn v6(n: u32) -> String {
    format!("fd00:10:244::{:x}:{:x}", n >> 16, n & 0xffff)
}

#[test]
fn shared_data_stays_bounded_by_the_live_index_under_ipv6_churn() {
    // 100 live pods; 20,000 pods come and go, each with a new IPv6
    // address (IPv6 pod IPs are rarely reused). Shared data cannot delete
    // a key: what bounds it is reusing them. The guard is off: the resets
    // below replace every IP at once, which it would hold.
    let mut store = MemoryStore::default();
    let off = GuardConfig {
        enabled: false,
        ..GuardConfig::default()
    };
    let mut p = Poller::new(CFG, 7).with_guard(Guard::new(off, Policy::default()));
    let live: Vec<String> = (0..100).map(v6).collect();
    let live: Vec<&str> = live.iter().map(String::as_str).collect();
    p.next_request(0, &store);
    p.on_response(0, 200, &json(&snapshot(9, 1, &live)), &mut store)
        .unwrap();
    let keys_at_start = store.len();
    for n in 100..20_100u32 {
        let generation = u64::from(n) - 99;
        let mut d = delta(9, generation, generation + 1);
        d.upserts = vec![rec(&v6(n))];
        if n > 100 {
            d.removed = vec![v6(n - 1).parse().unwrap()];
        }
        p.next_request(u64::from(n) * 1_000, &store).unwrap();
        p.on_response(0, 200, &json(&Changes::Delta(d)), &mut store)
            .unwrap();
    }
    assert_eq!(p.entries(), 101);
    assert!(present(&store, &v6(20_099)));
    assert!(!present(&store, &v6(20_098)));
    assert!(present(&store, &v6(7)));
    let bound = buckets::MIN_BUCKETS as usize + 8;
    assert!(
        store.len() <= bound,
        "{} keys after 20,000 IPs came and went (started with {keys_at_start}, bound {bound})",
        store.len()
    );
    // Resets churn too: each new snapshot reuses the same buckets.
    for round in 0..5u32 {
        let ips: Vec<String> = (0..100).map(|i| v6(100_000 * (round + 1) + i)).collect();
        let ips: Vec<&str> = ips.iter().map(String::as_str).collect();
        p.next_request(u64::MAX / 2, &store).unwrap();
        let reset = Changes::Reset(snapshot(10 + u64::from(round), 1, &ips));
        p.on_response(0, 200, &json(&reset), &mut store).unwrap();
        assert!(present(&store, ips[0]));
    }
    assert!(store.len() <= bound, "{} keys after resets", store.len());
}

#[test]
fn an_index_that_outgrows_its_buckets_is_laid_out_again_at_a_snapshot() {
    let mut store = MemoryStore::default();
    let mut p = Poller::new(CFG, 7);
    p.next_request(0, &store);
    p.on_response(0, 200, &json(&snapshot(9, 1, &[])), &mut store)
        .unwrap();
    // One IP more than twice the aimed-for density of the smallest layout.
    let n = 2 * buckets::IPS_PER_BUCKET as u32 * buckets::MIN_BUCKETS + 1;
    // Pods in no service: the member lists (one key per service, each
    // rewritten per change) are not what this test is about.
    let bare = |n: u32| {
        let mut r = rec(&v6(n));
        r.pods[0].services.clear();
        r
    };
    let grown: Vec<IpRecord> = (0..n).map(bare).collect();
    p.next_request(1_000, &store).unwrap();
    let mut d = delta(9, 1, 2);
    d.upserts = grown.clone();
    p.on_response(1_000, 200, &json(&Changes::Delta(d)), &mut store)
        .unwrap();
    assert_eq!(IndexReader::new(&store).meta().unwrap().buckets, 1_024);
    assert!(present(&store, &v6(n - 1)), "still served meanwhile");
    assert_eq!(p.next_request(2_000, &store), Some(Request::Snapshot));
    let ips: Vec<String> = (0..n).map(v6).collect();
    let ips: Vec<&str> = ips.iter().map(String::as_str).collect();
    p.on_response(2_000, 200, &json(&snapshot(9, 2, &ips)), &mut store)
        .unwrap();
    let meta = IndexReader::new(&store).meta().unwrap();
    assert_eq!((meta.buckets, meta.entries), (4_096, u64::from(n)));
    assert!(present(&store, &v6(n - 1)) && present(&store, &v6(0)));
}

#[test]
fn the_guard_holds_an_empty_reset_and_the_old_data_keeps_serving() {
    let ips = twenty_ips();
    let (mut p, mut store) = loaded(&ips.iter().map(String::as_str).collect::<Vec<_>>());
    let before = IndexReader::new(&store).meta().unwrap();
    let mut empty = snapshot(10, 1, &[]);
    empty.services = vec![cart()];
    let empty = json(&Changes::Reset(empty));

    p.next_request(10, &store);
    assert_eq!(
        p.on_response(10, 200, &empty, &mut store).unwrap(),
        Applied::Held
    );
    assert!(matches!(
        p.take_guard_event(),
        Some(GuardEvent::Held(b)) if b.lost_ips == 20
    ));
    assert_eq!(
        IndexReader::new(&store).meta(),
        Some(Meta {
            synced_ms: 10,
            ..before
        }),
        "nothing written but the time of the sync"
    );
    assert!(present(&store, "10.0.0.1"));
    // The held answer is watched, soon: a long poll from its generation.
    assert_eq!(p.next_request(10, &store), None);
    let watch = p.next_request(200, &store).unwrap();
    assert_eq!(
        watch,
        Request::Changes {
            epoch: 10,
            since: 1,
            wait_s: 5
        }
    );
    // Unchanged after the wait: the hold goes on, the data counts as
    // synced, and the watch goes on at once.
    assert_eq!(
        p.on_response(
            5_200,
            200,
            &json(&Changes::Delta(delta(10, 1, 1))),
            &mut store
        )
        .unwrap(),
        Applied::StillHeld
    );
    assert_eq!(IndexReader::new(&store).meta().unwrap().synced_ms, 5_200);
    assert_eq!(p.next_request(5_200, &store), Some(watch));
    // The held answer changes: judged anew, from the applied generation.
    let mut changed = delta(10, 1, 2);
    changed.removed = vec!["10.0.0.1".parse().unwrap()];
    assert_eq!(
        p.on_response(6_000, 200, &json(&Changes::Delta(changed)), &mut store)
            .unwrap(),
        Applied::Held
    );
    let again = p.next_request(7_000, &store).unwrap();
    assert_eq!(
        again,
        Request::Changes {
            epoch: 9,
            since: 3,
            wait_s: 5
        }
    );
    p.on_response(7_000, 200, &empty, &mut store).unwrap();
    assert!(present(&store, "10.0.0.1"));
    // Still there after confirm_ms: the change is taken as real.
    p.next_request(60_010, &store);
    assert_eq!(
        p.on_response(60_010, 200, &empty, &mut store).unwrap(),
        Applied::Reset { entries: 0 }
    );
    assert!(matches!(
        p.take_guard_event(),
        Some(GuardEvent::Confirmed(_))
    ));
    assert!(!present(&store, "10.0.0.1"));
}

#[test]
fn a_pod_that_appears_during_a_hold_is_written_and_nothing_else() {
    let ips = twenty_ips();
    let (mut p, mut store) = loaded(&ips.iter().map(String::as_str).collect::<Vec<_>>());
    let before = IndexReader::new(&store).meta().unwrap();
    // A wrong reset: 18 of 20 IPs gone, and one new pod (10.0.1.1).
    let held = Changes::Reset(snapshot(10, 1, &["10.0.0.1", "10.0.0.2", "10.0.1.1"]));
    p.next_request(10, &store);
    assert_eq!(
        p.on_response(10, 200, &json(&held), &mut store).unwrap(),
        Applied::Held
    );
    assert!(present(&store, "10.0.1.1"), "the new pod is not destroyed");
    let listed: Vec<IpAddr> = crate::members::read(&store, &cart(), before.load)
        .iter()
        .map(|m| m.ip)
        .collect();
    assert!(
        listed.contains(&"10.0.1.1".parse().unwrap()),
        "and is in cart's member list: {listed:?}"
    );
    assert!(
        present(&store, "10.0.0.20"),
        "the held losses are not written"
    );
    assert_eq!(
        IndexReader::new(&store).meta(),
        Some(Meta {
            synced_ms: 10,
            ..before
        }),
        "meta only synced"
    );
}

#[test]
fn a_hold_keeps_the_data_fresh_only_while_the_validator_calls_it_fresh() {
    let ips = twenty_ips();
    let (mut p, mut store) = loaded(&ips.iter().map(String::as_str).collect::<Vec<_>>());
    let mut empty = snapshot(10, 1, &[]);
    empty.freshness.fresh = false;
    p.next_request(10, &store);
    assert_eq!(
        p.on_response(10, 200, &json(&Changes::Reset(empty)), &mut store)
            .unwrap(),
        Applied::Held
    );
    let meta = IndexReader::new(&store).meta().unwrap();
    assert!(!meta.fresh, "a validator that is not fresh is not trusted");
    assert!(!meta.is_fresh(20, 60_000));
}

/// The sequence of issue 23: a wrong validator serves a huge reset of one
/// service that lacks its one live pod, then resets naming a single IP;
/// then the correct validator answers. Its answer is enforced at once:
/// the huge reset did not become the reference the guard holds the
/// truth against.
#[test]
fn a_wrong_validator_cannot_make_the_guard_hold_the_correct_one() {
    let (mut p, mut store) = loaded(&["10.0.0.1"]);
    // 1. 20,000 members of cart, not 10.0.0.1: applied (one pod is under
    //    every threshold), its additions unconfirmed.
    let huge: Vec<String> = (0..20_000)
        .map(|i| format!("10.1.{}.{}", i / 250, i % 250))
        .collect();
    let huge: Vec<&str> = huge.iter().map(String::as_str).collect();
    p.next_request(1_000, &store);
    let answer = p
        .on_response(
            1_000,
            200,
            &json(&Changes::Reset(snapshot(66, 1, &huge))),
            &mut store,
        )
        .unwrap();
    assert_eq!(answer, Applied::Reset { entries: 20_000 });
    assert_eq!(p.take_guard_event(), None);
    assert_eq!(p.guard().unconfirmed_ips(), 20_000);
    // 2. Then a reset naming two other IPs: every IP of cart, by the
    //    guard's rules, if they were its reference.
    p.next_request(2_000, &store);
    let two = Changes::Reset(snapshot(67, 1, &["10.0.0.2", "10.0.0.3"]));
    assert_eq!(
        p.on_response(2_000, 200, &json(&two), &mut store).unwrap(),
        Applied::Reset { entries: 2 }
    );
    // 3. The correct validator: enforced at once, nothing held.
    p.next_request(3_000, &store);
    let truth = Changes::Reset(snapshot(70, 1, &["10.0.0.1"]));
    assert_eq!(
        p.on_response(3_000, 200, &json(&truth), &mut store)
            .unwrap(),
        Applied::Reset { entries: 1 }
    );
    assert!(!p.guard_holding());
    assert!(present(&store, "10.0.0.1") && !present(&store, "10.0.0.2"));
    assert!(IndexReader::new(&store)
        .meta()
        .unwrap()
        .is_fresh(3_000, 5_000));
}

#[test]
fn a_delta_that_ends_a_hold_with_written_gains_is_followed_by_a_snapshot() {
    let ips = twenty_ips();
    let (mut p, mut store) = loaded(&ips.iter().map(String::as_str).collect::<Vec<_>>());
    // Held: 18 of 20 gone, and a new pod whose gain is written.
    let held = Changes::Reset(snapshot(10, 1, &["10.0.0.1", "10.0.0.2", "10.0.1.1"]));
    p.next_request(10, &store);
    assert_eq!(
        p.on_response(10, 200, &json(&held), &mut store).unwrap(),
        Applied::Held
    );
    assert!(present(&store, "10.0.1.1"));
    // The held answer changes; asked again from our cursor, the first
    // validator answers an empty delta: released.
    p.next_request(1_000, &store);
    let mut changed = delta(10, 1, 2);
    changed.removed = vec!["10.0.0.2".parse().unwrap()];
    p.on_response(1_000, 200, &json(&Changes::Delta(changed)), &mut store)
        .unwrap();
    p.next_request(2_000, &store);
    assert!(matches!(
        p.on_response(
            2_000,
            200,
            &json(&Changes::Delta(delta(9, 3, 4))),
            &mut store
        ),
        Ok(Applied::Delta { .. })
    ));
    assert_eq!(p.take_guard_event(), Some(GuardEvent::Released));
    // The gain it knows nothing of goes with the next request, a snapshot.
    assert_eq!(p.next_request(3_000, &store), Some(Request::Snapshot));
}

#[test]
fn the_guard_lets_a_delta_of_tombstones_through_at_once() {
    let ips: Vec<String> = (1..=250)
        .map(|i| format!("10.0.{}.{}", i / 200, i % 200))
        .collect();
    let (mut p, mut store) = loaded(&ips.iter().map(String::as_str).collect::<Vec<_>>());
    p.next_request(0, &store);
    let mut d = delta(9, 3, 233);
    d.upserts = ips[20..].iter().map(|ip| tombstoned(ip)).collect();
    assert_eq!(
        p.on_response(5, 200, &json(&Changes::Delta(d)), &mut store)
            .unwrap(),
        Applied::Delta { changed: 230 }
    );
    assert_eq!(p.take_guard_event(), None);
    let pods = |ip: &str| match IndexReader::new(&store)
        .lookup(&cart(), &ip.parse().unwrap())
        .record
    {
        Entry::Present(r) => r.pods.len(),
        _ => usize::MAX,
    };
    assert_eq!(pods(&ips[100]), 0, "written: only the tombstone is left");
    assert_eq!(pods(&ips[0]), 1);
}

#[test]
fn unfresh_answers_are_recorded_as_not_fresh() {
    let mut store = MemoryStore::default();
    let mut p = Poller::new(CFG, 7);
    p.next_request(0, &store);
    let mut s = snapshot(1, 1, &[]);
    s.freshness.fresh = false;
    p.on_response(0, 200, &json(&s), &mut store).unwrap();
    assert!(!IndexReader::new(&store).meta().unwrap().fresh);
}

#[test]
fn a_packed_reset_is_applied_holding_one_record_at_a_time() {
    a_reset_holding_one_record_at_a_time(packed::Encoding::Text);
}

#[test]
fn a_reset_with_binary_records_is_applied_holding_one_record_at_a_time() {
    a_reset_holding_one_record_at_a_time(packed::Encoding::Binary);
}

fn a_reset_holding_one_record_at_a_time(encoding: packed::Encoding) {
    use crate::buckets::alive;
    let encode_snapshot = |s: &Snapshot| packed::encode_snapshot_as(encoding, s);
    let encode_changes = |c: &Changes| packed::encode_changes_as(encoding, c);
    // 40,000 IPs: about 1.3 MB of bucket lines, written in two slices.
    let ips: Vec<String> = (0..40_000u32)
        .map(|i| std::net::Ipv4Addr::from(0x0a00_0000 + i).to_string())
        .collect();
    let ips: Vec<&str> = ips.iter().map(String::as_str).collect();
    let mut store = MemoryStore::default();
    let mut p = Poller::new(CFG, 7);
    p.next_request(0, &store);
    let first = encode_snapshot(&snapshot(9, 3, &ips));
    alive::take_peak();
    assert_eq!(
        p.on_response(0, 200, &first, &mut store).unwrap(),
        Applied::Reset { entries: 40_000 }
    );
    assert_eq!(alive::take_peak(), 1, "one record alive at a time");
    // A reset the guard judges against that baseline, all of it kept but
    // one IP: the same, and the IP it lacks is gone.
    let request = p.next_request(1, &store).unwrap();
    assert!(matches!(request, Request::Changes { .. }));
    let reset = encode_changes(&Changes::Reset(snapshot(10, 1, &ips[1..])));
    alive::take_peak();
    assert_eq!(
        p.on_response(1, 200, &reset, &mut store).unwrap(),
        Applied::Reset { entries: 39_999 }
    );
    assert_eq!(alive::take_peak(), 1, "one record alive at a time");
    assert!(!present(&store, ips[0]));
    assert!(ips[1..].iter().step_by(97).all(|ip| present(&store, ip)));
    // A reset the guard holds (every IP gone) keeps none of its records.
    p.next_request(2, &store);
    let empty = encode_changes(&Changes::Reset(snapshot(11, 1, &[])));
    assert_eq!(
        p.on_response(2, 200, &empty, &mut store).unwrap(),
        Applied::Held
    );
    assert!(present(&store, ips[1]));
}

// === answers in pages ===

#[cfg(feature = "pages")]
const PAGE: u32 = 100;

#[cfg(feature = "pages")]
fn paging() -> SyncConfig {
    SyncConfig {
        page_bytes: Some(PAGE),
        ..CFG
    }
}

/// `p`'s answer (`status`, `headers`, `body`) to its request in flight.
fn answer(
    p: &mut Poller,
    store: &mut MemoryStore,
    now: u64,
    status: u32,
    headers: &PageHeaders,
    body: &[u8],
) -> Result<Applied, SyncError> {
    let mut answer = WithBody {
        store,
        open: in_memory(Rc::new(body.to_vec())),
    };
    p.on_answer(now, status, headers, &mut answer)
}

/// The headers of the page of `whole` (answer id `a-1`) from `offset`.
fn page_headers(whole: &[u8], offset: usize) -> PageHeaders {
    PageHeaders {
        length: Some(whole.len().to_string()),
        id: Some("a-1".to_owned()),
        offset: Some(offset.to_string()),
    }
}

/// Serves `whole` to `p` in pages of [`PAGE`] bytes as the validator does,
/// checking each request for the next page; what the last page did.
#[cfg(feature = "pages")]
fn serve_in_pages(
    p: &mut Poller,
    store: &mut MemoryStore,
    now: u64,
    whole: &[u8],
) -> Result<Applied, SyncError> {
    let mut offset = 0;
    loop {
        let end = (offset + PAGE as usize).min(whole.len());
        let headers = page_headers(whole, offset);
        match answer(p, store, now, 200, &headers, &whole[offset..end])? {
            Applied::Page { received, total } => {
                assert_eq!((received, total), (end as u64, whole.len() as u64));
                offset = end;
                let next = p.next_request(now, store).expect("the next page at once");
                assert_eq!(
                    next,
                    Request::Page {
                        id: "a-1".to_owned(),
                        offset: offset as u64,
                        page_bytes: PAGE
                    }
                );
                assert_eq!(
                    p.path(&next),
                    format!("/v1/answer?v=1&id=a-1&offset={offset}&page_bytes={PAGE}")
                );
            }
            other => return Ok(other),
        }
    }
}

fn packed_snapshot(epoch: u64, generation: u64, ips: &[String]) -> Vec<u8> {
    let ips: Vec<&str> = ips.iter().map(String::as_str).collect();
    packed::encode_snapshot_as(packed::Encoding::Binary, &snapshot(epoch, generation, &ips))
}

#[test]
#[cfg(feature = "pages")]
fn an_answer_in_pages_applies_exactly_as_the_same_answer_whole() {
    let whole = packed_snapshot(9, 3, &twenty_ips());
    assert!(whole.len() > 3 * PAGE as usize, "{}", whole.len());
    let mut unpaged_store = MemoryStore::default();
    let mut unpaged = Poller::new(CFG, 7);
    unpaged.next_request(0, &unpaged_store);
    let applied = unpaged.on_response(10, 200, &whole, &mut unpaged_store);

    let mut store = MemoryStore::default();
    let mut p = Poller::new(paging(), 7);
    let first = p.next_request(0, &store).unwrap();
    assert_eq!(first, Request::Snapshot);
    assert_eq!(
        p.path(&first),
        format!("/v1/snapshot?v=1&view=verdict&page_bytes={PAGE}")
    );
    assert_eq!(
        serve_in_pages(&mut p, &mut store, 10, &whole).unwrap(),
        applied.unwrap()
    );
    assert_eq!(p.paged_bytes(), Some(whole.len() as u64), "for the log");
    assert_eq!(
        store.values(),
        unpaged_store.values(),
        "the same index, byte for byte"
    );
    assert!(present(&store, "10.0.0.20"), "the last page's IP is judged");
    // Then long polls, asking for pages again; a short answer comes whole.
    let next = p.next_request(10, &store).unwrap();
    assert!(p
        .path(&next)
        .ends_with(&format!("&wait=5&page_bytes={PAGE}")));
    let empty = json(&Changes::Delta(delta(9, 3, 3)));
    let applied = answer(&mut p, &mut store, 20, 200, &PageHeaders::default(), &empty);
    assert_eq!(applied.unwrap(), Applied::Delta { changed: 0 });
}

#[test]
#[cfg(feature = "pages")]
fn a_reset_answering_a_long_poll_in_pages_replaces_the_index() {
    let (mut p, mut store) = loaded(&["10.0.0.99"]);
    p.config.page_bytes = Some(PAGE);
    let poll = p.next_request(10, &store).unwrap();
    assert!(matches!(poll, Request::Changes { .. }));
    let ips = twenty_ips();
    let snapshot = snapshot(11, 1, &ips.iter().map(String::as_str).collect::<Vec<_>>());
    let whole = packed::encode_changes_as(packed::Encoding::Binary, &Changes::Reset(snapshot));
    let applied = serve_in_pages(&mut p, &mut store, 20, &whole).unwrap();
    assert_eq!(applied, Applied::Reset { entries: 20 });
    assert!(present(&store, "10.0.0.20") && !present(&store, "10.0.0.99"));
}

/// A poller that received the first page of `whole` (a snapshot) and asked
/// for the second.
#[cfg(feature = "pages")]
fn first_page_in(whole: &[u8]) -> (Poller, MemoryStore) {
    let mut store = MemoryStore::default();
    let mut p = Poller::new(paging(), 7);
    p.next_request(0, &store);
    let applied = answer(
        &mut p,
        &mut store,
        10,
        200,
        &page_headers(whole, 0),
        &whole[..PAGE as usize],
    );
    assert!(matches!(applied, Ok(Applied::Page { .. })), "{applied:?}");
    assert!(matches!(
        p.next_request(10, &store),
        Some(Request::Page { .. })
    ));
    (p, store)
}

/// After a failed page: nothing was written, the poller waits out a
/// backoff, then starts over with a snapshot (never another page).
#[cfg(feature = "pages")]
fn starts_over(p: &mut Poller, store: &MemoryStore) {
    assert!(IndexReader::new(store).meta().is_none());
    assert_eq!(p.next_request(10, store), None, "backoff");
    assert_eq!(p.next_request(10 + 2_000, store), Some(Request::Snapshot));
}

#[test]
#[cfg(feature = "pages")]
fn a_page_that_does_not_continue_the_answer_drops_it_and_the_sync_starts_over() {
    let whole = packed_snapshot(9, 3, &twenty_ips());
    let second = &whole[PAGE as usize..2 * PAGE as usize];
    let wrong: [(&str, PageHeaders, &[u8]); 5] = [
        ("offset", page_headers(&whole, 0), second),
        (
            "id",
            PageHeaders {
                id: Some("a-2".to_owned()),
                ..page_headers(&whole, PAGE as usize)
            },
            second,
        ),
        (
            "length",
            PageHeaders {
                length: Some((whole.len() + 1).to_string()),
                ..page_headers(&whole, PAGE as usize)
            },
            second,
        ),
        (
            "past the length",
            page_headers(&whole, PAGE as usize),
            &whole[..],
        ),
        ("empty", page_headers(&whole, PAGE as usize), &[]),
    ];
    for (what, headers, body) in wrong {
        let (mut p, mut store) = first_page_in(&whole);
        let error = answer(&mut p, &mut store, 10, 200, &headers, body).unwrap_err();
        assert!(
            matches!(error, SyncError::Page(PageError::Mismatch(_))),
            "{what}: {error}"
        );
        assert_eq!(error.kind(), "page");
        starts_over(&mut p, &store);
    }
}

#[test]
#[cfg(feature = "pages")]
fn an_answer_the_validator_no_longer_holds_starts_the_sync_over() {
    let whole = packed_snapshot(9, 3, &twenty_ips());
    let (mut p, mut store) = first_page_in(&whole);
    let gone = br#"{"error":{"code":"gone","message":"answer no longer held"}}"#;
    let error = answer(&mut p, &mut store, 10, 410, &PageHeaders::default(), gone).unwrap_err();
    assert!(matches!(error, SyncError::Page(PageError::Gone)), "{error}");
    starts_over(&mut p, &store);
    // And it does: the snapshot in pages again.
    assert!(matches!(
        serve_in_pages(&mut p, &mut store, 3_000, &whole),
        Ok(Applied::Reset { entries: 20 })
    ));
}

#[test]
#[cfg(feature = "pages")]
fn a_page_lost_to_the_watchdog_drops_the_answer() {
    let whole = packed_snapshot(9, 3, &twenty_ips());
    let (mut p, store) = first_page_in(&whole);
    let late = 10 + SNAPSHOT_TIMEOUT_MS + WATCHDOG_SLACK_MS;
    assert!(matches!(p.watchdog(late), Some(SyncError::Timeout(_))));
    assert_eq!(
        p.next_request(late + 2_000, &store),
        Some(Request::Snapshot)
    );
}

#[test]
#[cfg(feature = "pages")]
fn a_claimed_length_no_answer_can_have_is_refused_before_anything_is_reserved() {
    let whole = packed_snapshot(9, 3, &twenty_ips());
    let mut store = MemoryStore::default();
    let mut p = Poller::new(paging(), 7);
    p.next_request(0, &store);
    let lying = PageHeaders {
        length: Some((MAX_ANSWER_BYTES + 1).to_string()),
        ..page_headers(&whole, 0)
    };
    let error = answer(&mut p, &mut store, 10, 200, &lying, &whole[..PAGE as usize]).unwrap_err();
    assert!(
        matches!(error, SyncError::Page(PageError::TooLong(_))),
        "{error}"
    );
    assert_eq!(error.kind(), "decode");
    starts_over(&mut p, &store);
    let unreadable = PageHeaders {
        length: Some("many".to_owned()),
        ..page_headers(&whole, 0)
    };
    p.next_request(10 + 2_000, &store);
    let error = answer(
        &mut p,
        &mut store,
        10,
        200,
        &unreadable,
        &whole[..PAGE as usize],
    )
    .unwrap_err();
    assert!(
        matches!(error, SyncError::Page(PageError::Mismatch(_))),
        "{error}"
    );
}

#[test]
#[cfg(feature = "pages")]
fn a_validator_that_refuses_page_bytes_is_asked_for_whole_answers_at_once() {
    let mut store = MemoryStore::default();
    let mut p = Poller::new(paging(), 7);
    let first = p.next_request(0, &store).unwrap();
    assert!(p.path(&first).contains("page_bytes="));
    let refusal = br#"{"error":{"code":"bad_request","message":"unknown field `page_bytes`"}}"#;
    let applied = answer(
        &mut p,
        &mut store,
        10,
        400,
        &PageHeaders::default(),
        refusal,
    );
    assert_eq!(applied.unwrap(), Applied::PagesRefused);
    let again = p.next_request(10, &store).expect("at once, no backoff");
    assert_eq!(p.path(&again), "/v1/snapshot?v=1&view=verdict");
    let whole = packed_snapshot(9, 3, &twenty_ips());
    let applied = answer(&mut p, &mut store, 20, 200, &PageHeaders::default(), &whole);
    assert_eq!(applied.unwrap(), Applied::Reset { entries: 20 });
    let poll = p.next_request(20, &store).unwrap();
    assert!(!p.path(&poll).contains("page_bytes"));
    // A 400 to a request without pages is an error as ever.
    let error = answer(
        &mut p,
        &mut store,
        30,
        400,
        &PageHeaders::default(),
        refusal,
    );
    assert!(matches!(error, Err(SyncError::Status(400))));
    // Pages are tried again after a while: the validator may be upgraded.
    let later = p.next_request(30 + WHOLE_AFTER_REFUSAL_MS, &store).unwrap();
    assert!(p.path(&later).contains("page_bytes="));
}

#[test]
fn without_a_page_size_nothing_changes() {
    let mut store = MemoryStore::default();
    let mut p = Poller::new(CFG, 7);
    let first = p.next_request(0, &store).unwrap();
    assert!(!p.pages());
    assert_eq!(p.path(&first), "/v1/snapshot?v=1&view=verdict");
    // Page headers on an answer to a poller that asked for none: ignored,
    // the body is the answer.
    let whole = packed_snapshot(9, 3, &twenty_ips());
    let applied = answer(
        &mut p,
        &mut store,
        10,
        200,
        &page_headers(&whole, 0),
        &whole,
    );
    assert_eq!(applied.unwrap(), Applied::Reset { entries: 20 });
}

#[test]
fn page_headers_are_found_whatever_their_case() {
    let headers = vec![
        (":status".to_owned(), b"200".to_vec()),
        ("Staleguard-Answer-Length".to_owned(), b"1234".to_vec()),
        ("staleguard-answer-id".to_owned(), b"7-1".to_vec()),
        ("staleguard-answer-offset".to_owned(), b"0".to_vec()),
    ];
    assert_eq!(
        PageHeaders::of(&headers),
        PageHeaders {
            length: Some("1234".to_owned()),
            id: Some("7-1".to_owned()),
            offset: Some("0".to_owned()),
        }
    );
}
