//! The staleguard proxy-wasm filter: the engine (`staleguard-engine`) on
//! proxy-wasm hostcalls.
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used, clippy::panic))]

pub use staleguard_engine::{
    backoff, buckets, cache, check, config, guard, host, lease, members, metrics, replay, request,
    root, secret, steer, store, sync, throttle,
};

#[cfg(target_arch = "wasm32")]
mod glue;
