//! The shipped EnvoyFilter on an Istio ingress gateway: applied with Istio's
//! merge rules to the configuration istiod generates for h2, gRPC and HTTP/1.1
//! services (with DestinationRule pool and outlier settings and the mTLS
//! transport socket), it keeps every cluster setting, passes
//! `envoy --mode validate`, and in Envoy 1.40 h2c and gRPC backends answer
//! through the guard while stale hosts are rejected. See `src/istio.rs` for the
//! Istio source each piece follows.

use std::net::SocketAddr;
use std::process::Command;

use anyhow::{Context, Result};
use serde_json::{json, Value};
use staleguard_core::ServiceKey;
use staleguard_tests::blocking::{self, named_host, Answer, Server};
use staleguard_tests::envoy::{dependencies, tail, validate, WAIT};
use staleguard_tests::fake_validator::{records::pod, FakeValidator};
use staleguard_tests::h2::{self, Kind};
use staleguard_tests::istio::{
    self, apply_envoyfilter, cluster_names, gateway_output, plugin_config, proto_merge, set_module,
    set_plugin_config, shipped_envoyfilter, validate_bootstrap, Protocol, Service,
};

fn service(name: &str, ns: &str, port: u16, protocol: Protocol, eps: &[SocketAddr]) -> Service {
    Service {
        name: name.into(),
        namespace: ns.into(),
        port,
        protocol,
        route_host: format!("{name}.example.com"),
        endpoints: eps.to_vec(),
    }
}

fn protocol_options(output: &Value, cluster: &str) -> Value {
    output["clusters"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["name"] == cluster)
        .map(|c| c["typed_extension_protocol_options"].clone())
        .unwrap_or(Value::Null)
}

