//! The filter stays fresh and alive in real Envoy with the plugin
//! configuration `deploy/` ships (`tick_ms` 1000): a burst of changes reaches
//! the gateway within the poller's least interval, not at the next tick; an
//! IPv4-mapped upstream address is judged as the IPv4 address it is; and a
//! validator that accepts requests and never answers does not stall the
//! poller.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use serde_json::{json, Value};
use staleguard_core::ServiceKey;
use staleguard_tests::blocking::{named_host, Server};
use staleguard_tests::envoy::{shipped_plugin, shipped_plugin_config, Cluster, Envoy, Gateway};
use staleguard_tests::fake_validator::{records::pod, Behaviour, FakeValidator};

const CART: &str = "outbound|8080||cart.shop.svc.cluster.local";
const WAIT: Duration = Duration::from_secs(20);

fn cart() -> ServiceKey {
    ServiceKey::new("shop", "cart")
}

fn pay() -> ServiceKey {
    ServiceKey::new("shop", "pay")
}

/// The pod cart-1 at `127.0.1.<id>`, known to a validator that knows cart
/// and pay, behind the guarded cluster [`CART`] (the shipped plugin with
/// `knobs`), the filter synced once. Envoy names the host in IPv4-mapped form
/// with `mapped`. `None` when Envoy is missing outside CI.
fn one_pod(id: u8, knobs: Value, mapped: bool) -> Result<Option<(Envoy, FakeValidator, Server)>> {
    let ip = format!("127.0.1.{id}");
    let host = named_host(&ip, "cart-1")?;
    let validator = FakeValidator::start(u64::from(id))?;
    validator.set_index(
        vec![cart(), pay()],
        vec![pod(&ip, "cart-1", &[&cart()], false)],
    );
    let address = if mapped {
        format!("[::ffff:{ip}]:{}", host.addr().port()).parse()?
    } else {
        host.addr()
    };
    let gateway = Gateway::new(
        validator.addr(),
        vec![Cluster::new(CART, address, Some(shipped_plugin(knobs)))],
    );
    let Some(envoy) = gateway.start()? else {
        return Ok(None);
    };
    envoy.wait_first_sync()?;
    Ok(Some((envoy, validator, host)))
}

fn reason(envoy: &Envoy, cluster: &str) -> Result<String> {
    Ok(envoy.get(cluster)?.header("x-staleguard").to_owned())
}

