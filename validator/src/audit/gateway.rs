//! What a gateway holds: its clusters, the endpoints of each, and how each
//! cluster maps to a service, read from Envoy's admin output.
//!
//! Two inputs, one model ([`Gateway`]):
//! - the live admin API: `/clusters?format=json` for the hosts the load
//!   balancer has now, plus `/config_dump` for what the endpoint list does not
//!   carry (Istio cluster metadata and the staleguard plugin configuration);
//! - a saved `/config_dump?include_eds` file: clusters, their plugin
//!   configuration and their endpoints (`EndpointsConfigDump`, keyed by the
//!   EDS service name, which may differ from the cluster name).
//!
//! The plugin configuration is found where the filter finds it: in the Wasm
//! filter attached to the cluster (`typed_extension_protocol_options`), else in
//! one attached gateway-wide (a router's `upstream_http_filters`, ECDS). Any
//! Wasm filter whose configuration is a JSON object with `validator_cluster` is
//! staleguard's.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};

use serde::Deserialize;
use serde_json::Value;
use staleguard_core::ServiceKey;
use staleguard_engine::config::ConfigError;

/// Why admin output could not be read.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// Not JSON (truncated output ends mid-document).
    #[error("{what} is not complete JSON ({source}); truncated or not Envoy admin output?")]
    Json {
        /// Which document.
        what: String,
        /// The parser's complaint.
        #[source]
        source: serde_json::Error,
    },
    /// JSON, but not of the expected shape.
    #[error("{what} is not Envoy admin output: {detail}")]
    Shape {
        /// Which document.
        what: String,
        /// What is missing or wrong.
        detail: String,
    },
}

/// A staleguard plugin configuration, as the filter reads it: the engine's
/// own type, so the audit maps clusters, names twins and scopes IPs by the
/// rules and defaults the gateway runs (named apart from the validator's own
/// `Config`).
pub use staleguard_engine::config::Config as PluginConfig;

/// Parses a plugin configuration (the JSON text in the Wasm filter's
/// `configuration`) with the filter's own parser, so the audit refuses
/// exactly what a gateway would (`token_env` counts as set).
pub fn parse_plugin(text: &str) -> Result<PluginConfig, ConfigError> {
    PluginConfig::parse_outside_gateway(text.as_bytes())
}

/// One endpoint a cluster holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// The address as Envoy shows it (`IP:port`, or a pipe or name).
    pub address: String,
    /// The IP, when the address is an IP socket address.
    pub ip: Option<IpAddr>,
}

/// One cluster of the gateway.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Cluster {
    /// The cluster name.
    pub name: String,
    /// `filter_metadata.istio.services[0].host`, if present.
    pub istio_service_host: Option<String>,
    /// The staleguard plugin configuration attached to this cluster.
    pub plugin: Option<PluginConfig>,
    /// The endpoints.
    pub endpoints: Vec<Endpoint>,
    /// The settings a retry twin copies from its cluster ([`twin_settings`]),
    /// when the config dump has the cluster.
    pub settings: Option<Value>,
}

/// A gateway's clusters, sorted by name.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Gateway {
    /// The clusters.
    pub clusters: Vec<Cluster>,
    /// The staleguard plugin configuration attached gateway-wide, if any.
    pub plugin: Option<PluginConfig>,
    /// Things worth telling the operator (a plugin configuration that does
    /// not parse, several different gateway-wide ones).
    pub notes: Vec<String>,
}

