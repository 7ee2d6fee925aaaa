//! `staleguard-validator audit` against real Envoy 1.40 whose file-based EDS
//! holds valid, destroyed, recycled, terminating, hostNetwork and unmapped
//! endpoints, against a saved config dump, and against broken admin output,
//! an unreachable admin port and an unreachable validator.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};
use staleguard_tests::audit::{self, AuditRun, Broken, FileValidator, Pod, Truth};
use staleguard_tests::eds::EdsFile;
use staleguard_tests::envoy::{shipped_plugin, Cluster, Envoy, Gateway, WAIT};
use staleguard_tests::process::{free_addr, wait_for_port, OwnedProcess};
use staleguard_tests::scene::{self, Deps};
use staleguard_tests::traffic::Http;

const CART: &str = "outbound|80||cart.shop.svc.cluster.local";
const PAY: &str = "outbound|80||pay.shop.svc.cluster.local";
/// A plain-Envoy name the plugin's `clusters` rule maps to shop/cart.
const CART_PLAIN: &str = "shop-cart";
/// A cluster no rule and no Istio name maps: the filter leaves it alone.
const LEGACY: &str = "legacy-backend";

const MEMBER: &str = "127.0.3.1";
const TERMINATING: &str = "127.0.3.2";
const RECYCLED: &str = "127.0.3.3";
const HOST_NETWORK: &str = "127.0.3.4";
const DESTROYED: &str = "127.0.3.5";
const UNMAPPED: &str = "127.0.3.9";

/// The cluster's truth; `with_doomed` keeps the pod whose deletion the test
/// then shows (so the validator remembers it with a tombstone).
fn cluster(with_doomed: bool) -> Truth {
    let truth = Truth::default()
        .service("cart", 80)
        .service("pay", 80)
        .service("agent", 80)
        .pod(Pod::new("cart-0", "cart", MEMBER))
        .pod(Pod::new("cart-1", "cart", TERMINATING).terminating())
        .pod(Pod::new("pay-0", "pay", RECYCLED))
        .pod(Pod::new("agent-node-1", "agent", HOST_NETWORK).host_network());
    if with_doomed {
        truth.pod(Pod::new("cart-2", "cart", DESTROYED))
    } else {
        truth
    }
}

/// A validator on the truth, and an Envoy whose stuck EDS still lists the
/// pods of before.
struct Setup {
    deps: Deps,
    truth: FileValidator,
    _envoy: Envoy,
    admin: SocketAddr,
    /// Dropped last, once Envoy and the validator are gone.
    _one_at_a_time: tokio::sync::MutexGuard<'static, ()>,
}

impl Setup {
    async fn start() -> Option<Self> {
        let deps = scene::deps()?;
        // One Envoy at a time: the machine is small, and ports picked free
        // by concurrent setups could collide.
        static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
        let guard = ONE_AT_A_TIME.lock().await;
        let truth = FileValidator::start(
            &deps.validator,
            &cluster(true),
            None,
            &["--file-poll", "100ms"],
        )
        .await
        .unwrap();
        // cart-2 goes away: its IP keeps a tombstone, and the gateway's
        // (frozen) EDS still lists it.
        truth.write_truth(&cluster(false)).unwrap();
        let destroyed = DESTROYED.parse().unwrap();
        truth
            .validator
            .wait_verdicts(
                &Http::new(),
                &[("shop/cart".into(), destroyed, "destroyed")],
                Duration::from_secs(30),
            )
            .await
            .unwrap();

        let port = 8080;
        let addr = |ip: &str| SocketAddr::new(ip.parse().unwrap(), port);
        let mut cart_eds = EdsFile::new(truth.dir.join("eds-cart.json"), "cart");
        cart_eds.write(&CART_IPS.map(addr)).unwrap();
        let mut pay_eds = EdsFile::new(truth.dir.join("eds-pay.json"), "pay");
        pay_eds.write(&[addr(RECYCLED)]).unwrap();

        let plugin = shipped_plugin(json!({
            "clusters": [{"name": CART_PLAIN, "service": "shop/cart"}]
        }));
        // The shipped plugin (retry on, so each guarded cluster has its twin,
        // as deploy/ ships it), with a plain-Envoy name mapped to shop/cart.
        let guarded = || Some(plugin.clone());
        let gateway = Gateway {
            name: "audit".into(),
            ..Gateway::new(
                truth.validator.listen,
                vec![
                    Cluster::eds(CART, &cart_eds, guarded()),
                    Cluster::eds(CART_PLAIN, &cart_eds, guarded()),
                    Cluster::eds(PAY, &pay_eds, guarded()),
                    Cluster::new(LEGACY, addr(UNMAPPED), None),
                ],
            )
        };
        let envoy = gateway.run(&deps.envoy, &deps.wasm, |_| Ok(())).unwrap();
        let membership = |c: &str| format!("cluster.{c}.membership_total");
        envoy
            .wait_stats("every EDS cluster has its endpoints", WAIT, |s| {
                [(CART, 5), (CART_PLAIN, 5), (PAY, 1)]
                    .iter()
                    .all(|(c, n)| s.get(&membership(c)) == Some(n))
            })
            .unwrap();
        let admin = envoy.admin;
        Some(Self {
            deps,
            truth,
            _envoy: envoy,
            admin,
            _one_at_a_time: guard,
        })
    }

