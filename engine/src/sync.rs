//! The poller: the protocol state machine that keeps the shared-data index in
//! step with the validator.
//!
//! Driven by [`crate::root`]: [`Poller::next_request`] says what to ask the
//! validator, if anything; [`Poller::on_response`] judges an answer (in
//! sequence? held by the guard?) and has [`crate::store::write::Writer`] write
//! it to shared data; [`Poller::on_failure`] schedules a retry after a
//! [`crate::backoff`] delay; [`Poller::wake_at_ms`] says when the poller next
//! has something to do, so the root arms its timer for that moment instead of
//! waiting for the next lease tick; [`Poller::watchdog`] gives up on a call
//! that has been out longer than any answer can take. The cursor (epoch,
//! generation, load) is taken from `meta` when the poller starts, so a context
//! that takes the lease over from a dead poller continues with deltas instead
//! of reloading everything; it takes the guard's baseline from the index then
//! too ([`Guard::seed`]), so it holds what its predecessor held. Answers are asked for packed
//! with binary records ([`staleguard_core::packed`], [`ACCEPT`]) and read as
//! whichever form comes (binary or text packed, JSON), a record at a time
//! straight into [`CompactRecord`]s: the packed readers take both encodings,
//! so nothing here depends on which.
//!
//! A packed snapshot or reset is never held whole in the poller: it is read
//! once for the guard to judge it (counts, against the guard's baseline) and
//! to measure its layout, then once per slice of the layout to write it
//! ([`crate::store::write::Plan`]), each record dropped as soon as it is
//! used. The first of those readings also updates the guard's baseline and
//! gathers the member lists. A held reset is read once more for the records
//! that only add.
//!
//! With a page size ([`SyncConfig::page_bytes`]), requests ask for large
//! answers in pages ([`staleguard_core::page`]): a first page whose headers
//! say the answer is longer starts a [`Reassembly`], a buffer reserved once
//! at the whole's length, filled by [`Request::Page`]s one after the other;
//! the whole then goes through the same path as an answer that came whole.
//! Any page that does not continue it, or a failure, drops it: the sync
//! starts over as after any error. A validator that refuses `page_bytes` (a
//! release before pages: its routes refuse unknown parameters) is asked for
//! whole answers for [`WHOLE_AFTER_REFUSAL_MS`].
//!
//! A reset, an epoch that is not ours (a restarted validator, or another
//! replica behind the same Service), or a delta that does not start at our
//! generation all lead to a full snapshot under a new load id (see
//! [`crate::store`]).

use std::io::{BufRead as _, BufReader, Read};
use std::rc::Rc;

use staleguard_core::packed::{self, PackedError};
use staleguard_core::page;
use staleguard_core::wire::{Delta, WireError};
use staleguard_core::{Changes, Policy, Snapshot};

use crate::backoff::Backoff;
use crate::buckets::{service_id, CompactRecord};
use crate::guard::{Answer, Guard, GuardConfig, GuardEvent, Seeded};
use crate::host::{RawHeaders, SharedData, StoreError};
use crate::store::write::Writer;
use crate::store::{Meta, META_KEY};

mod reset;

use reset::Records;

