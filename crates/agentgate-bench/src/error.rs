//! The one error type of the bench: what stopped a run.
//!
//! Expected refusals of the protocol (the 999 `request_in_flight` answers of
//! a storm) are results, not errors; anything else that goes wrong while a
//! loop is measured ends the run, because a figure measured over failures
//! would mean nothing.

/// Why a bench run stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BenchError {
    /// A flag is out of range or unsupported.
    #[error("invalid options: {0}")]
    Options(String),
    /// The engine refused or failed a step that should have succeeded.
    #[error("engine: {0}")]
    Engine(#[from] agentgate::Error),
    /// A statement of the raw baseline or of the set-up failed.
    #[error("sql: {0}")]
    Sql(#[from] sqlx::Error),
    /// A Redis command of the raw baseline or of the clean-up failed.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// An HTTP call to `agentgate serve` failed.
    #[error("http: {0}")]
    Http(#[from] reqwest::Error),
    /// A file, socket or child process could not be used.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A step answered something a correct run never answers.
    #[error("unexpected answer: {0}")]
    Unexpected(String),
    /// The run was stopped from outside (Ctrl-C) before it finished.
    #[error("interrupted")]
    Interrupted,
}

impl BenchError {
    /// An I/O error with what was being done.
    pub(crate) fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        Self::Io {
            what: what.into(),
            source,
        }
    }

    /// A step answered what it never should.
    pub(crate) fn unexpected(message: impl Into<String>) -> Self {
        Self::Unexpected(message.into())
    }
}

/// `Result` with [`BenchError`].
pub type Result<T, E = BenchError> = std::result::Result<T, E>;
