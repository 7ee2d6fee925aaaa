//! `staleguard-demo`: the local demonstration `scripts/demo` runs. See
//! `staleguard_tests::demo` for what it does; `scripts/demo` installs and builds
//! what it needs and sets the environment.

use std::time::Duration;

use anyhow::{bail, Result};
use clap::Parser;
use staleguard_tests::demo::{self, Options};
use staleguard_tests::scene;

/// A stuck control plane, real Envoy with and without staleguard, and a live
/// table of where requests went.
#[derive(Debug, Parser)]
#[command(name = "staleguard-demo")]
struct Args {
    /// Stop after this many seconds (default: run until Ctrl-C).
    #[arg(long)]
    duration: Option<u64>,
    /// Pods of the `checkout` service before each scale-down.
    #[arg(long, default_value_t = 60)]
    pods: usize,
    /// Pods `checkout` keeps after a scale-down.
    #[arg(long, default_value_t = 6)]
    keep: usize,
    /// Print events as lines instead of a live table (the default when stdout
    /// is not a terminal).
    #[arg(long)]
    plain: bool,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let args = Args::parse();
    if args.keep == 0 || args.keep >= args.pods {
        bail!("--keep must be between 1 and --pods - 1");
    }
    let Some(deps) = scene::deps() else {
        bail!("missing dependencies (see the SKIP lines above); run scripts/demo, which installs them");
    };
    let options = Options {
        duration: args.duration.map(Duration::from_secs),
        checkout_pods: args.pods,
        checkout_keep: args.keep,
        live: !args.plain && demo::stdout_is_terminal(),
    };
    demo::run(&deps, &options).await?;
    Ok(())
}
