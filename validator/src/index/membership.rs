//! Membership: which services a pod is a member of at one IP, and how.
//!
//! The one place this is derived ([`Index::members`]). A served record
//! ([`Index::memberships`]), its fingerprint, the services a tombstone
//! remembers and the per-service member counts all ask here, so they cannot
//! drift apart. Likewise for the services an IP is a bare member of
//! ([`Index::bare_services`]).

use std::collections::{BTreeMap, BTreeSet};
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use smallvec::{smallvec, SmallVec};
use staleguard_core::wire::{EndpointConditions, EndpointPort, Membership, Via};
use staleguard_core::ServiceKey;

use super::facts::Target;
use super::pods::PodState;
use super::slices::IpEntry;
use super::Index;

/// How a pod is a member of one service at one IP: borrowed from the facts,
/// so the hot path (fingerprints) allocates nothing.
#[derive(Debug)]
pub(super) struct Member<'a> {
    pub(super) service: &'a Arc<ServiceKey>,
    pub(super) via: Via,
    /// The ports of every slice of the service listing the pod at the IP, in
    /// the order of the entries (each sorted, without duplicates); served
    /// merged.
    ports: SmallVec<[&'a [EndpointPort]; 1]>,
    /// The conditions of the first entry listing the pod (slices sorted by
    /// name); `None` for a member by selector only.
    conditions: Option<EndpointConditions>,
}

impl Member<'_> {
    /// The membership as served.
    pub(super) fn to_wire(&self) -> Membership {
        let mut ports: Vec<EndpointPort> =
            self.ports.iter().flat_map(|p| p.iter()).cloned().collect();
        if self.ports.len() > 1 {
            ports.sort();
            ports.dedup();
        }
        Membership {
            service: (**self.service).clone(),
            via: self.via,
            ports,
            conditions: self.conditions,
        }
    }

    /// Hashes everything [`Member::to_wire`] says.
    pub(super) fn hash_into(&self, h: &mut impl Hasher) {
        self.service.hash(h);
        let via: u8 = match self.via {
            Via::Slice => 0,
            Via::Selector => 1,
            Via::Both => 2,
        };
        via.hash(h);
        self.ports.len().hash(h);
        for ports in &self.ports {
            ports.len().hash(h);
            for p in ports.iter() {
                (&p.name, p.port, &p.protocol).hash(h);
            }
        }
        match self.conditions {
            None => 0u8.hash(h),
            Some(EndpointConditions {
                ready,
                serving,
                terminating,
            }) => (1u8, ready, serving, terminating).hash(h),
        }
    }
}

// === impl Index ===

impl Index {
    /// The services `pod` is a member of at an IP whose slice entries are
    /// `entries`, sorted by service: by selector (`pod.selected`), by the
    /// entries that name the pod, or both.
    pub(super) fn members<'a>(
        &'a self,
        pod: &'a PodState,
        entries: &'a [IpEntry],
    ) -> SmallVec<[Member<'a>; 2]> {
        let mut out: SmallVec<[Member<'a>; 2]> = pod
            .selected
            .iter()
            .map(|service| Member {
                service,
                via: Via::Selector,
                ports: SmallVec::new(),
                conditions: None,
            })
            .collect();
        for entry in entries.iter().filter(|e| pod.listed_by(e)) {
            let Some(slice) = self.slices.get(entry.slice) else {
                continue;
            };
            match out.iter_mut().find(|m| *m.service == slice.service) {
                Some(m) => {
                    if m.via == Via::Selector {
                        m.via = Via::Both;
                    }
                    m.ports.push(&slice.ports);
                    m.conditions.get_or_insert(entry.conditions);
                }
                None => out.push(Member {
                    service: &slice.service,
                    via: Via::Slice,
                    ports: smallvec![&slice.ports[..]],
                    conditions: Some(entry.conditions),
                }),
            }
        }
        out.sort_by(|a, b| a.service.cmp(b.service));
        out
    }

    /// The memberships of `pod` at an IP whose slice entries are `entries`,
    /// as served.
    pub(super) fn memberships(&self, pod: &PodState, entries: &[IpEntry]) -> Vec<Membership> {
        self.members(pod, entries)
            .iter()
            .map(Member::to_wire)
            .collect()
    }

    /// The services an IP whose slice entries are `entries` is a bare member
    /// of (entries without a pod `targetRef`), sorted, without duplicates.
    pub(super) fn bare_services<'a>(
        &'a self,
        entries: &'a [IpEntry],
    ) -> SmallVec<[&'a Arc<ServiceKey>; 1]> {
        let mut out: SmallVec<[&Arc<ServiceKey>; 1]> = entries
            .iter()
            .filter(|e| e.target == Target::Bare)
            .filter_map(|e| self.slices.get(e.slice))
            .map(|s| &s.service)
            .collect();
        out.sort();
        out.dedup();
        out
    }

    /// Per service, how many live (non-terminating) pods are members, sorted by
    /// service; services without members are listed with 0.
    pub fn service_members(&self) -> Vec<(ServiceKey, usize)> {
        let mut counts: BTreeMap<ServiceKey, usize> =
            self.services.keys().map(|k| ((**k).clone(), 0)).collect();
        for (_, pod) in self.pods.iter() {
            if pod.facts.terminating || pod.facts.ips.is_empty() {
                continue;
            }
            let mut services: BTreeSet<&ServiceKey> = BTreeSet::new();
            for ip in pod.facts.ips.iter() {
                let entries = self.ips.get(ip).map_or(&[][..], |s| &s.entries);
                services.extend(self.members(pod, entries).iter().map(|m| &**m.service));
            }
            for s in services {
                *counts.entry(s.clone()).or_default() += 1;
            }
        }
        counts.into_iter().collect()
    }
}
