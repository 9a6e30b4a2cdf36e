//! Running the service: open the store ([`Server::open`]), mount what the
//! program composes on it ([`Starting::mount`]), bind the socket
//! ([`Starting::bind`]), serve the router until a shutdown signal, then
//! finish the requests in flight. [`Server::bind`] is the v1 contract alone.
//!
//! Leases survive a shutdown: they belong to the callers, who either end
//! their turns against the next server on the same store or let them expire.

use std::fmt;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use agentgate::{Config, Gate};
use agentgate_core::lease::LeaseLayer;
use agentgate_store_redis::RedisLeases;
use axum::Router;
use tokio::net::TcpListener;

use crate::auth::ApiKey;
use crate::limits::{DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_CONNECTIONS, MAX_MAX_CONNECTIONS};
use crate::mount::{Extensions, Mount};
use crate::{router_with, AppState, ServerOptions};

/// How long a pending confirmation waits for a person under `agentgate
/// serve`, in ms: ten minutes. The engine's own default is a day, for
/// library users whose approvals go through a queue; a person at the chat
/// page answers within minutes or not at all, and until the confirmation
/// expires every new message in that conversation is refused.
pub const DEFAULT_CONFIRMATION_TTL_MS: u64 = 10 * 60 * 1000;

/// Everything the service is configured with (`agentgate serve`'s flags
/// but those of a mounted app).
#[derive(Clone)]
pub struct ServeConfig {
    /// Address to listen on, `host:port`; port 0 picks a free one.
    pub listen: String,
    /// The store URL (`sqlite://path`).
    pub store_url: String,
    /// The Redis lease layer's URL, if any: session leases and permits then
    /// live in Redis, records and fences stay in the SQL store.
    pub redis_url: Option<String>,
    /// How long a lease lives without a heartbeat.
    pub lease_ttl: Duration,
    /// Concurrent live turns per user unless overridden per user.
    pub max_turns_per_user: u32,
    /// How long a pending confirmation waits for an answer before it
    /// expires (judged on the store's clock).
    pub confirmation_ttl: Duration,
    /// How long a running turn asked to stop has to end itself before the
    /// sweeper force-releases it.
    pub cancel_grace: Duration,
    /// How long an orphan waits for a retry or a recovery worker before the
    /// sweeper ends it `abandoned` (never less than the lease TTL).
    pub orphan_grace: Duration,
    /// How often the sweeper runs (orphans, ignored cancels, retention).
    pub sweep_interval: Duration,
    /// Pooled connections of a PostgreSQL or MySQL store.
    pub store_connections: u32,
    /// When non-empty, every `/v1` call needs one of these as a bearer key.
    pub api_keys: Vec<ApiKey>,
    /// Recovery workers' keys (see [`crate::ServerOptions::recovery_keys`]).
    pub recovery_keys: Vec<ApiKey>,
    /// Largest request body.
    pub max_body_bytes: usize,
    /// Most connections open at once; more are answered 503 and closed.
    pub max_connections: usize,
    /// Most connections one client (peer IP address) holds open at once;
    /// more are answered 503 and closed.
    pub max_connections_per_client: usize,
    /// `Host` names answered besides IP addresses, `localhost` and the
    /// listen host (`name` or `name:port`).
    pub allowed_hosts: Vec<String>,
    /// Origins (`https://name[:port]`) allowed besides the server itself.
    pub allowed_origins: Vec<String>,
    /// The header a trusted front end names the caller's user in, if any.
    pub user_header: Option<String>,
}

impl Default for ServeConfig {
    fn default() -> Self {
        let engine = Config::default();
        Self {
            listen: "127.0.0.1:7700".to_owned(),
            store_url: "sqlite://agentgate.db".to_owned(),
            redis_url: None,
            lease_ttl: engine.lease_ttl,
            max_turns_per_user: engine.max_turns_per_user,
            confirmation_ttl: Duration::from_millis(DEFAULT_CONFIRMATION_TTL_MS),
            cancel_grace: engine.cancel_grace,
            orphan_grace: engine.orphan_grace,
            sweep_interval: engine.sweep_interval,
            store_connections: engine.store_connections,
            api_keys: Vec::new(),
            recovery_keys: Vec::new(),
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_connections_per_client: crate::limits::DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
            allowed_hosts: Vec::new(),
            allowed_origins: Vec::new(),
            user_header: None,
        }
    }
}

/// A URL fit for logs: credentials replaced, so
/// `postgres://user:secret@host/db` shows as `postgres://…@host/db`.
fn redact_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme_end), Some(at)) if at > scheme_end => {
            format!("{}://…{}", &url[..scheme_end], &url[at..])
        }
        _ => url.to_owned(),
    }
}

