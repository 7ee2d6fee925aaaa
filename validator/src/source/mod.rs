//! Where the index's objects come from: the Kubernetes API ([`kube`]) or a file
//! ([`file`]). Both feed a [`SharedIndex`] with watch events and report signs of
//! life, so freshness means the same thing for both.

pub mod file;
pub mod kube;

use tokio::task::JoinHandle;

use crate::config::SourceConfig;
use crate::live::SharedIndex;

/// Why a source could not start.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// The file source's first load failed.
    #[error(transparent)]
    File(#[from] file::FileError),
    /// No Kubernetes client could be configured.
    #[error("cannot configure a Kubernetes client (in-cluster or KUBECONFIG): {0}")]
    Kube(#[source] ::kube::Error),
}

/// Starts the configured source; its tasks run until aborted.
pub async fn start(
    config: &SourceConfig,
    shared: SharedIndex,
) -> Result<Vec<JoinHandle<()>>, SourceError> {
    match config {
        SourceConfig::Embedded => Ok(vec![file::start_embedded(shared)?]),
        SourceConfig::File { path, poll } => Ok(vec![file::start(path.clone(), *poll, shared)?]),
        SourceConfig::Kube {
            namespace,
            pod_selector,
            service_selector,
            watch_timeout,
        } => {
            let client_config = ::kube::Config::infer()
                .await
                .map_err(|e| SourceError::Kube(::kube::Error::InferConfig(e)))?;
            kube::start(
                client_config,
                kube::Scope {
                    namespace: namespace.clone(),
                    pod_selector: pod_selector.clone(),
                    service_selector: service_selector.clone(),
                    watch_timeout: Some(*watch_timeout),
                },
                shared,
            )
            .map_err(SourceError::Kube)
        }
    }
}

/// A short description of the source, for logs and summaries.
pub fn describe(config: &SourceConfig) -> String {
    match config {
        SourceConfig::Embedded => "embedded demo sample".into(),
        SourceConfig::File { path, .. } => format!("file {}", path.display()),
        SourceConfig::Kube { namespace, .. } => match namespace {
            Some(ns) => format!("kubernetes namespace {ns}"),
            None => "kubernetes, all namespaces".into(),
        },
    }
}