/// Why an answer could not be applied.
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    /// The validator answered with a non-200 status (503 also covers Envoy's
    /// own answer when it cannot reach the validator).
    #[error("validator answered HTTP {0}")]
    Status(u32),
    /// The request could not be sent or got no answer.
    #[error("validator request failed: {0}")]
    Transport(String),
    /// The body is not a document of the expected kind or version.
    #[error("validator answer unreadable: {0}")]
    Decode(#[source] WireError),
    /// The body is packed and not a document of the expected kind or version.
    #[error("validator answer unreadable: {0}")]
    DecodePacked(#[source] PackedError),
    /// A delta that does not continue from our generation.
    #[error("delta from generation {since} does not continue ours ({ours})")]
    Sequence {
        /// Where the delta starts.
        since: u64,
        /// Where we are.
        ours: u64,
    },
    /// Shared data refused a write.
    #[error("shared data: {0}")]
    Store(#[from] StoreError),
    /// A paged answer that cannot be put back together (see [`PageError`]).
    #[error("paged answer: {0}")]
    Page(#[source] PageError),
    /// The request was out longer than any answer can take (a validator that
    /// accepted the connection and never answered, or a host that never
    /// called back): the watchdog gave up on it.
    #[error("no answer after {0} ms: the watchdog gave up on the request")]
    Timeout(u64),
}

impl SyncError {
    /// A bounded label for the sync error counter.
    pub fn kind(&self) -> &'static str {
        match self {
            SyncError::Status(_) => "status",
            SyncError::Transport(_) => "transport",
            SyncError::Decode(_)
            | SyncError::DecodePacked(_)
            | SyncError::Page(PageError::TooLong(_)) => "decode",
            SyncError::Page(_) => "page",
            SyncError::Sequence { .. } => "sequence",
            SyncError::Store(_) => "store",
            SyncError::Timeout(_) => "timeout",
        }
    }
}

/// Why a paged answer could not be put back together.
#[derive(Debug, thiserror::Error)]
pub enum PageError {
    /// The headers claim a whole longer than any answer can be: the
    /// buffer is not reserved.
    #[error("the answer claims {0} bytes, more than the {MAX_ANSWER_BYTES} any answer may take")]
    TooLong(u64),
    /// The validator no longer holds the answer (410: it restarted, or let
    /// it go); the sync starts over.
    #[error("the validator no longer holds the answer (410)")]
    Gone,
    /// A page that does not continue the answer (another id, length or
    /// offset, a page longer than the rest, an empty one, unreadable
    /// headers).
    #[error("a page does not continue the answer: {0}")]
    Mismatch(String),
}

/// The longest answer a paged answer may claim to be: Envoy refuses
/// callout answers over 32 MiB anyway; this leaves room for a JSON answer
/// while refusing a claim that would reserve the machine's memory.
pub const MAX_ANSWER_BYTES: u64 = 256 << 20;

/// How long a poller asks for whole answers after its validator refused
/// `page_bytes`: then it tries pages again (the validator may have been
/// upgraded meanwhile).
pub const WHOLE_AFTER_REFUSAL_MS: u64 = 10 * 60 * 1000;

/// Knobs of the sync loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyncConfig {
    /// Long-poll wait in seconds.
    pub wait_s: u32,
    /// First retry delay.
    pub backoff_initial_ms: u64,
    /// Largest retry delay.
    pub backoff_max_ms: u64,
    /// Least time between two requests, even when answers come at once (a
    /// burst of changes, replicas answering resets in turn).
    pub min_interval_ms: u64,
    /// Ask for answers in pages of this many bytes (`None`: whole answers,
    /// each buffered whole by the host before it hands it over).
    pub page_bytes: Option<u32>,
}

/// What the host's timeout of a long poll adds to its wait: the validator
/// answers an idle long poll after `wait` seconds, so an answer later than
/// this is not coming.
pub const LONG_POLL_SLACK_MS: u64 = 5_000;

/// The host's timeout of a snapshot request: building, sending and receiving
/// a 150k-IP snapshot takes about a second (docs/benchmarks.md).
pub const SNAPSHOT_TIMEOUT_MS: u64 = 30_000;

/// How much of an answer's body the poller reads at a time.
pub const BODY_CHUNK: usize = 64 * 1024;

/// The `Accept` of every request to the validator: the packed form with
/// binary records ([`packed::BINARY_MEDIA_TYPE`]: about 12 bytes a record, so
/// less for Envoy to buffer), the text packed form ([`packed::MEDIA_TYPE`],
/// all a validator of the last release serves), or JSON from a validator
/// before it. Each is read a record at a time, whichever comes.
pub const ACCEPT: &str = "application/vnd.staleguard.packed-binary, \
    application/vnd.staleguard.packed;q=0.9, application/json;q=0.5";

/// What the watchdog adds to the host's timeout before it gives up itself.
pub const WATCHDOG_SLACK_MS: u64 = 2_000;

impl SyncConfig {
    /// The timeout to give the host for `request`.
    pub fn request_timeout_ms(&self, request: &Request) -> u64 {
        match request {
            Request::Snapshot | Request::Page { .. } => SNAPSHOT_TIMEOUT_MS,
            Request::Changes { wait_s, .. } => u64::from(*wait_s) * 1_000 + LONG_POLL_SLACK_MS,
        }
    }

    /// How long `request` may be out before the watchdog gives up on it: the
    /// host's timeout plus slack, so the host's own timeout normally fires
    /// first and the watchdog only catches a call the host never reports.
    pub fn watchdog_ms(&self, request: &Request) -> u64 {
        self.request_timeout_ms(request) + WATCHDOG_SLACK_MS
    }
}

/// A request to the validator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// `GET /v1/snapshot?v=1`.
    Snapshot,
    /// `GET /v1/changes?v=1&epoch=E&since=G&wait=S`.
    Changes {
        /// Our epoch.
        epoch: u64,
        /// Our generation.
        since: u64,
        /// Long-poll wait in seconds.
        wait_s: u32,
    },
    /// `GET /v1/answer?v=1&id=ID&offset=O&page_bytes=L`: the next page of
    /// an answer that came in pages.
    Page {
        /// The answer's id, as its first page named it.
        id: String,
        /// Where the page starts: the bytes the poller has.
        offset: u64,
        /// The page size.
        page_bytes: u32,
    },
}

