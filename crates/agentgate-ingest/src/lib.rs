//! Seed 003's document ingestion on agentgate's own primitives: an upload
//! is ingested once per content, resumes after a crash without paying the
//! embedding API twice for a stored batch, and switches a document's
//! version fenced, so a query sees the whole old version or the whole new
//! one.
//!
//! No new engine primitive was needed; each part of the seed's design maps
//! onto one the engine already has:
//!
//! | seed 003 | here |
//! |---|---|
//! | Redis lock per tenant + content hash, 60 s TTL, no fencing | a turn: user = tenant, session = `ingest:<document>`, request id = `v:<sha256>`; the lease is renewed and fenced |
//! | "does this document exist?" check, then insert | the begin's idempotency: a repeat replays the stored result, or gets `request_in_flight` while it runs (an upload waits for it, bounded) |
//! | embedding calls | one tool execution per batch of [`limits::EMBED_BATCH`] chunks; a takeover re-embeds only the batches whose outcome is unknown |
//! | check-then-insert vector writes | chunk ids derived from (document, version, index, chunk hash), upserted inside the batch's completion transaction |
//! | unfenced blue-green switch | the `publish` tool step switches the current version in its completion transaction, checked by the engine's fence and by the document row's |
//! | duplicate cleaner | [`Ingestor::reconcile`] counts chunks by what they belong to (nothing is a duplicate by construction); [`Ingestor::clean`] deletes superseded versions after a grace, each as a fenced turn |
//!
//! Text, Markdown (`pulldown-cmark`) and PDF (`pdf-extract`) are parsed;
//! a PDF in a blocking thread bounded by [`limits::MAX_PARSE_TIME`].
//!
//! The vector search is exact: the tenant's current chunks (at most
//! [`limits::MAX_SEARCH_CHUNKS`]) are read in one statement and scored by
//! cosine in process. Tested on SQLite and PostgreSQL.
#![forbid(unsafe_code)]

pub mod chunk;
mod db;
pub mod embed;
pub mod isolate;
pub mod limits;

use std::sync::Arc;
use std::time::Duration;

use agentgate::store::BoxFuture;
use agentgate::{Begun, BoxError, ErrorKind, Gate, OrphanFilter, ToolStep, Turn, TurnState};
use serde_json::{json, Value};

pub use chunk::MediaType;
pub use db::{Blob, DocumentView, Reconciliation};
pub use embed::{Embedder, HttpEmbedder, OfflineEmbedder};

use crate::chunk::{chunk_id, chunks, document_id, parse, sha256_hex};
use crate::db::{ChunkRow, Pool};
use crate::limits::{
    EMBED_BATCH, EMBED_RETRIES, EMBED_RETRY_PAUSE, FIRST_WAIT_STEP, MAX_CONCURRENT_PARSES,
    MAX_DOCUMENT_BYTES, MAX_INGEST_WAIT, MAX_NAME_BYTES, MAX_PARSE_TIME, MAX_QUERY_BYTES,
    MAX_RECOVER_PER_PASS, MAX_SEARCH_CHUNKS, MAX_SEARCH_HITS, MAX_TENANT_BYTES, MAX_WAIT_STEP,
    OLD_VERSION_GRACE,
};

/// What went wrong with an ingestion.
#[derive(Debug, thiserror::Error)]
pub enum IngestError {
    /// The upload or the query is not acceptable.
    #[error("invalid: {0}")]
    Invalid(String),
    /// The same content (or another update of the document) is still being
    /// ingested after the bounded wait; ask again after `retry_after`.
    #[error("processing: ask again in {retry_after:?}")]
    Processing {
        /// When to ask again.
        retry_after: Duration,
    },
    /// The ingestion failed for good; its stored error.
    #[error("failed: {0}")]
    Failed(Value),
    /// A step of a stale holder was refused (its lease was taken over).
    #[error("stale: {0}")]
    Stale(String),
    /// The embedder failed.
    #[error("embedding: {0}")]
    Embedding(String),
    /// The engine refused or failed.
    #[error(transparent)]
    Engine(#[from] agentgate::Error),
    /// The database failed.
    #[error("store: {0}")]
    Store(String),
    /// A stored value the schema does not allow.
    #[error("corrupt: {0}")]
    Corrupt(String),
}

/// One upload.
#[derive(Clone, Debug)]
pub struct Upload {
    /// The tenant (the turn's user).
    pub tenant: String,
    /// The file's name.
    pub name: String,
    /// What the bytes are.
    pub media_type: MediaType,
    /// The bytes.
    pub content: Vec<u8>,
    /// The document this upload updates; `None` for a first upload, whose
    /// document id is derived from the tenant and the content.
    pub document_id: Option<String>,
}

/// An ingestion's outcome: what every upload of the same content gets.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Ingested {
    /// The document.
    pub document_id: String,
    /// The version (the content's sha256).
    pub version: String,
    /// The version's number among the document's published versions.
    pub version_no: i64,
    /// Its chunks.
    pub chunks: i64,
}

