//! The one-command demonstration (`scripts/demo`): a stuck control plane, real
//! Envoy with and without staleguard, and a live table of where requests went.
//!
//! Two gateways read the same frozen EDS files; one runs the filter (enforce),
//! the other does not. Traffic flows through both while the demo destroys pods
//! at the incident's proportions (25 -> 2 by default), leaves their addresses
//! blackholed, refusing or hung, gives some to another service and drains
//! others. Every change goes
//! through [`Scene::sync`]: the validator and the filter see it before anything
//! new answers on an address, as in a real cluster where an IP is reused well
//! after the deletion is visible (see [`crate::world`]).
//!
//! While the control plane is stuck, the demo also audits both gateways
//! (`staleguard-validator audit`, see docs/audit.md): the endpoints each still
//! holds that are destroyed or recycled, found with no traffic at all.
//!
//! The table counts where requests *landed*, at the simulated pods, by gateway:
//! that is the number an operator cares about (requests that reached a dead or
//! wrong pod), not what any log claims.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::io::{IsTerminal, Write as _};
use std::time::{Duration, Instant};

use anyhow::Result;
use serde_json::json;

use crate::envoy::stats::{STAT_FRESH, STAT_REQUESTS_PREFIX};
use crate::envoy::{shipped_route_retry_policy, Gateway};
use crate::pods::{Occupant, Tally};
use crate::scene::{Deps, Expect, Scene};
use crate::traffic::{Load, Outcomes};
use crate::world::World;

/// The guarded gateway's name (`x-sg-via`).
pub const GUARDED: &str = "guarded";
/// The unguarded gateway's name.
pub const PLAIN: &str = "unguarded";

/// What the demo does.
#[derive(Debug, Clone)]
pub struct Options {
    /// Stop after this long; `None`: run until Ctrl-C.
    pub duration: Option<Duration>,
    /// Pods of the big service before each scale-down.
    pub checkout_pods: usize,
    /// Pods it keeps.
    pub checkout_keep: usize,
    /// Redraw the table in place (a terminal) or print events as lines.
    pub live: bool,
}

/// What the demo measured, by gateway.
#[derive(Debug, Clone, Default)]
pub struct Summary {
    /// Requests sent through the guarded gateway, as the clients saw them.
    pub guarded: Outcomes,
    /// Requests sent through the unguarded gateway.
    pub plain: Outcomes,
    /// Where the guarded gateway's requests landed.
    pub guarded_landed: Tally,
    /// Where the unguarded gateway's requests landed.
    pub plain_landed: Tally,
}

const CART_PODS: usize = 6;
/// Freed `checkout` IPs given to `payments` at the recycle step (6 of the
/// incident's 23 stale IPs).
const RECYCLED: usize = 6;
const SERVICES: [(&str, usize); 3] = [("cart", CART_PODS), ("payments", 4), ("search", 6)];

/// A step of the story, at an offset from the start of its cycle.
#[derive(Debug, Clone, Copy)]
enum Step {
    Freeze,
    ScaleDown,
    Recycle,
    Audit,
    Drain,
    Unfreeze,
    ScaleUp,
}

const CYCLE: [(u64, Step); 7] = [
    (2, Step::Freeze),
    (4, Step::ScaleDown),
    (9, Step::Recycle),
    (11, Step::Audit),
    (14, Step::Drain),
    (22, Step::Unfreeze),
    (26, Step::ScaleUp),
];
const CYCLE_SECS: u64 = 30;