impl Request {
    /// The request path.
    pub fn path(&self) -> String {
        match self {
            // The verdict view: what `decide` needs and no more, which keeps a
            // large snapshot under Envoy's 32 MiB callout limit.
            Request::Snapshot => "/v1/snapshot?v=1&view=verdict".to_owned(),
            Request::Changes {
                epoch,
                since,
                wait_s,
            } => format!("/v1/changes?v=1&view=verdict&epoch={epoch}&since={since}&wait={wait_s}"),
            Request::Page {
                id,
                offset,
                page_bytes,
            } => format!(
                "{}?v=1&id={id}&offset={offset}&page_bytes={page_bytes}",
                page::ANSWER_PATH
            ),
        }
    }
}

/// What an answer's headers say of the whole it is a page of
/// ([`staleguard_core::page`]): nothing, for an answer that came whole.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PageHeaders {
    /// The whole answer's length.
    pub length: Option<String>,
    /// The answer's id.
    pub id: Option<String>,
    /// Where this page starts.
    pub offset: Option<String>,
}

impl PageHeaders {
    /// The page headers among an answer's `headers`.
    pub fn of(headers: &RawHeaders) -> Self {
        let mut found = Self::default();
        for (name, value) in headers {
            let slot = if name.eq_ignore_ascii_case(page::LENGTH_HEADER) {
                &mut found.length
            } else if name.eq_ignore_ascii_case(page::ID_HEADER) {
                &mut found.id
            } else if name.eq_ignore_ascii_case(page::OFFSET_HEADER) {
                &mut found.offset
            } else {
                continue;
            };
            *slot = Some(String::from_utf8_lossy(value).into_owned());
        }
        found
    }
}

/// A paged answer being put back together.
#[derive(Debug, Clone)]
struct Reassembly {
    /// The request whose answer this is (a snapshot or changes).
    first: Request,
    /// That request watched a held answer.
    watching: bool,
    id: String,
    /// The whole's length.
    total: usize,
    /// The whole, reserved once at its length: no growth, one block.
    body: Vec<u8>,
}

/// What an applied answer did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// A full snapshot replaced the index.
    Reset {
        /// IPs in the index now.
        entries: u64,
    },
    /// A delta was applied (possibly empty).
    Delta {
        /// IPs written or cleared.
        changed: u64,
    },
    /// The blast-radius guard held the answer: nothing but its additions
    /// was written and the previous data keeps serving, synced as of this
    /// answer (see [`crate::guard`]).
    Held,
    /// An answer to the watch of a held answer: the validator still serves
    /// it unchanged. Nothing was written but the time of the sync.
    StillHeld,
    /// A page of an answer that came in pages: nothing applied yet, the next
    /// page is asked for at once.
    Page {
        /// Bytes of the answer received so far.
        received: u64,
        /// The whole answer's length.
        total: u64,
    },
    /// The validator refused `page_bytes` (a release before pages): whole
    /// answers are asked for from now on ([`WHOLE_AFTER_REFUSAL_MS`]).
    PagesRefused,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Cursor {
    load: u64,
    epoch: u64,
    generation: u64,
}

/// Where the validator's held answer stands: the poller long-polls from
/// here, so it hears at once when that answer changes or another validator
/// (a new epoch) answers instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct HeldAt {
    epoch: u64,
    generation: u64,
}

/// The longest the poller waits to ask again after the guard held an
/// answer: a correct validator replacing a wrong one is heard within a
/// second, whatever backoff the wrong one ran up.
pub const HOLD_RETRY_MAX_MS: u64 = 1_000;

/// The poller's state.
#[derive(Debug, Clone)]
pub struct Poller {
    config: SyncConfig,
    cursor: Option<Cursor>,
    /// Adopt the cursor from `meta` before the first request.
    adopted: bool,
    in_flight: Option<Request>,
    /// When the watchdog gives up on the request in flight.
    deadline_ms: u64,
    next_at_ms: u64,
    last_sent_ms: Option<u64>,
    backoff: Backoff,
    /// What applying an answer writes to shared data.
    writer: Writer,
    guard: Guard,
    /// The held answer being watched, while the guard holds one.
    held: Option<HeldAt>,
    /// The request in flight watches the held answer (set with the request,
    /// taken with its answer).
    watching: bool,
    /// A hold wrote additions into the index: if a delta ends the hold, the
    /// next request is a snapshot, which replaces them with the truth.
    gains_written: bool,
    /// The oldest index the guard's baseline is seeded from.
    seed_max_age_ms: u64,
    /// What the last seeding found, until taken.
    seeded: Option<Seeded>,
    /// The paged answer being put back together, if one is.
    paged: Option<Reassembly>,
    /// The request in flight asked for pages.
    asked_pages: bool,
    /// Whole answers until then: the validator refused pages.
    whole_until_ms: u64,
    /// The length of the last answer put together from pages, until the
    /// next request.
    paged_bytes: Option<u64>,
}

