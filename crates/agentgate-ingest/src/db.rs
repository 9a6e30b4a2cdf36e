//! The ingestion's own tables, in the engine's database: the uploaded
//! bytes (so a takeover can parse them again), the documents with their
//! current version, the versions, and the chunks with their vectors.
//!
//! Every statement is written once with `$n` placeholders and runs on
//! SQLite and PostgreSQL (`on_pool!`, `on_tx!`); only the schema's types
//! differ. Chunks and the version switch are written only inside a tool
//! execution's SQL transaction (`upsert_chunks`, `publish`), so they commit
//! with the step that records them, fenced by the engine: a stale holder's
//! transaction is refused before its effect runs.

use std::str::FromStr;
use std::time::Duration;

use agentgate::SqlTx;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::Row;

use crate::chunk::MediaType;
use crate::IngestError;

/// How long a statement of the app's SQLite pool waits for the writer.
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// The advisory lock key that orders two nodes creating the tables
/// ("ingestab" in ASCII).
const SCHEMA_LOCK_KEY: i64 = 0x696e_6765_7374_6162;

/// Pooled connections of the ingestion's own pool.
const CONNECTIONS: u32 = 4;

/// The ingestion's connection pool: the engine's database opened again.
#[derive(Clone, Debug)]
pub(crate) enum Pool {
    /// The engine's SQLite file (WAL: reads never wait for the engine).
    Sqlite(sqlx::SqlitePool),
    /// The engine's PostgreSQL database.
    Postgres(sqlx::PgPool),
}

macro_rules! on_pool {
    ($pool:expr, $p:ident => $body:expr) => {
        match $pool {
            Pool::Sqlite($p) => $body,
            Pool::Postgres($p) => $body,
        }
    };
}

macro_rules! on_tx {
    ($tx:expr, $c:ident => $body:expr) => {
        match $tx {
            SqlTx::Sqlite($c) => $body,
            SqlTx::Postgres($c) => $body,
            other => {
                return Err(IngestError::Invalid(format!(
                    "ingestion runs on SQLite and PostgreSQL, not on {other:?}"
                )))
            }
        }
    };
}

/// The tables, written once: `{int}` is a 64-bit integer, `{bytes}` a byte
/// string, in the dialect's spelling ([`schema`]).
const SCHEMA: &[&str] = &[
    "CREATE TABLE IF NOT EXISTS ingest_blobs (tenant TEXT NOT NULL, sha256 TEXT NOT NULL, \
     name TEXT NOT NULL, media_type TEXT NOT NULL, content {bytes} NOT NULL, \
     created_at_ms {int} NOT NULL, PRIMARY KEY (tenant, sha256))",
    "CREATE TABLE IF NOT EXISTS ingest_documents (document_id TEXT PRIMARY KEY, \
     tenant TEXT NOT NULL, name TEXT NOT NULL, current_version TEXT NOT NULL, \
     version_no {int} NOT NULL, chunks {int} NOT NULL, fence {int} NOT NULL, \
     updated_at_ms {int} NOT NULL)",
    "CREATE INDEX IF NOT EXISTS ingest_documents_tenant ON ingest_documents (tenant)",
    "CREATE TABLE IF NOT EXISTS ingest_versions (document_id TEXT NOT NULL, \
     version TEXT NOT NULL, version_no {int} NOT NULL, chunks {int} NOT NULL, \
     fence {int} NOT NULL, published_at_ms {int} NOT NULL, superseded_at_ms {int}, \
     PRIMARY KEY (document_id, version))",
    "CREATE TABLE IF NOT EXISTS ingest_chunks (chunk_id TEXT PRIMARY KEY, \
     document_id TEXT NOT NULL, version TEXT NOT NULL, idx {int} NOT NULL, \
     chunk_hash TEXT NOT NULL, text TEXT NOT NULL, vector {bytes} NOT NULL)",
    "CREATE INDEX IF NOT EXISTS ingest_chunks_version ON ingest_chunks (document_id, version)",
    "CREATE TABLE IF NOT EXISTS ingest_runs (turn_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, \
     document_id TEXT NOT NULL, version TEXT NOT NULL, name TEXT NOT NULL, \
     chunks {int} NOT NULL, created_at_ms {int} NOT NULL)",
    "CREATE INDEX IF NOT EXISTS ingest_runs_tenant ON ingest_runs (tenant, created_at_ms)",
];

