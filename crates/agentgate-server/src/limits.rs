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

/// Longest a client may take to send a request head (request line and
/// headers), from the moment the connection waits for it. A client that
/// never finishes its headers (slowloris) would otherwise hold a connection
/// and a file descriptor forever. Real clients send a head in one packet;
/// ten seconds allows for a very slow link. hyper starts the same timer when
/// a kept-alive connection waits for its next request, so this is also how
/// long an idle keep-alive connection is kept open.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Default cap on open connections; a connection over it is answered 503
/// `overloaded` and closed at once. Each connection is a file descriptor:
/// a common soft limit is 1024 per process, and the store's pool, Redis and
/// SQLite files need some, so 512 leaves headroom; agent backends talk
/// through a few pooled keep-alive connections, not hundreds.
pub const DEFAULT_MAX_CONNECTIONS: usize = 512;

/// Largest connection cap an operator may configure: past this the host's
/// descriptor limit, not the cap, is what stops a flood.
pub const MAX_MAX_CONNECTIONS: usize = 65_536;

/// Most connections one client (one peer IP address) may hold open at
/// once by default: half of [`DEFAULT_MAX_CONNECTIONS`], so one client's
/// idle streams or half-open connections can never take every place (515
/// of one client's streams once kept everyone else at 503), while a
/// backend that opens a few hundred connections from one address still
/// fits.
/// Behind a reverse proxy every client shares the proxy's address: set it
/// to `--max-connections` there.
pub const DEFAULT_MAX_CONNECTIONS_PER_CLIENT: usize = DEFAULT_MAX_CONNECTIONS / 2;

/// `Retry-After` sent to a connection refused at the cap: connections free
/// up as soon as requests finish, so a second is enough to try again.
pub const OVERLOADED_RETRY_AFTER: Duration = Duration::from_secs(1);

/// Pause after a failed `accept` (out of descriptors, say) before the next:
/// retrying at once would spin a core while nothing can change.
pub const ACCEPT_ERROR_BACKOFF: Duration = Duration::from_millis(100);

/// How long a shutdown waits for open connections to finish their requests
/// in flight; a stream that outlives it is cut. As long as
/// [`REQUEST_TIMEOUT`], the longest an ordinary request may take.
pub const SHUTDOWN_GRACE: Duration = REQUEST_TIMEOUT;

/// `Retry-After` of a 503 that knows no better (the store or Redis is down):
/// the health probe looks again every [`HEALTH_PROBE_INTERVAL`], so a retry
/// sooner could not see a recovery, and one much later would wait for
/// nothing.
pub const UNAVAILABLE_RETRY_AFTER: Duration = HEALTH_PROBE_INTERVAL;

/// Longest a client may take to send a request body once its headers are
/// in. The default 1 MiB body arrives in about 8 s even at 1 Mbit/s; a
/// client that stalls longer is answered 408 `request_timeout` instead of
/// holding a request slot until [`REQUEST_TIMEOUT`] (and being told the
/// store is unavailable).
pub const BODY_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// How often the background probe reads from the store and pings the
/// Redis lease layer. While one is down, requests that need it are refused
/// at once (503 + `Retry-After`) instead of each waiting out the store's
/// acquire timeout; a second is quick to notice both an outage and a
/// recovery, and costs one tiny read per second.
pub const HEALTH_PROBE_INTERVAL: Duration = Duration::from_secs(1);

/// Longest one probe may take before its dependency counts as down. A
/// healthy store answers a primary-key read in milliseconds, even under
/// load; a second means it is unreachable or wedged (the store's own
/// acquire timeout, `agentgate::limits::STORE_ACQUIRE_TIMEOUT`, is ten
/// times longer because it must also ride out lock waits).
pub const HEALTH_PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// Failed probes in a row before a dependency counts as down. One probe
/// slower than [`HEALTH_PROBE_TIMEOUT`] can be a pause (a checkpoint, a
/// pool momentarily busy); two in a row, two seconds without a primary-key
/// read, is an outage worth refusing requests for.
pub const PROBE_FAILURES_TO_TRIP: u32 = 2;

/// Most `--allowed-host` entries. Every request is compared against each;
/// a handful of names (a proxy's, a service name) is what deployments need.
pub const MAX_ALLOWED_HOSTS: usize = 64;

/// Most `--allowed-origin` entries, for the same reason as
/// [`MAX_ALLOWED_HOSTS`].
pub const MAX_ALLOWED_ORIGINS: usize = 64;

/// Longest one write to a client may wait for the client to take bytes;
/// past it the connection is closed ([`crate::stall`]). A reader that
/// stopped reading (an event stream nobody reads, a slow-read attack on a
/// large answer) frees its connection and the response's memory.
pub const WRITE_STALL: Duration = Duration::from_secs(30);

/// Longest data sent to a client may stay unacknowledged before the kernel
/// drops the connection (`TCP_USER_TIMEOUT`): a client that vanished
/// without closing (half-open) is found by the next event or keep-alive
/// line ([`SSE_KEEP_ALIVE`]) plus this.
pub const UNACKED_LIMIT: Duration = Duration::from_secs(30);

/// Longest one event stream stays open: then it closes without `end`, and
/// the reader resumes with `Last-Event-ID` (an `EventSource` does so by
/// itself), so no stream holds a connection forever.
pub const MAX_EVENT_STREAM_LIFETIME: Duration = Duration::from_secs(30 * 60);

/// How often an idle event stream sends an SSE comment line: proxies and
/// load balancers commonly close a response silent for 30 to 60 seconds.
pub const SSE_KEEP_ALIVE: Duration = Duration::from_secs(15);