/// Sends requests until the gateway's verdict header is `want`; how long that
/// took from `since`.
fn until_reason(envoy: &Envoy, cluster: &str, want: &str, since: Instant) -> Result<Duration> {
    while since.elapsed() < WAIT {
        if reason(envoy, cluster)? == want {
            return Ok(since.elapsed());
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    bail!("no {want:?} verdict within {WAIT:?}:\n{}", envoy.log());
}

#[test]
fn a_burst_of_changes_reaches_the_gateway_within_the_least_poll_interval_not_a_tick() -> Result<()>
{
    let tick_ms = shipped_plugin_config()["tick_ms"].as_u64().unwrap_or(1_000);
    assert!(tick_ms >= 1_000, "the point of this test is a slow tick");
    let (cart, pay) = (cart(), pay());
    let Some((envoy, validator, _host)) = one_pod(81, json!({}), false)? else {
        return Ok(());
    };
    envoy.eventually("cart-1 allowed", WAIT, |e| Ok(reason(e, CART)?.is_empty()))?;
    // Each round: a change answers the long poll that is out; a second one,
    // 20 ms later, answers the poll sent right after it; the third, 20 ms
    // later again, needs the poll after that, which the least interval
    // (50 ms) holds back. It must go out when the interval ends, not at the
    // next lease tick.
    let mut latencies = vec![];
    for round in 0..8u8 {
        validator.upsert(pod(&format!("127.0.2.{round}"), "a", &[&cart], false));
        // Pacing the burst (the test is about changes 20 ms apart).
        std::thread::sleep(Duration::from_millis(20));
        validator.upsert(pod(&format!("127.0.3.{round}"), "b", &[&cart], false));
        std::thread::sleep(Duration::from_millis(20));
        let (record, want) = if round % 2 == 0 {
            // Recycled: the IP now belongs to a pod of another service.
            (pod("127.0.1.81", "pay-1", &[&pay], false), "recycled")
        } else {
            (pod("127.0.1.81", "cart-1", &[&cart], false), "")
        };
        let changed = Instant::now();
        validator.upsert(record);
        latencies.push(until_reason(&envoy, CART, want, changed)?);
        // Another phase against the tick next round.
        std::thread::sleep(Duration::from_millis(130 + 70 * u64::from(round)));
    }
    println!("third change of a burst to the gateway's verdict: {latencies:?}");
    let slowest = latencies.iter().max().copied().unwrap_or_default();
    assert!(
        slowest < Duration::from_millis(tick_ms / 2),
        "a change waited for the lease tick ({tick_ms} ms): {latencies:?}"
    );
    Ok(())
}

#[test]
fn an_ipv4_mapped_upstream_address_is_judged_as_its_ipv4_address() -> Result<()> {
    // The cluster names its endpoint in IPv4-mapped form: Envoy reports the
    // host as [::ffff:127.0.1.82]:port, which is the live pod 127.0.1.82.
    let Some((envoy, validator, _host)) = one_pod(82, json!({}), true)? else {
        return Ok(());
    };
    let r = envoy.get(CART)?;
    assert_eq!(
        r.header("x-staleguard"),
        "",
        "a live pod was rejected: {r:?}"
    );
    envoy.wait_counted(1)?;
    assert_eq!(
        envoy.requests("member", "allow")?,
        1,
        "judged as the member it is"
    );
    // And once the pod is gone, its mapped address is rejected.
    validator.remove("127.0.1.82".parse()?);
    envoy.eventually("destroyed", WAIT, |e| Ok(reason(e, CART)? == "destroyed"))?;
    Ok(())
}

#[test]
fn a_validator_that_accepts_and_never_answers_does_not_stall_the_poller_with_poll_wait_s_1(
) -> Result<()> {
    // The knob: a 1 s long poll, so the hung calls' host timeout (wait + 5 s)
    // and the watchdog behind it fit in a test.
    let Some((envoy, validator, _host)) = one_pod(83, json!({"poll_wait_s": 1}), false)? else {
        return Ok(());
    };
    envoy.eventually("cart-1 allowed", WAIT, |e| Ok(reason(e, CART)?.is_empty()))?;
    validator.set_behaviour(Behaviour::Hang);
    let hung = validator.requests().len();
    // Every call now hangs; each is given up on and retried.
    envoy.eventually("two hung calls given up on", Duration::from_secs(40), |e| {
        let errors = e.stat("wasmcustom.staleguard_filter_sync_errors_total.kind.status")?
            + e.stat("wasmcustom.staleguard_filter_sync_errors_total.kind.transport")?
            + e.stat("wasmcustom.staleguard_filter_sync_errors_total.kind.timeout")?;
        Ok(errors >= 2 && validator.requests().len() >= hung + 2)
    })?;
    // The validator answers again: the next call picks the change up.
    validator.set_behaviour(Behaviour::Normal);
    validator.remove("127.0.1.83".parse()?);
    envoy.eventually("the change after the hang", Duration::from_secs(40), |e| {
        Ok(reason(e, CART)? == "destroyed")
    })?;
    println!(
        "sync errors during the hang: status {}, transport {}, timeout {}",
        envoy.stat("wasmcustom.staleguard_filter_sync_errors_total.kind.status")?,
        envoy.stat("wasmcustom.staleguard_filter_sync_errors_total.kind.transport")?,
        envoy.stat("wasmcustom.staleguard_filter_sync_errors_total.kind.timeout")?
    );
    Ok(())
}
