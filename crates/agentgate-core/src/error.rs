//! The one error type of the engine boundary.
//!
//! Every refusal of the protocol is a variant here with what a caller needs to
//! act on it (`retry_after`, `active_turn_id`). [`ErrorKind`] is the small,
//! stable classification that tests and the HTTP layer match on; its
//! [`ErrorKind::code`] is the wire code of docs/protocol.md §5.2.

use std::time::Duration;

/// A boxed error from a store driver or a caller's side effect.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// `Result` with the engine's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything the engine can refuse or fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Malformed or out-of-limit input. Nothing was written.
    #[error("invalid request: {message}")]
    InvalidRequest {
        /// What was wrong, for a person.
        message: String,
    },
    /// No such turn, session, user or tool execution visible to the caller
    /// (also: a session or turn of another user).
    #[error("{what} not found")]
    NotFound {
        /// What was looked for.
        what: String,
    },
    /// The session is held by another live turn.
    #[error("session is busy with turn {active_turn_id}")]
    SessionBusy {
        /// The turn holding the session.
        active_turn_id: String,
        /// When the holder's lease runs out if it is not renewed.
        retry_after: Duration,
    },
    /// This very request is already running under a live lease.
    #[error("request is already in flight as turn {active_turn_id}")]
    RequestInFlight {
        /// The running turn.
        active_turn_id: String,
        /// When its lease runs out if it is not renewed.
        retry_after: Duration,
    },
    /// The session waits for a person to confirm a pending action.
    #[error("session is awaiting confirmation of turn {pending_turn_id}")]
    AwaitingConfirmation {
        /// The turn whose pending action waits.
        pending_turn_id: String,
        /// When the pending confirmation expires.
        retry_after: Duration,
    },
    /// A confirmation names a turn whose pending confirmation expired
    /// (`confirmation_ttl`): nothing was confirmed, and the action it
    /// waited for will not run. Ask again with a new message.
    #[error("the pending confirmation of turn {turn_id} expired")]
    ConfirmationExpired {
        /// The turn whose confirmation expired.
        turn_id: String,
    },
    /// The same tool execution is running under the caller's own live lease.
    #[error("tool execution {execution_id} is already in flight")]
    ToolInFlight {
        /// The running execution.
        execution_id: String,
        /// Its running attempt.
        attempt: u32,
        /// When the turn's lease runs out if it is not renewed.
        retry_after: Duration,
    },
    /// The caller's lease is gone: wrong token, taken over, expired, or the
    /// turn already ended. The caller must stop; it can change nothing.
    #[error("lease lost: {reason}")]
    LeaseLost {
        /// Why, for logs; never contains the token.
        reason: &'static str,
    },
    /// The turn was asked to stop (`POST /v1/turns/{id}/cancel`): its
    /// holder may claim no more tools and should end it cancelled.
    #[error("turn {turn_id} was cancelled")]
    TurnCancelled {
        /// The cancelled turn.
        turn_id: String,
    },
    /// A repeat of a request with a different payload.
    #[error("client_request_id was already used with a different payload")]
    PayloadMismatch,
    /// The user's queues, across their sessions, hold their limit of
    /// waiting messages; nothing was queued.
    #[error("this user's queues are full ({limit} waiting turns across their sessions)")]
    UserQueueFull {
        /// The bound ([`crate::limits::MAX_USER_QUEUE`]).
        limit: u32,
        /// When the session's holder's lease runs out if it is not renewed.
        retry_after: Duration,
    },
    /// The session's queue holds its limit of waiting messages; nothing
    /// was queued.
    #[error("the session's queue is full ({limit} waiting turns)")]
    QueueFull {
        /// The queue's bound.
        limit: u32,
        /// When the session's holder's lease runs out if it is not renewed
        /// (the queue moves at the latest then).
        retry_after: Duration,
    },
    /// The user holds all of their permits.
    #[error("user is at capacity ({cap} concurrent turns)")]
    UserAtCapacity {
        /// The user's cap.
        cap: u32,
        /// When the soonest of the user's leases runs out if not renewed.
        retry_after: Duration,
    },
    /// A tool's previous attempt died mid-call and its policy says a person
    /// must decide; the library did not re-run it.
    #[error("tool execution {execution_id} has an unknown previous outcome")]
    UnknownToolOutcome {
        /// The execution whose outcome is unknown.
        execution_id: String,
    },
    /// A turn or tool execution used all its attempts (see `limits`); it will
    /// not be run again.
    #[error("{what} used all its attempts")]
    AttemptsExhausted {
        /// What was exhausted.
        what: String,
    },
    /// A caller-supplied side effect failed; its SQL transaction rolled back
    /// and the tool execution was not marked succeeded.
    #[error("tool side effect failed: {0}")]
    Effect(#[source] BoxError),
    /// The store could not be reached or answered with an error.
    #[error("store unavailable: {0}")]
    StoreUnavailable(#[source] BoxError),
}

/// The stable classification of an [`Error`]; one wire code each.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// `invalid_request`
    InvalidRequest,
    /// `not_found`
    NotFound,
    /// `session_busy`
    SessionBusy,
    /// `request_in_flight`
    RequestInFlight,
    /// `awaiting_confirmation`
    AwaitingConfirmation,
    /// `confirmation_expired`
    ConfirmationExpired,
    /// `tool_in_flight`
    ToolInFlight,
    /// `lease_lost`
    LeaseLost,
    /// `turn_cancelled`
    TurnCancelled,
    /// `payload_mismatch`
    PayloadMismatch,
    /// `user_at_capacity`
    UserAtCapacity,
    /// `queue_full`
    QueueFull,
    /// `unknown_tool_outcome`
    UnknownToolOutcome,
    /// `attempts_exhausted`
    AttemptsExhausted,
    /// `effect_failed`
    Effect,
    /// `store_unavailable`
    StoreUnavailable,
}

