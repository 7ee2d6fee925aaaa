//! Child processes that die with the test, and dependencies that must exist.

use std::io::Read;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// True when running under CI (`CI=true`), where a missing dependency fails.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// Finds a dependency named by the environment variable `var` (set by
/// `scripts/setup.sh`). Under CI a missing one panics with `hint`; elsewhere it
/// prints a loud SKIP line and returns `None`, so the caller returns early.
pub fn require(var: &str, what: &str, hint: &str) -> Option<PathBuf> {
    match std::env::var_os(var).map(PathBuf::from) {
        Some(path) if path.exists() => Some(path),
        found => {
            let why = match found {
                Some(path) => format!("{var}={} does not exist", path.display()),
                None => format!("{var} is not set"),
            };
            if in_ci() {
                panic!("{what} is required under CI=true but {why}; {hint}");
            }
            eprintln!("SKIP: {what} unavailable ({why}); {hint}");
            None
        }
    }
}

/// A child process that is killed (and reaped) when dropped.
#[derive(Debug)]
pub struct OwnedProcess {
    name: String,
    /// Behind a lock so that [`OwnedProcess::check_alive`] (which reaps an exited
    /// child) works through a shared reference.
    child: Mutex<Option<Child>>,
    log: PathBuf,
}

impl OwnedProcess {
    /// Spawns `cmd` with its stdout and stderr sent to a log file named after
    /// `name`, so a failing test can show what the process said.
    pub fn spawn(name: &str, mut cmd: Command) -> Result<Self> {
        let log = std::env::temp_dir().join(format!(
            "staleguard-{name}-{}-{}.log",
            std::process::id(),
            unique()
        ));
        let out = std::fs::File::create(&log).with_context(|| format!("create {log:?}"))?;
        let err = out.try_clone()?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .with_context(|| format!("spawn {name}: {cmd:?}"))?;
        Ok(Self {
            name: name.to_owned(),
            child: Mutex::new(Some(child)),
            log,
        })
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .map_or(0, Child::id)
    }

    /// What the process has written so far.
    pub fn output(&self) -> String {
        let mut text = String::new();
        if let Ok(mut f) = std::fs::File::open(&self.log) {
            let _ = f.read_to_string(&mut text);
        }
        text
    }

    /// Fails with the process's output if it has exited.
    pub fn check_alive(&self) -> Result<()> {
        let mut child = self.child.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(child) = child.as_mut() {
            if let Some(status) = child.try_wait()? {
                bail!("{} exited with {status}:\n{}", self.name, self.output());
            }
        }
        Ok(())
    }

    /// Kills the process and waits for it.
    pub fn kill(&mut self) {
        let child = self.child.get_mut().unwrap_or_else(PoisonError::into_inner);
        if let Some(mut child) = child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for OwnedProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Waits until something accepts TCP connections on `addr`, failing with the
/// guard's output if the process dies first.
pub fn wait_for_port(guard: &OwnedProcess, addr: SocketAddr, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        guard.check_alive()?;
        if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "{addr} not accepting after {timeout:?}:\n{}",
                guard.output()
            );
        }
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// A free TCP port on 127.0.0.1 (free when asked; bind it soon).
pub fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// 127.0.0.1 on a [`free_port`]: a listener or admin address to hand a
/// process.
pub fn free_addr() -> Result<SocketAddr> {
    Ok(SocketAddr::from(([127, 0, 0, 1], free_port()?)))
}

fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}
