//! The bootstrap extension (`envoy.bootstrap.dynamic_modules`, Envoy 1.38+):
//! the poller of an Envoy that runs the load-balancing policy alone, and the
//! hold on Envoy's start until the index is loaded.
//!
//! Its config runs the filter's [`Root`] on the plugin configuration (the
//! Wasm filter's schema) on the main thread: a timer ticks it at the period
//! the root asks for, the validator calls go out as the extension's
//! callouts, and the index it writes is the process's ([`crate::index`]).
//! The lease makes it one poller among the filter configs that may also run
//! in the process. Envoy starts no listener until the extension signals
//! that its init is complete: that happens at the first sync, or once
//! `max_staleness_ms` passed without one (the failure policy then decides,
//! as for any stale index: an outage of the validator never keeps a gateway
//! down).
//!
//! It asks for the validator's answers in pages of [`PAGE_BYTES`] unless the
//! plugin configuration's `sync_page_bytes` says otherwise (docs/native.md,
//! "Answers in pages").

use std::ffi::{c_void, CStr};
use std::sync::{Mutex, MutexGuard, PoisonError};

use staleguard_engine::config::Config;
use staleguard_engine::root::Root;
use staleguard_engine::store::IndexReader;

use super::host::{received_answer, EnvoyHeader, EnvoyHost, Metrics, Surface};
use super::{contain, EnvoyBuffer, ModuleBuffer};
use crate::index::{now_ms, ProcessStore};

extern "C" {
    fn envoy_dynamic_module_callback_bootstrap_extension_config_define_counter(
        config: *mut c_void,
        name: ModuleBuffer,
        labels: *const ModuleBuffer,
        labels_len: usize,
        id: *mut usize,
    ) -> u32;
    fn envoy_dynamic_module_callback_bootstrap_extension_config_define_gauge(
        config: *mut c_void,
        name: ModuleBuffer,
        labels: *const ModuleBuffer,
        labels_len: usize,
        id: *mut usize,
    ) -> u32;
    fn envoy_dynamic_module_callback_bootstrap_extension_config_increment_counter(
        config: *mut c_void,
        id: usize,
        values: *const ModuleBuffer,
        values_len: usize,
        by: u64,
    ) -> u32;
    fn envoy_dynamic_module_callback_bootstrap_extension_config_set_gauge(
        config: *mut c_void,
        id: usize,
        values: *const ModuleBuffer,
        values_len: usize,
        value: u64,
    ) -> u32;
    fn envoy_dynamic_module_callback_bootstrap_extension_http_callout(
        config: *mut c_void,
        callout_id: *mut u64,
        cluster: ModuleBuffer,
        headers: *const super::ModuleHeader,
        headers_len: usize,
        body: ModuleBuffer,
        timeout_ms: u64,
    ) -> u32;
    fn envoy_dynamic_module_callback_bootstrap_extension_timer_new(
        config: *mut c_void,
    ) -> *mut c_void;
    fn envoy_dynamic_module_callback_bootstrap_extension_timer_enable(
        timer: *mut c_void,
        delay_ms: u64,
    );
    fn envoy_dynamic_module_callback_bootstrap_extension_timer_delete(timer: *mut c_void);
    fn envoy_dynamic_module_callback_bootstrap_extension_config_signal_init_complete(
        config: *mut c_void,
    );
}

/// The Envoy callbacks the extension calls (checked at program init).
pub(crate) const CALLBACKS: &[&CStr] = &[
    c"envoy_dynamic_module_callback_bootstrap_extension_config_define_counter",
    c"envoy_dynamic_module_callback_bootstrap_extension_config_define_gauge",
    c"envoy_dynamic_module_callback_bootstrap_extension_config_increment_counter",
    c"envoy_dynamic_module_callback_bootstrap_extension_config_set_gauge",
    c"envoy_dynamic_module_callback_bootstrap_extension_http_callout",
    c"envoy_dynamic_module_callback_bootstrap_extension_timer_new",
    c"envoy_dynamic_module_callback_bootstrap_extension_timer_enable",
    c"envoy_dynamic_module_callback_bootstrap_extension_timer_delete",
    c"envoy_dynamic_module_callback_bootstrap_extension_config_signal_init_complete",
];

/// The page size of validator answers when `sync_page_bytes` is not set (for
/// this extension and for a filter config polling without it):
/// Envoy holds each callout's answer whole, in 16 KiB slices its allocator
/// keeps cached after the answer is handed over; a page of 256 KiB keeps
/// that at 16 slices (a 150k-IP snapshot, 1.9 MB, takes 8 callouts), and is
/// large enough that the module's copy of each page is a block its
/// allocator maps on its own and unmaps when freed (>= 128 KiB), like the
/// buffer the pages are put together in.
pub(crate) const PAGE_BYTES: u32 = 256 * 1024;

