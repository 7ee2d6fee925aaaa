//! The filter in real Envoy judges each upstream host against the index the
//! fake validator serves: allow, destroyed, recycled, terminating, unknown,
//! unmapped, a plain-Envoy mapping rule, audit mode, and a delta that changes
//! the verdicts while Envoy runs.

use std::time::Duration;

use anyhow::Result;
use serde_json::json;
use staleguard_core::ServiceKey;
use staleguard_tests::envoy::stats::{prometheus_value, PROM_REQUESTS};
use staleguard_tests::envoy::{native, shipped_plugin, tail, Cluster, Gateway};
use staleguard_tests::fake_validator::{records::pod, FakeValidator};

/// A node IP held by a hostNetwork pod of another service.
fn node_ip(ip: &str) -> staleguard_core::IpRecord {
    let mut r = pod(
        ip,
        "node-exporter",
        &[&ServiceKey::new("monitoring", "node-exporter")],
        false,
    );
    r.pods[0].host_network = true;
    r
}
use staleguard_tests::blocking::named_host;

const CART: &str = "cart.shop.svc.cluster.local";

fn istio(subset: &str) -> String {
    format!("outbound|8080|{subset}|{CART}")
}

/// The knob: `on_reject: reject`, so that every rejection reaches the client
/// as the verdict (the shipped `retry` would replay it to a live member).
#[test]
fn verdicts_in_real_envoy_with_on_reject_reject() -> Result<()> {
    let cart = ServiceKey::new("shop", "cart");
    let pay = ServiceKey::new("shop", "pay");
    let live = named_host("127.0.1.1", "cart-live")?;
    let gone = named_host("127.0.1.2", "ghost")?;
    let recycled = named_host("127.0.1.3", "pay-1")?;
    let draining = named_host("127.0.1.4", "cart-draining")?;
    let external = named_host("127.0.1.5", "external")?;
    let node = named_host("127.0.1.6", "node-agent")?;

    let validator = FakeValidator::start(41)?;
    validator.set_index(
        vec![cart.clone(), pay.clone()],
        vec![
            pod("127.0.1.1", "cart-live", &[&cart], false),
            pod("127.0.1.3", "pay-1", &[&pay], false),
            pod("127.0.1.4", "cart-draining", &[&cart], true),
            node_ip("127.0.1.6"),
        ],
    );

    let guarded = Some(shipped_plugin(json!({"on_reject": "reject"})));
    let node_cluster = istio("node");
    let gateway = Gateway::new(
        validator.addr(),
        vec![
            Cluster::new(&istio("live"), live.addr(), guarded.clone()),
            Cluster::new(&istio("gone"), gone.addr(), guarded.clone()),
            Cluster::new(&istio("recycled"), recycled.addr(), guarded.clone()),
            Cluster::new(&istio("draining"), draining.addr(), guarded.clone()),
            Cluster::new(
                &istio("draining-strict"),
                draining.addr(),
                Some(shipped_plugin(
                    json!({"on_reject": "reject", "policy": {"terminating": "reject"}}),
                )),
            ),
            Cluster::new(
                "outbound|80||ext.other.svc.cluster.local",
                external.addr(),
                guarded.clone(),
            ),
            Cluster::new("plain-unmapped", gone.addr(), guarded.clone()),
            Cluster::new(&node_cluster, node.addr(), guarded.clone()),
            Cluster::new(
                "legacy-cart",
                gone.addr(),
                Some(shipped_plugin(
                    json!({"on_reject": "reject", "clusters": [{"name": "legacy-cart", "service": "shop/cart"}]}),
                )),
            ),
            Cluster::new(
                &istio("audit"),
                gone.addr(),
                Some(shipped_plugin(
                    json!({"on_reject": "reject", "mode": "audit"}),
                )),
            ),
            Cluster::new(
                &istio("custom"),
                gone.addr(),
                Some(shipped_plugin(
                    json!({"on_reject": "reject", "reject_status": 421, "reject_header": "x-sg-verdict"}),
                )),
            ),
        ],
    );
    let mut gateway = gateway;
    let mut meta = Cluster::new("meta-only", gone.addr(), guarded.clone());
    meta.metadata =
        Some(json!({"istio": {"services": [{"host": CART, "name": "cart", "namespace": "shop"}]}}));
    gateway.clusters.push(meta);
    let Some(envoy) = gateway.start()? else {
        return Ok(());
    };
    // The first sync: the allowed host answers once the index is loaded.
    envoy.wait_first_sync()?;

    let ok = |e: &staleguard_tests::envoy::Envoy, cluster: &str, host: &str| -> Result<()> {
        let r = e.get(cluster)?;
        assert_eq!(r.status, 200, "{cluster}: {r:?}\n{}", tail(&e.log(), 40));
        assert_eq!(r.header("x-host"), host, "{cluster}");
        assert_eq!(r.header("x-staleguard"), "", "{cluster}");
        Ok(())
    };
    let rejected =
        |e: &staleguard_tests::envoy::Envoy, cluster: &str, reason: &str| -> Result<()> {
            let r = e.get(cluster)?;
            assert_eq!(r.status, 503, "{cluster}: {r:?}\n{}", tail(&e.log(), 40));
            assert_eq!(r.header("x-staleguard"), reason, "{cluster}");
            assert_eq!(r.header("x-host"), "", "{cluster}: reached the host");
            // Nothing but the reason code leaves Envoy: no pod, namespace or IP.
            for secret in ["127.0.1", "shop", "pay-1", "ghost", "cart"] {
                assert!(
                    !r.body.contains(secret),
                    "{cluster}: body leaks {secret}: {}",
                    r.body
                );
            }
            Ok(())
        };

    ok(&envoy, &istio("live"), "cart-live")?;
    rejected(&envoy, &istio("gone"), "destroyed")?;
    rejected(&envoy, &istio("recycled"), "recycled")?;
    ok(&envoy, &istio("draining"), "cart-draining")?;
    rejected(&envoy, &istio("draining-strict"), "terminating")?;
    ok(
        &envoy,
        "outbound|80||ext.other.svc.cluster.local",
        "external",
    )?;
    ok(&envoy, "plain-unmapped", "ghost")?;
    // A node IP shared by hostNetwork pods of another service: never recycled.
    ok(&envoy, &node_cluster, "node-agent")?;
    rejected(&envoy, "legacy-cart", "destroyed")?;
    if native::selected() {
        // The dynamic-module ABI reads no list of structs from cluster
        // metadata: the native build maps a cluster by its rules and name
        // only (docs/native.md, "Limits"), so this one is unmapped.
        ok(&envoy, "meta-only", "ghost")?;
    } else {
        rejected(&envoy, "meta-only", "destroyed")?;
    }
    ok(&envoy, &istio("audit"), "ghost")?;
    let r = envoy.get(&istio("custom"))?;
    assert_eq!(
        (r.status, r.header("x-sg-verdict")),
        (421, "destroyed"),
        "{r:?}"
    );

    // Every request above is counted once; the counts reach Envoy on the
    // filter's next tick (docs/metrics.md).
    envoy.wait_counted(12)?;
    let stat =
        |e: &staleguard_tests::envoy::Envoy, reason: &str, action: &str| e.requests(reason, action);
    assert_eq!(stat(&envoy, "member", "allow")?, 1);
    // meta-only is judged by the Wasm filter, unmapped by the native one.
    let meta_judged = u64::from(!native::selected());
    assert_eq!(stat(&envoy, "destroyed", "reject")?, 3 + meta_judged);
    assert_eq!(stat(&envoy, "recycled", "reject")?, 1);
    assert_eq!(stat(&envoy, "terminating", "allow")?, 1);
    assert_eq!(stat(&envoy, "terminating", "reject")?, 1);
    assert_eq!(stat(&envoy, "unknown_service", "allow")?, 1);
    assert_eq!(stat(&envoy, "host_network", "allow")?, 1);
    assert_eq!(stat(&envoy, "destroyed", "audit")?, 1);
    assert_eq!(
        envoy.stat("wasmcustom.staleguard_filter_requests_unmapped_total")?,
        2 - meta_judged
    );

    // The stats_tags turn the names into Prometheus labels. The native
    // module's labelled counters carry their labels themselves, in the
    // cluster's scope (docs/native.md, "Metrics"): Envoy's stats_tags do not
    // apply to them.
    if !native::selected() {
        // The stats_tags turn the names into Prometheus labels.
        let prom = envoy.admin("/stats/prometheus")?;
        // Envoy before 1.39 adds the cluster's labels (see stats::root_name).
        for (name, labels) in [
            (
                PROM_REQUESTS,
                &[
                    ("staleguard_service", "shop/cart"),
                    ("staleguard_reason", "member"),
                    ("staleguard_action", "allow"),
                ][..],
            ),
            (
                PROM_REQUESTS,
                &[
                    ("staleguard_service", "shop/cart"),
                    ("staleguard_reason", "destroyed"),
                    ("staleguard_action", "audit"),
                ][..],
            ),
            ("staleguard_filter_requests_unmapped_total", &[][..]),
        ] {
            assert_eq!(
                prometheus_value(&prom, name, labels),
                Some(1),
                "/stats/prometheus: {name}{labels:?} in:\n{}",
                prom.lines()
                    .filter(|l| l.contains("staleguard"))
                    .collect::<Vec<_>>()
                    .join("\n")
            );
        }
        assert_eq!(
            prometheus_value(
                &prom,
                PROM_REQUESTS,
                &[
                    ("staleguard_reason", "destroyed"),
                    ("staleguard_action", "reject")
                ]
            ),
            Some(4),
            "summed over staleguard_service"
        );
    }
    // No host of a rejected request was reached.
    assert_eq!(
        gone.hits(),
        3 - meta_judged,
        "only the unmapped and the audited requests reach the ghost"
    );
    assert_eq!(recycled.hits(), 0);

    // A delta while Envoy runs: the ghost's IP gets a cart pod, the live pod goes.
    validator.upsert(pod("127.0.1.2", "cart-new", &[&cart], false));
    validator.remove("127.0.1.1".parse()?);
    // Two changes, so possibly two deltas: wait until both have landed.
    envoy.eventually("the delta to apply", Duration::from_secs(10), |e| {
        Ok(e.get(&istio("gone"))?.status == 200 && e.get(&istio("live"))?.status == 503)
    })?;
    rejected(&envoy, &istio("live"), "destroyed")?;
    assert!(envoy.stat("wasmcustom.staleguard_filter_sync_deltas_total")? >= 1);
    assert_eq!(
        envoy.stat("wasmcustom.staleguard_filter_sync_resets_total")?,
        1,
        "deltas, not resets"
    );
    assert!(
        validator
            .requests()
            .iter()
            .any(|r| r.starts_with("/v1/changes?v=1&view=verdict&epoch=41&since=")),
        "{:?}",
        validator.requests()
    );
    Ok(())
}
