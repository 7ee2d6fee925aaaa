//! EndpointSlices: their entries, stored under the IPs they list.
//!
//! A slice keeps only its service, its ports and the IPs it lists; each entry
//! lives in its IP's state ([`IpEntry`]). An update is diffed against the IPs
//! the slice listed before, so only the IPs whose entries changed are marked.
//! Entries naming a uid that no holder of their IP has are tracked in
//! `Index::unmatched`, so the pod they wait for re-derives them when it comes.

use std::net::IpAddr;
use std::sync::Arc;

use k8s_openapi::api::discovery::v1::EndpointSlice;
use smallvec::SmallVec;
use staleguard_core::wire::{EndpointConditions, EndpointPort};
use staleguard_core::ServiceKey;

use super::facts::{
    obj_name, skip, slice_facts, EntryFacts, Kind, ObjName, Skip, SliceFacts, Target, Uid,
};
use super::relist::{Relist, Relists, Watched};
use super::table::{Id, Named};
use super::{HashMap, Index};

/// A slice as the index keeps it. Its entries live under their IPs only; the
/// slice remembers which IPs it listed, to diff the next version against.
#[derive(Debug)]
pub(super) struct SliceState {
    pub(super) name: ObjName,
    pub(super) service: Arc<ServiceKey>,
    pub(super) ports: Arc<[EndpointPort]>,
    /// Sorted, without duplicates.
    pub(super) ips: Box<[IpAddr]>,
}

impl Named for SliceState {
    fn name(&self) -> &ObjName {
        &self.name
    }
}

/// One slice entry, as seen from its IP.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct IpEntry {
    pub(super) slice: Id,
    pub(super) target: Target,
    pub(super) conditions: EndpointConditions,
    /// True while the entry names a uid that no holder of the IP has, and is
    /// listed in `Index::unmatched` for it.
    pub(super) unmatched: bool,
}

// === impl Watched for EndpointSlice ===

impl Watched for EndpointSlice {
    const KIND: Kind = Kind::EndpointSlice;
    type Facts = SliceFacts;
    type Name = ObjName;
    type Handle = Id;

    fn buffer(relists: &mut Relists) -> &mut Relist<SliceFacts> {
        &mut relists.slices
    }

    fn facts(index: &mut Index, slice: &EndpointSlice) -> Option<SliceFacts> {
        slice_facts(slice, &mut index.interner, &mut index.skips)
    }

    fn name(facts: &SliceFacts) -> &ObjName {
        &facts.name
    }

    fn known(index: &Index) -> impl Iterator<Item = (Id, &ObjName)> {
        index.slices.iter().map(|(id, s)| (id, &s.name))
    }

    fn upsert(index: &mut Index, facts: SliceFacts) {
        index.upsert_slice(facts);
    }

    fn remove(index: &mut Index, id: Id) {
        index.remove_slice(id);
    }

    fn apply(index: &mut Index, slice: EndpointSlice) {
        match slice_facts(&slice, &mut index.interner, &mut index.skips) {
            Some(facts) => index.upsert_slice(facts),
            // A slice that lost its service label lists nobody now.
            None => {
                if let Some(id) =
                    obj_name(&slice, &mut index.interner).and_then(|name| index.slices.find(&name))
                {
                    index.remove_slice(id);
                }
            }
        }
    }

    fn delete(index: &mut Index, slice: EndpointSlice) {
        match obj_name(&slice, &mut index.interner) {
            Some(name) => {
                if let Some(id) = index.slices.find(&name) {
                    index.remove_slice(id);
                }
            }
            None => skip(&mut index.skips, Skip::MissingName, &slice, ""),
        }
    }
}

impl Index {
    pub(super) fn upsert_slice(&mut self, facts: SliceFacts) {
        let SliceFacts {
            name,
            service,
            ports,
            entries,
        } = facts;
        let id = match self.slices.find(&name) {
            Some(id) => {
                let replace = self
                    .slices
                    .get(id)
                    .is_some_and(|s| s.service != service || s.ports != ports);
                if replace {
                    // Every entry changes: drop them all, then list the new ones.
                    self.clear_slice(id);
                    if let Some(slice) = self.slices.get_mut(id) {
                        slice.service = service;
                        slice.ports = ports;
                    }
                }
                id
            }
            None => self.slices.insert(SliceState {
                name,
                service,
                ports,
                ips: Box::default(),
            }),
        };
        let old_ips = match self.slices.get_mut(id) {
            Some(slice) => std::mem::take(&mut slice.ips),
            None => return,
        };
        // The common update (one endpoint of a hundred changed) touches only
        // the IPs whose entries differ. Both sides are sorted by IP and walked
        // together.
        let mut new_ips: Vec<IpAddr> = Vec::with_capacity(entries.len());
        let (mut i, mut j) = (0, 0);
        while i < old_ips.len() || j < entries.len() {
            let ip = match (old_ips.get(i), entries.get(j)) {
                (Some(a), Some(b)) => (*a).min(b.ip),
                (Some(a), None) => *a,
                (None, Some(b)) => b.ip,
                (None, None) => break,
            };
            let listed_before = old_ips.get(i) == Some(&ip);
            if listed_before {
                i += 1;
            }
            let end = j + entries[j..].iter().take_while(|e| e.ip == ip).count();
            let run = &entries[j..end];
            j = end;
            if !run.is_empty() {
                new_ips.push(ip);
            }
            if listed_before && self.same_entries(ip, id, run) {
                continue;
            }
            if listed_before {
                self.drop_entries(ip, id);
            }
            for entry in run {
                self.insert_entry(ip, id, entry);
            }
        }
        if let Some(slice) = self.slices.get_mut(id) {
            slice.ips = new_ips.into_boxed_slice();
        }
    }