impl ErrorKind {
    /// The wire code of docs/protocol.md §5.2.
    pub fn code(self) -> &'static str {
        match self {
            Self::InvalidRequest => "invalid_request",
            Self::NotFound => "not_found",
            Self::SessionBusy => "session_busy",
            Self::RequestInFlight => "request_in_flight",
            Self::AwaitingConfirmation => "awaiting_confirmation",
            Self::ConfirmationExpired => "confirmation_expired",
            Self::ToolInFlight => "tool_in_flight",
            Self::LeaseLost => "lease_lost",
            Self::TurnCancelled => "turn_cancelled",
            Self::PayloadMismatch => "payload_mismatch",
            Self::UserAtCapacity => "user_at_capacity",
            Self::QueueFull => "queue_full",
            Self::UnknownToolOutcome => "unknown_tool_outcome",
            Self::AttemptsExhausted => "attempts_exhausted",
            Self::Effect => "effect_failed",
            Self::StoreUnavailable => "store_unavailable",
        }
    }

    /// Whether the same call may succeed later without changing it.
    pub fn is_retryable(self) -> bool {
        matches!(
            self,
            Self::SessionBusy
                | Self::RequestInFlight
                | Self::ToolInFlight
                | Self::UserAtCapacity
                | Self::QueueFull
                | Self::StoreUnavailable
        )
    }
}

