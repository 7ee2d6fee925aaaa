//! A simulated cluster: services, pods on loopback addresses, and the two views
//! of it that the processes under test read.
//!
//! [`World`] keeps the truth (which pod holds which IP, which are terminating)
//! and writes it in two places:
//!
//! - the **validator's file source** (a Kubernetes `List` of Pods, Services and
//!   EndpointSlices, as `kubectl get -o json` prints it), always current: in
//!   the incident the API server knew the truth all along;
//! - one **EDS file** per service for Envoy, unless EDS is frozen: that is the
//!   stuck control plane, still telling the gateway about pods long gone.
//!
//! Operations change the truth in memory; [`World::publish`] writes both views.
//! What happens at a pod's address (the old pod stops, something else answers)
//! is queued and only applied by [`World::settle`], because the harness must
//! first wait until the validator and the filter have seen the change: in a
//! real cluster an IP is reused well after its pod's deletion is visible in the
//! API, and a test that flipped the address first would measure a race of its
//! own making, not the product. The one exception: a new pod on an address
//! whose deletion was synced long before may answer at once (settle, then
//! publish), as a new pod serves before its endpoint is published.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use crate::eds::EdsFile;
use crate::envoy::{Cluster, Gateway, VirtualHost};
use crate::pods::{merge, Occupant, PodServer, Tallies, INTENDED_HEADER, VIA_HEADER};

/// The namespace every simulated service lives in.
pub const NAMESPACE: &str = "shop";

/// The Envoy cluster name of a service (Istio's outbound form), so the filter
/// maps clusters to services the way it does under Istio.
pub fn cluster_name(service: &str) -> String {
    format!("outbound|80||{service}.{NAMESPACE}.svc.cluster.local")
}

/// A simulated pod, as the truth knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pod {
    /// The pod's name (`<service>-<n>`).
    pub name: String,
    /// The service's name (without namespace).
    pub service: String,
    /// The pod IP.
    pub ip: IpAddr,
    /// The pod's uid.
    pub uid: String,
    /// The pod has a deletion timestamp and drains.
    pub terminating: bool,
}

#[derive(Debug)]
struct Service {
    eds: EdsFile,
    next_pod: u32,
}

/// The simulated cluster. Needs a tokio runtime (pods are tokio servers).
#[derive(Debug)]
pub struct World {
    dir: PathBuf,
    port: u16,
    truth: PathBuf,
    services: BTreeMap<String, Service>,
    pods: BTreeMap<String, Pod>,
    servers: BTreeMap<IpAddr, PodServer>,
    next_ip: u32,
    next_uid: u64,
    eds_frozen: bool,
    pending: BTreeMap<IpAddr, Occupant>,
}

impl World {
    /// An empty cluster whose files live in a fresh directory under the system
    /// temp dir. All pods listen on one port, free on every address when chosen.
    pub fn new() -> Result<Self> {
        let dir = std::env::temp_dir().join(format!(
            "staleguard-world-{}-{}",
            std::process::id(),
            unique()
        ));
        std::fs::create_dir_all(&dir).with_context(|| format!("create {dir:?}"))?;
        let port = std::net::TcpListener::bind("0.0.0.0:0")?
            .local_addr()?
            .port();
        Ok(Self {
            truth: dir.join("cluster.json"),
            dir,
            port,
            services: BTreeMap::new(),
            pods: BTreeMap::new(),
            servers: BTreeMap::new(),
            next_ip: 0,
            next_uid: 0,
            eds_frozen: false,
            pending: BTreeMap::new(),
        })
    }

    /// The directory holding the truth and the EDS files.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The validator's file source.
    pub fn truth_path(&self) -> &Path {
        &self.truth
    }

    /// The port every pod listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `namespace/name` of a service.
    pub fn key(service: &str) -> String {
        format!("{NAMESPACE}/{service}")
    }

    /// The EDS file of a service.
    pub fn eds(&self, service: &str) -> Result<&EdsFile> {
        Ok(&self.service(service)?.eds)
    }

