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

/// Makes `bootstrap` run the native module wherever it runs the Wasm filter
/// (each upstream Wasm filter becomes the module's filter with the same
/// plugin configuration), adds the poller's bootstrap extension (with the
/// first filter's configuration), and adds what Envoy needs to find the
/// module to `env`. One harness, the build as a parameter: [`super::Envoy::spawn`]
/// calls this for every gateway when [`selected`].
pub fn swap_in(bootstrap: &mut Value, env: &mut Vec<(String, String)>) -> anyhow::Result<()> {
    let module =
        module().ok_or_else(|| anyhow::anyhow!("{BUILD_VAR}=native needs STALEGUARD_NATIVE"))?;
    let mut poller = None;
    let clusters = bootstrap["static_resources"]["clusters"]
        .as_array_mut()
        .into_iter()
        .flatten();
    for cluster in clusters {
        let filters = cluster["typed_extension_protocol_options"]
            .as_object_mut()
            .into_iter()
            .flat_map(|o| o.values_mut())
            .filter_map(|options| options["http_filters"].as_array_mut())
            .flatten();
        for filter in filters {
            if filter["name"] != "envoy.filters.http.wasm" {
                continue;
            }
            let plugin = filter["typed_config"]["config"]["configuration"]["value"]
                .as_str()
                .and_then(|text| serde_json::from_str::<Value>(text).ok())
                .unwrap_or(Value::Null);
            *filter = upstream_filter(&plugin);
            poller.get_or_insert(plugin);
        }
    }
    if let Some(plugin) = poller {
        let extensions = &mut bootstrap["bootstrap_extensions"];
        if !extensions.is_array() {
            *extensions = json!([]);
        }
        if let Some(list) = extensions.as_array_mut() {
            list.push(bootstrap_extension(&plugin));
        }
    }
    env.push(search_path(&module));
    Ok(())
}
