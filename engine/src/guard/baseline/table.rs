//! A dense hash table of small fixed-size keys, for the baseline's one entry
//! per IP: open addressing with linear probing, up to 7/8 full, with as many
//! slots as the entries need (not a power of two: a key's home slot is its
//! hash scaled to the slot count), an occupancy bitmap, and deletion by
//! backward shift (no tombstones). With the baseline's facts an IPv4 entry
//! takes a 16-byte slot: 18.4 bytes an IP when full, the bitmap included.
//!
//! The hash is a fixed mixer, not a keyed one: the keys are pod IPs the
//! cluster hands out, not chosen by a client.

/// A key the table holds: copied, compared, hashed.
pub(in crate::guard) trait Key: Copy + Eq + Default {
    /// 64 well-mixed bits: the top ones choose the home slot.
    fn hash(self) -> u64;
}

impl Key for u32 {
    fn hash(self) -> u64 {
        mix(u64::from(self))
    }
}

/// An IPv6 address as four words: 4-byte aligned, so an entry with the
/// baseline's facts takes 28 bytes, not the 32 a `u128` key would.
impl Key for [u32; 4] {
    fn hash(self) -> u64 {
        let [a, b, c, d] = self.map(u64::from);
        mix(((a << 32) | b) ^ mix((c << 32) | d))
    }
}

/// The finalizer of MurmurHash3: every input bit moves every output bit.
fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

/// The most entries `slots` slots take (7/8 of them: linear probing slows
/// down sharply beyond).
fn max_len(slots: usize) -> usize {
    slots / 8 * 7 + slots % 8 * 7 / 8
}

/// The slots `len` entries need.
fn slots_for(len: usize) -> usize {
    len.saturating_mul(8) / 7 + 1
}

/// Where a probe for a key ended.
enum Probe {
    /// The slot holding it.
    Found(usize),
    /// The empty slot that ends its run (none in a table without slots).
    Vacant(Option<usize>),
}

/// Keys `K` to values `V`. An empty slot holds `(K::default(),
/// V::default())`.
#[derive(Debug, Clone)]
pub(in crate::guard) struct Table<K, V> {
    slots: Vec<(K, V)>,
    /// Bit `i % 64` of word `i / 64`: slot `i` holds an entry.
    occupied: Vec<u64>,
    len: usize,
}

impl<K, V> Default for Table<K, V> {
    fn default() -> Self {
        Self {
            slots: Vec::new(),
            occupied: Vec::new(),
            len: 0,
        }
    }
}

fn bit(occupied: &[u64], i: usize) -> bool {
    occupied.get(i / 64).is_some_and(|w| w >> (i % 64) & 1 != 0)
}

// === impl Table ===

impl<K: Key, V: Default> Table<K, V> {
    pub(in crate::guard) fn len(&self) -> usize {
        self.len
    }

    /// Bytes the table has allocated.
    #[cfg(test)]
    pub(in crate::guard) fn allocated(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<(K, V)>()
            + self.occupied.capacity() * std::mem::size_of::<u64>()
    }

    pub(in crate::guard) fn get(&self, key: K) -> Option<&V> {
        match self.probe(key) {
            Probe::Found(i) => self.slots.get(i).map(|(_, v)| v),
            Probe::Vacant(_) => None,
        }
    }

    #[cfg(test)]
    pub(in crate::guard) fn get_mut(&mut self, key: K) -> Option<&mut V> {
        match self.probe(key) {
            Probe::Found(i) => self.slots.get_mut(i).map(|(_, v)| v),
            Probe::Vacant(_) => None,
        }
    }

    pub(in crate::guard) fn insert(&mut self, key: K, value: V) -> Option<V> {
        let mut probe = self.probe(key);
        if let Probe::Found(i) = probe {
            return self
                .slots
                .get_mut(i)
                .map(|(_, v)| std::mem::replace(v, value));
        }
        if self.len >= max_len(self.slots.len()) {
            // Half as many again as it holds: one rehash per growth.
            let len = self.len.saturating_add(self.len / 2).max(4);
            self.resize(slots_for(len));
            probe = self.probe(key);
        }
        if let Probe::Vacant(Some(i)) = probe {
            self.put(i, key, value);
        }
        None
    }

    pub(in crate::guard) fn remove(&mut self, key: K) -> Option<V> {
        let Probe::Found(i) = self.probe(key) else {
            return None;
        };
        Some(self.remove_at(i))
    }

    /// Room for `len` entries in all, in one allocation and one rehash.
    pub(in crate::guard) fn reserve(&mut self, len: usize) {
        if len > max_len(self.slots.len()) {
            self.resize(slots_for(len));
        }
    }

