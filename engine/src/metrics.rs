//! Metric names. Every name is built here, from bounded sets of labels, so the
//! number of series is fixed by the code and the gateway's configuration,
//! never by traffic.
//!
//! Envoy shows them as `wasmcustom.<name>` in `/stats`; `/stats/prometheus`
//! drops the `wasmcustom.` prefix. Each name is a Prometheus name already
//! (`staleguard_filter_` prefix, counters end in `_total`), followed by
//! `.service.X`, `.reason.X`, `.action.X` or `.kind.X` parts that the
//! `stats_tags` in `deploy/` (documented in `docs/metrics.md`) turn into the
//! labels `staleguard_service`, `staleguard_reason`, `staleguard_action` and
//! `staleguard_error_kind`. The `staleguard_filter_` prefix keeps every filter
//! series apart from the validator's `staleguard_validator_` series.

use staleguard_core::Reason;

use crate::cache::{FastMap, Resolved};
use crate::host::{Host, MetricKind};
use crate::judgement::Effect;
use crate::replay::ReplayOutcome;

/// Counter: requests whose cluster maps to no service (passed untouched).
pub const REQUESTS_UNMAPPED: &str = "staleguard_filter_requests_unmapped_total";
/// Counter: requests whose upstream address could not be read (passed untouched).
pub const REQUESTS_NO_ADDRESS: &str = "staleguard_filter_requests_no_address_total";
/// Counter: requests met while the plugin configuration is refused (passed
/// untouched, or rejected with `config_refused` under a closed failure
/// policy).
pub const REQUESTS_UNCONFIGURED: &str = "staleguard_filter_requests_unconfigured_total";
/// Counter: plugin configurations refused, each distinct configuration
/// counted once per Envoy process (by the first VM that met it); its log
/// lines name every problem.
pub const CONFIG_REFUSED: &str = "staleguard_filter_config_refused_total";
/// Counter: requests to an IP outside the configured `pod_cidrs` (another
/// cluster's pod, an east-west gateway: passed untouched).
pub const REQUESTS_OUT_OF_SCOPE: &str = "staleguard_filter_requests_out_of_scope_total";
/// Counter: validator requests sent.
pub const SYNC_POLLS: &str = "staleguard_filter_sync_polls_total";
/// Counter: full resyncs applied (snapshot or reset).
pub const SYNC_RESETS: &str = "staleguard_filter_sync_resets_total";
/// Counter: deltas applied (empty ones included).
pub const SYNC_DELTAS: &str = "staleguard_filter_sync_deltas_total";
/// Counter: bytes of validator answers read.
pub const SYNC_BYTES: &str = "staleguard_filter_sync_received_bytes_total";
/// Counter: times a context took the poller lease.
pub const SYNC_LEASE_ACQUIRED: &str = "staleguard_filter_sync_lease_acquired_total";
/// Gauge: the generation applied last.
pub const GAUGE_GENERATION: &str = "staleguard_filter_index_generation";
/// Gauge: whole seconds since the last successful sync.
pub const GAUGE_DATA_AGE_S: &str = "staleguard_filter_index_age_seconds";
/// Gauge: IPs in the index.
pub const GAUGE_ENTRIES: &str = "staleguard_filter_index_entries";
/// Gauge: 1 when the data is fresh enough to judge, else 0.
pub const GAUGE_FRESH: &str = "staleguard_filter_index_fresh";
/// Gauge: microseconds the last applied answer took to decode and write to
/// shared data, on the thread that holds the lease. The one duration not in
/// seconds: Wasm metrics hold integers, and in seconds it would always read 0
/// (docs/metrics.md).
pub const GAUGE_SYNC_APPLY_US: &str = "staleguard_filter_sync_apply_microseconds";

/// Gauge: bytes of linear memory of this Wasm VM. A Wasm memory never
/// shrinks, so this is the VM's peak: what the largest snapshot or reset it
/// decoded cost it, and whether the index it holds stays bounded.
pub const GAUGE_VM_MEMORY_BYTES: &str = "staleguard_filter_vm_memory_bytes";

