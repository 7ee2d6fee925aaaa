//! Issue 27: the native module's load-balancing policy
//! (`envoy.load_balancing_policies.dynamic_modules`) in real Envoy, as
//! `deploy/native/envoy-lb.yaml` ships it, on the Envoy the run names
//! (`STALEGUARD_ENVOY_VERSION` 1.38.2 or 1.40.0, the module built for its ABI
//! by `sg_build_native`).
//!
//! The incident at its proportions ([`staleguard_tests::incident`]: 25
//! endpoints, 23 stale: recycled, blackholed, refusing, hung; 16 clients;
//! GET, HEAD, POST, PUT, PATCH with bodies up to 1 MiB) through a gateway
//! whose cluster balances with the policy and runs no upstream filter: every
//! request is answered by a live pod, nothing is rejected or replayed (no
//! filter runs that could), and the gateway never opens a connection to a
//! stale IP (Envoy's own per-host connection counts, and the stale pods'
//! listeners).
//!
//! The module's bootstrap extension (in the shipped file) polls a fake
//! validator and holds Envoy's start until the first sync:
//!
//! ```text
//! . scripts/setup.sh && STALEGUARD_ENVOY_VERSION=1.38.2 sg_setup_all && sg_build_native   # or 1.40.0
//! cargo test -p staleguard-tests --test native_lb
//! ```

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use staleguard_tests::blocking::{named_host, Answer, Server};
use staleguard_tests::envoy::{dependencies, native, validate, Envoy, Launch, WAIT};
use staleguard_tests::fake_validator::{records::pod, FakeValidator};
use staleguard_tests::incident::{self, Endpoints, Kind, Load, Mix};
use staleguard_tests::istio::{
    apply_envoyfilter, gateway_output, read_yaml, validate_bootstrap, Protocol, Service,
};
use staleguard_tests::process::free_addr;

const SHIPPED: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../deploy/native/envoy-lb.yaml"
);

/// The policy's counters (`dynamicmodulescustom.*` in Envoy; the harness
/// reads the native module's namespace as the Wasm filter's, see
/// `staleguard_tests::envoy::stats::root_name`).
const SKIPPED: &str = "wasmcustom.staleguard_lb_hosts_skipped_total";
const NO_LIVE_HOST: &str = "wasmcustom.staleguard_lb_no_live_host_total";
const UNCHECKED: &str = "wasmcustom.staleguard_lb_unchecked_total";

/// `deploy/native/envoy-lb.yaml` with its addresses on loopback: the
/// listener and admin on free ports, `shop-cart`'s endpoints `cart`, the
/// validator `validator` (plain HTTP, as the fake one speaks it).
fn shipped(cart: &[SocketAddr], validator: SocketAddr) -> Result<(Value, SocketAddr, SocketAddr)> {
    let text = std::fs::read_to_string(SHIPPED).with_context(|| format!("read {SHIPPED}"))?;
    let mut doc: Value = yaml_serde::from_str(&text).context(SHIPPED)?;
    let (listener, admin) = (free_addr()?, free_addr()?);
    doc["admin"]["address"]["socket_address"] =
        json!({"address": "127.0.0.1", "port_value": admin.port()});
    doc["static_resources"]["listeners"][0]["address"]["socket_address"] =
        json!({"address": "127.0.0.1", "port_value": listener.port()});
    let clusters = doc["static_resources"]["clusters"]
        .as_array_mut()
        .context("no clusters in the shipped file")?;
    for c in clusters {
        let hosts: &[SocketAddr] = match c["name"].as_str() {
            Some("shop-cart") => cart,
            Some("staleguard-validator") => std::slice::from_ref(&validator),
            _ => continue,
        };
        let endpoints: Vec<Value> = hosts
            .iter()
            .map(|a| {
                json!({"endpoint": {"address": {"socket_address": {
                "address": a.ip().to_string(), "port_value": a.port()}}}})
            })
            .collect();
        c["type"] = json!("STATIC");
        c["load_assignment"]["endpoints"] = json!([{"lb_endpoints": endpoints}]);
    }
    Ok((doc, listener, admin))
}

