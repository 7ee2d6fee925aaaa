//! A deliberately simple model of the index, and a property test that drives
//! both with random event sequences.
//!
//! The model keeps the raw objects (with relist buffers) and recomputes every
//! record from scratch; it shares no code with the index but the wire types. The
//! incremental index must agree with it on every live fact after every event.
//! Tombstones depend on history, so the model does not predict them; the test
//! checks their invariants instead (only on IPs nobody holds, and never a reason
//! to accept).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::time::{Duration, UNIX_EPOCH};

use k8s_openapi::api::core::v1::{ObjectReference, Pod, PodStatus, Service};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointSlice};
use kube::runtime::watcher::Event;
use kube::ResourceExt;
use proptest::prelude::*;
use staleguard_core::wire::{EndpointConditions, EndpointPort, Membership, PodHolder, Via};
use staleguard_core::{decide, Freshness, Policy, Reason, ServiceKey, Snapshot};

use super::fixtures::{pod, service, slice};
use super::{Index, IndexConfig};

/// One kind's objects as a watcher consumer would hold them.
#[derive(Debug, Clone)]
struct Store<K> {
    live: BTreeMap<(String, String), K>,
    buffer: Option<BTreeMap<(String, String), K>>,
}

impl<K: ResourceExt + Clone> Store<K> {
    fn new() -> Self {
        Self {
            live: BTreeMap::new(),
            buffer: None,
        }
    }

    fn apply(&mut self, event: &Event<K>) {
        let key = |k: &K| (k.namespace().unwrap_or_default(), k.name_any());
        match event {
            Event::Init => self.buffer = Some(BTreeMap::new()),
            Event::InitApply(k) => {
                self.buffer
                    .get_or_insert_with(BTreeMap::new)
                    .insert(key(k), k.clone());
            }
            Event::InitDone => {
                if let Some(buffer) = self.buffer.take() {
                    self.live = buffer;
                }
            }
            Event::Apply(k) => {
                self.live.insert(key(k), k.clone());
            }
            Event::Delete(k) => {
                self.live.remove(&key(k));
            }
        }
    }
}

#[derive(Debug, Clone)]
struct Model {
    pods: Store<Pod>,
    services: Store<Service>,
    slices: Store<EndpointSlice>,
}

/// What the model predicts for an IP: holders and bare services.
type Live = (Vec<PodHolder>, Vec<ServiceKey>);

impl Model {
    fn new() -> Self {
        Self {
            pods: Store::new(),
            services: Store::new(),
            slices: Store::new(),
        }
    }