/// Counter: validator answers the blast-radius guard held back (see `crate::guard`).
pub const GUARD_HELD_TOTAL: &str = "staleguard_filter_guard_held_total";
/// Counter: held changes applied because they persisted for `guard.confirm_ms`.
pub const GUARD_CONFIRMED_TOTAL: &str = "staleguard_filter_guard_confirmed_total";
/// Counter: holds ended by an answer that no longer tripped the guard.
pub const GUARD_RELEASED_TOTAL: &str = "staleguard_filter_guard_released_total";
/// Gauge: 1 while the guard holds an answer back, else 0.
pub const GUARD_HOLDING: &str = "staleguard_filter_guard_holding";
/// Gauge: IPs the last held answer would have rejected without evidence.
pub const GUARD_HELD_IPS: &str = "staleguard_filter_guard_held_ips";
/// Gauge: how long the hold in progress has lasted, in seconds (0 when none).
pub const GUARD_HELD_SECONDS: &str = "staleguard_filter_guard_held_seconds";
/// Gauge: allowed IPs the guard does not count yet: newly allowed less than
/// `guard.confirm_ms` ago (see `crate::guard`).
pub const GUARD_UNCONFIRMED_IPS: &str = "staleguard_filter_guard_unconfirmed_ips";

/// Sync error kinds (labels of [`sync_errors`]).
pub const SYNC_ERROR_KINDS: [&str; 7] = [
    "status",
    "transport",
    "decode",
    "sequence",
    "store",
    "timeout",
    "page",
];

/// Distinct `staleguard_service` label values a VM gives out; later services
/// share [`OTHER_SERVICE`]. A gateway's services are bounded by its
/// configuration, not by traffic, but a cap keeps a huge mesh from turning into
/// tens of thousands of series.
pub const MAX_SERVICE_LABELS: usize = 256;
/// The service label of services past [`MAX_SERVICE_LABELS`]; it has no `/`, so
/// it never names a real service.
pub const OTHER_SERVICE: &str = "_other";

/// A service label value of one VM, as a small number (see [`ServiceLabels`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct LabelId(u16);

/// The bounded set of service label values of one VM, interned: a request
/// names its label by a [`LabelId`], and the text is looked up only when a
/// counter is flushed.
#[derive(Debug)]
pub struct ServiceLabels {
    /// By the service's id ([`Resolved::id`]).
    ids: FastMap<u64, LabelId>,
    /// The last service asked for and its label: a gateway's requests come
    /// in runs to one service, and a compare costs less than the map.
    last: Option<(u64, LabelId)>,
    /// Label values by id; id 0 is [`OTHER_SERVICE`].
    names: Vec<String>,
}

impl Default for ServiceLabels {
    fn default() -> Self {
        Self {
            ids: FastMap::default(),
            last: None,
            names: vec![OTHER_SERVICE.to_owned()],
        }
    }
}

impl ServiceLabels {
    /// The label of `service`: `namespace/name` while there is room, else
    /// [`OTHER_SERVICE`].
    pub fn id(&mut self, service: &Resolved) -> LabelId {
        if let Some((last, label)) = self.last {
            if last == service.id {
                return label;
            }
        }
        let label = self.interned(service);
        self.last = Some((service.id, label));
        label
    }

    fn interned(&mut self, service: &Resolved) -> LabelId {
        if let Some(id) = self.ids.get(&service.id) {
            return *id;
        }
        let value = service.key.to_string();
        // A dot would split the stat name where the stats_tags do not expect
        // it; Kubernetes names have none, but a key built without validation
        // might.
        if value.contains('.') || self.names.len() > MAX_SERVICE_LABELS {
            return LabelId(0);
        }
        let Ok(id) = u16::try_from(self.names.len()) else {
            return LabelId(0);
        };
        self.names.push(value);
        self.ids.insert(service.id, LabelId(id));
        LabelId(id)
    }

    /// The label value of `id`.
    pub fn name(&self, id: LabelId) -> &str {
        self.names
            .get(usize::from(id.0))
            .map_or(OTHER_SERVICE, String::as_str)
    }
}

/// The `action` of a counted request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Counted {
    /// The verdict's effect.
    Effect(Effect),
    /// Rejected, replayed, and answered (or timed out): `action.retry`.
    Replayed,
}

/// A per-request counter, without its name (built at flush time).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Count {
    /// `staleguard_filter_requests_total` of a service, reason and action.
    Request {
        /// The service label.
        label: LabelId,
        /// The verdict's reason.
        reason: Reason,
        /// What was done.
        action: Counted,
    },
    /// [`REQUESTS_UNMAPPED`].
    Unmapped,
    /// [`REQUESTS_NO_ADDRESS`].
    NoAddress,
    /// [`REQUESTS_OUT_OF_SCOPE`].
    OutOfScope,
}

