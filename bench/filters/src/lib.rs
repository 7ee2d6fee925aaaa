//! Reference filters for `bench/run`: what staleguard's per-request cost is
//! measured against. One module, two modes chosen by the plugin configuration:
//!
//! - `{}` or empty: **no-op**. The HTTP context answers `Continue` to every
//!   callback and calls nothing, so a gateway with it pays only for Envoy's
//!   Wasm machinery and the SDK's dispatch: the floor for any Wasm filter.
//! - `{"mode": "naive", "service": "NS/NAME"}`: **the naive design**, what
//!   an ext_authz-style check would do. Every request asks the validator
//!   (`GET /v1/verdict`, cluster `staleguard-validator` unless `cluster` says
//!   otherwise) about the host Envoy picked, pauses until the answer, then
//!   resumes or answers 503. It fails open when the call cannot be made.
//!   It reads the verdict with a substring test, not a JSON parser: the
//!   cheapest reading there is, so the comparison flatters the naive design.
//!
//! Built with `cargo build -p staleguard-bench-filters --target wasm32-wasip1
//! --profile wasm-release` (the same profile as the filter).

use std::time::Duration;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MetricType};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root::default()) });
}}

/// The naive filter's counter of requests it asked the validator about.
pub const NAIVE_ASKED: &str = "bench_naive_asked_total";
/// The naive filter's counter of requests it let through.
pub const NAIVE_ALLOWED: &str = "bench_naive_allowed_total";
/// The naive filter's counter of requests it answered 503.
pub const NAIVE_REJECTED: &str = "bench_naive_rejected_total";
/// The naive filter's counter of calls it could not make (failed open).
pub const NAIVE_FAILED: &str = "bench_naive_call_failures_total";

/// What a verdict answer that allows contains (`verdict.action`).
const ALLOW: &[u8] = br#""action":"allow""#;

/// The naive mode's settings, read once per VM.
#[derive(Debug, Clone)]
struct Naive {
    cluster: String,
    service: String,
    timeout: Duration,
    asked: Option<u32>,
    allowed: Option<u32>,
    rejected: Option<u32>,
    failed: Option<u32>,
}

/// The root context: reads the mode, hands out HTTP contexts.
#[derive(Debug, Default)]
struct Root {
    naive: Option<Naive>,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let raw = hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX)
            .ok()
            .flatten()
            .unwrap_or_default();
        let Ok(config) = serde_json::from_slice::<serde_json::Value>(&raw) else {
            // Empty or not JSON: the no-op.
            return true;
        };
        let text = |key: &str| config.get(key).and_then(|v| v.as_str());
        if text("mode") != Some("naive") {
            return true;
        }
        let Some(service) = text("service") else {
            let _ = hostcalls::log(LogLevel::Error, "bench naive: no `service` in config");
            return false;
        };
        let metric = |name: &str| hostcalls::define_metric(MetricType::Counter, name).ok();
        self.naive = Some(Naive {
            cluster: text("cluster").unwrap_or("staleguard-validator").to_owned(),
            service: service.to_owned(),
            timeout: Duration::from_millis(
                config
                    .get("timeout_ms")
                    .and_then(|v| v.as_u64())
                    .unwrap_or(1000),
            ),
            asked: metric(NAIVE_ASKED),
            allowed: metric(NAIVE_ALLOWED),
            rejected: metric(NAIVE_REJECTED),
            failed: metric(NAIVE_FAILED),
        });
        true
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        match &self.naive {
            None => Some(Box::new(Noop)),
            Some(naive) => Some(Box::new(Ask {
                naive: naive.clone(),
            })),
        }
    }
}

/// Does nothing: every callback keeps the SDK's default, `Continue`.
#[derive(Debug)]
struct Noop;

impl Context for Noop {}

impl HttpContext for Noop {}

/// Asks the validator about every request's host.
#[derive(Debug)]
struct Ask {
    naive: Naive,
}

fn count(metric: Option<u32>) {
    if let Some(id) = metric {
        let _ = hostcalls::increment_metric(id, 1);
    }
}

/// The IP of `host:port` or `[v6]:port`.
fn host_ip(address: &str) -> &str {
    let host = address.rsplit_once(':').map_or(address, |(h, _)| h);
    host.trim_start_matches('[').trim_end_matches(']')
}

impl Context for Ask {
    fn on_http_call_response(&mut self, _token: u32, _headers: usize, body: usize, _: usize) {
        let answer = hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body)
            .ok()
            .flatten()
            .unwrap_or_default();
        if answer.windows(ALLOW.len()).any(|w| w == ALLOW) {
            count(self.naive.allowed);
            let _ = hostcalls::resume_http_request();
        } else {
            count(self.naive.rejected);
            let _ = hostcalls::send_http_response(503, vec![("x-naive", "reject")], None);
        }
    }
}

impl HttpContext for Ask {
    fn on_http_request_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
        let address = match hostcalls::get_property(vec!["upstream", "address"]) {
            Ok(Some(bytes)) => String::from_utf8(bytes).unwrap_or_default(),
            _ => String::new(),
        };
        let path = format!(
            "/v1/verdict?service={}&ip={}",
            self.naive.service,
            host_ip(&address)
        );
        let headers = vec![
            (":method", "GET"),
            (":path", path.as_str()),
            (":authority", "staleguard-validator"),
        ];
        match hostcalls::dispatch_http_call(
            &self.naive.cluster,
            headers,
            None,
            vec![],
            self.naive.timeout,
        ) {
            Ok(_) => {
                count(self.naive.asked);
                Action::Pause
            }
            Err(_) => {
                count(self.naive.failed);
                Action::Continue
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_ip_drops_the_port_and_brackets() {
        assert_eq!(host_ip("127.0.1.3:8080"), "127.0.1.3");
        assert_eq!(host_ip("[fd00::1]:80"), "fd00::1");
    }
}
