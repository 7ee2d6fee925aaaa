//! The staleguard proxy-wasm filter: a verdict on every upstream host.
//!
//! Runs in Envoy as an *upstream* HTTP filter (one per cluster) and checks the
//! host Envoy chose against a local copy of the validator's index. Start with
//! [`check`] (one request's verdict), then [`sync`] (how the index is kept in
//! step with the validator), [`store`] (its layout in Envoy shared data, with
//! IP entries in [`buckets`], written by [`store::write`]) and [`lease`] (why
//! exactly one VM per Envoy process polls). [`root`] (the VM: lease, poll
//! schedule, answers, gauges) and [`request`] (one request: verdict, reply,
//! replay) do everything against the [`host::Host`] trait, and are tested
//! natively with a double; `glue` (built for `wasm32` only) implements that
//! trait over proxy-wasm hostcalls and forwards callbacks. The design and its
//! reasons are in `docs/filter.md`.
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used, clippy::panic))]

pub mod backoff;
pub mod buckets;
pub mod cache;
pub mod check;
pub mod config;
pub mod entry;
pub mod guard;
pub mod host;
pub mod lease;
pub mod members;
pub mod metrics;
pub mod replay;
pub mod request;
pub mod root;
pub mod secret;
pub mod steer;
pub mod store;
pub mod sync;
pub mod throttle;

#[cfg(test)]
mod fake;
