//! Envoy's dynamic-module ABI: the one place with `unsafe` code.
//!
//! The declarations are written from the ABI's documented signatures
//! (`source/extensions/dynamic_modules/abi/abi.h` in Envoy) for the ABI this
//! module is built for, chosen by a cargo feature: `abi-v0-2` (Envoy 1.40,
//! the default) or `abi-v0-1` (Envoy 1.38 and 1.39). [`version`] checks,
//! when Envoy loads the module, that the Envoy it is in has that ABI. This
//! file holds what every extension stands on: the buffers Envoy and the
//! module lend each other, the headers the module lends, the `log` facade
//! onto Envoy's log, and [`contain`]. Reading order, top to bottom (no file imports one above it):
//! [`version`] (the program init), the extensions ([`http`], [`bootstrap`],
//! [`lb`]), `host` (the engine's host over a config's handles), then this
//! file.
//!
//! Every exported hook runs its body through [`contain`]: a panic never
//! crosses into Envoy; the hook answers as if the guard were not there.

use std::ffi::CStr;
use std::panic::{catch_unwind, UnwindSafe};

/// Exports hooks the guard has no use for, as functions that do nothing.
/// Their arguments are ignored, so they take none (the C calling convention
/// lets the caller pass any).
macro_rules! ignored {
    ($($hook:ident),* $(,)?) => {$(
        /// Not used by the guard.
        #[no_mangle]
        extern "C" fn $hook() {}
    )*};
}

pub mod bootstrap;
mod host;
pub mod http;
pub mod lb;
pub mod version;

/// A buffer Envoy owns, valid for the call that hands it over.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct EnvoyBuffer {
    /// First byte (may be null when `len` is 0).
    pub ptr: *const u8,
    /// Length in bytes.
    pub len: usize,
}

impl EnvoyBuffer {
    /// The bytes.
    ///
    /// # Safety
    /// `ptr` must point to `len` readable bytes that outlive `'a` (Envoy's
    /// promise for the duration of the call that handed the buffer over).
    pub unsafe fn as_bytes<'a>(self) -> &'a [u8] {
        if self.ptr.is_null() || self.len == 0 {
            return &[];
        }
        // SAFETY: non-null, and the caller vouches for `len` bytes that live
        // for 'a.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

/// `bytes` as text when they are UTF-8. Envoy's addresses and cluster names
/// are ASCII, which is checked 8 bytes at a time; UTF-8 validation walks
/// them byte by byte (`from_utf8` was 290 instructions a request for the
/// filter's two texts, the lossy conversion before it 510).
pub(crate) fn text(bytes: &[u8]) -> Option<&str> {
    if bytes.is_ascii() {
        // SAFETY: ASCII is valid UTF-8.
        Some(unsafe { std::str::from_utf8_unchecked(bytes) })
    } else {
        std::str::from_utf8(bytes).ok()
    }
}

/// A buffer the module owns, lent to Envoy for one call.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ModuleBuffer {
    /// First byte.
    pub ptr: *const u8,
    /// Length in bytes.
    pub len: usize,
}

impl ModuleBuffer {
    /// Lends `bytes` (they must outlive the call the buffer is passed to).
    pub fn of(bytes: &[u8]) -> Self {
        Self {
            ptr: bytes.as_ptr(),
            len: bytes.len(),
        }
    }
}

/// A header the module lends Envoy.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct ModuleHeader {
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

/// The Envoy callbacks this file calls (the log's); each extension lists its
/// own, and [`version::required`] gathers them all.
const COMMON_CALLBACKS: &[&CStr] = &[
    c"envoy_dynamic_module_callback_log",
    c"envoy_dynamic_module_callback_log_enabled",
];

/// Envoy's log levels (`envoy_dynamic_module_type_log_level`).
fn envoy_level(level: log::Level) -> u32 {
    match level {
        log::Level::Trace => 0,
        log::Level::Debug => 1,
        log::Level::Info => 2,
        log::Level::Warn => 3,
        log::Level::Error => 4,
    }
}

extern "C" {
    fn envoy_dynamic_module_callback_log(level: u32, message: ModuleBuffer);
    fn envoy_dynamic_module_callback_log_enabled(level: u32) -> bool;
}

/// The `log` facade onto Envoy's log (the `dynamic_modules` logger).
#[derive(Debug)]
struct EnvoyLog;

impl log::Log for EnvoyLog {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        // SAFETY: a plain query of Envoy's logger, any thread.
        unsafe { envoy_dynamic_module_callback_log_enabled(envoy_level(metadata.level())) }
    }

    fn log(&self, record: &log::Record<'_>) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let message = record.args().to_string();
        // SAFETY: the message outlives the call; Envoy copies it.
        unsafe {
            envoy_dynamic_module_callback_log(
                envoy_level(record.level()),
                ModuleBuffer::of(message.as_bytes()),
            )
        }
    }

    fn flush(&self) {}
}

/// Routes the `log` facade to Envoy's log (once; later calls do nothing).
pub fn init_logger() {
    static LOGGER: EnvoyLog = EnvoyLog;
    if log::set_logger(&LOGGER).is_ok() {
        log::set_max_level(log::LevelFilter::Trace);
    }
}

/// Runs a hook's body; a panic is logged and answered with `fallback`, the
/// answer that lets traffic through as if the guard were not there.
pub fn contain<T>(hook: &str, fallback: T, body: impl FnOnce() -> T + UnwindSafe) -> T {
    match catch_unwind(body) {
        Ok(answer) => answer,
        Err(_) => {
            log::error!("staleguard: {hook} panicked; failing open");
            fallback
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panicking_hook_answers_its_fallback() {
        assert_eq!(contain("test", 7, || -> i32 { panic!("boom") }), 7);
        assert_eq!(contain("test", 7, || 3), 3);
    }
}
