//! The validator's kube source when the API server misbehaves for real:
//! compaction and restart (410 Gone, relist), a kill mid-stream, a freeze.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use staleguard_core::{Reason, ServiceKey};
use staleguard_tests::apiserver::{ApiServer, Cluster, SliceEndpoint};
use staleguard_tests::kube_source::{parse_ip, KubeSource, VALIDATOR_USER_AGENT};
use staleguard_validator::source::kube::Scope;

const WAIT: Duration = Duration::from_secs(30);
const NS: &str = "shop";

/// Pod name -> IP for every pod the API holds with an IP, and whether it is
/// terminating: the truth the index must end up equal to.
async fn truth(cluster_client: &kube::Client) -> BTreeMap<String, (String, bool)> {
    let pods = Api::<Pod>::all(cluster_client.clone())
        .list(&ListParams::default())
        .await
        .unwrap();
    pods.items
        .into_iter()
        .filter_map(|p| {
            let ip = p.status.as_ref()?.pod_ip.clone()?;
            let name = p.metadata.name.clone()?;
            Some((name, (ip, p.metadata.deletion_timestamp.is_some())))
        })
        .collect()
}

/// The index's view in the same shape.
fn indexed(source: &KubeSource) -> BTreeMap<String, (String, bool)> {
    let snapshot = source.shared.read().snapshot(Default::default());
    snapshot
        .records
        .iter()
        .flat_map(|r| {
            r.pods
                .iter()
                .map(move |p| (p.name.clone(), (r.ip.to_string(), p.terminating)))
        })
        .collect()
}

async fn wait_exact(source: &KubeSource, client: &kube::Client) {
    let want = truth(client).await;
    let result = source
        .wait_for("the index equals the API's pods", WAIT, |_| {
            indexed(source) == want
        })
        .await;
    if let Err(e) = result {
        panic!("{e}\nwant {want:?}\nhave {:?}", indexed(source));
    }
}

fn ip_of(i: usize) -> String {
    format!("10.3.{}.{}", i / 200, i % 200 + 1)
}

/// Creates `n` running pods of `app` with IPs from `first` on, and its slice.
async fn populate(cluster: &Cluster, app: &str, first: usize, n: usize) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut endpoints = Vec::new();
    for i in first..first + n {
        let name = format!("{app}-{i}");
        let ip = ip_of(i);
        cluster.pod(NS, &name, app).await.unwrap();
        let pod = cluster.run_pod(NS, &name, &ip, true).await.unwrap();
        endpoints.push(SliceEndpoint::pod(&ip, &pod));
        out.push((name, ip));
    }
    cluster.slice(NS, app, 8080, &endpoints).await.unwrap();
    out
}

async fn start() -> Option<(ApiServer, Cluster)> {
    let server = ApiServer::start().await.unwrap()?;
    let cluster = Cluster::new(server.client());
    cluster.namespace(NS).await.unwrap();
    cluster.service(NS, "cart", 8080).await.unwrap();
    cluster.service(NS, "pay", 8080).await.unwrap();
    Some((server, cluster))
}

