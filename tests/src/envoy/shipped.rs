//! What `deploy/envoy/envoy.yaml` ships, read from the file itself: the plugin
//! configuration and the route's retry policy. Tests, the demo and benchmarks
//! run these, so what they check is what users deploy.

use std::sync::OnceLock;

use serde_json::Value;

use super::bootstrap::merge_into;

const PATH: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/envoy/envoy.yaml");

/// `deploy/envoy/envoy.yaml`, or an empty text (the callers then say what
/// they did not find in it). Read once per process: every guarded cluster
/// of every gateway takes its filter entries from it.
fn shipped_envoy_yaml() -> &'static str {
    static YAML: OnceLock<String> = OnceLock::new();
    YAML.get_or_init(|| std::fs::read_to_string(PATH).unwrap_or_default())
}

/// `deploy/envoy/envoy.yaml` parsed, once per process.
fn shipped_envoy_doc() -> &'static Value {
    static DOC: OnceLock<Value> = OnceLock::new();
    DOC.get_or_init(|| {
        yaml_serde::from_str(shipped_envoy_yaml())
            .unwrap_or_else(|e| panic!("{PATH} is not YAML: {e}"))
    })
}

/// The JSON blocks under `value: |` in a YAML file: the plugin
/// configurations of a shipped manifest.
pub fn plugin_configs_in(yaml: &str) -> Vec<String> {
    let lines: Vec<&str> = yaml.lines().collect();
    let mut out = vec![];
    for (i, line) in lines.iter().enumerate() {
        if line.trim_end().ends_with("value: |") {
            let indent = line.len() - line.trim_start().len();
            let block: Vec<&str> = lines[i + 1..]
                .iter()
                .take_while(|l| l.trim().is_empty() || l.len() - l.trim_start().len() > indent)
                .copied()
                .collect();
            out.push(block.join("\n"));
        }
    }
    out
}

/// Keys of the shipped plugin configuration that describe one gateway's
/// topology (which cluster is which service, the validator's DNS name), not
/// how the filter behaves: a test gateway brings its own.
const TOPOLOGY_KEYS: [&str; 3] = ["clusters", "istio", "validator_authority"];

/// The plugin configuration `deploy/envoy/envoy.yaml` ships, read from that
/// file, without its topology keys. What tests, the demo and benchmarks run.
pub fn shipped_plugin_config() -> Value {
    let mut config = plugin_configs_in(shipped_envoy_yaml())
        .first()
        .and_then(|c| serde_json::from_str::<Value>(c).ok())
        .unwrap_or_else(|| panic!("no plugin configuration (`value: |` JSON) in {PATH}"));
    if let Some(object) = config.as_object_mut() {
        for key in TOPOLOGY_KEYS {
            object.remove(key);
        }
    }
    config
}

/// The `retry_policy` of the route `deploy/envoy/envoy.yaml` ships for
/// requests without a body (the last route of the gateway's virtual host):
/// what a gateway that stands for the shipped one sets on its routes.
pub fn shipped_route_retry_policy() -> Value {
    let routes = &shipped_envoy_doc()["static_resources"]["listeners"][0]["filter_chains"][0]
        ["filters"][0]["typed_config"]["route_config"]["virtual_hosts"][0]["routes"];
    routes
        .as_array()
        .and_then(|r| r.last())
        .map(|r| r["route"]["retry_policy"].clone())
        .filter(|p| p.is_object())
        .unwrap_or_else(|| panic!("no retry_policy on the last route of {PATH}"))
}

/// The shipped plugin configuration ([`shipped_plugin_config`]) with `extra`
/// fields on top: topology (`clusters`, `istio`), a `token`, or the knob a
/// test is about. A test that turns a knob names it in its title.
pub fn shipped_plugin(extra: Value) -> Value {
    let mut base = shipped_plugin_config();
    merge_into(&mut base, &extra);
    base
}

/// The guarded cluster `deploy/envoy/envoy.yaml` ships (`shop-cart`), or
/// with `twin` its retry twin (`shop-cart|staleguard-twin`).
fn shipped_cluster(twin: bool) -> Value {
    let name = if twin {
        "shop-cart|staleguard-twin"
    } else {
        "shop-cart"
    };
    shipped_envoy_doc()["static_resources"]["clusters"]
        .as_array()
        .and_then(|clusters| clusters.iter().find(|c| c["name"] == name))
        .cloned()
        .unwrap_or_else(|| panic!("no cluster {name} in {PATH}"))
}

/// The `typed_extension_protocol_options` of the guarded cluster, or with
/// `twin` of its twin, as `deploy/envoy/envoy.yaml` ships them: the
/// upstream filter chain (the Wasm filter with its failure policy and VM,
/// then the codec) that every test gateway runs, with its own module and
/// plugin configuration set in.
pub fn shipped_upstream_options(twin: bool) -> Value {
    let options = shipped_cluster(twin)["typed_extension_protocol_options"].clone();
    assert!(
        options.is_object(),
        "the shipped cluster has no upstream filters"
    );
    options
}

/// The `circuit_breakers` of the shipped guarded cluster (`Null` when it
/// sets none): every guarded test cluster gets them.
pub fn shipped_circuit_breakers() -> Value {
    shipped_cluster(false)["circuit_breakers"].clone()
}

