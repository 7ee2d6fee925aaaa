//! An Istio ingress gateway's Envoy configuration, as istiod generates it, and
//! the shipped EnvoyFilter applied to it with Istio's merge rules.
//!
//! [`gateway_output`] builds the listener and clusters a gateway gets for a
//! few services, following istio/istio (commit
//! 86c9f01fd735fb01d8192f5bcaf0d424afb7f14c):
//! - clusters: pilot/pkg/networking/core/cluster_builder.go (EDS over ADS,
//!   LEAST_REQUEST, `istio.services` metadata, h2 for HTTP2/gRPC ports via
//!   setH2Options), cluster_traffic_policy.go applyConnectionPool and
//!   applyOutlierDetection (DestinationRule pool and outlier settings),
//!   cluster_tls.go (the ISTIO_MUTUAL transport socket match with SDS
//!   `default`/`ROOTCA` from `sds-grpc`, and the plaintext fallback), checked
//!   against istioctl/pkg/describe/testdata/describe/http_config.json;
//! - the listener: the HTTP connection manager with Istio's router
//!   (pilot/pkg/xds/filters/filters.go BuildRouterFilter), Istio-proxy-only
//!   filters (metadata exchange, stats) left out because upstream Envoy does
//!   not have them, and the route table inline instead of RDS.
//!
//! [`apply_envoyfilter`] applies an EnvoyFilter's patches the way istiod does
//! (pilot/pkg/networking/core/envoyfilter/cluster_patch.go: ADD appends, and
//! cluster_builder.go normalizeClusters keeps the first of clusters with one
//! name; http_filter_patch.go: REPLACE swaps the named filter for the value;
//! listener_patch.go mergeHTTPFilter: MERGE of a filter's typed_config through
//! pilot/pkg/networking/util/util.go MergeAnyWithAny and pkg/proto/merge's
//! rules: lists append, map entries and Durations replace, messages merge,
//! an embedded Any is replaced whole; listener_patch.go patchListeners: a
//! LISTENER ADD appends after every other patch ran, so no patch reaches an
//! added listener; rc_patch.go: an HTTP_ROUTE MERGE merges into the routes
//! of the matched virtual hosts, INSERT_FIRST puts its route first). A
//! patch it does not model is an error,
//! never silently skipped. [`apply_envoyfilters`] applies several matching
//! EnvoyFilters in Istio's order (by `spec.priority`, then as listed: the root
//! namespace's before the workload's, older before newer).
//!
//! [`validate_bootstrap`] wraps the result in an Istio-like bootstrap
//! (`xds-grpc` and `sds-grpc` clusters, ADS, internal listeners) for
//! `envoy --mode validate`;
//! [`runnable`] turns it into a configuration that runs on loopback (static
//! endpoints; no SDS, which needs istio-agent).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde_json::{json, Map, Value};

use crate::envoy::{dependencies, lb_endpoint, Envoy, Launch};
use crate::process::free_addr;

/// The port protocols that shape a cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// `http-*` port: HTTP/1.1 upstream.
    Http,
    /// `http2-*` port: HTTP/2 upstream (h2c to the sidecar-less backend here).
    Http2,
    /// `grpc-*` port: HTTP/2 upstream.
    Grpc,
}

/// A Kubernetes Service port the gateway routes to, with its
/// DestinationRule's traffic policy.
#[derive(Debug, Clone)]
pub struct Service {
    /// Service name.
    pub name: String,
    /// Namespace.
    pub namespace: String,
    /// Port number.
    pub port: u16,
    /// Port protocol.
    pub protocol: Protocol,
    /// Host name the gateway's VirtualService routes to it.
    pub route_host: String,
    /// Endpoints (the pods); used by [`runnable`].
    pub endpoints: Vec<SocketAddr>,
}

impl Service {
    /// `name.namespace.svc.cluster.local`.
    pub fn fqdn(&self) -> String {
        format!("{}.{}.svc.cluster.local", self.name, self.namespace)
    }

