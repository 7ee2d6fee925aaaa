//! Steering requests with a body to live members: the body path's hop.
//!
//! A rejected request with a body cannot be replayed by the filter (Envoy
//! holds the body back from a filter that paused on the headers,
//! proxy-wasm/spec#63), and re-picks by the load balancer land on a stale
//! host as often as the first pick did (at 23 stale endpoints of 25, four
//! picks in a row are all stale 72% of the time). So the body path names
//! live members *before* the request goes anywhere: the filter runs in its
//! steering role as an upstream filter of the body path's hop (the cluster
//! that leads to the internal listener), puts the service's live members
//! from the index in the endpoint header, and lets the request and its body
//! stream on. The internal listener's route sends a request that carries the
//! header to the guarded cluster's twin, whose override-host balancer picks
//! a named member and whose filter lets through only a named pick. Without
//! a fresh index (none loaded yet, no sync for `max_staleness_ms`, or the
//! validator's data not fresh) or a live member, no header: the request
//! takes the guarded cluster and the normal verdict (docs/filter.md,
//! "Requests with a body").

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use staleguard_core::ServiceKey;

use serde_json::Value;

use crate::config::{header_problem, range_problem, read, RetryConfig, HOSTS_PER_CALL};
use crate::host::SharedData;
use crate::members::Member;
use crate::replay;

/// The plugin configuration of the steering role:
/// `{"steer": {"service": "ns/name", "port": 8080}}`; it steers only while
/// stale picks of the service were seen recently (`while_stale_ms`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SteerConfig {
    /// The service whose live members are named (`namespace/name`).
    pub service: String,
    /// The members' port, when the index does not list their ports.
    pub port: u16,
    /// The header the twin's load balancer reads (as `retry.endpoint_header`).
    pub endpoint_header: String,
    /// Members named per request (the twin takes the first that is one of
    /// its endpoints).
    pub hosts: u32,
    /// The guard's `reject_header`: taken out of the answers to steered
    /// requests, since the body path's route retries an answer carrying it.
    pub reject_header: String,
    /// No successful sync for longer than this: the index names no one (as
    /// the guard's `max_staleness_ms`; its members may have died since).
    pub max_staleness_ms: u64,
    /// Steer only while the guard judged a pick of the service stale
    /// (destroyed or recycled) within this long; otherwise the request keeps
    /// the guarded cluster and its own load balancing. `0`: always steer.
    pub while_stale_ms: u64,
}

/// 60 s: the body path steers for a minute after the guard last judged a
/// pick of the service stale.
pub fn default_while_stale_ms() -> u64 {
    60_000
}

/// Where the guard records when it last judged a pick of `service` stale,
/// for the steering role (same VM id, so the same shared data).
fn stale_seen_key(service: &ServiceKey) -> String {
    format!("staleguard/stale-seen/{service}")
}

/// Records that the guard judged a pick of `service` stale at `now_ms`. A
/// failed write only delays steering: the body path's route retries the
/// rejection, and the next stale pick writes again.
pub fn record_stale_pick(store: &mut dyn SharedData, service: &ServiceKey, now_ms: u64) {
    let _ = store.set(&stale_seen_key(service), &now_ms.to_le_bytes(), None);
}

/// The fields of `steer`, as a refusal lists them.
const STEER_FIELDS: &[&str] = &[
    "service",
    "port",
    "endpoint_header",
    "hosts",
    "reject_header",
    "max_staleness_ms",
    "while_stale_ms",
];

impl SteerConfig {
    /// The steering configuration, if `bytes` is one (`Ok(None)`: it is
    /// not; parse it as another role's).
    pub fn parse(bytes: &[u8]) -> Result<Option<Self>, String> {
        let Some(steer) = replay::role(bytes, "steer", "the steering role", Self::read)? else {
            return Ok(None);
        };
        let mut problems = Vec::new();
        if steer.key().is_none() {
            problems.push(format!(
                "steer.service {:?} is not namespace/name",
                steer.service
            ));
        }
        if steer.port == 0 {
            problems.push("steer.port must not be 0".to_owned());
        }
        problems.extend(range_problem("steer.hosts", steer.hosts, HOSTS_PER_CALL));
        problems.extend(header_problem(
            "steer.endpoint_header",
            &steer.endpoint_header,
        ));
        if problems.is_empty() {
            Ok(Some(steer))
        } else {
            Err(problems.join("; "))
        }
    }

    /// The steering role's fields at `path`, as the guard's configuration
    /// is read.
    fn read(path: &str, value: &Value, problems: &mut Vec<String>) -> Option<Self> {
        let (mut service, mut port) = (None, None);
        let mut steer = Self {
            service: String::new(),
            port: 0,
            endpoint_header: crate::config::default_endpoint_header(),
            hosts: crate::config::default_hosts_per_attempt(),
            reject_header: crate::config::default_reject_header(),
            max_staleness_ms: crate::config::default_max_staleness_ms(),
            while_stale_ms: default_while_stale_ms(),
        };
        read::fields(
            path,
            value,
            "struct SteerConfig",
            STEER_FIELDS,
            problems,
            &mut |key, at, value, p| match key {
                "service" => service = read::string(at, value, p).or(Some(String::new())),
                "port" => port = read::u16(at, value, p).or(Some(0)),
                "endpoint_header" => {
                    read::set(&mut steer.endpoint_header, read::string(at, value, p))
                }
                "hosts" => read::set(&mut steer.hosts, read::u32(at, value, p)),
                "reject_header" => read::set(&mut steer.reject_header, read::string(at, value, p)),
                "max_staleness_ms" => {
                    read::set(&mut steer.max_staleness_ms, read::u64(at, value, p))
                }
                "while_stale_ms" => read::set(&mut steer.while_stale_ms, read::u64(at, value, p)),
                // Not in STEER_FIELDS: named by `read::fields`.
                _ => {}
            },
        )?;
        for (field, given) in [("service", service.is_some()), ("port", port.is_some())] {
            if !given {
                read::missing(path, field, problems);
            }
        }
        steer.service = service?;
        steer.port = port?;
        Some(steer)
    }