/// Runs the shipped LB gateway over `cart` with `validator`'s index, and
/// waits until the policy judges picks (the index is synced: a pick is no
/// longer made unchecked). `None` when Envoy or the module is missing.
fn start(name: &str, cart: &[SocketAddr], validator: &FakeValidator) -> Result<Option<Envoy>> {
    let (Some((envoy, _)), Some(module)) = (dependencies(), native::module()) else {
        return Ok(None);
    };
    let (bootstrap, _, _) = shipped(cart, validator.addr())?;
    let launch = Launch {
        name: name.into(),
        concurrency: 2,
        env: vec![native::search_path(&module)],
        detach: false,
    };
    let running = Envoy::spawn(&envoy, &bootstrap, &launch)?;
    wait_synced(&running)?;
    Ok(Some(running))
}

/// Waits until the module's index is synced: the policy's counter of
/// unchecked picks (made while the index cannot be trusted) stops growing
/// over a pick. Picks made before (the failure policy is open) are the
/// warm-up's, which no test counts.
fn wait_synced(envoy: &Envoy) -> Result<()> {
    envoy.eventually("the module's index synced", WAIT, |e| {
        let before = e.stat(UNCHECKED)?;
        let _ = e.send("-", "GET", "/cart/warm-up", None);
        Ok(e.stat(UNCHECKED)? == before)
    })
}

/// Envoy's connection count of every host of `cluster` (`/clusters`).
fn connections(envoy: &Envoy, cluster: &str) -> Result<BTreeMap<SocketAddr, u64>> {
    let page = envoy.admin("/clusters")?;
    let mut out = BTreeMap::new();
    for line in page.lines() {
        let mut parts = line.split("::");
        let (Some(c), Some(host), Some("cx_total"), Some(n)) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        if c == cluster {
            out.insert(host.parse()?, n.trim().parse()?);
        }
    }
    Ok(out)
}

#[test]
fn the_shipped_lb_policy_answers_every_incident_request_from_a_live_pod_and_never_connects_to_a_stale_ip(
) -> Result<()> {
    let endpoints = Endpoints::start(27, Mix::INCIDENT)?;
    let validator = FakeValidator::start(2700)?;
    let (services, records) = endpoints.index();
    validator.set_index(services, records);
    let Some(envoy) = start("native-lb-incident", &endpoints.addrs(), &validator)? else {
        return Ok(());
    };
    let before = connections(&envoy, "shop-cart")?;
    let (recycled_before, hung_before) =
        (endpoints.hits(Kind::Recycled), endpoints.hits(Kind::Hung));
    let per_client = incident::requests_per_client(64);
    let reports = incident::run(envoy.listener, &Load::incident(per_client))?;
    for (method, r) in &reports {
        println!("native lb {method:5} {}", r.line());
    }
    let after = connections(&envoy, "shop-cart")?;
    let stale: Vec<(SocketAddr, Kind)> = endpoints
        .all
        .iter()
        .filter(|(_, k)| *k != Kind::Live)
        .copied()
        .collect();
    let mut reached = vec![];
    for (addr, kind) in &stale {
        let n = after.get(addr).copied().unwrap_or(0) - before.get(addr).copied().unwrap_or(0);
        if n > 0 {
            reached.push(format!("{addr} ({}): {n}", kind.as_str()));
        }
    }
    let live_connections: u64 = endpoints
        .all
        .iter()
        .filter(|(_, k)| *k == Kind::Live)
        .map(|(a, _)| after.get(a).copied().unwrap_or(0))
        .sum();
    println!(
        "connections: {live_connections} to live pods, stale: {reached:?}; skipped {}, no live host {}",
        envoy.stat(SKIPPED)?,
        envoy.stat(NO_LIVE_HOST)?
    );
    assert!(reached.is_empty(), "connections to stale IPs: {reached:?}");
    assert!(
        live_connections > 0,
        "Envoy's /clusters counted no connection"
    );
    assert_eq!(
        endpoints.hits(Kind::Recycled),
        recycled_before,
        "a recycled pod was reached"
    );
    assert_eq!(
        endpoints.hits(Kind::Hung),
        hung_before,
        "a hung IP was reached"
    );
    for (method, r) in &reports {
        assert_eq!(r.answered, r.sent, "{method}: {}", r.line());
        assert_eq!(r.wrong_service, 0, "{method}: {}", r.line());
    }
    assert_eq!(envoy.stat(NO_LIVE_HOST)?, 0);
    assert!(envoy.stat(SKIPPED)? > 0, "no stale host was passed over");
    Ok(())
}

