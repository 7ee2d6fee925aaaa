//! One buffer for every value of the store: a value is a [`Span`] of it.
//!
//! Kept as one exact-size box each, the index's values (16,384 bucket lines
//! of about 240 bytes at 150,000 IPs, a member list per service) are small
//! allocations that a reset frees and allocates again, interleaved with the
//! sync's own short-lived ones; the allocator keeps what they leave: free
//! objects in spans still in use and free pages inside huge pages still in
//! use, which its release does not give back. In one buffer they are a
//! single large allocation, which the module's allocator maps on its own
//! ([`crate::allocator`]): grown or shrunk by the kernel, and given back to
//! it whole when freed.
//!
//! A write appends its value (or overwrites the old one in place when it is
//! no longer); what it replaces becomes garbage, counted. Once the garbage
//! is more than a quarter of the live bytes (and more than [`MIN_GARBAGE`]),
//! the store compacts ([`Arena::compact`]): the live values are copied into
//! a new buffer sized to them with [`HEADROOM`], and the old one is freed
//! whole. So the buffer holds at most 1.25 times the live bytes (and one
//! value) besides its room, and a reset, which rewrites every value, costs
//! about four compactions of the index's bytes (2.9 MB at 150,000 IPs, a
//! copy of well under a millisecond each, under the write lock). A buffer
//! that grew during a sync is compacted to size at the sync's commit
//! ([`Arena::oversized`]). Its room past the values (an eighth of them) is
//! allocated but not touched until written, so not resident.

/// Where a value lies in the arena: `len` bytes at `at`. An empty span is
/// no value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Span {
    at: u32,
    len: u32,
}

impl Span {
    /// The value's length in bytes.
    pub(crate) fn len(self) -> usize {
        self.len as usize
    }

    /// Whether the span holds no value.
    pub(crate) fn is_empty(self) -> bool {
        self.len == 0
    }
}

/// Garbage below which the arena does not compact: a compaction walks every
/// slot of the store (16,384 buckets and more), so it waits for at least
/// this much written since the last.
pub(crate) const MIN_GARBAGE: usize = 64 * 1024;

/// Room a compaction or a growth leaves after the bytes it needs, as a
/// fraction of them (1/8): the writes that follow append there before the
/// buffer grows again.
const HEADROOM: usize = 8;

/// The capacity of a buffer that must hold `needed` bytes: `needed` and its
/// headroom. Whole huge pages are not needed: a buffer of
/// [`crate::allocator::LARGE`] bytes or more is a mapping of its own, whose
/// pages go back to the kernel when it is freed or shrunk.
pub(crate) fn capacity_for(needed: usize) -> usize {
    needed + needed / HEADROOM
}

/// The store's values in one buffer (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct Arena {
    bytes: Vec<u8>,
    /// Bytes of the buffer no span names any more.
    garbage: usize,
}

/// The arena cannot name a byte past `u32::MAX`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Full;

impl Arena {
    /// The bytes of `span` (empty for a span this arena never gave).
    pub(crate) fn get(&self, span: Span) -> &[u8] {
        let start = span.at as usize;
        self.bytes
            .get(start..start + span.len())
            .unwrap_or_default()
    }

    /// Writes `value` in place of `old`'s (a span of this arena, or empty):
    /// over it when it fits, else appended. Returns the value's span; an
    /// empty value is the empty span. `old`'s bytes that the value does not
    /// reuse are garbage.
    pub(crate) fn put(&mut self, old: Span, value: &[u8]) -> Result<Span, Full> {
        if value.is_empty() {
            self.garbage += old.len();
            return Ok(Span::default());
        }
        if value.len() <= old.len() {
            let start = old.at as usize;
            if let Some(place) = self.bytes.get_mut(start..start + value.len()) {
                place.copy_from_slice(value);
                self.garbage += old.len() - value.len();
                return Ok(Span {
                    at: old.at,
                    len: value.len() as u32,
                });
            }
        }
        let at = u32::try_from(self.bytes.len()).map_err(|_| Full)?;
        let len = u32::try_from(value.len()).map_err(|_| Full)?;
        at.checked_add(len).ok_or(Full)?;
        let needed = self.bytes.len() + value.len();
        if needed > self.bytes.capacity() {
            // By its headroom rather than `Vec`'s doubling, which would
            // leave up to twice the values: a large buffer grows in the
            // kernel (`mremap`), without a copy.
            self.bytes
                .reserve_exact(capacity_for(needed) - self.bytes.len());
        }
        self.bytes.extend_from_slice(value);
        self.garbage += old.len();
        Ok(Span { at, len })
    }

