//! Synthetic clusters for benchmarks and demos: many Services, their Pods and
//! EndpointSlices, shaped like what a real cluster serves, built without an API
//! server. Tests use the terser builders in `index::fixtures`.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, SystemTime};

use k8s_openapi::api::core::v1::{
    ObjectReference, Pod, PodCondition, PodIP, PodSpec, PodStatus, Service, ServiceSpec,
};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

use crate::index::{Index, IndexConfig};
use crate::live::SharedIndex;

/// The label every synthetic pod carries, matched by its service's selector.
pub const APP_LABEL: &str = "app";

/// Objects of a synthetic cluster.
#[derive(Debug, Clone, Default)]
pub struct Cluster {
    /// One per service.
    pub services: Vec<Service>,
    /// Every pod, service by service.
    pub pods: Vec<Pod>,
    /// One slice per service, listing its pods.
    pub slices: Vec<EndpointSlice>,
}

/// The `n`th synthetic pod IP: `10.0.0.0/8`, skipping `.0` and `.255` hosts.
pub fn ip(n: u32) -> IpAddr {
    let host = n % 254 + 1;
    let net = n / 254;
    IpAddr::V4(Ipv4Addr::new(
        10,
        (net >> 8) as u8,
        (net & 0xff) as u8,
        host as u8,
    ))
}

/// One synthetic pod, with the knobs a lifecycle needs. [`SynthPod::build`]
/// makes the Pod and [`SynthPod::endpoint`] the slice entry that lists it,
/// both shaped like what an API server serves (labels of a Deployment's pod,
/// a node, conditions).
#[derive(Debug, Clone)]
pub struct SynthPod {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub name: String,
    /// The value of its `app` label, its service's selector.
    pub app: String,
    /// The pod's uid.
    pub uid: String,
    /// The pod's IP.
    pub ip: IpAddr,
    /// The Ready condition.
    pub ready: bool,
    /// True once the pod has a deletion timestamp.
    pub terminating: bool,
}

impl SynthPod {
    /// A running, ready pod of `app` holding `ip`, with uid `uid-<name>`.
    pub fn new(namespace: &str, name: &str, app: &str, ip: IpAddr) -> Self {
        Self {
            namespace: namespace.into(),
            name: name.into(),
            app: app.into(),
            uid: format!("uid-{name}"),
            ip,
            ready: true,
            terminating: false,
        }
    }

    /// The Pod object.
    pub fn build(&self) -> Pod {
        Pod {
            metadata: ObjectMeta {
                namespace: Some(self.namespace.clone()),
                name: Some(self.name.clone()),
                uid: Some(self.uid.clone()),
                labels: Some(BTreeMap::from([
                    (APP_LABEL.into(), self.app.clone()),
                    ("pod-template-hash".into(), "7d9f8c6b5".into()),
                ])),
                deletion_timestamp: self.terminating.then(|| Time(Default::default())),
                ..ObjectMeta::default()
            },
            spec: Some(PodSpec {
                node_name: Some("node-1".into()),
                ..PodSpec::default()
            }),
            status: Some(PodStatus {
                phase: Some("Running".into()),
                pod_ip: Some(self.ip.to_string()),
                pod_ips: Some(vec![PodIP {
                    ip: self.ip.to_string(),
                }]),
                conditions: Some(vec![PodCondition {
                    type_: "Ready".into(),
                    status: if self.ready { "True" } else { "False" }.into(),
                    ..PodCondition::default()
                }]),
                ..PodStatus::default()
            }),
        }
    }

    /// The EndpointSlice entry listing this pod, with the conditions the
    /// endpoints controller would give it.
    pub fn endpoint(&self) -> Endpoint {
        Endpoint {
            addresses: vec![self.ip.to_string()],
            conditions: Some(EndpointConditions {
                ready: Some(self.ready && !self.terminating),
                serving: Some(self.ready),
                terminating: Some(self.terminating),
            }),
            target_ref: Some(ObjectReference {
                kind: Some("Pod".into()),
                namespace: Some(self.namespace.clone()),
                name: Some(self.name.clone()),
                uid: Some(self.uid.clone()),
                ..ObjectReference::default()
            }),
            node_name: Some("node-1".into()),
            zone: Some("zone-a".into()),
            ..Endpoint::default()
        }
    }
}