impl Gateway {
    /// The plugin configuration a cluster is resolved with: `forced` (the
    /// `--plugin-config` flag), else the cluster's own, else the
    /// gateway-wide one, else the defaults.
    pub fn plugin_for<'a>(
        &'a self,
        cluster: &'a Cluster,
        forced: Option<&'a PluginConfig>,
        defaults: &'a PluginConfig,
    ) -> &'a PluginConfig {
        forced
            .or(cluster.plugin.as_ref())
            .or(self.plugin.as_ref())
            .unwrap_or(defaults)
    }

    /// Where [`Gateway::plugin_for`] takes the configuration from: `flag`,
    /// `cluster`, `gateway` or `default`.
    pub fn plugin_source(&self, cluster: &Cluster, forced: Option<&PluginConfig>) -> &'static str {
        if forced.is_some() {
            "flag"
        } else if cluster.plugin.is_some() {
            "cluster"
        } else if self.plugin.is_some() {
            "gateway"
        } else {
            "default"
        }
    }

    /// The retry twins among the clusters: twin name -> the guarded
    /// cluster's name. A twin is `<cluster><twin_suffix>` of a cluster whose
    /// plugin configuration has a `retry` block. It holds its cluster's
    /// endpoints again and the filter there checks picks against the members
    /// the guarded cluster's filter named, not against the index.
    pub fn twins(
        &self,
        forced: Option<&PluginConfig>,
        defaults: &PluginConfig,
    ) -> std::collections::HashMap<String, String> {
        let names: std::collections::HashSet<&str> =
            self.clusters.iter().map(|c| c.name.as_str()).collect();
        self.clusters
            .iter()
            .filter_map(|c| {
                let retry = self.plugin_for(c, forced, defaults).retry.as_ref()?;
                let twin = retry.twin_name(&c.name);
                names
                    .contains(twin.as_str())
                    .then(|| (twin, c.name.clone()))
            })
            .collect()
    }

    /// The service `cluster` routes to, resolved as the filter resolves it.
    pub fn service_of(
        &self,
        cluster: &Cluster,
        forced: Option<&PluginConfig>,
        defaults: &PluginConfig,
    ) -> Option<ServiceKey> {
        self.plugin_for(cluster, forced, defaults)
            .cluster_map()
            .resolve(&cluster.name, cluster.istio_service_host.as_deref())
    }
}

// === /clusters?format=json ===

// Typed, so that serde skips what the audit does not read (per-host stats,
// health, locality: most of the document) without building it.
#[derive(Debug, Deserialize)]
struct ClustersJson {
    #[serde(default)]
    cluster_statuses: Option<Vec<ClusterStatus>>,
}

#[derive(Debug, Deserialize)]
struct ClusterStatus {
    name: String,
    #[serde(default)]
    host_statuses: Vec<HostStatus>,
}

#[derive(Debug, Deserialize)]
struct HostStatus {
    #[serde(default)]
    address: Option<Address>,
}

/// `envoy.config.core.v3.Address`, the parts the audit shows.
#[derive(Debug, Default, Deserialize)]
struct Address {
    #[serde(default)]
    socket_address: Option<SocketAddress>,
    #[serde(default)]
    pipe: Option<Pipe>,
    #[serde(default)]
    envoy_internal_address: Option<InternalAddress>,
}

/// An Envoy internal address (Istio ambient's HBONE endpoints:
/// `connect_originate` with the pod's `IP:port` as `endpoint_id`).
#[derive(Debug, Deserialize)]
struct InternalAddress {
    #[serde(default)]
    server_listener_name: String,
    #[serde(default)]
    endpoint_id: String,
}

#[derive(Debug, Deserialize)]
struct SocketAddress {
    #[serde(default)]
    address: String,
    #[serde(default)]
    port_value: Option<u32>,
}

#[derive(Debug, Deserialize)]
struct Pipe {
    #[serde(default)]
    path: String,
}

/// Reads `/clusters?format=json`: each cluster's name and hosts.
pub fn parse_clusters(bytes: &[u8]) -> Result<Vec<Cluster>, GatewayError> {
    let what = "/clusters?format=json";
    let parsed: ClustersJson = serde_json::from_slice(bytes).map_err(|source| {
        if source.is_eof() || source.is_syntax() {
            GatewayError::Json {
                what: what.into(),
                source,
            }
        } else {
            GatewayError::Shape {
                what: what.into(),
                detail: source.to_string(),
            }
        }
    })?;
    let statuses = match parsed.cluster_statuses {
        Some(statuses) => statuses,
        // Envoy omits an empty list: `{}` is a gateway with no clusters; any
        // other object without the list is not this endpoint's output.
        None if is_empty_object(bytes) => Vec::new(),
        None => {
            return Err(GatewayError::Shape {
                what: what.into(),
                detail: "no `cluster_statuses`".into(),
            })
        }
    };
    Ok(statuses
        .into_iter()
        .map(|c| Cluster {
            name: c.name,
            endpoints: c
                .host_statuses
                .into_iter()
                .map(|h| typed_endpoint(h.address.unwrap_or_default()))
                .collect(),
            ..Cluster::default()
        })
        .collect())
}

