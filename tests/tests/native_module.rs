//! The native build loads in real Envoy: the module configured as an
//! upstream HTTP filter, Envoy starts and a request reaches the host.

use std::net::SocketAddr;

use anyhow::{ensure, Result};
use serde_json::json;
use staleguard_tests::blocking::named_host;
use staleguard_tests::envoy::{
    cluster_mut, dependencies, native, shipped_plugin, Cluster, Envoy, Gateway, Launch,
};
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
