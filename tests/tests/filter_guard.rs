//! The blast-radius guard in real Envoy: a validator that answers fresh but
//! wrong (an empty reset, a reset dropping 90% of the IPs, a reset moving
//! every IP of a service to other owners) rejects no live member, and the
//! guard's metrics say it held the answers; a correct answer releases the
//! hold; deletions with tombstones, 18 of 20 pods at once, are enforced
//! without any hold; and a root that takes the poller lease over while an
//! answer is held holds it too.

use std::time::Duration;

use anyhow::{ensure, Result};
use serde_json::json;
use staleguard_core::wire::Tombstone;
use staleguard_core::{IpRecord, ServiceKey};
use staleguard_tests::blocking::named_host;
use staleguard_tests::envoy::stats::prometheus_value;
use staleguard_tests::envoy::{shipped_plugin, tail, Cluster, Envoy, Gateway};
use staleguard_tests::fake_validator::{records::pod, FakeValidator};

const CART: &str = "outbound|8080||cart.shop.svc.cluster.local";
const WEB: &str = "outbound|8080||web.shop.svc.cluster.local";
/// cart, through a host that appears while an answer is held.
const CART_NEW: &str = "outbound|8080|new|cart.shop.svc.cluster.local";
const WAIT: Duration = Duration::from_secs(15);
const HELD: &str = "wasmcustom.staleguard_filter_guard_held_total";
const RELEASED: &str = "wasmcustom.staleguard_filter_guard_released_total";
const HOLDING: &str = "wasmcustom.staleguard_filter_guard_holding";
const HELD_IPS: &str = "wasmcustom.staleguard_filter_guard_held_ips";
const RESETS: &str = "wasmcustom.staleguard_filter_sync_resets_total";

/// The live hosts Envoy routes to.
const CART_LIVE: &str = "127.0.1.51";
const WEB_LIVE: &str = "127.0.1.52";
const CART_NEW_LIVE: &str = "127.0.1.53";

fn cart_ips() -> Vec<String> {
    let mut ips = vec![CART_LIVE.to_owned()];
    ips.extend((1..20).map(|i| format!("127.0.3.{i}")));
    ips
}

fn web_ips() -> Vec<String> {
    let mut ips = vec![WEB_LIVE.to_owned()];
    ips.extend((1..4).map(|i| format!("127.0.4.{i}")));
    ips
}

/// The truth: cart has 20 pods, web 4.
fn truth(cart: &ServiceKey, web: &ServiceKey) -> Vec<IpRecord> {
    let mut records: Vec<IpRecord> = cart_ips()
        .iter()
        .enumerate()
        .map(|(i, ip)| pod(ip, &format!("cart-{i}"), &[cart], false))
        .collect();
    records.extend(
        web_ips()
            .iter()
            .enumerate()
            .map(|(i, ip)| pod(ip, &format!("web-{i}"), &[web], false)),
    );
    records
}

/// Sends `n` requests to `cluster`; every one must reach the host.
fn all_served(envoy: &Envoy, cluster: &str, n: usize) -> Result<()> {
    for _ in 0..n {
        let r = envoy.get(cluster)?;
        ensure!(
            r.status == 200 && r.header("x-staleguard").is_empty(),
            "{cluster}: a live member was rejected: {} {:?}\n{}",
            r.status,
            r.header("x-staleguard"),
            tail(&envoy.log(), 60)
        );
    }
    Ok(())
}

/// Serves a bogus index as a restarted validator would (new epoch, so a
/// reset), then checks that the guard held it and no live member is
/// rejected while it holds.
fn bogus_reset(
    envoy: &Envoy,
    validator: &FakeValidator,
    epoch: u64,
    services: Vec<ServiceKey>,
    records: Vec<IpRecord>,
    lost: u64,
) -> Result<()> {
    let held = envoy.stat(HELD)?;
    validator.restart_with(epoch, services, records);
    envoy.eventually("the guard holds the answer", WAIT, |e| {
        Ok(e.stat(HELD)? > held && e.stat(HOLDING)? == 1)
    })?;
    assert_eq!(envoy.stat(HELD_IPS)?, lost);
    // The previous data keeps serving: live members are members, not
    // destroyed or recycled (and later, once it is stale, the failure policy
    // lets them through).
    let counted = envoy.requests_counted()?;
    all_served(envoy, CART, 20)?;
    all_served(envoy, WEB, 20)?;
    envoy.wait_counted(counted + 40)?;
    assert_eq!(
        envoy.requests("destroyed", "reject")? + envoy.requests("recycled", "reject")?,
        0,
        "{}",
        envoy.admin("/stats?filter=staleguard")?
    );
    Ok(())
}

