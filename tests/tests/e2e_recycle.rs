//! IPs that change hands behind a frozen EDS: recycled to another service's
//! pod, and pods draining (terminating), through real Envoy and the validator.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use serde_json::json;
use staleguard_tests::envoy::stats::{requests_total, STAT_GUARD_HELD};
use staleguard_tests::pods::via;
use staleguard_tests::scene::{self, Expect, Scene, SYNC_TIMEOUT};
use staleguard_tests::traffic::burst;
use staleguard_tests::world::World;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ip_recycled_to_another_service_is_never_reached_through_the_stale_cluster_with_on_reject_reject(
) {
    let Some(deps) = scene::deps() else { return };
    let mut world = World::new().unwrap();
    world.add_service("api", 8).await.unwrap();
    world.add_service("billing", 2).await.unwrap();
    let specs = [
        // Rejections, not replays (retry is tested in filter_retry).
        world.guarded("guarded", json!({"on_reject": "reject"})),
        world.unguarded("plain"),
    ];
    let mut scene = Scene::start(&deps, world, &["--file-poll", "100ms"], &specs)
        .await
        .unwrap();
    scene.world.freeze_eds();

    // The old api pods stop; billing pods start on their addresses. The
    // gateway's api cluster still lists them.
    let taken: Vec<_> = scene
        .world
        .pods_of("api")
        .iter()
        .take(3)
        .map(|p| p.ip)
        .collect();
    let mut expect: Vec<Expect> = Vec::new();
    for ip in &taken {
        scene.world.recycle(*ip, "billing").unwrap();
        expect.push((World::key("api"), *ip, "recycled"));
        expect.push((World::key("billing"), *ip, "member"));
    }
    let published = std::time::Instant::now();
    scene.sync(&expect).await.unwrap();
    // Not a timed assertion: the number docs/benchmarks.md quotes.
    println!(
        "recycle: the guarded filter enforced the recycled IPs {} ms after the file changed",
        published.elapsed().as_millis()
    );

    let guarded = scene.gateway("guarded").unwrap();
    let plain = scene.gateway("plain").unwrap();
    let g = burst(&scene.http, &guarded.target("api"), 800, 4).await;
    let p = burst(&scene.http, &plain.target("api"), 800, 4).await;
    let landed = scene.world.tallies_at(&taken);
    let (lg, lp) = (via(&landed, "guarded"), via(&landed, "plain"));
    println!(
        "recycled 3 of 8 api IPs to billing, EDS frozen: reached billing through the api cluster: guarded {} of {}, unguarded {} of {}",
        lg.wrong_service,
        g.total(),
        lp.wrong_service,
        p.total()
    );
    assert_eq!(lg.wrong_service, 0, "{lg:?}");
    assert_eq!(g.misrouted(), 0, "{g:?}");
    assert_eq!(g.rejected_for("recycled"), g.total() - g.right, "{g:?}");
    assert!(g.rejected_for("recycled") > 0);
    assert!(lp.wrong_service > 0, "{lp:?}");
    assert_eq!(p.wrong_service, lp.wrong_service);
    guarded
        .wait_stats("the rejections counted", SYNC_TIMEOUT, |s| {
            requests_total(s, "recycled", "reject") >= g.rejected_for("recycled")
        })
        .unwrap();
    let stats = guarded.stats().unwrap();
    assert_eq!(
        requests_total(&stats, "recycled", "reject"),
        g.rejected_for("recycled")
    );
    assert_eq!(stats.get(STAT_GUARD_HELD).copied().unwrap_or(0), 0, "guard");

    // Billing's own (frozen) cluster still routes right: the new pods are
    // members of billing, and nothing about billing was rejected.
    let b = burst(&scene.http, &guarded.target("billing"), 200, 2).await;
    assert_eq!(b.right, 200, "{b:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminating_pods_follow_the_configured_rule_with_on_reject_reject() {
    let Some(deps) = scene::deps() else { return };
    let mut world = World::new().unwrap();
    world.add_service("api", 6).await.unwrap();
    let specs = [
        world.guarded("default", json!({})),
        world.guarded(
            "strict",
            json!({"policy": {"terminating": "reject"}, "on_reject": "reject"}),
        ),
    ];
    let mut scene = Scene::start(&deps, world, &["--file-poll", "100ms"], &specs)
        .await
        .unwrap();
    scene.world.freeze_eds();
    let draining: Vec<_> = scene
        .world
        .pods_of("api")
        .iter()
        .take(2)
        .map(|p| p.name.clone())
        .collect();
    let mut ips = Vec::new();
    let mut expect: Vec<Expect> = Vec::new();
    for pod in &draining {
        let ip = scene.world.mark_terminating(pod).unwrap();
        ips.push(ip);
        expect.push((World::key("api"), ip, "terminating"));
    }
    scene.sync(&expect).await.unwrap();

    let default = scene.gateway("default").unwrap();
    let strict = scene.gateway("strict").unwrap();
    let d = burst(&scene.http, &default.target("api"), 600, 4).await;
    let s = burst(&scene.http, &strict.target("api"), 600, 4).await;
    let landed = scene.world.tallies_at(&ips);
    println!(
        "2 of 6 api pods terminating: default rule (allow) served {} on them; strict rule (reject) rejected {:?}",
        via(&landed, "default").right, s.rejected
    );
    // Default: terminating pods still serve; nothing rejected.
    assert_eq!(d.right, 600, "{d:?}");
    assert!(via(&landed, "default").right > 0);
    let served = via(&landed, "default").right;
    default
        .wait_stats("the allowances counted", SYNC_TIMEOUT, |s| {
            requests_total(s, "terminating", "allow") >= served
        })
        .unwrap();
    let stats = default.stats().unwrap();
    assert_eq!(
        requests_total(&stats, "terminating", "allow"),
        via(&landed, "default").right
    );
    // Strict: nothing reaches them; the rest is served.
    assert_eq!(via(&landed, "strict").total(), 0);
    assert!(s.rejected_for("terminating") > 0, "{s:?}");
    assert_eq!(s.right + s.rejected_for("terminating"), 600, "{s:?}");
    let rejected = s.rejected_for("terminating");
    strict
        .wait_stats("the rejections counted", SYNC_TIMEOUT, |st| {
            requests_total(st, "terminating", "reject") >= rejected
        })
        .unwrap();
    let stats = strict.stats().unwrap();
    assert_eq!(
        requests_total(&stats, "terminating", "reject"),
        s.rejected_for("terminating")
    );
}
