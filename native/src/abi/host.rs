//! The filter's [`Host`] over a dynamic module's handles, shared by the
//! extensions that run the filter's root: the upstream HTTP filter's config
//! ([`super::http`]) and the bootstrap extension ([`super::bootstrap`]).
//! They differ in which Envoy callbacks define and update metrics and send
//! callouts: a [`Surface`] names them.

use std::borrow::Cow;
use std::ffi::c_void;
use std::io::{Cursor, Read};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use staleguard_engine::host::{
    Callouts, Clock, MetricKind, Peeked, RawHeaders, SharedData, Stats, StoreError, Stream, Vm,
};

use super::{EnvoyBuffer, ModuleBuffer, ModuleHeader};
use crate::index::ProcessStore;

/// A header Envoy lends the module.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct EnvoyHeader {
    key: *const u8,
    key_len: usize,
    value: *const u8,
    value_len: usize,
}

/// `envoy_dynamic_module_type_attribute_id_UpstreamAddress`.
pub(super) const ATTRIBUTE_UPSTREAM_ADDRESS: u32 = 41;
/// `envoy_dynamic_module_type_http_header_type_RequestHeader`.
const REQUEST_HEADERS: u32 = 0;
/// `envoy_dynamic_module_type_http_header_type_ResponseHeader`.
const RESPONSE_HEADERS: u32 = 2;
/// `envoy_dynamic_module_type_http_callout_init_result_Success`.
pub(super) const CALLOUT_INIT_SUCCESS: u32 = 0;
/// `envoy_dynamic_module_type_http_callout_result_Success`.
pub(super) const CALLOUT_SUCCESS: u32 = 0;

/// The request-level callbacks the host calls (checked at program init).
pub(super) const CALLBACKS: &[&std::ffi::CStr] = &[
    c"envoy_dynamic_module_callback_http_filter_get_attribute_string",
    c"envoy_dynamic_module_callback_http_get_cluster_name",
    c"envoy_dynamic_module_callback_http_get_header",
    c"envoy_dynamic_module_callback_http_get_headers_size",
    c"envoy_dynamic_module_callback_http_get_headers",
    c"envoy_dynamic_module_callback_http_set_header",
    c"envoy_dynamic_module_callback_http_filter_http_callout",
    c"envoy_dynamic_module_callback_http_send_response",
    c"envoy_dynamic_module_callback_http_filter_increment_counter",
    c"envoy_dynamic_module_callback_http_filter_set_gauge",
];