/// An upload checked by [`Ingestor::accept`].
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Accepted {
    /// The document it ingests into.
    pub document_id: String,
    /// The version (the content's sha256).
    pub version: String,
    /// Its chunks.
    pub chunks: i64,
}

/// One ingestion finished by [`Ingestor::recover`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Recovery {
    /// Its outcome.
    pub ingested: Ingested,
    /// Batches the dead holder had stored (not embedded again).
    pub batches_stored_before: usize,
    /// Batches it had claimed with no recorded outcome (embedded again).
    pub batches_unknown: usize,
}

/// Where an ingestion is, as a person should see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum IngestionState {
    /// Its turn runs (or its holder died and recovery will finish it).
    Processing,
    /// Published: queries read this version.
    Indexed,
    /// Published once, replaced by a later version.
    Superseded,
    /// Its document was deleted.
    Deleted,
    /// Failed; an upload of the same file again retries it, unless the
    /// file itself was refused.
    Failed,
}

/// One ingestion in a tenant's list.
#[derive(Clone, Debug, serde::Serialize)]
pub struct IngestionView {
    /// The ingestion's turn.
    pub turn_id: String,
    /// The tenant (the turn's user).
    pub tenant: String,
    /// The document.
    pub document_id: String,
    /// The upload's name.
    pub name: String,
    /// The version it ingests.
    pub version: String,
    /// The version's number among the document's versions, once published.
    pub version_no: Option<i64>,
    /// Where it is, from the engine's record of its turn.
    pub state: IngestionState,
    /// Chunks of its version in the index now.
    pub chunks_stored: i64,
    /// Chunks of its version.
    pub chunks: i64,
    /// The stored error of a failed one.
    pub error: Option<Value>,
}

/// One search hit: a chunk of a current version, with its citation.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Hit {
    /// The document.
    pub document_id: String,
    /// Its name.
    pub name: String,
    /// The version the chunk belongs to.
    pub version: String,
    /// The chunk's position in it.
    pub chunk_index: i64,
    /// Its text.
    pub text: String,
    /// The cosine of the query and the chunk.
    pub score: f32,
}

/// Document ingestion over one engine and its database.
#[derive(Clone, Debug)]
pub struct Ingestor {
    gate: Gate,
    pool: Pool,
    embedder: Arc<dyn Embedder>,
    /// [`MAX_CONCURRENT_PARSES`] permits; a parse holds one in its thread.
    parsing: Arc<tokio::sync::Semaphore>,
}

/// The session of a document's ingestions and updates.
fn session_of(document_id: &str) -> String {
    format!("ingest:{document_id}")
}

impl Ingestor {
    /// Ingestion over `gate`, whose store is the database at `store_url`
    /// (SQLite or PostgreSQL), embedding with `embedder`.
    ///
    /// # Errors
    /// `invalid` for another kind of store; `store` when the tables cannot
    /// be created.
    pub async fn open(
        gate: Gate,
        store_url: &str,
        embedder: Arc<dyn Embedder>,
    ) -> Result<Self, IngestError> {
        Ok(Self {
            gate,
            pool: Pool::open(store_url).await?,
            embedder,
            parsing: Arc::new(tokio::sync::Semaphore::new(MAX_CONCURRENT_PARSES)),
        })
    }

    /// [`parse`], at most [`MAX_CONCURRENT_PARSES`] at once, refused after
    /// [`MAX_PARSE_TIME`] (waiting for a permit included). A PDF goes to a
    /// child process when the binary chose one ([`isolate`]): killed at the
    /// deadline, its permit freed. Otherwise it runs in a blocking thread,
    /// which cannot be stopped, so it keeps its permit until it ends: a run
    /// of hostile files slows uploads down instead of piling up threads.
    async fn parse(&self, content: &[u8], media_type: MediaType) -> Result<String, IngestError> {
        let too_slow = || {
            IngestError::Invalid(format!(
                "parsing the document took longer than {MAX_PARSE_TIME:?}"
            ))
        };
        let parsing = async {
            let permit = Arc::clone(&self.parsing)
                .acquire_owned()
                .await
                .map_err(|e| IngestError::Corrupt(format!("the parse permits closed: {e}")))?;
            if let (MediaType::Pdf, Some(parser)) = (media_type, isolate::parser_process()) {
                // The child is killed when this future is dropped at the
                // deadline below, and the permit freed with it.
                let _permit = permit;
                return isolate::parse_pdf(parser, content).await;
            }
            let content = content.to_vec();
            tokio::task::spawn_blocking(move || {
                let _permit = permit;
                parse(&content, media_type)
            })
            .await
            .map_err(|e| IngestError::Corrupt(format!("the parse thread failed: {e}")))?
        };
        tokio::time::timeout(MAX_PARSE_TIME, parsing)
            .await
            .map_err(|_| too_slow())?
    }

