//! How a turn ends.

use super::*;

/// How a turn ends.
#[derive(Clone, Debug)]
pub enum Ending {
    /// With a response that repeats replay.
    Succeed {
        /// The response.
        response: CanonicalJson,
    },
    /// With an error; `retryable` lets a repeat restart it.
    Fail {
        /// The error.
        error: CanonicalJson,
        /// Whether a repeat of the request restarts the turn.
        retryable: bool,
    },
    /// Waiting for a person to approve `pending`.
    AwaitConfirmation {
        /// What the person is asked to approve.
        pending: CanonicalJson,
    },
    /// Stopped at a cancel request, with what it had produced so far
    /// (stored as its response, replayed to a repeat).
    Cancel {
        /// The partial response.
        partial: CanonicalJson,
    },
}