fn router(output: &Value) -> Value {
    output["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|f| f["name"] == "envoy.filters.http.router")
        .map(|f| f["typed_config"].clone())
        .unwrap_or(Value::Null)
}

/// Runs `envoy --mode validate` (which also loads the module and configures
/// the plugin) on `config`, with `token` as STALEGUARD_TOKEN; `Some(output)`
/// when Envoy accepted, `Err` with the output when not, `None` when Envoy is
/// missing outside CI.
fn envoy_validate(config: &Value, what: &str, token: Option<&str>) -> Result<Option<String>> {
    let Some((envoy, _)) = dependencies() else {
        return Ok(None);
    };
    let path = std::env::temp_dir().join(format!(
        "staleguard-istio-{what}-{}.json",
        std::process::id()
    ));
    std::fs::write(&path, serde_json::to_vec_pretty(config)?)?;
    let env: Vec<(&str, &str)> = token.map(|t| ("STALEGUARD_TOKEN", t)).into_iter().collect();
    validate(&envoy, &path, &env)
        .map_err(|e| anyhow::anyhow!("{what}: {e:#}"))
        .map(Some)
}

/// The deprecated options Envoy warns about in a validation's output.
fn deprecated(text: &str) -> std::collections::BTreeSet<String> {
    text.split("Using deprecated option '")
        .skip(1)
        .filter_map(|rest| rest.split_once('\'').map(|(option, _)| option.to_owned()))
        .collect()
}

fn three_services() -> Vec<Service> {
    let any: SocketAddr = "127.0.0.1:1".parse().unwrap_or_else(|_| unreachable!());
    vec![
        service("greeter", "grpc", 50051, Protocol::Grpc, &[any]),
        service("echo", "h2", 8080, Protocol::Http2, &[any]),
        service("cart", "shop", 8080, Protocol::Http, &[any]),
    ]
}

#[test]
fn the_envoyfilter_keeps_istios_cluster_settings_and_validates() -> Result<()> {
    let services = three_services();
    let before = gateway_output(&services, 8080);
    let mut after = before.clone();
    let applied = apply_envoyfilter(&mut after, &shipped_envoyfilter()?)?;
    // Two clusters added, the router of the one gateway listener replaced.
    assert_eq!(applied.counts, vec![1, 1, 1]);
    assert!(cluster_names(&after).contains(&"staleguard-validator".to_owned()));

    // Istio's clusters are untouched: h2 for the gRPC and HTTP2 ports, the
    // DestinationRule's pool settings, the mTLS transport socket.
    for s in &services {
        let name = s.cluster_name();
        assert_eq!(
            protocol_options(&after, &name),
            protocol_options(&before, &name),
            "{name}"
        );
        let opts = protocol_options(&after, &name);
        let h2 = &opts["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
            ["explicit_http_config"]["http2_protocol_options"];
        assert_eq!(
            h2["max_concurrent_streams"].as_u64(),
            (s.protocol != Protocol::Http).then_some(100),
            "{name}"
        );
    }
    assert_eq!(before["clusters"], {
        let mut c = after["clusters"].clone();
        if let Some(a) = c.as_array_mut() {
            a.retain(|c| !c["name"].as_str().unwrap_or("").starts_with("staleguard-"));
        }
        c
    });

    // The router is Istio's default one (no child spans, debug headers
    // kept: fields it leaves unset) with the filter before the codec.
    let r = router(&after);
    let set: Vec<&String> = r.as_object().into_iter().flat_map(|o| o.keys()).collect();
    assert_eq!(set, ["@type", "upstream_http_filters"]);
    assert_eq!(
        upstream_filter_names(&after),
        [
            "envoy.filters.http.wasm",
            "envoy.filters.http.upstream_codec"
        ]
    );

    // The token is not in the configuration: only the variable's name.
    let plugin = plugin_config(&after)?;
    assert!(plugin.get("token").is_none(), "{plugin}");
    assert_eq!(plugin["token_env"], "STALEGUARD_TOKEN");
    let token = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/istio/token.txt"
    ))?;
    assert!(!after.to_string().contains(token.trim()));

    // As shipped (remote module, sha256; validation does not fetch it). The
    // patch adds no deprecated field: Envoy warns about the same ones (those
    // of Istio's own output) with and without it.
    let patched = envoy_validate(&validate_bootstrap(&after), "remote-module", None)?;
    let istio_only = envoy_validate(&validate_bootstrap(&before), "istio-only", None)?;
    if let (Some(patched), Some(istio_only)) = (patched, istio_only) {
        assert_eq!(deprecated(&patched), deprecated(&istio_only));
    }
    // With the module loaded from a file, validation also configures the
    // plugin: it takes the shipped configuration with the token from the VM
    // environment; without one the configuration is refused, saying why, and
    // the gateway still validates (a refused plugin configuration must never
    // stop a gateway: docs/filter.md, "Plugin configuration").
    if let Some((_, wasm)) = dependencies() {
        let mut local = after.clone();
        set_module(&mut local, Some(&wasm), None);
        let bootstrap = validate_bootstrap(&local);
        envoy_validate(&bootstrap, "local-module", Some(TOKEN))?;
        let out = envoy_validate(&bootstrap, "no-token", None)?.unwrap_or_default();
        assert!(
            out.contains(r#"token_env "STALEGUARD_TOKEN" is not set"#)
                && out.contains("the plugin runs anyway"),
            "{out}"
        );
    }
    Ok(())
}

/// Why not a CLUSTER MERGE of the protocol options (the first EnvoyFilter):
/// under the same merge rules it replaces Istio's HttpProtocolOptions entry
/// whole, and the h2 cluster falls back to HTTP/1.1.
#[test]
fn a_cluster_merge_of_protocol_options_would_drop_http2() -> Result<()> {
    let services = three_services();
    let mut output = gateway_output(&services, 8080);
    let name = services[0].cluster_name();
    let patch = json!({"typed_extension_protocol_options": {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http_protocol_options": {}},
            "http_filters": []
        }
    }});
    let cluster = output["clusters"]
        .as_array_mut()
        .and_then(|cs| cs.iter_mut().find(|c| c["name"] == name.as_str()))
        .context("grpc cluster")?;
    proto_merge(cluster, &patch);
    let opts = &cluster["typed_extension_protocol_options"]
        ["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"];
    assert!(opts["explicit_http_config"]["http2_protocol_options"].is_null());
    assert!(
        opts["common_http_protocol_options"].is_null(),
        "pool settings lost too"
    );
    Ok(())
}

