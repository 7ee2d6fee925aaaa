//! `staleguard-validator`: see `--help`, and the library docs for the design.

use clap::Parser;
use staleguard_validator::config::{Args, Config, LogFormat};
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut argv = std::env::args().skip(1);
    if staleguard_validator::audit::wants_audit(argv.next().as_deref()) {
        init_logs(LogFormat::Text);
        std::process::exit(staleguard_validator::audit::run(argv).await);
    }
    let args = Args::parse();
    init_logs(args.log_format);
    let config = match Config::from_args(args) {
        Ok(config) => config,
        Err(error) => {
            eprintln!("staleguard-validator: {error}");
            std::process::exit(2);
        }
    };
    staleguard_validator::run(config).await?;
    Ok(())
}

fn init_logs(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    // Logs go to stderr so that `--once` and audit output on stdout stay clean.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.init(),
    }
}
