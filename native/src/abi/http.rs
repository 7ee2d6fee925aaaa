//! The upstream HTTP filter (`envoy.filters.http.dynamic_modules`) over the
//! filter's own logic.
//!
//! Envoy makes one filter config per filter in a cluster's `http_filters`
//! (main thread) and one filter per request (on the worker that serves it).
//! A config holds what a Wasm VM holds: the filter's [`Root`] (configuration,
//! lease, poller, per-request counts) behind one lock, and every request's
//! [`Filter`] is made by it and used under the same lock, so the filter's
//! state, written for one thread, is only ever touched by one thread at a
//! time. The poller runs on the main thread: a ticker thread wakes the
//! config's scheduler at the period the root asks for
//! ([`Host::set_tick_period`]), the tick sends the validator calls as config
//! callouts, and their answers come back to the root. The index it writes is
//! the process's ([`crate::index`]), read by every worker.
//!
//! A reply is sent after the lock is released (Envoy may run the answer
//! through the filter chain at once). Every hook answers "continue" when its
//! body fails. The hooks are not `pub`: Envoy finds them by their
//! unmangled names, and nothing in Rust may call them.

use std::collections::HashMap;
use std::ffi::{c_void, CStr};
use std::io::{Cursor, Read};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use proxy_wasm::types::Action;
use staleguard_filter::host::{Host, MetricKind, RawHeaders};
use staleguard_filter::request::Filter;
use staleguard_filter::root::Root;
use staleguard_filter::store::{SharedData, StoreError};

use super::{contain, EnvoyBuffer, ModuleBuffer};
use crate::index::ProcessStore;
use crate::stats::{Catalog, Resolved, FAMILIES};

// === ABI ===

/// A header the module lends Envoy.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct ModuleHeader {
    key: *const u8,
    key_len: usize,
    value: *const u8,
    value_len: usize,
}

/// A header Envoy lends the module.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct EnvoyHeader {
    key: *const u8,
    key_len: usize,
    value: *const u8,
    value_len: usize,
}

/// `envoy_dynamic_module_type_attribute_id_UpstreamAddress`.
const ATTRIBUTE_UPSTREAM_ADDRESS: u32 = 41;
/// `envoy_dynamic_module_type_attribute_id_XdsClusterName`.
const ATTRIBUTE_XDS_CLUSTER_NAME: u32 = 57;
/// `envoy_dynamic_module_type_metrics_result_Success`.
const METRICS_SUCCESS: u32 = 0;
/// `envoy_dynamic_module_type_http_callout_init_result_Success`.
const CALLOUT_INIT_SUCCESS: u32 = 0;
/// `envoy_dynamic_module_type_http_callout_result_Success`.
const CALLOUT_SUCCESS: u32 = 0;
/// Status 0 of every `on_http_filter_*_status` enum: continue.
const CONTINUE: u32 = 0;
/// Status 1 of the headers status enums: stop iteration.
const STOP_ITERATION: u32 = 1;

extern "C" {
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
    fn envoy_dynamic_module_callback_http_filter_config_define_counter(
        config: *mut c_void,
        name: ModuleBuffer,
        labels: *const ModuleBuffer,
        labels_len: usize,
        id: *mut usize,
    ) -> u32;
    fn envoy_dynamic_module_callback_http_filter_config_define_gauge(
        config: *mut c_void,
        name: ModuleBuffer,
        labels: *const ModuleBuffer,
        labels_len: usize,
        id: *mut usize,
    ) -> u32;
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
    #[cfg(feature = "abi-v0-2")]
    fn envoy_dynamic_module_callback_http_filter_config_increment_counter(
        config: *mut c_void,
        id: usize,
        values: *const ModuleBuffer,
        values_len: usize,
        by: u64,
    ) -> u32;
    #[cfg(feature = "abi-v0-2")]
    fn envoy_dynamic_module_callback_http_filter_config_set_gauge(
        config: *mut c_void,
        id: usize,
        values: *const ModuleBuffer,
        values_len: usize,
        value: u64,
    ) -> u32;
    fn envoy_dynamic_module_callback_http_filter_config_http_callout(
        config: *mut c_void,
        callout_id: *mut u64,
        cluster: ModuleBuffer,
        headers: *const ModuleHeader,
        headers_len: usize,
        body: ModuleBuffer,
        timeout_ms: u64,
    ) -> u32;
    fn envoy_dynamic_module_callback_http_filter_config_scheduler_new(
        config: *mut c_void,
    ) -> *mut c_void;
    fn envoy_dynamic_module_callback_http_filter_config_scheduler_commit(
        scheduler: *mut c_void,
        event_id: u64,
    );
    fn envoy_dynamic_module_callback_http_filter_config_scheduler_delete(scheduler: *mut c_void);
}

