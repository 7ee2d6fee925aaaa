//! The proxy-wasm host glue: thin on purpose. [`HostCalls`] implements
//! [`Host`] over `proxy_wasm::hostcalls` (whose errors are values) rather
//! than the SDK's trait methods (which unwrap), and the SDK's callbacks are
//! forwarded to [`Root`] and [`Filter`], which decide everything.

use std::hash::{BuildHasher, Hasher};
use std::io::Read;
use std::time::{Duration, UNIX_EPOCH};

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType, MetricType, Status};

use staleguard_engine::host::{
    Callouts, Clock, MetricKind, Next, RawHeaders, SharedData, Stats, StoreError, Stream, Vm,
};
use staleguard_engine::request::Filter;
use staleguard_engine::root::Root;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    // Replaces the SDK's hook (which unwraps): log the panic at critical, since
    // the VM is about to die and take every request of its worker with it.
    std::panic::set_hook(Box::new(|info| {
        let _ = hostcalls::log(LogLevel::Critical, &format!("staleguard: panic: {info}"));
    }));
    proxy_wasm::set_root_context(|context_id| -> Box<dyn RootContext> {
        Box::new(RootGlue(Root::new(context_id)))
    });
}}

// === impl HostCalls ===

/// Envoy, through hostcalls.
struct HostCalls;

impl SharedData for HostCalls {
    fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, u32), StoreError> {
        hostcalls::get_shared_data(key)
            .map(|(value, cas)| (value, cas.unwrap_or(0)))
            .map_err(|s| StoreError::Host(format!("{s:?}")))
    }

    fn set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        match hostcalls::set_shared_data(key, Some(value), cas.filter(|c| *c != 0)) {
            Ok(()) => Ok(()),
            Err(Status::CasMismatch) => Err(StoreError::CasMismatch),
            Err(s) => Err(StoreError::Host(format!("{s:?}"))),
        }
    }
}

impl Clock for HostCalls {
    fn now_us(&self) -> u64 {
        hostcalls::get_current_time()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
    }

    fn random_u64(&self) -> u64 {
        // RandomState is seeded from WASI random_get: good enough for owner
        // ids and jitter seeds.
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(self.now_ms());
        h.finish()
    }
}

impl Stream for HostCalls {
    fn property(&self, path: &[&str]) -> Option<String> {
        match hostcalls::get_property(path.to_vec()) {
            Ok(Some(bytes)) => String::from_utf8(bytes).ok(),
            _ => None,
        }
    }

    fn request_header(&self, name: &str) -> Option<String> {
        hostcalls::get_map_value(MapType::HttpRequestHeaders, name)
            .ok()
            .flatten()
    }

    fn request_headers(&self) -> RawHeaders {
        hostcalls::get_map_bytes(MapType::HttpRequestHeaders).unwrap_or_default()
    }

    fn remove_request_header(&mut self, name: &str) {
        let _ = hostcalls::remove_map_value(MapType::HttpRequestHeaders, name);
    }

    fn set_request_header(&mut self, name: &str, value: &str) {
        let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, name, Some(value));
    }

    fn remove_response_header(&mut self, name: &str) {
        let _ = hostcalls::remove_map_value(MapType::HttpResponseHeaders, name);
    }

    fn send_reply(&mut self, status: u32, headers: &[(&str, &str)], body: Option<&[u8]>) {
        let _ = hostcalls::send_http_response(status, headers.to_vec(), body);
    }
}

impl Callouts for HostCalls {
    fn dispatch_call(
        &mut self,
        cluster: &str,
        headers: &[(&str, &str)],
        timeout: Duration,
    ) -> Result<u32, String> {
        hostcalls::dispatch_http_call(cluster, headers.to_vec(), None, vec![], timeout)
            .map_err(|status| format!("{status:?}"))
    }

    fn call_status(&self) -> Option<u32> {
        hostcalls::get_map_value(MapType::HttpCallResponseHeaders, ":status")
            .ok()
            .flatten()
            .and_then(|s| s.parse::<u32>().ok())
    }

