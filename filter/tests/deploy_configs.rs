//! The plugin configurations shipped in deploy/ parse under the strict schema
//! (a typo there would be refused by every gateway that applies it).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use staleguard_filter::config::Config;
use staleguard_filter::replay::TwinConfig;

/// The JSON block under `value: |` in a YAML file (the plugin configuration).
fn plugin_configs(yaml: &str) -> Vec<String> {
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

fn check(path: &str, expected: usize) {
    let yaml =
        std::fs::read_to_string(format!("{}/../{path}", env!("CARGO_MANIFEST_DIR"))).unwrap();
    let configs = plugin_configs(&yaml);
    assert_eq!(configs.len(), expected, "{path}");
    for c in configs {
        // A retry twin's configuration is a role of its own (docs/filter.md).
        match TwinConfig::parse(c.as_bytes()) {
            Ok(Some(_)) => continue,
            Ok(None) => {}
            Err(e) => panic!("{path}: twin configuration refused: {e}\n{c}"),
        }
        // The VM environment the deployment provides: deploy/istio passes
        // STALEGUARD_TOKEN from a Secret (vm_config.environment_variables).
        let env = |name: &str| (name == "STALEGUARD_TOKEN").then(|| "t0ken".to_owned());
        let config = match Config::parse_with_env(c.as_bytes(), env) {
            Ok(config) => config,
            Err(e) => panic!("{path}: {e}\n{c}"),
        };
        // The variable the plugin reads must be one the VM is given.
        if let Some(name) = &config.raw.token_env {
            assert!(
                yaml.contains(&format!("host_env_keys: [{name}]")),
                "{path}: token_env {name} is not in vm_config.environment_variables"
            );
        }
    }
}

#[test]
fn shipped_plugin_configs_are_valid() {
    // The guarded cluster's plugin and its retry twin's.
    check("deploy/envoy/envoy.yaml", 2);
    check("deploy/istio/envoyfilter.yaml", 1);
}
