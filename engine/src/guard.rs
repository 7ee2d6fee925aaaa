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
//! judge it by). A wrong validator that serves for longer than `confirm_ms`
//! is taken for the truth, like any change that persists that long.

use std::collections::{HashMap, HashSet, VecDeque};
use std::net::IpAddr;

use serde::Deserialize;
use staleguard_core::wire::Delta;
use staleguard_core::{decide, Action, IpRecord, Policy, ServiceKey, Snapshot};

use crate::buckets::{placeholder, service_id, CompactRecord, Holders};

/// The guard's knobs (`guard` in the plugin configuration).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
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

/// One IP as the guard remembers it (32 bytes: the baseline has one per IP
/// of the index).
#[derive(Debug, Clone, PartialEq, Eq)]
struct IpFacts {
    /// The services the IP is allowed for, by [`service_id`].
    allowed: Allowed,
    /// When an allowed IP that was newly allowed counts as allowed; 0 once
    /// it does. Until then losing it is no loss.
    confirm_at_ms: u64,
    /// [`CompactRecord::fingerprint`]: who holds it.
    fingerprint: u32,
    /// The reset that last listed the IP ([`Baseline::mark`]).
    mark: u32,
}

impl IpFacts {
    fn unconfirmed(&self) -> bool {
        self.confirm_at_ms != 0
    }
}

/// Service ids, inline when there is at most one (almost every IP): the
/// baseline is one entry per IP of the index, so an allocation per IP would
/// cost the poller's VM as much again.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Allowed {
    None,
    One(u64),
    Many(Box<[u64]>),
}

impl Allowed {
    fn new(ids: Vec<u64>) -> Self {
        match ids.as_slice() {
            [] => Allowed::None,
            [id] => Allowed::One(*id),
            _ => Allowed::Many(ids.into_boxed_slice()),
        }
    }

    fn is_empty(&self) -> bool {
        matches!(self, Allowed::None)
    }

    fn iter(&self) -> std::slice::Iter<'_, u64> {
        match self {
            Allowed::None => [].iter(),
            Allowed::One(id) => std::slice::from_ref(id).iter(),
            Allowed::Many(ids) => ids.iter(),
        }
    }
}

/// What the poller last applied, reduced to what the guard compares.
#[derive(Debug, Default, Clone)]
pub struct Baseline {
    ips: HashMap<IpAddr, IpFacts>,
    counts: Counts,
    /// When each unconfirmed IP counts, in order (an entry whose IP has
    /// been removed or re-added since is skipped).
    pending: VecDeque<(u64, IpAddr)>,
    /// Counts the resets applied: a reset updates the baseline in place
    /// (never two baselines in the VM at once) and then drops every IP it
    /// did not mark.
    mark: u32,
    /// The services the validator knows, by id.
    known: HashSet<u64>,
    /// False until the poller applied a full snapshot itself (a poller that
    /// took over from a dead one has nothing to compare with).
    armed: bool,
}