    fn call_headers(&self) -> RawHeaders {
        hostcalls::get_map_bytes(MapType::HttpCallResponseHeaders).unwrap_or_default()
    }

    fn call_body(&self, offset: usize, len: usize) -> Result<Vec<u8>, String> {
        hostcalls::get_buffer(BufferType::HttpCallResponseBody, offset, len)
            .map(Option::unwrap_or_default)
            .map_err(|status| format!("get_buffer: {status:?}"))
    }

    fn call_body_reader(&self, size: usize) -> Box<dyn Read> {
        Box::new(CallBody { offset: 0, size })
    }
}

impl Stats for HostCalls {
    fn define_metric(&mut self, kind: MetricKind, name: &str) -> Option<u32> {
        let kind = match kind {
            MetricKind::Counter => MetricType::Counter,
            MetricKind::Gauge => MetricType::Gauge,
        };
        hostcalls::define_metric(kind, name).ok()
    }

    fn increment_metric(&mut self, id: u32, by: u64) {
        let _ = hostcalls::increment_metric(id, i64::try_from(by).unwrap_or(i64::MAX));
    }

    fn record_metric(&mut self, id: u32, value: u64) {
        let _ = hostcalls::record_metric(id, value);
    }
}

impl Vm for HostCalls {
    fn set_tick_period(&mut self, period: Duration) -> bool {
        hostcalls::set_tick_period(period).is_ok()
    }

    fn vm_memory_bytes(&self) -> u64 {
        // Pages of 64 KiB.
        core::arch::wasm32::memory_size(0) as u64 * 65_536
    }
}

/// The body of the poller's call, read from the host a piece at a time.
struct CallBody {
    offset: usize,
    size: usize,
}

impl Read for CallBody {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let wanted = buf.len().min(self.size.saturating_sub(self.offset));
        if wanted == 0 {
            return Ok(0);
        }
        let piece = hostcalls::get_buffer(BufferType::HttpCallResponseBody, self.offset, wanted)
            .map_err(|status| std::io::Error::other(format!("get_buffer: {status:?}")))?
            .unwrap_or_default();
        let n = piece.len().min(wanted);
        match (buf.get_mut(..n), piece.get(..n)) {
            (Some(to), Some(from)) => to.copy_from_slice(from),
            _ => return Ok(0),
        }
        self.offset += n;
        Ok(n)
    }
}

// === callbacks ===

struct RootGlue(Root);

impl Context for RootGlue {
    fn on_done(&mut self) -> bool {
        self.0.done(&mut HostCalls);
        true
    }

    fn on_http_call_response(&mut self, token: u32, headers: usize, body_size: usize, _: usize) {
        self.0
            .call_response(&mut HostCalls, token, headers, body_size);
    }
}

impl RootContext for RootGlue {
    fn on_configure(&mut self, size: usize) -> bool {
        let bytes = hostcalls::get_buffer(BufferType::PluginConfiguration, 0, size)
            .ok()
            .flatten()
            .unwrap_or_default();
        self.0.configure(&mut HostCalls, &bytes)
    }

    fn on_tick(&mut self) {
        self.0.tick(&mut HostCalls);
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        // Never None: the SDK panics on None (and the VM dies). Without a
        // configuration the filter passes everything through.
        Some(Box::new(FilterGlue(self.0.filter(context_id))))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct FilterGlue(Filter);

impl Context for FilterGlue {
    fn on_http_call_response(&mut self, token: u32, headers: usize, body_size: usize, _: usize) {
        self.0
            .call_response(&mut HostCalls, token, headers, body_size);
    }
}

impl HttpContext for FilterGlue {
    fn on_http_request_headers(&mut self, _: usize, end_of_stream: bool) -> Action {
        action(self.0.request_headers(&mut HostCalls, end_of_stream))
    }

    fn on_http_response_headers(&mut self, _: usize, _: bool) -> Action {
        action(self.0.response_headers(&mut HostCalls))
    }
}

/// The engine's word for what happens to a request, in proxy-wasm's.
fn action(next: Next) -> Action {
    match next {
        Next::Continue => Action::Continue,
        Next::Pause => Action::Pause,
    }
}
