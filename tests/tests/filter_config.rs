//! A plugin configuration the filter refuses never takes a gateway down: a
//! fresh Envoy starts and routes whatever is wrong in it (static clusters and
//! clusters over CDS alike), a running one takes the bad update and keeps
//! routing, and the log names every problem. Until a good configuration
//! arrives the filter runs with the failure policy (open: every request
//! through, counted).

use std::time::Duration;

use anyhow::Result;
use serde_json::{json, Value};
use staleguard_core::ServiceKey;
use staleguard_tests::blocking::{named_host, Server};
use staleguard_tests::envoy::{native, shipped_plugin, Cluster, Envoy, Gateway};
use staleguard_tests::fake_validator::{records::pod, FakeValidator};

const DYN: &str = "outbound|8080|dyn|cart.shop.svc.cluster.local";

const UNCONFIGURED: &str = "wasmcustom.staleguard_filter_requests_unconfigured_total";
const REFUSED: &str = "wasmcustom.staleguard_filter_config_refused_total";

/// One cluster per class of mistake, each guarded by the shipped plugin
/// configuration with that mistake in it, and the log line that must name
/// it.
fn mistakes() -> Vec<(&'static str, Value, &'static str)> {
    vec![
        (
            "unknown-field",
            json!({"mdoe": "audit"}),
            "plugin configuration: mdoe: unknown field `mdoe`, expected one of",
        ),
        (
            "wrong-type",
            json!({"poll_wait_s": "30"}),
            r#"plugin configuration: poll_wait_s: invalid type: string "30", expected u32"#,
        ),
        (
            "bad-value",
            json!({"reject_status": 42}),
            "plugin configuration: reject_status 42 not in 200..=599",
        ),
        (
            "token-env-unset",
            json!({"token_env": "STALEGUARD_TEST_TOKEN_NOT_SET"}),
            r#"plugin configuration: token_env "STALEGUARD_TEST_TOKEN_NOT_SET" is not set"#,
        ),
        (
            "no-such-validator-cluster",
            json!({"validator_cluster": "staleguard-validatr"}),
            // Each build names Envoy's refusal in its host's words.
            if native::selected() {
                r#"dispatch to validator_cluster "staleguard-validatr" failed: ClusterNotFound: Envoy has no cluster of that name"#
            } else {
                r#"dispatch to validator_cluster "staleguard-validatr" failed: BadArgument: Envoy has no cluster of that name"#
            },
        ),
    ]
}

/// The clusters of [`mistakes`] to `host`, each mapped to shop/cart so that
/// a working filter would judge its requests.
fn clusters(host: &Server) -> Vec<Cluster> {
    mistakes()
        .into_iter()
        .map(|(name, mistake, _)| {
            let mut extra = json!({"clusters": [{"name": name, "service": "shop/cart"}]});
            for (k, v) in mistake.as_object().into_iter().flatten() {
                extra[k] = v.clone();
            }
            Cluster::new(name, host.addr(), Some(shipped_plugin(extra)))
        })
        .collect()
}

/// Every cluster of [`mistakes`] routes to its host, and the log names each
/// mistake.
fn routes_and_names_every_mistake(envoy: &Envoy) -> Result<()> {
    for (name, _, _) in mistakes() {
        let r = envoy.get(name)?;
        assert_eq!(
            (r.status, r.header("x-host")),
            (200, "live"),
            "{name}: {}",
            envoy.log()
        );
    }
    envoy.eventually("every mistake logged", Duration::from_secs(20), |e| {
        let log = e.log();
        Ok(mistakes().iter().all(|(_, _, line)| log.contains(line)))
    })?;
    let log = envoy.log();
    assert!(
        log.contains("the plugin runs anyway and the filter lets every request through unguarded (failure policy open)"),
        "{log}"
    );
    // Four configurations refused, each counted once however many workers;
    // their requests counted as they passed.
    assert_eq!(envoy.stat(REFUSED)?, 4);
    assert!(envoy.stat(UNCONFIGURED)? >= 4);
    envoy.check_alive()
}

