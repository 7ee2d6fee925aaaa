//! Services: which services exist (in scope), and which pods their selectors
//! select.
//!
//! Each pod keeps the sorted list of services of its namespace whose selector
//! matches its labels (`PodState::selected`); a service whose selector changes
//! re-selects the pods of its namespace and marks the IPs of those that moved.

use std::sync::Arc;

use k8s_openapi::api::core::v1::Service;
use smallvec::SmallVec;
use staleguard_core::ServiceKey;

use super::facts::{obj_name, service_facts, skip, Kind, Labels, ServiceFacts, Skip};
use super::relist::{Relist, Relists, Watched};
use super::Index;

// === impl Watched for Service ===

impl Watched for Service {
    const KIND: Kind = Kind::Service;
    type Facts = ServiceFacts;
    type Name = Arc<ServiceKey>;
    type Handle = Arc<ServiceKey>;

    fn buffer(relists: &mut Relists) -> &mut Relist<ServiceFacts> {
        &mut relists.services
    }

    fn facts(index: &mut Index, service: &Service) -> Option<ServiceFacts> {
        service_facts(service, &mut index.interner, &mut index.skips)
    }

    fn name(facts: &ServiceFacts) -> &Arc<ServiceKey> {
        &facts.key
    }

    /// Services out of scope too: one the list no longer has keeps no reason.
    fn known(index: &Index) -> impl Iterator<Item = (Arc<ServiceKey>, &Arc<ServiceKey>)> {
        index
            .services
            .keys()
            .chain(index.out_of_scope.keys())
            .map(|key| (key.clone(), key))
    }

    fn upsert(index: &mut Index, facts: ServiceFacts) {
        index.upsert_service(facts);
    }

    fn remove(index: &mut Index, key: Arc<ServiceKey>) {
        index.remove_service(&key);
    }

    fn apply(index: &mut Index, service: Service) {
        if let Some(facts) = service_facts(&service, &mut index.interner, &mut index.skips) {
            index.upsert_service(facts);
        }
    }

    fn delete(index: &mut Index, service: Service) {
        match obj_name(&service, &mut index.interner) {
            Some(name) => {
                let key = ServiceKey::new(&*name.namespace, &*name.name);
                index.remove_service(&key);
            }
            None => skip(&mut index.skips, Skip::MissingName, &service, ""),
        }
    }
}

impl Index {
    /// Services of `namespace` whose selector matches `labels`, sorted.
    pub(super) fn select(
        &self,
        namespace: &str,
        labels: &Labels,
    ) -> SmallVec<[Arc<ServiceKey>; 1]> {
        let mut out: SmallVec<[Arc<ServiceKey>; 1]> = self
            .ns_selectors
            .get(namespace)
            .into_iter()
            .flatten()
            .filter(|key| {
                self.services
                    .get(*key)
                    .and_then(|s| s.selector.as_ref())
                    .is_some_and(|sel| selects(sel, labels))
            })
            .cloned()
            .collect();
        out.sort();
        out
    }

    pub(super) fn upsert_service(&mut self, facts: ServiceFacts) {
        let selector = facts
            .selector
            .as_deref()
            .map(|labels| labels.iter().map(|(k, v)| (&**k, &**v)));
        if let Some(why) = self.config.scope.excludes(&facts.key.namespace, selector) {
            // Judging it could call a live pod we do not watch destroyed.
            self.remove_service(&facts.key);
            self.out_of_scope.insert(facts.key, why.into());
            return;
        }
        self.out_of_scope.remove(&facts.key);
        let key = facts.key.clone();
        let old_selector = match self.services.get(&key) {
            Some(old) if *old == facts => return,
            Some(old) => Some(old.selector.clone()),
            None => {
                self.services_touched.entry(key.clone()).or_insert(false);
                None
            }
        };
        let new_selector = facts.selector.clone();
        self.services.insert(key.clone(), facts);
        if old_selector.as_ref() != Some(&new_selector) {
            self.reselect(&key, old_selector.flatten().is_some(), new_selector);
        }
    }

    pub(super) fn remove_service(&mut self, key: &ServiceKey) {
        self.out_of_scope.remove(key);
        let Some(old) = self.services.remove(key) else {
            return;
        };
        self.services_touched.entry(old.key.clone()).or_insert(true);
        if old.selector.is_some() {
            self.reselect(&old.key, true, None);
        }
    }

    /// The selector of `key` changed to `selector`: update the selected services
    /// of every pod of its namespace, touching the IPs of pods that changed.
    fn reselect(&mut self, key: &Arc<ServiceKey>, had_selector: bool, selector: Option<Labels>) {
        let namespace = self.interner.get(&key.namespace);
        let list = self.ns_selectors.entry(namespace.clone()).or_default();
        match (had_selector, selector.is_some()) {
            (false, true) => list.push(key.clone()),
            (true, false) => list.retain(|k| k != key),
            _ => {}
        }
        if list.is_empty() {
            self.ns_selectors.remove(&namespace);
        }
        let Some(ids) = self.ns_pods.get(&namespace) else {
            return;
        };
        for &id in ids {
            let Some(pod) = self.pods.get_mut(id) else {
                continue;
            };
            let matches = selector
                .as_ref()
                .is_some_and(|s| selects(s, &pod.facts.labels));
            let position = pod.selected.binary_search(key);
            match (matches, position) {
                (true, Err(at)) => pod.selected.insert(at, key.clone()),
                (false, Ok(at)) => {
                    pod.selected.remove(at);
                }
                _ => continue,
            }
            self.touched.extend(pod.facts.ips.iter().copied());
            if let Some(ips) = self.unmatched.get(&pod.facts.uid) {
                self.touched.extend(ips.iter().copied());
            }
        }
    }
}

/// True when every `key=value` of `selector` is among `labels` (both sorted).
fn selects(selector: &Labels, labels: &Labels) -> bool {
    selector.iter().all(|(k, v)| {
        labels
            .binary_search_by(|(lk, _)| (**lk).cmp(&**k))
            .is_ok_and(|at| labels[at].1 == *v)
    })
}
