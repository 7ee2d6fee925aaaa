//! One request's path through the filter: the verdict ([`crate::judgement`]),
//! counting it, the reply of a rejection, and a replay's start and steps
//! ([`crate::replay`]). Every host operation goes through [`Host`]; an
//! adapter only forwards its host's HTTP callbacks here.

use std::cell::RefCell;
use std::fmt;
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::Duration;

use staleguard_core::verdict::{FailurePolicy, Reason};

use crate::cache::Cache;
use crate::config::{Config, Fallback, RetryConfig, CONFIG_REFUSED};
use crate::host::{Host, Next};
use crate::judgement::{header_value, judge, Effect, Lazy, Ruling, UpstreamRef};
use crate::log_budget::LogBudget;
use crate::members;
use crate::metrics::{self, Count, Counted, LabelId, VmMetrics};
use crate::replay::{self, CallResult, Ineligible, Replay, ReplayOutcome, Step, TwinConfig};
use crate::steer::{self, SteerConfig};
use crate::store::IndexReader;

/// What the root context and every request of one VM share: the plugin
/// configuration (or, when it was refused, the fallback), the metric tally,
/// the verdict cache and the log budget.
#[derive(Clone)]
pub(crate) struct VmState {
    pub(crate) config: Option<Rc<Config>>,
    pub(crate) fallback: Option<Rc<Fallback>>,
    pub(crate) metrics: Rc<RefCell<VmMetrics>>,
    pub(crate) cache: Rc<RefCell<Cache>>,
    pub(crate) log_budget: Rc<RefCell<LogBudget>>,
}

impl VmState {
    /// A request while the VM has no configuration: through untouched when
    /// none was ever given, else what the refused configuration's failure
    /// policy says, counted.
    pub(crate) fn unconfigured<H: Host>(&self, host: &mut H) -> Next {
        let Some(fallback) = &self.fallback else {
            return Next::Continue;
        };
        self.metrics
            .borrow_mut()
            .inc(host, metrics::REQUESTS_UNCONFIGURED, 1);
        match fallback.failure_policy {
            FailurePolicy::Open => Next::Continue,
            FailurePolicy::Closed => {
                let headers = [(fallback.reject_header.as_str(), CONFIG_REFUSED)];
                let body = format!("staleguard: {CONFIG_REFUSED}\n");
                host.send_reply(fallback.reject_status, &headers, Some(body.as_bytes()));
                Next::Pause
            }
        }
    }
}

/// The lazy reads of `judgement::judge`, from a host.
#[derive(Debug)]
pub struct LazyReads<'a, H: ?Sized>(pub &'a H);

impl<H: Host + ?Sized> Lazy for LazyReads<'_, H> {
    fn istio_service_host(&self) -> Option<String> {
        // Istio lists the services a cluster serves in its metadata; the
        // first one is the service (a cluster per service and port).
        self.0.property(&[
            "xds",
            "cluster_metadata",
            "filter_metadata",
            "istio",
            "services",
            "0",
            "host",
        ])
    }

    fn now_ms(&self) -> u64 {
        self.0.coarse_now_ms()
    }
}

/// The HTTP context of one request.
pub struct Filter {
    id: u32,
    vm: Rc<VmState>,
    /// Set in a twin cluster's VM: this instance only checks its pick.
    twin: Option<Rc<TwinConfig>>,
    /// Set on the body path's hop: this instance only names live members.
    steer: Option<Rc<SteerConfig>>,
    /// A replay in flight (see `crate::replay`).
    replay: Option<Pending>,
    /// The header to take out of the upstream's answer (see
    /// `response_headers`).
    strip_answer: Option<String>,
}

impl fmt::Debug for Filter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Filter")
            .field("id", &self.id)
            .field("replaying", &self.replay.is_some())
            .finish_non_exhaustive()
    }
}

