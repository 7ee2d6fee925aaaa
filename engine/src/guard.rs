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
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

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

/// IPs to `V`, an IPv4 address keyed by its 4 bytes and an IPv6 one by its
/// 16: an `IpAddr` key takes 17 bytes and 24 with the facts' alignment, and
/// the baseline holds one entry per IP of the index (most of them IPv4).
#[derive(Debug, Clone)]
struct IpTable<V> {
    v4: HashMap<u32, V>,
    v6: HashMap<u128, V>,
}

impl<V> Default for IpTable<V> {
    fn default() -> Self {
        Self {
            v4: HashMap::new(),
            v6: HashMap::new(),
        }
    }
}

impl<V> IpTable<V> {
    fn len(&self) -> usize {
        self.v4.len() + self.v6.len()
    }

    fn get(&self, ip: &IpAddr) -> Option<&V> {
        match ip {
            IpAddr::V4(v4) => self.v4.get(&u32::from(*v4)),
            IpAddr::V6(v6) => self.v6.get(&u128::from(*v6)),
        }
    }

    fn get_mut(&mut self, ip: &IpAddr) -> Option<&mut V> {
        match ip {
            IpAddr::V4(v4) => self.v4.get_mut(&u32::from(*v4)),
            IpAddr::V6(v6) => self.v6.get_mut(&u128::from(*v6)),
        }
    }

    fn insert(&mut self, ip: IpAddr, value: V) -> Option<V> {
        match ip {
            IpAddr::V4(v4) => self.v4.insert(u32::from(v4), value),
            IpAddr::V6(v6) => self.v6.insert(u128::from(v6), value),
        }
    }

    fn remove(&mut self, ip: &IpAddr) -> Option<V> {
        match ip {
            IpAddr::V4(v4) => self.v4.remove(&u32::from(*v4)),
            IpAddr::V6(v6) => self.v6.remove(&u128::from(*v6)),
        }
    }

    /// Room for `ips` more of their families, at once rather than by
    /// doubling as the table fills.
    fn reserve<'a>(&mut self, ips: impl Iterator<Item = &'a IpAddr>) {
        let (mut v4, mut v6) = (0usize, 0usize);
        for ip in ips {
            match ip {
                IpAddr::V4(_) => v4 += 1,
                IpAddr::V6(_) => v6 += 1,
            }
        }
        self.v4.reserve(v4.saturating_sub(self.v4.len()));
        self.v6.reserve(v6.saturating_sub(self.v6.len()));
    }

    fn iter(&self) -> impl Iterator<Item = (IpAddr, &V)> {
        let v4 = self
            .v4
            .iter()
            .map(|(ip, v)| (IpAddr::from(Ipv4Addr::from(*ip)), v));
        let v6 = self
            .v6
            .iter()
            .map(|(ip, v)| (IpAddr::from(Ipv6Addr::from(*ip)), v));
        v4.chain(v6)
    }

    fn retain(&mut self, mut keep: impl FnMut(&mut V) -> bool) {
        self.v4.retain(|_, v| keep(v));
        self.v6.retain(|_, v| keep(v));
    }
}

/// What the poller last applied, reduced to what the guard compares.
#[derive(Debug, Default, Clone)]
pub struct Baseline {
    ips: IpTable<IpFacts>,
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
                b.ips.reserve(snapshot.records.iter().map(|r| &r.ip));
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
                ips.retain(|facts| {
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
                    for (ip, old) in b.ips.iter() {
                        if !present.contains(&ip) {
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
mod tests;
