//! The bootstrap of a test gateway, built from a [`Gateway`]: its clusters
//! (static endpoints or file-based EDS, each guarded by the filter or not,
//! with its retry twin when the plugin replays), the validator cluster, and
//! one listener whose routes reach every cluster two ways: by the cluster's
//! name in the `x-cluster` header (the filter tests), or by a `host` of its
//! own ([`VirtualHost`], the end-to-end scenes). The bootstrap carries the
//! `stats_tags` of `deploy/envoy/envoy.yaml`, read from it (see docs/metrics.md).
//!
//! The pieces (the filter entry, the upstream filter chain, the twin, the
//! body path) are public for tests that edit a bootstrap or build one from
//! Istio's output.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde_json::{json, Value};
use staleguard_engine::config::{Config, RetryConfig};

use super::shipped::{
    shipped_circuit_breakers, shipped_memory_allocator_manager, shipped_stats_tags,
    shipped_twin_lb_policy, shipped_upstream_options,
};
use super::{dependencies, Envoy, Launch};
use crate::eds::EdsFile;
use crate::process::free_addr;

/// Where a cluster's endpoints come from.
#[derive(Debug, Clone)]
pub enum Endpoints {
    /// Fixed addresses (`STATIC`).
    Static(Vec<SocketAddr>),
    /// A file-based EDS resource ([`EdsFile`]): the test plays the control
    /// plane and rewrites it, late or never, while Envoy runs.
    Eds {
        /// The file.
        path: PathBuf,
        /// The resource name in it.
        resource: String,
    },
}

/// A virtual host of a cluster's own: requests whose `host` is one of
/// `domains` go to the cluster, with `headers` added.
#[derive(Debug, Clone)]
pub struct VirtualHost {
    /// The `host` values (`name`, `name:*`).
    pub domains: Vec<String>,
    /// Request headers the route sets (overwriting what the client sent).
    pub headers: Vec<(String, String)>,
}

/// One upstream cluster of a gateway.
#[derive(Debug, Clone)]
pub struct Cluster {
    /// Cluster name (an Istio `outbound|...` name, or anything).
    pub name: String,
    /// Its endpoints.
    pub endpoints: Endpoints,
    /// The plugin configuration, or `None` for no filter.
    pub plugin: Option<Value>,
    /// Istio-style `filter_metadata` for the cluster.
    pub metadata: Option<Value>,
    /// Fields set on the cluster (Envoy's own defences: `health_checks`,
    /// `outlier_detection`...); `{}` for none.
    pub extra: Value,
    /// A virtual host of its own, or `None`: reached by `x-cluster` only.
    pub vhost: Option<VirtualHost>,
}

/// A gateway to start.
#[derive(Debug, Clone)]
pub struct Gateway {
    /// Its name: in the node id, the process's log and errors.
    pub name: String,
    /// Envoy worker threads.
    pub concurrency: u32,
    /// The validator's replicas behind the cluster `staleguard-validator`
    /// (round robin).
    pub validators: Vec<SocketAddr>,
    /// Clusters in the bootstrap.
    pub clusters: Vec<Cluster>,
    /// Clusters served by CDS from a file, replaceable with
    /// [`Envoy::update_clusters`] while Envoy runs.
    pub dynamic: Vec<Cluster>,
    /// Fields set on every route's action (`retry_policy`...); `{}` for none.
    pub route_extra: Value,
    /// Run Envoy in its own process group, so a terminal's Ctrl-C reaches only
    /// the harness, which then stops it (the demo); tests leave it `false` so
    /// an interrupted test run takes Envoy down with it.
    pub detach: bool,
}

impl Default for Gateway {
    fn default() -> Self {
        Self {
            name: "gateway".into(),
            concurrency: 1,
            validators: vec![],
            clusters: vec![],
            dynamic: vec![],
            route_extra: json!({}),
            detach: false,
        }
    }
}

/// The cluster name in the `x-cluster` header routes a request by.
pub const CLUSTER_HEADER: &str = "x-cluster";

impl Gateway {
    /// A gateway with one validator and `clusters`, defaults otherwise.
    pub fn new(validator: SocketAddr, clusters: Vec<Cluster>) -> Self {
        Self {
            validators: vec![validator],
            clusters,
            ..Self::default()
        }
    }

