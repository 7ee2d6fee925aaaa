//! Derived records: what the index serves for one IP, derived from the facts.
//!
//! Nothing here is stored but each IP's fingerprint: a record is built on
//! demand from the IP's holders and slice entries. At the end of every event
//! ([`Index::finish`]) the touched IPs are re-derived, their fingerprints
//! compared, and the changed ones bump the generation and enter the change
//! log.

use std::collections::hash_map::Entry;
use std::hash::{BuildHasher, Hash, Hasher};
use std::net::IpAddr;
use std::time::SystemTime;

use smallvec::SmallVec;
use staleguard_core::wire::{PodHolder, Tombstone};
use staleguard_core::{IpRecord, ServiceKey};

use super::facts::{canonical, Kind, Target};
use super::log::ChangeKey;
use super::slices::IpEntry;
use super::table::Id;
use super::tombstones::TombState;
use super::{unix_ms, Index};

/// Everything the index knows about one IP but its tombstone.
#[derive(Debug, Default)]
pub(super) struct IpState {
    /// Pods holding the IP.
    pub(super) holders: SmallVec<[Id; 1]>,
    /// Slice entries listing the IP, sorted by slice name (stable within a
    /// slice), so which slice's conditions win does not depend on the order
    /// events arrived in.
    pub(super) entries: SmallVec<[IpEntry; 1]>,
    /// The pod that held the IP last, once nobody does.
    pub(super) tomb: Option<Box<TombState>>,
    /// The fingerprint of the IP's record; 0 when it has none.
    pub(super) fingerprint: u64,
}

impl IpState {
    fn is_empty(&self) -> bool {
        self.holders.is_empty()
            && self.entries.is_empty()
            && self.tomb.is_none()
            && self.fingerprint == 0
    }
}

impl Index {
    /// The record of one IP, or `None` when the index knows nothing about it.
    pub fn record(&self, ip: IpAddr) -> Option<IpRecord> {
        let ip = canonical(ip);
        let state = self.ips.get(&ip);
        let entries: &[IpEntry] = state.map_or(&[], |s| &s.entries);
        let mut pods: Vec<PodHolder> = Vec::new();
        let holders = state.map(|s| self.holders(s)).unwrap_or_default();
        for pod in holders.iter().filter_map(|&id| self.pods.get(id)) {
            let f = &pod.facts;
            pods.push(PodHolder {
                namespace: pod.name.namespace.to_string(),
                name: pod.name.name.to_string(),
                uid: f.uid.to_string(),
                services: self.memberships(pod, entries),
                ready: f.ready,
                terminating: f.terminating,
                host_network: f.host_network,
            });
        }
        sort_holders(&mut pods);
        let bare_services: Vec<ServiceKey> = self
            .bare_services(entries)
            .iter()
            .map(|s| (***s).clone())
            .collect();
        let tombstone = state.and_then(|s| s.tomb.as_ref()).map(|t| Tombstone {
            pod: t.pod.to_string(),
            uid: t.uid.to_string(),
            services: t.services.iter().map(|s| (**s).clone()).collect(),
            since_ms: t.since_ms,
        });
        let record = IpRecord {
            ip,
            pods,
            bare_services,
            tombstone,
        };
        (!record.is_vacant()).then_some(record)
    }

    /// A hash of everything `record(ip)` would say, computed from the same
    /// derivations (holders, [`Index::members`], [`Index::bare_services`])
    /// without building it (the hot path of every event); 0 exactly when
    /// `record(ip)` is `None`. A new field in the record must be hashed here,
    /// or its changes would never reach clients (the property test compares
    /// deltas with snapshots).
    pub(super) fn fingerprint(&self, ip: IpAddr, state: Option<&IpState>) -> u64 {
        let holders = state.map(|s| self.holders(s)).unwrap_or_default();
        let entries: &[IpEntry] = state.map_or(&[], |s| &s.entries);
        let tomb = state.and_then(|s| s.tomb.as_ref());
        let bare = self.bare_services(entries);
        if holders.is_empty() && bare.is_empty() && tomb.is_none() {
            return 0;
        }
        let mut h = self.fingerprints.build_hasher();
        ip.hash(&mut h);
        // Holders are served sorted, so their order here must not matter.
        let mut holders_sum = 0u64;
        for pod in holders.iter().filter_map(|&id| self.pods.get(id)) {
            let mut ph = self.fingerprints.build_hasher();
            let f = &pod.facts;
            (&pod.name, &f.uid).hash(&mut ph);
            (f.ready, f.terminating, f.host_network).hash(&mut ph);
            let members = self.members(pod, entries);
            members.len().hash(&mut ph);
            for m in &members {
                m.hash_into(&mut ph);
            }
            holders_sum = holders_sum.wrapping_add(ph.finish());
        }
        holders_sum.hash(&mut h);
        if !bare.is_empty() {
            bare.hash(&mut h);
        }
        if let Some(t) = tomb {
            (&t.pod, &t.uid, &t.services, t.since_ms).hash(&mut h);
        }
        // 0 means "no record".
        h.finish().max(1)
    }

