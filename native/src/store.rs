//! The index's store: the engine's shared-data layout
//! ([`staleguard_engine::store`]) in process memory, its keys parsed once.
//!
//! The engine reads and writes the index through [`SharedData`], with text
//! keys. Kept as a map of those strings, each bucket of IPs costs a hash
//! node, a key string and a value vector besides its bytes. Here a key is
//! parsed into what it names ([`Key`]): a bucket is a slot in its layout's
//! array (`staleguard/ipb/<B>/<i>` is slot `i` of the layout of `B`
//! buckets), a member list is keyed by its service id, the sync state has a
//! slot of its own (every request reads it), and every other key (services,
//! the lease, counters) goes to a small map of its text. Every value is a
//! span of one buffer ([`arena`]) holding the engine's bytes as they are, so
//! the verdict code reads what the Wasm filter reads in Envoy's shared data,
//! and the allocator sees one large block instead of a small one per bucket.
//! [`Store::peek`] lends a value without copying it; [`SharedData::get`]
//! copies it, as the engine's trait asks.
//!
//! Shared data never forgets a key; this store does. An empty value is no
//! value (it reads as absent, cas token 0: every reader of the index reads
//! absent and empty alike), so the buckets, services and member lists a reset
//! retires give their memory back (at the arena's next compaction), and a
//! layout whose buckets are all empty is dropped whole.

mod arena;

use std::collections::HashMap;

use staleguard_engine::buckets::MAX_BUCKETS;
use staleguard_engine::host::{SharedData, StoreError};
use staleguard_engine::store::META_KEY;

use arena::{Arena, Span};

/// Where the engine keeps bucket `<i>` of a layout of `<B>`:
/// `staleguard/ipb/<B>/<i>` ([`staleguard_engine::buckets::bucket_key`]).
const BUCKET_PREFIX: &str = "staleguard/ipb/";

/// Where the engine keeps a service's member list: `staleguard/members/`
/// and the service id in 16 hex digits
/// ([`staleguard_engine::members::members_key`]).
const MEMBERS_PREFIX: &str = "staleguard/members/";

/// What a key names, parsed from its text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Key<'a> {
    /// `staleguard/meta`, the sync state.
    Meta,
    /// Bucket `index` of the layout of `buckets` buckets.
    Bucket {
        /// The layout's bucket count (a power of two).
        buckets: u32,
        /// The bucket, below `buckets`.
        index: u32,
    },
    /// The member list of the service with this id.
    Members(u64),
    /// Any other key (services, the lease, the load counter, ...), kept by
    /// its text.
    Named(&'a str),
}

impl<'a> Key<'a> {
    /// Parses `key`. Only the text the engine writes parses as a bucket or a
    /// member list (decimal without leading zeros, 16 lowercase hex digits),
    /// so two texts never name one slot; anything else is [`Key::Named`].
    pub fn parse(key: &'a str) -> Self {
        if key == META_KEY {
            return Key::Meta;
        }
        let parsed = if let Some(rest) = key.strip_prefix(BUCKET_PREFIX) {
            rest.split_once('/').and_then(|(buckets, index)| {
                let buckets =
                    decimal(buckets).filter(|b| b.is_power_of_two() && *b <= MAX_BUCKETS)?;
                let index = decimal(index).filter(|i| *i < buckets)?;
                Some(Key::Bucket { buckets, index })
            })
        } else if let Some(id) = key.strip_prefix(MEMBERS_PREFIX) {
            let lower_hex = id.len() == 16
                && id
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
            lower_hex
                .then(|| u64::from_str_radix(id, 16).ok())
                .flatten()
                .map(Key::Members)
        } else {
            None
        };
        parsed.unwrap_or(Key::Named(key))
    }
}

/// A `u32` written as the engine writes it: digits, no sign, no leading zero.
fn decimal(text: &str) -> Option<u32> {
    let canonical = !text.is_empty()
        && text.bytes().all(|b| b.is_ascii_digit())
        && (text == "0" || !text.starts_with('0'));
    canonical.then(|| text.parse().ok()).flatten()
}

/// Where one value lies in the arena and the cas token of its write; an
/// empty value is no value.
#[derive(Debug, Clone, Copy, Default)]
struct Slot {
    value: Span,
    cas: u32,
}