    async fn audit(&self, args: &[&str]) -> AuditRun {
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        audit::run(&self.deps.validator, &args).await.unwrap()
    }

    fn validator_url(&self) -> String {
        self.truth.url()
    }
}

/// `(cluster, address, reason)` of every endpoint in a JSON report.
fn rows(report: &Value) -> BTreeSet<(String, String, String)> {
    let mut out = BTreeSet::new();
    for c in report["clusters"].as_array().unwrap() {
        for e in c["endpoints"].as_array().unwrap() {
            out.insert((
                c["name"].as_str().unwrap().to_owned(),
                e["address"].as_str().unwrap().to_owned(),
                e["reason"].as_str().unwrap().to_owned(),
            ));
        }
    }
    out
}

/// The endpoints cart's frozen EDS still lists.
const CART_IPS: [&str; 5] = [MEMBER, TERMINATING, RECYCLED, HOST_NETWORK, DESTROYED];

/// The retry twin of a guarded cluster, as the shipped plugin names it.
fn twin(cluster: &str) -> String {
    format!("{cluster}|staleguard-twin")
}

fn expected(validator: SocketAddr) -> BTreeSet<(String, String, String)> {
    let mut out = BTreeSet::new();
    for cluster in [CART, CART_PLAIN] {
        for (ip, reason) in [
            (MEMBER, "member"),
            (TERMINATING, "terminating"),
            (RECYCLED, "recycled"),
            (HOST_NETWORK, "host_network"),
            (DESTROYED, "destroyed"),
        ] {
            out.insert((cluster.into(), format!("{ip}:8080"), reason.into()));
        }
    }
    out.insert((PAY.into(), format!("{RECYCLED}:8080"), "member".into()));
    // Each guarded cluster's retry twin (the shipped plugin replays) holds its
    // endpoints again: named as a twin, judged in its cluster's rows.
    for (cluster, ips) in [
        (CART, &CART_IPS[..]),
        (CART_PLAIN, &CART_IPS[..]),
        (PAY, &[RECYCLED][..]),
    ] {
        for ip in ips {
            out.insert((twin(cluster), format!("{ip}:8080"), "twin".into()));
        }
    }
    out.insert((LEGACY.into(), format!("{UNMAPPED}:8080"), "unmapped".into()));
    out.insert((
        "staleguard-validator".into(),
        validator.to_string(),
        "unmapped".into(),
    ));
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_audit_of_a_live_gateway_names_every_stale_endpoint_and_exits_1() {
    let Some(setup) = Setup::start().await else {
        return;
    };
    let admin = setup.admin.to_string();
    let url = setup.validator_url();
    let run = setup
        .audit(&[
            "--admin",
            &admin,
            "--validator",
            &url,
            "--output",
            "json",
            "--gateway",
            "gw-a",
        ])
        .await;
    assert_eq!(
        run.code, 1,
        "stale endpoints exit 1\n{}\n{}",
        run.stdout, run.stderr
    );
    let report = run.json().unwrap();
    assert_eq!(
        rows(&report),
        expected(setup.truth.validator.listen),
        "{report:#}"
    );
    assert_eq!(
        report["summary"]["stale"], 4,
        "2 clusters x (destroyed + recycled)"
    );
    assert_eq!(report["gateway"], "gw-a");
    let cart = report["clusters"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == CART)
        .unwrap();
    assert_eq!(cart["service"], "shop/cart");
    assert_eq!(cart["summary"]["stale"], 2);
    let destroyed = cart["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["reason"] == "destroyed")
        .unwrap();
    assert!(destroyed["since_ms"].as_u64().unwrap() > 0, "{destroyed}");
    assert_eq!(destroyed["holders"], json!(["was shop/cart-2"]));
    let recycled = cart["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["reason"] == "recycled")
        .unwrap();
    assert_eq!(recycled["holders"], json!(["shop/pay-0"]));
    assert_eq!(recycled["verdict"], "reject");

    // The table says the same, with a summary per cluster.
    let run = setup.audit(&["--admin", &admin, "--validator", &url]).await;
    assert_eq!(run.code, 1, "{}", run.stderr);
    println!("{}", run.stdout);
    for needle in [
        "CLUSTER",
        "DESTROYED",
        "RECYCLED",
        &format!("{CART} (shop/cart): 5 endpoints: 1 destroyed, 1 host_network, 1 member, 1 recycled, 1 terminating -> 2 STALE"),
        &format!("{LEGACY} (no service): 1 endpoints: 1 unmapped"),
        &format!("{} (retry twin of {CART}): 5 endpoints: 5 twin", twin(CART)),
        "4 stale endpoint(s) in 2 of 8 cluster(s), 24 endpoint(s) checked",
    ] {
        assert!(run.stdout.contains(needle), "missing {needle:?}:\n{}", run.stdout);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_saved_config_dump_audits_like_the_live_gateway() {
    let Some(setup) = Setup::start().await else {
        return;
    };
    let http = Http::new();
    let dump = http
        .get(&format!("http://{}/config_dump?include_eds", setup.admin))
        .await
        .unwrap();
    assert_eq!(dump.status, 200);
    let path = setup.truth.dir.join("config_dump.json");
    std::fs::write(&path, &dump.body).unwrap();
    let path = path.display().to_string();
    let url = setup.validator_url();
    let run = setup
        .audit(&[
            "--config-dump",
            &path,
            "--validator",
            &url,
            "--output",
            "json",
        ])
        .await;
    assert_eq!(run.code, 1, "{}\n{}", run.stdout, run.stderr);
    let report = run.json().unwrap();
    assert_eq!(
        rows(&report),
        expected(setup.truth.validator.listen),
        "{report:#}"
    );
    assert_eq!(report["gateway"], "config_dump.json");

    // And judged by a cluster dump through the file source, no validator.
    let truth = setup.truth.truth_path().display().to_string();
    let run = setup
        .audit(&[
            "--config-dump",
            &path,
            "--cluster-file",
            &truth,
            "--output",
            "json",
        ])
        .await;
    assert_eq!(run.code, 1, "{}\n{}", run.stdout, run.stderr);
    assert_eq!(
        rows(&run.json().unwrap()),
        expected(setup.truth.validator.listen)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_config_the_filter_refuses_or_that_maps_nothing_exits_non_zero_saying_why() {
    let Some(setup) = Setup::start().await else {
        return;
    };
    let admin = setup.admin.to_string();
    let url = setup.validator_url();
    let path = setup.truth.dir.join("plugin.json");
    let config = path.display().to_string();
    let args = [
        "--admin",
        &admin,
        "--validator",
        &url,
        "--plugin-config",
        &config,
    ];
    // What the filter would refuse, by the filter's own parser: every
    // problem, each with its field.
    let refused = json!({"validator_cluster": "staleguard-validator",
        "mdoe": "audit", "poll_wait_s": "30"});
    std::fs::write(&path, refused.to_string()).unwrap();
    let run = setup.audit(&args).await;
    assert_eq!(run.code, 2, "{}\n{}", run.stdout, run.stderr);
    for line in [
        "the filter would refuse it",
        "mdoe: unknown field `mdoe`",
        r#"poll_wait_s: invalid type: string "30""#,
    ] {
        assert!(run.stderr.contains(line), "{line}: {}", run.stderr);
    }
    // Valid, but it maps no cluster: nothing judged is no clean bill.
    let maps_nothing = json!({"validator_cluster": "staleguard-validator", "istio": false});
    std::fs::write(&path, maps_nothing.to_string()).unwrap();
    let run = setup.audit(&args).await;
    assert_eq!(run.code, 7, "{}\n{}", run.stdout, run.stderr);
    assert!(
        run.stderr.contains("nothing was judged")
            && run.stderr.contains("unmapped")
            && run.stderr.contains("--plugin-config"),
        "{}",
        run.stderr
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broken_admin_output_an_unreachable_admin_and_an_unreachable_validator_exit_distinctly() {
    let Some(setup) = Setup::start().await else {
        return;
    };
    let url = setup.validator_url();
    let live = Http::new()
        .get(&format!("http://{}/clusters?format=json", setup.admin))
        .await
        .unwrap()
        .text();
    let half = live[..live.len() / 2].to_owned();
    for (broken, what) in [
        (Broken::Body(half.clone()), "truncated"),
        (Broken::CutOff(half), "broke off"),
        (
            Broken::Body("<html>not envoy</html>".into()),
            "not complete JSON",
        ),
        (
            Broken::Body(r#"{"stats":[]}"#.into()),
            "not Envoy admin output",
        ),
    ] {
        let (addr, server) = audit::fake_admin(broken.clone()).await.unwrap();
        let run = setup
            .audit(&["--admin", &addr.to_string(), "--validator", &url])
            .await;
        server.abort();
        assert_eq!(run.code, 3, "{broken:?}: {}", run.stderr);
        assert!(
            run.stderr.contains("malformed or truncated"),
            "{}",
            run.stderr
        );
        assert!(run.stderr.contains(what), "{what}: {}", run.stderr);
    }

    let nobody = free_addr().unwrap().to_string();
    let run = setup
        .audit(&["--admin", &nobody, "--validator", &url])
        .await;
    assert_eq!(run.code, 4, "{}", run.stderr);
    assert!(
        run.stderr.contains("gateway admin is unreachable"),
        "{}",
        run.stderr
    );
    assert!(run.stderr.contains(&nobody), "{}", run.stderr);

    let admin = setup.admin.to_string();
    let run = setup
        .audit(&[
            "--admin",
            &admin,
            "--validator",
            &nobody,
            "--output",
            "json",
        ])
        .await;
    assert_eq!(run.code, 5, "{}", run.stderr);
    assert!(run.stderr.contains("cannot get verdicts"), "{}", run.stderr);
    let doc = run.json().unwrap();
    assert_eq!(doc["error"]["kind"], "validator_unreachable");
    assert_eq!(doc["exit_status"], 5);

    let missing = setup
        .truth
        .dir
        .join("no-such-dump.json")
        .display()
        .to_string();
    let run = setup
        .audit(&["--config-dump", &missing, "--validator", &url])
        .await;
    assert_eq!(run.code, 4, "{}", run.stderr);
    // Said as what it is: a file, not an admin port.
    assert!(
        run.stderr
            .contains(&format!("cannot read the config dump {missing}: "))
            && !run.stderr.contains("admin is unreachable"),
        "{}",
        run.stderr
    );

    // A --metrics-listen address in use is named.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken_addr = taken.local_addr().unwrap().to_string();
    let run = setup
        .audit(&[
            "--admin",
            &admin,
            "--validator",
            &url,
            "--every",
            "1s",
            "--metrics-listen",
            &taken_addr,
        ])
        .await;
    assert_ne!(run.code, 0, "{}", run.stderr);
    assert!(
        run.stderr.contains(&format!(
            "--metrics-listen {taken_addr}: cannot listen there"
        )),
        "{}",
        run.stderr
    );
    let run = setup.audit(&["--admin", &admin]).await;
    assert_eq!(run.code, 2, "{}", run.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_continuous_audit_with_every_1s_serves_stale_endpoints_by_gateway_cluster_and_reason() {
    let Some(mut setup) = Setup::start().await else {
        return;
    };
    let listen = free_addr().unwrap();
    let mut cmd = Command::new(&setup.deps.validator);
    cmd.arg("audit")
        .args(["--admin", &setup.admin.to_string()])
        .args(["--validator", &setup.validator_url()])
        .args(["--gateway", "gw-b", "--every", "1s"])
        .args(["--metrics-listen", &listen.to_string()]);
    let sidecar = OwnedProcess::spawn("audit-sidecar", cmd).unwrap();
    wait_for_port(&sidecar, listen, Duration::from_secs(30)).unwrap();
    let http = Http::new();
    let metrics = |want: Vec<String>| {
        let http = http.clone();
        async move {
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            loop {
                let text = http
                    .get(&format!("http://{listen}/metrics"))
                    .await
                    .map(|r| r.text())
                    .unwrap_or_default();
                if want.iter().all(|w| text.contains(w.as_str())) {
                    return text;
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "metrics never showed {want:?}:\n{text}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    let stale = |cluster: &str, reason: &str| {
        format!(
            "staleguard_validator_audit_stale_endpoints{{gateway=\"gw-b\",cluster=\"{cluster}\",reason=\"{reason}\"}} 1\n"
        )
    };
    let text = metrics(vec![
        stale(CART, "destroyed"),
        stale(CART, "recycled"),
        stale(CART_PLAIN, "destroyed"),
        stale(CART_PLAIN, "recycled"),
        "staleguard_validator_audit_endpoints{gateway=\"gw-b\",reason=\"unmapped\"} 2\n".into(),
        "staleguard_validator_audit_endpoints{gateway=\"gw-b\",reason=\"twin\"} 11\n".into(),
        "staleguard_validator_audit_runs_total{gateway=\"gw-b\",outcome=\"stale\"}".into(),
        "staleguard_validator_audit_last_success_timestamp_seconds{gateway=\"gw-b\"}".into(),
    ])
    .await;
    assert!(!text.contains(&format!("cluster=\"{PAY}\"")), "{text}");
    assert!(text.contains("# TYPE staleguard_validator_audit_run_duration_seconds gauge"));

    // The validator goes away: runs fail and are counted, and the last
    // findings stay for the alert.
    setup.truth.validator.kill();
    let text = metrics(vec![
        "staleguard_validator_audit_runs_total{gateway=\"gw-b\",outcome=\"validator_unreachable\"}"
            .into(),
    ])
    .await;
    assert!(text.contains(&stale(CART, "destroyed")), "{text}");
    sidecar.check_alive().unwrap();
}
