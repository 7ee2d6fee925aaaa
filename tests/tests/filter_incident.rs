//! Issue 21: the incident staleguard exists for, at its proportions, through
//! the gateway configuration the project ships. 25 endpoints of `shop/cart`,
//! 2 live, the rest recycled (answering 200 as `shop/other`), blackholed
//! (SYNs dropped), refusing and hung ([`staleguard_tests::incident`]); 16
//! concurrent clients; GET, HEAD, POST, PUT, PATCH with bodies up to 1 MiB.
//! Every request of each method is answered by a live cart pod (at least
//! 99.9%), none reaches a stale one, bodies arrive intact, and the p99 stays
//! within 50 ms of the same gateway's with no stale endpoint.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Result;
use staleguard_tests::blocking::{Answer, Server};
use staleguard_tests::envoy::{dependencies, shipped_gateway, Envoy, Launch};
use staleguard_tests::fake_validator::{records::pod, FakeValidator};
use staleguard_tests::incident::{self, Endpoints, Kind, Load, Mix, Reports, ALL};
use staleguard_tests::process::free_addr;

/// Requests per client: 16 clients, about 1,000 requests of each method
/// (`STALEGUARD_INCIDENT_REQUESTS` per client to change it;
/// `STALEGUARD_INCIDENT_ACCESS_LOG=1` prints the failures' access log lines).
fn per_client() -> usize {
    std::env::var("STALEGUARD_INCIDENT_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(320)
}

/// The shipped plain-Envoy gateway over `endpoints`, its filter synced.
fn shipped(name: &str, validator: &FakeValidator, cart: &[SocketAddr]) -> Result<Option<Envoy>> {
    let Some((envoy, wasm)) = dependencies() else {
        return Ok(None);
    };
    let (listener, admin) = (free_addr()?, free_addr()?);
    let mut bootstrap = shipped_gateway(&wasm, listener, admin, validator.addr(), cart);
    if std::env::var_os("STALEGUARD_INCIDENT_ACCESS_LOG").is_some() {
        bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
            ["typed_config"]["access_log"] = serde_json::json!([{"name": "envoy.access_loggers.stdout", "typed_config": {"@type": "type.googleapis.com/envoy.extensions.access_loggers.stream.v3.StdoutAccessLog", "log_format": {"text_format_source": {"inline_string": "ACCESS %REQ(:METHOD)% %RESPONSE_CODE% %RESPONSE_FLAGS% %UPSTREAM_HOST% attempts=%UPSTREAM_REQUEST_ATTEMPT_COUNT% %RESPONSE_CODE_DETAILS% %UPSTREAM_TRANSPORT_FAILURE_REASON%\n"}}}}]);
    }
    let launch = Launch {
        name: name.into(),
        concurrency: 2,
        env: vec![],
        detach: false,
    };
    let running = Envoy::spawn(&envoy, &bootstrap, &launch)?;
    running.wait_first_sync()?;
    Ok(Some(running))
}

fn print(what: &str, reports: &Reports) {
    for (method, r) in reports {
        println!("{what} {method:5} {}", r.line());
    }
}

#[test]
fn the_shipped_envoy_gateway_answers_every_request_from_a_live_pod_at_92_percent_stale(
) -> Result<()> {
    let endpoints = Endpoints::start(21, Mix::INCIDENT)?;
    let validator = FakeValidator::start(2100)?;
    let (services, records) = endpoints.index();
    validator.set_index(services, records);
    let Some(envoy) = shipped("incident", &validator, &endpoints.addrs())? else {
        return Ok(());
    };
    let load = Load::incident(per_client());
    let reports = incident::run(envoy.listener, &load)?;
    print("incident", &reports);
    let stale_hits: Vec<(Kind, u64)> = [Kind::Recycled, Kind::Hung]
        .into_iter()
        .map(|k| (k, endpoints.hits(k)))
        .collect();
    println!("requests at stale endpoints: {stale_hits:?}");
    if std::env::var_os("STALEGUARD_INCIDENT_ACCESS_LOG").is_some() {
        for line in envoy
            .log()
            .lines()
            .filter(|l| l.contains("ACCESS") && !l.contains(" 200 "))
        {
            println!("{line}");
        }
    }
    drop(envoy);

    // The same gateway with no stale endpoint: the latency baseline.
    let healthy = Endpoints::start(22, Mix::HEALTHY)?;
    let validator_ok = FakeValidator::start(2200)?;
    let (services, records) = healthy.index();
    validator_ok.set_index(services, records);
    let Some(baseline_envoy) = shipped("healthy", &validator_ok, &healthy.addrs())? else {
        return Ok(());
    };
    let baseline = incident::run(baseline_envoy.listener, &load)?;
    print("healthy ", &baseline);
    drop(baseline_envoy);

    for (kind, hits) in stale_hits {
        assert_eq!(hits, 0, "requests reached {} endpoints", kind.as_str());
    }
    for (method, r) in &reports {
        assert!(r.answered * 1000 >= r.sent * 999, "{method}: {}", r.line());
        assert_eq!(r.wrong_service, 0, "{method}: {}", r.line());
        assert!(
            !r.failed.contains_key("200 body altered"),
            "{method}: {}",
            r.line()
        );
    }
    let (p99, base) = (
        reports[ALL].percentile(99.0),
        baseline[ALL].percentile(99.0),
    );
    assert!(
        p99 <= base + Duration::from_millis(50),
        "p99 {p99:?} against {base:?} with no stale endpoint"
    );
    Ok(())
}

/// Issue 24: the body path's route retries an answer that carries the
/// reject header, so only the filter's own rejection may carry it: a
/// backend that sends it gets its POST once, and the client its answer
/// without the header.
#[test]
fn a_backend_sending_the_reject_header_gets_its_post_once() -> Result<()> {
    let backend = Server::start("127.0.23.1:0".parse()?, |_| Answer::Respond {
        status: 503,
        headers: vec![("x-staleguard".into(), "destroyed".into())],
        body: b"busy".to_vec(),
    })?;
    let validator = FakeValidator::start(2300)?;
    validator.set_index(
        vec![incident::cart()],
        vec![pod("127.0.23.1", "cart-0", &[&incident::cart()], false)],
    );
    let Some(envoy) = shipped("reject-header", &validator, &[backend.addr()])? else {
        return Ok(());
    };
    let r = envoy.send("-", "POST", "/cart/order", Some(b"one order"))?;
    assert_eq!(r.status, 503, "{r:?}");
    assert_eq!(r.body, "busy", "{r:?}");
    assert_eq!(r.header("x-staleguard"), "", "{r:?}");
    assert_eq!(backend.hits(), 1, "the POST was sent again");
    Ok(())
}

/// Issue 24: a replay holds at most `retry.max_answer_bytes` (1 MiB as
/// shipped) of the live host's answer in the VM; a larger answer is never
/// copied and the client gets the rejection. A direct pick is untouched.
#[test]
fn a_replayed_answer_above_the_shipped_max_answer_bytes_gets_the_rejection() -> Result<()> {
    let live = Server::start("127.0.24.2:0".parse()?, |req| {
        let size = if req.path().ends_with("/big") {
            (1 << 20) + 1
        } else {
            1 << 20
        };
        Answer::Respond {
            status: 200,
            headers: vec![(incident::SERVICE_HEADER.into(), "shop/cart".into())],
            body: vec![b'x'; size],
        }
    })?;
    let port = live.addr().port();
    let recycled = Server::start(SocketAddr::from(([127, 0, 24, 1], port)), |_| {
        Answer::status(200, "other")
    })?;
    let validator = FakeValidator::start(2400)?;
    validator.set_index(
        vec![incident::cart(), incident::other()],
        vec![
            pod("127.0.24.2", "cart-0", &[&incident::cart()], false),
            pod("127.0.24.1", "other-0", &[&incident::other()], false),
        ],
    );
    let Some(envoy) = shipped("answer-cap", &validator, &[recycled.addr(), live.addr()])? else {
        return Ok(());
    };
    let (mut direct, mut refused) = (0, 0);
    for _ in 0..10 {
        let r = envoy.send("-", "GET", "/cart/big", None)?;
        match (r.status, r.header("x-staleguard")) {
            (200, "") if r.body.len() == (1 << 20) + 1 => direct += 1,
            (503, "recycled") => refused += 1,
            _ => panic!("{} {:?}", r.status, r.headers),
        }
    }
    assert!(
        direct >= 1 && refused >= 1,
        "{direct} direct, {refused} refused"
    );
    for _ in 0..10 {
        let r = envoy.send("-", "GET", "/cart/fits", None)?;
        assert_eq!((r.status, r.body.len()), (200, 1 << 20), "{:?}", r.headers);
    }
    assert_eq!(recycled.hits(), 0, "a request reached the recycled pod");
    envoy.wait_stats("the refusals counted", Duration::from_secs(10), |s| {
        s.get("wasmcustom.staleguard_filter_retries_total.outcome.answer_too_large")
            .copied()
            .unwrap_or(0)
            == refused
    })?;
    Ok(())
}
