use super::*;

const CLUSTERS: &str = r#"{"cluster_statuses":[
    {"name":"legacy","host_statuses":[{"address":{"socket_address":{"address":"127.0.1.9","port_value":80}},"health_status":{"eds_health_status":"HEALTHY"}}]},
    {"name":"outbound|80||cart.shop.svc.cluster.local","eds_service_name":"cart","host_statuses":[
        {"address":{"socket_address":{"address":"127.0.1.1","port_value":8080}}},
        {"address":{"socket_address":{"address":"fd00::1","port_value":8080}}},
        {"address":{"pipe":{"path":"/tmp/sock"}}}]},
    {"name":"empty"}]}"#;

fn dump() -> String {
    let plugin = r#"{"validator_cluster":"sg","istio":false,"clusters":[{"name":"legacy","service":"shop/legacy"}],"policy":{"terminating":"reject"}}"#;
    serde_json::json!({"configs": [
        {"@type": "type.googleapis.com/envoy.admin.v3.BootstrapConfigDump", "bootstrap": {}},
        {"@type": "type.googleapis.com/envoy.admin.v3.ClustersConfigDump",
         "static_clusters": [
            {"cluster": {"name": "legacy", "typed_extension_protocol_options": {"x": {"http_filters": [
                {"name": "envoy.filters.http.wasm", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
                    "config": {"root_id": "staleguard", "configuration": {
                        "@type": "type.googleapis.com/google.protobuf.StringValue", "value": plugin}}}}]}}}},
            {"cluster": {"name": "outbound|80||cart.shop.svc.cluster.local",
                "eds_cluster_config": {"service_name": "cart"},
                "metadata": {"filter_metadata": {"istio": {"services": [{"host": "cart.shop.svc.cluster.local"}]}}}}}
         ],
         "dynamic_active_clusters": [{"cluster": {"name": "outbound|80||pay.shop.svc.cluster.local"}}]},
        {"@type": "type.googleapis.com/envoy.admin.v3.EndpointsConfigDump",
         "static_endpoint_configs": [
            {"endpoint_config": {"cluster_name": "legacy", "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"socket_address": {"address": "127.0.1.9", "port_value": 80}}}}]}]}},
            {"endpoint_config": {"cluster_name": "cart", "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"socket_address": {"address": "127.0.1.1", "port_value": 8080}}}},
                {"endpoint": {"address": {"socket_address": {"address": "127.0.1.2", "port_value": 8080}}}}]}]}}
         ]},
        {"@type": "type.googleapis.com/envoy.admin.v3.ListenersConfigDump"}
    ]})
    .to_string()
}

