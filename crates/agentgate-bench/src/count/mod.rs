//! Counting what a turn costs the store, instead of estimating it.
//!
//! Three counters, each read as a difference around a window in which the
//! bench runs a known number of turns one after another and nothing else
//! touches the store:
//!
//! - **statements**: sqlx emits one tracing event (target `sqlx::query`) per
//!   statement it executes. [`layer`] counts them. Its filter is dynamic and
//!   says yes only while a window is open, so outside the window sqlx does
//!   not even format the event (the measured loops pay nothing for it).
//!   sqlx executes some transaction control without an event: SQLite's
//!   `BEGIN`/`COMMIT`/`ROLLBACK` and PostgreSQL's `BEGIN`.
//! - **SQLite transactions**: the SQLite store counts the explicit write
//!   transactions it begins (`SqliteStore::transactions_begun`). A step
//!   that is one statement runs in autocommit; the others are one
//!   `BEGIN IMMEDIATE … COMMIT`, so the engine's calls into SQLite are
//!   statements + 2 × explicit transactions.
//! - **wire round trips** ([`wire`]): for PostgreSQL, MySQL and Redis a
//!   loopback proxy in front of the server counts the requests the client
//!   waits on (PostgreSQL `ReadyForQuery` messages, MySQL command packets,
//!   Redis commands). This is the exact round-trip count, `BEGIN` included.

pub mod wire;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use tracing::subscriber::Interest;
use tracing::{Event, Metadata, Subscriber};
use tracing_subscriber::filter::{DynFilterFn, LevelFilter};
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::registry::LookupSpan;

/// The target of sqlx's per-statement event.
const STATEMENT_TARGET: &str = "sqlx::query";

/// Whether a counting window is open.
static COUNTING: AtomicBool = AtomicBool::new(false);
/// Statements seen while a window was open.
static STATEMENTS: AtomicU64 = AtomicU64::new(0);
/// Whether [`layer`] is part of the global subscriber.
static INSTALLED: AtomicBool = AtomicBool::new(false);

fn is_statement(metadata: &Metadata<'_>) -> bool {
    metadata.target() == STATEMENT_TARGET
}

struct StatementCounter;

impl<S: Subscriber> Layer<S> for StatementCounter {
    fn on_event(&self, _event: &Event<'_>, _context: Context<'_, S>) {
        STATEMENTS.fetch_add(1, Ordering::Relaxed);
    }
}

/// The statement-counting layer, to add to the global subscriber (see
/// `crate::cli::init_tracing`). Call [`mark_installed`] once it is.
pub fn layer<S>() -> impl Layer<S>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    let filter = DynFilterFn::new(|metadata, _context| {
        is_statement(metadata) && COUNTING.load(Ordering::Relaxed)
    })
    .with_callsite_filter(|metadata| {
        if is_statement(metadata) {
            Interest::sometimes()
        } else {
            Interest::never()
        }
    })
    // sqlx logs statements at DEBUG by default (slow ones at WARN).
    .with_max_level_hint(LevelFilter::DEBUG);
    StatementCounter.with_filter(filter)
}

/// Records that [`layer`] is in the global subscriber, so statement counts
/// are real.
pub fn mark_installed() {
    INSTALLED.store(true, Ordering::Relaxed);
}

/// Whether statement counts are available in this process.
pub fn statements_counted() -> bool {
    INSTALLED.load(Ordering::Relaxed)
}

/// An open counting window: statements are counted until [`Window::close`].
#[derive(Debug)]
pub(crate) struct Window {
    statements_before: u64,
}

impl Window {
    pub(crate) fn open() -> Self {
        let statements_before = STATEMENTS.load(Ordering::SeqCst);
        COUNTING.store(true, Ordering::SeqCst);
        Self { statements_before }
    }

    /// Closes the window; the statements seen in it, if they are counted.
    pub(crate) fn close(self) -> Option<u64> {
        COUNTING.store(false, Ordering::SeqCst);
        let seen = STATEMENTS.load(Ordering::SeqCst) - self.statements_before;
        statements_counted().then_some(seen)
    }
}

impl Drop for Window {
    fn drop(&mut self) {
        COUNTING.store(false, Ordering::SeqCst);
    }
}