/// The names in the router's `upstream_http_filters` of `output`.
fn upstream_filter_names(output: &Value) -> Vec<String> {
    router(output)["upstream_http_filters"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|f| f["name"].as_str().map(str::to_owned))
        .collect()
}

/// The module URI of the first upstream Wasm filter of `output`.
fn module_uri(output: &Value) -> Value {
    router(output)["upstream_http_filters"][0]["typed_config"]["config"]["vm_config"]["code"]
        ["remote"]["http_uri"]["uri"]
        .clone()
}

/// A canary of `envoyfilter` as docs/operations.md ("Upgrade") writes it:
/// another name, the next module version (its path and sha256), and
/// `priority: 10`, so that Istio applies it after the stable one.
fn canary_of(envoyfilter: &Value) -> Result<Value> {
    let mut canary = envoyfilter.clone();
    canary["metadata"]["name"] = json!("staleguard-canary");
    canary["spec"]["priority"] = json!(10);
    let patches = canary["spec"]["configPatches"]
        .as_array_mut()
        .context("configPatches")?;
    let router = patches
        .iter_mut()
        .find(|p| p["applyTo"] == "HTTP_FILTER")
        .context("the router patch")?;
    let remote = &mut router["patch"]["value"]["typed_config"]["upstream_http_filters"][0]
        ["typed_config"]["config"]["vm_config"]["code"]["remote"];
    remote["http_uri"]["uri"] = json!(
        "http://staleguard-module.staleguard.svc.cluster.local:8080/staleguard_filter-0.1.1.wasm"
    );
    remote["sha256"] = json!("0".repeat(64));
    Ok(canary)
}

/// Two EnvoyFilters that match one gateway (a copy in the root namespace plus
/// the one in the gateway's, or the stable one beside a canary) leave Envoy a
/// valid router, `[wasm, codec]` once: the router patch is a REPLACE and the
/// clusters are ADDs Istio keeps once. The MERGE shipped before gave
/// `[wasm, codec, wasm, codec]`, which Envoy refuses.
#[test]
fn the_envoyfilter_applied_twice_or_beside_a_canary_leaves_one_valid_chain() -> Result<()> {
    let services = three_services();
    let shipped = shipped_envoyfilter()?;
    let mut once = gateway_output(&services, 8080);
    apply_envoyfilter(&mut once, &shipped)?;
    let codec = [
        "envoy.filters.http.wasm",
        "envoy.filters.http.upstream_codec",
    ];
    assert_eq!(upstream_filter_names(&once), codec);

    // Twice: the second copy adds no cluster and replaces the router with
    // the same one.
    let mut twice = gateway_output(&services, 8080);
    let applied = istio::apply_envoyfilters(&mut twice, &[&shipped, &shipped])?;
    assert_eq!(applied[0].counts, vec![1, 1, 1]);
    assert_eq!(applied[1].counts, vec![0, 0, 1]);
    assert_eq!(twice, once);

    // Beside a canary (listed first: priority, not order, decides): the
    // canary's router wins on the pods both select.
    let canary = canary_of(&shipped)?;
    let mut both = gateway_output(&services, 8080);
    istio::apply_envoyfilters(&mut both, &[&canary, &shipped])?;
    assert_eq!(upstream_filter_names(&both), codec);
    assert_eq!(
        module_uri(&both),
        module_uri(&gateway_output_with(&services, &canary)?)
    );
    assert_ne!(module_uri(&both), module_uri(&once));
    let validators = cluster_names(&both)
        .into_iter()
        .filter(|n| n == "staleguard-validator")
        .count();
    assert_eq!(validators, 1);

    envoy_validate(&validate_bootstrap(&twice), "twice", None)?;
    envoy_validate(&validate_bootstrap(&both), "canary", None)?;

    // What a MERGE of the router did: the lists append, and Envoy refuses
    // the listener.
    let mut merge = shipped.clone();
    for p in merge["spec"]["configPatches"]
        .as_array_mut()
        .into_iter()
        .flatten()
    {
        if p["applyTo"] == "HTTP_FILTER" {
            p["patch"]["operation"] = json!("MERGE");
        }
    }
    let mut doubled = gateway_output(&services, 8080);
    istio::apply_envoyfilters(&mut doubled, &[&merge, &merge])?;
    assert_eq!(upstream_filter_names(&doubled), [codec, codec].concat());
    if dependencies().is_some() {
        let err = envoy_validate(&validate_bootstrap(&doubled), "merged-twice", None)
            .err()
            .context("Envoy must refuse a chain with the codec in the middle")?;
        assert!(err.to_string().contains("must be the last filter"), "{err}");
    }
    Ok(())
}

