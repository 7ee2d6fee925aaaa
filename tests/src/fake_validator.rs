//! A fake validator for the filter tests: serves canned `staleguard_core::wire`
//! documents on the real API's paths, and can be told to go down, answer
//! garbage, restart with a new epoch, or call its data stale.
//!
//! `GET /v1/snapshot?v=1` answers the whole index; `GET /v1/changes` answers a
//! reset for a foreign epoch or a generation it has no history for, the
//! compacted delta when it has one, and otherwise holds the request until
//! something changes or `wait` seconds pass (then an empty delta), like the
//! real one. Every request is recorded, with how many were open at once. A
//! request whose `Accept` names the packed form gets its answer packed, in
//! the encoding the real validator would choose (binary records, or text
//! for a gateway of the last release). A request with `page_bytes` gets a
//! longer answer in pages as the real validator serves them
//! ([`staleguard_core::page`]: the first page, then `/v1/answer`), from
//! this release only: an older one refuses the parameter, as the real ones
//! refuse any query parameter they do not take.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use anyhow::Result;
use staleguard_core::wire::{Delta, WIRE_VERSION};
use staleguard_core::{Changes, Freshness, IpRecord, ServiceKey, Snapshot};

use crate::blocking::{Answer, Request, Server};

/// Answers served in pages that the fake still holds (the oldest go).
const HELD_ANSWERS: usize = 8;

/// How the fake answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Behaviour {
    /// Like the real validator.
    Normal,
    /// Closes every connection without answering.
    Down,
    /// Answers every request with this status.
    Status(u16),
    /// Answers 200 with a body that is not a wire document.
    Garbage,
    /// Accepts every request and never answers it: holds the connection open
    /// (up to two minutes) until the behaviour changes, then hangs up.
    Hang,
}

/// Which validator release the fake answers as: the forms it knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    /// This one: binary records, the text packed form, JSON.
    Current,
    /// The last release: the text packed form to an `Accept` naming it
    /// exactly, else JSON; no pages (`page_bytes` refused with 400).
    Last,
    /// A release before the packed form: JSON whatever the `Accept`; no
    /// pages.
    BeforePacked,
}

#[derive(Debug)]
struct State {
    release: Release,
    epoch: u64,
    generation: u64,
    /// Oldest generation deltas can start from.
    floor: u64,
    services: Vec<ServiceKey>,
    records: BTreeMap<IpAddr, IpRecord>,
    /// (generation, record or removal) in order.
    history: Vec<(u64, IpAddr, Option<IpRecord>)>,
    fresh: bool,
    behaviour: Behaviour,
    token: Option<String>,
    log: Vec<String>,
    open: u32,
    max_open: u32,
    /// Answers served in pages: (id, content type, body), oldest first.
    held: Vec<(String, String, Arc<Vec<u8>>)>,
    next_id: u64,
}

type Shared = Arc<(Mutex<State>, Condvar)>;

fn lock(shared: &Shared) -> MutexGuard<'_, State> {
    shared.0.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The fake; stops when dropped.
#[derive(Debug)]
pub struct FakeValidator {
    shared: Shared,
    server: Server,
}

impl FakeValidator {
    /// Starts on a free port of 127.0.0.1 with an empty index at `epoch`.
    pub fn start(epoch: u64) -> Result<Self> {
        let shared: Shared = Arc::new((
            Mutex::new(State {
                release: Release::Current,
                epoch,
                generation: 1,
                floor: 1,
                services: vec![],
                records: BTreeMap::new(),
                history: vec![],
                fresh: true,
                behaviour: Behaviour::Normal,
                token: None,
                log: vec![],
                open: 0,
                max_open: 0,
                held: vec![],
                next_id: 0,
            }),
            Condvar::new(),
        ));
        let handler_state = shared.clone();
        let server = Server::start("127.0.0.1:0".parse()?, move |req| {
            handle(&handler_state, req)
        })?;
        Ok(Self { shared, server })
    }

    /// Answers from now on as a validator of `release` would.
    pub fn set_release(&self, release: Release) {
        self.change(|s| s.release = release);
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.server.addr()
    }

