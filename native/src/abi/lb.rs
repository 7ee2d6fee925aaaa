//! The load-balancing policy's hooks (`envoy.load_balancing_policies.dynamic_modules`,
//! Envoy 1.38+), over [`crate::lb`].
//!
//! Envoy calls `on_lb_config_new` once per cluster configuration (main
//! thread), `on_lb_new` once per worker (and the main thread), then
//! `on_lb_choose_host` on that worker for every pick. The configuration is the
//! plugin configuration of the filter, same schema, read once; the policy's
//! counters are defined with it. The declarations below are written from the
//! ABI's documented signatures; they are the same in Envoy 1.38's v0.1.0 and
//! 1.40's v0.2.0 (checked by running the module in both).

use std::ffi::{c_void, CStr};
use std::panic::AssertUnwindSafe;
use std::time::Instant;

use staleguard_engine::config::Config;

use super::{contain, init_logger, EnvoyBuffer, ModuleBuffer};
use crate::index;
use crate::lb::{Choice, Hosts, Picker, Recent, Standing};

/// The Envoy callbacks the policy calls (checked at program init).
pub(crate) const CALLBACKS: &[&CStr] = &[
    c"envoy_dynamic_module_callback_lb_get_cluster_name",
    c"envoy_dynamic_module_callback_lb_get_priority_set_size",
    c"envoy_dynamic_module_callback_lb_get_healthy_hosts_count",
    c"envoy_dynamic_module_callback_lb_get_healthy_host_address",
    c"envoy_dynamic_module_callback_lb_config_define_counter",
    c"envoy_dynamic_module_callback_lb_config_increment_counter",
];

extern "C" {
    fn envoy_dynamic_module_callback_lb_get_cluster_name(lb: *mut c_void, result: *mut EnvoyBuffer);
    fn envoy_dynamic_module_callback_lb_get_priority_set_size(lb: *mut c_void) -> usize;
    fn envoy_dynamic_module_callback_lb_get_healthy_hosts_count(
        lb: *mut c_void,
        priority: u32,
    ) -> usize;
    fn envoy_dynamic_module_callback_lb_get_healthy_host_address(
        lb: *mut c_void,
        priority: u32,
        index: usize,
        result: *mut EnvoyBuffer,
    ) -> bool;
    fn envoy_dynamic_module_callback_lb_config_define_counter(
        config: *mut c_void,
        name: ModuleBuffer,
        label_names: *const ModuleBuffer,
        label_names_len: usize,
        id: *mut usize,
    ) -> i32;
    fn envoy_dynamic_module_callback_lb_config_increment_counter(
        config: *mut c_void,
        id: usize,
        label_values: *const ModuleBuffer,
        label_values_len: usize,
        value: u64,
    ) -> i32;
}

/// The policy's counters, in Envoy's `dynamicmodulescustom.` scope
/// (docs/native.md, "The load-balancing policy").
pub const COUNTERS: [&str; 4] = [SKIPPED, NO_LIVE_HOST, UNCHECKED, AUDITED];
/// Healthy hosts looked at and passed over because the index judges them stale.
pub const SKIPPED: &str = "staleguard_lb_hosts_skipped_total";
/// Picks answered with no host: every healthy host judged stale.
pub const NO_LIVE_HOST: &str = "staleguard_lb_no_live_host_total";
/// Picks made unjudged on an index that could not be trusted (failure policy open).
pub const UNCHECKED: &str = "staleguard_lb_unchecked_total";
/// Picks of a host the verdict rejects, let through by audit mode.
pub const AUDITED: &str = "staleguard_lb_audited_total";

/// A counter of [`COUNTERS`], by its place there.
#[derive(Debug, Clone, Copy)]
enum Counter {
    Skipped = 0,
    NoLiveHost = 1,
    Unchecked = 2,
    Audited = 3,
}

/// One cluster's policy: the plugin configuration and the counters' ids.
#[derive(Debug)]
struct Policy {
    config: Config,
    /// Envoy's side of the configuration, which the counters hang on: it
    /// outlives every load balancer made from it.
    envoy: *mut c_void,
    /// Ids of [`COUNTERS`], in order; `None` when Envoy refused one.
    ids: [Option<usize>; 4],
}

/// One worker's load balancer for one cluster.
#[derive(Debug)]
struct Balancer {
    policy: *const Policy,
    cluster: String,
    picker: Picker,
    recent: Recent,
}

