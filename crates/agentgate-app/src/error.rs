//! The reference app's errors as the server's error body: the one mapping
//! from [`LedgerError`] to [`ApiError`] (and so, through
//! `agentgate_server::error::status_of`, to an HTTP status).

use agentgate_ledger::LedgerError;
use agentgate_server::{ApiError, ErrorCode};

/// The reference app's errors: the engine's pass through unchanged (so a
/// refused chat message gets the same status as a refused `/v1` begin), bad
/// input is a 400, the app's own tables failing a 503.
pub(crate) fn api_error(error: LedgerError) -> ApiError {
    match error {
        LedgerError::Engine(engine) => ApiError::from(engine),
        LedgerError::Invalid { message } => ApiError::invalid(message),
        LedgerError::Database(source) => {
            tracing::error!(error = %source, "ledger database failed");
            ApiError::new(
                ErrorCode::StoreUnavailable,
                "the store is unavailable; retry later",
            )
        }
        // Model failures and cancellations end a running turn and reach the
        // page as an `error` event, never as a status; starting a turn or
        // reading cannot produce them.
        other => {
            tracing::error!(error = %other, code = other.code(), "unexpected app error");
            ApiError::new(ErrorCode::Internal, "internal error")
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use agentgate::Error;
    use axum::http::{header, StatusCode};
    use axum::response::IntoResponse as _;

    use super::*;

    #[test]
    fn ledger_errors_map_through_the_same_statuses() {
        let busy = LedgerError::from(Error::SessionBusy {
            active_turn_id: "turn_a".into(),
            retry_after: Duration::from_millis(900),
        });
        let response = api_error(busy).into_response();
        assert_eq!(response.status(), StatusCode::CONFLICT);
        assert_eq!(response.headers()[header::RETRY_AFTER], "1");
        let invalid = api_error(LedgerError::invalid("text must not be empty"));
        assert_eq!(invalid.status(), StatusCode::BAD_REQUEST);
        let database = api_error(LedgerError::database("disk I/O error"));
        assert_eq!(database.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(
            !database.detail().message.contains("disk"),
            "driver details stay in the log"
        );
        let cancelled = api_error(LedgerError::Cancelled);
        assert_eq!(cancelled.status(), StatusCode::INTERNAL_SERVER_ERROR);
    }
}
