//! The documents the validator serves and the filter reads (wire version 1).
//!
//! # Versioning
//! Every document carries `v`, the wire *major* version. Within a major, fields
//! are only ever added, each optional with a default, and readers ignore fields
//! they do not know; so a filter and a validator of different releases keep
//! working during a rollout. A breaking change bumps `v`; a reader refuses a
//! major it does not speak with [`WireError::Version`] instead of guessing, and a
//! client says which major it speaks with the `v` query parameter.
//!
//! IPs are keyed by their canonical text form (`10.0.0.7`, `fd00::7`), services
//! by `namespace/name` (see [`ServiceKey`]).

use std::net::IpAddr;

use serde::{Deserialize, Serialize};

use crate::service::ServiceKey;

/// The wire major version this crate reads and writes.
pub const WIRE_VERSION: u32 = 1;

/// Why a document could not be read.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// Not JSON, or not the shape of the expected document.
    #[error("malformed {what}: {source}")]
    Malformed {
        /// Which document was expected.
        what: &'static str,
        /// The parser's complaint.
        #[source]
        source: serde_json::Error,
    },
    /// A wire major version this reader does not speak.
    #[error("{what} has wire version {found}, this reader speaks {WIRE_VERSION}")]
    Version {
        /// Which document was read.
        what: &'static str,
        /// The version it carried.
        found: u32,
    },
}

/// How current the validator's view of the cluster is.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Freshness {
    /// Every watch finished its initial list and none is older than the
    /// validator's staleness bound. A filter treats `false` as stale data.
    pub fresh: bool,
    /// Milliseconds since the *least* recently heard-from watch last delivered an
    /// event or bookmark (`None` before any watch has synced). This is the age
    /// of the data: the newest event of the slowest source.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub age_ms: Option<u64>,
}

/// Everything the validator knows about one IP.
///
/// Live holders decide a verdict; the tombstone only says what the IP was. A
/// record with no pods, no bare members and no tombstone is never served: the
/// IP is simply absent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IpRecord {
    /// The IP, in canonical form.
    pub ip: IpAddr,
    /// Pods whose `status.podIPs` hold the IP now, terminating ones included.
    /// Usually one; two while a terminating pod and its successor overlap, and
    /// many for a node IP shared by `hostNetwork` pods.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pods: Vec<PodHolder>,
    /// Services whose EndpointSlices list the IP without a `targetRef` (hand-made
    /// slices, endpoints outside the cluster): members with no pod identity.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub bare_services: Vec<ServiceKey>,
    /// What last held the IP, kept for a while after its last holder went away.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tombstone: Option<Tombstone>,
}

/// A pod that holds an IP.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodHolder {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub name: String,
    /// The pod's uid: a recreated pod with the same name is a different pod.
    /// Empty in the `verdict` view.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub uid: String,
    /// Services the pod is a member of: by an EndpointSlice entry naming its uid,
    /// or by the service's selector matching its labels.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub services: Vec<Membership>,
    /// The pod's `Ready` condition is true.
    #[serde(default, skip_serializing_if = "is_false")]
    pub ready: bool,
    /// The pod has a `deletionTimestamp`: it is draining and will go away.
    #[serde(default, skip_serializing_if = "is_false")]
    pub terminating: bool,
    /// The pod runs in the node's network namespace, so the IP is the node's.
    #[serde(default, skip_serializing_if = "is_false")]
    pub host_network: bool,
}

/// A pod's membership in one service.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Membership {
    /// The service.
    pub service: ServiceKey,
    /// How the membership is known.
    pub via: Via,
    /// Ports of the service's slices that list this pod.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<EndpointPort>,
    /// The slice entry's conditions, when a slice lists the pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conditions: Option<EndpointConditions>,
}

/// How a membership is known.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Via {
    /// An EndpointSlice of the service lists the IP with this pod's uid.
    Slice,
    /// The service's selector matches the pod (its slice may not exist yet).
    Selector,
    /// Both.
    Both,
}

/// A port of an EndpointSlice.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct EndpointPort {
    /// The port's name, as in the Service.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The port number on the pod.
    pub port: u16,
    /// `TCP`, `UDP` or `SCTP`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocol: Option<String>,
}

/// An EndpointSlice entry's conditions (unset ones as the API defines them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointConditions {
    /// `ready`.
    pub ready: bool,
    /// `serving`.
    pub serving: bool,
    /// `terminating`.
    pub terminating: bool,
}