    /// A gateway named `name` as the incident had it: one EDS cluster per
    /// service on the world's EDS files (gateways built from one world see the
    /// same, possibly stale, control plane), guarded by `plugin` if given. A
    /// request picks its service with the `host` header; the route tags it
    /// with the service it means (`x-sg-intended`) and the gateway's name
    /// (`x-sg-via`), which lets the pods classify what reaches them (see
    /// [`crate::pods`]). Its validator is set by the scene that starts it.
    pub fn gateway(&self, name: &str, plugin: Option<Value>) -> Gateway {
        let clusters = self
            .services
            .iter()
            .map(|(service, s)| Cluster {
                vhost: Some(VirtualHost {
                    domains: vec![service.clone(), format!("{service}:*")],
                    headers: vec![
                        (INTENDED_HEADER.into(), Self::key(service)),
                        (VIA_HEADER.into(), name.into()),
                    ],
                }),
                ..Cluster::eds(&cluster_name(service), &s.eds, plugin.clone())
            })
            .collect();
        Gateway {
            name: name.into(),
            clusters,
            ..Gateway::default()
        }
    }

    /// [`World::gateway`] running the filter with the shipped plugin
    /// configuration plus `extra` fields (a test that turns a knob names it
    /// in its title).
    pub fn guarded(&self, name: &str, extra: Value) -> Gateway {
        self.gateway(name, Some(crate::envoy::shipped_plugin(extra)))
    }

    /// [`World::gateway`] without the filter.
    pub fn unguarded(&self, name: &str) -> Gateway {
        self.gateway(name, None)
    }

    /// The services, by name.
    pub fn services(&self) -> impl Iterator<Item = &str> {
        self.services.keys().map(String::as_str)
    }

    /// The live pods of a service (terminating ones included), by name.
    pub fn pods_of(&self, service: &str) -> Vec<Pod> {
        self.pods
            .values()
            .filter(|p| p.service == service)
            .cloned()
            .collect()
    }

    /// Pod addresses no pod holds now (destroyed pods' IPs, free for reuse).
    pub fn free_ips(&self) -> Vec<IpAddr> {
        self.servers
            .keys()
            .filter(|ip| !self.pods.values().any(|p| p.ip == **ip))
            .copied()
            .collect()
    }

    /// A pod by name.
    pub fn pod(&self, name: &str) -> Option<&Pod> {
        self.pods.get(name)
    }

    /// The pod address for an IP.
    pub fn addr(&self, ip: IpAddr) -> SocketAddr {
        SocketAddr::new(ip, self.port)
    }

    /// True while EDS is frozen.
    pub fn eds_frozen(&self) -> bool {
        self.eds_frozen
    }

    /// Adds a service with `replicas` pods.
    pub async fn add_service(&mut self, name: &str, replicas: usize) -> Result<()> {
        if self.services.contains_key(name) {
            bail!("service {name} exists");
        }
        let eds = EdsFile::new(self.dir.join(format!("eds-{name}.json")), name);
        self.services
            .insert(name.to_owned(), Service { eds, next_pod: 0 });
        self.scale_up(name, replicas).await
    }

    /// Starts `more` pods of a service on fresh IPs. New pods serve at once.
    pub async fn scale_up(&mut self, service: &str, more: usize) -> Result<()> {
        for _ in 0..more {
            let ip = self.fresh_ip()?;
            let pod = self.new_pod(service, ip)?;
            let server =
                PodServer::start(self.addr(ip), Occupant::pod(Self::key(service), &pod)).await?;
            self.servers.insert(ip, server);
        }
        Ok(())
    }

    /// Deletes pods of a service, newest first, until `keep` remain. Their
    /// addresses turn into ghosts at the next [`settle`](World::settle).
    /// Returns the IPs that lost their pod.
    pub fn scale_down(&mut self, service: &str, keep: usize) -> Result<Vec<IpAddr>> {
        self.service(service)?;
        let mut pods = self.pods_of(service);
        pods.sort_by_key(|p| pod_number(&p.name));
        let doomed: Vec<String> = pods.iter().skip(keep).map(|p| p.name.clone()).collect();
        doomed.iter().map(|name| self.destroy(name)).collect()
    }