/// The validator comes back with the truth: the hold is released.
fn restore(
    envoy: &Envoy,
    validator: &FakeValidator,
    epoch: u64,
    records: Vec<IpRecord>,
) -> Result<()> {
    let released = envoy.stat(RELEASED)?;
    let services = vec![
        ServiceKey::new("shop", "cart"),
        ServiceKey::new("shop", "web"),
    ];
    validator.restart_with(epoch, services, records);
    envoy.eventually("the hold is released", WAIT, |e| {
        Ok(e.stat(RELEASED)? > released
            && e.stat(HOLDING)? == 0
            && e.stat("wasmcustom.staleguard_filter_index_fresh")? == 1)
    })?;
    let members = envoy.requests("member", "allow")?;
    all_served(envoy, CART, 5)?;
    // Judged on fresh data again (counted on the filter's next tick).
    envoy.wait_requests("member", "allow", members + 5)?;
    Ok(())
}

#[test]
fn wrong_fresh_answers_are_held_and_tombstoned_deletions_are_not() -> Result<()> {
    let cart = ServiceKey::new("shop", "cart");
    let web = ServiceKey::new("shop", "web");
    let cart_host = named_host(CART_LIVE, "cart-0")?;
    let web_host = named_host(WEB_LIVE, "web-0")?;
    let new_host = named_host(CART_NEW_LIVE, "cart-new")?;
    let validator = FakeValidator::start(1)?;
    let both = vec![cart.clone(), web.clone()];
    validator.set_index(both.clone(), truth(&cart, &web));

    // The guard as shipped: on without configuration, and confirming a held
    // change after 60 s, longer than this test looks.
    let plugin = Some(shipped_plugin(json!({})));
    let gateway = Gateway::new(
        validator.addr(),
        vec![
            Cluster::new(CART, cart_host.addr(), plugin.clone()),
            Cluster::new(WEB, web_host.addr(), plugin.clone()),
            Cluster::new(CART_NEW, new_host.addr(), plugin),
        ],
    );
    let Some(envoy) = gateway.start()? else {
        return Ok(());
    };
    envoy.eventually("first sync: cart's live member allowed", WAIT, |e| {
        Ok(e.requests("member", "allow")? > 0 || {
            let _ = e.get(CART)?;
            false
        })
    })?;
    all_served(&envoy, CART, 5)?;
    assert_eq!(envoy.stat(HELD)?, 0);

    // 1. A fresh, well-formed, empty reset.
    bogus_reset(&envoy, &validator, 2, both.clone(), vec![], 24)?;
    restore(&envoy, &validator, 3, truth(&cart, &web))?;

    // 2. A reset that drops 22 of the 24 IPs (92%), the live ones among them,
    //    and lists a pod that has just appeared: the held answer's one
    //    addition is written, so the new pod is not taken for destroyed.
    let mut kept: Vec<IpRecord> = truth(&cart, &web)
        .into_iter()
        .filter(|r| ["127.0.3.1", "127.0.3.2"].contains(&r.ip.to_string().as_str()))
        .collect();
    kept.push(pod(CART_NEW_LIVE, "cart-new", &[&cart], false));
    bogus_reset(&envoy, &validator, 4, both.clone(), kept, 22)?;
    all_served(&envoy, CART_NEW, 10)?;
    restore(&envoy, &validator, 5, truth(&cart, &web))?;

    // 3. A reset that moves every IP of web to pods of another service (a
    //    4-pod service: 1 in 6 of the IPs, under the ratio, but all of web).
    let batch = ServiceKey::new("shop", "batch");
    let moved: Vec<IpRecord> = truth(&cart, &web)
        .into_iter()
        .map(|r| {
            if web_ips().contains(&r.ip.to_string()) {
                pod(
                    &r.ip.to_string(),
                    &format!("batch-{}", r.ip),
                    &[&batch],
                    false,
                )
            } else {
                r
            }
        })
        .collect();
    bogus_reset(&envoy, &validator, 6, both.clone(), moved, 4)?;
    restore(&envoy, &validator, 7, truth(&cart, &web))?;

    // The prometheus view of the guard's counter, for the alert rule.
    let prom = envoy.admin("/stats/prometheus")?;
    assert!(
        prometheus_value(&prom, "staleguard_filter_guard_held_total", &[]).is_some_and(|n| n > 0),
        "{prom}"
    );

    // The incident's pattern: 18 of cart's 20 pods deleted, each with its
    // tombstone, in one delta. Enforced at once; nothing held.
    let held = envoy.stat(HELD)?;
    for (i, ip) in cart_ips().iter().enumerate().take(18) {
        validator.upsert(IpRecord {
            ip: ip.parse()?,
            pods: vec![],
            bare_services: vec![],
            tombstone: Some(Tombstone {
                pod: format!("shop/cart-{i}"),
                uid: String::new(),
                services: vec![cart.clone()],
                since_ms: 1,
            }),
        });
    }
    envoy.eventually("the deleted live pod is rejected", WAIT, |e| {
        let r = e.get(CART)?;
        Ok(r.status == 503 && r.header("x-staleguard") == "destroyed")
    })?;
    assert_eq!(envoy.stat(HELD)?, held, "tombstoned deletions are not held");
    assert_eq!(envoy.stat(HOLDING)?, 0);
    all_served(&envoy, WEB, 5)?;
    Ok(())
}

