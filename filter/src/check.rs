//! One request's verdict: which service the cluster means, what the index
//! says about the host, and what the filter does about it.

use std::net::{IpAddr, SocketAddr};

use staleguard_core::ip::canonical;
use staleguard_core::{decide, Action, Reason, ServiceKey, Verdict};

use crate::config::{Config, Mode};
use crate::store::{Entry, SharedData, View};

/// What the host told us about the upstream request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Upstream {
    /// `xds.cluster_name`.
    pub cluster: Option<String>,
    /// The first host of Istio's `filter_metadata.istio.services`, if present.
    pub istio_service_host: Option<String>,
    /// `upstream.address`, as `IP:port`.
    pub address: Option<String>,
}

/// What the filter does with the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Effect {
    /// Continue.
    Allow,
    /// Answer locally with this status and the reason header.
    Reject {
        /// HTTP status.
        status: u32,
    },
    /// The verdict rejects, but audit mode lets it through.
    Audit,
}

impl Effect {
    /// The metric label: `allow`, `reject`, `audit`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Effect::Allow => "allow",
            Effect::Reject { .. } => "reject",
            Effect::Audit => "audit",
        }
    }
}

/// The outcome for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The cluster maps to no service: untouched.
    Unmapped,
    /// The upstream address is missing or unreadable: untouched.
    NoAddress,
    /// Judged.
    Judged {
        /// The service the cluster routes to.
        service: ServiceKey,
        /// The host's IP.
        ip: IpAddr,
        /// The verdict.
        verdict: Verdict,
        /// What the filter does.
        effect: Effect,
    },
}

/// The service a cluster routes to: configured rules first, then (with
/// `istio`) the cluster metadata, then the `outbound|PORT|SUBSET|FQDN` name.
/// The rule lives in `staleguard_core::cluster`, shared with the audit.
pub fn resolve_service(config: &Config, upstream: &Upstream) -> Option<ServiceKey> {
    config.cluster_map().resolve(
        upstream.cluster.as_deref().unwrap_or_default(),
        upstream.istio_service_host.as_deref(),
    )
}

/// Parses `IP:port` (`[v6]:port` too) or a bare IP, in the canonical form the
/// index keys IPs by: Envoy reports an IPv4-mapped endpoint as
/// `[::ffff:a.b.c.d]:port`, and that host is `a.b.c.d`.
pub fn parse_ip(address: &str) -> Option<IpAddr> {
    address
        .parse::<SocketAddr>()
        .map(|a| a.ip())
        .or_else(|_| address.parse::<IpAddr>())
        .ok()
        .map(canonical)
}

/// Judges one request against the shared-data index at `now_ms`.
pub fn judge(config: &Config, store: &dyn SharedData, upstream: &Upstream, now_ms: u64) -> Outcome {
    let Some(service) = resolve_service(config, upstream) else {
        return Outcome::Unmapped;
    };
    let Some(ip) = upstream.address.as_deref().and_then(parse_ip) else {
        return Outcome::NoAddress;
    };
    let lookup = View::new(store).lookup(&service, &ip);
    let mut fresh = lookup
        .meta
        .is_some_and(|m| m.is_fresh(now_ms, config.raw.max_staleness_ms));
    // An entry the filter cannot read is no basis for a rejection: it counts
    // as stale data, which the failure policy decides.
    let known = match lookup.service {
        Entry::Present(()) => true,
        Entry::Absent => false,
        Entry::Corrupt => {
            fresh = false;
            false
        }
    };
    let record = match lookup.record {
        Entry::Present(r) => Some(r),
        Entry::Absent => None,
        Entry::Corrupt => {
            fresh = false;
            None
        }
    };
    let verdict = decide(&config.raw.policy, fresh, &service, known, record.as_ref());
    let effect = match (verdict.action, config.raw.mode) {
        (Action::Allow, _) => Effect::Allow,
        (Action::Reject, Mode::Audit) => Effect::Audit,
        (Action::Reject, Mode::Enforce) => Effect::Reject {
            status: config.raw.reject_status,
        },
    };
    Outcome::Judged {
        service,
        ip,
        verdict,
        effect,
    }
}

