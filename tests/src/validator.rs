//! The validator as a child process (on a file source or a Kubernetes API
//! server), and the questions the
//! harness asks it (is it ready, what does it say about an IP, which generation).

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::Value;

use crate::process::{free_addr, require, OwnedProcess};
use crate::traffic::Http;

/// The validator binary (`STALEGUARD_VALIDATOR`, exported by
/// `scripts/setup.sh`'s `sg_build_validator`), or `None` after a SKIP line
/// outside CI.
pub fn binary() -> Option<PathBuf> {
    require(
        "STALEGUARD_VALIDATOR",
        "the staleguard-validator binary",
        "run `. scripts/setup.sh && sg_build_validator` (or scripts/test)",
    )
}

/// Where a validator reads the cluster from.
#[derive(Debug, Clone)]
pub enum Source {
    /// `--source file --file PATH`.
    File(PathBuf),
    /// `--source kube` with `KUBECONFIG=PATH`.
    Kube(PathBuf),
}

/// A running (or killed, restartable) validator.
#[derive(Debug)]
pub struct Validator {
    binary: PathBuf,
    source: Source,
    extra: Vec<String>,
    guard: Option<OwnedProcess>,
    detach: bool,
    /// The public listener (`/v1/...`).
    pub listen: SocketAddr,
    /// The admin listener (`/readyz`, `/metrics`).
    pub admin: SocketAddr,
}

impl Validator {
    /// Starts the validator on `file` (with `extra` flags) and waits until it
    /// is ready. `detach` runs it in its own process group (see
    /// [`crate::envoy::Gateway::detach`]).
    pub async fn start(
        http: &Http,
        binary: &Path,
        file: &Path,
        extra: &[&str],
        detach: bool,
    ) -> Result<Self> {
        Self::start_on(http, binary, Source::File(file.to_owned()), extra, detach).await
    }

    /// Starts the validator on `source` (with `extra` flags) and waits until
    /// it is ready.
    pub async fn start_on(
        http: &Http,
        binary: &Path,
        source: Source,
        extra: &[&str],
        detach: bool,
    ) -> Result<Self> {
        let mut validator = Self {
            binary: binary.to_owned(),
            source,
            extra: extra.iter().map(|s| s.to_string()).collect(),
            guard: None,
            detach,
            listen: free_addr()?,
            admin: free_addr()?,
        };
        validator.restart(http).await?;
        Ok(validator)
    }

    /// Starts the process again on the same addresses (a new epoch) and waits
    /// until it is ready. Kills it first if it runs.
    pub async fn restart(&mut self, http: &Http) -> Result<()> {
        self.kill();
        let mut cmd = Command::new(&self.binary);
        match &self.source {
            Source::File(file) => {
                cmd.args(["--source", "file", "--file"]).arg(file);
            }
            Source::Kube(kubeconfig) => {
                cmd.args(["--source", "kube"]).env("KUBECONFIG", kubeconfig);
            }
        }
        cmd.args(["--listen", &self.listen.to_string()])
            .args(["--admin-listen", &self.admin.to_string()])
            .args(&self.extra)
            .env("RUST_LOG", "info");
        if self.detach {
            crate::envoy::detach(&mut cmd);
        }
        self.guard = Some(OwnedProcess::spawn("validator", cmd)?);
        self.wait_ready(http, Duration::from_secs(30)).await
    }

    /// Kills the process (SIGKILL: no goodbye to long polls).
    pub fn kill(&mut self) {
        if let Some(mut guard) = self.guard.take() {
            guard.kill();
        }
    }

    /// The process's output so far.
    pub fn output(&self) -> String {
        self.guard
            .as_ref()
            .map(OwnedProcess::output)
            .unwrap_or_default()
    }

    /// Waits until `/readyz` answers 200.
    pub async fn wait_ready(&mut self, http: &Http, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(guard) = self.guard.as_mut() {
                guard.check_alive()?;
            }
            let url = format!("http://{}/readyz", self.admin);
            if let Ok(reply) = http.get(&url).await {
                if reply.status == 200 {
                    return Ok(());
                }
            }
            if Instant::now() > deadline {
                bail!("validator not ready after {timeout:?}:\n{}", self.output());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The verdict the validator gives a request to `ip` meaning `service`
    /// (`namespace/name`): `(reason, action)`.
    pub async fn verdict(
        &self,
        http: &Http,
        service: &str,
        ip: IpAddr,
    ) -> Result<(String, String)> {
        let url = format!(
            "http://{}/v1/verdict?service={service}&ip={ip}",
            self.listen
        );
        let reply = http.get(&url).await?;
        if reply.status != 200 {
            bail!("{url}: {} {}", reply.status, reply.text());
        }
        let doc: Value = serde_json::from_slice(&reply.body).context("verdict JSON")?;
        let field = |k: &str| doc["verdict"][k].as_str().unwrap_or_default().to_owned();
        Ok((field("reason"), field("action")))
    }

    /// `(epoch, generation)` of the validator's index now.
    pub async fn generation(&self, http: &Http) -> Result<(u64, u64)> {
        let url = format!("http://{}/v1/snapshot", self.listen);
        let reply = http.get(&url).await?;
        if reply.status != 200 {
            bail!("{url}: {} {}", reply.status, reply.text());
        }
        let doc: Value = serde_json::from_slice(&reply.body).context("snapshot JSON")?;
        Ok((
            doc["epoch"].as_u64().unwrap_or_default(),
            doc["generation"].as_u64().unwrap_or_default(),
        ))
    }

    /// Waits until the validator's verdict for each `(service, ip)` has the
    /// expected reason.
    pub async fn wait_verdicts(
        &self,
        http: &Http,
        expect: &[(String, IpAddr, &str)],
        timeout: Duration,
    ) -> Result<()> {
        let deadline = Instant::now() + timeout;
        for (service, ip, reason) in expect {
            loop {
                let got = self.verdict(http, service, *ip).await;
                if matches!(&got, Ok((r, _)) if r == reason) {
                    break;
                }
                if Instant::now() > deadline {
                    bail!(
                        "validator: {service} {ip} is {got:?}, want {reason} (after {timeout:?})"
                    );
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        Ok(())
    }
}
