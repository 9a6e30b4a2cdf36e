//! Every bound of an ingestion, named once.

use std::time::Duration;

/// The largest document accepted, in bytes.
pub const MAX_DOCUMENT_BYTES: usize = 4 * 1024 * 1024;

/// The longest document name, in bytes.
pub const MAX_NAME_BYTES: usize = 256;

/// The longest tenant id, in bytes (a tenant is the turn's user).
pub const MAX_TENANT_BYTES: usize = 100;

/// The most pages a PDF may have.
pub const MAX_PDF_PAGES: usize = 500;

/// The longest one document's parsing may take (a PDF's text extraction
/// is CPU work in a blocking thread) before the upload is refused.
pub const MAX_PARSE_TIME: Duration = Duration::from_secs(20);

/// The most documents parsed at once in one process. A parse in a child
/// process (`isolate`) frees its permit when the child is gone, killed at
/// [`MAX_PARSE_TIME`] if need be; one in a thread keeps it until the thread
/// really ends.
pub const MAX_CONCURRENT_PARSES: usize = 2;

/// The address space a PDF parser's child process may take: the file's
/// decompressed streams and the text included (a FlateDecode bomb dies
/// here, not in the server).
pub const MAX_PARSE_MEMORY: usize = 512 * 1024 * 1024;

/// The most text a PDF parser's child may hand back: more than
/// [`MAX_CHUNKS`] chunks could hold in any script.
pub const MAX_PARSED_TEXT_BYTES: usize = 4 * CHUNK_CHARS * MAX_CHUNKS + 1024;

/// A chunk's target size in characters; a paragraph longer than this is
/// cut at a character boundary.
pub const CHUNK_CHARS: usize = 800;

/// The most chunks one document may have.
pub const MAX_CHUNKS: usize = 2_000;

/// Chunks per embedding call (one tool execution each).
pub const EMBED_BATCH: usize = 16;

/// How many times a failed embedding call is asked again inside the
/// ingestion before the ingestion fails (retryable).
pub const EMBED_RETRIES: u32 = 3;

/// The first pause before asking the embedder again; doubled each time.
pub const EMBED_RETRY_PAUSE: Duration = Duration::from_millis(200);

/// The dimension of the offline embedder's vectors.
pub const OFFLINE_DIMENSIONS: usize = 64;

/// The largest vector dimension accepted from an embedder.
pub const MAX_DIMENSIONS: usize = 4_096;

/// The most current chunks one search scores (an exact search reads them
/// all, so a tenant is bounded).
pub const MAX_SEARCH_CHUNKS: i64 = 20_000;

/// The most hits one search returns.
pub const MAX_SEARCH_HITS: usize = 50;

/// The longest search query, in bytes.
pub const MAX_QUERY_BYTES: usize = 2_000;

/// How long an upload waits for a running ingestion of the same content
/// (or another update of the same document) before answering "processing".
pub const MAX_INGEST_WAIT: Duration = Duration::from_secs(30);

/// The first pause between two looks at a running ingestion; doubled up to
/// [`MAX_WAIT_STEP`], with jitter.
pub const FIRST_WAIT_STEP: Duration = Duration::from_millis(20);

/// The longest pause between two looks at a running ingestion.
pub const MAX_WAIT_STEP: Duration = Duration::from_millis(500);

/// How long a superseded version's chunks stay readable after the switch,
/// so queries already running finish on it.
pub const OLD_VERSION_GRACE: Duration = Duration::from_secs(60);

/// The most ingestions a tenant's list shows.
pub const MAX_LISTED_INGESTIONS: i64 = 50;

/// The most orphaned ingestions one recovery pass claims.
pub const MAX_RECOVER_PER_PASS: usize = 32;
