//! The Kubernetes source: one kube-runtime watcher per kind.
//!
//! The only API traffic is list and watch (with kube-runtime's default
//! backoff after errors); the validator never asks the API server about an IP.
//! Each object is stripped of what the index does not read before it is
//! handed over, so a relist of a large cluster does not buffer whole objects.
//!
//! Freshness: kube-runtime's watcher consumes bookmarks internally, so events
//! alone would let a quiet namespace age into staleness while its watch is
//! perfectly current. The watches are therefore asked to end after
//! `--watch-timeout` (default 60 s), and the watcher renews each from the last
//! resource version it saw. A renewal the API server accepts is a sign of life
//! (seen on the client's HTTP stack, [`WatchLiveness`]): the server was
//! reachable and still had our position. A hung API server accepts nothing, so
//! its watches age and the data turns stale after `--max-staleness`; the
//! watcher's client-side idle timeout (the watch timeout plus a margin) makes a
//! connection that went silent reconnect, or report an error.

use std::fmt::Debug;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use ::kube::api::Api;
use ::kube::client::ClientBuilder;
use ::kube::runtime::watcher::{self, Event};
use ::kube::runtime::WatchStreamExt;
use ::kube::{Client, Resource};
use futures::future::BoxFuture;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Pod, PodCondition, PodSpec, PodStatus, Service, ServiceSpec};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use serde::de::DeserializeOwned;
use tokio::task::JoinHandle;

use crate::index::Kind;
use crate::live::SharedIndex;

/// What to watch.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Scope {
    /// Only this namespace, if set.
    pub namespace: Option<String>,
    /// Label selector for Pods.
    pub pod_selector: Option<String>,
    /// Label selector for Services.
    pub service_selector: Option<String>,
    /// How long the API server keeps each watch open before the watcher
    /// renews it (whole seconds, at least 1). `None`: kube-runtime's default
    /// (290 s).
    pub watch_timeout: Option<Duration>,
}

/// Starts the three watches, with a client made from `config` that reports
/// every accepted watch renewal to `shared` as a sign of life.
pub fn start(
    config: ::kube::Config,
    scope: Scope,
    shared: SharedIndex,
) -> Result<Vec<JoinHandle<()>>, ::kube::Error> {
    // Named in every watch error: "client error (Connect)" alone does not say
    // which API server could not be reached.
    let server: Arc<str> = config.cluster_url.to_string().into();
    tracing::info!(api_server = %server, "watching the Kubernetes API");
    let client = ClientBuilder::try_from(config)?
        .with_layer(&WatchLiveness::new(shared.clone()))
        .build();
    let base = match scope.watch_timeout {
        Some(t) => {
            watcher::Config::default().timeout(u32::try_from(t.as_secs().max(1)).unwrap_or(290))
        }
        None => watcher::Config::default(),
    };
    let mut pods = base.clone();
    if let Some(sel) = &scope.pod_selector {
        pods = pods.labels(sel);
    }
    let mut services = base.clone();
    if let Some(sel) = &scope.service_selector {
        services = services.labels(sel);
    }
    let ns = scope.namespace.as_deref();
    Ok(vec![
        tokio::spawn(run(
            api::<Pod>(&client, ns),
            pods,
            Kind::Pod,
            shared.clone(),
            server.clone(),
            strip_pod,
            SharedIndex::apply_pod,
        )),
        tokio::spawn(run(
            api::<Service>(&client, ns),
            services,
            Kind::Service,
            shared.clone(),
            server.clone(),
            strip_service,
            SharedIndex::apply_service,
        )),
        tokio::spawn(run(
            api::<EndpointSlice>(&client, ns),
            base,
            Kind::EndpointSlice,
            shared,
            server,
            strip_slice,
            SharedIndex::apply_slice,
        )),
    ])
}

/// A layer on the Kubernetes client's HTTP stack: when the API server
/// accepts a watch of pods, services or endpointslices (a `2xx` answer to a
/// `watch=true` request), that kind's source has shown a sign of life.
#[derive(Debug, Clone)]
pub struct WatchLiveness {
    shared: SharedIndex,
}

impl WatchLiveness {
    /// Reports to `shared`.
    pub fn new(shared: SharedIndex) -> Self {
        Self { shared }
    }
}

impl<S> tower::Layer<S> for WatchLiveness {
    type Service = WatchLivenessService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        WatchLivenessService {
            inner,
            shared: self.shared.clone(),
        }
    }
}

/// The service [`WatchLiveness`] wraps a client's stack in.
#[derive(Debug, Clone)]
pub struct WatchLivenessService<S> {
    inner: S,
    shared: SharedIndex,
}

