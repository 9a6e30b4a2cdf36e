//! The server's own named limits, each with its reason. The engine's limits
//! (id bytes, JSON size and depth, TTL range) live in `agentgate::limits`.

use std::time::Duration;

/// Default largest request body. The engine accepts canonical JSON of up to
/// 1 MiB per payload or result, so the HTTP body limit matches it; anything
/// larger is refused before it is parsed.
pub const DEFAULT_MAX_BODY_BYTES: usize = 1024 * 1024;

/// Most bytes of an oversized body read and thrown away before answering
/// 413. A client that is still sending when the server answers and closes
/// the connection sees a reset instead of the answer; draining a bounded
/// amount lets ordinary clients read the 413, while a client sending more
/// than this is cut off (the request timeout bounds the time spent).
pub const MAX_DRAINED_BYTES: usize = 16 * 1024 * 1024;

/// Largest body limit an operator may configure. Bodies are buffered whole
/// before parsing; 64 MiB per request times [`MAX_CONCURRENT_REQUESTS`] is
/// already more memory than a small host has.
pub const MAX_MAX_BODY_BYTES: usize = 64 * 1024 * 1024;

/// Longest a request may take, queueing included, before the server answers
/// 503. Every protocol step is one short store transaction; one that takes as
/// long as a default lease TTL means the store is wedged, and the caller is
/// better told than left hanging.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// Requests handled at once; more wait (within [`REQUEST_TIMEOUT`]). The
/// store serialises writes anyway, so beyond this more concurrency only adds
/// memory and queueing inside the store's pool.
pub const MAX_CONCURRENT_REQUESTS: usize = 1024;

/// Longest error message sent back. Messages may quote the input (serde
/// names the offending value); a client sending megabytes must not get them
/// echoed back.
pub const MAX_ERROR_MESSAGE_BYTES: usize = 512;

/// Longest API key accepted. Keys are compared as SHA-256 digests, so length
/// costs nothing at compare time; the bound keeps header parsing cheap and
/// catches a whole file pasted into the flag by mistake.
pub const MAX_API_KEY_BYTES: usize = 256;

/// Shortest API key accepted: 16 bytes is the least that resists guessing
/// when a key is a random token, which is what operators should configure.
pub const MIN_API_KEY_BYTES: usize = 16;

/// Most API keys configured at once (flags plus file). Enough to rotate keys
/// per client; each request compares against every key.
pub const MAX_API_KEYS: usize = 64;

/// Largest API key file read. A file of [`MAX_API_KEYS`] keys of
/// [`MAX_API_KEY_BYTES`] with comments fits easily.
pub const MAX_API_KEY_FILE_BYTES: u64 = 64 * 1024;

/// Longest think time per model round the offline model may be given. The
/// point of the setting is to look like a 2–10 s LLM (SPEC §6); a minute per
/// round would only make a demo look hung.
pub const MAX_THINK_TIME: Duration = Duration::from_secs(60);

/// Interval of SSE keep-alive comments on a turn's event stream. Besides
/// keeping proxies from closing a quiet stream, each write is how a client
/// that went away is noticed while the model is silent (the `cancel`
/// disconnect policy then fires within about this long).
pub const SSE_KEEP_ALIVE: Duration = Duration::from_secs(1);

/// Rows of each kind (live leases, turns, tool executions) the dashboard
/// shows: a screenful. The store caps any overview at its own limit too.
pub const DASHBOARD_ROWS: u32 = 50;

/// Users whose permits the dashboard reads per refresh, one store read each.
/// The dashboard refreshes every second; this bounds the reads it costs.
pub const DASHBOARD_MAX_USERS: usize = 20;
