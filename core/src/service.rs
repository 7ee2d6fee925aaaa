//! Service names, and how Envoy cluster names map to them.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A Kubernetes Service, named `namespace/name`.
///
/// On the wire it is the string `"namespace/name"`: compact, greppable, and the
/// form operators type into `/v1/verdict?service=`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceKey {
    /// The Service's namespace.
    pub namespace: String,
    /// The Service's name.
    pub name: String,
}

/// Why a string is not a service name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ServiceKeyError {
    /// No `/` between namespace and name.
    #[error("service {0:?} is not of the form NAMESPACE/NAME")]
    NoSlash(String),
    /// A part is empty, too long, or not a DNS-1123 label.
    #[error("service {input:?}: {part} {value:?} is not a DNS-1123 label (lowercase letters, digits and '-', at most 63 characters)")]
    BadLabel {
        /// The whole input.
        input: String,
        /// `namespace` or `name`.
        part: &'static str,
        /// The offending part.
        value: String,
    },
}

impl ServiceKey {
    /// Builds a key from its parts without validation (for values that come from
    /// the API server, which already validated them).
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> Self {
        Self {
            namespace: namespace.into(),
            name: name.into(),
        }
    }

    /// Maps a Kubernetes service host name (`name.namespace.svc.<domain>` or
    /// `name.namespace.svc`) to its key. Other hosts (a `ServiceEntry`, an external
    /// name) are not Kubernetes Services and give `None`.
    pub fn from_fqdn(host: &str) -> Option<Self> {
        let mut parts = host.split('.');
        let name = parts.next()?;
        let namespace = parts.next()?;
        if parts.next()? != "svc" {
            return None;
        }
        if !is_dns_label(name) || !is_dns_label(namespace) {
            return None;
        }
        Some(Self::new(namespace, name))
    }

    /// Maps an Istio outbound cluster name, `outbound|PORT|SUBSET|FQDN`, to the
    /// service it routes to. Inbound, passthrough and other clusters give `None`.
    pub fn from_istio_cluster(cluster: &str) -> Option<Self> {
        let mut parts = cluster.split('|');
        if parts.next()? != "outbound" {
            return None;
        }
        let port = parts.next()?;
        let _subset = parts.next()?;
        let fqdn = parts.next()?;
        if parts.next().is_some() || port.parse::<u16>().is_err() {
            return None;
        }
        Self::from_fqdn(fqdn)
    }
}

/// True for a DNS-1123 label, the syntax of namespaces and service names.
pub fn is_dns_label(s: &str) -> bool {
    let bytes = s.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= 63
        && bytes
            .iter()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
        && bytes.first() != Some(&b'-')
        && bytes.last() != Some(&b'-')
}

impl FromStr for ServiceKey {
    type Err = ServiceKeyError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (namespace, name) = s
            .split_once('/')
            .ok_or_else(|| ServiceKeyError::NoSlash(s.to_owned()))?;
        for (part, value) in [("namespace", namespace), ("name", name)] {
            if !is_dns_label(value) {
                return Err(ServiceKeyError::BadLabel {
                    input: s.to_owned(),
                    part,
                    value: value.to_owned(),
                });
            }
        }
        Ok(Self::new(namespace, name))
    }
}

impl fmt::Display for ServiceKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

impl Serialize for ServiceKey {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ServiceKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints_namespace_slash_name() {
        let key: ServiceKey = "shop/cart".parse().unwrap();
        assert_eq!(key, ServiceKey::new("shop", "cart"));
        assert_eq!(key.to_string(), "shop/cart");
    }

    #[test]
    fn rejects_malformed_names_with_a_reason() {
        assert_eq!(
            "cart".parse::<ServiceKey>(),
            Err(ServiceKeyError::NoSlash("cart".into()))
        );
        for bad in [
            "/cart",
            "shop/",
            "Shop/cart",
            "shop/c_art",
            "a/b/c",
            "-a/b",
            "a/b-",
        ] {
            assert!(bad.parse::<ServiceKey>().is_err(), "{bad} parsed");
        }
        let long = format!("shop/{}", "a".repeat(64));
        assert!(long.parse::<ServiceKey>().is_err());
    }

    #[test]
    fn maps_istio_outbound_clusters() {
        assert_eq!(
            ServiceKey::from_istio_cluster("outbound|8080||cart.shop.svc.cluster.local"),
            Some(ServiceKey::new("shop", "cart"))
        );
        assert_eq!(
            ServiceKey::from_istio_cluster("outbound|80|v2|cart.shop.svc.cluster.local"),
            Some(ServiceKey::new("shop", "cart"))
        );
        for other in [
            "inbound|8080||",
            "outbound|80||httpbin.org",
            "outbound|x||cart.shop.svc.cluster.local",
            "outbound|80||cart.shop.svc.cluster.local|extra",
            "PassthroughCluster",
            "",
        ] {
            assert_eq!(ServiceKey::from_istio_cluster(other), None, "{other}");
        }
    }

    #[test]
    fn round_trips_through_json_as_a_string() {
        let key = ServiceKey::new("shop", "cart");
        let json = serde_json::to_string(&key).unwrap();
        assert_eq!(json, "\"shop/cart\"");
        assert_eq!(serde_json::from_str::<ServiceKey>(&json).unwrap(), key);
        assert!(serde_json::from_str::<ServiceKey>("\"nope\"").is_err());
    }
}
