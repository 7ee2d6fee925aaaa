//! The validator dies mid-traffic and comes back: under the default policy
//! (fail open) nothing is rejected while it is away, even once the filter's
//! data turns stale; after the restart (a new epoch) the filter resyncs and
//! enforcement resumes. The new validator never saw the pods that went while
//! it was away (no tombstones), and they are 6 of 10: the blast-radius guard
//! holds that reset until it persists for `guard.confirm_ms`, failing open
//! meanwhile, then applies it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use serde_json::json;
use staleguard_tests::envoy::stats::{requests_total, STAT_FRESH, STAT_GUARD_HELD};
use staleguard_tests::pods::via;
use staleguard_tests::scene::{self, Scene, SYNC_TIMEOUT};
use staleguard_tests::traffic::{burst, Load};
use staleguard_tests::world::World;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_validator_outage_rejects_nothing_and_enforcement_resumes_after_resync_with_max_staleness_ms_guard_confirm_ms_3000_and_on_reject_reject(
) {
    let Some(deps) = scene::deps() else { return };
    let mut world = World::new().unwrap();
    world.add_service("api", 10).await.unwrap();
    // The knobs: data is stale 3 s after the last successful sync (which needs
    // long polls shorter than that), retries stay prompt, and the guard
    // confirms a held change after as long as data takes to go stale, as the
    // shipped defaults do at 60 s each.
    let knobs = json!({
        "max_staleness_ms": 3000,
        "poll_wait_s": 1,
        "backoff_max_ms": 500,
        "guard": {"confirm_ms": 3000},
        // Counts rejections after the resync: a replay would hide them.
        "on_reject": "reject"
    });
    let specs = [world.guarded("guarded", knobs)];
    let mut scene = Scene::start(&deps, world, &["--file-poll", "100ms"], &specs)
        .await
        .unwrap();
    scene.world.freeze_eds();
    // Fields, not `scene.gateway()`: the validator is killed while we hold it.
    let guarded = &scene.gateways[0];
    let load = Load::start(scene.http.clone(), guarded.target("api"), 2, None, None);
    // Pacing, not a wait: traffic before the kill, so the outage counts
    // include requests from before it; no assertion depends on the length.
    tokio::time::sleep(Duration::from_millis(500)).await;

    // Kill it (SIGKILL) and keep the traffic going until the filter's data
    // is stale, and a while longer.
    scene.validator.kill();
    guarded
        .wait_stats("index_fresh = 0", SYNC_TIMEOUT, |s| {
            s.get(STAT_FRESH) == Some(&0)
        })
        .unwrap();
    // Pacing, not a wait: traffic keeps running on stale data for a window;
    // what is asserted (every request counted, verdicts) holds for any length.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let outage = load.stop().await;
    // Every request of the outage counted (on the filter's next tick).
    guarded.wait_counted(outage.total()).unwrap();
    let stats = guarded.stats().unwrap();
    let stale_allowed = requests_total(&stats, "stale", "allow");
    println!(
        "validator down: {} requests, {} judged on stale data and allowed, {} rejected",
        outage.total(),
        stale_allowed,
        outage.rejected_total()
    );
    assert_eq!(outage.rejected_total(), 0, "{outage:?}");
    assert_eq!(outage.right, outage.total(), "{outage:?}");
    assert!(
        stale_allowed > 0,
        "the outage never reached the stale state"
    );
    assert_eq!(requests_total(&stats, "stale", "reject"), 0);

    // While it is away, pods go (EDS still frozen). Then it comes back with a
    // new epoch; the filter resyncs, and only then do the addresses change.
    let gone = scene.world.scale_down("api", 4).unwrap();
    scene.world.publish().unwrap();
    scene.restart_validator().await.unwrap();
    let expect: Vec<_> = gone
        .iter()
        .map(|ip| (World::key("api"), *ip, "destroyed"))
        .collect();
    scene.sync(&expect).await.unwrap();

    let guarded = scene.gateway("guarded").unwrap();
    let stats = guarded.stats().unwrap();
    let count = |name: &str| stats.get(name).copied().unwrap_or(0);
    println!(
        "guard: {} answers held, {} confirmed",
        count(STAT_GUARD_HELD),
        count("wasmcustom.staleguard_filter_guard_confirmed_total")
    );
    assert!(
        count(STAT_GUARD_HELD) >= 1,
        "60% gone without evidence is held"
    );
    assert_eq!(
        count("wasmcustom.staleguard_filter_guard_confirmed_total"),
        1
    );
    let after = burst(&scene.http, &guarded.target("api"), 600, 4).await;
    let landed = via(&scene.world.tallies_at(&gone), "guarded");
    println!(
        "after the restart: {} requests, {:?} rejected, {} reached a destroyed pod",
        after.total(),
        after.rejected,
        landed.dead
    );
    assert_eq!(landed.dead, 0, "{landed:?}");
    assert!(after.rejected_for("destroyed") > 0, "{after:?}");
    assert_eq!(
        after.right + after.rejected_for("destroyed"),
        600,
        "{after:?}"
    );
}