/// Compact etcd and restart the server: every watch's resourceVersion is now
/// older than anything the server can replay, so each gets 410 Gone and
/// relists. The relist is buffered: no live IP is ever reported gone, and the
/// index ends exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compaction_and_restart_force_a_relist_that_loses_no_live_ip() {
    let Some((mut server, cluster)) = start().await else {
        return;
    };
    let source = KubeSource::start(&server, Duration::from_secs(120))
        .await
        .unwrap();
    let live = populate(&cluster, "cart", 0, 20).await;
    let doomed = populate(&cluster, "pay", 100, 10).await;
    source.synced().await.unwrap();
    wait_exact(&source, &server.client()).await;
    let lists_before: Vec<u64> = source
        .shared
        .watch_health()
        .iter()
        .map(|h| h.inits)
        .collect();

    // A watch of nothing we watch moves etcd's revision past every watch's
    // last resourceVersion, so none of them can resume after the restart.
    cluster.namespace("bump").await.unwrap();
    let revision = server.compact().await.unwrap();
    assert!(revision > 0);

    // Watch the index all through: a live pod's IP must never look gone.
    let stop = Arc::new(AtomicBool::new(false));
    let violations = Arc::new(AtomicU64::new(0));
    let samples = Arc::new(AtomicU64::new(0));
    let cart = ServiceKey::new(NS, "cart");
    let watcher = {
        let (stop, violations, samples) = (stop.clone(), violations.clone(), samples.clone());
        let shared = source.shared.clone();
        let live = live.clone();
        let cart = cart.clone();
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                {
                    let index = shared.read();
                    for (_, ip) in &live {
                        let ok = index
                            .record(parse_ip(ip))
                            .is_some_and(|r| r.pods.iter().any(|p| p.is_member_of(&cart)));
                        if !ok {
                            violations.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
                samples.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        })
    };

    server.kill();
    server.restart().await.unwrap();
    // Changes while the watches are down or relisting: the relist must
    // deliver them (as deletes the index computes itself).
    let cluster = Cluster::new(server.client());
    for (name, _) in &doomed {
        cluster.force_delete_pod(NS, name).await.unwrap();
    }
    source
        .wait_for("every watch relisted", WAIT, |_| {
            source
                .shared
                .watch_health()
                .iter()
                .zip(&lists_before)
                .all(|(h, before)| h.inits > *before && h.synced)
        })
        .await
        .unwrap();
    wait_exact(&source, &server.client()).await;
    stop.store(true, Ordering::Relaxed);
    watcher.await.unwrap();

    assert!(samples.load(Ordering::Relaxed) > 10, "the sampler ran");
    assert_eq!(
        violations.load(Ordering::Relaxed),
        0,
        "a live IP looked gone during the relist"
    );
    for (_, ip) in &doomed {
        assert_eq!(
            source.verdict(ip, &ServiceKey::new(NS, "pay")).reason,
            Reason::Destroyed
        );
    }
    let errors: u64 = source.shared.watch_health().iter().map(|h| h.errors).sum();
    assert!(errors >= 3, "each watch saw its stream break or expire");
    // The restarted server counted the validator's requests: the restart
    // forced relists (410 Gone), and all of them were lists and watches. Not
    // every watch has to relist: in CI one endpointslices watch resumed on the
    // restarted server from a resourceVersion it still served (one watch, no
    // list), while pods and services listed again; the relist of every watch
    // on the validator's side is asserted above.
    let counts = server.request_counts().await.unwrap();
    let ours: Vec<_> = counts
        .iter()
        .filter(|c| c.user_agent == VALIDATOR_USER_AGENT)
        .collect();
    let lists: u64 = ours
        .iter()
        .filter(|c| c.verb == "list")
        .map(|c| c.count)
        .sum();
    assert!(lists >= 1, "no relist at all after the restart: {counts:?}");
    assert!(
        ours.iter().all(|c| c.verb == "list" || c.verb == "watch"),
        "the validator made a request other than list or watch: {counts:?}"
    );
}

