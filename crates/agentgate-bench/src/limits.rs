//! Every named limit and fixed setting of the bench, each with its reason.

use std::time::Duration;

/// Most concurrent clients. `agentgate serve` handles 1,024 requests at once
/// (`agentgate_server::limits::MAX_CONCURRENT_REQUESTS`); beyond that an HTTP
/// run measures the server's queue, not the engine.
pub const MAX_CONCURRENCY: usize = 1024;

/// The connection cap the bench's server runs with. `agentgate serve` caps
/// open connections (512 by default) and refuses the rest; each bench client
/// keeps one keep-alive connection, so the cap must exceed
/// [`MAX_CONCURRENCY`] plus the harness's own few (readiness checks, the
/// live-turn clients), or a wide run would measure refusals.
pub const SERVER_MAX_CONNECTIONS: usize = MAX_CONCURRENCY + 128;

/// Longest measured time per loop. An hour is far past the point where
/// another minute changes a median; longer is a soak test.
pub const MAX_DURATION: Duration = Duration::from_secs(3600);

/// Most alternating rounds. Each round runs every loop once; a hundred
/// rounds already makes slices too short to warm a connection pool.
pub const MAX_ROUNDS: u32 = 100;

/// Most pre-populated sessions. Ten million rows take minutes to insert and
/// gigabytes of disk; past that the figure is about the disk, not agentgate.
pub const MAX_SESSIONS: u64 = 10_000_000;

/// Most duplicate begins in a storm. Over HTTP each is its own connection,
/// and a default descriptor limit of a few thousand per process must hold
/// them and the server's side too.
pub const MAX_STORM: usize = 10_000;

/// Most turns held live at once for the memory figure. The server keeps no
/// per-turn state beyond the store's rows, so more adds only time.
pub const MAX_LIVE_TURNS: usize = 100_000;

/// Most documents of the ingestion row, per loop.
pub const MAX_INGEST_DOCUMENTS: usize = 10_000;

/// Most turns of the round-trip counting pass. The count is exact per turn;
/// a few hundred turns only smooth out one-off pool pings.
pub const MAX_COUNT_TURNS: u32 = 100_000;

/// Sequential turns run before the counting window opens, so every prepared
/// statement is in the connection's cache and first-use preparation (a
/// one-off round trip per statement and connection) is not counted.
pub const COUNT_WARMUP_TURNS: u32 = 20;

/// A loop is warmed for this fraction of its measured time (at most
/// [`MAX_WARMUP`]) before its first measured slice: pools open their
/// connections, statements get prepared, the page cache fills.
pub const WARMUP_DIVISOR: u32 = 5;

/// Longest warm-up of a loop; two seconds open every pooled connection.
pub const MAX_WARMUP: Duration = Duration::from_secs(2);

/// Rows inserted per statement when pre-populating. One statement per
/// 100,000 rows keeps each transaction's undo/WAL in the tens of megabytes
/// while still inserting a million rows in ten statements.
pub const POPULATE_CHUNK_ROWS: u64 = 100_000;

/// Pre-populated sessions per synthetic user. Ten sessions per user looks
/// like real traffic (a few conversations each) and keeps the user index
/// from degenerating into one row per key.
pub const SESSIONS_PER_USER: u64 = 10;

/// Connections of the raw baseline's pool on PostgreSQL and MySQL: the same
/// as `MAX_CONNECTIONS` of `agentgate-store-postgres` and
/// `agentgate-store-mysql`, so both sides of the ratio get the same number
/// of connections. Keep in step with those stores.
pub const SERVER_POOL_CONNECTIONS: u32 = 10;

/// How long the raw baseline waits for a pooled connection, as the stores do
/// (`agentgate::limits::STORE_ACQUIRE_TIMEOUT`).
pub const POOL_ACQUIRE_TIMEOUT: Duration = Duration::from_secs(10);

/// SQLite busy timeout of the raw baseline's connection: the store's own
/// (`agentgate-store-sqlite`'s `BUSY_TIMEOUT`).
pub const SQLITE_BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a spawned `agentgate serve` may take to print its address.
/// Opening a store and applying its schema takes well under a second; thirty
/// allows for a loaded machine and a remote database.
pub const SERVER_STARTUP_TIMEOUT: Duration = Duration::from_secs(30);

/// Longest a bench HTTP call may take. The server answers 503 after its own
/// 30 s request timeout; ten more seconds is the margin for that answer.
pub const HTTP_TIMEOUT: Duration = Duration::from_secs(40);

/// Concurrent clients that begin the live turns of the memory figure. Enough
/// to begin 10,000 turns in seconds, few enough not to measure a connection
/// storm instead of the turns.
pub const LIVE_TURN_CLIENTS: usize = 64;

/// Lease TTL of the memory server: the longest the engine allows, so the
/// first of 10,000 turns is still live when the last one is begun, even on a
/// slow store.
pub const LIVE_LEASE_TTL: Duration = Duration::from_secs(600);

/// How often the engine's background sweeper runs during a bench: once an
/// hour, i.e. never within a run. The sweeper is a background cost, not a
/// per-turn one, and its statements must not fall into the counting window.
pub const BENCH_SWEEP_INTERVAL: Duration = Duration::from_secs(3600);

/// Keys deleted per `SCAN` batch when cleaning up the run's Redis prefix.
pub const REDIS_SCAN_BATCH: usize = 1000;

/// Most `SCAN` calls of the clean-up: enough for ten million keys at
/// [`REDIS_SCAN_BATCH`] per call, so a clean-up always ends.
pub const MAX_REDIS_SCAN_CALLS: usize = 10_000;

/// Longest header line of a wire protocol the counting proxy parses (a Redis
/// `*<n>` or `$<len>` line). Longer means the stream is not what the proxy
/// thinks it is; it stops counting and says so.
pub const MAX_WIRE_HEADER_BYTES: usize = 32;

/// How long the bench waits for a storm to be answered in full before it
/// reports a failure. Every begin is one short store step; a minute means
/// the store is wedged.
pub const STORM_TIMEOUT: Duration = Duration::from_secs(60);

/// Most followers of the events row: each is a task and a channel on one
/// gate; past this the figure is the machine's, not the feed's.
pub const MAX_EVENT_SUBSCRIBERS: usize = 100_000;

/// Most rounds per mode of the wake row.
pub const MAX_WAKE_ROUNDS: usize = 10_000;