    /// Istio's cluster name: `outbound|PORT||FQDN`.
    pub fn cluster_name(&self) -> String {
        format!("outbound|{}||{}", self.port, self.fqdn())
    }
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A YAML file of the repository as JSON (the first document).
pub fn read_yaml(path: &str) -> Result<Value> {
    let text =
        std::fs::read_to_string(repo().join(path)).with_context(|| format!("read {path}"))?;
    let value: yaml_serde::Value =
        yaml_serde::from_str(&text).with_context(|| format!("parse {path}"))?;
    serde_json::to_value(value).with_context(|| format!("{path} as JSON"))
}

/// The shipped EnvoyFilter (`deploy/istio/envoyfilter.yaml`).
pub fn shipped_envoyfilter() -> Result<Value> {
    read_yaml("deploy/istio/envoyfilter.yaml")
}

fn ads() -> Value {
    json!({"ads": {}, "initial_fetch_timeout": "0s", "resource_api_version": "V3"})
}

fn sds(name: &str) -> Value {
    json!({
        "name": name,
        "sds_config": {
            "api_config_source": {
                "api_type": "GRPC",
                "grpc_services": [{"envoy_grpc": {"cluster_name": "sds-grpc"}}],
                "set_node_on_first_message_only": true,
                "transport_api_version": "V3"
            },
            "initial_fetch_timeout": "0s",
            "resource_api_version": "V3"
        }
    })
}

fn cluster(s: &Service) -> Value {
    let name = s.cluster_name();
    let h2 = s.protocol != Protocol::Http;
    // A DestinationRule per service: connectionPool and outlierDetection.
    let mut common = json!({"idle_timeout": "30s", "max_requests_per_connection": 1000});
    let mut options = json!({
        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        "common_http_protocol_options": common.take()
    });
    // setH2Options for h2 ports; clusterWrapper.build() fills in HTTP/1.1
    // when a DestinationRule set only common options.
    options["explicit_http_config"] = if h2 {
        json!({"http2_protocol_options": {"max_concurrent_streams": 100}})
    } else {
        json!({"http_protocol_options": {}})
    };
    let alpn = if h2 {
        json!(["istio-peer-exchange", "istio", "h2"])
    } else {
        json!(["istio-peer-exchange", "istio"])
    };
    json!({
        "name": name,
        "type": "EDS",
        "eds_cluster_config": {"eds_config": ads(), "service_name": name},
        "connect_timeout": "10s",
        "lb_policy": "LEAST_REQUEST",
        "circuit_breakers": {"thresholds": [{
            "max_connections": 100,
            "max_pending_requests": 1024,
            "max_requests": 4294967295u64,
            "max_retries": 3,
            "track_remaining": true
        }]},
        "outlier_detection": {
            "consecutive_5xx": 5,
            "interval": "10s",
            "base_ejection_time": "30s",
            "max_ejection_percent": 50,
            "enforcing_consecutive_5xx": 100,
            "enforcing_success_rate": 0
        },
        "common_lb_config": {"healthy_panic_threshold": {}},
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": options
        },
        "metadata": {"filter_metadata": {"istio": {
            "config": format!("/apis/networking.istio.io/v1/namespaces/{}/destination-rule/{}", s.namespace, s.name),
            "default_original_port": s.port,
            "services": [{"host": s.fqdn(), "name": s.name, "namespace": s.namespace}]
        }}},
        "transport_socket_matches": [
            {
                "name": "tlsMode-istio",
                "match": {"tlsMode": "istio"},
                "transport_socket": {
                    "name": "envoy.transport_sockets.tls",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                        "common_tls_context": {
                            "tls_params": {
                                "tls_minimum_protocol_version": "TLSv1_2",
                                "tls_maximum_protocol_version": "TLSv1_3"
                            },
                            "alpn_protocols": alpn,
                            "tls_certificate_sds_secret_configs": [sds("default")],
                            "combined_validation_context": {
                                "default_validation_context": {"match_subject_alt_names": [
                                    {"exact": format!("spiffe://cluster.local/ns/{}/sa/{}", s.namespace, s.name)}
                                ]},
                                "validation_context_sds_secret_config": sds("ROOTCA")
                            }
                        },
                        "sni": format!("outbound_.{}_._.{}", s.port, s.fqdn())
                    }
                }
            },
            {
                "name": "tlsMode-disabled",
                "match": {},
                "transport_socket": {
                    "name": "envoy.transport_sockets.raw_buffer",
                    "typed_config": {"@type": "type.googleapis.com/envoy.extensions.transport_sockets.raw_buffer.v3.RawBuffer"}
                }
            }
        ]
    })
}

