//! Native fuzzing of everything the filter parses from outside: the plugin
//! configuration, validator answers (applied through the poller, as the root
//! does), and shared-data values (meta, IP and service entries, member
//! lists, the lease); and the round trip of the binary bucket lines and
//! member lists on random values.
//!
//! Inputs are valid documents mutated at random (bit flips, cuts, splices,
//! JSON tokens such as huge numbers and wrong types) plus pure random bytes. A
//! panic fails the test. CI runs `STALEGUARD_FUZZ_ITERS` (default 20 000)
//! inputs from a new seed each run (printed; `STALEGUARD_FUZZ_SEED` picks one),
//! after replaying the seeds in `tests/fuzz-regressions.txt`, where a failing
//! seed is appended. For the 1M-input run, see docs/filter.md:
//!
//! ```text
//! STALEGUARD_FUZZ_ITERS=1000000 cargo test --release -p staleguard-engine \
//!     --test fuzz_decoders -- --nocapture
//! ```
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Instant;

use staleguard_engine::buckets;
use staleguard_engine::config::Config;
use staleguard_engine::host::SharedData;
use staleguard_engine::lease::Lease;
use staleguard_engine::members;
use staleguard_engine::replay::TwinConfig;
use staleguard_engine::steer::SteerConfig;
use staleguard_engine::store::{
    decode_service, IndexReader, MemoryStore, Meta, LEASE_KEY, META_KEY,
};
use staleguard_engine::sync::{Poller, SyncConfig};

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }
}

const SEEDS: &[&str] = &[
    r#"{"validator_cluster":"sg","poll_wait_s":1,"max_staleness_ms":3000,"tick_ms":100,"lease_ttl_ms":500,"mode":"audit","policy":{"failure_policy":"closed","terminating":"reject"},"clusters":[{"name":"a","service":"shop/cart"},{"prefix":"p-","service":"a/b"}],"token":"t"}"#,
    r#"{"v":1,"epoch":7,"generation":3,"freshness":{"fresh":true,"age_ms":5},"services":["shop/cart","shop/pay"],"records":[{"ip":"10.0.0.1","pods":[{"namespace":"shop","name":"c","uid":"u","services":[{"service":"shop/cart","via":"both","ports":[{"name":"http","port":8080,"protocol":"TCP"}],"conditions":{"ready":true,"serving":true,"terminating":false}}],"ready":true}]},{"ip":"fd00::2","bare_services":["shop/pay"],"tombstone":{"pod":"shop/x","uid":"u2","services":["shop/cart"],"since_ms":17}}]}"#,
    r#"{"kind":"delta","v":1,"epoch":7,"since":3,"generation":5,"freshness":{"fresh":true},"services_added":["a/b"],"services_removed":["shop/pay"],"upserts":[{"ip":"10.0.0.9","pods":[{"namespace":"a","name":"b","terminating":true,"host_network":true}]}],"removed":["10.0.0.1","::1"]}"#,
    r#"{"kind":"reset","v":1,"epoch":8,"generation":1,"freshness":{"fresh":false},"services":[],"records":[]}"#,
    // Epochs and generations as decimal strings (what writers move to).
    r#"{"kind":"delta","v":1,"epoch":"9271046301922839485","since":"3","generation":"5","freshness":{"fresh":true},"removed":["10.0.0.1"]}"#,
    r#"{"v":1,"epoch":"18446744073709551615","generation":"1","freshness":{"fresh":true},"services":[],"records":[]}"#,
    // Packed answers (what the poller asks for first).
    "staleguard-packed 1 reset\nepoch 8\ngeneration 2\nfresh 1\nage_ms 4\n[services] 2\nshop/cart\nshop/pay\n[names] 1\nshop/gone\n[records] 3\n10.0.0.1 f41c56bca pr s0 pt s0 s1\nfd00::2 b1 t2,0\n192.168.0.4 f00000001 prh\nend\n",
    "staleguard-packed 1 delta\nepoch 7\ngeneration 5\nsince 3\nfresh 0\n[services_added] 1\na/b\n[services_removed] 0\n[names] 1\na/b\n[upserts] 1\n10.0.0.9 f12345678 ptx s0 q9\n[removed] 2\n10.0.0.1\n::ffff:10.0.0.2\nend\n",
    // A plugin configuration with wrong types and unknown fields at every
    // level (checked field by field).
    r#"{"validator_cluster":1,"poll_wait_s":"30","mdoe":1,"policy":{"fail":1},"clusters":[{"name":2},{"service":"a/b","x":1}],"retry":{"methods":["GET",7]},"guard":[]}"#,
    "m1 3 7 5 1700000000000 1 12",
    "m4 3 7 5 1700000000000 1 12 1024",
    // A text bucket of the m3 layout (absent to this one).
    "3\n10.0.0.1 pr s0123456789abcdef/80,443 pt sfedcba9876543210\nfd00::2 b0123456789abcdef t",
    "3 {\"ip\":\"10.0.0.1\",\"pods\":[{\"namespace\":\"a\",\"name\":\"b\"}]}",
    "12",
    "42 99999",
];

