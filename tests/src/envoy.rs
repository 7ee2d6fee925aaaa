//! Real Envoy with the staleguard filter, for the filter tests.
//!
//! [`Gateway`] describes a gateway: clusters (each one upstream host, with or
//! without the filter and its own plugin configuration) and the validator
//! cluster; [`Gateway::start`] writes the bootstrap (JSON) and runs Envoy. A
//! request picks its cluster with the `x-cluster` header, so one Envoy serves
//! every scenario of a test. The bootstrap carries the same `stats_tags` as
//! `deploy/envoy/envoy.yaml` (see `docs/metrics.md`).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use crate::blocking::{self, Response};
use crate::process::{free_port, require, wait_for_port, Guard};

/// The Envoy binary and the filter module, or `None` (after a SKIP line)
/// outside CI when they are missing.
pub fn dependencies() -> Option<(PathBuf, PathBuf)> {
    let hint = "run `. scripts/setup.sh && sg_setup_all` (installs Envoy, builds the filter)";
    let envoy = require("STALEGUARD_ENVOY", "Envoy 1.40", hint)?;
    let wasm = require("STALEGUARD_WASM", "the staleguard filter module", hint)?;
    Some((envoy, wasm))
}

/// The `stats_tags` that turn staleguard metric names into labels.
pub fn stats_tags() -> Value {
    json!([
        {"tag_name": "staleguard_service",
         "regex": "^wasmcustom\\.staleguard_filter_requests_total(\\.service\\.([^.]+))"},
        {"tag_name": "staleguard_reason",
         "regex": "^wasmcustom\\.staleguard_filter_requests_total\\.service\\.[^.]+(\\.reason\\.([a-z_]+))"},
        {"tag_name": "staleguard_action",
         "regex": "^wasmcustom\\.staleguard_filter_requests_total\\.service\\.[^.]+\\.reason\\.[a-z_]+(\\.action\\.([a-z_]+))$"},
        {"tag_name": "staleguard_error_kind",
         "regex": "^wasmcustom\\.staleguard_filter_sync_errors_total(\\.kind\\.([a-z_]+))$"},
        {"tag_name": "staleguard_outcome",
         "regex": "^wasmcustom\\.staleguard_filter_(?:retries_total|twin_picks_total)(\\.outcome\\.([a-z_]+))$"}
    ])
}

/// One cluster with one upstream host.
#[derive(Debug, Clone)]
pub struct Cluster {
    /// Cluster name (an Istio `outbound|...` name, or anything).
    pub name: String,
    /// The hosts (usually one).
    pub hosts: Vec<SocketAddr>,
    /// The plugin configuration, or `None` for no filter.
    pub plugin: Option<Value>,
    /// Istio-style `filter_metadata` for the cluster.
    pub metadata: Option<Value>,
}

/// A gateway to start.
#[derive(Debug, Clone)]
pub struct Gateway {
    /// Worker threads.
    pub concurrency: u32,
    /// The validator's address (cluster `staleguard-validator`).
    pub validator: SocketAddr,
    /// More validator replicas behind the same cluster (round robin).
    pub replicas: Vec<SocketAddr>,
    /// Clusters.
    pub clusters: Vec<Cluster>,
    /// Clusters served by CDS from a file, replaceable with
    /// [`Envoy::update_clusters`] while Envoy runs.
    pub dynamic: Vec<Cluster>,
}

/// The JSON blocks under `value: |` in a YAML file: the plugin
/// configurations of a shipped manifest.
pub fn plugin_configs_in(yaml: &str) -> Vec<String> {
    let lines: Vec<&str> = yaml.lines().collect();
    let mut out = vec![];
    for (i, line) in lines.iter().enumerate() {
        if line.trim_end().ends_with("value: |") {
            let indent = line.len() - line.trim_start().len();
            let block: Vec<&str> = lines[i + 1..]
                .iter()
                .take_while(|l| l.trim().is_empty() || l.len() - l.trim_start().len() > indent)
                .copied()
                .collect();
            out.push(block.join("\n"));
        }
    }
    out
}

/// Keys of the shipped plugin configuration that describe one gateway's
/// topology (which cluster is which service, the validator's DNS name), not
/// how the filter behaves: a test gateway brings its own.
const TOPOLOGY_KEYS: [&str; 3] = ["clusters", "istio", "validator_authority"];

