//! The commands README.md ("Running the pieces by hand") and docs/api.md show
//! run as written, against a validator on the built-in sample, and answer what
//! the docs say they answer (a `# {...}` line after a command is its expected
//! output). The only changes made to them: `cargo run -p staleguard-validator
//! --` is the built binary, and the ports are the ones this test's validator
//! got. The server start is this test's own, and the Wasm build is left to the
//! filter's tests. Needs `curl` and `jq` (SKIP without them outside CI).

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_staleguard-validator");

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// One command of a `sh` block and the output lines shown after it.
#[derive(Debug)]
struct Shown {
    file: &'static str,
    command: String,
    expected: Vec<String>,
}

/// The commands of the `sh` blocks of `file` (all of them, or only the block
/// after the heading `section`), continuation lines joined.
fn commands(file: &'static str, section: Option<&str>) -> Vec<Shown> {
    let text = std::fs::read_to_string(repo().join(file)).unwrap();
    let text = match section {
        Some(heading) => {
            let start = text
                .find(heading)
                .unwrap_or_else(|| panic!("no {heading} in {file}"));
            &text[start..]
        }
        None => &text[..],
    };
    let mut out: Vec<Shown> = Vec::new();
    let mut in_block = false;
    let mut pending = String::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            if in_block && section.is_some() {
                break;
            }
            in_block = line.trim() == "```sh";
            continue;
        }
        if !in_block {
            continue;
        }
        if let Some(output) = line.strip_prefix("# {") {
            if let Some(last) = out.last_mut() {
                last.expected.push(format!("{{{output}"));
            }
            continue;
        }
        if line.trim_start().starts_with('#') || line.trim().is_empty() {
            continue;
        }
        match line.strip_suffix('\\') {
            Some(head) => pending.push_str(head),
            None => {
                pending.push_str(line);
                out.push(Shown {
                    file,
                    command: std::mem::take(&mut pending),
                    expected: vec![],
                });
            }
        }
    }
    assert!(!out.is_empty(), "no commands found in {file}");
    out
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn have(tool: &str) -> bool {
    Command::new(tool)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn the_readme_and_api_doc_commands_run_as_written() {
    if !(have("curl") && have("jq")) {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "curl and jq are needed"
        );
        println!("SKIP: curl and jq are needed to run the documented commands");
        return;
    }
    let (port, admin) = (free_port(), free_port());
    let _validator = Running(
        Command::new(BIN)
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(["--admin-listen", &format!("127.0.0.1:{admin}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "the validator did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut shown = commands("README.md", Some("## Running the pieces by hand"));
    shown.extend(commands("docs/api.md", None));
    let mut ran = 0;
    // Variables a block sets (`E=$(...) G=$(...)`), for the commands after.
    let mut set = String::new();
    for Shown {
        file,
        command,
        expected,
    } in shown
    {
        // Ours to run: the server, and the Wasm build (the filter's tests).
        if command.contains("--listen 127.0.0.1:8080") || command.starts_with("cargo build") {
            continue;
        }
        let assigns = command.split_once('=').is_some_and(|(name, _)| {
            !name.is_empty() && name.bytes().all(|b| b.is_ascii_uppercase())
        });
        let run = command
            .replace("cargo run -p staleguard-validator --", BIN)
            .replace("localhost:8080", &format!("127.0.0.1:{port}"))
            .replace("127.0.0.1:8080", &format!("127.0.0.1:{port}"))
            .replace("127.0.0.1:9090", &format!("127.0.0.1:{admin}"));
        assert!(!run.contains("cargo "), "{file}: {command}");
        if assigns {
            set.push_str(&run);
            set.push_str("; ");
            continue;
        }
        let out = Command::new("bash")
            .args(["-c", &format!("set -o pipefail; {set}{run}")])
            .current_dir(repo())
            .env("TOKEN", "")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        // The audit of the sample's dump finds stale endpoints: exit 1, as
        // the README says.
        let code = if command.contains(" audit ") { 1 } else { 0 };
        assert_eq!(
            out.status.code(),
            Some(code),
            "{file}: {command}\n{stdout}\n{stderr}"
        );
        if !expected.is_empty() {
            let lines: Vec<&str> = stdout.lines().collect();
            assert_eq!(lines, expected, "{file}: {command}\n{stderr}");
        }
        ran += 1;
    }
    assert!(ran >= 10, "only {ran} commands ran");
}
