//! The pieces the index's binary values are made of (bucket lines in
//! [`crate::buckets`], member lists in [`crate::members`]): the byte that
//! opens every such value, LEB128 numbers, and a reader that never reads
//! past its input.
//!
//! Every value of the `m4` layout opens with [`MAGIC`], then its load as a
//! LEB128 number. A value opening with an ASCII digit is a text value of an
//! earlier layout (`m2`/`m3`: `LOAD` in decimal), which was written under an
//! older load than any `m4` one, so readers take it as absent; any other
//! first byte is garbage.

use std::net::IpAddr;

/// The first byte of every binary value of the index: no text value of an
/// earlier layout starts with it (they start with a decimal load).
pub const MAGIC: u8 = 0xb4;

/// How a value's opening reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Opening<'a> {
    /// Empty, or a text value of an earlier layout: no entry.
    Absent,
    /// Neither: unreadable.
    Garbage,
    /// A binary value written under `load`, and what follows its load.
    Load(u64, &'a [u8]),
}

/// Reads the opening of a value: [`MAGIC`] and the load.
pub fn opening(bytes: &[u8]) -> Opening<'_> {
    match bytes.first() {
        None => Opening::Absent,
        Some(b) if b.is_ascii_digit() => Opening::Absent,
        Some(&MAGIC) => {
            let mut r = Reader::new(&bytes[1..]);
            match r.varint() {
                Some(load) => Opening::Load(load, r.rest()),
                None => Opening::Garbage,
            }
        }
        Some(_) => Opening::Garbage,
    }
}

/// Appends [`MAGIC`] and `load`.
pub fn push_opening(out: &mut Vec<u8>, load: u64) {
    out.push(MAGIC);
    push_varint(out, load);
}

/// Appends `n` as LEB128: 7 bits a byte, low bits first, the top bit set on
/// every byte but the last.
pub fn push_varint(out: &mut Vec<u8>, mut n: u64) {
    while n >= 0x80 {
        out.push((n as u8) | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
}

/// The bytes [`push_varint`] writes for `n`.
pub fn varint_len(n: u64) -> usize {
    let bits = 64 - (n | 1).leading_zeros() as usize;
    bits.div_ceil(7)
}

/// Appends the address bytes of `ip` (4 or 16, network order).
pub fn push_ip(out: &mut Vec<u8>, ip: &IpAddr) {
    match ip {
        IpAddr::V4(v4) => out.extend_from_slice(&v4.octets()),
        IpAddr::V6(v6) => out.extend_from_slice(&v6.octets()),
    }
}

/// A cursor over a byte slice: every read is bounded by the slice, and a
/// read that would pass its end is `None` (and consumes nothing).
#[derive(Debug, Clone)]
pub struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    /// A reader at the start of `bytes`.
    pub fn new(bytes: &'a [u8]) -> Self {
        Self { bytes }
    }

    /// True when every byte was read.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// What is left to read.
    pub fn rest(&self) -> &'a [u8] {
        self.bytes
    }

    /// The next `n` bytes.
    pub fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, tail) = self.bytes.split_at_checked(n)?;
        self.bytes = tail;
        Some(head)
    }

    /// The next byte.
    pub fn byte(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }

    /// The next `N` bytes as an array.
    pub fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.take(N)?.try_into().ok()
    }

    /// A little-endian `u64`.
    pub fn u64(&mut self) -> Option<u64> {
        self.array().map(u64::from_le_bytes)
    }

    /// A little-endian `u16`.
    pub fn u16(&mut self) -> Option<u16> {
        self.array().map(u16::from_le_bytes)
    }

    /// A LEB128 number as [`push_varint`] writes it: at most 10 bytes, no
    /// bits past 64, no needless trailing zero byte (so each number has one
    /// spelling).
    pub fn varint(&mut self) -> Option<u64> {
        let mut n = 0u64;
        for (i, byte) in self.bytes.iter().enumerate().take(10) {
            let low = u64::from(byte & 0x7f);
            let shift = 7 * i as u32;
            if shift == 63 && low > 1 {
                return None;
            }
            n |= low << shift;
            if byte & 0x80 == 0 {
                if i > 0 && *byte == 0 {
                    return None;
                }
                self.bytes = &self.bytes[i + 1..];
                return Some(n);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_round_trip_with_one_spelling_each() {
        for n in [
            0,
            1,
            127,
            128,
            300,
            16_383,
            16_384,
            u64::from(u32::MAX),
            u64::MAX,
        ] {
            let mut out = Vec::new();
            push_varint(&mut out, n);
            assert_eq!(out.len(), varint_len(n), "{n}");
            let mut r = Reader::new(&out);
            assert_eq!(r.varint(), Some(n));
            assert!(r.is_empty());
        }
        // Independent spellings.
        let mut out = Vec::new();
        push_varint(&mut out, 300);
        assert_eq!(out, [0xac, 0x02]);
        for bad in [
            &[0x80][..],                                                   // cut
            &[0x80, 0x00],                                                 // needless zero
            &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02], // past 64 bits
            &[0xff; 11],
        ] {
            assert_eq!(Reader::new(bad).varint(), None, "{bad:?}");
        }
    }

    #[test]
    fn an_opening_tells_binary_text_and_garbage_apart() {
        assert_eq!(opening(b""), Opening::Absent);
        assert_eq!(opening(b"7\n10.0.0.1 pr"), Opening::Absent, "an m3 bucket");
        assert_eq!(opening(b"{"), Opening::Garbage);
        assert_eq!(opening(&[MAGIC]), Opening::Garbage, "no load");
        assert_eq!(opening(&[MAGIC, 0xac, 0x02, 9]), Opening::Load(300, &[9]));
        let mut out = Vec::new();
        push_opening(&mut out, 5);
        assert_eq!(out, [MAGIC, 5]);
    }

    #[test]
    fn reads_stop_at_the_end() {
        let mut r = Reader::new(&[1, 2, 3]);
        assert_eq!(r.u64(), None);
        assert_eq!(r.u16(), Some(0x0201));
        assert_eq!(r.take(2), None);
        assert_eq!(r.byte(), Some(3));
        assert_eq!(r.byte(), None);
    }
}
