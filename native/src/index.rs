//! The index: one copy of the validator's data per Envoy process.
//!
//! The engine's store layout ([`staleguard_engine::store`]) kept in plain
//! process memory instead of Envoy shared data ([`crate::store`]: keys parsed
//! once, values in one buffer): the poller writes it through the same
//! [`SharedData`] trait, every worker's filter and load balancer reads it,
//! and [`judge`] runs the engine's verdict (the Wasm filter's)
//! ([`staleguard_engine::judgement::judge`]) on it, so the native build and the
//! Wasm filter cannot disagree on a host.

use std::cell::RefCell;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{LazyLock, PoisonError, RwLock};
use std::time::{SystemTime, UNIX_EPOCH};

use staleguard_core::{Reason, Snapshot};
use staleguard_engine::buckets::CompactRecord;
use staleguard_engine::cache::Cache;
use staleguard_engine::config::Config;
use staleguard_engine::host::{Peeked, SharedData, StoreError};
use staleguard_engine::judgement::{self, Lazy, Ruling, UpstreamRef};
use staleguard_engine::store::write::Writer;
use staleguard_engine::store::Meta;

use crate::store::{Footprint, Store};

static STORE: LazyLock<RwLock<Store>> = LazyLock::new(Default::default);

/// How many writes the index has taken: a reader that remembers a verdict
/// (the load balancer's [`crate::lb::Recent`]) forgets it when this moves.
static WRITES: AtomicU64 = AtomicU64::new(0);

/// The index's write count (see [`WRITES`]). It moves after the write is in
/// the store, so a reader that sees a new count reads at least that write.
pub fn writes() -> u64 {
    WRITES.load(Ordering::Acquire)
}

/// The process's index as the store trait sees it: every handle is the same
/// store. Reads take a shared lock, writes (the poller's) an exclusive one.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcessStore;

impl SharedData for ProcessStore {
    fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, u32), StoreError> {
        // A panic while the lock was held cannot leave a half-written value:
        // the store replaces each value whole, and a compaction copies every
        // value into its new buffer (made first) before it drops the old.
        STORE
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(key)
    }

    fn set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        let written = STORE
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .set(key, value, cas);
        WRITES.fetch_add(1, Ordering::Release);
        written
    }

    fn peek(&self, key: &str, read: &mut dyn FnMut(Peeked<'_>)) {
        // What `get` answers (`Store::get`: no value, token 0), lent.
        ProcessStore::peek(self, key, |value| {
            read(Ok(
                value.map_or((None, 0), |(bytes, cas)| (Some(bytes), cas))
            ))
        });
    }

    fn writes(&self) -> Option<u64> {
        // Every write of the process's index goes through `set` above,
        // which moves the count after it.
        Some(writes())
    }
}

impl ProcessStore {
    /// Reads `key`'s value and cas token where the store holds them
    /// ([`Store::peek`]), under the read lock: `read` borrows the bytes
    /// instead of getting a copy, so a reader allocates nothing.
    pub fn peek<R>(&self, key: &str, read: impl FnOnce(Option<(&[u8], u32)>) -> R) -> R {
        read(
            STORE
                .read()
                .unwrap_or_else(PoisonError::into_inner)
                .peek(key),
        )
    }
}

/// What the process's index holds ([`Store::footprint`]).
pub fn footprint() -> Footprint {
    STORE
        .read()
        .unwrap_or_else(PoisonError::into_inner)
        .footprint()
}

thread_local! {
    // Each worker's cache of services and records, as each Wasm VM has one.
    static CACHE: RefCell<Cache> = RefCell::new(Cache::default());
}

/// What the index says about one host of one cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Judgement {
    /// The engine's outcome: unmapped cluster, no address, out of scope,
    /// or judged (reason, action, and what the configured mode makes of it).
    pub outcome: Ruling,
}

impl Judgement {
    /// Whether the index could be trusted: false when it is stale (never
    /// synced, or older than `max_staleness_ms`), when the failure policy
    /// decided. An unjudged host (unmapped, out of scope) counts as fresh:
    /// the index has nothing to say about it.
    pub fn fresh(&self) -> bool {
        !matches!(
            &self.outcome,
            Ruling::Judged { verdict, .. } if verdict.reason == Reason::Stale
        )
    }

    /// Whether the verdict rejects the host (enforced or only audited).
    pub fn rejects(&self) -> bool {
        matches!(
            &self.outcome,
            Ruling::Judged { verdict, .. } if verdict.action == staleguard_core::Action::Reject
        )
    }
}

/// The clock and the lazy reads of a judgement outside a request: no
/// cluster metadata (a cluster resolves by `clusters` rules and its
/// `outbound|PORT|SUBSET|FQDN` name).
#[derive(Debug)]
struct Clock;

