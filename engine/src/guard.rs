//! The blast-radius guard: an answer that would suddenly reject much of what
//! the index allowed is held, not applied.
//!
//! Envoy's panic threshold stops trusting health checks when too much of a
//! cluster looks unhealthy; this is staleguard's equivalent for its own data.
//! Before the poller applies an answer, [`Guard::assess`] compares it with
//! what the poller last applied (a [`Baseline`]: per IP, the services it is
//! allowed for and who holds it) and counts the IPs that would turn from
//! allowed into rejected for a service the answer still knows. A loss is
//! *backed by evidence* when the validator says what happened to that pod:
//!
//! - the IP's record carries a tombstone naming the service (the pod was
//!   deleted, and the validator saw it go), or
//! - in a delta, another pod holds the IP now (the validator watched it change
//!   hands).
//!
//! Evidenced losses are applied at once, whatever their number: that is the
//! incident staleguard exists for (250 -> 20 pods in a minute, each deletion
//! its own watch event, each with a tombstone). The answer is held when the
//! losses *without* evidence reach either threshold:
//!
//! - **ratio**: more than `max_loss_percent` of the allowed IPs (once at least
//!   `min_ips` are allowed), or
//! - **service**: every allowed IP of a service with at least
//!   `min_service_ips` of them.
//!
//! A held answer is not written: the previous data keeps serving, enforced as
//! before. A validator that answers, and calls its answer fresh, keeps that
//! data fresh while it holds (the poller refreshes `meta`; see
//! [`crate::sync`]): holding a wrong answer must not turn into failing closed
//! on live members, nor into failing open. The poller watches the held answer
//! and asks again at least every second; an answer that no longer trips is
//! applied normally (the hold is *released*), and one that still trips
//! `confirm_ms` after the hold began is applied (*confirmed*): a change that
//! persists that long is taken as real.
//!
//! The reference the losses are counted against must itself be sane, so it
//! is made only of IPs that have been allowed for `confirm_ms`: an IP an
//! answer newly allows is *unconfirmed* until then, and losing it again is no
//! loss. The guard protects established members. Without that rule, one
//! answer of a wrong validator that passes (a validator pointed at the wrong
//! cluster, a restore from an old backup, adding 150,000 IPs and dropping a
//! service's one live pod, under every threshold) would become the
//! reference, and the correct validator's next answer, which drops all of it,
//! would be held for a minute as a loss of everything. The first snapshot a
//! poller applies is its reference as it stands (there is nothing older to
//! judge it by), unless the index already holds one: a poller that takes the
//! lease over seeds its baseline from the index ([`Guard::seed`], see
//! `seed`), so what its predecessor held stays held. A wrong validator that serves for longer than `confirm_ms`
//! is taken for the truth, like any change that persists that long.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;

use staleguard_core::wire::Delta;
use staleguard_core::{Policy, ServiceKey, Snapshot};

use crate::buckets::{placeholder, service_id, CompactRecord};

mod baseline;
mod judged;
mod seed;

pub use baseline::Baseline;
use baseline::UNKNOWN_HOLDER;
use judged::Judged;
pub use seed::Seeded;

/// The guard's knobs (`guard` in the plugin configuration).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GuardConfig {
    /// Hold answers that trip a threshold (default true).
    pub enabled: bool,
    /// Hold when more than this percentage of the allowed IPs would be
    /// rejected without evidence (1..=100; default 50).
    pub max_loss_percent: u32,
    /// The ratio rule applies from this many allowed IPs (default 10).
    pub min_ips: u64,
    /// Hold when every allowed IP of a service with at least this many would
    /// be rejected without evidence (at least 1; default 2).
    pub min_service_ips: u64,
    /// A held change that still trips this long after the hold began is
    /// applied; an IP newly allowed counts as allowed this long after
    /// (default 60000).
    pub confirm_ms: u64,
}

impl Default for GuardConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            max_loss_percent: 50,
            min_ips: 10,
            min_service_ips: 2,
            confirm_ms: 60_000,
        }
    }
}

impl GuardConfig {
    /// Every problem with the values, one line each.
    pub fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        if !(1..=100).contains(&self.max_loss_percent) {
            problems.push(format!(
                "guard.max_loss_percent {} not in 1..=100",
                self.max_loss_percent
            ));
        }
        if self.min_service_ips == 0 {
            // Zero would hold any answer that touches a service with no IPs.
            problems.push("guard.min_service_ips must be at least 1".to_owned());
        }
        if self.confirm_ms > 3_600_000 {
            problems.push(format!(
                "guard.confirm_ms {} exceeds one hour",
                self.confirm_ms
            ));
        }
        problems
    }
}

