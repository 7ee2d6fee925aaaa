//! The Kubernetes source: one kube-runtime watcher per kind.
//!
//! The only API traffic is list and watch (with kube-runtime's default
//! backoff after errors); the validator never asks the API server about an IP.
//! Each object is stripped of what the index does not read before it is
//! handed over, so a relist of a large cluster does not buffer whole objects.
//!
//! Freshness: kube-runtime's watcher consumes bookmarks internally, so a sign of
//! life here is an event. A quiet namespace therefore ages; `--max-staleness`
//! (default 5 minutes) must be larger than the longest quiet period you expect,
//! and the watcher's client-side idle timeout (290 s) makes a hung connection
//! reconnect, or report an error, within it.

use std::fmt::Debug;
use std::time::SystemTime;

use ::kube::api::Api;
use ::kube::runtime::watcher::{self, Event};
use ::kube::runtime::WatchStreamExt;
use ::kube::{Client, Resource};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Pod, PodCondition, PodSpec, PodStatus, Service, ServiceSpec};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use serde::de::DeserializeOwned;
use tokio::task::JoinHandle;

use crate::index::Kind;
use crate::shared::SharedIndex;

/// What to watch.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Scope {
    /// Only this namespace, if set.
    pub namespace: Option<String>,
    /// Label selector for Pods.
    pub pod_selector: Option<String>,
    /// Label selector for Services.
    pub service_selector: Option<String>,
}

/// Starts the three watches.
pub fn start(client: Client, scope: Scope, shared: SharedIndex) -> Vec<JoinHandle<()>> {
    let mut pods = watcher::Config::default();
    if let Some(sel) = &scope.pod_selector {
        pods = pods.labels(sel);
    }
    let mut services = watcher::Config::default();
    if let Some(sel) = &scope.service_selector {
        services = services.labels(sel);
    }
    let ns = scope.namespace.as_deref();
    vec![
        tokio::spawn(run(
            api::<Pod>(&client, ns),
            pods,
            Kind::Pod,
            shared.clone(),
            strip_pod,
            SharedIndex::apply_pod,
        )),
        tokio::spawn(run(
            api::<Service>(&client, ns),
            services,
            Kind::Service,
            shared.clone(),
            strip_service,
            SharedIndex::apply_service,
        )),
        tokio::spawn(run(
            api::<EndpointSlice>(&client, ns),
            watcher::Config::default(),
            Kind::EndpointSlice,
            shared,
            strip_slice,
            SharedIndex::apply_slice,
        )),
    ]
}

fn api<K>(client: &Client, namespace: Option<&str>) -> Api<K>
where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope>,
    K::DynamicType: Default,
{
    match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

async fn run<K>(
    api: Api<K>,
    config: watcher::Config,
    kind: Kind,
    shared: SharedIndex,
    strip: fn(&mut K),
    apply: fn(&SharedIndex, Event<K>, SystemTime),
) where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    let stream = watcher::watcher(api, config).default_backoff();
    let mut stream = std::pin::pin!(stream);
    while let Some(item) = stream.next().await {
        match item {
            Ok(event) => {
                if matches!(event, Event::InitDone) {
                    tracing::info!(kind = %kind, "initial list done");
                }
                apply(&shared, event.modify(strip), SystemTime::now());
            }
            Err(error) => {
                shared.watch_error(kind);
                tracing::warn!(kind = %kind, %error, "watch error; retrying with backoff");
            }
        }
    }
    tracing::error!(kind = %kind, "watch stream ended");
}

/// Keeps name, namespace, uid, labels, deletionTimestamp, hostNetwork, phase,
/// pod IPs and the Ready condition.
pub(crate) fn strip_pod(pod: &mut Pod) {
    strip_meta(&mut pod.metadata);
    let host_network = pod.spec.as_ref().and_then(|s| s.host_network);
    pod.spec = Some(PodSpec {
        host_network,
        ..PodSpec::default()
    });
    if let Some(status) = pod.status.take() {
        let PodStatus {
            phase,
            pod_ip,
            pod_ips,
            conditions,
            ..
        } = status;
        pod.status = Some(PodStatus {
            phase,
            pod_ip,
            pod_ips,
            conditions: conditions.map(|c| {
                c.into_iter()
                    .filter(|c| c.type_ == "Ready")
                    .map(|c| PodCondition {
                        type_: c.type_,
                        status: c.status,
                        ..PodCondition::default()
                    })
                    .collect()
            }),
            ..PodStatus::default()
        });
    }
}

/// Keeps name, namespace and the selector.
pub(crate) fn strip_service(service: &mut Service) {
    strip_meta(&mut service.metadata);
    service.metadata.labels = None;
    let selector = service.spec.take().and_then(|s| s.selector);
    service.spec = Some(ServiceSpec {
        selector,
        ..ServiceSpec::default()
    });
    service.status = None;
}

/// Keeps name, namespace, the service-name label, addresses, targetRefs,
/// conditions and ports.
pub(crate) fn strip_slice(slice: &mut EndpointSlice) {
    strip_meta(&mut slice.metadata);
    if let Some(labels) = &mut slice.metadata.labels {
        labels.retain(|k, _| k == crate::index::SERVICE_NAME_LABEL);
    }
    for e in &mut slice.endpoints {
        e.deprecated_topology = None;
        e.hints = None;
        e.hostname = None;
        e.node_name = None;
        e.zone = None;
        if let Some(r) = &mut e.target_ref {
            r.field_path = None;
            r.resource_version = None;
            r.api_version = None;
        }
    }
}

fn strip_meta(meta: &mut k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) {
    meta.managed_fields = None;
    meta.annotations = None;
    meta.owner_references = None;
    meta.finalizers = None;
    meta.generate_name = None;
    meta.creation_timestamp = None;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::{Index, IndexConfig};

    #[test]
    fn stripping_keeps_every_fact_the_index_reads() {
        let yaml = include_str!("../../samples/demo.yaml");
        let objects = crate::source::file::parse(yaml, std::path::Path::new("demo")).unwrap();
        let feed = |strip: bool| {
            let mut ix = Index::new(1, IndexConfig::default());
            let now = SystemTime::UNIX_EPOCH;
            for mut s in objects.services.clone() {
                if strip {
                    strip_service(&mut s);
                }
                ix.apply_service(Event::Apply(s), now);
            }
            for mut p in objects.pods.clone() {
                if strip {
                    strip_pod(&mut p);
                }
                ix.apply_pod(Event::Apply(p), now);
            }
            for mut s in objects.slices.clone() {
                if strip {
                    strip_slice(&mut s);
                }
                ix.apply_slice(Event::Apply(s), now);
            }
            ix.snapshot(Default::default())
        };
        assert_eq!(feed(true), feed(false));
        assert!(!feed(true).records.is_empty());
    }
}