impl Slot {
    /// The token a cas write compares with: 0 for no value.
    fn cas(&self) -> u32 {
        if self.value.is_empty() {
            0
        } else {
            self.cas
        }
    }
}

/// The buckets of one layout: slot `i` is bucket `i`.
#[derive(Debug)]
struct Layout {
    buckets: u32,
    slots: Box<[Slot]>,
    /// Slots holding a value: the layout is dropped when none does.
    filled: u32,
}

/// The index's store (see the module docs).
#[derive(Debug, Default)]
pub struct Store {
    meta: Slot,
    /// One per bucket count in use: one, and two while a reset re-lays the
    /// index (the old layout's buckets are cleared at the next write).
    layouts: Vec<Layout>,
    members: HashMap<u64, Slot>,
    named: HashMap<Box<str>, Slot>,
    /// Every slot's bytes.
    arena: Arena,
    next_cas: u32,
}

/// What a [`Store`] holds, in bytes of the values and of the structures
/// that hold them (the allocator's rounding aside).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Footprint {
    /// Bucket values (the bucket lines).
    pub bucket_values: usize,
    /// The layouts' slot arrays.
    pub bucket_slots: usize,
    /// Member-list values.
    pub member_values: usize,
    /// Every other value, with its key's text.
    pub named: usize,
    /// The two maps' tables (their capacity).
    pub tables: usize,
    /// The arena's bytes that no value holds any more, until its next
    /// compaction.
    pub garbage: usize,
    /// The arena's buffer past its last value: room for the next writes.
    pub spare: usize,
}

impl Footprint {
    /// Everything together.
    pub fn total(&self) -> usize {
        let Footprint {
            bucket_values,
            bucket_slots,
            member_values,
            named,
            tables,
            garbage,
            spare,
        } = *self;
        bucket_values + bucket_slots + member_values + named + tables + garbage + spare
    }
}

/// A hash table's bytes at its capacity: one entry and one control byte a
/// bucket, at most 7 entries in 8 buckets (hashbrown's layout).
fn table_bytes<K, V>(map: &HashMap<K, V>) -> usize {
    let capacity = map.capacity();
    if capacity == 0 {
        return 0;
    }
    let buckets = if capacity < 8 {
        (capacity + 1).next_power_of_two()
    } else {
        (capacity * 8 / 7).next_power_of_two()
    };
    buckets * (size_of::<(K, V)>() + 1)
}

impl Store {
    /// The next cas token: never 0, which means "no value".
    fn next_cas(&mut self) -> u32 {
        self.next_cas = self.next_cas.wrapping_add(1).max(1);
        self.next_cas
    }

    fn layout(&self, buckets: u32) -> Option<&Layout> {
        self.layouts.iter().find(|l| l.buckets == buckets)
    }

    /// The slot `key` names, if it has one.
    fn slot(&self, key: Key<'_>) -> Option<&Slot> {
        match key {
            Key::Meta => Some(&self.meta),
            Key::Bucket { buckets, index } => self
                .layout(buckets)
                .and_then(|l| l.slots.get(index as usize)),
            Key::Members(id) => self.members.get(&id),
            Key::Named(name) => self.named.get(name),
        }
    }

    /// The value of `key` and its cas token, lent from the store: what
    /// [`SharedData::get`] returns, without the copy (a request reads the
    /// sync state and a bucket or two; none of it needs to be its own).
    pub fn peek(&self, key: &str) -> Option<(&[u8], u32)> {
        self.slot(Key::parse(key))
            .filter(|s| !s.value.is_empty())
            .map(|s| (self.arena.get(s.value), s.cas))
    }

    /// What the store holds (see [`Footprint`]).
    pub fn footprint(&self) -> Footprint {
        let slot = size_of::<Slot>();
        Footprint {
            bucket_values: self
                .layouts
                .iter()
                .flat_map(|l| l.slots.iter())
                .map(|s| s.value.len())
                .sum(),
            bucket_slots: self.layouts.iter().map(|l| l.slots.len() * slot).sum(),
            member_values: self.members.values().map(|s| s.value.len()).sum(),
            named: self.meta.value.len()
                + self
                    .named
                    .iter()
                    .map(|(k, s)| k.len() + s.value.len())
                    .sum::<usize>(),
            tables: table_bytes(&self.members) + table_bytes(&self.named),
            garbage: self.arena.garbage(),
            spare: self.arena.spare(),
        }
    }