// === A takeover while an answer is held ===

/// cart over CDS: its plugin configuration can be replaced, and with it the
/// root contexts, one of which holds the poller lease.
const CART_DYN: &str = "outbound|8080|dyn|cart.shop.svc.cluster.local";
const CART_DYN_LIVE: &str = "127.0.1.71";
const LEASE_ACQUIRED: &str = "wasmcustom.staleguard_filter_sync_lease_acquired_total";

#[test]
fn a_root_that_takes_the_lease_over_keeps_holding_the_answer_its_predecessor_held() -> Result<()> {
    if staleguard_tests::envoy::native::selected() {
        // The bootstrap extension holds the lease in the native build, and
        // a new filter config does not take it; its roots all run on the
        // main thread, so only a stall of that thread (not a signal: SIGSTOP
        // stops every root at once) moves it. The engine's tests cover the
        // takeover (`root::tests`, `guard::seed::tests`).
        eprintln!("skipped for the native build: a configuration update does not move its lease");
        return Ok(());
    }
    let cart = ServiceKey::new("shop", "cart");
    let host = named_host(CART_DYN_LIVE, "cart-0")?;
    let validator = FakeValidator::start(1)?;
    let mut ips = vec![CART_DYN_LIVE.to_owned()];
    ips.extend((1..20).map(|i| format!("127.0.6.{i}")));
    let records: Vec<IpRecord> = ips
        .iter()
        .enumerate()
        .map(|(i, ip)| pod(ip, &format!("cart-{i}"), &[&cart], false))
        .collect();
    validator.set_index(vec![cart.clone()], records);
    let cluster = |plugin| Cluster::new(CART_DYN, host.addr(), Some(plugin));
    let gateway = Gateway {
        dynamic: vec![cluster(shipped_plugin(json!({})))],
        ..Gateway::new(validator.addr(), vec![])
    };
    let Some(envoy) = gateway.start()? else {
        return Ok(());
    };
    envoy.eventually("first sync: cart's live member allowed", WAIT, |e| {
        Ok(e.requests("member", "allow")? > 0 || {
            let _ = e.get(CART_DYN)?;
            false
        })
    })?;
    // An empty reset: held by the lease holder.
    validator.restart_with(2, vec![cart.clone()], vec![]);
    envoy.eventually("the guard holds the answer", WAIT, |e| {
        Ok(e.stat(HELD)? == 1 && e.stat(HOLDING)? == 1)
    })?;
    // A new plugin configuration replaces every root context; one of the
    // new ones takes the lease over, and the validator still serves the
    // empty reset.
    let updated = envoy.stat("cluster_manager.cds.update_success")?;
    envoy.update_clusters(&[cluster(shipped_plugin(json!({"tick_ms": 500})))])?;
    envoy.eventually("the lease taken over", WAIT, |e| {
        Ok(e.stat("cluster_manager.cds.update_success")? > updated && e.stat(LEASE_ACQUIRED)? == 2)
    })?;
    envoy.eventually("the successor holds the answer too", WAIT, |e| {
        Ok(e.stat(HELD)? >= 2)
    })?;
    assert!(
        envoy
            .log()
            .contains("the guard's baseline is the index's: 20 IPs, 20 allowed"),
        "{}",
        tail(&envoy.log(), 60)
    );
    assert_eq!(envoy.stat(RESETS)?, 1, "only the first snapshot applied");
    all_served(&envoy, CART_DYN, 10)?;
    Ok(())
}