impl Count {
    /// The metric name.
    pub fn name(&self, labels: &ServiceLabels) -> String {
        match *self {
            Count::Request {
                label,
                reason,
                action: Counted::Effect(effect),
            } => requests(labels.name(label), reason, effect),
            Count::Request {
                label,
                reason,
                action: Counted::Replayed,
            } => requests_replayed(labels.name(label), reason),
            Count::Unmapped => REQUESTS_UNMAPPED.to_owned(),
            Count::NoAddress => REQUESTS_NO_ADDRESS.to_owned(),
            Count::OutOfScope => REQUESTS_OUT_OF_SCOPE.to_owned(),
        }
    }
}

/// Counts accumulated between two flushes before one is due anyway: bounds
/// how far the counters can lag behind traffic between two timer ticks.
pub const FLUSH_EVERY: u64 = 10_000;

/// Per-request counters held in VM memory, so that counting a request makes
/// no hostcall; the root adds them to Envoy's counters on the root context's
/// timer tick (and after [`FLUSH_EVERY`] counts, and when the root is done).
#[derive(Debug, Default)]
pub struct Tally {
    counts: FastMap<Count, u64>,
    /// The count of the latest requests while they count alike, not yet in
    /// `counts`: most requests count what the one before counted, and
    /// adding to it costs a compare instead of a map lookup.
    run: Option<(Count, u64)>,
    pending: u64,
}

impl Tally {
    /// Counts one request; true when a flush is due.
    pub fn add(&mut self, count: Count) -> bool {
        match &mut self.run {
            Some((last, n)) if *last == count => *n += 1,
            run => {
                if let Some((last, n)) = run.replace((count, 1)) {
                    *self.counts.entry(last).or_insert(0) += n;
                }
            }
        }
        self.pending += 1;
        self.pending >= FLUSH_EVERY
    }

    /// The counts since the last drain, each once, and starts again from 0.
    pub fn drain(&mut self) -> Vec<(Count, u64)> {
        if let Some((last, n)) = self.run.take() {
            *self.counts.entry(last).or_insert(0) += n;
        }
        self.pending = 0;
        let drained = self
            .counts
            .iter_mut()
            .filter(|(_, n)| **n > 0)
            .map(|(c, n)| (*c, std::mem::take(n)))
            .collect();
        // The keys stay (a bounded set): the next counts allocate nothing.
        drained
    }

    /// Counts not drained yet.
    pub fn pending(&self) -> u64 {
        self.pending
    }
}

/// Per-request counter:
/// `staleguard_filter_requests_total.service.<ns/name>.reason.<reason>.action.<action>`,
/// with `service` from [`ServiceLabels::name`].
pub fn requests(service: &str, reason: Reason, effect: Effect) -> String {
    format!(
        "staleguard_filter_requests_total.service.{service}.reason.{}.action.{}",
        reason.as_str(),
        effect.as_str()
    )
}

/// Per-request counter of a rejected request that was replayed instead and
/// answered (or timed out):
/// `staleguard_filter_requests_total.service.<ns/name>.reason.<reason>.action.retry`.
/// A replay that found no live member counts as `action.reject`, like any
/// rejection the client gets; [`retries`] counts every outcome.
pub fn requests_replayed(service: &str, reason: Reason) -> String {
    format!(
        "staleguard_filter_requests_total.service.{service}.reason.{}.action.retry",
        reason.as_str()
    )
}

/// Replay counter: `staleguard_filter_retries_total.outcome.<outcome>`
/// (outcomes: `answered`, `exhausted`, `timeout`, `not_eligible_<cause>`).
pub fn retries(outcome: ReplayOutcome) -> String {
    format!(
        "staleguard_filter_retries_total.outcome.{}",
        outcome.as_str()
    )
}

/// The twin's picks: `staleguard_filter_twin_picks_total.outcome.named` (a
/// host the origin named: let through) or `.miss` (failed at once, nothing
/// sent).
pub fn twin_picks(named: bool) -> String {
    let outcome = if named { "named" } else { "miss" };
    format!("staleguard_filter_twin_picks_total.outcome.{outcome}")
}

