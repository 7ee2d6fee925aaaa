//! What the filter asks of its host (Envoy), as one small trait.
//!
//! [`crate::root`] and [`crate::request`] make every decision against a
//! [`Host`]; `glue` (wasm32 only) implements it over `proxy_wasm::hostcalls`
//! and forwards callbacks, and the tests implement it with a double that
//! records what the filter did. Logging stays on the `log` facade, which the
//! SDK already routes to the host.

use std::io::Read;
use std::time::Duration;

use crate::check::Lazy;
use crate::store::SharedData;

/// The two kinds of metric the filter defines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MetricKind {
    /// Only ever incremented.
    Counter,
    /// Set to a value.
    Gauge,
}

/// A header list as the host gives it: names as text, values as bytes.
pub type RawHeaders = Vec<(String, Vec<u8>)>;

/// The host operations of the root and HTTP contexts. Errors of the host are
/// folded into `None`/`false`/`Err(text)`: the filter never panics on them.
pub trait Host: SharedData {
    /// The wall clock, µs since the Unix epoch (0 if the host cannot say).
    fn now_us(&self) -> u64;

    /// The wall clock, ms since the Unix epoch.
    fn now_ms(&self) -> u64 {
        self.now_us() / 1000
    }

    /// A random number: owner ids and jitter seeds.
    fn random_u64(&self) -> u64;

    /// A property of the stream as text (`["upstream", "address"]`).
    fn property(&self, path: &[&str]) -> Option<String>;

    /// One request header.
    fn request_header(&self, name: &str) -> Option<String>;

    /// All request headers.
    fn request_headers(&self) -> RawHeaders;

    /// Removes a request header before it goes upstream.
    fn remove_request_header(&mut self, name: &str);

    /// Sends a call to `cluster`; the token names its answer.
    fn dispatch_call(
        &mut self,
        cluster: &str,
        headers: &[(&str, &str)],
        timeout: Duration,
    ) -> Result<u32, String>;

    /// The `:status` of the answer being delivered (call only when the
    /// answer has headers: a failed call has no header map).
    fn call_status(&self) -> Option<u32>;

    /// The headers of the answer being delivered (same condition).
    fn call_headers(&self) -> RawHeaders;

    /// `len` bytes of the answer's body from `offset`.
    fn call_body(&self, offset: usize, len: usize) -> Result<Vec<u8>, String>;

    /// The answer's body of `size` bytes as a reader that fetches it a piece
    /// at a time (a copy of a large snapshot would stay in the VM's memory).
    fn call_body_reader(&self, size: usize) -> Box<dyn Read>;

    /// Answers the request from the filter instead of the upstream.
    fn send_reply(&mut self, status: u32, headers: &[(&str, &str)], body: Option<&[u8]>);

    /// Defines a metric; `None` if the host refuses.
    fn define_metric(&mut self, kind: MetricKind, name: &str) -> Option<u32>;

    /// Adds to a counter.
    fn increment_metric(&mut self, id: u32, by: u64);

    /// Sets a gauge.
    fn record_metric(&mut self, id: u32, value: u64);

    /// Sets the root context's timer period; false if the host refused.
    fn set_tick_period(&mut self, period: Duration) -> bool;

    /// The linear memory of this VM, in bytes.
    fn vm_memory_bytes(&self) -> u64;
}

/// The lazy reads of `check::judge`, from a host.
#[derive(Debug)]
pub struct LazyReads<'a, H: ?Sized>(pub &'a H);

impl<H: Host + ?Sized> Lazy for LazyReads<'_, H> {
    fn istio_service_host(&self) -> Option<String> {
        // Istio lists the services a cluster serves in its metadata; the
        // first one is the service (a cluster per service and port).
        self.0.property(&[
            "xds",
            "cluster_metadata",
            "filter_metadata",
            "istio",
            "services",
            "0",
            "host",
        ])
    }

    fn now_ms(&self) -> u64 {
        self.0.now_ms()
    }
}
