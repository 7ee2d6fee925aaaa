//! Objects kept by a small integer id and found by name.
//!
//! Pods and slices are referenced from every IP they touch; an id costs one
//! word and no reference count, where a shared name costs an allocation and an
//! atomic per reference. The name is stored once, in the object: the lookup
//! table holds only ids and asks the objects for their names.

use std::hash::{BuildHasher, Hasher};

use ahash::RandomState;
use hashbrown::HashTable;

use super::facts::ObjName;

/// An object's place in a [`Table`]. Ids of removed objects are reused.
pub(crate) type Id = usize;

/// Something with a namespaced name.
pub(crate) trait Named {
    fn name(&self) -> &ObjName;
}

/// A slab of objects with a name -> id lookup.
#[derive(Debug)]
pub(crate) struct Table<T> {
    slots: Vec<Option<T>>,
    free: Vec<Id>,
    by_name: HashTable<Id>,
    hasher: RandomState,
}

impl<T> Default for Table<T> {
    fn default() -> Self {
        Self {
            slots: Vec::new(),
            free: Vec::new(),
            by_name: HashTable::new(),
            hasher: RandomState::new(),
        }
    }
}

impl<T: Named> Table<T> {
    pub(crate) fn find(&self, name: &ObjName) -> Option<Id> {
        self.find_parts(&name.namespace, &name.name)
    }

    /// [`Table::find`] by borrowed parts: no name to allocate.
    pub(crate) fn find_parts(&self, namespace: &str, name: &str) -> Option<Id> {
        let mut h = self.hasher.build_hasher();
        ObjName::hash_parts(namespace, name, &mut h);
        let slots = &self.slots;
        self.by_name
            .find(h.finish(), |&id| {
                slots
                    .get(id)
                    .and_then(Option::as_ref)
                    .is_some_and(|o| *o.name().namespace == *namespace && *o.name().name == *name)
            })
            .copied()
    }

    pub(crate) fn get(&self, id: Id) -> Option<&T> {
        self.slots.get(id).and_then(Option::as_ref)
    }

    pub(crate) fn get_mut(&mut self, id: Id) -> Option<&mut T> {
        self.slots.get_mut(id).and_then(Option::as_mut)
    }

    /// Adds an object whose name is not in the table yet.
    pub(crate) fn insert(&mut self, value: T) -> Id {
        let hash = self.hasher.hash_one(value.name());
        let id = match self.free.pop() {
            Some(id) => {
                if let Some(slot) = self.slots.get_mut(id) {
                    *slot = Some(value);
                }
                id
            }
            None => {
                self.slots.push(Some(value));
                self.slots.len() - 1
            }
        };
        let (slots, hasher) = (&self.slots, &self.hasher);
        self.by_name.insert_unique(hash, id, |&other| {
            slots
                .get(other)
                .and_then(Option::as_ref)
                .map_or(0, |o| hasher.hash_one(o.name()))
        });
        id
    }

    pub(crate) fn remove(&mut self, id: Id) -> Option<T> {
        let value = self.slots.get_mut(id)?.take()?;
        let hash = self.hasher.hash_one(value.name());
        if let Ok(entry) = self.by_name.find_entry(hash, |&other| other == id) {
            entry.remove();
        }
        self.free.push(id);
        Some(value)
    }

    pub(crate) fn len(&self) -> usize {
        self.by_name.len()
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (Id, &T)> + '_ {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(id, slot)| slot.as_ref().map(|o| (id, o)))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[derive(Debug, PartialEq)]
    struct Thing(ObjName, u32);

    impl Named for Thing {
        fn name(&self) -> &ObjName {
            &self.0
        }
    }

    fn name(n: &str) -> ObjName {
        ObjName {
            namespace: Arc::from("ns"),
            name: n.into(),
        }
    }

    #[test]
    fn finds_by_name_and_reuses_ids_of_removed_objects() {
        let mut table = Table::default();
        let a = table.insert(Thing(name("a"), 1));
        let b = table.insert(Thing(name("b"), 2));
        assert_ne!(a, b);
        assert_eq!(table.find(&name("a")), Some(a));
        assert_eq!(table.find(&name("b")), Some(b));
        assert_eq!(table.find(&name("c")), None);
        assert_eq!(table.remove(a), Some(Thing(name("a"), 1)));
        assert_eq!(table.remove(a), None);
        assert_eq!(table.find(&name("a")), None);
        assert_eq!(table.len(), 1);
        let c = table.insert(Thing(name("c"), 3));
        assert_eq!(c, a, "a freed id is reused");
        assert_eq!(table.get(c).map(|t| t.1), Some(3));
        assert_eq!(table.find(&name("c")), Some(c));
        assert_eq!(table.find_parts("ns", "c"), Some(c));
        assert_eq!(table.find_parts("other", "c"), None);
        assert_eq!(table.find_parts("ns", "a"), None);
        let ids: Vec<Id> = table.iter().map(|(id, _)| id).collect();
        assert_eq!(ids.len(), 2);
        // Enough to make the lookup table grow and rehash.
        for i in 0..1000 {
            table.insert(Thing(name(&format!("x{i}")), i));
        }
        assert_eq!(
            table
                .find(&name("x999"))
                .and_then(|id| table.get(id))
                .map(|t| t.1),
            Some(999)
        );
        assert_eq!(table.find(&name("b")), Some(b));
    }
}
