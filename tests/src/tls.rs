//! A test certificate authority, made at test time: the CA and the
//! certificates it issues are written as PEM files for the validator
//! (`--tls-cert-file`, `--tls-key-file`), Envoy (`trusted_ca`) and the audit
//! (`--validator-ca-file`). Nothing is checked in; every run has new keys.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose, SanType,
};

/// A CA whose certificate is at [`TestCa::ca_file`].
pub struct TestCa {
    dir: PathBuf,
    issuer: Issuer<'static, KeyPair>,
    ca_file: PathBuf,
}

impl std::fmt::Debug for TestCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestCa").field("dir", &self.dir).finish()
    }
}

/// A certificate and its key, as PEM files.
#[derive(Debug, Clone)]
pub struct Issued {
    /// The certificate (`tls.crt`).
    pub cert: PathBuf,
    /// Its private key (`tls.key`).
    pub key: PathBuf,
}

impl TestCa {
    /// A new CA named `name`, its files under `dir` (created).
    pub fn new(dir: &Path, name: &str) -> Result<Self> {
        std::fs::create_dir_all(dir)?;
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, format!("{name} test CA"));
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let cert = params.self_signed(&key)?;
        let ca_file = dir.join(format!("{name}-ca.crt"));
        std::fs::write(&ca_file, cert.pem()).context("writing the CA certificate")?;
        Ok(Self {
            dir: dir.to_owned(),
            issuer: Issuer::new(params, key),
            ca_file,
        })
    }

    /// The CA's certificate (PEM).
    pub fn ca_file(&self) -> &Path {
        &self.ca_file
    }

    /// Issues a server certificate for `dns_names` (and 127.0.0.1), written
    /// as `<file_stem>.crt` and `<file_stem>.key`.
    pub fn issue(&self, file_stem: &str, dns_names: &[&str]) -> Result<Issued> {
        let key = KeyPair::generate()?;
        let names: Vec<String> = dns_names.iter().map(|n| (*n).to_owned()).collect();
        let mut params = CertificateParams::new(names)?;
        params
            .subject_alt_names
            .push(SanType::IpAddress([127, 0, 0, 1].into()));
        params.distinguished_name.push(
            DnType::CommonName,
            dns_names.first().copied().unwrap_or("server"),
        );
        let cert = params.signed_by(&key, &self.issuer)?;
        let issued = Issued {
            cert: self.dir.join(format!("{file_stem}.crt")),
            key: self.dir.join(format!("{file_stem}.key")),
        };
        std::fs::write(&issued.cert, cert.pem())?;
        std::fs::write(&issued.key, key.serialize_pem())?;
        Ok(issued)
    }
}