/// What a paused request needs to go on replaying.
struct Pending {
    replay: Replay,
    /// The service's metric label.
    label: LabelId,
    token: Option<u32>,
    twin_cluster: String,
    headers: Vec<(String, String)>,
    reason: staleguard_core::Reason,
    /// Body size of the last answer.
    body_size: usize,
    /// Headers of the last answer.
    answer: Vec<(String, String)>,
}

impl Filter {
    /// A request's context over its VM's shared state (see `Root::filter`).
    pub(crate) fn new(
        id: u32,
        vm: Rc<VmState>,
        twin: Option<Rc<TwinConfig>>,
        steer: Option<Rc<SteerConfig>>,
    ) -> Self {
        Self {
            id,
            vm,
            twin,
            steer,
            replay: None,
            strip_answer: None,
        }
    }

    /// True while a replay waits for an answer.
    pub fn replaying(&self) -> bool {
        self.replay.is_some()
    }

    /// True once the request needs nothing more of this context: no replay
    /// under way, no header to take out of the upstream's answer. An adapter
    /// may drop it then; its later hooks have nothing to do.
    pub fn done(&self) -> bool {
        self.replay.is_none() && self.strip_answer.is_none()
    }

    /// The request's headers arrived: judge the host Envoy chose, and let the
    /// request through, reject it, or start replaying it.
    pub fn request_headers<H: Host>(&mut self, host: &mut H, end_of_stream: bool) -> Next {
        if let Some(twin) = self.twin.clone() {
            return self.twin_request(host, &twin);
        }
        if let Some(steer) = self.steer.clone() {
            return self.steer_request(host, &steer);
        }
        let Some(config) = self.vm.config.clone() else {
            return self.vm.unconfigured(host);
        };
        // The host's texts are read lent, not copied; a replay, the one
        // path that needs them afterwards, copies what it needs here.
        let (ruling, replay_target) = {
            let (cluster, address) = host.upstream_texts();
            let upstream = UpstreamRef {
                cluster: cluster.as_deref(),
                address: address.as_deref(),
            };
            let ruling = judge(
                &config,
                &mut self.vm.cache.borrow_mut(),
                &*host,
                upstream,
                &LazyReads(&*host),
            );
            let target = match (&ruling, config.replay()) {
                (
                    Ruling::Judged {
                        effect: Effect::Reject { .. },
                        ..
                    },
                    Some(_),
                ) => Some(ReplayTarget::of(upstream)),
                _ => None,
            };
            (ruling, target)
        };
        let mut m = self.vm.metrics.borrow_mut();
        let (service, ip, verdict, effect) = match ruling {
            Ruling::Unmapped => {
                m.count(host, Count::Unmapped);
                return Next::Continue;
            }
            Ruling::NoAddress => {
                m.count(host, Count::NoAddress);
                return Next::Continue;
            }
            Ruling::OutOfScope => {
                m.count(host, Count::OutOfScope);
                return Next::Continue;
            }
            Ruling::Judged {
                service,
                ip,
                verdict,
                effect,
            } => (service, ip, verdict, effect),
        };
        let label = m.services.id(&service);
        // Most requests: allowed, and nothing to do but count them (the
        // rest of this hook is what any other verdict does).
        if effect == Effect::Allow
            && !matches!(verdict.reason, Reason::Destroyed | Reason::Recycled)
        {
            m.count(
                host,
                Count::Request {
                    label,
                    reason: verdict.reason,
                    action: Counted::Effect(effect),
                },
            );
            drop(m);
            if !end_of_stream {
                self.strip_answer = Some(config.reject_header.clone());
            }
            return Next::Continue;
        }
        let service = &service.key;
        drop(m);
        // The body path steers while stale picks are seen (`crate::steer`).
        if matches!(verdict.reason, Reason::Destroyed | Reason::Recycled) {
            let now_ms = host.now_ms();
            steer::record_stale_pick(host, service, now_ms);
        }
        // A rejection becomes a replay where one is configured and the
        // request is eligible; the decision is `crate::replay`'s.
        let mut replay_step = None;
        if let (Some(target), Some(retry)) = (replay_target, config.replay()) {
            match self.start_replay(
                host,
                retry,
                service,
                &target.cluster,
                target.stale,
                verdict.reason,
                end_of_stream,
            ) {
                Ok(step) => replay_step = Some(step),
                Err(cause) => self.vm.metrics.borrow_mut().inc(
                    host,
                    &metrics::retries(ReplayOutcome::NotEligible(cause)),
                    1,
                ),
            }
        }
        // A replay counts its verdict when it ends (`finish`).
        if let Some(pending) = self.replay.as_mut() {
            pending.label = label;
        }
        if replay_step.is_none() {
            self.vm.metrics.borrow_mut().count(
                host,
                Count::Request {
                    label,
                    reason: verdict.reason,
                    action: Counted::Effect(effect),
                },
            );
        }
        if effect != Effect::Allow {
            if let Some(skipped) = self.vm.log_budget.borrow_mut().allow(host.now_ms()) {
                let more = if skipped > 0 {
                    format!(" ({skipped} similar lines suppressed)")
                } else {
                    String::new()
                };
                let action = if replay_step.is_some() {
                    "retry"
                } else {
                    effect.as_str()
                };
                log::info!(
                    "[ctx {}] staleguard: {action} host {ip} of {service}: {}{more}",
                    self.id,
                    verdict.reason.as_str()
                );
            }
        }
        if let Some(step) = replay_step {
            self.drive(host, step);
            return Next::Pause;
        }
        match effect {
            Effect::Allow | Effect::Audit => {
                if !end_of_stream {
                    self.strip_answer = Some(config.reject_header.clone());
                }
                Next::Continue
            }
            Effect::Reject { status } => {
                reject(host, &config, status, verdict.reason);
                Next::Pause
            }
        }
    }

