//! What the engine asks of its host (Envoy, through proxy-wasm or a native
//! dynamic module): a few small traits, the bottom of the engine.
//!
//! [`crate::root`] and [`crate::request`] make every decision against a
//! [`Host`], which is the sum of these traits; an adapter implements each of
//! them over its host's calls and forwards the host's callbacks, and the tests
//! implement them with a double that records what the engine did. None of
//! them names a host's types, and none fails by panicking: a host's errors are
//! folded into `None`/`false`/`Err(..)`. Logging is not a trait: the engine
//! logs through the `log` facade, which an adapter routes to its host.

use std::borrow::Cow;
use std::io::Read;
use std::time::Duration;

// === the index store ===

/// Why a shared-data operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// Someone else wrote the key since it was read.
    #[error("compare-and-swap mismatch")]
    CasMismatch,
    /// The host refused the operation.
    #[error("host refused shared-data access: {0}")]
    Host(String),
}

/// What [`SharedData::peek`] hands its reader: what [`SharedData::get`]
/// answers, the value lent.
pub type Peeked<'a> = Result<(Option<&'a [u8]>, u32), StoreError>;

/// Shared data as the host offers it, one key-value store for every VM (or
/// worker) of one Envoy process: values with a compare-and-swap token. The
/// index lives here (layout in [`crate::store`]).
pub trait SharedData {
    /// Reads a key: its value (if any) and its cas token (0 if unknown).
    fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, u32), StoreError>;
    /// Writes a key; with `cas` set, only if the key is unchanged since read.
    fn set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError>;
    /// Reads a key as [`SharedData::get`] does and hands the answer to
    /// `read`, the value lent where the host can lend it (the native
    /// module's store); by default the copy `get` makes.
    fn peek(&self, key: &str, read: &mut dyn FnMut(Peeked<'_>)) {
        match self.get(key) {
            Ok((value, cas)) => read(Ok((value.as_deref(), cas))),
            Err(e) => read(Err(e)),
        }
    }
    /// A count that moves after every write to the store is in it, if the
    /// host keeps one (`None` by default): a reader that read a value after
    /// seeing the count at `n` may keep using it while the count stays at
    /// `n`, without reading it again ([`crate::cache::Cache::stamp`]).
    fn writes(&self) -> Option<u64> {
        None
    }
}

// === time and chance ===

/// The wall clock and a source of randomness.
pub trait Clock {
    /// The wall clock, µs since the Unix epoch (0 if the host cannot say).
    fn now_us(&self) -> u64;

    /// The wall clock, ms since the Unix epoch.
    fn now_ms(&self) -> u64 {
        self.now_us() / 1000
    }

    /// The wall clock as a request's freshness check reads it, ms since the
    /// Unix epoch: a host with a cheaper clock that lags by a few ms (a
    /// scheduler tick) may serve it; by default [`Clock::now_ms`].
    fn coarse_now_ms(&self) -> u64 {
        self.now_ms()
    }

    /// A random number: owner ids and jitter seeds.
    fn random_u64(&self) -> u64;
}

// === the request ===

/// A header list as the host gives it: names as text, values as bytes.
pub type RawHeaders = Vec<(String, Vec<u8>)>;

/// What happens to a request after the engine has seen its headers: the
/// engine's own word, which each adapter maps to its host's (proxy-wasm's
/// `Action`, a dynamic module's header status).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Send the request on (upstream, or to the reply already sent).
    Continue,
    /// Hold the request until the engine resumes or answers it (a replay's
    /// call in flight, a fail-closed reply).
    Pause,
}

/// The request being handled (the HTTP context's stream): its properties and
/// headers, and the reply that answers it instead of the upstream.
pub trait Stream {
    /// A property of the stream as text (`["upstream", "address"]`,
    /// `["xds", "cluster_name"]`).
    fn property(&self, path: &[&str]) -> Option<String>;

    /// [`Stream::property`], lent for as long as `self` is borrowed where the
    /// host can lend it (a native module reads Envoy's own text); by default
    /// the copy `property` makes.
    fn property_text(&self, path: &[&str]) -> Option<Cow<'_, str>> {
        self.property(path).map(Cow::Owned)
    }

    /// The two properties every judged request reads, `xds.cluster_name`
    /// and `upstream.address`, as [`Stream::property_text`] reads them; a
    /// host with a call for each (a native module) skips matching the paths.
    fn upstream_texts(&self) -> (Option<Cow<'_, str>>, Option<Cow<'_, str>>) {
        (
            self.property_text(&["xds", "cluster_name"]),
            self.property_text(&["upstream", "address"]),
        )
    }

    /// One request header.
    fn request_header(&self, name: &str) -> Option<String>;

    /// All request headers.
    fn request_headers(&self) -> RawHeaders;

    /// Removes a request header before it goes upstream.
    fn remove_request_header(&mut self, name: &str);

    /// Sets a request header (replacing it) before it goes upstream.
    fn set_request_header(&mut self, name: &str, value: &str);

    /// Removes a header from the upstream's answer.
    fn remove_response_header(&mut self, name: &str);

    /// Answers the request from the filter instead of the upstream.
    fn send_reply(&mut self, status: u32, headers: &[(&str, &str)], body: Option<&[u8]>);
}

// === callouts ===

/// HTTP calls to a cluster (the validator's, a twin's) and their answers.
/// An answer is delivered by the host's callback; while it runs, these read
/// the answer being delivered.
pub trait Callouts {
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
}

// === metrics ===

/// The two kinds of metric the engine defines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MetricKind {
    /// Only ever incremented.
    Counter,
    /// Set to a value.
    Gauge,
}

/// The host's metrics: defined once by name, then updated by id (the names
/// are in [`crate::metrics`]).
pub trait Stats {
    /// Defines a metric; `None` if the host refuses.
    fn define_metric(&mut self, kind: MetricKind, name: &str) -> Option<u32>;

    /// Adds to a counter.
    fn increment_metric(&mut self, id: u32, by: u64);

    /// Sets a gauge.
    fn record_metric(&mut self, id: u32, value: u64);
}

// === the VM ===

/// What the engine's instance (a Wasm VM, a module's per-worker state) has of
/// its own: a periodic timer and a memory size to report.
pub trait Vm {
    /// Sets the root context's timer period; false if the host refused.
    fn set_tick_period(&mut self, period: Duration) -> bool;

    /// The memory this instance holds, in bytes (a Wasm VM's linear memory).
    fn vm_memory_bytes(&self) -> u64;
}

// === all of it ===

/// Everything a host offers: what [`crate::root::Root`] and
/// [`crate::request::Filter`] are driven with. Implemented for any type
/// that implements the traits above.
pub trait Host: SharedData + Clock + Stream + Callouts + Stats + Vm {}

impl<T: SharedData + Clock + Stream + Callouts + Stats + Vm + ?Sized> Host for T {}