fn route_config(services: &[Service]) -> Value {
    let hosts: Vec<Value> = services
        .iter()
        .map(|s| {
            json!({
                "name": format!("{}:8080", s.route_host),
                "domains": [s.route_host, format!("{}:*", s.route_host)],
                "routes": [{
                    "match": {"prefix": "/"},
                    "route": {
                        "cluster": s.cluster_name(),
                        "timeout": "0s",
                        // Istio's default retry policy (pilot/pkg/networking/core/route/retry).
                        "retry_policy": {
                            "retry_on": "connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes",
                            "num_retries": 2,
                            "retry_host_predicate": [{"name": "envoy.retry_host_predicates.previous_hosts",
                                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"}}],
                            "host_selection_retry_max_attempts": "5",
                            "retriable_status_codes": [503]
                        },
                        "max_grpc_timeout": "0s"
                    },
                    "metadata": {"filter_metadata": {"istio": {"config": "/apis/networking.istio.io/v1/namespaces/default/virtual-service/gateway-routes"}}},
                    "decorator": {"operation": format!("{}:{}/*", s.fqdn(), s.port)}
                }],
                "include_request_attempt_count": true
            })
        })
        .collect();
    json!({"name": "http.8080", "virtual_hosts": hosts, "validate_clusters": false})
}

fn listener(services: &[Service], port: u16) -> Value {
    json!({
        "name": format!("0.0.0.0_{port}"),
        "address": {"socket_address": {"address": "0.0.0.0", "port_value": port}},
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                "stat_prefix": format!("outbound_0.0.0.0_{port}"),
                "route_config": route_config(services),
                "http_filters": [
                    {"name": "envoy.filters.http.grpc_stats", "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.http.grpc_stats.v3.FilterConfig",
                        "emit_filter_state": true, "stats_for_all_methods": false}},
                    {"name": "envoy.filters.http.fault", "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.http.fault.v3.HTTPFault"}},
                    {"name": "envoy.filters.http.cors", "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.http.cors.v3.Cors"}},
                    // BuildRouterFilter with the mesh defaults (no child
                    // spans, Envoy's debug headers kept): both fields false,
                    // which proto JSON leaves out.
                    {"name": "envoy.filters.http.router", "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}
                ],
                "use_remote_address": true,
                "upgrade_configs": [{"upgrade_type": "websocket"}],
                "stream_idle_timeout": "0s",
                "normalize_path": true,
                "path_with_escaped_slashes_action": "KEEP_UNCHANGED",
                "request_id_extension": {"typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.request_id.uuid.v3.UuidRequestIdConfig",
                    "use_request_id_for_trace_sampling": true}},
                "forward_client_cert_details": "SANITIZE_SET",
                "set_current_client_cert_details": {"subject": true, "dns": true, "uri": true},
                "server_name": "istio-envoy"
            }
        }]}]
    })
}

/// The listener and clusters istiod generates for a gateway on `port` that
/// routes to `services`: `{"listeners": [...], "clusters": [...]}`.
pub fn gateway_output(services: &[Service], port: u16) -> Value {
    let mut clusters: Vec<Value> = services.iter().map(cluster).collect();
    // Istio's own clusters on every gateway.
    clusters.push(json!({"name": "BlackHoleCluster", "type": "STATIC", "connect_timeout": "10s"}));
    json!({"listeners": [listener(services, port)], "clusters": clusters})
}

// === Istio's merge ===

/// Proto fields that are maps: a MERGE replaces their entries
/// (pkg/proto/merge mergeMap).
const MAP_FIELDS: [&str; 4] = [
    "typed_extension_protocol_options",
    "filter_metadata",
    "typed_filter_metadata",
    "typed_per_filter_config",
];