/// The Envoy callbacks the filter calls (checked at program init).
pub(crate) const CALLBACKS: &[&CStr] = &[
    c"envoy_dynamic_module_callback_http_filter_get_attribute_string",
    c"envoy_dynamic_module_callback_http_send_response",
    c"envoy_dynamic_module_callback_http_filter_config_define_counter",
    c"envoy_dynamic_module_callback_http_filter_config_define_gauge",
    c"envoy_dynamic_module_callback_http_filter_increment_counter",
    c"envoy_dynamic_module_callback_http_filter_set_gauge",
    #[cfg(feature = "abi-v0-2")]
    c"envoy_dynamic_module_callback_http_filter_config_increment_counter",
    #[cfg(feature = "abi-v0-2")]
    c"envoy_dynamic_module_callback_http_filter_config_set_gauge",
    c"envoy_dynamic_module_callback_http_filter_config_http_callout",
    c"envoy_dynamic_module_callback_http_filter_config_scheduler_new",
    c"envoy_dynamic_module_callback_http_filter_config_scheduler_commit",
    c"envoy_dynamic_module_callback_http_filter_config_scheduler_delete",
];

/// The `filter_name` of a filter that does nothing (no callback, no
/// lock): the baseline of the per-request cost (docs/benchmarks.md).
pub const NOOP_FILTER_NAME: &str = "noop";

// === impl FilterConfig ===

/// One filter config: the filter's root and its metrics, behind one lock.
struct FilterConfig {
    envoy: *mut c_void,
    vm: Mutex<Vm>,
    scheduler: *mut c_void,
    ticker: Option<Ticker>,
    next_context: AtomicU32,
}

/// What the lock guards: everything that holds the filter's single-threaded
/// state (`Rc`s inside [`Root`] and every [`Filter`] it made).
struct Vm {
    root: Root,
    metrics: Metrics,
}

impl FilterConfig {
    fn lock(&self) -> MutexGuard<'_, Vm> {
        self.vm.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The config handle a hook gets, turned back into the config.
///
/// # Safety
/// `config` must come from `envoy_dynamic_module_on_http_filter_config_new`
/// and not be destroyed yet (Envoy destroys a config after its filters).
unsafe fn config_of<'a>(config: *const c_void) -> Option<&'a Config> {
    // SAFETY: the caller vouches the pointer is one of ours and alive.
    unsafe { config.cast::<Config>().as_ref() }
}

/// A config as Envoy holds it.
enum Config {
    Guard(Box<FilterConfig>),
    Noop,
}

/// Wakes the config's scheduler at the period the root asked for.
struct Ticker {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<()>,
}

/// The scheduler pointer, moved to the ticker thread: Envoy's scheduler
/// commit may be called from any thread.
struct SchedulerPtr(*mut c_void);
// SAFETY: the scheduler is Envoy's thread-safe queue onto the main thread;
// the pointer lives until config_destroy, which stops the ticker first.
unsafe impl Send for SchedulerPtr {}

impl Ticker {
    fn start(scheduler: *mut c_void, period_ms: Arc<AtomicU64>) -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let scheduler = SchedulerPtr(scheduler);
        let thread = std::thread::Builder::new()
            .name("staleguard-tick".into())
            .spawn({
                let stop = stop.clone();
                move || {
                    let scheduler = scheduler;
                    while !stop.load(Ordering::Acquire) {
                        let period = period_ms.load(Ordering::Relaxed).max(1);
                        std::thread::park_timeout(Duration::from_millis(period));
                        if stop.load(Ordering::Acquire) {
                            break;
                        }
                        // SAFETY: the scheduler is alive until the ticker is
                        // stopped and joined (config_destroy).
                        unsafe {
                            envoy_dynamic_module_callback_http_filter_config_scheduler_commit(
                                scheduler.0,
                                0,
                            )
                        };
                    }
                }
            })?;
        Ok(Self { stop, thread })
    }