#[test]
fn a_twin_is_the_suffixed_name_of_a_cluster_whose_plugin_replays() {
    let plugin =
        |retry: &str| parse_plugin(&format!(r#"{{"validator_cluster":"sg"{retry}}}"#)).unwrap();
    let cluster = |name: &str, plugin: Option<PluginConfig>| Cluster {
        name: name.into(),
        plugin,
        ..Cluster::default()
    };
    let gateway = Gateway {
        clusters: vec![
            cluster("cart", Some(plugin(r#","retry":{}"#))),
            cluster("cart|staleguard-twin", None),
            cluster("pay", Some(plugin(r#","retry":{"twin_suffix":"-twin"}"#))),
            cluster("pay-twin", None),
            cluster("pay|staleguard-twin", None),
            cluster("web", Some(plugin(""))),
            cluster("web|staleguard-twin", None),
            cluster("ads", Some(plugin(r#","retry":{}"#))),
        ],
        ..Gateway::default()
    };
    let defaults = PluginConfig::default();
    let twins = gateway.twins(None, &defaults);
    let mut found: Vec<(&str, &str)> = twins
        .iter()
        .map(|(t, c)| (t.as_str(), c.as_str()))
        .collect();
    found.sort_unstable();
    // pay's twin has pay's own suffix; web does not replay; ads has no
    // twin cluster.
    assert_eq!(
        found,
        [("cart|staleguard-twin", "cart"), ("pay-twin", "pay")]
    );
    // --plugin-config applies to every cluster, the guarded ones too.
    let forced = plugin(r#","retry":{}"#);
    assert_eq!(gateway.twins(Some(&forced), &defaults).len(), 3);
}

#[test]
fn reads_clusters_and_their_hosts() {
    let clusters = parse_clusters(CLUSTERS.as_bytes()).unwrap();
    assert_eq!(clusters.len(), 3);
    assert_eq!(clusters[0].endpoints[0].address, "127.0.1.9:80");
    let cart = &clusters[1].endpoints;
    assert_eq!(cart[0].ip, Some("127.0.1.1".parse().unwrap()));
    assert_eq!(cart[1].address, "[fd00::1]:8080");
    assert_eq!(cart[2].ip, None, "a pipe has no IP");
    assert_eq!(cart[2].address, "pipe:/tmp/sock");
    assert!(clusters[2].endpoints.is_empty());
    assert!(parse_clusters(b"{}").unwrap().is_empty());
}

#[test]
fn truncated_or_foreign_admin_output_is_refused_with_a_reason() {
    let cut = &CLUSTERS.as_bytes()[..CLUSTERS.len() / 2];
    let err = parse_clusters(cut).unwrap_err();
    assert!(matches!(err, GatewayError::Json { .. }), "{err}");
    assert!(err.to_string().contains("truncated"), "{err}");
    for foreign in [
        &b"[]"[..],
        b"{\"stats\":[]}",
        b"{\"cluster_statuses\":{}}",
        b"{\"cluster_statuses\":[{\"host_statuses\":[]}]}",
        b"<html>admin</html>",
        b"",
    ] {
        assert!(parse_clusters(foreign).is_err(), "{foreign:?}");
    }
    assert!(parse_config_dump(b"{\"configs\":", "dump").is_err());
    let err = parse_config_dump(b"{\"stats\":1}", "dump").unwrap_err();
    assert!(err.to_string().contains("no `configs`"), "{err}");
}

#[test]
fn a_config_dump_gives_endpoints_by_eds_name_metadata_and_plugin_configs() {
    let gateway = parse_config_dump(dump().as_bytes(), "dump").unwrap();
    let names: Vec<&str> = gateway.clusters.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "legacy",
            "outbound|80||cart.shop.svc.cluster.local",
            "outbound|80||pay.shop.svc.cluster.local"
        ]
    );
    let legacy = &gateway.clusters[0];
    let plugin = legacy.plugin.as_ref().unwrap();
    assert!(!plugin.istio);
    assert_eq!(plugin.policy.terminating, staleguard_core::Action::Reject);
    assert_eq!(legacy.endpoints.len(), 1);
    let cart = &gateway.clusters[1];
    assert_eq!(cart.endpoints.len(), 2, "EDS service name `cart`");
    assert_eq!(
        cart.istio_service_host.as_deref(),
        Some("cart.shop.svc.cluster.local")
    );
    assert!(gateway.plugin.is_none() && gateway.notes.is_empty());

    let defaults = PluginConfig::default();
    let service = |c: &Cluster| gateway.service_of(c, None, &defaults);
    assert_eq!(service(legacy), Some(ServiceKey::new("shop", "legacy")));
    assert_eq!(service(cart), Some(ServiceKey::new("shop", "cart")));
    let no_istio = parse_plugin(r#"{"validator_cluster":"sg","istio":false}"#).unwrap();
    assert_eq!(gateway.service_of(cart, Some(&no_istio), &defaults), None);
}

#[test]
fn live_hosts_keep_what_the_dump_knows_about_their_cluster() {
    let config = parse_config_dump(dump().as_bytes(), "dump").unwrap();
    let live = parse_clusters(CLUSTERS.as_bytes()).unwrap();
    let merged = merge(config, live);
    let names: Vec<&str> = merged.clusters.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "empty",
            "legacy",
            "outbound|80||cart.shop.svc.cluster.local"
        ],
        "the live list decides which clusters and hosts there are"
    );
    assert!(merged.clusters[0].plugin.is_none());
    assert!(merged.clusters[1].plugin.is_some());
    assert_eq!(merged.clusters[2].endpoints.len(), 3);
    assert!(merged.clusters[2].istio_service_host.is_some());
}

#[test]
fn gateway_wide_and_broken_plugin_configs_are_noted() {
    let wasm = |value: &str| {
        serde_json::json!({"@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
            "config": {"configuration": {"value": value}}})
    };
    let doc = serde_json::json!({"configs": [
        {"@type": "type.googleapis.com/envoy.admin.v3.ListenersConfigDump",
         "dynamic_listeners": [{"upstream_http_filters": [
            wasm(r#"{"validator_cluster":"sg","istio":true}"#),
            wasm(r#"{"validator_cluster":"sg","clusters":"not a list"}"#),
            wasm(r#"{"something":"else"}"#)]}]}
    ]});
    let gateway = parse_config_dump(doc.to_string().as_bytes(), "dump").unwrap();
    assert_eq!(gateway.plugin.as_ref().unwrap().validator_cluster, "sg");
    assert_eq!(gateway.notes.len(), 1, "{:?}", gateway.notes);
    assert!(gateway.notes[0].contains("does not parse"));
}

#[test]
fn internal_addresses_are_read_by_endpoint_id_and_pod_cidrs_set_the_scope() {
    let clusters = parse_clusters(
        br#"{"cluster_statuses":[{"name":"c","host_statuses":[
            {"address":{"envoy_internal_address":{"server_listener_name":"connect_originate","endpoint_id":"10.244.1.5:8080"}}},
            {"address":{"envoy_internal_address":{"server_listener_name":"connect_originate"}}}]}]}"#,
    )
    .unwrap();
    let eps = &clusters[0].endpoints;
    assert_eq!(eps[0].address, "envoy://connect_originate/10.244.1.5:8080");
    assert_eq!(eps[0].ip, Some("10.244.1.5".parse().unwrap()));
    assert_eq!(eps[1].ip, None, "no endpoint_id: no address");

    let plugin =
        parse_plugin(r#"{"validator_cluster":"sg","pod_cidrs":["10.244.0.0/16"]}"#).unwrap();
    assert!(plugin.in_scope("10.244.7.7".parse().unwrap()));
    assert!(!plugin.in_scope("10.8.0.1".parse().unwrap()));
    assert!(PluginConfig::default().in_scope("10.8.0.1".parse().unwrap()));
}
