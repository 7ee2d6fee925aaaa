//! `staleguard-validator audit` as a child process, and a fake Envoy admin
//! port that answers with broken output, for the audit's tests and the demo;
//! the validator an audit test judges a gateway with ([`FileValidator`]), on a
//! cluster's objects built with [`Truth`] and [`Pod`].

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::traffic::Http;
use crate::validator::Validator;
use crate::world::write_atomically;

/// The namespace of every object a [`Truth`] holds.
pub const NAMESPACE: &str = "shop";

/// A ready, running pod of [`NAMESPACE`], for [`Truth::pod`].
#[derive(Debug, Clone)]
pub struct Pod {
    name: String,
    app: String,
    ip: String,
    terminating: bool,
    host_network: bool,
}

impl Pod {
    /// Pod `name`, labelled `app: APP` (what the Service `APP` selects), at `ip`.
    pub fn new(name: &str, app: &str, ip: &str) -> Self {
        Self {
            name: name.into(),
            app: app.into(),
            ip: ip.into(),
            terminating: false,
            host_network: false,
        }
    }

    /// With a `deletionTimestamp`: being deleted.
    pub fn terminating(self) -> Self {
        Self {
            terminating: true,
            ..self
        }
    }

    /// On the node's network (`spec.hostNetwork`).
    pub fn host_network(self) -> Self {
        Self {
            host_network: true,
            ..self
        }
    }

    fn to_json(&self) -> Value {
        let Self {
            name,
            app,
            ip,
            terminating,
            host_network,
        } = self;
        let mut metadata = json!({"name": name, "namespace": NAMESPACE,
            "uid": format!("uid-{name}"), "labels": {"app": app}});
        if *terminating {
            metadata["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
        }
        json!({"apiVersion": "v1", "kind": "Pod", "metadata": metadata,
            "spec": {"hostNetwork": host_network, "containers": [{"name": "app", "image": "x"}]},
            "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
                       "conditions": [{"type": "Ready", "status": "True"}]}})
    }
}

/// A cluster's Services and Pods as the validator's file source reads them
/// (a `v1/List`).
#[derive(Debug, Clone, Default)]
pub struct Truth {
    items: Vec<Value>,
}

impl Truth {
    /// With the Service `NAME` on `port`, selecting the pods labelled
    /// `app: NAME`.
    pub fn service(mut self, name: &str, port: u16) -> Self {
        self.items
            .push(json!({"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": NAMESPACE, "uid": format!("svc-{name}")},
            "spec": {"selector": {"app": name}, "ports": [{"name": "http", "port": port}]}}));
        self
    }

    /// With `pod`.
    pub fn pod(mut self, pod: Pod) -> Self {
        self.items.push(pod.to_json());
        self
    }

    /// The `v1/List` document.
    pub fn to_json(&self) -> Value {
        json!({"apiVersion": "v1", "kind": "List", "items": self.items})
    }
}

/// The validator of an audit test: a scratch directory holding the truth
/// (`cluster.json`) and, when asked for, a token file, and the validator
/// serving that truth through its file source. The directory is removed on
/// drop.
#[derive(Debug)]
pub struct FileValidator {
    /// The scratch directory, for the test's own files too.
    pub dir: PathBuf,
    /// The running validator.
    pub validator: Validator,
    token: Option<PathBuf>,
}

impl FileValidator {
    /// Writes `truth` and, with `token`, a token file that `/v1` then
    /// requires, and starts `binary` on them (with `extra` flags); returns
    /// once it is ready.
    pub async fn start(
        binary: &Path,
        truth: &Truth,
        token: Option<&str>,
        extra: &[&str],
    ) -> Result<Self> {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "staleguard-audit-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).with_context(|| format!("create {dir:?}"))?;
        let truth_path = dir.join("cluster.json");
        write_atomically(&truth_path, truth.to_json().to_string().as_bytes())?;
        let mut args: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        let token = match token {
            Some(token) => {
                let path = dir.join("token");
                std::fs::write(&path, token).with_context(|| format!("write {path:?}"))?;
                args.push(format!("--token-file={}", path.display()));
                Some(path)
            }
            None => None,
        };
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let validator = Validator::start(&Http::new(), binary, &truth_path, &args, false).await;
        match validator {
            Ok(validator) => Ok(Self {
                dir,
                validator,
                token,
            }),
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                Err(e)
            }
        }
    }

    /// The truth file the validator reads (what `--cluster-file` takes too).
    pub fn truth_path(&self) -> PathBuf {
        self.dir.join("cluster.json")
    }

    /// Replaces the truth; the validator reads it on its next file poll.
    pub fn write_truth(&self, truth: &Truth) -> Result<()> {
        write_atomically(&self.truth_path(), truth.to_json().to_string().as_bytes())
    }

    /// The token file, when started with a token.
    pub fn token_file(&self) -> Option<&Path> {
        self.token.as_deref()
    }

    /// The validator's public address as the audit's `--validator` takes it.
    pub fn url(&self) -> String {
        format!("http://{}", self.validator.listen)
    }
}

impl Drop for FileValidator {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// What one audit run printed and how it exited.
#[derive(Debug, Clone)]
pub struct AuditRun {
    /// The exit code (`-1` when killed by a signal).
    pub code: i32,
    /// Standard output: the table or the JSON document.
    pub stdout: String,
    /// Standard error: the reason of a failure.
    pub stderr: String,
}

impl AuditRun {
    /// The `--output json` document.
    pub fn json(&self) -> Result<serde_json::Value> {
        serde_json::from_str(&self.stdout).with_context(|| {
            format!(
                "audit output is not JSON:\n{}\n{}",
                self.stdout, self.stderr
            )
        })
    }
}

/// Runs `validator audit ARGS` to completion (off the async runtime's
/// workers).
pub async fn run(validator: &Path, args: &[String]) -> Result<AuditRun> {
    let mut cmd = Command::new(validator);
    cmd.arg("audit").args(args).env("RUST_LOG", "warn");
    let output = tokio::task::spawn_blocking(move || cmd.output())
        .await?
        .context("run staleguard-validator audit")?;
    Ok(AuditRun {
        code: output.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    })
}

/// How the fake admin port answers every request.
#[derive(Debug, Clone)]
pub enum Broken {
    /// A complete HTTP answer whose body is `body` (truncated JSON, HTML...).
    Body(String),
    /// Headers announcing more body than is sent, then the connection closes.
    CutOff(String),
}

/// Serves `broken` on a loopback port until the handle is aborted.
pub async fn fake_admin(broken: Broken) -> Result<(SocketAddr, JoinHandle<()>)> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let task = tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let broken = broken.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let _ = stream.read(&mut buf).await;
                let (body, announced) = match &broken {
                    Broken::Body(b) => (b.clone(), b.len()),
                    Broken::CutOff(b) => (b.clone(), b.len() * 2),
                };
                let head = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {announced}\r\nconnection: close\r\n\r\n"
                );
                let _ = stream.write_all(head.as_bytes()).await;
                let _ = stream.write_all(body.as_bytes()).await;
                let _ = stream.shutdown().await;
            });
        }
    });
    Ok((addr, task))
}
