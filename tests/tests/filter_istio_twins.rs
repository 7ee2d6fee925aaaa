//! `deploy/istio/twins.py` generates a working replay twin from an Istio
//! gateway's cluster: the twin it writes for an Istio-shaped cluster (its
//! transport socket matches, metadata and load balancer settings) replaces
//! the harness's own in real Envoy, and the replay still answers every stale
//! pick from a live pod with nothing at the stale host.

use std::process::{Command, Stdio};

use anyhow::{Context, Result};
use serde_json::{json, Value};
use staleguard_core::ServiceKey;
use staleguard_tests::blocking::{named_host, named_host_on};
use staleguard_tests::envoy::{cluster_mut, clusters_mut, shipped_plugin, tail, Cluster, Gateway};
use staleguard_tests::fake_validator::{records::pod, FakeValidator};
use staleguard_tests::istio::{generated_twins as generated, twins_py};

const CLUSTER: &str = "outbound|8080||cart.shop.svc.cluster.local";

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

/// `twin` keys of proto JSON in istioctl's spelling (lowerCamelCase), as
/// `istioctl proxy-config cluster -o json` prints them: map keys (protocol
/// options, metadata namespaces) and Struct contents (metadata values, a
/// transport socket `match`) stay as written.
fn camel_case(value: &Value) -> Value {
    match value {
        Value::Array(items) => Value::Array(items.iter().map(camel_case).collect()),
        Value::Object(fields) => Value::Object(
            fields
                .iter()
                .map(|(key, v)| {
                    let mut camel = String::new();
                    let mut upper = false;
                    for ch in key.chars() {
                        match (ch, upper) {
                            ('_', _) => upper = true,
                            (c, true) => {
                                camel.extend(c.to_uppercase());
                                upper = false;
                            }
                            (c, false) => camel.push(c),
                        }
                    }
                    let v = match key.as_str() {
                        "filter_metadata" | "match" => v.clone(),
                        "typed_extension_protocol_options" => Value::Object(
                            v.as_object()
                                .into_iter()
                                .flatten()
                                .map(|(k, entry)| (k.clone(), camel_case(entry)))
                                .collect(),
                        ),
                        _ => camel_case(v),
                    };
                    (camel, v)
                })
                .collect(),
        ),
        other => other.clone(),
    }
}

/// Every object key in `value`, outside Struct contents (`match`,
/// `filter_metadata`), with the path to it.
fn keys(value: &Value, path: &str, out: &mut Vec<String>) {
    match value {
        Value::Array(items) => items.iter().for_each(|v| keys(v, path, out)),
        Value::Object(fields) => {
            for (k, v) in fields {
                out.push(format!("{path}/{k}"));
                if k != "match" && k != "filter_metadata" {
                    keys(v, &format!("{path}/{k}"), out);
                }
            }
        }
        _ => {}
    }
}