/// What last held an IP that no pod holds now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tombstone {
    /// `namespace/name` of the last pod that held the IP.
    pub pod: String,
    /// That pod's uid. Empty in the `verdict` view.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub uid: String,
    /// The services it was a member of when it went away.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub services: Vec<ServiceKey>,
    /// When the IP lost its last holder, in milliseconds since the Unix epoch.
    pub since_ms: u64,
}

/// The whole index at one generation: `GET /v1/snapshot`.
///
/// `R` is what a reader keeps of each record: the record itself by default, or
/// a smaller type built from it (`#[serde(from = "IpRecord")]`), so that a
/// large snapshot never holds every record whole at once, only one at a time
/// while it is read ([`Snapshot::decode_from`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Snapshot<R = IpRecord> {
    /// Wire major version ([`WIRE_VERSION`]).
    pub v: u32,
    /// Random per validator process start: generations of different epochs are
    /// not comparable.
    pub epoch: u64,
    /// The index generation this snapshot shows.
    pub generation: u64,
    /// How current the data is.
    pub freshness: Freshness,
    /// Every service the validator watches. A service not listed is *unknown*.
    pub services: Vec<ServiceKey>,
    /// Every IP the validator knows.
    pub records: Vec<R>,
}

/// An answer to `GET /v1/changes`: a delta, or a full reset.
///
/// On the wire the variant's fields sit next to a `kind` tag. Reading is not
/// serde's internally tagged derive, which buffers the whole document into an
/// intermediate tree before it can look at the tag (for a 150k-IP reset, a
/// second copy of the index in the filter's VM): [`Changes`] reads every field
/// of either variant straight into its typed value, in any order, and picks the
/// variant by `kind` at the end.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Changes<R = IpRecord> {
    /// What changed after the generation the client asked from.
    Delta(Delta<R>),
    /// The client's epoch is wrong or its generation was compacted away: start
    /// over from this snapshot (its records kept as `R`, see [`Snapshot`]).
    Reset(Snapshot<R>),
}

/// The `kind` tag of a [`Changes`] document.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "snake_case")]
enum ChangesKind {
    Delta,
    Reset,
}

/// Every field either variant of [`Changes`] may carry, each read directly into
/// its type (no intermediate tree); unknown fields are skipped.
#[derive(Deserialize)]
struct ChangesFields<R> {
    kind: ChangesKind,
    v: u32,
    epoch: u64,
    generation: u64,
    freshness: Freshness,
    // Delta.
    #[serde(default)]
    since: Option<u64>,
    #[serde(default)]
    services_added: Vec<ServiceKey>,
    #[serde(default)]
    services_removed: Vec<ServiceKey>,
    #[serde(default = "Vec::new")]
    upserts: Vec<R>,
    #[serde(default)]
    removed: Vec<IpAddr>,
    // Reset.
    #[serde(default)]
    services: Option<Vec<ServiceKey>>,
    #[serde(default = "Option::default")]
    records: Option<Vec<R>>,
}

impl<'de, R: Deserialize<'de>> Deserialize<'de> for Changes<R> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        let ChangesFields {
            kind,
            v,
            epoch,
            generation,
            freshness,
            since,
            services_added,
            services_removed,
            upserts,
            removed,
            services,
            records,
        } = ChangesFields::<R>::deserialize(deserializer)?;
        Ok(match kind {
            ChangesKind::Delta => Changes::Delta(Delta {
                v,
                epoch,
                since: since.ok_or_else(|| D::Error::missing_field("since"))?,
                generation,
                freshness,
                services_added,
                services_removed,
                upserts,
                removed,
            }),
            ChangesKind::Reset => Changes::Reset(Snapshot {
                v,
                epoch,
                generation,
                freshness,
                services: services.ok_or_else(|| D::Error::missing_field("services"))?,
                records: records.ok_or_else(|| D::Error::missing_field("records"))?,
            }),
        })
    }
}