/// Runs the demo until the duration passes or Ctrl-C / SIGTERM, then stops
/// every process it started and returns what it measured.
pub async fn run(deps: &Deps, options: &Options) -> Result<Summary> {
    let mut interrupt = Interrupt::new()?;
    let started = Instant::now();
    let mut ui = Ui::new(options.live, started);
    ui.progress(&format!(
        "starting {} services ({} pods) on 127.0.1.x, the validator and two Envoys",
        SERVICES.len() + 1,
        options.checkout_pods + SERVICES.iter().map(|(_, n)| n).sum::<usize>()
    ));
    let setup = async {
        let mut world = World::new()?;
        world.add_service("checkout", options.checkout_pods).await?;
        for (name, pods) in SERVICES {
            world.add_service(name, pods).await?;
        }
        anyhow::Ok(world)
    };
    let start = async {
        let world = setup.await?;
        // Retry on, as deploy/ ships it: a rejected request without a body is
        // replayed to a live pod of its service (docs/filter.md, "Retry"),
        // and both gateways' routes re-pick after a refused connection as
        // the shipped routes do.
        let gateways =
            [world.guarded(GUARDED, json!({})), world.unguarded(PLAIN)].map(|g| Gateway {
                detach: true,
                route_extra: json!({"retry_policy": shipped_route_retry_policy()}),
                ..g
            });
        Scene::start(deps, world, &["--file-poll", "100ms"], &gateways).await
    };
    // A signal while starting drops the half-built scene, which stops what
    // it had started.
    let mut scene = tokio::select! {
        scene = start => scene?,
        _ = interrupt.recv() => {
            ui.progress("interrupted while starting; stopped");
            return Ok(Summary::default());
        }
    };
    ui.urls = urls(&scene)?;
    ui.event("all healthy; traffic flows through both gateways");

    let mut loads = Vec::new();
    for gateway in &scene.gateways {
        for service in ["checkout", "cart", "payments", "search"] {
            let workers = if service == "checkout" { 2 } else { 1 };
            loads.push((
                gateway.name.clone(),
                Load::start(
                    scene.http.clone(),
                    gateway.target(service),
                    workers,
                    None,
                    Some(Duration::from_millis(10)),
                ),
            ));
        }
    }

    let deadline = options.duration.map(|d| Instant::now() + d);
    let mut next_step = 0usize;
    let mut cycle_start = Instant::now();
    let mut frozen_since: Option<Instant> = None;
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    loop {
        tokio::select! {
            _ = interrupt.recv() => {
                ui.event("stopping (signal)");
                break;
            }
            _ = tick.tick() => {}
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            break;
        }
        if let Some(&(at, step)) = CYCLE.get(next_step) {
            if cycle_start.elapsed() >= Duration::from_secs(at) {
                next_step += 1;
                play(&mut scene, &mut ui, deps, options, step, &mut frozen_since).await?;
            }
        } else if cycle_start.elapsed() >= Duration::from_secs(CYCLE_SECS) {
            next_step = 0;
            cycle_start = Instant::now();
        }
        for gateway in &scene.gateways {
            gateway.check_alive()?;
        }
        let summary = summarize(&scene, &loads);
        let verdicts = verdicts(&scene);
        ui.draw(&summary, &verdicts, frozen_since);
    }

    let summary = summarize(&scene, &loads);
    let verdicts = verdicts(&scene);
    for (_, load) in loads {
        load.stop().await;
    }
    ui.finish(&summary, &verdicts, frozen_since);
    drop(scene);
    Ok(summary)
}

