//! An ingress gateway as the incident had it: real Envoy routing to services
//! whose endpoints come from file-based EDS (see [`crate::eds`]), with or
//! without the staleguard filter.
//!
//! Each service gets an Istio-style cluster, `outbound|80||<svc>.shop.svc.cluster.local`,
//! so the filter maps clusters to services the way it does under Istio. A
//! request picks its service with the `host` header. The route tags every
//! request with the service it means (`x-sg-intended`) and the gateway's name
//! (`x-sg-via`), which lets the pods classify what reaches them
//! (see [`crate::pods`]). Several gateways may read the same EDS files: they then
//! see the same (stale) control plane, and differ only in the filter.
//!
//! The filter's counters carry no cluster label, so tests compare metrics and
//! server counts per gateway: one Envoy per configuration.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use crate::envoy::{gateway_listener, stats_tags, tail, twin_cluster, upstream_filter_options};
use crate::pods::{INTENDED_HEADER, VIA_HEADER};
use crate::process::{free_port, wait_for_port, Guard};
use crate::traffic::{Http, Target};
use crate::world::{World, NAMESPACE};

/// The Envoy cluster name of a service (Istio's outbound form).
pub fn cluster_name(service: &str) -> String {
    format!("outbound|80||{service}.{NAMESPACE}.svc.cluster.local")
}

/// A gateway to start.
#[derive(Debug, Clone)]
pub struct GatewaySpec {
    /// The gateway's name, sent to the pods in `x-sg-via`.
    pub name: String,
    /// The plugin configuration, or `None` for an unguarded gateway.
    pub plugin: Option<Value>,
    /// Envoy worker threads.
    pub concurrency: u32,
    /// Fields set on every service cluster (Envoy's own defences:
    /// `health_checks`, `outlier_detection`...); `{}` for none.
    pub cluster_extra: Value,
    /// Fields set on every service route's action (`retry_policy`...); `{}`
    /// for none.
    pub route_extra: Value,
    /// Run Envoy in its own process group, so a terminal's Ctrl-C reaches only
    /// the harness, which then stops it (the demo); tests leave it `false` so
    /// an interrupted test run takes Envoy down with it.
    pub detach: bool,
}

/// A running gateway.
#[derive(Debug)]
pub struct Gateway {
    guard: Guard,
    /// Its name.
    pub name: String,
    /// True when the filter runs.
    pub guarded: bool,
    /// The listener.
    pub listener: SocketAddr,
    /// The admin listener.
    pub admin: SocketAddr,
    config: PathBuf,
}

/// Every request the filter judged or passed untouched, from a
/// [`Gateway::stats`] map: all `requests_total` series, plus unmapped and
/// no-address.
pub fn requests_counted(stats: &BTreeMap<String, u64>) -> u64 {
    stats
        .iter()
        .filter(|(k, _)| {
            k.starts_with(STAT_REQUESTS_PREFIX)
                || k.as_str() == "wasmcustom.staleguard_filter_requests_unmapped_total"
                || k.as_str() == "wasmcustom.staleguard_filter_requests_no_address_total"
        })
        .map(|(_, v)| v)
        .sum()
}

