//! The native build (`native/`, an Envoy dynamic module) in real Envoy: where
//! the module is, how Envoy finds it, and the upstream filter chain that runs
//! it in place of the Wasm filter.
//!
//! Envoy loads a dynamic module by name, `lib<name>.so`, from the directory
//! in `ENVOY_DYNAMIC_MODULES_SEARCH_PATH` ([`search_path`]); the module is
//! built for one Envoy's ABI (`scripts/setup.sh`'s `sg_build_native` builds
//! the one for `STALEGUARD_ENVOY_VERSION`).

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::process::require;

/// The module's name in Envoy's `dynamic_module_config`: the file is
/// `libstaleguard_native.so`.
pub const MODULE_NAME: &str = "staleguard_native";

/// The filter's name in the module (its `filter_name`).
pub const FILTER_NAME: &str = "staleguard";

/// The built module, or `None` (after a SKIP line) outside CI when it is
/// missing.
pub fn module() -> Option<PathBuf> {
    require(
        "STALEGUARD_NATIVE",
        "the staleguard native module",
        "run `. scripts/setup.sh && sg_build_native` (builds it for STALEGUARD_ENVOY_VERSION)",
    )
}

/// The environment variable that lets Envoy find `module`.
pub fn search_path(module: &Path) -> (String, String) {
    let dir = module.parent().unwrap_or(Path::new("."));
    (
        "ENVOY_DYNAMIC_MODULES_SEARCH_PATH".to_owned(),
        dir.display().to_string(),
    )
}

/// The upstream HTTP filter entry that runs the module with `plugin` (the
/// same configuration document as the Wasm filter's).
pub fn upstream_filter(plugin: &Value) -> Value {
    json!({
        "name": "envoy.filters.http.dynamic_modules",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter",
            "dynamic_module_config": {"name": MODULE_NAME},
            "filter_name": FILTER_NAME,
            "filter_config": {
                "@type": "type.googleapis.com/google.protobuf.StringValue",
                "value": plugin.to_string(),
            },
        },
    })
}

/// The bootstrap extension that runs the module's poller with `plugin` and
/// holds Envoy's start until the first sync (docs/native.md, "The poller").
pub fn bootstrap_extension(plugin: &Value) -> Value {
    json!({
        "name": "envoy.bootstrap.dynamic_modules",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.bootstrap.dynamic_modules.v3.DynamicModuleBootstrapExtension",
            "dynamic_module_config": {"name": MODULE_NAME},
            "extension_name": FILTER_NAME,
            "extension_config": {
                "@type": "type.googleapis.com/google.protobuf.StringValue",
                "value": plugin.to_string(),
            },
        },
    })
}

/// A cluster's `typed_extension_protocol_options` that run the module as an
/// upstream filter with `plugin`, then the codec.
pub fn upstream_filter_options(plugin: &Value) -> Value {
    json!({
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http_protocol_options": {}},
            "http_filters": [
                upstream_filter(plugin),
                {
                    "name": "envoy.filters.http.upstream_codec",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.http.upstream_codec.v3.UpstreamCodec"
                    },
                },
            ],
        }
    })
}

/// The environment variable that picks the build every real-Envoy test
/// runs: `STALEGUARD_BUILD=native` runs the native module where a test
/// configures the Wasm filter (`.ci/run` runs the filter tests both ways).
pub const BUILD_VAR: &str = "STALEGUARD_BUILD";

/// True when the tests run the native build.
pub fn selected() -> bool {
    std::env::var(BUILD_VAR).is_ok_and(|b| b == "native")
}

/// Makes `bootstrap` run the native module wherever it runs the Wasm filter:
/// each upstream Wasm filter, in a cluster's chain (static clusters) or in a
/// router's `upstream_http_filters` (every listener's, the Istio attachment
/// and the body path's internal listener among them), becomes the module's
/// filter with the same plugin configuration ([`swap_filters`]). It adds the
/// poller's bootstrap extension (with the first guard's configuration) and
/// what Envoy needs to find the module to `env`. One harness, the build as a
/// parameter: [`super::Envoy::spawn`] calls this for every gateway when
/// [`selected`].
pub fn swap_in(bootstrap: &mut Value, env: &mut Vec<(String, String)>) -> anyhow::Result<()> {
    let module =
        module().ok_or_else(|| anyhow::anyhow!("{BUILD_VAR}=native needs STALEGUARD_NATIVE"))?;
    let plugins = swap_filters(&mut bootstrap["static_resources"]);
    // A twin's or a body path hop's configuration runs no poller: the
    // extension takes a guard's.
    if let Some(plugin) = plugins.iter().find(|p| is_guard(p)) {
        let extensions = &mut bootstrap["bootstrap_extensions"];
        if !extensions.is_array() {
            *extensions = json!([]);
        }
        if let Some(list) = extensions.as_array_mut() {
            list.push(bootstrap_extension(plugin));
        }
    }
    env.push(search_path(&module));
    Ok(())
}

