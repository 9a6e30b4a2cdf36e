//! Every named limit of the engine, in one place, each with its reason.
//!
//! Inputs over a limit are rejected as `invalid_request` (or
//! `payload_too_large` at the HTTP layer) before anything is written.

use std::time::Duration;

/// Longest user, session, client request or tool name (and turn, execution
/// and lease token as received), in characters (Unicode scalar values):
/// what JSON Schema's `maxLength` counts, so the OpenAPI document states it
/// exactly. Long enough for a UUID with a prefix or a URL-safe hash, or a
/// name in any script; short enough to index cheaply: at most
/// 4 × 128 = 512 bytes of UTF-8, what the stores' id columns hold.
pub const MAX_ID_CHARS: usize = 128;

/// Largest canonical JSON of a payload, tool args, tool result, turn response,
/// turn error or pending confirmation. A turn's data is a chat message and its
/// answer, not a file; 1 MiB leaves room for long answers and keeps a row small.
pub const MAX_JSON_BYTES: usize = 1024 * 1024;

/// Deepest nesting of any JSON value accepted, counted in arrays and objects:
/// a scalar is depth 0, `[]` and `{}` depth 1, `[[1]]` depth 2.
/// Canonicalisation recurses, so an unbounded depth would let one request
/// exhaust a stack.
pub const MAX_JSON_DEPTH: usize = 64;

/// Shortest lease TTL. A heartbeat runs every TTL/3; below 100 ms the
/// heartbeat period approaches one store round trip and leases flap.
pub const MIN_LEASE_TTL: Duration = Duration::from_millis(100);

/// Longest lease TTL. A crashed holder blocks its session for one TTL; more
/// than ten minutes is a lock leak by another name.
pub const MAX_LEASE_TTL: Duration = Duration::from_secs(600);

/// Largest per-user cap on concurrent turns. A cap is a fairness limit; one
/// user holding more than this many live turns is not a user, it is a load test.
pub const MAX_TURNS_PER_USER: u32 = 10_000;

/// How many times a turn may be started (first start, takeovers, restarts)
/// before the engine stops retrying it and records it failed for good. A turn
/// that crashed its worker sixteen times will crash the seventeenth.
pub const MAX_TURN_ATTEMPTS: u32 = 16;

/// How many times one tool execution may be claimed for execution. Same
/// reasoning as [`MAX_TURN_ATTEMPTS`].
pub const MAX_TOOL_ATTEMPTS: u32 = 16;

/// Largest number of finished records one sweep deletes in one SQL
/// transaction, so a sweep never holds the write lock for long.
pub const MAX_SWEEP_BATCH: u32 = 10_000;

/// Default number of finished records deleted per sweep batch.
pub const DEFAULT_SWEEP_BATCH: u32 = 500;

/// Longest result retention and pending-confirmation lifetime: 30 days.
pub const MAX_RETENTION: Duration = Duration::from_secs(30 * 24 * 3600);

/// Shortest result retention: a replay must still find the answer a client
/// is retrying for, and clients retry within seconds to minutes.
pub const MIN_RETENTION: Duration = Duration::from_secs(1);

/// How long a store waits for a connection or a lock before reporting
/// `store_unavailable` instead of queueing forever.
pub const STORE_ACQUIRE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long the Redis lease layer waits for an answer to one command, and
/// for one connection attempt, before the step fails `store_unavailable`:
/// a lease script answers in well under a millisecond, so a Redis that has
/// not answered in this long is lost, and the first call after the loss
/// fails within a second, not after a reconnect's backoff.
pub const REDIS_RESPONSE_TIMEOUT: Duration = Duration::from_millis(500);

/// Idle time before TCP keepalive probes start on a Redis connection. The
/// event subscriber's connection is idle for as long as nothing is
/// appended, and no command's timeout watches it: without probes, a Redis
/// host that vanished (no FIN, no RST) leaves it open for hours (Linux's
/// default is 2 h) and cross-node wake-ups silently stop.
pub const REDIS_KEEPALIVE_IDLE: Duration = Duration::from_secs(10);

/// Time between keepalive probes; after [`REDIS_KEEPALIVE_PROBES`]
/// unanswered ones the connection is dropped and reconnected: a dead peer
/// is found within 10 + 3 × 5 = 25 s.
pub const REDIS_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);

/// Unanswered keepalive probes before the connection counts as dead.
pub const REDIS_KEEPALIVE_PROBES: u32 = 3;

/// How long one attempt to (re)connect to Redis may take; after a lost
/// connection each call makes one attempt (no retries inside a call, so no
/// backoff a caller waits through), and the next call tries again.
pub const REDIS_CONNECT_TIMEOUT: Duration = Duration::from_millis(500);

/// Pooled connections of a PostgreSQL or MySQL store by default
/// ([`crate::config::Config::store_connections`]).
pub const DEFAULT_STORE_CONNECTIONS: u32 = 10;

/// Most pooled connections one store may keep.
pub const MAX_STORE_CONNECTIONS: u32 = 200;