/// Envoy's healthy hosts of one load balancer, read at the pick.
struct EnvoyHosts(*mut c_void);

impl Hosts for EnvoyHosts {
    fn priorities(&self) -> u32 {
        // SAFETY: the load balancer pointer Envoy passed to this hook.
        let n = unsafe { envoy_dynamic_module_callback_lb_get_priority_set_size(self.0) };
        u32::try_from(n).unwrap_or(u32::MAX)
    }

    fn healthy(&self, priority: u32) -> usize {
        // SAFETY: as above; an unknown priority answers 0.
        unsafe { envoy_dynamic_module_callback_lb_get_healthy_hosts_count(self.0, priority) }
    }

    fn address(&self, priority: u32, index: usize) -> Option<&str> {
        let mut out = EnvoyBuffer {
            ptr: std::ptr::null(),
            len: 0,
        };
        // SAFETY: as above; Envoy fills `out` with the host's address string,
        // which lives as long as the host, beyond this pick.
        let found = unsafe {
            envoy_dynamic_module_callback_lb_get_healthy_host_address(
                self.0, priority, index, &mut out,
            )
        };
        if !found {
            return None;
        }
        // SAFETY: Envoy's buffer, valid for the pick (see above).
        super::text(unsafe { out.as_bytes() })
    }
}

impl Policy {
    fn count(&self, which: Counter, value: u64) {
        let Some(Some(id)) = self.ids.get(which as usize) else {
            return;
        };
        if value == 0 {
            return;
        }
        // SAFETY: `envoy` is the configuration pointer Envoy gave
        // `on_lb_config_new`, alive while any load balancer is; no labels.
        unsafe {
            envoy_dynamic_module_callback_lb_config_increment_counter(
                self.envoy,
                *id,
                std::ptr::null(),
                0,
                value,
            );
        }
    }

    /// Counts what a pick did.
    fn record(&self, choice: &Choice) {
        match *choice {
            Choice::Host {
                standing, skipped, ..
            } => {
                self.count(Counter::Skipped, skipped);
                match standing {
                    Standing::Unchecked => self.count(Counter::Unchecked, 1),
                    Standing::Audited => self.count(Counter::Audited, 1),
                    Standing::Good | Standing::Stale => {}
                }
            }
            Choice::NoLiveHost { skipped } => {
                self.count(Counter::Skipped, skipped);
                self.count(Counter::NoLiveHost, 1);
            }
            Choice::NoHealthyHost => {}
        }
    }
}

/// The standing of the host at `address` (`ip:port`) in `cluster`.
fn standing(config: &Config, cluster: &str, address: &str) -> Standing {
    Standing::of(&index::judge_address(config, cluster, address))
}

/// A cluster's policy configuration: the plugin configuration in
/// `config` (a `google.protobuf.StringValue` or `Struct` of JSON). Null when
/// it does not parse: Envoy then refuses the cluster, and the log says why.
/// # Safety
/// Envoy's call: `config_envoy` is its configuration object and `config`
/// a buffer valid for the call.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_lb_config_new(
    config_envoy: *mut c_void,
    _name: EnvoyBuffer,
    config: EnvoyBuffer,
) -> *const c_void {
    contain("on_lb_config_new", std::ptr::null(), || {
        init_logger();
        // SAFETY: Envoy's buffer, valid for this call.
        let bytes = unsafe { config.as_bytes() };
        let config = match Config::parse(bytes) {
            Ok(c) => c,
            Err(e) => {
                log::error!("staleguard: the load-balancing policy's configuration: {e}");
                return std::ptr::null();
            }
        };
        let mut ids = [None; 4];
        for (slot, name) in ids.iter_mut().zip(COUNTERS) {
            let mut id = 0usize;
            // SAFETY: Envoy's configuration pointer, during its creation,
            // when counters may be defined; the name is lent for the call.
            let result = unsafe {
                envoy_dynamic_module_callback_lb_config_define_counter(
                    config_envoy,
                    ModuleBuffer::of(name.as_bytes()),
                    std::ptr::null(),
                    0,
                    &mut id,
                )
            };
            *slot = (result == 0).then_some(id);
        }
        let policy = Box::new(Policy {
            config,
            envoy: config_envoy,
            ids,
        });
        Box::into_raw(policy) as *const c_void
    })
}

