//! Running the two listeners, and stopping them cleanly.

use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use tokio::net::TcpListener;

use super::connections::{self, ConnectionLimits};
use super::tls::{ServerTls, TlsError, TlsFiles};
use super::{admin_router, router, ApiState, Limits, Token, TokenError};

/// How the API is served (from `--listen`, `--admin-listen`, `--token-file`,
/// `--max-wait`, `--max-long-polls`, `--max-long-polls-per-client`,
/// `--request-timeout`, `--max-builds`,
/// `--max-verdict-batches`, `--shutdown-grace`,
/// `--max-connections`, `--max-connections-per-source`, `--header-read-timeout`,
/// `--idle-timeout`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiConfig {
    /// Address of the public listener (`/v1`).
    pub listen: SocketAddr,
    /// Address of the admin listener (`/healthz`, `/readyz`, `/metrics`).
    pub admin_listen: SocketAddr,
    /// File holding the bearer token `/v1` requires; `/v1` is open without it.
    pub token_file: Option<PathBuf>,
    /// Longest `wait` a long poll may ask for.
    pub max_wait: Duration,
    /// Long polls that may wait at once; more are answered 429.
    pub max_long_polls: usize,
    /// Of those, how many one client (source address) may hold.
    pub max_long_polls_per_client: usize,
    /// Time any request may take on top of its `wait`.
    pub request_timeout: Duration,
    /// Answers (snapshots, deltas) built at once; more wait their turn.
    pub max_builds: usize,
    /// `POST /v1/verdicts` read and judged at once; more wait their turn.
    pub max_verdict_batches: usize,
    /// After SIGTERM, how long open connections may take to finish.
    pub shutdown_grace: Duration,
    /// The public listener's connection bounds.
    pub connections: ConnectionLimits,
    /// The admin listener's connection bounds, apart from the public one's so
    /// that gateways cannot starve the probes.
    pub admin_connections: ConnectionLimits,
    /// TLS for the public listener; plain HTTP without it.
    pub tls: Option<TlsFiles>,
}

impl Default for ApiConfig {
    fn default() -> Self {
        let limits = Limits::default();
        Self {
            listen: Self::DEFAULT_LISTEN,
            admin_listen: Self::DEFAULT_ADMIN_LISTEN,
            token_file: None,
            max_wait: limits.max_wait,
            max_long_polls: limits.max_long_polls,
            max_long_polls_per_client: limits.max_long_polls_per_client,
            request_timeout: limits.request_timeout,
            max_builds: limits.max_builds,
            max_verdict_batches: limits.max_verdict_batches,
            shutdown_grace: Duration::from_secs(10),
            connections: ConnectionLimits::API,
            admin_connections: ConnectionLimits::ADMIN,
            tls: None,
        }
    }
}

/// Why the API could not be served.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// A listener could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// The token file is unusable.
    #[error(transparent)]
    Token(#[from] TokenError),
    /// The TLS certificate or key is unusable.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// A listener failed while serving.
    #[error("serving failed: {0}")]
    Io(#[from] std::io::Error),
}

impl ApiConfig {
    /// Where the public listener binds unless told otherwise (`--listen`):
    /// loopback, so a validator started by hand serves nobody else (in a
    /// cluster, `deploy/` sets `0.0.0.0:8080` and a token).
    pub const DEFAULT_LISTEN: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 8080);
    /// Where the admin listener binds unless told otherwise (`--admin-listen`):
    /// loopback, as [`Self::DEFAULT_LISTEN`].
    pub const DEFAULT_ADMIN_LISTEN: SocketAddr =
        SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 9090);

    /// The limits this configuration sets.
    pub fn limits(&self) -> Limits {
        Limits {
            max_wait: self.max_wait,
            max_long_polls: self.max_long_polls,
            max_long_polls_per_client: self.max_long_polls_per_client,
            request_timeout: self.request_timeout,
            max_builds: self.max_builds,
            max_verdict_batches: self.max_verdict_batches,
            ..Limits::default()
        }
    }

    /// Reads the token file, if one is configured.
    pub fn token(&self) -> Result<Option<Token>, TokenError> {
        self.token_file.as_deref().map(Token::from_file).transpose()
    }
}

/// Bound listeners, ready to serve. Binding first lets a caller report the
/// actual ports (port 0 picks a free one) before serving.
#[derive(Debug)]
pub struct Listeners {
    public: TcpListener,
    admin: TcpListener,
    public_limits: ConnectionLimits,
    admin_limits: ConnectionLimits,
    tls: Option<ServerTls>,
}

