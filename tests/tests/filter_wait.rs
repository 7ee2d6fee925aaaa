//! The validator and the filter agree on the long-poll wait: a validator whose
//! `--max-wait` is shorter than the filter's `poll_wait_s` answers each long
//! poll sooner instead of refusing it, so the guard stays fresh (it used to
//! answer 400 to every poll, silently, until the filter's data went stale).

use std::time::Duration;

use anyhow::Result;
use serde_json::json;
use staleguard_tests::blocking::named_host;
use staleguard_tests::envoy::{shipped_plugin, Cluster, Gateway};
use staleguard_tests::scene;
use staleguard_tests::traffic::Http;
use staleguard_tests::validator::Validator;

const SAMPLE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../validator/samples/demo.yaml"
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_max_wait_below_poll_wait_s_answers_sooner_and_the_guard_stays_fresh() -> Result<()> {
    let Some(deps) = scene::deps() else {
        return Ok(());
    };
    let http = Http::new();
    // The shipped poll_wait_s is 30 s; this validator waits 1 s at most.
    let validator = Validator::start(
        &http,
        &deps.validator,
        SAMPLE.as_ref(),
        &["--max-wait", "1s"],
        false,
    )
    .await?;
    assert!(shipped_plugin(json!({}))["poll_wait_s"].as_u64() > Some(1));
    let host = named_host("127.0.1.44", "cart")?;
    let gateway = Gateway::new(
        validator.listen,
        vec![Cluster::new(
            "shop-cart",
            host.addr(),
            Some(shipped_plugin(json!({}))),
        )],
    );
    let envoy = gateway.run(&deps.envoy, &deps.wasm, |_| Ok(()))?;
    envoy.wait_first_sync()?;
    let polls = envoy.stat("wasmcustom.staleguard_filter_sync_polls_total")?;
    // Long polls answered about every second, each a delta.
    envoy.eventually("three more long polls", Duration::from_secs(20), |e| {
        Ok(e.stat("wasmcustom.staleguard_filter_sync_polls_total")? >= polls + 3)
    })?;
    let stats = envoy.stats()?;
    let errors: u64 = stats
        .iter()
        .filter(|(name, _)| name.starts_with("wasmcustom.staleguard_filter_sync_errors_total"))
        .map(|(_, value)| value)
        .sum();
    assert_eq!(errors, 0, "{}", validator.output());
    assert!(envoy.stat("wasmcustom.staleguard_filter_sync_deltas_total")? >= 2);
    assert_eq!(envoy.stat("wasmcustom.staleguard_filter_index_fresh")?, 1);
    assert!(
        !validator.output().contains("refused a request"),
        "{}",
        validator.output()
    );
    Ok(())
}