impl Poller {
    /// A poller; `seed` feeds the backoff jitter.
    pub fn new(config: SyncConfig, seed: u64) -> Self {
        Self {
            config,
            cursor: None,
            adopted: false,
            in_flight: None,
            deadline_ms: 0,
            next_at_ms: 0,
            last_sent_ms: None,
            backoff: Backoff::new(config.backoff_initial_ms, config.backoff_max_ms, seed),
            writer: Writer::default(),
            guard: Guard::new(GuardConfig::default(), Policy::default()),
            held: None,
            watching: false,
            gains_written: false,
            seed_max_age_ms: crate::config::default_max_staleness_ms(),
            seeded: None,
            paged: None,
            asked_pages: false,
            whole_until_ms: 0,
            paged_bytes: None,
        }
    }

    /// Replaces the blast-radius guard (the default one judges under the
    /// default policy).
    pub fn with_guard(mut self, guard: Guard) -> Self {
        self.guard = guard;
        self
    }

    /// Seeds the guard's baseline from an index synced at most
    /// `max_age_ms` ago when this poller starts (`max_staleness_ms`; the
    /// default is that knob's default).
    pub fn with_seed_max_age(mut self, max_age_ms: u64) -> Self {
        self.seed_max_age_ms = max_age_ms;
        self
    }

    /// What the guard did with the last answer, once.
    pub fn take_guard_event(&mut self) -> Option<GuardEvent> {
        self.guard.take_event()
    }

    /// True while the guard holds an answer back.
    pub fn guard_holding(&self) -> bool {
        self.guard.holding()
    }

    /// The blast-radius guard, for its gauges.
    pub fn guard(&self) -> &Guard {
        &self.guard
    }

    /// Seeds the guard's baseline from the index `meta` describes (see
    /// [`crate::guard`]'s seeding), unless that index is older than
    /// `seed_max_age_ms`: requests no longer trust it (the failure policy
    /// answers them), so it is no reference, and the next answer is taken
    /// as the first one is.
    fn seed_guard(&mut self, now_ms: u64, store: &dyn SharedData, meta: &Meta) {
        if now_ms.saturating_sub(meta.synced_ms) > self.seed_max_age_ms {
            return;
        }
        self.seeded = self.guard.seed(store, meta);
    }

    /// What seeding the guard's baseline from the index found, once (`None`
    /// when this poller did not seed it since the last call).
    pub fn take_seeded(&mut self) -> Option<Seeded> {
        self.seeded.take()
    }

    /// The request to send now, if one is due and none is in flight. The
    /// caller must report its fate through `on_response` or `on_failure`.
    pub fn next_request(&mut self, now_ms: u64, store: &dyn SharedData) -> Option<Request> {
        if self.in_flight.is_some() || now_ms < self.next_at_ms {
            return None;
        }
        self.paged_bytes = None;
        if let Some(paged) = &self.paged {
            // The next page at once: the least interval spaces out answers,
            // and this is one answer.
            let request = Request::Page {
                id: paged.id.clone(),
                offset: paged.body.len() as u64,
                page_bytes: self.config.page_bytes.unwrap_or(page::MIN_PAGE_BYTES),
            };
            self.asked_pages = false;
            return Some(self.send(now_ms, request));
        }
        if let Some(last) = self.last_sent_ms {
            if now_ms < last.saturating_add(self.config.min_interval_ms) {
                return None;
            }
        }
        if !self.adopted {
            self.adopted = true;
            if let Ok((Some(value), _)) = store.get(META_KEY) {
                if let Some(meta) = Meta::decode(&value) {
                    self.cursor = Some(Cursor {
                        load: meta.load,
                        epoch: meta.epoch,
                        generation: meta.generation,
                    });
                    self.writer.adopt(&meta);
                    self.seed_guard(now_ms, store, &meta);
                }
            }
        }
        let request = match (self.held, self.cursor) {
            (Some(HeldAt { epoch, generation }), _) => Request::Changes {
                epoch,
                since: generation,
                wait_s: self.config.wait_s,
            },
            (None, None) => Request::Snapshot,
            (None, Some(c)) => Request::Changes {
                epoch: c.epoch,
                since: c.generation,
                wait_s: self.config.wait_s,
            },
        };
        self.watching = self.held.is_some();
        self.asked_pages = self.pages() && now_ms >= self.whole_until_ms;
        Some(self.send(now_ms, request))
    }