    fn change(&self, f: impl FnOnce(&mut State)) {
        let mut s = lock(&self.shared);
        f(&mut s);
        self.shared.1.notify_all();
    }

    /// Replaces the whole index (clients will get a reset).
    pub fn set_index(&self, services: Vec<ServiceKey>, records: Vec<IpRecord>) {
        self.change(|s| {
            s.generation += 1;
            s.floor = s.generation;
            s.history.clear();
            s.services = services;
            s.records = records.into_iter().map(|r| (r.ip, r)).collect();
        });
    }

    /// Adds or replaces one IP's record (clients get a delta).
    pub fn upsert(&self, record: IpRecord) {
        self.change(|s| {
            s.generation += 1;
            let g = s.generation;
            s.history.push((g, record.ip, Some(record.clone())));
            s.records.insert(record.ip, record);
        });
    }

    /// Forgets one IP (clients get a delta).
    pub fn remove(&self, ip: IpAddr) {
        self.change(|s| {
            s.generation += 1;
            let g = s.generation;
            s.history.push((g, ip, None));
            s.records.remove(&ip);
        });
    }

    /// Plays a validator restart: a new epoch, generations start over.
    pub fn restart(&self, epoch: u64) {
        self.change(|s| {
            s.epoch = epoch;
            s.generation = 1;
            s.floor = 1;
            s.history.clear();
        });
    }

    /// Plays a validator restart that comes back with another index: a new
    /// epoch whose first generation is `records`, in one step. A real
    /// validator never serves the previous epoch's data under the new epoch;
    /// [`FakeValidator::restart`] then [`FakeValidator::set_index`] may
    /// (a held request woken by the restart answers before the new index is
    /// set), and a filter then applies two resets, the first of the old
    /// records.
    pub fn restart_with(&self, epoch: u64, services: Vec<ServiceKey>, records: Vec<IpRecord>) {
        self.change(|s| {
            s.epoch = epoch;
            s.generation = 1;
            s.floor = 1;
            s.history.clear();
            s.services = services;
            s.records = records.into_iter().map(|r| (r.ip, r)).collect();
        });
    }

    /// Sets the `fresh` flag of every answer.
    pub fn set_fresh(&self, fresh: bool) {
        self.change(|s| s.fresh = fresh);
    }

    /// Sets how it answers.
    pub fn set_behaviour(&self, behaviour: Behaviour) {
        self.change(|s| s.behaviour = behaviour);
    }

    /// Requires `Authorization: Bearer <token>`.
    pub fn set_token(&self, token: Option<&str>) {
        self.change(|s| s.token = token.map(Into::into));
    }

    /// Every request target so far.
    pub fn requests(&self) -> Vec<String> {
        lock(&self.shared).log.clone()
    }

    /// The most requests that were open at the same time.
    pub fn max_open(&self) -> u32 {
        lock(&self.shared).max_open
    }

    /// Waits until `pred` holds for the request log, or `timeout` passes.
    pub fn wait_for(&self, timeout: Duration, pred: impl Fn(&[String]) -> bool) -> bool {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if pred(&lock(&self.shared).log) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        pred(&lock(&self.shared).log)
    }
}

impl Drop for FakeValidator {
    fn drop(&mut self) {
        // Wake held long polls so their threads end with the server.
        self.set_behaviour(Behaviour::Down);
    }
}

fn snapshot(s: &State) -> Snapshot {
    Snapshot {
        v: WIRE_VERSION,
        epoch: s.epoch,
        generation: s.generation,
        freshness: Freshness {
            fresh: s.fresh,
            age_ms: Some(1),
        },
        services: s.services.clone(),
        records: s.records.values().cloned().collect(),
    }
}

/// The compacted delta after `since`, if history covers it.
fn delta(s: &State, since: u64) -> Option<Delta> {
    if since < s.floor || since > s.generation {
        return None;
    }
    let mut latest: BTreeMap<IpAddr, Option<IpRecord>> = BTreeMap::new();
    for (g, ip, rec) in &s.history {
        if *g > since {
            latest.insert(*ip, rec.clone());
        }
    }
    let mut upserts = vec![];
    let mut removed = vec![];
    for (ip, rec) in latest {
        match rec {
            Some(r) => upserts.push(r),
            None => removed.push(ip),
        }
    }
    Some(Delta {
        v: WIRE_VERSION,
        epoch: s.epoch,
        since,
        generation: s.generation,
        freshness: Freshness {
            fresh: s.fresh,
            age_ms: Some(1),
        },
        services_added: vec![],
        services_removed: vec![],
        upserts,
        removed,
    })
}