    /// The embedder (its call counts).
    pub fn embedder(&self) -> &Arc<dyn Embedder> {
        &self.embedder
    }

    /// A document's current state.
    ///
    /// # Errors
    /// `store`.
    pub async fn document(&self, document_id: &str) -> Result<Option<DocumentView>, IngestError> {
        self.pool.document(document_id).await
    }

    /// Ingests an upload, waiting up to [`MAX_INGEST_WAIT`] for a running
    /// ingestion of the same content (or another update of the same
    /// document) to finish: every upload of one content gets the one
    /// ingestion's outcome.
    ///
    /// # Errors
    /// `invalid` (nothing written); `processing` after the wait; `failed`
    /// when the ingestion failed for good; `engine`, `store`, `embedding`.
    pub async fn ingest(&self, upload: &Upload) -> Result<Ingested, IngestError> {
        self.ingest_waiting(upload, MAX_INGEST_WAIT).await
    }

    /// Checks an upload as [`Ingestor::ingest`] would, writing nothing: the
    /// document id and the version it would ingest. For a caller that
    /// answers at once and ingests in the background.
    ///
    /// # Errors
    /// `invalid` (the bytes, the limits, another tenant's document); `store`.
    pub async fn accept(&self, upload: &Upload) -> Result<Accepted, IngestError> {
        check_upload(upload)?;
        let count = chunks(&self.parse(&upload.content, upload.media_type).await?)?.len();
        let sha = sha256_hex(&upload.content);
        let document_id = match &upload.document_id {
            Some(id) => id.clone(),
            None => document_id(&upload.tenant, &sha),
        };
        if let Some(current) = self.pool.document(&document_id).await? {
            if current.tenant != upload.tenant {
                return Err(IngestError::Invalid(format!(
                    "no document {document_id} for tenant {}",
                    upload.tenant
                )));
            }
        }
        let others = self
            .pool
            .tenant_chunks(&upload.tenant, &document_id)
            .await?;
        if others + i64::try_from(count).unwrap_or(i64::MAX) > MAX_SEARCH_CHUNKS {
            return Err(IngestError::Invalid(format!(
                "tenant {} holds {others} current chunks; this document's {count} would pass \
                 the {MAX_SEARCH_CHUNKS} an exact search reads",
                upload.tenant
            )));
        }
        Ok(Accepted {
            document_id,
            version: sha,
            chunks: i64::try_from(count).unwrap_or(i64::MAX),
        })
    }