extern "C" {
    fn envoy_dynamic_module_callback_http_get_header(
        filter: *mut c_void,
        header_type: u32,
        key: ModuleBuffer,
        result: *mut EnvoyBuffer,
        index: usize,
        count: *mut usize,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_get_headers_size(
        filter: *mut c_void,
        header_type: u32,
    ) -> usize;
    fn envoy_dynamic_module_callback_http_get_headers(
        filter: *mut c_void,
        header_type: u32,
        result: *mut EnvoyHeader,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_set_header(
        filter: *mut c_void,
        header_type: u32,
        key: ModuleBuffer,
        value: ModuleBuffer,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_filter_http_callout(
        filter: *mut c_void,
        callout_id: *mut u64,
        cluster: ModuleBuffer,
        headers: *const ModuleHeader,
        headers_len: usize,
        body: ModuleBuffer,
        timeout_ms: u64,
    ) -> u32;
    fn envoy_dynamic_module_callback_http_get_cluster_name(
        filter: *mut c_void,
        result: *mut EnvoyBuffer,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_filter_get_attribute_string(
        filter: *mut c_void,
        id: u32,
        result: *mut EnvoyBuffer,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_send_response(
        filter: *mut c_void,
        status: u32,
        headers: *const ModuleHeader,
        headers_len: usize,
        body: ModuleBuffer,
        details: ModuleBuffer,
    );
}

mod counters;
use counters::CalloutFn;
pub(super) use counters::{Metrics, Surface, Update};

// === impl EnvoyHost ===

/// The filter's [`Host`] over one hook's handles: the config's always, a
/// request's when the hook has one, a callout's answer while it is
/// delivered. A reply is kept for the hook to send after the lock.
pub(super) struct EnvoyHost<'a> {
    config: *mut c_void,
    filter: Option<*mut c_void>,
    metrics: &'a mut Metrics,
    pub(super) answer: Option<&'a Answer>,
    pub(super) reply: Option<Reply>,
    store: ProcessStore,
}

/// A callout's answer, copied out of Envoy's buffers.
#[derive(Debug, Default)]
pub(super) struct Answer {
    /// Headers, names as text.
    pub(super) headers: RawHeaders,
    /// The body, whole, shared with the reader the poller decodes it from
    /// ([`Callouts::call_body_reader`]) instead of copied to it.
    pub(super) body: Body,
}

/// An answer's body: one exact-size copy of Envoy's chunks, shared.
#[derive(Debug, Clone, Default)]
pub(super) struct Body(Arc<Vec<u8>>);

impl AsRef<[u8]> for Body {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl std::ops::Deref for Body {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.0
    }
}

/// A local reply to send once the lock is released.
#[derive(Debug)]
pub(super) struct Reply {
    status: u32,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl<'a> EnvoyHost<'a> {
    /// A host for a hook with Envoy's `config` handle, a request's `filter`
    /// handle if it has one, and the config's metrics.
    pub(super) fn new(
        config: *mut c_void,
        filter: Option<*mut c_void>,
        metrics: &'a mut Metrics,
    ) -> Self {
        Self {
            config,
            filter,
            metrics,
            answer: None,
            reply: None,
            store: ProcessStore,
        }
    }

    /// The request's cluster (the attribute `xds.cluster_name` is not
    /// served as text before ABI v0.2.0; this callback is, in both).
    fn cluster_name(&self) -> Option<&[u8]> {
        // SAFETY: the request's live handle and a valid out slot.
        self.lend(|filter, out| unsafe {
            envoy_dynamic_module_callback_http_get_cluster_name(filter, out)
        })
    }

    fn attribute(&self, id: u32) -> Option<&[u8]> {
        // SAFETY: the request's live handle and a valid out slot.
        self.lend(|filter, out| unsafe {
            envoy_dynamic_module_callback_http_filter_get_attribute_string(filter, id, out)
        })
    }

    /// The bytes of a stream property Envoy serves as text, lent.
    fn property_bytes(&self, path: &[&str]) -> Option<&[u8]> {
        match path {
            ["upstream", "address"] => self.attribute(ATTRIBUTE_UPSTREAM_ADDRESS),
            ["xds", "cluster_name"] => self.cluster_name(),
            // Istio's service list (`filter_metadata.istio.services`) is a
            // list of structs, and the ABI's metadata getters (1.38 to 1.40)
            // read a namespace's strings, numbers, bools and lists of those
            // only: its size, never `services[0].host`. Clusters map by rules
            // and their names (docs/native.md, "Limits").
            _ => None,
        }
    }

    /// Sets (or with `None` removes) header `name` of the request's map
    /// `header_type`.
    fn set_header(&mut self, header_type: u32, name: &str, value: Option<&str>) {
        let Some(filter) = self.filter else {
            return;
        };
        let value = value.map_or(
            ModuleBuffer {
                ptr: std::ptr::null(),
                len: 0,
            },
            |v| ModuleBuffer::of(v.as_bytes()),
        );
        // SAFETY: the request's live handle; name and value outlive the call
        // (a null value removes the header).
        unsafe {
            envoy_dynamic_module_callback_http_set_header(
                filter,
                header_type,
                ModuleBuffer::of(name.as_bytes()),
                value,
            )
        };
    }

    /// A text Envoy lends for this hook through `call`, which fills an
    /// out buffer from the request's handle; `None` without a request or
    /// when Envoy has none.
    fn read(&self, call: impl FnOnce(*mut c_void, *mut EnvoyBuffer) -> bool) -> Option<String> {
        self.lend(call).map(|bytes| lent_text(bytes).into_owned())
    }

    /// What [`EnvoyHost::read`] reads, lent for as long as this host is
    /// borrowed: a host lives for one hook, and Envoy's buffer lives as
    /// long.
    fn lend(&self, call: impl FnOnce(*mut c_void, *mut EnvoyBuffer) -> bool) -> Option<&[u8]> {
        let filter = self.filter?;
        let mut out = EnvoyBuffer {
            ptr: std::ptr::null(),
            len: 0,
        };
        let found = call(filter, &mut out);
        // SAFETY: Envoy filled `out` (or left it empty) for the duration of
        // this hook, which this host does not outlive (it is made by the
        // hook and dropped before it returns).
        let bytes = unsafe { out.as_bytes() };
        (found && !bytes.is_empty()).then_some(bytes)
    }
}

/// `bytes` as text ([`super::text`]): lent as it is, or invalid UTF-8
/// converted lossily.
fn lent_text(bytes: &[u8]) -> Cow<'_, str> {
    super::text(bytes).map_or_else(|| String::from_utf8_lossy(bytes), Cow::Borrowed)
}

impl SharedData for EnvoyHost<'_> {
    fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, u32), StoreError> {
        self.store.get(key)
    }

    fn set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        self.store.set(key, value, cas)
    }

    fn peek(&self, key: &str, read: &mut dyn FnMut(Peeked<'_>)) {
        SharedData::peek(&self.store, key, read);
    }

    fn writes(&self) -> Option<u64> {
        self.store.writes()
    }
}

impl Clock for EnvoyHost<'_> {
    fn now_us(&self) -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
    }

    /// The kernel's coarse wall clock ([`coarse_now_ms`]): for a request's
    /// freshness check only; the poller, the lease and the guard keep the
    /// precise one.
    fn coarse_now_ms(&self) -> u64 {
        coarse_now_ms().unwrap_or_else(|| self.now_ms())
    }

    fn random_u64(&self) -> u64 {
        use std::hash::{BuildHasher, Hasher};
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_u64(self.now_us());
        hasher.finish()
    }
}

