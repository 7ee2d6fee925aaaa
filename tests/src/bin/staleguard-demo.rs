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
    /// Stop after this long: seconds (`60`) or a duration as the validator's
    /// flags take it (`40s`, `2m`, `1m30s`); at least 10s (default: run until
    /// Ctrl-C).
    #[arg(long, value_parser = parse_duration)]
    duration: Option<Duration>,
    /// Pods of the `checkout` service before each scale-down (the
    /// incident's proportions: 25, of which 2 stay).
    #[arg(long, default_value_t = 25)]
    pods: usize,
    /// Pods `checkout` keeps after a scale-down.
    #[arg(long, default_value_t = 2)]
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
        duration: args.duration,
        checkout_pods: args.pods,
        checkout_keep: args.keep,
        live: !args.plain && demo::stdout_is_terminal(),
    };
    demo::run(&deps, &options).await?;
    Ok(())
}

/// The shortest `--duration`: the gateways, the validator and the services
/// take seconds to start, and a shorter run ends before the first scene.
const MIN_DURATION: Duration = Duration::from_secs(10);

/// `--duration`: bare seconds, or the validator's duration syntax.
fn parse_duration(text: &str) -> Result<Duration, String> {
    let duration = match text.trim().parse::<u64>() {
        Ok(seconds) => Duration::from_secs(seconds),
        Err(_) => staleguard_validator::config::parse_duration(text)?,
    };
    if duration < MIN_DURATION {
        return Err(format!(
            "{text:?} is too short: the demo needs at least {}s to start and show a scene \
             (leave --duration out to run until Ctrl-C)",
            MIN_DURATION.as_secs()
        ));
    }
    Ok(duration)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn duration_takes_seconds_or_the_validators_form_and_refuses_too_short() {
        assert_eq!(parse_duration("60"), Ok(Duration::from_secs(60)));
        assert_eq!(parse_duration("40s"), Ok(Duration::from_secs(40)));
        assert_eq!(parse_duration("1m30s"), Ok(Duration::from_secs(90)));
        for short in ["0", "0s", "5s", "9"] {
            let err = parse_duration(short).unwrap_err();
            assert!(err.contains("at least 10s"), "{short}: {err}");
        }
        assert!(parse_duration("soon").unwrap_err().contains("30s"));
        let err = Args::try_parse_from(["staleguard-demo", "--duration", "0"]).unwrap_err();
        assert!(err.to_string().contains("too short"), "{err}");
    }
}
