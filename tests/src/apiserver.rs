//! A real Kubernetes API server for tests: `staleguard-apiserver`
//! (tests/apiserver, see docs/apiserver.md), built on k8s.io/apiserver with an
//! embedded etcd, so watches see real resourceVersions, bookmarks, relists and
//! `410 Gone`.
//!
//! [`ApiServer::start`] runs one on a free port with its own data directory
//! and hands out a [`kube::Client`]; the helpers write objects the way the real
//! actors do (a kubelet sets a pod's IP and readiness through `pods/status`,
//! the EndpointSlice controller writes slices), and the fault helpers freeze,
//! kill, restart and compact it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use k8s_openapi::api::core::v1::{
    Container, Namespace, Pod, PodCondition, PodIP, PodSpec, PodStatus, Service, ServicePort,
    ServiceSpec,
};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::Client;
use serde::Deserialize;
use serde_json::json;

use crate::process::{free_port, require, OwnedProcess};

/// The node every "scheduled" pod is bound to. No kubelet runs it: a bound pod
/// deleted gracefully stays terminating until it is force-deleted.
pub const NODE: &str = "node-1";

/// How long a harness call to the server may take before the test fails.
const CALL_TIMEOUT: Duration = Duration::from_secs(20);

/// A running test API server; killed and its data removed when dropped.
pub struct ApiServer {
    guard: OwnedProcess,
    bin: PathBuf,
    dir: PathBuf,
    port: u16,
    client: Client,
    args: Vec<String>,
    /// How long the last start took until the server was ready.
    pub startup: Duration,
}

/// One line of the server's request log: how many requests a client (by user
/// agent) made with a verb on a resource.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct RequestCount {
    /// The client's `User-Agent`.
    #[serde(rename = "userAgent")]
    pub user_agent: String,
    /// `list`, `watch`, `get`, `create`, ... (HTTP method for non-API paths).
    pub verb: String,
    /// `pods`, `pods/status`, `endpointslices`, ... (path for non-API paths).
    pub resource: String,
    /// How many.
    pub count: u64,
}

/// What the harness identifies itself as, so request counts can tell its
/// writes from the validator's reads.
pub const HARNESS_USER_AGENT: &str = "staleguard-tests-harness";

impl std::fmt::Debug for ApiServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiServer")
            .field("pid", &self.pid())
            .field("url", &self.url())
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

impl ApiServer {
    /// Starts a server, or returns `None` (after a loud SKIP line) when the
    /// binary is missing outside CI. Under `CI=true` a missing binary panics.
    pub async fn start() -> Result<Option<Self>> {
        Self::start_with(&[]).await
    }

    /// Like [`ApiServer::start`], with extra flags for the server (for
    /// example `--watch-cache=false`).
    pub async fn start_with(extra: &[&str]) -> Result<Option<Self>> {
        let Some(bin) = require(
            "STALEGUARD_APISERVER",
            "the test API server (staleguard-apiserver)",
            "run `. scripts/setup.sh && sg_setup_apiserver` (or scripts/test), which builds it",
        ) else {
            return Ok(None);
        };
        let dir = std::env::temp_dir().join(format!(
            "staleguard-apiserver-{}-{}",
            std::process::id(),
            unique()
        ));
        std::fs::create_dir_all(&dir).with_context(|| format!("create {dir:?}"))?;
        let port = free_port()?;
        let args = extra.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        let started = Instant::now();
        let mut guard = spawn(&bin, &dir, port, &args)?;
        let client = wait_ready(&mut guard, &dir).await?;
        Ok(Some(Self {
            guard,
            bin,
            dir,
            port,
            client,
            args,
            startup: started.elapsed(),
        }))
    }

    /// A client for the server (anonymous, trusting its CA).
    pub fn client(&self) -> Client {
        self.client.clone()
    }

    /// The kubeconfig the server wrote; hand it to the validator.
    pub fn kubeconfig(&self) -> PathBuf {
        self.dir.join("certs").join("kubeconfig")
    }

    /// The server's URL.
    pub fn url(&self) -> String {
        format!("https://127.0.0.1:{}", self.port)
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.guard.pid()
    }

    /// What the server has logged.
    pub fn output(&self) -> String {
        self.guard.output()
    }