    fn stop(self) {
        self.stop.store(true, Ordering::Release);
        self.thread.thread().unpark();
        let _ = self.thread.join();
    }
}

// === impl Metrics ===

/// The filter's metrics as Envoy ids: families defined at config time, the
/// filter's metric ids (dotted names) resolved to a family and its labels,
/// and the updates made where no filter handle was at hand, applied by the
/// next request (Envoy 1.38 updates metrics only through a request).
#[derive(Default)]
struct Metrics {
    envoy_ids: Vec<Option<usize>>,
    resolved: Vec<Resolved>,
    by_name: HashMap<(bool, String), u32>,
    pending: Vec<(u32, Update)>,
    tick_ms: Arc<AtomicU64>,
}

#[derive(Debug, Clone, Copy)]
enum Update {
    Add(u64),
    Set(u64),
}

impl Metrics {
    /// Defines every family on the config (the only time Envoy allows it).
    fn define(config: *mut c_void) -> Self {
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
                    MetricKind::Counter => {
                        envoy_dynamic_module_callback_http_filter_config_define_counter
                    }
                    MetricKind::Gauge => {
                        envoy_dynamic_module_callback_http_filter_config_define_gauge
                    }
                };
                // SAFETY: `config` is Envoy's config handle during config_new;
                // name and labels outlive the call; `id` is a valid out slot.
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
            envoy_ids,
            ..Self::default()
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
            None => self.apply(config, id, update, true),
        };
        if !applied {
            self.pending.push((id, update));
        }
    }

    fn flush_pending(&mut self, filter: *mut c_void) {
        for (id, update) in std::mem::take(&mut self.pending) {
            self.apply(filter, id, update, false);
        }
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
        let call = match (update, on_config) {
            (Update::Add(_), false) => envoy_dynamic_module_callback_http_filter_increment_counter,
            (Update::Set(_), false) => envoy_dynamic_module_callback_http_filter_set_gauge,
            #[cfg(feature = "abi-v0-2")]
            (Update::Add(_), true) => {
                envoy_dynamic_module_callback_http_filter_config_increment_counter
            }
            #[cfg(feature = "abi-v0-2")]
            (Update::Set(_), true) => envoy_dynamic_module_callback_http_filter_config_set_gauge,
            #[cfg(not(feature = "abi-v0-2"))]
            (_, true) => return false,
        };
        let (Update::Add(n) | Update::Set(n)) = update;
        // SAFETY: `target` is the live filter (or config) handle of the hook
        // running now; the label buffers outlive the call.
        unsafe { call(target, *envoy_id, values.as_ptr(), values.len(), n) };
        true
    }
}

// === impl EnvoyHost ===

/// The filter's [`Host`] over one hook's handles: the config's always, a
/// request's when the hook has one, a callout's answer while it is
/// delivered. A reply is kept for the hook to send after the lock.
struct EnvoyHost<'a> {
    config: *mut c_void,
    filter: Option<*mut c_void>,
    metrics: &'a mut Metrics,
    answer: Option<&'a Answer>,
    reply: Option<Reply>,
    store: ProcessStore,
}

/// A callout's answer, copied out of Envoy's buffers.
#[derive(Debug, Default)]
struct Answer {
    headers: RawHeaders,
    body: Vec<u8>,
}

