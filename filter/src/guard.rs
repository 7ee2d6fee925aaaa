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
//! A held answer is not written: the previous data keeps serving (and ages
//! like any data, so it turns stale after `max_staleness_ms` and the failure
//! policy decides). The poller asks again with backoff; an answer that no
//! longer trips is applied normally (the hold is *released*), and one that
//! still trips `confirm_ms` after the hold began is applied (*confirmed*): a
//! change that persists that long is taken as real.

use std::collections::hash_map::DefaultHasher;
use std::collections::{HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::net::IpAddr;

use serde::Deserialize;
use staleguard_core::wire::Delta;
use staleguard_core::{decide, Action, IpRecord, Policy, ServiceKey, Snapshot};

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
    /// applied (default 60000).
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
    /// IPs allowed for at least one service before the answer.
    pub allowed_ips: u64,
    /// Of those, IPs the answer would reject for a service it still knows,
    /// without evidence.
    pub lost_ips: u64,
    /// IPs the answer would reject with evidence (tombstone, new holder).
    pub evidenced_ips: u64,
    /// The threshold tripped, if any.
    pub tripped: Option<Rule>,
}

/// What the guard did with the last answer, for the glue to count and log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GuardEvent {
    /// The answer was held; the previous data keeps serving.
    Held(Blast),
    /// A held change persisted for `confirm_ms` and was applied.
    Confirmed(Blast),
    /// An answer that no longer trips ended a hold and was applied.
    Released,
}

/// One IP as the guard remembers it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct IpFacts {
    /// Ids of the services the IP is allowed for.
    allowed: Allowed,
    /// A fingerprint of the pods holding it.
    holders: u64,
}

/// Service ids, inline when there is at most one (almost every IP): the
/// baseline is one entry per IP of the index, so an allocation per IP would
/// cost the poller's VM as much again.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Allowed {
    None,
    One(u32),
    Many(Box<[u32]>),
}

impl Allowed {
    fn new(ids: Vec<u32>) -> Self {
        match ids.as_slice() {
            [] => Allowed::None,
            [id] => Allowed::One(*id),
            _ => Allowed::Many(ids.into_boxed_slice()),
        }
    }

    fn is_empty(&self) -> bool {
        matches!(self, Allowed::None)
    }

    fn iter(&self) -> std::slice::Iter<'_, u32> {
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
    /// Service ids, handed out on first sight (bounded by the services ever
    /// seen, like the shared-data keys).
    ids: HashMap<ServiceKey, u32>,
    /// Services by id.
    names: Vec<ServiceKey>,
    /// Allowed IPs per service id.
    members: Vec<u64>,
    ips: HashMap<IpAddr, IpFacts>,
    /// IPs allowed for at least one service.
    allowed_ips: u64,
    known: HashSet<ServiceKey>,
    /// False until the poller applied a full snapshot itself (a poller that
    /// took over from a dead one has nothing to compare with).
    armed: bool,
}

/// The guard: its knobs, the baseline, and the hold in progress.
#[derive(Debug, Clone)]
pub struct Guard {
    config: GuardConfig,
    policy: Policy,
    baseline: Baseline,
    held_since_ms: Option<u64>,
    event: Option<GuardEvent>,
}

