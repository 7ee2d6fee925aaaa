//! The load-balancing policy's hooks (`envoy.load_balancing_policies.dynamic_modules`,
//! Envoy 1.38+), over [`crate::lb`].

use std::ffi::CStr;

/// The Envoy callbacks the policy calls (checked at program init).
pub(crate) const CALLBACKS: &[&CStr] = &[];
