//! `on_reject: retry` in real Envoy: a rejected request without a body is
//! replayed through the guarded cluster's twin to a live member the index
//! names, and the client gets the live host's answer; nothing ever reaches a
//! stale host (the servers count what they get).

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Result;
use serde_json::{json, Value};
use staleguard_core::ServiceKey;
use staleguard_tests::blocking::{Answer, Response, Server};
use staleguard_tests::envoy::stats::prometheus_value;
use staleguard_tests::envoy::{clusters_mut, shipped_plugin, tail, Cluster, Envoy, Gateway};
use staleguard_tests::fake_validator::{records::pod, FakeValidator};

const CART: &str = "cart.shop.svc.cluster.local";

fn istio(subset: &str) -> String {
    format!("outbound|8080|{subset}|{CART}")
}

fn cart() -> ServiceKey {
    ServiceKey::new("shop", "cart")
}

fn pay() -> ServiceKey {
    ServiceKey::new("shop", "pay")
}

/// A pod's server on `ip:port` (0: any): answers 203 with its name in a
/// header and the body, two cookies, and the method and path it got; `delay`
/// before answering.
fn host(ip: &str, port: u16, name: &str, delay: Duration) -> Result<Server> {
    let name = name.to_owned();
    let bind: SocketAddr = format!("{ip}:{port}").parse()?;
    Server::start(bind, move |req| {
        // A deliberately slow pod (the retry tests are about timeouts).
        std::thread::sleep(delay);
        Answer::Respond {
            status: 203,
            headers: vec![
                ("x-host".into(), name.clone()),
                ("content-type".into(), "text/x-pod".into()),
                ("set-cookie".into(), "a=1".into()),
                ("set-cookie".into(), "b=2".into()),
            ],
            body: format!("host={name} {} {}", req.method, req.target).into_bytes(),
        }
    })
}

fn retry_plugin(retry: Value) -> Value {
    shipped_plugin(json!({ "retry": retry }))
}

/// A gateway with one guarded cluster (replay on) over `servers`.
fn one_cluster(validator: &FakeValidator, name: &str, servers: &[Server]) -> Gateway {
    Gateway::new(
        validator.addr(),
        vec![Cluster::with_hosts(
            &istio(name),
            servers.iter().map(Server::addr).collect(),
            Some(retry_plugin(json!({}))),
        )],
    )
}

/// Hosts on `ips`, all on one port (the replay names members on the stale
/// pick's port, as an EDS cluster of pods has them), named `<name>-<i>`.
fn same_port(ips: &[&str], name: &str) -> Result<Vec<Server>> {
    let first = host(ips[0], 0, &format!("{name}-0"), Duration::ZERO)?;
    let port = first.addr().port();
    let mut out = vec![first];
    for (i, ip) in ips.iter().enumerate().skip(1) {
        out.push(host(ip, port, &format!("{name}-{i}"), Duration::ZERO)?);
    }
    Ok(out)
}

fn assert_live(r: &Response, e: &Envoy, live: &[&str], method: &str, target: &str) {
    assert_eq!(r.status, 203, "{r:?}\n{}", tail(&e.log(), 40));
    let name = r.header("x-host");
    assert!(
        live.contains(&name),
        "answered by {name:?}, not a live host: {r:?}"
    );
    assert_eq!(r.header("content-type"), "text/x-pod", "{r:?}");
    assert_eq!(r.header("x-staleguard"), "", "the reason leaked: {r:?}");
    assert_eq!(r.header("x-staleguard-twin-miss"), "", "{r:?}");
    assert!(
        !r.headers.keys().any(|k| k.contains("twin")),
        "the twin leaked: {r:?}"
    );
    if method != "HEAD" {
        assert_eq!(r.body, format!("host={name} {method} {target}"), "{r:?}");
    }
}

