//! The filter's sync in real Envoy: the validator goes down (stale data under
//! both failure policies), restarts with a new epoch (full resync), answers
//! garbage, calls its own data stale, and requires a bearer token; and a
//! gateway of this release syncs from validators of earlier releases.
//!
//! Knobs: `max_staleness_ms` 3000 (so data turns stale within the test),
//! which needs `poll_wait_s` 1 (staleness must exceed the wait), and
//! `backoff_max_ms` 500 (so recovery after an outage is prompt).

use std::time::Duration;

use anyhow::Result;
use serde_json::json;
use staleguard_core::ServiceKey;
use staleguard_tests::blocking::named_host;
use staleguard_tests::envoy::stats::prometheus_value;
use staleguard_tests::envoy::{shipped_plugin, Cluster, Envoy, Gateway};
use staleguard_tests::fake_validator::{records::pod, Behaviour, FakeValidator, Release};

const OPEN: &str = "outbound|8080|open|cart.shop.svc.cluster.local";
const CLOSED: &str = "outbound|8080|closed|cart.shop.svc.cluster.local";
const WAIT: Duration = Duration::from_secs(15);

fn verdict(envoy: &Envoy, cluster: &str) -> Result<(u16, String)> {
    let r = envoy.get(cluster)?;
    Ok((r.status, r.header("x-staleguard").to_owned()))
}

fn expect(envoy: &Envoy, what: &str, cluster: &str, status: u16, reason: &str) -> Result<()> {
    envoy.eventually(what, WAIT, |e| {
        Ok(verdict(e, cluster)? == (status, reason.to_owned()))
    })
}

#[test]
fn sync_failures_restarts_and_freshness_with_max_staleness_ms_3000_poll_wait_s_1_backoff_max_ms_500(
) -> Result<()> {
    let cart = ServiceKey::new("shop", "cart");
    let host = named_host("127.0.1.21", "host")?;
    let validator = FakeValidator::start(41)?;
    validator.set_token(Some("s3cret"));
    validator.set_index(vec![cart.clone()], vec![]);

    let plugin = |policy: &str| {
        Some(shipped_plugin(json!({
            "max_staleness_ms": 3000,
            "poll_wait_s": 1,
            "backoff_max_ms": 500,
            "token": "s3cret",
            "policy": {"failure_policy": policy}
        })))
    };
    let gateway = Gateway::new(
        validator.addr(),
        vec![
            Cluster::new(OPEN, host.addr(), plugin("open")),
            Cluster::new(CLOSED, host.addr(), plugin("closed")),
        ],
    );
    let Some(envoy) = gateway.start()? else {
        return Ok(());
    };

    // Synced (so the token was sent): the host's IP is not in the index.
    expect(&envoy, "first sync", CLOSED, 503, "destroyed")?;
    assert_eq!(verdict(&envoy, OPEN)?, (503, "destroyed".into()));

    // Validator down: once the data is older than max_staleness (3 s), the
    // failure policy decides: open lets through, closed rejects.
    validator.set_behaviour(Behaviour::Down);
    expect(&envoy, "stale under closed", CLOSED, 503, "stale")?;
    assert_eq!(verdict(&envoy, OPEN)?, (200, String::new()));
    envoy.wait_requests("stale", "allow", 1)?;
    envoy.wait_requests("stale", "reject", 1)?;
    // Envoy answers a hung-up request itself with a 503.
    let errors = envoy.stat("wasmcustom.staleguard_filter_sync_errors_total.kind.status")?
        + envoy.stat("wasmcustom.staleguard_filter_sync_errors_total.kind.transport")?;
    assert!(errors >= 1, "{}", envoy.admin("/stats?filter=staleguard")?);
    // Gauges follow on the next tick.
    envoy.eventually("index_fresh gauge 0", WAIT, |e| {
        Ok(e.stat("wasmcustom.staleguard_filter_index_fresh")? == 0)
    })?;

    // The validator comes back after a restart: new epoch, the IP is now a
    // cart pod. The filter's old epoch gets a reset.
    let resets = envoy.stat("wasmcustom.staleguard_filter_sync_resets_total")?;
    validator.restart(77);
    validator.set_index(
        vec![cart.clone()],
        vec![pod("127.0.1.21", "cart-1", &[&cart], false)],
    );
    validator.set_behaviour(Behaviour::Normal);
    expect(&envoy, "resync after restart", CLOSED, 200, "")?;
    assert!(envoy.stat("wasmcustom.staleguard_filter_sync_resets_total")? > resets);
    assert!(validator.wait_for(WAIT, |log| log
        .iter()
        .any(|r| r.starts_with("/v1/changes?v=1&view=verdict&epoch=77&"))));
    envoy.eventually("index_fresh gauge", WAIT, |e| {
        Ok(e.stat("wasmcustom.staleguard_filter_index_fresh")? == 1)
    })?;

    // Garbage answers are decode errors; the data stays until it is stale.
    validator.set_behaviour(Behaviour::Garbage);
    envoy.eventually("decode errors", WAIT, |e| {
        Ok(e.stat("wasmcustom.staleguard_filter_sync_errors_total.kind.decode")? >= 1)
    })?;
    assert_eq!(verdict(&envoy, CLOSED)?, (200, String::new()), "kept");
    let prom = envoy.admin("/stats/prometheus")?;
    assert!(
        prometheus_value(
            &prom,
            "staleguard_filter_sync_errors_total",
            &[("staleguard_error_kind", "decode")]
        )
        .is_some_and(|n| n >= 1),
        "{prom}"
    );
    expect(&envoy, "stale after garbage", CLOSED, 503, "stale")?;

    // The validator says its own data is not fresh: stale as well.
    validator.set_behaviour(Behaviour::Normal);
    expect(&envoy, "recovery", CLOSED, 200, "")?;
    validator.set_fresh(false);
    validator.upsert(pod("127.0.1.99", "nudge", &[&cart], false));
    expect(&envoy, "fresh=false is stale", CLOSED, 503, "stale")?;
    validator.set_fresh(true);
    validator.upsert(pod("127.0.1.98", "nudge-2", &[&cart], false));
    expect(&envoy, "fresh again", CLOSED, 200, "")?;

    // A wrong token: 401s are status errors, and the data goes stale.
    validator.set_token(Some("rotated"));
    let status_errors = envoy.stat("wasmcustom.staleguard_filter_sync_errors_total.kind.status")?;
    envoy.eventually("401 counted", WAIT, |e| {
        Ok(e.stat("wasmcustom.staleguard_filter_sync_errors_total.kind.status")? > status_errors)
    })?;
    expect(&envoy, "stale after 401", CLOSED, 503, "stale")?;
    let log = envoy.log();
    assert!(
        log.contains("staleguard: sync failed: validator answered HTTP 401"),
        "{log}"
    );
    assert!(log.contains("[ctx "), "log lines carry the context id");
    Ok(())
}

