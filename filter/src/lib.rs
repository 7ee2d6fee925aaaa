//! The staleguard proxy-wasm filter (work in progress: see issue 5).
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used, clippy::panic))]