static SURFACE: Surface = Surface {
    define_counter: envoy_dynamic_module_callback_bootstrap_extension_config_define_counter,
    define_gauge: envoy_dynamic_module_callback_bootstrap_extension_config_define_gauge,
    increment_counter: Some(
        envoy_dynamic_module_callback_bootstrap_extension_config_increment_counter,
    ),
    set_gauge: Some(envoy_dynamic_module_callback_bootstrap_extension_config_set_gauge),
    callout: envoy_dynamic_module_callback_bootstrap_extension_http_callout,
};

/// The extension's config: the poller's root, its metrics, its timer, and
/// whether Envoy's start was released yet.
struct PollerConfig {
    envoy: *mut c_void,
    vm: Mutex<Poller>,
    timer: *mut c_void,
}

struct Poller {
    root: Root,
    metrics: Metrics,
    /// When Envoy's start is released without a sync (ms since the epoch);
    /// `None` once released.
    hold_until_ms: Option<u64>,
}

impl PollerConfig {
    fn lock(&self) -> MutexGuard<'_, Poller> {
        self.vm.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Releases Envoy's start once the index is loaded or the hold is over.
    fn release_start(&self, poller: &mut Poller) {
        let Some(until) = poller.hold_until_ms else {
            return;
        };
        let synced = IndexReader::new(&ProcessStore).meta().is_some();
        if synced || now_ms() >= until {
            if !synced {
                log::warn!(
                    "staleguard: no sync within max_staleness_ms: Envoy starts with a stale index (the failure policy decides)"
                );
            }
            poller.hold_until_ms = None;
            // SAFETY: the config handle is alive while its config is.
            unsafe {
                envoy_dynamic_module_callback_bootstrap_extension_config_signal_init_complete(
                    self.envoy,
                )
            };
        }
    }

    /// After a tick or an answer: release Envoy's start if it is time, and
    /// arm the timer for the next tick.
    fn after_event(&self, poller: &mut Poller) {
        self.release_start(poller);
        self.arm(poller);
    }

    /// Arms the timer for the root's next tick.
    fn arm(&self, poller: &Poller) {
        if self.timer.is_null() {
            return;
        }
        let mut ms = poller
            .metrics
            .tick_ms
            .load(std::sync::atomic::Ordering::Relaxed)
            .max(1);
        if poller.hold_until_ms.is_some() {
            // While Envoy's start is held, look at the index often.
            ms = ms.min(100);
        }
        // SAFETY: the timer is ours until config_destroy deletes it.
        unsafe { envoy_dynamic_module_callback_bootstrap_extension_timer_enable(self.timer, ms) };
    }
}

/// # Safety
/// `config` must be a live config made by config_new.
unsafe fn config_of<'a>(config: *const c_void) -> Option<&'a PollerConfig> {
    // SAFETY: the caller vouches the pointer is one of ours and alive.
    unsafe { config.cast::<PollerConfig>().as_ref() }
}

#[no_mangle]
extern "C" fn envoy_dynamic_module_on_bootstrap_extension_config_new(
    config_envoy: *mut c_void,
    _name: EnvoyBuffer,
    config: EnvoyBuffer,
) -> *const c_void {
    contain("bootstrap_extension_config_new", std::ptr::null(), || {
        super::init_logger();
        // SAFETY: Envoy lends the buffer for this call.
        let bytes = unsafe { config.as_bytes() };
        let hold_ms = Config::parse(bytes).map_or(0, |c| c.max_staleness_ms);
        let mut metrics = Metrics::define(config_envoy, &SURFACE);
        metrics.become_sink(Some(config_envoy));
        let mut root = Root::new(0).with_sync_page_bytes(Some(PAGE_BYTES));
        root.configure(&mut EnvoyHost::new(config_envoy, None, &mut metrics), bytes);
        // SAFETY: the config handle is valid during config_new.
        let timer =
            unsafe { envoy_dynamic_module_callback_bootstrap_extension_timer_new(config_envoy) };
        let config = PollerConfig {
            envoy: config_envoy,
            vm: Mutex::new(Poller {
                root,
                metrics,
                hold_until_ms: Some(now_ms().saturating_add(hold_ms)),
            }),
            timer,
        };
        if timer.is_null() {
            log::error!("staleguard: no timer for the bootstrap extension: it cannot poll");
        } else {
            config.arm(&config.lock());
        }
        Box::into_raw(Box::new(config)).cast_const().cast()
    })
}

