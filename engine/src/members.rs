//! Each service's live members, for the replay of a rejected request
//! (see [`crate::replay`]): which hosts the index says a request may go to.
//!
//! The index is keyed by IP, which answers "may this host serve that service"
//! but not "which hosts may". The poller therefore keeps one more key per
//! service, written with the same load scheme as the IP entries (see
//! [`crate::store`]):
//!
//! | key                              | value                                  |
//! |----------------------------------|----------------------------------------|
//! | `staleguard/members/<id>`        | `LOAD` and the members, in binary, or empty |
//!
//! `<id>` is the service's [`service_id`] in 16 hex digits, the name bucket
//! lines know it by. The value ([`encode`]) is [`binary::MAGIC`], the load
//! as a LEB128 number, then runs of members in the list's order, each run a
//! LEB128 header `(count << 2) | is IPv6 << 1 | with ports` and its members:
//! the address (4 or 16 bytes), and with ports a LEB128 port count and the
//! ports (2 bytes each, little-endian). A run holds members of one family
//! and kind: a sorted list of IPv4 members without ports is one run, 4 bytes
//! a member.
//!
//! A member here is an IP whose verdict for the service is
//! [`Reason::Member`] (the one rule, [`staleguard_core::decide`]) and which a
//! *ready* pod holds (or a slice lists without a pod): the hosts a request can
//! be sent to now. A full snapshot writes every list under its new load; a
//! delta reads each IP's old line, gathers the changes of membership per
//! service ([`Updates`]) and rewrites each list that changed once, so a
//! poller that took over from another keeps them right without knowing what
//! its predecessor wrote, and a scale-down of one large service costs one
//! write of its list, not one per pod.

use std::collections::HashMap;
use std::net::IpAddr;

use staleguard_core::{decide, Policy, Reason, ServiceKey};

use crate::binary::{self, Opening, Reader};
use crate::buckets::{placeholder, service_id, CompactRecord, Holders};
use crate::host::{SharedData, StoreError};

/// One live member: its IP, and the ports the index lists for it in the
/// service (empty when the index does not say, as in the verdict view).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Member {
    /// The member's IP.
    pub ip: IpAddr,
    /// Its ports in the service, if the index says.
    pub ports: Vec<u16>,
}

/// Key of one service's member list.
pub fn members_key(service: &ServiceKey) -> String {
    id_key(service_id(service))
}

/// Key of the member list of the service with id `id` ([`service_id`]): a
/// bucket line names services by id, so a delta can update the lists of an
/// IP's old services from its line alone.
fn id_key(id: u64) -> String {
    format!("staleguard/members/{id:016x}")
}

/// The services (by [`service_id`]) `holders` make their IP a live, ready
/// member of, with the ports the index lists for each, in the order of
/// their ids, each once.
pub fn live_memberships(ip: IpAddr, holders: &Holders) -> Vec<(u64, Vec<u16>)> {
    let mut out = Vec::new();
    let record = holders.record_by_ids(ip);
    for id in holders.service_ids() {
        let verdict = decide(
            &Policy::default(),
            true,
            &placeholder(id),
            true,
            Some(&record),
        );
        if verdict.reason != Reason::Member {
            continue;
        }
        let ready_pod = holders
            .pods
            .iter()
            .filter(|p| p.flags.ready && !p.flags.terminating)
            .flat_map(|p| p.services.iter())
            .filter(|(sid, _)| *sid == id)
            .collect::<Vec<_>>();
        if ready_pod.is_empty() && !holders.bare.contains(&id) {
            continue;
        }
        let mut ports: Vec<u16> = ready_pod
            .iter()
            .flat_map(|(_, ports)| ports.iter().copied())
            .collect();
        ports.sort_unstable();
        ports.dedup();
        // `service_ids` are sorted and each once: so is `out`.
        out.push((id, ports));
    }
    out
}