impl<S, ReqBody, ResBody> tower::Service<http::Request<ReqBody>> for WatchLivenessService<S>
where
    S: tower::Service<http::Request<ReqBody>, Response = http::Response<ResBody>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<ReqBody>) -> Self::Future {
        let kind = watched_kind(request.uri());
        let answer = self.inner.call(request);
        let shared = self.shared.clone();
        Box::pin(async move {
            let response = answer.await?;
            if let Some(kind) = kind {
                if response.status().is_success() {
                    shared.heard(kind);
                }
            }
            Ok(response)
        })
    }
}

/// The kind a request watches, if it is a watch of one the index reads.
fn watched_kind(uri: &http::Uri) -> Option<Kind> {
    let watching = uri
        .query()?
        .split('&')
        .any(|pair| pair == "watch=true" || pair == "watch=1");
    if !watching {
        return None;
    }
    match uri.path().rsplit('/').next()? {
        "pods" => Some(Kind::Pod),
        "services" => Some(Kind::Service),
        "endpointslices" => Some(Kind::EndpointSlice),
        _ => None,
    }
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
    server: Arc<str>,
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
                tracing::warn!(
                    kind = %kind,
                    api_server = %server,
                    error = %causes(&error),
                    "watch error; retrying with backoff"
                );
            }
        }
    }
    tracing::error!(kind = %kind, "watch stream ended");
}

/// `error` and its causes on one line, each said once: the cause that names
/// the problem ("Connection refused", a certificate) is often three levels
/// down.
fn causes(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let said = cause.to_string();
        if !text.contains(&said) {
            text.push_str(": ");
            text.push_str(&said);
        }
        source = cause.source();
    }
    text
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
    fn a_watch_error_says_its_deepest_cause_once() {
        #[derive(Debug)]
        struct Outer(std::io::Error);
        impl std::fmt::Display for Outer {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("client error (Connect)")
            }
        }
        impl std::error::Error for Outer {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let refused =
            std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "Connection refused");
        assert_eq!(
            causes(&Outer(refused)),
            "client error (Connect): Connection refused"
        );
        let io = std::io::Error::other("no such host");
        assert_eq!(causes(&io), "no such host");
    }

    #[test]
    fn watches_of_the_three_kinds_are_recognised_and_nothing_else() {
        let kind = |uri: &str| watched_kind(&uri.parse().unwrap());
        assert_eq!(
            kind("https://k/api/v1/pods?&watch=true&timeoutSeconds=60&allowWatchBookmarks=true"),
            Some(Kind::Pod)
        );
        assert_eq!(
            kind("/api/v1/namespaces/shop/services?watch=1&resourceVersion=5"),
            Some(Kind::Service)
        );
        assert_eq!(
            kind("/apis/discovery.k8s.io/v1/endpointslices?watch=true"),
            Some(Kind::EndpointSlice)
        );
        assert_eq!(kind("/api/v1/pods?limit=500"), None, "a list");
        assert_eq!(kind("/api/v1/pods"), None);
        assert_eq!(kind("/api/v1/nodes?watch=true"), None);
        assert_eq!(kind("/api/v1/pods?watch=false"), None);
    }

    #[tokio::test]
    async fn an_accepted_watch_is_a_sign_of_life_and_a_refused_one_is_not() {
        use tower::{Layer, ServiceExt};
        let shared = SharedIndex::new(
            Index::new(1, IndexConfig::default()),
            Duration::from_secs(60),
        );
        let answer = |status: u16| {
            tower::service_fn(move |_: http::Request<()>| async move {
                Ok::<_, std::convert::Infallible>(
                    http::Response::builder().status(status).body(()).unwrap(),
                )
            })
        };
        let request = |uri: &str| http::Request::builder().uri(uri).body(()).unwrap();
        let age = |shared: &SharedIndex, slot: usize| shared.watch_health()[slot].last_event_age;
        let layer = WatchLiveness::new(shared.clone());
        layer
            .layer(answer(403))
            .oneshot(request("/api/v1/pods?watch=true"))
            .await
            .unwrap();
        layer
            .layer(answer(200))
            .oneshot(request("/api/v1/services?limit=500"))
            .await
            .unwrap();
        assert_eq!(age(&shared, 0), None, "a refused watch");
        assert_eq!(age(&shared, 1), None, "a list");
        layer
            .layer(answer(200))
            .oneshot(request("/api/v1/pods?watch=true"))
            .await
            .unwrap();
        assert!(age(&shared, 0).is_some_and(|a| a < Duration::from_secs(5)));
        assert_eq!(age(&shared, 2), None);
    }

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