impl GatewaySpec {
    /// The bootstrap for the world's services, EDS read from the world's files.
    pub fn bootstrap(
        &self,
        world: &World,
        wasm: &Path,
        validator: SocketAddr,
        listener: SocketAddr,
        admin: SocketAddr,
    ) -> Result<Value> {
        let mut clusters = Vec::new();
        let mut vhosts = Vec::new();
        for service in world.services() {
            let eds = world.eds(service)?;
            let name = cluster_name(service);
            let mut cluster = json!({
                "name": name,
                "type": "EDS",
                "connect_timeout": "1s",
                "eds_cluster_config": {
                    "service_name": eds.resource(),
                    "eds_config": {
                        "resource_api_version": "V3",
                        "path_config_source": {"path": eds.path().display().to_string()},
                    },
                },
            });
            merge_into(&mut cluster, &self.cluster_extra);
            if let Some(plugin) = &self.plugin {
                cluster["typed_extension_protocol_options"] = upstream_filter_options(wasm, plugin);
                // The twin reads the same EDS resource: the same endpoints.
                clusters.extend(twin_cluster(&cluster, wasm, plugin));
            }
            clusters.push(cluster);
            let mut route = json!({"cluster": name, "timeout": "5s"});
            merge_into(&mut route, &self.route_extra);
            vhosts.push(json!({
                "name": service,
                "domains": [service, format!("{service}:*")],
                "routes": [{
                    "match": {"prefix": "/"},
                    "route": route,
                    "request_headers_to_add": [
                        {"header": {"key": INTENDED_HEADER, "value": World::key(service)},
                         "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"},
                        {"header": {"key": VIA_HEADER, "value": self.name},
                         "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"},
                    ],
                }],
            }));
        }
        clusters.push(json!({
            "name": "staleguard-validator",
            "type": "STATIC",
            "connect_timeout": "1s",
            "load_assignment": {
                "cluster_name": "staleguard-validator",
                "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {"socket_address": {
                    "address": validator.ip().to_string(), "port_value": validator.port()}}}}]}]
            }
        }));
        Ok(json!({
            // File-based EDS needs a node identity, as any xDS subscription.
            "node": {"id": format!("staleguard-{}", self.name), "cluster": "staleguard-gateway"},
            "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin.port()}}},
            "stats_config": {"stats_tags": stats_tags()},
            "static_resources": {
                "listeners": [gateway_listener(listener.port(), Value::Array(vhosts))],
                "clusters": clusters
            }
        }))
    }

    /// Starts Envoy with `envoy` and `wasm` and waits until every cluster has
    /// its EDS endpoints and, when guarded, the filter has synced.
    pub async fn start(
        &self,
        http: &Http,
        world: &World,
        envoy: &Path,
        wasm: &Path,
        validator: SocketAddr,
    ) -> Result<Gateway> {
        let listener: SocketAddr = format!("127.0.0.1:{}", free_port()?).parse()?;
        let admin: SocketAddr = format!("127.0.0.1:{}", free_port()?).parse()?;
        let bootstrap = self.bootstrap(world, wasm, validator, listener, admin)?;
        let config = world.dir().join(format!("envoy-{}.json", self.name));
        std::fs::write(&config, serde_json::to_vec_pretty(&bootstrap)?)?;
        let mut cmd = Command::new(envoy);
        cmd.arg("-c")
            .arg(&config)
            .args(["--concurrency", &self.concurrency.to_string()])
            .args(["--disable-hot-restart", "-l", "warning"])
            .args(["--base-id", &free_port()?.to_string()]);
        if self.detach {
            detach(&mut cmd);
        }
        let mut guard = Guard::spawn(&format!("envoy-{}", self.name), cmd)?;
        wait_for_port(&mut guard, listener, Duration::from_secs(60))?;
        let gateway = Gateway {
            guard,
            name: self.name.clone(),
            guarded: self.plugin.is_some(),
            listener,
            admin,
            config,
        };
        for service in world.services() {
            let want = world.pods_of(service).len() as u64;
            let stat = format!("cluster.{}.membership_total", cluster_name(service));
            gateway
                .wait_stat(
                    http,
                    &format!("{stat} = {want}"),
                    Duration::from_secs(30),
                    |s| s.get(&stat).copied() == Some(want),
                )
                .await?;
        }
        if gateway.guarded {
            gateway
                .wait_stat(
                    http,
                    "filter synced (index_fresh = 1)",
                    Duration::from_secs(30),
                    |s| s.get(STAT_FRESH).copied() == Some(1),
                )
                .await?;
        }
        Ok(gateway)
    }
}

/// The filter's generation gauge, as Envoy names it.
pub const STAT_GENERATION: &str = "wasmcustom.staleguard_filter_index_generation";
/// The filter's freshness gauge.
pub const STAT_FRESH: &str = "wasmcustom.staleguard_filter_index_fresh";
/// The filter's full-resync counter.
pub const STAT_RESETS: &str = "wasmcustom.staleguard_filter_sync_resets_total";
/// Validator answers the filter's blast-radius guard held back.
pub const STAT_GUARD_HELD: &str = "wasmcustom.staleguard_filter_guard_held_total";

/// The filter's per-request counter in `/stats/prometheus` (labels
/// `staleguard_service`, `staleguard_reason`, `staleguard_action`).
pub const PROM_REQUESTS: &str = "staleguard_filter_requests_total";

/// The `/stats` prefix of the filter's per-request counters.
pub const STAT_REQUESTS_PREFIX: &str = "wasmcustom.staleguard_filter_requests_total.service.";

/// The filter's request counter for one service (`namespace/name`), reason
/// and action, as `/stats` names it.
pub fn stat_requests(service: &str, reason: &str, action: &str) -> String {
    format!("{STAT_REQUESTS_PREFIX}{service}.reason.{reason}.action.{action}")
}

/// The filter's requests with a reason and action, summed over services, from
/// a [`Gateway::stats`] map.
pub fn requests_total(stats: &BTreeMap<String, u64>, reason: &str, action: &str) -> u64 {
    let suffix = format!(".reason.{reason}.action.{action}");
    stats
        .iter()
        .filter(|(k, _)| k.starts_with(STAT_REQUESTS_PREFIX) && k.ends_with(&suffix))
        .map(|(_, v)| v)
        .sum()
}

impl GatewaySpec {
    /// A gateway running the filter with the shipped plugin configuration
    /// plus `extra` fields (a test that turns a knob names it in its title).
    pub fn guarded(name: &str, extra: Value) -> Self {
        Self {
            name: name.into(),
            plugin: Some(crate::envoy::shipped_plugin(extra)),
            concurrency: 1,
            cluster_extra: json!({}),
            route_extra: json!({}),
            detach: false,
        }
    }

    /// A gateway without the filter.
    pub fn unguarded(name: &str) -> Self {
        Self {
            name: name.into(),
            plugin: None,
            concurrency: 1,
            cluster_extra: json!({}),
            route_extra: json!({}),
            detach: false,
        }
    }
}

