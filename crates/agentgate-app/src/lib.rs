//! agentgate-app: the reference app of docs/protocol.md §11 served over HTTP beside
//! `/v1`: the ledger agent's chat page at `/`, the live dashboard at
//! `/dashboard`, and the JSON and SSE endpoints under `/app/` that those two
//! pages call.
//!
//! It is mounted on `agentgate-server` through that crate's public seam
//! ([`agentgate_server::mount`]): `agentgate serve` opens the engine with
//! [`agentgate_server::Server::open`], opens a [`LedgerMount`] on it and
//! passes it to [`agentgate_server::Starting::mount`]. The server crate does
//! not depend on this one nor on `agentgate-ledger`.
//!
//! - this file: [`LedgerMount`] (the in-process [`LedgerApp`] plus the
//!   disconnect policy, and its [`Mount`] implementation), [`ModelChoice`],
//!   [`OnDisconnect`], and the route list (`routes`);
//! - `stream`: send a message or a confirmation and stream the turn's
//!   [`agentgate_ledger::AgentEvent`]s as server-sent events;
//! - `api`: the page's reads (sessions, transcript with the session's
//!   queue, ledger, pending confirmation) and the Stop / Cancel button;
//! - `error`: the app's errors as the server's error body;
//! - `dashboard`: the store's overview, permits per user and this server's
//!   counters;
//! - `assets`: the HTML, CSS and JS files (`assets/`), embedded in the
//!   binary;
//! - [`limits`]: the app's named limits.
//!
//! The app runs the engine in-process, on the server's own [`agentgate::Gate`]
//! and store: the same library any Rust user would call, and the same leases
//! `/v1` callers contend for.
//!
//! Architecture invariant: a refusal (`session_busy`, `request_in_flight`,
//! `awaiting_confirmation`, `user_at_capacity`, …) is answered with its real
//! status and the usual JSON error body, through
//! [`agentgate_server::error::status_of`],
//! before any event stream starts. Only a granted turn (or a replay) streams;
//! a message queued behind a running reply is a 202 with its position, and
//! the task that ends the reply runs the session's queue after it.
//!
//! Architecture invariant: the app's endpoints are the pages' own, not part
//! of the v1 contract; they are deliberately absent from `/openapi.json`.
//! They sit behind the same API key and dependency checks as `/v1`
//! ([`agentgate_server::mount::protect`]; the page asks for the key when the
//! server wants one); the HTML, CSS and JS files are open. Every route gets
//! the server's `Host`/`Origin` guard, timeout, concurrency limit and
//! metrics, as `/v1` does.
#![forbid(unsafe_code)]

mod api;
mod assets;
mod dashboard;
mod documents;
mod error;
pub mod limits;
mod stream;

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use agentgate::Gate;
use agentgate_ingest::{Ingestor, OfflineEmbedder};
use agentgate_ledger::{LedgerApp, Model, OfflineModel, OpenAiConfig, OpenAiModel};
use agentgate_server::mount::{protect, Extensions, Mount};
use agentgate_server::{ApiError, AppState, ErrorCode, ServeError};
use axum::routing::{get, post};
use axum::Router;

pub use agentgate_ledger::LedgerConfig;

use crate::limits::MAX_THINK_TIME;

/// The offline model's default think time per round, in ms: a booking takes
/// three rounds, so a turn takes about two seconds (docs/protocol.md §11).
pub const DEFAULT_THINK_TIME_MS: u64 = OfflineModel::DEFAULT_THINK_TIME.as_millis() as u64;

/// What happens to a running turn when its event stream's client goes away
/// (a closed tab, a lost network).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OnDisconnect {
    /// The turn runs to its end and releases its lease; the reply is in the
    /// transcript on reload. The default: the person asked for it.
    #[default]
    Finish,
    /// The turn is cancelled cooperatively at its next step, failed as
    /// retryable (a resend resumes it without booking twice) and its lease
    /// released.
    Cancel,
}

impl OnDisconnect {
    /// The flag's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Finish => "finish",
            Self::Cancel => "cancel",
        }
    }
}

impl fmt::Display for OnDisconnect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for OnDisconnect {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "finish" => Ok(Self::Finish),
            "cancel" => Ok(Self::Cancel),
            other => Err(format!(
                "on-disconnect is {other:?}, expected finish or cancel"
            )),
        }
    }
}

/// Which model the ledger agent talks to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelChoice {
    /// The built-in deterministic model, thinking this long per round.
    Offline {
        /// Think time per model round (a booking takes three rounds).
        think_time: Duration,
    },
    /// An OpenAI-compatible chat-completions endpoint; the key comes from
    /// `AGENTGATE_MODEL_API_KEY`.
    OpenAi {
        /// Base URL or full `/chat/completions` URL.
        url: String,
        /// The model name sent with each request.
        name: String,
    },
}

impl Default for ModelChoice {
    fn default() -> Self {
        Self::Offline {
            think_time: OfflineModel::DEFAULT_THINK_TIME,
        }
    }
}

