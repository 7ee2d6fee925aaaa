//! Per-request cost of a verdict against indexes of different sizes, natively
//! with the in-memory shared-data double (which copies values out like the
//! host does). Shows that the cost does not grow with the index. `cold`: a
//! new per-VM cache for every verdict (three shared-data reads, the record
//! decoded); `warm`: one cache, every IP seen before (`meta` read only).
//!
//! `cargo run --release -p staleguard-bench --example judge_cost`
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::{IpAddr, Ipv4Addr};
use std::time::Instant;

use staleguard_bench::fresh_snapshot;
use staleguard_core::{IpRecord, PodHolder, ServiceKey};
use staleguard_engine::cache::Cache;
use staleguard_engine::config::Config;
use staleguard_engine::judgement::{judge, Lazy, Upstream};
use staleguard_engine::store::MemoryStore;
use staleguard_engine::sync::{Poller, SyncConfig};

fn ip(i: u32) -> IpAddr {
    IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i))
}

fn index(entries: u32) -> MemoryStore {
    let cart = ServiceKey::new("shop", "cart");
    let records = (0..entries)
        .map(|i| {
            IpRecord::held_by(
                ip(i),
                vec![PodHolder::ready_member(
                    "shop",
                    format!("cart-{i}"),
                    format!("uid-{i}"),
                    cart.clone(),
                )],
            )
        })
        .collect();
    let snapshot = fresh_snapshot(vec![cart], records);
    let mut store = MemoryStore::default();
    let mut poller = Poller::new(
        SyncConfig {
            wait_s: 1,
            backoff_initial_ms: 1,
            backoff_max_ms: 1,
            min_interval_ms: 0,
            page_bytes: None,
        },
        1,
    );
    poller.next_request(0, &store);
    poller
        .on_response(0, 200, &serde_json::to_vec(&snapshot).unwrap(), &mut store)
        .unwrap();
    store
}

/// The lazy reads: no Istio metadata, the clock at the sync.
struct AtSync;

impl Lazy for AtSync {
    fn istio_service_host(&self) -> Option<String> {
        None
    }
    fn now_ms(&self) -> u64 {
        0
    }
}

fn main() {
    let config = Config::parse(br#"{"validator_cluster":"sg"}"#).unwrap();
    println!("entries  median ns/verdict, cold and warm cache (11 runs of 100k verdicts)");
    for entries in [1_000u32, 10_000, 100_000] {
        let store = index(entries);
        let mut warm_cache = Cache::default();
        let mut medians = vec![];
        for warm in [false, true] {
            let mut runs = vec![];
            for _ in 0..11 {
                let started = Instant::now();
                let n = 100_000u32;
                for i in 0..n {
                    let upstream = Upstream {
                        cluster: Some("outbound|8080||cart.shop.svc.cluster.local".into()),
                        address: Some(format!("{}:8080", ip((i * 7919) % entries))),
                    };
                    let mut cold_cache = Cache::default();
                    let cache = if warm {
                        &mut warm_cache
                    } else {
                        &mut cold_cache
                    };
                    std::hint::black_box(judge(&config, cache, &store, &upstream, &AtSync));
                }
                runs.push(started.elapsed().as_nanos() as f64 / f64::from(n));
            }
            runs.sort_by(|a, b| a.total_cmp(b));
            medians.push(runs[runs.len() / 2]);
        }
        println!("{entries:>7}  {:.0}  {:.0}", medians[0], medians[1]);
    }
}
