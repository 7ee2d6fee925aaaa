//! A human-readable summary of the index, printed by `--once` and logged on
//! changes.

use std::fmt;

use staleguard_core::{Freshness, ServiceKey};

use crate::index::IndexStats;
use crate::live::SharedIndex;

/// What the index holds at one moment.
#[derive(Debug, Clone)]
pub struct Summary {
    /// Where the data comes from.
    pub source: String,
    /// The epoch.
    pub epoch: u64,
    /// Counts.
    pub stats: IndexStats,
    /// Freshness.
    pub freshness: Freshness,
    /// Live members per service; `None` in the summary logged on changes,
    /// which must not walk every pod under the index lock each time.
    pub members: Option<Vec<(ServiceKey, usize)>>,
    /// Services left unjudged because the watched scope may not cover their
    /// members.
    pub out_of_scope: usize,
    /// Those services and why; `None` in the summary logged on changes.
    pub out_of_scope_services: Option<Vec<(ServiceKey, String)>>,
}

impl Summary {
    /// Takes a full summary of `shared`, members per service included (a walk
    /// over every pod: for `--once`, not for every change).
    pub fn of(shared: &SharedIndex, source: &str) -> Self {
        let mut summary = Self::counts(shared, source);
        summary.members = Some(shared.read().service_members());
        summary.out_of_scope_services = Some(shared.read().out_of_scope_services());
        summary
    }

    /// Takes the counts of `shared` only: constant work under the lock, for the
    /// line logged on changes.
    pub fn counts(shared: &SharedIndex, source: &str) -> Self {
        let freshness = shared.freshness();
        let index = shared.read();
        Self {
            source: source.to_owned(),
            epoch: index.epoch(),
            stats: index.stats(),
            freshness,
            members: None,
            out_of_scope: index.out_of_scope_count(),
            out_of_scope_services: None,
        }
    }

    /// Logs the summary as one structured event.
    pub fn log(&self) {
        let s = &self.stats;
        tracing::info!(
            generation = s.generation,
            pods = s.pods,
            ips = s.ips,
            services = s.services,
            slices = s.slices,
            tombstones = s.tombstones,
            out_of_scope = self.out_of_scope,
            skipped = s.skipped.values().sum::<u64>(),
            fresh = self.freshness.fresh,
            "index changed"
        );
    }
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = &self.stats;
        writeln!(f, "staleguard index from {}", self.source)?;
        writeln!(
            f,
            "  epoch {:016x}  generation {}  fresh {}",
            self.epoch, s.generation, self.freshness.fresh
        )?;
        writeln!(
            f,
            "  pods {}  ips {}  services {}  slices {}  slice entries {}  tombstones {}",
            s.pods, s.ips, s.services, s.slices, s.slice_entries, s.tombstones
        )?;
        if let Some(members) = &self.members {
            writeln!(f, "  live members per service:")?;
            let width = members
                .iter()
                .map(|(k, _)| k.to_string().len())
                .max()
                .unwrap_or(0);
            for (service, count) in members {
                writeln!(f, "    {:width$}  {count}", service.to_string())?;
            }
        }
        if let Some(services) = self
            .out_of_scope_services
            .as_ref()
            .filter(|s| !s.is_empty())
        {
            writeln!(
                f,
                "  services out of the watched scope, treated as unknown (docs/index.md):"
            )?;
            for (service, why) in services {
                writeln!(f, "    {service}: {why}")?;
            }
        }
        if s.skipped.is_empty() {
            writeln!(f, "  skipped objects: none")?;
        } else {
            writeln!(f, "  skipped objects:")?;
            for ((kind, reason), count) in &s.skipped {
                writeln!(f, "    {kind} {reason}: {count}")?;
            }
        }
        Ok(())
    }
}

/// One line on each watch, for error messages.
pub fn watch_line(shared: &SharedIndex) -> String {
    shared
        .watch_health()
        .iter()
        .map(|w| format!("{} synced={} errors={}", w.kind, w.synced, w.errors))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, SystemTime};

    use kube::runtime::watcher::Event;

    use super::*;
    use crate::index::fixtures::{pod, service};
    use crate::index::{Index, IndexConfig};

    fn shared() -> SharedIndex {
        let shared = SharedIndex::new(
            Index::new(1, IndexConfig::default()),
            Duration::from_secs(60),
        );
        let now = SystemTime::now();
        let svc = service("shop", "cart").selector(&[("app", "cart")]).build();
        shared.apply_service(Event::Apply(svc), now);
        let p = pod("shop", "cart-1")
            .ip("10.0.0.1")
            .labels(&[("app", "cart")]);
        shared.apply_pod(Event::Apply(p.build()), now);
        shared
    }

    #[test]
    fn the_change_log_line_counts_without_walking_the_pods() {
        let s = shared();
        let line = Summary::counts(&s, "test");
        assert_eq!(line.members, None);
        assert_eq!(line.stats.pods, 1);
        assert!(!line.to_string().contains("members"));
    }

    #[test]
    fn the_once_summary_lists_members_per_service() {
        let s = shared();
        let full = Summary::of(&s, "test");
        assert_eq!(
            full.members,
            Some(vec![(ServiceKey::new("shop", "cart"), 1)])
        );
        assert!(full.to_string().contains("shop/cart  1"), "{full}");
        assert!(
            !full.to_string().contains("out of the watched scope"),
            "{full}"
        );
    }

    #[test]
    fn the_once_summary_names_services_out_of_scope_and_why() {
        let config = IndexConfig {
            scope: crate::scope::PodScope {
                namespace: Some("shop".into()),
                pod_selector: None,
            },
            ..IndexConfig::default()
        };
        let s = SharedIndex::new(Index::new(1, config), Duration::from_secs(60));
        s.apply_service(
            Event::Apply(service("shop", "legacy").build()),
            SystemTime::now(),
        );
        let full = Summary::of(&s, "test");
        assert_eq!(full.out_of_scope, 1);
        let text = full.to_string();
        assert!(text.contains("shop/legacy: it has no selector"), "{text}");
        assert_eq!(Summary::counts(&s, "test").out_of_scope_services, None);
    }
}
