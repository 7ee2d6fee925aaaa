//! Real Envoy for every test, example and the demo: one way to describe a
//! gateway ([`Gateway`], [`bootstrap`]), to run it ([`Envoy`]), to read its
//! metrics ([`stats`]) and to wait for them ([`Envoy::eventually`]).
//!
//! A filter test describes clusters with fixed hosts and picks one per request
//! with the `x-cluster` header ([`Envoy::get`]); an end-to-end scene
//! ([`crate::scene`]) gives each service an EDS cluster and a virtual host, and
//! plays the control plane through the EDS files. An Istio test runs the
//! bootstrap it rendered from Istio's output with [`Envoy::spawn`].
//!
//! The admin reads and waits are blocking. Inside a multi-thread tokio runtime
//! they step off the runtime first ([`crate::blocking::off_runtime`]), so the
//! async scenes call them too, while their pods and load keep running.

pub mod bootstrap;
pub mod native;
pub mod shipped;
pub mod stats;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::Value;

pub use bootstrap::{
    add_twin_endpoints, body_path, cluster_mut, clusters_mut, gateway_listener, lb_endpoint,
    static_cluster, stats_tags, twin_cluster, upstream_filter_options, Cluster, Endpoints, Gateway,
    VirtualHost, CLUSTER_HEADER,
};
pub use shipped::{
    plugin_configs_in, shipped_gateway, shipped_plugin, shipped_plugin_config,
    shipped_route_retry_policy, shipped_validator_tls,
};
pub use stats::Stats;

use crate::blocking::{self, off_runtime, Response};
use crate::process::{free_port, require, wait_for_port, Guard};
use crate::traffic::Target;
use crate::world::World;

/// What Envoy logs when the filter's VM fails: the filter's panic hook, or
/// a trap. The shipped configuration fails open, so such a VM lets traffic
/// through unguarded and a test might still pass: [`Envoy::check_alive`] and
/// dropping an [`Envoy`] fail on either line instead.
const VM_FAILURES: [&str; 2] = ["staleguard: panic:", "failed: Uncaught"];

/// How long a wait for Envoy's metrics may take before the test fails.
pub const WAIT: Duration = Duration::from_secs(30);

/// The Envoy binary and the filter module, or `None` (after a SKIP line)
/// outside CI when they are missing.
pub fn dependencies() -> Option<(PathBuf, PathBuf)> {
    let hint = "run `. scripts/setup.sh && sg_setup_all` (installs Envoy, builds the filter)";
    let envoy = require("STALEGUARD_ENVOY", "Envoy", hint)?;
    let wasm = require("STALEGUARD_WASM", "the staleguard filter module", hint)?;
    Some((envoy, wasm))
}

/// How to run Envoy on a bootstrap.
#[derive(Debug, Clone)]
pub struct Launch {
    /// The gateway's name ([`Envoy::name`]); the process is `envoy-<name>`
    /// in its log file and errors.
    pub name: String,
    /// Worker threads.
    pub concurrency: u32,
    /// Environment variables (the plugin's token...).
    pub env: Vec<(String, String)>,
    /// Run Envoy in its own process group (see [`Gateway::detach`]).
    pub detach: bool,
}

/// A running Envoy, killed when dropped.
#[derive(Debug)]
pub struct Envoy {
    guard: Guard,
    /// The gateway's name (the [`Launch`]'s).
    pub name: String,
    /// True when the filter runs on any of its clusters (set by
    /// [`Gateway::run`]; `false` for a bootstrap spawned as is).
    pub guarded: bool,
    /// The (first) gateway listener.
    pub listener: SocketAddr,
    /// The admin listener.
    pub admin: SocketAddr,
    /// The CDS file and the module its clusters run, when started with
    /// dynamic clusters.
    cds: Option<(PathBuf, PathBuf)>,
}

/// The address of `value["address"]["socket_address"]` in a bootstrap.
fn socket_address(value: &Value, what: &str) -> Result<SocketAddr> {
    let a = &value["address"]["socket_address"];
    let ip = a["address"]
        .as_str()
        .with_context(|| format!("the bootstrap's {what} has no address"))?;
    let port = a["port_value"]
        .as_u64()
        .and_then(|p| u16::try_from(p).ok())
        .with_context(|| format!("the bootstrap's {what} has no port"))?;
    Ok(SocketAddr::new(ip.parse()?, port))
}