    /// Puts `request` in flight now, under the watchdog.
    fn send(&mut self, now_ms: u64, request: Request) -> Request {
        self.in_flight = Some(request.clone());
        self.deadline_ms = now_ms.saturating_add(self.config.watchdog_ms(&request));
        self.last_sent_ms = Some(now_ms);
        request
    }

    /// The path and query to send `request` (just returned by
    /// [`Poller::next_request`]) with: its own, and the page size when
    /// this poller asks for pages.
    pub fn path(&self, request: &Request) -> String {
        let path = request.path();
        match self.config.page_bytes {
            Some(page_bytes) if self.asked_pages && !matches!(request, Request::Page { .. }) => {
                format!("{path}&page_bytes={page_bytes}")
            }
            _ => path,
        }
    }

    /// The length of the answer just applied when it came in pages (its
    /// last page's is not the answer's).
    pub fn paged_bytes(&self) -> Option<u64> {
        self.paged_bytes
    }

    /// True when answers may come in pages: the caller then hands
    /// [`Poller::on_answer`] the answer's [`PageHeaders`].
    pub fn pages(&self) -> bool {
        cfg!(feature = "pages") && self.config.page_bytes.is_some()
    }

    /// The knobs this poller runs with.
    pub fn config(&self) -> &SyncConfig {
        &self.config
    }

    /// True while a request is out.
    pub fn in_flight(&self) -> bool {
        self.in_flight.is_some()
    }

    /// When the poller next has something to do: the moment the next request
    /// may go out (after a backoff, or the least interval after the previous
    /// request), or, while a request is out, the moment the watchdog gives up
    /// on it. The root arms its timer for this instant, so neither a quick
    /// answer nor a backoff waits for a lease tick.
    pub fn wake_at_ms(&self) -> u64 {
        if self.in_flight.is_some() {
            return self.deadline_ms;
        }
        if self.paged.is_some() {
            return self.next_at_ms;
        }
        let interval = self
            .last_sent_ms
            .map_or(0, |last| last.saturating_add(self.config.min_interval_ms));
        self.next_at_ms.max(interval)
    }

    /// Gives up on a request that has been out past its watchdog deadline
    /// ([`SyncConfig::watchdog_ms`]; its answer, should it ever come, must then
    /// be ignored by the caller) and schedules the next attempt like any
    /// failure. Returns the error to count.
    pub fn watchdog(&mut self, now_ms: u64) -> Option<SyncError> {
        let request = self.in_flight.as_ref()?;
        if now_ms < self.deadline_ms {
            return None;
        }
        let out_for = now_ms.saturating_sub(
            self.deadline_ms
                .saturating_sub(self.config.watchdog_ms(request)),
        );
        let error = SyncError::Timeout(out_for);
        self.on_failure(now_ms, &error);
        Some(error)
    }

    /// Forgets the request in flight without judging it (the lease was lost:
    /// its answer will be ignored) and the adopted cursor (a later holder
    /// re-reads `meta`).
    pub fn stand_down(&mut self) {
        self.in_flight = None;
        self.adopted = false;
        self.cursor = None;
        self.backoff.reset();
        self.next_at_ms = 0;
        self.guard.reset();
        self.held = None;
        self.watching = false;
        self.gains_written = false;
        self.seeded = None;
        self.paged = None;
        self.asked_pages = false;
    }

    /// The generation applied last, if any.
    pub fn generation(&self) -> Option<u64> {
        self.cursor.map(|c| c.generation)
    }

    /// IPs in the index.
    pub fn entries(&self) -> u64 {
        self.writer.entries()
    }

    /// Applies an answer (`status`, `body`) to the request in flight.
    pub fn on_response(
        &mut self,
        now_ms: u64,
        status: u32,
        body: &[u8],
        store: &mut dyn SharedData,
    ) -> Result<Applied, SyncError> {
        let mut answer = WithBody {
            store,
            open: in_memory(Rc::new(body.to_vec())),
        };
        self.on_answer(now_ms, status, &PageHeaders::default(), &mut answer)
    }