/// Merges `src` into `dst` as `merge.Merge` does for two messages in proto
/// JSON form.
pub fn proto_merge(dst: &mut Value, src: &Value) {
    let (Some(d), Some(s)) = (dst.as_object_mut(), src.as_object()) else {
        *dst = src.clone();
        return;
    };
    for (k, v) in s {
        match (d.get_mut(k), v) {
            (Some(Value::Array(dl)), Value::Array(sl)) => dl.extend(sl.iter().cloned()),
            (Some(dm @ Value::Object(_)), Value::Object(sm))
                if MAP_FIELDS.contains(&k.as_str()) =>
            {
                if let Some(dm) = dm.as_object_mut() {
                    for (mk, mv) in sm {
                        dm.insert(mk.clone(), mv.clone());
                    }
                }
            }
            // An embedded Any merges as a message of type_url and bytes: both
            // are replaced, so the Any is replaced whole.
            (Some(dv @ Value::Object(_)), Value::Object(sm)) if !sm.contains_key("@type") => {
                proto_merge(dv, v);
            }
            _ => {
                d.insert(k.clone(), v.clone());
            }
        }
    }
}

/// `MergeAnyWithAny`: both must have the same type; the merged message keeps
/// it.
fn merge_any(dst: &mut Value, src: &Value) -> Result<()> {
    if dst["@type"] != src["@type"] {
        bail!(
            "typed_config types differ ({} vs {}): Istio would keep the original",
            dst["@type"],
            src["@type"]
        );
    }
    let mut body = src.clone();
    if let Some(o) = body.as_object_mut() {
        o.remove("@type");
    }
    proto_merge(dst, &body);
    Ok(())
}

/// What [`apply_envoyfilter`] did, by patch index.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Applied {
    /// How many objects each patch changed or added.
    pub counts: Vec<usize>,
}

/// Applies `envoyfilter`'s patches to a gateway's `output` as istiod does for
/// a gateway proxy (patch context GATEWAY).
pub fn apply_envoyfilter(output: &mut Value, envoyfilter: &Value) -> Result<Applied> {
    let patches = envoyfilter["spec"]["configPatches"]
        .as_array()
        .context("EnvoyFilter without spec.configPatches")?;
    let mut applied = Applied::default();
    for (i, p) in patches.iter().enumerate() {
        let context = p["match"]["context"].as_str().unwrap_or("ANY");
        if !matches!(context, "ANY" | "GATEWAY") {
            applied.counts.push(0);
            continue;
        }
        let apply_to = p["applyTo"].as_str().unwrap_or("");
        let op = p["patch"]["operation"].as_str().unwrap_or("");
        let value = &p["patch"]["value"];
        let n = match (apply_to, op) {
            ("CLUSTER", "ADD") => {
                if p["match"].get("cluster").is_some() {
                    bail!("patch {i}: an ADD with a cluster match is ignored by Istio");
                }
                let clusters = output["clusters"].as_array_mut().context("no clusters")?;
                // normalizeClusters: the first cluster of a name is kept.
                if clusters.iter().any(|c| c["name"] == value["name"]) {
                    0
                } else {
                    clusters.push(value.clone());
                    1
                }
            }
            ("CLUSTER", "MERGE") => {
                // cluster_patch.go: merge.Merge into each matching cluster;
                // the match is on the outbound|PORT|SUBSET|SERVICE parts.
                let service = p["match"]["cluster"]["service"].as_str();
                let mut n = 0;
                for c in output["clusters"].as_array_mut().into_iter().flatten() {
                    let name = c["name"].as_str().unwrap_or("").to_owned();
                    let host = name.split('|').nth(3);
                    if service.is_none() || host == service {
                        proto_merge(c, value);
                        n += 1;
                    }
                }
                n
            }
            ("LISTENER", "ADD") => {
                // patchListeners: added after every other patch ran, so the
                // HTTP_FILTER patches never reach an added listener (see
                // `matched_http_filters`).
                output["listeners"]
                    .as_array_mut()
                    .context("no listeners")?
                    .push(value.clone());
                1
            }
            ("HTTP_ROUTE", "MERGE") => route_patch(output, &p["match"], |routes| {
                let mut n = 0;
                for r in routes.iter_mut().filter(|r| route_matches(r, &p["match"])) {
                    proto_merge(r, value);
                    n += 1;
                }
                n
            })
            .with_context(|| format!("patch {i}"))?,
            ("HTTP_ROUTE", "INSERT_FIRST") => {
                if p["match"]["routeConfiguration"]["vhost"]
                    .get("route")
                    .is_some()
                {
                    bail!("patch {i}: INSERT_FIRST with a route match is not modelled");
                }
                route_patch(output, &p["match"], |routes| {
                    routes.insert(0, value.clone());
                    1
                })
                .with_context(|| format!("patch {i}"))?
            }
            ("HTTP_FILTER", "MERGE") => merge_http_filter(output, &p["match"], value)
                .with_context(|| format!("patch {i}"))?,
            ("HTTP_FILTER", "REPLACE") => replace_http_filter(output, &p["match"], value)
                .with_context(|| format!("patch {i}"))?,
            _ => bail!("patch {i}: {apply_to}/{op} is not modelled by this test"),
        };
        applied.counts.push(n);
    }
    Ok(applied)
}

