//! Experiment: can the filter make the router retry on another host?
//!
//! With `action: retry` the filter resets the upstream request
//! (`proxy_close_stream(HttpRequest)`), under a route retry policy
//! `retry_on: reset` + `previous_hosts`. Observed in Envoy 1.40: the reset
//! tears down the *downstream* stream (the client's connection is reset, no
//! answer), the upstream request counts as cancelled, and the router never
//! retries. This test pins that observation; see docs/filter.md.

use std::time::Duration;

use anyhow::Result;
use serde_json::json;
use staleguard_core::ServiceKey;
use staleguard_tests::envoy::{test_plugin, Cluster, Gateway};
use staleguard_tests::fake_validator::{records::pod, FakeValidator};
use staleguard_tests::tinyhttp::named_host;

const CART: &str = "outbound|8080||cart.shop.svc.cluster.local";

#[test]
fn a_reset_from_an_upstream_filter_is_not_retried() -> Result<()> {
    let cart = ServiceKey::new("shop", "cart");
    let gone = named_host("127.0.1.51", "ghost")?;
    let live = named_host("127.0.1.52", "cart-1")?;
    let validator = FakeValidator::start(8)?;
    validator.set_index(
        vec![cart.clone()],
        vec![pod("127.0.1.52", "cart-1", &[&cart], false)],
    );
    let mut cluster = Cluster::new(
        CART,
        gone.addr(),
        Some(test_plugin(json!({"action": "retry"}))),
    );
    cluster.hosts.push(live.addr());
    let gateway = Gateway {
        concurrency: 1,
        validator: validator.addr(),
        retry_on_reset: true,
        clusters: vec![cluster],
        dynamic: vec![],
    };
    let Some(mut envoy) = gateway.start()? else {
        return Ok(());
    };
    envoy.eventually("first sync", Duration::from_secs(20), |e| {
        Ok(e.stat("wasmcustom.staleguard.sync_resets")? >= 1)
    })?;
    // Round robin alternates the hosts: of 6 requests, 3 meet the ghost.
    let mut answered = 0;
    let mut reset = 0;
    for _ in 0..6 {
        match envoy.get(CART) {
            Ok(r) if r.status == 200 && r.header("x-host") == "cart-1" => answered += 1,
            Ok(r) => panic!("unexpected answer {r:?}"),
            Err(_) => reset += 1,
        }
    }
    assert_eq!((answered, reset), (3, 3));
    assert_eq!(gone.hits(), 0, "the ghost was never reached");
    assert_eq!(
        envoy.stat(&format!("cluster.{CART}.upstream_rq_retry"))?,
        0,
        "the router did not retry"
    );
    envoy.eventually("downstream resets counted", Duration::from_secs(5), |e| {
        Ok(e.stat("http.gateway.downstream_rq_tx_reset")? == 3)
    })?;
    Ok(())
}
