//! The ABI this module is built for, and the program init that refuses an
//! Envoy of another.
//!
//! Envoy only warns when a module reports another ABI version, and a callback
//! it lacks would abort the process at the first call, so
//! [`envoy_dynamic_module_on_program_init`] checks the Envoy it is loaded in
//! first: every callback the module calls must be exported, and the ABI's
//! marker symbol present (or absent), or the module refuses to load and
//! Envoy rejects the configuration with its name.

use std::ffi::{c_char, c_void, CStr};

use super::{bootstrap, contain, host, http, lb, COMMON_CALLBACKS};

/// The ABI version this module reports to Envoy, and the Envoy releases
/// that have it.
#[cfg(feature = "abi-v0-2")]
pub const ABI: Abi = Abi {
    version: c"v0.2.0",
    envoy: "1.40",
    marker: c"envoy_dynamic_module_callback_log_v2",
    marker_present: true,
};

/// The ABI version this module reports to Envoy, and the Envoy releases
/// that have it.
#[cfg(all(feature = "abi-v0-1", not(feature = "abi-v0-2")))]
pub const ABI: Abi = Abi {
    version: c"v0.1.0",
    envoy: "1.38 and 1.39",
    marker: c"envoy_dynamic_module_callback_log_v2",
    marker_present: false,
};

/// A pinned ABI: the version string and how to recognise an Envoy that has
/// it. Envoy exports no version symbol, so the marker is a callback the
/// next ABI added (`log_v2`, new in 1.40's v0.2.0).
#[derive(Debug, Clone, Copy)]
pub struct Abi {
    /// What `on_program_init` returns.
    pub version: &'static CStr,
    /// The Envoy releases of this ABI, for the refusal message.
    pub envoy: &'static str,
    /// The symbol that tells this ABI's Envoy from its neighbours.
    pub marker: &'static CStr,
    /// Whether an Envoy of this ABI exports `marker`.
    pub marker_present: bool,
}

/// The callbacks the module needs, all extensions together.
pub fn required() -> impl Iterator<Item = &'static CStr> {
    COMMON_CALLBACKS
        .iter()
        .chain(http::CALLBACKS.iter())
        .chain(host::CALLBACKS.iter())
        .chain(bootstrap::CALLBACKS.iter())
        .chain(lb::CALLBACKS.iter())
        .copied()
}

extern "C" {
    // glibc's dlsym; a null handle is RTLD_DEFAULT, the global scope, where
    // the Envoy executable's exported callbacks are.
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
}

/// Whether the process exports `symbol`.
fn exported(symbol: &CStr) -> bool {
    // SAFETY: `symbol` is NUL-terminated; RTLD_DEFAULT (null) is a valid
    // handle for dlsym, which only looks the name up.
    !unsafe { dlsym(std::ptr::null_mut(), symbol.as_ptr()) }.is_null()
}

/// Why this Envoy cannot run this module, if it cannot: the callbacks it
/// lacks, or its ABI against [`ABI`]. `exported` says whether the process
/// has a symbol (tests pass a set).
pub fn refusal(abi: &Abi, exported: impl Fn(&CStr) -> bool) -> Option<String> {
    let missing: Vec<_> = required()
        .filter(|s| !exported(s))
        .map(|s| s.to_string_lossy().into_owned())
        .collect();
    let version = abi.version.to_string_lossy();
    if !missing.is_empty() {
        return Some(format!(
            "staleguard: this module is built for the Envoy dynamic-module ABI {version} \
             (Envoy {}), and this Envoy lacks {} of its callbacks ({}): build it for this \
             Envoy (docs/native.md, \"ABI pinning\")",
            abi.envoy,
            missing.len(),
            missing.join(", ")
        ));
    }
    if exported(abi.marker) != abi.marker_present {
        return Some(format!(
            "staleguard: this module is built for the Envoy dynamic-module ABI {version} \
             (Envoy {}), and this Envoy has another ABI ({} {}): build it for this Envoy \
             (docs/native.md, \"ABI pinning\")",
            abi.envoy,
            abi.marker.to_string_lossy(),
            if abi.marker_present {
                "missing"
            } else {
                "present"
            },
        ));
    }
    None
}

/// Called once when Envoy loads the module: checks the Envoy it is in and
/// returns the ABI version, or null (Envoy then refuses the configuration
/// that named the module, and logs why below our own message on stderr).
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_program_init() -> *const c_char {
    contain("on_program_init", std::ptr::null(), || {
        match refusal(&ABI, exported) {
            Some(why) => {
                // Envoy's log is not ours to write to yet: a missing `log`
                // callback may be the very reason. stderr is Envoy's too.
                eprintln!("{why}");
                std::ptr::null()
            }
            None => ABI.version.as_ptr(),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const OTHER: Abi = Abi {
        version: c"v9.9.9",
        envoy: "none",
        marker: c"envoy_dynamic_module_callback_log_v2",
        marker_present: !ABI.marker_present,
    };

    #[test]
    fn an_envoy_with_every_callback_and_the_marker_is_accepted() {
        let this_envoy = |s: &CStr| s != ABI.marker || ABI.marker_present;
        assert_eq!(refusal(&ABI, this_envoy), None);
    }

    #[test]
    fn a_missing_callback_is_named_in_the_refusal() {
        let why = refusal(&ABI, |s| s != c"envoy_dynamic_module_callback_log").unwrap();
        assert!(why.contains("envoy_dynamic_module_callback_log"), "{why}");
        assert!(why.contains(ABI.version.to_str().unwrap()), "{why}");
    }

    #[test]
    fn an_envoy_of_another_abi_is_refused() {
        let accepts_other = |s: &CStr| s != OTHER.marker || OTHER.marker_present;
        assert!(refusal(&ABI, accepts_other).is_some());
        assert!(refusal(&OTHER, accepts_other).is_none());
    }
}
