//! The validator's kube source against a real API server (k8s.io/apiserver +
//! etcd, see docs/apiserver.md): a pod's life as the API really reports it,
//! and the index and the verdict after every step.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use staleguard_core::wire::Via;
use staleguard_core::{Action, Reason, ServiceKey};
use staleguard_tests::apiserver::{ApiServer, Cluster, SliceEndpoint};
use staleguard_tests::kube_source::{holders, member_via, KubeSource};
use staleguard_validator::source::kube::Scope;

const WAIT: Duration = Duration::from_secs(15);
const NS: &str = "shop";

/// An API server with the services cart and pay, and the kube source
/// watching it within `scope`, synced.
async fn setup_with(scope: Scope) -> Option<(ApiServer, Cluster, KubeSource)> {
    let server = ApiServer::start().await.unwrap()?;
    let cluster = Cluster::new(server.client());
    cluster.namespace(NS).await.unwrap();
    cluster.service(NS, "cart", 8080).await.unwrap();
    cluster.service(NS, "pay", 8080).await.unwrap();
    let source = KubeSource::start_with(&server, Duration::from_secs(120), scope)
        .await
        .unwrap();
    source.synced().await.unwrap();
    Some((server, cluster, source))
}

async fn setup() -> Option<(ApiServer, Cluster, KubeSource)> {
    setup_with(Scope::default()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pods_life_create_ip_terminate_force_delete_and_recycle() {
    let Some((server, cluster, source)) = setup().await else {
        return;
    };
    let cart = ServiceKey::new(NS, "cart");
    let pay = ServiceKey::new(NS, "pay");
    let ip = "10.1.0.7";
    source
        .wait_for("both services known", WAIT, |ix| {
            ix.knows_service(&cart) && ix.knows_service(&pay)
        })
        .await
        .unwrap();

    // Created: scheduled but no IP yet. Nothing holds the IP.
    let pod = cluster.pod(NS, "cart-1", "cart").await.unwrap();
    assert_eq!(source.record(ip), None);
    assert_eq!(source.verdict(ip, &cart).reason, Reason::Destroyed);

    // The kubelet reports the IP and readiness through pods/status.
    let running = cluster.run_pod(NS, "cart-1", ip, true).await.unwrap();
    assert_eq!(
        running.spec.as_ref().unwrap().node_name.as_deref(),
        Some(staleguard_tests::apiserver::NODE),
        "a status write must not touch the spec"
    );
    source
        .wait_record("cart-1 holds the IP, ready", ip, |r| {
            r.pods.len() == 1 && r.pods[0].ready
        })
        .await
        .unwrap();
    let record = source.record(ip).unwrap();
    assert_eq!(record.pods[0].name, "cart-1");
    assert_eq!(
        Some(&record.pods[0].uid),
        pod.metadata.uid.as_ref(),
        "the index knows the pod by its uid"
    );
    assert!(record.pods[0].is_member_of(&cart));
    assert_eq!(source.verdict(ip, &cart).reason, Reason::Member);
    assert_eq!(source.verdict(ip, &pay).reason, Reason::Recycled);

    // The EndpointSlice controller lists it: membership now by slice too.
    cluster
        .slice(NS, "cart", 8080, &[SliceEndpoint::pod(ip, &running)])
        .await
        .unwrap();
    source
        .wait_record("cart-1 is a member by slice and selector", ip, |r| {
            member_via(r, &cart, Via::Both)
        })
        .await
        .unwrap();

    // Graceful delete of a bound pod: the API keeps it with a
    // deletionTimestamp (no kubelet finishes it), the index says terminating.
    let still = cluster.delete_pod(NS, "cart-1").await.unwrap();
    let still = still.expect("a bound pod is deleted gracefully and stays");
    assert!(still.metadata.deletion_timestamp.is_some());
    source
        .wait_record("cart-1 terminating", ip, |r| {
            r.pods.len() == 1 && r.pods[0].terminating
        })
        .await
        .unwrap();
    let verdict = source.verdict(ip, &cart);
    assert_eq!(verdict.reason, Reason::Terminating);
    assert_eq!(
        verdict.action,
        Action::Allow,
        "draining pods may still serve"
    );
    assert!(cluster.get_pod(NS, "cart-1").await.unwrap().is_some());

    // Force delete: gone at once; the IP is destroyed, with a tombstone.
    cluster.force_delete_pod(NS, "cart-1").await.unwrap();
    assert!(cluster.get_pod(NS, "cart-1").await.unwrap().is_none());
    source.wait_unheld("no pod holds the IP", ip).await.unwrap();
    let verdict = source.verdict(ip, &cart);
    assert_eq!(verdict.reason, Reason::Destroyed);
    assert_eq!(verdict.action, Action::Reject);
    let tombstone = source.record(ip).and_then(|r| r.tombstone);
    assert_eq!(tombstone.map(|t| t.pod), Some(format!("{NS}/cart-1")));

    // The IP is recycled to a pod of another service while cart's slice still
    // (stale) lists it for cart-1: for cart it is recycled, for pay a member.
    cluster.pod(NS, "pay-1", "pay").await.unwrap();
    cluster.run_pod(NS, "pay-1", ip, true).await.unwrap();
    source
        .wait_record("pay-1 holds the recycled IP", ip, |r| {
            holders(r) == ["pay-1"]
        })
        .await
        .unwrap();
    let verdict = source.verdict(ip, &cart);
    assert_eq!(verdict.reason, Reason::Recycled);
    assert_eq!(verdict.action, Action::Reject);
    assert_eq!(source.verdict(ip, &pay).reason, Reason::Member);
    drop(server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unscheduled_pod_and_a_finished_pod_go_at_once() {
    let Some((server, cluster, source)) = setup().await else {
        return;
    };
    let cart = ServiceKey::new(NS, "cart");
    // Unscheduled: no kubelet would ever finish it, so no grace period.
    cluster.pod_on(NS, "pending-1", "cart", None).await.unwrap();
    assert!(cluster.delete_pod(NS, "pending-1").await.unwrap().is_none());
    assert!(cluster.get_pod(NS, "pending-1").await.unwrap().is_none());

    // Finished (Succeeded) while holding an IP: it stops holding it, and a
    // delete removes it at once although it is bound.
    let ip = "10.1.9.9";
    cluster.pod(NS, "job-1", "cart").await.unwrap();
    cluster.run_pod(NS, "job-1", ip, true).await.unwrap();
    source
        .wait_record("job-1 holds its IP", ip, |r| holders(r) == ["job-1"])
        .await
        .unwrap();
    let patch = serde_json::json!({"status": {"phase": "Succeeded"}});
    kube::Api::<k8s_openapi::api::core::v1::Pod>::namespaced(server.client(), NS)
        .patch_status(
            "job-1",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&patch),
        )
        .await
        .unwrap();
    source
        .wait_unheld("a finished pod holds no IP", ip)
        .await
        .unwrap();
    assert_eq!(source.verdict(ip, &cart).reason, Reason::Destroyed);
    assert!(cluster.delete_pod(NS, "job-1").await.unwrap().is_none());
    assert!(cluster.get_pod(NS, "job-1").await.unwrap().is_none());
}

/// The two watches race: the slice may arrive before the pod's IP, or after.
/// Either way the index ends with one member by slice and selector.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slice_and_pod_events_in_both_orders() {
    let Some((_server, cluster, source)) = setup().await else {
        return;
    };
    let cart = ServiceKey::new(NS, "cart");

    // Slice first: it names cart-a and 10.2.0.1 before the pod holds the IP.
    let a = cluster.pod(NS, "cart-a", "cart").await.unwrap();
    let ip_a = "10.2.0.1";
    cluster
        .named_slice(NS, "cart", "cart-a", 8080, &[SliceEndpoint::pod(ip_a, &a)])
        .await
        .unwrap();
    // The pod exists without an IP: the slice is trusted to say which IP it
    // got, so the pod holds it provisionally and is a member at once.
    source
        .wait_record("cart-a a provisional member", ip_a, |r| {
            holders(r) == ["cart-a"] && r.pods[0].services.iter().any(|m| m.service == cart)
        })
        .await
        .unwrap();
    assert_eq!(
        source.verdict(ip_a, &cart).reason,
        Reason::Member,
        "a slice naming a pod that has no IP yet must not make the IP destroyed or foreign"
    );
    cluster.run_pod(NS, "cart-a", ip_a, true).await.unwrap();

    // Pod first: cart-b holds 10.2.0.2, a member by selector, then the slice.
    let ip_b = "10.2.0.2";
    let b = cluster.pod(NS, "cart-b", "cart").await.unwrap();
    cluster.run_pod(NS, "cart-b", ip_b, true).await.unwrap();
    source
        .wait_record("cart-b a member by selector", ip_b, |r| {
            member_via(r, &cart, Via::Selector)
        })
        .await
        .unwrap();
    assert_eq!(source.verdict(ip_b, &cart).reason, Reason::Member);
    cluster
        .named_slice(NS, "cart", "cart-b", 8080, &[SliceEndpoint::pod(ip_b, &b)])
        .await
        .unwrap();

    for (ip, pod) in [(ip_a, "cart-a"), (ip_b, "cart-b")] {
        source
            .wait_record(&format!("{pod} a member by slice and selector"), ip, |r| {
                holders(r) == [pod] && member_via(r, &cart, Via::Both)
            })
            .await
            .unwrap();
        assert_eq!(source.verdict(ip, &cart).reason, Reason::Member);
    }

    // And the reverse on the way out: the slice entry goes first, then the pod.
    cluster.delete_slice(NS, "cart-a").await.unwrap();
    source
        .wait_record("cart-a a member by selector only", ip_a, |r| {
            member_via(r, &cart, Via::Selector)
        })
        .await
        .unwrap();
    assert_eq!(source.verdict(ip_a, &cart).reason, Reason::Member);
    cluster.force_delete_pod(NS, "cart-a").await.unwrap();
    source
        .wait_unheld("cart-a's IP destroyed", ip_a)
        .await
        .unwrap();
    assert_eq!(source.verdict(ip_a, &cart).reason, Reason::Destroyed);
    assert_eq!(source.verdict(ip_b, &cart).reason, Reason::Member);
}

/// `--pod-selector app=pay`: the validator never sees cart's pods. A running
/// cart pod listed in cart's slice must not be judged destroyed for cart:
/// cart is out of scope, treated as unknown (allowed), and the index says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_narrowed_pod_watch_never_judges_the_pods_it_does_not_see() {
    let scope = Scope {
        pod_selector: Some("app=pay".into()),
        ..Scope::default()
    };
    let Some((server, cluster, source)) = setup_with(scope).await else {
        return;
    };
    let (cart, pay) = (ServiceKey::new(NS, "cart"), ServiceKey::new(NS, "pay"));
    let (cart_ip, pay_ip) = ("10.1.3.1", "10.1.3.2");

    cluster.pod(NS, "cart-1", "cart").await.unwrap();
    let cart_1 = cluster.run_pod(NS, "cart-1", cart_ip, true).await.unwrap();
    cluster
        .slice(NS, "cart", 8080, &[SliceEndpoint::pod(cart_ip, &cart_1)])
        .await
        .unwrap();
    cluster.pod(NS, "pay-1", "pay").await.unwrap();
    let pay_1 = cluster.run_pod(NS, "pay-1", pay_ip, true).await.unwrap();
    cluster
        .slice(NS, "pay", 8080, &[SliceEndpoint::pod(pay_ip, &pay_1)])
        .await
        .unwrap();
    source
        .wait_record("pay-1 is a member of pay by its slice", pay_ip, |r| {
            member_via(r, &pay, Via::Both)
        })
        .await
        .unwrap();
    source
        .wait_for("cart's slice seen", WAIT, |ix| ix.stats().slices == 2)
        .await
        .unwrap();

    // The watch really is narrowed: cart-1 is invisible.
    assert_eq!(source.record(cart_ip), None);
    let verdict = source.verdict(cart_ip, &cart);
    assert_eq!(verdict.reason, Reason::UnknownService, "not destroyed");
    assert_eq!(verdict.action, Action::Allow);
    let why = source.shared.read().out_of_scope(&cart).map(str::to_owned);
    let why = why.expect("the index says why cart is not judged");
    assert!(
        why.contains("does not imply --pod-selector \"app=pay\""),
        "{why}"
    );
    // pay, which the scope covers, is judged as ever: its member is allowed,
    // and an IP none of its (all visible) pods holds is rejected.
    assert_eq!(source.verdict(pay_ip, &pay).reason, Reason::Member);
    assert_eq!(source.verdict(cart_ip, &pay).reason, Reason::Destroyed);
    drop(server);
}
