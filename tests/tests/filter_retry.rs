//! `on_reject: retry` in real Envoy: a rejected request without a body is
//! replayed through the guarded cluster's twin to a live member the index
//! names, and the client gets the live host's answer; nothing ever reaches a
//! stale host (the servers count what they get).

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Result;
use serde_json::{json, Value};
use staleguard_core::ServiceKey;
use staleguard_tests::envoy::{tail, test_plugin, Cluster, Envoy, Gateway};
use staleguard_tests::fake_validator::{records::pod, FakeValidator};
use staleguard_tests::tinyhttp::{Answer, Response, Server};

const CART: &str = "cart.shop.svc.cluster.local";

fn istio(subset: &str) -> String {
    format!("outbound|8080|{subset}|{CART}")
}

fn cart() -> ServiceKey {
    ServiceKey::new("shop", "cart")
}

fn pay() -> ServiceKey {
    ServiceKey::new("shop", "pay")
}

/// A pod's server: answers 203 with its name in a header and the body, two
/// cookies, and the path it got; `delay` before answering.
fn host(ip: &str, name: &str, delay: Duration) -> Result<Server> {
    let name = name.to_owned();
    let bind: SocketAddr = format!("{ip}:0").parse()?;
    Server::start(bind, move |req| {
        std::thread::sleep(delay);
        Answer::Respond {
            status: 203,
            headers: vec![
                ("x-host".into(), name.clone()),
                ("content-type".into(), "text/x-pod".into()),
                ("set-cookie".into(), "a=1".into()),
                ("set-cookie".into(), "b=2".into()),
            ],
            body: format!("host={name} {} {}", req.method, req.target).into_bytes(),
        }
    })
}

fn retry_plugin(retry: Value) -> Value {
    test_plugin(json!({ "retry": retry }))
}

/// Every host of `servers` on the same port as `port_of` (the twin names
/// members on the stale pick's port, as an EDS cluster of pods has them).
fn same_port(ips: &[&str], name: &str) -> Result<Vec<Server>> {
    let first = host(ips[0], &format!("{name}-0"), Duration::ZERO)?;
    let port = first.addr().port();
    let mut out = vec![first];
    for (i, ip) in ips.iter().enumerate().skip(1) {
        let bind: SocketAddr = format!("{ip}:{port}").parse()?;
        let name = format!("{name}-{i}");
        out.push(Server::start(bind, move |req| Answer::Respond {
            status: 203,
            headers: vec![
                ("x-host".into(), name.clone()),
                ("content-type".into(), "text/x-pod".into()),
                ("set-cookie".into(), "a=1".into()),
                ("set-cookie".into(), "b=2".into()),
            ],
            body: format!("host={name} {} {}", req.method, req.target).into_bytes(),
        })?);
    }
    Ok(out)
}

fn assert_live(r: &Response, e: &Envoy, live: &[&str], method: &str, target: &str) {
    assert_eq!(r.status, 203, "{r:?}\n{}", tail(&e.log(), 40));
    let name = r.header("x-host");
    assert!(
        live.contains(&name),
        "answered by {name:?}, not a live host: {r:?}"
    );
    assert_eq!(r.header("content-type"), "text/x-pod", "{r:?}");
    assert_eq!(r.header("x-staleguard"), "", "the reason leaked: {r:?}");
    assert_eq!(r.header("x-staleguard-twin-miss"), "", "{r:?}");
    assert!(
        !r.headers.keys().any(|k| k.contains("twin")),
        "the twin leaked: {r:?}"
    );
    if method != "HEAD" {
        assert_eq!(r.body, format!("host={name} {method} {target}"), "{r:?}");
    }
}

#[test]
fn rejected_requests_are_replayed_to_live_members() -> Result<()> {
    // Hosts on one port: 127.0.3.1 is gone (no pod holds it), .2 and .3 are
    // live cart pods, .4 holds a pay pod (recycled for cart).
    let servers = same_port(&["127.0.3.1", "127.0.3.2", "127.0.3.3", "127.0.3.4"], "h")?;
    let [gone, live_a, live_b, recycled] = &servers[..] else {
        unreachable!()
    };
    let validator = FakeValidator::start(51)?;
    validator.set_index(
        vec![cart(), pay()],
        vec![
            pod("127.0.3.2", "cart-a", &[&cart()], false),
            pod("127.0.3.3", "cart-b", &[&cart()], false),
            pod("127.0.3.4", "pay-1", &[&pay()], false),
        ],
    );
    let mixed = |name: &str, plugin: Value| Cluster {
        name: istio(name),
        hosts: vec![gone.addr(), live_a.addr(), live_b.addr(), recycled.addr()],
        plugin: Some(plugin),
        metadata: None,
    };
    let gateway = Gateway {
        concurrency: 1,
        validator: validator.addr(),
        replicas: vec![],
        dynamic: vec![],
        clusters: vec![mixed("retry", retry_plugin(json!({})))],
    };
    let Some(mut envoy) = gateway.start()? else {
        return Ok(());
    };
    envoy.eventually("the first sync", Duration::from_secs(20), |e| {
        Ok(e.stat("wasmcustom.staleguard.sync_resets")? >= 1)
    })?;
    let live = ["h-1", "h-2"];
    for i in 0..40 {
        let target = format!("/x/{i}?q=1");
        let r = envoy.send(&istio("retry"), "GET", &target, None)?;
        assert_live(&r, &envoy, &live, "GET", &target);
    }
    assert_eq!(
        gone.hits() + recycled.hits(),
        0,
        "a stale host got a request"
    );
    let answered = envoy.stat("wasmcustom.staleguard.retries_total.outcome.answered")?;
    assert!(
        answered >= 10,
        "half the picks are stale, {answered} replayed"
    );
    assert_eq!(
        answered,
        envoy.stat("wasmcustom.staleguard.requests.reason.destroyed.action.retry")?
            + envoy.stat("wasmcustom.staleguard.requests.reason.recycled.action.retry")?
    );
    assert_eq!(live_a.hits() + live_b.hits(), 40);
    Ok(())
}
