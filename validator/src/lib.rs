//! The staleguard validator: watches Pods, Services and EndpointSlices and keeps
//! a fresh pod IP -> identity index.
//!
//! Start with [`index`], the pure state machine that turns watch events into
//! records.
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used, clippy::panic))]

pub mod index;