/// Binary values of the m4 layout: bucket values (load 3; 10.0.0.1 with
/// two pods, a service with ports, a bare service and a tombstone; fd00::2
/// with a bare service), holders alone, member lists; then a validator's
/// answer with binary records.
const BINARY_SEEDS: &[&[u8]] = &[
    b"\xb4\x03\x44\x0a\x00\x00\x01\x01\x42\x01\x23\x45\x67\x89\xab\xcd\xef\x50\x00\xbb\x01\x02\x40\x10\x32\x54\x76\x98\xba\xdc\xfe\x80\xef\xcd\xab\x89\x67\x45\x23\x01\xc0\x15\xfd\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x80\xef\xcd\xab\x89\x67\x45\x23\x01\xc0",
    b"\x07\x41\x01\x23\x45\x67\x89\xab\xcd\xef\x01\x00\x80\x00\x00\x00\x00\x00\x00\x00\xff\xc0",
    b"\xb4\x03\x08\x0a\x00\x00\x01\x0a\x00\x00\x02\x07\xfd\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x07\x02\x90\x1f\x82\x23",
    // A packed reset with binary records: the text reset's records.
    b"staleguard-packed-binary 1 reset\nepoch 8\ngeneration 2\nfresh 1\nage_ms 4\n[services] 2\nshop/cart\nshop/pay\n[names] 1\nshop/gone\n[records] 3\n\x14\n\x00\x00\x01!\xcak\xc5A\x11\x00\x22\x00\x01\x0d\xfd\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x06\x01\x01\x02\x02\x00\x0c\xc0\xa8\x00\x04\x11\x01\x00\x00\x00\x05end\n",
];

const TOKENS: &[&str] = &[
    "{",
    "}",
    "[",
    "]",
    "\"",
    ",",
    ":",
    "null",
    "true",
    "-1",
    "0",
    "1e999",
    "18446744073709551616",
    "\"kind\"",
    "\"delta\"",
    "\"reset\"",
    "\"v\"",
    "\"epoch\"",
    "\"9271046301922839485\"",
    "\"-3\"",
    "\\u0000",
    "\u{ffff}",
    " ",
    "\"10.0.0.256\"",
    "\"a/\"",
    "\"/b\"",
    "m1",
    "m4",
    "\u{b4}",
    "\u{7f}",
    "\u{80}",
    "\u{c0}",
    "\n",
];

fn mutate(rng: &mut Rng, input: &mut Vec<u8>) {
    for _ in 0..=rng.below(4) {
        let len = input.len();
        match rng.below(7) {
            0 if len > 0 => {
                let i = rng.below(len);
                input[i] ^= 1 << rng.below(8);
            }
            1 => {
                let i = rng.below(len + 1);
                input.insert(i, rng.next() as u8);
            }
            2 if len > 0 => {
                let a = rng.below(len);
                let b = (a + rng.below(16)).min(len);
                input.drain(a..b);
            }
            3 => {
                let i = rng.below(len + 1);
                let t = TOKENS[rng.below(TOKENS.len())].as_bytes();
                input.splice(i..i, t.iter().copied());
            }
            4 if len > 0 => {
                input.truncate(rng.below(len));
            }
            5 => {
                let other = SEEDS[rng.below(SEEDS.len())].as_bytes();
                let a = rng.below(other.len());
                let b = (a + rng.below(64)).min(other.len());
                let i = rng.below(len + 1);
                input.splice(i..i, other[a..b].iter().copied());
            }
            _ => {
                if len > 1 {
                    let a = rng.below(len);
                    let b = rng.below(len);
                    input.swap(a, b);
                }
            }
        }
    }
}

