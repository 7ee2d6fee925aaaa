//! The staleguard proxy-wasm filter: the engine ([`staleguard_engine`]) on
//! proxy-wasm.
//!
//! Runs in Envoy as an *upstream* HTTP filter (one per cluster) and checks the
//! host Envoy chose against a local copy of the validator's index. Every
//! decision is the engine's; this crate is the adapter: `glue` (built for
//! `wasm32` only) implements the engine's host traits over
//! `proxy_wasm::hostcalls`, forwards the SDK's callbacks to the engine's
//! `Root` and `Filter`, maps the engine's `Next` to proxy-wasm's `Action`, and
//! installs the panic hook. The design and its reasons are in
//! `docs/filter.md`.

#[cfg(target_arch = "wasm32")]
mod glue;