    /// Deletes one pod; its address becomes a ghost at the next settle.
    pub fn destroy(&mut self, pod: &str) -> Result<IpAddr> {
        let gone = self
            .pods
            .remove(pod)
            .with_context(|| format!("no pod {pod}"))?;
        self.pending.insert(gone.ip, Occupant::Ghost);
        Ok(gone.ip)
    }

    /// How the address of a pod just destroyed behaves once settled:
    /// [`Occupant::Hung`], [`Occupant::Refusing`] or [`Occupant::Blackholed`]
    /// instead of a ghost that answers 200.
    pub fn leave_as(&mut self, ip: IpAddr, occupant: Occupant) -> Result<()> {
        match self.pending.get_mut(&ip) {
            Some(queued) if *queued == Occupant::Ghost => {
                *queued = occupant;
                Ok(())
            }
            _ => bail!("{ip} is not the address of a pod just destroyed"),
        }
    }

    /// Gives `ip` to a new pod of `service`, deleting the pod that held it if
    /// any. The address answers as the new pod at the next settle.
    pub fn recycle(&mut self, ip: IpAddr, service: &str) -> Result<String> {
        if !self.servers.contains_key(&ip) {
            bail!("{ip} is not a pod address of this world");
        }
        self.pods.retain(|_, p| p.ip != ip);
        let name = self.new_pod(service, ip)?;
        self.pending
            .insert(ip, Occupant::pod(Self::key(service), &name));
        Ok(name)
    }

    /// Stops the server on `ip` now, as a killed pod stops: connections are
    /// refused from then on (what [`settle`](World::settle) queued for it no
    /// longer matters). For a benchmark that times the gateways' reaction to
    /// the event itself.
    pub fn stop_address(&self, ip: IpAddr) -> Result<()> {
        match self.servers.get(&ip) {
            Some(server) => {
                server.stop();
                Ok(())
            }
            None => bail!("{ip} is not a pod address of this world"),
        }
    }

    /// Marks a pod terminating (deletion timestamp set, slice entry
    /// `terminating`); it keeps serving while it drains.
    pub fn mark_terminating(&mut self, pod: &str) -> Result<IpAddr> {
        let pod = self
            .pods
            .get_mut(pod)
            .with_context(|| format!("no pod {pod}"))?;
        pod.terminating = true;
        Ok(pod.ip)
    }

    /// Stops writing EDS: the gateway keeps the endpoints it has.
    pub fn freeze_eds(&mut self) {
        self.eds_frozen = true;
    }

    /// Writes EDS again from the next publish on.
    pub fn unfreeze_eds(&mut self) {
        self.eds_frozen = false;
    }

    /// Writes the truth for the validator and, unless frozen, the EDS files.
    pub fn publish(&mut self) -> Result<()> {
        self.publish_truth()?;
        self.publish_eds()
    }

    /// Writes the truth for the validator (the API server knows at once).
    pub fn publish_truth(&self) -> Result<()> {
        write_atomically(&self.truth, &serde_json::to_vec_pretty(&self.truth_doc())?)
    }

    /// Writes the EDS files, unless frozen (the control plane, which lags).
    pub fn publish_eds(&mut self) -> Result<()> {
        if !self.eds_frozen {
            let names: Vec<String> = self.services.keys().cloned().collect();
            for name in names {
                let endpoints: Vec<SocketAddr> = self
                    .pods_of(&name)
                    .iter()
                    .map(|p| self.addr(p.ip))
                    .collect();
                if let Some(svc) = self.services.get_mut(&name) {
                    svc.eds.write(&endpoints)?;
                }
            }
        }
        Ok(())
    }

    /// Applies queued address changes: destroyed pods' addresses become ghosts,
    /// recycled ones answer as their new pod (the last change of an address
    /// wins). Returns how many addresses changed. Call it only once the validator
    /// and the filter have seen the published truth (see the module docs).
    pub fn settle(&mut self) -> usize {
        let pending = std::mem::take(&mut self.pending);
        let n = pending.len();
        for (ip, occupant) in pending {
            if let Some(server) = self.servers.get(&ip) {
                server.set_occupant(occupant);
            }
        }
        n
    }

