//! The staleguard guard engine: what a gateway decides about every upstream
//! host, and when, with no host in it.
//!
//! The engine keeps a local copy of the validator's index (pod IP ->
//! identity) in step with the validator, and checks each request's chosen
//! host against it: allow, reject, or replay the request to a live member.
//! It runs in Envoy through an adapter: the proxy-wasm filter
//! (`staleguard-filter`) today, a native dynamic module next.
//!
//! # Where a new host starts
//!
//! [`host`] is the whole contract: implement its small traits
//! ([`host::SharedData`], [`host::Clock`], [`host::Stream`],
//! [`host::Callouts`], [`host::Stats`], [`host::Vm`]; [`host::Host`] is
//! their sum), make one [`root::Root`] per instance (a Wasm VM, a module's
//! worker), and forward the host's events to it: the configuration
//! ([`root::Root::configure`]), the timer ([`root::Root::tick`]), a call's
//! answer ([`root::Root::call_response`]) and shutdown ([`root::Root::done`]).
//! Each request gets a [`request::Filter`] from [`root::Root::filter`], fed
//! its headers ([`request::Filter::request_headers`], which answers with a
//! [`host::Next`]), its replay calls' answers and its response headers. The
//! engine logs through the `log` facade.
//!
//! # Reading order (top to bottom; no module imports one above it)
//!
//! - [`root`]: one instance: configuration, the poller's lease and
//!   schedule, applying the validator's answers, gauges.
//! - [`request`]: one request: verdict, reply, replay or steering.
//! - [`metrics`] (names and labels), [`steer`] (the body path's steering
//!   role), [`judgement`] (one request's verdict), [`replay`] (a rejected
//!   request's replay to a live member), [`sync`] (the poller's protocol
//!   state machine).
//! - [`config`] (the plugin configuration), [`cache`] (per-instance read
//!   caches), [`lease`] (why exactly one instance per Envoy polls),
//!   [`store::write`] (the index writer).
//! - [`store`] (the index's layout in shared data and its reader),
//!   [`members`] (each service's live members), [`guard`] (the
//!   blast-radius guard on the validator's answers).
//! - [`buckets`] (IP entries in hash buckets).
//! - [`binary`] (the bytes bucket lines and member lists are made of),
//!   [`host`], [`entry`], [`backoff`], [`log_budget`], [`secret`].
//!
//! The design and its reasons are in `docs/filter.md`.
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used, clippy::panic))]

pub mod backoff;
pub mod binary;
pub mod buckets;
pub mod cache;
pub mod config;
pub mod entry;
pub mod guard;
pub mod host;
pub mod judgement;
pub mod lease;
pub mod log_budget;
pub mod members;
pub mod metrics;
pub mod replay;
pub mod request;
pub mod root;
pub mod secret;
pub mod steer;
pub mod store;
pub mod sync;

#[cfg(test)]
mod fake;