/// `services`' gateway output with `envoyfilter` applied once.
fn gateway_output_with(services: &[Service], envoyfilter: &Value) -> Result<Value> {
    let mut output = gateway_output(services, 8080);
    apply_envoyfilter(&mut output, envoyfilter)?;
    Ok(output)
}

// === In real Envoy ===

/// At least 32 bytes: the validator refuses shorter tokens.
const TOKEN: &str = "gateway-token-from-a-kubernetes-secret-0123456789";

fn module_server(wasm: &[u8]) -> Result<Server> {
    let wasm = wasm.to_vec();
    Server::start("127.0.0.1:0".parse()?, move |req| {
        if req.path().starts_with("/staleguard_filter-") {
            Answer::Respond {
                status: 200,
                headers: vec![],
                body: wasm.clone(),
            }
        } else {
            Answer::status(404, "no such module")
        }
    })
}

fn sha256_hex(path: &std::path::Path) -> Result<String> {
    let out = Command::new("sha256sum").arg(path).output()?;
    let text = String::from_utf8(out.stdout)?;
    Ok(text
        .split_whitespace()
        .next()
        .context("sha256sum printed nothing")?
        .to_owned())
}

#[test]
fn h2c_and_grpc_backends_answer_through_the_guard_in_enforce_mode_and_stale_hosts_are_rejected(
) -> Result<()> {
    let Some((_, wasm)) = dependencies() else {
        return Ok(());
    };
    let greeter = h2::backend("127.0.3.1", "greeter-1", Kind::Grpc)?;
    let greeter_gone = h2::backend("127.0.3.2", "greeter-gone", Kind::Grpc)?;
    let echo = h2::backend("127.0.3.3", "echo-1", Kind::Http)?;
    let echo_gone = h2::backend("127.0.3.4", "echo-gone", Kind::Http)?;
    let cart = named_host("127.0.3.5", "cart-1")?;

    let validator = FakeValidator::start(5)?;
    validator.set_token(Some(TOKEN));
    let keys = [
        ServiceKey::new("grpc", "greeter"),
        ServiceKey::new("h2", "echo"),
        ServiceKey::new("shop", "cart"),
        ServiceKey::new("grpc", "ghost"),
        ServiceKey::new("h2", "echo-ghost"),
    ];
    validator.set_index(
        keys.to_vec(),
        vec![
            pod("127.0.3.1", "greeter-1", &[&keys[0]], false),
            pod("127.0.3.3", "echo-1", &[&keys[1]], false),
            pod("127.0.3.5", "cart-1", &[&keys[2]], false),
        ],
    );
    let services = vec![
        service("greeter", "grpc", 50051, Protocol::Grpc, &[greeter.addr()]),
        service("echo", "h2", 8080, Protocol::Http2, &[echo.addr()]),
        service("cart", "shop", 8080, Protocol::Http, &[cart.addr()]),
        // Services whose only endpoint is a destroyed pod (the control plane
        // has not caught up).
        service(
            "ghost",
            "grpc",
            50051,
            Protocol::Grpc,
            &[greeter_gone.addr()],
        ),
        service(
            "echo-ghost",
            "h2",
            8080,
            Protocol::Http2,
            &[echo_gone.addr()],
        ),
    ];

    let mut output = gateway_output(&services, 8080);
    apply_envoyfilter(&mut output, &shipped_envoyfilter()?)?;
    // The knob: enforce instead of the shipped audit, and test-speed polling.
    let mut plugin = plugin_config(&output)?;
    for (k, v) in [
        ("mode", json!("enforce")),
        ("poll_wait_s", json!(1)),
        ("max_staleness_ms", json!(3000)),
        ("tick_ms", json!(100)),
        ("lease_ttl_ms", json!(1000)),
        ("backoff_initial_ms", json!(100)),
        ("backoff_max_ms", json!(500)),
    ] {
        plugin[k] = v;
    }
    set_plugin_config(&mut output, &plugin);
    // The module comes over HTTP, checked against its sha256, as shipped.
    let module = module_server(&std::fs::read(&wasm)?)?;
    set_module(&mut output, None, Some(&sha256_hex(&wasm)?));

    let Some(gw) = istio::run(
        "istio",
        &output,
        &services,
        validator.addr(),
        Some(module.addr()),
        TOKEN,
    )?
    else {
        return Ok(());
    };
    // The first sync needs the token from the environment.
    gw.wait_first_sync()?;

    // Allowed: gRPC over h2, h2c, HTTP/1.1, each reaches its pod.
    for _ in 0..4 {
        let r = h2::request(
            gw.listener,
            "greeter.example.com",
            "/hello.Greeter/SayHello",
            Kind::Grpc,
        )?;
        assert_eq!(
            (r.status, r.grpc_status()),
            (200, Some(0)),
            "{r:?}\n{}",
            tail(&gw.log(), 30)
        );
        assert_eq!(r.header("x-host"), "greeter-1");
        assert!(r.body.ends_with(b"greeter-1"), "{r:?}");
        let r = h2::request(gw.listener, "echo.example.com", "/", Kind::Http)?;
        assert_eq!((r.status, r.header("x-host")), (200, "echo-1"), "{r:?}");
    }
    let r = h2::request(gw.listener, "cart.example.com", "/", Kind::Http)?;
    assert_eq!((r.status, r.header("x-host")), (200, "cart-1"), "{r:?}");

    // Rejected: the destroyed pods are never reached.
    let r = h2::request(
        gw.listener,
        "ghost.example.com",
        "/hello.Greeter/SayHello",
        Kind::Grpc,
    )?;
    assert_eq!(r.header("x-staleguard"), "destroyed", "{r:?}");
    assert_eq!(r.grpc_status(), Some(14), "UNAVAILABLE: {r:?}");
    let r = h2::request(gw.listener, "echo-ghost.example.com", "/", Kind::Http)?;
    assert_eq!(
        (r.status, r.header("x-staleguard")),
        (503, "destroyed"),
        "{r:?}"
    );
    assert_eq!(greeter_gone.hits(), 0);
    assert_eq!(echo_gone.hits(), 0);
    assert_eq!((greeter.hits(), echo.hits()), (4, 4));

    // Counted per service (on the filter's next tick: docs/metrics.md), as
    // an Istio gateway exports them: no stats tags, the labels in the name
    // (what deploy/monitoring/rules.yaml records as labelled series).
    let lines = [
        "staleguard_filter_requests_total_service_grpc_greeter_reason_member_action_allow{} 4",
        "staleguard_filter_requests_total_service_h2_echo_reason_member_action_allow{} 4",
    ];
    let ghost =
        "staleguard_filter_requests_total_service_grpc_ghost_reason_destroyed_action_reject{} ";
    gw.eventually("the requests counted", WAIT, |g| {
        let prom = blocking::get(g.admin, "/stats/prometheus", &[])?.body;
        Ok(lines.iter().all(|line| prom.lines().any(|l| l == *line))
            && prom.lines().any(|l| l.starts_with(ghost)))
    })?;
    let prom = blocking::get(gw.admin, "/stats/prometheus", &[])?.body;
    for line in lines {
        assert!(prom.lines().any(|l| l == line), "no {line}:\n{prom}");
    }
    assert!(prom.lines().any(|l| l.starts_with(ghost)), "{prom}");
    Ok(())
}