/// Applies several EnvoyFilters that match one gateway in Istio's order:
/// sorted by `spec.priority` (default 0), ties kept in the order given (the
/// root namespace's before the workload namespace's, then by creation time).
pub fn apply_envoyfilters(output: &mut Value, envoyfilters: &[&Value]) -> Result<Vec<Applied>> {
    let mut ordered: Vec<&Value> = envoyfilters.to_vec();
    ordered.sort_by_key(|f| f["spec"]["priority"].as_i64().unwrap_or(0));
    ordered
        .into_iter()
        .map(|f| apply_envoyfilter(output, f))
        .collect()
}

/// Applies `patch` to the routes of every virtual host an HTTP_ROUTE
/// patch's `match` names (rc_patch.go: by `vhost.name`; the gateway's route
/// configurations are inline here, one per listener), with how many routes
/// it changed or added.
fn route_patch(
    output: &mut Value,
    matcher: &Value,
    mut patch: impl FnMut(&mut Vec<Value>) -> usize,
) -> Result<usize> {
    let rc = &matcher["routeConfiguration"];
    for field in ["portNumber", "portName", "gateway", "name"] {
        if rc.get(field).is_some() {
            bail!("routeConfiguration.{field} matches are not modelled");
        }
    }
    let vhost = rc["vhost"]["name"].as_str();
    let mut n = 0;
    for l in output["listeners"].as_array_mut().into_iter().flatten() {
        if l.get("internal_listener").is_some() {
            continue;
        }
        for chain in l["filter_chains"].as_array_mut().into_iter().flatten() {
            for f in chain["filters"].as_array_mut().into_iter().flatten() {
                let hosts = f["typed_config"]["route_config"]["virtual_hosts"].as_array_mut();
                for vh in hosts.into_iter().flatten() {
                    if vhost.is_some_and(|name| vh["name"] != name) {
                        continue;
                    }
                    if let Some(routes) = vh["routes"].as_array_mut() {
                        n += patch(routes);
                    }
                }
            }
        }
    }
    Ok(n)
}

/// rc_patch.go routeMatch: a route `action` of ROUTE matches routes that
/// forward to a cluster (not redirects, not direct responses).
fn route_matches(route: &Value, matcher: &Value) -> bool {
    match matcher["routeConfiguration"]["vhost"]["route"]["action"].as_str() {
        Some("ROUTE") => route.get("route").is_some(),
        Some("REDIRECT") => route.get("redirect").is_some(),
        Some("DIRECT_RESPONSE") => route.get("direct_response").is_some(),
        _ => true,
    }
}

/// The HTTP filters an HTTP_FILTER patch's `match` names: every
/// `http_filters` entry of a matching network filter whose name is the
/// `subFilter`'s.
fn matched_http_filters<'a>(output: &'a mut Value, matcher: &Value) -> Result<Vec<&'a mut Value>> {
    let fc = &matcher["listener"]["filterChain"];
    let network = fc["filter"]["name"].as_str().context("no filter match")?;
    let sub = fc["filter"]["subFilter"]["name"]
        .as_str()
        .context("no subFilter match")?;
    if matcher["listener"].get("portNumber").is_some() || matcher["listener"].get("name").is_some()
    {
        bail!("listener port/name matches are not modelled");
    }
    let mut found = vec![];
    for l in output["listeners"].as_array_mut().into_iter().flatten() {
        // Istio's gateway listeners are never internal; one here was added
        // by a LISTENER ADD, which istiod applies after every patch.
        if l.get("internal_listener").is_some() {
            continue;
        }
        for chain in l["filter_chains"].as_array_mut().into_iter().flatten() {
            for f in chain["filters"].as_array_mut().into_iter().flatten() {
                if f["name"] != network {
                    continue;
                }
                for hf in f["typed_config"]["http_filters"]
                    .as_array_mut()
                    .into_iter()
                    .flatten()
                {
                    if hf["name"] == sub {
                        found.push(hf);
                    }
                }
            }
        }
    }
    Ok(found)
}