    /// Number of buckets holding a value, over every layout.
    pub fn filled_buckets(&self) -> usize {
        self.layouts.iter().map(|l| l.filled as usize).sum()
    }

    /// Writes `value` to a bucket slot (empty: clears it, and drops a layout
    /// left with no value).
    fn set_bucket(
        &mut self,
        buckets: u32,
        index: u32,
        value: &[u8],
        cas: u32,
    ) -> Result<(), StoreError> {
        let at = match self.layouts.iter().position(|l| l.buckets == buckets) {
            Some(at) => at,
            None if value.is_empty() => return Ok(()),
            None => {
                self.layouts.push(Layout {
                    buckets,
                    slots: vec![Slot::default(); buckets as usize].into_boxed_slice(),
                    filled: 0,
                });
                self.layouts.len() - 1
            }
        };
        let Some(layout) = self.layouts.get_mut(at) else {
            return Ok(());
        };
        let Some(slot) = layout.slots.get_mut(index as usize) else {
            return Ok(());
        };
        let was_empty = slot.value.is_empty();
        put(&mut self.arena, slot, value, cas)?;
        match (was_empty, value.is_empty()) {
            (true, false) => layout.filled += 1,
            (false, true) => layout.filled = layout.filled.saturating_sub(1),
            _ => {}
        }
        if layout.filled == 0 {
            self.layouts.swap_remove(at);
        }
        Ok(())
    }

    /// Compacts the arena when its garbage is worth it, or at a `commit`
    /// (the sync state written: a sync's writes are done) when it grew past
    /// what its values need (see [`arena`]): every slot's value moves to the
    /// new buffer.
    fn compact_if_due(&mut self, commit: bool) {
        if !(self.arena.wants_compaction() || (commit && self.arena.oversized())) {
            return;
        }
        let Store {
            meta,
            layouts,
            members,
            named,
            arena,
            next_cas: _,
        } = self;
        let slots = std::iter::once(meta)
            .chain(layouts.iter_mut().flat_map(|l| l.slots.iter_mut()))
            .chain(members.values_mut())
            .chain(named.values_mut());
        arena.compact(slots.map(|s| &mut s.value));
    }
}

/// Writes `value` into `slot` (its bytes into `arena`) under `cas`.
fn put(arena: &mut Arena, slot: &mut Slot, value: &[u8], cas: u32) -> Result<(), StoreError> {
    let span = arena
        .put(slot.value, value)
        .map_err(|_| StoreError::Host("the native index is over 4 GiB".to_owned()))?;
    *slot = Slot { value: span, cas };
    Ok(())
}

/// Writes `value` into a map's entry for `key`; empty removes the entry, and
/// a map left mostly empty gives its table back.
fn set_in<K: std::hash::Hash + Eq>(
    map: &mut HashMap<K, Slot>,
    arena: &mut Arena,
    key: K,
    value: &[u8],
    cas: u32,
) -> Result<(), StoreError> {
    if !value.is_empty() {
        return put(arena, map.entry(key).or_default(), value, cas);
    }
    if let Some(mut old) = map.remove(&key) {
        put(arena, &mut old, value, cas)?;
    }
    if map.len() * 4 < map.capacity() {
        map.shrink_to_fit();
    }
    Ok(())
}