/// A module whose sha256 does not match (a bad upgrade, a corrupted
/// download) is refused by Envoy; after the fetch retries the listener starts
/// and the gateway keeps routing, unguarded (failure_policy: FAIL_OPEN).
#[test]
fn a_module_with_the_wrong_sha256_is_refused_and_traffic_still_flows() -> Result<()> {
    let Some((_, wasm)) = dependencies() else {
        return Ok(());
    };
    let echo = h2::backend("127.0.3.11", "echo-1", Kind::Http)?;
    let validator = FakeValidator::start(6)?;
    let services = vec![service("echo", "h2", 8080, Protocol::Http2, &[echo.addr()])];
    let mut output = gateway_output(&services, 8080);
    apply_envoyfilter(&mut output, &shipped_envoyfilter()?)?;
    let module = module_server(&std::fs::read(&wasm)?)?;
    set_module(&mut output, None, Some(&"0".repeat(64)));
    let Some(gw) = istio::run(
        "istio",
        &output,
        &services,
        validator.addr(),
        Some(module.addr()),
        TOKEN,
    )?
    else {
        return Ok(());
    };
    let r = h2::request(gw.listener, "echo.example.com", "/", Kind::Http)?;
    // FAIL_OPEN in the EnvoyFilter: with FAIL_CLOSED this is a 503 for every
    // request of the gateway.
    assert_eq!(
        (r.status, r.header("x-host")),
        (200, "echo-1"),
        "{r:?}\n{}",
        tail(&gw.log(), 30)
    );
    assert_eq!(gw.stat("wasmcustom.staleguard_filter_sync_polls_total")?, 0);
    Ok(())
}