/// The `load_balancing_policy` of the shipped retry twin: the override-host
/// balancer reading the members the filter names, round robin as its
/// fallback.
pub fn shipped_twin_lb_policy() -> Value {
    let policy = shipped_cluster(true)["load_balancing_policy"].clone();
    assert!(
        policy.is_object(),
        "the shipped twin has no load_balancing_policy"
    );
    policy
}

/// `deploy/envoy/envoy.yaml` itself, made to run on loopback: only addresses
/// and paths change. The gateway listens on `listener`, its admin on
/// `admin`; the guarded cluster `shop-cart` and its twin have the static
/// endpoints `cart` (instead of DNS; one port for all, which the steering
/// role then names); the validator is `validator`, reached over plain HTTP;
/// every Wasm filter runs the module `wasm`. Routes, retry policies, circuit
/// breakers and the plugin configuration are the shipped ones.
pub fn shipped_gateway(
    wasm: &std::path::Path,
    listener: std::net::SocketAddr,
    admin: std::net::SocketAddr,
    validator: std::net::SocketAddr,
    cart: &[std::net::SocketAddr],
) -> Value {
    gateway_on_loopback(shipped_envoy_doc(), wasm, listener, admin, validator, cart)
}

/// What [`shipped_gateway`] does, to another version of
/// `deploy/envoy/envoy.yaml` (`doc`, parsed): a benchmark against the file an
/// earlier commit shipped.
pub fn gateway_on_loopback(
    doc: &Value,
    wasm: &std::path::Path,
    listener: std::net::SocketAddr,
    admin: std::net::SocketAddr,
    validator: std::net::SocketAddr,
    cart: &[std::net::SocketAddr],
) -> Value {
    use super::bootstrap::{static_cluster, wasm_configs_mut};
    let mut doc = doc.clone();
    doc["admin"]["address"]["socket_address"] =
        serde_json::json!({"address": "127.0.0.1", "port_value": admin.port()});
    doc["static_resources"]["listeners"][0]["address"]["socket_address"] = serde_json::json!(
        {"address": listener.ip().to_string(), "port_value": listener.port()}
    );
    if let Some(clusters) = doc["static_resources"]["clusters"].as_array_mut() {
        for c in clusters {
            for config in wasm_configs_mut(&mut c["typed_extension_protocol_options"], wasm) {
                // The steering role names members on the pods' port.
                let value = config["configuration"]["value"]
                    .as_str()
                    .unwrap_or_default();
                if let Ok(mut plugin) = serde_json::from_str::<Value>(value) {
                    if let (Some(steer), Some(first)) = (plugin.get_mut("steer"), cart.first()) {
                        steer["port"] = serde_json::json!(first.port());
                        config["configuration"]["value"] = serde_json::json!(plugin.to_string());
                    }
                }
            }
            let name = c["name"].as_str().unwrap_or_default().to_owned();
            let hosts = match name.as_str() {
                "shop-cart" | "shop-cart|staleguard-twin" => cart,
                "staleguard-validator" => std::slice::from_ref(&validator),
                _ => continue,
            };
            let fixed = static_cluster(&name, hosts);
            c["type"] = fixed["type"].clone();
            c["load_assignment"] = fixed["load_assignment"].clone();
            if name == "staleguard-validator" {
                // The fake validator speaks plain HTTP (the shipped TLS to
                // it has a test of its own: `shipped_validator_tls`).
                if let Some(o) = c.as_object_mut() {
                    o.remove("transport_socket");
                }
            }
        }
    }
    doc
}

/// The `transport_socket` of the validator cluster `deploy/envoy/envoy.yaml`
/// ships (TLS verifying the validator's name), with its `trusted_ca` file
/// replaced by `ca_file` (a test CA's certificate).
pub fn shipped_validator_tls(ca_file: &std::path::Path) -> Value {
    let mut socket = shipped_envoy_doc()["static_resources"]["clusters"]
        .as_array()
        .and_then(|clusters| {
            clusters
                .iter()
                .find(|c| c["name"] == "staleguard-validator")
        })
        .map(|c| c["transport_socket"].clone())
        .filter(|s| !s.is_null())
        .unwrap_or_else(|| panic!("no transport_socket on staleguard-validator in {PATH}"));
    socket["typed_config"]["common_tls_context"]["validation_context"]["trusted_ca"] =
        serde_json::json!({"filename": ca_file});
    socket
}

/// The `stats_config.stats_tags` of `deploy/envoy/envoy.yaml`: the tags that
/// make the filter's metric names Prometheus labels, on every Envoy version.
pub fn shipped_stats_tags() -> Value {
    let tags = shipped_envoy_doc()["stats_config"]["stats_tags"].clone();
    assert!(tags.is_array(), "no stats_config.stats_tags in {PATH}");
    tags
}

/// The `memory_allocator_manager` of `deploy/envoy/envoy.yaml`: Envoy gives
/// the pages its allocator freed back to the system. Every test gateway runs
/// it, since what the gateway holds (benchmarks.md, "The index in the
/// gateway's memory") depends on it.
pub fn shipped_memory_allocator_manager() -> Value {
    let manager = shipped_envoy_doc()["memory_allocator_manager"].clone();
    assert!(manager.is_object(), "no memory_allocator_manager in {PATH}");
    manager
}