    /// The upstream's answer headers arrived. For a request with a body the
    /// filter let through (or steered), the reject header goes: the body
    /// path's route retries an answer that carries it (docs/filter.md,
    /// "Requests with a body"), and only the filter's own rejection may,
    /// never a backend's.
    pub fn response_headers<H: Host>(&mut self, host: &mut H) -> Next {
        if let Some(header) = self.strip_answer.take() {
            host.remove_response_header(&header);
        }
        Next::Continue
    }

    /// The answer to a replay's call arrived (or the call failed).
    pub fn call_response<H: Host>(
        &mut self,
        host: &mut H,
        token: u32,
        headers: usize,
        body_size: usize,
    ) {
        let vm_config = self.vm.config.clone();
        let Some((_, retry, pending)) = under_way(vm_config.as_deref(), &mut self.replay) else {
            return;
        };
        if pending.token != Some(token) {
            return;
        }
        pending.token = None;
        pending.body_size = body_size;
        // A failed call has no header map (asking for one is BadArgument).
        let answer = (headers > 0).then(|| {
            host.call_headers()
                .into_iter()
                .map(|(k, v)| (k, String::from_utf8_lossy(&v).into_owned()))
                .collect::<Vec<_>>()
        });
        let result = replay::classify(retry, answer.as_deref(), body_size);
        pending.answer = answer.unwrap_or_default();
        let step = pending.replay.on_result(host.now_ms(), result);
        self.drive(host, step);
    }

    /// The twin's whole job: let through a pick the origin named (without the
    /// endpoint header), fail any other at once.
    fn twin_request<H: Host>(&mut self, host: &mut H, twin: &TwinConfig) -> Next {
        let named = host.request_header(&twin.endpoint_header);
        let address = host.property(&["upstream", "address"]);
        let ok = replay::twin_pick_is_named(named.as_deref(), address.as_deref());
        self.vm
            .metrics
            .borrow_mut()
            .inc(host, &metrics::twin_picks(ok), 1);
        if ok {
            host.remove_request_header(&twin.endpoint_header);
            return Next::Continue;
        }
        log::debug!(
            "[ctx {}] staleguard twin: pick {address:?} not among {named:?}",
            self.id
        );
        host.send_reply(503, &[(replay::TWIN_MISS_HEADER, "1")], None);
        Next::Pause
    }