async fn play(
    scene: &mut Scene,
    ui: &mut Ui,
    deps: &Deps,
    options: &Options,
    step: Step,
    frozen_since: &mut Option<Instant>,
) -> Result<()> {
    let t0 = Instant::now();
    match step {
        Step::Freeze => {
            scene.world.freeze_eds();
            *frozen_since = Some(Instant::now());
            ui.event("control plane STUCK: EDS frozen, gateways keep old endpoints");
        }
        Step::ScaleDown => {
            let gone = scene.world.scale_down("checkout", options.checkout_keep)?;
            // The four kinds of stale IP (issue 21): the first freed IPs go
            // to payments at the recycle step; the others hang, refuse or
            // drop SYNs, in turn.
            let recycled: Vec<_> = scene.world.free_ips().into_iter().take(RECYCLED).collect();
            let mut kinds = [0usize; 3];
            for (i, ip) in gone.iter().filter(|ip| !recycled.contains(ip)).enumerate() {
                let kind = i % 3;
                kinds[kind] += 1;
                let occupant =
                    [Occupant::Blackholed, Occupant::Refusing, Occupant::Hung][kind].clone();
                scene.world.leave_as(*ip, occupant)?;
            }
            let expect: Vec<Expect> = gone
                .iter()
                .map(|ip| (World::key("checkout"), *ip, "destroyed"))
                .collect();
            scene.sync(&expect).await?;
            ui.event(&format!(
                "checkout -> {} pods: {} destroyed (guard in sync after {:.2}s): \
                 {} blackholed, {} refusing, {} hung, {} to be recycled",
                options.checkout_keep,
                gone.len(),
                t0.elapsed().as_secs_f64(),
                kinds[0],
                kinds[1],
                kinds[2],
                gone.len() - kinds.iter().sum::<usize>(),
            ));
        }
        Step::Recycle => {
            let free = scene.world.free_ips();
            let mut expect = Vec::new();
            for ip in free.iter().take(RECYCLED) {
                scene.world.recycle(*ip, "payments")?;
                expect.push((World::key("checkout"), *ip, "recycled"));
            }
            scene.sync(&expect).await?;
            ui.event(&format!(
                "IP reuse: {} freed checkout IPs now serve payments (sync {:.2}s)",
                expect.len(),
                t0.elapsed().as_secs_f64()
            ));
        }
        Step::Audit => {
            // What an operator sees with no traffic at all: the endpoints
            // each gateway still holds that are gone or someone else's.
            ui.audits.clear();
            for gateway in &scene.gateways {
                let args = |extra: &[&str]| -> Vec<String> {
                    [
                        "--admin",
                        &gateway.admin.to_string(),
                        "--validator",
                        &format!("http://{}", scene.validator.listen),
                        "--gateway",
                        &gateway.name,
                    ]
                    .iter()
                    .chain(extra)
                    .map(|s| s.to_string())
                    .collect()
                };
                let json = crate::audit::run(&deps.validator, &args(&["--output", "json"])).await?;
                let line = match json.json() {
                    Ok(doc) => audit_line(&doc),
                    Err(_) => format!("audit failed ({}): {}", json.code, json.stderr.trim()),
                };
                ui.audits.push((gateway.name.clone(), line));
                if !ui.live {
                    let table =
                        crate::audit::run(&deps.validator, &args(&["--stale-only"])).await?;
                    print!("{}", table.stdout);
                }
            }
            ui.event("audited both gateways (staleguard-validator audit): see \"audit\"");
        }
        Step::Drain => {
            let mut expect = Vec::new();
            for pod in scene.world.pods_of("cart").iter().take(2) {
                let ip = scene.world.mark_terminating(&pod.name)?;
                expect.push((World::key("cart"), ip, "terminating"));
            }
            scene.sync(&expect).await?;
            ui.event(&format!(
                "draining: {} cart pods terminating, still serving (rule: allow)",
                expect.len()
            ));
        }
        Step::Unfreeze => {
            // The drained pods finish now, and the control plane catches up.
            let mut expect = Vec::new();
            for pod in scene.world.pods_of("cart") {
                if pod.terminating {
                    let ip = scene.world.destroy(&pod.name)?;
                    expect.push((World::key("cart"), ip, "destroyed"));
                }
            }
            scene.world.unfreeze_eds();
            scene.sync(&expect).await?;
            *frozen_since = None;
            ui.event("control plane recovered: EDS written again");
        }
        Step::ScaleUp => {
            // New pods take freed IPs (their deletion was synced long ago, so
            // the new pods may answer before anyone knows them, as in a real
            // cluster), then fresh ones.
            let want = options
                .checkout_pods
                .saturating_sub(scene.world.pods_of("checkout").len());
            let mut expect = Vec::new();
            for ip in scene.world.free_ips().into_iter().take(want) {
                scene.world.recycle(ip, "checkout")?;
                expect.push((World::key("checkout"), ip, "member"));
            }
            scene
                .world
                .scale_up("checkout", want.saturating_sub(expect.len()))
                .await?;
            let cart_missing = CART_PODS.saturating_sub(scene.world.pods_of("cart").len());
            scene.world.scale_up("cart", cart_missing).await?;
            scene.world.settle();
            scene.sync(&expect).await?;
            ui.event(&format!(
                "checkout back to {} pods; next round soon",
                options.checkout_pods
            ));
        }
    }
    Ok(())
}

fn summarize(scene: &Scene, loads: &[(String, Load)]) -> Summary {
    let mut summary = Summary::default();
    for (gateway, load) in loads {
        let outcomes = load.outcomes();
        let into = if gateway == GUARDED {
            &mut summary.guarded
        } else {
            &mut summary.plain
        };
        *into = add(into, &outcomes);
    }
    let tallies = scene.world.tallies();
    summary.guarded_landed = tallies.get(GUARDED).copied().unwrap_or_default();
    summary.plain_landed = tallies.get(PLAIN).copied().unwrap_or_default();
    summary
}