    /// What reached every address so far, by gateway path.
    pub fn tallies(&self) -> Tallies {
        let mut all = Tallies::new();
        for server in self.servers.values() {
            merge(&mut all, &server.tallies());
        }
        all
    }

    /// What reached some addresses so far, by gateway path.
    pub fn tallies_at(&self, ips: &[IpAddr]) -> Tallies {
        let mut all = Tallies::new();
        for ip in ips {
            if let Some(server) = self.servers.get(ip) {
                merge(&mut all, &server.tallies());
            }
        }
        all
    }

    fn service(&self, name: &str) -> Result<&Service> {
        self.services
            .get(name)
            .with_context(|| format!("no service {name}"))
    }

    fn new_pod(&mut self, service: &str, ip: IpAddr) -> Result<String> {
        let svc = self
            .services
            .get_mut(service)
            .with_context(|| format!("no service {service}"))?;
        let name = format!("{service}-{}", svc.next_pod);
        svc.next_pod += 1;
        self.next_uid += 1;
        let uid = format!("00000000-0000-4000-8000-{:012x}", self.next_uid);
        self.pods.insert(
            name.clone(),
            Pod {
                name: name.clone(),
                service: service.to_owned(),
                ip,
                uid,
                terminating: false,
            },
        );
        Ok(name)
    }

    /// `127.0.1.1`, `127.0.1.2`, ... `127.0.1.250`, `127.0.2.1`, ...
    fn fresh_ip(&mut self) -> Result<IpAddr> {
        let i = self.next_ip;
        self.next_ip += 1;
        let third = 1 + i / 250;
        if third > 255 {
            bail!("out of loopback pod addresses");
        }
        Ok(IpAddr::V4(Ipv4Addr::new(
            127,
            0,
            third as u8,
            (1 + i % 250) as u8,
        )))
    }

