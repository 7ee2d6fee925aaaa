//! `staleguard-validator`: see `--help`, and the library docs for the design.

use std::io::IsTerminal;

use clap::Parser;
use staleguard_validator::config::{Args, Config, LogFormat};
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() {
    let mut argv = std::env::args().skip(1);
    if staleguard_validator::audit::wants_audit(argv.next().as_deref()) {
        init_logs(LogFormat::Text);
        std::process::exit(staleguard_validator::audit::run(argv).await);
    }
    let args = Args::parse();
    let format = args.log_format;
    init_logs(format);
    let config = match Config::from_args(args) {
        Ok(config) => config,
        Err(error) => fatal(format, 2, &error.to_string()),
    };
    if let Err(error) = staleguard_validator::run(config).await {
        // The chain of causes on one line; no backtrace (RUST_BACKTRACE is
        // for panics, and a missing file is not one).
        fatal(format, 1, &format!("{error:#}"));
    }
}

/// Says why the validator stops, in the log format asked for, and exits.
fn fatal(format: LogFormat, code: i32, message: &str) -> ! {
    match format {
        LogFormat::Json => tracing::error!(error = %message, "stopping"),
        LogFormat::Text => eprintln!("staleguard-validator: {message}"),
    }
    std::process::exit(code)
}

fn init_logs(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    // Logs go to stderr so that `--once` and audit output on stdout stay clean;
    // colours only where a person reads them (a terminal), never in a
    // collected log.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.init(),
    }
}
