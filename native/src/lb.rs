//! The load-balancing policy's choice among hosts: only hosts the index does
//! not judge stale. Its hooks are in [`crate::abi::lb`]; `docs/native.md`
//! says when to use it.
//!
//! The choice is round robin over the healthy hosts Envoy offers, skipping
//! every host whose verdict rejects it: a worker's cursor moves past the host
//! it picked, so the good hosts take turns however the stale ones sit between
//! them. Priorities are tried in order, and the first with a good host is
//! used. When every healthy host is judged stale the policy picks none and
//! Envoy answers the request with its no-healthy-upstream 503: a 503 is a
//! better answer than one from a recycled IP. When the index cannot be
//! trusted (never synced, or older than `max_staleness_ms`), the filter's
//! failure policy decides: open (the default) judges every host good, closed
//! judges every host stale.
//!
//! A worker reuses a host's standing for [`REUSE`] (250 ms) before it asks
//! the index again ([`Recent`]): a pick then costs a clock read, a counter
//! read and a map lookup instead of a verdict. Every write of the index
//! forgets the reused standings, so a change reaches every worker's next
//! pick; the window only bounds how late the passing of time (an index
//! growing older than `max_staleness_ms`) is noticed.
//!
//! What it gives up against Envoy's own balancers: host and locality weights,
//! slow start, least-request's view of each host's load, priority spill-over
//! by health (the first priority with a good host takes all requests) and
//! panic mode (a priority without healthy hosts is never used). The pick
//! costs one verdict per host it looks at: one on a cluster with no stale
//! host, about `hosts / good hosts` when most are stale.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use staleguard_engine::judgement::{Effect, Ruling};

use crate::index::Judgement;

/// The healthy hosts Envoy offers a pick among, by priority (Envoy's
/// priority set, through [`crate::abi::lb`]; a list in the tests).
pub trait Hosts {
    /// How many priorities the cluster has.
    fn priorities(&self) -> u32;
    /// How many healthy hosts `priority` has.
    fn healthy(&self, priority: u32) -> usize;
    /// The address (`ip:port`) of healthy host `index` of `priority`.
    fn address(&self, priority: u32, index: usize) -> Option<&str>;
}

/// What the policy makes of one host, from the index's judgement of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Standing {
    /// The verdict allows the host, or the index has nothing to say about it
    /// (an unmapped cluster, an address out of scope).
    Good,
    /// The index cannot be trusted and the failure policy (open) lets the
    /// host through unjudged.
    Unchecked,
    /// The verdict rejects the host, but audit mode only counts it.
    Audited,
    /// The verdict rejects the host: it is never picked.
    Stale,
}

impl Standing {
    /// The standing of a host the index judged so.
    pub fn of(judgement: &Judgement) -> Self {
        match &judgement.outcome {
            Ruling::Judged { effect, .. } => match effect {
                Effect::Reject { .. } => Standing::Stale,
                Effect::Audit => Standing::Audited,
                Effect::Allow if !judgement.fresh() => Standing::Unchecked,
                Effect::Allow => Standing::Good,
            },
            Ruling::Unmapped | Ruling::NoAddress | Ruling::OutOfScope => Standing::Good,
        }
    }

    fn pickable(self) -> bool {
        self != Standing::Stale
    }
}

/// How long a worker reuses a host's standing.
pub const REUSE: Duration = Duration::from_millis(250);

/// A worker's recent standings, by host address (see [`REUSE`]). Cleared
/// when the cluster's membership changes, so it holds at most its hosts, and
/// when the index was written since they were judged.
#[derive(Debug, Default)]
pub struct Recent {
    /// foldhash, not SipHash: a third of a pick's instructions went to
    /// hashing the address; the keys are Envoy's hosts, not clients' input.
    by_address: HashMap<String, (Standing, Instant), foldhash::fast::RandomState>,
    /// The index's write count ([`crate::index::writes`]) the standings
    /// were judged under.
    writes: u64,
}

impl Recent {
    /// The standing of `address`: the one judged less than [`REUSE`] before
    /// `now` under the same index write count `writes`, or `judge`'s.
    pub fn standing(
        &mut self,
        address: &str,
        now: Instant,
        writes: u64,
        judge: impl FnOnce() -> Standing,
    ) -> Standing {
        if writes != self.writes {
            self.by_address.clear();
            self.writes = writes;
        }
        match self.by_address.get_mut(address) {
            Some((standing, at)) if now.saturating_duration_since(*at) < REUSE => *standing,
            Some(entry) => {
                *entry = (judge(), now);
                entry.0
            }
            None => {
                let standing = judge();
                self.by_address.insert(address.to_owned(), (standing, now));
                standing
            }
        }
    }

