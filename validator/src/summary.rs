//! A human-readable summary of the index, printed by `--once` and logged on
//! changes.

use std::fmt;

use staleguard_core::{Freshness, ServiceKey};

use crate::index::IndexStats;
use crate::shared::SharedIndex;

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
    /// Live members per service.
    pub members: Vec<(ServiceKey, usize)>,
}

impl Summary {
    /// Takes a summary of `shared`.
    pub fn of(shared: &SharedIndex, source: &str) -> Self {
        let freshness = shared.freshness();
        let index = shared.read();
        Self {
            source: source.to_owned(),
            epoch: index.epoch(),
            stats: index.stats(),
            freshness,
            members: index.service_members(),
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
        writeln!(f, "  live members per service:")?;
        let width = self
            .members
            .iter()
            .map(|(k, _)| k.to_string().len())
            .max()
            .unwrap_or(0);
        for (service, count) in &self.members {
            writeln!(f, "    {:width$}  {count}", service.to_string())?;
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