fn add(a: &Outcomes, b: &Outcomes) -> Outcomes {
    let mut sum = a.clone();
    sum.right += b.right;
    sum.wrong_service += b.wrong_service;
    sum.dead += b.dead;
    sum.errors += b.errors;
    for (k, v) in &b.rejected {
        *sum.rejected.entry(k.clone()).or_default() += v;
    }
    for (k, v) in &b.other_status {
        *sum.other_status.entry(*k).or_default() += v;
    }
    sum
}

/// `(service reason, action, count)` from the guarded gateway's filter
/// counters: `default/cart member`, `allow`, ...
fn verdicts(scene: &Scene) -> Vec<(String, String, u64)> {
    let Ok(gateway) = scene.gateway(GUARDED) else {
        return Vec::new();
    };
    let Ok(stats) = gateway.stats() else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for (name, value) in &stats {
        let Some((service, rest)) = name
            .strip_prefix(STAT_REQUESTS_PREFIX)
            .and_then(|r| r.split_once(".reason."))
        else {
            continue;
        };
        if let Some((reason, action)) = rest.split_once(".action.") {
            if *value > 0 {
                out.push((format!("{service} {reason}"), action.to_owned(), *value));
            }
        }
    }
    let fresh = stats.get(STAT_FRESH).copied().unwrap_or(0);
    out.push(("index_fresh".into(), String::new(), fresh));
    out
}

fn urls(scene: &Scene) -> Result<Vec<(String, String)>> {
    let guarded = scene.gateway(GUARDED)?;
    let plain = scene.gateway(PLAIN)?;
    Ok(vec![
        (
            "guarded Envoy".into(),
            format!("http://{}/stats/prometheus  (staleguard_*)", guarded.admin),
        ),
        (
            "unguarded Envoy".into(),
            format!("http://{}/stats/prometheus", plain.admin),
        ),
        (
            "validator".into(),
            format!("http://{}/metrics", scene.validator.admin),
        ),
        (
            "validator index".into(),
            format!("http://{}/v1/snapshot", scene.validator.listen),
        ),
        (
            "try it".into(),
            format!("curl -si -H 'host: checkout' http://{}/", guarded.listener),
        ),
    ])
}

/// SIGINT, SIGTERM and SIGHUP, caught from the start: the demo's children run
/// in their own process group (see [`Gateway::detach`]), so the demo must
/// never die of a signal without stopping them, not even while it starts.
#[derive(Debug)]
struct Interrupt {
    #[cfg(unix)]
    signals: Vec<tokio::signal::unix::Signal>,
}

