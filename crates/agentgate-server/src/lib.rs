//! agentgate-server: the HTTP service of docs/protocol.md §10 (`agentgate serve`), for
//! agent backends in any language.
//!
//! - [`router`] (this file): the axum router over an [`AppState`], callable
//!   by tests without a socket; its middleware (API keys on `/v1`, body
//!   limit, timeout, concurrency limit, metrics). [`router_with`] merges
//!   extra routes into it.
//! - [`mount`]: the seam for what a program serves beside `/v1` (the
//!   reference app of docs/protocol.md §11 lives in `agentgate-app`, which this crate
//!   does not know): an [`Extensions`] slot in the state, the [`Mount`]
//!   trait, and [`mount::protect`] for the `/v1` checks.
//! - [`mod@serve`]: opening the store, mounting, binding a socket, running
//!   the router.
//! - `conn`: the accept loop, header-read timeout, connection cap and
//!   graceful drain.
//! - `routes`: the handlers, one file per group (turns, tools, views, ops).
//! - [`openapi`]: the one route table, and the OpenAPI 3.1 document generated
//!   from it.
//! - [`dto`]: the wire format, request and response bodies.
//! - [`error`]: the error body and the one code → status mapping.
//! - [`extract`]: extractors that turn bad input into 400/413 JSON.
//! - [`auth`]: API keys and the bearer check, in constant time.
//! - [`guard`]: the `Host` and `Origin` checks against pages elsewhere, and
//!   the optional trusted user header.
//! - [`health`]: the dependency probe, the fail-fast guard and the
//!   `/healthz` and `/readyz` reports.
//! - [`metrics`]: the `agentgate_*` Prometheus metrics.
//! - [`limits`]: the server's named limits.
//!
//! Architecture invariant: this crate makes no protocol decision. Every
//! `/v1` handler is one call to the engine's [`agentgate::store::Store`],
//! driven by the lease token the caller sends; the caller heartbeats. A
//! mounted app runs its turns through the same [`Gate`] (whose watchdog
//! heartbeats them). Lease tokens and API keys are never logged nor shown in
//! `Debug`.
#![forbid(unsafe_code)]

pub mod auth;
mod conn;
pub mod dto;
pub mod error;
pub mod extract;
pub mod guard;
pub mod health;
pub mod limits;
pub mod metrics;
pub mod mount;
pub mod openapi;
mod routes;
pub mod schema;
pub mod serve;
mod stall;

use std::sync::Arc;

use agentgate::Gate;
use agentgate_core::lease::LeaseLayer;
use axum::error_handling::HandleErrorLayer;
use axum::http::HeaderName;
use axum::{middleware, Router};
use tower::limit::GlobalConcurrencyLimitLayer;
use tower::timeout::TimeoutLayer;
use tower::ServiceBuilder;

pub use auth::{read_key_file, ApiKey, ApiKeys, KeyError, RecoveryRole};
pub use error::{ApiError, ErrorCode};
pub use extract::{ApiBytes, ApiJson, ApiPath, ApiQuery, LEASE_TOKEN_HEADER};
pub use guard::CallerUser;
pub use metrics::Metrics;
pub use mount::{Extensions, Mount};
pub use serve::{serve, shutdown_signal, ServeConfig, ServeError, Server, Starting};

use crate::error::ErrorCode as Code;
use crate::limits::{
    DEFAULT_MAX_BODY_BYTES, MAX_CONCURRENT_REQUESTS, MAX_MAX_BODY_BYTES, REQUEST_TIMEOUT,
};

/// Server settings beyond the engine's.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// When non-empty, every `/v1` call needs `Authorization: Bearer <key>`.
    pub api_keys: Vec<ApiKey>,
    /// Largest request body; larger ones get 413 `payload_too_large`.
    pub max_body_bytes: usize,
    /// Shared values of mounted routes (see [`mount`]), read by their
    /// handlers with [`AppState::extension`]. Empty for the v1 contract
    /// alone.
    pub extensions: Extensions,
    /// The listen address (`host:port`), whose host is an allowed `Host`.
    pub listen: String,
    /// `Host` names answered besides IP addresses, `localhost` and the
    /// listen host; `name` or `name:port`.
    pub allowed_hosts: Vec<String>,
    /// Origins (`https://name[:port]`) allowed besides the server itself.
    pub allowed_origins: Vec<String>,
    /// When set, the header a trusted front end names the caller's user in;
    /// a request about another user is refused 403 `user_mismatch`.
    pub user_header: Option<String>,
    /// Keys of recovery workers: accepted as API keys, and a request with
    /// one may claim any user's orphan (`POST /v1/orphans/claim`) where
    /// callers are otherwise bound to their user.
    pub recovery_keys: Vec<ApiKey>,
    /// The lease layer the engine uses, if any, so `/healthz` can probe it.
    pub lease_layer: Option<Arc<dyn LeaseLayer>>,
}

impl Default for ServerOptions {
    fn default() -> Self {
        Self {
            api_keys: Vec::new(),
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            extensions: Extensions::new(),
            listen: String::new(),
            allowed_hosts: Vec::new(),
            allowed_origins: Vec::new(),
            user_header: None,
            recovery_keys: Vec::new(),
            lease_layer: None,
        }
    }
}

/// What every handler shares. Cheap to clone.
#[derive(Clone, Debug)]
pub struct AppState {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    gate: Gate,
    metrics: Metrics,
    api_keys: ApiKeys,
    recovery_keys: ApiKeys,
    max_body_bytes: usize,
    /// Rendered once: the document is static for the life of the process.
    openapi_json: String,
    /// Mounted routes' shared values.
    extensions: Extensions,
    health: health::Health,
    origin_policy: guard::OriginPolicy,
    user_header: Option<HeaderName>,
}

