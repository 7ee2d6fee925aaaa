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
//!
//! Epochs and generations: JSON readers that hold numbers as doubles (jq 1.6,
//! JavaScript) round integers above 2^53, so a client of a 0.1 validator
//! (whose epoch was any u64) never matched its epoch and always got a reset.
//! The validator now draws epochs below 2^53 ([`MAX_EPOCH`]), exact in every
//! reader, and readers take an epoch or generation as a number or as a
//! decimal string ([`counter`]): the form writers move to once every
//! supported reader reads it (a 0.1 gateway reads numbers only, and the
//! validator is upgraded first, so this release still writes numbers).

use std::net::IpAddr;

use serde::{Deserialize, Serialize};

use crate::service::ServiceKey;

/// The wire major version this crate reads and writes.
pub const WIRE_VERSION: u32 = 1;

/// Epochs are drawn below this (2^53): a JSON number any reader holds
/// exactly, doubles included.
pub const MAX_EPOCH: u64 = 1 << 53;

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
    #[serde(with = "counter")]
    pub epoch: u64,
    /// The index generation this snapshot shows.
    #[serde(with = "counter")]
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
    #[serde(with = "counter")]
    epoch: u64,
    #[serde(with = "counter")]
    generation: u64,
    freshness: Freshness,
    // Delta.
    #[serde(default, with = "counter::optional")]
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
    #[serde(with = "counter")]
    pub epoch: u64,
    /// The generation the client had (exclusive lower bound).
    #[serde(with = "counter")]
    pub since: u64,
    /// The generation after applying this delta. Equal to `since` for an empty
    /// answer to a long poll that timed out.
    #[serde(with = "counter")]
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

/// Epochs and generations on the wire (`#[serde(with = "counter")]`): read
/// from a JSON number or a decimal string, written as a number (see the
/// module's documentation for when that changes).
pub mod counter {
    use std::fmt;

    use serde::de::{self, Visitor};
    use serde::{Deserializer, Serializer};

    /// Writes `value` as a number.
    pub fn serialize<S: Serializer>(value: &u64, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_u64(*value)
    }

    /// Reads a decimal string or a non-negative integer.
    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u64, D::Error> {
        deserializer.deserialize_any(Counter)
    }

    struct Counter;

    impl Visitor<'_> for Counter {
        type Value = u64;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("an unsigned 64-bit integer as a decimal string (or a number)")
        }

        fn visit_u64<E: de::Error>(self, v: u64) -> Result<u64, E> {
            Ok(v)
        }

        fn visit_i64<E: de::Error>(self, v: i64) -> Result<u64, E> {
            u64::try_from(v).map_err(|_| E::invalid_value(de::Unexpected::Signed(v), &self))
        }

        fn visit_str<E: de::Error>(self, v: &str) -> Result<u64, E> {
            // Digits only: no sign, no spaces, no exponent.
            if v.is_empty() || !v.bytes().all(|b| b.is_ascii_digit()) {
                return Err(E::invalid_value(de::Unexpected::Str(v), &self));
            }
            v.parse()
                .map_err(|_| E::invalid_value(de::Unexpected::Str(v), &self))
        }
    }

    /// [`counter`](self) for an optional field.
    pub mod optional {
        use serde::{Deserialize, Deserializer, Serializer};

        /// Writes `Some` as a number, `None` as null.
        pub fn serialize<S: Serializer>(
            value: &Option<u64>,
            serializer: S,
        ) -> Result<S::Ok, S::Error> {
            match value {
                Some(v) => super::serialize(v, serializer),
                None => serializer.serialize_none(),
            }
        }

        /// Reads null, a decimal string or a non-negative integer.
        pub fn deserialize<'de, D: Deserializer<'de>>(
            deserializer: D,
        ) -> Result<Option<u64>, D::Error> {
            #[derive(Deserialize)]
            struct Wrapped(#[serde(with = "super")] u64);
            Ok(Option::<Wrapped>::deserialize(deserializer)?.map(|Wrapped(v)| v))
        }
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
mod tests;