    /// The service, as the index keys it.
    pub fn key(&self) -> Option<ServiceKey> {
        let (namespace, name) = self.service.split_once('/')?;
        (!namespace.is_empty() && !name.is_empty() && !name.contains('/'))
            .then(|| ServiceKey::new(namespace, name))
    }

    /// Whether the body path steers now: the guard judged a pick of the
    /// service stale within `while_stale_ms` (or that is 0).
    pub fn during_incident(
        &self,
        store: &dyn SharedData,
        service: &ServiceKey,
        now_ms: u64,
    ) -> bool {
        if self.while_stale_ms == 0 {
            return true;
        }
        match store.get(&stale_seen_key(service)) {
            Ok((Some(value), _)) => <[u8; 8]>::try_from(value.as_slice())
                .map(u64::from_le_bytes)
                .is_ok_and(|seen| now_ms.saturating_sub(seen) <= self.while_stale_ms),
            _ => false,
        }
    }

    /// The endpoint header's value naming up to `hosts` of `members`,
    /// rotated by `seed` so requests spread over all of them; `None` when
    /// there is none to name. The port rule is the replay's
    /// ([`replay::member_port`]).
    pub fn endpoint_value(&self, members: &[Member], seed: u64) -> Option<String> {
        let retry = RetryConfig {
            attempts: 1,
            hosts_per_attempt: self.hosts,
            ..RetryConfig::default()
        };
        // No member holds the unspecified address: none is left out.
        let nobody = SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), self.port);
        let batch = replay::plan(&retry, members, nobody, seed)
            .into_iter()
            .next()?;
        Some(replay::endpoint_value(&batch))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(ip: &str, ports: &[u16]) -> Member {
        Member {
            ip: ip.parse().unwrap(),
            ports: ports.to_vec(),
        }
    }

    #[test]
    fn steering_configurations_are_recognised_and_checked() {
        assert_eq!(
            SteerConfig::parse(br#"{"validator_cluster":"sg"}"#),
            Ok(None)
        );
        assert_eq!(SteerConfig::parse(b"not json"), Ok(None));
        let ok = SteerConfig::parse(br#"{"steer":{"service":"shop/cart","port":8080}}"#)
            .unwrap()
            .unwrap();
        assert_eq!(ok.key(), Some(ServiceKey::new("shop", "cart")));
        assert_eq!(ok.endpoint_header, "x-gateway-destination-endpoint");
        assert_eq!(ok.hosts, 8);
        assert_eq!(ok.reject_header, "x-staleguard");
        let bad = SteerConfig::parse(
            br#"{"steer":{"service":"cart","port":0,"hosts":0,"endpoint_header":"X"}}"#,
        )
        .unwrap_err();
        for problem in [
            "steer.service",
            "steer.port",
            "steer.hosts",
            "steer.endpoint_header",
        ] {
            assert!(bad.contains(problem), "{bad}");
        }
        assert!(bad.contains("steer.hosts 0 not in 1..=64"), "{bad}");
        assert!(SteerConfig::parse(br#"{"steer":{"service":"a/b","port":1,"x":1}}"#).is_err());
    }

    /// What each kind of mistake in the steering role's document is called.
    #[test]
    fn a_steering_configuration_that_does_not_read_says_what_is_wrong() {
        for (doc, says) in [
            (
                r#"{"steer":{"service":"a/b","port":1,"x":1}}"#,
                "unknown field `x`, expected one of `service`, `port`, `endpoint_header`, \
                 `hosts`, `reject_header`, `max_staleness_ms`, `while_stale_ms`",
            ),
            (r#"{"steer":{"service":"a/b"}}"#, "missing field `port`"),
            (
                r#"{"steer":{"service":"a/b","port":65536}}"#,
                "invalid value: integer `65536`, expected u16",
            ),
            (
                r#"{"steer":{"service":"a/b","port":"1"}}"#,
                r#"invalid type: string "1", expected u16"#,
            ),
            (
                r#"{"steer":{"service":"a/b","port":1},"validator_cluster":"x"}"#,
                "unknown field `validator_cluster`, expected `steer`",
            ),
            (
                r#"{"steer":1}"#,
                "invalid type: integer `1`, expected struct SteerConfig",
            ),
            (
                r#"{"steer":{"service":"a/b","port":1,"hosts":-1}}"#,
                "invalid value: integer `-1`, expected u32",
            ),
        ] {
            let refusal = SteerConfig::parse(doc.as_bytes()).unwrap_err();
            assert!(
                refusal.starts_with("plugin configuration of the steering role refused: ")
                    && refusal.contains(says),
                "{doc}: {refusal}"
            );
        }
    }

    #[test]
    fn live_members_are_named_on_the_port_spread_by_the_seed() {
        let steer =
            SteerConfig::parse(br#"{"steer":{"service":"shop/cart","port":8080,"hosts":2}}"#)
                .unwrap()
                .unwrap();
        let members = [
            member("10.0.0.1", &[]),
            member("10.0.0.2", &[]),
            member("10.0.0.3", &[9090]),
        ];
        assert_eq!(
            steer.endpoint_value(&members, 0).as_deref(),
            Some("10.0.0.1:8080,10.0.0.2:8080")
        );
        assert_eq!(
            steer.endpoint_value(&members, 2).as_deref(),
            Some("10.0.0.3:9090,10.0.0.1:8080")
        );
        assert_eq!(steer.endpoint_value(&[], 0), None);
    }
}