#[test]
fn rejected_requests_are_replayed_to_live_members() -> Result<()> {
    // Hosts on one port: 127.0.3.1 is gone (no pod holds it), .2 and .3 are
    // live cart pods, .4 holds a pay pod (recycled for cart).
    let servers = same_port(&["127.0.3.1", "127.0.3.2", "127.0.3.3", "127.0.3.4"], "h")?;
    let [gone, live_a, live_b, recycled] = &servers[..] else {
        unreachable!()
    };
    let validator = FakeValidator::start(51)?;
    validator.set_index(
        vec![cart(), pay()],
        vec![
            pod("127.0.3.2", "cart-a", &[&cart()], false),
            pod("127.0.3.3", "cart-b", &[&cart()], false),
            pod("127.0.3.4", "pay-1", &[&pay()], false),
            pod("127.0.3.5", "cart-slow", &[&cart()], false),
        ],
    );
    let mixed = |name: &str, plugin: Value| {
        Cluster::with_hosts(
            &istio(name),
            vec![gone.addr(), live_a.addr(), live_b.addr(), recycled.addr()],
            Some(plugin),
        )
    };
    let stale_only = Cluster::with_hosts(
        &istio("all-stale"),
        vec![gone.addr(), recycled.addr()],
        Some(retry_plugin(json!({}))),
    );
    let slow = host(
        "127.0.3.5",
        gone.addr().port(),
        "slow",
        Duration::from_secs(3),
    )?;
    let slow_cluster = Cluster::with_hosts(
        &istio("slow"),
        vec![gone.addr(), slow.addr()],
        Some(retry_plugin(json!({"timeout_ms": 500}))),
    );
    let gateway = Gateway::new(
        validator.addr(),
        vec![
            mixed("retry", retry_plugin(json!({}))),
            mixed("one-by-one", retry_plugin(json!({"hosts_per_attempt": 1}))),
            stale_only,
            slow_cluster,
            mixed("no-twin", retry_plugin(json!({}))),
        ],
    );
    // A replay path configured without its twin cluster: rejections stay
    // rejections, and the log says why.
    let Some(envoy) = gateway.start_with(|bootstrap| {
        let no_twin = format!("{}|staleguard-twin", istio("no-twin"));
        clusters_mut(bootstrap)?.retain(|c| c["name"] != no_twin.as_str());
        Ok(())
    })?
    else {
        return Ok(());
    };
    envoy.wait_first_sync()?;
    let live = ["h-1", "h-2"];
    for i in 0..40 {
        let target = format!("/x/{i}?q=1");
        let r = envoy.send(&istio("retry"), "GET", &target, None)?;
        assert_live(&r, &envoy, &live, "GET", &target);
    }
    assert_eq!(
        gone.hits() + recycled.hits(),
        0,
        "a stale host got a request"
    );
    let answered = envoy.stat("wasmcustom.staleguard_filter_retries_total.outcome.answered")?;
    assert!(
        answered >= 10,
        "half the picks are stale, {answered} replayed"
    );
    envoy.eventually("every replay counted", Duration::from_secs(30), |e| {
        Ok(e.requests("destroyed", "retry")? + e.requests("recycled", "retry")? >= answered)
    })?;
    assert_eq!(
        answered,
        envoy.requests("destroyed", "retry")? + envoy.requests("recycled", "retry")?
    );
    assert_eq!(live_a.hits() + live_b.hits(), 40);

    // A prefix rewrite: the replay carries the rewritten path.
    for i in 0..10 {
        let r = envoy.send(&istio("retry"), "GET", &format!("/rewrite/{i}"), None)?;
        assert_live(&r, &envoy, &live, "GET", &format!("/rewritten/{i}"));
    }
    // HEAD: the live host's status and headers, no body.
    for _ in 0..10 {
        let r = envoy.send(&istio("retry"), "HEAD", "/h", None)?;
        assert_live(&r, &envoy, &live, "HEAD", "/h");
        assert_eq!(r.body, "", "{r:?}");
    }
    let replayed_before_posts =
        envoy.stat("wasmcustom.staleguard_filter_retries_total.outcome.answered")?;
    assert!(
        replayed_before_posts >= answered + 5,
        "GET and HEAD replays"
    );

    // A POST with a body is not replayed: a stale pick is rejected.
    let mut rejected = 0;
    for i in 0..20 {
        let r = envoy.send(
            &istio("retry"),
            "POST",
            &format!("/p/{i}"),
            Some(b"payload"),
        )?;
        match r.status {
            203 => assert_live(&r, &envoy, &live, "POST", &format!("/p/{i}")),
            503 => {
                assert!(
                    ["destroyed", "recycled"].contains(&r.header("x-staleguard")),
                    "{r:?}"
                );
                rejected += 1;
            }
            _ => panic!("{r:?}"),
        }
    }
    assert!(
        rejected >= 5,
        "half the picks are stale, {rejected} rejected"
    );
    assert_eq!(
        envoy.stat("wasmcustom.staleguard_filter_retries_total.outcome.not_eligible_body")?,
        rejected
    );

    // The twin's own pick stale: named one at a time, the index's members
    // include one (.3 answers for cart-b) the twin may miss on; every miss is
    // failed by the twin and the next member named.
    validator.upsert(pod("127.0.3.9", "cart-elsewhere", &[&cart()], false));
    envoy.eventually("the new member", Duration::from_secs(10), |e| {
        Ok(e.stat("wasmcustom.staleguard_filter_sync_deltas_total")? >= 1)
    })?;
    for i in 0..30 {
        let target = format!("/one/{i}");
        let r = envoy.send(&istio("one-by-one"), "GET", &target, None)?;
        assert_live(&r, &envoy, &live, "GET", &target);
    }
    assert!(
        envoy.stat("wasmcustom.staleguard_filter_twin_picks_total.outcome.miss")? >= 1,
        "no twin miss in 15 replays naming one of three members at a time"
    );

    // Every host stale: the normal rejection, nothing sent.
    for _ in 0..10 {
        let r = envoy.send(&istio("all-stale"), "GET", "/", None)?;
        assert_eq!(r.status, 503, "{r:?}");
        assert!(
            ["destroyed", "recycled"].contains(&r.header("x-staleguard")),
            "{r:?}"
        );
    }
    assert!(envoy.stat("wasmcustom.staleguard_filter_retries_total.outcome.exhausted")? >= 10);

    // A slow live host: the replay's own timeout (no route timeout) gives a
    // 504 after 0.5 s; a direct pick waits for the answer.
    let mut timeouts = 0;
    while timeouts == 0 {
        let started = std::time::Instant::now();
        let r = envoy.send(&istio("slow"), "GET", "/no-timeout/", None)?;
        match r.status {
            504 => {
                assert!(
                    started.elapsed() < Duration::from_secs(2),
                    "{:?}",
                    started.elapsed()
                );
                timeouts += 1;
            }
            203 => assert_eq!(r.header("x-host"), "slow"),
            _ => panic!("{r:?}"),
        }
    }
    assert_eq!(
        envoy.stat("wasmcustom.staleguard_filter_retries_total.outcome.timeout")?,
        1
    );
    // With the route's 1 s timeout, every request ends in about a second.
    for _ in 0..2 {
        let started = std::time::Instant::now();
        let r = envoy.send(&istio("slow"), "GET", "/short-timeout/", None)?;
        assert_eq!(r.status, 504, "{r:?}");
        assert!(
            started.elapsed() < Duration::from_millis(2_500),
            "{:?}",
            started.elapsed()
        );
    }
    assert_eq!(
        gone.hits() + recycled.hits(),
        0,
        "a stale host got a request"
    );

    // No twin: the normal rejection, nothing at the stale hosts, a log line.
    for _ in 0..10 {
        let r = envoy.send(&istio("no-twin"), "GET", "/", None)?;
        match r.status {
            203 => assert_live(&r, &envoy, &live, "GET", "/"),
            503 => assert!(
                ["destroyed", "recycled"].contains(&r.header("x-staleguard")),
                "{r:?}"
            ),
            _ => panic!("{r:?}"),
        }
    }
    assert!(
        envoy.log().contains("cannot call the twin cluster"),
        "{}",
        tail(&envoy.log(), 30)
    );
    assert_eq!(gone.hits() + recycled.hits(), 0);

    // The outcomes are labels in Prometheus, as docs/metrics.md says (with
    // the cluster's labels too on Envoy before 1.39: see stats::root_name).
    let prom = envoy.admin("/stats/prometheus")?;
    let series = |name: &str, outcome: &str| {
        prometheus_value(&prom, name, &[("staleguard_outcome", outcome)]).is_some()
    };
    for outcome in ["answered", "exhausted", "timeout", "not_eligible_body"] {
        assert!(
            series("staleguard_filter_retries_total", outcome),
            "no staleguard_filter_retries_total{{staleguard_outcome=\"{outcome}\"}} in:\n{prom}"
        );
    }
    assert!(
        series("staleguard_filter_twin_picks_total", "miss"),
        "{prom}"
    );
    Ok(())
}

