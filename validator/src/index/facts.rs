//! Turns Kubernetes objects into the compact facts the index keeps.
//!
//! The index never stores a whole `Pod` or `EndpointSlice`: at 150k pods that
//! would cost gigabytes. Each object is reduced here to what the rules need, with
//! repeated strings (namespaces, label keys and values, service names) shared
//! through an [`Interner`]. Anything malformed is reported as a [`Skip`] with a
//! stable reason code, never a panic.

use std::collections::{BTreeMap, HashSet};
use std::hash::{BuildHasher, Hash, Hasher};
use std::net::IpAddr;
use std::sync::Arc;

use ahash::RandomState;
use hashbrown::HashTable;
use smallvec::SmallVec;

use k8s_openapi::api::core::v1::{Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::ResourceExt;
use staleguard_core::wire::{EndpointConditions, EndpointPort};
use staleguard_core::ServiceKey;

/// The label that ties an EndpointSlice to its Service.
pub(crate) const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// A resource kind the index is fed with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    /// `v1/Pod`.
    Pod,
    /// `v1/Service`.
    Service,
    /// `discovery.k8s.io/v1/EndpointSlice`.
    EndpointSlice,
}

impl Kind {
    /// Every kind, in a fixed order.
    pub const ALL: [Kind; 3] = [Kind::Pod, Kind::Service, Kind::EndpointSlice];

    /// `pod`, `service` or `endpointslice`: stable, used as a metric label.
    pub const fn as_str(self) -> &'static str {
        match self {
            Kind::Pod => "pod",
            Kind::Service => "service",
            Kind::EndpointSlice => "endpointslice",
        }
    }

    pub(crate) const fn slot(self) -> usize {
        match self {
            Kind::Pod => 0,
            Kind::Service => 1,
            Kind::EndpointSlice => 2,
        }
    }
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why (part of) an object was not indexed. The codes are stable and few, so
/// they can label a metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Skip {
    /// No `metadata.name` or `metadata.namespace`: the object cannot be keyed.
    MissingName,
    /// An address that does not parse as an IP (the rest of the object is kept).
    InvalidIp,
    /// An EndpointSlice whose `addressType` is not `IPv4` or `IPv6` (`FQDN`,
    /// or garbage): its entries are ignored.
    UnknownAddressType,
    /// An EndpointSlice without endpoints (kept: it lists nobody).
    EmptySlice,
    /// An EndpointSlice without the `kubernetes.io/service-name` label.
    NoServiceLabel,
    /// A slice port outside 1..=65535 (the port is dropped).
    InvalidPort,
}

impl Skip {
    /// The stable code.
    pub const fn as_str(self) -> &'static str {
        match self {
            Skip::MissingName => "missing_name",
            Skip::InvalidIp => "invalid_ip",
            Skip::UnknownAddressType => "unknown_address_type",
            Skip::EmptySlice => "empty_slice",
            Skip::NoServiceLabel => "no_service_label",
            Skip::InvalidPort => "invalid_port",
        }
    }
}

impl std::fmt::Display for Skip {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Shares repeated strings, and whole label sets: the pods of one ReplicaSet
/// carry identical labels, so they share one [`Labels`]. Entries nobody else
/// holds are dropped when a set has doubled since its last sweep, so churning
/// values (pod-template hashes of old ReplicaSets) do not accumulate.
#[derive(Debug, Default)]
pub(crate) struct Interner {
    strings: HashSet<Arc<str>, RandomState>,
    strings_swept: usize,
    label_sets: HashTable<Labels>,
    label_sets_swept: usize,
    hasher: RandomState,
}

impl Interner {
    pub(crate) fn get(&mut self, s: &str) -> Arc<str> {
        if let Some(found) = self.strings.get(s) {
            return found.clone();
        }
        if self.strings.len() >= 1024 && self.strings.len() >= 2 * self.strings_swept {
            self.strings.retain(|a| Arc::strong_count(a) > 1);
            self.strings_swept = self.strings.len();
        }
        let arc: Arc<str> = Arc::from(s);
        self.strings.insert(arc.clone());
        arc
    }