    /// Whether the garbage is worth a compaction: more than a quarter of the
    /// live bytes and than [`MIN_GARBAGE`], or everything (an empty arena's
    /// buffer is freed at once).
    pub(crate) fn wants_compaction(&self) -> bool {
        let live = self.live();
        (self.garbage > live / 4 && self.garbage >= MIN_GARBAGE)
            || (live == 0 && self.bytes.capacity() > 0)
    }

    /// Whether the buffer is larger than a compaction would make it: after
    /// it grew (a sync's writes), the room past the headroom is given back at
    /// the commit.
    pub(crate) fn oversized(&self) -> bool {
        let (capacity, live) = (self.bytes.capacity(), self.live());
        capacity > capacity_for(live) && capacity - live > live / 4 + MIN_GARBAGE
    }

    /// Copies the values of `spans` (every live span of this arena, each
    /// once) into a new buffer sized to them, moves each span to its copy,
    /// and frees the old buffer.
    pub(crate) fn compact<'a>(&mut self, spans: impl Iterator<Item = &'a mut Span>) {
        let live = self.live();
        let mut bytes = Vec::with_capacity(capacity_for(live));
        for span in spans.filter(|s| !s.is_empty()) {
            let value = self.get(*span);
            // The new buffer holds at most the old one's bytes.
            span.at = bytes.len() as u32;
            span.len = value.len() as u32;
            bytes.extend_from_slice(value);
        }
        self.bytes = bytes;
        self.garbage = 0;
    }

    /// Bytes the spans name.
    pub(crate) fn live(&self) -> usize {
        self.bytes.len() - self.garbage
    }

    /// Bytes no span names.
    pub(crate) fn garbage(&self) -> usize {
        self.garbage
    }

    /// The buffer's allocated bytes past its end.
    pub(crate) fn spare(&self) -> usize {
        self.bytes.capacity() - self.bytes.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// A store of `keys` spans over one arena, run as the store runs it:
    /// every put, then a compaction whenever the arena wants one.
    #[derive(Default)]
    struct Model {
        arena: Arena,
        spans: BTreeMap<u8, Span>,
        compactions: usize,
    }

    impl Model {
        fn set(&mut self, key: u8, value: &[u8]) {
            let old = self.spans.get(&key).copied().unwrap_or_default();
            let span = self.arena.put(old, value).unwrap();
            if span.is_empty() {
                self.spans.remove(&key);
            } else {
                self.spans.insert(key, span);
            }
            if self.arena.wants_compaction() {
                self.arena.compact(self.spans.values_mut());
                self.compactions += 1;
            }
        }

        fn get(&self, key: u8) -> Option<&[u8]> {
            self.spans.get(&key).map(|s| self.arena.get(*s))
        }
    }

    #[test]
    fn a_reset_rewriting_every_value_leaves_at_most_a_quarter_of_garbage() {
        let mut model = Model::default();
        // 16 bucket lines of 20,000 bytes: 320,000 live bytes.
        let line = |k: u8, round: u8, len: usize| vec![k ^ round; len];
        for k in 0..16 {
            model.set(k, &line(k, 0, 20_000));
        }
        assert_eq!(model.compactions, 0);
        // A reset: every value again, longer (appended, never in place).
        for k in 0..16 {
            model.set(k, &line(k, 1, 20_001));
            assert!(model.arena.garbage() <= model.arena.live() / 4 + 20_001);
        }
        assert!(model.compactions >= 3, "{}", model.compactions);
        assert!(model.arena.bytes.len() <= model.arena.live() * 5 / 4 + 20_001);
        for k in 0..16 {
            assert_eq!(model.get(k), Some(&line(k, 1, 20_001)[..]));
        }
    }

    #[test]
    fn a_value_no_longer_than_the_one_it_replaces_is_written_in_place() {
        let mut arena = Arena::default();
        let a = arena.put(Span::default(), b"0123456789").unwrap();
        let b = arena.put(a, b"abcd").unwrap();
        assert_eq!(b.at, a.at);
        assert_eq!(arena.get(b), b"abcd");
        assert_eq!((arena.live(), arena.garbage()), (4, 6));
        let c = arena.put(b, b"longer than four").unwrap();
        assert_ne!(c.at, b.at);
        assert_eq!((arena.live(), arena.garbage()), (16, 10));
    }

    #[test]
    fn an_arena_left_empty_frees_its_buffer() {
        let mut model = Model::default();
        model.set(1, b"value");
        model.set(1, b"");
        assert_eq!(model.compactions, 1);
        assert_eq!(model.arena.bytes.capacity(), 0);
        assert_eq!(model.arena.live() + model.arena.garbage(), 0);
    }
}
