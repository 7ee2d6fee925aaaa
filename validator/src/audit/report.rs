//! What an audit found, and how it is shown: a table and a summary per
//! cluster for people, `--output json` for machines, an exit status for
//! scripts.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::IpAddr;

use serde::Serialize;
use staleguard_core::{Freshness, IpRecord, Reason, ServiceKey, Verdict};

/// The audit's exit statuses (documented in docs/audit.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Exit {
    /// Every endpoint checked out.
    Clean = 0,
    /// The gateway holds stale endpoints (destroyed or recycled).
    Stale = 1,
    /// Bad flags or configuration.
    Usage = 2,
    /// The gateway's admin output (or dump file) is malformed or truncated.
    AdminMalformed = 3,
    /// The gateway's admin port is unreachable (or the dump file unreadable).
    AdminUnreachable = 4,
    /// The validator is unreachable or refused the request (or the cluster
    /// file cannot be loaded).
    Validator = 5,
    /// The validator's data is not fresh: no endpoint could be judged.
    NotFresh = 6,
    /// The gateway has endpoints but none was judged: every cluster maps to
    /// no service (a plugin configuration that maps nothing).
    NothingJudged = 7,
}

impl Exit {
    /// The process exit code.
    pub const fn code(self) -> i32 {
        self as i32
    }

    /// The outcome label of `staleguard_validator_audit_runs_total`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Exit::Clean => "clean",
            Exit::Stale => "stale",
            Exit::Usage => "usage",
            Exit::AdminMalformed => "admin_malformed",
            Exit::AdminUnreachable => "admin_unreachable",
            Exit::Validator => "validator_unreachable",
            Exit::NotFresh => "not_fresh",
            Exit::NothingJudged => "nothing_judged",
        }
    }
}

/// What became of one endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Judgement {
    /// Judged by the validator (or the cluster file).
    Judged(Verdict),
    /// The cluster maps to no service: the filter does not judge it either.
    Unmapped,
    /// The cluster is a guarded cluster's retry twin: it holds that
    /// cluster's endpoints again, judged there.
    Twin,
    /// The endpoint has no IP (a pipe, an unresolved name, an internal
    /// address without an endpoint_id).
    NoAddress,
    /// The IP is outside the plugin's `pod_cidrs`: another cluster's pod or
    /// an east-west gateway, which the filter passes unjudged.
    OutOfScope,
}

impl Judgement {
    /// The reason code: a verdict reason, `unmapped`, `twin`, `no_address`
    /// or `out_of_scope`.
    pub const fn reason(self) -> &'static str {
        match self {
            Judgement::Judged(v) => v.reason.as_str(),
            Judgement::Unmapped => "unmapped",
            Judgement::Twin => "twin",
            Judgement::NoAddress => "no_address",
            Judgement::OutOfScope => "out_of_scope",
        }
    }

    /// `allow`, `reject`, or `-` when not judged.
    pub const fn action(self) -> &'static str {
        match self {
            Judgement::Judged(v) => v.action.as_str(),
            Judgement::Unmapped
            | Judgement::Twin
            | Judgement::NoAddress
            | Judgement::OutOfScope => "-",
        }
    }

    /// True for an endpoint that no longer exists or now belongs to another
    /// service: what the audit is for.
    pub fn is_stale(self) -> bool {
        matches!(
            self,
            Judgement::Judged(Verdict {
                reason: Reason::Destroyed | Reason::Recycled,
                ..
            })
        )
    }
}

/// One endpoint's finding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    /// The address as Envoy shows it.
    pub address: String,
    /// Its IP, when it has one.
    pub ip: Option<IpAddr>,
    /// What the audit concluded.
    pub judgement: Judgement,
    /// When the IP lost its last pod (the validator's tombstone), ms since
    /// the Unix epoch.
    pub since_ms: Option<u64>,
    /// Who holds the IP now (`namespace/name` of pods), or held it last.
    pub holders: Vec<String>,
}

