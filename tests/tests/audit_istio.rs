//! `staleguard-validator audit` on an Istio ingress gateway as the shipped
//! EnvoyFilter leaves it (the filter in the router's upstream filters, not on
//! a cluster): the audit finds that plugin configuration gateway-wide, maps
//! Istio's clusters with it and names the stale endpoints, in real Envoy 1.40.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;

use staleguard_tests::audit::{self, FileValidator, Pod, Truth};
use staleguard_tests::envoy::dependencies;
use staleguard_tests::istio::{
    self, apply_envoyfilter, gateway_output, set_module, shipped_envoyfilter, Protocol, Service,
};
use staleguard_tests::validator;

const TOKEN: &str = "gateway-token-from-a-kubernetes-secret-0123456789";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_audit_maps_an_istio_gateway_with_the_plugin_config_on_its_router() {
    let (Some((_, wasm)), Some(binary)) = (dependencies(), validator::binary()) else {
        return;
    };
    let truth = Truth::default()
        .service("cart", 8080)
        .service("pay", 8080)
        .pod(Pod::new("cart-1", "cart", "127.0.3.41"))
        .pod(Pod::new("pay-1", "pay", "127.0.3.43"));
    let truth = FileValidator::start(&binary, &truth, Some(TOKEN), &[])
        .await
        .unwrap();
    let validator = &truth.validator;
    let token_file = truth.token_file().expect("started with a token");

    // Istio still lists cart-1, a destroyed pod's IP and pay-1's (recycled).
    let eps: Vec<SocketAddr> = ["127.0.3.41:8080", "127.0.3.42:8080", "127.0.3.43:8080"]
        .iter()
        .map(|a| a.parse().unwrap())
        .collect();
    let cart = Service {
        name: "cart".into(),
        namespace: "shop".into(),
        port: 8080,
        protocol: Protocol::Http,
        route_host: "cart.example.com".into(),
        endpoints: eps,
    };
    let services = [cart.clone()];
    let mut output = gateway_output(&services, 8080);
    apply_envoyfilter(&mut output, &shipped_envoyfilter().unwrap()).unwrap();
    set_module(&mut output, Some(&wasm), None);
    let gateway = istio::run(
        "istio-audit",
        &output,
        &services,
        validator.listen,
        None,
        TOKEN,
    )
    .unwrap()
    .expect("Envoy, checked above");

    let args: Vec<String> = [
        "--admin",
        &gateway.admin.to_string(),
        "--validator",
        &truth.url(),
        "--token-file",
        &token_file.display().to_string(),
        "--output",
        "json",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let run = audit::run(&binary, &args).await.unwrap();
    assert_eq!(run.code, 1, "{}\n{}", run.stdout, run.stderr);
    let report = run.json().unwrap();
    let clusters = report["clusters"].as_array().unwrap();
    let find = |name: &str| {
        clusters
            .iter()
            .find(|c| c["name"] == name)
            .unwrap_or_else(|| panic!("no cluster {name}: {report:#}"))
    };
    let cart = find(&cart.cluster_name());
    assert_eq!(cart["service"], "shop/cart");
    assert_eq!(cart["mapped_by"], "gateway", "{cart:#}");
    let reasons: Vec<&str> = cart["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["reason"].as_str().unwrap())
        .collect();
    assert_eq!(reasons, ["member", "destroyed", "recycled"], "{cart:#}");
    assert_eq!(report["summary"]["stale"], 2);
    // The cluster the EnvoyFilter adds to reach the validator is never judged.
    let own = find("staleguard-validator");
    assert_eq!(own["summary"]["by_reason"]["unmapped"], 1, "{own:#}");
    gateway.check_alive().unwrap();
}