    /// Like [`Poller::on_response`], reading the body from `answer` as the
    /// decoder goes, as often as it needs: the root reads a large answer
    /// from the host in chunks instead of copying all of it into the VM.
    /// `page` is what the answer's headers say of the whole it may be a
    /// page of (the default when [`Poller::pages`] is false).
    pub fn on_answer(
        &mut self,
        now_ms: u64,
        status: u32,
        page: &PageHeaders,
        answer: &mut dyn Answered,
    ) -> Result<Applied, SyncError> {
        let request = self.in_flight.take();
        let asked_pages = std::mem::take(&mut self.asked_pages);
        let result = match request {
            Some(Request::Page { offset, .. }) if cfg!(feature = "pages") => {
                self.next_page(now_ms, status, offset, page, answer)
            }
            // A validator before pages refuses a parameter it does not know.
            _ if asked_pages && status == 400 => {
                self.whole_until_ms = now_ms.saturating_add(WHOLE_AFTER_REFUSAL_MS);
                self.watching = false;
                Ok(Applied::PagesRefused)
            }
            request => {
                let watching = std::mem::take(&mut self.watching);
                match self.first_page(status, page, answer, &request, watching) {
                    Ok(None) => self.apply(now_ms, request, watching, status, answer),
                    Ok(Some(paged)) => self.received(now_ms, paged, answer),
                    Err(e) => Err(e),
                }
            }
        };
        match &result {
            // The next page, or the whole answer after a refusal, at once.
            Ok(Applied::Page { .. } | Applied::PagesRefused) => {
                self.next_at_ms = now_ms;
            }
            // Ask again soon: the answer may be corrected, replaced by another
            // validator's, or persist until the guard confirms it. The next
            // request watches the held answer, which the validator holds
            // until something changes; the backoff only spaces out answers
            // that come back at once.
            Ok(Applied::Held) => {
                let delay = self.backoff.fail().min(HOLD_RETRY_MAX_MS);
                self.next_at_ms = now_ms.saturating_add(delay);
            }
            Ok(Applied::StillHeld) => {
                self.next_at_ms = now_ms;
            }
            Ok(_) => {
                self.backoff.reset();
                self.next_at_ms = now_ms;
            }
            Err(e) => self.fail(now_ms, e),
        }
        result
    }

    /// Records that the request in flight failed without an answer.
    pub fn on_failure(&mut self, now_ms: u64, error: &SyncError) {
        self.in_flight = None;
        self.asked_pages = false;
        self.fail(now_ms, error);
    }

    fn fail(&mut self, now_ms: u64, error: &SyncError) {
        // A paged answer is dropped with any failure: the sync starts over.
        self.paged = None;
        if matches!(
            error,
            SyncError::Sequence { .. }
                | SyncError::Decode(_)
                | SyncError::DecodePacked(_)
                | SyncError::Page(PageError::TooLong(_))
        ) {
            // We may be out of step: the next attempt starts over.
            self.cursor = None;
            self.held = None;
        }
        self.next_at_ms = now_ms.saturating_add(self.backoff.fail());
    }

    /// The first page of a paged answer to `request`, if the answer is one
    /// (its headers name a longer whole): the reassembly it starts.
    fn first_page(
        &mut self,
        status: u32,
        page: &PageHeaders,
        answer: &mut dyn Answered,
        request: &Option<Request>,
        watching: bool,
    ) -> Result<Option<Reassembly>, SyncError> {
        // A poller without pages (or a build without them) never asks for
        // them.
        if !self.pages() || status != 200 {
            return Ok(None);
        }
        let (Some(first), Some(length)) = (request, &page.length) else {
            return Ok(None);
        };
        let total: u64 = length
            .trim()
            .parse()
            .map_err(|_| mismatch(format!("length {length:?} is not a number")))?;
        if total > MAX_ANSWER_BYTES {
            return Err(SyncError::Page(PageError::TooLong(total)));
        }
        let id = page
            .id
            .clone()
            .filter(|id| !id.is_empty())
            .ok_or_else(|| mismatch("the first page names no answer id".to_owned()))?;
        if page.offset.as_deref().is_some_and(|o| o.trim() != "0") {
            return Err(mismatch(format!(
                "the first page starts at {:?}",
                page.offset
            )));
        }
        let mut body = Vec::new();
        // One block of the whole's size: the native module's allocator maps
        // a block that large on its own and gives it back when it is freed.
        body.try_reserve_exact(total as usize)
            .map_err(|_| SyncError::Page(PageError::TooLong(total)))?;
        let mut paged = Reassembly {
            first: first.clone(),
            watching,
            id,
            total: total as usize,
            body,
        };
        read_page(&mut paged, answer)?;
        Ok(Some(paged))
    }