    /// True when any cluster runs the filter.
    pub fn guarded(&self) -> bool {
        self.clusters
            .iter()
            .chain(&self.dynamic)
            .any(|c| c.plugin.is_some())
    }

    /// The bootstrap: listener and admin on `listener` and `admin`, the
    /// module at `wasm`, the dynamic clusters read from `cds` (when any).
    pub fn bootstrap(
        &self,
        wasm: &Path,
        listener: SocketAddr,
        admin: SocketAddr,
        cds: Option<&Path>,
    ) -> Value {
        let route = |action: Value| {
            let mut action = action;
            merge_into(&mut action, &self.route_extra);
            action
        };
        let by_header = |extra: Value| {
            let mut action = json!({"cluster_header": CLUSTER_HEADER, "timeout": "5s"});
            merge_into(&mut action, &extra);
            route(action)
        };
        let mut vhosts: Vec<Value> = self
            .clusters
            .iter()
            .filter_map(|c| {
                let vhost = c.vhost.as_ref()?;
                let headers: Vec<Value> = vhost
                    .headers
                    .iter()
                    .map(|(k, v)| {
                        json!({"header": {"key": k, "value": v},
                        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"})
                    })
                    .collect();
                Some(json!({
                    "name": c.name,
                    "domains": vhost.domains,
                    "routes": [{
                        "match": {"prefix": "/"},
                        "route": route(json!({"cluster": c.name, "timeout": "5s"})),
                        "request_headers_to_add": headers,
                    }],
                }))
            })
            .collect();
        // Routes for the replay tests: a prefix rewrite, a short route
        // timeout, and none at all (the replay's own timeout then applies).
        vhosts.push(json!({"name": "by-header", "domains": ["*"], "routes": [
            {"match": {"prefix": "/rewrite/"},
             "route": by_header(json!({"prefix_rewrite": "/rewritten/"}))},
            {"match": {"prefix": "/short-timeout/"}, "route": by_header(json!({"timeout": "1s"}))},
            {"match": {"prefix": "/no-timeout/"}, "route": by_header(json!({"timeout": "0s"}))},
            {"match": {"prefix": "/"}, "route": by_header(json!({}))}
        ]}));
        let mut clusters: Vec<Value> = self
            .clusters
            .iter()
            .flat_map(|c| c.with_twin(wasm))
            .collect();
        clusters.push(static_cluster("staleguard-validator", &self.validators));
        let mut bootstrap = json!({
            // File-based EDS needs a node identity, as any xDS subscription.
            "node": {"id": format!("staleguard-{}", self.name), "cluster": "staleguard-gateway"},
            "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin.port()}}},
            "stats_config": {"stats_tags": stats_tags()},
            "memory_allocator_manager": shipped_memory_allocator_manager(),
            "static_resources": {
                "listeners": [gateway_listener(listener.port(), Value::Array(vhosts))],
                "clusters": clusters
            }
        });
        if let Some(cds) = cds {
            bootstrap["dynamic_resources"] = json!({"cds_config": {
                "path_config_source": {"path": cds.display().to_string()},
                "resource_api_version": "V3"
            }});
        }
        bootstrap
    }

    /// Starts Envoy; `None` (after a SKIP line) when Envoy or the module is
    /// missing outside CI.
    pub fn start(&self) -> Result<Option<Envoy>> {
        self.start_with(|_| Ok(()))
    }

    /// Like [`Gateway::start`], with `edit` applied to the bootstrap first
    /// (a test that brings clusters or routes of its own).
    pub fn start_with(&self, edit: impl FnOnce(&mut Value) -> Result<()>) -> Result<Option<Envoy>> {
        let Some((envoy, wasm)) = dependencies() else {
            return Ok(None);
        };
        self.run(&envoy, &wasm, edit).map(Some)
    }

    /// Runs `envoy` with the module `wasm` on this gateway's bootstrap, edited
    /// by `edit`, and waits until its listener accepts.
    pub fn run(
        &self,
        envoy: &Path,
        wasm: &Path,
        edit: impl FnOnce(&mut Value) -> Result<()>,
    ) -> Result<Envoy> {
        let (listener, admin) = (free_addr()?, free_addr()?);
        let cds = (!self.dynamic.is_empty()).then(|| {
            std::env::temp_dir().join(format!(
                "staleguard-cds-{}-{}.json",
                std::process::id(),
                admin.port()
            ))
        });
        if let Some(cds) = &cds {
            write_cds(cds, wasm, &self.dynamic)?;
        }
        let mut bootstrap = self.bootstrap(wasm, listener, admin, cds.as_deref());
        edit(&mut bootstrap)?;
        let launch = Launch {
            name: self.name.clone(),
            concurrency: self.concurrency,
            env: vec![],
            detach: self.detach,
        };
        let mut running = Envoy::spawn(envoy, &bootstrap, &launch)?;
        running.guarded = self.guarded();
        running.cds = cds.map(|path| (path, wasm.to_owned()));
        Ok(running)
    }
}

impl Cluster {
    /// A cluster to `host`, guarded by `plugin` if given.
    pub fn new(name: &str, host: SocketAddr, plugin: Option<Value>) -> Self {
        Self::with_hosts(name, vec![host], plugin)
    }

    /// A cluster to fixed `hosts`, guarded by `plugin` if given.
    pub fn with_hosts(name: &str, hosts: Vec<SocketAddr>, plugin: Option<Value>) -> Self {
        Self::on(name, Endpoints::Static(hosts), plugin)
    }

    /// A cluster whose endpoints `eds` lists, guarded by `plugin` if given.
    pub fn eds(name: &str, eds: &EdsFile, plugin: Option<Value>) -> Self {
        let endpoints = Endpoints::Eds {
            path: eds.path().to_owned(),
            resource: eds.resource().to_owned(),
        };
        Self::on(name, endpoints, plugin)
    }

    fn on(name: &str, endpoints: Endpoints, plugin: Option<Value>) -> Self {
        Self {
            name: name.into(),
            endpoints,
            plugin,
            metadata: None,
            extra: json!({}),
            vhost: None,
        }
    }

    /// The cluster, and its twin when the plugin replays rejections (the twin
    /// has the same endpoints, or reads the same EDS resource).
    fn with_twin(&self, wasm: &Path) -> Vec<Value> {
        let c = self.to_json(wasm);
        let twin = self.plugin.as_ref().and_then(|p| twin_cluster(&c, wasm, p));
        std::iter::once(c).chain(twin).collect()
    }

    fn to_json(&self, wasm: &Path) -> Value {
        let mut c = match &self.endpoints {
            Endpoints::Static(hosts) => static_cluster(&self.name, hosts),
            Endpoints::Eds { path, resource } => json!({
                "name": self.name,
                "type": "EDS",
                "connect_timeout": "1s",
                "eds_cluster_config": {
                    "service_name": resource,
                    "eds_config": {
                        "resource_api_version": "V3",
                        "path_config_source": {"path": path.display().to_string()},
                    },
                },
            }),
        };
        if self.plugin.is_some() && !shipped_circuit_breakers().is_null() {
            // The shipped thresholds (the route's retries need them).
            c["circuit_breakers"] = shipped_circuit_breakers();
        }
        merge_into(&mut c, &self.extra);
        if let Some(plugin) = &self.plugin {
            c["typed_extension_protocol_options"] = upstream_filter_options(wasm, plugin);
        }
        if let Some(m) = &self.metadata {
            c["metadata"] = json!({"filter_metadata": m});
        }
        c
    }
}

/// Writes the CDS file (aside, then renamed, as Envoy's file watch expects).
pub(super) fn write_cds(path: &Path, wasm: &Path, clusters: &[Cluster]) -> Result<()> {
    let resources: Vec<Value> = clusters
        .iter()
        .flat_map(|c| c.with_twin(wasm))
        .map(|mut c| {
            c["@type"] = json!("type.googleapis.com/envoy.config.cluster.v3.Cluster");
            // The build under test runs in CDS clusters too (see native::swap_in).
            if super::native::selected() {
                super::native::swap_cluster(&mut c);
            }
            c
        })
        .collect();
    let tmp = path.with_extension("tmp");
    std::fs::write(
        &tmp,
        serde_json::to_vec_pretty(&json!({"resources": resources}))?,
    )
    .with_context(|| format!("write {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("rename onto {}", path.display()))?;
    Ok(())
}

/// Sets every field of the object `extra` on the object `into`.
pub(super) fn merge_into(into: &mut Value, extra: &Value) {
    if let (Some(into), Some(extra)) = (into.as_object_mut(), extra.as_object()) {
        for (k, v) in extra {
            into.insert(k.clone(), v.clone());
        }
    }
}

/// A `STATIC` cluster to `hosts`.
pub fn static_cluster(name: &str, hosts: &[SocketAddr]) -> Value {
    let endpoints: Vec<Value> = hosts.iter().map(lb_endpoint).collect();
    json!({
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": endpoints}]
        }
    })
}

/// One entry of a `load_assignment`'s `lb_endpoints`: `addr`.
pub fn lb_endpoint(addr: &SocketAddr) -> Value {
    json!({"endpoint": {"address": {"socket_address": {
        "address": addr.ip().to_string(), "port_value": addr.port()}}}})
}

/// The `stats_tags` that turn staleguard metric names into labels, as
/// `deploy/envoy/envoy.yaml` ships them (see docs/metrics.md).
pub fn stats_tags() -> Value {
    shipped_stats_tags()
}

/// The static clusters of a bootstrap.
pub fn clusters_mut(bootstrap: &mut Value) -> Result<&mut Vec<Value>> {
    bootstrap["static_resources"]["clusters"]
        .as_array_mut()
        .context("no static clusters in the bootstrap")
}

/// The static cluster `name` of a bootstrap.
pub fn cluster_mut<'a>(bootstrap: &'a mut Value, name: &str) -> Result<&'a mut Value> {
    clusters_mut(bootstrap)?
        .iter_mut()
        .find(|c| c["name"] == name)
        .with_context(|| format!("no cluster {name} in the bootstrap"))
}

/// Adds `addresses` to the static endpoints of `cluster`'s retry twin
/// (named with the default `retry.twin_suffix`) in a bootstrap: the live pods a replay may
/// name, where the guarded cluster itself only has a stale one.
pub fn add_twin_endpoints(
    bootstrap: &mut Value,
    cluster: &str,
    addresses: &[SocketAddr],
) -> Result<()> {
    let twin_name = RetryConfig::default().twin_name(cluster);
    let twin = cluster_mut(bootstrap, &twin_name)?;
    let endpoints = twin["load_assignment"]["endpoints"][0]["lb_endpoints"]
        .as_array_mut()
        .with_context(|| format!("no static endpoints in {twin_name}"))?;
    endpoints.extend(addresses.iter().map(lb_endpoint));
    Ok(())
}

/// A cluster's `typed_extension_protocol_options` that run the filter as an
/// upstream HTTP filter (before the codec, where the chosen host is known):
/// the shipped guarded cluster's (see [`shipped_upstream_options`]) with the
/// module `wasm` and the configuration `plugin`.
pub fn upstream_filter_options(wasm: &Path, plugin: &Value) -> Value {
    configured(shipped_upstream_options(false), wasm, plugin)
}

/// `options` with every Wasm filter running `wasm` with `plugin`.
fn configured(mut options: Value, wasm: &Path, plugin: &Value) -> Value {
    for config in wasm_configs_mut(&mut options, wasm) {
        config["configuration"]["value"] = json!(plugin.to_string());
    }
    options
}

/// The `config` of every Wasm filter in a cluster's
/// `typed_extension_protocol_options`, each set to run the module `wasm`.
pub(super) fn wasm_configs_mut<'a>(
    options: &'a mut Value,
    wasm: &'a Path,
) -> impl Iterator<Item = &'a mut Value> + 'a {
    options
        .as_object_mut()
        .into_iter()
        .flat_map(|o| o.values_mut())
        .filter_map(|hpo| hpo["http_filters"].as_array_mut())
        .flatten()
        .filter(|f| f["name"] == "envoy.filters.http.wasm")
        .map(move |filter| {
            let config = &mut filter["typed_config"]["config"];
            config["vm_config"]["code"] =
                json!({"local": {"filename": wasm.display().to_string()}});
            config
        })
}

