//! Pods: the facts the index keeps per pod, and how a pod event changes them.
//!
//! A pod is kept by id in a [`Table`], found by name, by uid
//! (`pods_by_uid`) and by namespace (`ns_pods`, for selector changes). An
//! event that adds, changes or removes a pod marks the IPs it held or holds
//! now, and the IPs of slice entries that name its uid without a holder
//! (they may have been waiting for it), for re-derivation.

use std::collections::hash_map::Entry;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use smallvec::SmallVec;
use staleguard_core::ServiceKey;

use super::facts::{
    name_parts, obj_name, pod_facts, skip, Ips, Kind, ObjName, PodFacts, Skip, Uid,
};
use super::relist::{Relist, Relists, Watched};
use super::slices::IpEntry;
use super::table::{Id, Named};
use super::Index;

/// A pod as the index keeps it: its facts and the services that select it.
#[derive(Debug)]
pub(super) struct PodState {
    pub(super) name: ObjName,
    pub(super) facts: PodFacts,
    /// Sorted; services of the pod's namespace whose selector matches it.
    pub(super) selected: SmallVec<[Arc<ServiceKey>; 1]>,
    /// Where the pod's id sits in its namespace's list.
    pub(super) ns_slot: usize,
}

impl Named for PodState {
    fn name(&self) -> &ObjName {
        &self.name
    }
}

impl PodState {
    /// True when slice entry `e` names this pod.
    pub(super) fn listed_by(&self, e: &IpEntry) -> bool {
        e.target.is(&self.name, &self.facts.uid)
    }
}

// === impl Watched for Pod ===

impl Watched for Pod {
    const KIND: Kind = Kind::Pod;
    type Facts = (ObjName, PodFacts);
    type Name = ObjName;
    type Handle = Id;

    fn buffer(relists: &mut Relists) -> &mut Relist<Self::Facts> {
        &mut relists.pods
    }

    fn facts(index: &mut Index, pod: &Pod) -> Option<Self::Facts> {
        let Some(name) = obj_name(pod, &mut index.interner) else {
            skip(&mut index.skips, Skip::MissingName, pod, "");
            return None;
        };
        let before = index.pods.find(&name).and_then(|id| index.pods.get(id));
        let labels_before = before.map(|p| &p.facts.labels);
        let facts = pod_facts(pod, &mut index.interner, &mut index.skips, labels_before);
        Some((name, facts))
    }

    fn name((name, _): &Self::Facts) -> &ObjName {
        name
    }

    fn known(index: &Index) -> impl Iterator<Item = (Id, &ObjName)> {
        index.pods.iter().map(|(id, p)| (id, &p.name))
    }

    fn upsert(index: &mut Index, (name, facts): Self::Facts) {
        match index.pods.find(&name) {
            Some(id) => index.update_pod(id, facts),
            None => index.insert_pod(name, facts),
        }
    }

    fn remove(index: &mut Index, id: Id) {
        index.remove_pod(id);
    }

    // The hot path: look the pod up by borrowed name, and allocate a name
    // only for a pod the index has not seen.
    fn apply(index: &mut Index, pod: Pod) {
        let Some((namespace, name)) = name_parts(&pod) else {
            skip(&mut index.skips, Skip::MissingName, &pod, "");
            return;
        };
        let id = index.pods.find_parts(namespace, name);
        let before = id.and_then(|id| index.pods.get(id));
        let labels_before = before.map(|p| &p.facts.labels);
        let facts = pod_facts(&pod, &mut index.interner, &mut index.skips, labels_before);
        match id {
            Some(id) => index.update_pod(id, facts),
            None => {
                let name = ObjName {
                    namespace: index.interner.get(namespace),
                    name: name.into(),
                };
                index.insert_pod(name, facts);
            }
        }
    }

    fn delete(index: &mut Index, pod: Pod) {
        match name_parts(&pod) {
            Some((namespace, name)) => {
                if let Some(id) = index.pods.find_parts(namespace, name) {
                    index.remove_pod(id);
                }
            }
            None => skip(&mut index.skips, Skip::MissingName, &pod, ""),
        }
    }
}

impl Index {
    /// The pods with `uid`: one, unless objects disagree.
    pub(super) fn pods_with_uid<'a>(&'a self, uid: &'a Uid) -> impl Iterator<Item = Id> + 'a {
        self.pods_by_uid
            .iter_hash(self.fingerprints.hash_one(uid))
            .copied()
            .filter(move |&id| self.pods.get(id).is_some_and(|p| p.facts.uid == *uid))
    }