/// [`SCHEMA`] with `int` and `bytes` the dialect's types.
fn schema(int: &'static str, bytes: &'static str) -> impl Iterator<Item = String> {
    SCHEMA
        .iter()
        .map(move |s| s.replace("{int}", int).replace("{bytes}", bytes))
}

/// An uploaded document's bytes, kept under its content hash.
#[derive(Clone, Debug)]
pub struct Blob {
    /// The first upload's name.
    pub name: String,
    /// What the bytes are.
    pub media_type: MediaType,
    /// The bytes.
    pub content: Vec<u8>,
}

/// A chunk row to write.
#[derive(Clone, Debug)]
pub(crate) struct ChunkRow {
    pub(crate) chunk_id: String,
    pub(crate) index: i64,
    pub(crate) hash: String,
    pub(crate) text: String,
    pub(crate) vector: Vec<u8>,
}

/// A document as its row shows it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, sqlx::FromRow)]
pub struct DocumentView {
    /// The document.
    pub document_id: String,
    /// Its tenant.
    pub tenant: String,
    /// Its name.
    pub name: String,
    /// The version queries read.
    pub current_version: String,
    /// How many versions were published (the current one's number).
    pub version_no: i64,
    /// The current version's chunks.
    pub chunks: i64,
}

/// A current chunk, as a search reads it.
#[derive(Clone, Debug, sqlx::FromRow)]
pub(crate) struct CurrentChunk {
    pub(crate) document_id: String,
    pub(crate) name: String,
    pub(crate) version: String,
    #[sqlx(rename = "idx")]
    pub(crate) index: i64,
    pub(crate) text: String,
    pub(crate) vector: Vec<u8>,
}

/// What a reconcile found.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Reconciliation {
    /// Chunks of a document's current version.
    pub current_chunks: i64,
    /// Chunks of versions superseded within the grace (queries may still
    /// read them).
    pub superseded_in_grace: i64,
    /// Chunks of versions superseded before the grace: the cleaner's work.
    pub superseded_past_grace: i64,
    /// Chunks of no published version: an ingestion running, or one that
    /// failed and will be retried.
    pub unpublished: i64,
    /// Published versions whose stored chunks are not their recorded count.
    pub count_mismatches: i64,
}

/// The milliseconds since the epoch.
pub(crate) fn now_ms() -> i64 {
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    i64::try_from(since.as_millis()).unwrap_or(i64::MAX)
}

fn db(error: sqlx::Error) -> IngestError {
    IngestError::Store(error.to_string())
}

impl Pool {
    /// Opens the engine's database at `url` again and creates the tables.
    pub(crate) async fn open(url: &str) -> Result<Self, IngestError> {
        let pool = if url.starts_with("sqlite:") {
            let options = SqliteConnectOptions::from_str(url)
                .map_err(|e| IngestError::Invalid(format!("bad store URL: {e}")))?
                .journal_mode(SqliteJournalMode::Wal)
                .busy_timeout(BUSY_TIMEOUT)
                .create_if_missing(true);
            Pool::Sqlite(
                SqlitePoolOptions::new()
                    .max_connections(CONNECTIONS)
                    .connect_with(options)
                    .await
                    .map_err(db)?,
            )
        } else if url.starts_with("postgres:") || url.starts_with("postgresql:") {
            Pool::Postgres(
                sqlx::postgres::PgPoolOptions::new()
                    .max_connections(CONNECTIONS)
                    .connect(url)
                    .await
                    .map_err(db)?,
            )
        } else {
            return Err(IngestError::Invalid(
                "ingestion runs on a sqlite: or postgres: store".into(),
            ));
        };
        match &pool {
            // SQLite's writer lock serialises two nodes creating the tables.
            Pool::Sqlite(p) => {
                for statement in schema("INTEGER", "BLOB") {
                    sqlx::query(&statement).execute(p).await.map_err(db)?;
                }
            }
            // PostgreSQL's `IF NOT EXISTS` races between two nodes (both
            // insert the type row); one transaction under an advisory lock
            // orders them.
            Pool::Postgres(p) => {
                let mut tx = p.begin().await.map_err(db)?;
                sqlx::query("SELECT pg_advisory_xact_lock($1)")
                    .bind(SCHEMA_LOCK_KEY)
                    .execute(&mut *tx)
                    .await
                    .map_err(db)?;
                for statement in schema("BIGINT", "BYTEA") {
                    sqlx::query(&statement)
                        .execute(&mut *tx)
                        .await
                        .map_err(db)?;
                }
                tx.commit().await.map_err(db)?;
            }
        }
        Ok(pool)
    }

