//! One request's verdict: which service the cluster means, what the index
//! says about the host, and what the filter does about it.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::rc::Rc;

use staleguard_core::ip::canonical;
use staleguard_core::{decide, Action, IpRecord, Reason, ServiceKey, Verdict};

use crate::cache::{Cache, Resolved};
use crate::config::{Config, Mode};
use crate::entry::Entry;
use crate::host::SharedData;
use crate::store::Meta;

/// What the host told us about the upstream request: the two properties
/// every request reads.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Upstream {
    /// `xds.cluster_name`.
    pub cluster: Option<String>,
    /// `upstream.address`, as `IP:port`.
    pub address: Option<String>,
}

/// [`Upstream`] as [`judge`] reads it: lent, not owned (a request lends
/// the host's own texts, see [`crate::host::Stream::property_text`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UpstreamRef<'a> {
    /// `xds.cluster_name`.
    pub cluster: Option<&'a str>,
    /// `upstream.address`, as `IP:port`.
    pub address: Option<&'a str>,
}

impl<'a> From<&'a Upstream> for UpstreamRef<'a> {
    fn from(upstream: &'a Upstream) -> Self {
        Self {
            cluster: upstream.cluster.as_deref(),
            address: upstream.address.as_deref(),
        }
    }
}

/// What a request reads from the host only when it needs it.
pub trait Lazy {
    /// The first host of Istio's `filter_metadata.istio.services`, if any
    /// (read on a miss of the cluster cache, and only with `istio`).
    fn istio_service_host(&self) -> Option<String>;
    /// The wall clock, ms since the Unix epoch (read only when `meta` says
    /// the data was fresh when synced).
    fn now_ms(&self) -> u64;
}

/// What the filter does with the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Effect {
    /// Continue.
    Allow,
    /// Answer locally with this status and the reason header.
    Reject {
        /// HTTP status.
        status: u32,
    },
    /// The verdict rejects, but audit mode lets it through.
    Audit,
}

impl Effect {
    /// The metric label: `allow`, `reject`, `audit`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Effect::Allow => "allow",
            Effect::Reject { .. } => "reject",
            Effect::Audit => "audit",
        }
    }
}

/// What [`judge`] rules for one request: left untouched (and why), or judged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ruling {
    /// The cluster maps to no service: untouched.
    Unmapped,
    /// The upstream address is missing or unreadable (an internal address
    /// without an `endpoint_id`, too): untouched.
    NoAddress,
    /// The upstream IP is outside the configured `pod_cidrs`: not this
    /// cluster's pod (another cluster's, an east-west gateway), untouched.
    OutOfScope,
    /// Judged.
    Judged {
        /// The service the cluster routes to (the cache's, shared).
        service: Rc<Resolved>,
        /// The host's IP.
        ip: IpAddr,
        /// The verdict.
        verdict: Verdict,
        /// What the filter does.
        effect: Effect,
    },
}

/// The service a cluster routes to: configured rules first, then (with
/// `istio`) the cluster metadata, then the `outbound|PORT|SUBSET|FQDN` name.
/// The rule lives in `staleguard_core::cluster`, shared with the audit.
pub fn resolve_service(
    config: &Config,
    cluster: &str,
    istio_service_host: Option<&str>,
) -> Option<ServiceKey> {
    config.cluster_map().resolve(cluster, istio_service_host)
}

/// Parses `IP:port` (`[v6]:port` too) or a bare IP, in the canonical form the
/// index keys IPs by: Envoy reports an IPv4-mapped endpoint as
/// `[::ffff:a.b.c.d]:port`, and that host is `a.b.c.d`. An Envoy internal
/// address, `envoy://<listener>/<endpoint_id>` (Istio ambient's HBONE
/// endpoints: `envoy://connect_originate/10.244.1.5:8080`), is judged by
/// the IP in its `endpoint_id`; without one it has no IP.
pub fn parse_ip(address: &str) -> Option<IpAddr> {
    let address = match address.strip_prefix("envoy://") {
        Some(internal) => internal.split_once('/')?.1,
        None => address,
    };
    if let Some(ip) = ipv4_with_port(address) {
        return Some(IpAddr::V4(ip));
    }
    parse_ip_general(address)
}