/// REPLACE (http_filter_patch.go): the matched filter becomes the value.
fn replace_http_filter(output: &mut Value, matcher: &Value, value: &Value) -> Result<usize> {
    let matched = matched_http_filters(output, matcher)?;
    let n = matched.len();
    for hf in matched {
        *hf = value.clone();
    }
    Ok(n)
}

/// MERGE (mergeHTTPFilter): the matched filter takes the value's name, and
/// its typed_config is merged with the value's.
fn merge_http_filter(output: &mut Value, matcher: &Value, value: &Value) -> Result<usize> {
    let matched = matched_http_filters(output, matcher)?;
    let n = matched.len();
    for hf in matched {
        if let Some(name) = value["name"].as_str() {
            hf["name"] = json!(name);
        }
        if let Some(tc) = value.get("typed_config") {
            merge_any(&mut hf["typed_config"], tc)?;
        }
    }
    Ok(n)
}

/// Runs `deploy/istio/twins.py` with `args` on `input` (its stdin).
pub fn twins_py(input: &Value, args: &[&str]) -> Result<std::process::Output> {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let script = repo().join("deploy/istio/twins.py");
    let mut child = Command::new("python3")
        .arg(script)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("python3 (needed by deploy/istio/twins.py)")?;
    child
        .stdin
        .take()
        .context("stdin")?
        .write_all(input.to_string().as_bytes())?;
    Ok(child.wait_with_output()?)
}