    /// Kills the server (SIGKILL): watches break mid-stream.
    pub fn kill(&mut self) {
        self.guard.kill();
    }

    /// Starts the server again on the same port and data directory (after
    /// [`ApiServer::kill`], or kills it first).
    pub async fn restart(&mut self) -> Result<()> {
        self.guard.kill();
        let started = Instant::now();
        self.guard = spawn(&self.bin, &self.dir, self.port, &self.args)?;
        self.client = wait_ready(&mut self.guard, &self.dir).await?;
        self.startup = started.elapsed();
        Ok(())
    }

    /// Freezes the server (SIGSTOP): connections stay open, nothing answers.
    pub fn freeze(&self) -> Result<()> {
        signal(self.pid(), "STOP")
    }

    /// Thaws a frozen server (SIGCONT).
    pub fn thaw(&self) -> Result<()> {
        signal(self.pid(), "CONT")
    }

    /// Compacts etcd up to its current revision; returns that revision. A
    /// watch that reaches etcd from an older resourceVersion then gets `410
    /// Gone` (with the watch cache on, that is after a restart).
    pub async fn compact(&self) -> Result<i64> {
        #[derive(Deserialize)]
        struct Compacted {
            revision: i64,
        }
        let body = self.raw("POST", "/staleguard/compact").await?;
        let c: Compacted = serde_json::from_str(&body).context("compact answer")?;
        Ok(c.revision)
    }

    /// Every API request the server has counted since it started (or since
    /// the last [`ApiServer::reset_request_counts`]).
    pub async fn request_counts(&self) -> Result<Vec<RequestCount>> {
        let body = self.raw("GET", "/staleguard/requests").await?;
        serde_json::from_str(&body).context("request counts")
    }

    /// Clears the request counts.
    pub async fn reset_request_counts(&self) -> Result<()> {
        self.raw("DELETE", "/staleguard/requests").await.map(drop)
    }

