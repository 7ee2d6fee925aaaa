//! The upstream HTTP filter (`envoy.filters.http.dynamic_modules`) over the
//! engine, the Wasm filter's logic.
//!
//! Envoy makes one filter config per filter in a cluster's `http_filters`
//! (main thread) and one filter per request (on the worker that serves it).
//! A config holds what a Wasm VM holds: the engine's [`Root`] (configuration,
//! lease, poller, per-request counts) behind one lock, and every request's
//! [`Filter`] is made by it and used under the same lock, so the engine's
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

use std::ffi::{c_void, CStr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use staleguard_engine::host::Next;
use staleguard_engine::request::Filter;
use staleguard_engine::root::Root;

use super::bootstrap::PAGE_BYTES;
use super::host::{received_answer, send, Answer, EnvoyHeader, EnvoyHost, Metrics, Surface};
use super::{contain, EnvoyBuffer, ModuleBuffer};

// === ABI ===

/// Status 0 of every `on_http_filter_*_status` enum: continue.
const CONTINUE: u32 = 0;
/// Status 1 of the headers status enums: stop iteration.
const STOP_ITERATION: u32 = 1;

extern "C" {
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
        headers: *const super::ModuleHeader,
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
    c"envoy_dynamic_module_callback_http_filter_config_define_counter",
    c"envoy_dynamic_module_callback_http_filter_config_define_gauge",
    #[cfg(feature = "abi-v0-2")]
    c"envoy_dynamic_module_callback_http_filter_config_increment_counter",
    #[cfg(feature = "abi-v0-2")]
    c"envoy_dynamic_module_callback_http_filter_config_set_gauge",
    c"envoy_dynamic_module_callback_http_filter_config_http_callout",
    c"envoy_dynamic_module_callback_http_filter_config_scheduler_new",
    c"envoy_dynamic_module_callback_http_filter_config_scheduler_commit",
    c"envoy_dynamic_module_callback_http_filter_config_scheduler_delete",
];

/// The HTTP filter config's callbacks. Before ABI v0.2.0 (Envoy 1.38, 1.39)
/// a filter config cannot update a metric itself: its updates wait for the
/// next request's handle.
static SURFACE: Surface = Surface {
    define_counter: envoy_dynamic_module_callback_http_filter_config_define_counter,
    define_gauge: envoy_dynamic_module_callback_http_filter_config_define_gauge,
    #[cfg(feature = "abi-v0-2")]
    increment_counter: Some(envoy_dynamic_module_callback_http_filter_config_increment_counter),
    #[cfg(not(feature = "abi-v0-2"))]
    increment_counter: None,
    #[cfg(feature = "abi-v0-2")]
    set_gauge: Some(envoy_dynamic_module_callback_http_filter_config_set_gauge),
    #[cfg(not(feature = "abi-v0-2"))]
    set_gauge: None,
    callout: envoy_dynamic_module_callback_http_filter_config_http_callout,
};

/// The `filter_name` of a filter that does nothing (no callback, no
/// lock): the baseline of the per-request cost (docs/benchmarks.md).
pub const NOOP_FILTER_NAME: &str = "noop";

// === impl FilterConfig ===

/// One filter config: the engine's root and its metrics, behind one lock.
struct FilterConfig {
    envoy: *mut c_void,
    vm: Mutex<Vm>,
    scheduler: *mut c_void,
    ticker: Option<Ticker>,
}

/// What the lock guards: everything that holds the engine's single-threaded
/// state (`Rc`s inside [`Root`] and every [`Filter`] it made).
struct Vm {
    root: Root,
    metrics: Metrics,
    /// The context id of the next request's [`Filter`] (the engine's, for
    /// its log lines), counted under the lock rather than by an atomic
    /// operation a request.
    next_context: u32,
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
        let mut metrics = Metrics::define(config_envoy, &SURFACE);
        // Its poller (without the bootstrap extension) pages as the
        // extension's does: Envoy buffers a filter config's callout answer
        // whole just the same.
        let mut root = Root::new(1)
            .with_sync_page_bytes(Some(PAGE_BYTES))
            .with_known_passes();
        root.configure(&mut EnvoyHost::new(config_envoy, None, &mut metrics), bytes);
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
            vm: Mutex::new(Vm {
                root,
                metrics,
                next_context: 2,
            }),
            scheduler,
            ticker,
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
                let Vm { root, metrics, .. } = &mut *vm;
                let mut host = EnvoyHost::new(config.envoy, None, metrics);
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
        let Vm { root, metrics, .. } = &mut *vm;
        let mut host = EnvoyHost::new(config.envoy, None, metrics);
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
        // SAFETY: Envoy lends the arrays and their buffers for this call.
        let answer = unsafe { received_answer(result, headers, headers_len, chunks, chunks_len) };
        let header_count = answer.headers.len();
        let body_size = answer.body.len();
        let mut vm = config.lock();
        let Vm { root, metrics, .. } = &mut *vm;
        let mut host = EnvoyHost::new(config.envoy, None, metrics);
        host.answer = Some(&answer);
        root.call_response(&mut host, callout_id as u32, header_count, body_size);
    })
}

