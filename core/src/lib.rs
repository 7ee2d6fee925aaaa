//! Shared language of staleguard: what the validator serves and how the filter judges it.
//!
//! Start with [`wire`]: the versioned JSON documents the validator serves (a
//! [`wire::Snapshot`] of every IP it knows, then [`wire::Changes`] deltas) and the
//! [`wire::IpRecord`] that says who holds an IP. [`verdict`] turns one record, the
//! service a gateway cluster means, and the freshness of the data into a
//! [`verdict::Verdict`]; both the filter (per request) and the validator (its
//! `/v1/verdict` endpoint) call the same [`verdict::decide`], so an operator's
//! `curl` and the data plane can never disagree. [`service`] names services;
//! [`cluster`] maps a gateway's Envoy clusters to them, for the filter and the
//! audit alike; [`batch`] is the audit's one-request verdict query. [`ip`] holds
//! the one canonical form of an address that both sides key the index by.
//! [`packed`] is the compact form of snapshots and changes gateways ask for;
//! [`bytes`] the LEB128 numbers and bounded reads its binary records and a
//! gateway's binary index values are made of; [`page`] how a large answer is
//! asked for in pages.
//!
//! The crate has no I/O and no runtime: it compiles to `wasm32-wasip1` for the
//! filter and to native code for the validator, and must never panic on any
//! input (clippy denies `unwrap`, `expect` and `panic` outside tests).
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used, clippy::panic))]

pub mod batch;
pub mod bytes;
pub mod cluster;
pub mod ip;
pub mod packed;
pub mod page;
pub mod service;
pub mod verdict;
pub mod wire;

pub use service::ServiceKey;
pub use verdict::{decide, Action, Policy, Reason, Verdict};
pub use wire::{Changes, Freshness, IpRecord, PodHolder, Snapshot, Tombstone};
