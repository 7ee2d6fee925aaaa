//! The filter's [`Host`] over a dynamic module's handles, shared by the
//! extensions that run the filter's root: the upstream HTTP filter's config
//! ([`super::http`]) and the bootstrap extension ([`super::bootstrap`]).
//! They differ in which Envoy callbacks define and update metrics and send
//! callouts: a [`Surface`] names them.

use std::collections::HashMap;
use std::ffi::c_void;
use std::io::{Cursor, Read};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use staleguard_engine::host::{
    Callouts, Clock, MetricKind, RawHeaders, SharedData, Stats, StoreError, Stream, Vm,
};

use super::{EnvoyBuffer, ModuleBuffer};
use crate::index::ProcessStore;
use crate::stats::{Catalog, Resolved, FAMILIES};

/// A header the module lends Envoy.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct ModuleHeader {
    key: *const u8,
    key_len: usize,
    value: *const u8,
    value_len: usize,
}

impl ModuleHeader {
    /// Lends `headers` to Envoy (they must outlive the call they go to).
    fn lend<'a>(headers: impl Iterator<Item = (&'a str, &'a str)>) -> Vec<Self> {
        headers
            .map(|(k, v)| Self {
                key: k.as_ptr(),
                key_len: k.len(),
                value: v.as_ptr(),
                value_len: v.len(),
            })
            .collect()
    }
}

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
/// `envoy_dynamic_module_type_metrics_result_Success`.
pub(super) const METRICS_SUCCESS: u32 = 0;
/// `envoy_dynamic_module_type_http_callout_init_result_Success`.
pub(super) const CALLOUT_INIT_SUCCESS: u32 = 0;
/// `envoy_dynamic_module_type_http_callout_result_Success`.
pub(super) const CALLOUT_SUCCESS: u32 = 0;

/// The request-level callbacks the host calls (checked at program init).
pub(super) const CALLBACKS: &[&std::ffi::CStr] = &[
    c"envoy_dynamic_module_callback_http_filter_get_attribute_string",
    c"envoy_dynamic_module_callback_http_get_cluster_name",
    c"envoy_dynamic_module_callback_http_send_response",
    c"envoy_dynamic_module_callback_http_filter_increment_counter",
    c"envoy_dynamic_module_callback_http_filter_set_gauge",
];

/// Defines a metric on a config: `(config, name, label names, count, id out)`.
pub(super) type DefineFn =
    unsafe extern "C" fn(*mut c_void, ModuleBuffer, *const ModuleBuffer, usize, *mut usize) -> u32;
/// Updates a metric: `(handle, id, label values, count, value)`.
pub(super) type UpdateFn =
    unsafe extern "C" fn(*mut c_void, usize, *const ModuleBuffer, usize, u64) -> u32;
/// Sends a callout from a config: `(config, id out, cluster, headers, count,
/// body, timeout ms)`.
pub(super) type CalloutFn = unsafe extern "C" fn(
    *mut c_void,
    *mut u64,
    ModuleBuffer,
    *const ModuleHeader,
    usize,
    ModuleBuffer,
    u64,
) -> u32;

/// The config-level callbacks of one extension.
#[derive(Debug)]
pub(super) struct Surface {
    /// Defines a counter.
    pub(super) define_counter: DefineFn,
    /// Defines a gauge.
    pub(super) define_gauge: DefineFn,
    /// Adds to a counter from the config (none on the HTTP filter before
    /// ABI v0.2.0: the update waits for the next request).
    pub(super) increment_counter: Option<UpdateFn>,
    /// Sets a gauge from the config (same).
    pub(super) set_gauge: Option<UpdateFn>,
    /// Sends a callout.
    pub(super) callout: CalloutFn,
}

extern "C" {
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
    fn envoy_dynamic_module_callback_http_filter_increment_counter(
        filter: *mut c_void,
        id: usize,
        values: *const ModuleBuffer,
        values_len: usize,
        by: u64,
    ) -> u32;
    fn envoy_dynamic_module_callback_http_filter_set_gauge(
        filter: *mut c_void,
        id: usize,
        values: *const ModuleBuffer,
        values_len: usize,
        value: u64,
    ) -> u32;
}

// === impl Metrics ===