    /// A page after the first, asked for at `offset`.
    fn next_page(
        &mut self,
        now_ms: u64,
        status: u32,
        offset: u64,
        page: &PageHeaders,
        answer: &mut dyn Answered,
    ) -> Result<Applied, SyncError> {
        let Some(mut paged) = self.paged.take() else {
            return Err(mismatch(
                "a page of no answer being put together".to_owned(),
            ));
        };
        match status {
            200 => {}
            410 => return Err(SyncError::Page(PageError::Gone)),
            other => return Err(SyncError::Status(other)),
        }
        let total = paged.total.to_string();
        let offset = offset.to_string();
        let checks = [
            ("id", page.id.as_deref(), paged.id.as_str()),
            ("length", page.length.as_deref(), total.as_str()),
            ("offset", page.offset.as_deref(), offset.as_str()),
        ];
        for (what, got, want) in checks {
            if got.map(str::trim) != Some(want) {
                return Err(mismatch(format!("{what} {got:?}, expected {want:?}")));
            }
        }
        read_page(&mut paged, answer)?;
        self.received(now_ms, paged, answer)
    }

    /// After a page: the next one to ask for, or the whole to apply.
    fn received(
        &mut self,
        now_ms: u64,
        paged: Reassembly,
        answer: &mut dyn Answered,
    ) -> Result<Applied, SyncError> {
        if paged.body.len() < paged.total {
            let progress = Applied::Page {
                received: paged.body.len() as u64,
                total: paged.total as u64,
            };
            self.paged = Some(paged);
            return Ok(progress);
        }
        let Reassembly {
            first,
            watching,
            id: _,
            total: _,
            body,
        } = paged;
        self.paged_bytes = Some(body.len() as u64);
        // The whole, as if it had come in one answer.
        let mut whole = WithBody {
            store: answer,
            open: in_memory(Rc::new(body)),
        };
        self.apply(now_ms, Some(first), watching, 200, &mut whole)
    }

    fn apply(
        &mut self,
        now_ms: u64,
        request: Option<Request>,
        watching: bool,
        status: u32,
        answer: &mut dyn Answered,
    ) -> Result<Applied, SyncError> {
        if status != 200 {
            return Err(SyncError::Status(status));
        }
        // Both readers go a line or a byte at a time; a buffer makes that a
        // copy out of memory, and asks the host for large pieces.
        let mut body = BufReader::with_capacity(BODY_CHUNK, answer.body());
        // What we asked for ([`ACCEPT`]), or JSON from a validator that does
        // not serve it: the first bytes tell, and a packed answer's first
        // line its kind.
        let (is_packed, whole) = match body.fill_buf() {
            Ok(start) => (packed::starts_packed(start), packed::is_whole(start)),
            Err(_) => (false, None),
        };
        // A page is never applied alone (its whole goes as the request it
        // answers): should one come here, it is taken as a snapshot.
        let changes = match (request, is_packed) {
            (Some(Request::Snapshot | Request::Page { .. }) | None, true) => {
                return self.load_snapshot(now_ms, &Records::Packed, answer);
            }
            (Some(Request::Changes { .. }), true) if whole == Some(true) => {
                return self.load_snapshot(now_ms, &Records::Packed, answer);
            }
            (Some(Request::Snapshot | Request::Page { .. }) | None, false) => {
                Changes::Reset(Snapshot::decode_from(body).map_err(SyncError::Decode)?)
            }
            (Some(Request::Changes { .. }), true) => {
                packed::decode_changes(body, service_id, CompactRecord::of_packed)
                    .map_err(SyncError::DecodePacked)?
            }
            (Some(Request::Changes { .. }), false) => {
                Changes::decode_from(body).map_err(SyncError::Decode)?
            }
        };
        match changes {
            Changes::Reset(snapshot) => {
                self.load_snapshot(now_ms, &Records::Decoded(&snapshot), answer)
            }
            Changes::Delta(delta) if watching => self.watch_delta(now_ms, &delta, answer),
            Changes::Delta(delta) => self.apply_delta(now_ms, delta, answer),
        }
    }

    /// A delta answering the watch of a held answer. Unchanged, and not yet
    /// due for confirmation: the hold goes on and the data it keeps serving
    /// counts as synced now. Otherwise the next request asks from the
    /// applied generation again, so the guard judges the validator's whole
    /// answer anew (released, held again, or confirmed).
    fn watch_delta(
        &mut self,
        now_ms: u64,
        delta: &Delta<CompactRecord>,
        store: &mut dyn SharedData,
    ) -> Result<Applied, SyncError> {
        let continues = self
            .held
            .is_some_and(|h| delta.epoch == h.epoch && delta.since == h.generation);
        if continues && delta.is_empty() && !self.guard.confirm_due(now_ms) {
            self.held = Some(HeldAt {
                epoch: delta.epoch,
                generation: delta.generation,
            });
            self.writer.refresh(store, now_ms, delta.freshness.fresh)?;
            return Ok(Applied::StillHeld);
        }
        self.held = None;
        Ok(Applied::Held)
    }