    async fn raw(&self, method: &str, path: &str) -> Result<String> {
        let req = http::Request::builder()
            .method(method)
            .uri(path)
            .body(Vec::new())?;
        timed(self.client.request_text(req)).await
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        // SIGKILL ends a stopped process too; thawing first just keeps a
        // frozen server from outliving a failed test in odd states.
        let _ = signal(self.pid(), "CONT");
        self.guard.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn spawn(bin: &Path, dir: &Path, port: u16, extra: &[String]) -> Result<OwnedProcess> {
    let mut cmd = Command::new(bin);
    cmd.arg("--data-dir")
        .arg(dir)
        .arg("--port")
        .arg(port.to_string())
        .args(extra);
    OwnedProcess::spawn("apiserver", cmd)
}

/// Waits until the server answers `/readyz`, then returns a client for it.
async fn wait_ready(guard: &mut OwnedProcess, dir: &Path) -> Result<Client> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let kubeconfig = dir.join("certs").join("kubeconfig");
    loop {
        guard.check_alive()?;
        if kubeconfig.exists() {
            if let Ok(client) = client_for(&kubeconfig).await {
                let req = http::Request::get("/readyz").body(Vec::new())?;
                let ready = tokio::time::timeout(Duration::from_secs(2), client.request_text(req));
                if let Ok(Ok(text)) = ready.await {
                    if text.trim() == "ok" {
                        return Ok(client);
                    }
                }
            }
        }
        if Instant::now() > deadline {
            bail!("API server not ready after 60s:\n{}", guard.output());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A client from a kubeconfig the server wrote, identified as the harness.
pub async fn client_for(kubeconfig: &Path) -> Result<Client> {
    let mut config = kube_config(kubeconfig).await?;
    config.headers.push((
        http::header::USER_AGENT,
        http::HeaderValue::from_static(HARNESS_USER_AGENT),
    ));
    Ok(Client::try_from(config)?)
}

/// The kube config in a kubeconfig file.
pub async fn kube_config(kubeconfig: &Path) -> Result<kube::Config> {
    let file = Kubeconfig::read_from(kubeconfig)?;
    Ok(kube::Config::from_custom_kubeconfig(file, &KubeConfigOptions::default()).await?)
}

fn signal(pid: u32, sig: &str) -> Result<()> {
    if pid == 0 {
        return Ok(());
    }
    let status = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()?;
    if !status.success() {
        bail!("kill -{sig} {pid} failed: {status}");
    }
    Ok(())
}

async fn timed<T, E: Into<anyhow::Error>>(
    fut: impl std::future::Future<Output = std::result::Result<T, E>>,
) -> Result<T> {
    match tokio::time::timeout(CALL_TIMEOUT, fut).await {
        Ok(r) => r.map_err(Into::into),
        Err(_) => bail!("API server call timed out after {CALL_TIMEOUT:?}"),
    }
}

fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

// === objects, written as the real actors write them ===

/// Writes objects to a test API server the way Kubernetes' own actors would.
#[derive(Clone)]
pub struct Cluster {
    client: Client,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster").finish_non_exhaustive()
    }
}

/// One endpoint of an EndpointSlice: an IP and the pod behind it.
#[derive(Debug, Clone)]
pub struct SliceEndpoint {
    /// The IP.
    pub ip: String,
    /// The pod's name (the slice's `targetRef`), if any.
    pub pod: Option<String>,
    /// The pod's uid.
    pub uid: Option<String>,
    /// `conditions.ready`.
    pub ready: bool,
    /// `conditions.terminating`.
    pub terminating: bool,
}

impl SliceEndpoint {
    /// A ready endpoint for a pod.
    pub fn pod(ip: &str, pod: &Pod) -> Self {
        Self {
            ip: ip.to_owned(),
            pod: pod.metadata.name.clone(),
            uid: pod.metadata.uid.clone(),
            ready: true,
            terminating: false,
        }
    }
}

impl Cluster {
    /// Wraps a client.
    pub fn new(client: Client) -> Self {
        Self { client }
    }

    /// Creates a namespace.
    pub async fn namespace(&self, name: &str) -> Result<Namespace> {
        let ns = Namespace {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                ..ObjectMeta::default()
            },
            ..Namespace::default()
        };
        timed(Api::<Namespace>::all(self.client.clone()).create(&PostParams::default(), &ns)).await
    }

    /// Creates a service selecting pods labelled `app=<name>`, with one TCP
    /// port `http` 80 -> `port`.
    pub async fn service(&self, ns: &str, name: &str, port: i32) -> Result<Service> {
        let svc = Service {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                namespace: Some(ns.to_owned()),
                ..ObjectMeta::default()
            },
            spec: Some(ServiceSpec {
                selector: Some(BTreeMap::from([("app".to_owned(), name.to_owned())])),
                ports: Some(vec![ServicePort {
                    name: Some("http".to_owned()),
                    port: 80,
                    target_port: Some(
                        k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(port),
                    ),
                    protocol: Some("TCP".to_owned()),
                    ..ServicePort::default()
                }]),
                ..ServiceSpec::default()
            }),
            ..Service::default()
        };
        timed(
            Api::<Service>::namespaced(self.client.clone(), ns)
                .create(&PostParams::default(), &svc),
        )
        .await
    }

    /// Creates a pod of service `app` (label `app=<app>`), bound to [`NODE`]
    /// as the scheduler would (so deleting it is graceful).
    pub async fn pod(&self, ns: &str, name: &str, app: &str) -> Result<Pod> {
        self.pod_on(ns, name, app, Some(NODE)).await
    }

    /// Creates a pod of service `app` bound to `node`, or unscheduled.
    pub async fn pod_on(&self, ns: &str, name: &str, app: &str, node: Option<&str>) -> Result<Pod> {
        let pod = Pod {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                namespace: Some(ns.to_owned()),
                labels: Some(BTreeMap::from([("app".to_owned(), app.to_owned())])),
                ..ObjectMeta::default()
            },
            spec: Some(PodSpec {
                node_name: node.map(str::to_owned),
                containers: vec![Container {
                    name: "app".to_owned(),
                    image: Some("registry.invalid/app:1".to_owned()),
                    ..Container::default()
                }],
                ..PodSpec::default()
            }),
            ..Pod::default()
        };
        timed(Api::<Pod>::namespaced(self.client.clone(), ns).create(&PostParams::default(), &pod))
            .await
    }