/// The filter's metrics as Envoy ids: families defined at config time, the
/// filter's metric ids (dotted names) resolved to a family and its labels,
/// and the updates made where no filter handle was at hand, applied by the
/// next request (Envoy 1.38 updates metrics only through a request).
pub(super) struct Metrics {
    surface: &'static Surface,
    envoy_ids: Vec<Option<usize>>,
    resolved: Vec<Resolved>,
    by_name: HashMap<(bool, String), u32>,
    pub(super) pending: Vec<(u32, Update)>,
    /// The timer period the root last asked for, in ms.
    pub(super) tick_ms: Arc<AtomicU64>,
}

#[derive(Debug, Clone, Copy)]
pub(super) enum Update {
    Add(u64),
    Set(u64),
}

impl Metrics {
    /// Defines every family on the config (during its creation: the only
    /// time Envoy allows it).
    pub(super) fn define(config: *mut c_void, surface: &'static Surface) -> Self {
        let envoy_ids = FAMILIES
            .iter()
            .map(|family| {
                let labels: Vec<ModuleBuffer> = family
                    .labels
                    .iter()
                    .map(|label| ModuleBuffer::of(label.as_bytes()))
                    .collect();
                let mut id = 0usize;
                let define = match family.kind {
                    MetricKind::Counter => surface.define_counter,
                    MetricKind::Gauge => surface.define_gauge,
                };
                // SAFETY: `config` is Envoy's config handle during its
                // creation; name and labels outlive the call; `id` is a
                // valid out slot.
                let result = unsafe {
                    define(
                        config,
                        ModuleBuffer::of(family.name.as_bytes()),
                        labels.as_ptr(),
                        labels.len(),
                        &mut id,
                    )
                };
                (result == METRICS_SUCCESS).then_some(id)
            })
            .collect();
        Self {
            surface,
            envoy_ids,
            resolved: Vec::new(),
            by_name: HashMap::new(),
            pending: Vec::new(),
            tick_ms: Arc::new(AtomicU64::new(1_000)),
        }
    }

    fn id_of(&mut self, kind: MetricKind, name: &str) -> Option<u32> {
        let key = (kind == MetricKind::Counter, name.to_owned());
        if let Some(id) = self.by_name.get(&key) {
            return Some(*id);
        }
        let Some(resolved) = Catalog.resolve(kind, name) else {
            log::warn!("staleguard: metric {name} is not in the native module's catalogue");
            return None;
        };
        let id = u32::try_from(self.resolved.len()).ok()?;
        self.resolved.push(resolved);
        self.by_name.insert(key, id);
        Some(id)
    }

    /// Applies `update` to metric `id` through `filter` (a request's handle)
    /// or, without one, through the config where the ABI allows it; else it
    /// waits for the next request.
    fn update(
        &mut self,
        config: *mut c_void,
        filter: Option<*mut c_void>,
        id: u32,
        update: Update,
    ) {
        let applied = match filter {
            Some(filter) => self.apply(filter, id, update, false),
            // A gauge from a config on the main thread describes the one
            // index of the process: it goes to the sink's root-scope gauge
            // when there is one, so the process shows one value, not one
            // per filter config.
            None if matches!(update, Update::Set(_)) && !self.is_sink(config) => {
                self.apply_via_sink(id, update) || self.apply(config, id, update, true)
            }
            None => self.apply(config, id, update, true),
        };
        if !applied {
            self.pending.push((id, update));
        }
    }

    pub(super) fn flush_pending(&mut self, filter: *mut c_void) {
        for (id, update) in std::mem::take(&mut self.pending) {
            self.apply(filter, id, update, false);
        }
    }

    /// Whether `config` is the sink's own config.
    fn is_sink(&self, config: *mut c_void) -> bool {
        let sink = SINK.lock().unwrap_or_else(PoisonError::into_inner);
        sink.as_ref()
            .is_some_and(|s| std::ptr::eq(s.config, config))
    }

    /// Applies an update of metric `id` through the sink, if there is one.
    fn apply_via_sink(&self, id: u32, update: Update) -> bool {
        let Some(resolved) = self.resolved.get(id as usize) else {
            return true;
        };
        let values: Vec<ModuleBuffer> = resolved
            .values
            .iter()
            .map(|v| ModuleBuffer::of(v.as_bytes()))
            .collect();
        apply_on_sink(resolved.family, &values, update)
    }