    /// The guard held an answer (at `at`): its additions, `gains`, are
    /// written, the data it keeps serving is marked synced (fresh as the
    /// validator calls it), and the next request watches it.
    fn hold(
        &mut self,
        now_ms: u64,
        gains: &[&CompactRecord],
        at: HeldAt,
        fresh: bool,
        store: &mut dyn SharedData,
    ) -> Result<Applied, SyncError> {
        self.writer.write_hold(store, now_ms, fresh, gains)?;
        self.gains_written |= !gains.is_empty();
        self.held = Some(at);
        Ok(Applied::Held)
    }

    fn apply_delta(
        &mut self,
        now_ms: u64,
        delta: Delta<CompactRecord>,
        store: &mut dyn SharedData,
    ) -> Result<Applied, SyncError> {
        let (epoch, since, generation) = (delta.epoch, delta.since, delta.generation);
        let Some(cursor) = self.cursor else {
            return Err(SyncError::Sequence { since, ours: 0 });
        };
        if epoch != cursor.epoch || since != cursor.generation || generation < since {
            return Err(SyncError::Sequence {
                since,
                ours: cursor.generation,
            });
        }
        let answer = Answer::Delta(&delta);
        if !self.guard.admit(now_ms, answer) {
            let at = HeldAt { epoch, generation };
            let gains = self.guard.gains(answer);
            return self.hold(now_ms, &gains, at, delta.freshness.fresh, store);
        }
        self.held = None;
        let changed = self
            .writer
            .write_delta(store, now_ms, cursor.load, &delta)?;
        self.cursor = Some(Cursor {
            generation,
            ..cursor
        });
        if self.writer.outgrown() || std::mem::take(&mut self.gains_written) {
            // More than two IPs per bucket on average: readers' lookups grow.
            // Or a hold wrote additions this delta does not know of. The next
            // request is a snapshot, laid out anew.
            self.cursor = None;
        }
        self.guard.applied(now_ms, Answer::Delta(&delta));
        Ok(Applied::Delta { changed })
    }
}

/// The host as applying an answer needs it: shared data to write to, and
/// the answer's body, which a reset reads more than once.
pub trait Answered: SharedData {
    /// The answer's body, from its first byte.
    fn body(&self) -> Box<dyn Read>;
}

/// Shared data, and the body of the answer applied to it, which `open`
/// opens from the first byte (from the host that holds both, or from
/// memory).
pub struct WithBody<'a, S: ?Sized, F> {
    /// The shared data.
    pub store: &'a mut S,
    /// Opens the body.
    pub open: F,
}

impl<S: ?Sized, F> std::fmt::Debug for WithBody<'_, S, F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WithBody").finish_non_exhaustive()
    }
}

impl<S: SharedData + ?Sized, F> SharedData for WithBody<'_, S, F> {
    fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, u32), StoreError> {
        self.store.get(key)
    }

    fn set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        self.store.set(key, value, cas)
    }
}

impl<S: SharedData + ?Sized, F: Fn(&S) -> Box<dyn Read>> Answered for WithBody<'_, S, F> {
    fn body(&self) -> Box<dyn Read> {
        (self.open)(self.store)
    }
}

/// Opens `body`, held in memory, for any store.
fn in_memory<S: ?Sized>(body: Rc<Vec<u8>>) -> impl Fn(&S) -> Box<dyn Read> {
    move |_| Box::new(std::io::Cursor::new(Lent(Rc::clone(&body))))
}

/// A body held in memory, lent to each reader of it.
struct Lent(Rc<Vec<u8>>);

impl AsRef<[u8]> for Lent {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

fn mismatch(what: String) -> SyncError {
    SyncError::Page(PageError::Mismatch(what))
}

/// Appends the page `answer` carries to `paged`: never past the whole's
/// length (the buffer never grows), and never an empty page.
fn read_page(paged: &mut Reassembly, answer: &dyn Answered) -> Result<(), SyncError> {
    let start = paged.body.len();
    // Within the capacity reserved at the whole's length: never moved.
    paged.body.resize(paged.total, 0);
    let mut reader = answer.body();
    let mut filled = start;
    let mut failed = None;
    while filled < paged.total {
        match reader.read(&mut paged.body[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                failed = Some(e);
                break;
            }
        }
    }
    paged.body.truncate(filled);
    if let Some(e) = failed {
        return Err(mismatch(format!("unreadable page: {e}")));
    }
    let mut more = [0u8; 1];
    if reader.read(&mut more).unwrap_or(0) > 0 {
        return Err(mismatch(
            "the page runs past the answer's length".to_owned(),
        ));
    }
    if filled == start {
        return Err(mismatch("an empty page before the end".to_owned()));
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests;
