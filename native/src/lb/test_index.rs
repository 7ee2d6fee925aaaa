//! A test build's index (`--features test-index`, never shipped): the
//! snapshot file named by `STALEGUARD_NATIVE_TEST_SNAPSHOT` (the validator's
//! `/v1/snapshot` document), loaded when the first policy is configured and
//! again whenever the file changes, by a thread of its own. It lets the
//! policy's Envoy tests and benchmarks fill the process's index without the
//! module's poller.

use std::sync::Once;
use std::time::{Duration, SystemTime};

use crate::index;

/// The environment variable naming the snapshot file.
pub const VAR: &str = "STALEGUARD_NATIVE_TEST_SNAPSHOT";

/// Starts the loader once per process, when the variable is set.
pub fn start() {
    static STARTED: Once = Once::new();
    STARTED.call_once(|| {
        let Some(path) = std::env::var_os(VAR) else {
            return;
        };
        let spawned = std::thread::Builder::new()
            .name("staleguard-test-index".into())
            .spawn(move || {
                let mut seen: Option<SystemTime> = None;
                loop {
                    let modified = std::fs::metadata(&path).and_then(|m| m.modified()).ok();
                    if modified.is_some() && modified != seen {
                        match std::fs::read(&path) {
                            Ok(bytes) => match index::load_snapshot(&bytes, index::now_ms()) {
                                Ok(_) => {
                                    seen = modified;
                                    eprintln!("staleguard: test index loaded from {path:?}");
                                }
                                Err(e) => eprintln!("staleguard: test index {path:?}: {e}"),
                            },
                            Err(e) => eprintln!("staleguard: test index {path:?}: {e}"),
                        }
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            });
        if let Err(e) = spawned {
            eprintln!("staleguard: test index thread: {e}");
        }
    });
}