    /// True when the update reached Envoy (or can never: an unknown id).
    fn apply(&self, target: *mut c_void, id: u32, update: Update, on_config: bool) -> bool {
        let Some(resolved) = self.resolved.get(id as usize) else {
            return true;
        };
        let Some(Some(envoy_id)) = self.envoy_ids.get(resolved.family) else {
            return true;
        };
        let values: Vec<ModuleBuffer> = resolved
            .values
            .iter()
            .map(|v| ModuleBuffer::of(v.as_bytes()))
            .collect();
        let (call, target, envoy_id) = match (update, on_config) {
            (Update::Add(_), false) => (
                envoy_dynamic_module_callback_http_filter_increment_counter as UpdateFn,
                target,
                *envoy_id,
            ),
            (Update::Set(_), false) => (
                envoy_dynamic_module_callback_http_filter_set_gauge as UpdateFn,
                target,
                *envoy_id,
            ),
            (Update::Add(_), true) => match self.surface.increment_counter {
                Some(call) => (call, target, *envoy_id),
                None => return apply_on_sink(resolved.family, &values, update),
            },
            (Update::Set(_), true) => match self.surface.set_gauge {
                Some(call) => (call, target, *envoy_id),
                None => return apply_on_sink(resolved.family, &values, update),
            },
        };
        let (Update::Add(n) | Update::Set(n)) = update;
        // SAFETY: `target` is the live filter (or config) handle of the hook
        // running now; the label buffers outlive the call.
        unsafe { call(target, envoy_id, values.as_ptr(), values.len(), n) };
        true
    }
}

// === the sink ===

/// Where a config that cannot update its metrics itself (the HTTP filter's
/// before ABI v0.2.0) updates them from the main thread instead: the
/// bootstrap extension's config, when one runs, with its own ids of the same
/// families. The update then lands in the root stats scope, not the
/// cluster's.
pub(super) struct Sink {
    config: *mut c_void,
    surface: &'static Surface,
    envoy_ids: Vec<Option<usize>>,
}

// SAFETY: the sink is only used on Envoy's main thread (config ticks and
// callout answers); the mutex only makes the static well-formed.
unsafe impl Send for Sink {}

static SINK: Mutex<Option<Sink>> = Mutex::new(None);

impl Metrics {
    /// Makes this config's metrics the sink of the others' (the bootstrap
    /// extension's, on the main thread; `None` when it goes).
    pub(super) fn become_sink(&self, config: Option<*mut c_void>) {
        let sink = config.map(|config| Sink {
            config,
            surface: self.surface,
            envoy_ids: self.envoy_ids.clone(),
        });
        *SINK.lock().unwrap_or_else(PoisonError::into_inner) = sink;
    }
}

/// Applies an update through the sink; false (keep it for the next
/// request) when there is none.
fn apply_on_sink(family: usize, values: &[ModuleBuffer], update: Update) -> bool {
    let sink = SINK.lock().unwrap_or_else(PoisonError::into_inner);
    let Some(sink) = sink.as_ref() else {
        return false;
    };
    let Some(Some(envoy_id)) = sink.envoy_ids.get(family) else {
        return false;
    };
    let call = match update {
        Update::Add(_) => sink.surface.increment_counter,
        Update::Set(_) => sink.surface.set_gauge,
    };
    let Some(call) = call else {
        return false;
    };
    let (Update::Add(n) | Update::Set(n)) = update;
    // SAFETY: the sink's config handle is alive until its config_destroy
    // clears the sink; we are on the main thread, as it requires.
    unsafe { call(sink.config, *envoy_id, values.as_ptr(), values.len(), n) };
    true
}

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
    /// The body, whole.
    pub(super) body: Vec<u8>,
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
    fn cluster_name(&self) -> Option<String> {
        // SAFETY: the request's live handle and a valid out slot.
        self.read(|filter, out| unsafe {
            envoy_dynamic_module_callback_http_get_cluster_name(filter, out)
        })
    }

    fn attribute(&self, id: u32) -> Option<String> {
        // SAFETY: the request's live handle and a valid out slot.
        self.read(|filter, out| unsafe {
            envoy_dynamic_module_callback_http_filter_get_attribute_string(filter, id, out)
        })
    }

    /// A text Envoy lends for this hook through `call`, which fills an
    /// out buffer from the request's handle; `None` without a request or
    /// when Envoy has none.
    fn read(&self, call: impl FnOnce(*mut c_void, *mut EnvoyBuffer) -> bool) -> Option<String> {
        let filter = self.filter?;
        let mut out = EnvoyBuffer {
            ptr: std::ptr::null(),
            len: 0,
        };
        let found = call(filter, &mut out);
        // SAFETY: Envoy filled `out` (or left it empty) for the duration of
        // this hook.
        let bytes = unsafe { out.as_bytes() };
        (found && !bytes.is_empty()).then(|| String::from_utf8_lossy(bytes).into_owned())
    }
}

