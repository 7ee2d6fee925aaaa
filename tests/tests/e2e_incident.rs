//! The incident, end to end: 250 -> 20 pods of one service while the control
//! plane is stuck (EDS frozen) and traffic runs, through three real Envoys on
//! the same frozen endpoints: guarded (enforce), audit, and unguarded.
//!
//! Counts come from where requests landed (the pods) and from the filter's
//! metrics, never from logs.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::IpAddr;
use std::time::Duration;

use serde_json::json;
use staleguard_tests::envoy::stats::{prometheus_value, PROM_REQUESTS, STAT_GUARD_HELD};
use staleguard_tests::pods::{self, Tally};
use staleguard_tests::scene::{self, Expect, Scene};
use staleguard_tests::traffic::{burst, Load, Outcomes};
use staleguard_tests::world::World;

const BEFORE: usize = 250;
const AFTER: usize = 20;

fn landed(scene: &Scene, ips: &[IpAddr], via: &str) -> Tally {
    pods::via(&scene.world.tallies_at(ips), via)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scale_down_behind_a_frozen_eds_reaches_no_destroyed_pod_through_the_guard_with_on_reject_reject(
) {
    let Some(deps) = scene::deps() else { return };
    let mut world = World::new().unwrap();
    world.add_service("api", BEFORE).await.unwrap();
    let specs = [
        // Rejections, not replays: this test counts 503s against verdicts
        // (retry, the shipped default, is tested in filter_retry and e2e_demo).
        world.guarded("guarded", json!({"on_reject": "reject"})),
        world.guarded("audit", json!({"mode": "audit"})),
        world.unguarded("plain"),
    ];
    let mut scene = Scene::start(&deps, world, &["--file-poll", "100ms"], &specs)
        .await
        .unwrap();

    // Phase 1: the scale-down happens while traffic runs through all three.
    scene.world.freeze_eds();
    let loads: Vec<(String, Load)> = scene
        .gateways
        .iter()
        .map(|g| {
            let load = Load::start(scene.http.clone(), g.target("api"), 2, None, None);
            (g.name.clone(), load)
        })
        .collect();
    // Pacing, not a wait: traffic runs a while before the scale-down so the
    // counts cover both sides of it; nothing asserted depends on the length.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let gone = scene.world.scale_down("api", AFTER).unwrap();
    assert_eq!(gone.len(), BEFORE - AFTER);
    let expect: Vec<Expect> = gone
        .iter()
        .map(|ip| (World::key("api"), *ip, "destroyed"))
        .collect();
    let published = std::time::Instant::now();
    scene.sync(&expect).await.unwrap();
    // Not a timed assertion: the number docs/benchmarks.md quotes.
    println!(
        "incident: every guarded filter enforced the scale-down {} ms after the file changed",
        published.elapsed().as_millis()
    );
    // 92% of the service gone at once, each deletion with its tombstone: the
    // blast-radius guard let it through without holding anything.
    for g in scene.gateways.iter().filter(|g| g.guarded) {
        let stats = g.stats().unwrap();
        assert_eq!(
            stats.get(STAT_GUARD_HELD).copied().unwrap_or(0),
            0,
            "{}",
            g.name
        );
    }
    // The destroyed pods' addresses now answer 200 as something else.
    // Pacing, not a wait: the load keeps hitting them for a window after
    // enforcement; the assertions below hold for any window length.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut during = std::collections::BTreeMap::new();
    for (name, load) in loads {
        during.insert(name, load.stop().await);
    }

    // Phase 2: a bounded burst per gateway, for exact metric comparisons.
    // The filter counts on its tick (docs/metrics.md): first every answered
    // request of phase 1 is counted.
    let answered = |o: &Outcomes| o.total() - o.errors;
    for g in scene.gateways.iter().filter(|g| g.guarded) {
        g.wait_counted(answered(&during[&g.name])).unwrap();
    }
    let mut before = std::collections::BTreeMap::new();
    for g in &scene.gateways {
        let mut counters = Vec::new();
        for (reason, action) in [
            ("destroyed", "reject"),
            ("destroyed", "audit"),
            ("member", "allow"),
        ] {
            counters.push(g.requests(reason, action).unwrap());
        }
        before.insert(g.name.clone(), (counters, landed(&scene, &gone, &g.name)));
    }
    let served_before = pods::via(&scene.world.tallies(), "guarded");
    let mut burst_out: std::collections::BTreeMap<String, Outcomes> = Default::default();
    for g in &scene.gateways {
        burst_out.insert(
            g.name.clone(),
            burst(&scene.http, &g.target("api"), 1000, 4).await,
        );
    }

    let all_landed = |via: &str| landed(&scene, &gone, via);
    let (guarded, audit, plain) = (
        all_landed("guarded"),
        all_landed("audit"),
        all_landed("plain"),
    );
    println!("incident {BEFORE} -> {AFTER} pods, EDS frozen, traffic during and after the change:");
    for (name, tally) in [("guarded", guarded), ("audit", audit), ("plain", plain)] {
        let sent = during[name].total() + burst_out[name].total();
        println!(
            "  {name:<8} requests sent {sent:>6}; reached a destroyed pod's address: {:>5}; rejected: {:?}",
            tally.dead,
            {
                let mut r = during[name].rejected.clone();
                for (k, v) in &burst_out[name].rejected {
                    *r.entry(k.clone()).or_default() += v;
                }
                r
            }
        );
    }

    // With the filter enforcing: nothing reached a destroyed pod's address,
    // during the change or after it, and nothing failed otherwise.
    assert_eq!(guarded.misrouted(), 0, "guarded: {guarded:?}");
    for out in [&during["guarded"], &burst_out["guarded"]] {
        assert_eq!(out.misrouted(), 0, "{out:?}");
        assert_eq!(out.errors, 0, "{out:?}");
        assert!(out.other_status.is_empty(), "{out:?}");
    }
    assert!(burst_out["guarded"].rejected_for("destroyed") > 0);
    // Without it: the stale endpoints carried requests to the dead addresses.
    assert!(plain.dead > 0, "plain: {plain:?}");
    // Audit blocks nothing: the same dead addresses were reached.
    assert!(audit.dead > 0, "audit: {audit:?}");
    assert_eq!(burst_out["audit"].rejected_total(), 0);
    assert_eq!(during["audit"].rejected_total(), 0);

    // Metrics match what landed, over the bounded burst.
    for g in scene.gateways.iter().filter(|g| g.guarded) {
        let sent = answered(&during[&g.name]) + answered(&burst_out[&g.name]);
        g.wait_counted(sent).unwrap();
    }
    let guarded_gw = scene.gateway("guarded").unwrap();
    let audit_gw = scene.gateway("audit").unwrap();
    let delta = |name: &str, i: usize, now: u64| now - before[name].0[i];
    let rejected_now = guarded_gw.requests("destroyed", "reject").unwrap();
    assert_eq!(
        delta("guarded", 0, rejected_now),
        burst_out["guarded"].rejected_for("destroyed"),
        "guarded: destroyed/reject counter vs 503s the clients saw"
    );
    let member_now = guarded_gw.requests("member", "allow").unwrap();
    assert_eq!(
        delta("guarded", 2, member_now),
        burst_out["guarded"].right,
        "guarded: member/allow counter vs 200s the clients saw"
    );
    let served = pods::via(&scene.world.tallies(), "guarded");
    assert_eq!(
        delta("guarded", 2, member_now),
        served.right - served_before.right,
        "guarded: member/allow counter vs requests counted at the pods"
    );
    assert_eq!(served.total(), served.right, "{served:?}");
    let audited_now = audit_gw.requests("destroyed", "audit").unwrap();
    let audit_dead_in_burst = audit.dead - before["audit"].1.dead;
    assert_eq!(
        delta("audit", 1, audited_now),
        audit_dead_in_burst,
        "audit: destroyed/audit counter vs requests that reached a destroyed pod's address"
    );
    assert_eq!(audit_dead_in_burst, burst_out["audit"].dead);
    assert_eq!(audit_gw.requests("destroyed", "reject").unwrap(), 0);

    // /stats/prometheus carries the same numbers, with labels.
    let prom = guarded_gw.prometheus().unwrap();
    assert_eq!(
        prometheus_value(
            &prom,
            PROM_REQUESTS,
            &[
                ("staleguard_reason", "destroyed"),
                ("staleguard_action", "reject")
            ]
        ),
        Some(rejected_now),
        "{prom}"
    );
    let prom = audit_gw.prometheus().unwrap();
    assert_eq!(
        prometheus_value(
            &prom,
            PROM_REQUESTS,
            &[
                ("staleguard_reason", "destroyed"),
                ("staleguard_action", "audit")
            ]
        ),
        Some(audited_now)
    );
}
