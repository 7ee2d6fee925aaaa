//! Metric names. Every name is built here, from bounded sets of labels, so the
//! number of series is fixed by the code, never by traffic.
//!
//! Envoy shows them as `wasmcustom.<name>`; the `stats_tags` in
//! `deploy/envoy/envoy.yaml` (documented in `docs/metrics.md`) turn the
//! `.reason.X`, `.action.X` and `.kind.X` parts into Prometheus labels
//! `staleguard_reason`, `staleguard_action` and `staleguard_error_kind`.

use staleguard_core::Reason;

use crate::check::Effect;
use crate::replay::Outcome;

/// Requests whose cluster maps to no service (passed untouched).
pub const REQUESTS_UNMAPPED: &str = "staleguard.requests_unmapped";
/// Requests whose upstream address could not be read (passed untouched).
pub const REQUESTS_NO_ADDRESS: &str = "staleguard.requests_no_address";
/// Validator requests sent.
pub const SYNC_POLLS: &str = "staleguard.sync_polls";
/// Full resyncs applied (snapshot or reset).
pub const SYNC_RESETS: &str = "staleguard.sync_resets";
/// Deltas applied (empty ones included).
pub const SYNC_DELTAS: &str = "staleguard.sync_deltas";
/// Bytes of validator answers read.
pub const SYNC_BYTES: &str = "staleguard.sync_bytes";
/// Times a context took the poller lease.
pub const SYNC_LEASE_ACQUIRED: &str = "staleguard.sync_lease_acquired";
/// Gauge: the generation applied last.
pub const GAUGE_GENERATION: &str = "staleguard.index_generation";
/// Gauge: milliseconds since the last successful sync.
pub const GAUGE_DATA_AGE_MS: &str = "staleguard.index_age_ms";
/// Gauge: IPs in the index.
pub const GAUGE_ENTRIES: &str = "staleguard.index_entries";
/// Gauge: 1 when the data is fresh enough to judge, else 0.
pub const GAUGE_FRESH: &str = "staleguard.index_fresh";
/// Gauge: microseconds the last applied answer took to decode and write to
/// shared data, on the thread that holds the lease.
pub const GAUGE_SYNC_APPLY_US: &str = "staleguard.sync_apply_us";

/// Gauge: bytes of linear memory of this Wasm VM. A Wasm memory never
/// shrinks, so this is the VM's peak: what the largest snapshot or reset it
/// decoded cost it, and whether the index it holds stays bounded.
pub const GAUGE_VM_MEMORY_BYTES: &str = "staleguard.vm_memory_bytes";

/// Validator answers the blast-radius guard held back (see `crate::guard`).
pub const GUARD_HELD_TOTAL: &str = "staleguard.guard_held_total";
/// Held changes applied because they persisted for `guard.confirm_ms`.
pub const GUARD_CONFIRMED_TOTAL: &str = "staleguard.guard_confirmed_total";
/// Holds ended by an answer that no longer tripped the guard.
pub const GUARD_RELEASED_TOTAL: &str = "staleguard.guard_released_total";
/// Gauge: 1 while the guard holds an answer back, else 0.
pub const GUARD_HOLDING: &str = "staleguard.guard_holding";
/// Gauge: IPs the last held answer would have rejected without evidence.
pub const GUARD_HELD_IPS: &str = "staleguard.guard_held_ips";

/// Sync error kinds (labels of [`sync_errors`]).
pub const SYNC_ERROR_KINDS: [&str; 6] = [
    "status",
    "transport",
    "decode",
    "sequence",
    "store",
    "timeout",
];

/// Per-request counter: `staleguard.requests.reason.<reason>.action.<action>`.
pub fn requests(reason: Reason, effect: Effect) -> String {
    format!(
        "staleguard.requests.reason.{}.action.{}",
        reason.as_str(),
        effect.as_str()
    )
}

/// Per-request counter of a rejected request that was replayed instead:
/// `staleguard.requests.reason.<reason>.action.retry` (whatever the replay's
/// outcome, which [`retries`] counts).
pub fn requests_replayed(reason: Reason) -> String {
    format!(
        "staleguard.requests.reason.{}.action.retry",
        reason.as_str()
    )
}

/// Replay counter: `staleguard.retries_total.outcome.<outcome>` (outcomes:
/// `answered`, `exhausted`, `timeout`, `not_eligible_<cause>`).
pub fn retries(outcome: Outcome) -> String {
    format!("staleguard.retries_total.outcome.{}", outcome.as_str())
}

/// The twin's picks: `staleguard.twin_picks_total.outcome.named` (a host the
/// origin named: let through) or `.miss` (failed at once, nothing sent).
pub fn twin_picks(named: bool) -> String {
    let outcome = if named { "named" } else { "miss" };
    format!("staleguard.twin_picks_total.outcome.{outcome}")
}

/// Sync error counter: `staleguard.sync_errors.kind.<kind>`.
pub fn sync_errors(kind: &str) -> String {
    format!("staleguard.sync_errors.kind.{kind}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_dotted_and_bounded() {
        assert_eq!(
            requests(Reason::Destroyed, Effect::Reject { status: 503 }),
            "staleguard.requests.reason.destroyed.action.reject"
        );
        assert_eq!(sync_errors("decode"), "staleguard.sync_errors.kind.decode");
        let effects = [Effect::Allow, Effect::Reject { status: 1 }, Effect::Audit];
        let mut names = std::collections::BTreeSet::new();
        for r in Reason::ALL {
            for e in effects {
                names.insert(requests(r, e));
            }
        }
        assert_eq!(names.len(), Reason::ALL.len() * effects.len());
        assert_eq!(
            retries(Outcome::NotEligible(crate::replay::Ineligible::Body)),
            "staleguard.retries_total.outcome.not_eligible_body"
        );
        assert_eq!(
            requests_replayed(Reason::Recycled),
            "staleguard.requests.reason.recycled.action.retry"
        );
        assert_eq!(
            twin_picks(false),
            "staleguard.twin_picks_total.outcome.miss"
        );
    }
}