/// Which threshold an answer tripped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rule {
    /// Too large a share of the allowed IPs.
    Ratio,
    /// Every allowed IP of this service.
    Service(ServiceKey),
}

impl std::fmt::Display for Rule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Rule::Ratio => f.write_str("ratio"),
            Rule::Service(s) => write!(f, "every IP of {s}"),
        }
    }
}

/// What an answer would do to the IPs the index allows.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Blast {
    /// IPs allowed for at least one service before the answer, for at least
    /// `confirm_ms` (see [`crate::guard`]).
    pub allowed_ips: u64,
    /// Of those, IPs the answer would reject for a service it still knows,
    /// without evidence.
    pub lost_ips: u64,
    /// IPs the answer would reject with evidence (tombstone, new holder).
    pub evidenced_ips: u64,
    /// The threshold tripped, if any.
    pub tripped: Option<Rule>,
}

/// What the guard did with the last answer, for the root to count and log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GuardEvent {
    /// The answer was held; the previous data keeps serving.
    Held(Blast),
    /// A held change persisted for `confirm_ms` and was applied.
    Confirmed(Blast),
    /// An answer that no longer trips ended a hold and was applied.
    Released,
}

/// The guard: its knobs, the baseline, and the hold in progress.
#[derive(Debug, Clone)]
pub struct Guard {
    config: GuardConfig,
    policy: Policy,
    baseline: Baseline,
    /// Service names by id, for what the guard reports (records name
    /// services by id only).
    names: HashMap<u64, ServiceKey>,
    held_since_ms: Option<u64>,
    event: Option<GuardEvent>,
}