fn is_empty_object(bytes: &[u8]) -> bool {
    let text: Vec<u8> = bytes
        .iter()
        .copied()
        .filter(|b| !b.is_ascii_whitespace())
        .collect();
    text == b"{}"
}

fn typed_endpoint(address: Address) -> Endpoint {
    match (
        address.socket_address,
        address.pipe,
        address.envoy_internal_address,
    ) {
        (Some(s), _, _) => socket_endpoint(&s.address, s.port_value.map(u64::from)),
        (None, Some(pipe), _) => Endpoint {
            address: format!("pipe:{}", pipe.path),
            ip: None,
        },
        // Judged by the endpoint_id's IP, as the filter does.
        (None, None, Some(internal)) => Endpoint {
            ip: internal
                .endpoint_id
                .parse::<SocketAddr>()
                .map(|a| a.ip())
                .or_else(|_| internal.endpoint_id.parse::<IpAddr>())
                .ok()
                .map(staleguard_core::ip::canonical),
            address: format!(
                "envoy://{}/{}",
                internal.server_listener_name, internal.endpoint_id
            ),
        },
        (None, None, None) => Endpoint {
            address: "?".into(),
            ip: None,
        },
    }
}

fn socket_endpoint(host: &str, port: Option<u64>) -> Endpoint {
    let ip = host.parse::<IpAddr>().ok();
    let address = match (ip, port) {
        (Some(ip), Some(port)) => SocketAddr::new(ip, port as u16).to_string(),
        (None, Some(port)) => format!("{host}:{port}"),
        (_, None) => host.to_owned(),
    };
    Endpoint { address, ip }
}

/// An endpoint from an `envoy.config.core.v3.Address` in JSON.
fn endpoint(address: Option<&Value>) -> Endpoint {
    match address.map(Address::deserialize) {
        Some(Ok(address)) => typed_endpoint(address),
        Some(Err(_)) | None => Endpoint {
            address: address.map_or_else(|| "?".to_owned(), |a| compact(a, 80)),
            ip: None,
        },
    }
}

fn compact(value: &Value, max: usize) -> String {
    let text = value.to_string();
    if text.len() <= max {
        return text;
    }
    let mut cut = max;
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}…", &text[..cut])
}

// === /config_dump ===

