//! Synthetic clusters for benchmarks and demos: many Services, their Pods and
//! EndpointSlices, shaped like what a real cluster serves, built without an API
//! server. Tests use the terser builders in `index::fixtures`.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::time::SystemTime;

use k8s_openapi::api::core::v1::{
    ObjectReference, Pod, PodCondition, PodIP, PodSpec, PodStatus, Service, ServiceSpec,
};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::runtime::watcher::Event;

use crate::shared::SharedIndex;

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

/// A running, ready pod of `app` in `namespace` holding `ip`, uid `uid-<name>`.
pub fn pod(namespace: &str, name: &str, app: &str, ip: IpAddr) -> Pod {
    Pod {
        metadata: ObjectMeta {
            namespace: Some(namespace.into()),
            name: Some(name.into()),
            uid: Some(format!("uid-{name}")),
            labels: Some(BTreeMap::from([(APP_LABEL.into(), app.into())])),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            node_name: Some("node-1".into()),
            ..PodSpec::default()
        }),
        status: Some(PodStatus {
            phase: Some("Running".into()),
            pod_ip: Some(ip.to_string()),
            pod_ips: Some(vec![PodIP { ip: ip.to_string() }]),
            conditions: Some(vec![PodCondition {
                type_: "Ready".into(),
                status: "True".into(),
                ..PodCondition::default()
            }]),
            ..PodStatus::default()
        }),
    }
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

/// The slice of service `namespace/app` listing `pods` (port 8080).
pub fn slice(namespace: &str, app: &str, pods: &[Pod]) -> EndpointSlice {
    let endpoints = pods
        .iter()
        .filter_map(|p| {
            let ip = p.status.as_ref()?.pod_ip.clone()?;
            Some(Endpoint {
                addresses: vec![ip],
                conditions: Some(EndpointConditions {
                    ready: Some(true),
                    serving: Some(true),
                    terminating: Some(false),
                }),
                target_ref: Some(ObjectReference {
                    kind: Some("Pod".into()),
                    namespace: p.metadata.namespace.clone(),
                    name: p.metadata.name.clone(),
                    uid: p.metadata.uid.clone(),
                    ..ObjectReference::default()
                }),
                ..Endpoint::default()
            })
        })
        .collect();
    EndpointSlice {
        metadata: ObjectMeta {
            namespace: Some(namespace.into()),
            name: Some(format!("{app}-slice")),
            labels: Some(BTreeMap::from([(
                "kubernetes.io/service-name".into(),
                app.into(),
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
        let pods: Vec<Pod> = (0..pods_per_service)
            .map(|p| {
                let pod = pod("bench", &format!("{app}-{p}"), &app, ip(n));
                n += 1;
                pod
            })
            .collect();
        cluster.services.push(service("bench", &app));
        cluster.slices.push(slice("bench", &app, &pods));
        cluster.pods.extend(pods);
    }
    cluster
}

/// Feeds `cluster` to `shared` as the initial list of every kind.
pub fn feed(shared: &SharedIndex, cluster: Cluster) {
    let now = SystemTime::now();
    shared.apply_service(Event::Init, now);
    for s in cluster.services {
        shared.apply_service(Event::InitApply(s), now);
    }
    shared.apply_service(Event::InitDone, now);
    shared.apply_pod(Event::Init, now);
    for p in cluster.pods {
        shared.apply_pod(Event::InitApply(p), now);
    }
    shared.apply_pod(Event::InitDone, now);
    shared.apply_slice(Event::Init, now);
    for s in cluster.slices {
        shared.apply_slice(Event::InitApply(s), now);
    }
    shared.apply_slice(Event::InitDone, now);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::{Index, IndexConfig};
    use std::time::Duration;

    #[test]
    fn a_synthetic_cluster_indexes_every_pod_as_a_member() {
        let shared = SharedIndex::new(
            Index::new(1, IndexConfig::default()),
            Duration::from_secs(60),
        );
        feed(&shared, cluster(3, 300));
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