    /// [`Ingestor::ingest`] with a wait of at most `wait` (zero: answer
    /// `processing` at once; at most [`MAX_INGEST_WAIT`]).
    ///
    /// # Errors
    /// As [`Ingestor::ingest`].
    pub async fn ingest_waiting(
        &self,
        upload: &Upload,
        wait: Duration,
    ) -> Result<Ingested, IngestError> {
        let Accepted {
            document_id,
            version: sha,
            chunks: count,
        } = self.accept(upload).await?;
        // The generation: how many versions the document had when this
        // upload came. Uploads of one content at once share it (one turn);
        // the same content uploaded again after another version was
        // published (a revert) is a new request, not a replay of the old one.
        let generation = match self.pool.document(&document_id).await? {
            Some(current) if current.current_version == sha => {
                return Ok(Ingested {
                    document_id,
                    version: sha,
                    version_no: current.version_no,
                    chunks: current.chunks,
                })
            }
            Some(current) => current.version_no,
            None => 0,
        };
        self.pool
            .save_blob(
                &upload.tenant,
                &sha,
                &Blob {
                    name: upload.name.clone(),
                    media_type: upload.media_type,
                    content: upload.content.clone(),
                },
            )
            .await?;
        let payload = json!({ "document_id": document_id, "sha256": sha });
        let deadline = tokio::time::Instant::now() + wait.min(MAX_INGEST_WAIT);
        let mut step = FIRST_WAIT_STEP;
        loop {
            let begun = self
                .gate
                .begin(
                    &upload.tenant,
                    &session_of(&document_id),
                    &format!("v:{sha}@{generation}"),
                    &payload,
                )
                .await;
            let retry_after = match begun {
                Ok(Begun::Started(turn)) => {
                    self.pool
                        .record_run(
                            turn.id().as_str(),
                            &upload.tenant,
                            &document_id,
                            &sha,
                            &upload.name,
                            count,
                        )
                        .await?;
                    return self.run(turn, &upload.tenant, &payload).await;
                }
                Ok(Begun::Replay(view)) => return outcome(view.state, view.response, view.error),
                // Ingestion never queues its own requests; one of them
                // queued on its session by another caller waits like a
                // busy one.
                Ok(Begun::Queued(queued)) => queued.retry_after,
                Err(error)
                    if matches!(
                        error.kind(),
                        ErrorKind::RequestInFlight
                            | ErrorKind::SessionBusy
                            | ErrorKind::UserAtCapacity
                    ) =>
                {
                    error.retry_after().unwrap_or(MAX_WAIT_STEP)
                }
                Err(error) => return Err(error.into()),
            };
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return Err(IngestError::Processing { retry_after });
            }
            let pause = jitter(step).min(deadline - now);
            tokio::time::sleep(pause).await;
            step = (step * 2).min(MAX_WAIT_STEP);
        }
    }

    /// Takes orphaned ingestions over (their holder died) and runs them to
    /// the end from their stored bytes. Batches already stored are not
    /// embedded again; a batch whose outcome the dead holder left unknown
    /// is. The takeover repeats the orphan's own request, so it works even
    /// when a later turn of the document's session (the cleaner) came
    /// between. An orphan that fails to finish is logged and left for the
    /// next pass.
    ///
    /// # Errors
    /// `engine` when the orphans cannot be listed.
    pub async fn recover(&self) -> Result<Vec<Recovery>, IngestError> {
        let scan = u32::try_from(MAX_RECOVER_PER_PASS).unwrap_or(u32::MAX);
        let listed = self
            .gate
            .store()
            .orphans(&OrphanFilter::default(), scan)
            .await?;
        let mut recovered = Vec::new();
        for orphan in listed.into_iter().filter(|o| {
            o.session_id.as_str().starts_with("ingest:")
                && o.client_request_id.as_str().starts_with("v:")
        }) {
            match self.recover_one(&orphan).await {
                Ok(Some(done)) => recovered.push(done),
                Ok(None) => {}
                Err(error) => {
                    tracing::warn!(turn_id = %orphan.turn_id, %error, "an orphaned ingestion did not finish");
                }
            }
        }
        Ok(recovered)
    }

    async fn recover_one(
        &self,
        orphan: &agentgate::model::Orphan,
    ) -> Result<Option<Recovery>, IngestError> {
        let payload = match &orphan.payload {
            Some(payload) => payload.to_value("payload")?,
            None => {
                return Err(IngestError::Corrupt(
                    "an ingestion orphan without its payload".into(),
                ))
            }
        };
        let begun = self
            .gate
            .begin(
                orphan.user_id.as_str(),
                orphan.session_id.as_str(),
                orphan.client_request_id.as_str(),
                &payload,
            )
            .await;
        let turn = match begun {
            Ok(Begun::Started(turn)) => turn,
            // Finished or taken over by someone else meanwhile, or the
            // session is busy (or queued by another caller): nothing to do
            // in this pass.
            Ok(Begun::Replay(_) | Begun::Queued(_)) => return Ok(None),
            Err(error) if error.retry_after().is_some() => return Ok(None),
            Err(error) => return Err(error.into()),
        };
        let (stored, unknown) = self.journal(&turn).await?;
        let tenant = orphan.user_id.as_str().to_owned();
        let ingested = self.run(turn, &tenant, &payload).await?;
        Ok(Some(Recovery {
            ingested,
            batches_stored_before: stored,
            batches_unknown: unknown,
        }))
    }

    /// The embedding batches of `turn` stored and left unknown (running
    /// under an older fence) before it was taken over.
    async fn journal(&self, turn: &Turn) -> Result<(usize, usize), IngestError> {
        let (mut stored, mut unknown) = (0, 0);
        let mut after = None;
        loop {
            let page = agentgate::page::ExecutionPageRequest::new(after, None)?;
            let page = self.gate.store().executions(turn.id(), &page).await?;
            for execution in page
                .executions
                .iter()
                .filter(|e| e.tool.as_str() == "embed_batch")
            {
                match execution.state {
                    agentgate::ToolState::Succeeded => stored += 1,
                    agentgate::ToolState::Running => unknown += 1,
                    _ => {}
                }
            }
            match page.next {
                Some(next) => after = Some(next),
                None => return Ok((stored, unknown)),
            }
        }
    }

    /// Runs an ingestion turn: parse, chunk, embed and upsert each batch
    /// (tool steps), publish (a tool step), end.
    async fn run(
        &self,
        turn: Turn,
        tenant: &str,
        payload: &Value,
    ) -> Result<Ingested, IngestError> {
        let document_id = text_field(payload, "document_id")?;
        let sha = text_field(payload, "sha256")?;
        let done = self.steps(&turn, tenant, &document_id, &sha).await;
        match done {
            Ok(ingested) => {
                let response = serde_json::to_value(&ingested)
                    .map_err(|e| IngestError::Corrupt(e.to_string()))?;
                turn.succeed(&response)
                    .await
                    .map_err(|e| IngestError::Engine(e.error))?;
                Ok(ingested)
            }
            Err(error) => {
                // An input that cannot be ingested fails for good; anything
                // else (the embedder, the store) may be retried by an upload.
                let retryable = !matches!(error, IngestError::Invalid(_));
                let stored = json!({ "message": error.to_string() });
                if let Err(end) = turn.fail(&stored, retryable).await {
                    tracing::warn!(error = %end.error, "could not record a failed ingestion");
                }
                Err(error)
            }
        }
    }

    async fn steps(
        &self,
        turn: &Turn,
        tenant: &str,
        document_id: &str,
        sha: &str,
    ) -> Result<Ingested, IngestError> {
        let blob = self
            .pool
            .blob(tenant, sha)
            .await?
            .ok_or_else(|| IngestError::Corrupt(format!("no stored bytes for {sha}")))?;
        let text = self.parse(&blob.content, blob.media_type).await?;
        let pieces = chunks(&text)?;
        let count = i64::try_from(pieces.len()).map_err(|e| IngestError::Corrupt(e.to_string()))?;
        let others = self.pool.tenant_chunks(tenant, document_id).await?;
        if others + count > MAX_SEARCH_CHUNKS {
            return Err(IngestError::Invalid(format!(
                "tenant {tenant} would hold {} current chunks; an exact search reads at most \
                 {MAX_SEARCH_CHUNKS}",
                others + count
            )));
        }
        for (batch, group) in pieces.chunks(EMBED_BATCH).enumerate() {
            let hashes: Vec<&str> = group.iter().map(|c| c.hash.as_str()).collect();
            let args = json!({
                "document_id": document_id, "version": sha, "batch": batch, "hashes": hashes,
            });
            match turn.tool("embed_batch", &args).await? {
                ToolStep::Execute(execution) => {
                    self.embed_batch(execution, document_id, sha, batch, group)
                        .await?;
                }
                ToolStep::Cached(_) => {
                    // Stored by an earlier attempt. Its chunks are gone only
                    // if the cleaner removed this version since (it was
                    // superseded, and this turn restarted to publish it
                    // again): store them again, once per attempt.
                    let ids = chunk_ids(document_id, sha, group);
                    if self.pool.existing_chunks(&ids).await?.len() < ids.len() {
                        let args = json!({
                            "document_id": document_id, "version": sha, "batch": batch,
                            "attempt": turn.attempt(),
                        });
                        if let ToolStep::Execute(execution) =
                            turn.tool("repair_batch", &args).await?
                        {
                            self.embed_batch(execution, document_id, sha, batch, group)
                                .await?;
                        }
                    }
                }
            }
        }
        let document = DocumentView {
            document_id: document_id.to_owned(),
            tenant: tenant.to_owned(),
            name: blob.name.clone(),
            current_version: sha.to_owned(),
            version_no: 0,
            chunks: count,
        };
        let fence = turn.fence().0;
        let args = json!({ "document_id": document_id, "version": sha });
        let published = match turn.tool("publish", &args).await {
            Ok(ToolStep::Cached(result)) => result,
            Ok(ToolStep::Execute(execution)) => execution
                .complete_in_tx(move |tx| -> BoxFuture<'_, Result<Value, BoxError>> {
                    Box::pin(async move {
                        let published = db::publish(tx, &document, fence).await?;
                        Ok(json!({ "version_no": published.version_no }))
                    })
                })
                .await
                .map_err(stale)?,
            Err(error) => return Err(stale(error)),
        };
        let version_no = published
            .get("version_no")
            .and_then(Value::as_i64)
            .ok_or_else(|| IngestError::Corrupt(format!("a publish result {published}")))?;
        Ok(Ingested {
            document_id: document_id.to_owned(),
            version: sha.to_owned(),
            version_no,
            chunks: count,
        })
    }

    /// Runs one claimed batch: embeds the chunks not stored yet (a version
    /// published before and ingested again pays only for what is missing)
    /// and upserts them in the execution's completion transaction.
    async fn embed_batch(
        &self,
        execution: agentgate::Execution<'_>,
        document_id: &str,
        sha: &str,
        batch: usize,
        group: &[chunk::Chunk],
    ) -> Result<(), IngestError> {
        let ids = chunk_ids(document_id, sha, group);
        let stored = self.pool.existing_chunks(&ids).await?;
        let missing: Vec<(&chunk::Chunk, &String)> = group
            .iter()
            .zip(&ids)
            .filter(|(_, id)| !stored.contains(*id))
            .collect();
        let texts: Vec<String> = missing.iter().map(|(c, _)| c.text.clone()).collect();
        let vectors = if texts.is_empty() {
            Vec::new()
        } else {
            match self.embed_retrying(&texts).await {
                Ok(vectors) if vectors.len() == texts.len() => vectors,
                Ok(vectors) => {
                    let message = format!("{} vectors for {} texts", vectors.len(), texts.len());
                    execution.fail(&json!({ "message": message })).await?;
                    return Err(IngestError::Embedding(message));
                }
                Err(error) => {
                    execution
                        .fail(&json!({ "message": error.to_string() }))
                        .await?;
                    return Err(error);
                }
            }
        };
        let rows: Vec<ChunkRow> = missing
            .iter()
            .zip(vectors)
            .map(|((chunk, id), vector)| ChunkRow {
                chunk_id: (*id).clone(),
                index: i64::try_from(chunk.index).unwrap_or(i64::MAX),
                hash: chunk.hash.clone(),
                text: chunk.text.clone(),
                vector: embed::to_bytes(&vector),
            })
            .collect();
        let (doc, version, embedded) = (document_id.to_owned(), sha.to_owned(), texts.len());
        execution
            .complete_in_tx(move |tx| -> BoxFuture<'_, Result<Value, BoxError>> {
                Box::pin(async move {
                    let added = db::upsert_chunks(tx, &doc, &version, &rows).await?;
                    Ok(json!({ "batch": batch, "embedded": embedded, "added": added }))
                })
            })
            .await?;
        Ok(())
    }

    /// Embeds `texts`, asking again after a failure up to
    /// [`EMBED_RETRIES`] times with a growing pause, so a short outage of
    /// the embedding API does not end the ingestion (and use one of its
    /// attempts). The lease is renewed by the turn's watchdog meanwhile.
    async fn embed_retrying(&self, texts: &[String]) -> Result<Vec<Vec<f32>>, IngestError> {
        let mut pause = EMBED_RETRY_PAUSE;
        let mut tries = 0;
        loop {
            match self.embedder.embed(texts).await {
                Err(error) if tries < EMBED_RETRIES => {
                    tries += 1;
                    tracing::warn!(%error, tries, "the embedder failed; asking again");
                    tokio::time::sleep(jitter(pause)).await;
                    pause *= 2;
                }
                done => return done,
            }
        }
    }

    /// The tenant's latest ingestions (at most [`limits::MAX_LISTED_INGESTIONS`]),
    /// newest first. The state is the engine's record of each turn, so a
    /// crashed ingestion shows as processing until recovery finishes it or
    /// the sweeper abandons it (then failed: upload again to retry).
    ///
    /// # Errors
    /// `engine`, `store`.
    pub async fn ingestions(&self, tenant: &str) -> Result<Vec<IngestionView>, IngestError> {
        self.views(Some(tenant), limits::MAX_LISTED_INGESTIONS)
            .await
    }

    /// The latest `limit` ingestions of every tenant (at most
    /// [`limits::MAX_LISTED_INGESTIONS`]), newest first: the dashboard's
    /// view, the same states as [`Ingestor::ingestions`].
    ///
    /// # Errors
    /// `engine`, `store`.
    pub async fn recent(&self, limit: usize) -> Result<Vec<IngestionView>, IngestError> {
        let limit = i64::try_from(limit)
            .unwrap_or(i64::MAX)
            .min(limits::MAX_LISTED_INGESTIONS);
        self.views(None, limit).await
    }

    async fn views(
        &self,
        tenant: Option<&str>,
        limit: i64,
    ) -> Result<Vec<IngestionView>, IngestError> {
        let runs = self.pool.runs(tenant, limit).await?;
        let mut views = Vec::with_capacity(runs.len());
        for run in runs {
            let turn_id = agentgate::TurnId::new(run.turn_id.clone())?;
            let Some(turn) = self.gate.store().turn(&turn_id).await? else {
                // Swept after its retention: only the document row remains.
                continue;
            };
            let current = self.pool.document(&run.document_id).await?;
            let state = match turn.state {
                TurnState::Running => IngestionState::Processing,
                TurnState::Succeeded => match current {
                    Some(document) if document.current_version == run.version => {
                        IngestionState::Indexed
                    }
                    Some(document) if document.current_version.is_empty() => {
                        IngestionState::Deleted
                    }
                    _ => IngestionState::Superseded,
                },
                _ => IngestionState::Failed,
            };
            views.push(IngestionView {
                turn_id: run.turn_id,
                tenant: run.tenant,
                document_id: run.document_id,
                name: run.name,
                version: run.version,
                version_no: run.version_no,
                state,
                chunks_stored: run.stored,
                chunks: run.chunks,
                error: turn.error,
            });
        }
        Ok(views)
    }

    /// The `k` chunks of the tenant's current versions closest to `query`,
    /// best first.
    ///
    /// # Errors
    /// `invalid` for an empty or oversized query or `k`; `embedding`; `store`.
    pub async fn search(
        &self,
        tenant: &str,
        query: &str,
        k: usize,
    ) -> Result<Vec<Hit>, IngestError> {
        if query.trim().is_empty() || query.len() > MAX_QUERY_BYTES {
            return Err(IngestError::Invalid(format!(
                "a query is 1 to {MAX_QUERY_BYTES} bytes"
            )));
        }
        if k == 0 || k > MAX_SEARCH_HITS {
            return Err(IngestError::Invalid(format!("k is 1 to {MAX_SEARCH_HITS}")));
        }
        let asked = self
            .embedder
            .embed(&[query.to_owned()])
            .await?
            .into_iter()
            .next()
            .ok_or_else(|| IngestError::Embedding("no vector for the query".into()))?;
        let current = self
            .pool
            .current_chunks(tenant, MAX_SEARCH_CHUNKS + 1)
            .await?;
        if current.len() > usize::try_from(MAX_SEARCH_CHUNKS).unwrap_or(usize::MAX) {
            // An exact search that skipped chunks would answer wrongly.
            return Err(IngestError::Invalid(format!(
                "tenant {tenant} has more than {MAX_SEARCH_CHUNKS} current chunks, \
                 the bound of an exact search"
            )));
        }
        let mut hits = Vec::new();
        for chunk in current {
            let vector = embed::from_bytes(&chunk.vector)?;
            hits.push(Hit {
                score: embed::cosine(&asked, &vector),
                document_id: chunk.document_id,
                name: chunk.name,
                version: chunk.version,
                chunk_index: chunk.index,
                text: chunk.text,
            });
        }
        hits.sort_by(|a, b| b.score.total_cmp(&a.score));
        hits.truncate(k);
        Ok(hits)
    }

    /// Every chunk counted by what it belongs to (writes nothing). With
    /// single-flight ingestion and id upserts there are no duplicates to
    /// find: what it can find is a version superseded past its grace that
    /// the cleaner has not reached, or a version whose chunks are not its
    /// recorded count (which would be a bug).
    ///
    /// # Errors
    /// `store`.
    pub async fn reconcile(&self) -> Result<Reconciliation, IngestError> {
        self.pool.reconcile(grace_ms(OLD_VERSION_GRACE)).await
    }

    /// Deletes the tenant's document: a fenced turn of the document's
    /// session (never beside an ingestion of it) whose step removes it in
    /// one transaction; the chunks deleted (0 when it was already deleted).
    ///
    /// # Errors
    /// `invalid` for no such document of the tenant; `processing` while an
    /// ingestion of it runs; `engine`, `store`.
    pub async fn delete(&self, tenant: &str, document_id: &str) -> Result<u64, IngestError> {
        let document = match self.pool.document(document_id).await? {
            Some(document) if document.tenant == tenant => document,
            _ => {
                return Err(IngestError::Invalid(format!(
                    "no document {document_id} for tenant {tenant}"
                )))
            }
        };
        if document.current_version.is_empty() {
            return Ok(0);
        }
        let generation = document.version_no;
        let begun = self
            .gate
            .begin(
                tenant,
                &session_of(document_id),
                &format!("delete:{generation}"),
                &json!({ "document_id": document_id, "delete": generation }),
            )
            .await;
        let turn = match begun {
            Ok(Begun::Started(turn)) => turn,
            Ok(Begun::Replay(_)) => return Ok(0),
            Ok(Begun::Queued(queued)) => {
                return Err(IngestError::Processing {
                    retry_after: queued.retry_after,
                })
            }
            Err(error) if error.retry_after().is_some() => {
                return Err(IngestError::Processing {
                    retry_after: error.retry_after().unwrap_or(MAX_WAIT_STEP),
                })
            }
            Err(error) => return Err(error.into()),
        };
        let fence = turn.fence().0;
        let args = json!({ "document_id": document_id, "generation": generation });
        let step = match turn.tool("delete_document", &args).await? {
            ToolStep::Cached(result) => Ok(result),
            ToolStep::Execute(execution) => {
                let (doc, owner) = (document_id.to_owned(), tenant.to_owned());
                execution
                    .complete_in_tx(move |tx| -> BoxFuture<'_, Result<Value, BoxError>> {
                        Box::pin(async move {
                            let gone = db::delete_document(tx, &doc, &owner, fence).await?;
                            Ok(json!({ "deleted": gone }))
                        })
                    })
                    .await
                    .map_err(stale)
            }
        };
        match step {
            Ok(result) => {
                turn.succeed(&result)
                    .await
                    .map_err(|e| IngestError::Engine(e.error))?;
                Ok(result.get("deleted").and_then(Value::as_u64).unwrap_or(0))
            }
            Err(error) => {
                let stored = json!({ "message": error.to_string() });
                if let Err(end) = turn.fail(&stored, true).await {
                    tracing::warn!(error = %end.error, "could not record a failed delete");
                }
                Err(error)
            }
        }
    }

    /// Deletes the chunks of versions superseded more than `grace` ago,
    /// each as a fenced turn of the document's session (so it never runs
    /// beside an update of the same document); the chunks deleted.
    ///
    /// # Errors
    /// `engine`, `store`.
    pub async fn clean(&self, grace: Duration) -> Result<u64, IngestError> {
        let mut deleted = 0;
        for (document_id, tenant, version, superseded_at) in
            self.pool.superseded(grace_ms(grace), 100).await?
        {
            let begun = self
                .gate
                .begin(
                    &tenant,
                    &session_of(&document_id),
                    // One cleaning per supersession: a version made current
                    // again and superseded again is cleaned again.
                    &format!("clean:{version}@{superseded_at}"),
                    &json!({ "document_id": document_id, "clean": version }),
                )
                .await;
            let turn = match begun {
                Ok(Begun::Started(turn)) => turn,
                // Cleaned before, or an update holds (or queued on) the
                // document: later.
                Ok(Begun::Replay(_) | Begun::Queued(_)) => continue,
                Err(error) if error.retry_after().is_some() => continue,
                Err(error) => return Err(error.into()),
            };
            let args = json!({ "document_id": document_id, "version": version });
            let result = match turn.tool("delete_version", &args).await? {
                ToolStep::Cached(result) => result,
                ToolStep::Execute(execution) => {
                    let (doc, old) = (document_id.clone(), version.clone());
                    execution
                        .complete_in_tx(move |tx| -> BoxFuture<'_, Result<Value, BoxError>> {
                            Box::pin(async move {
                                let gone = db::delete_version(tx, &doc, &old).await?;
                                Ok(json!({ "deleted": gone }))
                            })
                        })
                        .await?
                }
            };
            deleted += result.get("deleted").and_then(Value::as_u64).unwrap_or(0);
            turn.succeed(&result)
                .await
                .map_err(|e| IngestError::Engine(e.error))?;
        }
        Ok(deleted)
    }
}