/// The longest one protocol step may take, its retries included, before
/// it is answered `store_unavailable`: a store that stops answering without
/// closing (a proxy that blackholes) never hangs a caller. Above
/// [`STORE_ACQUIRE_TIMEOUT`] (the retry budget) plus a statement's lock
/// wait, so a healthy but busy store answers first.
pub const STORE_STEP_DEADLINE: Duration = Duration::from_secs(15);

/// Bound on retries of a protocol step after a transient store conflict
/// (SQLITE_BUSY, serialization failure, deadlock).
pub const MAX_STORE_RETRIES: u32 = 8;

/// Most tool executions one turn may record. An agent loop runs a few model
/// rounds with a few tool calls each; a thousand distinct calls in one turn is
/// a runaway loop, and the bound keeps a turn's sweep batch bounded too.
pub const MAX_EXECUTIONS_PER_TURN: u32 = 1_000;

/// Most rows of each kind an overview returns: a dashboard shows a screenful,
/// and the query must stay cheap however large the store grows.
pub const MAX_OVERVIEW_ROWS: u32 = 200;

/// Orphans one claim looks at, oldest first. Many recovery workers race for
/// the same oldest orphans; a worker that loses one moves to the next, so the
/// window must exceed the workers a deployment runs at once, while one claim
/// stays a bounded number of store steps.
pub const MAX_ORPHAN_SCAN: u32 = 128;

/// Most users, and most turns, one orphan filter names: a recovery worker
/// serves a shard of users or its own recent turns, not every account; the
/// list becomes one bounded `IN (...)` of the candidate query.
pub const MAX_ORPHAN_FILTER_IDS: usize = 100;

/// Shortest orphan grace: a grace shorter than a lease TTL would abandon a
/// turn before the client's own retry, or a recovery worker, could come.
/// The grace is also checked against the configured TTL.
pub const MIN_ORPHAN_GRACE: Duration = Duration::from_secs(1);

/// Longest orphan grace: a day. A person waiting for a reply has long given
/// up; the turn must end so its session and permit are free.
pub const MAX_ORPHAN_GRACE: Duration = Duration::from_secs(24 * 3600);

/// The default cancel grace ([`crate::config::Config::cancel_grace`]): a
/// minute, two default TTLs.
pub const DEFAULT_CANCEL_GRACE: Duration = Duration::from_secs(60);

/// Shortest cancel grace: a holder heartbeats every third of its TTL, and
/// learns of a cancel on the first one after it; a second is the least it
/// can be given to end its turn itself.
pub const MIN_CANCEL_GRACE: Duration = Duration::from_secs(1);

/// Longest cancel grace: a day, as for orphans. A turn asked to stop that
/// still runs a day later is holding its session against its user's will.
pub const MAX_CANCEL_GRACE: Duration = Duration::from_secs(24 * 3600);

/// Largest TLS file (a CA bundle, a client certificate or key) a store URL
/// may name. Mozilla's whole root bundle is about 220 KB; a file larger than
/// a mebibyte is not a certificate, and is refused before it is read.
pub const MAX_TLS_FILE_BYTES: u64 = 1024 * 1024;

/// Batches one sweeper tick deletes at most before waiting for the next
/// tick, so a backlog is worked off without monopolising the store.
pub const SWEEP_BATCHES_PER_TICK: u32 = 16;

/// Attempts the background release of a dropped turn makes before leaving
/// the lease to expire on its own.
pub const RELEASE_ATTEMPTS: u32 = 5;

/// Fraction of the TTL kept in reserve: the signal fires this long before the
/// local deadline, leaving the holder time to stop before a takeover.
pub const SAFETY_MARGIN_DIVISOR: u32 = 5;

/// Retries of a failed renewal run this often (as a fraction of the TTL), so
/// a store blip shorter than the margin costs nothing.
pub const RETRY_DIVISOR: u32 = 10;

/// How many times a one-statement step runs before giving up when it
/// changed no row yet the explanation found nothing wrong (the state moved
/// between the two; in practice never twice).
pub const FAST_ATTEMPTS: u32 = 2;

/// Retry-after for a second confirmation while the first one's continuation
/// runs under a dead lease: only a repeat of the continuation's own request
/// can take it over, so the caller should not spin waiting for it.
pub const DEAD_CONTINUATION_RETRY: Duration = Duration::from_secs(1);

/// Tool executions on one page of a turn's executions when the caller names
/// no page size: a screenful, and what most turns record in all.
pub const DEFAULT_EXECUTION_PAGE: u32 = 50;

/// Most tool executions one page may carry. A read of a turn is an HTTP
/// response held in memory whole; with [`MAX_EXECUTIONS_PER_TURN`] executions
/// a caller walks at most five pages of this size.
pub const MAX_EXECUTION_PAGE: u32 = 200;