/// The EnvoyFilter `deploy/istio/twins.py` writes for `input` with `args`.
pub fn generated_twins(input: &Value, args: &[&str]) -> Result<Value> {
    let out = twins_py(input, args)?;
    if !out.status.success() {
        bail!("twins.py: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(serde_json::from_slice(&out.stdout)?)
}

// === Bootstraps ===

/// The cluster names of `output`.
pub fn cluster_names(output: &Value) -> Vec<String> {
    output["clusters"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c["name"].as_str().map(str::to_owned))
        .collect()
}

/// Every upstream Wasm filter entry the router filters of `output` carry.
fn upstream_wasm_filters(output: &mut Value) -> Vec<&mut Value> {
    let mut found = Vec::new();
    let listeners = output.get_mut("listeners").and_then(Value::as_array_mut);
    for l in listeners.into_iter().flatten() {
        let chains = l.get_mut("filter_chains").and_then(Value::as_array_mut);
        for chain in chains.into_iter().flatten() {
            let filters = chain.get_mut("filters").and_then(Value::as_array_mut);
            for f in filters.into_iter().flatten() {
                let http = f
                    .get_mut("typed_config")
                    .and_then(|t| t.get_mut("http_filters"))
                    .and_then(Value::as_array_mut);
                for hf in http.into_iter().flatten() {
                    let upstream = hf
                        .get_mut("typed_config")
                        .and_then(|t| t.get_mut("upstream_http_filters"))
                        .and_then(Value::as_array_mut);
                    for uf in upstream.into_iter().flatten() {
                        if uf["name"] == "envoy.filters.http.wasm" {
                            found.push(uf);
                        }
                    }
                }
            }
        }
    }
    found
}

/// Points the Wasm code source of every staleguard filter at a local file
/// or, with `sha256`, keeps the remote source and replaces only the checksum
/// (a test that serves the module itself).
pub fn set_module(output: &mut Value, local: Option<&Path>, sha256: Option<&str>) {
    for uf in upstream_wasm_filters(output) {
        let code = &mut uf["typed_config"]["config"]["vm_config"]["code"];
        if let Some(path) = local {
            *code = json!({"local": {"filename": path.display().to_string()}});
        }
        if let Some(sum) = sha256 {
            code["remote"]["sha256"] = json!(sum);
        }
    }
}

/// The plugin configuration (JSON) of the first staleguard filter.
pub fn plugin_config(output: &Value) -> Result<Value> {
    let text = output["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        ["http_filters"]
        .as_array()
        .into_iter()
        .flatten()
        .find_map(|hf| {
            hf["typed_config"]["upstream_http_filters"][0]["typed_config"]["config"]
                ["configuration"]["value"]
                .as_str()
        })
        .context("no staleguard plugin configuration")?;
    Ok(serde_json::from_str(text)?)
}

/// Replaces the plugin configuration of every staleguard filter.
pub fn set_plugin_config(output: &mut Value, plugin: &Value) {
    for uf in upstream_wasm_filters(output) {
        uf["typed_config"]["config"]["configuration"]["value"] = json!(plugin.to_string());
    }
}

/// The bootstrap extension every Istio proxy's bootstrap enables
/// (tools/packaging/common/envoy_bootstrap.json): internal listeners.
fn internal_listener_extension() -> Value {
    json!([{
        "name": "envoy.bootstrap.internal_listener",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.bootstrap.internal_listener.v3.InternalListener",
            "buffer_size_kb": 64
        }
    }])
}

/// A gateway's clusters as istiod builds them for services without a
/// DestinationRule: Istio's default circuit breakers (cluster_builder.go
/// getDefaultCircuitBreakerThresholds: every threshold 2^32-1) and no
/// outlier detection, instead of [`gateway_output`]'s DestinationRule.
pub fn without_destination_rules(output: &mut Value) {
    let max = u64::from(u32::MAX);
    for c in output["clusters"].as_array_mut().into_iter().flatten() {
        if c.get("eds_cluster_config").is_none() {
            continue;
        }
        c["circuit_breakers"] = json!({"thresholds": [{
            "max_connections": max, "max_pending_requests": max,
            "max_requests": max, "max_retries": max, "track_remaining": true
        }]});
        if let Some(o) = c.as_object_mut() {
            o.remove("outlier_detection");
        }
    }
}

/// An Istio-like bootstrap around `output` for `envoy --mode validate`: the
/// `xds-grpc` and `sds-grpc` clusters of Istio's bootstrap, ADS, and the
/// gateway's resources as static resources. No `stats_tags` for the filter:
/// an Istio gateway as installed has none (docs/metrics.md, "Istio").
pub fn validate_bootstrap(output: &Value) -> Value {
    let mut clusters = output["clusters"].as_array().cloned().unwrap_or_default();
    let pipe = |name: &str, path: &str| {
        json!({
            "name": name,
            "type": "STATIC",
            "connect_timeout": "1s",
            "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}}}},
            "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"pipe": {"path": path}}}}]}]}
        })
    };
    clusters.push(pipe("xds-grpc", "./etc/istio/proxy/XDS"));
    clusters.push(pipe(
        "sds-grpc",
        "./var/run/secrets/workload-spiffe-uds/socket",
    ));
    json!({
        "bootstrap_extensions": internal_listener_extension(),
        "node": {"id": "router~10.0.0.1~istio-ingressgateway-1.istio-ingress~istio-ingress.svc.cluster.local",
                 "cluster": "istio-ingressgateway.istio-ingress"},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 15000}}},
        "dynamic_resources": {
            "ads_config": {
                "api_type": "GRPC",
                "set_node_on_first_message_only": true,
                "transport_api_version": "V3",
                "grpc_services": [{"envoy_grpc": {"cluster_name": "xds-grpc"}}]
            },
            "cds_config": {"ads": {}, "initial_fetch_timeout": "0s", "resource_api_version": "V3"},
            "lds_config": {"ads": {}, "initial_fetch_timeout": "0s", "resource_api_version": "V3"}
        },
        "static_resources": {"listeners": output["listeners"], "clusters": clusters}
    })
}