    /// Keeps an upload's bytes under its hash (the first upload's name wins).
    pub(crate) async fn save_blob(
        &self,
        tenant: &str,
        sha: &str,
        blob: &Blob,
    ) -> Result<(), IngestError> {
        let media = serde_json::to_value(blob.media_type)
            .map_err(|e| IngestError::Corrupt(e.to_string()))?;
        let media = media.as_str().unwrap_or("text").to_owned();
        on_pool!(self, p => sqlx::query(
            "INSERT INTO ingest_blobs (tenant, sha256, name, media_type, content, created_at_ms) \
             VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (tenant, sha256) DO NOTHING",
        )
        .bind(tenant)
        .bind(sha)
        .bind(&blob.name)
        .bind(&media)
        .bind(&blob.content)
        .bind(now_ms())
        .execute(p)
        .await
        .map(|_| ()))
        .map_err(db)
    }

    /// The bytes kept under `sha`.
    pub(crate) async fn blob(&self, tenant: &str, sha: &str) -> Result<Option<Blob>, IngestError> {
        let row = on_pool!(self, p => sqlx::query(
            "SELECT name, media_type, content FROM ingest_blobs WHERE tenant = $1 AND sha256 = $2",
        )
        .bind(tenant)
        .bind(sha)
        .fetch_optional(p)
        .await
        .and_then(|row| row.map(|row| Ok::<_, sqlx::Error>((
            row.try_get::<String, _>("name")?,
            row.try_get::<String, _>("media_type")?,
            row.try_get::<Vec<u8>, _>("content")?,
        ))).transpose()))
        .map_err(db)?;
        row.map(|(name, media, content)| {
            let media_type = serde_json::from_value(serde_json::Value::String(media.clone()))
                .map_err(|_| IngestError::Corrupt(format!("stored media type {media:?}")))?;
            Ok(Blob {
                name,
                media_type,
                content,
            })
        })
        .transpose()
    }

    /// A document's row.
    pub(crate) async fn document(
        &self,
        document_id: &str,
    ) -> Result<Option<DocumentView>, IngestError> {
        on_pool!(self, p => sqlx::query_as::<_, DocumentView>(
            "SELECT document_id, tenant, name, current_version, version_no, chunks \
             FROM ingest_documents WHERE document_id = $1",
        )
        .bind(document_id)
        .fetch_optional(p)
        .await)
        .map_err(db)
    }

    /// The chunks of the tenant's current versions, in one statement: a
    /// query reads one committed snapshot, so every document in it is all
    /// of one version, never a mix and never a gap.
    pub(crate) async fn current_chunks(
        &self,
        tenant: &str,
        limit: i64,
    ) -> Result<Vec<CurrentChunk>, IngestError> {
        on_pool!(self, p => sqlx::query_as::<_, CurrentChunk>(
            "SELECT c.document_id, d.name, c.version, c.idx, c.text, c.vector \
             FROM ingest_documents d JOIN ingest_chunks c \
               ON c.document_id = d.document_id AND c.version = d.current_version \
             WHERE d.tenant = $1 ORDER BY c.document_id, c.idx LIMIT $2",
        )
        .bind(tenant)
        .bind(limit)
        .fetch_all(p)
        .await)
        .map_err(db)
    }

