//! Reference filters for `bench/run`: what staleguard's per-request cost is
//! measured against. One module, two modes chosen by the plugin configuration:
//!
//! - `{}` or empty: **no-op**. The HTTP context answers `Continue` to every
//!   callback and calls nothing, so a gateway with it pays only for Envoy's
//!   Wasm machinery and the SDK's dispatch: the floor for any Wasm filter.
//!
//! Built with `cargo build -p staleguard-bench-filters --target wasm32-wasip1
//! --profile wasm-release` (the same profile as the filter).

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{ContextType, LogLevel};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root) });
}}

/// The root context: hands out no-op HTTP contexts.
#[derive(Debug)]
struct Root;

impl Context for Root {}

impl RootContext for Root {
    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Noop))
    }
}

/// Does nothing: every callback keeps the SDK's default, `Continue`.
#[derive(Debug)]
struct Noop;

impl Context for Noop {}

impl HttpContext for Noop {}
