//! The staleguard validator: watches Pods, Services and EndpointSlices and keeps
//! a fresh pod IP -> identity index.
//!
//! Where to start: [`index`] is the pure state machine that turns watch events
//! into per-IP records (its rules are in `docs/index.md`); [`live`] puts it
//! behind a lock with freshness and watch health; [`source`] feeds it from the
//! Kubernetes API or a file; [`config`] reads flags and environment; [`run`]
//! wires them together. [`audit`] is the `audit` subcommand: what a gateway
//! holds that the index says is gone.
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used, clippy::panic))]

pub mod api;
pub mod audit;
pub mod config;
pub mod index;
pub mod live;
pub mod metrics;
pub mod scope;
pub mod source;
pub mod summary;
#[cfg(any(test, feature = "testing"))]
pub mod synth;

use std::time::{Duration, SystemTime};

use tokio::task::JoinHandle;

use crate::config::Config;
use crate::index::Index;
use crate::live::SharedIndex;
use crate::source::SourceError;

/// Why the validator stopped.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The source could not start.
    #[error(transparent)]
    Source(#[from] SourceError),
    /// The API could not be served.
    #[error(transparent)]
    Serve(#[from] crate::api::ServeError),
    /// `--once` gave up waiting for the initial sync.
    #[error("the initial sync did not finish within {0:?} (watch health: {1})")]
    SyncTimeout(Duration, String),
    /// A source task ended or panicked: the index would freeze while the
    /// process kept serving it, so the process stops (Kubernetes restarts it).
    #[error("{0}; stopping so that the validator is restarted with live watches")]
    SourceStopped(String),
}

/// Builds the shared index for `config`, with a random epoch.
pub fn shared_index(config: &Config) -> SharedIndex {
    // Below 2^53: exact in readers that hold JSON numbers as doubles (jq,
    // JavaScript), which would otherwise never match it in /v1/changes.
    let epoch = rand::random_range(1..staleguard_core::wire::MAX_EPOCH);
    SharedIndex::new(
        Index::new(epoch, config.index.clone()),
        config.max_staleness,
    )
}

/// Runs the validator: starts the source, waits for the initial sync, then
/// either prints a summary and returns (`--once`) or keeps the index current and
/// logs a summary whenever it changes, until SIGINT/SIGTERM or until a source
/// task stops.
pub async fn run(config: Config) -> Result<(), RunError> {
    if !config.once {
        let file_limit = api::raise_file_limit();
        tracing::info!(?file_limit, "open file limit");
    }
    let shared = shared_index(&config);
    let source_name = source::describe(&config.source);
    tracing::info!(source = %source_name, epoch = shared.epoch(), "starting");
    let tasks = source::start(&config.source, shared.clone()).await?;
    run_with_sources(&config, &shared, &source_name, tasks).await
}

/// [`run`] with the source's tasks already started on `shared`. Should any of
/// them end or panic, the index turns not fresh at once (`/healthz` fails,
/// waiting long polls answer `fresh: false`), the listeners drain and this
/// returns [`RunError::SourceStopped`], so the process exits non-zero.
pub async fn run_with_sources(
    config: &Config,
    shared: &SharedIndex,
    source_name: &str,
    tasks: Vec<JoinHandle<()>>,
) -> Result<(), RunError> {
    let aborts: Vec<_> = tasks.iter().map(JoinHandle::abort_handle).collect();
    let sources = watch_sources(tasks, shared.clone(), source_name.to_owned());
    tokio::pin!(sources);
    let expiry = tokio::spawn(expire_tombstones(shared.clone()));
    let result = if config.once {
        tokio::select! {
            synced = wait_for_sync(shared, config.sync_timeout) => if synced {
                print!("{}", summary::Summary::of(shared, source_name));
                Ok(())
            } else {
                Err(RunError::SyncTimeout(
                    config.sync_timeout,
                    summary::watch_line(shared),
                ))
            },
            stopped = &mut sources => Err(stopped),
        }
    } else {
        serve_until_shutdown(config, shared, source_name, sources).await
    };
    for task in aborts {
        task.abort();
    }
    expiry.abort();
    result
}

/// Waits for the first of `tasks` to finish (none should: sources run until
/// aborted), marks the index failed and says which and how.
async fn watch_sources(
    tasks: Vec<JoinHandle<()>>,
    shared: SharedIndex,
    source_name: String,
) -> RunError {
    if tasks.is_empty() {
        return std::future::pending().await;
    }
    let count = tasks.len();
    let (outcome, which, _rest) = futures::future::select_all(tasks).await;
    let how = match outcome {
        Ok(()) => "ended",
        Err(join) if join.is_panic() => "panicked",
        Err(_) => "was cancelled",
    };
    let reason = format!(
        "task {} of {count} of the source ({source_name}) {how}",
        which + 1
    );
    shared.fail(reason.clone());
    RunError::SourceStopped(reason)
}

/// Serves the API and logs index summaries until SIGINT/SIGTERM; then lets
/// waiting long polls answer and the listeners drain within the grace period.
async fn serve_until_shutdown(
    config: &Config,
    shared: &SharedIndex,
    source_name: &str,
    sources: std::pin::Pin<&mut impl std::future::Future<Output = RunError>>,
) -> Result<(), RunError> {
    let token = config.api.token().map_err(api::ServeError::from)?;
    let listeners = api::Listeners::bind(&config.api).await?;
    tracing::info!(
        listen = %listeners.public_addr().map_err(api::ServeError::from)?,
        admin = %listeners.admin_addr().map_err(api::ServeError::from)?,
        auth = token.is_some(),
        tls = listeners.tls(),
        "serving the index"
    );
    if !config.api.listen.ip().is_loopback() {
        if token.is_none() {
            tracing::warn!(
                listen = %config.api.listen,
                "/v1 is open to the network without a token (--allow-no-token)"
            );
        }
        if !listeners.tls() {
            tracing::warn!(
                listen = %config.api.listen,
                "/v1 is served in clear beyond loopback (--allow-plaintext)"
            );
        }
    }
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let state = api::ApiState::new(
        shared.clone(),
        std::sync::Arc::new(metrics::Metrics::new()),
        config.api.limits(),
        stop_rx.clone(),
    );
    let mut stopped = stop_rx;
    let server = tokio::spawn(api::serve(
        listeners,
        state,
        token,
        config.api.shutdown_grace,
        async move {
            let _ = stopped.wait_for(|s| *s).await;
        },
    ));
    tokio::pin!(server);
    tokio::select! {
        () = log_changes(shared, source_name) => {}
        // A listener that fails ends the process rather than leaving it
        // half-alive behind a readiness probe that still answers.
        result = &mut server => return joined(result),
        // So does a source that stopped: its index would freeze. Waiting long
        // polls answer (not fresh) and the listeners drain first.
        stopped = sources => {
            let _ = stop_tx.send(true);
            let _ = joined(server.await);
            return Err(stopped);
        }
    }
    let _ = stop_tx.send(true);
    joined(server.await)
}

fn joined(
    result: Result<Result<(), api::ServeError>, tokio::task::JoinError>,
) -> Result<(), RunError> {
    match result {
        Ok(served) => Ok(served?),
        Err(join) => Err(api::ServeError::from(std::io::Error::other(join.to_string())).into()),
    }
}

/// Waits until every kind finished its initial list; false after `timeout`.
pub async fn wait_for_sync(shared: &SharedIndex, timeout: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if shared.read().synced() {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Drops expired tombstones once a second.
pub async fn expire_tombstones(shared: SharedIndex) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        shared.expire_tombstones(SystemTime::now());
    }
}

/// Logs a summary on every change (at most once a second) until shutdown.
async fn log_changes(shared: &SharedIndex, source_name: &str) {
    let mut generations = shared.subscribe();
    let mut last_logged = None;
    let shutdown = shutdown_signal();
    tokio::pin!(shutdown);
    loop {
        let generation = *generations.borrow_and_update();
        if last_logged != Some(generation) && shared.read().synced() {
            summary::Summary::counts(shared, source_name).log();
            last_logged = Some(generation);
        }
        tokio::select! {
            _ = &mut shutdown => {
                tracing::info!("shutting down");
                return;
            }
            changed = generations.changed() => {
                if changed.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            // Also re-check when nothing changes: the initial sync of an empty
            // source moves no generation.
            _ = tokio::time::sleep(Duration::from_secs(1)), if last_logged.is_none() => {}
        }
    }
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(error) = tokio::signal::ctrl_c().await {
            tracing::error!(%error, "cannot listen for SIGINT");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(error) => {
                tracing::error!(%error, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[test]
    fn epochs_are_exact_as_doubles() {
        let config =
            Config::from_args(config::Args::try_parse_from(["staleguard-validator"]).unwrap())
                .unwrap();
        for _ in 0..1000 {
            let epoch = shared_index(&config).epoch();
            assert!(
                (1..staleguard_core::wire::MAX_EPOCH).contains(&epoch),
                "{epoch}"
            );
        }
    }
}
