//! The rules: is the host Envoy chose still what the control plane claims?
//!
//! [`decide`] looks at one IP's [`IpRecord`] and the service the gateway cluster
//! routes to, and answers with a [`Reason`] (what is true) and an [`Action`]
//! (what to do about it, after [`Policy`]). In order:
//!
//! 1. **stale**: the data is not fresh; the failure policy decides (open by
//!    default: a false rejection is worse than a miss).
//! 2. **unknown_service**: the index does not know the service (an Istio
//!    `ServiceEntry`, a namespace the validator does not watch); allowed by
//!    default.
//! 3. **member**: a live pod holding the IP is a member of the service (by its
//!    slice or by the service's selector, so a scale-up is never rejected), or a
//!    slice of the service lists the IP without a pod (hand-made endpoints).
//! 4. **terminating**: the only members holding the IP are draining and no
//!    running pod outside the service holds it; allowed by default, since they
//!    may still serve. A running (not terminating, not `hostNetwork`) stranger
//!    beside a draining member means the IP was reused: the API still showing
//!    the old pod is the very lag this project guards against, so that is
//!    **recycled** (rule 6).
//! 5. **host_network**: the IP is a node's, shared by `hostNetwork` pods, none of
//!    them a member: a node IP is never judged recycled; allowed.
//! 6. **recycled**: pods hold the IP, but none is a member of the service: the
//!    IP now belongs to someone else. Rejected.
//! 7. **destroyed**: no pod holds the IP. Rejected, whether or not a tombstone
//!    still remembers what held it: a dead IP never becomes acceptable with age.

use serde::{Deserialize, Serialize};

use crate::service::ServiceKey;
use crate::wire::IpRecord;

/// What to do with a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// Let it through.
    Allow,
    /// Stop it.
    Reject,
}

/// What the index says about a host. The `as_str` codes are stable: they name
/// metrics and the reject header, so their number is bounded by design.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// A live member of the service holds the IP.
    Member,
    /// Only terminating members of the service hold the IP.
    Terminating,
    /// The index does not know the service.
    UnknownService,
    /// The IP is a node's, held by `hostNetwork` pods that are not members.
    HostNetwork,
    /// Pods hold the IP, none of them a member of the service.
    Recycled,
    /// No pod holds the IP.
    Destroyed,
    /// The data is not fresh enough to judge.
    Stale,
}

impl Reason {
    /// Every reason, for metrics that want a series per reason up front.
    pub const ALL: [Reason; 7] = [
        Reason::Member,
        Reason::Terminating,
        Reason::UnknownService,
        Reason::HostNetwork,
        Reason::Recycled,
        Reason::Destroyed,
        Reason::Stale,
    ];

    /// The stable code: `member`, `terminating`, `unknown_service`,
    /// `host_network`, `recycled`, `destroyed`, `stale`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Reason::Member => "member",
            Reason::Terminating => "terminating",
            Reason::UnknownService => "unknown_service",
            Reason::HostNetwork => "host_network",
            Reason::Recycled => "recycled",
            Reason::Destroyed => "destroyed",
            Reason::Stale => "stale",
        }
    }
}

impl Action {
    /// `allow` or `reject`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Action::Allow => "allow",
            Action::Reject => "reject",
        }
    }
}

/// What to do when the data cannot be trusted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailurePolicy {
    /// Allow (the default): an outage of staleguard never becomes an outage of
    /// the gateway.
    #[default]
    Open,
    /// Reject: nothing reaches a host that could not be checked.
    Closed,
}

/// The configurable part of the rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Policy {
    /// What to do when the data is stale.
    pub failure_policy: FailurePolicy,
    /// What to do with an IP held only by terminating members.
    pub terminating: Action,
    /// What to do with a service the index does not know.
    pub unknown_service: Action,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            failure_policy: FailurePolicy::Open,
            terminating: Action::Allow,
            unknown_service: Action::Allow,
        }
    }
}

/// The outcome for one host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Verdict {
    /// What is true.
    pub reason: Reason,
    /// What to do.
    pub action: Action,
}