/// The plugin configuration `deploy/envoy/envoy.yaml` ships, read from that
/// file, without its topology keys. What tests, the demo and benchmarks run.
pub fn shipped_plugin_config() -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/envoy/envoy.yaml");
    let yaml = std::fs::read_to_string(path).unwrap_or_default();
    let mut config = plugin_configs_in(&yaml)
        .first()
        .and_then(|c| serde_json::from_str::<Value>(c).ok())
        .unwrap_or_else(|| panic!("no plugin configuration (`value: |` JSON) in {path}"));
    if let Some(object) = config.as_object_mut() {
        for key in TOPOLOGY_KEYS {
            object.remove(key);
        }
    }
    config
}

/// Adds `addresses` to the static endpoints of `cluster`'s retry twin
/// (`<cluster>|staleguard-twin`) in a bootstrap: the live pods a replay may
/// name, where the guarded cluster itself only has a stale one.
pub fn add_twin_endpoints(
    bootstrap: &mut Value,
    cluster: &str,
    addresses: &[SocketAddr],
) -> Result<()> {
    let twin_name = format!("{cluster}|staleguard-twin");
    let twin = bootstrap["static_resources"]["clusters"]
        .as_array_mut()
        .context("no static clusters in the bootstrap")?
        .iter_mut()
        .find(|c| c["name"] == twin_name.as_str())
        .with_context(|| format!("no twin cluster {twin_name}"))?;
    let endpoints = twin["load_assignment"]["endpoints"][0]["lb_endpoints"]
        .as_array_mut()
        .with_context(|| format!("no static endpoints in {twin_name}"))?;
    for a in addresses {
        endpoints.push(json!({"endpoint": {"address": {"socket_address": {
            "address": a.ip().to_string(), "port_value": a.port()}}}}));
    }
    Ok(())
}

/// The `retry_policy` of the route `deploy/envoy/envoy.yaml` ships for
/// requests without a body (the last route of the gateway's virtual host):
/// what a gateway that stands for the shipped one sets on its routes.
pub fn shipped_route_retry_policy() -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/envoy/envoy.yaml");
    let yaml = std::fs::read_to_string(path).unwrap_or_default();
    let doc: Value =
        yaml_serde::from_str(&yaml).unwrap_or_else(|e| panic!("{path} is not YAML: {e}"));
    let routes = &doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        ["typed_config"]["route_config"]["virtual_hosts"][0]["routes"];
    routes
        .as_array()
        .and_then(|r| r.last())
        .map(|r| r["route"]["retry_policy"].clone())
        .filter(|p| p.is_object())
        .unwrap_or_else(|| panic!("no retry_policy on the last route of {path}"))
}

/// The shipped plugin configuration ([`shipped_plugin_config`]) with `extra`
/// fields on top: topology (`clusters`, `istio`), a `token`, or the knob a
/// test is about. A test that turns a knob names it in its title.
pub fn shipped_plugin(extra: Value) -> Value {
    let mut base = shipped_plugin_config();
    if let (Some(b), Some(e)) = (base.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            b.insert(k.clone(), v.clone());
        }
    }
    base
}

/// The Wasm HTTP filter entry running the staleguard module with `plugin`.
pub fn wasm_filter(wasm: &Path, plugin: &Value) -> Value {
    json!({
        "name": "envoy.filters.http.wasm",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
            "config": {
                "name": "staleguard",
                "root_id": "staleguard",
                "vm_config": {
                    "vm_id": "staleguard",
                    "runtime": "envoy.wasm.runtime.v8",
                    "code": {"local": {"filename": wasm.display().to_string()}}
                },
                "configuration": {
                    "@type": "type.googleapis.com/google.protobuf.StringValue",
                    "value": plugin.to_string()
                }
            }
        }
    })
}

/// A cluster's `typed_extension_protocol_options` that run the filter as an
/// upstream HTTP filter (before the codec, where the chosen host is known).
pub fn upstream_filter_options(wasm: &Path, plugin: &Value) -> Value {
    json!({
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http_protocol_options": {}},
            "http_filters": [
                wasm_filter(wasm, plugin),
                {"name": "envoy.filters.http.upstream_codec",
                 "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.upstream_codec.v3.UpstreamCodec"}}
            ]
        }
    })
}

