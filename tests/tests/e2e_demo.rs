//! Smoke test of the one-command demo: `staleguard-demo --duration` runs the
//! story non-interactively, reports that the guard stopped every misrouted
//! request while the unguarded gateway let some through, that with retry on
//! the guarded gateway failed none, prints the audit of both gateways while
//! the control plane is stuck, and leaves nothing listening behind it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::{SocketAddr, TcpStream};
use std::process::Command;
use std::time::Duration;

use staleguard_tests::scene;

#[test]
fn the_demo_runs_reports_and_cleans_up() {
    if scene::deps().is_none() {
        return;
    }
    let out = Command::new(env!("CARGO_BIN_EXE_staleguard-demo"))
        .args(["--duration", "14", "--plain", "--pods", "30", "--keep", "4"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "demo failed: {}\n{stdout}\n{stderr}",
        out.status
    );
    println!("{stdout}");

    // "summary: with staleguard G of N requests reached a wrong or dead pod;
    // without, P of M; the guarded gateway failed F of N requests, the
    // unguarded E of M."
    let summary = stdout
        .lines()
        .find(|l| l.starts_with("summary:"))
        .unwrap_or_else(|| panic!("no summary line:\n{stdout}"));
    let numbers: Vec<u64> = summary
        .split(|c: char| !c.is_ascii_digit() && c != ',')
        .filter_map(|w| w.replace(',', "").parse().ok())
        .collect();
    let [guarded, guarded_total, plain, plain_total, guarded_failed, guarded_total_again, _plain_failed, _] =
        numbers[..]
    else {
        panic!("unexpected summary: {summary}");
    };
    assert_eq!(guarded_total, guarded_total_again, "{summary}");
    // Retry on: every request the guard rejects is replayed to a live pod.
    assert_eq!(
        guarded_failed, 0,
        "the guarded gateway failed requests: {summary}"
    );
    assert_eq!(guarded, 0, "{summary}");
    assert!(guarded_total > 0 && plain_total > 0, "{summary}");
    assert!(
        plain > 0,
        "the unguarded gateway was never misrouted: {summary}"
    );
    assert!(
        stdout.contains(" destroyed (guard in sync after"),
        "{stdout}"
    );

    // While stuck, it printed the audit of both gateways: the same frozen
    // EDS, so the same stale endpoints, guarded or not.
    for gateway in ["guarded", "unguarded"] {
        assert!(
            stdout.contains(&format!(
                "audit of gateway {gateway}: verdicts from http://"
            )),
            "no audit of {gateway}:\n{stdout}"
        );
    }
    let stale_lines: Vec<&str> = stdout
        .lines()
        .filter(|l| l.contains("(shop/checkout): ") && l.ends_with(" STALE"))
        .collect();
    assert_eq!(stale_lines.len(), 2, "{stdout}");
    assert_eq!(
        stale_lines[0], stale_lines[1],
        "both gateways hold the same"
    );

    // Every admin address it printed is closed: Envoy and the validator are gone.
    let addrs: Vec<SocketAddr> = stdout
        .split_whitespace()
        .filter_map(|w| w.strip_prefix("http://"))
        .filter_map(|w| w.split('/').next())
        .filter_map(|a| a.parse().ok())
        .collect();
    assert!(addrs.len() >= 3, "no URLs printed:\n{stdout}");
    for addr in addrs {
        assert!(
            TcpStream::connect_timeout(&addr, Duration::from_millis(300)).is_err(),
            "{addr} still accepts connections after the demo exited"
        );
    }
}
