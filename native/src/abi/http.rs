//! The upstream HTTP filter's hooks (`envoy.filters.http.dynamic_modules`).
//!
//! Envoy makes one filter config per filter in a cluster's
//! `http_filters`, on the main thread, and one filter per request on the
//! worker that serves it. Every hook answers "continue" when its body fails.

use std::ffi::{c_void, CStr};

use super::{contain, EnvoyBuffer};

/// The Envoy callbacks the filter calls (checked at program init).
pub(crate) const CALLBACKS: &[&CStr] = &[];

/// Envoy's `FilterHeadersStatus::Continue` (and `FilterDataStatus::Continue`,
/// `FilterTrailersStatus::Continue`): value 0 of each status enum.
const CONTINUE: u32 = 0;

/// One filter configuration, as the module holds it.
#[derive(Debug)]
struct FilterConfig {}

/// One request's filter.
#[derive(Debug)]
struct Filter {}

/// A filter config: Envoy rejects the configuration when this returns null.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    _config_envoy: *mut c_void,
    _name: EnvoyBuffer,
    _config: EnvoyBuffer,
) -> *const c_void {
    contain("http_filter_config_new", std::ptr::null(), || {
        Box::into_raw(Box::new(FilterConfig {})).cast_const().cast()
    })
}

/// Envoy drops a filter config.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(config: *const c_void) {
    contain("http_filter_config_destroy", (), || {
        if !config.is_null() {
            // SAFETY: `config` came from Box::into_raw in config_new, and
            // Envoy destroys each config once.
            drop(unsafe { Box::from_raw(config.cast_mut().cast::<FilterConfig>()) });
        }
    })
}

/// A request's filter: Envoy closes the stream when this returns null.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_new(
    _config: *const c_void,
    _filter_envoy: *mut c_void,
) -> *const c_void {
    contain("http_filter_new", std::ptr::null(), || {
        Box::into_raw(Box::new(Filter {})).cast_const().cast()
    })
}

/// Envoy drops a request's filter.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_destroy(filter: *const c_void) {
    contain("http_filter_destroy", (), || {
        if !filter.is_null() {
            // SAFETY: `filter` came from Box::into_raw in filter_new, and
            // Envoy destroys each filter once.
            drop(unsafe { Box::from_raw(filter.cast_mut().cast::<Filter>()) });
        }
    })
}

/// The request's headers: the verdict on the host Envoy picked.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(
    _filter_envoy: *mut c_void,
    _filter: *const c_void,
    _end_of_stream: bool,
) -> u32 {
    contain("http_filter_request_headers", CONTINUE, || CONTINUE)
}

/// The hooks the filter has no use for answer "continue" (Envoy requires
/// each of them to be exported).
macro_rules! pass_through {
    ($($hook:ident),* $(,)?) => {$(
        /// Not used by the guard: continue.
        #[no_mangle]
        pub extern "C" fn $hook(
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
    envoy_dynamic_module_on_http_filter_response_headers,
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
        pub extern "C" fn $hook() {}
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
