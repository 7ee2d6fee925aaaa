//! Reading Envoy's counters and gauges: the `/stats` text form (`name: value`)
//! as a map, the names the filter's metrics take there, and series from
//! `/stats/prometheus` (where `stats_tags` turned name parts into labels; see
//! docs/metrics.md).
//!
//! Envoy before 1.39 keeps the metrics of a Wasm filter in a *cluster's*
//! upstream chain (`HttpProtocolOptions.http_filters`, as
//! `deploy/envoy/envoy.yaml` and every test gateway attach it) in that
//! cluster's stats scope, `cluster.<name>.wasmcustom.<metric>`; 1.39 moved
//! them to the root scope, `wasmcustom.<metric>` (envoyproxy/envoy#45242), where
//! a router's `upstream_http_filters` (the Istio attachment) always had them.
//! [`parse`] reads both as the root name, so a test asserts the same thing on
//! every Envoy it runs on (docs/operations.md, "Envoy and Istio versions").

use std::borrow::Cow;
use std::collections::BTreeMap;

/// Counters and gauges by their full `/stats` name.
pub type Stats = BTreeMap<String, u64>;

/// The filter's generation gauge, as Envoy names it.
pub const STAT_GENERATION: &str = "wasmcustom.staleguard_filter_index_generation";
/// The filter's freshness gauge.
pub const STAT_FRESH: &str = "wasmcustom.staleguard_filter_index_fresh";
/// The filter's full-resync counter.
pub const STAT_RESETS: &str = "wasmcustom.staleguard_filter_sync_resets_total";
/// Validator answers the filter's blast-radius guard held back.
pub const STAT_GUARD_HELD: &str = "wasmcustom.staleguard_filter_guard_held_total";
/// The `/stats` prefix of the filter's per-request counters.
pub const STAT_REQUESTS_PREFIX: &str = "wasmcustom.staleguard_filter_requests_total.service.";
/// Requests to a cluster the filter maps to no service.
pub const STAT_UNMAPPED: &str = "wasmcustom.staleguard_filter_requests_unmapped_total";
/// Requests whose upstream address the filter could not read.
pub const STAT_NO_ADDRESS: &str = "wasmcustom.staleguard_filter_requests_no_address_total";

/// The filter's per-request counter in `/stats/prometheus` (labels
/// `staleguard_service`, `staleguard_reason`, `staleguard_action`).
pub const PROM_REQUESTS: &str = "staleguard_filter_requests_total";

/// The stats namespace of the native module's metrics (Envoy's default for
/// dynamic modules), in a cluster's scope: `cluster.<name>.dynamicmodulescustom.<metric>`.
pub const NATIVE_NAMESPACE: &str = "dynamicmodulescustom";

/// The root-scope name of a stat: `cluster.<name>.wasmcustom.<metric>` (a
/// cluster-level upstream filter's metric on Envoy before 1.39) is
/// `wasmcustom.<metric>`; the native module's `[cluster.<name>.]dynamicmodulescustom.<metric>`
/// is read as the same `wasmcustom.<metric>`, so that a test asserts the
/// same thing of either build; any other name is itself.
pub fn root_name(name: &str) -> Cow<'_, str> {
    let native = match name.strip_prefix("cluster.") {
        None => name
            .strip_prefix(NATIVE_NAMESPACE)
            .and_then(|r| r.strip_prefix('.')),
        Some(rest) => {
            let scope = format!(".{NATIVE_NAMESPACE}.");
            rest.find(&scope).map(|i| &rest[i + scope.len()..])
        }
    };
    if let Some(metric) = native {
        return Cow::Owned(format!("wasmcustom.{metric}"));
    }
    Cow::Borrowed(
        name.strip_prefix("cluster.")
            .and_then(|rest| rest.find(".wasmcustom.").map(|i| &rest[i + 1..]))
            .unwrap_or(name),
    )
}