/// Most bytes of stored results and errors (canonical JSON) one page of
/// executions carries; a page stops before the execution that would pass
/// it, but always carries at least one (each is at most [`MAX_JSON_BYTES`]).
/// Without it, 200 results of 1 MiB make one read cost 200 MiB of memory.
pub const MAX_EXECUTION_PAGE_BYTES: usize = 4 * 1024 * 1024;

/// Longest a begin with the `wait` or `interrupt` policy waits for its
/// session to come free. Below the HTTP service's request timeout (30 s),
/// so a waiting begin answers before the server gives up on it.
pub const MAX_BUSY_WAIT: Duration = Duration::from_secs(20);

/// How long `wait` and `interrupt` wait when the caller names no bound:
/// long enough for a remote holder to learn of an interrupt on its next
/// heartbeat (a third of the default 30 s TTL).
pub const DEFAULT_BUSY_WAIT: Duration = Duration::from_secs(12);

/// Longest a waiting begin sleeps between attempts when no notification
/// wakes it (a store without one, a holder on another node, a lease that
/// simply expired): the poll is this, or the holder's remaining lease when
/// sooner, with jitter so waiters do not retry in step.
pub const MAX_BUSY_POLL: Duration = Duration::from_millis(500);

/// Most sessions one store handle watches for waiting begins at once;
/// past it a waiter still waits, by its bounded poll alone.
pub const MAX_WATCHED_SESSIONS: usize = 10_000;

/// Most turns waiting in one session's queue (`on_busy: enqueue` or
/// `supersede`): a conversation's backlog a person could still follow; one
/// more is refused `queue_full`, never dropped.
pub const MAX_SESSION_QUEUE: u32 = 100;

/// Most turns one user has waiting in queues, across all their sessions:
/// a session's bound ([`MAX_SESSION_QUEUE`]) alone lets one user fill the
/// store by opening sessions. One more is refused `queue_full`, never
/// dropped; counted under the user's lock, so concurrent begins in
/// different sessions never overshoot it.
pub const MAX_USER_QUEUE: u32 = 200;

/// Most events one append carries (`Turn::emit_all`, `POST
/// /v1/turns/{id}/events`): a batch is one transaction, and its statement
/// binds six values an event, far below every driver's placeholder limit.
pub const MAX_EVENT_BATCH: usize = 500;

/// Longest event name, in bytes: names an SSE `event:` line, so it is a
/// short token (letters, digits, `_`, `-`, `.`, `:`).
pub const MAX_EVENT_NAME_BYTES: usize = 64;

/// Largest event data, canonical JSON bytes: a streamed token, a tool's
/// progress, a status line; not a document.
pub const MAX_EVENT_DATA_BYTES: usize = 64 * 1024;

/// Most events one turn keeps: a long reply streamed token by token fits
/// several times over; a runaway loop is refused, typed, long before the
/// store fills.
pub const MAX_TURN_EVENTS: u64 = 20_000;

/// Most event data bytes one turn keeps.
pub const MAX_TURN_EVENT_BYTES: u64 = 16 * 1024 * 1024;

/// Most events one read returns; a reader pages through the rest.
pub const MAX_EVENT_PAGE: u32 = 500;

/// Longest a follower of a turn's events waits between reads when no
/// notification wakes it (MySQL, SQLite across processes, a node whose
/// listener is reconnecting): the tail's latency bound there.
pub const EVENT_POLL: Duration = Duration::from_millis(250);

/// Most turns one gate follows at once (one store read loop each, shared
/// by all of a turn's subscribers on the node); past it a subscription is
/// refused `store_unavailable` with a retry.
pub const MAX_FOLLOWED_TURNS: usize = 10_000;

/// Pages of events buffered per followed turn for its slowest subscriber;
/// one that falls further behind re-reads from the store, never blocks the
/// others. With [`MAX_FANOUT_PAGE_BYTES`] a followed turn's buffer holds at
/// most 4 MiB of event data, however many subscribers it has.
pub const EVENT_FANOUT_BUFFER: usize = 64;

/// Most event data one broadcast page carries to a turn's subscribers; a
/// page read over it is announced without its events, and each subscriber
/// reads it from the store in its own bounded pages ([`FOLLOW_PAGE`]).
pub const MAX_FANOUT_PAGE_BYTES: usize = 64 * 1024;

/// Events one follower or feed reads from the store at a time: with
/// [`MAX_EVENT_DATA_BYTES`] at most 2 MiB of data, so a reader that has
/// fallen behind, or never reads, pins a bounded page, not the turn's log.
pub const FOLLOW_PAGE: u32 = 32;

/// Events a follower hands its reader ahead of what the reader took: with
/// [`FOLLOW_PAGE`], at most 2.5 MiB of event data held per follower.
pub const FOLLOW_BUFFER: usize = 8;

/// Longest a follower waits for its reader to take the next event: a
/// reader that takes nothing for this long while events wait is cut off
/// (the stream closes without `end`; the reader resumes with
/// `Last-Event-ID`), so a reader that stopped reading frees its place.
pub const FOLLOW_STALL: Duration = Duration::from_secs(30);
