//! The streaming reset apply: a snapshot or reset is judged, measured and
//! written a record at a time, its body read once per pass (see
//! [`crate::sync`]'s docs), never held whole.

use std::io::BufReader;
use std::net::IpAddr;
use std::ops::ControlFlow;

use staleguard_core::packed;
use staleguard_core::{ServiceKey, Snapshot};

use super::{Answered, Applied, Cursor, HeldAt, Poller, SyncError, BODY_CHUNK};
use crate::buckets::{service_id, CompactRecord};
use crate::guard::{Applying, Guard, Judging};
use crate::store::write::{Head, Loading, Plan};

// === impl Poller ===

impl Poller {
    /// Judges a snapshot or reset and applies it, or holds it; its records
    /// are read once per pass (see the module's docs).
    pub(super) fn load_snapshot(
        &mut self,
        now_ms: u64,
        records: &Records<'_>,
        answer: &mut dyn Answered,
    ) -> Result<Applied, SyncError> {
        let judging = self.guard.judging_reset(now_ms);
        let mut judge = Judge {
            guard: &self.guard,
            judging,
            plan: Plan::new(0),
        };
        let head = read(records, answer, &mut judge)?;
        let Judge { judging, plan, .. } = judge;
        self.guard.learn(&head.services);
        if let Some(judging) = judging {
            if !self.guard.conclude(now_ms, judging) {
                let mut gains = Gains {
                    guard: &self.guard,
                    gains: Vec::new(),
                };
                read(records, answer, &mut gains)?;
                let at = HeldAt {
                    epoch: head.epoch,
                    generation: head.generation,
                };
                let gains: Vec<&CompactRecord> = gains.gains.iter().collect();
                return self.hold(now_ms, &gains, at, head.freshness.fresh, answer);
            }
        }
        self.held = None;
        self.gains_written = false;
        let (v4, v6) = plan.families();
        let mut loading = self.writer.begin_snapshot(answer, plan)?;
        let applying = self.guard.begin_reset(now_ms, v4, v6);
        let mut first = Some(applying);
        loop {
            let mut apply = Apply {
                guard: first.map(|applying| (&mut self.guard, applying)),
                loading: &mut loading,
            };
            let read = read(records, answer, &mut apply);
            if first.take().is_some() {
                if let Err(e) = read {
                    // The baseline is half of this answer: start over
                    // without one, as a new poller does.
                    self.guard.reset();
                    return Err(e);
                }
                self.guard.end_reset(&head.services);
            } else {
                read?;
            }
            if !loading.finish_slice(answer)? {
                break;
            }
        }
        let meta = self.writer.commit_snapshot(
            answer,
            now_ms,
            loading,
            &Head {
                epoch: head.epoch,
                generation: head.generation,
                fresh: head.freshness.fresh,
                services: &head.services,
            },
        )?;
        self.cursor = Some(Cursor {
            load: meta.load,
            epoch: meta.epoch,
            generation: meta.generation,
        });
        Ok(Applied::Reset {
            entries: meta.entries,
        })
    }
}

/// A snapshot's records, as each pass reads them: from the answer's body
/// again (packed), or from the records decoded whole (JSON).
pub(super) enum Records<'a> {
    Packed,
    Decoded(&'a Snapshot<CompactRecord>),
}

/// What one reading of a snapshot does with its records.
trait Pass {
    /// `count` records follow; the snapshot knows `services`.
    fn begin(&mut self, services: &[ServiceKey], count: usize) {
        let _ = (services, count);
    }

    /// Whether this pass needs the record of `ip`.
    fn wants(&self, ip: &IpAddr) -> bool {
        let _ = ip;
        true
    }

    /// One record.
    fn record(&mut self, record: &CompactRecord);
}

/// Reads `records` once through `pass`; returns the snapshot without its
/// records.
fn read(
    records: &Records<'_>,
    answer: &dyn Answered,
    pass: &mut dyn Pass,
) -> Result<Snapshot<()>, SyncError> {
    match records {
        Records::Packed => {
            let body = BufReader::with_capacity(BODY_CHUNK, answer.body());
            packed::visit_snapshot(body, service_id, &mut Visiting(pass))
                .map_err(SyncError::DecodePacked)
        }
        Records::Decoded(snapshot) => {
            pass.begin(&snapshot.services, snapshot.records.len());
            for record in &snapshot.records {
                if pass.wants(&record.ip) {
                    pass.record(record);
                }
            }
            Ok(Snapshot {
                v: snapshot.v,
                epoch: snapshot.epoch,
                generation: snapshot.generation,
                freshness: snapshot.freshness.clone(),
                services: snapshot.services.clone(),
                records: Vec::new(),
            })
        }
    }
}

/// A [`Pass`] over a packed answer: each record as the poller keeps it,
/// dropped once the pass has used it.
struct Visiting<'p>(&'p mut dyn Pass);

impl packed::Visit<u64> for Visiting<'_> {
    fn begin(&mut self, services: &[ServiceKey], count: usize) -> ControlFlow<()> {
        self.0.begin(services, count);
        ControlFlow::Continue(())
    }

    fn wants(&mut self, ip: IpAddr) -> bool {
        self.0.wants(&ip)
    }

    fn record(&mut self, record: packed::Record<u64>) -> ControlFlow<()> {
        self.0.record(&CompactRecord::of_packed(record));
        ControlFlow::Continue(())
    }
}

/// The first reading: the guard's judgement, and the layout's measure.
struct Judge<'g> {
    guard: &'g Guard,
    judging: Option<Judging>,
    plan: Plan,
}

impl Pass for Judge<'_> {
    fn begin(&mut self, services: &[ServiceKey], count: usize) {
        if let Some(judging) = self.judging.as_mut() {
            judging.know(services);
        }
        self.plan = Plan::new(count);
    }

    fn record(&mut self, record: &CompactRecord) {
        if let Some(judging) = self.judging.as_mut() {
            self.guard.judge(judging, record);
        }
        self.plan.measure(record);
    }
}

/// The reading of a held answer: the records that only add.
struct Gains<'g> {
    guard: &'g Guard,
    gains: Vec<CompactRecord>,
}

impl Pass for Gains<'_> {
    fn record(&mut self, record: &CompactRecord) {
        if self.guard.is_gain(record) {
            self.gains.push(record.clone());
        }
    }
}

/// A reading that writes a slice of the layout; the first also makes the
/// answer the guard's baseline.
struct Apply<'a> {
    guard: Option<(&'a mut Guard, Applying)>,
    loading: &'a mut Loading,
}

impl Pass for Apply<'_> {
    fn wants(&self, ip: &IpAddr) -> bool {
        self.loading.wants(ip)
    }

    fn record(&mut self, record: &CompactRecord) {
        if let Some((guard, applying)) = self.guard.as_mut() {
            guard.apply(applying, record);
        }
        self.loading.put(record);
    }
}