/// Reads a `/config_dump` (with or without `include_eds`): clusters with
/// their metadata, plugin configuration and, when the dump has them, their
/// endpoints; and the gateway-wide plugin configuration.
pub fn parse_config_dump(bytes: &[u8], what: &str) -> Result<Gateway, GatewayError> {
    let value: Value = serde_json::from_slice(bytes).map_err(|source| GatewayError::Json {
        what: what.into(),
        source,
    })?;
    let Some(configs) = value.get("configs").and_then(Value::as_array) else {
        return Err(GatewayError::Shape {
            what: what.into(),
            detail: "no `configs` list".into(),
        });
    };
    let mut gateway = Gateway::default();
    // EDS resource name -> the clusters that read it.
    let mut eds_names: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    let mut assignments = Vec::new();
    let mut wide = Vec::new();
    for config in configs {
        let kind = config.get("@type").and_then(Value::as_str).unwrap_or("");
        if kind.ends_with(".ClustersConfigDump") {
            for entry in entries(config, ["static_clusters", "dynamic_active_clusters"]) {
                let Some(cluster) = entry.get("cluster") else {
                    continue;
                };
                let Some(name) = cluster.get("name").and_then(Value::as_str) else {
                    continue;
                };
                let eds_name = cluster
                    .pointer("/eds_cluster_config/service_name")
                    .and_then(Value::as_str)
                    .filter(|s| !s.is_empty())
                    .unwrap_or(name);
                eds_names
                    .entry(eds_name.to_owned())
                    .or_default()
                    .push(gateway.clusters.len());
                let mut found = Vec::new();
                plugin_configs(cluster, &mut found);
                gateway.clusters.push(Cluster {
                    name: name.to_owned(),
                    istio_service_host: cluster
                        .pointer("/metadata/filter_metadata/istio/services/0/host")
                        .and_then(Value::as_str)
                        .map(str::to_owned),
                    plugin: pick(found, &format!("cluster {name}"), &mut gateway.notes),
                    endpoints: Vec::new(),
                    settings: Some(twin_settings(cluster)),
                });
            }
        } else if kind.ends_with(".EndpointsConfigDump") {
            let lists = ["static_endpoint_configs", "dynamic_endpoint_configs"];
            assignments.extend(entries(config, lists).filter_map(|e| e.get("endpoint_config")));
        } else if !kind.ends_with(".BootstrapConfigDump") {
            // Listeners (a router's upstream filters), ECDS, ...: the
            // bootstrap only repeats static clusters and listeners.
            plugin_configs(config, &mut wide);
        }
    }
    for cla in assignments {
        let Some(name) = cla.get("cluster_name").and_then(Value::as_str) else {
            continue;
        };
        let endpoints: Vec<Endpoint> = cla
            .get("endpoints")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .flat_map(|locality| {
                locality
                    .get("lb_endpoints")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
            })
            .map(|lb| endpoint(lb.pointer("/endpoint/address")))
            .collect();
        for &i in eds_names.get(name).into_iter().flatten() {
            gateway.clusters[i]
                .endpoints
                .extend(endpoints.iter().cloned());
        }
    }
    gateway.plugin = pick(wide, "the gateway's listeners", &mut gateway.notes);
    gateway.clusters.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(gateway)
}

// === Retry twins ===

/// The load balancer fields a twin replaces with its override-host policy
/// (deploy/istio/twins.py `LB_FIELDS`, plus the policy itself).
const TWIN_LB_FIELDS: [&str; 9] = [
    "lb_policy",
    "common_lb_config",
    "least_request_lb_config",
    "round_robin_lb_config",
    "ring_hash_lb_config",
    "maglev_lb_config",
    "original_dst_lb_config",
    "lb_subset_config",
    "load_balancing_policy",
];
const HPO: &str = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions";

/// What a retry twin copies from its cluster, as a config dump shows it
/// (snake_case): the cluster without its name, the EDS resource it reads
/// (the cluster's name when unset: a twin names it), its load balancer
/// (a twin has its own) and its upstream HTTP filters (a twin has the
/// replay filter), and without HTTP/1.1 protocol options that only spell
/// out the default (deploy/istio/twins.py writes them where a cluster has
/// none).
pub fn twin_settings(cluster: &Value) -> Value {
    let mut s = cluster.clone();
    let name = cluster.get("name").cloned().unwrap_or(Value::Null);
    if let Some(o) = s.as_object_mut() {
        o.remove("name");
        for field in TWIN_LB_FIELDS {
            o.remove(field);
        }
        if let Some(la) = o.get_mut("load_assignment").and_then(Value::as_object_mut) {
            la.remove("cluster_name");
        }
        if let Some(eds) = o
            .get_mut("eds_cluster_config")
            .and_then(Value::as_object_mut)
        {
            let read = eds
                .get("service_name")
                .filter(|v| v.as_str().is_some_and(|s| !s.is_empty()))
                .cloned()
                .unwrap_or(name);
            eds.insert("service_name".into(), read);
        }
        let options = o
            .get_mut("typed_extension_protocol_options")
            .and_then(Value::as_object_mut);
        if let Some(options) = options {
            if let Some(hpo) = options.get_mut(HPO).and_then(Value::as_object_mut) {
                hpo.remove("http_filters");
                let default_only = hpo.len() == 2
                    && hpo.get("explicit_http_config")
                        == Some(&serde_json::json!({"http_protocol_options": {}}));
                if default_only || hpo.len() == 1 {
                    options.remove(HPO);
                }
            }
            if options.is_empty() {
                o.remove("typed_extension_protocol_options");
            }
        }
    }
    s
}