    /// Touches the IPs whose unmatched entries name `uid`.
    fn touch_unmatched(&mut self, uid: &Uid) {
        if let Some(ips) = self.unmatched.get(uid) {
            self.touched.extend(ips.iter().copied());
        }
    }

    fn insert_pod(&mut self, name: ObjName, facts: PodFacts) {
        let selected = self.select(&name.namespace, &facts.labels);
        let ns_list = self.ns_pods.entry(name.namespace.clone()).or_default();
        let ns_slot = ns_list.len();
        let ips = facts.ips.clone();
        let uid = facts.uid.clone();
        let id = self.pods.insert(PodState {
            name,
            facts,
            selected,
            ns_slot,
        });
        ns_list.push(id);
        self.index_uid(id, &uid);
        self.touch_unmatched(&uid);
        for ip in ips {
            self.ips.entry(ip).or_default().holders.push(id);
            self.touched.push(ip);
        }
    }

    fn update_pod(&mut self, id: Id, facts: PodFacts) {
        let Some(old) = self.pods.get(id) else {
            return;
        };
        if old.facts == facts {
            return;
        }
        // The IPs the pod gave up: settle them while the state is the old one,
        // which a tombstone remembers.
        let released: Ips = old
            .facts
            .ips
            .iter()
            .filter(|ip| !facts.ips.contains(ip))
            .copied()
            .collect();
        // Label sets are shared: the same set means the same labels.
        let selected = if Arc::ptr_eq(&old.facts.labels, &facts.labels) {
            None
        } else {
            Some(self.select(&old.name.namespace, &facts.labels))
        };
        for ip in released {
            self.release(ip, id);
        }
        let Some(pod) = self.pods.get_mut(id) else {
            return;
        };
        let new_uid = (pod.facts.uid != facts.uid).then(|| facts.uid.clone());
        let old = std::mem::replace(&mut pod.facts, facts);
        let old_ips = old.ips;
        if let Some(selected) = selected {
            pod.selected = selected;
        }
        self.touch_unmatched(&old.uid);
        if let Some(uid) = new_uid {
            self.unindex_uid(id, &old.uid);
            self.index_uid(id, &uid);
            self.touch_unmatched(&uid);
        }
        let Some(pod) = self.pods.get(id) else {
            return;
        };
        for &ip in pod.facts.ips.iter() {
            if !old_ips.contains(&ip) {
                self.ips.entry(ip).or_default().holders.push(id);
            }
            self.touched.push(ip);
        }
    }

    fn remove_pod(&mut self, id: Id) {
        let ips = match self.pods.get(id) {
            Some(pod) => pod.facts.ips.clone(),
            None => return,
        };
        for ip in ips {
            self.release(ip, id);
        }
        if let Some(uid) = self.pods.get(id).map(|p| p.facts.uid.clone()) {
            self.touch_unmatched(&uid);
            self.unindex_uid(id, &uid);
        }
        let Some(old) = self.pods.remove(id) else {
            return;
        };
        if let Entry::Occupied(mut list) = self.ns_pods.entry(old.name.namespace.clone()) {
            let list_ref = list.get_mut();
            if list_ref.get(old.ns_slot) == Some(&id) {
                list_ref.swap_remove(old.ns_slot);
                if let Some(&moved) = list_ref.get(old.ns_slot) {
                    if let Some(pod) = self.pods.get_mut(moved) {
                        pod.ns_slot = old.ns_slot;
                    }
                }
            }
            if list.get().is_empty() {
                list.remove();
            }
        }
    }

    fn index_uid(&mut self, id: Id, uid: &Uid) {
        let hash = self.fingerprints.hash_one(uid);
        let (pods, hasher) = (&self.pods, &self.fingerprints);
        self.pods_by_uid.insert_unique(hash, id, |&other| {
            pods.get(other).map_or(0, |p| hasher.hash_one(&p.facts.uid))
        });
    }

    fn unindex_uid(&mut self, id: Id, uid: &Uid) {
        let hash = self.fingerprints.hash_one(uid);
        if let Ok(entry) = self.pods_by_uid.find_entry(hash, |&other| other == id) {
            entry.remove();
        }
    }
}