    #[cfg(test)]
    pub(in crate::guard) fn iter(&self) -> impl Iterator<Item = (K, &V)> {
        let occupied = &self.occupied;
        self.slots
            .iter()
            .enumerate()
            .filter(move |(i, _)| bit(occupied, *i))
            .map(|(_, (k, v))| (*k, v))
    }

    pub(in crate::guard) fn values_mut(&mut self) -> impl Iterator<Item = &mut V> {
        let Table {
            slots, occupied, ..
        } = self;
        let occupied = &*occupied;
        slots
            .iter_mut()
            .enumerate()
            .filter(move |(i, _)| bit(occupied, *i))
            .map(|(_, (_, v))| v)
    }

    /// Keeps the entries `keep` says to, asking once for each.
    pub(in crate::guard) fn retain(&mut self, mut keep: impl FnMut(&mut V) -> bool) {
        let slots = self.slots.len();
        // From an empty slot round: no run crosses it, and a backward shift
        // only moves an entry within its run, towards the slot just
        // emptied, so every entry is asked about once.
        let Some(start) = (0..slots).find(|i| !self.is_occupied(*i)) else {
            return;
        };
        let mut i = start;
        for _ in 0..slots {
            i = self.next(i);
            // An entry shifted into the slot just emptied is asked next.
            while self.is_occupied(i) {
                let kept = self.slots.get_mut(i).is_none_or(|(_, v)| keep(v));
                if kept {
                    break;
                }
                self.remove_at(i);
            }
        }
    }

    fn is_occupied(&self, i: usize) -> bool {
        bit(&self.occupied, i)
    }

    fn set_occupied(&mut self, i: usize, on: bool) {
        if let Some(w) = self.occupied.get_mut(i / 64) {
            let mask = 1 << (i % 64);
            if on {
                *w |= mask;
            } else {
                *w &= !mask;
            }
        }
    }

    /// The slot `key` hashes to.
    fn home(&self, key: K) -> usize {
        ((u128::from(key.hash()) * self.slots.len() as u128) >> 64) as usize
    }

    fn next(&self, i: usize) -> usize {
        if i + 1 >= self.slots.len() {
            0
        } else {
            i + 1
        }
    }

    /// How many slots after `from` `to` is, round the end.
    fn distance(&self, from: usize, to: usize) -> usize {
        if to >= from {
            to - from
        } else {
            to + self.slots.len() - from
        }
    }

    fn probe(&self, key: K) -> Probe {
        let mut i = self.home(key);
        for _ in 0..self.slots.len() {
            if !self.is_occupied(i) {
                return Probe::Vacant(Some(i));
            }
            if self.slots.get(i).is_some_and(|(k, _)| *k == key) {
                return Probe::Found(i);
            }
            i = self.next(i);
        }
        // No slots (a table at most 7/8 full always has an empty one).
        Probe::Vacant(None)
    }

    fn put(&mut self, i: usize, key: K, value: V) {
        if let Some(slot) = self.slots.get_mut(i) {
            *slot = (key, value);
            self.set_occupied(i, true);
            self.len += 1;
        }
    }

    /// Empties slot `i` (occupied), shifting back the entries after it in
    /// its run that may live nearer their home.
    fn remove_at(&mut self, i: usize) -> V {
        let value = self
            .slots
            .get_mut(i)
            .map(std::mem::take)
            .map(|(_, v)| v)
            .unwrap_or_default();
        self.set_occupied(i, false);
        self.len -= 1;
        let mut hole = i;
        let mut j = self.next(i);
        while self.is_occupied(j) && j != i {
            let home = self.slots.get(j).map_or(j, |(k, _)| self.home(*k));
            // Its home is not after the hole (round the end): it may move
            // back into it.
            if self.distance(home, j) >= self.distance(hole, j) {
                self.slots.swap(hole, j);
                self.set_occupied(hole, true);
                self.set_occupied(j, false);
                hole = j;
            }
            j = self.next(j);
        }
        value
    }

    /// Rehashes every entry into `slots` slots.
    fn resize(&mut self, slots: usize) {
        let mut grown = Table {
            slots: Vec::with_capacity(slots),
            occupied: vec![0; slots.div_ceil(64)],
            len: 0,
        };
        grown.slots.resize_with(slots, Default::default);
        let old = std::mem::replace(self, grown);
        let Table {
            slots: entries,
            occupied,
            ..
        } = old;
        for (i, (key, value)) in entries.into_iter().enumerate() {
            if bit(&occupied, i) {
                if let Probe::Vacant(Some(at)) = self.probe(key) {
                    self.put(at, key, value);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
