//! The guard as an Envoy dynamic module (`libstaleguard_native.so`).
//!
//! The same guard as the proxy-wasm filter, loaded natively: Envoy calls the
//! exported `envoy_dynamic_module_on_*` hooks and the module calls Envoy back
//! through `envoy_dynamic_module_callback_*` functions. Start with [`index`],
//! the one copy of the validator's index per Envoy process that every hook
//! reads ([`index::judge`]), held in [`store`] (the engine's keys parsed
//! once, every value in one buffer); then [`abi`], the FFI boundary and with
//! [`allocator`] the only modules with `unsafe`
//! code: the ABI's types, the program init that refuses an Envoy of another
//! ABI ([`abi::version`]), and one submodule per extension ([`abi::http`]
//! the upstream HTTP filter, [`abi::bootstrap`] the poller, [`abi::lb`] the
//! load-balancing policy). [`allocator`], the module's global allocator,
//! maps large blocks on their own so that they go back to the kernel when
//! freed. [`lb`] is the policy's
//! choice among hosts; [`stats`] maps the engine's metrics to Envoy's. The decisions themselves are the
//! engine's (`staleguard_engine`, which the Wasm filter runs too): this crate adapts Envoy to them and decides
//! nothing of its own. When to choose this build, the Envoy versions it
//! loads in and its limits are in `docs/native.md`.
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used, clippy::panic))]

pub mod abi;
#[cfg(target_os = "linux")]
pub mod allocator;
pub mod index;
pub mod lb;
pub mod stats;
pub mod store;

/// Large blocks mapped on their own, the rest to Envoy's allocator
/// ([`allocator`]).
#[cfg(target_os = "linux")]
#[global_allocator]
static ALLOCATOR: allocator::Allocator = allocator::Allocator;
