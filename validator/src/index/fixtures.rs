//! Builders for the Kubernetes objects tests feed the index with.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    ObjectReference, Pod, PodCondition, PodIP, PodSpec, PodStatus, Service, ServiceSpec,
};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

use super::facts::SERVICE_NAME_LABEL;

fn meta(namespace: &str, name: &str) -> ObjectMeta {
    ObjectMeta {
        namespace: Some(namespace.into()),
        name: Some(name.into()),
        ..ObjectMeta::default()
    }
}

fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// A running, ready pod named `namespace/name` with uid `uid-<name>`.
pub(crate) fn pod(namespace: &str, name: &str) -> PodBuilder {
    let mut metadata = meta(namespace, name);
    metadata.uid = Some(format!("uid-{name}"));
    PodBuilder(Pod {
        metadata,
        spec: Some(PodSpec::default()),
        status: Some(PodStatus {
            phase: Some("Running".into()),
            conditions: Some(vec![PodCondition {
                type_: "Ready".into(),
                status: "True".into(),
                ..PodCondition::default()
            }]),
            ..PodStatus::default()
        }),
    })
}

#[derive(Debug, Clone)]
pub(crate) struct PodBuilder(Pod);

impl PodBuilder {
    fn status(&mut self) -> &mut PodStatus {
        self.0.status.get_or_insert_with(PodStatus::default)
    }

    pub(crate) fn uid(mut self, uid: &str) -> Self {
        self.0.metadata.uid = Some(uid.into());
        self
    }

    /// Sets `status.podIPs` (and `status.podIP` to the first).
    pub(crate) fn ips(mut self, ips: &[&str]) -> Self {
        let status = self.status();
        status.pod_ip = ips.first().map(|s| (*s).to_owned());
        status.pod_ips = Some(
            ips.iter()
                .map(|ip| PodIP {
                    ip: (*ip).to_owned(),
                })
                .collect(),
        );
        self
    }

    pub(crate) fn ip(self, ip: &str) -> Self {
        self.ips(&[ip])
    }

    /// Sets only the older `status.podIP`; `status.podIPs` is an empty list
    /// when `empty_list`, absent otherwise (as some API servers and hand-made
    /// files leave it).
    pub(crate) fn pod_ip_only(mut self, ip: &str, empty_list: bool) -> Self {
        let status = self.status();
        status.pod_ip = Some(ip.to_owned());
        status.pod_ips = empty_list.then(Vec::new);
        self
    }

    pub(crate) fn labels(mut self, pairs: &[(&str, &str)]) -> Self {
        self.0.metadata.labels = Some(labels(pairs));
        self
    }

    pub(crate) fn terminating(mut self) -> Self {
        self.0.metadata.deletion_timestamp = Some(Time(Default::default()));
        self
    }

    pub(crate) fn phase(mut self, phase: &str) -> Self {
        self.status().phase = Some(phase.into());
        self
    }

    pub(crate) fn not_ready(mut self) -> Self {
        self.status().conditions = None;
        self
    }

    pub(crate) fn host_network(mut self) -> Self {
        self.0
            .spec
            .get_or_insert_with(PodSpec::default)
            .host_network = Some(true);
        self
    }

    pub(crate) fn build(self) -> Pod {
        self.0
    }
}

/// A Service named `namespace/name` without a selector.
pub(crate) fn service(namespace: &str, name: &str) -> ServiceBuilder {
    ServiceBuilder(Service {
        metadata: meta(namespace, name),
        spec: Some(ServiceSpec::default()),
        status: None,
    })
}

#[derive(Debug, Clone)]
pub(crate) struct ServiceBuilder(Service);

impl ServiceBuilder {
    pub(crate) fn selector(mut self, pairs: &[(&str, &str)]) -> Self {
        self.0
            .spec
            .get_or_insert_with(ServiceSpec::default)
            .selector = Some(labels(pairs));
        self
    }

    pub(crate) fn build(self) -> Service {
        self.0
    }
}

/// An IPv4 EndpointSlice named `namespace/name` of service `namespace/service`.
pub(crate) fn slice(namespace: &str, name: &str, service: &str) -> SliceBuilder {
    let mut metadata = meta(namespace, name);
    metadata.labels = Some(labels(&[(SERVICE_NAME_LABEL, service)]));
    SliceBuilder(EndpointSlice {
        metadata,
        address_type: "IPv4".into(),
        endpoints: Vec::new(),
        ports: None,
    })
}

#[derive(Debug, Clone)]
pub(crate) struct SliceBuilder(EndpointSlice);

impl SliceBuilder {
    pub(crate) fn address_type(mut self, t: &str) -> Self {
        self.0.address_type = t.into();
        self
    }

    pub(crate) fn port(mut self, name: &str, port: i32) -> Self {
        self.0
            .ports
            .get_or_insert_with(Vec::new)
            .push(EndpointPort {
                name: Some(name.into()),
                port: Some(port),
                protocol: Some("TCP".into()),
                app_protocol: None,
            });
        self
    }

    /// An entry for `ip` naming pod uid `uid` (`None`: no targetRef), ready.
    pub(crate) fn endpoint(self, ip: &str, uid: Option<&str>) -> Self {
        self.endpoint_with(ip, uid, Some((true, true, false)))
    }

    /// An entry with explicit `(ready, serving, terminating)` conditions.
    pub(crate) fn endpoint_with(
        mut self,
        ip: &str,
        uid: Option<&str>,
        conditions: Option<(bool, bool, bool)>,
    ) -> Self {
        self.0.endpoints.push(Endpoint {
            addresses: vec![ip.into()],
            conditions: conditions.map(|(ready, serving, terminating)| EndpointConditions {
                ready: Some(ready),
                serving: Some(serving),
                terminating: Some(terminating),
            }),
            target_ref: uid.map(|uid| ObjectReference {
                kind: Some("Pod".into()),
                uid: Some(uid.into()),
                ..ObjectReference::default()
            }),
            ..Endpoint::default()
        });
        self
    }

    /// Replaces the `targetRef` of the last endpoint with one of `kind`, with
    /// the given namespace, name and uid (each may be unset).
    pub(crate) fn target_ref(
        mut self,
        kind: &str,
        namespace: Option<&str>,
        name: Option<&str>,
        uid: Option<&str>,
    ) -> Self {
        if let Some(last) = self.0.endpoints.last_mut() {
            last.target_ref = Some(ObjectReference {
                kind: Some(kind.into()),
                namespace: namespace.map(Into::into),
                name: name.map(Into::into),
                uid: uid.map(Into::into),
                ..ObjectReference::default()
            });
        }
        self
    }

    /// Adds `ip` to the addresses of the last endpoint.
    pub(crate) fn also(mut self, ip: &str) -> Self {
        if let Some(last) = self.0.endpoints.last_mut() {
            last.addresses.push(ip.into());
        }
        self
    }

    pub(crate) fn build(self) -> EndpointSlice {
        self.0
    }
}