/// The live `cart-0` on 127.0.`net`.1 and, on the same port of .2, the pod
/// of another app that took over a stale member's IP.
fn cart_and_its_recycled_ip(net: u8) -> Result<(Server, Server)> {
    let live = named_host(&format!("127.0.{net}.1"), "cart-0")?;
    let recycled = Server::start(
        SocketAddr::from(([127, 0, net, 2], live.addr().port())),
        |_| Answer::status(200, "other"),
    )?;
    Ok((live, recycled))
}

/// The shipped gateway synced from a validator at `epoch` (of `release`, or
/// this one) serving [`many_and_then`], every request answered by the live pod: the
/// requests the validator was asked (`None` when Envoy is not here).
fn synced_from_many(
    name: &str,
    live: &Server,
    recycled: &Server,
    epoch: u64,
    release: Option<staleguard_tests::fake_validator::Release>,
) -> Result<Option<Vec<String>>> {
    let validator = FakeValidator::start(epoch)?;
    if let Some(release) = release {
        validator.set_release(release);
    }
    let (services, records) = many_and_then(live.addr(), recycled.addr());
    validator.set_index(services, records);
    let Some(envoy) = start(name, &[live.addr(), recycled.addr()], &validator)? else {
        return Ok(None);
    };
    all_to_the_live_pod(&envoy, recycled)?;
    Ok(Some(validator.requests()))
}

/// When the index says every healthy host is stale, the policy picks none:
/// the client gets Envoy's 503 "no healthy upstream", counted, and the
/// recycled pod is never reached.
#[test]
fn with_every_host_stale_the_lb_policy_picks_none_and_counts_it() -> Result<()> {
    let (live, recycled) = cart_and_its_recycled_ip(28)?;
    let validator = FakeValidator::start(2800)?;
    let (cart, other) = (incident::cart(), incident::other());
    validator.set_index(
        vec![cart.clone(), other.clone()],
        vec![
            pod("127.0.28.1", "cart-0", &[&cart], false),
            pod("127.0.28.2", "other-0", &[&other], false),
        ],
    );
    let Some(envoy) = start(
        "native-lb-none",
        &[live.addr(), recycled.addr()],
        &validator,
    )?
    else {
        return Ok(());
    };
    for _ in 0..10 {
        let r = envoy.send("-", "GET", "/cart/a", None)?;
        if (r.status, r.body.as_str()) != (200, "host=cart-0") {
            bail!("{} {:?} {}", r.status, r.headers, r.body);
        }
    }
    // The live pod is deleted: no pod holds its IP any more.
    validator.set_index(
        vec![cart.clone(), other.clone()],
        vec![pod("127.0.28.2", "other-0", &[&other], false)],
    );
    envoy.eventually("the deletion reached the index", WAIT, |e| {
        Ok(e.send("-", "GET", "/cart/b", None)?.status == 503)
    })?;
    let counted = envoy.stat(NO_LIVE_HOST)?;
    for _ in 0..5 {
        let r = envoy.send("-", "GET", "/cart/c", None)?;
        assert_eq!(r.status, 503, "{r:?}");
        assert!(r.body.contains("no healthy upstream"), "{r:?}");
    }
    envoy.eventually("the empty picks counted", Duration::from_secs(5), |e| {
        Ok(e.stat(NO_LIVE_HOST)? >= counted + 5)
    })?;
    assert_eq!(recycled.hits(), 0, "the recycled pod was reached");
    Ok(())
}

