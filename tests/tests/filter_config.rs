//! A bad plugin configuration is refused with a clear log line, and Envoy
//! keeps serving with the configuration it had.

use std::time::Duration;

use anyhow::Result;
use serde_json::json;
use staleguard_core::ServiceKey;
use staleguard_tests::blocking::named_host;
use staleguard_tests::envoy::{shipped_plugin, Cluster, Gateway};
use staleguard_tests::fake_validator::{records::pod, FakeValidator};

const DYN: &str = "outbound|8080|dyn|cart.shop.svc.cluster.local";

#[test]
fn bad_plugin_config_is_refused_and_envoy_keeps_serving() -> Result<()> {
    let gone = named_host("127.0.1.41", "ghost")?;
    let validator = FakeValidator::start(3)?;
    let cart = ServiceKey::new("shop", "cart");
    validator.set_index(vec![cart.clone()], vec![]);
    let good = Cluster::new(DYN, gone.addr(), Some(shipped_plugin(json!({}))));
    let gateway = Gateway {
        dynamic: vec![good],
        ..Gateway::new(validator.addr(), vec![])
    };
    let Some(envoy) = gateway.start()? else {
        return Ok(());
    };
    envoy.eventually("guarded cluster rejects", Duration::from_secs(20), |e| {
        Ok(e.get(DYN)?.header("x-staleguard") == "destroyed")
    })?;

    let rejected = envoy.stat("cluster_manager.cds.update_rejected")?;
    let typo = shipped_plugin(json!({"mdoe": "audit"}));
    envoy.update_clusters(&[Cluster::new(DYN, gone.addr(), Some(typo))])?;
    envoy.eventually("the update to be rejected", Duration::from_secs(20), |e| {
        Ok(e.stat("cluster_manager.cds.update_rejected")? > rejected)
    })?;
    let log = envoy.log();
    assert!(
        log.contains("plugin configuration is not valid JSON for staleguard: unknown field `mdoe`"),
        "no clear log line:\n{log}"
    );
    // Still serving, still guarding, with the old configuration.
    let r = envoy.get(DYN)?;
    assert_eq!((r.status, r.header("x-staleguard")), (503, "destroyed"));

    // Out-of-range values are refused too, all reported in one line.
    let bad = shipped_plugin(json!({"reject_status": 42, "poll_wait_s": 99}));
    let rejected = envoy.stat("cluster_manager.cds.update_rejected")?;
    envoy.update_clusters(&[Cluster::new(DYN, gone.addr(), Some(bad))])?;
    envoy.eventually(
        "the second update to be rejected",
        Duration::from_secs(20),
        |e| Ok(e.stat("cluster_manager.cds.update_rejected")? > rejected),
    )?;
    let log = envoy.log();
    assert!(
        log.contains("poll_wait_s 99 exceeds 60")
            && log.contains("reject_status 42 not in 200..=599"),
        "{log}"
    );
    assert_eq!(envoy.get(DYN)?.status, 503);

    // A good update is taken: audit mode now lets the request through.
    let audit = shipped_plugin(json!({"mode": "audit"}));
    envoy.update_clusters(&[Cluster::new(DYN, gone.addr(), Some(audit))])?;
    envoy.eventually("the audit config to apply", Duration::from_secs(20), |e| {
        Ok(e.get(DYN)?.status == 200)
    })?;

    // The update replaced the plugin and its root contexts: the old poller
    // released its lease (on_done), a new root context took it over.
    envoy.eventually("the lease taken over", Duration::from_secs(20), |e| {
        Ok(e.stat("wasmcustom.staleguard_filter_sync_lease_acquired_total")? == 2)
    })?;
    // Each change answers the long poll that is out; the next one follows.
    let polls = validator.requests().len();
    for i in 0..2 {
        let open = validator.requests().len();
        validator.upsert(pod(&format!("127.0.2.{i}"), "other", &[&cart], false));
        assert!(
            validator.wait_for(Duration::from_secs(10), |log| log.len() > open),
            "polling stopped after the update"
        );
    }
    assert_eq!(
        envoy.stat("wasmcustom.staleguard_filter_sync_resets_total")?,
        1,
        "the successor continued from meta with deltas, no reload"
    );
    assert!(
        validator.requests().len() >= polls + 2,
        "polling stopped after the update"
    );
    assert_eq!(envoy.stat("wasmcustom.staleguard_filter_index_fresh")?, 1);
    Ok(())
}
