//! What is outside this cluster's index, in real Envoy: an upstream IP outside
//! the plugin's `pod_cidrs` (another cluster's pod) is passed and counted as
//! out of scope, and an Envoy internal address (Istio ambient's HBONE
//! endpoint, `envoy://connect_originate/<IP:port>`) is judged by the IP of
//! its `endpoint_id` (docs/index.md, "Multi-cluster and ambient").
//!
//! Knobs: `pod_cidrs` (the subject), `on_reject: reject` (a rejection is
//! answered, not replayed: no twin to wire to the internal listener).

use anyhow::{Context, Result};
use serde_json::{json, Value};
use staleguard_core::ServiceKey;
use staleguard_tests::blocking::named_host;
use staleguard_tests::envoy::stats::STAT_REQUESTS_PREFIX;
use staleguard_tests::envoy::{
    cluster_mut, shipped_plugin, static_cluster, Cluster, Gateway, WAIT,
};
use staleguard_tests::fake_validator::{records::pod, FakeValidator};

const OUT_OF_SCOPE: &str = "wasmcustom.staleguard_filter_requests_out_of_scope_total";

fn istio(name: &str) -> String {
    format!("outbound|8080|{name}|cart.shop.svc.cluster.local")
}

/// `cluster`'s endpoints become internal addresses of the listener
/// `connect_originate`, one per `endpoint_id`.
fn hbone_endpoints(bootstrap: &mut Value, cluster: &str, endpoint_ids: &[String]) -> Result<()> {
    let endpoints: Vec<Value> = endpoint_ids
        .iter()
        .map(|id| {
            json!({"endpoint": {"address": {"envoy_internal_address": {
                "server_listener_name": "connect_originate", "endpoint_id": id}}}})
        })
        .collect();
    cluster_mut(bootstrap, cluster)?["load_assignment"]["endpoints"] =
        json!([{"lb_endpoints": endpoints}]);
    Ok(())
}

#[test]
fn pod_cidrs_put_other_ips_out_of_scope_and_hbone_endpoints_are_judged_with_on_reject_reject(
) -> Result<()> {
    let cart = ServiceKey::new("shop", "cart");
    let live = named_host("127.0.8.1", "cart-a")?;
    // Another cluster's pod: outside this cluster's pod network.
    let remote = named_host("127.0.9.1", "cart-remote")?;
    // What the waypoint's HBONE tunnel reaches, behind the internal listener.
    let tunnelled = named_host("127.0.8.2", "cart-b")?;

    let validator = FakeValidator::start(81)?;
    validator.set_index(
        vec![cart.clone()],
        vec![
            pod("127.0.8.1", "cart-a", &[&cart], false),
            pod("127.0.8.2", "cart-b", &[&cart], false),
        ],
    );
    let plugin = Some(shipped_plugin(
        json!({"on_reject": "reject", "pod_cidrs": ["127.0.8.0/24"]}),
    ));
    let gateway = Gateway::new(
        validator.addr(),
        vec![
            Cluster::new(&istio("live"), live.addr(), plugin.clone()),
            Cluster::new(&istio("remote"), remote.addr(), plugin.clone()),
            Cluster::new(&istio("hbone"), tunnelled.addr(), plugin.clone()),
            Cluster::new(&istio("hbone-gone"), tunnelled.addr(), plugin.clone()),
        ],
    );
    let port = tunnelled.addr().port();
    let started = gateway.start_with(|bootstrap| {
        bootstrap["bootstrap_extensions"] = json!([{
            "name": "envoy.bootstrap.internal_listener",
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.bootstrap.internal_listener.v3.InternalListener"}
        }]);
        // The tunnel's far end: every connection to the internal listener
        // goes to the tunnelled pod.
        bootstrap["static_resources"]["listeners"]
            .as_array_mut()
            .context("listeners")?
            .push(json!({
                "name": "connect_originate",
                "internal_listener": {},
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.tcp_proxy",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
                        "stat_prefix": "hbone",
                        "cluster": "hbone-far-end"
                    }
                }]}]
            }));
        bootstrap["static_resources"]["clusters"]
            .as_array_mut()
            .context("clusters")?
            .push(static_cluster("hbone-far-end", &[tunnelled.addr()]));
        hbone_endpoints(bootstrap, &istio("hbone"), &[format!("127.0.8.2:{port}")])?;
        // A destroyed pod's IP in the endpoint_id: judged, and rejected.
        hbone_endpoints(bootstrap, &istio("hbone-gone"), &[format!("127.0.8.9:{port}")])?;
        Ok(())
    })?;
    let Some(envoy) = started else {
        return Ok(());
    };
    envoy.wait_first_sync()?;

    let r = envoy.get(&istio("live"))?;
    assert_eq!((r.status, r.header("x-host")), (200, "cart-a"), "{r:?}");
    // Outside pod_cidrs: not judged (without them: destroyed, see the unit
    // tests in engine/src/judgement.rs), reached, counted.
    let r = envoy.get(&istio("remote"))?;
    assert_eq!(
        (r.status, r.header("x-host")),
        (200, "cart-remote"),
        "{r:?}"
    );
    // HBONE: the endpoint_id's IP is a live member.
    let r = envoy.get(&istio("hbone"))?;
    assert_eq!((r.status, r.header("x-host")), (200, "cart-b"), "{r:?}");
    let before = tunnelled.hits();
    let r = envoy.get(&istio("hbone-gone"))?;
    assert_eq!(
        (r.status, r.header("x-staleguard")),
        (503, "destroyed"),
        "{r:?}"
    );
    assert_eq!(tunnelled.hits(), before, "the rejected request never left");

    envoy.wait_stats("out of scope and judged requests counted", WAIT, |s| {
        s.get(OUT_OF_SCOPE) == Some(&1)
            && staleguard_tests::envoy::stats::requests_total(s, "member", "allow") == 2
            && staleguard_tests::envoy::stats::requests_total(s, "destroyed", "reject") == 1
    })?;
    let stats = envoy.stats()?;
    assert!(
        !stats
            .keys()
            .any(|k| k.starts_with(STAT_REQUESTS_PREFIX) && k.contains("no_address")),
        "{stats:?}"
    );
    assert_eq!(
        stats
            .get("wasmcustom.staleguard_filter_requests_no_address_total")
            .copied()
            .unwrap_or(0),
        0
    );
    Ok(())
}
