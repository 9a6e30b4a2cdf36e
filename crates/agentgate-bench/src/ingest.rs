//! The ingestion row (seed 003): chunks/s of `agentgate-ingest` against a
//! raw loop that parses, chunks, embeds and inserts the same shape of
//! documents without any coordination (no lease, no tool record, one plain
//! transaction of inserts per batch), in the same run, on the same store,
//! with the same offline embedder. MySQL has no ingestion yet: no row.

use std::sync::Arc;

use agentgate::Gate;
use agentgate_ingest::chunk::{chunk_id, chunks, parse};
use agentgate_ingest::embed::to_bytes;
use agentgate_ingest::limits::EMBED_BATCH;
use agentgate_ingest::{Embedder, Ingestor, MediaType, OfflineEmbedder, Upload};
use serde::Serialize;
use tokio::sync::Mutex;
use tokio::time::Instant;

use crate::error::{BenchError, Result};
use crate::raw::SqlPool;

/// Paragraphs per benched document (about 48 chunks: three batches).
const PARAGRAPHS: usize = 240;

/// What the ingestion row measured.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Ingestion {
    /// Documents each loop ingested.
    pub documents: usize,
    /// Chunks per document.
    pub chunks_per_document: i64,
    /// Chunks/s through `agentgate-ingest`.
    pub chunks_per_s: f64,
    /// Chunks/s of the raw loop.
    pub raw_chunks_per_s: f64,
    /// `chunks_per_s` ÷ `raw_chunks_per_s`.
    pub ratio: f64,
    /// Texts the engine's embedder embedded (= chunks: each paid once).
    pub texts_embedded: u64,
}

fn document(seed: &str, n: usize) -> Vec<u8> {
    (0..PARAGRAPHS)
        .map(|i| {
            format!(
                "{seed} document {n} paragraph {i}: an expense report line, a taxi from the \
                 airport to the hotel, paid by card, refundable under the travel policy."
            )
        })
        .collect::<Vec<_>>()
        .join("\n\n")
        .into_bytes()
}

/// Runs both loops over `documents` documents with `clients` workers each.
///
/// # Errors
/// Any failure of an ingestion or of the raw loop's statements.
pub(crate) async fn measure(
    gate: &Gate,
    store_url: &str,
    pool: &SqlPool,
    documents: usize,
    clients: usize,
) -> Result<Option<Ingestion>> {
    if documents == 0 || matches!(pool, SqlPool::MySql(_)) {
        return Ok(None);
    }
    let embedder = Arc::new(OfflineEmbedder::new());
    let ingestor = Ingestor::open(gate.clone(), store_url, embedder.clone())
        .await
        .map_err(|e| BenchError::unexpected(format!("ingestion: {e}")))?;
    let queue = Arc::new(Mutex::new((0..documents).collect::<Vec<_>>()));
    let started = Instant::now();
    let workers: Vec<_> = (0..clients)
        .map(|_| {
            let (ingestor, queue) = (ingestor.clone(), queue.clone());
            tokio::spawn(async move {
                let mut chunks = 0;
                while let Some(n) = queue.lock().await.pop() {
                    let upload = Upload {
                        tenant: "bench".to_owned(),
                        name: format!("report-{n}.txt"),
                        media_type: MediaType::Text,
                        content: document("engine", n),
                        document_id: None,
                    };
                    chunks += ingestor.ingest(&upload).await?.chunks;
                }
                Ok::<i64, agentgate_ingest::IngestError>(chunks)
            })
        })
        .collect();
    let mut engine_chunks = 0;
    for worker in workers {
        engine_chunks += worker
            .await
            .map_err(|e| BenchError::unexpected(format!("an ingestion worker: {e}")))?
            .map_err(|e| BenchError::unexpected(format!("ingestion: {e}")))?;
    }
    let engine_s = started.elapsed().as_secs_f64();

    create_raw_table(pool).await?;
    let raw_embedder = Arc::new(OfflineEmbedder::new());
    let queue = Arc::new(Mutex::new((0..documents).collect::<Vec<_>>()));
    let started = Instant::now();
    let workers: Vec<_> = (0..clients)
        .map(|_| {
            let (pool, queue, embedder) = (pool.clone(), queue.clone(), raw_embedder.clone());
            tokio::spawn(async move {
                let mut stored = 0usize;
                while let Some(n) = queue.lock().await.pop() {
                    stored += raw_ingest(&pool, embedder.as_ref(), n).await?;
                }
                Ok::<usize, BenchError>(stored)
            })
        })
        .collect();
    let mut raw_chunks = 0;
    for worker in workers {
        raw_chunks += worker
            .await
            .map_err(|e| BenchError::unexpected(format!("a raw ingestion worker: {e}")))??;
    }
    let raw_s = started.elapsed().as_secs_f64();
    let per_s = |chunks: f64, s: f64| if s > 0.0 { chunks / s } else { 0.0 };
    let chunks_per_s = per_s(engine_chunks as f64, engine_s);
    let raw_chunks_per_s = per_s(raw_chunks as f64, raw_s);
    Ok(Some(Ingestion {
        documents,
        chunks_per_document: engine_chunks / i64::try_from(documents).unwrap_or(i64::MAX),
        chunks_per_s,
        raw_chunks_per_s,
        ratio: if raw_chunks_per_s > 0.0 {
            chunks_per_s / raw_chunks_per_s
        } else {
            0.0
        },
        texts_embedded: embedder.texts(),
    }))
}