impl Finding {
    /// A finding from the validator's answer for the endpoint.
    pub fn judged(
        address: String,
        ip: IpAddr,
        verdict: Verdict,
        record: Option<&IpRecord>,
    ) -> Self {
        let mut holders: Vec<String> = record
            .map(|r| {
                r.pods
                    .iter()
                    .map(|p| format!("{}/{}", p.namespace, p.name))
                    .collect()
            })
            .unwrap_or_default();
        let tombstone = record.and_then(|r| r.tombstone.as_ref());
        if holders.is_empty() {
            if let Some(t) = tombstone {
                holders.push(format!("was {}", t.pod));
            }
        }
        Self {
            address,
            ip: Some(ip),
            judgement: Judgement::Judged(verdict),
            since_ms: tombstone.map(|t| t.since_ms),
            holders,
        }
    }
}

/// One cluster's findings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterReport {
    /// The cluster name.
    pub name: String,
    /// The service it routes to, if it maps to one.
    pub service: Option<ServiceKey>,
    /// Which plugin configuration mapped it: `cluster` (attached to the
    /// cluster), `gateway` (attached gateway-wide), `flag`
    /// (`--plugin-config`) or `default` (none found: Istio names).
    pub mapped_by: &'static str,
    /// The guarded cluster, when this one is its retry twin.
    pub twin_of: Option<String>,
    /// Its endpoints.
    pub findings: Vec<Finding>,
}

impl ClusterReport {
    /// Endpoints by reason code.
    pub fn by_reason(&self) -> BTreeMap<&'static str, usize> {
        let mut counts = BTreeMap::new();
        for f in &self.findings {
            *counts.entry(f.judgement.reason()).or_default() += 1;
        }
        counts
    }

    /// Stale endpoints.
    pub fn stale(&self) -> usize {
        self.findings
            .iter()
            .filter(|f| f.judgement.is_stale())
            .count()
    }
}

/// A whole audit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    /// The gateway's name (`--gateway`).
    pub gateway: String,
    /// Where the verdicts came from.
    pub verdicts_from: String,
    /// The validator's index generation the verdicts were taken at.
    pub generation: u64,
    /// How current the verdicts' data was.
    pub freshness: Freshness,
    /// Every cluster, by name.
    pub clusters: Vec<ClusterReport>,
    /// Things worth telling the operator.
    pub notes: Vec<String>,
}

impl Report {
    /// Stale endpoints in all clusters.
    pub fn stale(&self) -> usize {
        self.clusters.iter().map(ClusterReport::stale).sum()
    }

    /// Endpoints in all clusters.
    pub fn endpoints(&self) -> usize {
        self.clusters.iter().map(|c| c.findings.len()).sum()
    }

    /// Endpoints the validator judged, in all clusters.
    pub fn judged(&self) -> usize {
        self.clusters
            .iter()
            .flat_map(|c| &c.findings)
            .filter(|f| matches!(f.judgement, Judgement::Judged(_)))
            .count()
    }

    /// The exit status this report calls for.
    pub fn exit(&self) -> Exit {
        if self.stale() > 0 {
            Exit::Stale
        } else if self.endpoints() > 0 && self.judged() == 0 {
            Exit::NothingJudged
        } else if !self.freshness.fresh {
            Exit::NotFresh
        } else {
            Exit::Clean
        }
    }

    /// Why the audit judged nothing, for stderr: `None` when the exit
    /// status says what there is to say (clean, stale).
    pub fn failure(&self) -> Option<String> {
        match self.exit() {
            Exit::NothingJudged => {
                let mut counts: BTreeMap<&'static str, usize> = BTreeMap::new();
                for c in &self.clusters {
                    for (reason, n) in c.by_reason() {
                        *counts.entry(reason).or_default() += n;
                    }
                }
                let counts: Vec<String> = counts.iter().map(|(r, n)| format!("{n} {r}")).collect();
                Some(format!(
                    "nothing was judged: none of the {} endpoint(s) could be ({}); an unmapped endpoint is in a \
                     cluster that maps to no service: check the plugin configuration the clusters are mapped by \
                     (--plugin-config, or the gateway's: `clusters` rules, `istio`)",
                    self.endpoints(),
                    counts.join(", ")
                ))
            }
            Exit::NotFresh => Some(format!(
                "the validator's data is not fresh{}: nothing could be judged",
                self.freshness
                    .age_ms
                    .map_or_else(String::new, |ms| format!(" (last event {ms} ms ago)"))
            )),
            _ => None,
        }
    }