// === A wrong validator, then the correct one (issue 23) ===

/// shop/api's one live pod, and a pod of it that was deleted.
const API: &str = "outbound|8080||api.shop.svc.cluster.local";
const API_GONE: &str = "outbound|8080|gone|api.shop.svc.cluster.local";
const API_LIVE_IP: &str = "127.0.1.61";
const API_GONE_IP: &str = "127.0.1.62";
/// The plugin knobs of the check: short waits, so staleness comes within
/// the test's seconds.
const POLL_WAIT_S: u64 = 2;
const MAX_STALENESS_MS: u64 = 5_000;

/// The truth: shop/api's one live member and one deleted pod with its
/// tombstone, and 20 members of shop/web (Envoy routes to none of them).
fn api_truth(api: &ServiceKey) -> (Vec<ServiceKey>, Vec<IpRecord>) {
    let web = ServiceKey::new("shop", "web");
    let mut records: Vec<IpRecord> = (1..=20)
        .map(|i| pod(&format!("127.0.5.{i}"), &format!("web-{i}"), &[&web], false))
        .collect();
    records.extend([
        pod(API_LIVE_IP, "api-0", &[api], false),
        IpRecord {
            ip: API_GONE_IP
                .parse()
                .unwrap_or(std::net::IpAddr::from([0; 4])),
            pods: vec![],
            bare_services: vec![],
            tombstone: Some(Tombstone {
                pod: "shop/api-1".into(),
                uid: String::new(),
                services: vec![api.clone()],
                since_ms: 1,
            }),
        },
    ]);
    (vec![api.clone(), web], records)
}

/// What the gateway did with one request.
fn verdict(envoy: &Envoy, cluster: &str) -> Result<String> {
    let r = envoy.get(cluster)?;
    Ok(match (r.status, r.header("x-staleguard")) {
        (200, "") => "served".to_owned(),
        (status, reason) => format!("{status} {reason}"),
    })
}