/// What [`ipv4_with_port`] does not read, by the general parsers; out of
/// line, so that the common case's code stays together.
#[cold]
#[inline(never)]
fn parse_ip_general(address: &str) -> Option<IpAddr> {
    address
        .parse::<SocketAddr>()
        .map(|a| a.ip())
        .or_else(|_| address.parse::<IpAddr>())
        .ok()
        .map(canonical)
}

/// `a.b.c.d:port`, the form Envoy names almost every upstream host by, read
/// by hand: the general parser (`SocketAddr`'s) costs about 350
/// instructions a request. `None` for anything it is not sure of (IPv6,
/// a bare IP, a port with more than 5 digits, a leading zero in an octet),
/// which [`parse_ip`] then hands to the general parser; what it reads, it
/// reads as that parser does.
fn ipv4_with_port(address: &str) -> Option<Ipv4Addr> {
    let mut octets = [0u8; 4];
    let mut bytes = address.as_bytes().iter();
    for (i, octet) in octets.iter_mut().enumerate() {
        let end = if i == 3 { b':' } else { b'.' };
        let (mut value, mut digits) = (0u32, 0u32);
        loop {
            let b = *bytes.next()?;
            if b == end && digits > 0 {
                break;
            }
            // At most 3 digits, and no digit after a leading 0.
            if !b.is_ascii_digit() || digits == 3 || (digits == 1 && value == 0) {
                return None;
            }
            value = value * 10 + u32::from(b - b'0');
            digits += 1;
        }
        *octet = u8::try_from(value).ok()?;
    }
    let port = bytes.as_slice();
    if port.is_empty() || port.len() > 5 {
        return None;
    }
    let mut value = 0u32;
    for b in port {
        if !b.is_ascii_digit() {
            return None;
        }
        value = value * 10 + u32::from(b - b'0');
    }
    (value <= u32::from(u16::MAX)).then(|| Ipv4Addr::from(octets))
}

/// Judges one request against the shared-data index, through the VM's
/// `cache`: one read of `meta` when nothing changed (see `crate::cache`),
/// the clock only when `meta` says the data was fresh, an allowing verdict
/// kept for the same service and IP ([`Cache::allowed`]), and never a
/// rejection on a cached record (a rejecting verdict re-reads the IP's
/// bucket).
pub fn judge<'u>(
    config: &Config,
    cache: &mut Cache,
    store: &dyn SharedData,
    upstream: impl Into<UpstreamRef<'u>>,
    lazy: &dyn Lazy,
) -> Ruling {
    let upstream = upstream.into();
    let cluster = upstream.cluster.unwrap_or_default();
    let service = cache.service_of(cluster, || {
        let host = if config.istio {
            lazy.istio_service_host()
        } else {
            None
        };
        resolve_service(config, cluster, host.as_deref())
    });
    let Some(service) = service else {
        return Ruling::Unmapped;
    };
    let Some(ip) = upstream.address.and_then(parse_ip) else {
        return Ruling::NoAddress;
    };
    if !config.in_scope(ip) {
        return Ruling::OutOfScope;
    }
    let stamp = cache.current(store);
    let meta = stamp
        .map(|(meta, _)| meta)
        .filter(|m| m.fresh && m.is_fresh(lazy.now_ms(), config.max_staleness_ms));
    let verdict = match meta {
        // Stale whatever the entries say: none is read.
        None => decide(&config.policy, false, &service.key, false, None),
        Some(meta) => {
            let verdict = match cache.allowed(service.id, &ip) {
                Some(verdict) => verdict,
                None => verdict_from_entries(config, cache, store, &meta, &service, ip),
            };
            if cache.keeps_passes() {
                keep_pass(config, cache, upstream, &meta, &service, ip);
            }
            verdict
        }
    };
    let effect = match (verdict.action, config.mode) {
        (Action::Allow, _) => Effect::Allow,
        (Action::Reject, Mode::Audit) => Effect::Audit,
        (Action::Reject, Mode::Enforce) => Effect::Reject {
            status: config.reject_status,
        },
    };
    Ruling::Judged {
        service,
        ip,
        verdict,
        effect,
    }
}