/// The twin of a guarded cluster, for the replay of rejected requests
/// (`on_reject: retry`), as `deploy/envoy/envoy.yaml` has it: `cluster` (the
/// guarded cluster's JSON: same endpoints or EDS source, same transport
/// socket) renamed `<name><twin_suffix>`, with the override-host load balancer
/// reading `endpoint_header` (round robin as the fallback), and the filter in
/// its twin role in a VM of its own (`vm_id` `staleguard-twin`: a callout into
/// the VM that made it would re-enter it). `None` when `plugin` asks for no
/// replay.
pub fn twin_cluster(cluster: &Value, wasm: &Path, plugin: &Value) -> Option<Value> {
    let retry = plugin.get("retry")?;
    if plugin.get("on_reject").and_then(Value::as_str) == Some("reject") {
        return None;
    }
    let suffix = retry
        .get("twin_suffix")
        .and_then(Value::as_str)
        .unwrap_or("|staleguard-twin");
    let header = retry
        .get("endpoint_header")
        .and_then(Value::as_str)
        .unwrap_or("x-gateway-destination-endpoint");
    let mut twin = cluster.clone();
    let name = format!("{}{suffix}", cluster.get("name")?.as_str()?);
    twin["name"] = json!(name);
    if twin.get("load_assignment").is_some() {
        twin["load_assignment"]["cluster_name"] = json!(name);
    }
    twin["load_balancing_policy"] = json!({"policies": [{"typed_extension_config": {
        "name": "envoy.load_balancing_policies.override_host",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
            "override_host_sources": [{"header": header}],
            "fallback_policy": {"policies": [{"typed_extension_config": {
                "name": "envoy.load_balancing_policies.round_robin",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"}
            }}]}
        }
    }}]});
    let mut filter = wasm_filter(wasm, &json!({"replay_twin": {"endpoint_header": header}}));
    filter["typed_config"]["config"]["vm_config"]["vm_id"] = json!("staleguard-twin");
    twin["typed_extension_protocol_options"] = json!({
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http_protocol_options": {}},
            "http_filters": [
                filter,
                {"name": "envoy.filters.http.upstream_codec",
                 "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.upstream_codec.v3.UpstreamCodec"}}
            ]
        }
    });
    Some(twin)
}

/// The full-fidelity path for requests with bodies, as
/// `deploy/envoy/body-path.yaml` ships it: the outer route sends them to the
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