impl Error {
    /// An `invalid_request` with a message.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::InvalidRequest {
            message: message.into(),
        }
    }

    /// A `not_found` for `what`.
    pub fn not_found(what: impl Into<String>) -> Self {
        Self::NotFound { what: what.into() }
    }

    /// A `store_unavailable` wrapping a driver error.
    pub fn store(source: impl Into<BoxError>) -> Self {
        Self::StoreUnavailable(source.into())
    }

    /// A `store_unavailable` for a stored value the schema does not allow
    /// (a bug or a foreign writer): never read as a default.
    pub fn corrupt(what: impl std::fmt::Display) -> Self {
        Self::store(format!("corrupt row: {what}"))
    }

    /// The postcondition of a write whose row count the protocol relies on
    /// (a write decided under the lock that makes it certain): anything but
    /// `expected` rows changed means the records are not what the decision
    /// read, so the step fails `corrupt` and its transaction rolls back.
    pub fn expect_rows(affected: u64, expected: u64, what: &str) -> Result<()> {
        if affected == expected {
            Ok(())
        } else {
            Err(Self::corrupt(format!(
                "{what} changed {affected} rows where the protocol expects {expected}"
            )))
        }
    }

    /// This error's classification.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::InvalidRequest { .. } => ErrorKind::InvalidRequest,
            Self::NotFound { .. } => ErrorKind::NotFound,
            Self::SessionBusy { .. } => ErrorKind::SessionBusy,
            Self::RequestInFlight { .. } => ErrorKind::RequestInFlight,
            Self::AwaitingConfirmation { .. } => ErrorKind::AwaitingConfirmation,
            Self::ConfirmationExpired { .. } => ErrorKind::ConfirmationExpired,
            Self::ToolInFlight { .. } => ErrorKind::ToolInFlight,
            Self::LeaseLost { .. } => ErrorKind::LeaseLost,
            Self::TurnCancelled { .. } => ErrorKind::TurnCancelled,
            Self::PayloadMismatch => ErrorKind::PayloadMismatch,
            Self::UserAtCapacity { .. } => ErrorKind::UserAtCapacity,
            Self::QueueFull { .. } | Self::UserQueueFull { .. } => ErrorKind::QueueFull,
            Self::UnknownToolOutcome { .. } => ErrorKind::UnknownToolOutcome,
            Self::AttemptsExhausted { .. } => ErrorKind::AttemptsExhausted,
            Self::Effect(_) => ErrorKind::Effect,
            Self::StoreUnavailable(_) => ErrorKind::StoreUnavailable,
        }
    }

    /// How long to wait before the same call can succeed, where the store knows.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::SessionBusy { retry_after, .. }
            | Self::RequestInFlight { retry_after, .. }
            | Self::AwaitingConfirmation { retry_after, .. }
            | Self::ToolInFlight { retry_after, .. }
            | Self::UserAtCapacity { retry_after, .. }
            | Self::QueueFull { retry_after, .. }
            | Self::UserQueueFull { retry_after, .. } => Some(*retry_after),
            _ => None,
        }
    }

    /// The turn that holds the session or runs the request, where one does.
    pub fn active_turn_id(&self) -> Option<&str> {
        match self {
            Self::SessionBusy { active_turn_id, .. }
            | Self::RequestInFlight { active_turn_id, .. } => Some(active_turn_id),
            Self::AwaitingConfirmation {
                pending_turn_id, ..
            } => Some(pending_turn_id),
            _ => None,
        }
    }

    /// The running execution and attempt a `tool_in_flight` names: the
    /// caller's own claim, so a holder whose claim's answer was lost can
    /// tell it from a sibling's.
    pub fn running_execution(&self) -> Option<(&str, u32)> {
        match self {
            Self::ToolInFlight {
                execution_id,
                attempt,
                ..
            } => Some((execution_id, *attempt)),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_count_other_than_the_expected_one_is_corrupt() {
        assert!(Error::expect_rows(1, 1, "the grant").is_ok());
        for affected in [0, 2] {
            let error = Error::expect_rows(affected, 1, "the grant").expect_err("refused");
            assert_eq!(error.kind(), ErrorKind::StoreUnavailable);
            let message = error.to_string();
            assert!(
                message.contains("corrupt") && message.contains("the grant"),
                "{message}"
            );
        }
    }

    #[test]
    fn codes_are_distinct_and_lowercase() {
        let kinds = [
            ErrorKind::InvalidRequest,
            ErrorKind::NotFound,
            ErrorKind::SessionBusy,
            ErrorKind::RequestInFlight,
            ErrorKind::AwaitingConfirmation,
            ErrorKind::ConfirmationExpired,
            ErrorKind::ToolInFlight,
            ErrorKind::LeaseLost,
            ErrorKind::TurnCancelled,
            ErrorKind::PayloadMismatch,
            ErrorKind::UserAtCapacity,
            ErrorKind::QueueFull,
            ErrorKind::UnknownToolOutcome,
            ErrorKind::AttemptsExhausted,
            ErrorKind::Effect,
            ErrorKind::StoreUnavailable,
        ];
        let codes: std::collections::HashSet<_> = kinds.iter().map(|k| k.code()).collect();
        assert_eq!(codes.len(), kinds.len());
        assert!(codes
            .iter()
            .all(|c| c.chars().all(|ch| ch.is_ascii_lowercase() || ch == '_')));
    }

    #[test]
    fn conflicts_carry_retry_after_and_lease_lost_does_not() {
        let busy = Error::SessionBusy {
            active_turn_id: "t".into(),
            retry_after: Duration::from_millis(1200),
        };
        assert_eq!(busy.retry_after(), Some(Duration::from_millis(1200)));
        assert_eq!(busy.active_turn_id(), Some("t"));
        assert!(busy.kind().is_retryable());
        let lost = Error::LeaseLost { reason: "expired" };
        assert_eq!(lost.retry_after(), None);
        assert!(!lost.kind().is_retryable());
    }
}
