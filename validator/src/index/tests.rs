//! The orderings of the incident, and the rules one by one.

use std::net::IpAddr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kube::runtime::watcher::Event;
use staleguard_core::wire::Via;
use staleguard_core::{decide, Freshness, Policy, Reason, ServiceKey};

use super::fixtures::{pod, service, slice, PodBuilder};
use super::relist::Watched;
use super::*;

fn t(secs: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(1_800_000_000 + secs)
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn key(ns: &str, name: &str) -> ServiceKey {
    ServiceKey::new(ns, name)
}

fn index() -> Index {
    Index::new(7, IndexConfig::default())
}

/// Watch events at `t(secs)`: a test states the object and the moment.
trait Feed {
    fn apply<K: Watched>(&mut self, object: K, secs: u64);
    fn delete<K: Watched>(&mut self, object: K, secs: u64);
    /// A complete list of kind `K`: `Init`, an `InitApply` each, `InitDone`.
    fn relist<K: Watched>(&mut self, objects: impl IntoIterator<Item = K>, secs: u64);
}

impl Feed for Index {
    fn apply<K: Watched>(&mut self, object: K, secs: u64) {
        self.apply_event(Event::Apply(object), t(secs));
    }

    fn delete<K: Watched>(&mut self, object: K, secs: u64) {
        self.apply_event(Event::Delete(object), t(secs));
    }

    fn relist<K: Watched>(&mut self, objects: impl IntoIterator<Item = K>, secs: u64) {
        self.apply_event(Event::<K>::Init, t(secs));
        for object in objects {
            self.apply_event(Event::InitApply(object), t(secs));
        }
        self.apply_event(Event::<K>::InitDone, t(secs));
    }
}

/// Pod `shop/<name>` with the label app=cart (what `shop/cart` selects).
fn cart_pod(name: &str) -> PodBuilder {
    pod("shop", name).labels(&[("app", "cart")])
}

/// Adds Service `shop/<name>`, without a selector, at `t(0)`; returns its key.
fn bare_service(ix: &mut Index, name: &str) -> ServiceKey {
    ix.apply(service("shop", name).build(), 0);
    key("shop", name)
}

/// The verdict the filter would reach for `service` and `addr`.
fn verdict(index: &Index, service: &ServiceKey, addr: &str) -> Reason {
    let record = index.record(ip(addr));
    decide(
        &Policy::default(),
        true,
        service,
        index.knows_service(service),
        record.as_ref(),
    )
    .reason
}

/// `shop/cart` (app=cart) with pod cart-1 on 10.0.0.1, listed by its slice.
fn cart_world() -> Index {
    let mut ix = index();
    ix.apply(
        service("shop", "cart").selector(&[("app", "cart")]).build(),
        0,
    );
    ix.apply(cart_pod("cart-1").ip("10.0.0.1").build(), 0);
    ix.apply(
        slice("shop", "cart-abc", "cart")
            .port("http", 8080)
            .endpoint("10.0.0.1", Some("uid-cart-1"))
            .build(),
        0,
    );
    ix
}

#[test]
fn a_listed_pod_is_a_member_by_slice_and_selector_with_ports_and_conditions() {
    let ix = cart_world();
    let record = ix.record(ip("10.0.0.1")).unwrap();
    assert_eq!(record.pods.len(), 1);
    let holder = &record.pods[0];
    assert_eq!(holder.uid, "uid-cart-1");
    assert!(holder.ready);
    let m = &holder.services[0];
    assert_eq!(m.service, key("shop", "cart"));
    assert_eq!(m.via, Via::Both);
    assert_eq!(m.ports[0].port, 8080);
    assert_eq!(m.ports[0].name.as_deref(), Some("http"));
    assert!(m.conditions.unwrap().ready);
    assert_eq!(
        verdict(&ix, &key("shop", "cart"), "10.0.0.1"),
        Reason::Member
    );
}

#[test]
fn slice_update_before_pod_delete_keeps_a_terminating_member_then_a_dead_ip() {
    let mut ix = cart_world();
    let cart = key("shop", "cart");
    ix.apply(cart_pod("cart-1").ip("10.0.0.1").terminating().build(), 1);
    ix.apply(
        slice("shop", "cart-abc", "cart").port("http", 8080).build(),
        2,
    );
    assert_eq!(verdict(&ix, &cart, "10.0.0.1"), Reason::Terminating);
    ix.delete(pod("shop", "cart-1").build(), 3);
    assert_eq!(verdict(&ix, &cart, "10.0.0.1"), Reason::Destroyed);
    let tomb = ix.record(ip("10.0.0.1")).unwrap().tombstone.unwrap();
    assert_eq!(tomb.pod, "shop/cart-1");
    assert_eq!(tomb.uid, "uid-cart-1");
    assert_eq!(tomb.services, vec![cart]);
    assert_eq!(tomb.since_ms, unix_ms(t(3)));
}

#[test]
fn pod_delete_before_slice_update_ignores_the_stale_entry() {
    let mut ix = cart_world();
    let cart = key("shop", "cart");
    ix.delete(pod("shop", "cart-1").build(), 1);
    // The slice still lists 10.0.0.1 for uid-cart-1, but nobody holds it.
    let record = ix.record(ip("10.0.0.1")).unwrap();
    assert!(record.pods.is_empty());
    assert!(record.bare_services.is_empty());
    assert_eq!(record.tombstone.unwrap().services, vec![cart.clone()]);
    assert_eq!(verdict(&ix, &cart, "10.0.0.1"), Reason::Destroyed);
}

#[test]
fn an_ip_recycled_to_another_services_pod_within_a_second_is_recycled() {
    let mut ix = cart_world();
    let cart = key("shop", "cart");
    let pay = key("bank", "pay");
    ix.apply(
        service("bank", "pay").selector(&[("app", "pay")]).build(),
        0,
    );
    ix.delete(pod("shop", "cart-1").build(), 1);
    let pay_9 = pod("bank", "pay-9").labels(&[("app", "pay")]);
    ix.apply(pay_9.ip("10.0.0.1").build(), 1);
    // cart's slice has not caught up: it still lists the IP with the old uid.
    assert_eq!(verdict(&ix, &cart, "10.0.0.1"), Reason::Recycled);
    assert_eq!(verdict(&ix, &pay, "10.0.0.1"), Reason::Member);
    let record = ix.record(ip("10.0.0.1")).unwrap();
    assert!(record.tombstone.is_none(), "a held IP has no tombstone");
    assert_eq!(record.pods[0].services[0].via, Via::Selector);
}

#[test]
fn two_holders_overlap_and_the_live_one_decides() {
    let mut ix = cart_world();
    let cart = key("shop", "cart");
    ix.apply(
        service("bank", "pay").selector(&[("app", "pay")]).build(),
        0,
    );
    ix.apply(cart_pod("cart-1").ip("10.0.0.1").terminating().build(), 1);
    let pay_9 = pod("bank", "pay-9").labels(&[("app", "pay")]);
    ix.apply(pay_9.ip("10.0.0.1").build(), 1);
    let record = ix.record(ip("10.0.0.1")).unwrap();
    assert_eq!(record.pods.len(), 2);
    assert_eq!(record.pods[0].name, "pay-9", "live holders first");
    // The only cart member is draining and a running pod of another service
    // holds the IP: the node gave it away, the API just has not caught up.
    assert_eq!(verdict(&ix, &cart, "10.0.0.1"), Reason::Recycled);
    assert_eq!(
        verdict(&ix, &key("bank", "pay"), "10.0.0.1"),
        Reason::Member
    );
    ix.delete(pod("shop", "cart-1").build(), 2);
    assert_eq!(verdict(&ix, &cart, "10.0.0.1"), Reason::Recycled);
    assert!(ix.record(ip("10.0.0.1")).unwrap().tombstone.is_none());
}

#[test]
fn succeeded_and_failed_pods_release_their_ip() {
    for phase in ["Succeeded", "Failed"] {
        let mut ix = cart_world();
        ix.apply(cart_pod("cart-1").ip("10.0.0.1").phase(phase).build(), 1);
        let record = ix.record(ip("10.0.0.1")).unwrap();
        assert!(record.pods.is_empty(), "{phase}");
        assert!(record.tombstone.is_some(), "{phase}");
        assert_eq!(ix.stats().pods, 1);
    }
}

#[test]
fn scale_up_is_a_member_by_selector_before_its_slice_arrives() {
    let mut ix = cart_world();
    ix.apply(cart_pod("cart-2").ip("10.0.0.2").not_ready().build(), 1);
    assert_eq!(
        verdict(&ix, &key("shop", "cart"), "10.0.0.2"),
        Reason::Member
    );
    let record = ix.record(ip("10.0.0.2")).unwrap();
    assert_eq!(record.pods[0].services[0].via, Via::Selector);
    assert!(!record.pods[0].ready);
}

#[test]
fn a_selector_change_moves_every_pod_of_the_namespace() {
    let mut ix = cart_world();
    let cart = key("shop", "cart");
    let canary = [("app", "cart"), ("track", "canary")];
    ix.apply(
        pod("shop", "cart-2").labels(&canary).ip("10.0.0.2").build(),
        1,
    );
    let before = ix.generation();
    ix.apply(service("shop", "cart").selector(&canary).build(), 2);
    assert_eq!(ix.generation(), before + 1, "one event, one generation");
    // cart-1 is still listed by the slice, cart-2 now only by the selector.
    assert_eq!(
        ix.record(ip("10.0.0.1")).unwrap().pods[0].services[0].via,
        Via::Slice
    );
    assert_eq!(verdict(&ix, &cart, "10.0.0.2"), Reason::Member);
    ix.delete(service("shop", "cart").build(), 3);
    assert!(!ix.knows_service(&cart));
    assert_eq!(verdict(&ix, &cart, "10.0.0.2"), Reason::UnknownService);
    assert!(ix.record(ip("10.0.0.2")).unwrap().pods[0]
        .services
        .is_empty());
}

#[test]
fn bare_entries_are_members_without_pod_identity() {
    let mut ix = index();
    let ext = bare_service(&mut ix, "legacy");
    let legacy_1 = slice("shop", "legacy-1", "legacy");
    ix.apply(legacy_1.endpoint("192.168.9.9", None).build(), 0);
    let record = ix.record(ip("192.168.9.9")).unwrap();
    assert_eq!(record.bare_services, vec![ext.clone()]);
    assert_eq!(verdict(&ix, &ext, "192.168.9.9"), Reason::Member);
    assert_eq!(
        verdict(&ix, &ext, "192.168.9.10"),
        Reason::Destroyed,
        "an IP nobody lists is not a member"
    );
}

#[test]
fn host_network_pods_share_a_node_ip_and_never_make_it_recycled() {
    let mut ix = cart_world();
    for name in ["node-exporter-a", "kube-proxy-a"] {
        let daemon = pod("kube-system", name).host_network();
        ix.apply(daemon.ip("172.16.0.5").build(), 1);
    }
    let record = ix.record(ip("172.16.0.5")).unwrap();
    assert_eq!(record.pods.len(), 2);
    assert!(record.pods.iter().all(|p| p.host_network));
    assert_eq!(
        verdict(&ix, &key("shop", "cart"), "172.16.0.5"),
        Reason::HostNetwork
    );
    ix.delete(pod("kube-system", "kube-proxy-a").build(), 2);
    let record = ix.record(ip("172.16.0.5")).unwrap();
    assert_eq!(record.pods.len(), 1);
    assert!(record.tombstone.is_none());
}

#[test]
fn dual_stack_pods_are_indexed_under_both_ips() {
    let mut ix = index();
    let web = key("shop", "web");
    ix.apply(
        service("shop", "web").selector(&[("app", "web")]).build(),
        0,
    );
    let web_1 = pod("shop", "web-1").labels(&[("app", "web")]);
    ix.apply(web_1.ips(&["10.0.0.3", "fd00::3"]).build(), 0);
    ix.apply(
        slice("shop", "web-v6", "web")
            .address_type("IPv6")
            .port("http", 80)
            .endpoint("fd00::3", Some("uid-web-1"))
            .build(),
        0,
    );
    assert_eq!(verdict(&ix, &web, "10.0.0.3"), Reason::Member);
    assert_eq!(verdict(&ix, &web, "fd00::3"), Reason::Member);
    let v6 = ix.record(ip("fd00::3")).unwrap();
    assert_eq!(v6.pods[0].services[0].via, Via::Both);
    let v4 = ix.record(ip("10.0.0.3")).unwrap();
    assert_eq!(v4.pods[0].services[0].via, Via::Selector);
    // An IPv4-mapped address is the IPv4 address.
    assert_eq!(ix.record(ip("::ffff:10.0.0.3")), Some(v4));
}

#[test]
fn an_expired_tombstone_never_makes_a_dead_ip_valid() {
    let mut ix = cart_world();
    let cart = key("shop", "cart");
    ix.delete(pod("shop", "cart-1").build(), 10);
    ix.apply(slice("shop", "cart-abc", "cart").build(), 10);
    ix.expire_tombstones(t(10 + 599));
    assert!(ix.record(ip("10.0.0.1")).unwrap().tombstone.is_some());
    let before = ix.generation();
    ix.expire_tombstones(t(10 + 600));
    assert_eq!(ix.record(ip("10.0.0.1")), None);
    assert_eq!(ix.generation(), before + 1);
    assert_eq!(ix.stats().tombstones, 0);
    assert_eq!(verdict(&ix, &cart, "10.0.0.1"), Reason::Destroyed);
    let delta = ix.changes_since(before, Freshness::default()).unwrap();
    assert_eq!(delta.removed, vec![ip("10.0.0.1")]);
}

#[test]
fn a_relist_buffers_then_swaps_and_applies_deletions_missed_while_away() {
    let mut ix = cart_world();
    let cart = key("shop", "cart");
    let cart_2 = || cart_pod("cart-2").ip("10.0.0.2").build();
    ix.apply(cart_2(), 0);
    // Reconnect: cart-1 was deleted while the watch was down.
    ix.apply_pod(Event::Init, t(5));
    ix.apply_pod(Event::InitApply(cart_2()), t(5));
    // Nothing vanishes before the list is complete.
    assert_eq!(verdict(&ix, &cart, "10.0.0.1"), Reason::Member);
    assert_eq!(verdict(&ix, &cart, "10.0.0.2"), Reason::Member);
    let before = ix.generation();
    ix.apply_pod(Event::InitDone, t(6));
    assert_eq!(verdict(&ix, &cart, "10.0.0.1"), Reason::Destroyed);
    assert_eq!(verdict(&ix, &cart, "10.0.0.2"), Reason::Member);
    assert_eq!(ix.generation(), before + 1);
    let delta = ix.changes_since(before, Freshness::default()).unwrap();
    assert_eq!(delta.upserts.len(), 1, "only the dropped pod's IP changed");
    assert_eq!(delta.upserts[0].ip, ip("10.0.0.1"));
}

#[test]
fn a_relist_of_services_and_slices_drops_what_is_gone() {
    let mut ix = cart_world();
    let cart = key("shop", "cart");
    ix.relist::<Service>([], 1);
    assert!(!ix.knows_service(&cart));
    ix.relist::<EndpointSlice>([], 1);
    assert_eq!(ix.stats().slices, 0);
    assert!(ix.record(ip("10.0.0.1")).unwrap().pods[0]
        .services
        .is_empty());
}

#[test]
fn duplicate_and_replayed_events_change_nothing() {
    let mut ix = cart_world();
    let generation = ix.generation();
    let snapshot = ix.snapshot(Freshness::default());
    let cart_1 = || cart_pod("cart-1").ip("10.0.0.1").build();
    ix.apply(cart_1(), 9);
    ix.apply(cart_1(), 9);
    // A full replay as a relist.
    ix.relist([cart_1()], 9);
    ix.apply(
        service("shop", "cart").selector(&[("app", "cart")]).build(),
        9,
    );
    // Deleting what is not there.
    ix.delete(pod("shop", "ghost").build(), 9);
    ix.delete(slice("shop", "ghost", "x").build(), 9);
    assert_eq!(ix.generation(), generation);
    assert_eq!(ix.snapshot(Freshness::default()), snapshot);
    assert!(ix
        .changes_since(generation, Freshness::default())
        .unwrap()
        .is_empty());
}

#[test]
fn readiness_needs_every_kind_listed() {
    let mut ix = index();
    assert!(!ix.synced());
    ix.relist::<Pod>([], 0);
    ix.relist::<Service>([], 0);
    assert!(ix.kind_synced(Kind::Pod));
    assert!(!ix.synced());
    ix.relist::<EndpointSlice>([], 0);
    assert!(ix.synced());
    assert_eq!(ix.generation(), 0, "an empty cluster changes nothing");
}

#[test]
fn malformed_objects_are_skipped_and_counted() {
    let mut ix = cart_world();
    let generation = ix.generation();
    let mut nameless = pod("shop", "x").ip("10.9.9.9").build();
    nameless.metadata.name = None;
    ix.apply(nameless, 1);
    ix.apply(pod("shop", "bad-ip").ip("10.0.0.300").build(), 1);
    let mut no_label = slice("shop", "orphan", "x")
        .endpoint("10.0.0.9", None)
        .build();
    no_label.metadata.labels = None;
    ix.apply(no_label, 1);
    ix.apply(
        slice("shop", "fqdn", "cart")
            .address_type("FQDN")
            .endpoint("example.com", None)
            .build(),
        1,
    );
    ix.apply(
        slice("shop", "mixed", "cart")
            .endpoint("fd00::1", None)
            .endpoint("not-an-ip", None)
            .port("bad", 70000)
            .build(),
        1,
    );
    ix.apply(slice("shop", "empty", "cart").build(), 1);
    let mut nameless = service("shop", "x").build();
    nameless.metadata.namespace = None;
    ix.apply(nameless, 1);
    let skipped = ix.stats().skipped;
    let count = |kind, skip| skipped.get(&(kind, skip)).copied().unwrap_or(0);
    assert_eq!(count(Kind::Pod, Skip::MissingName), 1);
    assert_eq!(count(Kind::Pod, Skip::InvalidIp), 1);
    assert_eq!(count(Kind::EndpointSlice, Skip::NoServiceLabel), 1);
    assert_eq!(count(Kind::EndpointSlice, Skip::UnknownAddressType), 1);
    assert_eq!(count(Kind::EndpointSlice, Skip::InvalidIp), 2);
    assert_eq!(count(Kind::EndpointSlice, Skip::InvalidPort), 1);
    assert_eq!(count(Kind::EndpointSlice, Skip::EmptySlice), 1);
    assert_eq!(count(Kind::Service, Skip::MissingName), 1);
    // The pod with a bad IP is known, just holds nothing; nothing changed.
    assert_eq!(ix.stats().pods, 2);
    assert_eq!(ix.generation(), generation);
}

#[test]
fn a_skipped_object_is_named_with_its_reason_in_a_debug_line() {
    // Whether a call site is enabled is cached process-wide, and tests on
    // other threads set up and drop subscribers of their own meanwhile; under
    // load one attempt's lines can be lost to that cache. Up to three
    // attempts, each with objects of its own names, the cache asked again:
    // the assertion is on the lines of one whole attempt.
    let mut seen = String::new();
    for attempt in 0..3 {
        let path = std::env::temp_dir().join(format!(
            "staleguard-skips-{}-{attempt}.log",
            std::process::id()
        ));
        let log = std::sync::Arc::new(std::fs::File::create(&path).unwrap());
        let subscriber = tracing_subscriber::fmt()
            .with_writer(log)
            .with_ansi(false)
            .with_max_level(tracing::Level::DEBUG)
            .finish();
        let (pod_name, slice_name) = (format!("bad-ip-{attempt}"), format!("mixed-{attempt}"));
        tracing::subscriber::with_default(subscriber, || {
            tracing::callsite::rebuild_interest_cache();
            let mut ix = cart_world();
            ix.apply(pod("shop", &pod_name).ip("10.0.0.300").build(), 1);
            ix.apply(
                slice("shop", &slice_name, "cart")
                    .endpoint("not-an-ip", None)
                    .port("bad", 70000)
                    .build(),
                1,
            );
        });
        let text = std::fs::read_to_string(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        let expected = [
            format!("kind=Pod namespace=\"shop\" name=\"{pod_name}\" reason=\"invalid_ip\" detail=\"10.0.0.300\""),
            format!("kind=EndpointSlice namespace=\"shop\" name=\"{slice_name}\" reason=\"invalid_ip\" detail=\"not-an-ip\""),
            format!("name=\"{slice_name}\" reason=\"invalid_port\" detail=\"70000\""),
        ];
        if expected.iter().all(|line| text.contains(line.as_str())) {
            return;
        }
        seen.push_str(&format!(
            "attempt {attempt}, expecting {expected:?}:\n{text}\n"
        ));
    }
    panic!("no attempt logged every skipped object:\n{seen}");
}

#[test]
fn a_slice_that_turns_malformed_stops_listing_its_old_entries() {
    let mut ix = index();
    let s = || slice("shop", "s", "cart");
    ix.apply(s().endpoint("10.0.0.8", None).build(), 0);
    assert!(ix.record(ip("10.0.0.8")).is_some());
    let fqdn = s().address_type("FQDN");
    ix.apply(fqdn.endpoint("a.example", None).build(), 1);
    assert_eq!(ix.record(ip("10.0.0.8")), None);
}

#[test]
fn changes_since_compacts_and_resets_when_too_far_behind() {
    let mut ix = Index::new(
        1,
        IndexConfig {
            change_log_capacity: 2,
            ..IndexConfig::default()
        },
    );
    for i in 1..=3u8 {
        let p = pod("shop", &format!("p{i}"));
        ix.apply(p.ip(&format!("10.0.1.{i}")).build(), 0);
    }
    assert_eq!(ix.generation(), 3);
    assert!(ix.changes_since(0, Freshness::default()).is_none());
    assert!(ix.changes_since(4, Freshness::default()).is_none());
    let delta = ix.changes_since(1, Freshness::default()).unwrap();
    assert_eq!(delta.since, 1);
    assert_eq!(delta.generation, 3);
    assert_eq!(delta.upserts.len(), 2);
    assert!(ix
        .changes_since(3, Freshness::default())
        .unwrap()
        .is_empty());
    let s = ix.snapshot(Freshness::default());
    assert_eq!((s.epoch, s.generation, s.records.len()), (1, 3, 3));
}

#[test]
fn an_endpoint_with_two_addresses_lists_both_and_a_repeated_one_once() {
    let mut ix = index();
    let cart = bare_service(&mut ix, "cart");
    let on_10_0_0_1 = || slice("shop", "cart-abc", "cart").endpoint("10.0.0.1", None);
    ix.apply(on_10_0_0_1().also("10.0.0.2").also("10.0.0.1").build(), 0);
    assert_eq!(ix.stats().slice_entries, 2);
    for addr in ["10.0.0.1", "10.0.0.2"] {
        assert_eq!(
            ix.record(ip(addr)).unwrap().bare_services,
            vec![cart.clone()]
        );
    }
    // The same slice without the second address: only that IP changes.
    let before = ix.generation();
    ix.apply(on_10_0_0_1().build(), 1);
    assert_eq!(ix.stats().slice_entries, 1);
    assert!(ix.record(ip("10.0.0.2")).is_none());
    let delta = ix.changes_since(before, Freshness::default()).unwrap();
    assert_eq!(delta.removed, vec![ip("10.0.0.2")]);
    assert!(delta.upserts.is_empty());
}

#[test]
fn pods_with_the_same_labels_share_one_label_set() {
    let mut ix = index();
    let labels = [("app", "cart"), ("pod-template-hash", "7d9f8c6b5")];
    let other = [("app", "other")];
    for i in 0..100 {
        let p = pod("shop", &format!("cart-{i}")).labels(&labels);
        ix.apply(p.ip(&format!("10.0.1.{i}")).build(), 0);
    }
    ix.apply(
        pod("shop", "other").labels(&other).ip("10.0.2.1").build(),
        0,
    );
    assert_eq!(ix.stats().pods, 101);
    assert_eq!(ix.interner.label_sets(), 2);
    // A label change is seen: the pod moves to the service selecting it.
    ix.apply(service("shop", "other").selector(&other).build(), 1);
    ix.apply(
        pod("shop", "cart-0").labels(&other).ip("10.0.1.0").build(),
        2,
    );
    assert_eq!(
        verdict(&ix, &key("shop", "other"), "10.0.1.0"),
        Reason::Member
    );
    assert_eq!(
        verdict(&ix, &key("shop", "other"), "10.0.1.1"),
        Reason::Recycled
    );
}

#[test]
fn a_slice_that_outruns_its_pod_makes_the_pod_a_provisional_holder() {
    let mut ix = cart_world();
    let cart = key("shop", "cart");
    let web = bare_service(&mut ix, "web");
    // cart-2 exists (scheduled, no IP yet) when the slice listing it on
    // 10.0.0.2 arrives, before the pod's own update with that IP.
    ix.apply(cart_pod("cart-2").not_ready().build(), 1);
    ix.apply(
        slice("shop", "cart-abc", "cart")
            .port("http", 8080)
            .endpoint("10.0.0.1", Some("uid-cart-1"))
            .endpoint("10.0.0.2", Some("uid-cart-2"))
            .build(),
        1,
    );
    assert_eq!(verdict(&ix, &cart, "10.0.0.2"), Reason::Member);
    let record = ix.record(ip("10.0.0.2")).unwrap();
    assert_eq!(record.pods.len(), 1);
    assert_eq!(record.pods[0].name, "cart-2");
    assert_eq!(record.pods[0].services[0].via, Via::Both);
    // The pod's update arrives: the same record, now held for real.
    let generation = ix.generation();
    ix.apply(cart_pod("cart-2").ip("10.0.0.2").build(), 2);
    assert_eq!(verdict(&ix, &cart, "10.0.0.2"), Reason::Member);
    assert!(ix.record(ip("10.0.0.2")).unwrap().pods[0].ready);
    assert!(ix.generation() > generation, "readiness changed");

    // A recycled IP: cart-1 dies; web-1 (no IP yet) is listed on its IP.
    ix.delete(pod("shop", "cart-1").build(), 3);
    assert_eq!(verdict(&ix, &cart, "10.0.0.1"), Reason::Destroyed);
    ix.apply(pod("shop", "web-1").uid("uid-web-1").not_ready().build(), 4);
    let web_abc = slice("shop", "web-abc", "web");
    ix.apply(web_abc.endpoint("10.0.0.1", Some("uid-web-1")).build(), 4);
    assert_eq!(verdict(&ix, &web, "10.0.0.1"), Reason::Member);
    assert_eq!(verdict(&ix, &cart, "10.0.0.1"), Reason::Recycled);
    assert!(ix.record(ip("10.0.0.1")).unwrap().tombstone.is_none());
    // web-1 is deleted before it ever got the IP: nobody holds it now.
    ix.delete(pod("shop", "web-1").build(), 5);
    assert_eq!(verdict(&ix, &web, "10.0.0.1"), Reason::Destroyed);
    assert_eq!(verdict(&ix, &cart, "10.0.0.1"), Reason::Destroyed);
}

#[test]
fn a_finished_or_terminating_pod_never_holds_an_ip_provisionally() {
    let mut ix = cart_world();
    let cart = key("shop", "cart");
    ix.apply(cart_pod("cart-2").phase("Succeeded").build(), 1);
    ix.apply(cart_pod("cart-3").terminating().build(), 1);
    ix.apply(
        slice("shop", "cart-abc", "cart")
            .endpoint("10.0.0.2", Some("uid-cart-2"))
            .endpoint("10.0.0.3", Some("uid-cart-3"))
            .build(),
        2,
    );
    assert_eq!(verdict(&ix, &cart, "10.0.0.2"), Reason::Destroyed);
    assert_eq!(verdict(&ix, &cart, "10.0.0.3"), Reason::Destroyed);
}

#[test]
fn a_pod_scope_treats_services_it_may_not_cover_as_unknown() {
    // `--pod-selector app in (cart,pay)`: cart is covered, web is not (its
    // pods would be invisible and its live IPs read as destroyed).
    let mut ix = Index::new(
        7,
        IndexConfig {
            scope: crate::scope::PodScope {
                namespace: None,
                pod_selector: Some(crate::scope::Selector::parse("app in (cart,pay)").unwrap()),
            },
            ..IndexConfig::default()
        },
    );
    let web = key("shop", "web");
    let cart = key("shop", "cart");
    let selecting = |name: &str, app: &str| service("shop", name).selector(&[("app", app)]);
    ix.relist(
        [
            selecting("cart", "cart").build(),
            selecting("web", "web").build(),
            service("shop", "ext").build(),
        ],
        0,
    );
    let web_abc = slice("shop", "web-abc", "web");
    ix.apply(web_abc.endpoint("10.0.0.5", Some("uid-web-1")).build(), 0);
    assert!(ix.knows_service(&cart));
    assert!(!ix.knows_service(&web));
    assert!(ix.out_of_scope(&web).is_some());
    assert!(ix
        .out_of_scope(&key("shop", "ext"))
        .unwrap()
        .contains("no selector"));
    assert_eq!(verdict(&ix, &web, "10.0.0.5"), Reason::UnknownService);
    assert_eq!(verdict(&ix, &cart, "10.0.0.5"), Reason::Destroyed);
    assert_eq!(ix.out_of_scope_count(), 2);

    // web's selector changes to one the scope covers: judged from now on,
    // and gateways hear of it.
    let g = ix.generation();
    ix.apply(selecting("web", "pay").build(), 1);
    assert!(ix.knows_service(&web));
    assert_eq!(ix.out_of_scope(&web), None);
    assert!(ix.generation() > g);
    let delta = ix.changes_since(g, Freshness::default()).unwrap();
    assert_eq!(delta.services_added, vec![web.clone()]);
    // And back out: gateways drop it.
    let g = ix.generation();
    ix.apply(service("shop", "web").selector(&[("tier", "x")]).build(), 2);
    assert!(!ix.knows_service(&web));
    let delta = ix.changes_since(g, Freshness::default()).unwrap();
    assert_eq!(delta.services_removed, vec![web.clone()]);
    // Deleted, or gone at a relist: no reason is kept for it.
    ix.delete(service("shop", "web").build(), 3);
    assert_eq!(ix.out_of_scope(&web), None);
    ix.relist([selecting("cart", "cart").build()], 4);
    assert_eq!(ix.out_of_scope_count(), 0);
}

#[test]
fn a_second_slice_of_one_service_adds_its_ports_but_not_its_conditions() {
    let mut ix = cart_world();
    // Slices sort by name: cart-abc (ready) comes before cart-xyz.
    let second = |ready: bool| {
        slice("shop", "cart-xyz", "cart")
            .port("metrics", 9090)
            .endpoint_with("10.0.0.1", Some("uid-cart-1"), Some((ready, ready, false)))
            .build()
    };
    ix.apply(second(false), 1);
    let m = &ix.record(ip("10.0.0.1")).unwrap().pods[0].services[0];
    let ports: Vec<u16> = m.ports.iter().map(|p| p.port).collect();
    assert_eq!(ports, vec![8080, 9090]);
    assert!(m.conditions.unwrap().ready, "the first slice's conditions");
    // Only the second slice's conditions change: the record does not, and
    // neither does the generation.
    let generation = ix.generation();
    let record = ix.record(ip("10.0.0.1"));
    ix.apply(second(true), 2);
    assert_eq!(ix.record(ip("10.0.0.1")), record);
    assert_eq!(ix.generation(), generation);
}

#[test]
fn a_target_ref_without_uid_names_the_pod_by_namespace_and_name() {
    let mut ix = cart_world();
    let cart = key("shop", "cart");
    let ext = bare_service(&mut ix, "ext");
    ix.apply(pod("shop", "ext-1").ip("10.0.0.5").build(), 0);
    ix.apply(pod("shop", "ext-2").not_ready().build(), 0);
    ix.apply(
        slice("shop", "ext-abc", "ext")
            .port("http", 80)
            // By name, namespace from the slice: a member by slice.
            .endpoint("10.0.0.5", None)
            .target_ref("Pod", None, Some("ext-1"), None)
            // By name, a pod that holds another IP: a stale entry.
            .endpoint("10.0.0.1", None)
            .target_ref("Pod", Some("shop"), Some("ext-1"), None)
            // By name, a pod without an IP yet: no provisional holder,
            // that needs a uid.
            .endpoint("10.0.0.6", None)
            .target_ref("Pod", None, Some("ext-2"), None)
            // Neither uid nor name: it names nobody, and is not bare.
            .endpoint("10.0.0.7", None)
            .target_ref("Pod", None, None, None)
            .build(),
        1,
    );
    let record = ix.record(ip("10.0.0.5")).unwrap();
    assert_eq!(record.pods[0].services[0].service, ext);
    assert_eq!(record.pods[0].services[0].via, Via::Slice);
    assert_eq!(record.pods[0].services[0].ports[0].port, 80);
    assert_eq!(verdict(&ix, &ext, "10.0.0.5"), Reason::Member);
    let held_by_cart = ix.record(ip("10.0.0.1")).unwrap();
    assert_eq!(held_by_cart.pods.len(), 1);
    assert_eq!(held_by_cart.pods[0].services[0].service, cart);
    assert_eq!(verdict(&ix, &ext, "10.0.0.1"), Reason::Recycled);
    assert_eq!(ix.record(ip("10.0.0.6")), None);
    assert_eq!(ix.record(ip("10.0.0.7")), None);
    assert_eq!(verdict(&ix, &ext, "10.0.0.7"), Reason::Destroyed);
    // A name in another namespace names the pod there.
    ix.apply(
        slice("bank", "ext-abc", "ext")
            .endpoint("10.0.0.5", None)
            .target_ref("Pod", Some("shop"), Some("ext-1"), None)
            .build(),
        2,
    );
    let services: Vec<ServiceKey> = ix.record(ip("10.0.0.5")).unwrap().pods[0]
        .services
        .iter()
        .map(|m| m.service.clone())
        .collect();
    assert_eq!(services, vec![key("bank", "ext"), ext]);
}

#[test]
fn a_target_ref_to_another_kind_than_pod_makes_a_bare_member() {
    let mut ix = cart_world();
    let cart = key("shop", "cart");
    let nodes = bare_service(&mut ix, "nodes");
    ix.apply(
        slice("shop", "nodes-abc", "nodes")
            // Even with the uid of the pod holding the IP.
            .endpoint("10.0.0.1", None)
            .target_ref("Node", None, Some("node-a"), Some("uid-cart-1"))
            .endpoint("172.16.0.9", None)
            .target_ref("Node", None, Some("node-b"), Some("uid-node-b"))
            .build(),
        1,
    );
    let record = ix.record(ip("10.0.0.1")).unwrap();
    assert_eq!(record.bare_services, vec![nodes.clone()]);
    let services: Vec<&ServiceKey> = record.pods[0].services.iter().map(|m| &m.service).collect();
    assert_eq!(
        services,
        vec![&cart],
        "not a member of nodes through the pod"
    );
    let node = ix.record(ip("172.16.0.9")).unwrap();
    assert!(node.pods.is_empty());
    assert_eq!(node.bare_services, vec![nodes.clone()]);
    assert_eq!(verdict(&ix, &nodes, "172.16.0.9"), Reason::Member);
    // Without a kind, a reference is taken to be a Pod.
    let mut no_kind = slice("shop", "nodes-abc", "nodes")
        .endpoint("10.0.0.1", Some("uid-cart-1"))
        .build();
    if let Some(r) = no_kind.endpoints[0].target_ref.as_mut() {
        r.kind = None;
    }
    ix.apply(no_kind, 2);
    let record = ix.record(ip("10.0.0.1")).unwrap();
    assert!(record.bare_services.is_empty());
    let services: Vec<&ServiceKey> = record.pods[0].services.iter().map(|m| &m.service).collect();
    assert_eq!(services, vec![&cart, &nodes]);
}

#[test]
fn a_pod_with_empty_pod_ips_holds_its_pod_ip() {
    let mut ix = cart_world();
    let cart = key("shop", "cart");
    for (name, addr, empty_list) in [("cart-2", "10.0.0.2", true), ("cart-3", "10.0.0.3", false)] {
        ix.apply(cart_pod(name).pod_ip_only(addr, empty_list).build(), 1);
        let record = ix.record(ip(addr)).unwrap();
        assert_eq!(record.pods[0].name, name);
        assert_eq!(verdict(&ix, &cart, addr), Reason::Member);
    }
    // When podIPs lists anything, podIP is not read.
    let mut both = cart_pod("cart-4").ip("10.0.0.4").build();
    if let Some(status) = both.status.as_mut() {
        status.pod_ip = Some("10.0.0.40".into());
    }
    ix.apply(both, 2);
    assert!(ix.record(ip("10.0.0.4")).is_some());
    assert_eq!(ix.record(ip("10.0.0.40")), None);
    // The pod's update to a podIPs list moves nothing but what it lists.
    let generation = ix.generation();
    ix.apply(cart_pod("cart-2").ip("10.0.0.2").build(), 3);
    assert_eq!(ix.generation(), generation);
}