    /// Sets a pod's IP, phase `Running` and `Ready` condition through
    /// `pods/status`, as its kubelet would.
    pub async fn run_pod(&self, ns: &str, name: &str, ip: &str, ready: bool) -> Result<Pod> {
        let status = PodStatus {
            phase: Some("Running".to_owned()),
            pod_ip: Some(ip.to_owned()),
            pod_ips: Some(vec![PodIP { ip: ip.to_owned() }]),
            conditions: Some(vec![PodCondition {
                type_: "Ready".to_owned(),
                status: if ready { "True" } else { "False" }.to_owned(),
                ..PodCondition::default()
            }]),
            ..PodStatus::default()
        };
        let patch = json!({ "status": status });
        timed(
            Api::<Pod>::namespaced(self.client.clone(), ns).patch_status(
                name,
                &PatchParams::default(),
                &Patch::Merge(&patch),
            ),
        )
        .await
    }

    /// Creates or replaces the EndpointSlice `<service>-1` of a service with
    /// these endpoints, all on port `port` named `http`.
    pub async fn slice(
        &self,
        ns: &str,
        service: &str,
        port: i32,
        endpoints: &[SliceEndpoint],
    ) -> Result<EndpointSlice> {
        self.named_slice(ns, service, &format!("{service}-1"), port, endpoints)
            .await
    }

    /// Creates or replaces the EndpointSlice `name` of a service.
    pub async fn named_slice(
        &self,
        ns: &str,
        service: &str,
        name: &str,
        port: i32,
        endpoints: &[SliceEndpoint],
    ) -> Result<EndpointSlice> {
        let slice = EndpointSlice {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                namespace: Some(ns.to_owned()),
                labels: Some(BTreeMap::from([(
                    "kubernetes.io/service-name".to_owned(),
                    service.to_owned(),
                )])),
                ..ObjectMeta::default()
            },
            address_type: "IPv4".to_owned(),
            endpoints: endpoints
                .iter()
                .map(|e| Endpoint {
                    addresses: vec![e.ip.clone()],
                    conditions: Some(EndpointConditions {
                        ready: Some(e.ready && !e.terminating),
                        serving: Some(e.ready),
                        terminating: Some(e.terminating),
                    }),
                    target_ref: e.pod.as_ref().map(|pod| {
                        k8s_openapi::api::core::v1::ObjectReference {
                            kind: Some("Pod".to_owned()),
                            name: Some(pod.clone()),
                            namespace: Some(ns.to_owned()),
                            uid: e.uid.clone(),
                            ..Default::default()
                        }
                    }),
                    ..Endpoint::default()
                })
                .collect(),
            ports: Some(vec![EndpointPort {
                name: Some("http".to_owned()),
                port: Some(port),
                protocol: Some("TCP".to_owned()),
                ..EndpointPort::default()
            }]),
        };
        let api = Api::<EndpointSlice>::namespaced(self.client.clone(), ns);
        let params = PatchParams::apply("staleguard-tests").force();
        timed(api.patch(name, &params, &Patch::Apply(&slice))).await
    }

    /// Deletes a pod as `kubectl delete` does: a bound pod stays, terminating
    /// (no kubelet finishes it); returns the pod if it is still there.
    pub async fn delete_pod(&self, ns: &str, name: &str) -> Result<Option<Pod>> {
        let api = Api::<Pod>::namespaced(self.client.clone(), ns);
        Ok(timed(api.delete(name, &DeleteParams::default()))
            .await?
            .left())
    }

    /// Deletes a pod at once (grace period 0, `--force`).
    pub async fn force_delete_pod(&self, ns: &str, name: &str) -> Result<()> {
        let api = Api::<Pod>::namespaced(self.client.clone(), ns);
        timed(api.delete(name, &DeleteParams::default().grace_period(0)))
            .await
            .map(drop)
    }

    /// Deletes an EndpointSlice.
    pub async fn delete_slice(&self, ns: &str, name: &str) -> Result<()> {
        let api = Api::<EndpointSlice>::namespaced(self.client.clone(), ns);
        timed(api.delete(name, &DeleteParams::default()))
            .await
            .map(drop)
    }

    /// Reads a pod, if it exists.
    pub async fn get_pod(&self, ns: &str, name: &str) -> Result<Option<Pod>> {
        timed(Api::<Pod>::namespaced(self.client.clone(), ns).get_opt(name)).await
    }
}