fn static_cluster(name: &str, hosts: &[SocketAddr]) -> Value {
    let endpoints: Vec<Value> = hosts
        .iter()
        .map(|h| {
            json!({"endpoint": {"address": {"socket_address": {
                "address": h.ip().to_string(), "port_value": h.port()}}}})
        })
        .collect();
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

impl Cluster {
    /// A cluster to `host`, guarded by `plugin` if given.
    pub fn new(name: &str, host: SocketAddr, plugin: Option<Value>) -> Self {
        Self {
            name: name.into(),
            hosts: vec![host],
            plugin,
            metadata: None,
        }
    }

    /// The cluster, and its twin when the plugin replays rejections.
    fn with_twin(&self, wasm: &Path) -> Vec<Value> {
        let c = self.to_json(wasm);
        let twin = self.plugin.as_ref().and_then(|p| twin_cluster(&c, wasm, p));
        std::iter::once(c).chain(twin).collect()
    }

    fn to_json(&self, wasm: &Path) -> Value {
        let mut c = static_cluster(&self.name, &self.hosts);
        if let Some(plugin) = &self.plugin {
            c["typed_extension_protocol_options"] = upstream_filter_options(wasm, plugin);
        }
        if let Some(m) = &self.metadata {
            c["metadata"] = json!({"filter_metadata": m});
        }
        c
    }
}

/// A running Envoy.
#[derive(Debug)]
pub struct Envoy {
    guard: Guard,
    wasm: PathBuf,
    cds: PathBuf,
    /// The gateway listener.
    pub listener: SocketAddr,
    /// The admin listener.
    pub admin: SocketAddr,
}

impl Gateway {
    /// The bootstrap for this gateway.
    pub fn bootstrap(
        &self,
        wasm: &Path,
        listener: SocketAddr,
        admin: SocketAddr,
        cds: &Path,
    ) -> Value {
        let route = json!({"cluster_header": "x-cluster", "timeout": "5s"});
        // Routes for the replay tests: a prefix rewrite, a short route
        // timeout, and none at all (the replay's own timeout then applies).
        let routes = json!([
            {"match": {"prefix": "/rewrite/"}, "route":
                {"cluster_header": "x-cluster", "timeout": "5s", "prefix_rewrite": "/rewritten/"}},
            {"match": {"prefix": "/short-timeout/"}, "route":
                {"cluster_header": "x-cluster", "timeout": "1s"}},
            {"match": {"prefix": "/no-timeout/"}, "route":
                {"cluster_header": "x-cluster", "timeout": "0s"}},
            {"match": {"prefix": "/"}, "route": route}
        ]);
        let mut clusters: Vec<Value> = self
            .clusters
            .iter()
            .flat_map(|c| c.with_twin(wasm))
            .collect();
        let validators: Vec<SocketAddr> = std::iter::once(self.validator)
            .chain(self.replicas.iter().copied())
            .collect();
        clusters.push(static_cluster("staleguard-validator", &validators));
        json!({
            "node": {"id": "staleguard-test", "cluster": "staleguard-test"},
            "dynamic_resources": {"cds_config": {
                "path_config_source": {"path": cds.display().to_string()},
                "resource_api_version": "V3"
            }},
            "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin.port()}}},
            "stats_config": {"stats_tags": stats_tags()},
            "static_resources": {
                "listeners": [gateway_listener(listener.port(), json!([{"name": "all", "domains": ["*"],
                    "routes": routes}]))],
                "clusters": clusters
            }
        })
    }

    /// Starts Envoy; `None` (after a SKIP line) when Envoy or the module is
    /// missing outside CI.
    pub fn start(&self) -> Result<Option<Envoy>> {
        self.start_with(|_| Ok(()))
    }

    /// Like [`Gateway::start`], with `edit` applied to the bootstrap first
    /// (a test that brings clusters of its own, such as generated twins).
    pub fn start_with(&self, edit: impl FnOnce(&mut Value) -> Result<()>) -> Result<Option<Envoy>> {
        let Some((envoy, wasm)) = dependencies() else {
            return Ok(None);
        };
        let listener: SocketAddr = format!("127.0.0.1:{}", free_port()?).parse()?;
        let admin: SocketAddr = format!("127.0.0.1:{}", free_port()?).parse()?;
        let dir = std::env::temp_dir().join(format!(
            "staleguard-envoy-{}-{}",
            std::process::id(),
            listener.port()
        ));
        std::fs::create_dir_all(&dir)?;
        let cds = dir.join("cds.json");
        write_cds(&cds, &wasm, &self.dynamic)?;
        let mut config = self.bootstrap(&wasm, listener, admin, &cds);
        edit(&mut config)?;
        let path = dir.join("envoy.json");
        std::fs::write(&path, serde_json::to_vec_pretty(&config)?)?;
        let mut cmd = Command::new(envoy);
        cmd.arg("-c")
            .arg(&path)
            .args(["--concurrency", &self.concurrency.to_string()])
            .args(["--disable-hot-restart", "-l", "info"]);
        let mut guard = Guard::spawn("envoy", cmd)?;
        wait_for_port(&mut guard, listener, Duration::from_secs(30))?;
        let envoy = Envoy {
            guard,
            wasm,
            cds,
            listener,
            admin,
        };
        Ok(Some(envoy))
    }
}

impl Envoy {
    /// Sends `GET /` through the gateway to `cluster`.
    pub fn get(&mut self, cluster: &str) -> Result<Response> {
        self.guard.check_alive()?;
        blocking::get(self.listener, "/", &[("x-cluster", cluster)])
    }

    /// Sends `method target` with `body` through the gateway to `cluster`.
    pub fn send(
        &mut self,
        cluster: &str,
        method: &str,
        target: &str,
        body: Option<&[u8]>,
    ) -> Result<Response> {
        self.guard.check_alive()?;
        blocking::request(
            self.listener,
            method,
            target,
            &[("x-cluster", cluster)],
            body,
        )
    }

    /// Envoy's process id.
    pub fn pid(&self) -> u32 {
        self.guard.pid()
    }

    /// An admin page.
    pub fn admin(&self, target: &str) -> Result<String> {
        Ok(blocking::get(self.admin, target, &[])?.body)
    }

    /// A counter or gauge from `/stats` (full name, e.g.
    /// `wasmcustom.staleguard_filter_sync_polls_total`); `0` when not defined yet.
    pub fn stat(&self, name: &str) -> Result<u64> {
        let stats = self.admin(&format!("/stats?filter=^{}$", name.replace('|', "\\|")))?;
        for line in stats.lines() {
            if let Some((k, v)) = line.split_once(": ") {
                if k == name {
                    return v
                        .trim()
                        .parse()
                        .with_context(|| format!("stat {name}: {v:?}"));
                }
            }
        }
        Ok(0)
    }

    /// The filter's requests with `reason` and `action`, summed over the
    /// `staleguard_service` part of their names.
    pub fn requests(&self, reason: &str, action: &str) -> Result<u64> {
        let stats =
            self.admin("/stats?filter=^wasmcustom\\.staleguard_filter_requests_total\\.")?;
        let suffix = format!(".reason.{reason}.action.{action}");
        let mut sum = 0;
        for line in stats.lines() {
            if let Some((k, v)) = line.split_once(": ") {
                if k.ends_with(&suffix) {
                    sum += v
                        .trim()
                        .parse::<u64>()
                        .with_context(|| format!("stat {k}: {v:?}"))?;
                }
            }
        }
        Ok(sum)
    }

    /// Every request the filter judged or passed untouched: all
    /// `requests_total` series, plus unmapped and no-address.
    pub fn requests_counted(&self) -> Result<u64> {
        let stats = self.admin("/stats?filter=^wasmcustom\\.staleguard_filter_requests_")?;
        let mut sum = 0;
        for line in stats.lines() {
            if let Some((_, v)) = line.split_once(": ") {
                sum += v
                    .trim()
                    .parse::<u64>()
                    .with_context(|| format!("stat line {line:?}"))?;
            }
        }
        Ok(sum)
    }

    /// Waits until the filter has counted at least `requests` requests: it
    /// adds its per-request counts to Envoy's counters on its timer tick
    /// (docs/metrics.md), so counters lag the traffic by up to a tick.
    pub fn wait_counted(&mut self, requests: u64) -> Result<()> {
        self.eventually(
            &format!("{requests} requests counted"),
            Duration::from_secs(30),
            |e| Ok(e.requests_counted()? >= requests),
        )
    }

    /// Waits until the filter's `reason`/`action` counter reaches `at_least`
    /// (see [`Envoy::wait_counted`] for why it lags).
    pub fn wait_requests(&mut self, reason: &str, action: &str, at_least: u64) -> Result<()> {
        self.eventually(
            &format!("{at_least} requests counted as {reason}/{action}"),
            Duration::from_secs(30),
            |e| Ok(e.requests(reason, action)? >= at_least),
        )
    }

    /// What Envoy has logged so far.
    pub fn log(&self) -> String {
        self.guard.output()
    }

    /// Polls `f` until it returns `Ok(true)` or `timeout` passes.
    pub fn eventually(
        &mut self,
        what: &str,
        timeout: Duration,
        mut f: impl FnMut(&mut Self) -> Result<bool>,
    ) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            self.guard.check_alive()?;
            if f(self)? {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "timed out after {timeout:?} waiting for: {what}\n--- envoy log (tail) ---\n{}",
                    tail(&self.log(), 60)
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Replaces the CDS clusters (written aside, then renamed, as Envoy's
    /// file watch expects).
    pub fn update_clusters(&self, clusters: &[Cluster]) -> Result<()> {
        write_cds(&self.cds, &self.wasm, clusters)
    }

    /// Kills Envoy.
    pub fn stop(&mut self) {
        self.guard.kill();
    }
}

fn write_cds(path: &Path, wasm: &Path, clusters: &[Cluster]) -> Result<()> {
    let resources: Vec<Value> = clusters
        .iter()
        .flat_map(|c| c.with_twin(wasm))
        .map(|c| {
            let mut v = c;
            v["@type"] = json!("type.googleapis.com/envoy.config.cluster.v3.Cluster");
            v
        })
        .collect();
    let tmp = path.with_extension("tmp");
    std::fs::write(
        &tmp,
        serde_json::to_vec_pretty(&json!({"resources": resources}))?,
    )?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// The last `n` lines of `text`.
pub fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