/// Judges one upstream host. `service_known` says whether the index knows
/// `service`; `record` is the index's record of the host's IP, if any; `fresh`
/// whether the data may be trusted. See the module docs for the rules.
pub fn decide(
    policy: &Policy,
    fresh: bool,
    service: &ServiceKey,
    service_known: bool,
    record: Option<&IpRecord>,
) -> Verdict {
    let reason = reason(fresh, service, service_known, record);
    let action = match reason {
        Reason::Member | Reason::HostNetwork => Action::Allow,
        Reason::Recycled | Reason::Destroyed => Action::Reject,
        Reason::Terminating => policy.terminating,
        Reason::UnknownService => policy.unknown_service,
        Reason::Stale => match policy.failure_policy {
            FailurePolicy::Open => Action::Allow,
            FailurePolicy::Closed => Action::Reject,
        },
    };
    Verdict { reason, action }
}

fn reason(
    fresh: bool,
    service: &ServiceKey,
    service_known: bool,
    record: Option<&IpRecord>,
) -> Reason {
    if !fresh {
        return Reason::Stale;
    }
    if !service_known {
        return Reason::UnknownService;
    }
    let Some(record) = record else {
        return Reason::Destroyed;
    };
    let members = || record.pods.iter().filter(|p| p.is_member_of(service));
    if members().any(|p| !p.terminating) || record.bare_services.contains(service) {
        return Reason::Member;
    }
    // The IP has a new owner while the member drains: the node gave the IP to
    // the running pod, so the draining member can no longer be serving on it.
    let running_stranger = || {
        record
            .pods
            .iter()
            .any(|p| !p.terminating && !p.host_network && !p.is_member_of(service))
    };
    if members().next().is_some() && !running_stranger() {
        return Reason::Terminating;
    }
    if record.pods.is_empty() {
        Reason::Destroyed
    } else if record.pods.iter().any(|p| p.host_network) {
        Reason::HostNetwork
    } else {
        Reason::Recycled
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{Membership, PodHolder, Tombstone, Via};

    fn cart() -> ServiceKey {
        ServiceKey::new("shop", "cart")
    }

    fn pod(name: &str, services: &[ServiceKey]) -> PodHolder {
        PodHolder {
            namespace: "shop".into(),
            name: name.into(),
            uid: format!("uid-{name}"),
            services: services
                .iter()
                .map(|s| Membership {
                    service: s.clone(),
                    via: Via::Selector,
                    ports: vec![],
                    conditions: None,
                })
                .collect(),
            ready: true,
            terminating: false,
            host_network: false,
        }
    }

    fn record(pods: Vec<PodHolder>) -> IpRecord {
        IpRecord {
            ip: "10.0.0.7".parse().unwrap(),
            pods,
            bare_services: vec![],
            tombstone: None,
        }
    }

    fn judge(record: Option<&IpRecord>) -> Verdict {
        decide(&Policy::default(), true, &cart(), true, record)
    }

    #[test]
    fn a_live_member_is_allowed() {
        let r = record(vec![pod("cart-1", &[cart()])]);
        assert_eq!(
            judge(Some(&r)),
            Verdict {
                reason: Reason::Member,
                action: Action::Allow
            }
        );
    }

    #[test]
    fn an_ip_no_pod_holds_is_destroyed_with_or_without_history() {
        assert_eq!(judge(None).reason, Reason::Destroyed);
        let mut r = record(vec![]);
        r.tombstone = Some(Tombstone {
            pod: "shop/cart-1".into(),
            uid: "u".into(),
            services: vec![cart()],
            since_ms: 0,
        });
        assert_eq!(judge(Some(&r)).reason, Reason::Destroyed);
        assert_eq!(judge(Some(&r)).action, Action::Reject);
    }

    #[test]
    fn an_ip_held_by_another_service_is_recycled() {
        let r = record(vec![pod("pay-1", &[ServiceKey::new("shop", "pay")])]);
        assert_eq!(
            judge(Some(&r)),
            Verdict {
                reason: Reason::Recycled,
                action: Action::Reject
            }
        );
        let unowned = record(vec![pod("batch-1", &[])]);
        assert_eq!(judge(Some(&unowned)).reason, Reason::Recycled);
    }

    #[test]
    fn a_live_member_wins_over_a_terminating_predecessor() {
        let mut old = pod("pay-old", &[ServiceKey::new("shop", "pay")]);
        old.terminating = true;
        let r = record(vec![old, pod("cart-new", &[cart()])]);
        assert_eq!(judge(Some(&r)).reason, Reason::Member);
    }

    #[test]
    fn a_running_stranger_beats_a_terminating_member() {
        let mut draining = pod("cart-old", &[cart()]);
        draining.terminating = true;
        let r = record(vec![
            pod("pay-new", &[ServiceKey::new("shop", "pay")]),
            draining.clone(),
        ]);
        assert_eq!(
            judge(Some(&r)),
            Verdict {
                reason: Reason::Recycled,
                action: Action::Reject
            }
        );
        // A pod of no service is a stranger as much as a pod of another one.
        let r = record(vec![pod("batch-1", &[]), draining.clone()]);
        assert_eq!(judge(Some(&r)).reason, Reason::Recycled);
    }

    #[test]
    fn only_a_running_pod_off_the_host_network_takes_the_ip_from_a_draining_member() {
        let mut draining = pod("cart-old", &[cart()]);
        draining.terminating = true;
        let mut also_draining = pod("pay-old", &[ServiceKey::new("shop", "pay")]);
        also_draining.terminating = true;
        let r = record(vec![draining.clone(), also_draining]);
        assert_eq!(judge(Some(&r)).reason, Reason::Terminating);
        let mut node = pod("node-exporter", &[ServiceKey::new("mon", "exporter")]);
        node.host_network = true;
        let mut draining_on_node = draining;
        draining_on_node.host_network = true;
        let r = record(vec![node, draining_on_node]);
        assert_eq!(judge(Some(&r)).reason, Reason::Terminating);
    }

    #[test]
    fn terminating_members_follow_the_policy() {
        let mut draining = pod("cart-1", &[cart()]);
        draining.terminating = true;
        let r = record(vec![draining]);
        assert_eq!(
            judge(Some(&r)),
            Verdict {
                reason: Reason::Terminating,
                action: Action::Allow
            }
        );
        let strict = Policy {
            terminating: Action::Reject,
            ..Policy::default()
        };
        assert_eq!(
            decide(&strict, true, &cart(), true, Some(&r)).action,
            Action::Reject
        );
    }

    #[test]
    fn bare_slice_members_are_members() {
        let mut r = record(vec![]);
        r.bare_services = vec![cart()];
        assert_eq!(judge(Some(&r)).reason, Reason::Member);
    }

    #[test]
    fn node_ips_are_never_recycled() {
        let mut node = pod("node-exporter", &[ServiceKey::new("mon", "exporter")]);
        node.host_network = true;
        let r = record(vec![node]);
        assert_eq!(
            judge(Some(&r)),
            Verdict {
                reason: Reason::HostNetwork,
                action: Action::Allow
            }
        );
    }

    #[test]
    fn unknown_services_pass_by_default() {
        let v = decide(&Policy::default(), true, &cart(), false, None);
        assert_eq!(v.reason, Reason::UnknownService);
        assert_eq!(v.action, Action::Allow);
    }

    #[test]
    fn stale_data_follows_the_failure_policy_whatever_the_record_says() {
        let r = record(vec![pod("pay-1", &[ServiceKey::new("shop", "pay")])]);
        let open = decide(&Policy::default(), false, &cart(), true, Some(&r));
        assert_eq!(
            open,
            Verdict {
                reason: Reason::Stale,
                action: Action::Allow
            }
        );
        let closed = Policy {
            failure_policy: FailurePolicy::Closed,
            ..Policy::default()
        };
        assert_eq!(
            decide(&closed, false, &cart(), true, Some(&r)).action,
            Action::Reject
        );
    }

    #[test]
    fn reason_codes_are_distinct_and_snake_case() {
        let codes: std::collections::BTreeSet<_> = Reason::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(codes.len(), Reason::ALL.len());
        for r in Reason::ALL {
            assert_eq!(serde_json::to_value(r).unwrap(), r.as_str());
        }
    }

    #[test]
    fn policy_config_is_strict() {
        let p: Policy = serde_json::from_str(r#"{"failure_policy":"closed"}"#).unwrap();
        assert_eq!(p.failure_policy, FailurePolicy::Closed);
        assert_eq!(p.terminating, Action::Allow);
        assert!(serde_json::from_str::<Policy>(r#"{"failur_policy":"closed"}"#).is_err());
    }
}