/// The value of service `id` in `map` (sorted by id), added if missing.
/// A sorted `Vec` rather than a `BTreeMap`: a reset or a delta touches at
/// most a few thousand services, and the Wasm module carries no B-tree
/// code for it.
fn slot<V: Default>(map: &mut Vec<(u64, V)>, id: u64) -> &mut V {
    let at = match map.binary_search_by_key(&id, |(k, _)| *k) {
        Ok(at) => at,
        Err(at) => {
            map.insert(at, (id, V::default()));
            at
        }
    };
    // `at` is in bounds: found, or just inserted there.
    &mut map[at].1
}

/// Encodes a member list under `load`, in its order.
pub fn encode(load: u64, members: &[Member]) -> Vec<u8> {
    let mut out = Vec::with_capacity(12 + 4 * members.len());
    binary::push_opening(&mut out, load);
    let kind = |m: &Member| (m.ip.is_ipv6(), !m.ports.is_empty());
    for run in members.chunk_by(|a, b| kind(a) == kind(b)) {
        let (v6, ports) = run.first().map(kind).unwrap_or_default();
        binary::push_varint(
            &mut out,
            (run.len() as u64) << 2 | u64::from(v6) << 1 | u64::from(ports),
        );
        for m in run {
            binary::push_ip(&mut out, &m.ip);
            if ports {
                binary::push_varint(&mut out, m.ports.len() as u64);
                for port in &m.ports {
                    out.extend_from_slice(&port.to_le_bytes());
                }
            }
        }
    }
    out
}

/// Decodes a member list; a list from an older load (a text list of an
/// earlier layout among them), an empty value or garbage is no list
/// (`None`), which the replay treats as "no member known". Reads nothing
/// past `bytes` and allocates no more than `bytes` can fill.
pub fn decode(bytes: &[u8], meta_load: u64) -> Option<Vec<Member>> {
    let Opening::Load(load, rest) = binary::opening(bytes) else {
        return None;
    };
    if load < meta_load {
        return None;
    }
    let mut reader = Reader::new(rest);
    let mut members = Vec::new();
    while !reader.is_empty() {
        let header = reader.varint()?;
        let (v6, with_ports) = (header & 2 != 0, header & 1 != 0);
        let count = usize::try_from(header >> 2).ok().filter(|n| *n > 0)?;
        let size = if v6 { 16 } else { 4 };
        if count > reader.rest().len() / size {
            return None;
        }
        members.reserve(count);
        for _ in 0..count {
            let ip = if v6 {
                IpAddr::from(reader.array::<16>()?)
            } else {
                IpAddr::from(reader.array::<4>()?)
            };
            let mut ports = Vec::new();
            if with_ports {
                let n = usize::try_from(reader.varint()?).ok().filter(|n| *n > 0)?;
                if n > reader.rest().len() / 2 {
                    return None;
                }
                ports = (0..n).map(|_| reader.u16()).collect::<Option<Vec<_>>>()?;
            }
            members.push(Member { ip, ports });
        }
    }
    Some(members)
}

/// Reads a service's live members at `meta_load` (empty when none is known).
pub fn read(store: &dyn SharedData, service: &ServiceKey, meta_load: u64) -> Vec<Member> {
    read_id(store, service_id(service), meta_load)
}

fn read_id(store: &dyn SharedData, id: u64, meta_load: u64) -> Vec<Member> {
    match store.get(&id_key(id)) {
        Ok((Some(value), _)) => decode(&value, meta_load).unwrap_or_default(),
        _ => Vec::new(),
    }
}

/// Writes every service's list for a full snapshot under `load` (see
/// [`Lists`]).
pub fn write_snapshot(
    store: &mut dyn SharedData,
    load: u64,
    records: &[CompactRecord],
) -> Result<(), StoreError> {
    let mut lists = Lists::default();
    for record in records {
        lists.add(record);
    }
    lists.write(store, load)
}

