//! What the examples under `tests/examples` share to read their knobs and
//! report their runs.

use std::cmp::Ordering;
use std::net::SocketAddr;
use std::time::Duration;

use serde_json::json;

use staleguard_core::{Freshness, IpRecord, ServiceKey};
use staleguard_validator::index::{Index, IndexConfig};
use staleguard_validator::shared::SharedIndex;
use staleguard_validator::synth;

use crate::envoy::{shipped_plugin, Cluster, Gateway};

/// The whole number in the environment variable `name`, or `default` when it
/// is unset or not a number (the examples' knobs: `ROUNDS`, `PODS`, ...).
pub fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The median of `v` (the upper one of an even count), sorting `v` in place.
/// Panics on an empty slice: a run that measured nothing has no median.
pub fn median<T: Copy + PartialOrd>(v: &mut [T]) -> T {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(Ordering::Equal));
    v[v.len() / 2]
}

/// A synthetic cluster of `pods` pods spread over `services` services, as
/// the validator indexes it (`validator::synth`), in the verdict view the
/// filter is sent: the services and one record per IP.
pub fn synthetic_index(services: usize, pods: usize) -> (Vec<ServiceKey>, Vec<IpRecord>) {
    let services = services.max(1);
    let shared = SharedIndex::new(
        Index::new(1, IndexConfig::default()),
        Duration::from_secs(3600),
    );
    synth::feed(&shared, synth::cluster(services, pods / services));
    let snapshot = shared.read().snapshot(Freshness {
        fresh: true,
        age_ms: Some(0),
    });
    let records = snapshot
        .records
        .into_iter()
        .map(IpRecord::verdict_view)
        .collect();
    (snapshot.services, records)
}

/// One gateway (one worker) with one guarded cluster of a synthetic service
/// (`svc-0` of [`synthetic_index`]) and the shipped plugin, polling the
/// validator at `validator`: what the memory and reset examples load an
/// index into. Its one endpoint, 127.0.1.250:9, is never sent traffic.
pub fn index_gateway(validator: SocketAddr) -> Gateway {
    Gateway::new(
        validator,
        vec![Cluster::new(
            "outbound|80||svc-0.bench.svc.cluster.local",
            SocketAddr::from(([127, 0, 1, 250], 9)),
            Some(shipped_plugin(json!({}))),
        )],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_is_the_middle_or_the_upper_middle() {
        assert_eq!(median(&mut [3u64, 1, 2]), 2);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 3.0);
    }
}