/// The `/stats?filter=` regex for the stat `name` in either scope (see
/// [`root_name`]).
pub fn filter_for(name: &str) -> String {
    let escaped = name.replace('|', "\\|");
    if let Some(metric) = escaped.strip_prefix("wasmcustom.") {
        // No `+`: the admin's query decoding may read it as a space.
        format!("^(cluster\\..*\\.)?(wasmcustom|{NATIVE_NAMESPACE}).{metric}$")
    } else {
        format!("^{escaped}$")
    }
}

/// Parses `/stats` text, each name read as its [`root_name`] (the values of a
/// metric found in several scopes are added up); lines whose value is not a
/// number (histograms) are left out.
pub fn parse(text: &str) -> Stats {
    let mut stats = Stats::new();
    for line in text.lines() {
        let Some((k, v)) = line.split_once(": ") else {
            continue;
        };
        let Ok(v) = v.trim().parse::<u64>() else {
            continue;
        };
        *stats.entry(root_name(k).into_owned()).or_default() += v;
    }
    stats
}

/// The filter's requests with `reason` and `action`, summed over services.
pub fn requests_total(stats: &Stats, reason: &str, action: &str) -> u64 {
    let suffix = format!(".reason.{reason}.action.{action}");
    stats
        .iter()
        .filter(|(k, _)| k.starts_with(STAT_REQUESTS_PREFIX) && k.ends_with(&suffix))
        .map(|(_, v)| v)
        .sum()
}

/// Every request the filter judged or passed untouched: all `requests_total`
/// series, plus unmapped and no-address.
pub fn requests_counted(stats: &Stats) -> u64 {
    stats
        .iter()
        .filter(|(k, _)| {
            k.starts_with(STAT_REQUESTS_PREFIX)
                || k.as_str() == STAT_UNMAPPED
                || k.as_str() == STAT_NO_ADDRESS
        })
        .map(|(_, v)| v)
        .sum()
}

/// The Prometheus name of the filter's unlabelled metric `metric` in the
/// root scope, for the build under test: the Wasm filter's `stats_tags` give
/// it its own name; the native module's poller (the bootstrap extension)
/// keeps it under Envoy's prefix and the dynamic modules' namespace
/// (docs/native.md, "Metrics").
pub fn prom_name(metric: &str) -> String {
    if super::native::selected() {
        format!("envoy_{NATIVE_NAMESPACE}_{metric}")
    } else {
        metric.to_owned()
    }
}

/// The Prometheus label `label` (a `stats_tags` name of the Wasm filter's,
/// `staleguard_error_kind`) for the build under test: the native module
/// labels its stats itself, with the keys of the dotted name (`kind`).
pub fn prom_label(label: &str) -> &str {
    if !super::native::selected() {
        return label;
    }
    match label {
        "staleguard_error_kind" => "kind",
        other => other.strip_prefix("staleguard_").unwrap_or(other),
    }
}

