//! TLS for the public listener: rustls (ring), the certificate chain and key
//! read from PEM files (a mounted `kubernetes.io/tls` Secret, `tls.crt` and
//! `tls.key`) and re-read when they change, so a renewed certificate takes
//! effect without a restart.
//!
//! Without TLS the token travels in clear and nothing authenticates the
//! validator: whoever can spoof its DNS name or sit on the path feeds every
//! gateway's index. With it, gateways verify the validator's name (the
//! `UpstreamTlsContext` in `deploy/`) before they send the token.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio_rustls::TlsAcceptor;

/// Where the certificate chain and its key are (`--tls-cert-file`,
/// `--tls-key-file`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// PEM certificate chain, the validator's own certificate first.
    pub cert: PathBuf,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
}

/// Why the certificate or key cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read or holds no PEM item of the kind expected.
    #[error("{path}: {detail}")]
    File {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        detail: String,
    },
    /// rustls refused the key or the configuration.
    #[error("TLS configuration: {0}")]
    Config(#[from] rustls::Error),
}

/// The public listener's TLS: an acceptor whose certificate is re-read when
/// its files change.
#[derive(Clone)]
pub struct ServerTls {
    acceptor: TlsAcceptor,
    certificate: Arc<Reloading>,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls")
            .field("files", &self.certificate.files)
            .finish_non_exhaustive()
    }
}

impl ServerTls {
    /// Loads the chain and key; refuses files that do not make a usable pair.
    pub fn from_files(files: &TlsFiles) -> Result<Self, TlsError> {
        let (key, modified) = load(files)?;
        let certificate = Arc::new(Reloading {
            files: files.clone(),
            current: RwLock::new((Arc::new(key), modified)),
        });
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_cert_resolver(certificate.clone());
        // The listener speaks HTTP/1.1 only (see `connections`).
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Self {
            acceptor: TlsAcceptor::from(Arc::new(config)),
            certificate,
        })
    }

    pub(crate) fn acceptor(&self) -> &TlsAcceptor {
        &self.acceptor
    }

    /// Re-reads the files every `period` when either changed; a pair that no
    /// longer loads keeps the previous certificate and logs why.
    pub async fn watch(self, period: Duration) {
        let mut tick = tokio::time::interval(period);
        loop {
            tick.tick().await;
            let modified = modified(&self.certificate.files);
            let current = self
                .certificate
                .current
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .1;
            if modified == current {
                continue;
            }
            match load(&self.certificate.files) {
                Ok((key, modified)) => {
                    tracing::info!(
                        cert = %self.certificate.files.cert.display(),
                        "reloaded the TLS certificate"
                    );
                    *self
                        .certificate
                        .current
                        .write()
                        .unwrap_or_else(|e| e.into_inner()) = (Arc::new(key), modified);
                }
                Err(error) => {
                    // Not again until the files change once more.
                    self.certificate
                        .current
                        .write()
                        .unwrap_or_else(|e| e.into_inner())
                        .1 = modified;
                    tracing::warn!(%error, "keeping the previous TLS certificate");
                }
            }
        }
    }
}

/// The certificate in force, and the files' modification times it came from.
#[derive(Debug)]
struct Reloading {
    files: TlsFiles,
    current: RwLock<(Arc<CertifiedKey>, Modified)>,
}

type Modified = (Option<SystemTime>, Option<SystemTime>);

impl ResolvesServerCert for Reloading {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(
            self.current
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .0
                .clone(),
        )
    }
}

fn modified(files: &TlsFiles) -> Modified {
    let at = |path: &Path| std::fs::metadata(path).and_then(|m| m.modified()).ok();
    (at(&files.cert), at(&files.key))
}

fn load(files: &TlsFiles) -> Result<(CertifiedKey, Modified), TlsError> {
    let bad = |path: &Path, detail: String| TlsError::File {
        path: path.to_owned(),
        detail,
    };
    let modified = modified(files);
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&files.cert)
        .map_err(|e| bad(&files.cert, e.to_string()))?
        .collect::<Result<_, _>>()
        .map_err(|e| bad(&files.cert, e.to_string()))?;
    if chain.is_empty() {
        return Err(bad(&files.cert, "holds no PEM certificate".into()));
    }
    let key = PrivateKeyDer::from_pem_file(&files.key)
        .map_err(|e| bad(&files.key, format!("no usable PEM private key: {e}")))?;
    let signing = rustls::crypto::ring::sign::any_supported_type(&key)?;
    let certified = CertifiedKey::new(chain, signing);
    // A key that does not match the certificate fails here, not at the first
    // handshake.
    certified.keys_match()?;
    Ok((certified, modified))
}
