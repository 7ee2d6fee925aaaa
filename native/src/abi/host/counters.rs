//! The filter's metrics as Envoy defines them: the config-level callbacks of
//! each extension ([`Surface`]), families at config time, the engine's dotted
//! metric names resolved to a family and its labels, and the sink that
//! applies updates made outside a request.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, PoisonError};

use staleguard_engine::host::MetricKind;

use crate::abi::{ModuleBuffer, ModuleHeader};
use crate::stats::{Catalog, Resolved, FAMILIES};

/// `envoy_dynamic_module_type_metrics_result_Success`.
const METRICS_SUCCESS: u32 = 0;

/// Defines a metric on a config: `(config, name, label names, count, id out)`.
pub(in crate::abi) type DefineFn =
    unsafe extern "C" fn(*mut c_void, ModuleBuffer, *const ModuleBuffer, usize, *mut usize) -> u32;
/// Updates a metric: `(handle, id, label values, count, value)`.
pub(in crate::abi) type UpdateFn =
    unsafe extern "C" fn(*mut c_void, usize, *const ModuleBuffer, usize, u64) -> u32;
/// Sends a callout from a config: `(config, id out, cluster, headers, count,
/// body, timeout ms)`.
pub(in crate::abi) type CalloutFn = unsafe extern "C" fn(
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
pub(in crate::abi) struct Surface {
    /// Defines a counter.
    pub(in crate::abi) define_counter: DefineFn,
    /// Defines a gauge.
    pub(in crate::abi) define_gauge: DefineFn,
    /// Adds to a counter from the config (none on the HTTP filter before
    /// ABI v0.2.0: the update waits for the next request).
    pub(in crate::abi) increment_counter: Option<UpdateFn>,
    /// Sets a gauge from the config (same).
    pub(in crate::abi) set_gauge: Option<UpdateFn>,
    /// Sends a callout.
    pub(in crate::abi) callout: CalloutFn,
}

extern "C" {
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

/// The filter's metrics as Envoy ids: families defined at config time, the
/// filter's metric ids (dotted names) resolved to a family and its labels,
/// and the updates made where no filter handle was at hand, applied by the
/// next request (Envoy 1.38 updates metrics only through a request).
pub(in crate::abi) struct Metrics {
    pub(super) surface: &'static Surface,
    envoy_ids: Vec<Option<usize>>,
    resolved: Vec<Resolved>,
    by_name: HashMap<(bool, String), u32>,
    pub(in crate::abi) pending: Vec<(u32, Update)>,
    /// The timer period the root last asked for, in ms.
    pub(in crate::abi) tick_ms: Arc<AtomicU64>,
}

#[derive(Debug, Clone, Copy)]
pub(in crate::abi) enum Update {
    Add(u64),
    Set(u64),
}

impl Metrics {
    /// Defines every family on the config (during its creation: the only
    /// time Envoy allows it).
    pub(in crate::abi) fn define(config: *mut c_void, surface: &'static Surface) -> Self {
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

    pub(super) fn id_of(&mut self, kind: MetricKind, name: &str) -> Option<u32> {
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
    pub(super) fn update(
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

    pub(in crate::abi) fn flush_pending(&mut self, filter: *mut c_void) {
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
        let values = label_values(resolved);
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
        let values = label_values(resolved);
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

/// The label values of a resolved metric, lent to Envoy.
fn label_values(resolved: &Resolved) -> Vec<ModuleBuffer> {
    resolved
        .values
        .iter()
        .map(|v| ModuleBuffer::of(v.as_bytes()))
        .collect()
}

// === the sink ===

/// Where a config that cannot update its metrics itself (the HTTP filter's
/// before ABI v0.2.0) updates them from the main thread instead: the
/// bootstrap extension's config, when one runs, with its own ids of the same
/// families. The update then lands in the root stats scope, not the
/// cluster's.
pub(in crate::abi) struct Sink {
    config: *mut c_void,
    pub(super) surface: &'static Surface,
    envoy_ids: Vec<Option<usize>>,
}

// SAFETY: the sink is only used on Envoy's main thread (config ticks and
// callout answers); the mutex only makes the static well-formed.
unsafe impl Send for Sink {}

static SINK: Mutex<Option<Sink>> = Mutex::new(None);

impl Metrics {
    /// Makes this config's metrics the sink of the others' (the bootstrap
    /// extension's, on the main thread; `None` when it goes).
    pub(in crate::abi) fn become_sink(&self, config: Option<*mut c_void>) {
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
