//! Which service a gateway cluster routes to: one rule for the filter (per
//! request) and the audit (per endpoint), so both always agree.
//!
//! In order: the plugin configuration's `clusters` rules (first match); then,
//! when `istio` is on, Istio's cluster metadata
//! (`filter_metadata.istio.services[0].host`); then the cluster name
//! `outbound|PORT|SUBSET|FQDN`. The validator's own cluster never maps.

use serde::{Deserialize, Serialize};

use crate::service::ServiceKey;

/// A plain-Envoy mapping rule: a cluster name (exact or prefix) to a service.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterRule {
    /// Exact cluster name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Cluster name prefix (used when `name` is absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
    /// The service the cluster routes to.
    pub service: ServiceKey,
}

impl ClusterRule {
    /// True when the rule names `cluster`.
    pub fn matches(&self, cluster: &str) -> bool {
        match (&self.name, &self.prefix) {
            (Some(name), _) => name == cluster,
            (None, Some(prefix)) => cluster.starts_with(prefix.as_str()),
            (None, None) => false,
        }
    }

    /// What is wrong with the rule, if anything.
    pub fn problem(&self) -> Option<&'static str> {
        match (&self.name, &self.prefix) {
            (Some(n), None) if !n.is_empty() => None,
            (None, Some(p)) if !p.is_empty() => None,
            _ => Some("needs exactly one non-empty `name` or `prefix`"),
        }
    }
}

/// The default of the plugin configuration's `istio` field.
pub const fn default_istio() -> bool {
    true
}

/// The parts of a plugin configuration that map clusters to services.
#[derive(Debug, Clone, Copy)]
pub struct ClusterMap<'a> {
    /// The cluster that reaches the validator: never judged.
    pub validator_cluster: &'a str,
    /// Derive services from Istio cluster metadata and `outbound|...` names.
    pub istio: bool,
    /// Mapping rules, tried first, in order.
    pub rules: &'a [ClusterRule],
}

impl ClusterMap<'_> {
    /// The service `cluster` routes to. `istio_service_host` is the first
    /// host of the cluster's `filter_metadata.istio.services`, when known.
    pub fn resolve(&self, cluster: &str, istio_service_host: Option<&str>) -> Option<ServiceKey> {
        if cluster == self.validator_cluster {
            // The poller's own requests may run through the filter (an Istio
            // patch applied to every cluster); judging them could lock the
            // filter out of the very data that would clear a fail-closed
            // verdict.
            return None;
        }
        if let Some(rule) = self.rules.iter().find(|r| r.matches(cluster)) {
            return Some(rule.service.clone());
        }
        if !self.istio {
            return None;
        }
        istio_service_host
            .and_then(ServiceKey::from_fqdn)
            .or_else(|| ServiceKey::from_istio_cluster(cluster))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules() -> Vec<ClusterRule> {
        serde_json::from_str(
            r#"[{"name":"plain","service":"a/b"},{"prefix":"pay-","service":"shop/pay"}]"#,
        )
        .unwrap()
    }

    const CART: &str = "outbound|8080||cart.shop.svc.cluster.local";

    #[test]
    fn services_come_from_rules_metadata_and_istio_names() {
        let rules = rules();
        let map = ClusterMap {
            validator_cluster: "sg",
            istio: true,
            rules: &rules,
        };
        let cart = Some(ServiceKey::new("shop", "cart"));
        assert_eq!(map.resolve("plain", None), Some(ServiceKey::new("a", "b")));
        assert_eq!(
            map.resolve("pay-v2", None),
            Some(ServiceKey::new("shop", "pay"))
        );
        assert_eq!(map.resolve(CART, None), cart);
        assert_eq!(
            map.resolve("whatever", Some("cart.shop.svc.cluster.local")),
            cart
        );
        assert_eq!(map.resolve("other", None), None);
        let own = ClusterMap {
            validator_cluster: CART,
            ..map
        };
        assert_eq!(
            own.resolve(CART, None),
            None,
            "the validator's own cluster is never judged"
        );
        let plain = ClusterMap {
            istio: false,
            ..map
        };
        assert_eq!(plain.resolve(CART, None), None);
        assert_eq!(
            plain.resolve("whatever", Some("cart.shop.svc.cluster.local")),
            None
        );
        assert_eq!(
            plain.resolve("plain", None),
            Some(ServiceKey::new("a", "b"))
        );
    }

    #[test]
    fn rules_need_exactly_one_name_or_prefix() {
        let ok = rules();
        assert!(ok.iter().all(|r| r.problem().is_none()));
        for bad in [
            r#"{"service":"a/b"}"#,
            r#"{"name":"","service":"a/b"}"#,
            r#"{"name":"x","prefix":"y","service":"a/b"}"#,
        ] {
            let rule: ClusterRule = serde_json::from_str(bad).unwrap();
            assert!(rule.problem().is_some(), "{bad}");
            if rule.name.is_none() && rule.prefix.is_none() {
                assert!(!rule.matches("anything"));
            }
        }
        assert!(serde_json::from_str::<ClusterRule>(r#"{"nmae":"x","service":"a/b"}"#).is_err());
    }
}
