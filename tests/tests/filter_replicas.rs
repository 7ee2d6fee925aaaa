//! Validator replicas behind one Service: each has its own epoch, so a poll
//! that lands on the other replica is answered with a reset. The filter keeps
//! judging correctly through the switches, and one replica going down does
//! not make the data stale while the other answers.

use std::time::Duration;

use anyhow::Result;
use serde_json::json;
use staleguard_core::ServiceKey;
use staleguard_tests::blocking::named_host;
use staleguard_tests::envoy::{shipped_plugin, Cluster, Envoy, Gateway};
use staleguard_tests::fake_validator::{records::pod, Behaviour, FakeValidator};

const LIVE: &str = "outbound|8080|live|cart.shop.svc.cluster.local";
const GONE: &str = "outbound|8080|gone|cart.shop.svc.cluster.local";

#[test]
fn replicas_with_different_epochs_and_one_down() -> Result<()> {
    let cart = ServiceKey::new("shop", "cart");
    let live = named_host("127.0.1.61", "cart-1")?;
    let gone = named_host("127.0.1.62", "ghost")?;
    let a = FakeValidator::start(100)?;
    let b = FakeValidator::start(200)?;
    for v in [&a, &b] {
        v.set_index(
            vec![cart.clone()],
            vec![pod("127.0.1.61", "cart-1", &[&cart], false)],
        );
    }
    // Fail closed, so any stale moment would show as a rejected live host.
    let plugin = Some(shipped_plugin(
        json!({"policy": {"failure_policy": "closed"}}),
    ));
    let gateway = Gateway {
        validators: vec![a.addr(), b.addr()],
        ..Gateway::new(
            a.addr(),
            vec![
                Cluster::new(LIVE, live.addr(), plugin.clone()),
                Cluster::new(GONE, gone.addr(), plugin.clone()),
            ],
        )
    };
    let Some(envoy) = gateway.start()? else {
        return Ok(());
    };
    // Both replicas get polled; every switch is a reset.
    envoy.eventually("both replicas polled", Duration::from_secs(20), |_| {
        Ok(a.requests().len() >= 2 && b.requests().len() >= 2)
    })?;
    let resets = envoy.stat("wasmcustom.staleguard_filter_sync_resets_total")?;
    assert!(resets >= 2);
    // Judged right at every check until two more switches (resets) happened.
    envoy.eventually("two more replica switches", Duration::from_secs(30), |e| {
        assert_eq!(e.get(LIVE)?.status, 200);
        let r = e.get(GONE)?;
        assert_eq!((r.status, r.header("x-staleguard")), (503, "destroyed"));
        Ok(e.stat("wasmcustom.staleguard_filter_sync_resets_total")? >= resets + 2)
    })?;

    // Replica b goes down: its polls fail, a's keep the data fresh and
    // deliver a's changes (a long poll to a holds until one comes).
    b.set_behaviour(Behaviour::Down);
    let sync_errors = |e: &Envoy| -> Result<u64> {
        Ok(
            e.stat("wasmcustom.staleguard_filter_sync_errors_total.kind.status")?
                + e.stat("wasmcustom.staleguard_filter_sync_errors_total.kind.transport")?,
        )
    };
    let errors = sync_errors(&envoy)?;
    let polled_a = a.requests().len();
    // Fresh at every check until a poll to b has failed and a has had a
    // poll since b went down.
    envoy.eventually("b failing, a answering", Duration::from_secs(30), |e| {
        assert_eq!(e.get(LIVE)?.status, 200, "stale with a healthy replica");
        Ok(sync_errors(e)? > errors && a.requests().len() > polled_a)
    })?;
    a.upsert(pod("127.0.1.62", "cart-2", &[&cart], false));
    envoy.eventually("a's change while b is down", Duration::from_secs(20), |e| {
        Ok(e.get(GONE)?.status == 200)
    })?;
    assert_eq!(envoy.get(LIVE)?.status, 200);
    assert!(sync_errors(&envoy)? > errors);
    Ok(())
}