impl AppState {
    /// State over an opened engine.
    ///
    /// # Errors
    /// [`ServeError::Config`] for more API keys than allowed, a body limit
    /// of 0 or over [`MAX_MAX_BODY_BYTES`], a bad allowed host or origin, or
    /// a user header that is not a header name. Must be called inside a
    /// Tokio runtime (it starts the dependency probe).
    pub fn new(gate: Gate, options: ServerOptions) -> Result<Self, ServeError> {
        if options.max_body_bytes == 0 || options.max_body_bytes > MAX_MAX_BODY_BYTES {
            return Err(ServeError::Config(format!(
                "max body bytes is {}, allowed 1..={MAX_MAX_BODY_BYTES}",
                options.max_body_bytes
            )));
        }
        let api_keys =
            ApiKeys::new(&options.api_keys).map_err(|e| ServeError::Config(e.to_string()))?;
        let recovery_keys =
            ApiKeys::new(&options.recovery_keys).map_err(|e| ServeError::Config(e.to_string()))?;
        let origin_policy = guard::OriginPolicy::new(
            &options.listen,
            &options.allowed_hosts,
            &options.allowed_origins,
        )
        .map_err(|e| ServeError::Config(e.to_string()))?;
        let user_header = options
            .user_header
            .as_deref()
            .map(guard::parse_user_header)
            .transpose()
            .map_err(|e| ServeError::Config(e.to_string()))?;
        let health =
            health::Health::start(std::sync::Arc::clone(gate.store()), options.lease_layer);
        Ok(Self {
            inner: Arc::new(Inner {
                gate,
                metrics: Metrics::new(),
                api_keys,
                recovery_keys,
                max_body_bytes: options.max_body_bytes,
                openapi_json: openapi::document_json(),
                extensions: options.extensions,
                health,
                origin_policy,
                user_header,
            }),
        })
    }

    /// The engine.
    pub fn gate(&self) -> &Gate {
        &self.inner.gate
    }

    /// The metrics registry.
    pub fn metrics(&self) -> &Metrics {
        &self.inner.metrics
    }

    /// The shared value of type `T` a mount put in
    /// [`ServerOptions::extensions`], if any.
    pub fn extension<T: std::any::Any + Send + Sync>(&self) -> Option<&T> {
        self.inner.extensions.get::<T>()
    }

    pub(crate) fn api_keys(&self) -> &ApiKeys {
        &self.inner.api_keys
    }

    pub(crate) fn recovery_keys(&self) -> &ApiKeys {
        &self.inner.recovery_keys
    }

    /// The dependencies' health.
    pub fn health(&self) -> &health::Health {
        &self.inner.health
    }

    pub(crate) fn origin_policy(&self) -> &guard::OriginPolicy {
        &self.inner.origin_policy
    }

    pub(crate) fn user_header(&self) -> Option<&HeaderName> {
        self.inner.user_header.as_ref()
    }

    pub(crate) fn max_body_bytes(&self) -> usize {
        self.inner.max_body_bytes
    }

    pub(crate) fn openapi_json(&self) -> String {
        self.inner.openapi_json.clone()
    }
}

/// Answers errors of the timeout layer (and anything else a tower layer
/// reports) as JSON: a timeout means the store did not answer in time.
async fn on_layer_error(error: tower::BoxError) -> ApiError {
    if error.is::<tower::timeout::error::Elapsed>() {
        ApiError::new(
            Code::StoreUnavailable,
            format!(
                "the request took longer than {} s; retry later",
                REQUEST_TIMEOUT.as_secs()
            ),
        )
    } else {
        tracing::error!(%error, "middleware failed");
        ApiError::new(Code::Internal, "internal error")
    }
}

/// The whole HTTP service as a router: every route of docs/protocol.md §10, the `Host`
/// and `Origin` checks on every route, the API key check and the fail-fast
/// dependency check on `/v1`, JSON answers for unknown routes and methods, the body
/// limit (enforced by the JSON extractor), a per-request timeout, a global
/// concurrency limit and metrics.
pub fn router(state: AppState) -> Router {
    router_with(state, Router::new())
}

/// [`router`] with `extra` routes merged beside `/v1` (see [`mount`]). They
/// get the `Host` and `Origin` checks, the timeout, the concurrency limit,
/// the JSON fallbacks and the metrics; the API key and dependency checks are
/// theirs to apply, with [`mount::protect`]. A path of `extra` that is also
/// a v1 or ops path panics here, at startup (axum's merge).
pub fn router_with(state: AppState, extra: Router<AppState>) -> Router {
    let api_key_check = middleware::from_fn_with_state(state.clone(), auth::require_api_key);
    let dependencies = middleware::from_fn_with_state(state.clone(), health::require_dependencies);
    let (v1, _) = openapi::v1_routes()
        .route_layer(dependencies)
        .route_layer(api_key_check)
        .split_for_parts();
    let (ops, _) = openapi::ops_routes().split_for_parts();
    let guards = ServiceBuilder::new()
        .layer(HandleErrorLayer::new(on_layer_error))
        .layer(TimeoutLayer::new(REQUEST_TIMEOUT))
        .layer(GlobalConcurrencyLimitLayer::new(MAX_CONCURRENT_REQUESTS));
    Router::new()
        .merge(v1)
        .merge(ops)
        .merge(extra)
        .fallback(routes::ops::no_route)
        .method_not_allowed_fallback(routes::ops::wrong_method)
        .layer(guards)
        .layer(middleware::from_fn_with_state(
            state.clone(),
            guard::check_origin,
        ))
        // Outermost, so it also sees timeouts, limit waits and refusals.
        .layer(middleware::from_fn_with_state(
            state.clone(),
            metrics::track,
        ))
        .with_state(state)
}