/// The reason code the reject header carries: nothing else leaves Envoy.
pub fn header_value(reason: Reason) -> &'static str {
    reason.as_str()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::buckets::{self, MIN_BUCKETS};
    use crate::store::{encode_service, service_key, MemoryStore, Meta, META_KEY};
    use staleguard_core::wire::{Membership, Via};
    use staleguard_core::{IpRecord, PodHolder};

    fn config(extra: &str) -> Config {
        Config::parse(format!(r#"{{"validator_cluster":"sg"{extra}}}"#).as_bytes()).unwrap()
    }

    fn cart() -> ServiceKey {
        ServiceKey::new("shop", "cart")
    }

    fn pod(services: &[ServiceKey], terminating: bool) -> PodHolder {
        PodHolder {
            namespace: "shop".into(),
            name: "p".into(),
            uid: "u".into(),
            services: services
                .iter()
                .map(|s| Membership {
                    service: s.clone(),
                    via: Via::Slice,
                    ports: vec![],
                    conditions: None,
                })
                .collect(),
            ready: true,
            terminating,
            host_network: false,
        }
    }

    /// An index at load 1, synced at t=1000, with cart known.
    fn store(records: &[IpRecord]) -> MemoryStore {
        let mut s = MemoryStore::default();
        let meta = Meta {
            load: 1,
            epoch: 1,
            generation: 1,
            synced_ms: 1_000,
            fresh: true,
            entries: records.len() as u64,
            buckets: MIN_BUCKETS,
        };
        s.set(META_KEY, &meta.encode(), None).unwrap();
        s.set(&service_key(&cart()), &encode_service(1), None)
            .unwrap();
        for r in records {
            buckets::put(&mut s, 1, MIN_BUCKETS, r).unwrap();
        }
        s
    }

    fn record(ip: &str, pods: Vec<PodHolder>) -> IpRecord {
        IpRecord {
            ip: ip.parse().unwrap(),
            pods,
            bare_services: vec![],
            tombstone: None,
        }
    }

    fn upstream(cluster: &str, address: &str) -> Upstream {
        Upstream {
            cluster: Some(cluster.into()),
            istio_service_host: None,
            address: Some(address.into()),
        }
    }

    const CART: &str = "outbound|8080||cart.shop.svc.cluster.local";

    fn effect(o: &Outcome) -> (Reason, Effect) {
        match o {
            Outcome::Judged {
                verdict, effect, ..
            } => (verdict.reason, *effect),
            other => panic!("not judged: {other:?}"),
        }
    }

    #[test]
    fn services_come_from_rules_metadata_and_istio_names() {
        let c = config(
            r#","clusters":[{"name":"plain","service":"a/b"},{"prefix":"pay-","service":"shop/pay"}]"#,
        );
        let up = |cluster: &str, host: Option<&str>| Upstream {
            cluster: Some(cluster.into()),
            istio_service_host: host.map(Into::into),
            address: None,
        };
        assert_eq!(
            resolve_service(&c, &up("plain", None)),
            Some(ServiceKey::new("a", "b"))
        );
        assert_eq!(
            resolve_service(&c, &up("pay-v2", None)),
            Some(ServiceKey::new("shop", "pay"))
        );
        assert_eq!(resolve_service(&c, &up(CART, None)), Some(cart()));
        assert_eq!(
            resolve_service(&c, &up("whatever", Some("cart.shop.svc.cluster.local"))),
            Some(cart())
        );
        assert_eq!(resolve_service(&c, &up("other", None)), None);
        let own =
            Config::parse(br#"{"validator_cluster":"outbound|8080||sg.sg.svc.cluster.local"}"#)
                .unwrap();
        assert_eq!(
            resolve_service(&own, &up("outbound|8080||sg.sg.svc.cluster.local", None)),
            None,
            "the validator's own cluster is never judged"
        );
        let no_istio = config(r#","istio":false"#);
        assert_eq!(resolve_service(&no_istio, &up(CART, None)), None);
    }

    #[test]
    fn addresses_parse_for_v4_and_v6() {
        assert_eq!(parse_ip("10.0.0.1:80"), Some("10.0.0.1".parse().unwrap()));
        assert_eq!(parse_ip("[fd00::1]:80"), Some("fd00::1".parse().unwrap()));
        assert_eq!(parse_ip("fd00::1"), Some("fd00::1".parse().unwrap()));
        assert_eq!(parse_ip("nonsense"), None);
    }

    #[test]
    fn an_ipv4_mapped_host_is_judged_as_its_ipv4_address() {
        let c = config("");
        let s = store(&[record("10.0.0.1", vec![pod(&[cart()], false)])]);
        assert_eq!(
            parse_ip("[::ffff:10.0.0.1]:8080"),
            Some("10.0.0.1".parse().unwrap())
        );
        let mapped = upstream(CART, "[::ffff:10.0.0.1]:8080");
        assert_eq!(
            effect(&judge(&c, &s, &mapped, 1_500)),
            (Reason::Member, Effect::Allow),
            "a live pod reached through its mapped address is no destroyed pod"
        );
        // Written under either form, an entry has one key.
        assert_eq!(
            buckets::key_of(&"::ffff:10.0.0.1".parse().unwrap(), MIN_BUCKETS),
            buckets::key_of(&"10.0.0.1".parse().unwrap(), MIN_BUCKETS)
        );
    }

    #[test]
    fn verdicts_follow_the_index() {
        let c = config("");
        let s = store(&[
            record("10.0.0.1", vec![pod(&[cart()], false)]),
            record(
                "10.0.0.2",
                vec![pod(&[ServiceKey::new("shop", "pay")], false)],
            ),
            record("10.0.0.3", vec![pod(&[cart()], true)]),
        ]);
        let j = |addr: &str| effect(&judge(&c, &s, &upstream(CART, addr), 1_500));
        assert_eq!(j("10.0.0.1:8080"), (Reason::Member, Effect::Allow));
        assert_eq!(
            j("10.0.0.2:8080"),
            (Reason::Recycled, Effect::Reject { status: 503 })
        );
        assert_eq!(j("10.0.0.3:8080"), (Reason::Terminating, Effect::Allow));
        assert_eq!(
            j("10.0.0.9:8080"),
            (Reason::Destroyed, Effect::Reject { status: 503 })
        );
        let unknown = upstream("outbound|80||x.other.svc.cluster.local", "10.0.0.9:80");
        assert_eq!(
            effect(&judge(&c, &s, &unknown, 1_500)),
            (Reason::UnknownService, Effect::Allow)
        );
        assert_eq!(
            judge(&c, &s, &upstream("plain", "10.0.0.1:80"), 0),
            Outcome::Unmapped
        );
        let mut no_addr = upstream(CART, "");
        no_addr.address = None;
        assert_eq!(judge(&c, &s, &no_addr, 0), Outcome::NoAddress);
    }

    #[test]
    fn stale_data_follows_the_failure_policy() {
        let s = store(&[]);
        let open = config(r#","max_staleness_ms":40000,"poll_wait_s":1"#);
        let closed = config(
            r#","max_staleness_ms":40000,"poll_wait_s":1,"policy":{"failure_policy":"closed"}"#,
        );
        let late = 1_000 + 40_001;
        assert_eq!(
            effect(&judge(&open, &s, &upstream(CART, "10.0.0.9:1"), late)),
            (Reason::Stale, Effect::Allow)
        );
        assert_eq!(
            effect(&judge(&closed, &s, &upstream(CART, "10.0.0.9:1"), late)),
            (Reason::Stale, Effect::Reject { status: 503 })
        );
        // Never synced: stale too.
        let empty = MemoryStore::default();
        assert_eq!(
            effect(&judge(&closed, &empty, &upstream(CART, "10.0.0.9:1"), 0)).0,
            Reason::Stale
        );
    }

    #[test]
    fn corrupt_entries_count_as_stale_not_as_destroyed() {
        let mut s = store(&[]);
        let ip = "10.0.0.7".parse().unwrap();
        s.set(
            &buckets::key_of(&ip, MIN_BUCKETS),
            b"1\n10.0.0.7 {broken",
            None,
        )
        .unwrap();
        let c = config("");
        assert_eq!(
            effect(&judge(&c, &s, &upstream(CART, "10.0.0.7:1"), 1_000)),
            (Reason::Stale, Effect::Allow)
        );
    }

    #[test]
    fn audit_lets_through_and_the_status_is_configurable() {
        let s = store(&[]);
        let audit = config(r#","mode":"audit""#);
        let custom = config(r#","reject_status":429"#);
        let up = upstream(CART, "10.0.0.9:1");
        assert_eq!(
            effect(&judge(&audit, &s, &up, 1_000)),
            (Reason::Destroyed, Effect::Audit)
        );
        assert_eq!(
            effect(&judge(&custom, &s, &up, 1_000)),
            (Reason::Destroyed, Effect::Reject { status: 429 })
        );
        assert_eq!(header_value(Reason::Destroyed), "destroyed");
    }
}