/// The ids of a batch's chunks.
fn chunk_ids(document_id: &str, version: &str, group: &[chunk::Chunk]) -> Vec<String> {
    group
        .iter()
        .map(|c| chunk_id(document_id, version, c.index, &c.hash))
        .collect()
}

/// A refused publish as the caller should read it: a lost lease means a
/// newer holder of the document's session took over (this one is stale).
fn stale(error: agentgate::Error) -> IngestError {
    if error.kind() == ErrorKind::LeaseLost {
        IngestError::Stale(error.to_string())
    } else {
        IngestError::Engine(error)
    }
}

fn grace_ms(grace: Duration) -> i64 {
    i64::try_from(grace.as_millis()).unwrap_or(i64::MAX)
}

/// What a finished ingestion turn answers.
fn outcome(
    state: TurnState,
    response: Option<Value>,
    error: Option<Value>,
) -> Result<Ingested, IngestError> {
    match (state, response) {
        (TurnState::Succeeded, Some(response)) => serde_json::from_value(response)
            .map_err(|e| IngestError::Corrupt(format!("a stored ingestion result: {e}"))),
        (TurnState::Failed, _) => Err(IngestError::Failed(error.unwrap_or(Value::Null))),
        (state, _) => Err(IngestError::Corrupt(format!(
            "an ingestion replayed in state {state:?}"
        ))),
    }
}