    /// The shared label set equal to `labels`. A hit (the common case: a pod
    /// update that did not touch its labels) hashes the strings once and
    /// allocates nothing.
    pub(crate) fn labels(&mut self, labels: &BTreeMap<String, String>) -> Labels {
        let hash = hash_pairs(&self.hasher, labels.iter().map(|(k, v)| (&**k, &**v)));
        if let Some(found) = self.label_sets.find(hash, |set| same_labels(set, labels)) {
            return found.clone();
        }
        if self.label_sets.len() >= 1024 && self.label_sets.len() >= 2 * self.label_sets_swept {
            self.label_sets.retain(|set| Arc::strong_count(set) > 1);
            self.label_sets_swept = self.label_sets.len();
        }
        let set: Labels = labels
            .iter()
            .map(|(k, v)| (self.get(k), self.get(v)))
            .collect();
        let hasher = &self.hasher;
        self.label_sets.insert_unique(hash, set.clone(), |s| {
            hash_pairs(hasher, s.iter().map(|(k, v)| (&**k, &**v)))
        });
        set
    }

    #[cfg(test)]
    pub(crate) fn label_sets(&self) -> usize {
        self.label_sets.len()
    }
}

/// True when `set` holds exactly `labels`.
pub(crate) fn same_labels(set: &Labels, labels: &BTreeMap<String, String>) -> bool {
    set.len() == labels.len()
        && set
            .iter()
            .zip(labels)
            .all(|((a, b), (k, v))| **a == **k && **b == **v)
}

fn hash_pairs<'a>(
    hasher: &RandomState,
    pairs: impl ExactSizeIterator<Item = (&'a str, &'a str)>,
) -> u64 {
    let mut h = hasher.build_hasher();
    pairs.len().hash(&mut h);
    for pair in pairs {
        pair.hash(&mut h);
    }
    h.finish()
}

/// A Kubernetes uid. The API server makes them lowercase UUIDs, kept as 128
/// bits (no allocation); anything else is kept as text.
///
/// The number is two `u64` halves rather than a `u128`, whose 16-byte
/// alignment would pad every struct holding a uid.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Uid {
    Uuid(u64, u64),
    Other(Arc<str>),
}

impl Uid {
    pub(crate) fn parse(s: &str) -> Self {
        match Self::parse_uuid(s) {
            Some(v) => Uid::Uuid((v >> 64) as u64, v as u64),
            None => Uid::Other(Arc::from(s)),
        }
    }

    /// Only the canonical form (36 characters, lowercase hex, hyphens at
    /// 8-13-18-23), so that printing it gives back the same text.
    fn parse_uuid(s: &str) -> Option<u128> {
        let b = s.as_bytes();
        if b.len() != 36 {
            return None;
        }
        let mut value = 0u128;
        for (i, c) in b.iter().enumerate() {
            if matches!(i, 8 | 13 | 18 | 23) {
                if *c != b'-' {
                    return None;
                }
                continue;
            }
            let digit = match c {
                b'0'..=b'9' => c - b'0',
                b'a'..=b'f' => c - b'a' + 10,
                _ => return None,
            };
            value = (value << 4) | u128::from(digit);
        }
        Some(value)
    }
}

impl std::fmt::Display for Uid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Uid::Other(s) => f.write_str(s),
            Uid::Uuid(hi, lo) => {
                let hex = format!("{hi:016x}{lo:016x}");
                write!(
                    f,
                    "{}-{}-{}-{}-{}",
                    &hex[..8],
                    &hex[8..12],
                    &hex[12..16],
                    &hex[16..20],
                    &hex[20..]
                )
            }
        }
    }
}

/// Sorted `(key, value)` pairs, shared by every object with the same labels.
pub(crate) type Labels = Arc<[(Arc<str>, Arc<str>)]>;

/// A pod's IPs: one, or two when dual-stack (which spills to the heap).
pub(crate) type Ips = SmallVec<[IpAddr; 1]>;

/// A namespaced object's name.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct ObjName {
    pub(crate) namespace: Arc<str>,
    pub(crate) name: Box<str>,
}