#[test]
fn a_fresh_envoy_with_bad_plugin_configurations_starts_and_routes() -> Result<()> {
    let live = named_host("127.0.1.42", "live")?;
    let validator = FakeValidator::start(3)?;
    let gateway = Gateway {
        concurrency: 2,
        ..Gateway::new(validator.addr(), clusters(&live))
    };
    let Some(envoy) = gateway.start()? else {
        return Ok(());
    };
    routes_and_names_every_mistake(&envoy)
}

#[test]
fn a_fresh_envoy_with_bad_plugin_configurations_over_cds_starts_and_routes() -> Result<()> {
    let live = named_host("127.0.1.43", "live")?;
    let validator = FakeValidator::start(3)?;
    let gateway = Gateway {
        concurrency: 2,
        dynamic: clusters(&live),
        ..Gateway::new(validator.addr(), vec![])
    };
    let Some(envoy) = gateway.start()? else {
        return Ok(());
    };
    envoy.eventually("the CDS clusters", Duration::from_secs(20), |e| {
        // Each guarded cluster and the validator's; no retry twins: a
        // refused configuration replays nothing (see `twin_cluster`).
        let expected = mistakes().len() as u64 + 1;
        Ok(e.stat("cluster_manager.active_clusters")? >= expected)
    })?;
    assert_eq!(envoy.stat("cluster_manager.cds.update_rejected")?, 0);
    routes_and_names_every_mistake(&envoy)
}

#[test]
fn a_bad_plugin_config_update_is_taken_runs_open_and_a_good_one_guards_again() -> Result<()> {
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

    // Every problem of the update in the log, each with its field; the
    // update is taken (Envoy would reject the cluster if the plugin refused
    // to start) and the filter fails open until a good one arrives.
    let updated = envoy.stat("cluster_manager.cds.update_success")?;
    let bad = shipped_plugin(json!({"mdoe": "audit", "reject_status": 42, "poll_wait_s": 99}));
    envoy.update_clusters(&[Cluster::new(DYN, gone.addr(), Some(bad))])?;
    envoy.eventually("the update to be taken", Duration::from_secs(20), |e| {
        Ok(e.stat("cluster_manager.cds.update_success")? > updated)
    })?;
    envoy.eventually(
        "the bad update to fail open",
        Duration::from_secs(20),
        |e| Ok(e.get(DYN)?.status == 200),
    )?;
    assert_eq!(envoy.stat("cluster_manager.cds.update_rejected")?, 0);
    let log = envoy.log();
    for line in [
        "mdoe: unknown field `mdoe`",
        "poll_wait_s 99 exceeds 60",
        "reject_status 42 not in 200..=599",
        "max_staleness_ms 60000 must exceed poll_wait_s (99 s)",
        "plugin configuration refused (4 problems)",
    ] {
        assert!(log.contains(line), "no {line:?} in:\n{log}");
    }
    assert!(envoy.stat(UNCONFIGURED)? >= 1);
    assert_eq!(envoy.stat(REFUSED)?, 1);

    // A good update is taken: audit mode lets the request through, counted
    // as a verdict again, and the next enforcing one rejects again.
    let audit = shipped_plugin(json!({"mode": "audit"}));
    envoy.update_clusters(&[Cluster::new(DYN, gone.addr(), Some(audit))])?;
    envoy.eventually("the audit config to apply", Duration::from_secs(20), |e| {
        Ok(e.requests("destroyed", "audit")? >= 1 || {
            e.get(DYN)?;
            false
        })
    })?;
    let enforce = shipped_plugin(json!({}));
    envoy.update_clusters(&[Cluster::new(DYN, gone.addr(), Some(enforce))])?;
    envoy.eventually("guarding again", Duration::from_secs(20), |e| {
        Ok(e.get(DYN)?.header("x-staleguard") == "destroyed")
    })?;

    // Each update replaced the plugin and its root contexts: the refused one
    // held no lease; each good one took it over in turn.
    envoy.eventually("the lease taken over", Duration::from_secs(20), |e| {
        Ok(e.stat("wasmcustom.staleguard_filter_sync_lease_acquired_total")? == 3)
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
        "the successors continued from meta with deltas, no reload"
    );
    assert!(
        validator.requests().len() >= polls + 2,
        "polling stopped after the update"
    );
    assert_eq!(envoy.stat("wasmcustom.staleguard_filter_index_fresh")?, 1);
    Ok(())
}