/// Changes between two generations, compacted to the latest state of each IP
/// and service; `R` as in [`Snapshot`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Delta<R = IpRecord> {
    /// Wire major version ([`WIRE_VERSION`]).
    pub v: u32,
    /// The validator's epoch.
    pub epoch: u64,
    /// The generation the client had (exclusive lower bound).
    pub since: u64,
    /// The generation after applying this delta. Equal to `since` for an empty
    /// answer to a long poll that timed out.
    pub generation: u64,
    /// How current the data is.
    pub freshness: Freshness,
    /// Services that appeared.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub services_added: Vec<ServiceKey>,
    /// Services that went away.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub services_removed: Vec<ServiceKey>,
    /// IPs whose record changed: replace the old record whole.
    #[serde(default = "Vec::new", skip_serializing_if = "Vec::is_empty")]
    pub upserts: Vec<R>,
    /// IPs the validator no longer knows at all.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub removed: Vec<IpAddr>,
}

impl<R> Delta<R> {
    /// True when the delta changes nothing.
    pub fn is_empty(&self) -> bool {
        self.services_added.is_empty()
            && self.services_removed.is_empty()
            && self.upserts.is_empty()
            && self.removed.is_empty()
    }
}

impl Snapshot {
    /// Reads a snapshot, refusing other wire versions.
    pub fn from_json(bytes: &[u8]) -> Result<Self, WireError> {
        let snapshot: Self = parse("snapshot", bytes)?;
        check_version("snapshot", snapshot.v)?;
        Ok(snapshot)
    }

    /// Like [`Snapshot::from_json`], reading the document from `reader` as it
    /// goes: a reader that holds a large answer elsewhere (a proxy-wasm
    /// filter reading its call's body in chunks from the host) needs no copy
    /// of the whole document beside the decoded value.
    pub fn from_reader(reader: impl std::io::Read) -> Result<Self, WireError> {
        Self::decode_from(reader)
    }
}

impl<R: serde::de::DeserializeOwned> Snapshot<R> {
    /// Like [`Snapshot::from_reader`], keeping each record as `R`: every
    /// record is read whole, turned into an `R` and dropped before the next.
    pub fn decode_from(reader: impl std::io::Read) -> Result<Self, WireError> {
        let snapshot: Self = parse_reader("snapshot", reader)?;
        check_version("snapshot", snapshot.v)?;
        Ok(snapshot)
    }
}

impl Changes {
    /// Reads a changes answer, refusing other wire versions.
    pub fn from_json(bytes: &[u8]) -> Result<Self, WireError> {
        let changes: Self = parse("changes", bytes)?;
        changes.checked()
    }

    /// Like [`Changes::from_json`], reading from `reader` as it goes (see
    /// [`Snapshot::from_reader`]).
    pub fn from_reader(reader: impl std::io::Read) -> Result<Self, WireError> {
        Self::decode_from(reader)
    }
}

impl<R: serde::de::DeserializeOwned> Changes<R> {
    /// Like [`Changes::from_reader`], keeping a reset's records as `R` (see
    /// [`Snapshot::decode_from`]).
    pub fn decode_from(reader: impl std::io::Read) -> Result<Self, WireError> {
        let changes: Self = parse_reader("changes", reader)?;
        changes.checked()
    }

    fn checked(self) -> Result<Self, WireError> {
        let v = match &self {
            Changes::Delta(d) => d.v,
            Changes::Reset(s) => s.v,
        };
        check_version("changes", v)?;
        Ok(self)
    }
}

impl IpRecord {
    /// A record with no holders, members or history: the IP is unknown.
    pub fn is_vacant(&self) -> bool {
        self.pods.is_empty() && self.bare_services.is_empty() && self.tombstone.is_none()
    }
}

impl IpRecord {
    /// Keeps only what [`crate::decide`] and an operator's log line need: pod
    /// names, memberships (service and `via`), and the `ready`, `terminating`
    /// and `host_network` flags. Drops uids, ports and slice conditions: a full
    /// snapshot of 150k IPs shrinks to under half its size, which keeps it below
    /// Envoy's 32 MiB limit for a callout answer and halves what a gateway
    /// decodes. This is `view=verdict` on the API.
    pub fn verdict_view(mut self) -> Self {
        for pod in &mut self.pods {
            pod.uid.clear();
            for membership in &mut pod.services {
                membership.ports.clear();
                membership.conditions = None;
            }
        }
        if let Some(tombstone) = &mut self.tombstone {
            tombstone.uid.clear();
        }
        self
    }
}

impl IpRecord {
    /// The record of `ip` held by `pods`, with no bare members or tombstone.
    pub fn held_by(ip: IpAddr, pods: Vec<PodHolder>) -> Self {
        Self {
            ip,
            pods,
            bare_services: Vec::new(),
            tombstone: None,
        }
    }
}