fn feed(input: &[u8], rng: &mut Rng) {
    let _ = Config::parse(input);
    let _ = TwinConfig::parse(input);
    let _ = SteerConfig::parse(input);
    let _ = Meta::decode(input);
    let ip = "10.0.0.1".parse().unwrap();
    let _ = buckets::find(input, &ip, rng.next() % 4);
    let _ = buckets::find_line(input, &"fd00::2".parse().unwrap(), rng.next() % 4);
    // A bucket read for editing writes back what it read.
    let bucket = buckets::Bucket::read(input, rng.next() % 4);
    assert_eq!(buckets::Bucket::read(&bucket.encode(9), 9), bucket);
    // A bucket line's holders: whatever decodes encodes back to itself.
    if let Some(holders) = buckets::Holders::decode(input) {
        let again = buckets::Holders::decode(&holders.encode());
        assert_eq!(again.as_ref(), Some(&holders), "{input:x?}");
        let _ = holders.record_for(ip, &"shop/cart".parse().unwrap());
    }
    // A member list likewise.
    if let Some(list) = members::decode(input, rng.next() % 4) {
        assert_eq!(members::decode(&members::encode(9, &list), 9), Some(list));
    }
    let _ = decode_service(input, rng.next() % 4);

    // Validator answers through the poller, starting from a synced index.
    let mut store = MemoryStore::default();
    let mut poller = Poller::new(
        SyncConfig {
            wait_s: 1,
            backoff_initial_ms: 1,
            backoff_max_ms: 10,
            min_interval_ms: 0,
            page_bytes: None,
        },
        rng.next(),
    );
    if poller.next_request(0, &store).is_some() {
        let _ = poller.on_response(0, 200, SEEDS[1].as_bytes(), &mut store);
    }
    if poller.next_request(1_000, &store).is_some() {
        let _ = poller.on_response(1, 200, input, &mut store);
    }

    // Garbage in shared data: meta, an IP entry, the lease.
    store.set(META_KEY, input, None).unwrap();
    store
        .set(&buckets::key_of(&ip, buckets::MIN_BUCKETS), input, None)
        .unwrap();
    // The reads of a request: meta, then (under a meta that decodes, or
    // the smallest layout) the service and the IP's bucket.
    let view = IndexReader::new(&store);
    let meta = view.meta().unwrap_or(Meta {
        buckets: buckets::MIN_BUCKETS,
        ..Meta::default()
    });
    let _ = view.service(&meta, &"shop/cart".parse().unwrap());
    let _ = view.record(&meta, &ip);
    store.set(LEASE_KEY, input, None).unwrap();
    let _ = Lease::new(1, 100).tick(&mut store, 5);
    if poller.next_request(u64::MAX / 2, &store).is_some() {
        let _ = poller.on_response(2, 200, SEEDS[2].as_bytes(), &mut store);
    }
}

/// Seeds that once made an input panic, replayed first on every run.
const REGRESSIONS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fuzz-regressions.txt");

/// The seeds in the regressions file: `SEED INPUTS` a line (`INPUTS`, how many
/// inputs to replay to reach the failing one); `#` starts a comment.
fn regressions() -> Vec<(u64, u64)> {
    let text = std::fs::read_to_string(REGRESSIONS).unwrap_or_default();
    text.lines()
        .map(|line| line.split('#').next().unwrap_or("").trim())
        .filter(|line| !line.is_empty())
        .map(|line| {
            let mut words = line.split_whitespace().map(|w| w.parse::<u64>());
            match (words.next(), words.next()) {
                (Some(Ok(seed)), Some(Ok(inputs))) => (seed, inputs),
                _ => panic!("{REGRESSIONS}: not `SEED INPUTS`: {line:?}"),
            }
        })
        .collect()
}