/// The top-level fields whose settings differ between a twin and its
/// cluster (see [`twin_settings`]); empty when the twin is current.
pub fn twin_drift(twin: &Value, cluster: &Value) -> Vec<String> {
    let (Some(t), Some(c)) = (twin.as_object(), cluster.as_object()) else {
        return vec!["the whole cluster".into()];
    };
    let mut fields: Vec<String> = t
        .keys()
        .chain(c.keys())
        .filter(|k| t.get(*k) != c.get(*k))
        .cloned()
        .collect();
    fields.sort();
    fields.dedup();
    fields
}

/// Merges the live endpoint lists into what the config dump says about the
/// clusters: the load balancer's hosts are the truth of what is routed to.
pub fn merge(mut config: Gateway, live: Vec<Cluster>) -> Gateway {
    let mut by_name: BTreeMap<String, Cluster> = std::mem::take(&mut config.clusters)
        .into_iter()
        .map(|c| (c.name.clone(), c))
        .collect();
    config.clusters = live
        .into_iter()
        .map(|mut c| {
            if let Some(known) = by_name.remove(&c.name) {
                c.istio_service_host = known.istio_service_host;
                c.plugin = known.plugin;
                c.settings = known.settings;
            }
            c
        })
        .collect();
    config.clusters.sort_by(|a, b| a.name.cmp(&b.name));
    config
}

/// Every staleguard plugin configuration (text) under `value`.
/// The entries of the arrays `lists` of one section of a config dump (a
/// missing list has none).
fn entries<'a, const N: usize>(
    section: &'a Value,
    lists: [&'static str; N],
) -> impl Iterator<Item = &'a Value> {
    lists.into_iter().flat_map(move |list| {
        section
            .get(list)
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
    })
}

fn plugin_configs(value: &Value, out: &mut Vec<Result<PluginConfig, String>>) {
    match value {
        Value::Object(map) => {
            let is_wasm = map
                .get("@type")
                .and_then(Value::as_str)
                .is_some_and(|t| t.ends_with("envoy.extensions.filters.http.wasm.v3.Wasm"));
            if is_wasm {
                let text = value
                    .pointer("/config/configuration/value")
                    .and_then(Value::as_str);
                if let Some(text) = text {
                    let ours = serde_json::from_str::<Value>(text)
                        .ok()
                        .is_some_and(|v| v.get("validator_cluster").is_some());
                    if ours {
                        out.push(parse_plugin(text).map_err(|e| e.problems().join("; ")));
                    }
                }
                return;
            }
            for v in map.values() {
                plugin_configs(v, out);
            }
        }
        Value::Array(items) => {
            for v in items {
                plugin_configs(v, out);
            }
        }
        _ => {}
    }
}

/// The one configuration among `found`, noting what is odd.
fn pick(
    found: Vec<Result<PluginConfig, String>>,
    place: &str,
    notes: &mut Vec<String>,
) -> Option<PluginConfig> {
    let mut good: Vec<PluginConfig> = Vec::new();
    for f in found {
        match f {
            Ok(p) => {
                if !good.contains(&p) {
                    good.push(p);
                }
            }
            Err(e) => notes.push(format!(
                "{place}: a staleguard plugin configuration does not parse ({e}); ignored"
            )),
        }
    }
    if good.len() > 1 {
        notes.push(format!(
            "{place}: {} different staleguard plugin configurations; the first one maps clusters",
            good.len()
        ));
    }
    good.into_iter().next()
}

#[cfg(test)]
mod tests;
