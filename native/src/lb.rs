//! The load-balancing policy's choice among hosts: only hosts the index does
//! not judge stale (see `docs/native.md`). Its hooks are in [`crate::abi::lb`].