/// The twin of a guarded cluster, for the replay of rejected requests
/// (`on_reject: retry`), as `deploy/envoy/envoy.yaml` has it: `cluster` (the
/// guarded cluster's JSON: same endpoints or EDS source, same transport
/// socket) renamed `<name><twin_suffix>`, with the override-host load balancer
/// reading `endpoint_header` (round robin as the fallback: the shipped
/// twin's `load_balancing_policy`, read from the file), and the filter in
/// its twin role in a VM of its own (`vm_id` `staleguard-twin`: a callout into
/// the VM that made it would re-enter it). `None` when `plugin` asks for no
/// replay: the filter's own parser decides that, and names the twin, so the
/// harness builds a twin exactly where the filter replays (not in audit
/// mode, not with `on_reject: reject`, not for a refused configuration).
pub fn twin_cluster(cluster: &Value, wasm: &Path, plugin: &Value) -> Option<Value> {
    let config = Config::parse_outside_gateway(plugin.to_string().as_bytes()).ok()?;
    let retry = config.replay()?;
    let header = retry.endpoint_header.as_str();
    let mut twin = cluster.clone();
    let name = retry.twin_name(cluster.get("name")?.as_str()?);
    twin["name"] = json!(name);
    if twin.get("load_assignment").is_some() {
        twin["load_assignment"]["cluster_name"] = json!(name);
    }
    // The override-host balancer of the shipped twin, reading `header`.
    let mut policy = shipped_twin_lb_policy();
    policy["policies"][0]["typed_extension_config"]["typed_config"]["override_host_sources"] =
        json!([{"header": header}]);
    twin["load_balancing_policy"] = policy;
    twin["typed_extension_protocol_options"] = configured(
        shipped_upstream_options(true),
        wasm,
        &json!({"replay_twin": {"endpoint_header": header}}),
    );
    Some(twin)
}