/// `envoy --mode validate` of an Istio-shaped gateway's output with the
/// module; `None` when Envoy or the module is missing.
fn validate_with_module(output: &Value, what: &str) -> Result<Option<String>> {
    let (Some((envoy, _)), Some(module)) = (dependencies(), native::module()) else {
        return Ok(None);
    };
    let path = std::env::temp_dir().join(format!(
        "staleguard-native-lb-{what}-{}.json",
        std::process::id()
    ));
    std::fs::write(
        &path,
        serde_json::to_vec_pretty(&validate_bootstrap(output))?,
    )?;
    let (k, v) = native::search_path(&module);
    let checked = validate(&envoy, &path, &[(k.as_str(), v.as_str())]);
    let _ = std::fs::remove_file(&path);
    checked.map(Some)
}

fn cluster_of<'a>(output: &'a Value, name: &str) -> Result<&'a Value> {
    output["clusters"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["name"] == name))
        .with_context(|| format!("no cluster {name}"))
}

/// The shipped Istio EnvoyFilter (deploy/native/istio/envoyfilter-lb.yaml)
/// merges the policy into the guarded service's cluster only, keeps every
/// field istiod set there, and Envoy accepts the result; beside Istio's
/// locality-weighted setting Envoy refuses it, which is why the file asks
/// for `localityLbSetting.enabled: false` on guarded services.
#[test]
fn the_istio_lb_envoyfilter_keeps_istios_cluster_settings_and_envoy_accepts_it() -> Result<()> {
    let any: SocketAddr = "127.0.0.1:1".parse()?;
    let service = |name: &str| Service {
        name: name.into(),
        namespace: "shop".into(),
        port: 8080,
        protocol: Protocol::Http,
        route_host: format!("{name}.example.com"),
        endpoints: vec![any],
    };
    let (cart, pay) = (service("cart"), service("pay"));
    let before = gateway_output(&[cart.clone(), pay.clone()], 8080);
    let patch = read_yaml("deploy/native/istio/envoyfilter-lb.yaml")?;
    let mut after = before.clone();
    let applied = apply_envoyfilter(&mut after, &patch)?;
    assert_eq!(applied.counts, vec![1], "one cluster merged");
    let (was, is) = (
        cluster_of(&before, &cart.cluster_name())?,
        cluster_of(&after, &cart.cluster_name())?,
    );
    for (field, value) in was.as_object().context("cluster")? {
        assert_eq!(&is[field], value, "istiod's {field} changed");
    }
    assert_eq!(
        is["load_balancing_policy"]["policies"][0]["typed_extension_config"]["name"],
        "envoy.load_balancing_policies.dynamic_modules"
    );
    let config = is["load_balancing_policy"]["policies"][0]["typed_extension_config"]
        ["typed_config"]["lb_policy_config"]["value"]
        .as_str()
        .context("no plugin configuration")?;
    staleguard_engine::config::Config::parse(config.as_bytes())
        .map_err(|e| anyhow::anyhow!("the shipped plugin configuration: {e:?}"))?;
    assert_eq!(
        cluster_of(&after, &pay.cluster_name())?,
        cluster_of(&before, &pay.cluster_name())?,
        "an unguarded service's cluster changed"
    );
    if validate_with_module(&after, "istio-lb")?.is_none() {
        return Ok(());
    }
    let mut local = before.clone();
    for c in local["clusters"].as_array_mut().into_iter().flatten() {
        if c["name"] == cart.cluster_name().as_str() {
            c["common_lb_config"]["locality_weighted_lb_config"] = json!({});
        }
    }
    apply_envoyfilter(&mut local, &patch)?;
    let refused = validate_with_module(&local, "istio-lb-locality")
        .err()
        .context("Envoy must refuse the policy beside locality_weighted_lb_config")?;
    assert!(
        refused.to_string().contains("cannot be combined"),
        "{refused}"
    );
    Ok(())
}