    fn records(&self) -> BTreeMap<IpAddr, Live> {
        let mut out: BTreeMap<IpAddr, Live> = BTreeMap::new();
        // Which uids really hold each IP (their pods list it).
        let mut real: BTreeSet<(IpAddr, String)> = BTreeSet::new();
        for p in self.pods.live.values() {
            let status = p.status.clone().unwrap_or_default();
            if matches!(status.phase.as_deref(), Some("Succeeded" | "Failed")) {
                continue;
            }
            for ip in listed_ips(&status) {
                real.insert((ip, p.metadata.uid.clone().unwrap_or_default()));
            }
        }
        for ((ns, name), p) in &self.pods.live {
            let status = p.status.clone().unwrap_or_default();
            if matches!(status.phase.as_deref(), Some("Succeeded" | "Failed")) {
                continue;
            }
            let uid = p.metadata.uid.clone().unwrap_or_default();
            let labels = p.metadata.labels.clone().unwrap_or_default();
            let mut ips: BTreeSet<IpAddr> = listed_ips(&status).into_iter().collect();
            // A pod without an IP yet holds every address a slice entry
            // naming it lists (its update with the IP is on its way), unless
            // a pod with its uid really holds that address.
            if ips.is_empty() && p.metadata.deletion_timestamp.is_none() {
                for sl in self.slices.live.values() {
                    for e in sl.endpoints.iter().filter(|e| names_uid(e, &uid)) {
                        let family_ok = |ip: &IpAddr| ip.is_ipv4() == (sl.address_type == "IPv4");
                        ips.extend(
                            e.addresses
                                .iter()
                                .filter_map(|a| a.parse::<IpAddr>().ok())
                                .filter(family_ok)
                                .filter(|ip| !real.contains(&(*ip, uid.clone()))),
                        );
                    }
                }
            }
            for ip in ips {
                let mut services: BTreeMap<ServiceKey, Membership> = BTreeMap::new();
                for ((sns, sname), s) in &self.services.live {
                    let selector = s
                        .spec
                        .as_ref()
                        .and_then(|s| s.selector.clone())
                        .unwrap_or_default();
                    if sns == ns
                        && !selector.is_empty()
                        && selector.iter().all(|(k, v)| labels.get(k) == Some(v))
                    {
                        let key = ServiceKey::new(sns, sname);
                        services.insert(
                            key.clone(),
                            Membership {
                                service: key,
                                via: Via::Selector,
                                ports: vec![],
                                conditions: None,
                            },
                        );
                    }
                }
                for ((sns, _), sl) in &self.slices.live {
                    let svc = ServiceKey::new(sns, &sl.labels()["kubernetes.io/service-name"]);
                    for e in &sl.endpoints {
                        let names_pod = names_pod(e, sns, (ns, name), &uid);
                        let lists_ip = e.addresses.iter().any(|a| a.parse() == Ok(ip))
                            && ip.is_ipv4() == (sl.address_type == "IPv4");
                        if !(names_pod && lists_ip) {
                            continue;
                        }
                        let ports: Vec<EndpointPort> = sl
                            .ports
                            .iter()
                            .flatten()
                            .map(|p| EndpointPort {
                                name: p.name.clone(),
                                port: p.port.unwrap_or(0) as u16,
                                protocol: p.protocol.clone(),
                            })
                            .collect();
                        let c = e.conditions.clone().unwrap_or_default();
                        let conditions = EndpointConditions {
                            ready: c.ready.unwrap_or(true),
                            serving: c.serving.unwrap_or(c.ready.unwrap_or(true)),
                            terminating: c.terminating.unwrap_or(false),
                        };
                        let m = services.entry(svc.clone()).or_insert(Membership {
                            service: svc.clone(),
                            via: Via::Slice,
                            ports: vec![],
                            conditions: None,
                        });
                        if m.via == Via::Selector {
                            m.via = Via::Both;
                        }
                        m.ports.extend(ports);
                        m.ports.sort();
                        m.ports.dedup();
                        m.conditions.get_or_insert(conditions);
                    }
                }
                out.entry(ip).or_default().0.push(PodHolder {
                    namespace: ns.clone(),
                    name: name.clone(),
                    uid: uid.clone(),
                    services: services.into_values().collect(),
                    ready: status
                        .conditions
                        .iter()
                        .flatten()
                        .any(|c| c.type_ == "Ready" && c.status == "True"),
                    terminating: p.metadata.deletion_timestamp.is_some(),
                    host_network: p.spec.as_ref().and_then(|s| s.host_network) == Some(true),
                });
            }
        }
        for ((sns, _), sl) in &self.slices.live {
            let svc = ServiceKey::new(sns, &sl.labels()["kubernetes.io/service-name"]);
            for e in sl.endpoints.iter().filter(|e| is_bare(e)) {
                for a in &e.addresses {
                    let family_ok = |ip: &IpAddr| ip.is_ipv4() == (sl.address_type == "IPv4");
                    if let Some(ip) = a.parse::<IpAddr>().ok().filter(family_ok) {
                        out.entry(ip).or_default().1.push(svc.clone());
                    }
                }
            }
        }
        for (pods, bare) in out.values_mut() {
            pods.sort_by(|a, b| {
                (a.terminating, &a.namespace, &a.name).cmp(&(b.terminating, &b.namespace, &b.name))
            });
            bare.sort();
            bare.dedup();
        }
        out
    }
}

/// The verdict the rules promise for `service` on an IP the model predicts
/// `live` for, stated from scratch (docs/index.md, "Who holds an IP"): a
/// running member or a bare slice entry makes it a member; a draining member
/// keeps it only while no running pod off the host network has taken the IP.
fn expected_reason(live: &Live, service: &ServiceKey) -> Reason {
    let (pods, bare) = live;
    let member = |p: &PodHolder| p.services.iter().any(|m| m.service == *service);
    let running = |p: &PodHolder| !p.terminating;
    if bare.contains(service) || pods.iter().any(|p| member(p) && running(p)) {
        return Reason::Member;
    }
    if pods.is_empty() {
        return Reason::Destroyed;
    }
    let taken_over = pods
        .iter()
        .any(|p| running(p) && !p.host_network && !member(p));
    if pods.iter().any(member) && !taken_over {
        Reason::Terminating
    } else if pods.iter().any(|p| p.host_network) {
        Reason::HostNetwork
    } else {
        Reason::Recycled
    }
}