impl Listeners {
    /// Binds both listeners. The public listener's connection cap shrinks, with
    /// a warning, when the open file limit has no room for it beside the
    /// admin listener's ([`connections::fit_api_cap`]).
    pub async fn bind(config: &ApiConfig) -> Result<Self, ServeError> {
        let bind = |addr: SocketAddr| async move {
            TcpListener::bind(addr)
                .await
                .map_err(|source| ServeError::Bind { addr, source })
        };
        let admin_limits = config.admin_connections;
        let mut public_limits = config.connections;
        let file_limit = rlimit::getrlimit(rlimit::Resource::NOFILE)
            .ok()
            .map(|(soft, _)| soft);
        let fitted = connections::fit_api_cap(
            public_limits.max_connections,
            admin_limits.max_connections,
            file_limit,
        );
        if fitted < public_limits.max_connections {
            tracing::warn!(
                asked = public_limits.max_connections,
                allowed = fitted,
                file_limit,
                "the open file limit leaves room for fewer API connections than \
                 --max-connections; raise the limit (ulimit -n) to allow more"
            );
            public_limits.max_connections = fitted;
        }
        let tls = config.tls.as_ref().map(ServerTls::from_files).transpose()?;
        Ok(Self {
            public: bind(config.listen).await?,
            admin: bind(config.admin_listen).await?,
            public_limits,
            admin_limits,
            tls,
        })
    }

    /// True when the public listener serves TLS.
    pub fn tls(&self) -> bool {
        self.tls.is_some()
    }

    /// The public listener's address.
    pub fn public_addr(&self) -> std::io::Result<SocketAddr> {
        self.public.local_addr()
    }

    /// The admin listener's address.
    pub fn admin_addr(&self) -> std::io::Result<SocketAddr> {
        self.admin.local_addr()
    }
}

/// Serves until `stop` resolves. Then waiting long polls answer at once (the
/// caller's `ApiState` shutdown flag must be set by then, see [`ApiState::new`]),
/// and whatever is still open after `grace` is dropped.
pub async fn serve(
    listeners: Listeners,
    state: ApiState,
    token: Option<Token>,
    grace: Duration,
    stop: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    if let Some(token) = &token {
        tokio::spawn(
            token
                .clone()
                .watch(Duration::from_secs(10), state.metrics.clone()),
        );
    }
    if let Some(tls) = &listeners.tls {
        tokio::spawn(tls.clone().watch(Duration::from_secs(10)));
    }
    let (stopped_tx, stopped_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        stop.await;
        let _ = stopped_tx.send(true);
    });
    let until_stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let connections = state.metrics.connections();
    let public = connections::serve_bounded(
        listeners.public,
        router(state.clone(), token),
        listeners.public_limits,
        connections.clone(),
        "api",
        stopped_rx.clone(),
        listeners.tls.as_ref().map(|tls| tls.acceptor().clone()),
    );
    let admin = connections::serve_bounded(
        listeners.admin,
        admin_router(state),
        listeners.admin_limits,
        connections,
        "admin",
        stopped_rx.clone(),
        None,
    );
    let both = async { tokio::join!(public, admin) };
    tokio::select! {
        _ = both => {}
        _ = async {
            until_stopped(stopped_rx).await;
            tokio::time::sleep(grace).await;
        } => {
            tracing::warn!(?grace, "connections still open after the grace period; exiting anyway");
        }
    }
    Ok(())
}

/// Serves `index` in the background on `config`'s addresses (port 0 picks a
/// free one) until the process ends, and returns the public and admin
/// addresses: the validator's API inside a benchmark or a test harness
/// (feature `testing`).
#[cfg(any(test, feature = "testing"))]
pub async fn spawn(
    index: crate::live::SharedIndex,
    config: &ApiConfig,
) -> Result<(SocketAddr, SocketAddr), ServeError> {
    let listeners = Listeners::bind(config).await?;
    let addrs = (listeners.public_addr()?, listeners.admin_addr()?);
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let state = ApiState::new(
        index,
        std::sync::Arc::new(crate::metrics::Metrics::new()),
        config.limits(),
        stopped,
    );
    tokio::spawn(async move {
        let _keep_open = stop;
        serve(
            listeners,
            state,
            None,
            Duration::ZERO,
            std::future::pending(),
        )
        .await
    });
    Ok(addrs)
}