/// Kill the server while pods churn, restart it, keep churning: the index
/// ends equal to the API.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_mid_stream_ends_exact() {
    let Some((mut server, cluster)) = start().await else {
        return;
    };
    let source = KubeSource::start(&server, Duration::from_secs(120))
        .await
        .unwrap();
    populate(&cluster, "cart", 0, 10).await;
    source.synced().await.unwrap();
    wait_exact(&source, &server.client()).await;

    let churn = |cluster: Cluster, from: usize| async move {
        for i in from..from + 15 {
            let name = format!("pay-{i}");
            // Writes may fail while the server is down: skip those.
            if cluster.pod(NS, &name, "pay").await.is_ok() {
                let _ = cluster.run_pod(NS, &name, &ip_of(i), true).await;
            }
            if i % 3 == 0 {
                let _ = cluster
                    .force_delete_pod(NS, &format!("cart-{}", i - from))
                    .await;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let first = tokio::spawn(churn(cluster.clone(), 100));
    // Pacing, not a wait: the kill lands somewhere in the churn; any point
    // (even before its first write) leaves the assertions below true.
    tokio::time::sleep(Duration::from_millis(150)).await;
    server.kill();
    first.await.unwrap();
    server.restart().await.unwrap();
    churn(Cluster::new(server.client()), 200).await;
    wait_exact(&source, &server.client()).await;
    assert!(
        source.shared.watch_health().iter().all(|h| h.errors >= 1),
        "every watch saw the kill"
    );
}

/// Freeze the server (SIGSTOP) longer than the staleness bound: the validator
/// reports itself stale within the bound (and a verdict turns `stale`), and
/// fresh again after SIGCONT.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_server_makes_the_validator_stale_within_the_bound_and_it_recovers() {
    let Some((server, cluster)) = start().await else {
        return;
    };
    let bound = Duration::from_secs(3);
    let source = KubeSource::start(&server, bound).await.unwrap();
    let pods = populate(&cluster, "cart", 0, 2).await;
    source.synced().await.unwrap();

    // A heartbeat of writes to all three kinds keeps every watch busy, as a
    // live cluster would; each write gives up quickly while frozen.
    let stop = Arc::new(AtomicBool::new(false));
    let heartbeat = {
        let stop = stop.clone();
        let cluster = cluster.clone();
        let pods = pods.clone();
        tokio::spawn(async move {
            let mut beat = 0u64;
            while !stop.load(Ordering::Relaxed) {
                beat += 1;
                let quick = Duration::from_millis(400);
                let (name, ip) = &pods[(beat % 2) as usize];
                let _ =
                    tokio::time::timeout(quick, cluster.run_pod(NS, name, ip, beat % 4 < 2)).await;
                let _ =
                    tokio::time::timeout(quick, cluster.service(NS, &format!("beat-{beat}"), 80))
                        .await;
                let _ = tokio::time::timeout(
                    quick,
                    cluster.named_slice(NS, "beat", "beat", 80 + (beat % 2) as i32, &[]),
                )
                .await;
                tokio::time::sleep(Duration::from_millis(150)).await;
            }
        })
    };
    let fresh_for = |dur: Duration| {
        let source = &source;
        async move {
            let until = Instant::now() + dur;
            while Instant::now() < until {
                if !source.shared.freshness().fresh {
                    return false;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            true
        }
    };
    source
        .wait_for("fresh", WAIT, |_| source.shared.freshness().fresh)
        .await
        .unwrap();
    assert!(
        fresh_for(bound + Duration::from_secs(1)).await,
        "with a heartbeat the data stays fresh longer than the bound"
    );
    let cart = ServiceKey::new(NS, "cart");
    assert_eq!(source.verdict(&pods[0].1, &cart).reason, Reason::Member);

    server.freeze().unwrap();
    let frozen = Instant::now();
    let took = source
        .wait_for("stale", bound * 3, |_| !source.shared.freshness().fresh)
        .await
        .unwrap();
    let age = source.shared.freshness().age_ms.unwrap_or(0);
    eprintln!("stale {took:?} after the freeze (age {age} ms, bound {bound:?})");
    // The age is measured from the last event, which came before the freeze.
    assert!(
        frozen.elapsed() <= bound + Duration::from_secs(2),
        "stale only {:?} after the freeze",
        frozen.elapsed()
    );
    assert_eq!(source.verdict(&pods[0].1, &cart).reason, Reason::Stale);

    server.thaw().unwrap();
    let recovered = source
        .wait_for("fresh again", WAIT, |_| source.shared.freshness().fresh)
        .await
        .unwrap();
    eprintln!("fresh again {recovered:?} after SIGCONT");
    // The watches come back after the thaw, and a relist may briefly take the
    // freshness it just regained: the verdict must come back to Member.
    let thawed = Instant::now();
    while source.verdict(&pods[0].1, &cart).reason != Reason::Member {
        assert!(
            thawed.elapsed() < WAIT,
            "still {:?} {:?} after the thaw",
            source.verdict(&pods[0].1, &cart).reason,
            thawed.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.store(true, Ordering::Relaxed);
    heartbeat.await.unwrap();
}

/// A quiet cluster is not a stale one: with watches renewed every second, a
/// validator with a 3 s bound stays fresh through 4.5 s without a single
/// change, while one left on kube-runtime's default (a watch held for 290 s,
/// bookmarks swallowed) turns stale in the same silence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_renewals_keep_a_quiet_cluster_fresh() {
    let Some((server, cluster)) = start().await else {
        return;
    };
    let bound = Duration::from_secs(3);
    let renewing = KubeSource::start_with(
        &server,
        bound,
        Scope {
            watch_timeout: Some(Duration::from_secs(1)),
            ..Scope::default()
        },
    )
    .await
    .unwrap();
    let holding = KubeSource::start(&server, bound).await.unwrap();
    let pods = populate(&cluster, "cart", 0, 2).await;
    for source in [&renewing, &holding] {
        source
            .wait_for("fresh and holding both pods", WAIT, |ix| {
                source.shared.freshness().fresh && ix.stats().pods == 2
            })
            .await
            .unwrap();
    }
    // Silence: no writes from here on.
    let quiet = Instant::now();
    let mut holding_went_stale = None;
    while quiet.elapsed() < bound + Duration::from_millis(1500) {
        assert!(
            renewing.shared.freshness().fresh,
            "the renewing validator read stale {:?} into the silence: {:?}",
            quiet.elapsed(),
            renewing.shared.watch_health()
        );
        if holding_went_stale.is_none() && !holding.shared.freshness().fresh {
            holding_went_stale = Some(quiet.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let went = holding_went_stale.expect("without renewals, silence reads as stale");
    eprintln!("without renewals: stale {went:?} into the silence (bound {bound:?})");
    let cart = ServiceKey::new(NS, "cart");
    assert_eq!(renewing.verdict(&pods[0].1, &cart).reason, Reason::Member);
    assert_eq!(holding.verdict(&pods[0].1, &cart).reason, Reason::Stale);
    let ages: Vec<_> = renewing
        .shared
        .watch_health()
        .iter()
        .map(|h| h.last_event_age)
        .collect();
    assert!(
        ages.iter()
            .all(|a| a.is_some_and(|a| a < Duration::from_secs(2))),
        "every watch renewed within the last 2 s: {ages:?}"
    );
}
