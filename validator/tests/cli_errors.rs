//! What a person or a log collector sees when the validator cannot start: one
//! clear line (no backtrace, no colour codes off a terminal), in JSON under
//! `--log-format json`, and a warning for a file that holds nothing.

use std::process::{Command, Output};

fn validator(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_staleguard-validator"))
        .args(args)
        // Asks for backtraces: a missing file must not produce one.
        .env("RUST_BACKTRACE", "1")
        .env_remove("RUST_LOG")
        .output()
        .unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn missing() -> String {
    std::env::temp_dir()
        .join(format!(
            "staleguard-no-such-file-{}.yaml",
            std::process::id()
        ))
        .display()
        .to_string()
}

#[test]
fn a_missing_file_is_one_line_without_a_backtrace_and_without_colour_codes() {
    let path = missing();
    let out = validator(&["--once", "--file", &path]);
    let text = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.lines()
            .any(|l| l.starts_with("staleguard-validator: cannot read")
                && l.contains(&path)
                && l.contains("No such file")),
        "{text}"
    );
    assert!(text.lines().count() <= 3, "{text}");
    assert!(!text.to_lowercase().contains("backtrace"), "{text}");
    // stderr is a pipe here, as in a container: no ANSI escapes.
    assert!(!text.contains('\u{1b}'), "{text:?}");
}

#[test]
fn log_format_json_covers_the_fatal_error_too() {
    let path = missing();
    for (args, code, what) in [
        (
            vec!["--log-format", "json", "--once", "--file", path.as_str()],
            1,
            path.as_str(),
        ),
        (
            vec!["--log-format", "json", "--max-wait", "soon"],
            2,
            "--max-wait",
        ),
    ] {
        let out = validator(&args);
        let text = stderr(&out);
        assert_eq!(out.status.code(), Some(code), "{args:?}: {text}");
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l:?}")))
            .collect();
        let fatal = lines.last().unwrap();
        assert_eq!(fatal["level"], "ERROR", "{text}");
        assert!(
            fatal["fields"]["error"].as_str().unwrap().contains(what),
            "{text}"
        );
    }
}

#[test]
fn an_empty_file_is_served_with_a_warning() {
    let path = std::env::temp_dir().join(format!("staleguard-empty-{}.yaml", std::process::id()));
    std::fs::write(&path, "").unwrap();
    let out = validator(&["--once", "--file", path.to_str().unwrap()]);
    let _ = std::fs::remove_file(&path);
    let text = stderr(&out);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(
        text.contains("WARN") && text.contains("no Pods, Services or EndpointSlices"),
        "{text}"
    );
}
