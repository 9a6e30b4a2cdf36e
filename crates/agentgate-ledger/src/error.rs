//! [`LedgerError`]: the one error type of the app's boundary.
//!
//! Engine refusals (`session_busy`, `awaiting_confirmation`, …) pass through
//! unchanged as [`LedgerError::Engine`], so the server maps them with the same
//! function it uses for the engine's own routes. [`LedgerError::code`] gives
//! every variant a stable wire code.

use agentgate::{BoxError, ErrorKind};

use crate::model::ModelError;

/// `Result` with [`LedgerError`].
pub type Result<T, E = LedgerError> = std::result::Result<T, E>;

/// What the ledger app can refuse or fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LedgerError {
    /// The engine refused or failed: a conflict (`session_busy`,
    /// `request_in_flight`, `awaiting_confirmation`, `user_at_capacity`),
    /// `lease_lost`, `not_found`, `store_unavailable`, …
    #[error(transparent)]
    Engine(#[from] agentgate::Error),
    /// Malformed or out-of-limit input from the caller. Nothing was written.
    #[error("invalid request: {message}")]
    Invalid {
        /// What was wrong, for a person.
        message: String,
    },
    /// The model failed after its retries; the turn was failed as retryable.
    #[error("model failed: {0}")]
    Model(#[source] ModelError),
    /// The caller's cancellation token fired (for example, the client went
    /// away under the `cancel` disconnect policy); the turn was failed as
    /// retryable and its lease released.
    #[error("turn cancelled by the caller")]
    Cancelled,
    /// The app's own tables could not be read or written.
    #[error("ledger database: {0}")]
    Database(#[source] BoxError),
}

impl LedgerError {
    /// An `Invalid` with a message.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::Invalid {
            message: message.into(),
        }
    }

    /// A `Database` wrapping a driver error.
    pub fn database(source: impl Into<BoxError>) -> Self {
        Self::Database(source.into())
    }

    /// The engine's classification, for engine errors.
    pub fn engine_kind(&self) -> Option<ErrorKind> {
        match self {
            Self::Engine(error) => Some(error.kind()),
            _ => None,
        }
    }

    /// A stable wire code: the engine's code for engine errors, else
    /// `invalid_request`, `model_unavailable`, `cancelled` or
    /// `store_unavailable`.
    pub fn code(&self) -> &'static str {
        match self {
            Self::Engine(error) => error.kind().code(),
            Self::Invalid { .. } => "invalid_request",
            Self::Model(_) => "model_unavailable",
            Self::Cancelled => "cancelled",
            Self::Database(_) => "store_unavailable",
        }
    }

    /// Whether sending the same request again may succeed: engine
    /// conflicts, store outages, model outages and cancellations (the turn
    /// was failed as retryable, so a repeat restarts it).
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Engine(error) => error.kind().is_retryable(),
            Self::Invalid { .. } => false,
            Self::Model(_) | Self::Cancelled | Self::Database(_) => true,
        }
    }
}

impl From<sqlx::Error> for LedgerError {
    fn from(error: sqlx::Error) -> Self {
        Self::database(error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_follow_the_engine_and_name_the_rest() {
        let busy = LedgerError::from(agentgate::Error::SessionBusy {
            active_turn_id: "t".into(),
            retry_after: std::time::Duration::from_millis(5),
        });
        assert_eq!(busy.code(), "session_busy");
        assert_eq!(busy.engine_kind(), Some(ErrorKind::SessionBusy));
        assert!(busy.is_retryable());
        let invalid = LedgerError::invalid("empty");
        assert_eq!(invalid.code(), "invalid_request");
        assert!(!invalid.is_retryable());
        assert_eq!(LedgerError::Cancelled.code(), "cancelled");
    }
}