/// Sync error counter: `staleguard_filter_sync_errors_total.kind.<kind>`.
pub fn sync_errors(kind: &str) -> String {
    format!("staleguard_filter_sync_errors_total.kind.{kind}")
}

// === impl VmMetrics ===

/// The metrics of one VM against its host: metric ids defined on first use,
/// and the per-request counts not yet added to the host's counters.
#[derive(Debug, Default)]
pub struct VmMetrics {
    ids: FastMap<String, Option<u32>>,
    /// The service labels of this VM.
    pub services: ServiceLabels,
    tally: Tally,
    count_ids: FastMap<Count, Option<u32>>,
}

impl VmMetrics {
    /// Counts a request in VM memory; flushes when enough are pending.
    pub fn count<H: Host + ?Sized>(&mut self, host: &mut H, count: Count) {
        if self.tally.add(count) {
            self.flush(host);
        }
    }

    /// Adds the pending counts to the host's counters: a call per series
    /// that moved, names built once per series and VM.
    pub fn flush<H: Host + ?Sized>(&mut self, host: &mut H) {
        for (count, n) in self.tally.drain() {
            let id = match self.count_ids.get(&count) {
                Some(id) => *id,
                None => {
                    let id = host.define_metric(MetricKind::Counter, &count.name(&self.services));
                    self.count_ids.insert(count, id);
                    id
                }
            };
            if let Some(id) = id {
                host.increment_metric(id, n);
            }
        }
    }

    fn id<H: Host + ?Sized>(&mut self, host: &mut H, kind: MetricKind, name: &str) -> Option<u32> {
        if let Some(id) = self.ids.get(name) {
            return *id;
        }
        let id = host.define_metric(kind, name);
        self.ids.insert(name.to_owned(), id);
        id
    }

    /// Adds `by` to the counter `name`.
    pub fn inc<H: Host + ?Sized>(&mut self, host: &mut H, name: &str, by: u64) {
        if let Some(id) = self.id(host, MetricKind::Counter, name) {
            host.increment_metric(id, by);
        }
    }