/// The IPs a pod's status lists: `podIPs`, or `podIP` when that is empty.
fn listed_ips(status: &PodStatus) -> Vec<IpAddr> {
    let texts: Vec<&str> = match status.pod_ips.as_deref() {
        Some(list) if !list.is_empty() => list.iter().map(|i| i.ip.as_str()).collect(),
        _ => status.pod_ip.as_deref().into_iter().collect(),
    };
    texts.iter().filter_map(|t| t.parse().ok()).collect()
}

/// The entry's `targetRef` when it refers to a Pod (a reference without a
/// kind does).
fn pod_ref(e: &Endpoint) -> Option<&ObjectReference> {
    e.target_ref
        .as_ref()
        .filter(|r| r.kind.as_deref().is_none_or(|k| k == "Pod"))
}

/// True when slice entry `e` has no pod identity: no `targetRef`, or one to
/// another kind.
fn is_bare(e: &Endpoint) -> bool {
    pod_ref(e).is_none()
}

/// True when slice entry `e` names the pod with `uid` by uid.
fn names_uid(e: &Endpoint, uid: &str) -> bool {
    pod_ref(e)
        .and_then(|r| r.uid.as_deref())
        .is_some_and(|u| u == uid)
}

/// True when slice entry `e`, of a slice in namespace `slice_ns`, names the
/// pod `(namespace, name)` with `uid`: by uid, or by name when it has none.
fn names_pod(e: &Endpoint, slice_ns: &str, (namespace, name): (&str, &str), uid: &str) -> bool {
    let Some(r) = pod_ref(e) else {
        return false;
    };
    match (r.uid.as_deref(), r.name.as_deref()) {
        (Some(u), _) => u == uid,
        (None, Some(n)) => n == name && r.namespace.as_deref().unwrap_or(slice_ns) == namespace,
        (None, None) => false,
    }
}

// === generators ===

/// Pod uids: plain text for some incarnations, UUIDs (kept as numbers by the
/// index) for others, so both representations are exercised.
fn uid_of(n: usize, incarnation: usize) -> String {
    if incarnation == 2 {
        format!("00000000-0000-4000-8000-{:012x}", n * 16 + incarnation)
    } else {
        format!("uid-p{n}-{incarnation}")
    }
}

const IPS: [&str; 5] = ["10.0.0.1", "10.0.0.2", "10.0.0.3", "fd00::1", "fd00::2"];
const NAMESPACES: [&str; 2] = ["a", "b"];

#[derive(Debug, Clone)]
enum Op {
    Pod(Box<Event<Pod>>),
    Service(Box<Event<Service>>),
    Slice(Box<Event<EndpointSlice>>),
    Tick(u64),
}

fn any_pod() -> impl Strategy<Value = Pod> + Clone {
    (
        0..2usize,
        0..4usize,
        0..3usize,
        proptest::sample::subsequence(IPS.to_vec(), 0..=2),
        0..3usize,
        0..4usize,
        any::<bool>(),
        // Now and then only `podIP`, with `podIPs` empty or absent.
        proptest::option::weighted(0.2, any::<bool>()),
    )
        .prop_map(|(ns, n, incarnation, ips, app, state, host, pod_ip_only)| {
            let name = format!("p{n}");
            let mut b = pod(NAMESPACES[ns], &name)
                .uid(&uid_of(n, incarnation))
                .labels(&[("app", ["x", "y", "z"][app])]);
            b = match (pod_ip_only, ips.first()) {
                (Some(empty_list), Some(first)) => b.pod_ip_only(first, empty_list),
                _ => b.ips(&ips),
            };
            b = match state {
                0 => b,
                1 => b.not_ready(),
                2 => b.terminating(),
                _ => b.phase(if host { "Succeeded" } else { "Failed" }),
            };
            if host && state == 1 {
                b = b.host_network();
            }
            b.build()
        })
}

fn any_service() -> impl Strategy<Value = Service> + Clone {
    (0..2usize, 0..3usize, 0..4usize).prop_map(|(ns, name, app)| {
        let b = service(NAMESPACES[ns], &format!("s{name}"));
        match app {
            3 => b.build(),
            app => b.selector(&[("app", ["x", "y", "z"][app])]).build(),
        }
    })
}