fn json<T: serde::Serialize>(t: &T) -> Answer {
    Answer::json(serde_json::to_vec(t).unwrap_or_default())
}

/// The packed encoding a validator of `release` answers `req` in; `None`
/// for JSON.
fn packed(release: Release, req: &Request) -> Option<staleguard_core::packed::Encoding> {
    use staleguard_core::packed::{Encoding, MEDIA_TYPE};
    let accept = req.headers.get("accept")?;
    match release {
        Release::Current => Encoding::accepted([accept.as_str()]),
        Release::Last => accept
            .split(',')
            .filter_map(|range| range.split(';').next())
            .any(|media| media.trim().eq_ignore_ascii_case(MEDIA_TYPE))
            .then_some(Encoding::Text),
        Release::BeforePacked => None,
    }
}

fn packed_answer(encoding: staleguard_core::packed::Encoding, body: Vec<u8>) -> Answer {
    Answer::Respond {
        status: 200,
        headers: vec![("content-type".into(), encoding.media_type().into())],
        body,
    }
}

/// `changes` as a validator of `release` answers `req`.
fn changes(release: Release, req: &Request, changes: &Changes) -> Answer {
    match packed(release, req) {
        Some(encoding) => packed_answer(
            encoding,
            staleguard_core::packed::encode_changes_as(encoding, changes),
        ),
        None => json(changes),
    }
}

fn handle(shared: &Shared, req: &Request) -> Answer {
    let mut s = lock(shared);
    s.log.push(req.target.clone());
    s.open += 1;
    s.max_open = s.max_open.max(s.open);
    let answer = answer(shared, s, req);
    let mut s = lock(shared);
    s.open -= 1;
    in_pages(&mut s, req, answer)
}

/// `answer` to `req` in pages, if it asked for them and is longer than a
/// page: its first page, the rest held for `/v1/answer`.
fn in_pages(s: &mut State, req: &Request, answer: Answer) -> Answer {
    use staleguard_core::page;
    let Some(len) = req.query("page_bytes").and_then(|l| l.parse::<u32>().ok()) else {
        return answer;
    };
    let len = page::page_len(len) as usize;
    let Answer::Respond {
        status: 200,
        headers,
        body,
    } = &answer
    else {
        return answer;
    };
    if body.len() <= len || s.release != Release::Current {
        return answer;
    }
    s.next_id += 1;
    let id = format!("{:x}-{}", s.epoch, s.next_id);
    let content_type = headers
        .iter()
        .find(|(k, _)| k == "content-type")
        .map_or_else(String::new, |(_, v)| v.clone());
    let body = Arc::new(body.clone());
    s.held
        .push((id.clone(), content_type.clone(), body.clone()));
    if s.held.len() > HELD_ANSWERS {
        s.held.remove(0);
    }
    page_of(&id, &content_type, &body, 0, len)
}

fn page_of(id: &str, content_type: &str, body: &[u8], offset: usize, len: usize) -> Answer {
    use staleguard_core::page;
    let end = offset.saturating_add(len).min(body.len());
    Answer::Respond {
        status: 200,
        headers: vec![
            ("content-type".into(), content_type.into()),
            (page::LENGTH_HEADER.into(), body.len().to_string()),
            (page::ID_HEADER.into(), id.into()),
            (page::OFFSET_HEADER.into(), offset.to_string()),
        ],
        body: body[offset.min(end)..end].to_vec(),
    }
}