/// 100,000 pods of `shop/other` on 10.0.0.0 and up (their binary snapshot is
/// over 1 MB: several pages of the shipped `sync_page_bytes`), then
/// `cart` and `recycled` on loopback, which sort last: the last page holds
/// them.
fn many_and_then(
    live: SocketAddr,
    recycled: SocketAddr,
) -> (
    Vec<staleguard_core::ServiceKey>,
    Vec<staleguard_core::IpRecord>,
) {
    let (cart, other) = (incident::cart(), incident::other());
    let mut records: Vec<_> = (0..100_000u32)
        .map(|i| {
            let ip = format!("10.0.{}.{}", i / 250, i % 250 + 1);
            pod(&ip, &format!("other-{i}"), &[&other], false)
        })
        .collect();
    records.push(pod(&live.ip().to_string(), "cart-0", &[&cart], false));
    records.push(pod(&recycled.ip().to_string(), "other-x", &[&other], false));
    (vec![cart, other], records)
}

/// Sends ten requests through `envoy`: each must reach the live pod.
fn all_to_the_live_pod(envoy: &Envoy, recycled: &Server) -> Result<()> {
    for _ in 0..10 {
        let r = envoy.send("-", "GET", "/cart/a", None)?;
        if (r.status, r.body.as_str()) != (200, "host=cart-0") {
            bail!("{} {:?} {}", r.status, r.headers, r.body);
        }
    }
    assert_eq!(recycled.hits(), 0, "the recycled pod was reached");
    Ok(())
}

/// The shipped `sync_page_bytes` (256 KiB): the bootstrap extension asks for
/// the snapshot in pages, one callout each, puts them together, and judges
/// hosts only the last page names.
#[test]
fn with_the_shipped_sync_page_bytes_a_snapshot_of_several_pages_is_put_together_and_judged_to_its_last_page(
) -> Result<()> {
    let (live, recycled) = cart_and_its_recycled_ip(29)?;
    let Some(requests) = synced_from_many("native-lb-pages", &live, &recycled, 2900, None)? else {
        return Ok(());
    };
    let pages = requests
        .iter()
        .filter(|r| r.starts_with(staleguard_core::page::ANSWER_PATH))
        .count();
    println!("requests: {:?}", &requests[..requests.len().min(6)]);
    assert!(
        requests[0].starts_with("/v1/snapshot") && requests[0].contains("page_bytes=262144"),
        "{requests:?}"
    );
    assert!(
        pages >= 2,
        "the snapshot came in {} pages: {requests:?}",
        pages + 1
    );
    Ok(())
}

/// A validator of the last release refuses `page_bytes` (its query
/// parameters are strict): the bootstrap extension asks for whole answers
/// and syncs all the same.
#[test]
fn a_validator_of_the_last_release_without_pages_still_syncs_the_shipped_module() -> Result<()> {
    let (live, recycled) = cart_and_its_recycled_ip(30)?;
    let last = Some(staleguard_tests::fake_validator::Release::Last);
    let Some(requests) = synced_from_many("native-lb-last", &live, &recycled, 3000, last)? else {
        return Ok(());
    };
    assert!(requests[0].contains("page_bytes="), "{requests:?}");
    assert_eq!(requests[1], "/v1/snapshot?v=1&view=verdict", "{requests:?}");
    assert!(
        !requests
            .iter()
            .any(|r| r.starts_with(staleguard_core::page::ANSWER_PATH)),
        "{requests:?}"
    );
    Ok(())
}
