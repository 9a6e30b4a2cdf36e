//! Every named limit of the ledger app, each with the reason for its number.
//! The engine's own limits live in `agentgate::limits`.

use std::time::Duration;

/// Model rounds per turn (docs/protocol.md §11). A booking needs three: look up the
/// categories, create the entries, say what was done. The last round is asked
/// for text only, so a turn always ends with a reply and never loops.
pub const MAX_MODEL_ROUNDS: u32 = 3;

/// Tool calls honoured per model round; extra calls are answered with a tool
/// error. Ten entries in one chat message is already a receipt, not a chat.
pub const MAX_TOOL_CALLS_PER_ROUND: usize = 10;

/// Longest user message, in characters. A chat line about money, not a
/// document; the engine's payload limit is far above this.
pub const MAX_MESSAGE_CHARS: usize = 2_000;

/// Longest note kept on an entry, in characters; longer notes are cut.
pub const MAX_NOTE_CHARS: usize = 200;

/// Longest category hint considered, in characters; a category name is a
/// word or two.
pub const MAX_CATEGORY_HINT_CHARS: usize = 64;

/// Largest single entry: 100 million yuan, in cents. A personal ledger
/// entry above it is a typo (or a unit mix-up) that must not be booked.
pub const MAX_AMOUNT_CENTS: i64 = 10_000_000_000;

/// Events one turn emits at most: 1 start + 3 rounds × (16 deltas + 10 tool
/// calls × 2) + a final or error event, rounded up. The channel returned by
/// [`crate::event_channel`] holds this many, so a turn never waits for a slow
/// reader and never drops an event of its own turn.
pub const EVENT_BUFFER: usize = 128;

/// Tries of one append to a turn's event log while the store is
/// unavailable, before the log stops (the turn and its live stream go on).
pub const LOG_APPEND_TRIES: u32 = 4;

/// The first pause between those tries; it doubles after each.
pub const LOG_APPEND_PAUSE: std::time::Duration = std::time::Duration::from_millis(100);

// The tee appends what its channel holds in one step: one channel's worth
// must fit the engine's batch.
const _: () = assert!(EVENT_BUFFER <= agentgate::limits::MAX_EVENT_BATCH);

/// Chunks the offline model's reply is streamed in at most, so a long reply
/// stays within [`EVENT_BUFFER`].
pub const MAX_DELTAS_PER_ROUND: usize = 16;

/// Rows a UI query returns at most (sessions, entries, transcript turns):
/// a page, not an export.
pub const MAX_LIST_ROWS: u32 = 200;

/// How long the OpenAI-compatible client waits for one chat completion.
/// LLM calls take 2–60 s (docs/protocol.md §11); a minute and a half covers a slow model
/// with tools while still failing a dead connection well inside a session.
pub const MODEL_REQUEST_TIMEOUT: Duration = Duration::from_secs(90);

/// Retries of a failed chat completion (timeouts, 429, 5xx, connection
/// errors). Two retries ride out a blip; more would keep a person staring at
/// a spinner for minutes.
pub const MODEL_MAX_RETRIES: u32 = 2;

/// First backoff between model retries; doubled per retry.
pub const MODEL_RETRY_BACKOFF: Duration = Duration::from_millis(500);

/// Longest wait a server's `Retry-After` may impose between model retries.
pub const MODEL_MAX_RETRY_AFTER: Duration = Duration::from_secs(10);

/// Largest model response body read, in bytes. A chat completion with a few
/// tool calls is a few KiB; this bounds memory against a misbehaving server.
pub const MODEL_MAX_RESPONSE_BYTES: usize = 4 * 1024 * 1024;

/// How long a SQLite statement of the app waits for the engine's write lock
/// on the shared file. Engine steps take milliseconds; five seconds of
/// waiting means the file is wedged.
pub const DB_BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// Connections of the app's own pool: UI reads and message writes only; the
/// ledger inserts ride on the engine's connection.
pub const DB_CONNECTIONS: u32 = 4;

/// How often the recovery worker looks for the app's orphaned turns. A
/// person waiting on "Working on it…" after a crash should see the reply
/// within a TTL plus about this long; the look-up is one indexed query.
pub const RECOVERY_INTERVAL: Duration = Duration::from_secs(2);

/// The app's unanswered messages one recovery look-up considers, newest
/// first: the engine's orphan filter takes at most this many turn ids.
pub const RECOVERY_CANDIDATES: u32 = 100;

/// Orphans the recovery worker resumes per look-up. Each runs the agent
/// loop (model rounds with think time); a look claims up to this many and
/// runs them together, so a backlog after a crash is worked off a few at a
/// time rather than all at once or one by one.
pub const RECOVERIES_PER_TICK: usize = 4;

/// Queued messages one worker runs after ending a turn, one after another
/// (the handoff). The engine's queue holds at most 100 per session
/// (`agentgate::limits::MAX_SESSION_QUEUE`), so this drains a full queue
/// once; messages that keep arriving after that are left to the recovery
/// worker, so no worker's task runs one conversation forever.
pub const MAX_HANDOFFS_PER_DRAIN: u32 = 100;