fn text_field(payload: &Value, field: &str) -> Result<String, IngestError> {
    payload
        .get(field)
        .and_then(Value::as_str)
        .map(str::to_owned)
        .ok_or_else(|| IngestError::Corrupt(format!("an ingestion payload without {field}")))
}

fn check_upload(upload: &Upload) -> Result<(), IngestError> {
    let bad = |what: String| Err(IngestError::Invalid(what));
    if upload.tenant.is_empty() || upload.tenant.len() > MAX_TENANT_BYTES {
        return bad(format!("a tenant is 1 to {MAX_TENANT_BYTES} bytes"));
    }
    if upload.name.is_empty() || upload.name.len() > MAX_NAME_BYTES {
        return bad(format!("a name is 1 to {MAX_NAME_BYTES} bytes"));
    }
    if upload.content.is_empty() || upload.content.len() > MAX_DOCUMENT_BYTES {
        return bad(format!("a document is 1 to {MAX_DOCUMENT_BYTES} bytes"));
    }
    if let Some(id) = &upload.document_id {
        let shaped = id.len() == 28
            && id.starts_with("doc_")
            && id[4..].bytes().all(|b| b.is_ascii_hexdigit());
        if !shaped {
            return bad("a document id is `doc_` and 24 hex digits".into());
        }
    }
    Ok(())
}

/// `step` scaled by a factor in [0.5, 1.5), so waiters do not ask in step.
fn jitter(step: Duration) -> Duration {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let factor = 0.5 + f64::from(nanos % 1000) / 1000.0;
    step.mul_f64(factor)
}