/// An answer about to be applied.
#[derive(Debug, Clone, Copy)]
pub enum Answer<'a> {
    /// A snapshot or reset: the whole index.
    Reset(&'a Snapshot),
    /// A delta that continues the applied generation.
    Delta(&'a Delta),
}

// === impl Guard ===

impl Guard {
    /// A guard judging "allowed" under `policy`.
    pub fn new(config: GuardConfig, policy: Policy) -> Self {
        Self {
            config,
            policy,
            baseline: Baseline::default(),
            held_since_ms: None,
            event: None,
        }
    }

    /// True while an answer is held.
    pub fn holding(&self) -> bool {
        self.held_since_ms.is_some()
    }

    /// What happened with the last answer, once.
    pub fn take_event(&mut self) -> Option<GuardEvent> {
        self.event.take()
    }

    /// Decides whether `answer` may be applied at `now_ms`. `false`: hold it.
    /// After `true` the caller applies it and reports with
    /// [`Guard::applied`].
    pub fn admit(&mut self, now_ms: u64, answer: Answer<'_>) -> bool {
        if !self.config.enabled || !self.baseline.armed {
            return true;
        }
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

    /// The poller applied `answer`: it is the new baseline.
    pub fn applied(&mut self, answer: Answer<'_>) {
        match answer {
            Answer::Reset(snapshot) => {
                let mut baseline = Baseline {
                    ids: std::mem::take(&mut self.baseline.ids),
                    names: std::mem::take(&mut self.baseline.names),
                    members: Vec::new(),
                    ips: HashMap::with_capacity(snapshot.records.len()),
                    allowed_ips: 0,
                    known: snapshot.services.iter().cloned().collect(),
                    armed: true,
                };
                baseline.members = vec![0; baseline.names.len()];
                for record in &snapshot.records {
                    baseline.insert(&self.policy, record);
                }
                self.baseline = baseline;
            }
            Answer::Delta(delta) => {
                let b = &mut self.baseline;
                for s in &delta.services_removed {
                    b.known.remove(s);
                }
                b.known.extend(delta.services_added.iter().cloned());
                for record in &delta.upserts {
                    b.remove(&record.ip);
                    b.insert(&self.policy, record);
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
    pub fn gains<'a>(&self, answer: Answer<'a>) -> Vec<&'a IpRecord> {
        let records: &'a [IpRecord] = match answer {
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
            .filter(|r| candidates(r).any(|s| allows(&self.policy, s, Some(r))))
            .collect()
    }

    /// What `answer` would do to the IPs allowed now.
    pub fn assess(&self, answer: Answer<'_>) -> Blast {
        let b = &self.baseline;
        let mut lost_by_service: HashMap<u32, u64> = HashMap::new();
        let mut blast = Blast {
            allowed_ips: b.allowed_ips,
            ..Blast::default()
        };
        let in_delta = matches!(answer, Answer::Delta(_));
        let mut judge =
            |old: &IpFacts, new: Option<&IpRecord>, known: &dyn Fn(&ServiceKey) -> bool| {
                let mut lost = false;
                let mut evidenced = false;
                for &id in old.allowed.iter() {
                    let Some(service) = b.service(id) else {
                        continue;
                    };
                    // The verdict first: it is cheaper than the set lookup, and
                    // almost always still allows.
                    if allows(&self.policy, service, new) || !known(service) {
                        continue;
                    }
                    if has_evidence(service, old, new, in_delta) {
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
                let known: HashSet<&ServiceKey> = snapshot.services.iter().collect();
                let known = |s: &ServiceKey| known.contains(s);
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
                let known = |s: &ServiceKey| {
                    delta.services_added.contains(s)
                        || (b.known.contains(s) && !delta.services_removed.contains(s))
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
        let mut wiped: Vec<&ServiceKey> = lost_by_service
            .iter()
            .filter(|(id, lost)| {
                let members = b.members.get(**id as usize).copied().unwrap_or(0);
                members >= c.min_service_ips && **lost >= members
            })
            .filter_map(|(id, _)| b.service(*id))
            .collect();
        wiped.sort();
        blast.tripped = if blast.allowed_ips >= c.min_ips
            && blast.lost_ips * 100 > u64::from(c.max_loss_percent) * blast.allowed_ips
        {
            Some(Rule::Ratio)
        } else {
            wiped.first().map(|s| Rule::Service((*s).clone()))
        };
        blast
    }
}

// === impl Baseline ===

impl Baseline {
    fn service(&self, id: u32) -> Option<&ServiceKey> {
        self.names.get(id as usize)
    }

    fn id(&mut self, service: &ServiceKey) -> u32 {
        if let Some(id) = self.ids.get(service) {
            return *id;
        }
        let id = u32::try_from(self.names.len()).unwrap_or(u32::MAX);
        self.ids.insert(service.clone(), id);
        self.names.push(service.clone());
        self.members.push(0);
        id
    }

    fn insert(&mut self, policy: &Policy, record: &IpRecord) {
        let mut allowed: Vec<u32> = Vec::new();
        for service in candidates(record) {
            if allows(policy, service, Some(record)) {
                let id = self.id(service);
                if !allowed.contains(&id) {
                    allowed.push(id);
                    if let Some(n) = self.members.get_mut(id as usize) {
                        *n += 1;
                    }
                }
            }
        }
        if allowed.is_empty() && record.pods.is_empty() {
            // Destroyed or vacant: nothing to lose, nothing to remember.
            return;
        }
        if !allowed.is_empty() {
            self.allowed_ips += 1;
        }
        self.ips.insert(
            record.ip,
            IpFacts {
                allowed: Allowed::new(allowed),
                holders: holders(record),
            },
        );
    }

    fn remove(&mut self, ip: &IpAddr) {
        if let Some(old) = self.ips.remove(ip) {
            if !old.allowed.is_empty() {
                self.allowed_ips = self.allowed_ips.saturating_sub(1);
            }
            for id in old.allowed.iter() {
                if let Some(n) = self.members.get_mut(*id as usize) {
                    *n = n.saturating_sub(1);
                }
            }
        }
    }
}

/// Every service a record could allow the IP for.
fn candidates(record: &IpRecord) -> impl Iterator<Item = &ServiceKey> {
    record
        .pods
        .iter()
        .flat_map(|p| p.services.iter().map(|m| &m.service))
        .chain(record.bare_services.iter())
}

/// True when the verdict for `service` on fresh data with `record` allows.
/// The verdict rules themselves, so "allowed" cannot drift from what requests
/// get.
fn allows(policy: &Policy, service: &ServiceKey, record: Option<&IpRecord>) -> bool {
    decide(policy, true, service, true, record).action == Action::Allow
}

fn holders(record: &IpRecord) -> u64 {
    // A fixed-key hasher: the fingerprint is compared across answers.
    let mut h = DefaultHasher::new();
    for pod in &record.pods {
        pod.namespace.hash(&mut h);
        pod.name.hash(&mut h);
    }
    h.finish()
}

fn has_evidence(
    service: &ServiceKey,
    old: &IpFacts,
    new: Option<&IpRecord>,
    in_delta: bool,
) -> bool {
    let Some(new) = new else {
        return false;
    };
    if new
        .tombstone
        .as_ref()
        .is_some_and(|t| t.services.contains(service))
    {
        return true;
    }
    in_delta && !new.pods.is_empty() && holders(new) != old.holders
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
        IpAddr::from([10, 0, (n / 256) as u8, (n % 256) as u8])
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

    fn snapshot(services: &[&str], records: Vec<IpRecord>) -> Snapshot {
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

    fn delta(upserts: Vec<IpRecord>, removed: Vec<IpAddr>) -> Delta {
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
        g.applied(Answer::Reset(&snapshot(&["api", "web"], records)));
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
        g.applied(Answer::Reset(&snapshot(&["solo"], vec![member(1, "solo")])));
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
        g.applied(Answer::Reset(&sane));

        assert!(!g.admit(40_000, Answer::Reset(&empty)));
        assert!(!g.admit(99_999, Answer::Reset(&empty)));
        assert!(g.admit(100_000, Answer::Reset(&empty)), "confirmed");
        assert!(matches!(g.take_event(), Some(GuardEvent::Confirmed(_))));
        g.applied(Answer::Reset(&empty));
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
            g.applied(Answer::Delta(&d));
        }
        assert_eq!(g.baseline.members[0], 8);
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
        strict.applied(Answer::Reset(&snapshot(&["api"], vec![r.clone()])));
        assert_eq!(
            strict
                .assess(Answer::Reset(&snapshot(&["api"], vec![])))
                .allowed_ips,
            0
        );
        let mut open = Guard::new(GuardConfig::default(), Policy::default());
        open.applied(Answer::Reset(&snapshot(&["api"], vec![r])));
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
}