/// Keeps the request as a pass ([`Cache::keep_pass`]) when its verdict is
/// the one kept for the service and IP (an allowing verdict on readable
/// entries) and is not a stale pick's: the body path steers by those, so
/// each must be seen. Out of line: only a host that keeps passes runs it,
/// and only for a request that was not one.
#[inline(never)]
fn keep_pass(
    config: &Config,
    cache: &mut Cache,
    upstream: UpstreamRef<'_>,
    meta: &Meta,
    service: &Rc<Resolved>,
    ip: IpAddr,
) {
    let (Some(cluster), Some(address)) = (upstream.cluster, upstream.address) else {
        return;
    };
    let Some(verdict) = cache.allowed(service.id, &ip) else {
        return;
    };
    if matches!(verdict.reason, Reason::Destroyed | Reason::Recycled) {
        return;
    }
    let fresh_until_ms = meta.synced_ms.saturating_add(config.max_staleness_ms);
    cache.keep_pass(cluster, address, service, verdict.reason, fresh_until_ms);
}

/// The verdict when none is kept for the service and IP: from the cached or
/// read entries, kept when it allows. Out of line: a request to a host
/// judged before neither runs nor loads this code.
#[inline(never)]
fn verdict_from_entries(
    config: &Config,
    cache: &mut Cache,
    store: &dyn SharedData,
    meta: &Meta,
    service: &Resolved,
    ip: IpAddr,
) -> Verdict {
    let known = cache.service(store, meta, service);
    let (record, cached) = cache.record(store, meta, &ip);
    // An entry read as corrupt counts as stale data: its verdict is the
    // failure policy's, not the entries', and is not kept.
    let readable = !matches!(known, Entry::Corrupt) && !matches!(record, Entry::Corrupt);
    let verdict = verdict_of(config, service, &known, record);
    if verdict.action == Action::Reject && cached {
        let record = cache.reread(store, meta, &ip);
        verdict_of(config, service, &known, record)
    } else {
        if readable {
            cache.keep(service.id, ip, verdict);
        }
        verdict
    }
}

/// The verdict on entries read under a fresh `meta`. An entry the filter
/// cannot read is no basis for a rejection: it counts as stale data, which
/// the failure policy decides.
fn verdict_of(
    config: &Config,
    service: &Resolved,
    known: &Entry<()>,
    record: Entry<&IpRecord>,
) -> Verdict {
    let mut fresh = true;
    let known = match known {
        Entry::Present(()) => true,
        Entry::Absent => false,
        Entry::Corrupt => {
            fresh = false;
            false
        }
    };
    let record = match record {
        Entry::Present(r) => Some(r),
        Entry::Absent => None,
        Entry::Corrupt => {
            fresh = false;
            None
        }
    };
    // Cached records name their services by id (`IndexReader::record`).
    decide(&config.policy, fresh, &service.by_id, known, record)
}