    /// The table, the summary per cluster and a verdict line. `now_ms` dates
    /// the "since" column; `stale_only` leaves the other endpoints out of the
    /// table (not out of the summary).
    pub fn table(&self, now_ms: u64, stale_only: bool) -> String {
        let mut rows = vec![[
            "CLUSTER".to_owned(),
            "ENDPOINT".to_owned(),
            "SERVICE".to_owned(),
            "VERDICT".to_owned(),
            "REASON".to_owned(),
            "SINCE".to_owned(),
            "HELD BY".to_owned(),
        ]];
        for c in &self.clusters {
            for f in c
                .findings
                .iter()
                .filter(|f| !stale_only || f.judgement.is_stale())
            {
                rows.push([
                    c.name.clone(),
                    f.address.clone(),
                    c.service
                        .as_ref()
                        .map_or_else(|| "-".to_owned(), ToString::to_string),
                    f.judgement.action().to_owned(),
                    if f.judgement.is_stale() {
                        f.judgement.reason().to_uppercase()
                    } else {
                        f.judgement.reason().to_owned()
                    },
                    f.since_ms
                        .map_or_else(|| "-".to_owned(), |ms| since(ms, now_ms)),
                    if f.holders.is_empty() {
                        "-".to_owned()
                    } else {
                        f.holders.join(",")
                    },
                ]);
            }
        }
        let mut widths = [0usize; 7];
        for row in &rows {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.chars().count());
            }
        }
        let mut out = String::new();
        let freshness = match (self.freshness.fresh, self.freshness.age_ms) {
            (true, Some(age)) => format!("fresh, data {:.1}s old", age as f64 / 1000.0),
            (true, None) => "fresh".to_owned(),
            (false, _) => "NOT FRESH: no endpoint could be judged".to_owned(),
        };
        let _ = writeln!(
            out,
            "audit of gateway {}: verdicts from {} (generation {}, {freshness})\n",
            self.gateway, self.verdicts_from, self.generation
        );
        for row in &rows {
            let mut line = String::new();
            for (i, (cell, w)) in row.iter().zip(widths).enumerate() {
                if i + 1 == row.len() {
                    line.push_str(cell);
                } else {
                    let _ = write!(line, "{cell:<w$}  ");
                }
            }
            let _ = writeln!(out, "{}", line.trim_end());
        }
        let _ = writeln!(out, "\nper cluster:");
        for c in &self.clusters {
            let counts: Vec<String> = c
                .by_reason()
                .iter()
                .map(|(reason, n)| format!("{n} {reason}"))
                .collect();
            let service = match (&c.service, &c.twin_of) {
                (Some(service), _) => service.to_string(),
                (None, Some(guarded)) => format!("retry twin of {guarded}"),
                (None, None) => "no service".to_owned(),
            };
            let stale = c.stale();
            let _ = writeln!(
                out,
                "  {} ({service}): {} endpoints{}{}{}",
                c.name,
                c.findings.len(),
                if counts.is_empty() { "" } else { ": " },
                counts.join(", "),
                if stale > 0 {
                    format!(" -> {stale} STALE")
                } else {
                    String::new()
                }
            );
        }
        for note in &self.notes {
            let _ = writeln!(out, "note: {note}");
        }
        let stale_clusters = self.clusters.iter().filter(|c| c.stale() > 0).count();
        let _ = writeln!(
            out,
            "\n{} stale endpoint(s) in {} of {} cluster(s), {} endpoint(s) checked",
            self.stale(),
            stale_clusters,
            self.clusters.len(),
            self.endpoints()
        );
        out
    }

    /// The `--output json` document.
    pub fn to_json(&self) -> serde_json::Value {
        let clusters: Vec<serde_json::Value> = self
            .clusters
            .iter()
            .map(|c| {
                let endpoints: Vec<serde_json::Value> = c
                    .findings
                    .iter()
                    .map(|f| {
                        serde_json::json!({
                            "address": f.address,
                            "ip": f.ip,
                            "verdict": f.judgement.action(),
                            "reason": f.judgement.reason(),
                            "stale": f.judgement.is_stale(),
                            "since_ms": f.since_ms,
                            "holders": f.holders,
                        })
                    })
                    .collect();
                serde_json::json!({
                    "name": c.name,
                    "service": c.service,
                    "mapped_by": c.mapped_by,
                    "twin_of": c.twin_of,
                    "endpoints": endpoints,
                    "summary": {"endpoints": c.findings.len(), "stale": c.stale(), "by_reason": c.by_reason()},
                })
            })
            .collect();
        serde_json::json!({
            "gateway": self.gateway,
            "verdicts_from": self.verdicts_from,
            "generation": self.generation,
            "freshness": self.freshness,
            "clusters": clusters,
            "notes": self.notes,
            "summary": {"endpoints": self.endpoints(), "stale": self.stale()},
            "exit_status": self.exit().code(),
        })
    }
}