    /// True when slice `id`'s entries at `ip` are exactly `run`, in order.
    fn same_entries(&self, ip: IpAddr, id: Id, run: &[EntryFacts]) -> bool {
        let entries = self.ips.get(&ip).map_or(&[][..], |s| &s.entries);
        let mut mine = entries.iter().filter(|e| e.slice == id);
        run.iter().all(|new| {
            mine.next()
                .is_some_and(|e| e.target == new.target && e.conditions == new.conditions)
        }) && mine.next().is_none()
    }

    /// Adds one entry of slice `id` at `ip`, after the entries of slices whose
    /// names sort before or equal to its name.
    fn insert_entry(&mut self, ip: IpAddr, id: Id, entry: &EntryFacts) {
        let Some(name) = self.slices.get(id).map(|s| &s.name) else {
            return;
        };
        let slices = &self.slices;
        let list = &mut self.ips.entry(ip).or_default().entries;
        let at = list.partition_point(|e| slices.get(e.slice).is_some_and(|s| s.name <= *name));
        list.insert(
            at,
            IpEntry {
                slice: id,
                target: entry.target.clone(),
                conditions: entry.conditions,
                unmatched: false,
            },
        );
        self.slice_entries += 1;
        self.touched.push(ip);
    }

    /// Removes the entries of slice `id` at `ip`.
    fn drop_entries(&mut self, ip: IpAddr, id: Id) {
        if let Some(state) = self.ips.get_mut(&ip) {
            let before = state.entries.len();
            let unmatched = &mut self.unmatched;
            state.entries.retain(|e| {
                if e.slice != id {
                    return true;
                }
                if let (true, Target::Uid(uid)) = (e.unmatched, &e.target) {
                    forget_unmatched(unmatched, uid, ip);
                }
                false
            });
            self.slice_entries -= before - state.entries.len();
        }
        self.touched.push(ip);
    }

    /// Removes every entry of slice `id`; the slice stays, listing nobody.
    fn clear_slice(&mut self, id: Id) {
        let ips = match self.slices.get_mut(id) {
            Some(slice) => std::mem::take(&mut slice.ips),
            None => return,
        };
        for ip in ips.iter() {
            self.drop_entries(*ip, id);
        }
    }

    pub(super) fn remove_slice(&mut self, id: Id) {
        self.clear_slice(id);
        self.slices.remove(id);
    }
}

impl Index {
    /// Marks which entries at `ip` name a uid none of its holders has, and
    /// keeps `unmatched` in step.
    pub(super) fn match_entries(&mut self, ip: IpAddr) {
        let Some(state) = self.ips.get_mut(&ip) else {
            return;
        };
        let (pods, unmatched) = (&self.pods, &mut self.unmatched);
        for e in state.entries.iter_mut() {
            let Target::Uid(uid) = &e.target else {
                continue;
            };
            let matched = state
                .holders
                .iter()
                .any(|&h| pods.get(h).is_some_and(|p| p.facts.uid == *uid));
            if e.unmatched != matched {
                continue;
            }
            e.unmatched = !matched;
            if e.unmatched {
                unmatched.entry(uid.clone()).or_default().push(ip);
            } else {
                forget_unmatched(unmatched, uid, ip);
            }
        }
    }
}

/// Removes one `(uid, ip)` from `unmatched`.
fn forget_unmatched(unmatched: &mut HashMap<Uid, SmallVec<[IpAddr; 1]>>, uid: &Uid, ip: IpAddr) {
    if let Some(ips) = unmatched.get_mut(uid) {
        if let Some(at) = ips.iter().position(|x| *x == ip) {
            ips.swap_remove(at);
        }
        if ips.is_empty() {
            unmatched.remove(uid);
        }
    }
}