impl ObjName {
    /// Hashes a name given as borrowed parts exactly as the `ObjName` with
    /// those parts hashes, so a table can be searched without allocating one.
    pub(crate) fn hash_parts<H: Hasher>(namespace: &str, name: &str, h: &mut H) {
        namespace.hash(h);
        name.hash(h);
    }
}

impl Hash for ObjName {
    fn hash<H: Hasher>(&self, h: &mut H) {
        Self::hash_parts(&self.namespace, &self.name, h);
    }
}

impl std::fmt::Display for ObjName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// What the index keeps of a Pod, but its name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PodFacts {
    pub(crate) uid: Uid,
    pub(crate) labels: Labels,
    /// The IPs the pod holds: empty for a pod without an IP yet, and for a
    /// `Succeeded`/`Failed` pod, whose IP the node has released.
    pub(crate) ips: Ips,
    /// No IP yet, and neither finished nor terminating: a slice entry that
    /// names this pod is trusted to say which IP it got (see the index).
    pub(crate) awaiting_ip: bool,
    pub(crate) ready: bool,
    pub(crate) terminating: bool,
    pub(crate) host_network: bool,
}

/// What the index keeps of a Service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ServiceFacts {
    pub(crate) key: Arc<ServiceKey>,
    /// `None` for a service without a selector (its endpoints are hand-made).
    pub(crate) selector: Option<Labels>,
}

/// Who an EndpointSlice entry says holds its addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Target {
    /// No `targetRef`, or one that is not a Pod: a member without pod identity.
    Bare,
    /// A Pod, by uid.
    Uid(Uid),
    /// A Pod reference without a uid, by name.
    Name(Box<ObjName>),
    /// A Pod reference with neither uid nor name: it names nobody.
    Nobody,
}

impl Target {
    /// True when the entry names the pod `name` with `uid`.
    pub(crate) fn is(&self, name: &ObjName, uid: &Uid) -> bool {
        match self {
            Target::Uid(u) => u == uid,
            Target::Name(n) => **n == *name,
            Target::Bare | Target::Nobody => false,
        }
    }
}

/// One address of one endpoint of a slice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EntryFacts {
    pub(crate) ip: IpAddr,
    pub(crate) target: Target,
    pub(crate) conditions: EndpointConditions,
}

/// What the index keeps of an EndpointSlice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SliceFacts {
    pub(crate) name: ObjName,
    pub(crate) service: Arc<ServiceKey>,
    pub(crate) ports: Arc<[EndpointPort]>,
    /// One per address, sorted by IP; entries of one IP stay in slice order.
    pub(crate) entries: Vec<EntryFacts>,
}

/// The namespace and name of any object, borrowed.
pub(crate) fn name_parts<K: ResourceExt>(obj: &K) -> Option<(&str, &str)> {
    let meta = obj.meta();
    let name = meta.name.as_deref().filter(|n| !n.is_empty())?;
    let namespace = meta.namespace.as_deref().filter(|n| !n.is_empty())?;
    Some((namespace, name))
}

/// The namespace and name of any object.
pub(crate) fn obj_name<K: ResourceExt>(obj: &K, interner: &mut Interner) -> Option<ObjName> {
    let (namespace, name) = name_parts(obj)?;
    Some(ObjName {
        namespace: interner.get(namespace),
        name: name.into(),
    })
}

/// Records that an object, or a part of it, was skipped, and names it in a
/// debug line (`RUST_LOG=staleguard_validator::index=debug`): the counter
/// `staleguard_validator_objects_skipped_total` has only the kind and reason.
pub(crate) fn skip<K>(skips: &mut Vec<Skip>, skip: Skip, object: &K, detail: &str)
where
    K: kube::Resource<DynamicType = ()>,
{
    let meta = object.meta();
    tracing::debug!(
        kind = %K::kind(&()),
        namespace = meta.namespace.as_deref().unwrap_or(""),
        name = meta.name.as_deref().unwrap_or(""),
        reason = skip.as_str(),
        detail,
        "skipped (part of) an object"
    );
    skips.push(skip);
}