/// The kernel's coarse wall clock, ms since the Unix epoch: moved at every
/// scheduler tick (a few ms at most behind the precise one). Every judged
/// request reads the clock for the index's freshness, whose bound is
/// seconds; this is a few loads where the precise clock, read through
/// `SystemTime`, costs about 150 instructions and their cache lines. `None`
/// where the kernel has no such clock.
fn coarse_now_ms() -> Option<u64> {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out slot for the call.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_REALTIME_COARSE, &mut now) };
    if rc != 0 {
        return None;
    }
    let secs = u64::try_from(now.tv_sec).ok()?;
    let nanos = u64::try_from(now.tv_nsec).ok()?;
    Some(secs.saturating_mul(1000).saturating_add(nanos / 1_000_000))
}

impl Stream for EnvoyHost<'_> {
    fn property(&self, path: &[&str]) -> Option<String> {
        self.property_text(path).map(Cow::into_owned)
    }

    fn property_text(&self, path: &[&str]) -> Option<Cow<'_, str>> {
        self.property_bytes(path).map(lent_text)
    }

    fn upstream_texts(&self) -> (Option<Cow<'_, str>>, Option<Cow<'_, str>>) {
        (
            self.cluster_name().map(lent_text),
            self.attribute(ATTRIBUTE_UPSTREAM_ADDRESS).map(lent_text),
        )
    }

    fn request_header(&self, name: &str) -> Option<String> {
        // SAFETY: the request's live handle, the key outlives the call, and
        // a valid out slot; no count wanted.
        self.read(|filter, out| unsafe {
            envoy_dynamic_module_callback_http_get_header(
                filter,
                REQUEST_HEADERS,
                ModuleBuffer::of(name.as_bytes()),
                out,
                0,
                std::ptr::null_mut(),
            )
        })
    }

    fn request_headers(&self) -> RawHeaders {
        let Some(filter) = self.filter else {
            return Vec::new();
        };
        // SAFETY: the request's live handle.
        let size =
            unsafe { envoy_dynamic_module_callback_http_get_headers_size(filter, REQUEST_HEADERS) };
        let mut headers = vec![
            EnvoyHeader {
                key: std::ptr::null(),
                key_len: 0,
                value: std::ptr::null(),
                value_len: 0,
            };
            size
        ];
        // SAFETY: `headers` has room for the `size` headers Envoy reported
        // for this map, on this thread, in this hook.
        if !unsafe {
            envoy_dynamic_module_callback_http_get_headers(
                filter,
                REQUEST_HEADERS,
                headers.as_mut_ptr(),
            )
        } {
            return Vec::new();
        }
        // SAFETY: Envoy filled each header with buffers valid in this hook.
        unsafe { copy_headers(&headers) }
    }

    fn remove_request_header(&mut self, name: &str) {
        self.set_header(REQUEST_HEADERS, name, None);
    }

    fn set_request_header(&mut self, name: &str, value: &str) {
        self.set_header(REQUEST_HEADERS, name, Some(value));
    }

    fn remove_response_header(&mut self, name: &str) {
        self.set_header(RESPONSE_HEADERS, name, None);
    }

    fn send_reply(&mut self, status: u32, headers: &[(&str, &str)], body: Option<&[u8]>) {
        self.reply = Some(Reply {
            status,
            headers: headers
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            body: body.unwrap_or_default().to_vec(),
        });
    }
}

