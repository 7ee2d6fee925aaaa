//! A source task that ends or panics must not leave the validator serving a
//! frozen index as fresh: the index turns not fresh at once, `/healthz` fails,
//! and the run returns an error (the process exits non-zero and Kubernetes
//! restarts it). Each test ends a source task of a running validator.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use clap::Parser;
use staleguard_validator::api::{self, ApiState, Limits};
use staleguard_validator::config::{Args, Config};
use staleguard_validator::live::SharedIndex;
use staleguard_validator::metrics::Metrics;
use staleguard_validator::source::file;
use staleguard_validator::{run_with_sources, shared_index, RunError};
use tokio::sync::oneshot;
use tower::ServiceExt;

fn config() -> Config {
    let argv = [
        "staleguard-validator",
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
        "--shutdown-grace",
        "1s",
    ];
    Config::from_args(Args::try_parse_from(argv).unwrap()).unwrap()
}

async fn healthz(shared: &SharedIndex) -> StatusCode {
    let (_tx, rx) = tokio::sync::watch::channel(false);
    let state = ApiState::new(
        shared.clone(),
        Arc::new(Metrics::new()),
        Limits::default(),
        rx,
    );
    api::admin_router(state)
        .oneshot(Request::get("/healthz").body(Body::empty()).unwrap())
        .await
        .unwrap()
        .status()
}

/// Runs a validator on the embedded sample plus one more source task that ends
/// (or panics) when told; returns what the run returned and the index.
async fn run_until_a_source_stops(panic: bool) -> (Result<(), RunError>, SharedIndex) {
    let config = config();
    let shared = shared_index(&config);
    let (stop, stopped) = oneshot::channel::<()>();
    let fragile = tokio::spawn(async move {
        let _ = stopped.await;
        assert!(!panic, "a bug in a watch task");
    });
    let tasks = vec![file::start_embedded(shared.clone()).unwrap(), fragile];
    let run = tokio::spawn({
        let shared = shared.clone();
        async move { run_with_sources(&config, &shared, "test", tasks).await }
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !shared.ready() {
        assert!(tokio::time::Instant::now() < deadline, "never fresh");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(healthz(&shared).await, StatusCode::OK);
    // A deliberate hold, not a wait for something: nothing may happen in it,
    // and no condition says "nothing will"; a slow machine only makes the
    // check weaker, never wrong.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!run.is_finished(), "stopped while every source was running");

    stop.send(()).unwrap();
    let result = tokio::time::timeout(Duration::from_secs(10), run)
        .await
        .expect("the validator kept running after a source task stopped")
        .unwrap();
    (result, shared)
}

fn assert_stopped(result: Result<(), RunError>, how: &str) {
    match result {
        Err(RunError::SourceStopped(reason)) => {
            assert!(reason.contains(how), "{reason}");
            assert!(reason.contains("task 2 of 2"), "{reason}");
        }
        other => panic!("expected SourceStopped, got {other:?}"),
    }
}

#[tokio::test]
async fn a_source_task_that_ends_stops_the_validator_and_turns_the_index_stale() {
    let (result, shared) = run_until_a_source_stops(false).await;
    assert_stopped(result, "ended");
    assert!(!shared.freshness().fresh);
    assert!(!shared.ready());
    assert_eq!(healthz(&shared).await, StatusCode::SERVICE_UNAVAILABLE);
}

#[tokio::test]
async fn a_source_task_that_panics_stops_the_validator_and_turns_the_index_stale() {
    let (result, shared) = run_until_a_source_stops(true).await;
    assert_stopped(result, "panicked");
    assert!(!shared.freshness().fresh);
    assert_eq!(healthz(&shared).await, StatusCode::SERVICE_UNAVAILABLE);
}
