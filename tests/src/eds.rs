//! File-based EDS: the endpoint lists Envoy routes by, written by the harness.
//!
//! Envoy reads a cluster's endpoints from a file (`eds_config.path_config_source`)
//! and re-reads it when a file is *moved* onto that path. The harness plays the
//! control plane: it rewrites the file promptly, late, or never, to act out a
//! healthy, lagging or stuck control plane. Every write goes to a temporary file
//! in the same directory and is renamed over the target, so Envoy never reads a
//! half-written list.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::Result;
use serde_json::json;

use crate::world::write_atomically;

/// The endpoint list of one EDS resource (`cluster_name`), kept in one file.
#[derive(Debug)]
pub struct EdsFile {
    path: PathBuf,
    resource: String,
    version: u64,
}

impl EdsFile {
    /// An EDS file at `path` for the resource named `resource` (the clusters'
    /// `eds_cluster_config.service_name`). Nothing is written until [`write`].
    ///
    /// [`write`]: EdsFile::write
    pub fn new(path: impl Into<PathBuf>, resource: impl Into<String>) -> Self {
        Self {
            path: path.into(),
            resource: resource.into(),
            version: 0,
        }
    }

    /// Where the file is.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The resource name Envoy clusters ask for.
    pub fn resource(&self) -> &str {
        &self.resource
    }

    /// How many times the file was written.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Replaces the endpoint list, atomically.
    pub fn write(&mut self, endpoints: &[SocketAddr]) -> Result<()> {
        self.version += 1;
        let doc = document(&self.resource, self.version, endpoints);
        write_atomically(&self.path, &serde_json::to_vec_pretty(&doc)?)?;
        Ok(())
    }
}

/// The discovery response Envoy expects in the file.
fn document(resource: &str, version: u64, endpoints: &[SocketAddr]) -> serde_json::Value {
    let lb_endpoints: Vec<_> = endpoints
        .iter()
        .map(|addr| {
            json!({"endpoint": {"address": {"socket_address": {
                "address": addr.ip().to_string(),
                "port_value": addr.port(),
            }}}})
        })
        .collect();
    json!({
        "version_info": version.to_string(),
        "resources": [{
            "@type": "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
            "cluster_name": resource,
            "endpoints": [{"lb_endpoints": lb_endpoints}],
        }],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_a_cluster_load_assignment_atomically() {
        let dir = std::env::temp_dir().join(format!("sg-eds-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut eds = EdsFile::new(dir.join("cart.json"), "cart");
        eds.write(&["127.0.1.1:8080".parse().unwrap()]).unwrap();
        eds.write(&[
            "127.0.1.1:8080".parse().unwrap(),
            "127.0.1.2:8080".parse().unwrap(),
        ])
        .unwrap();
        let doc: serde_json::Value =
            serde_json::from_slice(&std::fs::read(eds.path()).unwrap()).unwrap();
        assert_eq!(doc["version_info"], "2");
        let cla = &doc["resources"][0];
        assert_eq!(cla["cluster_name"], "cart");
        let eps = cla["endpoints"][0]["lb_endpoints"].as_array().unwrap();
        assert_eq!(eps.len(), 2);
        assert_eq!(
            eps[1]["endpoint"]["address"]["socket_address"]["address"],
            "127.0.1.2"
        );
        // No temporary file is left behind.
        let left: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
        assert_eq!(left.len(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