/// Who a generated slice entry names.
#[derive(Debug, Clone)]
enum Ref {
    /// No `targetRef`.
    None,
    /// Pod `p<n>`'s incarnation, by uid.
    Uid(usize, usize),
    /// Pod `p<n>` by name only, in the slice's namespace or the given one.
    Name(usize, Option<usize>),
    /// A Node, with the uid of a pod's incarnation (which must not count).
    Node(usize, usize),
    /// A Pod reference with neither uid nor name.
    Nobody,
}

fn any_ref() -> impl Strategy<Value = Ref> + Clone {
    prop_oneof![
        6 => Just(Ref::None),
        6 => (0..4usize, 0..3usize).prop_map(|(n, inc)| Ref::Uid(n, inc)),
        2 => (0..4usize, proptest::option::of(0..2usize)).prop_map(|(n, ns)| Ref::Name(n, ns)),
        1 => (0..4usize, 0..3usize).prop_map(|(n, inc)| Ref::Node(n, inc)),
        1 => Just(Ref::Nobody),
    ]
}

fn any_slice() -> impl Strategy<Value = EndpointSlice> + Clone {
    let entry = (
        0..IPS.len(),
        any_ref(),
        proptest::option::of((any::<bool>(), any::<bool>(), any::<bool>())),
        // Now and then a second address (maybe the same one, maybe of the
        // other family) on the same endpoint.
        proptest::option::weighted(0.2, 0..IPS.len()),
    );
    (
        0..2usize,
        0..4usize,
        0..3usize,
        any::<bool>(),
        proptest::collection::vec(entry, 0..4),
    )
        .prop_map(|(ns, name, svc, v6, entries)| {
            let mut b = slice(NAMESPACES[ns], &format!("sl{name}"), &format!("s{svc}"))
                .port("http", 8000 + name as i32);
            if v6 {
                b = b.address_type("IPv6");
            }
            for (ip, target, conditions, also) in entries {
                b = match target {
                    Ref::None => b.endpoint_with(IPS[ip], None, conditions),
                    Ref::Uid(n, inc) => b.endpoint_with(IPS[ip], Some(&uid_of(n, inc)), conditions),
                    Ref::Name(n, namespace) => {
                        b.endpoint_with(IPS[ip], None, conditions).target_ref(
                            "Pod",
                            namespace.map(|ns| NAMESPACES[ns]),
                            Some(&format!("p{n}")),
                            None,
                        )
                    }
                    Ref::Node(n, inc) => b.endpoint_with(IPS[ip], None, conditions).target_ref(
                        "Node",
                        None,
                        Some(&format!("node-{n}")),
                        Some(&uid_of(n, inc)),
                    ),
                    Ref::Nobody => b
                        .endpoint_with(IPS[ip], None, conditions)
                        .target_ref("Pod", None, None, None),
                };
                if let Some(also) = also {
                    b = b.also(IPS[also]);
                }
            }
            b.build()
        })
}

fn any_event<K: std::fmt::Debug + Clone>(
    obj: impl Strategy<Value = K> + Clone,
) -> impl Strategy<Value = Event<K>> {
    prop_oneof![
        6 => obj.clone().prop_map(Event::Apply),
        2 => obj.clone().prop_map(Event::Delete),
        1 => Just(Event::Init),
        2 => obj.prop_map(Event::InitApply),
        1 => Just(Event::InitDone),
    ]
}

fn any_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => any_event(any_pod()).prop_map(|e| Op::Pod(Box::new(e))),
        2 => any_event(any_service()).prop_map(|e| Op::Service(Box::new(e))),
        3 => any_event(any_slice()).prop_map(|e| Op::Slice(Box::new(e))),
        1 => (0..400u64).prop_map(Op::Tick),
    ]
}

// === the property ===

fn apply_delta(old: &Snapshot, index: &Index) -> Option<Snapshot> {
    let delta = index.changes_since(old.generation, Freshness::default())?;
    let mut records: BTreeMap<IpAddr, _> = old.records.iter().map(|r| (r.ip, r.clone())).collect();
    for ip in &delta.removed {
        records.remove(ip);
    }
    for r in delta.upserts {
        records.insert(r.ip, r);
    }
    let mut services: BTreeSet<ServiceKey> = old.services.iter().cloned().collect();
    for s in &delta.services_removed {
        services.remove(s);
    }
    services.extend(delta.services_added);
    Some(Snapshot {
        generation: delta.generation,
        services: services.into_iter().collect(),
        records: records.into_values().collect(),
        ..old.clone()
    })
}