/// Sends a request to each cluster every 50 ms for `span`; returns what
/// happened to each, with the time it was sent.
fn traffic(envoy: &Envoy, span: Duration) -> Result<Vec<(Duration, String, String)>> {
    let start = std::time::Instant::now();
    let mut seen = vec![];
    while start.elapsed() < span {
        let at = start.elapsed();
        seen.push((at, verdict(envoy, API)?, verdict(envoy, API_GONE)?));
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(seen)
}

/// A wrong validator serves fresh, valid, wrong answers for about 11 s: a
/// reset of 100,000 members of shop/api without its live pod, then resets
/// that name one or two other IPs; then the correct validator answers. Before
/// that, a wrong answer the guard holds for longer than `max_staleness_ms`.
fn wrong_then_correct(failure_policy: &str) -> Result<()> {
    let api = ServiceKey::new("shop", "api");
    let live = named_host(API_LIVE_IP, "api-0")?;
    let gone = named_host(API_GONE_IP, "api-1-recycled")?;
    let validator = FakeValidator::start(1)?;
    let (services, truth) = api_truth(&api);
    validator.set_index(services.clone(), truth.clone());
    let plugin = Some(shipped_plugin(json!({
        "poll_wait_s": POLL_WAIT_S,
        "max_staleness_ms": MAX_STALENESS_MS,
        "tick_ms": 200,
        "policy": {"failure_policy": failure_policy},
    })));
    let gateway = Gateway::new(
        validator.addr(),
        vec![
            Cluster::new(API, live.addr(), plugin.clone()),
            Cluster::new(API_GONE, gone.addr(), plugin),
        ],
    );
    let Some(envoy) = gateway.start()? else {
        return Ok(());
    };
    envoy.eventually("first sync: the deleted pod rejected", WAIT, |e| {
        Ok(verdict(e, API_GONE)? == "503 destroyed")
    })?;

    // 1. A held answer (an empty reset, for twice max_staleness_ms) keeps the
    //    previous data serving as it did, fresh: neither the live pod
    //    rejected (fail-closed) nor the deleted one let through (fail-open).
    validator.restart_with(50, services.clone(), vec![]);
    envoy.eventually("the guard holds the empty reset", WAIT, |e| {
        Ok(e.stat(HOLDING)? == 1)
    })?;
    let during = traffic(&envoy, Duration::from_millis(2 * MAX_STALENESS_MS))?;
    for (at, live, gone) in &during {
        ensure!(
            live == "served" && gone == "503 destroyed",
            "{at:?} into the hold ({failure_policy}): live {live}, deleted {gone}\n{}",
            tail(&envoy.log(), 60)
        );
    }
    ensure!(envoy.stat("wasmcustom.staleguard_filter_guard_held_seconds")? >= 5);
    ensure!(envoy.stat("wasmcustom.staleguard_filter_index_fresh")? == 1);

    // 2. The wrong validator, for about 11 s: it knows only shop/api (so
    //    web's IPs are no loss), and api's one live pod is under every
    //    threshold, so its answers pass the guard: a huge valid reset without
    //    the live pod, then resets naming one or two other IPs.
    let huge: Vec<IpRecord> = (0..100_000u32)
        .map(|i| {
            let [_, b, c, d] = i.to_be_bytes();
            pod(
                &format!("10.{b}.{c}.{d}"),
                &format!("api-w{i}"),
                &[&api],
                false,
            )
        })
        .collect();
    let mut epoch = 100;
    validator.restart_with(epoch, vec![api.clone()], huge);
    let wrong_until = std::time::Instant::now() + Duration::from_secs(11);
    while std::time::Instant::now() < wrong_until {
        std::thread::sleep(Duration::from_millis(900));
        epoch += 1;
        let mut few = vec![pod(API_GONE_IP, "api-w0", &[&api], false)];
        if epoch % 2 == 0 {
            few.push(pod("10.0.0.9", "api-w9", &[&api], false));
        }
        validator.restart_with(epoch, vec![api.clone()], few);
    }

    // 3. The correct validator answers: its answer is applied within
    //    poll_wait_s + 1 s, and from then on the live pod is served and the
    //    deleted pod rejected, past max_staleness_ms. The reset counter says
    //    when it is applied, so the wrong validator's last answer must be
    //    counted first (the poller asks for what follows it), and the
    //    restart brings the new index in one step (a restart, then a new
    //    index, may serve the old index once more under the new epoch: one
    //    more reset, counted before the correct one).
    let last = format!("/v1/changes?v=1&view=verdict&epoch={epoch}&since=1&");
    ensure!(
        validator.wait_for(WAIT, |log| log.iter().any(|r| r.starts_with(&last))),
        "the wrong validator's last answer (epoch {epoch}) was not applied"
    );
    let resets = envoy.stat(RESETS)?;
    let asked = std::time::Instant::now();
    validator.restart_with(1_000, services, truth);
    let bound = Duration::from_secs(POLL_WAIT_S + 1);
    envoy.eventually("the correct answer applied", bound, |e| {
        Ok(e.stat(RESETS)? > resets)
    })?;
    let applied = asked.elapsed();
    let after = traffic(&envoy, Duration::from_millis(MAX_STALENESS_MS + 1_000))?;
    for (at, live, gone) in &after {
        ensure!(
            live == "served" && gone == "503 destroyed",
            "({failure_policy}) {at:?} after the correct answer was applied ({applied:?} after it was served): live {live}, deleted {gone}\n{}",
            tail(&envoy.log(), 60)
        );
    }
    assert_eq!(envoy.stat(HOLDING)?, 0);
    Ok(())
}

#[test]
fn a_wrong_validator_then_the_correct_one_with_failure_policy_closed() -> Result<()> {
    wrong_then_correct("closed")
}

#[test]
fn a_wrong_validator_then_the_correct_one_with_failure_policy_open() -> Result<()> {
    wrong_then_correct("open")
}