impl Lazy for Clock {
    fn istio_service_host(&self) -> Option<String> {
        None
    }

    fn now_ms(&self) -> u64 {
        now_ms()
    }
}

/// The wall clock, ms since the Unix epoch (0 if the clock is before it).
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Judges `ip` as a host of `cluster` under `config` (the plugin
/// configuration, same schema as the Wasm filter's), as the Wasm filter would
/// judge a request sent to it. Callable from any thread.
pub fn judge(config: &Config, cluster: &str, ip: &IpAddr) -> Judgement {
    judge_address(config, cluster, &ip.to_string())
}

/// [`judge`] for a host as Envoy names it, `IP:port` (`[v6]:port`, or an
/// internal `envoy://` address), without building the address text.
pub fn judge_address(config: &Config, cluster: &str, address: &str) -> Judgement {
    judge_upstream(
        config,
        UpstreamRef {
            cluster: Some(cluster),
            address: Some(address),
        },
        &Clock,
    )
}

/// [`judge`] for a request: the upstream as the host reports it, with the
/// request's lazy reads.
pub fn judge_upstream(config: &Config, upstream: UpstreamRef<'_>, lazy: &dyn Lazy) -> Judgement {
    let outcome = CACHE.with(|cache| {
        let mut cache = cache.borrow_mut();
        judgement::judge(config, &mut cache, &ProcessStore, upstream, lazy)
    });
    Judgement { outcome }
}

/// Replaces the index with `snapshot` (the validator's `/v1/snapshot`
/// document), as a reset sync would, synced at `now_ms`. For tests and
/// benchmarks that fill the index without a validator; the poller writes
/// through its own writer.
pub fn load_snapshot(snapshot_json: &[u8], now_ms: u64) -> Result<Meta, String> {
    let mut snapshot: Snapshot<CompactRecord> =
        serde_json::from_slice(snapshot_json).map_err(|e| e.to_string())?;
    Writer::default()
        .write_snapshot(&mut ProcessStore, now_ms, &mut snapshot)
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use staleguard_core::wire::{Freshness, PodHolder, WIRE_VERSION};
    use staleguard_core::{Action, IpRecord, ServiceKey};

    fn config() -> Config {
        Config::parse(
            br#"{"validator_cluster": "staleguard-validator", "on_reject": "reject",
                 "clusters": [{"name": "shop-cart", "service": "shop/cart"}]}"#,
        )
        .unwrap()
    }

    /// The whole life of the process's index in one test (the store is
    /// process-wide, so tests of it cannot run side by side): stale before
    /// the first sync, then the filter's verdicts on what was loaded.
    #[test]
    fn the_index_judges_as_the_filter_once_loaded_and_is_stale_before() {
        let config = config();
        let live: IpAddr = "10.0.0.1".parse().unwrap();
        let gone: IpAddr = "10.0.0.2".parse().unwrap();

        let before = judge(&config, "shop-cart", &live);
        assert!(!before.fresh(), "{before:?}");
        assert!(!before.rejects(), "failure policy open: {before:?}");

        let cart = ServiceKey::new("shop", "cart");
        let snapshot = Snapshot {
            v: WIRE_VERSION,
            epoch: 7,
            generation: 1,
            freshness: Freshness {
                fresh: true,
                age_ms: Some(0),
            },
            services: vec![cart.clone()],
            records: vec![IpRecord::held_by(
                live,
                vec![PodHolder::ready_member("shop", "cart-1", "u1", cart)],
            )],
        };
        load_snapshot(&serde_json::to_vec(&snapshot).unwrap(), now_ms()).unwrap();

        let meta = ProcessStore
            .get(staleguard_engine::store::META_KEY)
            .unwrap();
        let lent = ProcessStore.peek(staleguard_engine::store::META_KEY, |v| {
            v.map(|(bytes, cas)| (bytes.to_vec(), cas))
        });
        assert_eq!(lent.map(|(v, cas)| (Some(v), cas)), Some(meta));

        let member = judge(&config, "shop-cart", &live);
        assert!(member.fresh() && !member.rejects(), "{member:?}");
        let destroyed = judge_address(&config, "shop-cart", "10.0.0.2:8080");
        assert!(destroyed.fresh() && destroyed.rejects(), "{destroyed:?}");
        let Ruling::Judged { verdict, .. } = destroyed.outcome else {
            panic!("not judged");
        };
        assert_eq!(
            (verdict.reason, verdict.action),
            (Reason::Destroyed, Action::Reject)
        );
        assert_eq!(judge(&config, "elsewhere", &gone).outcome, Ruling::Unmapped);
    }
}