/// The demo's proportions: 90% of a service's endpoints stale (half of them
/// destroyed, half recycled to another service), the control plane stuck.
#[test]
fn ninety_percent_stale_endpoints_still_answer_from_live_pods() -> Result<()> {
    let ips: Vec<String> = (1..=20).map(|i| format!("127.0.4.{i}")).collect();
    let refs: Vec<&str> = ips.iter().map(String::as_str).collect();
    let servers = same_port(&refs, "p")?;
    // p-0 and p-1 are live cart pods; p-2..p-10 destroyed; p-11..p-19 pay's.
    let mut records = vec![
        pod(&ips[0], "cart-0", &[&cart()], false),
        pod(&ips[1], "cart-1", &[&cart()], false),
    ];
    for ip in &ips[11..] {
        records.push(pod(ip, &format!("pay-{ip}"), &[&pay()], false));
    }
    let validator = FakeValidator::start(52)?;
    validator.set_index(vec![cart(), pay()], records);
    let gateway = one_cluster(&validator, "ninety", &servers);
    let Some(envoy) = gateway.start()? else {
        return Ok(());
    };
    envoy.wait_first_sync()?;
    let total = 2_000u64;
    let mut answered = 0u64;
    let mut failures = Vec::new();
    for i in 0..total {
        let target = format!("/n/{i}");
        let r = envoy.send(&istio("ninety"), "GET", &target, None)?;
        if r.status == 203
            && ["p-0", "p-1"].contains(&r.header("x-host"))
            && r.body == format!("host={} GET {target}", r.header("x-host"))
        {
            answered += 1;
        } else if failures.len() < 5 {
            failures.push(r);
        }
    }
    let stale_hits: u64 = servers[2..].iter().map(Server::hits).sum();
    assert_eq!(stale_hits, 0, "requests reached stale hosts");
    assert!(
        answered * 1000 >= total * 999,
        "{answered} of {total} answered by a live cart pod; first failures: {failures:?}"
    );
    let replayed = envoy.stat("wasmcustom.staleguard_filter_retries_total.outcome.answered")?;
    assert!(replayed >= total * 8 / 10, "only {replayed} replays");
    println!("ninety percent stale: {answered} of {total} answered by a live pod, {replayed} of them replayed, 0 at a stale host");
    Ok(())
}

