use super::baseline::IpTable;
use super::*;
use staleguard_core::wire::Tombstone;
use staleguard_core::{Action, Freshness, IpRecord, PodHolder};

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
fn the_ip_table_keeps_both_families_apart_and_whole() {
    let mut t: IpTable<u32> = IpTable::default();
    let ips: Vec<IpAddr> = ["10.0.0.1", "0.0.0.10", "fd00::1", "::a", "255.255.255.255"]
        .iter()
        .map(|ip| ip.parse().unwrap())
        .collect();
    let (v4, v6) = families(ips.iter());
    t.reserve(v4, v6);
    for (n, ip) in ips.iter().enumerate() {
        assert_eq!(t.insert(*ip, n as u32), None);
    }
    assert_eq!(t.len(), 5);
    assert_eq!((t.v4.len(), t.v6.len()), (3, 2));
    // `::a` is not `0.0.0.10`: each family has its own keys.
    assert_eq!(t.get(&ips[1]), Some(&1));
    assert_eq!(t.get(&ips[3]), Some(&3));
    *t.get_mut(&ips[2]).unwrap() = 20;
    let mut listed: Vec<(IpAddr, u32)> = t.iter().map(|(ip, n)| (ip, *n)).collect();
    listed.sort();
    let mut want: Vec<(IpAddr, u32)> = ips.iter().copied().zip([0, 1, 20, 3, 4]).collect();
    want.sort();
    assert_eq!(listed, want);
    assert_eq!(t.remove(&ips[0]), Some(0));
    assert_eq!(t.remove(&ips[0]), None);
    t.retain(|n| *n % 2 == 0);
    assert_eq!(t.len(), 2, "20 and 4 stay");
    assert_eq!(t.get(&ips[4]), Some(&4));
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
    assert_eq!(g.baseline.members(service_id(&svc("api"))), 8);
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