    /// The steering role's whole job (`crate::steer`): while the guard saw
    /// stale picks of the service recently, name its live members in the
    /// endpoint header; otherwise, or when the index names none, leave the
    /// request to the guarded cluster; never pause.
    fn steer_request<H: Host>(&mut self, host: &mut H, steer: &SteerConfig) -> Next {
        let now_ms = host.now_ms();
        let fresh = IndexReader::new(&*host)
            .meta()
            .filter(|m| m.is_fresh(now_ms, steer.max_staleness_ms));
        let members = match (fresh, steer.key()) {
            (Some(meta), Some(service)) if steer.during_incident(&*host, &service, now_ms) => {
                members::read(&*host, &service, meta.load)
            }
            _ => Vec::new(),
        };
        match steer.endpoint_value(&members, host.random_u64()) {
            Some(value) => {
                host.set_request_header(&steer.endpoint_header, &value);
                self.strip_answer = Some(steer.reject_header.clone());
            }
            // Whatever a client sent must not pick the host instead.
            None => host.remove_request_header(&steer.endpoint_header),
        }
        Next::Continue
    }

    /// Starts replaying a rejected request, or says why it cannot be.
    #[allow(clippy::too_many_arguments)]
    fn start_replay<H: Host>(
        &mut self,
        host: &mut H,
        retry: &RetryConfig,
        service: &staleguard_core::ServiceKey,
        cluster: &str,
        stale: Option<SocketAddr>,
        reason: staleguard_core::Reason,
        end_of_stream: bool,
    ) -> Result<Step, Ineligible> {
        replay::reason_allows_replay(reason)?;
        let headers = replay::text_headers(host.request_headers())?;
        replay::eligibility(retry, &headers, end_of_stream)?;
        let batches = match (IndexReader::new(&*host).meta(), stale) {
            (Some(meta), Some(stale)) => {
                let live = members::read(&*host, service, meta.load);
                replay::plan(retry, &live, stale, host.random_u64())
            }
            _ => Vec::new(),
        };
        let timeout = replay::timeout_ms(retry, &headers);
        let (state, step) = Replay::start(batches, host.now_ms(), timeout);
        self.replay = Some(Pending {
            replay: state,
            token: None,
            twin_cluster: retry.twin_name(cluster),
            headers,
            reason,
            label: LabelId::default(),
            body_size: 0,
            answer: Vec::new(),
        });
        Ok(step)
    }

