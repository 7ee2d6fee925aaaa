//! The validator's Kubernetes source, run in process against a test
//! [`ApiServer`](crate::apiserver::ApiServer): the real watchers
//! (`staleguard_validator::source::kube`) feeding the real
//! [`SharedIndex`], so a test can wait on index generations and read records
//! and verdicts directly.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use staleguard_core::wire::Via;
use staleguard_core::{decide, IpRecord, Policy, ServiceKey, Verdict};
use staleguard_validator::index::{Index, IndexConfig};
use staleguard_validator::live::SharedIndex;
use staleguard_validator::scope::{PodScope, Selector};
use staleguard_validator::source::kube::{start, Scope};
use tokio::task::JoinHandle;

use crate::apiserver::{kube_config, ApiServer};

/// The user agent of the validator's watches, so the server's request counts
/// single them out.
pub const VALIDATOR_USER_AGENT: &str = "staleguard-validator-under-test";

/// The validator's watches over a test API server; stopped when dropped.
#[derive(Debug)]
pub struct KubeSource {
    /// The index the watches feed.
    pub shared: SharedIndex,
    tasks: Vec<JoinHandle<()>>,
}

impl KubeSource {
    /// Starts the three watches (all namespaces) with a staleness bound and
    /// kube-runtime's default watch timeout.
    pub async fn start(server: &ApiServer, max_staleness: Duration) -> Result<Self> {
        Self::start_with(server, max_staleness, Scope::default()).await
    }

    /// Starts the three watches over `scope` with a staleness bound; the
    /// index knows the scope, as the validator's does from its flags.
    pub async fn start_with(
        server: &ApiServer,
        max_staleness: Duration,
        scope: Scope,
    ) -> Result<Self> {
        let mut config = kube_config(&server.kubeconfig()).await?;
        config.headers.push((
            http::header::USER_AGENT,
            http::HeaderValue::from_static(VALIDATOR_USER_AGENT),
        ));
        let pod_selector = match scope.pod_selector.as_deref().map(Selector::parse) {
            Some(Ok(s)) => Some(s),
            Some(Err(e)) => bail!("pod selector: {e}"),
            None => None,
        };
        let index_config = IndexConfig {
            scope: PodScope {
                namespace: scope.namespace.clone(),
                pod_selector,
            },
            ..IndexConfig::default()
        };
        let shared = SharedIndex::new(Index::new(1, index_config), max_staleness);
        let tasks = start(config, scope, shared.clone())?;
        Ok(Self { shared, tasks })
    }

    /// Waits until `check` holds for the index (re-checked on every
    /// generation and every 50 ms); fails with `what` and the last record of
    /// `ip` after `timeout`.
    pub async fn wait_for(
        &self,
        what: &str,
        timeout: Duration,
        mut check: impl FnMut(&Index) -> bool,
    ) -> Result<Duration> {
        let started = Instant::now();
        let mut generations = self.shared.subscribe();
        loop {
            if check(&self.shared.read()) {
                return Ok(started.elapsed());
            }
            if started.elapsed() > timeout {
                bail!(
                    "timed out after {timeout:?} waiting for: {what}\nwatch health: {:?}",
                    self.shared.watch_health()
                );
            }
            let _ = tokio::time::timeout(Duration::from_millis(50), generations.changed()).await;
        }
    }

    /// Waits until the record of `ip` satisfies `check` (an IP with no
    /// record never does); fails with `what` after 15 s.
    pub async fn wait_record(
        &self,
        what: &str,
        ip: &str,
        check: impl Fn(&IpRecord) -> bool,
    ) -> Result<Duration> {
        let ip = parse_ip(ip);
        self.wait_for(what, Duration::from_secs(15), |ix| {
            ix.record(ip).is_some_and(|r| check(&r))
        })
        .await
    }

    /// Waits until no pod holds `ip` (a tombstone may remain).
    pub async fn wait_unheld(&self, what: &str, ip: &str) -> Result<Duration> {
        let ip = parse_ip(ip);
        self.wait_for(what, Duration::from_secs(15), |ix| {
            ix.record(ip).is_none_or(|r| r.pods.is_empty())
        })
        .await
    }

    /// Waits for every watch's initial list.
    pub async fn synced(&self) -> Result<Duration> {
        self.wait_for("initial sync", Duration::from_secs(30), Index::synced)
            .await
    }

    /// The record of an IP now.
    pub fn record(&self, ip: &str) -> Option<IpRecord> {
        self.shared.read().record(parse_ip(ip))
    }

    /// The verdict for a request to `ip` meant for `service`, as the filter
    /// and the `/v1/verdict` API would give it (default policy).
    pub fn verdict(&self, ip: &str, service: &ServiceKey) -> Verdict {
        let fresh = self.shared.freshness().fresh;
        let index = self.shared.read();
        let record = index.record(parse_ip(ip));
        decide(
            &Policy::default(),
            fresh,
            service,
            index.knows_service(service),
            record.as_ref(),
        )
    }
}

impl Drop for KubeSource {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// The names of the pods holding an IP.
pub fn holders(record: &IpRecord) -> Vec<&str> {
    record.pods.iter().map(|p| p.name.as_str()).collect()
}

/// True when a pod holding the IP is a member of `service` by `via`.
pub fn member_via(record: &IpRecord, service: &ServiceKey, via: Via) -> bool {
    record
        .pods
        .iter()
        .flat_map(|p| &p.services)
        .any(|m| m.service == *service && m.via == via)
}

/// Parses an IP the tests wrote themselves.
pub fn parse_ip(ip: &str) -> IpAddr {
    ip.parse().unwrap_or_else(|_| IpAddr::from([0, 0, 0, 0]))
}
