//! `deploy/istio/twins.py` generates a working replay twin from an Istio
//! gateway's cluster: the twin it writes for an Istio-shaped cluster (its
//! transport socket matches, metadata and load balancer settings) replaces
//! the harness's own in real Envoy, and the replay still answers every stale
//! pick from a live pod with nothing at the stale host.

use std::io::Write;
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use staleguard_core::ServiceKey;
use staleguard_tests::blocking::{named_host, named_host_on};
use staleguard_tests::envoy::{cluster_mut, clusters_mut, shipped_plugin, tail, Cluster, Gateway};
use staleguard_tests::fake_validator::{records::pod, FakeValidator};

const CLUSTER: &str = "outbound|8080||cart.shop.svc.cluster.local";

fn twins_py(input: &Value, args: &[&str]) -> Result<std::process::Output> {
    let script = format!("{}/../deploy/istio/twins.py", env!("CARGO_MANIFEST_DIR"));
    let mut child = Command::new("python3")
        .arg(script)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("python3 (needed by deploy/istio/twins.py)")?;
    child
        .stdin
        .take()
        .context("stdin")?
        .write_all(input.to_string().as_bytes())?;
    Ok(child.wait_with_output()?)
}

fn generated(input: &Value, args: &[&str]) -> Result<Value> {
    let out = twins_py(input, args)?;
    if !out.status.success() {
        bail!("twins.py: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// What Istio adds to an outbound cluster that the twin must keep.
fn istio_shape(cluster: &mut Value) {
    cluster["lb_policy"] = json!("LEAST_REQUEST");
    cluster["metadata"] = json!({"filter_metadata": {"istio": {"services": [
        {"host": "cart.shop.svc.cluster.local", "name": "cart", "namespace": "shop"}]}}});
    cluster["transport_socket_matches"] = json!([
        {"name": "tlsMode-istio", "match": {"tlsMode": "istio"},
         "transport_socket": {"name": "envoy.transport_sockets.tls", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
            "sni": "outbound_.8080_._.cart.shop.svc.cluster.local"}}},
        {"name": "tlsMode-disabled", "match": {},
         "transport_socket": {"name": "envoy.transport_sockets.raw_buffer", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.raw_buffer.v3.RawBuffer"}}}
    ]);
}

#[test]
fn eds_twins_read_the_guarded_clusters_resource_and_bad_input_is_refused() -> Result<()> {
    let eds = json!([
        {"name": CLUSTER, "type": "EDS", "eds_cluster_config": {"eds_config": {"ads": {}}}},
        {"name": "outbound|80||other.shop.svc.cluster.local", "type": "EDS"},
        {"name": "inbound|80||", "type": "STATIC"}
    ]);
    let doc = generated(&eds, &["--service", "cart.shop.svc.cluster.local"])?;
    let patches = doc["spec"]["configPatches"].as_array().context("patches")?;
    assert_eq!(patches.len(), 1, "{doc}");
    let twin = &patches[0]["patch"]["value"];
    assert_eq!(twin["name"], format!("{CLUSTER}|staleguard-twin"));
    assert_eq!(twin["eds_cluster_config"]["service_name"], CLUSTER);
    assert_eq!(twin["eds_cluster_config"]["eds_config"], json!({"ads": {}}));
    assert_eq!(patches[0]["patch"]["operation"], "ADD");
    // The module as deploy/istio fetches it (remote, pinned by sha256), in
    // the twin's own VM, and without failure_policy (fail closed).
    assert_eq!(doc["metadata"]["namespace"], "istio-ingress");
    let remote = generated(
        &eds,
        &[
            "--module-uri",
            "http://m/sg.wasm",
            "--module-sha256",
            "abc123",
        ],
    )?;
    let config = &remote["spec"]["configPatches"][0]["patch"]["value"]
        ["typed_extension_protocol_options"]
        ["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]["http_filters"][0]
        ["typed_config"]["config"];
    assert_eq!(config["vm_config"]["vm_id"], "staleguard-twin");
    assert_eq!(config["vm_config"]["code"]["remote"]["sha256"], "abc123");
    assert_eq!(
        config["vm_config"]["code"]["remote"]["http_uri"]["uri"],
        "http://m/sg.wasm"
    );
    assert!(config.get("failure_policy").is_none());
    let half = twins_py(&eds, &["--module-uri", "http://m/sg.wasm"])?;
    assert!(String::from_utf8_lossy(&half.stderr).contains("go together"));
    // Every *.svc.* outbound cluster without --service.
    let all = generated(&eds, &[])?;
    assert_eq!(
        all["spec"]["configPatches"].as_array().map(Vec::len),
        Some(2)
    );

    for (input, args, says) in [
        (json!([]), vec![], "no outbound cluster"),
        (
            eds.clone(),
            vec!["--service", "nope.shop.svc.cluster.local"],
            "no outbound cluster",
        ),
        (
            eds.clone(),
            vec![
                "--service",
                "cart.shop.svc.cluster.local",
                "--service",
                "gone.shop.svc.cluster.local",
            ],
            "no cluster for gone.shop.svc.cluster.local",
        ),
    ] {
        let out = twins_py(&input, &args)?;
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(says),
            "{args:?}: {err}"
        );
    }
    let out = Command::new("python3")
        .arg(format!(
            "{}/../deploy/istio/twins.py",
            env!("CARGO_MANIFEST_DIR")
        ))
        .stdin(Stdio::null())
        .output()?;
    assert!(String::from_utf8_lossy(&out.stderr).contains("stdin is not JSON"));
    Ok(())
}

#[test]
fn a_generated_twin_replays_in_real_envoy() -> Result<()> {
    let gone = named_host("127.0.5.1", "ghost")?;
    let port = gone.addr().port();
    let live_a = named_host_on("127.0.5.2", port, "cart-a")?;
    let live_b = named_host_on("127.0.5.3", port, "cart-b")?;
    let cart = ServiceKey::new("shop", "cart");
    let validator = FakeValidator::start(61)?;
    validator.set_index(
        vec![cart.clone()],
        vec![
            pod("127.0.5.2", "cart-a", &[&cart], false),
            pod("127.0.5.3", "cart-b", &[&cart], false),
        ],
    );
    let gateway = Gateway::new(
        validator.addr(),
        vec![Cluster::with_hosts(
            CLUSTER,
            vec![gone.addr(), live_a.addr(), live_b.addr()],
            Some(shipped_plugin(json!({"retry": {}}))),
        )],
    );
    let mut generated_twin = Value::Null;
    let started = gateway.start_with(|bootstrap| {
        let guarded = cluster_mut(bootstrap, CLUSTER)?;
        istio_shape(guarded);
        let wasm = guarded["typed_extension_protocol_options"]
            ["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]["http_filters"][0]
            ["typed_config"]["config"]["vm_config"]["code"]["local"]["filename"]
            .as_str()
            .context("module path")?
            .to_owned();
        let doc = generated(&json!([guarded.clone()]), &["--wasm", &wasm])?;
        generated_twin = doc["spec"]["configPatches"][0]["patch"]["value"].clone();
        assert_eq!(
            generated_twin["transport_socket_matches"],
            guarded["transport_socket_matches"]
        );
        assert_eq!(generated_twin["metadata"], guarded["metadata"]);
        assert!(generated_twin.get("lb_policy").is_none());
        // The generated twin replaces the harness's own.
        let clusters = clusters_mut(bootstrap)?;
        clusters.retain(|c| c["name"] != generated_twin["name"]);
        clusters.push(generated_twin.clone());
        Ok(())
    })?;
    let Some(envoy) = started else {
        return Ok(());
    };
    envoy.wait_first_sync()?;
    // Istio's LEAST_REQUEST picks at random among idle hosts: 60 requests
    // make at least 3 stale picks all but certain (p < 1e-8).
    for _ in 0..60 {
        let r = envoy.get(CLUSTER)?;
        assert_eq!(r.status, 200, "{r:?}\n{}", tail(&envoy.log(), 40));
        assert!(["cart-a", "cart-b"].contains(&r.header("x-host")), "{r:?}");
    }
    assert_eq!(gone.hits(), 0, "the stale host got a request");
    assert!(envoy.stat("wasmcustom.staleguard_filter_retries_total.outcome.answered")? >= 3);
    assert_eq!(
        generated_twin["name"],
        format!("{CLUSTER}|staleguard-twin"),
        "the generated twin ran"
    );
    Ok(())
}

/// The guard attached through the router's `upstream_http_filters` (as the
/// Istio EnvoyFilter of deploy/istio attaches it: an HTTP_FILTER REPLACE of
/// the router) instead of per cluster: the twin, with its own upstream filter
/// chain, still replays, and nothing reaches the stale host.
#[test]
fn replays_work_with_the_guard_on_the_routers_upstream_http_filters() -> Result<()> {
    let gone = named_host("127.0.5.11", "ghost")?;
    let port = gone.addr().port();
    let live = named_host_on("127.0.5.12", port, "cart-a")?;
    let cart = ServiceKey::new("shop", "cart");
    let validator = FakeValidator::start(62)?;
    validator.set_index(
        vec![cart.clone()],
        vec![pod("127.0.5.12", "cart-a", &[&cart], false)],
    );
    let gateway = Gateway::new(
        validator.addr(),
        vec![Cluster::with_hosts(
            CLUSTER,
            vec![gone.addr(), live.addr()],
            Some(shipped_plugin(json!({}))),
        )],
    );
    let started = gateway.start_with(|bootstrap| {
        let guarded = cluster_mut(bootstrap, CLUSTER)?;
        // Take the guard off the cluster...
        let options = guarded
            .as_object_mut()
            .context("cluster")?
            .remove("typed_extension_protocol_options")
            .context("options")?;
        let filters = options["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
            ["http_filters"]
            .clone();
        // ... and put it on the router, for every cluster without its own.
        let router = &mut bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]
            ["filters"][0]["typed_config"]["http_filters"][0]["typed_config"];
        router["upstream_http_filters"] = filters;
        Ok(())
    })?;
    let Some(envoy) = started else {
        return Ok(());
    };
    envoy.wait_first_sync()?;
    for _ in 0..20 {
        let r = envoy.get(CLUSTER)?;
        assert_eq!(r.status, 200, "{r:?}\n{}", tail(&envoy.log(), 40));
        assert_eq!(r.header("x-host"), "cart-a", "{r:?}");
    }
    assert_eq!(gone.hits(), 0, "the stale host got a request");
    assert!(envoy.stat("wasmcustom.staleguard_filter_retries_total.outcome.answered")? >= 5);
    Ok(())
}
