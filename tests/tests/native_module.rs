//! The native build loads in real Envoy: the module configured as an
//! upstream HTTP filter, Envoy starts and a request reaches the host.

use std::net::SocketAddr;
use std::path::Path;

use anyhow::{ensure, Result};
use serde_json::json;
use staleguard_core::ServiceKey;
use staleguard_tests::blocking::named_host;
use staleguard_tests::envoy::{
    cluster_mut, dependencies, native, shipped_plugin, validate, Cluster, Envoy, Gateway, Launch,
};
use staleguard_tests::fake_validator::{records::pod, FakeValidator};
use staleguard_tests::process::free_port;

#[test]
fn native_module_loads_in_envoy_as_an_upstream_filter() -> Result<()> {
    let (Some((envoy, wasm)), Some(module)) = (dependencies(), native::module()) else {
        return Ok(());
    };
    let host = named_host("127.0.1.1", "cart-live")?;
    let validator: SocketAddr = "127.0.0.1:9".parse()?;
    let gateway = Gateway::new(validator, vec![Cluster::new("cart", host.addr(), None)]);
    let local = |port| SocketAddr::from(([127, 0, 0, 1], port));
    let mut bootstrap = gateway.bootstrap(&wasm, local(free_port()?), local(free_port()?), None);
    let plugin = shipped_plugin(json!({"clusters": [{"name": "cart", "service": "shop/cart"}]}));
    cluster_mut(&mut bootstrap, "cart")?["typed_extension_protocol_options"] =
        native::upstream_filter_options(&plugin);
    let launch = Launch {
        name: "native-load".into(),
        concurrency: 1,
        env: vec![native::search_path(&module)],
        detach: false,
    };
    let running = Envoy::spawn(&envoy, &bootstrap, &launch)?;
    let answer = running.get("cart")?;
    ensure!(
        answer.status == 200 && answer.body == "host=cart-live",
        "through the native filter: {answer:?}\n{}",
        running.log()
    );
    ensure!(
        running.log().contains("Dynamic module ABI version"),
        "Envoy did not report loading the module:\n{}",
        running.log()
    );
    Ok(())
}

/// deploy/native/envoy.yaml, as shipped: Envoy loads the module from the
/// search path and accepts the bootstrap extension and the filter.
#[test]
fn the_plain_envoy_native_example_validates() -> Result<()> {
    let (Some((envoy, _)), Some(module)) = (dependencies(), native::module()) else {
        return Ok(());
    };
    let path = format!("{}/../deploy/native/envoy.yaml", env!("CARGO_MANIFEST_DIR"));
    let (key, dir) = native::search_path(&module);
    let out = validate(&envoy, Path::new(&path), &[(key.as_str(), dir.as_str())])?;
    ensure!(out.contains("Dynamic module ABI version"), "{out}");
    Ok(())
}

/// A module built for another ABI (`STALEGUARD_NATIVE_OTHER_ABI`) does not
/// load, and Envoy refuses the configuration saying why, instead of crashing
/// at the first call.
#[test]
fn a_module_built_for_another_envoy_refuses_to_load() -> Result<()> {
    let Some((envoy, _)) = dependencies() else {
        return Ok(());
    };
    let Ok(other) = std::env::var("STALEGUARD_NATIVE_OTHER_ABI") else {
        eprintln!("SKIP: STALEGUARD_NATIVE_OTHER_ABI (a module of the other ABI) is not set");
        return Ok(());
    };
    let path = format!("{}/../deploy/native/envoy.yaml", env!("CARGO_MANIFEST_DIR"));
    let (key, dir) = native::search_path(Path::new(&other));
    let err = validate(&envoy, Path::new(&path), &[(key.as_str(), dir.as_str())])
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    // A newer module in an older Envoy fails at dlopen on the first callback
    // the Envoy lacks (the module binds every symbol at load); an older one in
    // a newer Envoy loads, and its program init refuses.
    ensure!(
        err.contains("staleguard: this module is built for the Envoy dynamic-module ABI")
            || err.contains("undefined symbol: envoy_dynamic_module_callback_"),
        "Envoy accepted a module of another ABI, or said nothing of why:\n{err}"
    );
    Ok(())
}

/// Istio cluster metadata resolution in the native filter: the module cannot
/// read Istio's `filter_metadata.istio.services[0].host` (a list of structs,
/// and the ABI's metadata getters read only strings, numbers, bools and lists
/// of them: docs/native.md, "Limits"), so the `istio` knob's metadata step
/// finds nothing and a cluster resolves by its `outbound|PORT|SUBSET|FQDN`
/// name, which istiod gives every cluster. A cluster that only its metadata
/// maps is unmapped: passed untouched and counted, never judged.
#[test]
fn istio_cluster_metadata_resolution_in_the_native_filter_falls_back_to_the_cluster_name(
) -> Result<()> {
    let (Some((envoy, wasm)), Some(module)) = (dependencies(), native::module()) else {
        return Ok(());
    };
    let cart = ServiceKey::new("shop", "cart");
    // Not in the index: a destroyed cart pod, to whatever cluster maps it.
    let gone = named_host("127.0.2.81", "ghost")?;
    let validator = FakeValidator::start(81)?;
    validator.set_index(
        vec![cart.clone()],
        vec![pod("127.0.2.82", "cart-0", &[&cart], false)],
    );
    // Istio's metadata as istiod writes it for shop/cart's clusters.
    let istio = json!({"istio": {"services": [
        {"host": "cart.shop.svc.cluster.local", "name": "cart", "namespace": "shop"}
    ]}});
    let named = "outbound|8080||cart.shop.svc.cluster.local";
    let clusters: Vec<Cluster> = [named, "meta-only"]
        .into_iter()
        .map(|name| {
            let mut c = Cluster::new(name, gone.addr(), None);
            c.metadata = Some(istio.clone());
            c
        })
        .collect();
    let gateway = Gateway::new(validator.addr(), clusters);
    let local = |port| SocketAddr::from(([127, 0, 0, 1], port));
    let mut bootstrap = gateway.bootstrap(&wasm, local(free_port()?), local(free_port()?), None);
    let plugin = shipped_plugin(json!({"on_reject": "reject", "istio": true}));
    for name in [named, "meta-only"] {
        cluster_mut(&mut bootstrap, name)?["typed_extension_protocol_options"] =
            native::upstream_filter_options(&plugin);
    }
    // The poller, as deploy/native ships it: its counters reach Envoy on
    // 1.38 too (a filter config's wait for a request there).
    bootstrap["bootstrap_extensions"] = json!([native::bootstrap_extension(&plugin)]);
    let launch = Launch {
        name: "native-istio-metadata".into(),
        concurrency: 1,
        env: vec![native::search_path(&module)],
        detach: false,
    };
    let running = Envoy::spawn(&envoy, &bootstrap, &launch)?;
    running.wait_first_sync()?;
    let by_name = running.get(named)?;
    ensure!(
        (by_name.status, by_name.header("x-staleguard")) == (503, "destroyed"),
        "the Istio cluster resolves by its name: {by_name:?}\n{}",
        running.log()
    );
    let by_metadata = running.get("meta-only")?;
    ensure!(
        (by_metadata.status, by_metadata.body.as_str()) == (200, "host=ghost"),
        "a cluster only its metadata maps is not judged: {by_metadata:?}"
    );
    running.wait_counted(2)?;
    assert_eq!(running.requests("destroyed", "reject")?, 1);
    assert_eq!(
        running.stat("wasmcustom.staleguard_filter_requests_unmapped_total")?,
        1
    );
    Ok(())
}