/// Sets every field of the object `extra` on the object `into`.
fn merge_into(into: &mut Value, extra: &Value) {
    if let (Some(into), Some(extra)) = (into.as_object_mut(), extra.as_object()) {
        for (k, v) in extra {
            into.insert(k.clone(), v.clone());
        }
    }
}

/// Puts a child in its own process group (see [`GatewaySpec::detach`]).
pub fn detach(cmd: &mut Command) {
    #[cfg(unix)]
    {
        use std::os::unix::process::CommandExt;
        cmd.process_group(0);
    }
}

/// The sum of the series `name{labels}` in Prometheus text, if any is present.
/// `labels` are `(key, value)` pairs that must all match; series with more
/// labels (the filter's `staleguard_service`) are summed.
pub fn prometheus_value(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<u64> {
    let mut values = text.lines().filter_map(|line| {
        let (series, value) = line.rsplit_once(' ')?;
        let (metric, rest) = series.split_once('{').unwrap_or((series, "}"));
        if metric != name {
            return None;
        }
        let rest = rest.strip_suffix('}')?;
        let ok = labels
            .iter()
            .all(|(k, v)| rest.split(',').any(|kv| kv == format!("{k}=\"{v}\"")));
        if !ok {
            return None;
        }
        value.parse::<f64>().ok().map(|v| v as u64)
    });
    let first = values.next()?;
    Some(first + values.sum::<u64>())
}

impl Gateway {
    /// A load-generator target for a service through this gateway.
    pub fn target(&self, service: &str) -> Target {
        Target {
            url: format!("http://{}/", self.listener),
            headers: vec![("host".into(), service.into())],
            service: World::key(service),
        }
    }

    /// Every counter and gauge from `/stats` (text form, `name: value`).
    pub async fn stats(&self, http: &Http) -> Result<BTreeMap<String, u64>> {
        let reply = http
            .get(&format!("http://{}/stats", self.admin))
            .await
            .with_context(|| format!("gateway {} admin", self.name))?;
        Ok(reply
            .text()
            .lines()
            .filter_map(|line| {
                let (k, v) = line.split_once(": ")?;
                Some((k.to_owned(), v.trim().parse().ok()?))
            })
            .collect())
    }

    /// `/stats/prometheus`.
    pub async fn prometheus(&self, http: &Http) -> Result<String> {
        Ok(http
            .get(&format!("http://{}/stats/prometheus", self.admin))
            .await?
            .text())
    }

    /// Polls `/stats` until `ok` holds, failing with Envoy's log after `timeout`.
    pub async fn wait_stat(
        &self,
        http: &Http,
        what: &str,
        timeout: Duration,
        ok: impl Fn(&BTreeMap<String, u64>) -> bool,
    ) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(stats) = self.stats(http).await {
                if ok(&stats) {
                    return Ok(());
                }
            }
            if Instant::now() > deadline {
                bail!(
                    "gateway {}: timed out after {timeout:?} waiting for {what}\n--- envoy log (tail) ---\n{}",
                    self.name,
                    tail(&self.guard.output(), 40)
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until the filter has counted at least `requests` requests: it
    /// adds its per-request counts to Envoy's counters on its timer tick
    /// (docs/metrics.md), so counters lag the traffic by up to a tick.
    pub async fn wait_counted(&self, http: &Http, requests: u64) -> Result<()> {
        self.wait_stat(
            http,
            &format!("{requests} requests counted"),
            Duration::from_secs(30),
            |s| requests_counted(s) >= requests,
        )
        .await
    }

    /// Envoy's log so far.
    pub fn log(&self) -> String {
        self.guard.output()
    }

    /// The bootstrap file.
    pub fn config_path(&self) -> &Path {
        &self.config
    }

    /// Fails with the log if Envoy exited.
    pub fn check_alive(&mut self) -> Result<()> {
        self.guard.check_alive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_labelled_series_from_prometheus_text() {
        let text = "# TYPE staleguard_filter_requests_total counter\n\
            staleguard_filter_requests_total{staleguard_service=\"shop/cart\",staleguard_reason=\"destroyed\",staleguard_action=\"reject\"} 1800\n\
            staleguard_filter_requests_total{staleguard_service=\"shop/pay\",staleguard_reason=\"destroyed\",staleguard_action=\"reject\"} 40\n\
            staleguard_filter_requests_total{staleguard_service=\"shop/cart\",staleguard_reason=\"member\",staleguard_action=\"allow\"} 660\n\
            staleguard_filter_index_fresh{} 1\n";
        let get = |labels: &[(&str, &str)]| prometheus_value(text, PROM_REQUESTS, labels);
        assert_eq!(
            get(&[
                ("staleguard_reason", "destroyed"),
                ("staleguard_action", "reject")
            ]),
            Some(1840)
        );
        assert_eq!(
            get(&[
                ("staleguard_reason", "member"),
                ("staleguard_action", "allow")
            ]),
            Some(660)
        );
        assert_eq!(get(&[("staleguard_reason", "recycled")]), None);
        assert_eq!(
            prometheus_value(text, "staleguard_filter_index_fresh", &[]),
            Some(1)
        );
    }
}
