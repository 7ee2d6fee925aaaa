//! Bytes written and read a piece at a time, for the binary forms of the
//! index (the packed answer's binary records, a gateway's bucket lines):
//! LEB128 numbers, addresses, and a reader that never reads past its input.

use std::net::IpAddr;

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
    fn reads_stop_at_the_end() {
        let mut r = Reader::new(&[1, 2, 3]);
        assert_eq!(r.u64(), None);
        assert_eq!(r.u16(), Some(0x0201));
        assert_eq!(r.take(2), None);
        assert_eq!(r.byte(), Some(3));
        assert_eq!(r.byte(), None);
    }
}
