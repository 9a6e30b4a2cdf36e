//! The seam between the HTTP service and what a program mounts on it (the
//! reference app in `agentgate-app`, or anything else): this crate knows no
//! app.
//!
//! A mount brings two things:
//!
//! - **state**, put in the [`Extensions`] type map of [`ServerOptions`] and
//!   read back by its handlers with [`AppState::extension`];
//! - **routes**, a `Router<AppState>` built over the final state by
//!   [`Mount::routes`] and merged beside `/v1` by [`router_with`].
//!
//! Mounted routes get everything every route gets: the `Host` and `Origin`
//! check, the request timeout, the global concurrency limit, the JSON
//! fallbacks for unknown routes and methods, and the request metrics. What a
//! mount chooses per route is the API key check and the fail-fast dependency
//! check, both applied by [`protect`] (the reference app protects its JSON
//! and SSE endpoints, not its HTML, CSS and JS files). Handlers use this
//! crate's error body ([`crate::ApiError`]), extractors ([`crate::extract`]),
//! caller binding ([`crate::guard::CallerUser`]) and counters
//! ([`crate::Metrics`]), so a mounted endpoint refuses exactly like `/v1`.
//!
//! [`ServerOptions`]: crate::ServerOptions
//! [`AppState::extension`]: crate::AppState::extension
//! [`router_with`]: crate::router_with

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use axum::{middleware, Router};

use crate::AppState;

/// A type map of shared values, at most one per type, carried by
/// [`AppState`] for mounted handlers. Cheap to clone.
#[derive(Clone, Default)]
pub struct Extensions {
    map: HashMap<TypeId, Arc<dyn Any + Send + Sync>>,
}

impl Extensions {
    /// An empty map.
    pub fn new() -> Self {
        Self::default()
    }

    /// Stores `value`, replacing any earlier value of its type.
    pub fn insert<T: Any + Send + Sync>(&mut self, value: T) {
        self.map.insert(TypeId::of::<T>(), Arc::new(value));
    }

    /// The value of type `T`, if one was stored.
    pub fn get<T: Any + Send + Sync>(&self) -> Option<&T> {
        self.map
            .get(&TypeId::of::<T>())
            .and_then(|value| value.downcast_ref::<T>())
    }
}

impl fmt::Debug for Extensions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Extensions")
            .field("values", &self.map.len())
            .finish()
    }
}

/// Something served beside `/v1` by [`crate::serve::Starting::mount`].
pub trait Mount: Send + Sync + 'static {
    /// What is mounted, for the startup log (e.g. the app and its model).
    fn describe(&self) -> String;

    /// Puts the mount's shared state where its handlers find it.
    fn extend(&self, extensions: &mut Extensions);

    /// The mount's routes, over the final state (which the middlewares of
    /// [`protect`] need).
    fn routes(&self, state: &AppState) -> Router<AppState>;
}

/// `routes` behind the same checks as `/v1`: 401 `unauthorized` without a
/// configured API key (when keys are configured), then 503
/// `store_unavailable` while the dependency probe sees the store down.
pub fn protect(state: &AppState, routes: Router<AppState>) -> Router<AppState> {
    let api_key_check = middleware::from_fn_with_state(state.clone(), crate::auth::require_api_key);
    let dependencies =
        middleware::from_fn_with_state(state.clone(), crate::health::require_dependencies);
    routes.route_layer(dependencies).route_layer(api_key_check)
}