impl ModelChoice {
    /// Builds the model.
    ///
    /// # Errors
    /// [`ServeError::Config`] for a think time over [`MAX_THINK_TIME`] or a
    /// model URL that is not http(s).
    pub fn build(&self) -> Result<Arc<dyn Model>, ServeError> {
        match self {
            Self::Offline { think_time } => {
                if *think_time > MAX_THINK_TIME {
                    return Err(ServeError::Config(format!(
                        "think time is {} ms, allowed 0..={}",
                        think_time.as_millis(),
                        MAX_THINK_TIME.as_millis()
                    )));
                }
                Ok(Arc::new(OfflineModel::new(*think_time)))
            }
            Self::OpenAi { url, name } => {
                if name.trim().is_empty() {
                    return Err(ServeError::Config(
                        "--model openai needs --model-name".to_owned(),
                    ));
                }
                let model = OpenAiModel::new(OpenAiConfig::new(url.clone(), name.clone()))
                    .map_err(|e| ServeError::Config(e.to_string()))?;
                Ok(Arc::new(model))
            }
        }
    }
}

/// The reference app as mounted in the server. Cheap to clone.
#[derive(Clone, Debug)]
pub struct LedgerMount {
    /// The agent, on the server's engine.
    pub app: LedgerApp,
    /// What a client disconnect does to its running turn.
    pub on_disconnect: OnDisconnect,
    /// Document ingestion (SQLite and PostgreSQL stores; `None` on MySQL).
    pub documents: Option<Ingestor>,
    /// Stops the app's recovery worker when the last clone is dropped.
    _recovery: Arc<tokio_util::sync::DropGuard>,
}

impl LedgerMount {
    /// Opens the ledger app on `gate` (whose SQL store is at `store_url`),
    /// with `model` and `config`.
    ///
    /// # Errors
    /// [`ServeError::Config`] for a bad model or app setting, or a store the
    /// app cannot keep its tables in; [`ServeError::App`] when the app's
    /// tables cannot be created.
    pub async fn open(
        gate: Gate,
        store_url: &str,
        model: &ModelChoice,
        config: LedgerConfig,
        on_disconnect: OnDisconnect,
    ) -> Result<Self, ServeError> {
        let model = model.build()?;
        let app = LedgerApp::open(gate, store_url, model, config)
            .await
            .map_err(|error| match error {
                agentgate_ledger::LedgerError::Invalid { message } => ServeError::Config(message),
                other => ServeError::App(Box::new(other)),
            })?;
        // The recovery worker resumes this app's turns whose worker died (a
        // crash of this or another node): the person waiting on one sees the
        // reply without doing anything.
        let stop = tokio_util::sync::CancellationToken::new();
        tokio::spawn(app.clone().recover_forever(stop.clone()));
        let documents = if store_url.starts_with("sqlite:") || store_url.starts_with("postgres") {
            let ingestor = Ingestor::open(
                app.gate().clone(),
                store_url,
                Arc::new(OfflineEmbedder::new()),
            )
            .await
            .map_err(|error| ServeError::App(Box::new(error)))?;
            // Orphaned ingestions (their node died) are finished here, from
            // their stored bytes.
            tokio::spawn(recover_ingestions(ingestor.clone(), stop.clone()));
            app.set_documents(ingestor.clone());
            Some(ingestor)
        } else {
            None
        };
        Ok(Self {
            app,
            on_disconnect,
            documents,
            _recovery: Arc::new(stop.drop_guard()),
        })
    }
}

/// Takes orphaned ingestions over and finishes them, until `stop`.
async fn recover_ingestions(ingestor: Ingestor, stop: tokio_util::sync::CancellationToken) {
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(limits::INGEST_RECOVERY_INTERVAL) => {}
        }
        if let Err(error) = ingestor.recover().await {
            tracing::warn!(%error, "could not list orphaned ingestions");
        }
    }
}

impl Mount for LedgerMount {
    fn describe(&self) -> String {
        format!(
            "reference app (model {}, on disconnect {})",
            self.app.model_name(),
            self.on_disconnect
        )
    }

    fn extend(&self, extensions: &mut Extensions) {
        extensions.insert(self.clone());
    }

    fn routes(&self, state: &AppState) -> Router<AppState> {
        routes(state)
    }
}

/// The mounted app, or the 404 its routes answer without one (a router
/// built with these routes but without the mount's extension).
fn ledger(state: &AppState) -> Result<&LedgerMount, ApiError> {
    state.extension::<LedgerMount>().ok_or_else(|| {
        ApiError::new(
            ErrorCode::NotFound,
            "the reference app is not served by this server",
        )
    })
}

/// The app's routes: the two pages and their files (open), and the JSON and
/// SSE endpoints (behind the API key and dependency checks).
fn routes(state: &AppState) -> Router<AppState> {
    let api = Router::new()
        .route("/app/messages", post(stream::send_message))
        .route("/app/confirmations", post(stream::confirm))
        .route("/app/sessions", get(api::sessions))
        .route("/app/transcript", get(api::transcript))
        .route("/app/ledger", get(api::ledger))
        .route("/app/settings", get(api::settings))
        .route("/app/stop", post(api::stop))
        .route(
            "/app/documents",
            get(documents::list).post(documents::upload),
        )
        .route("/app/documents/search", get(documents::search))
        .route("/app/documents/delete", post(documents::delete))
        .route("/app/dashboard", get(dashboard::dashboard));
    Router::new()
        .route("/", get(assets::index))
        .route("/dashboard", get(assets::dashboard))
        .route("/assets/{file}", get(assets::file))
        .merge(protect(state, api))
}