/// The reason code the reject header carries: nothing else leaves Envoy.
pub fn header_value(reason: Reason) -> &'static str {
    reason.as_str()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::buckets::{self, MIN_BUCKETS};
    use crate::store::{encode_service, service_key, IndexReader, MemoryStore, Meta, META_KEY};
    use staleguard_core::wire::{Membership, Via};
    use staleguard_core::{IpRecord, PodHolder};

    fn config(extra: &str) -> Config {
        Config::parse(format!(r#"{{"validator_cluster":"sg"{extra}}}"#).as_bytes()).unwrap()
    }

    fn cart() -> ServiceKey {
        ServiceKey::new("shop", "cart")
    }

    fn pod(services: &[ServiceKey], terminating: bool) -> PodHolder {
        PodHolder {
            namespace: "shop".into(),
            name: "p".into(),
            uid: "u".into(),
            services: services
                .iter()
                .map(|s| Membership {
                    service: s.clone(),
                    via: Via::Slice,
                    ports: vec![],
                    conditions: None,
                })
                .collect(),
            ready: true,
            terminating,
            host_network: false,
        }
    }

    /// An index at load 1, synced at t=1000, with cart known.
    fn store(records: &[IpRecord]) -> MemoryStore {
        let mut s = MemoryStore::default();
        let meta = Meta {
            load: 1,
            epoch: 1,
            generation: 1,
            synced_ms: 1_000,
            fresh: true,
            entries: records.len() as u64,
            buckets: MIN_BUCKETS,
        };
        s.set(META_KEY, &meta.encode(), None).unwrap();
        s.set(&service_key(&cart()), &encode_service(1), None)
            .unwrap();
        for r in records {
            buckets::put(&mut s, 1, MIN_BUCKETS, r).unwrap();
        }
        s
    }

    fn record(ip: &str, pods: Vec<PodHolder>) -> IpRecord {
        IpRecord {
            ip: ip.parse().unwrap(),
            pods,
            bare_services: vec![],
            tombstone: None,
        }
    }

    fn upstream(cluster: &str, address: &str) -> Upstream {
        Upstream {
            cluster: Some(cluster.into()),
            address: Some(address.into()),
        }
    }

    /// The host's lazy reads, counted.
    struct Host {
        istio: Option<&'static str>,
        now_ms: u64,
        reads: std::cell::Cell<(u32, u32)>,
    }

    impl Lazy for Host {
        fn istio_service_host(&self) -> Option<String> {
            let (m, c) = self.reads.get();
            self.reads.set((m + 1, c));
            self.istio.map(Into::into)
        }
        fn now_ms(&self) -> u64 {
            let (m, c) = self.reads.get();
            self.reads.set((m, c + 1));
            self.now_ms
        }
    }

    fn at(now_ms: u64) -> Host {
        Host {
            istio: None,
            now_ms,
            reads: Default::default(),
        }
    }

    /// One request with a cold cache.
    fn judge_at(c: &Config, s: &dyn SharedData, up: &Upstream, now_ms: u64) -> Ruling {
        judge(c, &mut Cache::default(), s, up, &at(now_ms))
    }

    const CART: &str = "outbound|8080||cart.shop.svc.cluster.local";

    fn effect(o: &Ruling) -> (Reason, Effect) {
        match o {
            Ruling::Judged {
                verdict, effect, ..
            } => (verdict.reason, *effect),
            other => panic!("not judged: {other:?}"),
        }
    }

    #[test]
    fn services_come_from_rules_metadata_and_istio_names() {
        let c = config(
            r#","clusters":[{"name":"plain","service":"a/b"},{"prefix":"pay-","service":"shop/pay"}]"#,
        );
        let up = |cluster: &'static str, host: Option<&'static str>| (cluster, host);
        let resolve_service =
            |c: &Config, (cluster, host): &(&str, Option<&str>)| resolve_service(c, cluster, *host);
        assert_eq!(
            resolve_service(&c, &up("plain", None)),
            Some(ServiceKey::new("a", "b"))
        );
        assert_eq!(
            resolve_service(&c, &up("pay-v2", None)),
            Some(ServiceKey::new("shop", "pay"))
        );
        assert_eq!(resolve_service(&c, &up(CART, None)), Some(cart()));
        assert_eq!(
            resolve_service(&c, &up("whatever", Some("cart.shop.svc.cluster.local"))),
            Some(cart())
        );
        assert_eq!(resolve_service(&c, &up("other", None)), None);
        let own =
            Config::parse(br#"{"validator_cluster":"outbound|8080||sg.sg.svc.cluster.local"}"#)
                .unwrap();
        assert_eq!(
            resolve_service(&own, &up("outbound|8080||sg.sg.svc.cluster.local", None)),
            None,
            "the validator's own cluster is never judged"
        );
        let no_istio = config(r#","istio":false"#);
        assert_eq!(resolve_service(&no_istio, &up(CART, None)), None);
    }

    #[test]
    fn addresses_parse_for_v4_and_v6() {
        assert_eq!(parse_ip("10.0.0.1:80"), Some("10.0.0.1".parse().unwrap()));
        assert_eq!(parse_ip("[fd00::1]:80"), Some("fd00::1".parse().unwrap()));
        assert_eq!(parse_ip("fd00::1"), Some("fd00::1".parse().unwrap()));
        assert_eq!(parse_ip("nonsense"), None);
    }

    #[test]
    fn an_ipv4_host_and_port_read_by_hand_reads_as_the_general_parser_reads_it() {
        let general = |a: &str| {
            a.parse::<SocketAddr>()
                .map(|s| s.ip())
                .or_else(|_| a.parse::<IpAddr>())
                .ok()
                .map(canonical)
        };
        let mut cases: Vec<String> = [
            "10.0.0.1:80",
            "10.244.1.5:8080",
            "0.0.0.0:0",
            "255.255.255.255:65535",
            "1.2.3.4:65536",
            "1.2.3.4:99999",
            "1.2.3.4:0080",
            "1.2.3.4:000080",
            "1.2.3.4:",
            "1.2.3.4:+80",
            "1.2.3.4:8a",
            "01.2.3.4:80",
            "1.2.3.04:80",
            "256.1.1.1:80",
            "1.2.3:80",
            "1.2.3.4.5:80",
            "1..3.4:80",
            ".1.2.3:80",
            "1.2.3.4.:80",
            "1.2.3.1000:80",
            " 1.2.3.4:80",
            "1.2.3.4",
            "[fd00::1]:80",
            "[::ffff:10.0.0.1]:8080",
            "fd00::1",
            "::ffff:1.2.3.4",
            "",
            ":80",
            "a.b.c.d:80",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        // Every octet and a spread of ports.
        for n in 0..=300u32 {
            cases.push(format!("{n}.{}.0.{}:{}", 300 - n, n % 7, n * 217));
        }
        for case in &cases {
            assert_eq!(parse_ip(case), general(case), "{case:?}");
            if let Some(ip) = ipv4_with_port(case) {
                assert_eq!(Some(IpAddr::V4(ip)), general(case), "{case:?}");
            }
        }
        assert!(
            ipv4_with_port("10.0.0.1:8080").is_some(),
            "the fast path runs"
        );
    }

    #[test]
    fn an_ipv4_mapped_host_is_judged_as_its_ipv4_address() {
        let c = config("");
        let s = store(&[record("10.0.0.1", vec![pod(&[cart()], false)])]);
        assert_eq!(
            parse_ip("[::ffff:10.0.0.1]:8080"),
            Some("10.0.0.1".parse().unwrap())
        );
        let mapped = upstream(CART, "[::ffff:10.0.0.1]:8080");
        assert_eq!(
            effect(&judge_at(&c, &s, &mapped, 1_500)),
            (Reason::Member, Effect::Allow),
            "a live pod reached through its mapped address is no destroyed pod"
        );
        // Written under either form, an entry has one key.
        assert_eq!(
            buckets::key_of(&"::ffff:10.0.0.1".parse().unwrap(), MIN_BUCKETS),
            buckets::key_of(&"10.0.0.1".parse().unwrap(), MIN_BUCKETS)
        );
    }

    #[test]
    fn verdicts_follow_the_index() {
        let c = config("");
        let s = store(&[
            record("10.0.0.1", vec![pod(&[cart()], false)]),
            record(
                "10.0.0.2",
                vec![pod(&[ServiceKey::new("shop", "pay")], false)],
            ),
            record("10.0.0.3", vec![pod(&[cart()], true)]),
        ]);
        let j = |addr: &str| effect(&judge_at(&c, &s, &upstream(CART, addr), 1_500));
        assert_eq!(j("10.0.0.1:8080"), (Reason::Member, Effect::Allow));
        assert_eq!(
            j("10.0.0.2:8080"),
            (Reason::Recycled, Effect::Reject { status: 503 })
        );
        assert_eq!(j("10.0.0.3:8080"), (Reason::Terminating, Effect::Allow));
        assert_eq!(
            j("10.0.0.9:8080"),
            (Reason::Destroyed, Effect::Reject { status: 503 })
        );
        let unknown = upstream("outbound|80||x.other.svc.cluster.local", "10.0.0.9:80");
        assert_eq!(
            effect(&judge_at(&c, &s, &unknown, 1_500)),
            (Reason::UnknownService, Effect::Allow)
        );
        assert_eq!(
            judge_at(&c, &s, &upstream("plain", "10.0.0.1:80"), 0),
            Ruling::Unmapped
        );
        let mut no_addr = upstream(CART, "");
        no_addr.address = None;
        assert_eq!(judge_at(&c, &s, &no_addr, 0), Ruling::NoAddress);
        // An internal address without an endpoint_id has no IP either.
        let internal = upstream(CART, "envoy://connect_originate/");
        assert_eq!(judge_at(&c, &s, &internal, 0), Ruling::NoAddress);
    }

    #[test]
    fn stale_data_follows_the_failure_policy() {
        let s = store(&[]);
        let open = config(r#","max_staleness_ms":40000,"poll_wait_s":1"#);
        let closed = config(
            r#","max_staleness_ms":40000,"poll_wait_s":1,"policy":{"failure_policy":"closed"}"#,
        );
        let late = 1_000 + 40_001;
        assert_eq!(
            effect(&judge_at(&open, &s, &upstream(CART, "10.0.0.9:1"), late)),
            (Reason::Stale, Effect::Allow)
        );
        assert_eq!(
            effect(&judge_at(&closed, &s, &upstream(CART, "10.0.0.9:1"), late)),
            (Reason::Stale, Effect::Reject { status: 503 })
        );
        // Never synced: stale too.
        let empty = MemoryStore::default();
        assert_eq!(
            effect(&judge_at(&closed, &empty, &upstream(CART, "10.0.0.9:1"), 0)).0,
            Reason::Stale
        );
    }

    /// An index whose bucket of 10.0.0.7 does not decode: load 1, then a
    /// line cut inside its holders.
    fn with_a_corrupt_line_for_10_0_0_7() -> MemoryStore {
        let mut s = store(&[]);
        let ip = "10.0.0.7".parse().unwrap();
        s.set(
            &buckets::key_of(&ip, MIN_BUCKETS),
            &[0xb4, 1, 0x14, 10, 0, 0, 7, 0x01],
            None,
        )
        .unwrap();
        s
    }

    #[test]
    fn corrupt_entries_count_as_stale_not_as_destroyed() {
        let s = with_a_corrupt_line_for_10_0_0_7();
        let c = config("");
        assert_eq!(
            effect(&judge_at(&c, &s, &upstream(CART, "10.0.0.7:1"), 1_000)),
            (Reason::Stale, Effect::Allow)
        );
    }

    #[test]
    fn audit_lets_through_and_the_status_is_configurable() {
        let s = store(&[]);
        let audit = config(r#","mode":"audit""#);
        let custom = config(r#","reject_status":429"#);
        let up = upstream(CART, "10.0.0.9:1");
        assert_eq!(
            effect(&judge_at(&audit, &s, &up, 1_000)),
            (Reason::Destroyed, Effect::Audit)
        );
        assert_eq!(
            effect(&judge_at(&custom, &s, &up, 1_000)),
            (Reason::Destroyed, Effect::Reject { status: 429 })
        );
        assert_eq!(header_value(Reason::Destroyed), "destroyed");
    }

    /// Counts the reads that reach the store.
    struct Counting<'a>(&'a MemoryStore, std::cell::Cell<u32>);

    impl SharedData for Counting<'_> {
        fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, u32), crate::host::StoreError> {
            self.1.set(self.1.get() + 1);
            self.0.get(key)
        }
        fn set(
            &mut self,
            _: &str,
            _: &[u8],
            _: Option<u32>,
        ) -> Result<(), crate::host::StoreError> {
            Err(crate::host::StoreError::Host("read only".into()))
        }
    }

    #[test]
    fn a_repeated_request_reads_meta_and_the_clock_only() {
        let c = config("");
        let s = store(&[record("10.0.0.1", vec![pod(&[cart()], false)])]);
        let counted = Counting(&s, Default::default());
        let mut cache = Cache::default();
        let host = Host {
            istio: Some("cart.shop.svc.cluster.local"),
            ..at(1_500)
        };
        let up = upstream(CART, "10.0.0.1:8080");
        for _ in 0..3 {
            assert_eq!(
                effect(&judge(&c, &mut cache, &counted, &up, &host)),
                (Reason::Member, Effect::Allow)
            );
        }
        assert_eq!(
            counted.1.get(),
            3 + 2,
            "meta each time, service and bucket once"
        );
        assert_eq!(
            host.reads.get(),
            (1, 3),
            "metadata on the miss, clock each time"
        );
        // Stale by meta's own flag: no clock, no entries.
        let mut stale = store(&[]);
        let meta = Meta {
            fresh: false,
            ..IndexReader::new(&stale).meta().unwrap()
        };
        stale.set(META_KEY, &meta.encode(), None).unwrap();
        let host = at(1_500);
        assert_eq!(
            effect(&judge(&c, &mut cache, &stale, &up, &host)).0,
            Reason::Stale
        );
        assert_eq!(host.reads.get(), (0, 0));
    }

    #[test]
    fn a_rejection_is_never_served_from_the_cache() {
        // While the guard holds an answer it writes the records that only add
        // without moving meta: a pod that appears then must be allowed even
        // though its IP was cached as destroyed.
        let c = config("");
        let mut s = store(&[]);
        let mut cache = Cache::default();
        let up = upstream(CART, "10.0.0.5:8080");
        assert_eq!(
            effect(&judge(&c, &mut cache, &s, &up, &at(1_500))),
            (Reason::Destroyed, Effect::Reject { status: 503 })
        );
        buckets::put(
            &mut s,
            1,
            MIN_BUCKETS,
            &record("10.0.0.5", vec![pod(&[cart()], false)]),
        )
        .unwrap();
        assert_eq!(
            effect(&judge(&c, &mut cache, &s, &up, &at(1_500))),
            (Reason::Member, Effect::Allow)
        );
    }

    #[test]
    fn a_cached_allowance_ends_when_meta_moves() {
        let c = config("");
        let mut s = store(&[record("10.0.0.1", vec![pod(&[cart()], false)])]);
        let mut cache = Cache::default();
        let up = upstream(CART, "10.0.0.1:8080");
        assert_eq!(
            effect(&judge(&c, &mut cache, &s, &up, &at(1_500))).1,
            Effect::Allow
        );
        // The IP goes to a pod of another service, committed by a new meta.
        let pay = ServiceKey::new("shop", "pay");
        buckets::put(
            &mut s,
            1,
            MIN_BUCKETS,
            &record("10.0.0.1", vec![pod(&[pay], false)]),
        )
        .unwrap();
        let meta = IndexReader::new(&s).meta().unwrap();
        let next = Meta {
            generation: meta.generation + 1,
            ..meta
        };
        s.set(META_KEY, &next.encode(), None).unwrap();
        assert_eq!(
            effect(&judge(&c, &mut cache, &s, &up, &at(1_500))),
            (Reason::Recycled, Effect::Reject { status: 503 })
        );
    }

    #[test]
    fn a_kept_allowance_is_forgotten_with_the_configuration() {
        // A terminating pod: allowed by the default policy, rejected by one
        // that says so. The root clears the clusters on a new configuration.
        let s = store(&[record("10.0.0.1", vec![pod(&[cart()], true)])]);
        let counted = Counting(&s, Default::default());
        let allowing = config("");
        let rejecting = config(r#","policy":{"terminating":"reject"}"#);
        let mut cache = Cache::default();
        let up = upstream(CART, "10.0.0.1:8080");
        for _ in 0..2 {
            assert_eq!(
                effect(&judge(&allowing, &mut cache, &counted, &up, &at(1_500))),
                (Reason::Terminating, Effect::Allow)
            );
        }
        assert_eq!(counted.1.get(), 2 + 2, "meta each time, entries once");
        cache.clear_clusters();
        assert_eq!(
            effect(&judge(&rejecting, &mut cache, &counted, &up, &at(1_500))),
            (Reason::Terminating, Effect::Reject { status: 503 })
        );
    }

    #[test]
    fn an_allowance_on_a_corrupt_entry_is_not_kept() {
        // Fail open on a bucket that does not decode; once it is rewritten
        // (without a new meta), the next request reads it.
        let mut s = with_a_corrupt_line_for_10_0_0_7();
        let c = config("");
        let mut cache = Cache::default();
        let up = upstream(CART, "10.0.0.7:1");
        assert_eq!(
            effect(&judge(&c, &mut cache, &s, &up, &at(1_000))),
            (Reason::Stale, Effect::Allow)
        );
        buckets::put(
            &mut s,
            1,
            MIN_BUCKETS,
            &record("10.0.0.7", vec![pod(&[cart()], false)]),
        )
        .unwrap();
        assert_eq!(
            effect(&judge(&c, &mut cache, &s, &up, &at(1_000))),
            (Reason::Member, Effect::Allow)
        );
    }

    #[test]
    fn ips_outside_pod_cidrs_are_out_of_scope_and_internal_addresses_are_judged_by_endpoint_id() {
        let s = store(&[record("10.244.1.5", vec![pod(&[cart()], false)])]);
        let scoped = config(r#","pod_cidrs":["10.244.0.0/16","fd00:10:244::/56"]"#);
        // Another cluster's pod, an east-west gateway: passed, not destroyed.
        assert_eq!(
            judge_at(&scoped, &s, &upstream(CART, "10.8.3.4:8080"), 2_000),
            Ruling::OutOfScope
        );
        // Inside: judged as ever; a gone pod of this cluster is destroyed.
        assert_eq!(
            effect(&judge_at(
                &scoped,
                &s,
                &upstream(CART, "10.244.9.9:8080"),
                2_000
            ))
            .0,
            Reason::Destroyed
        );
        // Without pod_cidrs every IP is judged (the remote pod is destroyed).
        let all = config("");
        assert_eq!(
            effect(&judge_at(&all, &s, &upstream(CART, "10.8.3.4:8080"), 2_000)).0,
            Reason::Destroyed
        );
        // HBONE: the endpoint_id's IP is the pod's.
        for c in [&scoped, &all] {
            let hbone = upstream(CART, "envoy://connect_originate/10.244.1.5:8080");
            assert_eq!(effect(&judge_at(c, &s, &hbone, 2_000)).0, Reason::Member);
        }
        let remote_hbone = upstream(CART, "envoy://connect_originate/10.8.3.4:15008");
        assert_eq!(
            judge_at(&scoped, &s, &remote_hbone, 2_000),
            Ruling::OutOfScope
        );
        assert_eq!(
            parse_ip("envoy://connect_originate/[::ffff:10.244.1.5]:80"),
            Some("10.244.1.5".parse().unwrap())
        );
        assert_eq!(parse_ip("envoy://no-endpoint-id"), None);
    }

    #[test]
    fn pod_cidrs_that_do_not_parse_are_refused_together() {
        let err = Config::parse(
            br#"{"validator_cluster":"sg","pod_cidrs":["10.244.0.0/16","10.244.0.1/16","nope"]}"#,
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("pod_cidrs[1]") && err.contains("pod_cidrs[2]"),
            "{err}"
        );
    }
}