    /// Which of `ids` are stored.
    pub(crate) async fn existing_chunks(
        &self,
        ids: &[String],
    ) -> Result<std::collections::HashSet<String>, IngestError> {
        if ids.is_empty() {
            return Ok(std::collections::HashSet::new());
        }
        let placeholders: Vec<String> = (1..=ids.len()).map(|i| format!("${i}")).collect();
        let sql = format!(
            "SELECT chunk_id FROM ingest_chunks WHERE chunk_id IN ({})",
            placeholders.join(", ")
        );
        on_pool!(self, p => {
            let mut query = sqlx::query_scalar::<_, String>(&sql);
            for id in ids {
                query = query.bind(id);
            }
            query.fetch_all(p).await
        })
        .map(|found| found.into_iter().collect())
        .map_err(db)
    }

    /// The chunks of the tenant's current versions, other documents than
    /// `document_id`.
    pub(crate) async fn tenant_chunks(
        &self,
        tenant: &str,
        document_id: &str,
    ) -> Result<i64, IngestError> {
        on_pool!(self, p => sqlx::query_scalar(
            "SELECT CAST(COALESCE(SUM(chunks), 0) AS BIGINT) FROM ingest_documents \
             WHERE tenant = $1 AND document_id <> $2",
        )
        .bind(tenant)
        .bind(document_id)
        .fetch_one(p)
        .await)
        .map_err(db)
    }

    /// Counts every chunk by what it belongs to; writes nothing.
    pub(crate) async fn reconcile(&self, grace_ms: i64) -> Result<Reconciliation, IngestError> {
        let cutoff = now_ms() - grace_ms;
        let row = on_pool!(self, p => sqlx::query(
            "SELECT \
               (SELECT COUNT(*) FROM ingest_chunks c JOIN ingest_documents d \
                  ON d.document_id = c.document_id AND d.current_version = c.version) AS current_chunks, \
               (SELECT COUNT(*) FROM ingest_chunks c JOIN ingest_versions v \
                  ON v.document_id = c.document_id AND v.version = c.version \
                  WHERE v.superseded_at_ms IS NOT NULL AND v.superseded_at_ms >= $1) AS in_grace, \
               (SELECT COUNT(*) FROM ingest_chunks c JOIN ingest_versions v \
                  ON v.document_id = c.document_id AND v.version = c.version \
                  WHERE v.superseded_at_ms IS NOT NULL AND v.superseded_at_ms < $1) AS past_grace, \
               (SELECT COUNT(*) FROM ingest_chunks c WHERE NOT EXISTS (SELECT 1 FROM ingest_versions v \
                  WHERE v.document_id = c.document_id AND v.version = c.version)) AS unpublished, \
               (SELECT COUNT(*) FROM ingest_versions v WHERE v.chunks <> (SELECT COUNT(*) \
                  FROM ingest_chunks c WHERE c.document_id = v.document_id AND c.version = v.version) \
                  AND v.superseded_at_ms IS NULL) AS mismatches",
        )
        .bind(cutoff)
        .fetch_one(p)
        .await
        .and_then(|row| Ok(Reconciliation {
            current_chunks: row.try_get("current_chunks")?,
            superseded_in_grace: row.try_get("in_grace")?,
            superseded_past_grace: row.try_get("past_grace")?,
            unpublished: row.try_get("unpublished")?,
            count_mismatches: row.try_get("mismatches")?,
        })))
        .map_err(db)?;
        Ok(row)
    }

    /// Versions superseded before the grace, with chunks left: the
    /// cleaner's work list, at most `limit`.
    pub(crate) async fn superseded(
        &self,
        grace_ms: i64,
        limit: i64,
    ) -> Result<Vec<(String, String, String, i64)>, IngestError> {
        let cutoff = now_ms() - grace_ms;
        on_pool!(self, p => sqlx::query(
            "SELECT v.document_id, d.tenant, v.version, v.superseded_at_ms FROM ingest_versions v \
             JOIN ingest_documents d ON d.document_id = v.document_id \
             WHERE v.superseded_at_ms IS NOT NULL AND v.superseded_at_ms < $1 \
               AND EXISTS (SELECT 1 FROM ingest_chunks c \
                           WHERE c.document_id = v.document_id AND c.version = v.version) \
             ORDER BY v.superseded_at_ms LIMIT $2",
        )
        .bind(cutoff)
        .bind(limit)
        .fetch_all(p)
        .await
        .and_then(|rows| rows.into_iter().map(|row| Ok((
            row.try_get("document_id")?,
            row.try_get("tenant")?,
            row.try_get("version")?,
            row.try_get("superseded_at_ms")?,
        ))).collect::<Result<Vec<_>, sqlx::Error>>()))
        .map_err(db)
    }
}

