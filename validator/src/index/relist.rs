//! The relist, written once for the three kinds.
//!
//! After a watch (re)starts, kube-runtime sends `Init`, the listed objects as
//! `InitApply`, then `InitDone`. The listed objects are buffered, reduced to
//! facts, until the list is complete, and then replace the kind's objects in
//! one step: whatever the index knows that the list no longer has was deleted
//! while the watch was away and goes; every listed object is upserted. So no
//! live IP vanishes during a relist. Each kind says, through [`Watched`], how
//! an object is reduced, named, upserted and removed; the order of the steps
//! is here only.

use std::hash::Hash;
use std::time::SystemTime;

use kube::runtime::watcher::Event;

use super::facts::{Kind, ObjName, PodFacts, ServiceFacts, SliceFacts};
use super::{HashSet, Index};

/// Objects of one kind listed since the last `Init`, waiting for `InitDone`.
#[derive(Debug)]
pub(super) struct Relist<F>(Option<Vec<F>>);

impl<F> Default for Relist<F> {
    fn default() -> Self {
        Self(None)
    }
}

/// The relist buffers of every kind.
#[derive(Debug, Default)]
pub(super) struct Relists {
    pub(super) pods: Relist<(ObjName, PodFacts)>,
    pub(super) services: Relist<ServiceFacts>,
    pub(super) slices: Relist<SliceFacts>,
}

/// What the index needs to know about a watched kind to apply its events.
pub(super) trait Watched: Sized {
    /// The kind, for readiness and the skip counts.
    const KIND: Kind;
    /// What a listed object is buffered as.
    type Facts;
    /// What a listed object and a known one are matched by.
    type Name: Hash + Eq + 'static;
    /// How a known object is removed.
    type Handle;

    /// This kind's buffer.
    fn buffer(relists: &mut Relists) -> &mut Relist<Self::Facts>;
    /// Reduces a listed object; `None` when it is skipped (and counted).
    fn facts(index: &mut Index, object: &Self) -> Option<Self::Facts>;
    /// The name of a listed object.
    fn name(facts: &Self::Facts) -> &Self::Name;
    /// Every object of this kind the index knows, by name.
    fn known(index: &Index) -> impl Iterator<Item = (Self::Handle, &Self::Name)>;
    /// Adds or updates a listed object.
    fn upsert(index: &mut Index, facts: Self::Facts);
    /// Removes a known object.
    fn remove(index: &mut Index, handle: Self::Handle);
    /// Applies an `Apply` event outside a relist.
    fn apply(index: &mut Index, object: Self);
    /// Applies a `Delete` event.
    fn delete(index: &mut Index, object: Self);
}

// === impl Index ===

impl Index {
    /// Applies one watch event of kind `K`, then ends the event.
    pub(super) fn apply_event<K: Watched>(&mut self, event: Event<K>, now: SystemTime) {
        match event {
            Event::Init => K::buffer(&mut self.relists).0 = Some(Vec::new()),
            Event::InitApply(object) => {
                if let Some(facts) = K::facts(self, &object) {
                    K::buffer(&mut self.relists)
                        .0
                        .get_or_insert_with(Vec::new)
                        .push(facts);
                }
            }
            Event::InitDone => {
                self.synced[K::KIND.slot()] = true;
                if let Some(listed) = K::buffer(&mut self.relists).0.take() {
                    self.swap::<K>(listed);
                }
            }
            Event::Apply(object) => K::apply(self, object),
            Event::Delete(object) => K::delete(self, object),
        }
        self.finish(K::KIND, now);
    }

    /// Replaces the objects of kind `K` with the complete list `listed`.
    fn swap<K: Watched>(&mut self, listed: Vec<K::Facts>) {
        let keep: HashSet<&K::Name> = listed.iter().map(K::name).collect();
        let gone: Vec<K::Handle> = K::known(self)
            .filter(|(_, name)| !keep.contains(name))
            .map(|(handle, _)| handle)
            .collect();
        drop(keep);
        for handle in gone {
            K::remove(self, handle);
        }
        for facts in listed {
            K::upsert(self, facts);
        }
    }
}