impl PodHolder {
    /// A ready, running pod (off the host network) that is a member of
    /// `service` by slice and selector, with no ports or conditions listed:
    /// the common holder of benchmarks and tests.
    pub fn ready_member(
        namespace: impl Into<String>,
        name: impl Into<String>,
        uid: impl Into<String>,
        service: ServiceKey,
    ) -> Self {
        Self {
            namespace: namespace.into(),
            name: name.into(),
            uid: uid.into(),
            services: vec![Membership {
                service,
                via: Via::Both,
                ports: Vec::new(),
                conditions: None,
            }],
            ready: true,
            terminating: false,
            host_network: false,
        }
    }

    /// True when the pod is a member of `service` by any path.
    pub fn is_member_of(&self, service: &ServiceKey) -> bool {
        self.services.iter().any(|m| &m.service == service)
    }
}

fn parse<'a, T: Deserialize<'a>>(what: &'static str, bytes: &'a [u8]) -> Result<T, WireError> {
    serde_json::from_slice(bytes).map_err(|source| WireError::Malformed { what, source })
}

fn parse_reader<T: serde::de::DeserializeOwned>(
    what: &'static str,
    reader: impl std::io::Read,
) -> Result<T, WireError> {
    serde_json::from_reader(reader).map_err(|source| WireError::Malformed { what, source })
}

fn check_version(what: &'static str, found: u32) -> Result<(), WireError> {
    if found == WIRE_VERSION {
        Ok(())
    } else {
        Err(WireError::Version { what, found })
    }
}