/// `2026-11-30T22:53:20Z (12m ago)`.
fn since(ms: u64, now_ms: u64) -> String {
    let secs = ms / 1000;
    let (days, rest) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_from_days(days as i64);
    let age = now_ms.saturating_sub(ms) / 1000;
    let ago = if age < 120 {
        format!("{age}s")
    } else if age < 7_200 {
        format!("{}m", age / 60)
    } else {
        format!("{}h", age / 3_600)
    };
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z ({ago} ago)",
        rest / 3_600,
        rest % 3_600 / 60,
        rest % 60
    )
}

/// Howard Hinnant's days-to-civil: (year, month, day) of a day since 1970-01-01.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use staleguard_core::Action;

    fn verdict(reason: Reason, action: Action) -> Judgement {
        Judgement::Judged(Verdict { reason, action })
    }

    fn finding(judgement: Judgement) -> Finding {
        Finding {
            address: "10.0.0.1:80".into(),
            ip: Some("10.0.0.1".parse().unwrap()),
            judgement,
            since_ms: None,
            holders: vec![],
        }
    }

    fn report(findings: Vec<Finding>, fresh: bool) -> Report {
        Report {
            gateway: "gw".into(),
            verdicts_from: "test".into(),
            generation: 3,
            freshness: Freshness {
                fresh,
                age_ms: Some(100),
            },
            clusters: vec![ClusterReport {
                name: "c".into(),
                service: Some(ServiceKey::new("shop", "cart")),
                mapped_by: "default",
                twin_of: None,
                findings,
            }],
            notes: vec![],
        }
    }

    #[test]
    fn only_destroyed_and_recycled_endpoints_are_stale() {
        let clean = report(
            vec![
                finding(verdict(Reason::Member, Action::Allow)),
                finding(verdict(Reason::Terminating, Action::Allow)),
                finding(verdict(Reason::HostNetwork, Action::Allow)),
                finding(Judgement::Unmapped),
                finding(Judgement::Twin),
                finding(Judgement::NoAddress),
            ],
            true,
        );
        assert_eq!((clean.stale(), clean.exit()), (0, Exit::Clean));
        let stale = report(
            vec![
                finding(verdict(Reason::Destroyed, Action::Reject)),
                finding(verdict(Reason::Recycled, Action::Reject)),
            ],
            true,
        );
        assert_eq!((stale.stale(), stale.exit()), (2, Exit::Stale));
        let blind = report(vec![finding(verdict(Reason::Stale, Action::Allow))], false);
        assert_eq!(blind.exit(), Exit::NotFresh);
        assert!(blind.table(0, false).contains("NOT FRESH"));
        assert_eq!(clean.failure(), None);
        assert_eq!(stale.failure(), None);
        let why = blind.failure().unwrap();
        assert!(why.contains("not fresh") && why.contains("100 ms"), "{why}");
    }

    #[test]
    fn an_audit_that_judged_nothing_exits_7_saying_why() {
        let unmapped = report(
            vec![
                finding(Judgement::Unmapped),
                finding(Judgement::Unmapped),
                finding(Judgement::NoAddress),
            ],
            true,
        );
        assert_eq!(unmapped.exit(), Exit::NothingJudged);
        assert_eq!(unmapped.exit().code(), 7);
        let why = unmapped.failure().unwrap();
        assert!(
            why.contains("none of the 3 endpoint(s)") && why.contains("(1 no_address, 2 unmapped)"),
            "{why}"
        );
        // A gateway without endpoints has nothing to judge: clean.
        assert_eq!(report(vec![], true).exit(), Exit::Clean);
    }

    #[test]
    fn the_table_and_json_say_the_same() {
        let mut destroyed = finding(verdict(Reason::Destroyed, Action::Reject));
        destroyed.since_ms = Some(1_764_543_200_000);
        destroyed.holders = vec!["was shop/cart-3".into()];
        let mut member = finding(verdict(Reason::Member, Action::Allow));
        member.holders = vec!["shop/cart-0".into()];
        let r = report(vec![member, destroyed], true);
        let table = r.table(1_764_543_200_000 + 720_000, false);
        assert!(table.contains("shop/cart-0"), "{table}");
        assert!(table.contains("DESTROYED"), "{table}");
        assert!(table.contains("2025-11-30T22:53:20Z (12m ago)"), "{table}");
        assert!(
            table.contains("c (shop/cart): 2 endpoints: 1 destroyed, 1 member -> 1 STALE"),
            "{table}"
        );
        assert!(
            table.contains("1 stale endpoint(s) in 1 of 1 cluster(s)"),
            "{table}"
        );
        let stale_only = r.table(0, true);
        assert!(!stale_only.contains("shop/cart-0"), "{stale_only}");
        assert!(stale_only.contains("DESTROYED"), "{stale_only}");
        assert!(stale_only.contains("1 destroyed, 1 member"), "{stale_only}");
        let json = r.to_json();
        assert_eq!(json["summary"]["stale"], 1);
        assert_eq!(json["exit_status"], 1);
        assert_eq!(json["clusters"][0]["endpoints"][1]["reason"], "destroyed");
        assert_eq!(json["clusters"][0]["summary"]["by_reason"]["member"], 1);
    }

    #[test]
    fn a_twin_says_whose_it_is_and_is_never_stale() {
        let mut r = report(
            vec![finding(verdict(Reason::Destroyed, Action::Reject))],
            true,
        );
        r.clusters.push(ClusterReport {
            name: "c|staleguard-twin".into(),
            service: None,
            mapped_by: "default",
            twin_of: Some("c".into()),
            findings: vec![finding(Judgement::Twin)],
        });
        assert_eq!(
            r.stale(),
            1,
            "the twin's copy of the endpoint is not counted"
        );
        let table = r.table(0, false);
        assert!(
            table.contains("c|staleguard-twin (retry twin of c): 1 endpoints: 1 twin"),
            "{table}"
        );
        let json = r.to_json();
        assert_eq!(json["clusters"][1]["twin_of"], "c");
        assert_eq!(json["clusters"][1]["endpoints"][0]["reason"], "twin");
        assert_eq!(json["clusters"][0]["twin_of"], serde_json::Value::Null);
    }

    #[test]
    fn exit_statuses_are_distinct() {
        let all = [
            Exit::Clean,
            Exit::Stale,
            Exit::Usage,
            Exit::AdminMalformed,
            Exit::AdminUnreachable,
            Exit::Validator,
            Exit::NotFresh,
        ];
        let codes: std::collections::BTreeSet<i32> = all.iter().map(|e| e.code()).collect();
        let labels: std::collections::BTreeSet<&str> = all.iter().map(|e| e.as_str()).collect();
        assert_eq!((codes.len(), labels.len()), (all.len(), all.len()));
    }
}