/// An ingestion's turn as the listing reads it.
#[derive(Clone, Debug, sqlx::FromRow)]
pub(crate) struct RunRow {
    pub(crate) turn_id: String,
    pub(crate) tenant: String,
    pub(crate) document_id: String,
    pub(crate) version: String,
    pub(crate) name: String,
    pub(crate) chunks: i64,
    pub(crate) stored: i64,
    /// The version's number once published.
    pub(crate) version_no: Option<i64>,
}

impl Pool {
    /// Records which turn ingests `version` (once per turn: a takeover or a
    /// restart keeps the turn id).
    pub(crate) async fn record_run(
        &self,
        turn_id: &str,
        tenant: &str,
        document_id: &str,
        version: &str,
        name: &str,
        chunks: i64,
    ) -> Result<(), IngestError> {
        on_pool!(self, p => sqlx::query(
            "INSERT INTO ingest_runs (turn_id, tenant, document_id, version, name, chunks, \
               created_at_ms) VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (turn_id) DO NOTHING",
        )
        .bind(turn_id)
        .bind(tenant)
        .bind(document_id)
        .bind(version)
        .bind(name)
        .bind(chunks)
        .bind(now_ms())
        .execute(p)
        .await
        .map(|_| ()))
        .map_err(db)
    }

    /// The latest `limit` ingestions of `tenant` (of every tenant for
    /// `None`), newest first, with the chunks of their version stored so
    /// far and the version's number once published.
    pub(crate) async fn runs(
        &self,
        tenant: Option<&str>,
        limit: i64,
    ) -> Result<Vec<RunRow>, IngestError> {
        on_pool!(self, p => sqlx::query_as::<_, RunRow>(
            "SELECT r.turn_id, r.tenant, r.document_id, r.version, r.name, r.chunks, \
               (SELECT COUNT(*) FROM ingest_chunks c \
                WHERE c.document_id = r.document_id AND c.version = r.version) AS stored, \
               (SELECT v.version_no FROM ingest_versions v \
                WHERE v.document_id = r.document_id AND v.version = r.version) AS version_no \
             FROM ingest_runs r WHERE ($1 IS NULL OR r.tenant = $1) \
             ORDER BY r.created_at_ms DESC, r.turn_id LIMIT $2",
        )
        .bind(tenant)
        .bind(limit)
        .fetch_all(p)
        .await)
        .map_err(db)
    }
}

/// Upserts a batch's chunks by id inside the step's transaction: a chunk
/// already written (a batch run again after a crash) is left as it is.
pub(crate) async fn upsert_chunks(
    tx: SqlTx<'_>,
    document_id: &str,
    version: &str,
    rows: &[ChunkRow],
) -> Result<u64, IngestError> {
    let mut added = 0;
    on_tx!(tx, conn => {
        for row in rows {
            added += sqlx::query(
                "INSERT INTO ingest_chunks (chunk_id, document_id, version, idx, chunk_hash, text, vector) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (chunk_id) DO NOTHING",
            )
            .bind(&row.chunk_id)
            .bind(document_id)
            .bind(version)
            .bind(row.index)
            .bind(&row.hash)
            .bind(&row.text)
            .bind(&row.vector)
            .execute(&mut *conn)
            .await
            .map_err(db)?
            .rows_affected();
        }
    });
    Ok(added)
}

/// What a publish switched.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Published {
    pub(crate) version_no: i64,
}

