//! The guard's alert rules (`deploy/monitoring/rules-guard.yaml`) are valid
//! Prometheus rules and fire on the series the filter really exports: the
//! `spec` part through `promtool check rules` and `promtool test rules`.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context, Result};

fn repo(path: &str) -> String {
    format!("{}/../{path}", env!("CARGO_MANIFEST_DIR"))
}

/// The PrometheusRule's `spec`, as a plain rules file: the block under the
/// top-level `spec:` line, dedented.
fn spec(yaml: &str) -> Result<String> {
    let (_, rest) = yaml
        .split_once("\nspec:\n")
        .context("no top-level spec: in the PrometheusRule")?;
    Ok(rest
        .lines()
        .map(|l| l.strip_prefix("  ").unwrap_or(l))
        .collect::<Vec<_>>()
        .join("\n"))
}

fn promtool() -> Result<Option<PathBuf>> {
    let found = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join("promtool"))
        .find(|p| p.is_file());
    match found {
        Some(p) => Ok(Some(p)),
        None if std::env::var("CI").as_deref() == Ok("true") => {
            bail!("CI=true and promtool is not installed (Debian: apt-get install prometheus)")
        }
        None => {
            eprintln!("SKIP: promtool not found on PATH (Debian: apt-get install prometheus)");
            Ok(None)
        }
    }
}

const TEST: &str = r#"
rule_files: [rules.yaml]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'staleguard_filter_guard_held_total{namespace="istio-system",pod="gw-1"}'
        values: '0 0 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1'
      - series: 'staleguard_filter_guard_holding{namespace="istio-system",pod="gw-1"}'
        values: '0 0 1 0 0 0 0 0 0 0 0 0 0 0 0 0 0'
      - series: 'staleguard_filter_guard_confirmed_total{namespace="istio-system",pod="gw-1"}'
        values: '0 0 0 1 1 1 1 1 1 1 1 1 1 1 1 1 1'
      - series: 'staleguard_filter_guard_held_total{namespace="istio-system",pod="gw-2"}'
        values: '0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0'
    alert_rule_test:
      - eval_time: 1m
        alertname: StaleguardGuardHeldValidatorAnswer
        exp_alerts: []
      - eval_time: 4m
        alertname: StaleguardGuardHeldValidatorAnswer
        exp_alerts:
          - exp_labels: {severity: critical, namespace: istio-system, pod: gw-1}
            exp_annotations:
              summary: "staleguard held a validator answer that would reject most live traffic"
              description: "Gateway istio-system/gw-1 kept its previous data instead of an answer that would newly reject most allowed IPs, or every IP of a service, without evidence. The previous data keeps being enforced (and stays fresh while the validator answers) until the answer changes or persists for guard.confirm_ms. Check the validator (flags, /readyz, /v1/snapshot on each replica); staleguard_filter_guard_held_ips says how many IPs it would have rejected, staleguard_filter_guard_held_seconds how long the hold has lasted."
              runbook: "docs/filter.md#the-blast-radius-guard"
      - eval_time: 16m
        alertname: StaleguardGuardHeldValidatorAnswer
        exp_alerts: []
      - eval_time: 5m
        alertname: StaleguardGuardConfirmedSuspiciousChange
        exp_alerts:
          - exp_labels: {severity: warning, namespace: istio-system, pod: gw-1}
            exp_annotations:
              summary: "staleguard applied a large change that its guard had held"
              description: "Gateway istio-system/gw-1 applied a held change that persisted for guard.confirm_ms. Expected after a validator outage during a scale-down; otherwise look for live pods in staleguard_filter_requests_total{staleguard_action=\"reject\"} and consider mode audit."
              runbook: "docs/filter.md#the-blast-radius-guard"
"#;

#[test]
fn guard_alert_rules_pass_promtool_and_fire_on_the_filters_series() -> Result<()> {
    let Some(promtool) = promtool()? else {
        return Ok(());
    };
    let yaml = std::fs::read_to_string(repo("deploy/monitoring/rules-guard.yaml"))?;
    let dir = std::env::temp_dir().join(format!("sg-guard-alerts-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("rules.yaml"), spec(&yaml)?)?;
    std::fs::write(dir.join("test.yaml"), TEST)?;
    for args in [
        ["check", "rules", "rules.yaml"],
        ["test", "rules", "test.yaml"],
    ] {
        let out = Command::new(&promtool)
            .args(args)
            .current_dir(&dir)
            .output()?;
        assert!(
            out.status.success(),
            "promtool {}:\n{}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