    /// Forgets every standing.
    pub fn clear(&mut self) {
        self.by_address.clear();
    }
}

/// One pick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Choice {
    /// Healthy host `index` of `priority`.
    Host {
        /// The priority.
        priority: u32,
        /// The index among the priority's healthy hosts.
        index: usize,
        /// The picked host's standing.
        standing: Standing,
        /// Stale hosts looked at and passed over first.
        skipped: u64,
    },
    /// Every healthy host is judged stale: Envoy's no-healthy-upstream answer.
    NoLiveHost {
        /// Stale hosts looked at.
        skipped: u64,
    },
    /// The cluster has no healthy host at all: Envoy's own answer, as without
    /// the policy.
    NoHealthyHost,
}

/// A worker's round robin among the good hosts of one cluster.
#[derive(Debug, Default)]
pub struct Picker {
    /// Where the next pick starts looking, per priority.
    next: Vec<usize>,
}

impl Picker {
    /// Picks a host of `hosts`, asking `standing` about each host it looks
    /// at: the first good host from the cursor on, in the first priority that
    /// has one.
    pub fn choose(
        &mut self,
        hosts: &impl Hosts,
        mut standing: impl FnMut(&str) -> Standing,
    ) -> Choice {
        let mut skipped = 0u64;
        let mut any_healthy = false;
        for priority in 0..hosts.priorities() {
            let count = hosts.healthy(priority);
            if count == 0 {
                continue;
            }
            any_healthy = true;
            let slot = usize::try_from(priority).unwrap_or(usize::MAX);
            if self.next.len() <= slot {
                self.next.resize(slot.saturating_add(1), 0);
            }
            let start = self.next.get(slot).copied().unwrap_or(0) % count;
            for step in 0..count {
                let index = (start + step) % count;
                let Some(address) = hosts.address(priority, index) else {
                    continue;
                };
                let s = standing(address);
                if s.pickable() {
                    if let Some(next) = self.next.get_mut(slot) {
                        *next = index.wrapping_add(1);
                    }
                    return Choice::Host {
                        priority,
                        index,
                        standing: s,
                        skipped,
                    };
                }
                skipped += 1;
            }
        }
        if any_healthy {
            Choice::NoLiveHost { skipped }
        } else {
            Choice::NoHealthyHost
        }
    }

    /// The pick without the index: plain round robin over the first
    /// priority with healthy hosts (what a hook answers when judging failed).
    pub fn unguarded(&mut self, hosts: &impl Hosts) -> Choice {
        self.choose(hosts, |_| Standing::Good)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Healthy hosts by priority.
    struct List(Vec<Vec<String>>);

    impl List {
        fn one(addresses: &[&str]) -> Self {
            List(vec![addresses.iter().map(|a| a.to_string()).collect()])
        }
    }

    impl Hosts for List {
        fn priorities(&self) -> u32 {
            u32::try_from(self.0.len()).unwrap()
        }
        fn healthy(&self, priority: u32) -> usize {
            self.0[priority as usize].len()
        }
        fn address(&self, priority: u32, index: usize) -> Option<&str> {
            self.0[priority as usize].get(index).map(String::as_str)
        }
    }

    #[test]
    fn a_standing_is_reused_for_250_ms_then_judged_again() {
        let mut recent = Recent::default();
        let t0 = Instant::now();
        let mut asked = 0;
        let mut ask = |standing| {
            asked += 1;
            standing
        };
        assert_eq!(
            recent.standing("10.0.0.1:80", t0, 0, || ask(Standing::Good)),
            Standing::Good
        );
        let soon = t0 + Duration::from_millis(249);
        assert_eq!(
            recent.standing("10.0.0.1:80", soon, 0, || ask(Standing::Stale)),
            Standing::Good
        );
        let later = t0 + REUSE;
        assert_eq!(
            recent.standing("10.0.0.1:80", later, 0, || ask(Standing::Stale)),
            Standing::Stale
        );
        recent.clear();
        assert_eq!(
            recent.standing("10.0.0.1:80", later, 0, || ask(Standing::Good)),
            Standing::Good
        );
        assert_eq!(asked, 3);
    }

    /// Two workers: one judged a host just before the index changed. Its
    /// next pick must see the change, not the standing it still holds.
    #[test]
    fn a_write_of_the_index_forgets_every_reused_standing() {
        let mut recent = Recent::default();
        let t0 = Instant::now();
        assert_eq!(
            recent.standing("10.0.0.1:80", t0, 7, || Standing::Good),
            Standing::Good
        );
        let soon = t0 + Duration::from_millis(1);
        assert_eq!(
            recent.standing("10.0.0.1:80", soon, 7, || Standing::Stale),
            Standing::Good,
            "same write count: reused"
        );
        assert_eq!(
            recent.standing("10.0.0.1:80", soon, 8, || Standing::Stale),
            Standing::Stale,
            "the index was written: judged again"
        );
    }

    fn stale_unless(live: &'static [&'static str]) -> impl FnMut(&str) -> Standing {
        move |a: &str| {
            if live.contains(&a) {
                Standing::Good
            } else {
                Standing::Stale
            }
        }
    }