impl Envoy {
    /// Runs `envoy` on `bootstrap` and waits until its first listener accepts
    /// (the admin listener is up before it).
    pub fn spawn(envoy: &Path, bootstrap: &Value, launch: &Launch) -> Result<Self> {
        if native::selected() {
            let (mut bootstrap, mut launch) = (bootstrap.clone(), launch.clone());
            native::swap_in(&mut bootstrap, &mut launch.env)?;
            return Self::spawn_as_is(envoy, &bootstrap, &launch);
        }
        Self::spawn_as_is(envoy, bootstrap, launch)
    }

    /// [`Envoy::spawn`] on `bootstrap` exactly as given, whatever the build.
    fn spawn_as_is(envoy: &Path, bootstrap: &Value, launch: &Launch) -> Result<Self> {
        let admin = socket_address(&bootstrap["admin"], "admin")?;
        let listener = socket_address(
            &bootstrap["static_resources"]["listeners"][0],
            "first listener",
        )?;
        let path = std::env::temp_dir().join(format!(
            "staleguard-envoy-{}-{}-{}.json",
            launch.name,
            std::process::id(),
            admin.port()
        ));
        std::fs::write(&path, serde_json::to_vec_pretty(bootstrap)?)
            .with_context(|| format!("write {}", path.display()))?;
        let mut cmd = Command::new(envoy);
        cmd.arg("-c")
            .arg(&path)
            .args(["--concurrency", &launch.concurrency.to_string()])
            .args(["--disable-hot-restart", "-l", "info"])
            .args(["--base-id", &free_port()?.to_string()])
            .env_remove("STALEGUARD_TOKEN")
            .envs(launch.env.iter().map(|(k, v)| (k, v)));
        if launch.detach {
            detach(&mut cmd);
        }
        let guard = Guard::spawn(&format!("envoy-{}", launch.name), cmd)?;
        wait_for_port(&guard, listener, Duration::from_secs(60))?;
        Ok(Self {
            guard,
            name: launch.name.clone(),
            guarded: false,
            listener,
            admin,
            cds: None,
        })
    }

    /// Sends `GET /` through the gateway to `cluster`.
    pub fn get(&self, cluster: &str) -> Result<Response> {
        self.send(cluster, "GET", "/", None)
    }

    /// Sends `method target` with `body` through the gateway to `cluster`.
    pub fn send(
        &self,
        cluster: &str,
        method: &str,
        target: &str,
        body: Option<&[u8]>,
    ) -> Result<Response> {
        // The process only: a request is a measured path in the benchmarks,
        // and a failed VM is caught by the waits and when Envoy is dropped.
        self.guard.check_alive()?;
        blocking::request(
            self.listener,
            method,
            target,
            &[(CLUSTER_HEADER, cluster)],
            body,
        )
    }

    /// A load-generator target for a service of a scene through this
    /// gateway: the service's virtual host (see [`World::gateway`]).
    pub fn target(&self, service: &str) -> Target {
        Target {
            url: format!("http://{}/", self.listener),
            headers: vec![("host".into(), service.into())],
            service: World::key(service),
        }
    }

    /// Envoy's process id.
    pub fn pid(&self) -> u32 {
        self.guard.pid()
    }

    /// An admin page.
    pub fn admin(&self, target: &str) -> Result<String> {
        let page = blocking::get(self.admin, target, &[])
            .with_context(|| format!("{} admin {target}", self.name))?;
        if page.status != 200 {
            bail!(
                "{} admin {target}: {} {}",
                self.name,
                page.status,
                page.body
            );
        }
        Ok(page.body)
    }

    /// Every counter and gauge (`/stats`).
    pub fn stats(&self) -> Result<Stats> {
        Ok(stats::parse(&self.admin("/stats")?))
    }

    /// One counter or gauge by its full root-scope name (e.g.
    /// `wasmcustom.staleguard_filter_sync_polls_total`, read in a cluster's
    /// scope too: see [`stats::root_name`]); `0` when not defined yet.
    pub fn stat(&self, name: &str) -> Result<u64> {
        let filter = format!("/stats?filter={}", stats::filter_for(name));
        Ok(stats::parse(&self.admin(&filter)?)
            .get(name)
            .copied()
            .unwrap_or(0))
    }

    /// The filter's requests with `reason` and `action`, summed over services.
    pub fn requests(&self, reason: &str, action: &str) -> Result<u64> {
        Ok(stats::requests_total(&self.stats()?, reason, action))
    }

    /// Every request the filter judged or passed untouched.
    pub fn requests_counted(&self) -> Result<u64> {
        Ok(stats::requests_counted(&self.stats()?))
    }

    /// `/stats/prometheus`.
    pub fn prometheus(&self) -> Result<String> {
        self.admin("/stats/prometheus")
    }