    /// Carries out `step`s until one waits for an answer (`Pause`) or ends the
    /// request.
    fn drive<H: Host>(&mut self, host: &mut H, mut step: Step) {
        let vm_config = self.vm.config.clone();
        loop {
            let Some((config, retry, pending)) = under_way(vm_config.as_deref(), &mut self.replay)
            else {
                return;
            };
            match step {
                Step::Send { hosts, timeout_ms } => {
                    let headers =
                        replay::request_headers(&pending.headers, &retry.endpoint_header, &hosts);
                    let headers: Vec<(&str, &str)> = headers
                        .iter()
                        .map(|(k, v)| (k.as_str(), v.as_str()))
                        .collect();
                    match host.dispatch_call(
                        &pending.twin_cluster,
                        &headers,
                        Duration::from_millis(timeout_ms),
                    ) {
                        Ok(token) => {
                            pending.token = Some(token);
                            return;
                        }
                        Err(status) => {
                            // No twin cluster (a deploy without one) or no
                            // room for a call: this batch failed. Logged
                            // within the verdict log budget: a missing twin
                            // fails every replay.
                            if self
                                .vm
                                .log_budget
                                .borrow_mut()
                                .allow(host.now_ms())
                                .is_some()
                            {
                                log::warn!(
                                    "[ctx {}] staleguard: cannot call the twin cluster {:?} ({status}): is it configured? (docs/filter.md, \"Retry\")",
                                    self.id,
                                    pending.twin_cluster
                                );
                            }
                            step = pending.replay.on_result(host.now_ms(), CallResult::Failed);
                        }
                    }
                }
                Step::Deliver => {
                    let body_size = pending.body_size;
                    let status = host.call_status().unwrap_or(502);
                    let headers = std::mem::take(&mut pending.answer);
                    let filler = replay::head_filler(&pending.headers, &headers);
                    self.finish(host, ReplayOutcome::Answered);
                    let headers = replay::response_headers(&headers);
                    let headers: Vec<(&str, &str)> = headers
                        .iter()
                        .map(|(k, v)| (k.as_str(), v.as_str()))
                        .collect();
                    let body = match filler {
                        Some(n) => vec![b' '; n],
                        None => host.call_body(0, body_size).unwrap_or_default(),
                    };
                    host.send_reply(status, &headers, Some(&body));
                    return;
                }
                Step::Fail(ReplayOutcome::Timeout) => {
                    self.finish(host, ReplayOutcome::Timeout);
                    // What the router itself answers when a route times out.
                    host.send_reply(
                        504,
                        &[("content-type", "text/plain")],
                        Some(b"upstream request timeout"),
                    );
                    return;
                }
                Step::Fail(outcome) => {
                    let reason = pending.reason;
                    self.finish(host, outcome);
                    reject(host, config, config.reject_status, reason);
                    return;
                }
            }
        }
    }

    fn finish<H: Host>(&mut self, host: &mut H, outcome: ReplayOutcome) {
        if let Some(pending) = self.replay.take() {
            // The verdict counter says what the client got: a replayed
            // answer (`retry`) or the rejection.
            let action = if replay::counts_as_retry(outcome) {
                Counted::Replayed
            } else {
                Counted::Effect(Effect::Reject {
                    status: self.vm.config.as_deref().map_or(503, |c| c.reject_status),
                })
            };
            self.vm.metrics.borrow_mut().count(
                host,
                Count::Request {
                    label: pending.label,
                    reason: pending.reason,
                    action,
                },
            );
            if outcome != ReplayOutcome::Answered {
                log::debug!(
                    "[ctx {}] staleguard: replay ended {} after {} calls",
                    self.id,
                    outcome.as_str(),
                    pending.replay.attempts()
                );
            }
        }
        self.vm
            .metrics
            .borrow_mut()
            .inc(host, &metrics::retries(outcome), 1);
    }
}

/// What a replay needs of the upstream the rejected request was aimed at,
/// copied out of the host's lent texts.
struct ReplayTarget {
    /// The guarded cluster (its twin is named after it).
    cluster: String,
    /// The stale host, not to be picked again.
    stale: Option<SocketAddr>,
}

impl ReplayTarget {
    fn of(upstream: UpstreamRef<'_>) -> Self {
        Self {
            cluster: upstream.cluster.unwrap_or_default().to_owned(),
            stale: upstream.address.and_then(|a| a.parse().ok()),
        }
    }
}

/// The replay under way and what it runs by: the configuration and its retry
/// settings. `None` when there is no configuration, it does not replay, or
/// the request has no replay.
fn under_way<'c, 'r>(
    config: Option<&'c Config>,
    replay: &'r mut Option<Pending>,
) -> Option<(&'c Config, &'c RetryConfig, &'r mut Pending)> {
    let config = config?;
    Some((config, config.replay()?, replay.as_mut()?))
}

/// The filter's own answer to a rejected request: `status`, the reason in
/// the configured header and in the body.
fn reject<H: Host>(host: &mut H, config: &Config, status: u32, reason: staleguard_core::Reason) {
    let reason = header_value(reason);
    let headers = [(config.reject_header.as_str(), reason)];
    let body = format!("staleguard: {reason}\n");
    host.send_reply(status, &headers, Some(body.as_bytes()));
}

#[cfg(test)]
mod tests;