impl SharedData for Store {
    fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, u32), StoreError> {
        Ok(self
            .peek(key)
            .map_or((None, 0), |(value, cas)| (Some(value.to_vec()), cas)))
    }

    fn set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        let key = Key::parse(key);
        let current = self.slot(key).map_or(0, Slot::cas);
        if let Some(cas) = cas {
            if cas != 0 && cas != current {
                return Err(StoreError::CasMismatch);
            }
        }
        let cas = self.next_cas();
        match key {
            Key::Meta => put(&mut self.arena, &mut self.meta, value, cas)?,
            Key::Bucket { buckets, index } => self.set_bucket(buckets, index, value, cas)?,
            Key::Members(id) => set_in(&mut self.members, &mut self.arena, id, value, cas)?,
            Key::Named(name) => set_in(&mut self.named, &mut self.arena, name.into(), value, cas)?,
        }
        self.compact_if_due(matches!(key, Key::Meta));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use staleguard_core::wire::{Delta, Freshness};
    use staleguard_core::{IpRecord, PodHolder, ServiceKey};
    use staleguard_engine::buckets::{bucket_key, CompactRecord};
    use staleguard_engine::entry::Entry;
    use staleguard_engine::members::members_key;
    use staleguard_engine::store::write::Writer;
    use staleguard_engine::store::IndexReader;
    use staleguard_engine::store::{service_key, LEASE_KEY, LOADS_KEY};
    use std::collections::BTreeMap;

    #[test]
    fn every_key_the_engine_writes_parses_to_what_it_names() {
        assert_eq!(Key::parse(META_KEY), Key::Meta);
        assert_eq!(
            Key::parse(&bucket_key(32_768, 12_345)),
            Key::Bucket {
                buckets: 32_768,
                index: 12_345
            }
        );
        assert_eq!(
            Key::parse(&bucket_key(1_024, 0)),
            Key::Bucket {
                buckets: 1_024,
                index: 0
            }
        );
        assert_eq!(
            Key::parse(&bucket_key(MAX_BUCKETS, MAX_BUCKETS - 1)),
            Key::Bucket {
                buckets: MAX_BUCKETS,
                index: MAX_BUCKETS - 1
            }
        );
        let cart = ServiceKey::new("shop", "cart");
        assert_eq!(
            Key::parse(&members_key(&cart)),
            Key::Members(staleguard_engine::buckets::service_id(&cart))
        );
        for named in [
            LEASE_KEY.to_owned(),
            LOADS_KEY.to_owned(),
            service_key(&cart),
            "staleguard.config_refused.0123456789abcdef".to_owned(),
        ] {
            assert_eq!(Key::parse(&named), Key::Named(&named));
        }
    }

    #[test]
    fn a_key_the_engine_would_not_write_is_kept_by_its_text() {
        for odd in [
            "staleguard/ipb/1000/1",               // not a power of two
            "staleguard/ipb/1024/1024",            // past the layout
            "staleguard/ipb/1024/01",              // a second text for bucket 1
            "staleguard/ipb/1024/+1",              // likewise
            "staleguard/ipb/1024",                 // no index
            "staleguard/ipb/0/0",                  // no layout has no bucket
            "staleguard/ipb/33554432/0",           // more buckets than any layout
            "staleguard/members/0123",             // too short
            "staleguard/members/0123456789ABCDEF", // upper case
            "staleguard/metadata",
            "",
        ] {
            assert_eq!(Key::parse(odd), Key::Named(odd), "{odd:?}");
        }
        let mut store = Store::default();
        store.set("staleguard/ipb/1024/01", b"kept", None).unwrap();
        assert_eq!(
            store.get("staleguard/ipb/1024/01").unwrap().0.as_deref(),
            Some(&b"kept"[..])
        );
        assert_eq!(store.get(&bucket_key(1_024, 1)).unwrap(), (None, 0));
    }

    #[test]
    fn every_key_form_round_trips_and_empty_is_absent() {
        let cart = ServiceKey::new("shop", "cart");
        let keys = [
            META_KEY.to_owned(),
            bucket_key(1_024, 7),
            bucket_key(2_048, 7),
            members_key(&cart),
            service_key(&cart),
            LEASE_KEY.to_owned(),
        ];
        let mut store = Store::default();
        for key in &keys {
            assert_eq!(store.get(key).unwrap(), (None, 0), "{key}");
            store.set(key, key.as_bytes(), None).unwrap();
        }
        for key in &keys {
            let (value, cas) = store.get(key).unwrap();
            assert_eq!(value.as_deref(), Some(key.as_bytes()), "{key}");
            assert_ne!(cas, 0, "{key}");
        }
        assert_eq!(store.layouts.len(), 2, "two layouts side by side");
        for key in &keys {
            store.set(key, b"", None).unwrap();
            assert_eq!(store.get(key).unwrap(), (None, 0), "{key}");
        }
        assert!(store.layouts.is_empty(), "an empty layout is dropped");
        assert!(store.members.is_empty() && store.named.is_empty());
        assert_eq!(store.footprint().total(), 0);
    }

    #[test]
    fn cas_writes_only_over_the_value_they_read() {
        for key in [
            META_KEY.to_owned(),
            bucket_key(1_024, 3),
            members_key(&ServiceKey::new("shop", "cart")),
            LOADS_KEY.to_owned(),
        ] {
            let mut store = Store::default();
            let (_, cas0) = store.get(&key).unwrap();
            store.set(&key, b"a", Some(cas0)).unwrap();
            let (value, cas1) = store.get(&key).unwrap();
            assert_eq!(value.as_deref(), Some(&b"a"[..]));
            assert_ne!(cas1, cas0);
            store.set(&key, b"b", Some(cas1)).unwrap();
            assert_eq!(
                store.set(&key, b"c", Some(cas1)),
                Err(StoreError::CasMismatch),
                "{key}"
            );
            assert_eq!(store.get(&key).unwrap().0.as_deref(), Some(&b"b"[..]));
            // No check without a token, or with 0.
            store.set(&key, b"d", None).unwrap();
            store.set(&key, b"e", Some(0)).unwrap();
        }
        // The engine's counter: ids are unique.
        let mut store = Store::default();
        let ids: Vec<u64> = (0..3)
            .map(|_| staleguard_engine::store::next_id(&mut store, LOADS_KEY).unwrap())
            .collect();
        assert_eq!(ids, [1, 2, 3]);
    }

    /// `n` pods on 10.x.y.z in 100 services, as a poller reads them.
    fn snapshot(generation: u64, n: u32) -> staleguard_core::Snapshot<CompactRecord> {
        let service = |i: u32| ServiceKey::new("shop", format!("cart-{}", i % 100));
        staleguard_core::Snapshot {
            v: 1,
            epoch: 1,
            generation,
            freshness: Freshness {
                fresh: true,
                age_ms: Some(0),
            },
            services: (0..100).map(service).collect(),
            records: (1..=n)
                .map(|i| {
                    let ip = std::net::Ipv4Addr::from(0x0a00_0000 + i).into();
                    CompactRecord::of(&IpRecord::held_by(
                        ip,
                        vec![PodHolder::ready_member(
                            "shop",
                            format!("p-{i}"),
                            "u",
                            service(i),
                        )],
                    ))
                })
                .collect(),
        }
    }

    #[test]
    fn the_engines_writer_and_reader_run_on_it_and_a_replaced_layout_is_freed() {
        let mut store = Store::default();
        let mut writer = Writer::default();
        writer
            .write_snapshot(&mut store, 1, &mut snapshot(1, 100))
            .unwrap();
        assert_eq!(store.layouts.len(), 1);
        let small = store.footprint();
        // 40,000 IPs take a layout of more buckets: both stand until the
        // next write clears the old one.
        let meta = writer
            .write_snapshot(&mut store, 2, &mut snapshot(2, 40_000))
            .unwrap();
        assert_eq!(store.layouts.len(), 2);
        let view = IndexReader::new(&store);
        assert_eq!(view.meta(), Some(meta));
        let ip = std::net::Ipv4Addr::from(0x0a00_0000 + 40_000).into();
        assert!(matches!(view.record(&meta, &ip), Entry::Present(_)));
        let delta = Delta {
            v: 1,
            epoch: 1,
            since: 2,
            generation: 3,
            freshness: Freshness {
                fresh: true,
                age_ms: Some(0),
            },
            services_added: vec![],
            services_removed: vec![],
            upserts: vec![],
            removed: (1..=40_000)
                .map(|i| std::net::Ipv4Addr::from(0x0a00_0000 + i).into())
                .collect(),
        };
        writer
            .write_delta(&mut store, 3, meta.load, &delta)
            .unwrap();
        assert!(
            store.layouts.is_empty(),
            "the old layout cleared, every bucket of the new one emptied"
        );
        assert_eq!(store.filled_buckets(), 0);
        assert!(store.footprint().bucket_values == 0 && small.bucket_values > 0);
        assert!(matches!(
            IndexReader::new(&store).record(&meta, &ip),
            Entry::Absent
        ));
    }

    #[test]
    fn a_synced_index_leaves_its_arena_compacted_to_what_its_values_need() {
        let mut store = Store::default();
        let mut writer = Writer::default();
        let meta = writer
            .write_snapshot(&mut store, 1, &mut snapshot(1, 20_000))
            .unwrap();
        assert!(!store.arena.oversized(), "{:?}", store.footprint());
        let footprint = store.footprint();
        let values = store.arena.live();
        let buffer = values + footprint.garbage + footprint.spare;
        assert!(buffer <= arena::capacity_for(values), "{footprint:?}");
        // A reset rewrites every bucket: the garbage it leaves is compacted
        // away as it goes, and the buffer is sized again at the commit.
        let mut again = snapshot(2, 20_000);
        again.epoch = 2;
        writer.write_snapshot(&mut store, 2, &mut again).unwrap();
        let after = store.footprint();
        assert!(!store.arena.oversized(), "{after:?}");
        assert!(
            after.garbage <= values / 4 + arena::MIN_GARBAGE,
            "{after:?}"
        );
        let ip = std::net::Ipv4Addr::from(0x0a00_0000 + 20_000).into();
        let view = IndexReader::new(&store);
        let meta2 = view.meta().unwrap();
        assert_ne!(meta2.load, meta.load);
        assert!(matches!(view.record(&meta2, &ip), Entry::Present(_)));
    }

    #[test]
    fn a_bucket_costs_its_bytes_and_one_slot() {
        let mut store = Store::default();
        store
            .set(&bucket_key(1_024, 1), b"7\n10.0.0.1 pr", None)
            .unwrap();
        store
            .set(&bucket_key(1_024, 2), b"7\n10.0.0.2 pr", None)
            .unwrap();
        let footprint = store.footprint();
        assert_eq!(footprint.bucket_values, 26);
        assert_eq!(footprint.bucket_slots, 1_024 * size_of::<Slot>());
        assert_eq!(store.filled_buckets(), 2);
        store.set(&bucket_key(1_024, 1), b"", None).unwrap();
        assert_eq!(store.filled_buckets(), 1);
        assert_eq!(store.layouts.len(), 1, "bucket 2 still holds a value");
    }

    /// Keys of every form, two layouts among them.
    fn model_keys() -> Vec<String> {
        let mut keys = vec![META_KEY.to_owned(), LEASE_KEY.to_owned()];
        for i in 0..6 {
            keys.push(bucket_key(1_024, i * 100));
            keys.push(bucket_key(2_048, i * 100));
            let service = ServiceKey::new("shop", format!("s{i}"));
            keys.push(members_key(&service));
            keys.push(service_key(&service));
        }
        keys
    }

    #[derive(Debug, Clone)]
    enum Op {
        Set(usize, Vec<u8>),
        Delete(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0usize..26, prop::collection::vec(any::<u8>(), 1..6000))
                .prop_map(|(k, v)| Op::Set(k, v)),
            1 => (0usize..26).prop_map(Op::Delete),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// Random sets, overwrites (shorter: in place; longer: appended)
        /// and deletes over keys of every form, with the arena compactions
        /// they cause, read as a plain map reads them, by `get` and `peek`
        /// alike; the arena never holds more garbage than its rule allows.
        #[test]
        fn the_store_reads_as_a_map_through_writes_and_arena_compactions(
            ops in prop::collection::vec(op(), 1..300),
        ) {
            let keys = model_keys();
            let mut store = Store::default();
            let mut map: BTreeMap<usize, Vec<u8>> = BTreeMap::new();
            for op in ops {
                match op {
                    Op::Set(k, v) => {
                        store.set(&keys[k], &v, None).unwrap();
                        map.insert(k, v);
                    }
                    Op::Delete(k) => {
                        store.set(&keys[k], b"", None).unwrap();
                        map.remove(&k);
                    }
                }
                for (k, key) in keys.iter().enumerate() {
                    let want = map.get(&k).map(Vec::as_slice);
                    let (got, cas) = store.get(key).unwrap();
                    prop_assert_eq!(got.as_deref(), want, "{}", key);
                    prop_assert_eq!(store.peek(key), want.map(|v| (v, cas)), "{}", key);
                    prop_assert_eq!(cas == 0, want.is_none());
                }
                let live: usize = map.values().map(Vec::len).sum();
                prop_assert_eq!(store.arena.live(), live);
                prop_assert!(
                    store.footprint().garbage <= (live / 4).max(arena::MIN_GARBAGE) + 6000,
                    "garbage {} over live {}", store.footprint().garbage, live
                );
            }
        }
    }
}