/// Makes `cluster` (a cluster's JSON, static or served by CDS) run the native
/// module wherever it runs the Wasm filter; the plugin configuration of the
/// first filter swapped, if any.
pub fn swap_cluster(cluster: &mut Value) -> Option<Value> {
    swap_filters(cluster).into_iter().next()
}

/// Replaces every upstream Wasm filter under `value` (a cluster's
/// `HttpProtocolOptions.http_filters`, a router's `upstream_http_filters`)
/// with the module's filter, same plugin configuration; returns the
/// configurations swapped, in document order. A downstream filter chain (an
/// HTTP connection manager's `http_filters`) is left as it is.
pub fn swap_filters(value: &mut Value) -> Vec<Value> {
    let mut swapped = Vec::new();
    walk(value, false, &mut swapped);
    swapped
}

/// [`swap_filters`]' walk; `upstream` is true inside a cluster's protocol
/// options, where `http_filters` is an upstream chain.
fn walk(value: &mut Value, upstream: bool, swapped: &mut Vec<Value>) {
    match value {
        Value::Array(items) => {
            for item in items {
                walk(item, upstream, swapped);
            }
        }
        Value::Object(fields) => {
            for (key, field) in fields.iter_mut() {
                let chain = key == "upstream_http_filters" || (upstream && key == "http_filters");
                if let (true, Some(filters)) = (chain, field.as_array_mut()) {
                    for filter in filters {
                        swap_filter(filter, swapped);
                    }
                } else {
                    let upstream = upstream || key == "typed_extension_protocol_options";
                    walk(field, upstream, swapped);
                }
            }
        }
        _ => {}
    }
}

/// Replaces one upstream filter entry by the module's if it is the Wasm
/// filter, keeping its plugin configuration.
fn swap_filter(filter: &mut Value, swapped: &mut Vec<Value>) {
    if filter["name"] != "envoy.filters.http.wasm" {
        return;
    }
    let plugin = filter["typed_config"]["config"]["configuration"]["value"]
        .as_str()
        .and_then(|text| serde_json::from_str::<Value>(text).ok())
        .unwrap_or(Value::Null);
    *filter = upstream_filter(&plugin);
    swapped.push(plugin);
}

/// True for a guard's plugin configuration: not a replay twin's nor a body
/// path hop's (`replay_twin`, `steer`), which poll nothing.
fn is_guard(plugin: &Value) -> bool {
    plugin.is_object() && plugin.get("replay_twin").is_none() && plugin.get("steer").is_none()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Wasm filter's entry with the plugin configuration `plugin`.
    fn wasm(plugin: &Value) -> Value {
        json!({
            "name": "envoy.filters.http.wasm",
            "typed_config": {"config": {"configuration": {"value": plugin.to_string()}}},
        })
    }

    #[test]
    fn every_upstream_wasm_filter_is_swapped_and_the_downstream_chain_is_not() {
        let guard = json!({"validator_cluster": "v"});
        let steer = json!({"steer": {"service": "shop/cart"}});
        let twin = json!({"replay_twin": {"endpoint_header": "x"}});
        let router = |filters: Vec<Value>| {
            json!({"filter_chains": [{"filters": [{"typed_config": {"http_filters": [
                wasm(&json!({"downstream": true})),
                {"name": "envoy.filters.http.router",
                 "typed_config": {"upstream_http_filters": filters}},
            ]}}]}]})
        };
        let protocol = |filters: Vec<Value>| {
            json!({"typed_extension_protocol_options": {
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {"http_filters": filters}}})
        };
        let mut resources = json!({
            "clusters": [protocol(vec![wasm(&twin)]), protocol(vec![wasm(&steer), json!({"name": "codec"})])],
            "listeners": [router(vec![wasm(&guard)]), router(vec![wasm(&guard), json!({"name": "codec"})])],
        });
        let swapped = swap_filters(&mut resources);
        assert_eq!(swapped, [twin, steer.clone(), guard.clone(), guard.clone()]);
        let text = resources.to_string();
        assert_eq!(
            text.matches("envoy.filters.http.dynamic_modules").count(),
            4
        );
        assert_eq!(text.matches("envoy.filters.http.wasm").count(), 2, "{text}");
        assert_eq!(
            resources["listeners"][1]["filter_chains"][0]["filters"][0]["typed_config"]
                ["http_filters"][0]["name"],
            "envoy.filters.http.wasm",
            "the downstream chain"
        );
        assert!(!is_guard(&steer) && is_guard(&guard));
    }
}
