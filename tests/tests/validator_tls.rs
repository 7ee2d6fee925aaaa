//! The validator's API over TLS (`--tls-cert-file`, `--tls-key-file`), with a
//! CA and certificates made at test time: the audit's client verifies it, and
//! real Envoy syncs the filter's index through the validator cluster's
//! `UpstreamTlsContext` as `deploy/envoy/envoy.yaml` ships it (the validator's
//! name verified), and refuses a validator whose certificate names another.

use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::{json, Value};
use staleguard_tests::blocking::named_host;
use staleguard_tests::envoy::stats::STAT_RESETS;
use staleguard_tests::envoy::{
    cluster_mut, shipped_plugin, shipped_validator_tls, Cluster, Gateway,
};
use staleguard_tests::tls::TestCa;
use staleguard_validator::api::{self, ApiConfig, TlsFiles};
use staleguard_validator::audit::fetch::{Client, FetchError};
use staleguard_validator::synth;

const NAME: &str = "staleguard-validator.staleguard.svc";

fn temp_dir(test: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("sg-tls-{test}-{}", std::process::id()))
}

/// Serves a small index over TLS with `cert` on loopback, on `runtime`.
fn validator(runtime: &tokio::runtime::Runtime, tls: TlsFiles) -> Result<std::net::SocketAddr> {
    let config = ApiConfig {
        listen: "127.0.0.1:0".parse()?,
        admin_listen: "127.0.0.1:0".parse()?,
        tls: Some(tls),
        ..ApiConfig::default()
    };
    let index = synth::indexed(synth::cluster(2, 3));
    let (public, _) = runtime.block_on(api::spawn(index, &config))?;
    Ok(public)
}

fn files(issued: &staleguard_tests::tls::Issued) -> TlsFiles {
    TlsFiles {
        cert: issued.cert.clone(),
        key: issued.key.clone(),
    }
}

#[test]
fn tls_cert_file_serves_the_api_and_the_audit_client_verifies_it_with_validator_ca_file(
) -> Result<()> {
    let dir = temp_dir("audit");
    let ca = TestCa::new(&dir, "ours")?;
    let other = TestCa::new(&dir, "other")?;
    let runtime = tokio::runtime::Runtime::new()?;
    let addr = validator(&runtime, files(&ca.issue("validator", &["localhost"])?))?;
    let url = format!("https://localhost:{}/v1/snapshot", addr.port());
    runtime.block_on(async {
        let trusting =
            Client::new(Duration::from_secs(5), Some(ca.ca_file())).map_err(anyhow::Error::msg)?;
        let body = trusting.get(&url).await?;
        let doc: Value = serde_json::from_slice(&body)?;
        assert!(doc["generation"].as_u64().is_some(), "{doc}");
        // Another CA's client refuses the certificate before any request.
        let doubting = Client::new(Duration::from_secs(5), Some(other.ca_file()))
            .map_err(anyhow::Error::msg)?;
        let err = doubting.get(&url).await.unwrap_err();
        assert!(matches!(err, FetchError::Unreachable { .. }), "{err}");
        assert!(err.to_string().contains("certificate"), "{err}");
        // Plain HTTP to the TLS listener gets no answer.
        let plain = Client::new(Duration::from_secs(5), None).map_err(anyhow::Error::msg)?;
        let http = format!("http://localhost:{}/v1/snapshot", addr.port());
        assert!(plain.get(&http).await.is_err());
        anyhow::Ok(())
    })?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// A gateway whose validator cluster reaches `validator` through `socket`.
fn tls_gateway(
    validator: std::net::SocketAddr,
    socket: Value,
    cluster: Cluster,
) -> Result<Option<staleguard_tests::envoy::Envoy>> {
    Gateway::new(validator, vec![cluster]).start_with(|bootstrap| {
        cluster_mut(bootstrap, "staleguard-validator")?["transport_socket"] = socket;
        Ok(())
    })
}

/// The transport socket `deploy/istio/components/validator-tls` adds to the
/// EnvoyFilter's validator cluster, with `ca_file` as its `trusted_ca`.
fn istio_validator_tls(ca_file: &std::path::Path) -> Result<Value> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/istio/components/validator-tls/kustomization.yaml"
    );
    let component: Value = yaml_serde::from_str(&std::fs::read_to_string(path)?)?;
    let ops: Value = yaml_serde::from_str(
        component["patches"][0]["patch"]
            .as_str()
            .context("the component's patch")?,
    )?;
    let mut socket = ops
        .as_array()
        .and_then(|ops| {
            ops.iter().find(|op| {
                op["path"]
                    .as_str()
                    .is_some_and(|p| p.ends_with("/transport_socket"))
            })
        })
        .map(|op| op["value"].clone())
        .context("no transport_socket in the component")?;
    socket["typed_config"]["common_tls_context"]["validation_context"]["trusted_ca"] =
        json!({"filename": ca_file});
    Ok(socket)
}

#[test]
fn the_gateway_syncs_from_the_validator_over_tls_only_when_the_san_verifies() -> Result<()> {
    let dir = temp_dir("envoy");
    let ca = TestCa::new(&dir, "ours")?;
    let runtime = tokio::runtime::Runtime::new()?;
    let host = named_host("127.0.1.61", "host")?;
    let cluster = "outbound|8080||cart.shop.svc.cluster.local";
    let plugin = Some(shipped_plugin(json!({})));

    // The validator's certificate names the validator: the filter syncs,
    // through the socket deploy/envoy ships and the one deploy/istio's
    // validator-tls component adds.
    let good = validator(&runtime, files(&ca.issue("good", &[NAME])?))?;
    for socket in [
        shipped_validator_tls(ca.ca_file()),
        istio_validator_tls(ca.ca_file())?,
    ] {
        let cluster = Cluster::new(cluster, host.addr(), plugin.clone());
        let Some(envoy) = tls_gateway(good, socket, cluster)? else {
            return Ok(());
        };
        envoy.wait_first_sync()?;
    }

    // A certificate of the same CA for another name: Envoy refuses it, and
    // the filter never loads an index from it.
    let impostor = validator(&runtime, files(&ca.issue("impostor", &["impostor.test"])?))?;
    let socket = shipped_validator_tls(ca.ca_file());
    let Some(envoy) = tls_gateway(impostor, socket, Cluster::new(cluster, host.addr(), plugin))?
    else {
        return Ok(());
    };
    envoy.eventually("a failed sync", Duration::from_secs(15), |e| {
        let stats = e.admin("/stats?filter=staleguard_filter_sync_errors")?;
        Ok(stats
            .lines()
            .any(|l| l.rsplit(": ").next().is_some_and(|n| n != "0")))
    })?;
    let ssl = envoy.admin("/stats?filter=cluster.staleguard-validator.ssl")?;
    let refused = ssl
        .lines()
        .find(|l| l.contains("ssl.fail_verify_san"))
        .and_then(|l| l.rsplit(": ").next())
        .context("no fail_verify_san counter")?;
    assert_ne!(refused, "0", "{ssl}");
    assert_eq!(envoy.stat(STAT_RESETS)?, 0, "synced from an impostor");
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