/// An answer about to be applied, whole (a reset read a record at a time
/// goes through [`Guard::judging_reset`] and [`Guard::begin_reset`] instead).
#[derive(Debug, Clone, Copy)]
pub enum Answer<'a> {
    /// A snapshot or reset: the whole index.
    Reset(&'a Snapshot<CompactRecord>),
    /// A delta that continues the applied generation.
    Delta(&'a Delta<CompactRecord>),
}

/// An answer being judged a record at a time: what it would do to the IPs
/// allowed now, tallied as its records go by, without keeping them.
#[derive(Debug, Clone)]
pub struct Judging {
    known: Known,
    lost_by_service: HashMap<u64, u64>,
    /// Per set, the confirmed allowed IPs of the baseline the answer lists
    /// (a reset): the others are the ones it lacks.
    listed: Vec<u64>,
    blast: Blast,
}

/// The services an answer leaves known.
#[derive(Debug, Clone)]
enum Known {
    /// A reset's: those it lists.
    Reset(HashSet<u64>),
    /// A delta's: the baseline's, with its additions and removals.
    Delta {
        added: HashSet<u64>,
        removed: HashSet<u64>,
    },
}

/// A reset being applied to the baseline a record at a time
/// ([`Guard::begin_reset`]).
#[derive(Debug, Clone, Copy)]
pub struct Applying {
    first: bool,
    confirm_at_ms: u64,
}

// === impl Guard ===

impl Guard {
    /// A guard judging "allowed" under `policy`.
    pub fn new(config: GuardConfig, policy: Policy) -> Self {
        Self {
            config,
            policy,
            baseline: Baseline::default(),
            names: HashMap::new(),
            held_since_ms: None,
            event: None,
        }
    }

    /// True while an answer is held.
    pub fn holding(&self) -> bool {
        self.held_since_ms.is_some()
    }

    /// How long the hold in progress has lasted at `now_ms`, if one is.
    pub fn held_for_ms(&self, now_ms: u64) -> Option<u64> {
        self.held_since_ms.map(|since| now_ms.saturating_sub(since))
    }

    /// True when a hold that began at the latest `confirm_ms` ago would be
    /// confirmed by an answer that still trips at `now_ms`.
    pub fn confirm_due(&self, now_ms: u64) -> bool {
        self.held_for_ms(now_ms)
            .is_some_and(|held| held >= self.config.confirm_ms)
    }

    /// Allowed IPs not confirmed yet (newly allowed less than `confirm_ms`
    /// ago), as of the last answer.
    pub fn unconfirmed_ips(&self) -> u64 {
        self.baseline.counts.unconfirmed_ips
    }

    /// What happened with the last answer, once.
    pub fn take_event(&mut self) -> Option<GuardEvent> {
        self.event.take()
    }

    /// Decides whether `answer` may be applied at `now_ms`. `false`: hold it.
    /// After `true` the caller applies it and reports with
    /// [`Guard::applied`].
    pub fn admit(&mut self, now_ms: u64, answer: Answer<'_>) -> bool {
        self.learn_names(answer);
        let Some(mut judging) = self.judging(now_ms, answer) else {
            return true;
        };
        self.judge_all(&mut judging, answer);
        self.conclude(now_ms, judging)
    }

    fn judging(&mut self, now_ms: u64, answer: Answer<'_>) -> Option<Judging> {
        self.judges(now_ms).then(|| Judging::of(answer))
    }

    /// Starts judging a reset at `now_ms`, its records fed to
    /// [`Guard::judge`] as they are read (its services to
    /// [`Judging::know`]), then [`Guard::conclude`]. `None`: the guard
    /// admits every answer (it is off, or has no baseline to judge by).
    pub fn judging_reset(&mut self, now_ms: u64) -> Option<Judging> {
        self.judges(now_ms).then(|| Judging::reset(&[]))
    }

    /// True when answers are judged at all; then the IPs whose time has
    /// come at `now_ms` are confirmed first.
    fn judges(&mut self, now_ms: u64) -> bool {
        if !self.config.enabled || !self.baseline.armed {
            return false;
        }
        self.baseline.confirm_due(now_ms);
        true
    }

    /// Decides on the answer `judging` tallied, at `now_ms` (the names of
    /// the services it lists learnt first, [`Guard::learn`]). `false`: hold
    /// it.
    pub fn conclude(&mut self, now_ms: u64, judging: Judging) -> bool {
        let blast = self.blast(judging);
        match (blast.tripped.is_some(), self.held_since_ms) {
            (false, None) => true,
            (false, Some(_)) => {
                self.held_since_ms = None;
                self.event = Some(GuardEvent::Released);
                true
            }
            (true, Some(since)) if now_ms.saturating_sub(since) >= self.config.confirm_ms => {
                self.held_since_ms = None;
                self.event = Some(GuardEvent::Confirmed(blast));
                true
            }
            (true, since) => {
                self.held_since_ms = Some(since.unwrap_or(now_ms));
                self.event = Some(GuardEvent::Held(blast));
                false
            }
        }
    }

    /// The poller applied `answer` at `now_ms`: it is the new baseline. An
    /// IP that stays allowed keeps its standing; one newly allowed is
    /// unconfirmed for `confirm_ms`, except in the first snapshot.
    pub fn applied(&mut self, now_ms: u64, answer: Answer<'_>) {
        self.learn_names(answer);
        match answer {
            Answer::Reset(snapshot) => {
                let (v4, v6) = families(snapshot.records.iter().map(|r| &r.ip));
                let applying = self.begin_reset(now_ms, v4, v6);
                for record in &snapshot.records {
                    self.apply(&applying, record);
                }
                self.end_reset(&snapshot.services);
            }
            Answer::Delta(delta) => {
                let applying = Applying {
                    first: false,
                    confirm_at_ms: self.confirm_at(now_ms),
                };
                let b = &mut self.baseline;
                for s in &delta.services_removed {
                    b.known.remove(&service_id(s));
                }
                b.known.extend(delta.services_added.iter().map(service_id));
                for record in &delta.upserts {
                    self.apply(&applying, record);
                }
                for ip in &delta.removed {
                    self.baseline.remove(ip);
                }
            }
        }
    }

    /// A reset of `v4` + `v6` IPs is about to be applied at `now_ms`, a
    /// record at a time ([`Guard::apply`], then [`Guard::end_reset`]).
    pub fn begin_reset(&mut self, now_ms: u64, v4: usize, v6: usize) -> Applying {
        let b = &mut self.baseline;
        let first = !b.armed;
        b.armed = true;
        b.mark = !b.mark;
        if first {
            // Every IP it lists is confirmed; any other is dropped.
            b.pending.clear();
        }
        // At once, not by doubling as it fills: the table is the largest
        // thing the guard keeps.
        b.ips.reserve(v4, v6);
        Applying {
            first,
            confirm_at_ms: self.confirm_at(now_ms),
        }
    }

    /// One record of an answer being applied: it replaces what the baseline
    /// knew of its IP.
    pub fn apply(&mut self, applying: &Applying, record: &CompactRecord) {
        let b = &mut self.baseline;
        let ticket = match b.remove(&record.ip) {
            _ if applying.first => Some(0),
            // A standing carried over keeps its place in the queue.
            Some(before) if before.allowed() => Some(before.ticket),
            _ => None,
        };
        b.insert(&self.policy, record, ticket, applying.confirm_at_ms);
    }

    /// The reset begun with [`Guard::begin_reset`] is applied: it listed
    /// `services`, and the IPs it did not list are forgotten.
    pub fn end_reset(&mut self, services: &[ServiceKey]) {
        self.learn(services);
        let b = &mut self.baseline;
        b.known = services.iter().map(service_id).collect();
        let Baseline {
            ips,
            sets,
            counts,
            mark,
            ..
        } = b;
        ips.retain(|facts| {
            let listed = facts.mark() == *mark;
            if !listed {
                counts.add(sets, facts, -1);
                sets.release(facts.set());
            }
            listed
        });
    }

    /// Forgets the baseline and any hold (the poller lost its lease; a
    /// successor seeds its own from the index, [`Guard::seed`]).
    pub fn reset(&mut self) {
        self.baseline = Baseline::default();
        self.held_since_ms = None;
    }

    /// The records of `answer` that only add ([`Guard::is_gain`]).
    pub fn gains<'a>(&self, answer: Answer<'a>) -> Vec<&'a CompactRecord> {
        let records: &'a [CompactRecord] = match answer {
            Answer::Reset(snapshot) => &snapshot.records,
            Answer::Delta(delta) => &delta.upserts,
        };
        records.iter().filter(|r| self.is_gain(r)).collect()
    }

    /// True for a record that only adds: its IP the current data allows for
    /// no service, and the answer allows for one. Writing it while the
    /// answer is held can turn a rejection into an allowance, never the
    /// reverse, so a pod that appeared during a hold is not read as
    /// destroyed.
    pub fn is_gain(&self, record: &CompactRecord) -> bool {
        self.baseline
            .ips
            .get(&record.ip)
            .is_none_or(|old| !old.allowed())
            && !Judged::of(Some(record)).allowed(&self.policy).is_empty()
    }

    /// What `answer` would do to the IPs allowed now.
    pub fn assess(&self, answer: Answer<'_>) -> Blast {
        let mut judging = Judging::of(answer);
        self.judge_all(&mut judging, answer);
        self.blast(judging)
    }

    fn judge_all(&self, judging: &mut Judging, answer: Answer<'_>) {
        match answer {
            Answer::Reset(snapshot) => {
                for record in &snapshot.records {
                    self.judge(judging, record);
                }
            }
            Answer::Delta(delta) => {
                for record in &delta.upserts {
                    self.judge(judging, record);
                }
                for ip in &delta.removed {
                    self.judge_removed(judging, ip);
                }
            }
        }
    }

    /// Tallies one record of the answer `judging` judges.
    pub fn judge(&self, judging: &mut Judging, record: &CompactRecord) {
        let Some(old) = self.baseline.ips.get(&record.ip) else {
            return;
        };
        if old.unconfirmed() || !old.allowed() {
            // Not trusted as allowed (yet): nothing to lose.
            return;
        }
        if matches!(judging.known, Known::Reset(_)) {
            let set = old.set() as usize;
            if judging.listed.len() <= set {
                judging.listed.resize(set + 1, 0);
            }
            if let Some(listed) = judging.listed.get_mut(set) {
                *listed += 1;
            }
        }
        let judged = Judged::of(Some(record));
        let mut lost = false;
        let mut evidenced = false;
        let in_delta = matches!(judging.known, Known::Delta { .. });
        for &id in self.baseline.sets.ids(old.set()) {
            // The verdict first: it is cheaper than the set lookup, and
            // almost always still allows.
            if judged.allows(&self.policy, id) || !self.known(&judging.known, id) {
                continue;
            }
            let evidence = record.tombstone.contains(&id)
                || (in_delta
                    && judged.has_pods()
                    && old.fingerprint != UNKNOWN_HOLDER
                    && record.fingerprint != old.fingerprint);
            if evidence {
                evidenced = true;
            } else {
                lost = true;
                *judging.lost_by_service.entry(id).or_default() += 1;
            }
        }
        if lost {
            judging.blast.lost_ips += 1;
        } else if evidenced {
            judging.blast.evidenced_ips += 1;
        }
    }

    /// Tallies an IP a delta removes.
    fn judge_removed(&self, judging: &mut Judging, ip: &IpAddr) {
        if let Some(old) = self.baseline.ips.get(ip) {
            if !old.unconfirmed() && old.allowed() {
                self.judge_gone(judging, old.set(), 1);
            }
        }
    }

    /// `ips` confirmed IPs allowed for `set` that the answer no longer has:
    /// lost for every service it still knows, without evidence.
    fn judge_gone(&self, judging: &mut Judging, set: u32, ips: u64) {
        let none = Judged::of(None);
        let mut lost = false;
        for &id in self.baseline.sets.ids(set) {
            if none.allows(&self.policy, id) || !self.known(&judging.known, id) {
                continue;
            }
            lost = true;
            *judging.lost_by_service.entry(id).or_default() += ips;
        }
        if lost {
            judging.blast.lost_ips += ips;
        }
    }

    fn known(&self, known: &Known, id: u64) -> bool {
        match known {
            Known::Reset(listed) => listed.contains(&id),
            Known::Delta { added, removed } => {
                added.contains(&id) || (self.baseline.known.contains(&id) && !removed.contains(&id))
            }
        }
    }

    /// What the answer `judging` tallied would do, and the threshold it
    /// trips.
    fn blast(&self, mut judging: Judging) -> Blast {
        let b = &self.baseline;
        if matches!(judging.known, Known::Reset(_)) {
            // What the reset lacks, by set: the confirmed IPs it did not list.
            for (set, confirmed) in b.sets.confirmed.iter().enumerate() {
                let listed = judging.listed.get(set).copied().unwrap_or(0);
                let gone = confirmed.saturating_sub(listed);
                if gone > 0 {
                    self.judge_gone(&mut judging, set as u32, gone);
                }
            }
        }
        let mut blast = Blast {
            allowed_ips: b.counts.allowed_ips,
            ..judging.blast
        };
        let c = &self.config;
        let mut wiped: Vec<ServiceKey> = judging
            .lost_by_service
            .iter()
            .filter(|(id, lost)| {
                let members = b.members(**id);
                members >= c.min_service_ips && **lost >= members
            })
            .map(|(id, _)| self.name(*id))
            .collect();
        wiped.sort();
        blast.tripped = if blast.allowed_ips >= c.min_ips
            && blast.lost_ips * 100 > u64::from(c.max_loss_percent) * blast.allowed_ips
        {
            Some(Rule::Ratio)
        } else {
            wiped.into_iter().next().map(Rule::Service)
        };
        blast
    }

    fn confirm_at(&self, now_ms: u64) -> u64 {
        now_ms.saturating_add(self.config.confirm_ms).max(1)
    }

    /// Remembers the names of the services `answer` lists.
    fn learn_names(&mut self, answer: Answer<'_>) {
        match answer {
            Answer::Reset(snapshot) => self.learn(&snapshot.services),
            Answer::Delta(delta) => self.learn(&delta.services_added),
        }
    }

    /// Remembers the names of `services`, for what the guard reports.
    pub fn learn(&mut self, services: &[ServiceKey]) {
        for service in services {
            self.names
                .entry(service_id(service))
                .or_insert_with(|| service.clone());
        }
    }

    /// The name of the service with id `id`, as far as the guard knows it.
    fn name(&self, id: u64) -> ServiceKey {
        self.names
            .get(&id)
            .cloned()
            .unwrap_or_else(|| placeholder(id))
    }
}