/// The fenced switch: makes `version` the document's current version,
/// inside the publish step's transaction. The engine has already checked
/// the step's lease; the document row checks the fence again (a switch
/// only moves to a newer grant of the document's session), so a stale
/// updater can never switch back. The version must hold exactly `chunks`
/// chunks, so a query never sees a version with a gap.
pub(crate) async fn publish(
    tx: SqlTx<'_>,
    document: &DocumentView,
    fence: i64,
) -> Result<Published, IngestError> {
    let now = now_ms();
    let version_no;
    on_tx!(tx, conn => {
        let stored: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM ingest_chunks WHERE document_id = $1 AND version = $2",
        )
        .bind(&document.document_id)
        .bind(&document.current_version)
        .fetch_one(&mut *conn)
        .await
        .map_err(db)?;
        if stored != document.chunks {
            return Err(IngestError::Corrupt(format!(
                "version {} holds {stored} chunks, not {}",
                document.current_version, document.chunks
            )));
        }
        let previous: Option<(String, i64, i64)> = sqlx::query_as(
            "SELECT current_version, version_no, fence FROM ingest_documents WHERE document_id = $1",
        )
        .bind(&document.document_id)
        .fetch_optional(&mut *conn)
        .await
        .map_err(db)?;
        version_no = match &previous {
            Some((_, _, stored_fence)) if *stored_fence >= fence => {
                return Err(IngestError::Stale(format!(
                    "document {} was switched under fence {stored_fence}; this step holds {fence}",
                    document.document_id
                )))
            }
            Some((current, number, _)) if *current == document.current_version => *number,
            Some((_, number, _)) => number + 1,
            None => 1,
        };
        if let Some((old, _, _)) = &previous {
            if *old != document.current_version {
                sqlx::query(
                    "UPDATE ingest_versions SET superseded_at_ms = $3 \
                     WHERE document_id = $1 AND version = $2 AND superseded_at_ms IS NULL",
                )
                .bind(&document.document_id)
                .bind(old)
                .bind(now)
                .execute(&mut *conn)
                .await
                .map_err(db)?;
            }
        }
        let switched = sqlx::query(
            "INSERT INTO ingest_documents (document_id, tenant, name, current_version, version_no, \
               chunks, fence, updated_at_ms) VALUES ($1, $2, $3, $4, $5, $6, $7, $8) \
             ON CONFLICT (document_id) DO UPDATE SET current_version = excluded.current_version, \
               version_no = excluded.version_no, chunks = excluded.chunks, fence = excluded.fence, \
               name = excluded.name, updated_at_ms = excluded.updated_at_ms \
             WHERE ingest_documents.fence < excluded.fence \
               AND ingest_documents.tenant = excluded.tenant",
        )
        .bind(&document.document_id)
        .bind(&document.tenant)
        .bind(&document.name)
        .bind(&document.current_version)
        .bind(version_no)
        .bind(document.chunks)
        .bind(fence)
        .bind(now)
        .execute(&mut *conn)
        .await
        .map_err(db)?
        .rows_affected();
        if switched != 1 {
            return Err(IngestError::Stale(format!(
                "document {} has a newer switch than fence {fence}, or another tenant",
                document.document_id
            )));
        }
        sqlx::query(
            "INSERT INTO ingest_versions (document_id, version, version_no, chunks, fence, \
               published_at_ms, superseded_at_ms) VALUES ($1, $2, $3, $4, $5, $6, NULL) \
             ON CONFLICT (document_id, version) DO UPDATE SET version_no = excluded.version_no, \
               chunks = excluded.chunks, fence = excluded.fence, \
               published_at_ms = excluded.published_at_ms, superseded_at_ms = NULL",
        )
        .bind(&document.document_id)
        .bind(&document.current_version)
        .bind(version_no)
        .bind(document.chunks)
        .bind(fence)
        .bind(now)
        .execute(&mut *conn)
        .await
        .map_err(db)?;
    });
    Ok(Published { version_no })
}

/// Deletes a document inside its delete step, fenced like a switch: the
/// document row stays as a tombstone (no current version, its version
/// count kept, so a later upload of the same file is a new request), every
/// version is marked superseded, and every chunk is removed, in one
/// transaction, so a query sees the whole document or none of it. The
/// chunks deleted.
pub(crate) async fn delete_document(
    tx: SqlTx<'_>,
    document_id: &str,
    tenant: &str,
    fence: i64,
) -> Result<u64, IngestError> {
    let now = now_ms();
    let deleted;
    on_tx!(tx, conn => {
        let switched = sqlx::query(
            "UPDATE ingest_documents SET current_version = '', chunks = 0, fence = $3, \
               updated_at_ms = $4 \
             WHERE document_id = $1 AND tenant = $2 AND fence < $3",
        )
        .bind(document_id)
        .bind(tenant)
        .bind(fence)
        .bind(now)
        .execute(&mut *conn)
        .await
        .map_err(db)?
        .rows_affected();
        if switched != 1 {
            return Err(IngestError::Stale(format!(
                "document {document_id} has a newer switch than fence {fence}, or another tenant"
            )));
        }
        sqlx::query(
            "UPDATE ingest_versions SET superseded_at_ms = $2 \
             WHERE document_id = $1 AND superseded_at_ms IS NULL",
        )
        .bind(document_id)
        .bind(now)
        .execute(&mut *conn)
        .await
        .map_err(db)?;
        deleted = sqlx::query("DELETE FROM ingest_chunks WHERE document_id = $1")
            .bind(document_id)
            .execute(&mut *conn)
            .await
            .map_err(db)?
            .rows_affected();
    });
    Ok(deleted)
}