impl Callouts for EnvoyHost<'_> {
    fn dispatch_call(
        &mut self,
        cluster: &str,
        headers: &[(&str, &str)],
        timeout: Duration,
    ) -> Result<u32, String> {
        let module_headers = ModuleHeader::lend(headers.iter().map(|(k, v)| (*k, *v)));
        let mut callout_id = 0u64;
        let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        let cluster = ModuleBuffer::of(cluster.as_bytes());
        let body = ModuleBuffer::of(&[]);
        // A request's callout goes through its filter; without one, through
        // the config's (main thread) entry of the surface it was made for.
        let (handle, callout): (*mut c_void, CalloutFn) = match self.filter {
            Some(filter) => (
                filter,
                envoy_dynamic_module_callback_http_filter_http_callout,
            ),
            None => (self.config, self.metrics.surface.callout),
        };
        // SAFETY: a live handle of the kind `callout` takes; every buffer
        // outlives the call.
        let result = unsafe {
            callout(
                handle,
                &mut callout_id,
                cluster,
                module_headers.as_ptr(),
                module_headers.len(),
                body,
                timeout_ms,
            )
        };
        if result == CALLOUT_INIT_SUCCESS {
            // Callout ids count up from 1 per config: a u32 names them for
            // longer than any poller runs.
            Ok(callout_id as u32)
        } else {
            Err(callout_refusal(result).to_owned())
        }
    }

    fn call_status(&self) -> Option<u32> {
        let answer = self.answer?;
        answer
            .headers
            .iter()
            .find(|(k, _)| k == ":status")
            .and_then(|(_, v)| std::str::from_utf8(v).ok()?.parse().ok())
    }

    fn call_headers(&self) -> RawHeaders {
        self.answer.map(|a| a.headers.clone()).unwrap_or_default()
    }

    fn call_body(&self, offset: usize, len: usize) -> Result<Vec<u8>, String> {
        let body = self.answer.map_or(&[][..], |a| &a.body[..]);
        let end = offset.saturating_add(len).min(body.len());
        Ok(body.get(offset.min(end)..end).unwrap_or_default().to_vec())
    }

    fn call_body_reader(&self, size: usize) -> Box<dyn Read> {
        // A 150,000-IP snapshot is megabytes: read in place, not copied.
        let body = self.answer.map(|a| a.body.clone()).unwrap_or_default();
        Box::new(Cursor::new(body).take(size as u64))
    }
}

impl Stats for EnvoyHost<'_> {
    fn define_metric(&mut self, kind: MetricKind, name: &str) -> Option<u32> {
        self.metrics.id_of(kind, name)
    }

    fn increment_metric(&mut self, id: u32, by: u64) {
        self.metrics
            .update(self.config, self.filter, id, Update::Add(by));
    }

    fn record_metric(&mut self, id: u32, value: u64) {
        self.metrics
            .update(self.config, self.filter, id, Update::Set(value));
    }
}

impl Vm for EnvoyHost<'_> {
    fn set_tick_period(&mut self, period: Duration) -> bool {
        let ms = u64::try_from(period.as_millis()).unwrap_or(u64::MAX);
        self.metrics.tick_ms.store(ms, Ordering::Relaxed);
        true
    }

    fn vm_memory_bytes(&self) -> u64 {
        0
    }
}

/// Why Envoy refused to start a callout
/// (`envoy_dynamic_module_type_http_callout_init_result`), in the words the
/// engine logs after `dispatch to validator_cluster "..." failed: `.
fn callout_refusal(result: u32) -> &'static str {
    match result {
        1 => "MissingRequiredHeaders: the call lacks :method, :path or host",
        2 => "ClusterNotFound: Envoy has no cluster of that name",
        3 => "DuplicateCalloutId: Envoy reused a callout id",
        4 => "CannotCreateRequest: no healthy host to call",
        _ => "Envoy refused the callout",
    }
}