/// The body path for requests with bodies as `deploy/envoy/envoy.yaml` has
/// it when its hop names no members (no index yet; the steering hop itself
/// is not built here, see `shipped_gateway`): the outer route sends them to the
/// cluster `staleguard-body`, whose one endpoint is the internal listener
/// `staleguard-body`, whose route (`inner_route`) leads to the guarded
/// cluster. A rejection there (a 503 with `reject_header`) is an answer the
/// outer router retries, `retries` times, body included; each retry is a new
/// pick. Returns the outer route for `prefix` and edits `bootstrap` (the
/// bootstrap extension, the internal listener and its cluster).
pub fn body_path(
    bootstrap: &mut Value,
    prefix: &str,
    inner_route: Value,
    reject_header: &str,
    retries: u32,
) -> Value {
    bootstrap["bootstrap_extensions"] = json!([{
        "name": "envoy.bootstrap.internal_listener",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.bootstrap.internal_listener.v3.InternalListener"}
    }]);
    let listener = json!({
        "name": "staleguard-body",
        "internal_listener": {},
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                "stat_prefix": "staleguard_body",
                "route_config": {"virtual_hosts": [{"name": "inner", "domains": ["*"],
                    "routes": [{"match": {"prefix": "/"}, "route": inner_route}]}]},
                "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]
            }
        }]}]
    });
    let cluster = json!({
        "name": "staleguard-body",
        "connect_timeout": "1s",
        "load_assignment": {"cluster_name": "staleguard-body", "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"envoy_internal_address": {"server_listener_name": "staleguard-body"}}}}
        ]}]}
    });
    if let Some(l) = bootstrap["static_resources"]["listeners"].as_array_mut() {
        l.push(listener);
    }
    if let Some(c) = bootstrap["static_resources"]["clusters"].as_array_mut() {
        c.push(cluster);
    }
    json!({
        "match": {"prefix": prefix},
        "route": {
            "cluster": "staleguard-body",
            "timeout": "5s",
            "retry_policy": {
                "retry_on": "retriable-headers",
                "retriable_headers": [{"name": reject_header, "present_match": true}],
                "num_retries": retries
            }
        }
    })
}

/// The gateway's listener on `127.0.0.1:port`: an HTTP connection manager
/// with `virtual_hosts` and the router, as every test Envoy has it.
pub fn gateway_listener(port: u16, virtual_hosts: Value) -> Value {
    json!({
        "name": "gateway",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                "stat_prefix": "gateway",
                "route_config": {"virtual_hosts": virtual_hosts},
                "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]
            }
        }]}]
    })
}