fn check(index: &Index, model: &Model) -> Result<(), TestCaseError> {
    let expected = model.records();
    let snapshot = index.snapshot(Freshness::default());
    for record in &snapshot.records {
        let (pods, bare) = expected.get(&record.ip).cloned().unwrap_or_default();
        prop_assert_eq!(&record.pods, &pods, "pods of {}", record.ip);
        prop_assert_eq!(
            &record.bare_services,
            &bare,
            "bare services of {}",
            record.ip
        );
        if record.tombstone.is_some() {
            prop_assert!(record.pods.is_empty(), "a held IP has a tombstone");
        }
    }
    for (ip, (pods, bare)) in &expected {
        if !pods.is_empty() || !bare.is_empty() {
            prop_assert!(
                snapshot.records.iter().any(|r| r.ip == *ip),
                "{} missing",
                ip
            );
        }
    }
    let services: Vec<ServiceKey> = model
        .services
        .live
        .keys()
        .map(|(ns, n)| ServiceKey::new(ns, n))
        .collect();
    prop_assert_eq!(&snapshot.services, &services);
    // Every verdict the index's records lead to is the one the rules promise.
    for record in &snapshot.records {
        let live = expected.get(&record.ip).cloned().unwrap_or_default();
        for service in &services {
            let verdict = decide(&Policy::default(), true, service, true, Some(record));
            prop_assert_eq!(
                verdict.reason,
                expected_reason(&live, service),
                "{} for {}",
                record.ip,
                service
            );
        }
    }
    // However old a tombstone, an IP no live member holds is never a member.
    for record in snapshot.records.iter().filter(|r| r.pods.is_empty()) {
        for service in &services {
            if record.bare_services.contains(service) {
                continue;
            }
            let verdict = decide(&Policy::default(), true, service, true, Some(record));
            prop_assert_eq!(verdict.reason, Reason::Destroyed);
        }
    }
    Ok(())
}

fn run(ops: Vec<Op>, checkpoints: Vec<usize>, capacity: usize) -> Result<(), TestCaseError> {
    let mut index = Index::new(
        3,
        IndexConfig {
            tombstone_ttl: Duration::from_secs(300),
            change_log_capacity: capacity,
            ..IndexConfig::default()
        },
    );
    let mut model = Model::new();
    let mut now = UNIX_EPOCH + Duration::from_secs(1_800_000_000);
    let mut saved: Vec<Snapshot> = Vec::new();
    for (i, op) in ops.into_iter().enumerate() {
        let before = index.generation();
        match op {
            Op::Pod(e) => {
                model.pods.apply(&e);
                index.apply_pod(*e, now);
            }
            Op::Service(e) => {
                model.services.apply(&e);
                index.apply_service(*e, now);
            }
            Op::Slice(e) => {
                model.slices.apply(&e);
                index.apply_slice(*e, now);
            }
            Op::Tick(secs) => {
                now += Duration::from_secs(secs);
                index.expire_tombstones(now);
            }
        }
        prop_assert!(index.generation() - before <= 1, "one event, one bump");
        check(&index, &model)?;
        if checkpoints.contains(&i) {
            saved.push(index.snapshot(Freshness::default()));
        }
    }
    let current = index.snapshot(Freshness::default());
    for old in saved {
        match apply_delta(&old, &index) {
            Some(replayed) => prop_assert_eq!(&replayed, &current),
            None => prop_assert!(capacity < 1000, "reset without compaction"),
        }
    }
    Ok(())
}

/// 256 cases in CI; `STALEGUARD_PROPTEST_CASES=20000` for a longer search.
fn cases() -> u32 {
    std::env::var("STALEGUARD_PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn the_index_agrees_with_a_model_that_recomputes_everything(
        ops in proptest::collection::vec(any_op(), 1..60),
        checkpoints in proptest::collection::vec(0..60usize, 0..4),
    ) {
        run(ops, checkpoints, 100_000)?;
    }

    #[test]
    fn deltas_stay_correct_or_reset_when_the_log_is_tiny(
        ops in proptest::collection::vec(any_op(), 1..40),
        checkpoints in proptest::collection::vec(0..40usize, 0..4),
    ) {
        run(ops, checkpoints, 3)?;
    }
}