async fn create_raw_table(pool: &SqlPool) -> Result<()> {
    let ddl = |bytes: &str| {
        format!(
            "CREATE TABLE IF NOT EXISTS bench_raw_chunks (chunk_id TEXT PRIMARY KEY, \
             document TEXT NOT NULL, idx BIGINT NOT NULL, text TEXT NOT NULL, vector {bytes} NOT NULL)"
        )
    };
    match pool {
        SqlPool::Sqlite(p) => sqlx::query(&ddl("BLOB")).execute(p).await.map(|_| ()),
        SqlPool::Postgres(p) => sqlx::query(&ddl("BYTEA")).execute(p).await.map(|_| ()),
        SqlPool::MySql(_) => Ok(()),
    }
    .map_err(BenchError::from)
}

/// One document the raw way: parse, chunk, and per batch one embedding
/// call and one transaction of plain inserts; the chunks stored.
async fn raw_ingest(pool: &SqlPool, embedder: &OfflineEmbedder, n: usize) -> Result<usize> {
    let document_id = format!("raw-{n}");
    let text = parse(&document("raw", n), MediaType::Text)
        .map_err(|e| BenchError::unexpected(e.to_string()))?;
    let pieces = chunks(&text).map_err(|e| BenchError::unexpected(e.to_string()))?;
    for group in pieces.chunks(EMBED_BATCH) {
        let texts: Vec<String> = group.iter().map(|c| c.text.clone()).collect();
        let vectors = embedder
            .embed(&texts)
            .await
            .map_err(|e| BenchError::unexpected(e.to_string()))?;
        let insert = "INSERT INTO bench_raw_chunks (chunk_id, document, idx, text, vector) \
                      VALUES ($1, $2, $3, $4, $5)";
        macro_rules! batch {
            ($p:expr) => {{
                let mut tx = $p.begin().await?;
                for (chunk, vector) in group.iter().zip(&vectors) {
                    sqlx::query(insert)
                        .bind(chunk_id(&document_id, "v1", chunk.index, &chunk.hash))
                        .bind(&document_id)
                        .bind(i64::try_from(chunk.index).unwrap_or(i64::MAX))
                        .bind(&chunk.text)
                        .bind(to_bytes(vector))
                        .execute(&mut *tx)
                        .await?;
                }
                tx.commit().await?;
            }};
        }
        match pool {
            SqlPool::Sqlite(p) => batch!(p),
            SqlPool::Postgres(p) => batch!(p),
            SqlPool::MySql(_) => {}
        }
    }
    Ok(pieces.len())
}