/// One request's filter: the root's [`Filter`], used only under the lock.
struct RequestFilter {
    config: *const FilterConfig,
    /// Made by the request's headers, and dropped (under the lock) as soon
    /// as it has nothing left to do ([`Filter::done`]): a request the filter
    /// lets through takes the lock once, in its headers' hook, and its later
    /// hooks return at once.
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
            Some(Config::Guard(config)) => Box::into_raw(Box::new(RequestFilter {
                config: &**config,
                filter: None,
            }))
            .cast_const()
            .cast(),
            // A no-op filter has no state; Envoy needs a non-null handle.
            Some(Config::Noop) => std::ptr::NonNull::<u8>::dangling()
                .as_ptr()
                .cast_const()
                .cast(),
            None => std::ptr::null(),
        }
    })
}

/// Whether a hook makes the request's [`Filter`] when it has none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Making {
    /// The request's headers when they end it: counted as a pass if they
    /// are one ([`Root::pass_known`]), with no filter made; else as `Make`.
    PassOrMake,
    /// The request's headers: the filter's first hook.
    Make,
    /// Any later hook: without a filter (done, or never made), nothing to do.
    Existing,
}

/// Runs `step` on a request's filter under its config's lock, then sends
/// the reply it kept, if any; `None` for a no-op filter, and without taking
/// the lock for a request whose filter is done.
fn with_request(
    filter_envoy: *mut c_void,
    request: *const c_void,
    answer: Option<&Answer>,
    making: Making,
    step: impl FnOnce(&mut Filter, &mut EnvoyHost<'_>) -> Next,
) -> Option<Next> {
    if is_noop(request) {
        return None;
    }
    // SAFETY: callers pass null or a RequestFilter made by filter_new and
    // alive until filter_destroy (the no-op marker is filtered out first).
    let request = unsafe { request.cast_mut().cast::<RequestFilter>().as_mut() }?;
    if request.filter.is_none() && making == Making::Existing {
        return None;
    }
    // SAFETY: a filter's config outlives it.
    let config = unsafe { request.config.as_ref() }?;
    let reply = {
        let mut vm = config.lock();
        let Vm {
            root,
            metrics,
            next_context,
        } = &mut *vm;
        if !metrics.pending.is_empty() {
            metrics.flush_pending(filter_envoy);
        }
        if making == Making::PassOrMake && request.filter.is_none() {
            let mut host = EnvoyHost::new(config.envoy, Some(filter_envoy), metrics);
            if root.pass_known(&mut host) {
                return Some(Next::Continue);
            }
        }
        let filter = request.filter.get_or_insert_with(|| {
            let id = *next_context;
            *next_context = id.wrapping_add(1);
            root.filter(id)
        });
        let mut host = EnvoyHost::new(config.envoy, Some(filter_envoy), metrics);
        host.answer = answer;
        let action = step(filter, &mut host);
        let reply = host.reply.take();
        if filter.done() {
            // Its `Rc`s are the root's: dropped under the lock.
            request.filter = None;
        }
        reply.map(|r| (r, action)).ok_or(action)
    };
    match reply {
        Ok((reply, action)) => {
            send(filter_envoy, &reply);
            Some(action)
        }
        Err(action) => Some(action),
    }
}

/// The answer to a request's callout (a replay's attempt through the twin
/// cluster), or its failure: the engine answers the client or tries again.
#[no_mangle]
extern "C" fn envoy_dynamic_module_on_http_filter_http_callout_done(
    filter_envoy: *mut c_void,
    request: *const c_void,
    callout_id: u64,
    result: u32,
    headers: *const EnvoyHeader,
    headers_len: usize,
    chunks: *const EnvoyBuffer,
    chunks_len: usize,
) {
    contain("http_filter_http_callout_done", (), || {
        // SAFETY: Envoy lends the arrays and their buffers for this call.
        let answer = unsafe { received_answer(result, headers, headers_len, chunks, chunks_len) };
        let (count, size) = (answer.headers.len(), answer.body.len());
        with_request(
            filter_envoy,
            request,
            Some(&answer),
            Making::Existing,
            |f, host| {
                f.call_response(host, callout_id as u32, count, size);
                Next::Continue
            },
        );
    })
}

fn status_of(action: Option<Next>) -> u32 {
    match action {
        Some(Next::Pause) => STOP_ITERATION,
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
        let making = if end_of_stream {
            Making::PassOrMake
        } else {
            Making::Make
        };
        status_of(with_request(
            filter_envoy,
            request,
            None,
            making,
            |f, host| f.request_headers(host, end_of_stream),
        ))
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
        status_of(with_request(
            filter_envoy,
            request,
            None,
            Making::Existing,
            |f, host| f.response_headers(host),
        ))
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
        let Some(filter) = request.filter.take() else {
            // Done (or never made): nothing of the root's to drop.
            return;
        };
        // SAFETY: a filter's config outlives it.
        if let Some(config) = unsafe { request.config.as_ref() } {
            let _vm = config.lock();
            drop(filter);
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

ignored!(
    envoy_dynamic_module_on_http_filter_stream_complete,
    envoy_dynamic_module_on_http_filter_http_stream_headers,
    envoy_dynamic_module_on_http_filter_http_stream_data,
    envoy_dynamic_module_on_http_filter_http_stream_trailers,
    envoy_dynamic_module_on_http_filter_http_stream_complete,
    envoy_dynamic_module_on_http_filter_http_stream_reset,
    envoy_dynamic_module_on_http_filter_scheduled,
    envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark,
    envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark,
);
