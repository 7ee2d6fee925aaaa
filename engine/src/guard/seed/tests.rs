//! A successor's baseline, seeded from the index its predecessor wrote.

use std::net::IpAddr;

use staleguard_core::{Changes, IpRecord, PodHolder, ServiceKey, Snapshot};

use crate::buckets::{self, Bucket, CompactRecord};
use crate::guard::{GuardConfig, GuardEvent};
use crate::store::{IndexReader, MemoryStore};
use crate::sync::tests::{delta, json, present, rec, snapshot, tombstoned, twenty_ips, CFG};
use crate::sync::{Applied, Poller};

use super::*;

/// The default `max_staleness_ms`, which a poller seeds within.
const MAX_AGE_MS: u64 = 60_000;

/// The validator's snapshot of `ips` at `generation` (epoch 9).
fn snapshot_of(generation: u64, ips: &[String]) -> Snapshot {
    let ips: Vec<&str> = ips.iter().map(String::as_str).collect();
    snapshot(9, generation, &ips)
}

/// The shared data a poller left when it stopped: a snapshot of `ips`
/// (generation 3), applied at time 0.
fn left_by_predecessor(ips: &[String]) -> MemoryStore {
    let mut store = MemoryStore::default();
    let mut a = Poller::new(CFG, 1);
    a.next_request(0, &store);
    a.on_response(0, 200, &json(&snapshot_of(3, ips)), &mut store)
        .unwrap();
    store
}

/// The poller that takes over at `now_ms`, its first request out.
fn successor(store: &MemoryStore, now_ms: u64) -> Poller {
    let mut b = Poller::new(CFG, 2);
    assert!(b.next_request(now_ms, store).is_some());
    b
}

/// The validator's answer that keeps only the first two of `ips`.
fn dropping(ips: &[String]) -> Vec<u8> {
    json(&Changes::Reset(snapshot_of(4, &ips[..2])))
}

#[test]
fn a_successor_seeds_every_ip_of_the_index_as_confirmed() {
    let ips = twenty_ips();
    let store = left_by_predecessor(&ips);
    let mut b = successor(&store, 10_000);
    assert_eq!(
        b.take_seeded(),
        Some(Seeded {
            ips: 20,
            allowed_ips: 20,
            unreadable: 0
        })
    );
    assert_eq!(b.take_seeded(), None, "told once");
    assert_eq!(b.guard().unconfirmed_ips(), 0);
}

#[test]
fn a_successor_holds_a_reset_that_drops_most_of_the_index() {
    let ips = twenty_ips();
    let mut store = left_by_predecessor(&ips);
    let mut b = successor(&store, 10_000);
    assert_eq!(
        b.on_response(10_000, 200, &dropping(&ips), &mut store)
            .unwrap(),
        Applied::Held
    );
    assert!(matches!(
        b.take_guard_event(),
        Some(GuardEvent::Held(blast)) if blast.lost_ips == 18 && blast.allowed_ips == 20
    ));
    assert!(present(&store, "10.0.0.20"));
}

#[test]
fn a_successor_holds_a_delta_that_removes_most_of_the_index() {
    // The services the validator knows are the ones the lines name: a
    // delta's removals count against them.
    let ips = twenty_ips();
    let mut store = left_by_predecessor(&ips);
    let mut b = successor(&store, 10_000);
    let mut d = delta(9, 3, 4);
    d.removed = ips[2..].iter().map(|ip| ip.parse().unwrap()).collect();
    assert_eq!(
        b.on_response(10_000, 200, &json(&Changes::Delta(d)), &mut store)
            .unwrap(),
        Applied::Held
    );
    assert!(present(&store, "10.0.0.20"));
}

#[test]
fn a_successor_lets_tombstones_through_at_once() {
    let ips = twenty_ips();
    let mut store = left_by_predecessor(&ips);
    let mut b = successor(&store, 10_000);
    let mut d = delta(9, 3, 4);
    d.upserts = ips[2..].iter().map(|ip| tombstoned(ip)).collect();
    assert_eq!(
        b.on_response(10_000, 200, &json(&Changes::Delta(d)), &mut store)
            .unwrap(),
        Applied::Delta { changed: 18 }
    );
    assert_eq!(b.take_guard_event(), None);
}

#[test]
fn a_new_holder_of_a_seeded_ip_is_no_evidence_until_an_answer_names_its_holder() {
    // A line keeps no pod names: the successor cannot tell a new pod from
    // the old one, so it holds where its predecessor would have applied.
    let ips = twenty_ips();
    let mut store = left_by_predecessor(&ips);
    let mut b = successor(&store, 10_000);
    let other = ServiceKey::new("shop", "other");
    let mut d = delta(9, 3, 4);
    d.services_added = vec![other.clone()];
    d.upserts = ips[2..]
        .iter()
        .map(|ip| {
            IpRecord::held_by(
                ip.parse().unwrap(),
                vec![PodHolder::ready_member(
                    "shop",
                    format!("other-{ip}"),
                    ip,
                    other.clone(),
                )],
            )
        })
        .collect();
    let d = json(&Changes::Delta(d));
    assert_eq!(
        b.on_response(10_000, 200, &d, &mut store).unwrap(),
        Applied::Held
    );
    // The predecessor, which applied those IPs itself, lets it through.
    let mut a = Poller::new(CFG, 1);
    let mut store = MemoryStore::default();
    a.next_request(0, &store);
    a.on_response(0, 200, &json(&snapshot_of(3, &ips)), &mut store)
        .unwrap();
    a.next_request(10_000, &store);
    assert_eq!(
        a.on_response(10_000, 200, &d, &mut store).unwrap(),
        Applied::Delta { changed: 18 }
    );
}