/// The baseline's tallies of allowed IPs.
#[derive(Debug, Default, Clone)]
struct Counts {
    /// Confirmed allowed IPs per service id.
    members: HashMap<u64, u64>,
    /// Confirmed IPs allowed for at least one service.
    allowed_ips: u64,
    /// Allowed IPs not confirmed yet.
    unconfirmed_ips: u64,
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

/// An answer about to be applied.
#[derive(Debug, Clone, Copy)]
pub enum Answer<'a> {
    /// A snapshot or reset: the whole index.
    Reset(&'a Snapshot<CompactRecord>),
    /// A delta that continues the applied generation.
    Delta(&'a Delta<CompactRecord>),
}

/// What an answer's record says, for the guard: the line it decodes to, and
/// the record a verdict reads (services as [`placeholder`]s of their ids).
struct Judged {
    holders: Option<Holders>,
    record: Option<IpRecord>,
}

impl Judged {
    fn of(record: Option<&CompactRecord>) -> Self {
        let holders = record.and_then(CompactRecord::holders);
        Self {
            record: record
                .zip(holders.as_ref())
                .map(|(r, h)| h.record_by_ids(r.ip)),
            holders,
        }
    }

    /// True when a pod holds the IP.
    fn has_pods(&self) -> bool {
        self.holders.as_ref().is_some_and(|h| !h.pods.is_empty())
    }

    /// True when the verdict for service `id` on fresh data allows. The
    /// verdict rules themselves, so "allowed" cannot drift from what requests
    /// get.
    fn allows(&self, policy: &Policy, id: u64) -> bool {
        decide(policy, true, &placeholder(id), true, self.record.as_ref()).action == Action::Allow
    }

    /// Every service the record allows the IP for.
    fn allowed(&self, policy: &Policy) -> Vec<u64> {
        let mut ids = self
            .holders
            .as_ref()
            .map(Holders::service_ids)
            .unwrap_or_default();
        ids.retain(|id| self.allows(policy, *id));
        ids
    }
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
        if !self.config.enabled || !self.baseline.armed {
            return true;
        }
        self.baseline.confirm_due(now_ms);
        let blast = self.assess(answer);
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
        let confirm_at = now_ms.saturating_add(self.config.confirm_ms).max(1);
        match answer {
            Answer::Reset(snapshot) => {
                let b = &mut self.baseline;
                let first = !b.armed;
                b.armed = true;
                b.known = snapshot.services.iter().map(service_id).collect();
                b.mark = b.mark.wrapping_add(1);
                if first {
                    b.pending.clear();
                }
                // At once, not by doubling as it fills: the table is the
                // largest thing the guard keeps.
                b.ips
                    .reserve(snapshot.records.len().saturating_sub(b.ips.len()));
                for record in &snapshot.records {
                    let at = match b.remove(&record.ip) {
                        _ if first => 0,
                        Some(before) if !before.allowed.is_empty() => before.confirm_at_ms,
                        _ => confirm_at,
                    };
                    // A standing carried over keeps its place in the queue.
                    if b.insert(&self.policy, record, at) && at == confirm_at {
                        b.pending.push_back((at, record.ip));
                    }
                }
                let Baseline {
                    ips, counts, mark, ..
                } = b;
                ips.retain(|_, facts| {
                    let listed = facts.mark == *mark;
                    if !listed {
                        counts.add(facts, -1);
                    }
                    listed
                });
            }
            Answer::Delta(delta) => {
                let b = &mut self.baseline;
                for s in &delta.services_removed {
                    b.known.remove(&service_id(s));
                }
                b.known.extend(delta.services_added.iter().map(service_id));
                for record in &delta.upserts {
                    let at = match b.remove(&record.ip) {
                        Some(before) if !before.allowed.is_empty() => before.confirm_at_ms,
                        _ => confirm_at,
                    };
                    // A standing carried over keeps its place in the queue.
                    if b.insert(&self.policy, record, at) && at == confirm_at {
                        b.pending.push_back((at, record.ip));
                    }
                }
                for ip in &delta.removed {
                    b.remove(ip);
                }
            }
        }
    }

    /// Forgets the baseline and any hold (the poller lost its lease).
    pub fn reset(&mut self) {
        self.baseline = Baseline::default();
        self.held_since_ms = None;
    }

    /// The records of `answer` that only add: IPs the current data allows for
    /// no service, which the answer allows for one. Writing them while the
    /// answer is held can turn a rejection into an allowance, never the
    /// reverse, so a pod that appeared during a hold is not read as
    /// destroyed.
    pub fn gains<'a>(&self, answer: Answer<'a>) -> Vec<&'a CompactRecord> {
        let records: &'a [CompactRecord] = match answer {
            Answer::Reset(snapshot) => &snapshot.records,
            Answer::Delta(delta) => &delta.upserts,
        };
        records
            .iter()
            .filter(|r| {
                self.baseline
                    .ips
                    .get(&r.ip)
                    .is_none_or(|old| old.allowed.is_empty())
            })
            .filter(|r| !Judged::of(Some(r)).allowed(&self.policy).is_empty())
            .collect()
    }

    /// What `answer` would do to the IPs allowed now.
    pub fn assess(&self, answer: Answer<'_>) -> Blast {
        let b = &self.baseline;
        let mut lost_by_service: HashMap<u64, u64> = HashMap::new();
        let mut blast = Blast {
            allowed_ips: b.counts.allowed_ips,
            ..Blast::default()
        };
        let in_delta = matches!(answer, Answer::Delta(_));
        let mut judge =
            |old: &IpFacts, new: Option<&CompactRecord>, known: &dyn Fn(u64) -> bool| {
                if old.unconfirmed() || old.allowed.is_empty() {
                    // Not trusted as allowed (yet): nothing to lose.
                    return;
                }
                let judged = Judged::of(new);
                let mut lost = false;
                let mut evidenced = false;
                for &id in old.allowed.iter() {
                    // The verdict first: it is cheaper than the set lookup, and
                    // almost always still allows.
                    if judged.allows(&self.policy, id) || !known(id) {
                        continue;
                    }
                    if has_evidence(id, old, new, &judged, in_delta) {
                        evidenced = true;
                    } else {
                        lost = true;
                        *lost_by_service.entry(id).or_default() += 1;
                    }
                }
                if lost {
                    blast.lost_ips += 1;
                } else if evidenced {
                    blast.evidenced_ips += 1;
                }
            };
        match answer {
            Answer::Reset(snapshot) => {
                let known: HashSet<u64> = snapshot.services.iter().map(service_id).collect();
                let known = |id: u64| known.contains(&id);
                let mut seen = 0usize;
                for record in &snapshot.records {
                    if let Some(old) = b.ips.get(&record.ip) {
                        seen += 1;
                        judge(old, Some(record), &known);
                    }
                }
                if seen < b.ips.len() {
                    // Only when the reset lacks some IPs: which ones.
                    let present: HashSet<IpAddr> = snapshot.records.iter().map(|r| r.ip).collect();
                    for (ip, old) in &b.ips {
                        if !present.contains(ip) {
                            judge(old, None, &known);
                        }
                    }
                }
            }
            Answer::Delta(delta) => {
                let added: HashSet<u64> = delta.services_added.iter().map(service_id).collect();
                let removed: HashSet<u64> = delta.services_removed.iter().map(service_id).collect();
                let known = |id: u64| {
                    added.contains(&id) || (b.known.contains(&id) && !removed.contains(&id))
                };
                for record in &delta.upserts {
                    if let Some(old) = b.ips.get(&record.ip) {
                        judge(old, Some(record), &known);
                    }
                }
                for ip in &delta.removed {
                    if let Some(old) = b.ips.get(ip) {
                        judge(old, None, &known);
                    }
                }
            }
        }
        let c = &self.config;
        let mut wiped: Vec<ServiceKey> = lost_by_service
            .iter()
            .filter(|(id, lost)| {
                let members = b.counts.members.get(id).copied().unwrap_or(0);
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

    /// Remembers the names of the services `answer` lists.
    fn learn_names(&mut self, answer: Answer<'_>) {
        let services = match answer {
            Answer::Reset(snapshot) => &snapshot.services,
            Answer::Delta(delta) => &delta.services_added,
        };
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

// === impl Baseline ===

impl Baseline {
    /// Remembers `record`, unconfirmed until `confirm_at_ms` if that is not
    /// 0. True when it is allowed and unconfirmed.
    fn insert(&mut self, policy: &Policy, record: &CompactRecord, confirm_at_ms: u64) -> bool {
        let judged = Judged::of(Some(record));
        let allowed = judged.allowed(policy);
        if allowed.is_empty() && !judged.has_pods() {
            // Destroyed or vacant: nothing to lose, nothing to remember.
            return false;
        }
        let facts = IpFacts {
            confirm_at_ms: if allowed.is_empty() { 0 } else { confirm_at_ms },
            allowed: Allowed::new(allowed),
            fingerprint: record.fingerprint,
            mark: self.mark,
        };
        self.counts.add(&facts, 1);
        let unconfirmed = facts.unconfirmed();
        self.ips.insert(record.ip, facts);
        unconfirmed
    }

    /// Forgets `ip`; returns what was known of it.
    fn remove(&mut self, ip: &IpAddr) -> Option<IpFacts> {
        let old = self.ips.remove(ip)?;
        self.counts.add(&old, -1);
        Some(old)
    }

    /// Confirms the IPs whose time has come at `now_ms`.
    fn confirm_due(&mut self, now_ms: u64) {
        while let Some(&(at, ip)) = self.pending.front() {
            if at > now_ms {
                break;
            }
            self.pending.pop_front();
            let Some(facts) = self.ips.get_mut(&ip) else {
                continue;
            };
            if facts.confirm_at_ms != at {
                // Removed and allowed again since: a later entry counts.
                continue;
            }
            self.counts.add(facts, -1);
            facts.confirm_at_ms = 0;
            self.counts.add(facts, 1);
        }
    }
}

// === impl Counts ===

impl Counts {
    /// Adds (`sign` 1) or takes away (-1) an IP's share.
    fn add(&mut self, facts: &IpFacts, sign: i64) {
        if facts.allowed.is_empty() {
            return;
        }
        if facts.unconfirmed() {
            self.unconfirmed_ips = self.unconfirmed_ips.saturating_add_signed(sign);
            return;
        }
        self.allowed_ips = self.allowed_ips.saturating_add_signed(sign);
        for id in facts.allowed.iter() {
            let n = self.members.entry(*id).or_default();
            *n = n.saturating_add_signed(sign);
        }
    }
}

fn has_evidence(
    id: u64,
    old: &IpFacts,
    new: Option<&CompactRecord>,
    judged: &Judged,
    in_delta: bool,
) -> bool {
    let Some(new) = new else {
        return false;
    };
    if new.tombstone.contains(&id) {
        return true;
    }
    in_delta && judged.has_pods() && new.fingerprint != old.fingerprint
}

#[cfg(test)]
mod tests {
    use super::*;
    use staleguard_core::wire::Tombstone;
    use staleguard_core::{Freshness, PodHolder};

    fn svc(name: &str) -> ServiceKey {
        ServiceKey::new("shop", name)
    }

    fn ip(n: u32) -> IpAddr {
        let [_, b, c, d] = n.to_be_bytes();
        IpAddr::from([10, b, c, d])
    }

    fn held_by(n: u32, pod: &str, service: &str) -> IpRecord {
        IpRecord::held_by(
            ip(n),
            vec![PodHolder::ready_member(
                "shop",
                pod,
                String::new(),
                svc(service),
            )],
        )
    }

    fn member(n: u32, service: &str) -> IpRecord {
        held_by(n, &format!("{service}-{n}"), service)
    }

    fn tombstone(n: u32, service: &str) -> IpRecord {
        IpRecord {
            ip: ip(n),
            pods: vec![],
            bare_services: vec![],
            tombstone: Some(Tombstone {
                pod: format!("shop/{service}-{n}"),
                uid: String::new(),
                services: vec![svc(service)],
                since_ms: 1,
            }),
        }
    }

    fn snapshot(services: &[&str], records: Vec<IpRecord>) -> Snapshot<CompactRecord> {
        let records = records.iter().map(CompactRecord::of).collect();
        Snapshot {
            v: 1,
            epoch: 1,
            generation: 1,
            freshness: Freshness {
                fresh: true,
                age_ms: None,
            },
            services: services.iter().map(|s| svc(s)).collect(),
            records,
        }
    }

    fn delta(upserts: Vec<IpRecord>, removed: Vec<IpAddr>) -> Delta<CompactRecord> {
        let upserts = upserts.iter().map(CompactRecord::of).collect();
        Delta {
            v: 1,
            epoch: 1,
            since: 1,
            generation: 2,
            freshness: Freshness {
                fresh: true,
                age_ms: None,
            },
            services_added: vec![],
            services_removed: vec![],
            upserts,
            removed,
        }
    }

    /// A guard whose baseline is `api` with `n` IPs and `web` with 4.
    fn armed(n: u32) -> Guard {
        let mut g = Guard::new(GuardConfig::default(), Policy::default());
        let mut records: Vec<IpRecord> = (0..n).map(|i| member(i, "api")).collect();
        records.extend((1000..1004).map(|i| member(i, "web")));
        g.applied(0, Answer::Reset(&snapshot(&["api", "web"], records)));
        g
    }

    #[test]
    fn an_empty_fresh_reset_is_held() {
        let mut g = armed(20);
        let empty = snapshot(&["api", "web"], vec![]);
        let blast = g.assess(Answer::Reset(&empty));
        assert_eq!((blast.allowed_ips, blast.lost_ips), (24, 24));
        assert_eq!(blast.tripped, Some(Rule::Ratio));
        assert!(!g.admit(5, Answer::Reset(&empty)));
        assert!(g.holding());
        assert!(matches!(g.take_event(), Some(GuardEvent::Held(_))));
        assert_eq!(g.take_event(), None, "an event is reported once");
    }

    #[test]
    fn a_reset_dropping_most_ips_is_held_and_a_small_drop_is_not() {
        let g = armed(20);
        let keep = |n: u32| {
            let mut r: Vec<IpRecord> = (0..n).map(|i| member(i, "api")).collect();
            r.extend((1000..1004).map(|i| member(i, "web")));
            snapshot(&["api", "web"], r)
        };
        // 18 of 24 gone: 75%.
        assert_eq!(g.assess(Answer::Reset(&keep(2))).tripped, Some(Rule::Ratio));
        // 8 of 24 gone: a third, and api keeps 12.
        let small = keep(12);
        let blast = g.assess(Answer::Reset(&small));
        assert_eq!((blast.lost_ips, blast.tripped), (8, None));
    }

    #[test]
    fn a_reset_moving_every_ip_of_a_service_to_other_owners_is_held() {
        let g = armed(20);
        let mut records: Vec<IpRecord> = (0..20).map(|i| member(i, "api")).collect();
        // web's 4 IPs now belong to api pods: recycled for web.
        records.extend((1000..1004).map(|i| member(i, "api")));
        let moved = snapshot(&["api", "web"], records);
        let blast = g.assess(Answer::Reset(&moved));
        assert_eq!(blast.lost_ips, 4);
        assert_eq!(blast.tripped, Some(Rule::Service(svc("web"))));
    }

    #[test]
    fn tombstones_let_any_number_of_deletions_through() {
        // The incident: 250 -> 20, each deletion with its tombstone, in one
        // delta or a reset.
        let mut g = armed(250);
        let gone: Vec<IpRecord> = (20..250).map(|i| tombstone(i, "api")).collect();
        let d = delta(gone.clone(), vec![]);
        let blast = g.assess(Answer::Delta(&d));
        assert_eq!((blast.lost_ips, blast.evidenced_ips), (0, 230));
        assert_eq!(blast.tripped, None);
        assert!(g.admit(1, Answer::Delta(&d)));
        assert_eq!(g.take_event(), None);
        let mut records: Vec<IpRecord> = (0..20).map(|i| member(i, "api")).collect();
        records.extend(gone);
        records.extend((1000..1004).map(|i| tombstone(i, "web")));
        let g = armed(250);
        assert_eq!(
            g.assess(Answer::Reset(&snapshot(&["api", "web"], records)))
                .tripped,
            None
        );
    }

    #[test]
    fn a_new_holder_in_a_delta_is_evidence_but_not_in_a_reset() {
        let g = armed(4);
        // Every web IP taken over by api pods, as watch events saw it.
        let taken: Vec<IpRecord> = (1000..1004).map(|i| member(i, "api")).collect();
        let blast = g.assess(Answer::Delta(&delta(taken.clone(), vec![])));
        assert_eq!((blast.lost_ips, blast.evidenced_ips), (0, 4));
        assert_eq!(blast.tripped, None);
        let mut all: Vec<IpRecord> = (0..4).map(|i| member(i, "api")).collect();
        all.extend(taken);
        assert!(g
            .assess(Answer::Reset(&snapshot(&["api", "web"], all)))
            .tripped
            .is_some());
        // The same pods dropped from a service (a selector switch) in a
        // delta: no new holder, no evidence.
        let dropped: Vec<IpRecord> = (1000..1004)
            .map(|i| held_by(i, &format!("web-{i}"), "other"))
            .collect();
        assert_eq!(
            g.assess(Answer::Delta(&delta(dropped, vec![]))).tripped,
            Some(Rule::Service(svc("web")))
        );
    }

    #[test]
    fn services_that_go_away_are_not_losses() {
        let g = armed(20);
        let records: Vec<IpRecord> = (0..20).map(|i| member(i, "api")).collect();
        let blast = g.assess(Answer::Reset(&snapshot(&["api"], records)));
        assert_eq!((blast.lost_ips, blast.tripped), (0, None));
        let mut d = delta(vec![], (1000..1004).map(ip).collect());
        d.services_removed = vec![svc("web")];
        assert_eq!(g.assess(Answer::Delta(&d)).tripped, None);
    }

    #[test]
    fn removals_in_a_delta_count_as_losses() {
        let g = armed(20);
        let d = delta(vec![], (0..15).map(ip).collect());
        let blast = g.assess(Answer::Delta(&d));
        assert_eq!((blast.lost_ips, blast.tripped), (15, Some(Rule::Ratio)));
        // One lost IP of a 1-IP service is under min_service_ips.
        let mut g = Guard::new(GuardConfig::default(), Policy::default());
        g.applied(
            0,
            Answer::Reset(&snapshot(&["solo"], vec![member(1, "solo")])),
        );
        assert_eq!(
            g.assess(Answer::Delta(&delta(vec![], vec![ip(1)]))).tripped,
            None
        );
    }

    #[test]
    fn a_hold_is_released_by_a_sane_answer_and_confirmed_by_persistence() {
        let mut g = armed(20);
        let empty = snapshot(&["api", "web"], vec![]);
        assert!(!g.admit(1_000, Answer::Reset(&empty)));
        assert!(!g.admit(30_000, Answer::Reset(&empty)), "still held");
        g.take_event();
        let mut sane: Vec<IpRecord> = (0..20).map(|i| member(i, "api")).collect();
        sane.extend((1000..1004).map(|i| member(i, "web")));
        let sane = snapshot(&["api", "web"], sane);
        assert!(g.admit(31_000, Answer::Reset(&sane)));
        assert_eq!(g.take_event(), Some(GuardEvent::Released));
        assert!(!g.holding());
        g.applied(0, Answer::Reset(&sane));

        assert!(!g.admit(40_000, Answer::Reset(&empty)));
        assert!(!g.admit(99_999, Answer::Reset(&empty)));
        assert!(g.admit(100_000, Answer::Reset(&empty)), "confirmed");
        assert!(matches!(g.take_event(), Some(GuardEvent::Confirmed(_))));
        g.applied(0, Answer::Reset(&empty));
        // Nothing is allowed now: nothing left to lose.
        assert!(g.admit(100_001, Answer::Reset(&empty)));
    }

    #[test]
    fn deltas_keep_the_baseline_in_step() {
        let mut g = armed(20);
        // Twelve api IPs change hands one delta at a time: each is evidenced.
        for i in 0..12 {
            let d = delta(vec![held_by(i, "batch", "batch")], vec![]);
            assert!(g.admit(1, Answer::Delta(&d)));
            g.applied(0, Answer::Delta(&d));
        }
        assert_eq!(g.baseline.counts.members[&service_id(&svc("api"))], 8);
        // Now the remaining eight vanish without evidence: every IP of api.
        let d = delta(vec![], (12..20).map(ip).collect());
        assert_eq!(
            g.assess(Answer::Delta(&d)).tripped,
            Some(Rule::Service(svc("api")))
        );
    }

    #[test]
    fn unarmed_or_disabled_guards_admit_everything() {
        let mut fresh = Guard::new(GuardConfig::default(), Policy::default());
        let empty = snapshot(&["api"], vec![]);
        assert!(fresh.admit(0, Answer::Reset(&empty)));
        let mut off = armed(20);
        off.config.enabled = false;
        assert!(off.admit(0, Answer::Reset(&empty)));
        let mut lost = armed(20);
        lost.reset();
        assert!(lost.admit(0, Answer::Reset(&empty)));
    }

    #[test]
    fn terminating_members_count_as_allowed_only_when_the_policy_allows_them() {
        let mut r = member(1, "api");
        r.pods[0].terminating = true;
        let mut strict = Guard::new(
            GuardConfig::default(),
            Policy {
                terminating: Action::Reject,
                ..Policy::default()
            },
        );
        strict.applied(0, Answer::Reset(&snapshot(&["api"], vec![r.clone()])));
        assert_eq!(
            strict
                .assess(Answer::Reset(&snapshot(&["api"], vec![])))
                .allowed_ips,
            0
        );
        let mut open = Guard::new(GuardConfig::default(), Policy::default());
        open.applied(0, Answer::Reset(&snapshot(&["api"], vec![r])));
        assert_eq!(
            open.assess(Answer::Reset(&snapshot(&["api"], vec![])))
                .allowed_ips,
            1
        );
    }

    #[test]
    fn only_ips_nothing_allowed_before_are_gains() {
        let g = armed(20);
        let mut records: Vec<IpRecord> = vec![member(500, "api"), tombstone(501, "api")];
        // web's IPs taken by api pods: not gains, web allowed them.
        records.extend((1000..1004).map(|i| member(i, "api")));
        let s = snapshot(&["api", "web"], records);
        let gains: Vec<IpAddr> = g.gains(Answer::Reset(&s)).iter().map(|r| r.ip).collect();
        assert_eq!(gains, vec![ip(500)]);
    }

    #[test]
    fn config_values_are_checked() {
        assert!(GuardConfig::default().problems().is_empty());
        let bad = GuardConfig {
            max_loss_percent: 0,
            min_service_ips: 0,
            confirm_ms: 4_000_000,
            ..GuardConfig::default()
        };
        assert_eq!(bad.problems().len(), 3);
    }

    /// A baseline of one live `api` pod (IP 1): the situation of issue 23.
    fn one_live_pod() -> Guard {
        let mut g = Guard::new(GuardConfig::default(), Policy::default());
        g.applied(
            0,
            Answer::Reset(&snapshot(&["api"], vec![member(1, "api")])),
        );
        g
    }

    /// `n` members of api from IP 10,000 on, without IP 1.
    fn huge(n: u32) -> Snapshot<CompactRecord> {
        snapshot(
            &["api"],
            (10_000..10_000 + n).map(|i| member(i, "api")).collect(),
        )
    }

    #[test]
    fn newly_allowed_ips_are_no_loss_until_confirm_ms_has_passed() {
        let mut g = one_live_pod();
        let big = huge(150_000);
        let blast = g.assess(Answer::Reset(&big));
        assert_eq!((blast.allowed_ips, blast.lost_ips), (1, 1));
        assert_eq!(blast.tripped, None, "one pod is under every loss threshold");
        assert!(g.admit(1_000, Answer::Reset(&big)));
        g.applied(1_000, Answer::Reset(&big));
        assert_eq!(
            (g.baseline.counts.allowed_ips, g.unconfirmed_ips()),
            (0, 150_000)
        );
        // Losing all of them again is no loss: the live pod comes back.
        let truth = snapshot(&["api"], vec![member(1, "api")]);
        let blast = g.assess(Answer::Reset(&truth));
        assert_eq!(
            (blast.allowed_ips, blast.lost_ips, blast.tripped),
            (0, 0, None)
        );
        // Once they have persisted confirm_ms (60 s) they are the reference,
        // and losing them is held like any loss.
        assert!(!g.admit(61_000, Answer::Reset(&truth)));
        assert_eq!(
            (g.baseline.counts.allowed_ips, g.unconfirmed_ips()),
            (150_000, 0)
        );
        assert!(matches!(g.take_event(), Some(GuardEvent::Held(b)) if b.lost_ips == 150_000));
    }

    #[test]
    fn an_ip_keeps_its_standing_while_it_stays_allowed() {
        let mut g = armed(20);
        // A new pod, then its IP changes hands within the same service.
        let d = delta(vec![member(500, "api")], vec![]);
        g.applied(1_000, Answer::Delta(&d));
        assert_eq!(g.unconfirmed_ips(), 1);
        let d = delta(vec![held_by(500, "api-other", "api")], vec![]);
        g.applied(30_000, Answer::Delta(&d));
        g.baseline.confirm_due(60_999);
        assert_eq!(
            g.unconfirmed_ips(),
            1,
            "not yet: still the first pod's clock"
        );
        g.baseline.confirm_due(61_000);
        assert_eq!(
            (g.unconfirmed_ips(), g.baseline.counts.allowed_ips),
            (0, 25)
        );
        // Removed and allowed again: a new clock, the old entry skipped.
        let gone = delta(vec![], vec![ip(500)]);
        g.applied(70_000, Answer::Delta(&gone));
        let back = delta(vec![member(500, "api")], vec![]);
        g.applied(80_000, Answer::Delta(&back));
        g.baseline.confirm_due(130_000);
        assert_eq!(g.unconfirmed_ips(), 1);
        g.baseline.confirm_due(140_000);
        assert_eq!(g.unconfirmed_ips(), 0);
        // A reset carries the standing over: the baseline's IPs stay
        // confirmed, a new one starts its clock.
        let mut records: Vec<IpRecord> = (0..20).map(|i| member(i, "api")).collect();
        records.push(member(600, "api"));
        g.applied(150_000, Answer::Reset(&snapshot(&["api", "web"], records)));
        assert_eq!(
            (g.baseline.counts.allowed_ips, g.unconfirmed_ips()),
            (20, 1)
        );
    }

    #[test]
    fn the_sequence_of_a_wrong_validator_then_the_correct_one_is_applied_at_once() {
        // Issue 23: a valid 150,000-IP reset without the live pod, resets
        // naming one or two other IPs, then the truth.
        let mut g = one_live_pod();
        let mut now = 0;
        let mut feed = |g: &mut Guard, s: &Snapshot<CompactRecord>| {
            now += 500;
            let admitted = g.admit(now, Answer::Reset(s));
            if admitted {
                g.applied(now, Answer::Reset(s));
            }
            admitted
        };
        assert!(feed(&mut g, &huge(150_000)));
        for _ in 0..10 {
            assert!(feed(
                &mut g,
                &snapshot(&["api"], vec![member(10_000, "api")])
            ));
            assert!(feed(
                &mut g,
                &snapshot(&["api"], vec![member(10_001, "api"), member(10_002, "api")])
            ));
        }
        let truth = snapshot(&["api"], vec![member(1, "api"), tombstone(2, "api")]);
        assert!(feed(&mut g, &truth), "the truth is not held");
        assert!(!g.holding());
        assert_eq!(g.baseline.counts.allowed_ips + g.unconfirmed_ips(), 1);
    }
}