/// Every service's live members, gathered a record at a time while a full
/// snapshot is read, in a few bytes per member: an IPv4 member without
/// ports is its 4 bytes (the packed form never lists ports).
///
/// Counted first ([`Lists::count`], in the pass that measures the
/// snapshot), every list's IPv4 members get one buffer, reserved once at
/// their number ([`Lists::reserve`]), each list a range of it, before the
/// lists fill ([`Lists::add`]): grown by doubling instead, a reset would
/// leave the allocator every list's smaller buffers (a 150-member list's
/// 512, 256, 128... bytes), and a buffer each the lists themselves once
/// written; it keeps both. A list never counted (or past its count) grows
/// a vector of its own.
#[derive(Debug, Clone, Default)]
pub struct Lists {
    /// By service id, sorted (see [`slot`]).
    lists: Vec<(u64, List)>,
    /// The counted lists' IPv4 members without ports, each list's at its
    /// range ([`List::at`], its count long).
    v4: Vec<u32>,
}

#[derive(Debug, Clone, Default)]
struct List {
    /// Where the list's range of [`Lists::v4`] starts, and how many of its
    /// members are written there.
    at: usize,
    filled: usize,
    /// IPv4 members without ports past the range.
    v4: Vec<u32>,
    /// IPv6 members, and members with ports.
    others: Vec<Member>,
    /// Members counted for the range and for `others`.
    counted: (usize, usize),
}

impl List {
    /// Adds an IPv4 member without ports: in the list's range of `shared`
    /// while it has room, else in its own vector.
    fn push_v4(&mut self, shared: &mut [u32], ip: u32) {
        if self.filled < self.counted.0 {
            if let Some(slot) = shared.get_mut(self.at + self.filled) {
                *slot = ip;
                self.filled += 1;
                return;
            }
        }
        self.v4.push(ip);
    }
}

impl Lists {
    /// Adds the IP of `record` to the lists of the services it is a live
    /// member of.
    pub fn add(&mut self, record: &CompactRecord) {
        let shared = &mut self.v4;
        each_membership(&mut self.lists, record, |list, ip, ports| match ip {
            IpAddr::V4(v4) if ports.is_empty() => list.push_v4(shared, u32::from(v4)),
            ip => list.others.push(Member { ip, ports }),
        });
    }

    /// Counts the IP of `record` in the lists of the services it is a live
    /// member of, without adding it: the measuring pass, before
    /// [`Lists::reserve`].
    pub fn count(&mut self, record: &CompactRecord) {
        each_membership(&mut self.lists, record, |list, ip, ports| match ip {
            IpAddr::V4(_) if ports.is_empty() => list.counted.0 += 1,
            _ => list.counted.1 += 1,
        });
    }

    /// Reserves the room for the members counted, exactly, before any is
    /// added: the IPv4 members' buffer at once, each list's range in it,
    /// and each list's other members; adding them reallocates none.
    pub fn reserve(&mut self) {
        let total = self.lists.iter().map(|(_, l)| l.counted.0).sum();
        self.v4 = vec![0; total];
        let mut at = 0;
        for (_, list) in &mut self.lists {
            (list.at, list.filled) = (at, 0);
            at += list.counted.0;
            list.others.reserve_exact(list.counted.1);
        }
    }

    /// The room of service `id`'s list: IPv4 members without ports, others.
    #[cfg(test)]
    pub(crate) fn capacity(&self, id: u64) -> Option<(usize, usize)> {
        let (_, list) = self.lists.iter().find(|(k, _)| *k == id)?;
        let range = self
            .v4
            .get(list.at..list.at + list.counted.0)
            .map_or(0, <[u32]>::len);
        Some((range + list.v4.capacity(), list.others.capacity()))
    }

    /// Writes every list under `load`. Services with no live member get no
    /// list: an older one is invalid under the new load anyway.
    pub fn write(self, store: &mut dyn SharedData, load: u64) -> Result<(), StoreError> {
        let shared = self.v4;
        for (id, list) in self.lists {
            let List {
                at,
                filled,
                v4,
                others,
                counted: _,
            } = list;
            let range = shared.get(at..at + filled).unwrap_or_default();
            if range.is_empty() && v4.is_empty() && others.is_empty() {
                continue;
            }
            let mut members: Vec<Member> = range
                .iter()
                .copied()
                .chain(v4)
                .map(|ip| Member {
                    ip: IpAddr::from(std::net::Ipv4Addr::from(ip)),
                    ports: Vec::new(),
                })
                .chain(others)
                .collect();
            members.sort();
            store.set(&id_key(id), &encode(load, &members), None)?;
        }
        Ok(())
    }
}