#[test]
fn an_index_older_than_max_staleness_ms_seeds_nothing_and_the_next_answer_is_the_first() {
    let ips = twenty_ips();
    let mut store = left_by_predecessor(&ips);
    let mut b = successor(&store, MAX_AGE_MS + 1);
    assert_eq!(b.take_seeded(), None);
    assert_eq!(
        b.on_response(MAX_AGE_MS + 1, 200, &dropping(&ips), &mut store)
            .unwrap(),
        Applied::Reset { entries: 2 }
    );
    // At the limit, it is still the reference.
    let mut store = left_by_predecessor(&ips);
    let mut b = successor(&store, MAX_AGE_MS);
    assert!(b.take_seeded().is_some());
    assert_eq!(
        b.on_response(MAX_AGE_MS, 200, &dropping(&ips), &mut store)
            .unwrap(),
        Applied::Held
    );
}

#[test]
fn the_seed_age_follows_max_staleness_ms() {
    let ips = twenty_ips();
    let store = left_by_predecessor(&ips);
    let mut b = Poller::new(CFG, 2).with_seed_max_age(5_000);
    b.next_request(5_001, &store);
    assert_eq!(b.take_seeded(), None);
    let mut b = Poller::new(CFG, 2).with_seed_max_age(5_000);
    b.next_request(5_000, &store);
    assert!(b.take_seeded().is_some());
}

#[test]
fn a_guard_turned_off_seeds_nothing() {
    let ips = twenty_ips();
    let store = left_by_predecessor(&ips);
    let off = GuardConfig {
        enabled: false,
        ..GuardConfig::default()
    };
    let mut b = Poller::new(CFG, 2).with_guard(Guard::new(off, staleguard_core::Policy::default()));
    b.next_request(10_000, &store);
    assert_eq!(b.take_seeded(), None);
}

/// The key of the bucket of `ip` in the layout `store`'s `meta` names.
fn bucket_of(store: &MemoryStore, ip: &str) -> String {
    let meta = IndexReader::new(store).meta().unwrap();
    buckets::key_of(&ip.parse::<IpAddr>().unwrap(), meta.buckets)
}

#[test]
fn an_unreadable_bucket_seeds_nothing_and_the_rest_still_holds_a_drop() {
    // The safe choice: the damaged bucket's IPs are neither allowed nor
    // lost, and the answer is judged by the IPs that could be read.
    let ips = twenty_ips();
    let mut store = left_by_predecessor(&ips);
    let key = bucket_of(&store, "10.0.0.20");
    use crate::host::SharedData as _;
    let (value, _) = store.get(&key).unwrap();
    let lines = Bucket::read(&value.unwrap(), 0).len() as u64;
    store.set(&key, b"not a bucket", None).unwrap();
    let mut b = successor(&store, 10_000);
    assert_eq!(
        b.take_seeded(),
        Some(Seeded {
            ips: 20 - lines,
            allowed_ips: 20 - lines,
            unreadable: 1
        })
    );
    assert_eq!(
        b.on_response(10_000, 200, &dropping(&ips), &mut store)
            .unwrap(),
        Applied::Held
    );
}

#[test]
fn an_unreadable_line_is_counted_and_its_neighbours_are_seeded() {
    let ips = twenty_ips();
    let mut store = left_by_predecessor(&ips);
    let meta = IndexReader::new(&store).meta().unwrap();
    let key = bucket_of(&store, "10.0.0.20");
    use crate::host::SharedData as _;
    let (value, _) = store.get(&key).unwrap();
    let mut bucket = Bucket::read(&value.unwrap(), meta.load);
    let before = bucket.len() as u64;
    // A line this build cannot decode, beside the bucket's own.
    let mut garbled = CompactRecord::of(&rec("10.0.9.9"));
    garbled.line = b"q".to_vec().into_boxed_slice();
    bucket.put(&garbled);
    store.set(&key, &bucket.encode(meta.load), None).unwrap();
    let mut b = successor(&store, 10_000);
    assert_eq!(
        b.take_seeded(),
        Some(Seeded {
            ips: 20,
            allowed_ips: 20,
            unreadable: 1
        }),
        "the {before} readable lines of that bucket are seeded"
    );
}

#[test]
fn a_takeover_during_an_unfinished_reset_seeds_what_readers_serve() {
    // The predecessor's thread stalled while it wrote a reset slice by
    // slice (each slice under the reset's new load, `meta` still naming the
    // old one): readers serve the slice it wrote and the old rest, and so
    // does the successor's baseline.
    let ips = twenty_ips();
    let mut store = left_by_predecessor(&ips);
    let meta = IndexReader::new(&store).meta().unwrap();
    let key = bucket_of(&store, "10.0.0.20");
    let fresh = CompactRecord::of(&rec("10.0.0.20"));
    let mut written = Bucket::default();
    written.put(&fresh);
    let newcomer = (0..=255)
        .map(|i| format!("10.0.5.{i}"))
        .find(|ip| bucket_of(&store, ip) == key)
        .unwrap();
    written.put(&CompactRecord::of(&rec(&newcomer)));
    use crate::host::SharedData as _;
    let (value, _) = store.get(&key).unwrap();
    let replaced = Bucket::read(&value.unwrap(), meta.load).len() as u64;
    store
        .set(&key, &written.encode(meta.load + 1), None)
        .unwrap();
    assert!(present(&store, &newcomer), "readers serve the slice");
    let mut b = successor(&store, 10_000);
    let seeded = b.take_seeded().unwrap();
    assert_eq!((seeded.ips, seeded.unreadable), (20 - replaced + 2, 0));
    assert_eq!(
        b.on_response(10_000, 200, &dropping(&ips), &mut store)
            .unwrap(),
        Applied::Held
    );
    assert!(present(&store, &newcomer));
}