fn is_false(b: &bool) -> bool {
    !*b
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> IpRecord {
        IpRecord {
            ip: "10.0.0.7".parse().unwrap(),
            pods: vec![PodHolder {
                namespace: "shop".into(),
                name: "cart-7d9f".into(),
                uid: "u-1".into(),
                services: vec![Membership {
                    service: ServiceKey::new("shop", "cart"),
                    via: Via::Both,
                    ports: vec![EndpointPort {
                        name: Some("http".into()),
                        port: 8080,
                        protocol: Some("TCP".into()),
                    }],
                    conditions: Some(EndpointConditions {
                        ready: true,
                        serving: true,
                        terminating: false,
                    }),
                }],
                ready: true,
                terminating: false,
                host_network: false,
            }],
            bare_services: vec![],
            tombstone: None,
        }
    }

    #[test]
    fn the_verdict_view_keeps_what_decide_needs() {
        let full = record();
        let slim = full.clone().verdict_view();
        let service = ServiceKey::new("shop", "cart");
        let strict = crate::Policy {
            terminating: crate::Action::Reject,
            unknown_service: crate::Action::Reject,
            failure_policy: crate::verdict::FailurePolicy::Closed,
        };
        for policy in [crate::Policy::default(), strict] {
            assert_eq!(
                crate::decide(&policy, true, &service, true, Some(&full)),
                crate::decide(&policy, true, &service, true, Some(&slim))
            );
        }
        assert_eq!(slim.pods[0].name, "cart-7d9f");
        assert!(slim.pods[0].uid.is_empty());
        assert!(slim.pods[0].services[0].ports.is_empty());
        let (full_len, slim_len) = (
            serde_json::to_vec(&full).unwrap().len(),
            serde_json::to_vec(&slim).unwrap().len(),
        );
        assert!(slim_len * 2 < full_len, "{slim_len} vs {full_len}");
    }

    #[test]
    fn snapshot_round_trips() {
        let snapshot = Snapshot {
            v: WIRE_VERSION,
            epoch: u64::MAX,
            generation: 42,
            freshness: Freshness {
                fresh: true,
                age_ms: Some(120),
            },
            services: vec![ServiceKey::new("shop", "cart")],
            records: vec![record()],
        };
        let json = serde_json::to_vec(&snapshot).unwrap();
        assert_eq!(Snapshot::from_json(&json).unwrap(), snapshot);
    }

    #[test]
    fn changes_are_tagged_by_kind() {
        let delta = Changes::Delta(Delta {
            v: 1,
            epoch: 7,
            since: 3,
            generation: 5,
            freshness: Freshness::default(),
            services_added: vec![],
            services_removed: vec![],
            upserts: vec![record()],
            removed: vec!["fd00::1".parse().unwrap()],
        });
        let json = serde_json::to_string(&delta).unwrap();
        assert!(json.starts_with(r#"{"kind":"delta""#), "{json}");
        assert_eq!(Changes::from_json(json.as_bytes()).unwrap(), delta);
    }

    #[test]
    fn a_reset_reads_in_any_field_order_and_needs_its_fields() {
        let reset = Changes::Reset(Snapshot {
            v: WIRE_VERSION,
            epoch: 3,
            generation: 9,
            freshness: Freshness::default(),
            services: vec![ServiceKey::new("shop", "cart")],
            records: vec![record()],
        });
        let json = serde_json::to_string(&reset).unwrap();
        assert!(json.starts_with(r#"{"kind":"reset""#), "{json}");
        assert_eq!(Changes::from_json(json.as_bytes()).unwrap(), reset);
        // The tag last, as another encoder may write it.
        let rest = json.replacen(r#""kind":"reset","#, "", 1);
        let reordered = format!(r#"{},"kind":"reset"}}"#, &rest[..rest.len() - 1]);
        assert!(reordered.ends_with(r#""kind":"reset"}"#), "{reordered}");
        assert_eq!(Changes::from_json(reordered.as_bytes()).unwrap(), reset);
        // A reset without records, a delta without `since`: refused, named.
        let no_records = br#"{"kind":"reset","v":1,"epoch":1,"generation":1,"freshness":{"fresh":true},"services":[]}"#;
        let err = Changes::from_json(no_records).unwrap_err().to_string();
        assert!(err.contains("missing field `records`"), "{err}");
        let no_since =
            br#"{"kind":"delta","v":1,"epoch":1,"generation":1,"freshness":{"fresh":true}}"#;
        let err = Changes::from_json(no_since).unwrap_err().to_string();
        assert!(err.contains("missing field `since`"), "{err}");
    }

    #[test]
    fn a_reset_is_read_without_an_intermediate_tree() {
        // serde's internally tagged derive buffers the whole document into a
        // tree before it looks at the tag, so a bad field is only found once
        // every record has been read, and its error has no position. Read
        // straight into typed fields, the reader stops at the bad field.
        let records = vec![r#"{"ip":"10.0.0.1"}"#; 1_000].join(",");
        let json = format!(
            r#"{{"kind":"reset","v":1,"epoch":"x","generation":1,"freshness":{{"fresh":true}},"services":[],"records":[{records}]}}"#
        );
        let Err(WireError::Malformed { source, .. }) = Changes::from_json(json.as_bytes()) else {
            panic!("a string epoch must be refused");
        };
        // Buffered, the error has no position at all (line 0, column 0).
        assert_eq!(source.line(), 1, "{source}");
        assert!(
            (1..40).contains(&source.column()),
            "read past the bad field: {source}"
        );
    }

    #[test]
    fn unknown_fields_are_ignored_and_defaults_fill_gaps() {
        let json = br#"{"kind":"delta","v":1,"epoch":1,"since":0,"generation":1,
            "freshness":{"fresh":true,"future":"field"},"also_new":[1,2],
            "upserts":[{"ip":"10.1.2.3","pods":[{"namespace":"a","name":"b","extra":true}]}]}"#;
        let Changes::Delta(delta) = Changes::from_json(json).unwrap() else {
            panic!("expected a delta");
        };
        assert_eq!(delta.upserts[0].pods[0].uid, "");
        assert!(delta.removed.is_empty());
    }

    #[test]
    fn other_versions_and_garbage_are_refused_with_a_reason() {
        let v2 = br#"{"kind":"delta","v":2,"epoch":1,"since":0,"generation":1,"freshness":{"fresh":true}}"#;
        assert!(matches!(
            Changes::from_json(v2),
            Err(WireError::Version { found: 2, .. })
        ));
        for garbage in [&b""[..], b"{", b"[]", b"{\"kind\":\"nope\"}", b"\xff\xfe"] {
            let err = Changes::from_json(garbage).unwrap_err();
            assert!(err.to_string().starts_with("malformed changes"), "{err}");
        }
        let bad_ip = br#"{"v":1,"epoch":1,"generation":1,"freshness":{"fresh":true},"services":[],"records":[{"ip":"10.0.0.256"}]}"#;
        assert!(Snapshot::from_json(bad_ip).is_err());
    }
}