/// Frees a policy configuration.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_lb_config_destroy(policy: *mut c_void) {
    contain("on_lb_config_destroy", (), || {
        if !policy.is_null() {
            // SAFETY: made by `Box::into_raw` in `on_lb_config_new`, freed once.
            drop(unsafe { Box::from_raw(policy.cast::<Policy>()) });
        }
    });
}

/// A worker's load balancer for the cluster of `policy`.
/// # Safety
/// Envoy's call: `policy` is what `on_lb_config_new` returned and `lb` its
/// load balancer object.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_lb_new(
    policy: *mut c_void,
    lb: *mut c_void,
) -> *mut c_void {
    contain("on_lb_new", std::ptr::null_mut(), || {
        let mut name = EnvoyBuffer {
            ptr: std::ptr::null(),
            len: 0,
        };
        // SAFETY: the load balancer pointer Envoy passed to this hook.
        unsafe { envoy_dynamic_module_callback_lb_get_cluster_name(lb, &mut name) };
        // SAFETY: Envoy's buffer, valid for this call; copied.
        let cluster = String::from_utf8_lossy(unsafe { name.as_bytes() }).into_owned();
        let balancer = Box::new(Balancer {
            policy: policy.cast_const().cast::<Policy>(),
            cluster,
            picker: Picker::default(),
            recent: Recent::default(),
        });
        Box::into_raw(balancer).cast::<c_void>()
    })
}

/// Picks a host: see [`crate::lb`]. A panic picks as if the policy were not
/// there (round robin).
/// # Safety
/// Envoy's call, on the worker that owns `balancer`: `lb` is its load
/// balancer object and `priority`, `index` writable.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_lb_choose_host(
    lb: *mut c_void,
    balancer: *mut c_void,
    _context: *mut c_void,
    priority: *mut u32,
    index: *mut u32,
) -> bool {
    if balancer.is_null() || priority.is_null() || index.is_null() {
        return false;
    }
    // SAFETY: made by `on_lb_new`, used by this worker only, until
    // `on_lb_destroy`.
    let balancer = unsafe { &mut *balancer.cast::<Balancer>() };
    let hosts = EnvoyHosts(lb);
    let guarded = contain(
        "on_lb_choose_host",
        None,
        AssertUnwindSafe(|| {
            // SAFETY: the configuration outlives the load balancers made
            // from it.
            let policy = unsafe { &*balancer.policy };
            let Balancer {
                cluster,
                picker,
                recent,
                ..
            } = &mut *balancer;
            let now = Instant::now();
            let writes = crate::index::writes();
            let choice = picker.choose(&hosts, |a| {
                recent.standing(a, now, writes, || standing(&policy.config, cluster, a))
            });
            policy.record(&choice);
            Some(choice)
        }),
    );
    let choice = match guarded {
        Some(choice) => choice,
        None => contain(
            "on_lb_choose_host (unguarded)",
            Choice::NoHealthyHost,
            AssertUnwindSafe(|| balancer.picker.unguarded(&hosts)),
        ),
    };
    match choice {
        Choice::Host {
            priority: p,
            index: i,
            ..
        } => {
            let Ok(i) = u32::try_from(i) else {
                return false;
            };
            // SAFETY: Envoy's out-parameters for this call, checked non-null.
            unsafe {
                *priority = p;
                *index = i;
            }
            true
        }
        Choice::NoLiveHost { .. } | Choice::NoHealthyHost => false,
    }
}

/// A membership change forgets the worker's recent standings (every pick
/// reads the hosts afresh; this only bounds what is remembered).
///
/// # Safety
/// Envoy's call, on the worker that owns `balancer`.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_lb_on_host_membership_update(
    _lb: *mut c_void,
    balancer: *mut c_void,
    _added: usize,
    _removed: usize,
) {
    if balancer.is_null() {
        return;
    }
    // SAFETY: made by `on_lb_new`, used by this worker only.
    let balancer = unsafe { &mut *balancer.cast::<Balancer>() };
    contain(
        "on_lb_on_host_membership_update",
        (),
        AssertUnwindSafe(|| balancer.recent.clear()),
    );
}

/// Frees a worker's load balancer.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_lb_destroy(balancer: *mut c_void) {
    contain("on_lb_destroy", (), || {
        if !balancer.is_null() {
            // SAFETY: made by `Box::into_raw` in `on_lb_new`, freed once.
            drop(unsafe { Box::from_raw(balancer.cast::<Balancer>()) });
        }
    });
}
