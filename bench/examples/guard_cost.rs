//! What the blast-radius guard costs the poller, natively, next to what the
//! poller pays anyway for the same answer (decoding its JSON).
//!
//! ```text
//! cargo run --release -p staleguard-bench --example guard_cost
//! ```
//!
//! `IPS` (150000) IPs in `SERVICES` (1000) services, `ROUNDS` (7), medians.
//! For a reset: building the baseline from it (`applied`), and judging a
//! second reset against it (`assess`: one with nothing lost, one empty); for
//! a delta of `CHANGES` (100) deletions with tombstones: `assess`. And the
//! baseline a poller that takes the lease over seeds from the index the
//! reset was written to (`seed`: every bucket read from shared data, here
//! the engine's in-memory store), paired with `applied` in the same run.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use staleguard_bench::{env_usize, fresh_snapshot, median, rss_kib};
use staleguard_core::wire::{Delta, Tombstone};
use staleguard_core::{IpRecord, PodHolder, Policy, ServiceKey, Snapshot};
use staleguard_engine::buckets::CompactRecord;
use staleguard_engine::guard::{Answer, Guard, GuardConfig};
use staleguard_engine::store::{IndexReader, MemoryStore};
use staleguard_engine::sync::{Poller, SyncConfig};

fn service(i: usize) -> ServiceKey {
    ServiceKey::new("shop", format!("svc-{i}"))
}

fn record(i: usize, services: usize) -> IpRecord {
    IpRecord::held_by(
        std::net::IpAddr::from([10, (i >> 16) as u8, (i >> 8) as u8, i as u8]),
        vec![PodHolder::ready_member(
            "shop",
            format!("svc-{}-{i}", i % services),
            String::new(),
            service(i % services),
        )],
    )
}

fn snapshot(services: usize, records: Vec<IpRecord>) -> Snapshot {
    fresh_snapshot((0..services).map(service).collect(), records)
}

fn time<T>(rounds: usize, mut f: impl FnMut() -> T) -> Duration {
    median(
        &mut (0..rounds)
            .map(|_| {
                let started = Instant::now();
                std::hint::black_box(f());
                started.elapsed()
            })
            .collect::<Vec<_>>(),
    )
}

/// Resident memory of this process, from /proc (Linux).
fn rss_bytes() -> Option<u64> {
    rss_kib(std::process::id()).ok().map(|kib| kib * 1024)
}

fn main() {
    let ips = env_usize("IPS", 150_000);
    let services = env_usize("SERVICES", 1000);
    let changes = env_usize("CHANGES", 100);
    let rounds = env_usize("ROUNDS", 7).max(1);

    let full = snapshot(services, (0..ips).map(|i| record(i, services)).collect());
    let json = serde_json::to_vec(&full).unwrap();
    // What the poller holds: records read off the wire into their compact form.
    let full: Snapshot<CompactRecord> = Snapshot::decode_from(&json[..]).unwrap();
    let empty: Snapshot<CompactRecord> =
        Snapshot::decode_from(&serde_json::to_vec(&snapshot(services, vec![])).unwrap()[..])
            .unwrap();
    let delta = Delta {
        v: 1,
        epoch: 1,
        since: 1,
        generation: 2,
        freshness: full.freshness.clone(),
        services_added: vec![],
        services_removed: vec![],
        upserts: (0..changes)
            .map(|i| IpRecord {
                pods: vec![],
                tombstone: Some(Tombstone {
                    pod: format!("shop/svc-{}-{i}", i % services),
                    uid: String::new(),
                    services: vec![service(i % services)],
                    since_ms: 1,
                }),
                ..record(i, services)
            })
            .map(|r| CompactRecord::of(&r))
            .collect(),
        removed: vec![],
    };

    // The baseline's memory: one guard, measured before anything else
    // allocates and frees around it.
    let before = rss_bytes();
    let mut first = Guard::new(GuardConfig::default(), Policy::default());
    first.applied(0, Answer::Reset(&full));
    let baseline_bytes = before.zip(rss_bytes()).map(|(b, a)| a.saturating_sub(b));
    drop(first);
    let decode = time(rounds, || Snapshot::from_json(&json).unwrap());
    let mut guard = Guard::new(GuardConfig::default(), Policy::default());
    let baseline = time(rounds, || guard.applied(0, Answer::Reset(&full)));
    let same = time(rounds, || guard.assess(Answer::Reset(&full)));
    let all_gone = time(rounds, || guard.assess(Answer::Reset(&empty)));
    assert!(guard.assess(Answer::Reset(&empty)).tripped.is_some());
    let tombstones = time(rounds.max(101), || guard.assess(Answer::Delta(&delta)));
    assert!(guard.assess(Answer::Delta(&delta)).tripped.is_none());

    // The index the reset makes in shared data, and a successor's seeding
    // from it.
    let mut store = MemoryStore::default();
    let mut poller = Poller::new(
        SyncConfig {
            wait_s: 30,
            backoff_initial_ms: 500,
            backoff_max_ms: 30_000,
            min_interval_ms: 0,
            page_bytes: None,
        },
        1,
    );
    poller.next_request(0, &store);
    poller.on_response(0, 200, &json, &mut store).unwrap();
    let meta = IndexReader::new(&store).meta().unwrap();
    let mut successor = Guard::new(GuardConfig::default(), Policy::default());
    let seed = time(rounds, || successor.seed(&store, &meta));
    let seeded = successor.seed(&store, &meta).unwrap();
    assert_eq!(seeded.allowed_ips, ips as u64);
    assert!(successor.assess(Answer::Reset(&empty)).tripped.is_some());

    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "{ips} IPs in {services} services, snapshot {} MB, medians of {rounds}:",
        json.len() / 1_000_000
    );
    println!(
        "  decode the snapshot (paid anyway)     {:>9.1} ms",
        ms(decode)
    );
    if let Some(bytes) = baseline_bytes {
        println!(
            "  guard: baseline memory (RSS growth)    {:>9.1} MB ({} bytes per IP)",
            bytes as f64 / 1e6,
            bytes / ips as u64
        );
    }
    println!(
        "  guard: baseline from the reset         {:>9.1} ms ({:.0}% of decode)",
        ms(baseline),
        100.0 * baseline.as_secs_f64() / decode.as_secs_f64()
    );
    println!(
        "  guard: baseline seeded from the index  {:>9.1} ms ({} buckets read)",
        ms(seed),
        meta.buckets
    );
    println!(
        "  guard: assess a reset, nothing lost    {:>9.1} ms ({:.0}% of decode)",
        ms(same),
        100.0 * same.as_secs_f64() / decode.as_secs_f64()
    );
    println!(
        "  guard: assess an empty reset (held)    {:>9.1} ms",
        ms(all_gone)
    );
    println!(
        "  guard: assess a delta of {changes} tombstones  {:>9.3} ms",
        ms(tombstones)
    );
}