#[no_mangle]
extern "C" fn envoy_dynamic_module_on_bootstrap_extension_config_destroy(config: *const c_void) {
    contain("bootstrap_extension_config_destroy", (), || {
        if config.is_null() {
            return;
        }
        // SAFETY: made by Box::into_raw in config_new; destroyed once.
        let config = unsafe { Box::from_raw(config.cast_mut().cast::<PollerConfig>()) };
        if !config.timer.is_null() {
            // SAFETY: ours since timer_new.
            unsafe { envoy_dynamic_module_callback_bootstrap_extension_timer_delete(config.timer) };
        }
        let mut poller = config.lock();
        let Poller { root, metrics, .. } = &mut *poller;
        root.done(&mut EnvoyHost::new(config.envoy, None, metrics));
        metrics.become_sink(None);
    })
}

/// The timer: the root's tick, the start's release, the next tick.
#[no_mangle]
extern "C" fn envoy_dynamic_module_on_bootstrap_extension_timer_fired(
    _config_envoy: *mut c_void,
    config: *const c_void,
    _timer: *mut c_void,
) {
    contain("bootstrap_extension_timer_fired", (), || {
        // SAFETY: Envoy passes the config this module made, alive.
        let Some(config) = (unsafe { config_of(config) }) else {
            return;
        };
        let mut poller = config.lock();
        {
            let Poller { root, metrics, .. } = &mut *poller;
            root.tick(&mut EnvoyHost::new(config.envoy, None, metrics));
        }
        config.after_event(&mut poller);
    })
}

/// A validator call's answer (or its failure).
#[no_mangle]
extern "C" fn envoy_dynamic_module_on_bootstrap_extension_http_callout_done(
    _config_envoy: *mut c_void,
    config: *const c_void,
    callout_id: u64,
    result: u32,
    headers: *const EnvoyHeader,
    headers_len: usize,
    chunks: *const EnvoyBuffer,
    chunks_len: usize,
) {
    contain("bootstrap_extension_http_callout_done", (), || {
        // SAFETY: Envoy passes the config this module made, alive.
        let Some(config) = (unsafe { config_of(config) }) else {
            return;
        };
        // SAFETY: Envoy lends the arrays and their buffers for this call.
        let answer = unsafe { received_answer(result, headers, headers_len, chunks, chunks_len) };
        let mut poller = config.lock();
        {
            let Poller { root, metrics, .. } = &mut *poller;
            let mut host = EnvoyHost::new(config.envoy, None, metrics);
            host.answer = Some(&answer);
            root.call_response(
                &mut host,
                callout_id as u32,
                answer.headers.len(),
                answer.body.len(),
            );
        }
        config.after_event(&mut poller);
    })
}

/// The extension instance: stateless (the config holds everything).
#[no_mangle]
extern "C" fn envoy_dynamic_module_on_bootstrap_extension_new(
    config: *const c_void,
    _extension_envoy: *mut c_void,
) -> *const c_void {
    config
}

/// Envoy shuts down: nothing to finish, so done at once.
#[no_mangle]
extern "C" fn envoy_dynamic_module_on_bootstrap_extension_shutdown(
    _extension_envoy: *mut c_void,
    _extension: *const c_void,
    completion: Option<unsafe extern "C" fn(*mut c_void)>,
    context: *mut c_void,
) {
    if let Some(completion) = completion {
        // SAFETY: Envoy's completion callback with its own context, called
        // once as the ABI asks.
        unsafe { completion(context) };
    }
}

/// An admin request for a path the extension never registered.
#[no_mangle]
extern "C" fn envoy_dynamic_module_on_bootstrap_extension_admin_request() -> u32 {
    404
}

ignored!(
    envoy_dynamic_module_on_bootstrap_extension_server_initialized,
    envoy_dynamic_module_on_bootstrap_extension_worker_thread_initialized,
    envoy_dynamic_module_on_bootstrap_extension_drain_started,
    envoy_dynamic_module_on_bootstrap_extension_destroy,
    envoy_dynamic_module_on_bootstrap_extension_config_scheduled,
    envoy_dynamic_module_on_bootstrap_extension_file_changed,
    envoy_dynamic_module_on_bootstrap_extension_cluster_add_or_update,
    envoy_dynamic_module_on_bootstrap_extension_cluster_removal,
    envoy_dynamic_module_on_bootstrap_extension_listener_add_or_update,
    envoy_dynamic_module_on_bootstrap_extension_listener_removal,
);