/// The body path's fallback for requests with bodies (`deploy/envoy/envoy.yaml`
/// when its steering hop names no members):
/// through an internal listener, a rejection is an answer the outer router
/// retries with the body; every request is answered by a live host with its
/// body intact, none reaches the stale host.
#[test]
fn body_path_retries_posts_through_the_internal_listener() -> Result<()> {
    let ips = ["127.0.6.1", "127.0.6.2", "127.0.6.3"];
    let first = echo_host(ips[0], 0, "b-0")?;
    let port = first.addr().port();
    let servers = [
        first,
        echo_host(ips[1], port, "b-1")?,
        echo_host(ips[2], port, "b-2")?,
    ];
    let validator = FakeValidator::start(53)?;
    validator.set_index(
        vec![cart()],
        vec![
            pod(ips[1], "cart-1", &[&cart()], false),
            pod(ips[2], "cart-2", &[&cart()], false),
        ],
    );
    let gateway = one_cluster(&validator, "body", &servers);
    let Some(envoy) = gateway.start_with(|bootstrap| {
        let outer = staleguard_tests::envoy::body_path(
            bootstrap,
            "/body/",
            json!({"cluster_header": "x-cluster", "timeout": "5s"}),
            "x-staleguard",
            3,
        );
        let routes = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"]
            [0]["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
            .as_array_mut()
            .ok_or_else(|| anyhow::anyhow!("no routes"))?;
        routes.insert(0, outer);
        Ok(())
    })?
    else {
        return Ok(());
    };
    envoy.wait_first_sync()?;
    for i in 0..30 {
        let body = format!("payload {i} {}", "x".repeat(i * 100));
        let r = envoy.send(
            &istio("body"),
            "POST",
            &format!("/body/{i}"),
            Some(body.as_bytes()),
        )?;
        assert_eq!(r.status, 201, "{r:?}\n{}", tail(&envoy.log(), 30));
        assert!(["b-1", "b-2"].contains(&r.header("x-host")), "{r:?}");
        assert_eq!(r.body, format!("POST /body/{i} {body}"));
    }
    assert_eq!(servers[0].hits(), 0, "the stale host got a request");
    // "A third of the picks are stale": at least 5 of 15 rejected.
    envoy.wait_requests("destroyed", "reject", 5)?;
    Ok(())
}

/// A pod's server that echoes method, path and body, with a 201.
fn echo_host(ip: &str, port: u16, name: &str) -> Result<Server> {
    let name = name.to_owned();
    let bind: SocketAddr = format!("{ip}:{port}").parse()?;
    Server::start(bind, move |req| Answer::Respond {
        status: 201,
        headers: vec![("x-host".into(), name.clone())],
        body: [
            format!("{} {} ", req.method, req.target).into_bytes(),
            req.body.clone(),
        ]
        .concat(),
    })
}

/// `deploy/envoy/envoy.yaml` ships retry on with a twin wired as the tests'
/// (`staleguard_tests::envoy::twin_cluster`): the twin's name, load balancer,
/// header, VM and plugin configuration agree with the shipped `retry` block.
#[test]
fn the_shipped_twin_is_the_tested_one() -> Result<()> {
    let yaml = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/envoy/envoy.yaml"
    ))?;
    let shipped = staleguard_tests::envoy::shipped_plugin_config();
    let retry = shipped.get("retry").expect("deploy ships a retry block");
    assert_ne!(shipped.get("on_reject"), Some(&json!("reject")));
    let suffix = retry["twin_suffix"].as_str().unwrap_or("|staleguard-twin");
    let header = retry["endpoint_header"]
        .as_str()
        .unwrap_or("x-gateway-destination-endpoint");
    let configs = staleguard_tests::envoy::plugin_configs_in(&yaml);
    let twin_config: Vec<Value> = configs
        .iter()
        .filter_map(|c| serde_json::from_str::<Value>(c).ok())
        .filter(|c| c.get("replay_twin").is_some())
        .collect();
    assert_eq!(
        twin_config,
        vec![json!({"replay_twin": {"endpoint_header": header}})]
    );
    for needle in [
        format!("- name: shop-cart{suffix}"),
        "name: envoy.load_balancing_policies.override_host".to_owned(),
        format!("- header: {header}"),
        "vm_id: staleguard-twin".to_owned(),
    ] {
        assert!(
            yaml.contains(&needle),
            "deploy/envoy/envoy.yaml lacks {needle:?}"
        );
    }
    // And the harness builds the same from the shipped plugin.
    let cluster = json!({"name": "shop-cart", "type": "STATIC"});
    let twin = staleguard_tests::envoy::twin_cluster(
        &cluster,
        std::path::Path::new("/m.wasm"),
        &shipped_plugin(json!({})),
    )
    .expect("a twin");
    assert_eq!(twin["name"], format!("shop-cart{suffix}"));
    assert_eq!(
        twin["load_balancing_policy"]["policies"][0]["typed_extension_config"]["typed_config"]
            ["override_host_sources"][0]["header"],
        header
    );
    Ok(())
}