    fn picks(
        picker: &mut Picker,
        hosts: &List,
        live: &'static [&'static str],
        n: usize,
    ) -> Vec<String> {
        (0..n)
            .map(|_| match picker.choose(hosts, stale_unless(live)) {
                Choice::Host {
                    priority, index, ..
                } => hosts.address(priority, index).unwrap().to_string(),
                other => format!("{other:?}"),
            })
            .collect()
    }

    #[test]
    fn good_hosts_take_turns_however_the_stale_ones_sit_between_them() {
        // 2 live among 25, both at the front: a cursor that only advanced by
        // one would send 24 picks of 25 to the first.
        let mut addresses = vec!["10.0.0.1:80", "10.0.0.2:80"];
        let stale: Vec<String> = (3..=25).map(|i| format!("10.0.0.{i}:80")).collect();
        addresses.extend(stale.iter().map(String::as_str));
        let hosts = List::one(&addresses);
        let got = picks(
            &mut Picker::default(),
            &hosts,
            &["10.0.0.1:80", "10.0.0.2:80"],
            10,
        );
        let first = got.iter().filter(|a| *a == "10.0.0.1:80").count();
        assert_eq!((first, got.len() - first), (5, 5), "{got:?}");
    }

    #[test]
    fn a_stale_host_is_never_picked_and_the_skips_are_counted() {
        let hosts = List::one(&["10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"]);
        let mut picker = Picker::default();
        let mut skipped = 0;
        for _ in 0..30 {
            match picker.choose(&hosts, stale_unless(&["10.0.0.2:80"])) {
                Choice::Host {
                    index, skipped: s, ..
                } => {
                    assert_eq!(index, 1);
                    skipped += s;
                }
                other => panic!("{other:?}"),
            }
        }
        // The first pick passes over the host before the live one, every
        // later pick over the one after it and the one before it.
        assert_eq!(skipped, 1 + 29 * 2);
    }

    #[test]
    fn with_every_healthy_host_stale_it_picks_none() {
        let hosts = List::one(&["10.0.0.1:80", "10.0.0.2:80"]);
        let choice = Picker::default().choose(&hosts, |_| Standing::Stale);
        assert_eq!(choice, Choice::NoLiveHost { skipped: 2 });
    }

    #[test]
    fn a_cluster_without_healthy_hosts_is_left_to_envoy() {
        let hosts = List(vec![vec![]]);
        assert_eq!(
            Picker::default().choose(&hosts, |_| Standing::Good),
            Choice::NoHealthyHost
        );
    }

    #[test]
    fn the_next_priority_serves_when_the_first_has_only_stale_hosts() {
        let hosts = List(vec![
            vec!["10.0.0.1:80".into()],
            vec!["10.0.1.1:80".into(), "10.0.1.2:80".into()],
        ]);
        let got = picks(&mut Picker::default(), &hosts, &["10.0.1.2:80"], 3);
        assert_eq!(got, vec!["10.0.1.2:80"; 3]);
    }

    #[test]
    fn unchecked_and_audited_hosts_are_picked_in_turn() {
        let hosts = List::one(&["10.0.0.1:80", "10.0.0.2:80"]);
        let mut picker = Picker::default();
        for standing in [Standing::Unchecked, Standing::Audited] {
            let got: Vec<_> = (0..4)
                .map(|_| match picker.choose(&hosts, |_| standing) {
                    Choice::Host {
                        index, standing: s, ..
                    } => {
                        assert_eq!(s, standing);
                        index
                    }
                    other => panic!("{other:?}"),
                })
                .collect();
            assert_eq!(got.iter().filter(|i| **i == 0).count(), 2, "{got:?}");
        }
    }

    #[test]
    fn the_unguarded_pick_is_plain_round_robin() {
        let hosts = List::one(&["10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"]);
        let mut picker = Picker::default();
        let got: Vec<_> = (0..6)
            .map(|_| match picker.unguarded(&hosts) {
                Choice::Host { index, .. } => index,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(got, vec![0, 1, 2, 0, 1, 2]);
    }

    /// One pod of `service` (`ns/name`) holding `ip`.
    fn holder(ip: &str, name: &str, service: &str) -> staleguard_core::IpRecord {
        use staleguard_core::{IpRecord, PodHolder, ServiceKey};
        let (ns, svc) = service.split_once('/').unwrap();
        let pod =
            PodHolder::ready_member(ns, name, format!("uid-{name}"), ServiceKey::new(ns, svc));
        IpRecord::held_by(ip.parse().unwrap(), vec![pod])
    }

    #[test]
    fn the_index_decides_which_hosts_are_picked() {
        use staleguard_core::{Freshness, ServiceKey, Snapshot};
        use staleguard_engine::config::Config;
        let cluster = "outbound|80||cart.lbtest.svc.cluster.local";
        let snapshot = Snapshot {
            v: staleguard_core::wire::WIRE_VERSION,
            epoch: 1,
            generation: 1,
            freshness: Freshness {
                fresh: true,
                age_ms: Some(0),
            },
            services: vec![
                ServiceKey::new("lbtest", "cart"),
                ServiceKey::new("lbtest", "other"),
            ],
            records: vec![
                holder("10.99.0.1", "cart-0", "lbtest/cart"),
                holder("10.99.0.2", "other-0", "lbtest/other"),
            ],
        };
        crate::index::load_snapshot(
            &serde_json::to_vec(&snapshot).unwrap(),
            crate::index::now_ms(),
        )
        .unwrap();
        // live, recycled, destroyed
        let hosts = List::one(&["10.99.0.1:80", "10.99.0.2:80", "10.99.0.3:80"]);
        let standing_under = |config: &Config| {
            let mut picker = Picker::default();
            (0..3)
                .map(|_| {
                    picker.choose(&hosts, |a| {
                        let ip = staleguard_engine::judgement::parse_ip(a).unwrap();
                        Standing::of(&crate::index::judge(config, cluster, &ip))
                    })
                })
                .collect::<Vec<_>>()
        };
        let enforce = Config::parse(br#"{"validator_cluster":"sg"}"#).unwrap();
        let skips: Vec<u64> = standing_under(&enforce)
            .into_iter()
            .map(|c| match c {
                Choice::Host {
                    index: 0,
                    standing: Standing::Good,
                    skipped,
                    ..
                } => skipped,
                other => panic!("{other:?}"),
            })
            .collect();
        // The recycled and the destroyed host are passed over on every pick
        // after the first.
        assert_eq!(skips, vec![0, 2, 2]);
        // mode: audit only counts: every host is picked in turn.
        let audit = Config::parse(br#"{"validator_cluster":"sg","mode":"audit"}"#).unwrap();
        let standings: Vec<_> = standing_under(&audit)
            .into_iter()
            .map(|c| match c {
                Choice::Host { standing, .. } => standing,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(
            standings,
            vec![Standing::Good, Standing::Audited, Standing::Audited]
        );
        // An index older than max_staleness_ms: the failure policy decides,
        // open (the default) picks every host unchecked, closed none.
        let old = crate::index::now_ms() - 3_600_000;
        crate::index::load_snapshot(&serde_json::to_vec(&snapshot).unwrap(), old).unwrap();
        assert!(standing_under(&enforce).iter().all(|c| matches!(
            c,
            Choice::Host {
                standing: Standing::Unchecked,
                ..
            }
        )));
        let closed =
            Config::parse(br#"{"validator_cluster":"sg","policy":{"failure_policy":"closed"}}"#)
                .unwrap();
        assert!(standing_under(&closed)
            .iter()
            .all(|c| *c == Choice::NoLiveHost { skipped: 3 }));
    }
}