/// Runs Envoy on `output` made [`runnable`] (two workers, as a gateway has
/// several), with `token` as the plugin's
/// `STALEGUARD_TOKEN`; `None` when Envoy is missing outside CI.
pub fn run(
    name: &str,
    output: &Value,
    services: &[Service],
    validator: SocketAddr,
    module: Option<SocketAddr>,
    token: &str,
) -> Result<Option<Envoy>> {
    let Some((envoy, _)) = dependencies() else {
        return Ok(None);
    };
    let config = runnable(output, services, validator, module)?;
    let launch = Launch {
        name: name.into(),
        concurrency: 2,
        env: vec![("STALEGUARD_TOKEN".into(), token.into())],
        detach: false,
    };
    Envoy::spawn(&envoy, &config, &launch).map(Some)
}

/// A configuration of `output` that runs on loopback: the listener and the
/// admin on free ports of 127.0.0.1 ([`crate::envoy::Envoy::spawn`] reads
/// them back), each service's EDS cluster replaced by its static endpoints, the
/// transport socket matches dropped (their SDS secrets come from istio-agent,
/// which is not here; the backends are plaintext, as the `tlsMode-disabled`
/// match would pick for them), the validator and module clusters pointed
/// at `validator` and `module`, and no `stats_tags` (Istio's bootstrap has
/// none for the filter).
pub fn runnable(
    output: &Value,
    services: &[Service],
    validator: SocketAddr,
    module: Option<SocketAddr>,
) -> Result<Value> {
    let (listen, admin) = (free_addr()?, free_addr()?);
    let mut out = output.clone();
    for l in out["listeners"].as_array_mut().into_iter().flatten() {
        if l.get("internal_listener").is_none() {
            l["address"] = json!({"socket_address": {"address": listen.ip().to_string(), "port_value": listen.port()}});
        }
    }
    let endpoints = |hosts: &[SocketAddr]| -> Value {
        let eps: Vec<Value> = hosts.iter().map(lb_endpoint).collect();
        json!([{"lb_endpoints": eps}])
    };
    for c in out["clusters"].as_array_mut().context("no clusters")? {
        let name = c["name"].as_str().unwrap_or("").to_owned();
        // A twin reads its guarded cluster's EDS resource.
        let eds = c["eds_cluster_config"]["service_name"]
            .as_str()
            .unwrap_or(&name)
            .to_owned();
        let o: &mut Map<String, Value> = c.as_object_mut().context("cluster")?;
        if let Some(s) = services
            .iter()
            .find(|s| s.cluster_name() == name || s.cluster_name() == eds)
        {
            o.remove("eds_cluster_config");
            o.remove("transport_socket_matches");
            o.insert("type".into(), json!("STATIC"));
            o.insert(
                "load_assignment".into(),
                json!({"cluster_name": name, "endpoints": endpoints(&s.endpoints)}),
            );
        } else if name == "staleguard-validator" || name == "staleguard-module" {
            let target = if name == "staleguard-validator" {
                Some(validator)
            } else {
                module
            };
            let Some(target) = target else { continue };
            o.insert("type".into(), json!("STATIC"));
            o.remove("dns_lookup_family");
            o.remove("dns_refresh_rate");
            o.remove("respect_dns_ttl");
            o.insert(
                "load_assignment".into(),
                json!({"cluster_name": name, "endpoints": endpoints(&[target])}),
            );
        }
    }
    Ok(json!({
        "node": {"id": "staleguard-istio-test", "cluster": "staleguard-istio-test"},
        "bootstrap_extensions": internal_listener_extension(),
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin.port()}}},
        "static_resources": {"listeners": out["listeners"], "clusters": out["clusters"]}
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_appends_lists_replaces_map_entries_and_anys() {
        let mut dst = json!({
            "a": [1], "s": "x", "m": {"k": 1},
            "typed_extension_protocol_options": {"o": {"@type": "t", "x": 1, "y": 2}},
            "inner": {"keep": true, "any": {"@type": "t1", "v": 1}}
        });
        proto_merge(
            &mut dst,
            &json!({
                "a": [2], "s": "y", "m": {"j": 2},
                "typed_extension_protocol_options": {"o": {"@type": "t", "x": 3}},
                "inner": {"any": {"@type": "t2", "w": 2}}
            }),
        );
        assert_eq!(
            dst,
            json!({
                "a": [1, 2], "s": "y", "m": {"k": 1, "j": 2},
                "typed_extension_protocol_options": {"o": {"@type": "t", "x": 3}},
                "inner": {"keep": true, "any": {"@type": "t2", "w": 2}}
            })
        );
    }
}