/// Reduces a Pod (its name is the caller's business); `skips` collects what
/// was wrong with it. `labels_before` are the pod's labels as the index knows
/// them: when unchanged (most updates are status changes) they are reused
/// without a lookup.
pub(crate) fn pod_facts(
    pod: &Pod,
    interner: &mut Interner,
    skips: &mut Vec<Skip>,
    labels_before: Option<&Labels>,
) -> PodFacts {
    let meta = &pod.metadata;
    let uid = Uid::parse(meta.uid.as_deref().unwrap_or(""));
    let empty = BTreeMap::new();
    let map = meta.labels.as_ref().unwrap_or(&empty);
    let labels = match labels_before {
        Some(before) if same_labels(before, map) => before.clone(),
        _ => interner.labels(map),
    };
    let status = pod.status.as_ref();
    let phase = status.and_then(|s| s.phase.as_deref());
    let released = matches!(phase, Some("Succeeded" | "Failed"));
    let mut ips = Ips::new();
    if !released {
        let listed = status
            .and_then(|s| s.pod_ips.as_ref())
            .filter(|l| !l.is_empty());
        let texts: Vec<&str> = match listed {
            Some(list) => list.iter().map(|p| p.ip.as_str()).collect(),
            None => status
                .and_then(|s| s.pod_ip.as_deref())
                .into_iter()
                .collect(),
        };
        for text in texts {
            match text.trim().parse::<IpAddr>().map(canonical) {
                Ok(ip) if !ips.contains(&ip) => ips.push(ip),
                Ok(_) => {}
                Err(_) => skip(skips, Skip::InvalidIp, pod, text),
            }
        }
    }
    ips.sort_unstable();
    ips.dedup();
    let ready = status
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
    let terminating = meta.deletion_timestamp.is_some();
    PodFacts {
        uid,
        labels,
        awaiting_ip: ips.is_empty() && !released && !terminating,
        ips,
        ready,
        terminating,
        host_network: pod
            .spec
            .as_ref()
            .and_then(|s| s.host_network)
            .unwrap_or(false),
    }
}

/// Reduces a Service.
pub(crate) fn service_facts(
    service: &Service,
    interner: &mut Interner,
    skips: &mut Vec<Skip>,
) -> Option<ServiceFacts> {
    let Some(name) = obj_name(service, interner) else {
        skip(skips, Skip::MissingName, service, "");
        return None;
    };
    // An empty selector selects nothing, as the endpoints controller reads it.
    let selector = service
        .spec
        .as_ref()
        .and_then(|s| s.selector.as_ref())
        .filter(|s| !s.is_empty())
        .map(|s| interner.labels(s));
    Some(ServiceFacts {
        key: Arc::new(ServiceKey::new(&*name.namespace, &*name.name)),
        selector,
    })
}