/// `GET /v1/answer`: a page of a held answer.
fn page(s: &State, req: &Request) -> Answer {
    let (Some(id), Some(offset)) = (
        req.query("id"),
        req.query("offset").and_then(|o| o.parse::<usize>().ok()),
    ) else {
        return Answer::status(400, "need id and offset");
    };
    let Some((_, content_type, body)) = s.held.iter().find(|(held, _, _)| held == id) else {
        return Answer::Respond {
            status: 410,
            headers: vec![("content-type".into(), "application/json".into())],
            body: br#"{"error":{"code":"gone","message":"no longer held"}}"#.to_vec(),
        };
    };
    if offset > body.len() {
        return Answer::status(400, "offset past the end");
    }
    let len = req
        .query("page_bytes")
        .and_then(|l| l.parse::<u32>().ok())
        .map_or(usize::MAX, |l| staleguard_core::page::page_len(l) as usize);
    page_of(id, content_type, body, offset, len)
}

fn answer(shared: &Shared, mut s: MutexGuard<'_, State>, req: &Request) -> Answer {
    match s.behaviour.clone() {
        Behaviour::Normal => {}
        Behaviour::Down => return Answer::Hangup,
        Behaviour::Status(code) => return Answer::status(code, "fake failure"),
        Behaviour::Garbage => return Answer::json(b"{\"kind\":\"delta\",\"v\":1,\"oops".to_vec()),
        Behaviour::Hang => {
            let deadline = Instant::now() + Duration::from_secs(120);
            while s.behaviour == Behaviour::Hang {
                let now = Instant::now();
                if now >= deadline {
                    break;
                }
                s = shared
                    .1
                    .wait_timeout(s, deadline - now)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
            }
            return Answer::Hangup;
        }
    }
    if let Some(token) = &s.token {
        if req.headers.get("authorization") != Some(&format!("Bearer {token}")) {
            return Answer::status(401, "unauthorized");
        }
    }
    if s.release != Release::Current && req.query("page_bytes").is_some() {
        // Strict query parameters, as the real releases before pages.
        return Answer::status(400, "unknown field `page_bytes`");
    }
    match req.path() {
        staleguard_core::page::ANSWER_PATH if s.release == Release::Current => page(&s, req),
        "/v1/snapshot" => match packed(s.release, req) {
            Some(encoding) => packed_answer(
                encoding,
                staleguard_core::packed::encode_snapshot_as(encoding, &snapshot(&s)),
            ),
            None => json(&snapshot(&s)),
        },
        "/v1/changes" => {
            let num = |k: &str| req.query(k).and_then(|v| v.parse::<u64>().ok());
            let (Some(epoch), Some(since)) = (num("epoch"), num("since")) else {
                return Answer::status(400, "need epoch and since");
            };
            let wait = Duration::from_secs(num("wait").unwrap_or(0).min(60));
            let deadline = Instant::now() + wait;
            loop {
                if s.behaviour != Behaviour::Normal {
                    return Answer::Hangup;
                }
                if epoch != s.epoch {
                    return changes(s.release, req, &Changes::Reset(snapshot(&s)));
                }
                let Some(d) = delta(&s, since) else {
                    return changes(s.release, req, &Changes::Reset(snapshot(&s)));
                };
                let now = Instant::now();
                if s.generation != since || now >= deadline {
                    return changes(s.release, req, &Changes::Delta(d));
                }
                s = shared
                    .1
                    .wait_timeout(s, deadline - now)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
            }
        }
        _ => Answer::status(404, "no such path"),
    }
}

/// Builders for index records.
pub mod records {
    use staleguard_core::wire::{Membership, Via};
    use staleguard_core::{IpRecord, PodHolder, ServiceKey};

    /// A pod named `pod` holding `ip`, member of `services`.
    pub fn pod(ip: &str, pod: &str, services: &[&ServiceKey], terminating: bool) -> IpRecord {
        IpRecord {
            ip: ip.parse().unwrap_or(std::net::IpAddr::from([0, 0, 0, 0])),
            pods: vec![PodHolder {
                namespace: "shop".into(),
                name: pod.into(),
                uid: format!("uid-{pod}"),
                services: services
                    .iter()
                    .map(|s| Membership {
                        service: (*s).clone(),
                        via: Via::Both,
                        ports: vec![],
                        conditions: None,
                    })
                    .collect(),
                ready: !terminating,
                terminating,
                host_network: false,
            }],
            bare_services: vec![],
            tombstone: None,
        }
    }
}
