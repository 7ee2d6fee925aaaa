//! The stuck control plane with the validator on a real Kubernetes API server
//! (the test API server, see docs/apiserver.md) instead of its file source:
//! pods are deleted and an IP goes to another service's pod through the API,
//! as a kubelet and the EndpointSlice controller would write them, while
//! Envoy's EDS stays frozen.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams};
use serde_json::json;
use staleguard_tests::apiserver::{ApiServer, Cluster, SliceEndpoint};
use staleguard_tests::pods::via;
use staleguard_tests::scene::{self, Expect, Scene};
use staleguard_tests::traffic::burst;
use staleguard_tests::validator::Source;
use staleguard_tests::world::{World, NAMESPACE};

/// Writes a service's slice from the world's pods, with their uids from the API.
async fn write_slice(api: &ApiServer, cluster: &Cluster, world: &World, service: &str) {
    let pods = Api::<Pod>::namespaced(api.client(), NAMESPACE);
    let mut endpoints = Vec::new();
    for p in world.pods_of(service) {
        let pod = pods.get(&p.name).await.unwrap();
        endpoints.push(SliceEndpoint::pod(&p.ip.to_string(), &pod));
    }
    cluster
        .slice(NAMESPACE, service, i32::from(world.port()), &endpoints)
        .await
        .unwrap();
}

/// Creates a world pod in the API and runs it on its IP, as a kubelet would.
async fn run_pod(cluster: &Cluster, world: &World, name: &str) {
    let p = world.pod(name).unwrap();
    cluster.pod(NAMESPACE, name, &p.service).await.unwrap();
    cluster
        .run_pod(NAMESPACE, name, &p.ip.to_string(), true)
        .await
        .unwrap();
}

/// Deletes a pod at once (grace 0: no kubelet here to finish a graceful one).
async fn delete_pod(api: &ApiServer, name: &str) {
    let params = DeleteParams {
        grace_period_seconds: Some(0),
        ..DeleteParams::default()
    };
    Api::<Pod>::namespaced(api.client(), NAMESPACE)
        .delete(name, &params)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_the_kube_source_destroyed_and_recycled_ips_are_never_reached_with_on_reject_reject(
) {
    let Some(deps) = scene::deps() else { return };
    let Some(api) = ApiServer::start().await.unwrap() else {
        return;
    };
    let cluster = Cluster::new(api.client());
    let mut world = World::new().unwrap();
    world.add_service("api", 6).await.unwrap();
    world.add_service("billing", 1).await.unwrap();
    cluster.namespace(NAMESPACE).await.unwrap();
    for service in ["api", "billing"] {
        cluster
            .service(NAMESPACE, service, i32::from(world.port()))
            .await
            .unwrap();
        for p in world.pods_of(service) {
            run_pod(&cluster, &world, &p.name).await;
        }
        write_slice(&api, &cluster, &world, service).await;
    }
    let specs = [
        // Rejections, not replays: this test counts 503s by reason (retry,
        // the shipped default, is tested in filter_retry and e2e_demo).
        world.guarded("guarded", json!({"on_reject": "reject"})),
        world.unguarded("plain"),
    ];
    let kube = Source::Kube(api.kubeconfig());
    let mut scene = Scene::start_on(&deps, world, kube, &[], &specs)
        .await
        .unwrap();
    scene.world.freeze_eds();

    // Two api pods are deleted; a third api pod's IP goes to a new billing pod.
    let api_pods = scene.world.pods_of("api");
    let mut expect: Vec<Expect> = Vec::new();
    let mut destroyed = Vec::new();
    for p in &api_pods[..2] {
        delete_pod(&api, &p.name).await;
        scene.world.destroy(&p.name).unwrap();
        destroyed.push(p.ip);
        expect.push((World::key("api"), p.ip, "destroyed"));
    }
    let recycled = api_pods[2].ip;
    delete_pod(&api, &api_pods[2].name).await;
    let new_pod = scene.world.recycle(recycled, "billing").unwrap();
    run_pod(&cluster, &scene.world, &new_pod).await;
    for service in ["api", "billing"] {
        write_slice(&api, &cluster, &scene.world, service).await;
    }
    expect.push((World::key("api"), recycled, "recycled"));
    expect.push((World::key("billing"), recycled, "member"));
    scene.sync_told(&expect).await.unwrap();

    let guarded = scene.gateway("guarded").unwrap();
    let plain = scene.gateway("plain").unwrap();
    let g = burst(&scene.http, &guarded.target("api"), 600, 4).await;
    let p = burst(&scene.http, &plain.target("api"), 600, 4).await;
    let dead = scene.world.tallies_at(&destroyed);
    let taken = scene.world.tallies_at(&[recycled]);
    println!(
        "kube source, EDS frozen, 2 of 6 api pods deleted and 1 IP recycled to billing: \
         guarded reached {} dead and {} billing of {}; unguarded {} dead and {} billing of {}",
        via(&dead, "guarded").dead,
        via(&taken, "guarded").wrong_service,
        g.total(),
        via(&dead, "plain").dead,
        via(&taken, "plain").wrong_service,
        p.total()
    );
    assert_eq!(via(&dead, "guarded").total(), 0);
    assert_eq!(via(&taken, "guarded").total(), 0);
    assert_eq!(g.misrouted(), 0, "{g:?}");
    assert!(g.rejected_for("destroyed") > 0, "{g:?}");
    assert!(g.rejected_for("recycled") > 0, "{g:?}");
    assert_eq!(
        g.right + g.rejected_for("destroyed") + g.rejected_for("recycled"),
        600,
        "{g:?}"
    );
    assert!(via(&dead, "plain").dead > 0);
    assert!(via(&taken, "plain").wrong_service > 0);
}