/// The validator cluster the EnvoyFilter adds keeps its connections across
/// long polls (the real validator keeps them alive): with the Service's
/// `sessionAffinity: ClientIP` the gateway stays on one replica, and a
/// reconnect goes to the same one and resumes with a delta. One full snapshot,
/// then deltas only.
#[test]
fn the_gateway_polls_the_real_validator_over_kept_alive_connections() -> Result<()> {
    let (Some((_, wasm)), Some(binary)) = (dependencies(), staleguard_tests::validator::binary())
    else {
        return Ok(());
    };
    let runtime = tokio::runtime::Runtime::new()?;
    let http = staleguard_tests::traffic::Http::new();
    let dir =
        std::env::temp_dir().join(format!("staleguard-istio-keepalive-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let token_file = dir.join("token");
    std::fs::write(&token_file, TOKEN)?;
    let sample = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../validator/samples/demo.yaml"
    );
    let token_arg = format!("--token-file={}", token_file.display());
    let validator = runtime.block_on(staleguard_tests::validator::Validator::start(
        &http,
        &binary,
        std::path::Path::new(sample),
        &[&token_arg],
        false,
    ))?;

    let echo = h2::backend("127.0.3.21", "echo-1", Kind::Http)?;
    let services = vec![service("echo", "h2", 8080, Protocol::Http2, &[echo.addr()])];
    let mut output = gateway_output(&services, 8080);
    apply_envoyfilter(&mut output, &shipped_envoyfilter()?)?;
    let mut plugin = plugin_config(&output)?;
    // Test speed: a long poll answers every second.
    for (k, v) in [
        ("poll_wait_s", json!(1)),
        ("max_staleness_ms", json!(3000)),
        ("tick_ms", json!(100)),
        ("lease_ttl_ms", json!(1000)),
    ] {
        plugin[k] = v;
    }
    set_plugin_config(&mut output, &plugin);
    set_module(&mut output, Some(&wasm), None);
    let Some(gw) = istio::run("istio", &output, &services, validator.listen, None, TOKEN)? else {
        return Ok(());
    };
    gw.eventually("five long polls answered", WAIT, |g| {
        Ok(g.stat("wasmcustom.staleguard_filter_sync_deltas_total")? >= 5)
    })?;
    let requests = gw.stat("cluster.staleguard-validator.upstream_rq_total")?;
    let connections = gw.stat("cluster.staleguard-validator.upstream_cx_total")?;
    let active = gw.stat("cluster.staleguard-validator.upstream_cx_active")?;
    assert!(requests >= 6, "{requests} requests");
    // Every connection opened is still open: none is closed between polls.
    // (A poll sent from the previous answer's callback, before that stream
    // is back in the pool, may open a second one.)
    assert_eq!(active, connections, "connections were closed");
    assert!(
        connections <= 2,
        "{requests} requests over {connections} connections"
    );
    assert_eq!(
        gw.stat("wasmcustom.staleguard_filter_sync_resets_total")?,
        1
    );
    drop(validator);
    Ok(())
}

/// The optional allocator release for an Istio gateway
/// (`deploy/istio/bootstrap-override.yaml`, docs/operations.md "Give freed
/// memory back"): pilot-agent hands the override to Envoy with
/// `--config-yaml`, and Envoy merges it into the bootstrap Istio generated:
/// the block is there, Istio's node and admin are kept.
#[test]
fn the_bootstrap_override_gives_an_istio_gateway_the_memory_allocator_manager() -> Result<()> {
    use staleguard_tests::process::{free_addr, free_port, wait_for_port, OwnedProcess};
    let Some((envoy, _)) = dependencies() else {
        return Ok(());
    };
    let over = istio::read_yaml("deploy/istio/bootstrap-override.yaml")?;
    let wanted = over["memory_allocator_manager"].clone();
    assert!(wanted.is_object(), "no memory_allocator_manager in {over}");
    let admin = free_addr()?;
    let node =
        "router~10.0.0.1~istio-ingressgateway-1.istio-ingress~istio-ingress.svc.cluster.local";
    let generated = json!({
        "node": {"id": node, "cluster": "istio-ingressgateway.istio-ingress"},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin.port()}}},
    });
    let path = std::env::temp_dir().join(format!(
        "staleguard-istio-override-{}.json",
        std::process::id()
    ));
    std::fs::write(&path, serde_json::to_vec(&generated)?)?;
    let mut cmd = Command::new(&envoy);
    cmd.arg("-c")
        .arg(&path)
        .args(["--config-yaml", &over.to_string()])
        .args(["--concurrency", "1", "--disable-hot-restart"])
        .args(["--base-id", &free_port()?.to_string()]);
    let proc = OwnedProcess::spawn("envoy-istio-override", cmd)?;
    wait_for_port(&proc, admin, WAIT)?;
    let dump: Value = serde_json::from_str(&blocking::get(admin, "/config_dump", &[])?.body)?;
    let bootstrap = dump["configs"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["bootstrap"].is_object()))
        .map(|c| c["bootstrap"].clone())
        .context("no bootstrap in /config_dump")?;
    assert_eq!(
        bootstrap["memory_allocator_manager"]["memory_release_interval"],
        wanted["memory_release_interval"]
    );
    assert_eq!(
        bootstrap["memory_allocator_manager"]["bytes_to_release"]
            .to_string()
            .trim_matches('"'),
        wanted["bytes_to_release"].to_string(),
        "{bootstrap}"
    );
    assert_eq!(
        bootstrap["node"]["id"], node,
        "the override replaced Istio's node"
    );
    Ok(())
}