impl fmt::Debug for ServeConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServeConfig")
            .field("listen", &self.listen)
            .field("store_url", &redact_url(&self.store_url))
            .field("redis_url", &self.redis_url.as_deref().map(redact_url))
            .field("lease_ttl", &self.lease_ttl)
            .field("max_turns_per_user", &self.max_turns_per_user)
            .field("confirmation_ttl", &self.confirmation_ttl)
            .field("cancel_grace", &self.cancel_grace)
            .field("orphan_grace", &self.orphan_grace)
            .field("sweep_interval", &self.sweep_interval)
            .field("store_connections", &self.store_connections)
            .field("api_keys", &self.api_keys.len())
            .field("recovery_keys", &self.recovery_keys.len())
            .field("max_body_bytes", &self.max_body_bytes)
            .field("max_connections", &self.max_connections)
            .field(
                "max_connections_per_client",
                &self.max_connections_per_client,
            )
            .field("allowed_hosts", &self.allowed_hosts)
            .field("allowed_origins", &self.allowed_origins)
            .field("user_header", &self.user_header)
            .finish()
    }
}

/// Why the service could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    /// A setting is out of range or unsupported.
    #[error("configuration: {0}")]
    Config(String),
    /// The engine refused to open the store.
    #[error("cannot open the store: {0}")]
    Store(#[source] agentgate::Error),
    /// A mounted app could not open (its tables, its model): the app's own
    /// error, boxed, since this crate knows no app.
    #[error("cannot open the app: {0}")]
    App(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The socket could not be bound or served.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

/// A bound, ready server.
#[derive(Debug)]
pub struct Server {
    listener: TcpListener,
    router: Router,
    local_addr: SocketAddr,
    max_connections: usize,
    max_connections_per_client: usize,
}

impl Server {
    /// Opens the store and binds the socket for the v1 contract alone (no
    /// mounts); call [`Server::run`] to serve.
    ///
    /// # Errors
    /// As [`Server::open`] and [`Starting::bind`].
    pub async fn bind(config: ServeConfig) -> Result<Self, ServeError> {
        Self::open(config).await?.bind().await
    }

    /// Opens the store (and the Redis lease layer, if any); mount apps on
    /// the result, then [`Starting::bind`].
    ///
    /// # Errors
    /// [`ServeError::Config`] for a setting out of range or an unsupported
    /// store URL; [`ServeError::Store`] when the store (or Redis) cannot be
    /// opened.
    pub async fn open(config: ServeConfig) -> Result<Starting, ServeError> {
        if config.max_connections == 0 || config.max_connections > MAX_MAX_CONNECTIONS {
            return Err(ServeError::Config(format!(
                "max connections is {}, allowed 1..={MAX_MAX_CONNECTIONS}",
                config.max_connections
            )));
        }
        if config.max_connections_per_client == 0
            || config.max_connections_per_client > config.max_connections
        {
            return Err(ServeError::Config(format!(
                "max connections per client is {}, allowed 1..=max connections ({})",
                config.max_connections_per_client, config.max_connections
            )));
        }
        let engine = Config {
            lease_ttl: config.lease_ttl,
            max_turns_per_user: config.max_turns_per_user,
            confirmation_ttl: config.confirmation_ttl,
            cancel_grace: config.cancel_grace,
            orphan_grace: config.orphan_grace,
            sweep_interval: config.sweep_interval,
            store_connections: config.store_connections,
            ..Config::default()
        };
        let opening = |error: agentgate::Error| match error.kind() {
            agentgate::ErrorKind::InvalidRequest => ServeError::Config(error.to_string()),
            _ => ServeError::Store(error),
        };
        // The lease layer is opened here rather than by `Gate::connect` so
        // the health probe can ping the same connection the engine uses.
        let lease_layer: Option<Arc<dyn LeaseLayer>> = match config.redis_url.as_deref() {
            Some(url) => Some(Arc::new(RedisLeases::open(url).await.map_err(opening)?)),
            None => None,
        };
        let gate = match &lease_layer {
            Some(layer) => {
                Gate::connect_with_layer(&config.store_url, Arc::clone(layer), engine).await
            }
            None => Gate::open(&config.store_url, engine).await,
        }
        .map_err(opening)?;
        Ok(Starting {
            config,
            gate,
            lease_layer,
            mounts: Vec::new(),
        })
    }

    /// The address actually bound (useful with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Serves until `shutdown` completes, then stops accepting connections
    /// and finishes the requests in flight (see [`crate::conn`] for the
    /// per-connection limits).
    ///
    /// # Errors
    /// None today: accept errors are logged and retried. The `Result` stays
    /// so a future fatal error has somewhere to go.
    pub async fn run(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), ServeError> {
        crate::conn::serve_connections(
            self.listener,
            self.router,
            self.max_connections,
            self.max_connections_per_client,
            shutdown,
        )
        .await;
        tracing::info!("agentgate stopped");
        Ok(())
    }
}

/// An opened engine, not yet bound: what a program composes the service
/// from (the CLI mounts the reference app here).
pub struct Starting {
    config: ServeConfig,
    gate: Gate,
    lease_layer: Option<Arc<dyn LeaseLayer>>,
    mounts: Vec<Box<dyn Mount>>,
}

impl fmt::Debug for Starting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Starting")
            .field("config", &self.config)
            .field("mounts", &self.mounts.len())
            .finish_non_exhaustive()
    }
}

impl Starting {
    /// The engine, for a mount to run its turns on (the same leases `/v1`
    /// callers contend for).
    pub fn gate(&self) -> &Gate {
        &self.gate
    }

