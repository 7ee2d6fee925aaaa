//! The filter's metrics as Envoy stats of a dynamic module.
//!
//! The filter names a metric by a dotted string (`staleguard_filter_requests_total.service.shop/cart.reason.member.action.allow`)
//! and defines it on first use; a Wasm VM may do that at any time, and
//! Envoy's `stats_tags` turn the dotted parts into Prometheus labels. A
//! dynamic module must define its metrics while Envoy creates its
//! configuration, and gives labels explicitly. So [`Catalog`] lists every
//! metric the filter uses up front, the labelled ones as families whose
//! label names are the keys of the dotted name (`service`, `reason`,
//! `action`...), and [`Catalog::resolve`] maps a dotted name to its family
//! and label values. Envoy writes a labelled stat as the name and its
//! label pairs joined by dots, so `/stats` shows the Wasm filter's names
//! under the module's namespace, `dynamicmodulescustom.` (docs/native.md,
//! "Metrics").

use staleguard_engine::host::MetricKind;
use staleguard_engine::metrics;

/// A metric Envoy knows: a name and its label names (none for a plain one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Family {
    /// Counter or gauge.
    pub kind: MetricKind,
    /// The name without labels.
    pub name: &'static str,
    /// The label names: the keys of the filter's dotted name, in order.
    pub labels: &'static [&'static str],
}

const fn counter(name: &'static str) -> Family {
    Family {
        kind: MetricKind::Counter,
        name,
        labels: &[],
    }
}

const fn gauge(name: &'static str) -> Family {
    Family {
        kind: MetricKind::Gauge,
        name,
        labels: &[],
    }
}

/// Every metric of the filter.
pub const FAMILIES: &[Family] = &[
    Family {
        kind: MetricKind::Counter,
        name: "staleguard_filter_requests_total",
        labels: &["service", "reason", "action"],
    },
    Family {
        kind: MetricKind::Counter,
        name: "staleguard_filter_retries_total",
        labels: &["outcome"],
    },
    Family {
        kind: MetricKind::Counter,
        name: "staleguard_filter_twin_picks_total",
        labels: &["outcome"],
    },
    Family {
        kind: MetricKind::Counter,
        name: "staleguard_filter_sync_errors_total",
        labels: &["kind"],
    },
    counter(metrics::REQUESTS_UNMAPPED),
    counter(metrics::REQUESTS_NO_ADDRESS),
    counter(metrics::REQUESTS_UNCONFIGURED),
    counter(metrics::CONFIG_REFUSED),
    counter(metrics::REQUESTS_OUT_OF_SCOPE),
    counter(metrics::SYNC_POLLS),
    counter(metrics::SYNC_RESETS),
    counter(metrics::SYNC_DELTAS),
    counter(metrics::SYNC_BYTES),
    counter(metrics::SYNC_LEASE_ACQUIRED),
    counter(metrics::GUARD_HELD_TOTAL),
    counter(metrics::GUARD_CONFIRMED_TOTAL),
    counter(metrics::GUARD_RELEASED_TOTAL),
    gauge(metrics::GAUGE_GENERATION),
    gauge(metrics::GAUGE_DATA_AGE_S),
    gauge(metrics::GAUGE_ENTRIES),
    gauge(metrics::GAUGE_FRESH),
    gauge(metrics::GAUGE_SYNC_APPLY_US),
    gauge(metrics::GAUGE_VM_MEMORY_BYTES),
    gauge(metrics::GUARD_HOLDING),
    gauge(metrics::GUARD_HELD_IPS),
    gauge(metrics::GUARD_HELD_SECONDS),
    gauge(metrics::GUARD_UNCONFIRMED_IPS),
];

/// A dotted name resolved: its family (an index into [`FAMILIES`]) and
/// label values in the family's order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolved {
    /// Index into [`FAMILIES`].
    pub family: usize,
    /// One value per label.
    pub values: Vec<String>,
}

/// Maps the filter's metric names to [`FAMILIES`].
#[derive(Debug, Clone, Copy, Default)]
pub struct Catalog;

impl Catalog {
    /// The family and label values of `name` (a metric of `kind`), or `None`
    /// when the filter names a metric this catalogue does not list.
    pub fn resolve(self, kind: MetricKind, name: &str) -> Option<Resolved> {
        let (base, rest) = name.split_once('.').unwrap_or((name, ""));
        let family = FAMILIES
            .iter()
            .position(|f| f.kind == kind && f.name == base)?;
        let mut parts = rest.split('.').filter(|p| !p.is_empty());
        let mut values = Vec::with_capacity(FAMILIES[family].labels.len());
        for key in FAMILIES[family].labels {
            if parts.next()? != *key {
                return None;
            }
            values.push(parts.next()?.to_owned());
        }
        parts
            .next()
            .is_none()
            .then_some(Resolved { family, values })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use staleguard_core::Reason;
    use staleguard_engine::judgement::Effect;
    use staleguard_engine::replay::ReplayOutcome;

    #[test]
    fn every_name_the_filter_builds_resolves() {
        let names = [
            (
                MetricKind::Counter,
                metrics::requests("shop/cart", Reason::Member, Effect::Allow),
            ),
            (
                MetricKind::Counter,
                metrics::requests_replayed("shop/cart", Reason::Recycled),
            ),
            (
                MetricKind::Counter,
                metrics::retries(ReplayOutcome::Answered),
            ),
            (MetricKind::Counter, metrics::twin_picks(true)),
            (
                MetricKind::Counter,
                metrics::sync_errors(metrics::SYNC_ERROR_KINDS[0]),
            ),
            (MetricKind::Gauge, metrics::GAUGE_FRESH.to_owned()),
        ];
        for (kind, name) in names {
            assert!(Catalog.resolve(kind, &name).is_some(), "{name}");
        }
    }

    #[test]
    fn labels_come_out_in_the_family_order() {
        let name = metrics::requests(
            "shop/cart",
            Reason::Destroyed,
            Effect::Reject { status: 503 },
        );
        let resolved = Catalog.resolve(MetricKind::Counter, &name).unwrap();
        assert_eq!(
            FAMILIES[resolved.family].name,
            "staleguard_filter_requests_total"
        );
        assert_eq!(resolved.values, ["shop/cart", "destroyed", "reject"]);
    }

    #[test]
    fn an_unknown_name_or_kind_resolves_to_nothing() {
        assert_eq!(
            Catalog.resolve(MetricKind::Counter, "staleguard_filter_nope"),
            None
        );
        assert_eq!(
            Catalog.resolve(MetricKind::Counter, metrics::GAUGE_FRESH),
            None
        );
        assert_eq!(
            Catalog.resolve(
                MetricKind::Counter,
                "staleguard_filter_retries_total.kind.x"
            ),
            None
        );
    }
}
