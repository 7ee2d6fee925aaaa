//! Exactly one poller per Envoy process: with two workers (two VMs, each with
//! a root context per guarded cluster, plus the main thread's), the validator
//! sees one snapshot request and never two requests at once, and every worker
//! judges from the one shared index.

use std::time::Duration;

use anyhow::Result;
use serde_json::json;
use staleguard_core::ServiceKey;
use staleguard_tests::blocking::named_host;
use staleguard_tests::envoy::{shipped_plugin, Cluster, Gateway};
use staleguard_tests::fake_validator::{records::pod, FakeValidator};

#[test]
fn one_poller_per_process_with_two_workers() -> Result<()> {
    let cart = ServiceKey::new("shop", "cart");
    let live = named_host("127.0.1.31", "cart-1")?;
    let gone = named_host("127.0.1.32", "ghost")?;
    let validator = FakeValidator::start(5)?;
    validator.set_index(
        vec![cart.clone()],
        vec![pod("127.0.1.31", "cart-1", &[&cart], false)],
    );
    let plugin = Some(shipped_plugin(json!({})));
    let names: Vec<String> = (0..3)
        .map(|i| format!("outbound|8080|s{i}|cart.shop.svc.cluster.local"))
        .collect();
    let gateway = Gateway {
        concurrency: 2,
        ..Gateway::new(
            validator.addr(),
            vec![
                Cluster::new(&names[0], live.addr(), plugin.clone()),
                Cluster::new(&names[1], gone.addr(), plugin.clone()),
                // Same config as s0: a third root context per VM, same lease.
                Cluster::new(&names[2], live.addr(), plugin.clone()),
            ],
        )
    };
    let Some(envoy) = gateway.start()? else {
        return Ok(());
    };
    envoy.eventually("first sync", Duration::from_secs(20), |e| {
        Ok(e.stat("wasmcustom.staleguard_filter_sync_resets_total")? >= 1)
    })?;
    // Requests on many connections land on both workers; all judge alike.
    for _ in 0..20 {
        assert_eq!(envoy.get(&names[0])?.status, 200);
        assert_eq!(envoy.get(&names[1])?.status, 503);
        assert_eq!(envoy.get(&names[2])?.status, 200);
    }
    // Several long-poll rounds: each change answers the poll that is out.
    for i in 0..3 {
        let open = validator.requests().len();
        validator.upsert(pod(&format!("127.0.2.{i}"), "other", &[&cart], false));
        assert!(
            validator.wait_for(Duration::from_secs(10), |log| log.len() > open),
            "the next long poll follows an answer"
        );
    }
    // Give every worker's timer the chance to start a second poller: not a
    // sleep but a round of traffic on many connections (so on both workers)
    // counted in full, and the filter counts on its tick, so every worker that
    // served the round has ticked since the last long poll went out.
    for _ in 0..20 {
        assert_eq!(envoy.get(&names[0])?.status, 200);
        assert_eq!(envoy.get(&names[1])?.status, 503);
        assert_eq!(envoy.get(&names[2])?.status, 200);
    }
    envoy.wait_counted(120)?;
    let requests = validator.requests();
    let snapshots = requests
        .iter()
        .filter(|r| r.starts_with("/v1/snapshot"))
        .count();
    assert_eq!(snapshots, 1, "{requests:#?}");
    assert_eq!(
        validator.max_open(),
        1,
        "two pollers overlapped: {requests:#?}"
    );
    assert!(requests.len() >= 5, "long polls continue: {requests:#?}");
    assert!(
        requests.len() <= 6,
        "one poller, one long poll per answer: {requests:#?}"
    );
    assert_eq!(
        envoy.stat("wasmcustom.staleguard_filter_sync_lease_acquired_total")?,
        1
    );
    assert_eq!(
        envoy.stat("wasmcustom.staleguard_filter_sync_polls_total")?,
        requests.len() as u64
    );
    assert_eq!(envoy.stat("wasmcustom.staleguard_filter_index_entries")?, 4);
    Ok(())
}