    /// The store URL the engine opened, for a mount that keeps its own
    /// tables beside the engine's.
    pub fn store_url(&self) -> &str {
        &self.config.store_url
    }

    /// Serves `mount`'s routes beside `/v1` (see [`crate::mount`]).
    #[must_use]
    pub fn mount(mut self, mount: impl Mount) -> Self {
        self.mounts.push(Box::new(mount));
        self
    }

    /// Builds the router over the engine and the mounts, and binds the
    /// socket; call [`Server::run`] to serve.
    ///
    /// # Errors
    /// [`ServeError::Config`] for a setting out of range (see
    /// [`AppState::new`]); [`ServeError::Io`] when the address cannot be
    /// bound.
    pub async fn bind(self) -> Result<Server, ServeError> {
        let Self {
            config,
            gate,
            lease_layer,
            mounts,
        } = self;
        let mut extensions = Extensions::new();
        for mount in &mounts {
            mount.extend(&mut extensions);
        }
        let options = ServerOptions {
            api_keys: config.api_keys,
            recovery_keys: config.recovery_keys,
            max_body_bytes: config.max_body_bytes,
            extensions,
            listen: config.listen.clone(),
            allowed_hosts: config.allowed_hosts,
            allowed_origins: config.allowed_origins,
            user_header: config.user_header.clone(),
            lease_layer,
        };
        let state = AppState::new(gate, options)?;
        let extra = mounts.iter().fold(Router::new(), |routes, mount| {
            routes.merge(mount.routes(&state))
        });
        let listener =
            TcpListener::bind(&config.listen)
                .await
                .map_err(|source| ServeError::Io {
                    what: format!("cannot listen on {}", config.listen),
                    source,
                })?;
        let local_addr = listener.local_addr().map_err(|source| ServeError::Io {
            what: "cannot read the bound address".to_owned(),
            source,
        })?;
        let mounted: Vec<String> = mounts.iter().map(|mount| mount.describe()).collect();
        tracing::info!(
            %local_addr,
            store = %redact_url(&config.store_url),
            redis = ?config.redis_url.as_deref().map(redact_url),
            lease_ttl_ms = config.lease_ttl.as_millis() as u64,
            max_turns_per_user = config.max_turns_per_user,
            confirmation_ttl_ms = config.confirmation_ttl.as_millis() as u64,
            cancel_grace_ms = config.cancel_grace.as_millis() as u64,
            orphan_grace_ms = config.orphan_grace.as_millis() as u64,
            sweep_interval_ms = config.sweep_interval.as_millis() as u64,
            store_connections = config.store_connections,
            api_key_required = state.api_keys().enabled(),
            mounted = ?mounted,
            max_connections = config.max_connections,
            max_connections_per_client = config.max_connections_per_client,
            user_header = ?config.user_header,
            "agentgate serving"
        );
        Ok(Server {
            listener,
            router: router_with(state, extra),
            local_addr,
            max_connections: config.max_connections,
            max_connections_per_client: config.max_connections_per_client,
        })
    }
}

/// Binds and serves until `shutdown` completes.
///
/// # Errors
/// As [`Server::bind`] and [`Server::run`].
pub async fn serve(
    config: ServeConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    Server::bind(config).await?.run(shutdown).await
}

/// Completes on Ctrl-C or SIGTERM (the signals a terminal and a container
/// runtime send). If a signal handler cannot be installed, that signal is
/// ignored and the other still works.
pub fn shutdown_signal() -> impl Future<Output = ()> + Send + 'static {
    // The handlers are installed now, not when the future is first polled:
    // a signal that arrives between "listening on" and the first poll must
    // still shut down gracefully instead of killing the process.
    #[cfg(unix)]
    let signals = {
        use tokio::signal::unix::{signal, SignalKind};
        (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        )
    };
    async move {
        #[cfg(unix)]
        match signals {
            (Ok(mut terminate), Ok(mut interrupt)) => {
                tokio::select! {
                    _ = terminate.recv() => {}
                    _ = interrupt.recv() => {}
                }
            }
            (terminate, interrupt) => {
                if let Err(error) = terminate.and(interrupt) {
                    tracing::error!(%error, "cannot listen for SIGTERM or Ctrl-C");
                }
                std::future::pending::<()>().await;
            }
        }
        #[cfg(not(unix))]
        if let Err(error) = tokio::signal::ctrl_c().await {
            tracing::error!(%error, "cannot listen for Ctrl-C");
            std::future::pending::<()>().await;
        }
        tracing::info!("shutdown requested: finishing requests in flight");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_shown_without_credentials() {
        assert_eq!(
            redact_url("postgres://user:secret@db:5432/app"),
            "postgres://…@db:5432/app"
        );
        assert_eq!(redact_url("sqlite://agentgate.db"), "sqlite://agentgate.db");
        let config = ServeConfig {
            redis_url: Some("redis://:hunter2@cache".to_owned()),
            ..ServeConfig::default()
        };
        assert!(!format!("{config:?}").contains("hunter2"));
    }
}
