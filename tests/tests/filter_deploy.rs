//! The shipped plain-Envoy example is a configuration Envoy accepts (its
//! stats_tags are the ones the filter tests run: the harness reads them from
//! it); the plugin configurations it ships parse under the filter's strict
//! schema, and the guarding plugin fails open.

use anyhow::Result;
use staleguard_engine::config::Config;
use staleguard_engine::replay::TwinConfig;
use staleguard_engine::steer::SteerConfig;
use staleguard_tests::envoy::{dependencies, plugin_configs_in, validate};

fn repo(path: &str) -> String {
    format!("{}/../{path}", env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn plain_envoy_example_validates() -> Result<()> {
    let Some((envoy, wasm)) = dependencies() else {
        return Ok(());
    };
    // The validator's CA, which the operator provides: one made now.
    let dir = std::env::temp_dir().join(format!("staleguard-example-ca-{}", std::process::id()));
    let ca = staleguard_tests::tls::TestCa::new(&dir, "example")?;
    let yaml = std::fs::read_to_string(repo("deploy/envoy/envoy.yaml"))?
        .replace(
            "/etc/envoy/staleguard_filter.wasm",
            &wasm.display().to_string(),
        )
        .replace(
            "/etc/envoy/staleguard-validator-ca.crt",
            &ca.ca_file().display().to_string(),
        );
    let path = std::env::temp_dir().join(format!("staleguard-example-{}.yaml", std::process::id()));
    std::fs::write(&path, yaml)?;
    validate(&envoy, &path, &[])?;
    Ok(())
}

fn check_plugin_configs(path: &str, expected: usize) {
    let yaml =
        std::fs::read_to_string(format!("{}/../{path}", env!("CARGO_MANIFEST_DIR"))).unwrap();
    let configs = plugin_configs_in(&yaml);
    assert_eq!(configs.len(), expected, "{path}");
    for c in configs {
        // A retry twin's configuration is a role of its own (docs/filter.md).
        match TwinConfig::parse(c.as_bytes()) {
            Ok(Some(_)) => continue,
            Ok(None) => {}
            Err(e) => panic!("{path}: twin configuration refused: {e}\n{c}"),
        }
        // So is the body path's steering hop (docs/filter.md).
        match SteerConfig::parse(c.as_bytes()) {
            Ok(Some(_)) => continue,
            Ok(None) => {}
            Err(e) => panic!("{path}: steering configuration refused: {e}\n{c}"),
        }
        // The VM environment the deployment provides: deploy/istio passes
        // STALEGUARD_TOKEN from a Secret (vm_config.environment_variables).
        let env = |name: &str| (name == "STALEGUARD_TOKEN").then(|| "t0ken".to_owned());
        let config = match Config::parse_with_env(c.as_bytes(), env) {
            Ok(config) => config,
            Err(e) => panic!("{path}: {e}\n{c}"),
        };
        // The variable the plugin reads must be one the VM is given.
        if let Some(name) = &config.token_env {
            assert!(
                yaml.contains(&format!("host_env_keys: [{name}]")),
                "{path}: token_env {name} is not in vm_config.environment_variables"
            );
        }
    }
}

/// The plugin configurations shipped in deploy/ parse under the strict schema
/// (a typo there would be refused by every gateway that applies it).
#[test]
fn shipped_plugin_configs_are_valid() {
    // The guarded cluster's plugin, its retry twin's and the body path's
    // steering hop's.
    check_plugin_configs("deploy/envoy/envoy.yaml", 3);
    check_plugin_configs("deploy/istio/envoyfilter.yaml", 1);
}

/// A deleted pod refuses the connection before any upstream filter runs, so
/// the shipped route retries a refused connection on another host
/// (docs/benchmarks.md, "Reaction time"); the reaction benchmark reads the
/// same policy.
#[test]
fn the_shipped_route_retries_a_refused_connection_on_another_host() {
    let policy = staleguard_tests::envoy::shipped_route_retry_policy();
    let on = policy["retry_on"].as_str().unwrap_or_default();
    assert!(on.split(',').any(|c| c == "connect-failure"), "{policy}");
    assert!(policy["num_retries"].as_u64().unwrap_or(0) >= 1, "{policy}");
    assert_eq!(
        policy["retry_host_predicate"][0]["name"], "envoy.retry_host_predicates.previous_hosts",
        "{policy}"
    );
}

/// Every Wasm filter named `staleguard` in `yaml` with its `failure_policy`
/// (`None` when unset), found wherever it sits in the document.
fn wasm_failure_policies(yaml: &str) -> Vec<(String, Option<String>)> {
    fn walk(v: &yaml_serde::Value, out: &mut Vec<(String, Option<String>)>) {
        match v {
            yaml_serde::Value::Mapping(m) => {
                let name = m.get("name").and_then(|n| n.as_str());
                if let (Some("staleguard"), Some(vm)) = (name, m.get("vm_config")) {
                    let vm_id = vm
                        .get("vm_id")
                        .and_then(|i| i.as_str())
                        .unwrap_or_default()
                        .to_owned();
                    let policy = m
                        .get("failure_policy")
                        .and_then(|p| p.as_str())
                        .map(str::to_owned);
                    out.push((vm_id, policy));
                }
                m.values().for_each(|v| walk(v, out));
            }
            yaml_serde::Value::Sequence(s) => s.iter().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    for doc in yaml_serde::Deserializer::from_str(yaml) {
        let value = <yaml_serde::Value as serde::Deserialize>::deserialize(doc).unwrap();
        walk(&value, &mut out);
    }
    out
}

/// Envoy's default for a Wasm VM that fails is FAIL_CLOSED: a 503 for every
/// request of the worker. The plugin that guards a cluster must fail open in
/// every shipped configuration. A retry twin's plugin has none on purpose: a
/// twin that cannot run fails the replay, which the guard turns into its
/// normal rejection (docs/filter.md, "The twin, plain Envoy and Istio").
#[test]
fn the_guarding_plugin_fails_open_in_every_shipped_configuration() {
    for path in ["deploy/envoy/envoy.yaml", "deploy/istio/envoyfilter.yaml"] {
        let yaml = std::fs::read_to_string(repo(path)).unwrap();
        let plugins = wasm_failure_policies(&yaml);
        let guards: Vec<_> = plugins
            .iter()
            .filter(|(vm, _)| vm == "staleguard")
            .collect();
        // The guard, and in deploy/envoy the body path's steering hop (which
        // shares its VM, and fails open to the guarded route).
        assert!(!guards.is_empty(), "{path}: {plugins:?}");
        for (vm, policy) in &plugins {
            let want = (vm == "staleguard").then_some("FAIL_OPEN");
            assert_eq!(policy.as_deref(), want, "{path}: vm_id {vm}");
        }
    }
}