/// The same clusters in istioctl's camelCase and in a config_dump's
/// snake_case give the same twins, in snake_case only (istiod's jsonpb would
/// read a camelCase copy beside them and drop the twin's filter chain), and
/// without the locality-weighted settings Envoy refuses beside
/// `load_balancing_policy`; Envoy accepts the result.
#[test]
fn twins_py_reads_istioctl_camel_case_and_config_dump_snake_case_alike() -> Result<()> {
    use staleguard_tests::istio::{gateway_output, validate_bootstrap, Protocol, Service};
    let any = "127.0.0.1:1".parse()?;
    let services: Vec<Service> = [
        ("greeter", "grpc", Protocol::Grpc),
        ("cart", "shop", Protocol::Http),
    ]
    .into_iter()
    .map(|(name, ns, protocol)| Service {
        name: name.into(),
        namespace: ns.into(),
        port: 8080,
        protocol,
        route_host: format!("{name}.example.com"),
        endpoints: vec![any],
    })
    .collect();
    let mut output = gateway_output(&services, 8080);
    // Locality load balancing on (a DestinationRule's localityLbSetting).
    for c in output["clusters"].as_array_mut().into_iter().flatten() {
        c["common_lb_config"]["locality_weighted_lb_config"] = json!({});
    }
    let snake = output["clusters"].clone();
    let camel = camel_case(&snake);
    assert!(camel[0].get("edsClusterConfig").is_some(), "{camel}");
    let config_dump = json!({"configs": [{"dynamic_active_clusters":
        snake.as_array().into_iter().flatten().map(|c| json!({"cluster": c})).collect::<Vec<_>>()}]});

    let wasm = staleguard_tests::envoy::dependencies().map(|(_, wasm)| wasm);
    let wasm_arg = wasm.as_ref().map_or_else(
        || "/etc/staleguard/staleguard_filter.wasm".to_owned(),
        |w| w.display().to_string(),
    );
    let args = ["--wasm", wasm_arg.as_str()];
    let from_camel = generated(&camel, &args)?;
    assert_eq!(from_camel, generated(&snake, &args)?);
    assert_eq!(from_camel, generated(&config_dump, &args)?);

    let twins: Vec<&Value> = from_camel["spec"]["configPatches"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| &p["patch"]["value"])
        .collect();
    assert_eq!(twins.len(), 2);
    for twin in &twins {
        let mut found = vec![];
        keys(twin, "", &mut found);
        let camel_keys: Vec<&String> = found
            .iter()
            .filter(|k| {
                let last = k.rsplit('/').next().unwrap_or_default();
                !last.starts_with('@')
                    && !last.contains('.')
                    && last.chars().any(char::is_uppercase)
            })
            .collect();
        assert!(
            camel_keys.is_empty(),
            "camelCase left in the twin: {camel_keys:?}"
        );
        assert!(twin.get("common_lb_config").is_none(), "{twin}");
        assert!(twin.get("lb_policy").is_none(), "{twin}");
        let hpo = &twin["typed_extension_protocol_options"]
            ["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"];
        assert_eq!(hpo["http_filters"][0]["name"], "envoy.filters.http.wasm");
        assert_eq!(
            twin["transport_socket_matches"][0]["match"],
            json!({"tlsMode": "istio"}),
            "Struct contents keep their keys"
        );
    }
    // The gRPC twin keeps Istio's h2 settings.
    let grpc = twins
        .iter()
        .find(|t| t["name"].as_str().unwrap_or_default().contains("greeter"))
        .context("the greeter twin")?;
    assert_eq!(
        grpc["typed_extension_protocol_options"]
            ["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]["explicit_http_config"]
            ["http2_protocol_options"]["max_concurrent_streams"],
        100
    );

    // Envoy takes the gateway's clusters with the twins beside them.
    if let (Some((envoy, _)), Some(_)) = (staleguard_tests::envoy::dependencies(), &wasm) {
        let mut with_twins = output.clone();
        if let Some(clusters) = with_twins["clusters"].as_array_mut() {
            clusters.extend(twins.iter().map(|t| (*t).clone()));
        }
        let path =
            std::env::temp_dir().join(format!("staleguard-twins-{}.json", std::process::id()));
        std::fs::write(
            &path,
            serde_json::to_vec_pretty(&validate_bootstrap(&with_twins))?,
        )?;
        staleguard_tests::envoy::validate(&envoy, &path, &[])?;
    }
    Ok(())
}

/// Past 200 KiB of twins (a client-side apply's annotation holds 256 KiB)
/// the script says to apply server-side.
#[test]
fn twins_py_says_to_apply_server_side_when_the_output_is_large() -> Result<()> {
    let many: Vec<Value> = (0..80)
        .map(|i| json!({"name": format!("outbound|8080||svc{i}.shop.svc.cluster.local"), "type": "EDS"}))
        .collect();
    let out = twins_py(&Value::Array(many), &[])?;
    assert!(out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--server-side"), "{err}");
    let few = twins_py(&json!([{"name": CLUSTER, "type": "EDS"}]), &[])?;
    assert!(few.status.success() && few.stderr.is_empty());
    Ok(())
}

/// The audit reports a twin whose settings are no longer its cluster's: the
/// twin `twins.py` writes matches its cluster until the cluster changes (a
/// DestinationRule edited after the script ran).
#[test]
fn the_audit_reports_a_twin_that_drifted_from_its_cluster() -> Result<()> {
    use staleguard_validator::audit::gateway::{parse_config_dump, twin_drift, Gateway};
    let mut guarded = json!({
        "name": CLUSTER, "type": "EDS",
        "eds_cluster_config": {"eds_config": {"ads": {}}},
        "circuit_breakers": {"thresholds": [{"max_connections": 100}]},
        "connect_timeout": "10s"
    });
    istio_shape(&mut guarded);
    let doc = generated(&json!([guarded.clone()]), &[])?;
    let twin = doc["spec"]["configPatches"][0]["patch"]["value"].clone();
    let dump = |guarded: &Value| {
        json!({"configs": [{
            "@type": "type.googleapis.com/envoy.admin.v3.ClustersConfigDump",
            "dynamic_active_clusters": [{"cluster": guarded}, {"cluster": twin}]
        }]})
    };
    let drift = |gateway: &Gateway| -> Result<Vec<String>> {
        let settings = |name: &str| {
            gateway
                .clusters
                .iter()
                .find(|c| c.name == name)
                .and_then(|c| c.settings.clone())
                .with_context(|| format!("no settings for {name}"))
        };
        Ok(twin_drift(
            &settings(&format!("{CLUSTER}|staleguard-twin"))?,
            &settings(CLUSTER)?,
        ))
    };
    let current = parse_config_dump(dump(&guarded).to_string().as_bytes(), "dump")?;
    assert_eq!(drift(&current)?, Vec::<String>::new());

    // The DestinationRule changed: more connections, another timeout.
    guarded["circuit_breakers"]["thresholds"][0]["max_connections"] = json!(500);
    guarded["connect_timeout"] = json!("2s");
    let changed = parse_config_dump(dump(&guarded).to_string().as_bytes(), "dump")?;
    assert_eq!(drift(&changed)?, ["circuit_breakers", "connect_timeout"]);
    Ok(())
}

/// `--body` adds the service's body path to the twins' EnvoyFilter: the hop
/// cluster in the guard's VM (its vm_config, the module aside), the internal
/// listener whose router carries the guard of `--guard`, the vhost's routes
/// re-picking ten times, and the body route inserted first; it refuses to
/// run without the guard or for a service it does not guard.
#[test]
fn twins_py_body_writes_the_body_path_with_the_guard_of_the_shipped_envoyfilter() -> Result<()> {
    let eds = json!([{"name": CLUSTER, "type": "EDS", "eds_cluster_config": {"eds_config": {"ads": {}}}}]);
    let shipped = staleguard_tests::istio::shipped_envoyfilter()?;
    let guard = std::env::temp_dir().join(format!(
        "staleguard-twins-guard-{}.json",
        std::process::id()
    ));
    std::fs::write(&guard, shipped.to_string())?;
    let guard_arg = guard.display().to_string();
    let body = "cart.shop.svc.cluster.local=cart.example.com:80";
    let doc = generated(&eds, &["--body", body, "--guard", &guard_arg]);
    let no_guard = twins_py(&eds, &["--body", body])?;
    let unguarded = twins_py(
        &eds,
        &[
            "--body",
            "other.shop.svc.cluster.local=x:80",
            "--guard",
            &guard_arg,
        ],
    )?;
    let _ = std::fs::remove_file(&guard);
    let doc = doc?;
    assert!(String::from_utf8_lossy(&no_guard.stderr).contains("--body needs --guard"));
    assert!(String::from_utf8_lossy(&unguarded.stderr).contains("names no guarded cluster"));

    let patches = doc["spec"]["configPatches"].as_array().context("patches")?;
    let kinds: Vec<(String, String)> = patches
        .iter()
        .map(|p| {
            (
                p["applyTo"].as_str().unwrap_or_default().to_owned(),
                p["patch"]["operation"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
            )
        })
        .collect();
    let want: Vec<(String, String)> = [
        ("CLUSTER", "ADD"),
        ("CLUSTER", "ADD"),
        ("LISTENER", "ADD"),
        ("HTTP_ROUTE", "MERGE"),
        ("HTTP_ROUTE", "INSERT_FIRST"),
    ]
    .iter()
    .map(|(a, b)| ((*a).to_owned(), (*b).to_owned()))
    .collect();
    assert_eq!(kinds, want);
    let hop = &patches[1]["patch"]["value"];
    assert_eq!(hop["name"], format!("{CLUSTER}|staleguard-body"));
    let steer = &hop["typed_extension_protocol_options"]
        ["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]["http_filters"][0]
        ["typed_config"]["config"];
    let guard_vm = &shipped["spec"]["configPatches"][2]["patch"]["value"]["typed_config"]
        ["upstream_http_filters"][0]["typed_config"]["config"]["vm_config"];
    assert_eq!(steer["vm_config"]["vm_id"], guard_vm["vm_id"]);
    assert_eq!(
        steer["vm_config"]["environment_variables"],
        guard_vm["environment_variables"]
    );
    let steer_config: Value = serde_json::from_str(
        steer["configuration"]["value"]
            .as_str()
            .context("steer configuration")?,
    )?;
    assert_eq!(steer_config["steer"]["service"], "shop/cart");
    assert_eq!(steer_config["steer"]["port"], 8080);
    let listener = &patches[2]["patch"]["value"];
    let hcm = &listener["filter_chains"][0]["filters"][0]["typed_config"];
    assert_eq!(
        hcm["http_filters"][0]["typed_config"]["upstream_http_filters"][0]["typed_config"]
            ["config"]["configuration"],
        shipped["spec"]["configPatches"][2]["patch"]["value"]["typed_config"]
            ["upstream_http_filters"][0]["typed_config"]["config"]["configuration"]
    );
    let inner = &hcm["route_config"]["virtual_hosts"][0]["routes"];
    assert_eq!(
        inner[0]["route"]["cluster"],
        format!("{CLUSTER}|staleguard-twin")
    );
    assert_eq!(inner[1]["route"]["cluster"], CLUSTER);
    assert_eq!(
        patches[3]["patch"]["value"]["route"]["retry_policy"]["num_retries"],
        10
    );
    assert_eq!(
        patches[4]["patch"]["value"]["route"]["cluster"],
        format!("{CLUSTER}|staleguard-body")
    );
    Ok(())
}
