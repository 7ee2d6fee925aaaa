//! A whole stuck-control-plane setup, wired: a [`World`], the validator on its
//! file source, and gateways (guarded, unguarded, audit...) on its EDS files.
//!
//! [`Scene::sync`] is the one honest way to move the world forward: it
//! publishes the truth, waits until the validator says what the test expects
//! about the changed IPs, waits until every guarded gateway's filter has
//! applied at least the validator's generation, then writes EDS (unless
//! frozen) and waits for the gateways to load it, and only then changes what
//! answers on the pods' addresses (see [`crate::world`] for why that order).

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Result};

use crate::envoy::stats::{STAT_FRESH, STAT_GENERATION, STAT_RESETS};
use crate::envoy::{dependencies, Envoy, Gateway};
use crate::traffic::Http;
use crate::validator::{self, Source, Validator};
use crate::world::{cluster_name, World};

/// How long a sync may take before the test fails.
pub const SYNC_TIMEOUT: Duration = Duration::from_secs(30);

/// The binaries a scene runs.
#[derive(Debug, Clone)]
pub struct Deps {
    /// Envoy 1.40.
    pub envoy: PathBuf,
    /// The filter module.
    pub wasm: PathBuf,
    /// `staleguard-validator`.
    pub validator: PathBuf,
}

/// The binaries, or `None` after SKIP lines outside CI (a failure under CI).
pub fn deps() -> Option<Deps> {
    let (envoy, wasm) = dependencies()?;
    let validator = validator::binary()?;
    Some(Deps {
        envoy,
        wasm,
        validator,
    })
}

/// What the validator must say about one IP before a sync is complete:
/// `(service "namespace/name", ip, reason)`.
pub type Expect = (String, IpAddr, &'static str);

/// The running setup.
#[derive(Debug)]
pub struct Scene {
    /// The client every helper uses.
    pub http: Http,
    /// The simulated cluster.
    pub world: World,
    /// The validator.
    pub validator: Validator,
    /// The gateways, in the order given.
    pub gateways: Vec<Envoy>,
}

impl Scene {
    /// Publishes the world, starts the validator (with `validator_args`) and
    /// the gateways (built with [`World::gateway`]; the scene points them at
    /// its validator), and waits until all have the initial state: every
    /// cluster its EDS endpoints and, when guarded, the filter synced. The
    /// validator is detached when any gateway is.
    pub async fn start(
        deps: &Deps,
        world: World,
        validator_args: &[&str],
        specs: &[Gateway],
    ) -> Result<Self> {
        let truth = Source::File(world.truth_path().to_owned());
        Self::start_on(deps, world, truth, validator_args, specs).await
    }

    /// [`Scene::start`] with the validator on `source` (a kube source must
    /// already hold the world's objects).
    pub async fn start_on(
        deps: &Deps,
        mut world: World,
        source: Source,
        validator_args: &[&str],
        specs: &[Gateway],
    ) -> Result<Self> {
        let http = Http::new();
        world.publish()?;
        let detach = specs.iter().any(|s| s.detach);
        let validator =
            Validator::start_on(&http, &deps.validator, source, validator_args, detach).await?;
        let mut gateways = Vec::new();
        for spec in specs {
            let spec = Gateway {
                validators: vec![validator.listen],
                ..spec.clone()
            };
            gateways.push(spec.run(&deps.envoy, &deps.wasm, |_| Ok(()))?);
        }
        let scene = Self {
            http,
            world,
            validator,
            gateways,
        };
        scene.wait_gateways_have_eds()?;
        for gateway in scene.gateways.iter().filter(|g| g.guarded) {
            gateway.wait_stats("filter synced (index_fresh = 1)", SYNC_TIMEOUT, |s| {
                s.get(STAT_FRESH).copied() == Some(1)
            })?;
        }
        Ok(scene)
    }

    /// The gateway named `name`.
    pub fn gateway(&self, name: &str) -> Result<&Envoy> {
        match self.gateways.iter().find(|g| g.name == name) {
            Some(g) => Ok(g),
            None => bail!("no gateway {name}"),
        }
    }

    /// Publishes the world's changes, waits until the validator and every
    /// guarded gateway have them (and, when EDS is not frozen, every gateway
    /// has its new endpoints), then settles the pods' addresses. `expect` must
    /// name every IP whose address changes at the settle: it is how the sync
    /// knows the validator has read the new truth.
    pub async fn sync(&mut self, expect: &[Expect]) -> Result<()> {
        self.world.publish_truth()?;
        self.sync_told(expect).await
    }

    /// [`Scene::sync`] for a validator whose source the caller already told
    /// (a Kubernetes API server the test writes to): from step 2 on.
    pub async fn sync_told(&mut self, expect: &[Expect]) -> Result<()> {
        self.validator
            .wait_verdicts(&self.http, expect, SYNC_TIMEOUT)
            .await?;
        self.wait_filters_caught_up().await?;
        // The control plane comes after the validator, as it does in a cluster
        // (the validator watches the API; the gateway waits for its control
        // plane's push): a new pod is never routed to before the filter knows it.
        self.world.publish_eds()?;
        if !self.world.eds_frozen() {
            self.wait_gateways_have_eds()?;
        }
        self.world.settle();
        Ok(())
    }

    /// Waits until every gateway's clusters have as many endpoints as the
    /// world's services have pods (after an EDS write).
    pub fn wait_gateways_have_eds(&self) -> Result<()> {
        for gateway in &self.gateways {
            for service in self.world.services() {
                let want = self.world.pods_of(service).len() as u64;
                let stat = format!("cluster.{}.membership_total", cluster_name(service));
                gateway.wait_stats(&format!("{stat} = {want}"), SYNC_TIMEOUT, |s| {
                    s.get(&stat).copied() == Some(want)
                })?;
            }
        }
        Ok(())
    }

    /// Waits until every guarded gateway's filter applied the validator's
    /// current generation.
    pub async fn wait_filters_caught_up(&self) -> Result<()> {
        let (_, generation) = self.validator.generation(&self.http).await?;
        for gateway in self.gateways.iter().filter(|g| g.guarded) {
            gateway.wait_stats(
                &format!("{STAT_GENERATION} >= {generation}"),
                SYNC_TIMEOUT,
                |s| s.get(STAT_GENERATION).copied().unwrap_or(0) >= generation,
            )?;
        }
        Ok(())
    }

    /// Restarts the validator (a new epoch) and waits until every guarded
    /// gateway has resynced from it.
    pub async fn restart_validator(&mut self) -> Result<()> {
        let mut resets = Vec::new();
        for gateway in self.gateways.iter().filter(|g| g.guarded) {
            resets.push(gateway.stat(STAT_RESETS)?);
        }
        self.validator.restart(&self.http).await?;
        for (gateway, before) in self.gateways.iter().filter(|g| g.guarded).zip(resets) {
            gateway.eventually(&format!("{STAT_RESETS} > {before}"), SYNC_TIMEOUT, |g| {
                Ok(g.stat(STAT_RESETS)? > before)
            })?;
        }
        self.wait_filters_caught_up().await
    }
}