/// This release's gateway asks for binary records first; a validator of the
/// last release answers the text packed form, one before it JSON. Resets
/// and deltas of each are applied alike (shipped plugin configuration).
#[test]
fn the_gateway_syncs_from_validators_of_the_last_releases_as_from_this_one() -> Result<()> {
    let cart = ServiceKey::new("shop", "cart");
    let host = named_host("127.0.1.22", "host")?;
    let live = || pod("127.0.1.22", "cart-1", &[&cart], false);
    let validator = FakeValidator::start(51)?;
    validator.set_release(Release::Last);
    validator.set_index(vec![cart.clone()], vec![live()]);
    let plugin = Some(shipped_plugin(json!({})));
    let gateway = Gateway::new(
        validator.addr(),
        vec![Cluster::new(CLOSED, host.addr(), plugin)],
    );
    let Some(envoy) = gateway.start()? else {
        return Ok(());
    };
    let ip = "127.0.1.22".parse()?;
    for (release, epoch) in [
        (Release::Last, 51),
        (Release::BeforePacked, 52),
        (Release::Current, 53),
    ] {
        if epoch != 51 {
            // A validator of another release, restarted: a reset.
            validator.set_release(release);
            validator.restart_with(epoch, vec![cart.clone()], vec![live()]);
        }
        expect(&envoy, &format!("{release:?}: a reset"), CLOSED, 200, "")?;
        // A delta: the pod is gone.
        validator.remove(ip);
        expect(
            &envoy,
            &format!("{release:?}: a delta"),
            CLOSED,
            503,
            "destroyed",
        )?;
    }
    let errors = envoy.stat("wasmcustom.staleguard_filter_sync_errors_total.kind.decode")?;
    assert_eq!(errors, 0, "{}", envoy.admin("/stats?filter=staleguard")?);
    Ok(())
}