    /// Sets the gauge `name`.
    pub fn gauge<H: Host + ?Sized>(&mut self, host: &mut H, name: &str, value: u64) {
        if let Some(id) = self.id(host, MetricKind::Gauge, name) {
            host.record_metric(id, value);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use staleguard_core::ServiceKey;
    use std::collections::HashMap;

    #[test]
    fn names_are_dotted_and_bounded() {
        assert_eq!(
            requests(
                "shop/cart",
                Reason::Destroyed,
                Effect::Reject { status: 503 }
            ),
            "staleguard_filter_requests_total.service.shop/cart.reason.destroyed.action.reject"
        );
        assert_eq!(
            sync_errors("decode"),
            "staleguard_filter_sync_errors_total.kind.decode"
        );
        let effects = [Effect::Allow, Effect::Reject { status: 1 }, Effect::Audit];
        let mut names = std::collections::BTreeSet::new();
        for r in Reason::ALL {
            for e in effects {
                names.insert(requests("a/b", r, e));
            }
        }
        assert_eq!(names.len(), Reason::ALL.len() * effects.len());
        assert_eq!(
            retries(ReplayOutcome::NotEligible(crate::replay::Ineligible::Body)),
            "staleguard_filter_retries_total.outcome.not_eligible_body"
        );
        assert_eq!(
            requests_replayed("shop/cart", Reason::Recycled),
            "staleguard_filter_requests_total.service.shop/cart.reason.recycled.action.retry"
        );
        assert_eq!(
            twin_picks(false),
            "staleguard_filter_twin_picks_total.outcome.miss"
        );
    }

    #[test]
    fn counters_end_in_total_and_nothing_is_named_like_the_validator() {
        let counters = [
            REQUESTS_UNMAPPED,
            REQUESTS_NO_ADDRESS,
            REQUESTS_OUT_OF_SCOPE,
            SYNC_POLLS,
            SYNC_RESETS,
            SYNC_DELTAS,
            SYNC_BYTES,
            SYNC_LEASE_ACQUIRED,
            GUARD_HELD_TOTAL,
            GUARD_CONFIRMED_TOTAL,
            GUARD_RELEASED_TOTAL,
        ];
        for name in counters {
            assert!(name.ends_with("_total"), "{name}");
        }
        let base = |n: String| n.split('.').next().map(str::to_owned);
        assert_eq!(
            base(requests("a/b", Reason::Member, Effect::Allow)).as_deref(),
            Some("staleguard_filter_requests_total")
        );
        assert_eq!(
            base(sync_errors("store")).as_deref(),
            Some("staleguard_filter_sync_errors_total")
        );
        assert_eq!(
            base(retries(ReplayOutcome::Answered)).as_deref(),
            Some("staleguard_filter_retries_total")
        );
        assert_eq!(
            base(twin_picks(true)).as_deref(),
            Some("staleguard_filter_twin_picks_total")
        );
        let gauges = [
            GAUGE_GENERATION,
            GAUGE_DATA_AGE_S,
            GAUGE_ENTRIES,
            GAUGE_FRESH,
            GAUGE_SYNC_APPLY_US,
            GAUGE_VM_MEMORY_BYTES,
            GUARD_HOLDING,
            GUARD_HELD_IPS,
        ];
        for name in counters.iter().chain(&gauges) {
            assert!(name.starts_with("staleguard_filter_"), "{name}");
            assert!(!name.contains('.'), "{name}");
        }
    }

    #[test]
    fn service_labels_are_capped() {
        let mut labels = ServiceLabels::default();
        let cart = ServiceKey::new("shop", "cart");
        let id = labels.id(&Resolved::new(cart.clone()));
        assert_eq!(labels.name(id), "shop/cart");
        for i in 1..MAX_SERVICE_LABELS {
            labels.id(&Resolved::new(ServiceKey::new("ns", format!("s{i}"))));
        }
        let late = labels.id(&Resolved::new(ServiceKey::new("ns", "one-too-many")));
        assert_eq!(labels.name(late), OTHER_SERVICE);
        assert_eq!(
            labels.id(&Resolved::new(cart)),
            id,
            "known services keep theirs"
        );
        let dotted = labels.id(&Resolved::new(ServiceKey::new("a.b", "c")));
        assert_eq!(
            labels.name(dotted),
            OTHER_SERVICE,
            "a dot would break the stats_tags"
        );
    }

    #[test]
    fn the_tally_sums_exactly_and_names_at_flush() {
        let mut labels = ServiceLabels::default();
        let cart = labels.id(&Resolved::new(ServiceKey::new("shop", "cart")));
        let pay = labels.id(&Resolved::new(ServiceKey::new("shop", "pay")));
        let mut tally = Tally::default();
        let allow = |label| Count::Request {
            label,
            reason: Reason::Member,
            action: Counted::Effect(Effect::Allow),
        };
        let replayed = Count::Request {
            label: pay,
            reason: Reason::Destroyed,
            action: Counted::Replayed,
        };
        let mut expected: HashMap<String, u64> = HashMap::new();
        let mut flushed: HashMap<String, u64> = HashMap::new();
        let drain = |tally: &mut Tally, into: &mut HashMap<String, u64>| {
            for (count, n) in tally.drain() {
                *into.entry(count.name(&labels)).or_default() += n;
            }
        };
        // Not a multiple of FLUSH_EVERY, with flushes when due and between.
        for i in 0..(2 * FLUSH_EVERY + 123) {
            let count = match i % 5 {
                0 => allow(pay),
                1 => replayed,
                2 => Count::Unmapped,
                _ => allow(cart),
            };
            *expected.entry(count.name(&labels)).or_default() += 1;
            if tally.add(count) {
                drain(&mut tally, &mut flushed);
                assert_eq!(tally.pending(), 0);
            }
            if i % 7_777 == 0 {
                drain(&mut tally, &mut flushed);
            }
        }
        assert!(tally.pending() > 0);
        drain(&mut tally, &mut flushed);
        assert_eq!(flushed, expected);
        assert_eq!(flushed.values().sum::<u64>(), 2 * FLUSH_EVERY + 123);
        assert!(tally.drain().is_empty(), "nothing counted twice");
        assert_eq!(
            replayed.name(&labels),
            "staleguard_filter_requests_total.service.shop/pay.reason.destroyed.action.retry"
        );
        assert_eq!(Count::NoAddress.name(&labels), REQUESTS_NO_ADDRESS);
        assert_eq!(Count::OutOfScope.name(&labels), REQUESTS_OUT_OF_SCOPE);
    }
}