/// Reduces an EndpointSlice. A slice with an unknown address type is kept with
/// no entries, so that it replaces whatever an earlier version listed.
pub(crate) fn slice_facts(
    slice: &EndpointSlice,
    interner: &mut Interner,
    skips: &mut Vec<Skip>,
) -> Option<SliceFacts> {
    let Some(name) = obj_name(slice, interner) else {
        skip(skips, Skip::MissingName, slice, "");
        return None;
    };
    let Some(service_name) = slice
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(SERVICE_NAME_LABEL))
        .filter(|n| !n.is_empty())
    else {
        skip(skips, Skip::NoServiceLabel, slice, SERVICE_NAME_LABEL);
        return None;
    };
    let service = Arc::new(ServiceKey::new(&*name.namespace, service_name.as_str()));
    let want_v4 = match slice.address_type.as_str() {
        "IPv4" => true,
        "IPv6" => false,
        _ => {
            skip(skips, Skip::UnknownAddressType, slice, &slice.address_type);
            return Some(SliceFacts {
                name,
                service,
                ports: Arc::from(Vec::new()),
                entries: Vec::new(),
            });
        }
    };
    if slice.endpoints.is_empty() {
        skip(skips, Skip::EmptySlice, slice, "");
    }
    let mut ports: Vec<EndpointPort> = Vec::new();
    for port in slice.ports.iter().flatten() {
        // A port without a number means "all ports" in the API; there is nothing
        // to list for it.
        let Some(number) = port.port else { continue };
        match u16::try_from(number) {
            Ok(n) if n > 0 => ports.push(EndpointPort {
                name: port.name.clone().filter(|n| !n.is_empty()),
                port: n,
                protocol: port.protocol.clone(),
            }),
            _ => skip(skips, Skip::InvalidPort, slice, &number.to_string()),
        }
    }
    ports.sort();
    ports.dedup();
    let mut entries = Vec::with_capacity(slice.endpoints.len());
    for endpoint in &slice.endpoints {
        let first = entries.len();
        let target = match &endpoint.target_ref {
            Some(r) if r.kind.as_deref().is_none_or(|k| k == "Pod") => {
                match r.uid.as_deref().filter(|u| !u.is_empty()) {
                    Some(uid) => Target::Uid(Uid::parse(uid)),
                    // The name only matters when there is no uid to match by.
                    None => match r.name.as_deref().filter(|n| !n.is_empty()) {
                        Some(n) => {
                            let namespace = r
                                .namespace
                                .as_deref()
                                .filter(|n| !n.is_empty())
                                .map(|n| interner.get(n))
                                .unwrap_or_else(|| name.namespace.clone());
                            Target::Name(Box::new(ObjName {
                                namespace,
                                name: n.into(),
                            }))
                        }
                        None => Target::Nobody,
                    },
                }
            }
            _ => Target::Bare,
        };
        let c = endpoint.conditions.as_ref();
        // Unset conditions as the API defines them: ready unknown = ready,
        // serving unset = ready, terminating unset = false.
        let ready = c.and_then(|c| c.ready).unwrap_or(true);
        let conditions = EndpointConditions {
            ready,
            serving: c.and_then(|c| c.serving).unwrap_or(ready),
            terminating: c.and_then(|c| c.terminating).unwrap_or(false),
        };
        for text in &endpoint.addresses {
            match text.trim().parse::<IpAddr>().map(canonical) {
                Ok(ip) if ip.is_ipv4() != want_v4 => skip(skips, Skip::InvalidIp, slice, text),
                // An endpoint that lists an address twice lists it once.
                Ok(ip) if entries[first..].iter().any(|e: &EntryFacts| e.ip == ip) => {}
                Ok(ip) => entries.push(EntryFacts {
                    ip,
                    target: target.clone(),
                    conditions,
                }),
                Err(_) => skip(skips, Skip::InvalidIp, slice, text),
            }
        }
    }
    // Stable: the entries of one IP keep their order in the slice.
    entries.sort_by_key(|e| e.ip);
    Some(SliceFacts {
        name,
        service,
        ports: ports.into(),
        entries,
    })
}

/// IPv4-mapped IPv6 addresses are IPv4 addresses: one IP, one key (also how
/// the index looks an IP up). The rule lives in core, shared with the filter.
pub(crate) use staleguard_core::ip::canonical;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuids_are_kept_as_numbers_and_print_back_the_same() {
        let text = "6f1c0a52-0001-4c1e-9a11-0123456789ab";
        let uid = Uid::parse(text);
        assert!(matches!(uid, Uid::Uuid(..)));
        assert_eq!(std::mem::size_of::<Uid>(), 24);
        assert_eq!(uid.to_string(), text);
        assert_eq!(
            Uid::parse("00000000-0000-0000-0000-000000000000").to_string(),
            "00000000-0000-0000-0000-000000000000"
        );
        for other in [
            "uid-cart-1",
            "6F1C0A52-0001-4C1E-9A11-0123456789AB",
            "6f1c0a52x0001-4c1e-9a11-0123456789ab",
            "",
        ] {
            let uid = Uid::parse(other);
            assert!(matches!(uid, Uid::Other(_)), "{other}");
            assert_eq!(uid.to_string(), other);
        }
        assert_ne!(
            Uid::parse(text),
            Uid::parse("6f1c0a52-0001-4c1e-9a11-0123456789ac")
        );
    }
}