/// A new seed each run, unless `STALEGUARD_FUZZ_SEED` names one.
fn seed() -> u64 {
    if let Ok(v) = std::env::var("STALEGUARD_FUZZ_SEED") {
        return v
            .parse()
            .unwrap_or_else(|_| panic!("STALEGUARD_FUZZ_SEED={v:?} is not a u64"));
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or_default();
    // Mixed so that runs started in the same instant by two processes differ.
    (nanos ^ u64::from(std::process::id()).rotate_left(32)).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// A failing input: which one, and what it was.
struct Failure {
    index: u64,
    input: Vec<u8>,
}

/// Feeds `iters` inputs generated from `seed`; the first that panics.
fn fuzz(seed: u64, iters: u64) -> Result<(), Failure> {
    let mut rng = Rng(seed | 1);
    let mut input = Vec::new();
    for i in 0..iters {
        if rng.below(16) == 0 {
            input = (0..rng.below(256)).map(|_| rng.next() as u8).collect();
        } else if i % 8 == 0 || input.len() > 8_192 {
            input = match rng.below(SEEDS.len() + BINARY_SEEDS.len()) {
                n if n < SEEDS.len() => SEEDS[n].as_bytes().to_vec(),
                n => BINARY_SEEDS[n - SEEDS.len()].to_vec(),
            };
        }
        mutate(&mut rng, &mut input);
        let snapshot = input.clone();
        if std::panic::catch_unwind(|| feed(&snapshot, &mut Rng(i | 1))).is_err() {
            return Err(Failure {
                index: i,
                input: snapshot,
            });
        }
    }
    Ok(())
}

#[test]
fn decoders_never_panic() {
    for (seed, inputs) in regressions() {
        if let Err(f) = fuzz(seed, inputs) {
            panic!(
                "regression seed {seed} ({REGRESSIONS}) still panics on input {}: {:?}",
                f.index,
                String::from_utf8_lossy(&f.input)
            );
        }
        println!("fuzz_decoders: regression seed {seed} ({inputs} inputs) passes");
    }
    let iters: u64 = std::env::var("STALEGUARD_FUZZ_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000);
    let seed = seed();
    println!("fuzz_decoders: seed {seed} (replay with STALEGUARD_FUZZ_SEED={seed})");
    let started = Instant::now();
    if let Err(f) = fuzz(seed, iters) {
        let inputs = f.index + 1;
        let kept = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(REGRESSIONS)
            .and_then(|mut file| {
                use std::io::Write;
                writeln!(file, "{seed} {inputs}")
            });
        panic!(
            "panic on input {} (seed {seed}): {:?}\n\
             seed kept in {REGRESSIONS}: {kept:?}; replay with\n  \
             STALEGUARD_FUZZ_SEED={seed} STALEGUARD_FUZZ_ITERS={inputs} \
             cargo test -p staleguard-engine --test fuzz_decoders -- --nocapture",
            f.index,
            String::from_utf8_lossy(&f.input)
        );
    }
    println!(
        "fuzz_decoders: {iters} inputs, 0 panics, {:.1} s (seed {seed})",
        started.elapsed().as_secs_f64()
    );
}

/// The seeds of the string form are real documents: the mutations start from
/// something the decoder takes.
#[test]
fn the_string_form_seeds_decode() {
    use staleguard_core::{Changes, Snapshot};
    let delta = SEEDS
        .iter()
        .find(|s| s.starts_with(r#"{"kind":"delta","v":1,"epoch":"9"#))
        .unwrap();
    assert!(matches!(
        Changes::from_json(delta.as_bytes()),
        Ok(Changes::Delta(d)) if d.epoch == 9_271_046_301_922_839_485 && d.since == 3
    ));
    let snapshot = SEEDS
        .iter()
        .find(|s| s.starts_with(r#"{"v":1,"epoch":"18446744073709551615""#))
        .unwrap();
    assert_eq!(
        Snapshot::from_json(snapshot.as_bytes()).unwrap().epoch,
        u64::MAX
    );
}

#[test]
fn the_packed_seeds_decode() {
    use staleguard_core::{packed, Changes};
    let packed_seeds: Vec<&str> = SEEDS
        .iter()
        .copied()
        .filter(|s| packed::starts_packed(s.as_bytes()))
        .collect();
    assert_eq!(packed_seeds.len(), 2);
    for seed in packed_seeds {
        let read = packed::decode_changes(seed.as_bytes(), buckets::service_id, |r| r);
        assert!(
            matches!(read, Ok(Changes::Reset(_) | Changes::Delta(_))),
            "{seed}: {read:?}"
        );
    }
    // The binary reset reads as the text one does.
    let binary = BINARY_SEEDS[3];
    assert_eq!(packed::encoding_of(binary), Some(packed::Encoding::Binary));
    let read = |bytes: &[u8]| match packed::decode_changes(bytes, buckets::service_id, |r| r) {
        Ok(Changes::Reset(s)) => s.records,
        other => panic!("{other:?}"),
    };
    assert_eq!(read(binary), read(SEEDS[6].as_bytes()));
}

/// The binary seeds are real values: the mutations start from something the
/// readers take.
#[test]
fn the_binary_seeds_decode() {
    use staleguard_engine::entry::Entry;
    let one = "10.0.0.1".parse().unwrap();
    let two = "fd00::2".parse().unwrap();
    let Entry::Present(holders) = buckets::find(BINARY_SEEDS[0], &one, 3) else {
        panic!("10.0.0.1 is in the bucket seed");
    };
    assert_eq!(holders.pods.len(), 2);
    assert_eq!(
        holders.pods[0].services,
        [(0xefcd_ab89_6745_2301, vec![80, 443])]
    );
    assert!(holders.tombstone);
    assert!(
        matches!(buckets::find(BINARY_SEEDS[0], &two, 3), Entry::Present(h) if h.bare.len() == 1)
    );
    assert!(buckets::Holders::decode(BINARY_SEEDS[1]).is_some());
    assert_eq!(
        members::decode(BINARY_SEEDS[2], 3).map(|l| l.len()),
        Some(3)
    );
}

/// A random [`buckets::Holders`]: up to 3 pods of up to 3 services with up to
/// 70 ports (past the 62 a tag holds), bare services, a tombstone.
fn random_holders(rng: &mut Rng) -> buckets::Holders {
    use staleguard_core::packed::PodFlags;
    let pods = (0..rng.below(4))
        .map(|_| {
            let flags = rng.next();
            buckets::Pod {
                flags: PodFlags {
                    ready: flags & 1 != 0,
                    terminating: flags & 2 != 0,
                    host_network: flags & 4 != 0,
                },
                services: (0..rng.below(4))
                    .map(|_| {
                        let ports = match rng.below(4) {
                            0 => rng.below(71),
                            _ => rng.below(3),
                        };
                        (rng.next(), (0..ports).map(|_| rng.next() as u16).collect())
                    })
                    .collect(),
            }
        })
        .collect();
    let mut holders = buckets::Holders {
        pods,
        bare: (0..rng.below(3)).map(|_| rng.next()).collect(),
        tombstone: rng.below(2) == 0,
    };
    if holders.pods.is_empty() && holders.bare.is_empty() {
        holders.tombstone = true;
    }
    holders
}

fn random_ip(rng: &mut Rng) -> std::net::IpAddr {
    use std::net::IpAddr;
    match rng.below(3) {
        0 => IpAddr::from(std::net::Ipv6Addr::from(
            (rng.next() as u128) << 64 | u128::from(rng.next()),
        )),
        // Few distinct addresses, so buckets see the same IP twice.
        1 => IpAddr::from([10, 0, 0, rng.below(8) as u8]),
        _ => IpAddr::from(std::net::Ipv4Addr::from(rng.next() as u32)),
    }
}

#[test]
fn bucket_lines_and_member_lists_round_trip() {
    use staleguard_engine::buckets::{Bucket, CompactRecord, Holders};
    use staleguard_engine::entry::Entry;
    use staleguard_engine::members::Member;
    let iters: u64 = std::env::var("STALEGUARD_FUZZ_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000)
        / 10;
    let seed = seed();
    println!("round trip: seed {seed} (replay with STALEGUARD_FUZZ_SEED={seed})");
    let mut rng = Rng(seed | 1);
    for _ in 0..iters {
        let load = rng.next() >> rng.below(64);
        let mut bucket = Bucket::default();
        let mut kept: Vec<(std::net::IpAddr, Holders)> = Vec::new();
        for _ in 0..rng.below(9) {
            let holders = random_holders(&mut rng);
            let ip = staleguard_core::ip::canonical(random_ip(&mut rng));
            let line = holders.encode();
            assert_eq!(Holders::decode(&line).as_ref(), Some(&holders));
            bucket.put(&CompactRecord {
                ip,
                line: line.into_boxed_slice(),
                fingerprint: 0,
                tombstone: Box::default(),
            });
            kept.retain(|(i, _)| *i != ip);
            kept.push((ip, holders));
        }
        let value = bucket.encode(load);
        assert_eq!(Bucket::read(&value, load), bucket);
        for (ip, holders) in &kept {
            assert_eq!(
                buckets::find(&value, ip, load),
                Entry::Present(holders.clone())
            );
            if load < u64::MAX {
                assert_eq!(buckets::find(&value, ip, load + 1), Entry::Absent);
            }
            // Cut anywhere, the value never reads as another IP's entry.
            let cut = rng.below(value.len());
            match buckets::find(&value[..cut], ip, load) {
                Entry::Present(h) => assert_eq!(&h, holders),
                Entry::Absent | Entry::Corrupt => {}
            }
        }
        let mut list: Vec<Member> = (0..rng.below(20))
            .map(|_| Member {
                ip: random_ip(&mut rng),
                ports: match rng.below(3) {
                    0 => (0..=rng.below(70)).map(|_| rng.next() as u16).collect(),
                    _ => vec![],
                },
            })
            .collect();
        if rng.below(2) == 0 {
            list.sort();
        }
        assert_eq!(
            members::decode(&members::encode(load, &list), load),
            Some(list)
        );
    }
}