/// Sends a reply kept by [`EnvoyHost::send_reply`].
pub(super) fn send(filter: *mut c_void, reply: &Reply) {
    let headers = ModuleHeader::lend(reply.headers.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    // SAFETY: `filter` is the request's live handle; the headers and body
    // outlive the call.
    unsafe {
        envoy_dynamic_module_callback_http_send_response(
            filter,
            reply.status,
            headers.as_ptr(),
            headers.len(),
            ModuleBuffer::of(&reply.body),
            ModuleBuffer::of(b"staleguard"),
        )
    }
}

/// Copies headers out of Envoy's buffers.
///
/// # Safety
/// Each header's key and value must be valid for the call.
unsafe fn copy_headers(headers: &[EnvoyHeader]) -> RawHeaders {
    let text = |ptr: *const u8, len: usize| {
        // SAFETY: the caller vouches for each key and value.
        unsafe { EnvoyBuffer { ptr, len }.as_bytes() }
    };
    headers
        .iter()
        .map(|h| {
            (
                String::from_utf8_lossy(text(h.key, h.key_len)).into_owned(),
                text(h.value, h.value_len).to_vec(),
            )
        })
        .collect()
}

/// A callout's answer as Envoy reports it to a `*_http_callout_done` hook:
/// copied out of Envoy's buffers when `result` is [`CALLOUT_SUCCESS`], empty
/// otherwise (the engine then sees a call that failed).
///
/// # Safety
/// The arrays must hold `headers_len` headers and `chunks_len` buffers, each
/// valid for the call.
pub(super) unsafe fn received_answer(
    result: u32,
    headers: *const EnvoyHeader,
    headers_len: usize,
    chunks: *const EnvoyBuffer,
    chunks_len: usize,
) -> Answer {
    if result != CALLOUT_SUCCESS {
        return Answer::default();
    }
    let headers = if headers.is_null() {
        &[][..]
    } else {
        // SAFETY: the caller vouches for `headers_len` headers.
        unsafe { std::slice::from_raw_parts(headers, headers_len) }
    };
    let chunks = if chunks.is_null() {
        &[][..]
    } else {
        // SAFETY: the caller vouches for `chunks_len` buffers.
        unsafe { std::slice::from_raw_parts(chunks, chunks_len) }
    };
    Answer {
        // SAFETY: each header's key and value are valid for the call.
        headers: unsafe { copy_headers(headers) },
        body: {
            // Sized once: grown by doubling, a large answer would cost up to
            // twice its size, which the allocator keeps.
            let mut body = Vec::with_capacity(chunks.iter().map(|c| c.len).sum());
            for chunk in chunks {
                // SAFETY: each chunk is valid for the call.
                body.extend_from_slice(unsafe { chunk.as_bytes() });
            }
            Body(Arc::new(body))
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_text_from_envoy_is_lent_as_it_is_and_invalid_bytes_converted_lossily() {
        assert!(matches!(
            lent_text(b"10.0.0.1:8080"),
            Cow::Borrowed("10.0.0.1:8080")
        ));
        assert!(matches!(
            lent_text(b"outbound|8080||cart.shop.svc.cluster.local"),
            Cow::Borrowed("outbound|8080||cart.shop.svc.cluster.local")
        ));
        assert_eq!(lent_text("caf\u{e9}".as_bytes()), "caf\u{e9}");
        assert!(matches!(lent_text(b"a\xffb"), Cow::Owned(t) if t == "a\u{fffd}b"));
    }

    #[test]
    fn the_coarse_clock_reads_the_wall_clock_a_tick_behind_at_most() {
        let precise = || {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap()
                .as_millis() as u64
        };
        for _ in 0..100 {
            let before = precise();
            let coarse = coarse_now_ms().unwrap();
            let after = precise();
            // A tick is 1 to 10 ms (HZ 1000 to 100).
            assert!(
                coarse + 20 >= before && coarse <= after,
                "{before} {coarse} {after}"
            );
            std::thread::sleep(Duration::from_micros(300));
        }
    }
}