// === impl Judging ===

impl Judging {
    fn of(answer: Answer<'_>) -> Self {
        match answer {
            Answer::Reset(snapshot) => Self::reset(&snapshot.services),
            Answer::Delta(delta) => Self {
                known: Known::Delta {
                    added: delta.services_added.iter().map(service_id).collect(),
                    removed: delta.services_removed.iter().map(service_id).collect(),
                },
                lost_by_service: HashMap::new(),
                listed: Vec::new(),
                blast: Blast::default(),
            },
        }
    }

    /// Judging a reset that lists `services`.
    fn reset(services: &[ServiceKey]) -> Self {
        Self {
            known: Known::Reset(services.iter().map(service_id).collect()),
            lost_by_service: HashMap::new(),
            listed: Vec::new(),
            blast: Blast::default(),
        }
    }

    /// The reset's services, when they are read after judging began.
    pub fn know(&mut self, services: &[ServiceKey]) {
        if let Known::Reset(known) = &mut self.known {
            *known = services.iter().map(service_id).collect();
        }
    }
}

/// How many of `ips` are IPv4 and IPv6.
pub fn families<'a>(ips: impl Iterator<Item = &'a IpAddr>) -> (usize, usize) {
    ips.fold((0, 0), |(v4, v6), ip| match ip {
        IpAddr::V4(_) => (v4 + 1, v6),
        IpAddr::V6(_) => (v4, v6 + 1),
    })
}

#[cfg(test)]
mod tests;