    /// Polls `f` until it returns `Ok(true)`, failing with Envoy's log when
    /// `timeout` passes or Envoy exits.
    pub fn eventually(
        &self,
        what: &str,
        timeout: Duration,
        mut f: impl FnMut(&Self) -> Result<bool>,
    ) -> Result<()> {
        off_runtime(|| {
            let deadline = Instant::now() + timeout;
            loop {
                self.check_alive()?;
                if f(self)? {
                    return Ok(());
                }
                if Instant::now() > deadline {
                    bail!(
                        "{}: timed out after {timeout:?} waiting for: {what}\n--- envoy log (tail) ---\n{}",
                        self.name,
                        tail(&self.log(), 60)
                    );
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        })
    }

    /// Polls `/stats` until `ok` holds (see [`Envoy::eventually`]).
    pub fn wait_stats(
        &self,
        what: &str,
        timeout: Duration,
        ok: impl Fn(&Stats) -> bool,
    ) -> Result<()> {
        self.eventually(what, timeout, |e| Ok(ok(&e.stats()?)))
    }

    /// Waits until the filter has loaded the validator's index once (its
    /// first full resync).
    pub fn wait_first_sync(&self) -> Result<()> {
        self.eventually("the filter's first sync", WAIT, |e| {
            Ok(e.stat(stats::STAT_RESETS)? >= 1)
        })
    }

    /// Waits until the filter has counted at least `requests` requests: it
    /// adds its per-request counts to Envoy's counters on its timer tick
    /// (docs/metrics.md), so counters lag the traffic by up to a tick.
    pub fn wait_counted(&self, requests: u64) -> Result<()> {
        self.wait_stats(&format!("{requests} requests counted"), WAIT, |s| {
            stats::requests_counted(s) >= requests
        })
    }

    /// Waits until the filter's `reason`/`action` counter reaches `at_least`
    /// (see [`Envoy::wait_counted`] for why it lags).
    pub fn wait_requests(&self, reason: &str, action: &str, at_least: u64) -> Result<()> {
        self.wait_stats(
            &format!("{at_least} requests counted as {reason}/{action}"),
            WAIT,
            |s| stats::requests_total(s, reason, action) >= at_least,
        )
    }

    /// What Envoy has logged so far.
    pub fn log(&self) -> String {
        self.guard.output()
    }

    /// Fails with the log if Envoy exited, or with the line that says so if
    /// the filter's VM failed.
    pub fn check_alive(&self) -> Result<()> {
        self.guard.check_alive()?;
        match self.vm_failure() {
            Some(line) => bail!("{}: the filter's VM failed: {line}", self.name),
            None => Ok(()),
        }
    }

    /// The first log line that says the filter's VM failed.
    fn vm_failure(&self) -> Option<String> {
        self.log()
            .lines()
            .find(|l| VM_FAILURES.iter().any(|f| l.contains(f)))
            .map(str::to_owned)
    }

    /// Replaces the CDS clusters.
    pub fn update_clusters(&self, clusters: &[Cluster]) -> Result<()> {
        let Some((path, wasm)) = &self.cds else {
            bail!("{} was started without dynamic clusters", self.name);
        };
        bootstrap::write_cds(path, wasm, clusters)
    }

    /// Kills Envoy.
    pub fn stop(&mut self) {
        self.guard.kill();
    }
}

impl Drop for Envoy {
    /// A VM that failed fails the test that ran it, even one whose requests
    /// all passed (see [`VM_FAILURES`]).
    fn drop(&mut self) {
        if let Some(line) = self.vm_failure() {
            if !std::thread::panicking() {
                panic!("{}: the filter's VM failed: {line}", self.name);
            }
        }
    }
}

/// Runs `envoy --mode validate` on the configuration file `config` (which
/// also loads the module and configures each plugin), with `env` set and
/// `STALEGUARD_TOKEN` unset otherwise. The output when Envoy accepts; an
/// error with it when not.
pub fn validate(envoy: &Path, config: &Path, env: &[(&str, &str)]) -> Result<String> {
    let out = Command::new(envoy)
        .args(["--mode", "validate", "-c"])
        .arg(config)
        .env_remove("STALEGUARD_TOKEN")
        .envs(env.iter().copied())
        .output()
        .with_context(|| format!("run {}", envoy.display()))?;
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    if out.status.success() && text.contains("OK") {
        Ok(text)
    } else {
        bail!(
            "envoy --mode validate refused {}:\n{text}",
            config.display()
        )
    }
}

/// Puts a child in its own process group (see [`Gateway::detach`]).
pub fn detach(cmd: &mut Command) {
    #[cfg(unix)]
    {
        use std::os::unix::process::CommandExt;
        cmd.process_group(0);
    }
}

/// The last `n` lines of `text`.
pub fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