/// Calls `f` with the list in `lists` of each service `record` makes its IP
/// a live member of, the IP and its ports there.
fn each_membership(
    lists: &mut Vec<(u64, List)>,
    record: &CompactRecord,
    mut f: impl FnMut(&mut List, IpAddr, Vec<u16>),
) {
    let Some(holders) = record.holders() else {
        return;
    };
    for (id, ports) in live_memberships(record.ip, &holders) {
        f(slot(lists, id), record.ip, ports);
    }
}

/// A batch's changes to the member lists (a delta's, a hold's gains),
/// gathered per service an IP at a time ([`Updates::change`]), then written
/// with each touched list read, edited and written once
/// ([`Updates::write`]): a delta removing N IPs of one service costs one
/// read and one write of its list, not N of each.
#[derive(Debug, Default)]
pub struct Updates {
    /// Per service, the IPs whose membership changed: the ports of the IP
    /// as a member now, `None` when it no longer is one.
    /// By service id, sorted (see [`slot`]).
    services: Vec<(u64, Changed)>,
}

/// One service's changed IPs (see [`Updates`]). A hash map: which order
/// they are put back in does not matter, since a list that gains members is
/// sorted.
type Changed = HashMap<IpAddr, Option<Vec<u16>>, foldhash::fast::RandomState>;

impl Updates {
    /// Notes the change of one IP: `old` is the record the index held (read
    /// before it is overwritten), `new` its new record, `None` when the IP
    /// is removed. Only the services whose membership of the IP changes are
    /// noted; a later change of the same IP replaces an earlier one.
    pub fn change(&mut self, ip: IpAddr, old: Option<&Holders>, new: Option<&CompactRecord>) {
        let old = old.map(|h| live_memberships(ip, h)).unwrap_or_default();
        let mut new = new
            .and_then(CompactRecord::holders)
            .map(|h| live_memberships(ip, &h))
            .unwrap_or_default();
        for (id, before) in &old {
            let after = new
                .iter()
                .position(|(n, _)| n == id)
                .map(|at| new.swap_remove(at).1);
            if after.as_ref() != Some(before) {
                slot(&mut self.services, *id).insert(ip, after);
            }
        }
        for (id, after) in new {
            slot(&mut self.services, id).insert(ip, Some(after));
        }
    }