    /// The pods holding the IP of `state`: its holders, and the pods awaiting
    /// an IP that an unmatched entry there names.
    pub(super) fn holders(&self, state: &IpState) -> SmallVec<[Id; 2]> {
        let mut out: SmallVec<[Id; 2]> = state.holders.iter().copied().collect();
        let provisional = state.entries.iter().filter(|e| e.unmatched);
        for e in provisional {
            let Target::Uid(uid) = &e.target else {
                continue;
            };
            for id in self.pods_with_uid(uid) {
                if self.pods.get(id).is_some_and(|p| p.facts.awaiting_ip) && !out.contains(&id) {
                    out.push(id);
                }
            }
        }
        out
    }

    /// Ends an event: settles tombstones, re-derives the touched IPs and bumps
    /// the generation when anything changed.
    pub(super) fn finish(&mut self, kind: Kind, now: SystemTime) {
        for skip in self.skips.drain(..) {
            *self.skipped.entry((kind, skip)).or_default() += 1;
        }
        let now_ms = unix_ms(now);
        let mut touched = std::mem::take(&mut self.touched);
        touched.sort_unstable();
        touched.dedup();
        let mut changed = std::mem::take(&mut self.changed);
        for &ip in &touched {
            self.match_entries(ip);
            let held = self
                .ips
                .get(&ip)
                .is_some_and(|s| !self.holders(s).is_empty());
            if held {
                if let Some(old) = self.ips.get_mut(&ip).and_then(|s| s.tomb.take()) {
                    self.tomb_queue.remove(&(old.since_ms, ip));
                }
            } else if let Some(mut tomb) = self.pending_tombs.remove(&ip) {
                tomb.since_ms = now_ms;
                let state = self.ips.entry(ip).or_default();
                if let Some(old) = state.tomb.replace(Box::new(tomb)) {
                    self.tomb_queue.remove(&(old.since_ms, ip));
                }
                self.tomb_queue.insert((now_ms, ip));
            }
            let fingerprint = self.fingerprint(ip, self.ips.get(&ip));
            let old = match self.ips.entry(ip) {
                Entry::Occupied(mut e) => {
                    let old = std::mem::replace(&mut e.get_mut().fingerprint, fingerprint);
                    if e.get().is_empty() {
                        e.remove();
                    }
                    old
                }
                Entry::Vacant(e) => {
                    if fingerprint != 0 {
                        e.insert(IpState {
                            fingerprint,
                            ..IpState::default()
                        });
                    }
                    0
                }
            };
            match (old != 0, fingerprint != 0) {
                (false, true) => self.records += 1,
                (true, false) => self.records -= 1,
                _ => {}
            }
            if old != fingerprint {
                changed.push(ChangeKey::Ip(ip));
            }
        }
        touched.clear();
        self.touched = touched;
        self.pending_tombs.clear();
        for (key, existed) in self.services_touched.drain() {
            if self.services.contains_key(&key) != existed {
                changed.push(ChangeKey::Service(key));
            }
        }
        if !changed.is_empty() {
            self.generation += 1;
            for key in changed.drain(..) {
                self.log.record(key, self.generation);
            }
        }
        self.changed = changed;
    }
}

/// Live holders first, then by name: the order records are served in.
fn sort_holders(pods: &mut [PodHolder]) {
    pods.sort_by(|a, b| {
        (a.terminating, &a.namespace, &a.name, &a.uid).cmp(&(
            b.terminating,
            &b.namespace,
            &b.name,
            &b.uid,
        ))
    });
}