    fn truth_doc(&self) -> Value {
        let mut items = Vec::new();
        for name in self.services.keys() {
            items.push(json!({
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": name, "namespace": NAMESPACE, "uid": format!("svc-{name}")},
                "spec": {
                    "selector": {"app": name},
                    "ports": [{"name": "http", "port": 80, "targetPort": self.port, "protocol": "TCP"}],
                },
            }));
            let endpoints: Vec<Value> = self
                .pods_of(name)
                .iter()
                .map(|p| {
                    json!({
                        "addresses": [p.ip.to_string()],
                        "conditions": {"ready": !p.terminating, "serving": true, "terminating": p.terminating},
                        "targetRef": {"kind": "Pod", "namespace": NAMESPACE, "name": p.name, "uid": p.uid},
                    })
                })
                .collect();
            items.push(json!({
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {
                    "name": format!("{name}-sg"),
                    "namespace": NAMESPACE,
                    "labels": {"kubernetes.io/service-name": name},
                },
                "addressType": "IPv4",
                "ports": [{"name": "http", "port": self.port, "protocol": "TCP"}],
                "endpoints": endpoints,
            }));
        }
        for pod in self.pods.values() {
            let mut metadata = json!({
                "name": pod.name,
                "namespace": NAMESPACE,
                "uid": pod.uid,
                "labels": {"app": pod.service},
            });
            if pod.terminating {
                metadata["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
            }
            items.push(json!({
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": metadata,
                "spec": {"containers": [{"name": "app", "image": "staleguard/pod"}]},
                "status": {
                    "phase": "Running",
                    "podIP": pod.ip.to_string(),
                    "podIPs": [{"ip": pod.ip.to_string()}],
                    "conditions": [{"type": "Ready", "status": "True"}],
                },
            }));
        }
        json!({"apiVersion": "v1", "kind": "List", "items": items})
    }
}

impl Drop for World {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn pod_number(name: &str) -> u32 {
    name.rsplit('-')
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// Writes `bytes` to a temporary file next to `path`, then renames it over
/// `path`: readers see the old or the new content, never a mix.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let tmp = dir.join(format!(".{name}.{}.tmp", unique()));
    std::fs::write(&tmp, bytes).with_context(|| format!("write {tmp:?}"))?;
    std::fs::rename(&tmp, path).with_context(|| format!("rename {tmp:?} to {path:?}"))?;
    Ok(())
}

fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn scale_down_and_recycle_change_the_truth_now_and_the_addresses_later() {
        let mut world = World::new().unwrap();
        world.add_service("cart", 3).await.unwrap();
        world.add_service("pay", 1).await.unwrap();
        world.publish().unwrap();
        world.freeze_eds();

        let gone = world.scale_down("cart", 1).unwrap();
        assert_eq!(gone.len(), 2);
        let new_pod = world.recycle(gone[0], "pay").unwrap();
        world.publish().unwrap();

        let truth: Value =
            serde_json::from_slice(&std::fs::read(world.truth_path()).unwrap()).unwrap();
        let pods: Vec<&Value> = truth["items"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|i| i["kind"] == "Pod")
            .collect();
        assert_eq!(pods.len(), 3, "cart-0, pay-0 and the recycled pay pod");
        assert!(pods
            .iter()
            .any(|p| p["metadata"]["name"] == new_pod.as_str()
                && p["status"]["podIP"] == gone[0].to_string()));

        // EDS is frozen: it still lists all three cart pods.
        let eds: Value =
            serde_json::from_slice(&std::fs::read(world.eds("cart").unwrap().path()).unwrap())
                .unwrap();
        let listed = eds["resources"][0]["endpoints"][0]["lb_endpoints"]
            .as_array()
            .unwrap()
            .len();
        assert_eq!(listed, 3);

        // The addresses change only at settle.
        assert!(matches!(
            world.servers[&gone[1]].occupant(),
            Occupant::Pod { .. }
        ));
        assert_eq!(world.settle(), 2);
        assert_eq!(world.servers[&gone[1]].occupant(), Occupant::Ghost);
        assert_eq!(
            world.servers[&gone[0]].occupant(),
            Occupant::pod("shop/pay", new_pod)
        );
    }

    /// A destroyed pod's address left refusing, blackholed or hung behaves
    /// so once settled, and answers again when a pod takes it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_destroyed_address_left_refusing_blackholed_or_hung_does_so_until_reused() {
        use std::time::Duration;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut world = World::new().unwrap();
        world.add_service("cart", 4).await.unwrap();
        let gone = world.scale_down("cart", 1).unwrap();
        for (ip, kind) in
            gone.iter()
                .zip([Occupant::Refusing, Occupant::Blackholed, Occupant::Hung])
        {
            world.leave_as(*ip, kind).unwrap();
        }
        let live = world.pods_of("cart")[0].ip;
        assert!(world.leave_as(live, Occupant::Hung).is_err(), "a live pod");
        world.settle();
        let addrs: Vec<SocketAddr> = gone.iter().map(|ip| world.addr(*ip)).collect();
        let connect = |addr: SocketAddr| async move {
            tokio::time::timeout(
                Duration::from_millis(300),
                tokio::net::TcpStream::connect(addr),
            )
            .await
        };
        // Give the accept loops a moment to close their listeners.
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(matches!(connect(addrs[0]).await, Ok(Err(_))), "refused");
        assert!(connect(addrs[1]).await.is_err(), "the SYN vanished");
        let mut hung = connect(addrs[2]).await.unwrap().unwrap();
        hung.write_all(b"GET / HTTP/1.1\r\nhost: x\r\nx-sg-intended: shop/cart\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 16];
        assert!(
            tokio::time::timeout(Duration::from_millis(300), hung.read(&mut buf))
                .await
                .is_err(),
            "the hung address answered"
        );
        // Reused: the refusing address answers as its new pod.
        world.recycle(gone[0], "cart").unwrap();
        world.settle();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(matches!(connect(addrs[0]).await, Ok(Ok(_))), "reused");
    }
}