/// A local reply to send once the lock is released.
#[derive(Debug)]
struct Reply {
    status: u32,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl<'a> EnvoyHost<'a> {
    fn new(config: &FilterConfig, filter: Option<*mut c_void>, metrics: &'a mut Metrics) -> Self {
        Self {
            config: config.envoy,
            filter,
            metrics,
            answer: None,
            reply: None,
            store: ProcessStore,
        }
    }

    fn attribute(&self, id: u32) -> Option<String> {
        let filter = self.filter?;
        let mut out = EnvoyBuffer {
            ptr: std::ptr::null(),
            len: 0,
        };
        // SAFETY: `filter` is the request's live handle; `out` is a valid
        // out slot Envoy fills with a buffer valid during this hook.
        let found = unsafe {
            envoy_dynamic_module_callback_http_filter_get_attribute_string(filter, id, &mut out)
        };
        // SAFETY: Envoy filled `out` for the duration of this hook.
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

impl Host for EnvoyHost<'_> {
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

    fn property(&self, path: &[&str]) -> Option<String> {
        match path {
            ["upstream", "address"] => self.attribute(ATTRIBUTE_UPSTREAM_ADDRESS),
            ["xds", "cluster_name"] => self.attribute(ATTRIBUTE_XDS_CLUSTER_NAME),
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

    fn dispatch_call(
        &mut self,
        cluster: &str,
        headers: &[(&str, &str)],
        timeout: Duration,
    ) -> Result<u32, String> {
        if self.filter.is_some() {
            return Err("the native build makes no callout from a request".into());
        }
        let module_headers: Vec<ModuleHeader> = headers
            .iter()
            .map(|(k, v)| ModuleHeader {
                key: k.as_ptr(),
                key_len: k.len(),
                value: v.as_ptr(),
                value_len: v.len(),
            })
            .collect();
        let mut callout_id = 0u64;
        // SAFETY: `config` is the live config handle on the main thread (a
        // tick or a callout's answer); every buffer outlives the call.
        let result = unsafe {
            envoy_dynamic_module_callback_http_filter_config_http_callout(
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
fn send(filter: *mut c_void, reply: &Reply) {
    let headers: Vec<ModuleHeader> = reply
        .headers
        .iter()
        .map(|(k, v)| ModuleHeader {
            key: k.as_ptr(),
            key_len: k.len(),
            value: v.as_ptr(),
            value_len: v.len(),
        })
        .collect();
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

// === hooks ===

/// A filter config: Envoy rejects the configuration when this returns null.
/// `config` is the plugin configuration (the Wasm filter's schema).
#[no_mangle]
extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    config_envoy: *mut c_void,
    name: EnvoyBuffer,
    config: EnvoyBuffer,
) -> *const c_void {
    contain("http_filter_config_new", std::ptr::null(), || {
        super::init_logger();
        // SAFETY: Envoy lends both buffers for this call.
        let (name, bytes) = unsafe { (name.as_bytes(), config.as_bytes()) };
        if name == NOOP_FILTER_NAME.as_bytes() {
            return Box::into_raw(Box::new(Config::Noop)).cast_const().cast();
        }
        let mut metrics = Metrics::define(config_envoy);
        metrics.tick_ms.store(1_000, Ordering::Relaxed);
        let mut root = Root::new(1);
        let mut host = EnvoyHost {
            config: config_envoy,
            filter: None,
            metrics: &mut metrics,
            answer: None,
            reply: None,
            store: ProcessStore,
        };
        root.configure(&mut host, bytes);
        // SAFETY: the config handle is valid during config_new.
        let scheduler =
            unsafe { envoy_dynamic_module_callback_http_filter_config_scheduler_new(config_envoy) };
        let ticker = if scheduler.is_null() {
            log::error!("staleguard: no scheduler for the filter config: the poller cannot run");
            None
        } else {
            match Ticker::start(scheduler, metrics.tick_ms.clone()) {
                Ok(t) => Some(t),
                Err(e) => {
                    log::error!("staleguard: cannot start the poller's ticker: {e}");
                    None
                }
            }
        };
        let config = FilterConfig {
            envoy: config_envoy,
            vm: Mutex::new(Vm { root, metrics }),
            scheduler,
            ticker,
            next_context: AtomicU32::new(2),
        };
        Box::into_raw(Box::new(Config::Guard(Box::new(config))))
            .cast_const()
            .cast()
    })
}

/// Envoy drops a filter config: the ticker stops, the lease goes.
#[no_mangle]
extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(config: *const c_void) {
    contain("http_filter_config_destroy", (), || {
        if config.is_null() {
            return;
        }
        // SAFETY: `config` came from Box::into_raw in config_new, and Envoy
        // destroys each config once, after its filters.
        let config = unsafe { Box::from_raw(config.cast_mut().cast::<Config>()) };
        if let Config::Guard(mut config) = *config {
            if let Some(ticker) = config.ticker.take() {
                ticker.stop();
            }
            {
                let mut vm = config.lock();
                let Vm { root, metrics } = &mut *vm;
                let mut host = EnvoyHost::new(&config, None, metrics);
                root.done(&mut host);
            }
            if !config.scheduler.is_null() {
                // SAFETY: ours since scheduler_new; the ticker is stopped.
                unsafe {
                    envoy_dynamic_module_callback_http_filter_config_scheduler_delete(
                        config.scheduler,
                    )
                };
            }
        }
    })
}

/// The ticker's wake-up, on the main thread: the root's tick (lease, poll,
/// gauges, counter flush).
#[no_mangle]
extern "C" fn envoy_dynamic_module_on_http_filter_config_scheduled(
    _config_envoy: *mut c_void,
    config: *const c_void,
    _event_id: u64,
) {
    contain("http_filter_config_scheduled", (), || {
        // SAFETY: Envoy passes the config this module made, alive.
        let Some(Config::Guard(config)) = (unsafe { config_of(config) }) else {
            return;
        };
        let mut vm = config.lock();
        let Vm { root, metrics } = &mut *vm;
        let mut host = EnvoyHost::new(config, None, metrics);
        root.tick(&mut host);
    })
}

/// A validator call's answer (or its failure), on the main thread.
#[no_mangle]
extern "C" fn envoy_dynamic_module_on_http_filter_config_http_callout_done(
    _config_envoy: *mut c_void,
    config: *const c_void,
    callout_id: u64,
    result: u32,
    headers: *const EnvoyHeader,
    headers_len: usize,
    chunks: *const EnvoyBuffer,
    chunks_len: usize,
) {
    contain("http_filter_config_http_callout_done", (), || {
        // SAFETY: Envoy passes the config this module made, alive.
        let Some(Config::Guard(config)) = (unsafe { config_of(config) }) else {
            return;
        };
        let answer = if result == CALLOUT_SUCCESS {
            // SAFETY: Envoy lends the header and chunk arrays, and the
            // buffers they point to, for this call.
            unsafe { copy_answer(headers, headers_len, chunks, chunks_len) }
        } else {
            Answer::default()
        };
        let header_count = answer.headers.len();
        let body_size = answer.body.len();
        let mut vm = config.lock();
        let Vm { root, metrics } = &mut *vm;
        let mut host = EnvoyHost::new(config, None, metrics);
        host.answer = Some(&answer);
        root.call_response(&mut host, callout_id as u32, header_count, body_size);
    })
}

/// Copies a callout's answer out of Envoy's buffers.
///
/// # Safety
/// The arrays must hold `headers_len` headers and `chunks_len` buffers, each
/// valid for the call.
unsafe fn copy_answer(
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

/// One request's filter: the root's [`Filter`], used only under the lock.
struct RequestFilter {
    config: *const FilterConfig,
    filter: Option<Filter>,
}

/// A request's filter: Envoy closes the stream when this returns null.
#[no_mangle]
extern "C" fn envoy_dynamic_module_on_http_filter_new(
    config: *const c_void,
    _filter_envoy: *mut c_void,
) -> *const c_void {
    contain("http_filter_new", std::ptr::null(), || {
        // SAFETY: Envoy passes the config this module made, alive.
        match unsafe { config_of(config) } {
            Some(Config::Guard(config)) => {
                let id = config.next_context.fetch_add(1, Ordering::Relaxed);
                let filter = config.lock().root.filter(id);
                Box::into_raw(Box::new(RequestFilter {
                    config: &**config,
                    filter: Some(filter),
                }))
                .cast_const()
                .cast()
            }
            // A no-op filter has no state; Envoy needs a non-null handle.
            Some(Config::Noop) => std::ptr::NonNull::<u8>::dangling()
                .as_ptr()
                .cast_const()
                .cast(),
            None => std::ptr::null(),
        }
    })
}

/// Runs `step` on a request's filter under its config's lock, then sends
/// the reply it kept, if any; `None` for a no-op filter.
fn with_request(
    filter_envoy: *mut c_void,
    request: *const c_void,
    step: impl FnOnce(&mut Filter, &mut EnvoyHost<'_>) -> Action,
) -> Option<Action> {
    // SAFETY: callers pass null or a RequestFilter made by filter_new and
    // alive until filter_destroy (the no-op marker is filtered out first).
    let request = unsafe { request.cast_mut().cast::<RequestFilter>().as_mut() }?;
    // SAFETY: a filter's config outlives it.
    let config = unsafe { request.config.as_ref() }?;
    let reply = {
        let mut vm = config.lock();
        let filter = request.filter.as_mut()?;
        let Vm { metrics, .. } = &mut *vm;
        if !metrics.pending.is_empty() {
            metrics.flush_pending(filter_envoy);
        }
        let mut host = EnvoyHost::new(config, Some(filter_envoy), metrics);
        let action = step(filter, &mut host);
        host.reply.take().map(|r| (r, action)).ok_or(action)
    };
    match reply {
        Ok((reply, action)) => {
            send(filter_envoy, &reply);
            Some(action)
        }
        Err(action) => Some(action),
    }
}

fn status_of(action: Option<Action>) -> u32 {
    match action {
        Some(Action::Pause) => STOP_ITERATION,
        _ => CONTINUE,
    }
}

/// The request's headers: the verdict on the host Envoy picked.
#[no_mangle]
extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(
    filter_envoy: *mut c_void,
    request: *const c_void,
    end_of_stream: bool,
) -> u32 {
    contain("http_filter_request_headers", CONTINUE, || {
        if is_noop(request) {
            return CONTINUE;
        }
        status_of(with_request(filter_envoy, request, |f, host| {
            f.request_headers(host, end_of_stream)
        }))
    })
}

/// The upstream's answer headers.
#[no_mangle]
extern "C" fn envoy_dynamic_module_on_http_filter_response_headers(
    filter_envoy: *mut c_void,
    request: *const c_void,
    _end_of_stream: bool,
) -> u32 {
    contain("http_filter_response_headers", CONTINUE, || {
        if is_noop(request) {
            return CONTINUE;
        }
        status_of(with_request(filter_envoy, request, |f, host| {
            f.response_headers(host)
        }))
    })
}

/// True for the no-op filter's handle.
fn is_noop(request: *const c_void) -> bool {
    std::ptr::eq(
        request,
        std::ptr::NonNull::<u8>::dangling()
            .as_ptr()
            .cast_const()
            .cast(),
    )
}

/// Envoy drops a request's filter (under the lock: it holds the root's
/// shared state).
#[no_mangle]
extern "C" fn envoy_dynamic_module_on_http_filter_destroy(request: *const c_void) {
    contain("http_filter_destroy", (), || {
        if request.is_null() || is_noop(request) {
            return;
        }
        // SAFETY: made by Box::into_raw in filter_new; Envoy destroys each
        // filter once.
        let mut request = unsafe { Box::from_raw(request.cast_mut().cast::<RequestFilter>()) };
        // SAFETY: a filter's config outlives it.
        if let Some(config) = unsafe { request.config.as_ref() } {
            let _vm = config.lock();
            drop(request.filter.take());
        }
    })
}

/// The hooks the filter has no use for answer "continue" (Envoy requires
/// each of them to be exported).
macro_rules! pass_through {
    ($($hook:ident),* $(,)?) => {$(
        /// Not used by the guard: continue.
        #[no_mangle]
        extern "C" fn $hook(
            _filter_envoy: *mut c_void,
            _filter: *const c_void,
            _end_of_stream: bool,
        ) -> u32 {
            CONTINUE
        }
    )*};
}

pass_through!(
    envoy_dynamic_module_on_http_filter_request_body,
    envoy_dynamic_module_on_http_filter_request_trailers,
    envoy_dynamic_module_on_http_filter_response_body,
    envoy_dynamic_module_on_http_filter_response_trailers,
);

/// The notifications the filter has no use for. Their arguments are
/// ignored, so they take none (the C calling convention lets the caller
/// pass any).
macro_rules! ignored {
    ($($hook:ident),* $(,)?) => {$(
        /// Not used by the guard.
        #[no_mangle]
        extern "C" fn $hook() {}
    )*};
}

ignored!(
    envoy_dynamic_module_on_http_filter_stream_complete,
    envoy_dynamic_module_on_http_filter_http_callout_done,
    envoy_dynamic_module_on_http_filter_http_stream_headers,
    envoy_dynamic_module_on_http_filter_http_stream_data,
    envoy_dynamic_module_on_http_filter_http_stream_trailers,
    envoy_dynamic_module_on_http_filter_http_stream_complete,
    envoy_dynamic_module_on_http_filter_http_stream_reset,
    envoy_dynamic_module_on_http_filter_scheduled,
    envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark,
    envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark,
);