/// The sum of the series `name{labels}` in Prometheus text, if any is present.
/// `labels` are `(key, value)` pairs that must all match; series with more
/// labels (the filter's `staleguard_service`) are summed.
pub fn prometheus_value(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<u64> {
    let mut values = text.lines().filter_map(|line| {
        let (series, value) = line.rsplit_once(' ')?;
        let (metric, rest) = series.split_once('{').unwrap_or((series, "}"));
        if metric != name {
            return None;
        }
        let rest = rest.strip_suffix('}')?;
        let ok = labels
            .iter()
            .all(|(k, v)| rest.split(',').any(|kv| kv == format!("{k}=\"{v}\"")));
        if !ok {
            return None;
        }
        value.parse::<f64>().ok().map(|v| v as u64)
    });
    let first = values.next()?;
    Some(first + values.sum::<u64>())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_the_request_counters_by_reason_and_action() {
        let stats = parse(
            "wasmcustom.staleguard_filter_requests_total.service.shop/cart.reason.destroyed.action.reject: 7\n\
             wasmcustom.staleguard_filter_requests_total.service.shop/pay.reason.destroyed.action.reject: 3\n\
             wasmcustom.staleguard_filter_requests_total.service.shop/cart.reason.member.action.allow: 20\n\
             wasmcustom.staleguard_filter_requests_unmapped_total: 2\n\
             wasmcustom.staleguard_filter_index_fresh: 1\n\
             cluster.x.upstream_rq_time: P0(nan,1.0) P25(nan,2.0)\n",
        );
        assert_eq!(requests_total(&stats, "destroyed", "reject"), 10);
        assert_eq!(requests_total(&stats, "member", "allow"), 20);
        assert_eq!(requests_total(&stats, "recycled", "reject"), 0);
        assert_eq!(requests_counted(&stats), 32);
        assert_eq!(stats.get(STAT_FRESH), Some(&1));
        assert!(!stats.contains_key("cluster.x.upstream_rq_time"));
    }

    #[test]
    fn reads_cluster_scoped_filter_metrics_as_root_ones() {
        // Envoy 1.36-1.38: a cluster-level upstream chain's metrics carry the
        // cluster's scope (cluster names have dots and bars).
        let stats = parse(
            "cluster.outbound|8080||cart.shop.svc.cluster.local.wasmcustom.staleguard_filter_sync_resets_total: 1\n\
             cluster.outbound|8080||cart.shop.svc.cluster.local.wasmcustom.staleguard_filter_requests_total.service.shop/cart.reason.destroyed.action.reject: 2\n\
             cluster.outbound|8080||pay.shop.svc.cluster.local.wasmcustom.staleguard_filter_requests_total.service.shop/cart.reason.destroyed.action.reject: 3\n\
             cluster.outbound|8080||cart.shop.svc.cluster.local.wasm.staleguard.vm_reload: 0\n",
        );
        assert_eq!(stats.get(STAT_RESETS), Some(&1));
        assert_eq!(requests_total(&stats, "destroyed", "reject"), 5);
        assert_eq!(
            stats.get(
                "cluster.outbound|8080||cart.shop.svc.cluster.local.wasm.staleguard.vm_reload"
            ),
            Some(&0)
        );
        assert_eq!(
            filter_for(STAT_RESETS),
            "^(cluster\\..*\\.)?(wasmcustom|dynamicmodulescustom).staleguard_filter_sync_resets_total$"
        );
        assert_eq!(filter_for("a.b|c"), "^a.b\\|c$");
    }

    #[test]
    fn reads_the_native_modules_metrics_as_the_filters() {
        let stats = parse(
            "cluster.outbound|8080||cart.shop.svc.cluster.local.dynamicmodulescustom.staleguard_filter_index_fresh: 1\n\
             dynamicmodulescustom.staleguard_filter_sync_resets_total: 2\n\
             cluster.dynamicmodulescustom.upstream_rq_total: 5\n",
        );
        assert_eq!(stats.get(STAT_FRESH), Some(&1));
        assert_eq!(stats.get(STAT_RESETS), Some(&2));
        assert_eq!(
            stats.get("cluster.dynamicmodulescustom.upstream_rq_total"),
            Some(&5)
        );
    }

    #[test]
    fn reads_a_labelled_series_from_prometheus_text() {
        let text = "# TYPE staleguard_filter_requests_total counter\n\
            staleguard_filter_requests_total{staleguard_service=\"shop/cart\",staleguard_reason=\"destroyed\",staleguard_action=\"reject\"} 1800\n\
            staleguard_filter_requests_total{staleguard_service=\"shop/pay\",staleguard_reason=\"destroyed\",staleguard_action=\"reject\"} 40\n\
            staleguard_filter_requests_total{staleguard_service=\"shop/cart\",staleguard_reason=\"member\",staleguard_action=\"allow\"} 660\n\
            staleguard_filter_index_fresh{} 1\n";
        let get = |labels: &[(&str, &str)]| prometheus_value(text, PROM_REQUESTS, labels);
        assert_eq!(
            get(&[
                ("staleguard_reason", "destroyed"),
                ("staleguard_action", "reject")
            ]),
            Some(1840)
        );
        assert_eq!(
            get(&[
                ("staleguard_reason", "member"),
                ("staleguard_action", "allow")
            ]),
            Some(660)
        );
        assert_eq!(get(&[("staleguard_reason", "recycled")]), None);
        assert_eq!(
            prometheus_value(text, "staleguard_filter_index_fresh", &[]),
            Some(1)
        );
    }
}
