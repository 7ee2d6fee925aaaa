//! `staleguard-validator audit` as a child process, and a fake Envoy admin
//! port that answers with broken output, for the audit's tests and the demo.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

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