/// Deletes a superseded version's chunks inside the cleaner's step, if the
/// version is still superseded (a later update may have made it current
/// again); the chunks deleted.
pub(crate) async fn delete_version(
    tx: SqlTx<'_>,
    document_id: &str,
    version: &str,
) -> Result<u64, IngestError> {
    let deleted;
    on_tx!(tx, conn => {
        deleted = sqlx::query(
            "DELETE FROM ingest_chunks WHERE document_id = $1 AND version = $2 \
             AND EXISTS (SELECT 1 FROM ingest_versions v WHERE v.document_id = $1 \
                         AND v.version = $2 AND v.superseded_at_ms IS NOT NULL) \
             AND NOT EXISTS (SELECT 1 FROM ingest_documents d WHERE d.document_id = $1 \
                             AND d.current_version = $2)",
        )
        .bind(document_id)
        .bind(version)
        .execute(&mut *conn)
        .await
        .map_err(db)?
        .rows_affected();
    });
    Ok(deleted)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    async fn pool(dir: &tempfile::TempDir) -> sqlx::SqlitePool {
        let url = format!("sqlite://{}", dir.path().join("ingest.db").display());
        match Pool::open(&url).await.unwrap() {
            Pool::Sqlite(pool) => pool,
            Pool::Postgres(_) => unreachable!("a sqlite URL"),
        }
    }

    fn version(version: &str, chunks: i64) -> DocumentView {
        DocumentView {
            document_id: "doc_1".into(),
            tenant: "t".into(),
            name: "n".into(),
            current_version: version.into(),
            version_no: 0,
            chunks,
        }
    }

    async fn write_chunks(pool: &sqlx::SqlitePool, version: &str, chunks: i64) {
        let mut conn = pool.acquire().await.unwrap();
        let rows: Vec<ChunkRow> = (0..chunks)
            .map(|i| ChunkRow {
                chunk_id: format!("{version}-{i}"),
                index: i,
                hash: "h".into(),
                text: "t".into(),
                vector: vec![0; 4],
            })
            .collect();
        upsert_chunks(SqlTx::Sqlite(&mut conn), "doc_1", version, &rows)
            .await
            .unwrap();
    }

    /// The switch moves only to a newer grant of the document's session: a
    /// stale updater (an older fence) is refused and switches nothing back,
    /// and a version missing chunks is never made current.
    #[tokio::test]
    async fn a_stale_or_incomplete_switch_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let pool = pool(&dir).await;
        write_chunks(&pool, "old", 2).await;
        write_chunks(&pool, "new", 3).await;
        let mut conn = pool.acquire().await.unwrap();
        publish(SqlTx::Sqlite(&mut conn), &version("old", 2), 5)
            .await
            .unwrap();
        publish(SqlTx::Sqlite(&mut conn), &version("new", 3), 9)
            .await
            .unwrap();
        let stale = publish(SqlTx::Sqlite(&mut conn), &version("old", 2), 7).await;
        assert!(matches!(stale, Err(IngestError::Stale(_))), "{stale:?}");
        let gap = publish(SqlTx::Sqlite(&mut conn), &version("new", 4), 12).await;
        assert!(matches!(gap, Err(IngestError::Corrupt(_))), "{gap:?}");
        let current: (String, i64) = sqlx::query_as(
            "SELECT current_version, version_no FROM ingest_documents WHERE document_id = 'doc_1'",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(current, ("new".to_owned(), 2));
    }
}
