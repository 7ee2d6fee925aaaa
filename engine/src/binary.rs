//! The pieces the index's binary values are made of (bucket lines in
//! [`crate::buckets`], member lists in [`crate::members`]): the byte that
//! opens every such value; LEB128 numbers, addresses and the bounded reader
//! are [`staleguard_core::bytes`]'s, re-exported here.
//!
//! Every value of the `m4` layout opens with [`MAGIC`], then its load as a
//! LEB128 number. A value opening with an ASCII digit is a text value of an
//! earlier layout (`m2`/`m3`: `LOAD` in decimal), which was written under an
//! older load than any `m4` one, so readers take it as absent; any other
//! first byte is garbage.

pub use staleguard_core::bytes::{push_ip, push_varint, varint_len, Reader};

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