/// A running, ready pod of `app` in `namespace` holding `ip`, uid `uid-<name>`.
pub fn pod(namespace: &str, name: &str, app: &str, ip: IpAddr) -> Pod {
    SynthPod::new(namespace, name, app, ip).build()
}

/// A service `namespace/app` selecting pods labelled `app=<app>`.
pub fn service(namespace: &str, app: &str) -> Service {
    Service {
        metadata: ObjectMeta {
            namespace: Some(namespace.into()),
            name: Some(app.into()),
            ..ObjectMeta::default()
        },
        spec: Some(ServiceSpec {
            selector: Some(BTreeMap::from([(APP_LABEL.into(), app.into())])),
            ..ServiceSpec::default()
        }),
        status: None,
    }
}

/// Slice `name` of service `namespace/service` listing `endpoints` (port
/// 8080, named `http`).
pub fn slice(
    namespace: &str,
    name: &str,
    service: &str,
    endpoints: Vec<Endpoint>,
) -> EndpointSlice {
    EndpointSlice {
        metadata: ObjectMeta {
            namespace: Some(namespace.into()),
            name: Some(name.into()),
            labels: Some(BTreeMap::from([(
                "kubernetes.io/service-name".into(),
                service.into(),
            )])),
            ..ObjectMeta::default()
        },
        address_type: "IPv4".into(),
        endpoints,
        ports: Some(vec![EndpointPort {
            name: Some("http".into()),
            port: Some(8080),
            protocol: Some("TCP".into()),
            app_protocol: None,
        }]),
    }
}

/// `services` services named `svc-<i>` in namespace `bench`, each with
/// `pods_per_service` pods, IPs numbered from 0.
pub fn cluster(services: usize, pods_per_service: usize) -> Cluster {
    let mut cluster = Cluster::default();
    let mut n = 0u32;
    for s in 0..services {
        let app = format!("svc-{s}");
        let pods: Vec<SynthPod> = (0..pods_per_service)
            .map(|p| {
                let pod = SynthPod::new("bench", &format!("{app}-{p}"), &app, ip(n));
                n += 1;
                pod
            })
            .collect();
        cluster.services.push(service("bench", &app));
        cluster.slices.push(slice(
            "bench",
            &format!("{app}-slice"),
            &app,
            pods.iter().map(SynthPod::endpoint).collect(),
        ));
        cluster.pods.extend(pods.iter().map(SynthPod::build));
    }
    cluster
}

/// An index (epoch 1, default configuration) that listed `cluster`; its data
/// counts as fresh for an hour without news, longer than any measurement.
pub fn indexed(cluster: Cluster) -> SharedIndex {
    let shared = SharedIndex::new(
        Index::new(1, IndexConfig::default()),
        Duration::from_secs(3600),
    );
    feed(&shared, cluster);
    shared
}

/// Feeds `cluster` to `shared` as the initial list of every kind.
pub fn feed(shared: &SharedIndex, cluster: Cluster) {
    let Cluster {
        services,
        pods,
        slices,
    } = cluster;
    shared.relist_all(services, pods, slices, SystemTime::now());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_synthetic_cluster_indexes_every_pod_as_a_member() {
        let shared = indexed(cluster(3, 300));
        let index = shared.read();
        assert!(index.synced());
        assert_eq!(index.stats().pods, 900);
        assert_eq!(index.stats().ips, 900);
        let record = index.record(ip(899)).unwrap();
        assert_eq!(record.pods[0].name, "svc-2-299");
        assert!(record.pods[0].is_member_of(&staleguard_core::ServiceKey::new("bench", "svc-2")));
    }

    #[test]
    fn ips_are_distinct_and_never_network_or_broadcast() {
        let ips: std::collections::HashSet<_> = (0..100_000).map(ip).collect();
        assert_eq!(ips.len(), 100_000);
        assert!(ips.iter().all(|ip| match ip {
            IpAddr::V4(v4) => v4.octets()[3] != 0 && v4.octets()[3] != 255,
            IpAddr::V6(_) => false,
        }));
    }
}