    /// Writes each touched list under `load`: its members read at `load`,
    /// the changed IPs taken out, those still members put back with their
    /// ports, sorted; the bytes one IP at a time in the batch's order would
    /// have written.
    pub fn write(self, store: &mut dyn SharedData, load: u64) -> Result<(), StoreError> {
        for (id, changes) in self.services {
            let mut members = read_id(store, id, load);
            members.retain(|m| !changes.contains_key(&m.ip));
            let kept = members.len();
            members.extend(
                changes
                    .into_iter()
                    .filter_map(|(ip, ports)| ports.map(|ports| Member { ip, ports })),
            );
            // A list only loses members in place; one that gains is sorted.
            if members.len() > kept {
                members.sort();
            }
            store.set(&id_key(id), &encode(load, &members), None)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;
    use staleguard_core::wire::{EndpointPort, Membership, Via};
    use staleguard_core::{IpRecord, PodHolder};

    fn cart() -> ServiceKey {
        ServiceKey::new("shop", "cart")
    }

    fn pay() -> ServiceKey {
        ServiceKey::new("shop", "pay")
    }

    fn rec(ip: &str, service: &ServiceKey, ready: bool, terminating: bool) -> IpRecord {
        IpRecord {
            ip: ip.parse().unwrap(),
            pods: vec![PodHolder {
                namespace: "shop".into(),
                name: format!("p-{ip}"),
                uid: String::new(),
                services: vec![Membership {
                    service: service.clone(),
                    via: Via::Both,
                    ports: vec![],
                    conditions: None,
                }],
                ready,
                terminating,
                host_network: false,
            }],
            bare_services: vec![],
            tombstone: None,
        }
    }

    /// The memberships as a bucket line gives them (each service once, in
    /// the order of their ids).
    fn live(r: &IpRecord) -> std::collections::BTreeMap<u64, Vec<u16>> {
        let live = live_memberships(r.ip, &Holders::from_record(r));
        assert!(live.windows(2).all(|w| w[0].0 < w[1].0), "{live:?}");
        live.into_iter().collect()
    }

    fn ips(members: &[Member]) -> Vec<String> {
        members.iter().map(|m| m.ip.to_string()).collect()
    }

    #[test]
    fn only_ready_live_members_count() {
        assert_eq!(live(&rec("10.0.0.1", &cart(), true, false)).len(), 1);
        assert!(live(&rec("10.0.0.1", &cart(), false, false)).is_empty());
        assert!(live(&rec("10.0.0.1", &cart(), true, true)).is_empty());
        let mut bare = rec("10.0.0.2", &cart(), true, false);
        bare.pods.clear();
        bare.bare_services = vec![pay()];
        assert_eq!(
            live(&bare).keys().collect::<Vec<_>>(),
            vec![&service_id(&pay())]
        );
    }

    #[test]
    fn lists_round_trip_with_ports_and_honour_the_load() {
        let members = vec![
            Member {
                ip: "10.0.0.1".parse().unwrap(),
                ports: vec![],
            },
            Member {
                ip: "fd00::7".parse().unwrap(),
                ports: vec![8080, 9090],
            },
        ];
        let bytes = encode(4, &members);
        let mut expected = vec![0xb4, 4];
        expected.extend([0x04, 10, 0, 0, 1]); // a run of one IPv4 member
        expected.extend([0x07, 0xfd, 0]); // a run of one IPv6 member with ports
        expected.extend([0; 13]);
        expected.push(7);
        expected.extend([2, 0x90, 0x1f, 0x82, 0x23]); // 8080, 9090
        assert_eq!(bytes, expected);
        assert_eq!(decode(&bytes, 4), Some(members.clone()));
        assert_eq!(decode(&bytes, 5), None, "an older load is no list");
        assert_eq!(decode(&[0xb4, 4], 4), Some(vec![]));
        assert_eq!(decode(b"4 10.0.0.1", 0), None, "a text list of m3");
        for bad in [
            &b""[..],
            b"x 10.0.0.1",
            &[0xb4],
            &[0xb4, 4, 0x00],                 // an empty run
            &[0xb4, 4, 0x08, 10, 0, 0, 1],    // two members, one there
            &[0xb4, 4, 0x05, 10, 0, 0, 1],    // its port count missing
            &[0xb4, 4, 0x05, 10, 0, 0, 1, 0], // no ports though counted
            &[0xb4, 4, 0x05, 10, 0, 0, 1, 1, 0x50],
            &[0xb4, 4, 0xfc, 0xff, 0xff, 0xff, 0x0f, 10], // more than the bytes hold
        ] {
            assert_eq!(decode(bad, 0), None, "{bad:x?}");
        }
        // A sorted list of IPv4 members is one run: 4 bytes a member.
        let many: Vec<Member> = (1..=100u8)
            .map(|i| Member {
                ip: IpAddr::from([10, 0, 1, i]),
                ports: vec![],
            })
            .collect();
        let bytes = encode(4, &many);
        assert_eq!(&bytes[..4], &[0xb4, 4, 0x90, 0x03], "(100 << 2)");
        assert_eq!(bytes.len(), 4 + 400);
        assert_eq!(decode(&bytes, 4), Some(many));
    }

    #[test]
    fn ports_come_from_the_index_when_it_has_them() {
        let mut r = rec("10.0.0.1", &cart(), true, false);
        r.pods[0].services[0].ports = vec![EndpointPort {
            name: None,
            port: 8443,
            protocol: None,
        }];
        assert_eq!(live(&r).get(&service_id(&cart())), Some(&vec![8443]));
    }

    #[test]
    fn the_poller_keeps_the_lists() {
        use crate::sync::{Poller, SyncConfig};
        use staleguard_core::wire::Delta;
        use staleguard_core::{Changes, Freshness, Snapshot};
        let mut store = MemoryStore::default();
        // The guard is off: the delta below empties cart without tombstones,
        // which it would hold; this test is about the member lists.
        let off = crate::guard::GuardConfig {
            enabled: false,
            ..crate::guard::GuardConfig::default()
        };
        let mut p = Poller::new(
            SyncConfig {
                wait_s: 5,
                backoff_initial_ms: 100,
                backoff_max_ms: 1_000,
                min_interval_ms: 0,
                page_bytes: None,
            },
            7,
        )
        .with_guard(crate::guard::Guard::new(
            off,
            staleguard_core::Policy::default(),
        ));
        let fresh = Freshness {
            fresh: true,
            age_ms: None,
        };
        p.next_request(0, &store);
        let snapshot = Snapshot {
            v: 1,
            epoch: 1,
            generation: 1,
            freshness: fresh.clone(),
            services: vec![cart(), pay()],
            records: vec![
                rec("10.0.0.1", &cart(), true, false),
                rec("10.0.0.2", &cart(), true, false),
            ],
        };
        p.on_response(0, 200, &serde_json::to_vec(&snapshot).unwrap(), &mut store)
            .unwrap();
        let load = crate::store::IndexReader::new(&store).meta().unwrap().load;
        assert_eq!(ips(&read(&store, &cart(), load)), ["10.0.0.1", "10.0.0.2"]);
        p.next_request(0, &store);
        let delta = Changes::Delta(Delta {
            v: 1,
            epoch: 1,
            since: 1,
            generation: 2,
            freshness: fresh,
            services_added: vec![],
            services_removed: vec![],
            // With evidence (a tombstone, a new holder), so the blast-radius
            // guard applies it at once.
            upserts: vec![rec("10.0.0.2", &pay(), true, false), {
                let mut gone = rec("10.0.0.1", &cart(), true, false);
                gone.pods.clear();
                gone.tombstone = Some(staleguard_core::Tombstone {
                    pod: "shop/p-10.0.0.1".into(),
                    uid: String::new(),
                    services: vec![cart()],
                    since_ms: 0,
                });
                gone
            }],
            removed: vec![],
        });
        let applied = p
            .on_response(1, 200, &serde_json::to_vec(&delta).unwrap(), &mut store)
            .unwrap();
        assert!(
            matches!(applied, crate::sync::Applied::Delta { .. }),
            "{applied:?}"
        );
        assert!(read(&store, &cart(), load).is_empty());
        assert_eq!(ips(&read(&store, &pay(), load)), ["10.0.0.2"]);
    }

    #[test]
    fn lists_counted_first_are_reserved_exactly_and_never_reallocated_while_they_fill() {
        let mut records: Vec<CompactRecord> = (1..=300u32)
            .map(|i| {
                let ip = IpAddr::from(std::net::Ipv4Addr::from(0x0a00_0000 + i));
                let service = if i % 3 == 0 { pay() } else { cart() };
                CompactRecord::of(&rec(&ip.to_string(), &service, i % 7 != 0, false))
            })
            .collect();
        // An IPv6 member and one with ports go to the other members.
        records.push(CompactRecord::of(&rec("fd00::1", &cart(), true, false)));
        let mut ported = rec("10.9.0.1", &cart(), true, false);
        ported.pods[0].services[0].ports = vec![EndpointPort {
            name: None,
            port: 8443,
            protocol: None,
        }];
        records.push(CompactRecord::of(&ported));
        let mut lists = Lists::default();
        for record in &records {
            lists.count(record);
        }
        let counted = |lists: &Lists, service: &ServiceKey| {
            let id = service_id(service);
            let (_, list) = lists.lists.iter().find(|(k, _)| *k == id).unwrap();
            (list.counted, list.filled, list.others.len())
        };
        // Of 1..=300: cart is i % 3 != 0 (200), pay i % 3 == 0 (100); not
        // ready when i % 7 == 0 (28 of cart, 14 of pay).
        assert_eq!(counted(&lists, &cart()), ((172, 2), 0, 0));
        assert_eq!(counted(&lists, &pay()), ((86, 0), 0, 0));
        lists.reserve();
        let capacity = |lists: &Lists, service: &ServiceKey| lists.capacity(service_id(service));
        assert_eq!(capacity(&lists, &cart()), Some((172, 2)));
        assert_eq!(capacity(&lists, &pay()), Some((86, 0)));
        assert_eq!(lists.v4.len(), 172 + 86, "one buffer, every IPv4 member");
        // Where the buffers are, and how large: a reallocation would change
        // them, and a list past its range would grow a vector of its own.
        let buffers = |lists: &Lists| {
            let each = lists.lists.iter().map(|(_, l)| {
                (
                    l.v4.capacity(),
                    l.others.as_ptr() as usize,
                    l.others.capacity(),
                )
            });
            (
                lists.v4.as_ptr(),
                lists.v4.capacity(),
                each.collect::<Vec<_>>(),
            )
        };
        let reserved = buffers(&lists);
        for record in &records {
            lists.add(record);
            assert_eq!(buffers(&lists), reserved, "a list reallocated");
        }
        assert_eq!(counted(&lists, &cart()), ((172, 2), 172, 2));
        assert_eq!(counted(&lists, &pay()), ((86, 0), 86, 0));
        // Written, they hold what lists never counted would.
        let (mut counted_store, mut plain_store) = (MemoryStore::default(), MemoryStore::default());
        lists.write(&mut counted_store, 1).unwrap();
        write_snapshot(&mut plain_store, 1, &records).unwrap();
        for service in [cart(), pay()] {
            let key = members_key(&service);
            assert_eq!(
                counted_store.get(&key).unwrap(),
                plain_store.get(&key).unwrap()
            );
        }
    }

    #[test]
    fn a_snapshot_writes_lists_and_deltas_keep_them_right() {
        let mut s = MemoryStore::default();
        let records = [
            rec("10.0.0.1", &cart(), true, false),
            rec("10.0.0.2", &cart(), true, false),
            rec("10.0.0.3", &pay(), true, false),
        ];
        let compact: Vec<CompactRecord> = records.iter().map(CompactRecord::of).collect();
        write_snapshot(&mut s, 1, &compact).unwrap();
        let mut index: std::collections::HashMap<IpAddr, IpRecord> =
            records.iter().map(|r| (r.ip, r.clone())).collect();
        assert_eq!(ips(&read(&s, &cart(), 1)), ["10.0.0.1", "10.0.0.2"]);
        // 10.0.0.2 goes to pay (recycled), 10.0.0.1 starts draining, a new
        // cart pod appears, 10.0.0.3 is removed.
        for r in [
            rec("10.0.0.2", &pay(), true, false),
            rec("10.0.0.1", &cart(), true, true),
            rec("10.0.0.4", &cart(), true, false),
        ] {
            let old = index.get(&r.ip).map(Holders::from_record);
            let mut updates = Updates::default();
            updates.change(r.ip, old.as_ref(), Some(&CompactRecord::of(&r)));
            updates.write(&mut s, 1).unwrap();
            index.insert(r.ip, r);
        }
        let gone: IpAddr = "10.0.0.3".parse().unwrap();
        let old = index.get(&gone).map(Holders::from_record);
        let mut updates = Updates::default();
        updates.change(gone, old.as_ref(), None);
        updates.write(&mut s, 1).unwrap();
        assert_eq!(ips(&read(&s, &cart(), 1)), ["10.0.0.4"]);
        assert_eq!(ips(&read(&s, &pay(), 1)), ["10.0.0.2"]);
        // A new load hides every list the snapshot did not write.
        let one = CompactRecord::of(&rec("10.0.0.9", &cart(), true, false));
        write_snapshot(&mut s, 2, &[one]).unwrap();
        assert_eq!(ips(&read(&s, &cart(), 2)), ["10.0.0.9"]);
        assert!(read(&s, &pay(), 2).is_empty());
    }
}
