//! `staleguard-validator`: see `--help`, and the library docs for the design.

use clap::Parser;
use staleguard_validator::config::{Args, Config, LogFormat};
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let format = args.log_format;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    // Logs go to stderr so that `--once` output on stdout stays clean.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.init(),
    }
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