impl Interrupt {
    fn new() -> Result<Self> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            let signals = [
                SignalKind::interrupt(),
                SignalKind::terminate(),
                SignalKind::hangup(),
            ]
            .into_iter()
            .map(signal)
            .collect::<std::io::Result<Vec<_>>>()?;
            Ok(Self { signals })
        }
        #[cfg(not(unix))]
        Ok(Self {})
    }

    /// Resolves at the first of the signals.
    async fn recv(&mut self) {
        #[cfg(unix)]
        {
            let waits = self.signals.iter_mut().map(|s| Box::pin(s.recv()));
            let _ = futures_select_all(waits.collect()).await;
        }
        #[cfg(not(unix))]
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// The first of several futures to resolve.
async fn futures_select_all<F: std::future::Future + Unpin>(mut futures: Vec<F>) {
    std::future::poll_fn(|cx| {
        for f in futures.iter_mut() {
            if std::pin::Pin::new(f).poll(cx).is_ready() {
                return std::task::Poll::Ready(());
            }
        }
        std::task::Poll::Pending
    })
    .await
}

// === impl Ui ===

/// The terminal view: a table redrawn in place, or plain lines when not a
/// terminal.
#[derive(Debug)]
struct Ui {
    live: bool,
    started: Instant,
    events: VecDeque<String>,
    urls: Vec<(String, String)>,
    /// The last audit of each gateway: `(gateway, one line)`.
    audits: Vec<(String, String)>,
    drawn: bool,
}

impl Ui {
    fn new(live: bool, started: Instant) -> Self {
        Self {
            live,
            started,
            events: VecDeque::new(),
            urls: Vec::new(),
            audits: Vec::new(),
            drawn: false,
        }
    }

    fn progress(&self, what: &str) {
        eprintln!("{}", self.paint("1", &format!("==> {what}")));
    }

    /// `text` in an SGR colour or weight when drawing live, plain otherwise.
    fn paint(&self, sgr: &str, text: &str) -> String {
        if self.live {
            format!("\x1b[{sgr}m{text}\x1b[0m")
        } else {
            text.to_owned()
        }
    }

    fn event(&mut self, what: &str) {
        let line = format!("{:>6.1}s  {what}", self.started.elapsed().as_secs_f64());
        if !self.live {
            println!("{line}");
        }
        self.events.push_back(line);
        while self.events.len() > 7 {
            self.events.pop_front();
        }
    }

    fn draw(
        &mut self,
        summary: &Summary,
        verdicts: &[(String, String, u64)],
        frozen: Option<Instant>,
    ) {
        if !self.live {
            return;
        }
        let frame = self.frame(summary, verdicts, frozen, true);
        let mut out = std::io::stdout().lock();
        // Home and clear below: the frame replaces the previous one.
        let _ = write!(
            out,
            "{}\x1b[H\x1b[J{frame}",
            if self.drawn { "" } else { "\x1b[2J" }
        );
        let _ = out.flush();
        self.drawn = true;
    }

    fn finish(
        &mut self,
        summary: &Summary,
        verdicts: &[(String, String, u64)],
        frozen: Option<Instant>,
    ) {
        let frame = self.frame(summary, verdicts, frozen, false);
        let mut out = std::io::stdout().lock();
        if self.live {
            let _ = write!(out, "\x1b[H\x1b[J");
        }
        let _ = writeln!(out, "{frame}");
        let _ = writeln!(
            out,
            "summary: with staleguard {} of {} requests reached a wrong or dead pod; without, {} of {}; the guarded gateway failed {} of {} requests, the unguarded {} of {}.",
            num(summary.guarded_landed.misrouted()),
            num(summary.guarded.total()),
            num(summary.plain_landed.misrouted()),
            num(summary.plain.total()),
            num(summary.guarded.failed()),
            num(summary.guarded.total()),
            num(summary.plain.failed()),
            num(summary.plain.total())
        );
        let _ = out.flush();
    }

    fn frame(
        &self,
        s: &Summary,
        verdicts: &[(String, String, u64)],
        frozen: Option<Instant>,
        running: bool,
    ) -> String {
        let bold = |t: &str| self.paint("1", t);
        let mut f = String::new();
        let state = match frozen {
            Some(since) => format!(
                "{} (EDS frozen for {}s)",
                self.paint("31", "STUCK"),
                since.elapsed().as_secs()
            ),
            None => self.paint("32", "healthy"),
        };
        let _ = writeln!(
            f,
            "{}  {:.0}s   control plane: {state}\n",
            bold("staleguard demo"),
            self.started.elapsed().as_secs_f64()
        );
        let _ = writeln!(f, "  {:<44}{:>15}{:>12}", "", "with staleguard", "without");
        let row = |f: &mut String, label: &str, a: String, b: String| {
            let _ = writeln!(f, "  {label:<44}{a:>15}{b:>12}");
        };
        row(
            &mut f,
            "requests sent",
            num(s.guarded.total()),
            num(s.plain.total()),
        );
        row(
            &mut f,
            "answered by the right service",
            num(s.guarded_landed.right),
            num(s.plain_landed.right),
        );
        let red = |n: u64| self.paint(if n > 0 { "31" } else { "32" }, &num(n));
        // Colour codes are invisible but counted by the padding: pad by hand.
        let colored_row = |f: &mut String, label: &str, a: u64, b: u64| {
            let (ta, tb) = (num(a), num(b));
            let _ = writeln!(
                f,
                "  {label:<44}{}{}{}{}",
                " ".repeat(15usize.saturating_sub(ta.len())),
                red(a),
                " ".repeat(12usize.saturating_sub(tb.len())),
                red(b)
            );
        };
        colored_row(
            &mut f,
            "reached a DEAD pod (destroyed, IP not reused)",
            s.guarded_landed.dead,
            s.plain_landed.dead,
        );
        colored_row(
            &mut f,
            "reached the WRONG service (recycled IP)",
            s.guarded_landed.wrong_service,
            s.plain_landed.wrong_service,
        );
        let reasons: Vec<String> = s
            .guarded
            .rejected
            .iter()
            .map(|(r, n)| format!("{r} {}", num(*n)))
            .collect();
        row(
            &mut f,
            "rejected by staleguard (503)",
            num(s.guarded.rejected_total()),
            "-".into(),
        );
        if !reasons.is_empty() {
            let _ = writeln!(f, "    {}", reasons.join(" · "));
        }
        let other = |o: &Outcomes| o.errors + o.other_status.values().sum::<u64>();
        row(
            &mut f,
            "other errors",
            num(other(&s.guarded)),
            num(other(&s.plain)),
        );

        let _ = writeln!(
            f,
            "\n{}",
            bold("filter verdicts (guarded Envoy, staleguard_filter_requests_total)")
        );
        let parts: Vec<String> = verdicts
            .iter()
            .map(|(reason, action, n)| {
                if action.is_empty() {
                    format!("index fresh: {}", if *n == 1 { "yes" } else { "no" })
                } else {
                    format!("{reason}/{action} {}", num(*n))
                }
            })
            .collect();
        // Wrap by hand to stay within 80 columns.
        let mut line = String::new();
        for part in parts {
            if !line.is_empty() && line.len() + part.len() > 74 {
                let _ = writeln!(f, "  {line}");
                line.clear();
            }
            if !line.is_empty() {
                line.push_str(" · ");
            }
            line.push_str(&part);
        }
        let _ = writeln!(f, "  {line}");

        if !self.audits.is_empty() {
            let _ = writeln!(
                f,
                "\n{}",
                bold("audit while stuck (staleguard-validator audit: no traffic needed)")
            );
            for (gateway, line) in &self.audits {
                let _ = writeln!(f, "  {gateway:<10} {line}");
            }
        }
        let _ = writeln!(f, "\n{}", bold("events"));
        for e in &self.events {
            let _ = writeln!(f, "  {e}");
        }
        let _ = writeln!(f, "\n{}", bold("metrics"));
        for (what, url) in &self.urls {
            let _ = writeln!(f, "  {what:<16} {url}");
        }
        if self.live && running {
            let _ = writeln!(f, "\nCtrl-C to stop.");
        }
        f
    }
}

/// One line of an audit's JSON report: stale endpoints and where they are,
/// by service and reason. Each endpoint counts once: a retry twin's
/// endpoints are its cluster's again, judged in its cluster's rows.
fn audit_line(doc: &serde_json::Value) -> String {
    let mut parts = Vec::new();
    let mut endpoints = 0;
    for cluster in doc["clusters"].as_array().into_iter().flatten() {
        if cluster["twin_of"].is_null() {
            endpoints += cluster["endpoints"].as_array().map_or(0, Vec::len);
        }
        let reasons = &cluster["summary"]["by_reason"];
        let stale: Vec<String> = ["destroyed", "recycled"]
            .iter()
            .filter_map(|r| reasons[*r].as_u64().map(|n| format!("{n} {r}")))
            .collect();
        if !stale.is_empty() {
            let service = cluster["service"].as_str().unwrap_or("?");
            parts.push(format!("{service}: {}", stale.join(", ")));
        }
    }
    format!(
        "{} stale of {endpoints} endpoints{}{}",
        doc["summary"]["stale"],
        if parts.is_empty() { "" } else { " · " },
        parts.join("; ")
    )
}

/// `12345` as `12,345`.
fn num(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// True when stdout is a terminal (the live table), false in pipes and tests.
pub fn stdout_is_terminal() -> bool {
    std::io::stdout().is_terminal()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_audit_line_counts_a_twins_endpoints_once() {
        let endpoint = |reason: &str| json!({"reason": reason});
        let doc = json!({
            "summary": {"stale": 1, "endpoints": 5},
            "clusters": [
                {"service": "default/cart", "twin_of": null,
                 "summary": {"by_reason": {"destroyed": 1, "member": 2}},
                 "endpoints": [endpoint("destroyed"), endpoint("member"), endpoint("member")]},
                {"service": null, "twin_of": "cart",
                 "summary": {"by_reason": {"twin": 2}},
                 "endpoints": [endpoint("twin"), endpoint("twin")]}
            ]
        });
        assert_eq!(
            audit_line(&doc),
            "1 stale of 3 endpoints · default/cart: 1 destroyed"
        );
    }

    #[test]
    fn numbers_get_thousands_separators() {
        assert_eq!(num(0), "0");
        assert_eq!(num(999), "999");
        assert_eq!(num(1000), "1,000");
        assert_eq!(num(1234567), "1,234,567");
    }
}