impl SharedData for EnvoyHost<'_> {
    fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, u32), StoreError> {
        self.store.get(key)
    }

    fn set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        self.store.set(key, value, cas)
    }
}

impl Clock for EnvoyHost<'_> {
    fn now_us(&self) -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
    }

    fn random_u64(&self) -> u64 {
        use std::hash::{BuildHasher, Hasher};
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_u64(self.now_us());
        hasher.finish()
    }
}

impl Stream for EnvoyHost<'_> {
    fn property(&self, path: &[&str]) -> Option<String> {
        match path {
            ["upstream", "address"] => self.attribute(ATTRIBUTE_UPSTREAM_ADDRESS),
            ["xds", "cluster_name"] => self.cluster_name(),
            // Cluster metadata (Istio's service list) is not read: clusters
            // map by rules and their names (docs/native.md, "Limits").
            _ => None,
        }
    }

    fn request_header(&self, _name: &str) -> Option<String> {
        None
    }

    fn request_headers(&self) -> RawHeaders {
        Vec::new()
    }

    fn remove_request_header(&mut self, _name: &str) {}

    fn set_request_header(&mut self, _name: &str, _value: &str) {}

    fn remove_response_header(&mut self, _name: &str) {}

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
        if self.filter.is_some() {
            return Err("the native build makes no callout from a request".into());
        }
        let module_headers = ModuleHeader::lend(headers.iter().map(|(k, v)| (*k, *v)));
        let mut callout_id = 0u64;
        // SAFETY: `config` is the live config handle on the main thread (a
        // tick or a callout's answer); every buffer outlives the call.
        let result = unsafe {
            (self.metrics.surface.callout)(
                self.config,
                &mut callout_id,
                ModuleBuffer::of(cluster.as_bytes()),
                module_headers.as_ptr(),
                module_headers.len(),
                ModuleBuffer::of(&[]),
                u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
            )
        };
        if result == CALLOUT_INIT_SUCCESS {
            // Callout ids count up from 1 per config: a u32 names them for
            // longer than any poller runs.
            Ok(callout_id as u32)
        } else {
            Err(format!("callout refused (init result {result})"))
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
        let body = self.answer.map_or(&[][..], |a| a.body.as_slice());
        let end = offset.saturating_add(len).min(body.len());
        Ok(body.get(offset.min(end)..end).unwrap_or_default().to_vec())
    }

    fn call_body_reader(&self, size: usize) -> Box<dyn Read> {
        let body = self.answer.map_or(&[][..], |a| a.body.as_slice());
        let body = body
            .get(..size.min(body.len()))
            .unwrap_or_default()
            .to_vec();
        Box::new(Cursor::new(body))
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

/// Copies a callout's answer out of Envoy's buffers.
///
/// # Safety
/// The arrays must hold `headers_len` headers and `chunks_len` buffers, each
/// valid for the call.
pub(super) unsafe fn copy_answer(
    headers: *const EnvoyHeader,
    headers_len: usize,
    chunks: *const EnvoyBuffer,
    chunks_len: usize,
) -> Answer {
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
    let text = |ptr: *const u8, len: usize| {
        // SAFETY: each header's key and value are valid for the call.
        unsafe { EnvoyBuffer { ptr, len }.as_bytes() }
    };
    Answer {
        headers: headers
            .iter()
            .map(|h| {
                (
                    String::from_utf8_lossy(text(h.key, h.key_len)).into_owned(),
                    text(h.value, h.value_len).to_vec(),
                )
            })
            .collect(),
        body: chunks
            .iter()
            // SAFETY: each chunk is valid for the call.
            .flat_map(|c| unsafe { c.as_bytes() }.iter().copied())
            .collect(),
    }
}
